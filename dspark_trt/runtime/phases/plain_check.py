"""Plain checks: a stretch of steps without drafting while the cost model plans drafting at a load where it
never saw what plain decoding costs.

The mirror of scheduled exploration (exploration.py). The call-shape model prices plain calls from their
own calls once it saw some at a width (costs/call_shape.py); before that, from the profile and what other
calls said. A model that prices plain decoding too dearly there (a profile measured wrong: at 64 requests
one priced verifying 2-3 tokens a row 25-35% under what the calls took and one token 8% over) keeps
drafting, and then no plain call of that width is ever observed to show it wrong. So after ``every``
drafting steps at a load whose plain calls were never observed, ``length`` steps run plain: the first
``settle_calls`` of them pay for the switch of graphs and teach nothing, the rest price plain decoding
there, and the next plan reads it. A stretch, not one step: a single plain step after drafting costs a
switch's price (1.45x at 16 rows), and learned from, plain decoding was priced at that (while adaptive
drafted at 16 requests, 2-2.5x its cost). Once a load's plain calls were observed it is never checked
again; it costs a few steps once per load where drafting pays.

Lossless sampling is unaffected: whether a step checks depends only on earlier steps' plans and calls.
"""

from __future__ import annotations

from dspark_trt.runtime.costs.overhead import load_bucket

__all__ = ["PlainCheckSchedule"]


class PlainCheckSchedule:
    """Call order: ``due(n_decode, observed)`` on each step the model plans drafting (True: run it plain);
    ``idle(n_decode)`` on each step it plans none."""

    def __init__(self, every: int, length: int):
        self.every, self.length = int(every), max(1, int(length))
        self._loads: dict[int, list[int]] = {}  # load bucket: [drafting steps counted, check steps left]
        self.checks = 0  # stretches started

    def due(self, n_decode: int, observed: bool) -> bool:
        """observed: the cost model has seen plain calls of this width (settled ones)."""
        if self.every <= 0:
            return False
        load = self._loads.setdefault(load_bucket(n_decode), [0, 0])
        if load[1] > 0:
            load[1] -= 1
            return True
        if observed:
            return False
        load[0] += 1
        if load[0] < self.every:
            return False
        load[0], load[1] = 0, self.length - 1
        self.checks += 1
        return True

    def idle(self, n_decode: int) -> None:
        self._loads.pop(load_bucket(n_decode), None)
