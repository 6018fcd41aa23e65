"""Plain checks (phases/plain_check.py) and the per-kind levels they feed (costs/call_shape.py): a cost
model that prices drafting too cheaply next to plain decoding at some width is shown wrong and turns to
plain decoding there; calls soon after a switch of graphs teach only what a switch cannot explain."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from dspark_trt.runtime.controller import AdaptiveController
from dspark_trt.runtime.costs.call_shape import SWITCH_EXTRA, CallShapeCost, features
from dspark_trt.runtime.costs.step import Costs
from dspark_trt.runtime.costs.table import CostTable
from dspark_trt.runtime.phases.depth_planner import DepthPlanner
from dspark_trt.runtime.phases.plain_check import PlainCheckSchedule
from dspark_trt.runtime.tuning import RuntimeTuning

K = 4
# The tiny pair's fresh profile fit (ms = call + tokens + rows x past + padded attention): at 64 rows its
# depth slope is a third too shallow next to the calls a running batch makes.
PROFILED = np.array([2.78, 0.081, 0.085, 0.139])
SETTLE = RuntimeTuning().settle_calls


def test_a_check_is_a_stretch_of_plain_steps_after_so_many_drafting_steps_at_a_load_never_seen_plain():
    s = PlainCheckSchedule(4, 3)
    due = [s.due(64, observed=False) for _ in range(11)]
    assert due == [False, False, False, True, True, True, False, False, False, True, True]
    assert not any(s.due(64, observed=True) for _ in range(50) if s._loads[6][1] == 0)  # observed: never again
    assert not any(PlainCheckSchedule(0, 3).due(64, False) for _ in range(100))


def test_each_load_has_its_own_count_and_planning_no_drafting_there_starts_it_again():
    s = PlainCheckSchedule(2, 1)
    assert [s.due(64, False) for _ in range(2)] == [False, True]
    assert [s.due(4, False) for _ in range(2)] == [False, True]  # another load: its own count
    s.due(64, False)
    s.idle(64)
    assert [s.due(64, False) for _ in range(2)] == [False, True]
    assert s.checks == 3


def _costs(shape: CallShapeCost) -> Costs:
    """Costs at 64 rows with a call-shape model, draft calls 3.5 ms, no step overhead."""
    costs = Costs(512, K)
    costs.table = CostTable(np.linspace(0.0, 80.0, 513), np.full(K + 2, 3.5) * (np.arange(K + 2) > 0))
    costs.table.call_shape = shape
    return costs


def _true_ms(tokens, rows, longest, past):
    """What the calls take: plain 8% under the profile, deeper verification 30% over it."""
    return float(features(tokens, rows, longest, past) @ PROFILED) * (0.92 if longest == 1 else 1.3)


def _drafted_a_while() -> CallShapeCost:
    """The profiled model after 400 calls of a batch of 64 verifying one draft each."""
    shape = CallShapeCost(PROFILED)
    for _ in range(400):
        shape.observe(128, 64, 2, 100, _true_ms(128, 64, 2, 100))
    return shape


def _run(planner, shape, steps=200):
    """Steps at 64 rows as the planner plans them, each call as long as it truly takes, the first SETTLE
    calls after a switch between plain and verify calls as a switch makes them (half a plain call more) and
    marked so."""
    plans, last, same = [], None, 0
    for _ in range(steps):
        plan = planner.plan_for(64, 64, _costs_of[id(shape)].for_step(64, 100))
        plans.append(0 if plan.exploring else plan.steps)  # an exploration drafts, the plan stays plain
        q = 1 + plan.steps
        same = same + 1 if (q > 1) == last else 0
        last = q > 1
        settled = same >= SETTLE
        switch = 0.0 if settled else 0.5 * _true_ms(64, 64, 1, 100)
        shape.observe(64 * q, 64, q, 100, _true_ms(64 * q, 64, q, 100) + switch, settled=settled)
    return plans


_costs_of: dict = {}


def test_while_drafting_where_plain_was_never_seen_a_check_shows_plain_decoding_faster_and_the_plan_turns_to_it():
    """The model at 64 rows thinks depth 1 pays; the calls say plain decoding is faster. Drafting steps
    teach the verify calls' level; plain calls, never seen, are priced from what the verify calls said, too
    dear. A stretch of plain steps prices plain decoding by its own settled calls, and the plan turns plain."""
    shape = _drafted_a_while()
    _costs_of[id(shape)] = _costs(shape)
    planner = DepthPlanner(K, replace(RuntimeTuning(), plan_headroom=0), AdaptiveController())
    plans = _run(planner, shape)
    assert planner.plain_checks.checks == 1
    assert plans[-100:] == [0] * 100
    assert shape.ms(64, 64, 1, 100) == pytest.approx(_true_ms(64, 64, 1, 100), rel=0.05)


def test_without_plain_checks_the_same_model_keeps_drafting():
    shape = _drafted_a_while()
    _costs_of[id(shape)] = _costs(shape)
    planner = DepthPlanner(K, replace(RuntimeTuning(), plan_headroom=0, plain_check_every=0), AdaptiveController())
    assert min(_run(planner, shape)[-50:]) >= 1


def _calls(m, n, plain=None, verify=None, seed=0, settled=True):
    """n calls at 64 rows: plain ones (one token a row) taking `plain` x the base model, verify ones (three
    tokens a row) `verify` x, alternating when both are given; 3% noise."""
    rng = np.random.default_rng(seed)
    kinds = [k for k in ((64, 1, plain), (192, 3, verify)) if k[2] is not None]
    for i in range(n):
        tokens, q, factor = kinds[i % len(kinds)]
        m.observe(tokens, 64, q, 100, factor * float(rng.lognormal(0, 0.03)) * m.base_ms(tokens, 64, q, 100),
                  settled=settled)


def _factors(m):
    return m.ms(64, 64, 1, 100) / m.base_ms(64, 64, 1, 100), m.ms(192, 64, 3, 100) / m.base_ms(192, 64, 3, 100)


def test_at_a_width_plain_and_verify_calls_get_a_level_each():
    m = CallShapeCost(PROFILED)
    m.refit_every = 0  # levels only (a refit would learn this slope)
    _calls(m, 200, plain=0.8, verify=1.25)
    assert _factors(m) == pytest.approx((0.8, 1.25), rel=0.03)
    # every verify depth shares one level: a depth run a few times cannot look cheaper than the others
    assert m.ms(512, 64, 8, 100) / m.base_ms(512, 64, 8, 100) == pytest.approx(1.25, rel=0.03)
    grid = m.table(np.array([64, 128, 192, 512]), 64, np.array([1, 2, 3, 8]), 100)
    assert grid == pytest.approx([m.ms(t, 64, q, 100) for t, q in ((64, 1), (128, 2), (192, 3), (512, 8))])


@pytest.mark.parametrize("stretch", ["plain", "verify"])
def test_a_stretch_of_one_kind_leaves_the_other_kind_priced_by_its_own_calls(stretch):
    # Both kinds were seen, then only one runs for a while, dearer than before (a flat profile's verify
    # calls, or a busy spell): the other kind keeps its price. A level shared by both kinds handed the
    # stretch's error to the other kind (after drafting, plain decoding priced at 2-3x its cost).
    m = CallShapeCost(PROFILED)
    m.refit_every = 0
    _calls(m, 64, plain=0.8, verify=1.25)
    factor = {"plain": 0.8, "verify": 1.25}[stretch]
    _calls(m, 300, **{stretch: 2.0 * factor}, seed=1)
    expected = {"plain": (1.6, 1.25), "verify": (0.8, 2.5)}[stretch]
    assert _factors(m) == pytest.approx(expected, rel=0.05)


def test_calls_soon_after_a_switch_of_graphs_teach_nothing_that_a_switch_can_explain():
    m = CallShapeCost(PROFILED)
    m.refit_every = 0
    _calls(m, 64, plain=0.8, verify=1.25)
    before, moves = _factors(m), m.moves
    plain_call = 0.8 * m.base_ms(64, 64, 1, 100)
    for q in (1, 3, 7) * 10:  # each right after the other kind, up to a switch's price dearer at any depth
        factor = 0.8 if q == 1 else 1.25
        m.observe(64 * q, 64, q, 100, factor * m.base_ms(64 * q, 64, q, 100) + 0.95 * SWITCH_EXTRA * plain_call,
                  settled=False)
    _calls(m, 40, plain=0.5, verify=0.5, settled=False)  # cheaper: half of any noise would be learned
    assert _factors(m) == pytest.approx(before)
    assert m.moves == moves


def test_a_call_soon_after_a_switch_dearer_than_a_switch_explains_teaches_the_rest_at_once():
    """A flat profile prices deep verification far too cheaply; its first verify calls all come right after
    the plain graph ran. Skipping them all, a cold start drafted 5 deep for 8 steps at 16 requests (4-5x a
    plain step each) before its first settled call."""
    m = CallShapeCost(PROFILED)
    m.refit_every = 0
    _calls(m, 1, verify=4.0, settled=False)
    # what is left once a whole switch's price (SWITCH_EXTRA plain calls) is taken out, learned as a settled
    # call would be
    verify, plain = m.base_ms(192, 64, 3, 100), m.base_ms(64, 64, 1, 100)
    left = (4.0 * verify - SWITCH_EXTRA * plain) / verify
    assert _factors(m)[1] == pytest.approx(math.exp(0.5 * math.log(left)), rel=0.05)
    assert m.moves == 1  # news: plans made before it are made again (depth_planner)


def test_a_kind_never_observed_follows_every_calls_drift_until_one_of_its_calls_is():
    m = CallShapeCost(PROFILED)
    m.refit_every = 0
    _calls(m, 200, verify=1.3)
    assert _factors(m) == pytest.approx((1.3, 1.3), rel=0.03)  # plain never seen: the machine's speed
    _calls(m, 30, plain=0.8)
    _calls(m, 200, verify=2.0, seed=2)
    assert _factors(m) == pytest.approx((0.8, 2.0), rel=0.04)


def test_a_level_catches_up_with_a_prior_3x_off_within_a_dozen_calls_and_one_stall_moves_it_little():
    m = CallShapeCost(PROFILED)
    m.refit_every = 0
    _calls(m, 12, verify=3.0)
    assert _factors(m)[1] == pytest.approx(3.0, rel=0.1)
    _calls(m, 200, verify=3.0, seed=1)
    m.observe(192, 64, 3, 100, 8 * 3.0 * m.base_ms(192, 64, 3, 100))  # a stalled call
    assert 3.0 < _factors(m)[1] < 3.0 * math.exp(m.alpha * m.STEP) * 1.01


def test_the_profile_prices_each_kind_at_each_width_it_measured():
    """ONNX Runtime's plain calls run a faster graph than verify calls: one fit cannot price both, and each
    kind starts from the fit's error on its profiled calls (at the nearest measured width elsewhere)."""
    pts = []
    for rows in (1, 4, 16, 64):
        for q in (1, 3, 8):
            for past in (32, 192):
                t = rows * q
                pts.append([t, rows, q, past, float(features(t, rows, q, past) @ PROFILED) * (0.65 if q == 1 else 1.1)])
    m = CallShapeCost.from_points(pts)
    for rows in (4, 16, 64):
        assert m.ms(rows, rows, 1, 100) == pytest.approx(0.65 * float(features(rows, rows, 1, 100) @ PROFILED), rel=0.12)
        assert m.ms(3 * rows, rows, 3, 100) == pytest.approx(1.1 * float(features(3 * rows, rows, 3, 100) @ PROFILED),
                                                             rel=0.12)
    assert m.ms(32, 32, 1, 100) < 0.8 * m.ms(96, 32, 3, 100) / 3 * 3  # 32 rows (not measured): as 16 or 64
