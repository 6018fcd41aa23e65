"""Issue 22 item 3: the runtime counts like vLLM's budget rule and respects a global cap on verified tokens.

The reference is re-implemented here from vLLM's ``get_num_tokens`` (PR #47808, see
/work/shared/notes/peers.md), and the runtime's verify planner (the N it passes, the cap it computes,
the controller and solver behind it) must pick the same budget B on random steps, draft-less rows included.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from dspark_trt.runtime.config import GenerationConfig, parse_spec
from dspark_trt.runtime.controller import AdaptiveController
from dspark_trt.runtime.costs.step import Costs
from dspark_trt.runtime.costs.table import CostTable
from dspark_trt.runtime.phases.drafter import Draft, DraftRound
from dspark_trt.runtime.phases.verify_planner import VerifyPlanner
from dspark_trt.runtime.request import Request
from dspark_trt.runtime.solver import solve_budget
from dspark_trt.runtime.tuning import RuntimeTuning

K = 5


def vllm_budget(scheduled: list[np.ndarray], draft_cost: np.ndarray, verify_cost: np.ndarray, max_total: int) -> int:
    """vLLM's budget rule for a decode-only step: ``scheduled[r]`` holds request r's draft survivals
    (empty for a request without drafts). N = every request (each samples a token), T = one token per
    request, Bmax = min(sum drafts, max(0, cap - num_reqs)), B = first argmax of num / cost."""
    num_reqs = len(scheduled)
    scores = np.sort(np.concatenate([np.asarray(s, dtype=np.float64) for s in scheduled] + [np.zeros(0)]))[::-1]
    bmax = min(scores.size, max(0, max_total - num_reqs))
    num = np.concatenate([[num_reqs], num_reqs + np.cumsum(scores[:bmax])])
    T = num_reqs
    cost = draft_cost[num_reqs] + verify_cost[T:T + bmax + 1]
    return int(np.argmax(num / cost))


def _request(rid: int, spec: str) -> Request:
    return Request(rid, [1, 2, 3], GenerationConfig(spec=spec), parse_spec(spec, K), K)


def _random_step(rng, rows: int):
    """Decode rows, some adaptive with 1..K drafts, some without drafts (an off-mode row, or an adaptive
    row that did not draft this step, e.g. one at its max_new_tokens)."""
    decode, drafts, scheduled = [], {}, []
    for rid in range(rows):
        kind = rng.choice(["drafted", "drafted", "off", "undrafted"])
        r = _request(rid, "off" if kind == "off" else "adaptive")
        decode.append(r)
        if kind == "drafted":
            n = int(rng.integers(1, K + 1))
            surv = np.cumprod(rng.uniform(0.3, 1.0, n))
            drafts[rid] = Draft(list(range(n)), [], surv.astype(np.float32), surv.tolist())
            scheduled.append(surv)
        else:
            scheduled.append(np.zeros(0))
    return decode, drafts, scheduled


def _planner(max_tokens_per_step: int, verify_cost, draft_cost, tuning=RuntimeTuning()):
    costs = Costs(max_tokens_per_step, K)
    costs.table = CostTable(verify_cost, draft_cost)
    return VerifyPlanner(K, tuning, AdaptiveController(), None, costs), costs


def _random_costs(rng, rows: int):
    n = rows * (K + 1) + 2
    verify = np.concatenate([[0.0], rng.uniform(2.0, 10.0) + np.cumsum(rng.uniform(0.0, 0.6, n - 1))])
    draft = np.concatenate([[0.0], rng.uniform(0.2, 4.0) + np.cumsum(rng.uniform(0.0, 0.3, rows + 1))])
    return verify, draft


def test_the_runtime_picks_the_reference_budget_on_random_steps_with_draft_less_rows():
    rng = np.random.default_rng(22)
    cases = draft_less = 0
    for _ in range(400):
        rows = int(rng.integers(1, 12))
        decode, drafts, scheduled = _random_step(rng, rows)
        if not drafts:
            continue
        verify, draft = _random_costs(rng, rows)
        planner, costs = _planner(10_000, verify, draft)
        # The step's drafting cost as the solver sees it: the drafting calls' time already spent (the step
        # overhead is still 0 here), the reference's draft_cost[num_reqs].
        plan = planner.plan(SimpleNamespace(decode=decode), DraftRound(drafts, 0.0, float(draft[rows]), 0.0),
                            costs.for_step(rows, 0))
        assert sum(plan.lengths.values()) == vllm_budget(scheduled, draft, verify, 10_000)
        cases += 1
        draft_less += len(drafts) < rows
    assert cases > 300 and draft_less > 200


def test_with_a_global_cap_the_runtime_picks_the_reference_budget_and_never_verifies_more():
    rng = np.random.default_rng(7)
    binding = 0
    for _ in range(300):
        rows = int(rng.integers(1, 12))
        decode, drafts, scheduled = _random_step(rng, rows)
        if not drafts:
            continue
        verify, draft = np.concatenate([[0.0], np.full(rows * (K + 1) + 1, 5.0)]), np.full(rows + 2, 0.1)
        cap = int(rng.integers(1, rows * (K + 1) + 1))  # max_verify_tokens = 0 means no cap of its own
        for engine, tuned in ((cap, 0), (10_000, cap)):  # the engine's limit or RuntimeTuning.max_verify_tokens
            planner, costs = _planner(engine, verify, draft, replace(RuntimeTuning(), max_verify_tokens=tuned))
            plan = planner.plan(SimpleNamespace(decode=decode), DraftRound(drafts, 0.0, float(draft[rows]), 0.0),
                                costs.for_step(rows, 0))
            B = sum(plan.lengths.values())
            assert B == vllm_budget(scheduled, draft, verify, cap)
            assert rows + B <= max(cap, rows)  # every row verifies its next token whatever the cap
        binding += vllm_budget(scheduled, draft, verify, 10_000) > max(0, cap - rows)
    assert binding > 50  # flat verify costs admit everything drafted, so the cap decides often


def test_fixed_rows_are_trimmed_to_the_cap_deepest_first():
    fixed = [_request(i, "fixed:4") for i in range(3)]
    drafts = {r.id: Draft([1, 2, 3, 4], [], np.ones(4, np.float32), [0.9, 0.8, 0.7, 0.6]) for r in fixed}
    verify, draft = np.arange(40, dtype=float), np.full(5, 0.1)
    planner, costs = _planner(64, verify, draft, replace(RuntimeTuning(), max_verify_tokens=3 + 7))
    plan = planner.plan(SimpleNamespace(decode=fixed), DraftRound(drafts, 0.0, 0.1, 0.0), costs.for_step(3, 0))
    assert sorted(plan.lengths.values()) == [2, 2, 3] and planner.verify_limit() == 10


def test_the_solver_respects_a_global_budget_cap_and_is_optimal_under_it():
    rng = np.random.default_rng(3)
    for _ in range(200):
        R = int(rng.integers(1, 9))
        S = np.cumprod(rng.uniform(0.2, 1.0, (R, K)), axis=1)
        verify = np.concatenate([[0.0], 3.0 + np.cumsum(rng.uniform(0.0, 0.5, R * (K + 1) + 1))])
        cap = int(rng.integers(0, R * K + 1))
        L = solve_budget(S, verify, 1.0, max_budget=cap)
        assert L.sum() <= cap
        flat = np.sort(S.ravel())[::-1]
        best = max(range(cap + 1), key=lambda b: ((R + flat[:b].sum()) / (1.0 + verify[R + b]), -b))
        assert L.sum() == best
    with pytest.raises(ValueError, match="whole number"):
        solve_budget(np.full((1, K), 0.5), np.arange(10.0), max_budget=1.5)


def test_the_draft_depth_counts_every_decode_row_too():
    """Before drafting, the depth planner weighs a depth by the step's output per ms; rows that do not
    draft adaptively emit their token at every depth, so they belong in its numerator as in the budget's."""
    from dspark_trt.runtime.phases.depth_planner import DepthPlanner

    n_decode, n_adaptive = 8, 1
    costs = Costs(256, K)
    costs.table = CostTable(np.concatenate([[0.0], 10.0 + np.arange(1, 60, dtype=float)]),
                            np.concatenate([[0.0], np.full(9, 2.5)]))
    tuning = replace(RuntimeTuning(), plan_headroom=0)
    planner = DepthPlanner(K, tuning, AdaptiveController())
    got = planner.plan_for(n_adaptive, n_decode, costs.for_step(n_decode, 0)).steps
    prof = RuntimeTuning.prior_acceptance ** np.arange(1, K + 1)
    cum = np.concatenate([[0.0], np.cumsum(prof)])
    j = np.arange(K + 1)
    cost = j * 2.5 + costs.table.verify_ms(n_decode + n_adaptive * j)

    def depth(N):
        return int(np.argmax((N + n_adaptive * cum) / cost))

    assert depth(n_adaptive) != depth(n_decode)  # counting only the drafting rows would draft deeper
    assert got == depth(n_decode)
