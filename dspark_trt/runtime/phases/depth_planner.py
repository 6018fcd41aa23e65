"""Draft-depth planning: how many draft steps adaptive requests get this step, decided before drafting.

From the running survival profile (which does not depend on this step's drafts) and the step's costs
(solver.best_draft_depth); one step of headroom lets live survivals ask for more. A plan is reused per
batch shape for a few steps (the profile moves slowly). When no drafting pays, nothing is drafted but
scheduled exploration (exploration.py) drafts now and then, within a budget, so a cost model or a
survival profile that is wrong about drafting is shown wrong; while drafting pays, a plain step now
and then (plain_check.py) shows a model that is wrong the other way.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dspark_trt.runtime.costs.overhead import load_bucket
from dspark_trt.runtime.phases.exploration import ExplorationSchedule
from dspark_trt.runtime.phases.plain_check import PlainCheckSchedule
from dspark_trt.runtime.solver import best_draft_depth

__all__ = ["DepthPlan", "DepthPlanner"]

STRETCH_ALPHA = 0.2  # weight of the last stretch in the mean stretch length


class DepthPlan(NamedTuple):
    """The draft depth of one step."""

    steps: int  # draft steps adaptive requests get this step
    exploring: bool = False  # this step's drafting is scheduled exploration (the model plans none): draft
    # `steps` deep and verify all of it
    explore_ms: float = 0.0  # an exploring step's modelled extra ms over a plain step
    plain_ms: float = 0.0  # an exploring step's modelled ms without drafting
    charged_ms: float = 0.0  # what the exploration schedule charged for it (its catch-up included)
    checking: bool = False  # a plain check: no drafting although the model plans some (plain_check.py)
    rows: frozenset | None = None  # the ids of the adaptive requests an exploration drafts for (None: all)


class _CachedPlan(NamedTuple):
    """A cached draft-depth plan of one batch shape."""

    depth: int  # best draft depth by the cost model, drafting already (its graph running)
    start_depth: int  # the same from plain decoding: a switch of graphs to pay first
    until: int  # the planner's step count at which it is made again
    moves: int  # the cost model's moves when it was made (CostTable.moves): made again once they change
    plain_ms: float  # modelled ms of a step without drafting


class _Exploration(NamedTuple):
    """What an exploration would do and cost now."""

    depth: int  # its draft depth
    extra_ms: float  # modelled extra ms over a plain step (its draft calls, verifying them, a switch)
    charge_ms: float  # that and the draft catching its rows up
    rows: frozenset | None  # the ids of the requests it drafts for (None: all adaptive ones)


class DepthPlanner:
    """Call order: ``plan(batch, cost)`` once per step (``plan_for`` with explicit counts)."""

    def __init__(self, max_draft: int, tuning, controller, sequential: bool = True, catch_up_ms=None):
        """sequential: a depth of j costs j draft calls (classic drafter); else one call at any depth (DSpark).
        catch_up_ms: the drafter's modelled ms of catching up a list of requests (what exploring them costs
        before their draft call); None: nothing."""
        self.max_draft, self.tuning, self.controller = max_draft, tuning, controller
        self.sequential, self.catch_up_ms = sequential, catch_up_ms
        self._drafting = False  # the last step's plan drafted: a stretch of drafting is under way
        # Steps a stretch of drafting lasted, a running mean per load bucket it started at (explorations and
        # plain checks aside): what the switch into drafting and back is spread over when the plan weighs
        # starting one there; plan_every until a stretch ends. Learned from all loads alike, at capacity the
        # long stretches of its lulls started short ones (TPOT p50 1% worse in scripts/simulate_open.py).
        self._stretch_steps: dict[int, float] = {}
        self._stretch, self._stretch_load = 0, 0  # planned drafting steps of the stretch under way, its load
        self._cache: dict[tuple[int, int, bool], _CachedPlan] = {}
        self._steps = 0  # plans made so far: a cached plan lives for the next plan_every steps, not uses
        self.exploration = ExplorationSchedule(tuning.explore_budget)
        self.plain_checks = PlainCheckSchedule(tuning.plain_check_every, tuning.settle_calls + 3)

    def plan(self, batch, cost) -> DepthPlan:
        if not batch.n_adaptive:
            return DepthPlan(self.max_draft)
        def catch_up() -> float:
            return self.catch_up_ms([r for r in batch.decode if r.mode.kind == "adaptive"])
        return self.plan_for(batch.n_adaptive, len(batch.decode), cost,
                             catch_up if self.catch_up_ms is not None else None,
                             joining=bool(batch.prefill or batch.held), decode=batch.decode)

    def plan_for(self, n_adaptive: int, n_decode: int, cost, catch_up=None, joining: bool = False,
                 decode=None) -> DepthPlan:
        """The plan for n_adaptive adaptive requests among n_decode decoding ones; catch_up: a function
        giving the modelled ms of the draft catching them up, asked only when a plan is made or an
        exploration is near; joining: prompts are being fed or held, so more rows decode within a step or
        two; decode: the decoding requests, among whose adaptive ones an exploration picks its rows (None: it
        drafts for all of them)."""
        plan = self._plan_for(n_adaptive, n_decode, cost, catch_up, joining, decode)
        self._drafting = plan.steps > 0
        if not (plan.exploring or plan.checking):
            if plan.steps:
                if not self._stretch:
                    self._stretch_load = load_bucket(n_decode)
                self._stretch += 1
            elif self._stretch:
                mean = self.stretch_steps(self._stretch_load)
                self._stretch_steps[self._stretch_load] = mean + STRETCH_ALPHA * (self._stretch - mean)
                self._stretch = 0
        return plan

    def _plan_for(self, n_adaptive: int, n_decode: int, cost, catch_up, joining: bool, decode) -> DepthPlan:
        if cost.table is None:
            return DepthPlan(self.max_draft)
        self._steps += 1
        key = (n_adaptive, n_decode, joining)
        cached = self._cache.get(key)
        # By steps, not uses: a plan made when the draft was caught up, used once and met again at the next
        # run's tail, had the last two rows catch up ~900 tokens (90 ms) to draft a few tokens. And at once
        # when the costs moved: a cold start from a flat profile drafted on for the plan's 8 steps at 16
        # requests, 4-5x a plain step each, after its first verify call had shown drafting dear.
        moves = cost.table.moves
        if cached is None or self._steps >= cached.until or moves != cached.moves:
            behind = catch_up() if catch_up is not None else 0.0
            cached = self._cache[key] = self._best(n_adaptive, n_decode, cost, behind,
                                                   1 if joining else self.tuning.plan_every,
                                                   until=self._steps + self.tuning.plan_every, moves=moves,
                                                   switch_horizon=1.0 if joining
                                                   else self.stretch_steps(load_bucket(n_decode)))
        best = cached.depth if self._drafting else cached.start_depth
        # Explorations and plain checks exist to be observed, and nothing is learned while the machine's
        # timings are not its own (Costs.learning: the host caches still being mapped): in a closed loop's
        # first seconds at 16 requests, 6 explorations in a row ran at the full share and taught nothing.
        learning = cost.costs.learning
        if best == 0:
            if not learning:
                return DepthPlan(0)
            self.plain_checks.idle(n_decode)
            # An exploration is one step, not a plan: the plan stays "no drafting" around it, and the next
            # plan (at most plan_every steps on) reads what it observed.
            looked: list[_Exploration] = []

            def charge() -> float:
                looked.append(self._exploration(n_adaptive, n_decode, cost, cached.plain_ms, decode, catch_up))
                return looked[-1].charge_ms

            charged = self.exploration.due(n_decode, cached.plain_ms, charge)
            if charged is not None:
                self._cache.pop(key)
                e = looked[-1]
                return DepthPlan(e.depth, True, e.extra_ms, cached.plain_ms, charged, rows=e.rows)
            return DepthPlan(0)
        shape = cost.costs.shape
        if learning and self.plain_checks.due(n_decode, shape is None or shape.observed(n_decode, plain=True)):
            self._cache.pop(key)  # the next plan reads what the check observed
            return DepthPlan(0, checking=True)
        return DepthPlan(min(self.max_draft, best + self.tuning.plan_headroom))

    def stretch_steps(self, load: int) -> float:
        """What a switch into drafting is spread over at this load bucket (costs/overhead.load_bucket)."""
        return self._stretch_steps.get(load, float(self.tuning.plan_every))

    def _best(self, n_adaptive: int, n_decode: int, cost, behind_ms: float = 0.0, horizon: int = 1,
              until: int = 0, moves: int = 0, switch_horizon: float = 1.0) -> _CachedPlan:
        """The model's plan: best draft depth, and what a plain step costs. behind_ms: the
        modelled ms of the draft catching up on what it has not seen, which drafting pays before its first
        call: spread over `horizon` steps, the price of starting to draft. Unpriced, a model that put
        plain decoding and drafting close (64 requests) switched between them every few plans and paid a
        catch-up of every row's recent text each time: two thirds of the full-width time went to drafting
        steps at 0.87x plain decoding's tokens per ms. The plan's steps are the horizon while the batch
        keeps its shape; one step while prompts join it: at 16 requests the few rows left decoding while a
        wave of prompts went in planned to draft, each catching up its whole text (8-10 ms), and the
        next step, full again, did not draft (2-4 such steps a run, each 2-5x a plain step).

        From plain decoding, drafting first pays a switch of graphs (costs/switch.py, in plain calls: the
        verify graph's first call, and the decoding graph's next few once drafting stops), spread over
        `switch_horizon` steps: how long stretches of drafting started at this load lasted (stretch_steps), one
        step while prompts join. Spread over the plan's 8 steps, in an open loop at half the capacity stretches
        at 2-3 rows, which last until requests come or go, did not start: 0.61 of such steps drafted, where
        fixed:3's tokens per ms ran 3% above plain decoding's, and TPOT p50 was 1.05x fixed:3's
        (scripts/simulate_open.py). Unpriced, adaptive drafted one step here and there (explorations, the
        ramp, lone rows at low load) and each cost about two more plain steps than its model: with fixed:3
        run in the same runtime (its settled verify calls priced verifying), 0.92-0.96x `off` at 4 requests,
        temperature 1.0."""
        prof = np.asarray(self.controller.prior_row(self.max_draft), dtype=np.float64)
        verify, draft_ms, spec, switch = self._drafting_costs(cost, n_adaptive, n_decode, behind_ms / horizon)
        plain = cost.overhead("plain")
        others = n_decode - n_adaptive
        depth, _ = best_draft_depth(prof, n_adaptive, verify, draft_ms, plain, spec, others=others)
        start = depth
        if switch > 0 and depth > 0:
            start, _ = best_draft_depth(prof, n_adaptive, verify, draft_ms, plain, spec + switch / switch_horizon,
                                        others=others)
        return _CachedPlan(depth, start, until, moves, plain + float(verify[0]))

    def _drafting_costs(self, cost, n_adaptive: int, n_decode: int, extra_spec: float = 0.0):
        """What drafting for n_adaptive of n_decode rows costs: the verify call by draft depth, a draft step's
        ms, the ms of drafting at all (the step's overhead, extra_spec, a DSpark block pass) and a switch of
        graphs' ms (costs/switch.py)."""
        verify = cost.depth_verify_ms(n_decode - n_adaptive, n_adaptive)
        draft_ms = float(cost.table.draft_ms(n_adaptive, past=cost.past))
        spec = cost.overhead("spec") + extra_spec
        if not self.sequential:  # one block pass at any depth: a cost of drafting at all, not per step
            draft_ms, spec = 0.0, spec + draft_ms
        return verify, draft_ms, spec, cost.costs.switch.calls * float(verify[0])

    def _exploration(self, n_adaptive: int, n_decode: int, cost, plain_ms: float, decode=None,
                     catch_up=None) -> _Exploration:
        """The exploration that would run now: its rows, depth and modelled cost.

        Its rows: those the draft has seen the most of (the least to catch up) first, as many as it catches
        up within a plain step's time, and at least one. Catching every row up stalled the step: in an open
        loop at the capacity, explorations at ~40 rows took 137 and 191 ms against a 6 ms plain step, and
        every request arriving meanwhile waited (TTFT p99 242 ms against `off`'s 118).

        It drafts as deep as pays best with the starting survival profile, not the running one: what it
        tests is whether that profile is too pessimistic, and its own best depth is then none. One token
        deep, at 1 request with plain decoding on a graph of its own, an exploration never paid (1.9 tokens
        for ~2x a plain step's time), so a profile cut down by a fresh start's first rows (0.41 / 0.18 /
        0.08, one-token prompts) stayed at `off`'s speed where fixed:4 ran 1.75x faster.

        decode: as plan_for; without it, it drafts for all n_adaptive, and catch_up() prices their catch-up."""
        rows, behind_ms = None, 0.0
        if decode is None or self.catch_up_ms is None:
            behind_ms = catch_up() if catch_up is not None else 0.0
        else:
            explorers = [r for r in decode if r.mode.kind == "adaptive"]
            picked = []
            for ms, i in sorted((self.catch_up_ms([r]), i) for i, r in enumerate(explorers)):
                if picked and behind_ms + ms > plain_ms:
                    break
                picked.append(explorers[i].id)
                behind_ms += ms
            rows, n_adaptive = frozenset(picked), len(picked)
        verify, draft_ms, spec, switch = self._drafting_costs(cost, n_adaptive, n_decode)
        # plain_ms infinite: the best depth of at least one, whether or not it beats plain decoding
        depth = max(1, best_draft_depth(self.controller.starting_row(self.max_draft), n_adaptive, verify, draft_ms,
                                        float("inf"), spec, others=n_decode - n_adaptive)[0])
        extra = spec + depth * draft_ms + float(verify[min(depth, len(verify) - 1)]) - plain_ms + switch
        return _Exploration(depth, extra, extra + behind_ms, rows)
