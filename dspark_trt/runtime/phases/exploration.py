"""Scheduled exploration: drafting now and then while the cost model says drafting does not pay.

A cost model that is too pessimistic about drafting (a profile measured on a busy machine, draft calls
3x too dear) stops drafting, and then no draft call is ever observed to show it wrong. So while the
model plans no drafting, a step now and then drafts (as deep as drafting pays best with the starting
survival profile: the running one is what is being tested) and verifies it all: its draft call, its
wider verify call and its acceptances are fed to the cost tables and the survival correction (the
runtime observes every call of an exploring step), and the next plan reads what they learned. It drafts
for the adaptive requests the draft has seen the most of, as many as it catches up within a plain
step's time and at least one (depth_planner.py): caught up on every request, an exploration stalled
every other request for 15-30 plain steps' time at high load.

The schedule is a budget, not a period: every step the model plans no drafting earns a share of its
modelled step time as credit (per load bucket), and an exploration runs once the credit covers what it
is expected to cost: its modelled extra time (its draft calls, the tokens it verifies, a drafting
step's overhead, a switch of graphs) plus the draft catching up on what it has not seen (the requests'
prompts and the text generated since it last drafted), at the rate the drafter's catch-up calls measured
(the first one finds out). Once it ran, what it measurably cost beyond a plain step is settled against the credit
(a saving earns credit only where it did not confirm the plan not to draft: ``confirms``).
So exploring costs at most that share of plain steps' time, bar the first catch-up ever timed, and stops
where even its catch-up cannot fit; credit saved up beyond an exploration's charge is dropped when it
runs, so long savings never pay for a burst. The share starts at ``explore_budget`` and falls as
1/(1 + n)^2, n the explorations at the load that confirmed the plan not to draft (the step they ran,
drafting, emitted fewer tokens per ms than the modelled plain step, the draft's catch-up aside), down to a
fiftieth of it, which keeps a machine that changes later from going unnoticed for good; one that does not
confirm it keeps exploring at the full share until the tables have caught up. (Falling as 1/(1 + n),
explorations at ~62 rows in an open loop at twice the capacity, 200-400 ms each with the draft catching up
every row's long text, all confirming, took 2-4.5% of the time. Confirming by the tables instead, a draft
call within the drift's margin, let a draft table 25% too dear at 64 requests, where drafting still did not
pay, keep the full share: exploring cost ~8% of the time there. With the floor at a tenth, an open loop
at half the capacity, temperature 1.0, explored ~8 times a 10 s round, every one confirming, and each
exploring step, 2-4x a plain one, held up every request in flight: TPOT p50 1.06x `off`'s, against 0.99x
with the floor at a fiftieth, 8 rounds side by side.)

Lossless sampling is unaffected: whether a step explores depends only on earlier steps' timings.
"""

from __future__ import annotations

from dspark_trt.runtime.costs.overhead import load_bucket

__all__ = ["ExplorationSchedule"]


class _Load:
    __slots__ = ("credit", "count", "confirmed", "need")

    def __init__(self):
        self.credit = 0.0  # ms exploration may still spend
        # What the last look found an exploration would cost, its catch-up included: the catch-up only grows
        # while nothing drafts, so it is asked again once the credit covers this (asked every step, it was
        # a fifth of the draft-depth planner's time).
        self.need = 0.0
        self.count = 0  # explorations so far
        self.confirmed = 0  # explorations that confirmed the plan not to draft


class ExplorationSchedule:
    """Call order: ``due(n_decode, plain_ms, cost_ms)`` on each step the model plans no
    drafting; ``settle(n_decode, charged_ms, measured_extra_ms, confirmed)`` after a step that explored."""

    FLOOR = 0.02  # the share never falls below this fraction of explore_budget

    def __init__(self, budget: float):
        self.budget = float(budget)
        self._loads: dict[int, _Load] = {}

    def _load(self, n_decode: int) -> _Load:
        b = load_bucket(n_decode)
        load = self._loads.get(b)
        if load is None:
            load = self._loads[b] = _Load()
        return load

    def share(self, n_decode: int) -> float:
        """The fraction of plain step time exploration may spend at this load now."""
        n = self._load(n_decode).confirmed
        return self.budget * max(self.FLOOR, 1.0 / (1.0 + n) ** 2)

    def due(self, n_decode: int, plain_ms: float, cost_ms) -> float | None:
        """Whether this step explores: plain_ms, the modelled ms of this step without drafting; cost_ms, the
        modelled ms exploring now costs beyond it, the draft's catch-up included (a number, or a function
        giving it: asked only once the credit covers what it gave last). Returns the ms charged for it
        (None: not now)."""
        if self.budget <= 0:
            return None
        load = self._load(n_decode)
        load.credit += self.share(n_decode) * max(plain_ms, 0.0)
        if load.credit < load.need:
            return None
        cost = max(0.0, cost_ms() if callable(cost_ms) else cost_ms)
        if load.credit < cost:
            load.need = cost
            return None
        load.need = 0.0
        # Credit left over is dropped: saved up while the catch-up was dear (long histories), it would
        # otherwise pay for a burst of explorations once it is cheap (new requests).
        load.credit = min(0.0, load.credit - cost)
        load.count += 1
        return cost

    def settle(self, n_decode: int, charged_ms: float, measured_extra_ms: float, confirmed: bool) -> None:
        """An exploration charged charged_ms (its modelled cost, catch-up included) measurably cost
        measured_extra_ms beyond a plain step: the difference goes to the credit, a saving only up to zero
        when confirmed. confirmed: drafting did not pay in the step it ran."""
        load = self._load(n_decode)
        load.credit -= measured_extra_ms - charged_ms
        if confirmed:
            # A saving pays for another look only when this one said drafting might pay (a profile too
            # dear about drafting recovers in a burst); once confirmed, it paid for a second exploration
            # the very next step (16 requests, a busy machine's profile) that learned nothing new.
            load.credit = min(load.credit, 0.0)
        load.confirmed += bool(confirmed)

    @staticmethod
    def confirms(plain_tokens: int, rows: int, expected: float, accepted: int, plain_ms: float,
                 drafting_ms: float) -> bool:
        """Whether an exploration confirmed the plan not to draft: the step it ran, drafting, would emit
        fewer tokens per ms than the modelled plain step (plain_ms; its `rows` rows emit a token each), with
        the exploring rows' drafts counted both as their survivals expected and as accepted. plain_tokens:
        what the step emitted without those drafts; drafting_ms: its measured ms, the catch-up aside.

        Either count alone misjudged: one step's acceptances are few (a run of rejections confirmed a
        profile 3x too dear about drafting), and a fresh start's head scored drafts that were all accepted
        at 0.4 (the plan it confirmed kept one request at `off`'s speed where fixed:4 ran 1.75x faster)."""
        return (rows + max(expected, accepted)) * plain_ms <= plain_tokens * drafting_ms

    def report(self) -> dict:
        return {1 << b: {"explorations": x.count, "confirmed": x.confirmed, "credit_ms": round(x.credit, 3)}
                for b, x in sorted(self._loads.items()) if x.count}
