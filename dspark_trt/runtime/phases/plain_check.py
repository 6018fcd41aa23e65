"""Plain checks: a step without drafting now and then while the cost model plans drafting.

The mirror of scheduled exploration (exploration.py). A cost model that prices drafting too cheaply next
to plain decoding (at 64 requests the tiny pair's profile priced verifying 2-3 tokens a row 25-35% under
what the calls took and one token 8% over) keeps drafting, and then no plain call of that width is ever
observed to show it wrong: the call-shape model learns the level of the depths it runs, not of the one
it compares them with. So while the model plans drafting at a load, a plain step runs after every
``every`` drafting steps there for the first FIRST checks (the offset learns from a median of calls, and
one is noise), then after twice as many each time, up to ``every`` x 32; its verify call
gives the call-shape model that width's one-token level (costs/call_shape.py), its overhead the plain
step's, and the next plan reads them. Where drafting pays 1.4x a check costs about 0.3 of a step, a few a
run; where the choice is close it costs next to nothing; where plain decoding is faster the plan turns
to it. The period starts again whenever the model stops drafting at that load.

Lossless sampling is unaffected: whether a step checks depends only on earlier steps' plans.
"""

from __future__ import annotations

from dspark_trt.runtime.costs.overhead import load_bucket

__all__ = ["PlainCheckSchedule"]


class PlainCheckSchedule:
    """Call order: ``due(n_decode)`` on each step the model plans drafting (True: run it plain);
    ``idle(n_decode)`` on each step it plans none."""

    FIRST = 3  # checks at the starting period before it doubles
    LONGEST = 32  # the period stops doubling at every x LONGEST

    def __init__(self, every: int):
        self.every = int(every)
        self._loads: dict[int, list[int]] = {}  # load bucket: [drafting steps since the last check, period, checks]
        self.checks = 0

    def due(self, n_decode: int) -> bool:
        if self.every <= 0:
            return False
        load = self._loads.setdefault(load_bucket(n_decode), [0, self.every, 0])
        load[0] += 1
        if load[0] < load[1]:
            return False
        load[0], load[2] = 0, load[2] + 1
        if load[2] >= self.FIRST:
            load[1] = min(2 * load[1], self.every * self.LONGEST)
        self.checks += 1
        return True

    def idle(self, n_decode: int) -> None:
        self._loads.pop(load_bucket(n_decode), None)
