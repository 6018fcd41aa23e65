"""Plain checks (phases/plain_check.py) and the per-depth levels they feed (costs/call_shape.py): a cost
model that prices drafting too cheaply next to plain decoding at some width is shown wrong and turns to
plain decoding there."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from dspark_trt.runtime.controller import AdaptiveController
from dspark_trt.runtime.costs.call_shape import CallShapeCost, features
from dspark_trt.runtime.costs.step import Costs
from dspark_trt.runtime.costs.table import CostTable
from dspark_trt.runtime.phases.depth_planner import DepthPlanner
from dspark_trt.runtime.phases.plain_check import PlainCheckSchedule
from dspark_trt.runtime.tuning import RuntimeTuning

K = 4
# The tiny pair's fresh profile fit (ms = call + tokens + rows x past + padded attention): at 64 rows its
# depth slope is a third too shallow next to the calls a running batch makes.
PROFILED = np.array([2.78, 0.081, 0.085, 0.139])


def test_plain_checks_come_every_so_many_drafting_steps_three_times_then_twice_as_far_apart_up_to_32x():
    s = PlainCheckSchedule(4)
    due = [i for i in range(1, 700) if s.due(64)]
    assert due[:6] == [4, 8, 12, 20, 36, 68] and np.diff(due)[-1] == 4 * 32
    assert not any(PlainCheckSchedule(0).due(64) for _ in range(100))


def test_each_load_has_its_own_period_and_planning_no_drafting_there_starts_it_again():
    s = PlainCheckSchedule(2)
    assert [s.due(64) for _ in range(2)] == [False, True]
    assert [s.due(4) for _ in range(2)] == [False, True]  # another load: its own count
    assert [s.due(64) for _ in range(4)] == [False, True, False, True]
    assert [s.due(64) for _ in range(4)] == [False, False, False, True]  # after three: twice as far apart
    s.idle(64)
    assert [s.due(64) for _ in range(2)] == [False, True]
    assert s.checks == 6


def _costs(shape: CallShapeCost) -> Costs:
    """Costs at 64 rows with a call-shape model, draft calls 3.5 ms, no step overhead."""
    costs = Costs(512, K)
    costs.table = CostTable(np.linspace(0.0, 80.0, 513), np.full(K + 2, 3.5) * (np.arange(K + 2) > 0))
    costs.table.call_shape = shape
    return costs


def _true_ms(tokens, rows, longest, past):
    """What the calls take: plain 8% under the profile, deeper verification 30% over it."""
    return float(features(tokens, rows, longest, past) @ PROFILED) * (0.92 if longest == 1 else 1.3)


def test_while_drafting_a_plain_step_checks_plain_decoding_and_the_plan_turns_to_it_where_it_is_faster():
    """The model at 64 rows thinks depth 1 pays; the calls say plain decoding is faster. Drafting steps
    alone teach the width the depth it runs, whose level then prices plain too; the plain checks show
    plain's own, and the plan turns plain."""
    shape = _drafted_a_while()
    costs = _costs(shape)
    planner = DepthPlanner(K, replace(RuntimeTuning(), plan_headroom=0), AdaptiveController())
    plans = []
    for _ in range(200):
        plan = planner.plan_for(64, 64, costs.for_step(64, 100))
        plans.append(0 if plan.exploring else plan.steps)  # an exploration drafts, the plan stays plain
        q = 1 + plan.steps
        shape.observe(64 * q, 64, q, 100, _true_ms(64 * q, 64, q, 100))
    assert planner.plain_checks.checks >= 1
    assert plans[-100:] == [0] * 100
    plain_ms = shape.ms(64, 64, 1, 100)
    assert plain_ms == pytest.approx(_true_ms(64, 64, 1, 100), rel=0.05)


def _drafted_a_while() -> CallShapeCost:
    """The profiled model after 400 calls of a batch of 64 verifying one draft each."""
    shape = CallShapeCost(PROFILED)
    for _ in range(400):
        shape.observe(128, 64, 2, 100, _true_ms(128, 64, 2, 100))
    return shape


def test_without_plain_checks_the_same_model_keeps_drafting():
    shape = _drafted_a_while()
    costs = _costs(shape)
    planner = DepthPlanner(K, replace(RuntimeTuning(), plan_headroom=0, plain_check_every=0), AdaptiveController())
    plans = []
    for _ in range(200):
        plan = planner.plan_for(64, 64, costs.for_step(64, 100))
        plans.append(plan.steps)
        q = 1 + plan.steps
        shape.observe(64 * q, 64, q, 100, _true_ms(64 * q, 64, q, 100))
    assert min(plans[-50:]) >= 1


def test_at_a_width_plain_and_verify_calls_get_their_own_offsets_from_its_level():
    m = CallShapeCost(PROFILED)
    m.refit_every = 0  # offsets only (a refit would learn this slope)
    for _ in range(100):
        m.observe(64, 64, 1, 100, 0.8 * float(features(64, 64, 1, 100) @ PROFILED))
        m.observe(192, 64, 3, 100, 1.25 * float(features(192, 64, 3, 100) @ PROFILED))
    assert m.ms(64, 64, 1, 100) / m.base_ms(64, 64, 1, 100) == pytest.approx(0.8, rel=0.03)
    assert m.ms(192, 64, 3, 100) / m.base_ms(192, 64, 3, 100) == pytest.approx(1.25, rel=0.03)
    # every verify depth shares one offset: a depth run a few times cannot look cheaper than the others
    assert m.ms(512, 64, 8, 100) / m.base_ms(512, 64, 8, 100) == pytest.approx(1.25, rel=0.03)
    assert m.ms(16, 16, 1, 100) == pytest.approx(m.base_ms(16, 16, 1, 100) * math.exp(m.log_drift))  # unseen width
    grid = m.table(np.array([64, 128, 192, 512]), 64, np.array([1, 2, 3, 8]), 100)
    assert grid == pytest.approx([m.ms(t, 64, q, 100) for t, q in ((64, 1), (128, 2), (192, 3), (512, 8))])


def _calls(m, n, plain=None, verify=None, seed=0):
    """n calls at 64 rows: plain ones (one token a row) taking `plain` x the base model, verify ones (three
    tokens a row) `verify` x, alternating when both are given; 3% noise."""
    rng = np.random.default_rng(seed)
    kinds = [k for k in ((64, 1, plain), (192, 3, verify)) if k[2] is not None]
    for i in range(n):
        tokens, q, factor = kinds[i % len(kinds)]
        m.observe(tokens, 64, q, 100, factor * float(rng.lognormal(0, 0.03)) * m.base_ms(tokens, 64, q, 100))


def _factors(m):
    return m.ms(64, 64, 1, 100) / m.base_ms(64, 64, 1, 100), m.ms(192, 64, 3, 100) / m.base_ms(192, 64, 3, 100)


@pytest.mark.parametrize("stretch", ["plain", "verify"])
def test_a_stretch_of_one_kind_leaves_the_other_kind_priced_by_what_it_costs(stretch):
    # The profile's slope is wrong: at 64 rows verifying is 1.25x the model, plain decoding 0.8x. Both kinds
    # were seen, then only one runs for a while (adaptive drafting for good, or plain for good): the other
    # kind keeps its price. Learned against a level that followed the stretch, it took the stretch's price
    # (after drafting, plain decoding looked as dear as verifying: adaptive drafted on at 16 requests, 0.88x
    # `off`; after plain decoding, verifying looked as cheap as plain).
    m = CallShapeCost(PROFILED)
    m.refit_every = 0  # offsets and levels only
    _calls(m, 64, plain=0.8, verify=1.25)
    factor = {"plain": 0.8, "verify": 1.25}[stretch]
    _calls(m, 300, **{stretch: factor}, seed=1)
    assert _factors(m) == pytest.approx((0.8, 1.25), rel=0.05)
    # the machine slowing down 1.3x during a stretch slows both
    _calls(m, 300, **{stretch: 1.3 * factor}, seed=2)
    assert _factors(m) == pytest.approx((1.3 * 0.8, 1.3 * 1.25), rel=0.06)


@pytest.mark.parametrize("seed", range(3))
def test_explorations_now_and_then_leave_plain_decodings_price_alone(seed):
    # Plain decoding with an exploration every 31st call whose verify call costs 1.35x the model: the
    # exploration's surprise is its kind's offset, not the machine's speed, so plain decoding stays priced
    # within 4% (moved by it, the level handed each exploration's error to plain's offset: 5-6% off).
    m = CallShapeCost(PROFILED)
    m.refit_every = 0
    rng = np.random.default_rng(seed)
    worst = 0.0
    for i in range(31 * 40):
        tokens, q, factor = (192, 3, 1.35) if i % 31 == 30 else (64, 1, 1.0)
        m.observe(tokens, 64, q, 100, factor * float(rng.lognormal(0, 0.05)) * m.base_ms(tokens, 64, q, 100))
        if i > 31 * 10:
            worst = max(worst, abs(math.log(_factors(m)[0])))
    assert worst < math.log(1.04)
    assert _factors(m)[1] == pytest.approx(1.35, rel=0.08)


def test_plain_checks_among_verify_calls_teach_plain_its_price():
    # Verify calls only, then a plain call every 8th: a few checks price plain decoding (a kind's median
    # starts short), though the width's level followed the verify calls.
    m = CallShapeCost(PROFILED)
    m.refit_every = 0
    _calls(m, 200, verify=1.25)
    assert _factors(m)[0] == pytest.approx(1.25, rel=0.05)  # never seen: priced at the width's level
    for i in range(24):
        _calls(m, 1, **({"plain": 0.8} if i % 8 == 7 else {"verify": 1.25}), seed=i)
    assert _factors(m) == pytest.approx((0.8, 1.25), rel=0.05)


def test_one_stalled_call_moves_an_offset_by_at_most_half_again():
    m = CallShapeCost(PROFILED)
    m.observe(64, 64, 1, 100, float(features(64, 64, 1, 100) @ PROFILED))
    m.observe(192, 64, 3, 100, 6.7 * float(features(192, 64, 3, 100) @ PROFILED))  # the first call of its depth
    assert m.kind_offset[(6, True)][0] == pytest.approx(math.log(1.5) / 2)  # its first call: half of at most 1.5x
    assert m.ms(192, 64, 3, 100) / m.base_ms(192, 64, 3, 100) < 1.5
