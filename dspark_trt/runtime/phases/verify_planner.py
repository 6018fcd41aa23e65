"""Verify planning: how many drafts each request verifies this step.

Fixed-K requests verify what they drafted, up to K; adaptive requests get the budget solver's answer on
their online-corrected survivals (through the controller, which keeps sampling lossless), the first draft
of every request on an exploring step (scheduled by the depth planner, or after steps that admitted
nothing), and a depth cap where padding every row to the deepest stops paying. The plan
also sets the break-even survival that drafting reads next step.

Counting as vLLM's budget rule does (issue 22): the objective's N is every decode row that emits a
token this step, drafted or not (plus the expected accepted drafts of fixed-K rows, which the step
emits whatever the budget is), and the step verifies at most ``verify_limit()`` tokens over all decode
rows (the engine's most tokens per step, the cost profile's largest size, ``max_verify_tokens``).

The plan carries what the cost model and the survivals predict for the step (expected accepted drafts,
modelled step ms); runtime/explain.py sets them against what the step measured.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from dspark_trt.runtime.costs.call_shape import packed_shape
from dspark_trt.runtime.solver import cap_depth, marginal_survival, table_lookup

__all__ = ["VerifyPlan", "VerifyPlanner"]


class VerifyPlan(NamedTuple):
    lengths: dict[int, int]  # drafts each request verifies, by request id (absent: none)
    solver_us: float  # time the controller took
    predicted_accepted: float = 0.0  # expected accepted drafts: the (corrected) survivals of the verified slots
    predicted_ms: float | None = None  # the step's modelled ms at this plan (None without a cost profile)


class _StepCost:
    """This step's costs in the shape the controller reads (a verify table and the draft time)."""

    def __init__(self, table: np.ndarray, draft_ms: float):
        self._table, self._draft_ms = table, draft_ms

    def verify_table(self) -> np.ndarray:
        return self._table

    def draft_ms(self, batch: int) -> float:
        return self._draft_ms


class VerifyPlanner:
    """Call order: ``plan(batch, drafted, cost)`` once per step, after drafting."""

    def __init__(self, max_draft: int, tuning, controller, correction, costs):
        self.max_draft, self.tuning, self.controller, self.correction, self.costs = (
            max_draft, tuning, controller, correction, costs)
        self._unverified_steps = 0

    def verify_limit(self) -> int:
        """Most tokens a step verifies over all decode rows (next tokens plus verified drafts)."""
        limit = self.costs.max_tokens_per_step
        if self.costs.table is not None:
            limit = min(limit, self.costs.table.max_tokens)
        if self.tuning.max_verify_tokens:
            limit = min(limit, self.tuning.max_verify_tokens)
        return limit

    def plan(self, batch, drafted, cost, explore: bool = False) -> VerifyPlan:
        """explore: the depth planner scheduled this step's drafting as exploration (verify what it drafted)."""
        lengths, solver_us = self._plan(batch, drafted, cost, explore)
        return self._predict(batch, drafted, cost, lengths, solver_us)

    def _plan(self, batch, drafted, cost, explore: bool = False) -> tuple[dict[int, int], float]:
        decode, drafts, draft_ms = batch.decode, drafted.drafts, drafted.priced_ms
        lengths: dict[int, int] = {}
        adaptive = []
        for r in decode:
            if r.id not in drafts:
                continue
            n = len(drafts[r.id].tokens)
            if r.mode.kind == "fixed":
                lengths[r.id] = min(r.mode.k, n)
            elif r.mode.kind == "adaptive":
                adaptive.append(r)
        room = max(0, self.verify_limit() - len(decode))  # drafts the step may verify over all rows
        if sum(lengths.values()) > room:
            lengths = _trim(lengths, room)
        if not adaptive:
            return lengths, 0.0
        # N: every decode row emits a token whatever the budget, and fixed-K rows their accepted drafts too.
        n_emitting = len(decode) + sum(float(sum(drafts[rid].corrected[:L])) for rid, L in lengths.items() if L)
        max_budget = room - sum(lengths.values())
        # Survivals as lists, not arrays: for a few requests the controller plans in plain Python
        # (solver.SMALL_SLOTS), where every numpy call would cost more than its arithmetic. Caps as int64,
        # which the controller takes without converting.
        K = self.max_draft
        rows = [drafts[r.id].corrected for r in adaptive]
        caps = np.fromiter((len(s) for s in rows), dtype=np.int64, count=len(rows))
        live = [s + [0.0] * (K - len(s)) for s in rows]
        fixed_ms = draft_ms + cost.overhead("spec")
        t = time.perf_counter_ns()
        others = len(decode) - len(adaptive) + sum(lengths.values())
        table = cost.verify_table(others, len(decode))
        plan = self.controller.plan(live, [r.id for r in adaptive], [r.sampling for r in adaptive],
                                    _StepCost(table, fixed_ms), len(adaptive), caps=caps, n_emitting=n_emitting,
                                    max_budget=max_budget)
        solver_us = (time.perf_counter_ns() - t) / 1e3
        # Exploration: survivals that are too pessimistic admit nothing, and then verification never shows
        # that they are wrong; drafts made to explore the costs are there to be verified too. So verify
        # regardless (decisions independent of the drafts, so sampling stays lossless): all that was drafted
        # on a scheduled exploring step (its depth was fixed before drafting), the first draft of every
        # request after explore_every drafting steps that admitted none.
        exploring = explore
        if self.correction is not None:
            self._unverified_steps = self._unverified_steps + 1 if not (plan.any() or explore) else 0
            if self._unverified_steps >= self.tuning.correction.explore_every:
                self._unverified_steps = 0
                exploring = True
        if exploring:
            plan = np.maximum(plan, caps if explore else np.minimum(caps, 1))
            plan[np.cumsum(plan) > max_budget] = 0  # the first rows, by position: independent of the drafts
        if not exploring and plan.any() and self.costs.shape is not None:
            plan = self._cap_depth(plan, live, decode, lengths, drafts, fixed_ms, cost)
        plan = plan.tolist()
        for r, L in zip(adaptive, plan):
            lengths[r.id] = L
        # Drafting further than the solver admits is wasted work: stop drafting next step once a
        # request's survival falls well below the weakest slot admitted now. Any stopping rule keeps
        # sampling lossless (it only removes later slots, which never outrank earlier ones).
        admitted = sum(sum(s[:L]) for s, L in zip(rows, plan))
        self.costs.break_even = marginal_survival(len(adaptive), admitted, sum(plan), table, fixed_ms,
                                                  span=max(self.tuning.break_even_span, len(decode)),
                                                  n_emitting=n_emitting)
        return lengths, solver_us

    def _predict(self, batch, drafted, cost, lengths: dict[int, int], solver_us: float) -> VerifyPlan:
        """The plan with its predictions: expected accepted drafts (the survivals the solver saw, over the
        verified slots) and the step's modelled ms: the drafting time already spent (catch-up included),
        the step overhead of this load, the verify call at these lengths."""
        decode, drafts = batch.decode, drafted.drafts
        expected = sum(float(sum(drafts[rid].corrected[:L])) for rid, L in lengths.items() if L)
        if cost.table is None or not decode:
            return VerifyPlan(lengths, solver_us, expected, None)
        query_lens = [1 + lengths.get(r.id, 0) for r in decode]
        shape = self.costs.shape
        if shape is not None:
            verify_ms = shape.ms(*packed_shape(query_lens, [r.target_len for r in decode]))
        else:
            verify_ms = table_lookup(np.asarray(cost.table.verify_table(), dtype=np.float64), sum(query_lens))
        ms = drafted.priced_ms + drafted.catch_up_ms + cost.overhead("spec" if drafts else "plain") + verify_ms
        return VerifyPlan(lengths, solver_us, expected, float(ms))

    def _cap_depth(self, plan: np.ndarray, live: list, decode: list, fixed: dict, drafts: dict,
                   fixed_ms: float, cost) -> np.ndarray:
        """Cap adaptive verify lengths where padding every row to the deepest stops paying (solver.cap_depth)."""
        shape = self.costs.shape
        rows = len(decode)
        fixed_tokens, fixed_deep = sum(fixed.values()), max(fixed.values(), default=0)
        deepest = max(int(plan.max()), fixed_deep)
        if len(plan) == rows and deepest <= -(-int(plan.sum()) // rows):
            # Every row adaptive and the depths as even as they can be: the solver's table priced exactly
            # this shape, and every capped allocation costs at least its even spread, which the solver
            # already weighed; so no cap can do better.
            return plan
        base = rows + sum(float(np.sum(drafts[rid].corrected[:L])) for rid, L in fixed.items() if L)

        def call_ms(extra: int, depth: int) -> float:
            return shape.ms(rows + fixed_tokens + extra, rows, 1 + max(depth, fixed_deep), cost.past)

        d = cap_depth(plan, live, call_ms, fixed_ms, base)
        return np.minimum(plan, d)


def _trim(lengths: dict[int, int], room: int) -> dict[int, int]:
    """Verify lengths cut to `room` drafts in all, the deepest first (ties to the later request): only
    later slots go, chosen from the lengths alone, so a sampled request's stopping rule still holds."""
    out = dict(lengths)
    excess = sum(out.values()) - room
    while excess > 0:
        rid = max(out, key=lambda i: (out[i], i))
        out[rid] -= 1
        excess -= 1
    return {rid: L for rid, L in out.items()}
