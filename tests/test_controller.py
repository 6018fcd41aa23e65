"""The controller: exact for greedy, stale-sized (hence lossless) for sampling, caps honoured."""

import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_trt.runtime.controller import AdaptiveController
from dspark_trt.runtime.costs.table import CostTable, measurement_points
from dspark_trt.runtime.solver import best_budget, solve_budget, solve_budget_for_b

SETTINGS = settings(max_examples=60, deadline=None)


class LinearCost:
    """verify(t) = fixed + per_token * t; draft(b) = draft_fixed."""

    def __init__(self, fixed=2.0, per_token=0.05, draft=0.5, size=64):
        self.table = fixed + per_token * np.arange(size + 1.0)
        self.table[0] = 0.0
        self.draft = draft

    def verify_table(self):
        return self.table

    def draft_ms(self, batch):
        return self.draft


COST = LinearCost()


@st.composite
def survival(draw, R, K):
    c = np.array(draw(st.lists(st.floats(0.0, 1.0), min_size=R * K, max_size=R * K))).reshape(R, K)
    return np.cumprod(c, axis=1)


@st.composite
def batch(draw, max_r=4, max_k=5):
    R = draw(st.integers(1, max_r))
    K = draw(st.integers(1, max_k))
    return R, K, draw(survival(R, K)), np.array(draw(st.lists(st.booleans(), min_size=R, max_size=R)))


def geometric(R, K, c):
    return np.tile(c ** np.arange(1, K + 1), (R, 1))


# ------------------------------------------------------------------------------------------ greedy

@SETTINGS
@given(batch())
def test_all_greedy_uses_the_exact_optimum_of_the_live_survivals(b):
    R, K, S, _ = b
    ctl = AdaptiveController()
    lengths = ctl.plan(S, list(range(R)), np.zeros(R, bool), COST, draft_batch=R)
    assert lengths.tolist() == solve_budget(S, COST.table, COST.draft).tolist()


def test_greedy_verifies_everything_when_verification_is_free_and_nothing_when_ruinous():
    S = geometric(3, 4, 0.6)
    free = LinearCost(per_token=0.0)
    ruinous = LinearCost(fixed=1.0, per_token=1000.0)
    assert AdaptiveController().plan(S, "abc", np.zeros(3, bool), free, 3).tolist() == [4, 4, 4]
    assert AdaptiveController().plan(S, "abc", np.zeros(3, bool), ruinous, 3).tolist() == [0, 0, 0]


# ---------------------------------------------------------------------------------------- sampling

def test_sampling_sizes_the_budget_from_last_steps_rows_and_allocates_from_the_live_ones():
    ctl = AdaptiveController()
    ids, sampling = ["a", "b", "c"], np.ones(3, bool)
    previous = np.array([[0.9, 0.8, 0.7], [0.5, 0.2, 0.1], [0.3, 0.1, 0.0]])
    ctl.plan(previous, ids, sampling, COST, 3)
    live = np.array([[0.2, 0.1, 0.0], [0.95, 0.9, 0.9], [0.6, 0.5, 0.1]])
    lengths = ctl.plan(live, ids, sampling, COST, 3)
    budget, _ = best_budget(previous, COST.table, COST.draft)
    assert lengths.sum() == budget
    assert lengths.tolist() == solve_budget_for_b(live, budget).tolist()


def test_rows_are_matched_by_request_id_not_position():
    ctl = AdaptiveController()
    confident, doubtful = [0.99, 0.99, 0.99], [0.1, 0.01, 0.0]
    ctl.plan(np.array([confident, doubtful]), ["x", "y"], [True, True], COST, 2)
    live = np.full((2, 3), 0.5)
    lengths = ctl.plan(live, ["y", "x"], [True, True], COST, 2)  # order swapped
    budget, _ = best_budget(np.array([doubtful, confident]), COST.table, COST.draft)
    assert lengths.sum() == budget


def test_new_requests_use_the_prior_then_the_running_mean_profile():
    ctl = AdaptiveController(prior_decay=0.5)
    K = 4
    assert ctl.prior_row(K) == pytest.approx(0.7 ** np.arange(1, K + 1))  # before any step
    first = geometric(2, K, 0.9)
    ctl.plan(first, ["a", "b"], [True, True], COST, 2)
    assert ctl.prior_row(K) == pytest.approx(first.mean(axis=0))
    ctl.plan(geometric(2, K, 0.5), ["a", "b"], [True, True], COST, 2)
    w = 1 - (1 - 0.5) ** 2  # a step of 2 rows at 0.5 a row
    assert ctl.prior_row(K) == pytest.approx((1 - w) * first[0] + w * geometric(1, K, 0.5)[0])
    # a newcomer is sized from that profile, the others from their previous rows
    prior = ctl.prior_row(K)
    lengths = ctl.plan(geometric(3, K, 0.3), ["a", "b", "new"], [True, True, True], COST, 3)
    sizing = np.vstack([geometric(2, K, 0.5), prior])
    assert lengths.sum() == best_budget(sizing, COST.table, COST.draft)[0]


@pytest.mark.parametrize("sampling", [True, False])  # the numpy path and the small greedy one
def test_the_starting_profile_counts_as_prior_rows_rows_so_one_low_first_row_does_not_replace_it(sampling):
    """A head that scores a request's first drafts low (all of them accepted) set the whole profile when the
    first row replaced the starting one, and a fresh runtime at 1 request then planned no drafting for 64
    requests. With prior_rows the starting profile is one row among prior_rows + 1."""
    K = 4
    start = 0.7 ** np.arange(1, K + 1)
    low = geometric(1, K, 0.3)
    ctl = AdaptiveController(prior_decay=1 / 256, prior_rows=16)
    ctl.plan(low, ["a"], [sampling], COST, 1)
    assert ctl.prior_row(K) == pytest.approx((16 * start + low[0]) / 17)
    ctl.plan(low, ["a"], [sampling], COST, 1)
    assert ctl.prior_row(K) == pytest.approx((16 * start + 2 * low[0]) / 18)  # a plain mean of rows so far
    # prior_rows=0: the first row is the profile
    ctl = AdaptiveController(prior_decay=1 / 256)
    ctl.plan(low, ["a"], [sampling], COST, 1)
    assert ctl.prior_row(K) == pytest.approx(low[0])
    with pytest.raises(ValueError, match="prior_rows"):
        AdaptiveController(prior_rows=-1)


def test_the_mean_profile_weighs_steps_by_their_rows():
    """A step of R rows weighs max(R / rows seen, 1 - (1 - decay)^R): the plain mean of every row until
    ~1/decay rows are seen, then an average over about that many rows. So near-empty steps (a batch
    draining) move the profile a little and full steps a lot."""
    K, d = 3, 0.005
    ctl = AdaptiveController(prior_decay=d)
    hi, lo = geometric(1, K, 0.9)[0], geometric(1, K, 0.5)[0]
    ctl.plan(geometric(64, K, 0.9), list(range(64)), [False] * 64, COST, 64)
    ctl.plan(geometric(64, K, 0.9), list(range(64)), [False] * 64, COST, 64)
    assert ctl.prior_row(K) == pytest.approx(hi)
    ctl.plan(geometric(1, K, 0.5), ["slow"], [False], COST, 1)  # 129 rows seen: still their plain mean
    assert ctl.prior_row(K) == pytest.approx((128 * hi + lo) / 129)
    for _ in range(5):
        ctl.plan(geometric(1, K, 0.5), ["slow"], [False], COST, 1)
    assert ctl.prior_row(K) == pytest.approx((128 * hi + 6 * lo) / 134)  # 6 slow rows of 134: 4% of the way
    before = ctl.prior_row(K)
    for _ in range(4):
        ctl.plan(geometric(64, K, 0.5), list(range(64)), [False] * 64, COST, 64)
    w = 1 - (1 - d) ** 64  # past 1/d rows: a 64-row step weighs 1 - (1 - d)^64
    # the first of them still a share of the plain mean (64 / 198 > w), the rest w each
    assert ctl.prior_row(K) == pytest.approx(lo + (before - lo) * (1 - 64 / 198) * (1 - w) ** 3)


@SETTINGS
@given(st.data())
def test_the_small_path_plans_and_remembers_what_the_numpy_path_does(data):
    """Up to solver.SMALL_SLOTS slots the plan runs in pure Python, sampling requests (budget sized from
    their last rows or the prior) included: the same lengths, the same rows kept for the next step and the
    same mean profile as the numpy path, step after step."""
    fast, slow = AdaptiveController(prior_decay=0.2), AdaptiveController(prior_decay=0.2, small_slots=0)
    for step in range(4):
        R, K = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 7))
        S = data.draw(survival(R, K))
        caps = data.draw(st.one_of(st.none(), st.lists(st.integers(0, K), min_size=R, max_size=R)))
        ids = data.draw(st.lists(st.integers(0, 12), min_size=R, max_size=R, unique=True))
        sampling = data.draw(st.lists(st.booleans(), min_size=R, max_size=R))
        got = fast.plan(S, ids, sampling, COST, R, caps=caps)
        want = slow.plan(S, ids, sampling, COST, R, caps=caps)
        assert got.tolist() == want.tolist() and got.dtype == want.dtype
        for rid in ids:
            assert fast.previous_row(rid) == pytest.approx(slow.previous_row(rid), abs=1e-12)
        assert fast.prior_row(7) == pytest.approx(slow.prior_row(7), abs=1e-12)


def test_an_explicit_prior_and_a_change_of_draft_length_are_handled():
    ctl = AdaptiveController(prior_survival=[0.9, 0.8])
    assert ctl.prior_row(4) == pytest.approx([0.9, 0.8, 0.8 * 8 / 9, 0.8 * (8 / 9) ** 2])
    ctl.plan(geometric(1, 2, 0.9), ["a"], [True], COST, 1)
    lengths = ctl.plan(geometric(1, 5, 0.9), ["a"], [True], COST, 1)  # K grew: stale row is extended
    assert lengths.shape == (1,)


@SETTINGS
@given(st.data(), batch())
def test_when_sampling_the_budget_never_depends_on_the_sampled_requests_live_drafts(data, b):
    R, K, previous, sampling = b
    sampling[0] = True
    ctl = AdaptiveController()
    ids = [f"r{i}" for i in range(R)]
    ctl.plan(previous, ids, sampling, COST, R)
    live_a = data.draw(survival(R, K))
    live_b = live_a.copy()
    live_b[sampling] = data.draw(survival(int(sampling.sum()), K))  # other drafts for sampling requests
    plan_a = copy.deepcopy(ctl).plan(live_a, ids, sampling, COST, R)
    plan_b = copy.deepcopy(ctl).plan(live_b, ids, sampling, COST, R)
    assert plan_a.sum() == plan_b.sum()


@SETTINGS
@given(st.data(), batch(max_k=6))
def test_verifying_a_sampled_draft_token_never_depends_on_that_token(data, b):
    """End to end: S_{r,k+1..} are functions of x_k; changing them must not change whether slots 1..k
    of a sampling request r are verified (the stopping-rule condition for lossless sampling)."""
    R, K, previous, sampling = b
    r = data.draw(st.integers(0, R - 1))
    sampling[r] = True
    ids = list(range(R))
    ctl = AdaptiveController()
    ctl.plan(previous, ids, sampling, COST, R)
    live = data.draw(survival(R, K))
    k = data.draw(st.integers(0, K - 1))
    other = live.copy()
    other[r, k:] = (live[r, k - 1] if k else 1.0) * np.cumprod(data.draw(
        st.lists(st.floats(0.0, 1.0), min_size=K - k, max_size=K - k)))
    L1 = copy.deepcopy(ctl).plan(live, ids, sampling, COST, R)[r]
    L2 = copy.deepcopy(ctl).plan(other, ids, sampling, COST, R)[r]
    assert min(L1, k) == min(L2, k)


def test_greedy_rows_in_a_mixed_batch_size_the_budget_live():
    ctl = AdaptiveController()
    ctl.plan(geometric(2, 3, 0.5), ["g", "s"], [False, True], COST, 2)
    live = np.array([[0.99, 0.98, 0.97], [0.1, 0.05, 0.0]])
    lengths = ctl.plan(live, ["g", "s"], [False, True], COST, 2)
    sizing = np.vstack([live[0], geometric(1, 3, 0.5)])
    assert lengths.sum() == best_budget(sizing, COST.table, COST.draft)[0]


# ------------------------------------------------------------------------------------------- caps

@SETTINGS
@given(st.data(), batch())
def test_caps_are_respected(data, b):
    R, K, S, sampling = b
    caps = np.array(data.draw(st.lists(st.integers(0, K + 2), min_size=R, max_size=R)))
    ctl = AdaptiveController()
    for _ in range(2):
        lengths = ctl.plan(S, list(range(R)), sampling, COST, R, caps=caps)
        assert (lengths >= 0).all() and (lengths <= np.minimum(caps, K)).all()


def test_capped_requests_do_not_waste_the_budget():
    """Sizing sees the caps too: a request that can verify nothing gets no budget sized for it."""
    ctl = AdaptiveController()
    S = np.array([[0.99, 0.99, 0.99], [0.5, 0.4, 0.3]])
    ctl.plan(S, [1, 2], [True, True], COST, 2, caps=[0, 3])
    lengths = ctl.plan(S, [1, 2], [True, True], COST, 2, caps=[0, 3])
    assert lengths[0] == 0
    assert lengths.sum() == best_budget(S, COST.table, COST.draft, caps=[0, 3])[0]


def test_placeholders_past_a_cap_do_not_drag_down_next_steps_sizing():
    """A request that drafted 2 of 4 tokens (zero-padded, cap 2) is remembered as a continuation of its
    row, not as a request whose later drafts are certain to be rejected."""
    ctl = AdaptiveController(prior_decay=1.0)
    padded = np.array([[0.9, 0.81, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0]])
    ctl.plan(padded, ["a", "b"], [True, True], COST, 2, caps=[2, 0])
    assert ctl.previous_row("a") == pytest.approx([0.9, 0.81, 0.729, 0.6561])
    assert ctl.previous_row("b") == pytest.approx(0.7 ** np.arange(1, 5))  # nothing known: the prior
    assert ctl.prior_row(4)[2:] == pytest.approx((np.array([0.729, 0.6561]) + 0.7 ** np.arange(3, 5)) / 2)


def test_malformed_step_inputs_are_rejected():
    ctl, S = AdaptiveController(), geometric(2, 3, 0.5)
    with pytest.raises(ValueError, match="request ids"):
        ctl.plan(S, ["a"], [True, True], COST, 2)
    with pytest.raises(ValueError, match="unique"):
        ctl.plan(S, ["a", "a"], [True, True], COST, 2)
    with pytest.raises(ValueError, match="sampling_mask"):
        ctl.plan(S, ["a", "b"], [True], COST, 2)
    with pytest.raises(ValueError, match="caps"):
        ctl.plan(S, ["a", "b"], [True, True], COST, 2, caps=[1, -1])
    with pytest.raises(ValueError, match=r"\(R, K\)"):
        ctl.plan(S[0], ["a"], [True], COST, 1)


def test_works_with_a_profiled_cost_table_and_an_empty_batch():
    v = {t: [2.0 + 0.02 * t] for t in measurement_points(64)}
    table = CostTable.from_measurements(v, {b: [0.5 + 0.01 * b] for b in measurement_points(8)}, {})
    ctl = AdaptiveController()
    lengths = ctl.plan(geometric(8, 4, 0.8), list(range(8)), np.ones(8, bool), table, 8)
    assert lengths.shape == (8,) and lengths.sum() > 0
    assert ctl.plan(np.zeros((0, 4)), [], np.zeros(0, bool), table, 0).tolist() == []
