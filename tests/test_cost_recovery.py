"""Recovery from a wrong cost profile, in a simulated cost environment (tests/cost_sim.py): engines whose
acceptance is known (calibrated survivals, conditional acceptance 0.85, 0.8, 0.75, 0.7 by position) and
whose calls take known true times on a simulated clock. Whatever the starting profile (too pessimistic
about drafting, too optimistic, a flat verify curve), adaptive learns the true costs from its own calls
and converges to what they imply; where drafting truly does not pay, exploring costs at most its budget.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from cost_sim import generate_all_at_once, profile_table, simulated
from dspark_trt.runtime import GenerationConfig, Runtime
from dspark_trt.runtime.tuning import RuntimeTuning

ACCEPT = [0.85, 0.8, 0.75, 0.7]
PROMPTS = [[5 + i, 9, 13] for i in range(8)]  # 8 requests: every slot of the test artifact


def true_draft(rows, tokens):
    return 2.0 + 0.1 * rows + 0.01 * max(0, tokens - rows)


def true_verify(rows, tokens):
    return 6.0 + 0.1 * tokens


def run(artifact, monkeypatch, profile_draft=true_draft, profile_verify=true_verify, tuning=RuntimeTuning(),
        spec="adaptive", draft=true_draft, verify=true_verify, tokens=200):
    """Generate from PROMPTS on the simulated engines, the runtime starting from the given profile.
    Returns (outputs, simulated ms, per-step log, cost drift, the runtime's exploration report)."""
    rt = Runtime.load(artifact, profile="none", tuning=tuning)
    try:
        with monkeypatch.context() as mp:
            engines = simulated(rt, mp, draft, verify, accept=ACCEPT)
            rt.cost = profile_table(profile_draft, profile_verify, rt.max_batch, 64, rt)
            start = engines.clock()
            outs = generate_all_at_once(rt, PROMPTS, GenerationConfig(max_new_tokens=tokens, spec=spec))
            ms = (engines.clock() - start) * 1e3
        return outs, ms, list(rt.metrics.step_log), rt.cost.drift(), rt.depth_planner.exploration.report()
    finally:
        rt.cost = None  # nothing to persist next to the shared test artifact
        rt.close()


def rate(result) -> float:
    outs, ms = result[0], result[1]
    return sum(len(o.token_ids) for o in outs) / ms


def full_steps(log, skip: int) -> list[dict]:
    """The steps after the first `skip` with every request decoding (the converged regime)."""
    return [s for s in log[skip:] if s["decode_requests"] == len(PROMPTS)]


@pytest.fixture(scope="module")
def truth(tiny_artifact):
    """Adaptive started from the true costs: the decisions the true costs imply."""
    with pytest.MonkeyPatch.context() as mp:
        return run(tiny_artifact, mp)


def test_the_simulated_environment_has_a_right_answer(tiny_artifact, monkeypatch, truth):
    """Drafting pays here (best fixed K well above plain decoding) and adaptive from the true profile is
    within a few percent of the best fixed K; greedy text is the target's whatever is drafted."""
    off = run(tiny_artifact, monkeypatch, spec="off")
    fixed = {k: run(tiny_artifact, monkeypatch, spec=f"fixed:{k}") for k in (1, 2)}
    best = max(rate(r) for r in fixed.values())
    assert best > 1.15 * rate(off)
    assert rate(truth) > 0.95 * best
    assert [o.token_ids for o in truth[0]] == [o.token_ids for o in off[0]]


def test_a_profile_3x_too_pessimistic_about_drafting_is_recovered_by_exploring(tiny_artifact, monkeypatch, truth):
    """Draft calls profiled 3x too dear: the model plans no drafting, so only exploration observes a draft
    call. A few explorations teach the tables the true draft cost and adaptive drafts as the true costs
    imply. Without exploration it never drafts again after its first step."""
    pessimistic = run(tiny_artifact, monkeypatch, profile_draft=lambda r, t: 3 * true_draft(r, t))
    outs, _, log, drift, explored = pessimistic
    assert 1 <= explored[8]["explorations"] <= 6
    assert drift["draft"]["global"] == pytest.approx(1 / 3, rel=0.1)
    late = full_steps(log, 64)
    assert np.mean([any(s["drafted"]) for s in late]) > 0.9
    assert rate(pessimistic) > 0.93 * rate(truth)
    assert [o.token_ids for o in outs] == [o.token_ids for o in truth[0]]

    stuck = run(tiny_artifact, monkeypatch, profile_draft=lambda r, t: 3 * true_draft(r, t),
                tuning=replace(RuntimeTuning(), explore_budget=0.0))
    assert not any(any(s["drafted"]) for s in full_steps(stuck[2], 8))
    assert stuck[3]["draft"]["observations"] <= 1
    assert rate(stuck) < 0.9 * rate(truth)


@pytest.mark.parametrize("factor", [20.0, 1 / 20.0])
def test_a_profile_20x_off_about_drafting_is_recovered_within_the_run(tiny_artifact, monkeypatch, truth, factor):
    """Draft calls profiled 20x too dear (a profile measured under heavy load: adaptive plans no drafting)
    or 20x too cheap: the correction is not capped short of the truth, so the tables learn the true draft
    cost (from explorations, or from the drafting calls) and adaptive drafts again within the run. With
    the correction capped at 4x, as it was, a 20x too dear profile never drafted again."""
    result = run(tiny_artifact, monkeypatch, profile_draft=lambda r, t: factor * true_draft(r, t))
    outs, _, log, drift, _ = result
    assert drift["draft"]["global"] == pytest.approx(1 / factor, rel=0.15)
    assert all(any(s["drafted"]) or s["plain_check"] for s in full_steps(log, 0)[-24:])
    assert rate(result) > (0.85 if factor > 1 else 0.95) * rate(truth)
    assert [o.token_ids for o in outs] == [o.token_ids for o in truth[0]]


def test_a_profile_too_optimistic_about_drafting_is_corrected_by_its_own_calls(tiny_artifact, monkeypatch, truth):
    """Draft calls profiled 3x too cheap: adaptive drafts deep at first; the drafting calls it observes
    teach the tables the true cost, and it settles where the true costs put it."""
    optimistic = run(tiny_artifact, monkeypatch, profile_draft=lambda r, t: true_draft(r, t) / 3)
    _, _, log, drift, _ = optimistic
    assert drift["draft"]["global"] == pytest.approx(3.0, rel=0.1)
    first = log[1]
    depth = [np.mean([max(s["drafted"]) for s in full_steps(r[2], 48)]) for r in (optimistic, truth)]
    assert max(first["drafted"]) > depth[1] + 1  # it started out drafting deeper than the truth implies
    assert depth[0] == pytest.approx(depth[1], abs=0.5)
    assert rate(optimistic) > 0.95 * rate(truth)


def test_a_flat_verify_profile_is_corrected_by_its_own_calls(tiny_artifact, monkeypatch, truth):
    """A verify curve recorded flat (extra verified tokens look free) at the cost of a plain step: the
    verify calls it observes move the table to the true curve's level where it verifies."""
    flat = run(tiny_artifact, monkeypatch, profile_verify=lambda r, t: true_verify(1, 8))
    drift = flat[3]["verify"]
    assert drift["observations"] > 10 and drift["global"] > 1.1
    assert rate(flat) > 0.95 * rate(truth)


def test_where_drafting_truly_does_not_pay_exploring_costs_at_most_its_budget(tiny_artifact, monkeypatch):
    """Draft calls truly cost 20 ms and the profile says so: adaptive does not draft, and exploring costs at
    most explore_budget of the run's time, the draft catching up on what it skipped included."""
    dear = dict(draft=lambda r, t: 20.0 + true_draft(r, t))
    dear["profile_draft"] = dear["draft"]
    budget = RuntimeTuning().explore_budget
    exploring = run(tiny_artifact, monkeypatch, **dear)
    never = run(tiny_artifact, monkeypatch, tuning=replace(RuntimeTuning(), explore_budget=0.0), **dear)
    assert exploring[4][8]["explorations"] >= 1
    extra = exploring[1] - never[1]
    assert 0 < extra <= budget * never[1]
    assert [o.token_ids for o in exploring[0]] == [o.token_ids for o in never[0]]


# ----------------------------------------------------------------------------------- the schedule alone

def test_exploration_spends_a_share_of_plain_step_time_that_falls_as_explorations_confirm_the_plan():
    from dspark_trt.runtime.phases.exploration import ExplorationSchedule

    budget = 0.1

    def drive(confirmed: bool, steps: int):
        s = ExplorationSchedule(budget)
        due = []
        for _ in range(steps):
            c = s.due(16, 10.0, 5.0)
            if c is not None:
                s.settle(16, c, c, confirmed)  # it cost what was charged
            due.append(c)
        return s, due

    s, due = drive(True, 20000)
    charged = [c for c in due if c is not None]
    assert all(c == 5.0 for c in charged)
    assert 5.0 * len(charged) <= budget * 10.0 * len(due)
    gaps = np.diff([i for i, c in enumerate(due) if c is not None])
    assert gaps[0] < gaps[-1] <= gaps[0] / ExplorationSchedule.FLOOR  # it falls with confirmations, to the floor
    # as 1 / (1 + n)^2: after one confirmation the wait is 4x the first, after two 9x
    assert gaps[1] / gaps[0] == pytest.approx(9 / 4, rel=0.15)
    assert s.share(16) == pytest.approx(budget * ExplorationSchedule.FLOOR)
    # Confirmed over and over, it spends a fiftieth of its budget: each exploring step holds up every request
    # in flight, and at a tenth an open loop's TPOT p50 read 1.06x `off`'s.
    late = [c for c in due[10000:] if c is not None]
    assert 5.0 * len(late) <= 1.05 * budget / 50 * 10.0 * 10000
    assert s.due(1, 10.0, 5.0) is None  # every load bucket earns its own credit
    # Explorations where drafting paid do not count: exploring goes on at the full share.
    s, due = drive(False, 2000)
    assert s.share(16) == budget and len({int(g) for g in np.diff([i for i, c in enumerate(due) if c])}) == 1


def test_an_exploration_is_due_only_once_the_credit_covers_its_catch_up_too():
    """Exploring first feeds the draft what it has not seen (16 requests' prompts at the start of a burst
    cost five plain steps once): the schedule waits until the credit covers that as well, and asks what
    exploring would cost only once the credit covers what it said last (the catch-up only grows while
    nothing drafts; the estimate sums over the requests)."""
    from dspark_trt.runtime.phases.exploration import ExplorationSchedule

    asked = []

    def cost():
        asked.append(1)
        return 5.0 + 20.0  # its draft calls and verifying them, and the catch-up

    s = ExplorationSchedule(0.1)  # 1 ms of credit a 10 ms plain step
    due = [s.due(16, 10.0, cost) for _ in range(25)]
    assert due == [None] * 24 + [25.0]
    assert len(asked) == 2  # at the first step, and when the credit covered the 25 ms it said


def test_an_exploration_that_cost_more_than_charged_is_paid_back_before_the_next():
    """What an exploration measurably cost beyond its charge is taken from the credit: one slowed by
    something else (20 ms over) delays the next exploration by what it overran, and no more; a saving brings
    the next one forward only where the exploration did not confirm the plan not to draft."""
    from dspark_trt.runtime.phases.exploration import ExplorationSchedule

    def gaps(overrun: float, confirmed: bool = False) -> list[int]:
        s = ExplorationSchedule(0.1)
        due = []
        for _ in range(60):
            c = s.due(16, 10.0, 5.0)
            if c is not None:
                s.settle(16, c, c + (overrun if not any(due) else 0.0), confirmed)
            due.append(c)
        return np.diff([-1] + [i for i, c in enumerate(due) if c is not None]).tolist()

    assert gaps(0.0)[:3] == [5, 5, 5]
    assert gaps(20.0)[:3] == [5, 25, 5]
    # One that cost less than charged (a profile too dear about drafting) pays for the next look sooner,
    # unless it confirmed that drafting does not pay: then the saving earns nothing.
    assert gaps(-4.0)[:2] == [5, 1]
    assert gaps(-4.0, confirmed=True)[:2] == [5, 20]  # and the share falls to a quarter


def test_the_catch_up_rate_is_weighed_by_tokens():
    """A catch-up of 960 prompt tokens is priced at what large catch-up calls cost per token: the fixed
    cost of a small call (0.5 ms for 2 tokens) does not set the rate, and the rate follows the machine."""
    from dspark_trt.runtime.costs.catch_up import CatchUpRate

    rate = CatchUpRate()
    assert rate.ms(960) == 0.0  # nothing timed yet: the first catch-up finds out
    rate.observe(480, 12.0)
    rate.observe(2, 0.5)
    assert rate.ms(960) == pytest.approx(24.0, rel=0.1)  # a mean of per-call rates: 0.14 ms a token, 131 ms
    for _ in range(20):
        rate.observe(480, 24.0)  # the machine got twice as slow
    assert rate.ms(960) == pytest.approx(48.0, rel=0.02)



def test_one_dear_catch_up_is_forgotten_at_the_next_large_one():
    """A catch-up priced too dear is never explored, so never timed again: the rate is never above what
    the latest large catch-up cost, and one normal call after a cold one (a fresh server's first, its
    caches still being mapped: 1.1 ms a token) brings it back."""
    from dspark_trt.runtime.costs.catch_up import CatchUpRate

    rate = CatchUpRate()
    rate.observe(400, 450.0)
    assert rate.ms(100) == pytest.approx(112.5)
    rate.observe(40, 0.8)  # 0.02 ms a token
    assert rate.ms(100) == pytest.approx(2.0)
    rate.observe(2, 0.5)  # a small call's fixed cost does not set it
    assert rate.ms(100) == pytest.approx(2.0)
    rate.observe(400, 16.0)  # dearer than the one before: the latest sets it while the mean is dearer still
    assert 2.0 < rate.ms(100) <= 4.0


def test_a_catch_up_token_is_never_priced_above_twice_a_drafting_rows_cost():
    """A server's first catch-up, timed while its caches were still being mapped, cost 13x what one more
    row costs a drafting call; priced at that, every later catch-up was out of the exploration budget's
    reach, so adaptive never drafted again. Feeding a token costs about a row's work: the price is bounded
    at twice the cost table's slope, whatever was timed."""
    from types import SimpleNamespace

    from dspark_trt.runtime.costs.catch_up import CatchUpRate
    from dspark_trt.runtime.costs.step import Costs
    from dspark_trt.runtime.costs.table import CostTable
    from dspark_trt.runtime.phases.drafter import Drafter

    costs = Costs(64, 4)
    rows = np.arange(65)
    costs.table = CostTable(np.arange(65) * 0.1, np.where(rows > 0, 0.4 + 0.05 * rows, 0.0))  # 0.05 ms a row
    drafter = Drafter.__new__(Drafter)
    drafter.costs, drafter.catch_up_rate = costs, CatchUpRate()
    behind = [SimpleNamespace(tokens=[1] * 301, draft_len=0)]
    drafter.catch_up_rate.observe(300, 200.0)  # cold: 0.67 ms a token
    assert drafter.catch_up_ms(behind) == pytest.approx(300 * 2 * 0.05)
    drafter.catch_up_rate.observe(300, 6.0)  # warm: 0.02 ms a token, below the bound
    assert drafter.catch_up_ms(behind) == pytest.approx(6.0)
