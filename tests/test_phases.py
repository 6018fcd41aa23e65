"""The step phases on their own (runtime/phases/): admission, depth planning, verify planning, commit.

Pure Python and numpy, no engines: each phase is built from its parts and driven through its public
methods; the whole step is covered by test_runtime.py.
"""

from __future__ import annotations

import queue
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from dspark_trt.runtime.config import GenerationConfig, parse_spec
from dspark_trt.runtime.controller import AdaptiveController
from dspark_trt.runtime.costs.step import Costs
from dspark_trt.runtime.costs.overhead import load_bucket
from dspark_trt.runtime.costs.switch import SwitchPrice
from dspark_trt.runtime.costs.table import CostTable
from dspark_trt.runtime.metrics import Metrics
from dspark_trt.runtime.phases.admission import Admission, QueueFullError
from dspark_trt.runtime.phases.commit import Committer
from dspark_trt.runtime.phases.depth_planner import DepthPlanner
from dspark_trt.runtime.phases.drafter import Draft, DraftRound
from dspark_trt.runtime.phases.verifier import Verifier, VerifyResult
from dspark_trt.runtime.phases.verify_planner import VerifyPlanner
from dspark_trt.runtime.request import Request
from dspark_trt.runtime.tuning import RuntimeTuning

K = 4


def request(rid: int, prompt=(1, 2, 3), spec="adaptive", **cfg) -> Request:
    config = GenerationConfig(spec=spec, **cfg)
    return Request(rid, list(prompt), config, parse_spec(spec, K), K)


def admission(max_batch=2, max_queue=None, tuning=RuntimeTuning()):
    metrics = Metrics(K)
    return Admission(4, max_batch, max_queue, tuning, Costs(64, K), 256, metrics), metrics


# ------------------------------------------------------------------------------------------ admission

def test_admission_fills_free_slots_and_splits_decode_from_prefill():
    adm, metrics = admission(max_batch=2)
    assert adm.admit() is None  # nothing queued: no step
    decoding = request(0, prompt=[5])  # one uncached token: it decodes
    for r in (decoding, request(1, prompt=[1, 2, 3]), request(2)):
        with adm.lock:
            adm.enqueue(r)
    batch = adm.admit()
    assert [r.id for r in batch.decode] == [0] and [r.id for r in batch.prefill] == [1]
    assert batch.n_adaptive == 1 and batch.past == 0 and not batch.held
    assert metrics.queue_depth == 1 and adm.busy()  # request 2 waits for a slot


def test_admission_finishes_cancelled_requests_and_bounds_the_queue():
    adm, _ = admission(max_batch=1, max_queue=1)
    first, second = request(0), request(1)
    with adm.lock:
        adm.check_room()
        adm.enqueue(first)
        with pytest.raises(QueueFullError):
            adm.check_room()
    first.cancelled = True
    assert adm.admit() is None and first.finish_reason == "cancelled"
    with adm.lock:
        adm.enqueue(second)
    assert adm.admit().prefill == [second]
    adm.fail_all("stopped")
    assert second.finish_reason == "error" and second.error == "stopped" and not adm.busy()


# -------------------------------------------------------------------------------------- depth planner

def depth_planner(tuning=RuntimeTuning()):
    return DepthPlanner(K, tuning, AdaptiveController())


def test_without_a_cost_profile_adaptive_requests_may_draft_to_the_limit():
    costs = Costs(64, K)
    row = SimpleNamespace(mode=SimpleNamespace(kind="adaptive"))
    batch = SimpleNamespace(n_adaptive=2, decode=[row, row], prefill=[], held=[])
    assert depth_planner().plan(batch, costs.for_step(2, 0)).steps == K


def test_where_drafting_pays_the_model_plans_its_best_depth_plus_headroom():
    costs = Costs(64, K)
    costs.table = CostTable(np.full(64, 10.0) * (np.arange(64) > 0), np.full(K + 2, 0.01) * (np.arange(K + 2) > 0))
    plan = depth_planner().plan_for(4, 4, costs.for_step(4, 0))
    assert plan.steps > 0 and not plan.exploring
    headroom = depth_planner(replace(RuntimeTuning(), plan_headroom=0)).plan_for(4, 4, costs.for_step(4, 0))
    assert headroom.steps == plan.steps - 1 or plan.steps == K


def test_while_the_machines_timings_are_not_its_own_it_neither_explores_nor_checks():
    """Explorations and plain checks exist to be observed; while the host caches are still being mapped
    nothing is learned from a step (Costs.learning), so neither runs, and exploring earns no credit."""
    def planner_at(draft_ms: float, learning: bool):
        costs = Costs(64, K)
        costs.table = CostTable(np.full(64, 10.0) * (np.arange(64) > 0),
                                np.full(K + 2, draft_ms) * (np.arange(K + 2) > 0))
        costs.learning = learning
        return depth_planner(replace(RuntimeTuning(), explore_budget=0.5, plain_check_every=2)), costs

    for learning in (False, True):
        planner, costs = planner_at(20.0, learning)  # drafting does not pay: only explorations would draft
        plans = [planner.plan_for(4, 4, costs.for_step(4, 0)) for _ in range(40)]
        assert any(p.exploring for p in plans) == learning
        planner, costs = planner_at(0.01, learning)  # drafting pays, and a plain check is due at every step
        planner.plain_checks.due = lambda n_decode, seen_plain: True
        plan = planner.plan_for(4, 4, costs.for_step(4, 0))
        assert plan.checking == learning and (plan.steps > 0) != learning


def test_an_exploration_drafts_as_deep_as_the_starting_profile_pays_best_not_the_running_one():
    """The running profile says no depth pays (a fresh start's head scored its first drafts low); what an
    exploration tests is whether that is so, and one token deep it could not tell (at 1 request with
    plain decoding on a graph of its own, 1.9 tokens for ~2x a plain step's time). So it drafts as deep as
    pays best with the starting profile, and is charged for that depth."""
    from dspark_trt.runtime.solver import best_draft_depth

    costs = Costs(64, K)
    costs.table = CostTable(np.full(64, 10.0) * (np.arange(64) > 0), np.full(K + 2, 1.0) * (np.arange(K + 2) > 0))
    controller = AdaptiveController()
    rows = [[0.05 ** (k + 1) for k in range(K)]]
    controller.plan(rows, [0], [False], costs.table, 1)  # the first row replaces the starting profile
    planner = DepthPlanner(K, replace(RuntimeTuning(), explore_budget=0.5), controller)
    cost = costs.for_step(1, 0)
    plans = [planner.plan_for(1, 1, cost) for _ in range(40)]
    explored = [p for p in plans if p.exploring]
    assert explored and all(p.steps == 0 for p in plans if not p.exploring)
    verify = cost.depth_verify_ms(0, 1)
    depth, _ = best_draft_depth(controller.starting_row(K), 1, verify, 1.0, float("inf"), cost.overhead("spec"))
    assert depth >= 2 and all(p.steps == depth for p in explored)
    plain_ms = cost.overhead("plain") + verify[0]
    assert explored[0].explore_ms == pytest.approx(cost.overhead("spec") + depth * 1.0 + verify[depth] - plain_ms
                                                   + costs.switch.calls * verify[0])


def test_an_exploration_drafts_for_the_rows_the_draft_catches_up_within_a_plain_step():
    """Catching every row up stalled the step (at ~40 rows in an open loop, 137-191 ms against a 6 ms plain
    step, and every arriving request waited): an exploration drafts for the rows the draft has seen the
    most of, as many as it catches up within a plain step's time, at least one, and is charged for those."""
    from dspark_trt.runtime.phases.drafter import drafting_rows

    costs = Costs(64, K)
    costs.table = CostTable(np.full(64, 10.0) * (np.arange(64) > 0), np.full(K + 2, 20.0) * (np.arange(K + 2) > 0))
    behind = {0: 6.0, 1: 2.0, 2: 50.0, 3: 1.0, 4: 3.0}  # ms of catch-up a row

    def explored(rows):
        planner = DepthPlanner(K, replace(RuntimeTuning(), explore_budget=1.0), AdaptiveController(),
                               catch_up_ms=lambda reqs: sum(behind[r.id] for r in reqs))
        batch = SimpleNamespace(n_adaptive=len(rows), decode=rows, prefill=[], held=[])
        plans = [planner.plan(batch, costs.for_step(len(rows), 0)) for _ in range(200)]
        return [p for p in plans if p.exploring]

    rows = [request(i) for i in behind]
    plans = explored(rows)
    assert plans and all(p.rows == {3, 1, 4} for p in plans)  # 1 + 2 + 3 ms; with row 0's 6 ms, over
    cost = costs.for_step(5, 0)
    plain_ms = cost.overhead("plain") + cost.depth_verify_ms(5, 0)[0]
    assert plain_ms < 12.0
    three = DepthPlanner(K, RuntimeTuning(), AdaptiveController())._exploration(3, 5, cost, plain_ms)
    assert plans[0].steps == three.depth and plans[0].charged_ms == pytest.approx(three.extra_ms + 6.0)
    assert [r.id for r in drafting_rows(rows, plans[0].steps, lambda r, d: d, plans[0].rows)] == [1, 3, 4]
    # however far behind, one row explores
    assert all(p.rows == {2} for p in explored([request(2)]))


def test_an_exploration_confirms_the_plan_only_if_neither_its_survivals_nor_its_acceptances_say_drafting_paid():
    from dspark_trt.runtime.phases.exploration import ExplorationSchedule

    confirms = ExplorationSchedule.confirms
    # 1 row, plain step 1 ms; the exploring step took 2 ms (its catch-up aside)
    assert confirms(1, 1, expected=0.4, accepted=0, plain_ms=1.0, drafting_ms=2.0)
    # the head expected 0.4 but all 3 drafts were accepted: 4 tokens in 2 ms beat 1 in 1 ms
    assert not confirms(1, 1, expected=0.4, accepted=3, plain_ms=1.0, drafting_ms=2.0)
    # a run of rejections where the survivals expected 2.5: one step's outcomes are too few to confirm by
    assert not confirms(1, 1, expected=2.5, accepted=0, plain_ms=1.0, drafting_ms=2.0)
    # 64 rows at 20 ms a plain step: 64 + 40 accepted drafts in 40 ms do not beat 64 in 20 ms
    assert confirms(64, 64, expected=38.0, accepted=40, plain_ms=20.0, drafting_ms=40.0)


def test_drafting_is_priced_at_the_steps_past():
    """A draft call's cost grows with the tokens cached per row (costs/draft_past.py): the same batch that
    drafts at the profile's past does not where draft calls cost 40x as much."""
    from dspark_trt.runtime.costs.draft_past import DraftPast

    costs = Costs(64, K)
    grows = DraftPast.points(128, 1128, [1, K + 1], [1.0, 1.0], [40.0, 40.0])
    costs.table = CostTable(np.full(64, 10.0) * (np.arange(64) > 0), np.full(K + 2, 0.5) * (np.arange(K + 2) > 0),
                            points={"draft_past": grows})
    tuning = replace(RuntimeTuning(), plain_check_every=0, explore_budget=0.0)
    assert depth_planner(tuning).plan_for(4, 4, costs.for_step(4, 128)).steps > 0
    assert depth_planner(tuning).plan_for(4, 4, costs.for_step(4, 1128)).steps == 0


def test_starting_to_draft_pays_the_drafts_catch_up_spread_over_the_plans_steps():
    """Rows that decoded plainly for a while have text the draft has not seen; drafting feeds it first.
    Where drafting pays a little, a catch-up that the plan's steps cannot pay for keeps the plan plain
    (switching back and forth paid it over and over at 64 requests)."""
    costs = Costs(64, K)
    costs.table = CostTable(np.full(64, 10.0) * (np.arange(64) > 0), np.full(K + 2, 0.01) * (np.arange(K + 2) > 0))
    tuning = replace(RuntimeTuning(), plain_check_every=0)
    assert depth_planner(tuning).plan_for(4, 4, costs.for_step(4, 0), lambda: 0.0).steps > 0
    behind = depth_planner(tuning).plan_for(4, 4, costs.for_step(4, 0), lambda: 100.0 * tuning.plan_every)
    assert behind.steps == 0


def test_while_prompts_join_the_batch_starting_to_draft_pays_its_whole_catch_up_in_one_step():
    """The rows left decoding while a wave of prompts goes in are a shape of one or two steps: the next
    step, full again, plans plainly, so a catch-up spread over the plan's steps was paid for one step of
    drafting (at 16 requests each such step cost 2-5x a plain one). The same catch-up is worth paying
    when the batch keeps its shape."""
    costs = Costs(64, K)
    costs.table = CostTable(np.full(64, 10.0) * (np.arange(64) > 0), np.full(K + 2, 0.01) * (np.arange(K + 2) > 0))
    tuning = replace(RuntimeTuning(), plain_check_every=0)
    catch_up = 4.0 * tuning.plan_every  # ms: pays spread over plan_every steps, not in one
    assert depth_planner(tuning).plan_for(4, 4, costs.for_step(4, 0), lambda: catch_up).steps > 0
    joining = depth_planner(tuning).plan_for(4, 4, costs.for_step(4, 0), lambda: catch_up, joining=True)
    assert joining.steps == 0
    caught_up = depth_planner(tuning).plan_for(4, 4, costs.for_step(4, 0), lambda: 0.0, joining=True)
    assert caught_up.steps > 0  # rows already drafting go on drafting while prompts join

def test_a_plan_met_again_after_other_shapes_is_made_afresh_with_the_catch_up_it_now_needs():
    """A plan lives for the next plan_every steps, not for plan_every uses: one made at a run's tail while
    the draft was caught up, used once, was met again at the next run's tail, where the last two rows
    then caught up their whole texts (90 ms) to draft a few tokens."""
    costs = Costs(64, K)
    costs.table = CostTable(np.full(64, 10.0) * (np.arange(64) > 0), np.full(K + 2, 0.01) * (np.arange(K + 2) > 0))
    tuning = replace(RuntimeTuning(), plain_check_every=0, explore_budget=0.0)
    behind = [0.0]
    planner = DepthPlanner(K, tuning, AdaptiveController())
    assert planner.plan_for(2, 2, costs.for_step(2, 0), lambda: behind[0]).steps > 0
    for _ in range(tuning.plan_every):
        planner.plan_for(16, 16, costs.for_step(16, 0), lambda: 0.0)
    behind[0] = 100.0 * tuning.plan_every
    assert planner.plan_for(2, 2, costs.for_step(2, 0), lambda: behind[0]).steps == 0
    assert planner.plan_for(2, 2, costs.for_step(2, 0), lambda: 0.0).steps == 0  # within its steps: reused


def test_a_plan_is_made_again_as_soon_as_the_costs_it_was_made_from_moved():
    """Not only after plan_every steps: a cold start from a flat profile drafted on for a plan's 8 steps at 16
    requests (4-5x a plain step each) after its first verify call had shown drafting dear."""
    costs = Costs(64, K)
    costs.table = CostTable(np.full(64, 10.0) * (np.arange(64) > 0), np.full(K + 2, 0.5) * (np.arange(K + 2) > 0))
    tuning = replace(RuntimeTuning(), plain_check_every=0, explore_budget=0.0)
    planner = DepthPlanner(K, tuning, AdaptiveController())
    assert planner.plan_for(2, 2, costs.for_step(2, 0)).steps > 0
    for _ in range(5):  # draft calls far dearer than profiled, five in a row: the draft drift jumps
        costs.table.observe_draft(2, 40.0)
    assert planner.plan_for(2, 2, costs.for_step(2, 0)).steps == 0


def test_drafting_from_plain_decoding_pays_a_switch_of_graphs_that_going_on_drafting_does_not():
    """After a drafting step the decoding graph's next calls take 1.9, 1.5, 1.3, 1.15x their time (ONNX Runtime,
    4 requests): a stretch of drafting that starts from plain decoding pays about 2.5 plain calls more than
    its steps. Where drafting gains less than that over the plan's horizon it does not start; once drafting,
    going on costs no switch."""
    costs = Costs(64, K)
    # verify: 10 ms a call plus 0.1 a token, draft 1 ms a call: at 4 rows drafting gains a little
    costs.table = CostTable(np.concatenate([[0.0], 10.0 + 0.1 * np.arange(1, 64)]),
                            np.full(K + 2, 1.0) * (np.arange(K + 2) > 0))
    tuning = replace(RuntimeTuning(), plain_check_every=0, explore_budget=0.0)
    free = DepthPlanner(K, tuning, AdaptiveController())
    assert free.plan_for(4, 4, costs.for_step(4, 0), joining=True).steps > 0
    costs.switch = SwitchPrice(tuning.switch_calls, tuning.settle_calls)
    priced = DepthPlanner(K, tuning, AdaptiveController())
    assert priced.plan_for(4, 4, costs.for_step(4, 0), joining=True).steps == 0  # a horizon of one step
    assert priced.plan_for(4, 4, costs.for_step(4, 0)).steps > 0  # spread over plan_every steps it pays
    assert priced.plan_for(4, 4, costs.for_step(4, 0), joining=True).steps > 0  # drafting: no switch to pay


def test_a_switch_into_drafting_is_spread_over_how_long_stretches_of_drafting_have_lasted_at_the_load():
    """Whether a stretch of drafting pays for its switch of graphs depends on how long it lasts. In an open
    loop at half the capacity stretches at 2-3 rows last until requests come or go, far beyond the plan's 8
    steps; spread over those 8 they did not start (TPOT p50 1.05x fixed:3's, scripts/simulate_open.py).
    Per load: learned from all loads alike, at capacity the long stretches of its lulls started ones that
    did not last (TPOT p50 1% worse there). Stretches that end after a step bring the horizon back down."""
    def table(per_token: float) -> CostTable:  # verify: 10 ms a call plus per_token a token; draft 1 ms a call
        return CostTable(np.concatenate([[0.0], 10.0 + per_token * np.arange(1, 64)]),
                         np.full(K + 2, 1.0) * (np.arange(K + 2) > 0))

    costs = Costs(64, K)
    tuning = replace(RuntimeTuning(), plain_check_every=0, explore_budget=0.0)
    costs.switch = SwitchPrice(tuning.switch_calls, tuning.settle_calls)
    planner = DepthPlanner(K, tuning, AdaptiveController())

    def plain() -> None:  # no adaptive row: a stretch under way ends, and the plans made age out
        for _ in range(tuning.plan_every):
            assert planner.plan_for(0, 4, costs.for_step(4, 0)).steps == 0

    def stretches(length: int, times: int) -> None:
        costs.table = table(0.1)  # drafting pays at 4 rows whatever the switch
        for _ in range(times):
            plain()
            for _ in range(length):
                assert planner.plan_for(4, 4, costs.for_step(4, 0)).steps > 0
        plain()
        costs.table = table(2.0)  # at 4 rows drafting gains a little a step

    costs.table = table(2.0)
    assert planner.plan_for(4, 4, costs.for_step(4, 0)).steps == 0  # 8 steps do not pay the switch
    stretches(60, 12)
    assert planner.stretch_steps(load_bucket(4)) > 40
    assert planner.stretch_steps(load_bucket(16)) == tuning.plan_every  # other loads: as they were
    assert planner.plan_for(4, 4, costs.for_step(4, 0), joining=True).steps == 0  # prompts joining: one step
    assert planner.plan_for(4, 4, costs.for_step(4, 0)).steps > 0
    stretches(1, 10)
    assert planner.stretch_steps(load_bucket(4)) < tuning.plan_every
    assert planner.plan_for(4, 4, costs.for_step(4, 0)).steps == 0


def test_the_planner_reads_joining_prompts_off_the_batch():
    costs = Costs(64, K)
    costs.table = CostTable(np.full(64, 10.0) * (np.arange(64) > 0), np.full(K + 2, 0.01) * (np.arange(K + 2) > 0))
    tuning = replace(RuntimeTuning(), plain_check_every=0)
    rows = [request(i) for i in range(4)]
    for prefill, held, drafts in (([], [], True), ([request(5)], [], False), ([], [request(5)], False)):
        planner = DepthPlanner(K, tuning, AdaptiveController(), catch_up_ms=lambda reqs: 4.0 * tuning.plan_every)
        batch = SimpleNamespace(n_adaptive=4, decode=rows, prefill=prefill, held=held)
        assert (planner.plan(batch, costs.for_step(4, 0)).steps > 0) == drafts


# ------------------------------------------------------------------------------------------ verifier

def test_a_cache_copys_sync_is_a_switch_cost_kept_out_of_what_the_call_is_priced_at():
    """A decode call that first brings the target's cache copy up to date (ort_decode.MirroredKVCache.sync)
    pays for the entries written since the slot last decoded: once per switch from drafting to plain
    decoding. The verifier reports that time as the step's switch cost and teaches the cost model only the
    rest (a plain check after drafting at 16 requests synced 2-4 ms and taught plain calls twice their
    price)."""
    import time

    kv = SimpleNamespace(sync_ms=0.0, past=lambda n: [], write=lambda *a: None)

    class Backend:
        def run_target(self, feeds, past):
            time.sleep(0.03)
            kv.sync_ms += 25.0  # 25 of the call's ~30 ms went to the copy's sync
            n = len(feeds["slot_ids"])
            return {"accepted": np.zeros(n, np.int64), "next_token": np.full(n, 7, np.int64)}, []

    seen = []
    costs = Costs(64, K)
    costs.table = SimpleNamespace(observe_verify=lambda tokens, ms: seen.append(ms),
                                  call_shape=SimpleNamespace(observe=lambda *a, **k: seen.append(a[4])))
    costs.observing = True
    verifier = Verifier(Backend(), kv, RuntimeTuning(), (97, 64, 64), costs, Metrics(K))
    rows = [request(0, spec="off"), request(1, spec="off")]
    for i, r in enumerate(rows):
        r.slot, r.target_len = i, 3
    batch = SimpleNamespace(decode=rows, prefill=[])
    verifier.run(batch, DraftRound({}, 0.0, 0.0, 0.0), SimpleNamespace(lengths={}))
    assert not seen  # a graph's first call in a runtime pays its set-up: it teaches nothing
    result = verifier.run(batch, DraftRound({}, 0.0, 0.0, 0.0), SimpleNamespace(lengths={}))
    assert list(result.next_token) == [7, 7] and result.switch_ms == 25.0
    assert len(seen) == 2 and all(0 < ms < 20 for ms in seen)  # ~5 ms of call, not ~30
    assert result.priced_ms < 20


# ------------------------------------------------------------------------------------- verify planner

def test_fixed_requests_verify_what_they_drafted_up_to_k_and_adaptive_ones_what_the_solver_admits():
    costs = Costs(64, K)
    planner = VerifyPlanner(K, RuntimeTuning(), AdaptiveController(), None, costs)
    fixed, adaptive, off = request(0, spec="fixed:2"), request(1), request(2, spec="off")
    drafts = {0: Draft([7, 8, 9], [], np.ones(3, np.float32), [0.9, 0.8, 0.7]),
              1: Draft([7, 8], [], np.ones(2, np.float32), [0.99, 0.98])}
    batch = SimpleNamespace(decode=[fixed, adaptive, off])
    plan = planner.plan(batch, DraftRound(drafts, 0.0, 0.0, 0.0), costs.for_step(3, 0))
    assert plan.lengths[0] == 2 and 2 not in plan.lengths
    assert 0 <= plan.lengths[1] <= 2 and plan.solver_us >= 0
    assert costs.break_even >= 0.0  # set for the next step's drafting


def test_an_exploring_step_verifies_all_it_drafted_whatever_the_survivals_admit():
    """Its depth was fixed before drafting, so verifying all of it keeps sampling lossless; and its
    outcomes at every drafted position are what the survival correction learns from."""
    costs = Costs(64, K)
    costs.table = CostTable(np.arange(64, dtype=float) + 10.0, np.full(K + 2, 5.0) * (np.arange(K + 2) > 0))
    planner = VerifyPlanner(K, RuntimeTuning(), AdaptiveController(), None, costs)
    sure, unsure = request(0), request(1, temperature=1.0)
    drafts = {0: Draft([7, 8, 9], [], np.ones(3, np.float32), [0.02, 0.01, 0.005]),
              1: Draft([7, 8], [np.ones(4)] * 2, np.ones(2, np.float32), [0.02, 0.01])}
    batch = SimpleNamespace(decode=[sure, unsure])
    step = DraftRound(drafts, 0.0, 0.0, 0.0)
    assert sum(planner.plan(batch, step, costs.for_step(2, 0)).lengths.values()) < 5
    assert planner.plan(batch, step, costs.for_step(2, 0), explore=True).lengths == {0: 3, 1: 2}


def test_a_steps_predicted_ms_counts_the_whole_drafting_time_not_only_its_engine_calls():
    costs = Costs(64, K)
    costs.table = CostTable(np.arange(64, dtype=float), np.full(K + 2, 0.5))  # verify: 1 ms a token
    planner = VerifyPlanner(K, RuntimeTuning(), AdaptiveController(), None, costs)
    fixed = request(0, spec="fixed:2")
    drafts = {0: Draft([7, 8], [], np.ones(2, np.float32), [0.9, 0.8])}
    # engine 1.0 ms of the drafting calls' 3.0 ms (feeds, KV writes), plus 0.5 ms catching up and 0.25 ms
    # feeding a new prompt: the step spent 3.75 ms drafting before its verify call of 3 tokens
    plan = planner.plan(SimpleNamespace(decode=[fixed]), DraftRound(drafts, 1.0, 3.0, 0.5, 0.25), costs.for_step(1, 0))
    assert plan.lengths[0] == 2 and plan.predicted_accepted == pytest.approx(1.7)
    assert plan.predicted_ms == pytest.approx(3.75 + 3.0)  # the step overhead is still 0


# ---------------------------------------------------------------------------------------------- commit

class _Tok:
    def decode(self, ids):
        return " ".join(map(str, ids))


def test_commit_appends_accepted_drafts_and_the_targets_token_and_stops_where_asked():
    adm, metrics = admission(max_batch=4)
    committer = Committer(_Tok(), eos_ids=[99], max_context=64, metrics=metrics, admission=adm)
    r = request(0, prompt=[1], max_new_tokens=10)
    r.pieces = queue.Queue()
    s = request(1, prompt=[1], max_new_tokens=10)
    for i, x in enumerate((r, s)):
        x.slot, adm.slots[i] = i, x
    drafts = {0: Draft([5, 6, 7], [], np.ones(3, np.float32), [0.9, 0.8, 0.7]),
              1: Draft([99, 4], [], np.ones(2, np.float32), [0.9, 0.8])}
    result = VerifyResult([r, s], [], np.array([3, 2]), np.array([2, 1]), np.array([8, 3]), [4, 3], [0, 0], 1,
                          0.0, 0.0, 7, 7, 0.0)
    committer.commit(SimpleNamespace(decode=[r, s]), DraftRound(drafts, 0.0, 0.0, 0.0), result)
    assert r.generated_ids == [5, 6, 8] and r.pieces.get_nowait() == [5, 6, 8] and not r.finished
    assert r.target_len == 3 and r.stats.accepted_per_position[:3] == [1, 1, 0]
    assert s.generated_ids == [99] and s.finish_reason == "stop"  # the EOS among the accepted drafts
    assert adm.slots[1] is None and metrics.requests_finished == 1 and metrics.output_tokens == 4
    committer.extend(r, list(range(20, 40)), 0.0)
    assert len(r.generated_ids) == 10 and r.finish_reason == "length"
