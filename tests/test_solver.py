"""The budget solver: exact, prefix-shaped, cap-respecting, fast — and why live sizing is greedy-only."""

import itertools
import timeit

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_trt.runtime.solver import (best_budget, extend_linear, rows_valid, solve_budget, solve_budget_for_b,
                                       solve_small)

SETTINGS = settings(max_examples=100, deadline=None)  # exactness against brute force
FAST = settings(max_examples=50, deadline=None)  # behavioural properties

# Confidences include exact 0, 1 and repeated values, so ties and dead rows are exercised.
confidence = st.one_of(st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.floats(0.0, 1.0))


@st.composite
def survivals(draw, max_r=3, max_k=3, min_r=1, min_k=0):
    R = draw(st.integers(min_r, max_r))
    K = draw(st.integers(min_k, max_k))
    c = np.array(draw(st.lists(confidence, min_size=R * K, max_size=R * K)), dtype=np.float64).reshape(R, K)
    return np.cumprod(c, axis=1)


@st.composite
def monotone_costs(draw, max_len):
    """A non-decreasing verify curve, sometimes shorter than needed (exercises extrapolation)."""
    n = draw(st.integers(2, max_len))
    start = draw(st.floats(0.05, 10.0))
    steps = draw(st.lists(st.floats(0.0, 3.0), min_size=n - 1, max_size=n - 1))
    return np.concatenate([[start], start + np.cumsum(steps)])


def cost_at(table, t):
    """Reference extrapolation: linear from the last two points."""
    n = len(table)
    return table[t] if t < n else table[-1] + (t - (n - 1)) * (table[-1] - table[-2])


def objective(S, lengths, table, draft=0.0, n=None):
    R = S.shape[0]
    n = R if n is None else n
    gain = n + sum(S[r, :L].sum() for r, L in enumerate(lengths))
    return gain / (draft + cost_at(table, R + int(sum(lengths))))


def brute_force(S, table, draft=0.0, n=None, caps=None):
    """Best objective over ALL per-request prefix allocations (L_r in 0..min(K, cap_r))."""
    R, K = S.shape
    limits = [K if caps is None else min(K, caps[r]) for r in range(R)]
    return max(objective(S, L, table, draft, n) for L in itertools.product(*(range(m + 1) for m in limits)))


def assert_valid(lengths, S, caps=None):
    R, K = S.shape
    assert lengths.shape == (R,) and lengths.dtype.kind == "i"
    assert (lengths >= 0).all() and (lengths <= K).all()
    if caps is not None:
        assert (lengths <= np.asarray(caps)).all()


# ---------------------------------------------------------------------------------------- exactness

@SETTINGS
@given(data=st.data(), S=survivals(), draft=st.floats(0.0, 5.0))
def test_objective_equals_brute_force_optimum_over_all_prefix_allocations(data, S, draft):
    R, K = S.shape
    table = data.draw(monotone_costs(max_len=R * (K + 1) + 2))
    lengths = solve_budget(S, table, draft)
    B, obj = best_budget(S, table, draft)
    assert_valid(lengths, S)
    assert lengths.sum() == B
    best = brute_force(S, table, draft)
    assert objective(S, lengths, table, draft) == pytest.approx(best, rel=1e-9)
    assert obj == pytest.approx(best, rel=1e-9)


@SETTINGS
@given(data=st.data(), S=survivals(), n=st.floats(0.0, 4.0))
def test_exact_for_any_positive_cost_curve_and_any_emitting_count(data, S, n):
    """For a fixed B the top-B slots maximise the numerator, so exactness needs no cost convexity."""
    R, K = S.shape
    table = np.array(data.draw(st.lists(st.floats(0.1, 10.0), min_size=R * (K + 1) + 1,
                                        max_size=R * (K + 1) + 1)))
    lengths = solve_budget(S, table, n_emitting=n)
    assert objective(S, lengths, table, n=n) == pytest.approx(brute_force(S, table, n=n), rel=1e-9)


@SETTINGS
@given(data=st.data(), S=survivals(min_k=1))
def test_caps_are_an_allocation_constraint(data, S):
    R, K = S.shape
    caps = np.array(data.draw(st.lists(st.integers(0, K + 1), min_size=R, max_size=R)))
    table = data.draw(monotone_costs(max_len=R * (K + 1) + 2))
    draft = data.draw(st.floats(0.0, 5.0))
    lengths = solve_budget(S, table, draft, caps=caps)
    assert_valid(lengths, S, caps)
    assert objective(S, lengths, table, draft) == pytest.approx(brute_force(S, table, draft, caps=caps), rel=1e-9)
    # however large the given budget, a capped slot is never admitted
    assert_valid(solve_budget_for_b(S, R * K + 5, caps=caps), S, caps)


def test_caps_beat_a_dead_end_even_when_zero_survival_slots_would_tie():
    """Flat verify cost: zero-survival slots tie, capped slots must still never be admitted."""
    S = np.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert solve_budget_for_b(S, 6, caps=[1, 3]).tolist() == [1, 3]
    assert solve_budget(S, np.ones(20), caps=[1, 3]).tolist() == [1, 1]


# --------------------------------------------------------------------------------------- behaviour

def test_verifies_nothing_when_verification_is_very_expensive():
    S = np.full((4, 5), 0.99)
    table = 1.0 + 1000.0 * np.maximum(np.arange(40) - 4, 0)  # free up to the 4 bonus tokens, then ruinous
    assert solve_budget(S, table).tolist() == [0, 0, 0, 0]
    assert best_budget(S, table)[0] == 0


def test_verifies_every_draft_when_verification_is_free():
    S = np.cumprod(np.full((3, 4), 0.3), axis=1)  # weak drafts, but every one is worth something
    assert solve_budget(S, np.ones(2)).tolist() == [4, 4, 4]


def test_zero_survival_slots_are_not_verified_for_free_when_nothing_is_gained():
    """Among equal objectives the smallest budget wins."""
    S = np.array([[0.9, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert solve_budget(S, np.ones(10)).tolist() == [1, 0]


def test_ties_admit_earlier_positions_first_so_allocations_are_prefixes():
    S = np.ones((2, 3))
    assert solve_budget_for_b(S, 1).tolist() == [1, 0]
    assert solve_budget_for_b(S, 3).tolist() == [2, 1]
    assert solve_budget_for_b(S, 99).tolist() == [3, 3]
    assert solve_budget_for_b(S, -1).tolist() == [0, 0]


@FAST
@given(S=survivals(max_r=5, max_k=5), B=st.integers(0, 30))
def test_budget_for_b_admits_exactly_the_top_b_slots(S, B):
    R, K = S.shape
    lengths = solve_budget_for_b(S, B)
    assert_valid(lengths, S)
    assert lengths.sum() == min(B, R * K)
    admitted = np.arange(K)[None, :] < lengths[:, None]
    if admitted.any() and (~admitted).any():
        assert S[admitted].min() >= S[~admitted].max()


@FAST
@given(S=survivals(max_r=4, max_k=6), a=st.floats(0.0, 2.0), extra=st.floats(0.0, 2.0),
       c=st.floats(0.1, 5.0))
def test_steeper_verify_cost_never_verifies_more(S, a, extra, c):
    R, K = S.shape
    t = np.arange(R * (K + 1) + 1)
    cheap, steep = c + a * t, c + (a + extra) * t
    b_cheap, _ = best_budget(S, cheap)
    b_steep, obj_steep = best_budget(S, steep)
    # (allow a floating-point tie between the two budgets under the steep curve)
    assert b_steep <= b_cheap or obj_steep == pytest.approx(objective(S, solve_budget_for_b(S, b_cheap), steep))


@FAST
@given(S=survivals(max_r=4, max_k=6), a=st.floats(0.0, 2.0), c=st.floats(0.1, 5.0), extra=st.floats(0.0, 20.0))
def test_higher_fixed_step_overhead_never_verifies_less(S, a, c, extra):
    R, K = S.shape
    table = c + a * np.arange(R * (K + 1) + 1)
    b_low, _ = best_budget(S, table, draft_cost_ms=0.0)
    b_high, obj_high = best_budget(S, table, draft_cost_ms=extra)
    assert b_high >= b_low or obj_high == pytest.approx(
        objective(S, solve_budget_for_b(S, b_low), table, draft=extra))


def test_extrapolates_linearly_beyond_the_cost_table():
    S = np.cumprod(np.full((8, 4), 0.8), axis=1)
    full = 2.0 + 0.05 * np.arange(8 * 5 + 1)
    assert solve_budget(S, full[:2], 0.3).tolist() == solve_budget(S, full, 0.3).tolist()
    assert extend_linear([1.0, 2.0], [0, 1, 2, 5]).tolist() == [1.0, 2.0, 3.0, 6.0]


@SETTINGS
@given(data=st.data(), S=survivals(max_r=9, max_k=7, min_k=1), draft=st.floats(0.0, 5.0),
       n=st.one_of(st.none(), st.floats(0.0, 10.0)))
def test_the_pure_python_solver_gives_the_numpy_solvers_answer_exactly(data, S, draft, n):
    """solve_small is the numpy solver's twin for small matrices: the same lengths (not just an equally
    good allocation: the same ties broken the same way), with caps and with cost tables too short."""
    R, K = S.shape
    table = data.draw(monotone_costs(R * (K + 1) + 2))
    caps = data.draw(st.one_of(st.none(), st.lists(st.integers(0, K + 1), min_size=R, max_size=R)))
    rows = S.tolist()
    assert rows_valid(rows)
    B, lengths = solve_small(rows, caps, table, draft, n)
    assert lengths == solve_budget(S, table, draft, n, caps=caps).tolist()
    assert B == best_budget(S, table, draft, n, caps=caps)[0] == sum(lengths)


def test_the_pure_python_solver_leaves_bad_input_to_the_numpy_path():
    assert not rows_valid([[0.5, 0.6]]) and not rows_valid([[float("nan")]]) and not rows_valid([[1.2]])
    assert not rows_valid([[-0.1]]) and rows_valid([[1.0, 0.5, 0.5, 0.0]])
    assert solve_small([[0.5]], None, np.array([0.0, float("nan"), 1.0]), 0.0) is None  # numpy explains
    assert solve_small([[0.5]], None, np.array([1.0]), 0.0) is None  # too short to extrapolate
    assert solve_small([[0.5]], None, np.array([0.0, 1.0, 2.0]), float("inf")) is None
    assert solve_small([[0.5]], None, np.ones((3, 2)), 0.0) is None  # not a 1-D table


# ------------------------------------------------------------------------------------- losslessness

@FAST
@given(data=st.data(), S=survivals(max_r=4, max_k=5, min_k=2), B=st.integers(0, 20))
def test_with_b_fixed_admitting_x_k_ignores_every_later_slot_of_its_request(data, S, B):
    """S_{r,k+1..} are functions of x_k; changing them must not change whether slots 1..k are admitted."""
    R, K = S.shape
    r = data.draw(st.integers(0, R - 1))
    k = data.draw(st.integers(1, K - 1))  # positions 1..k are kept, k+1..K redrawn
    tail = np.array(data.draw(st.lists(confidence, min_size=K - k, max_size=K - k)))
    S2 = S.copy()
    S2[r, k:] = S[r, k - 1] * np.cumprod(tail)
    assert min(solve_budget_for_b(S, B)[r], k) == min(solve_budget_for_b(S2, B)[r], k)


def test_live_sizing_would_make_verifying_x1_depend_on_x1():
    """Why sampling needs stale sizing: with a step-shaped cost curve (tile quantisation), whether draft
    token 1 is verified at all depends on S_2 = c_1 * c_2, and c_2 is computed from x_1."""
    table = np.array([0.0, 1.0, 2.0, 2.0])  # 1 token: 1 ms; 2 or 3 tokens: 2 ms
    assert solve_budget([[0.9, 0.05]], table).tolist() == [0]  # x_1 drafted such that c_2 is low
    assert solve_budget([[0.9, 0.5]], table).tolist() == [2]  # ... or high: now x_1 is verified


# ------------------------------------------------------------------------------------------- inputs

def test_empty_batches_and_zero_draft_length():
    assert solve_budget(np.zeros((0, 4)), [1.0, 2.0]).tolist() == []
    assert best_budget(np.zeros((0, 4)), [1.0, 2.0]) == (0, 0.0)
    assert solve_budget(np.zeros((3, 0)), np.arange(1.0, 5.0)).tolist() == [0, 0, 0]
    assert solve_budget_for_b(np.zeros((3, 0)), 5).tolist() == [0, 0, 0]


def test_rises_within_float_tolerance_are_repaired_not_rejected():
    S = np.array([[0.5, 0.5 + 1e-7, 0.2]])
    assert solve_budget_for_b(S, 2).tolist() == [2]


@pytest.mark.parametrize("survival, match", [
    (np.array([0.9, 0.5]), "2-D"),
    (np.array([[0.5, 0.6]]), "non-increasing"),
    (np.array([[0.5, np.nan]]), "NaN"),
    (np.array([[np.nan]]), "NaN"),
    (np.array([[np.inf, 0.5]]), "NaN or infinite"),
    (np.array([[1.5, 0.5]]), r"\[0, 1\]"),
    (np.array([[0.5, -0.1]]), r"\[0, 1\]"),
])
def test_malformed_survivals_are_rejected_with_a_clear_message(survival, match):
    with pytest.raises(ValueError, match=match):
        solve_budget(survival, np.arange(1.0, 10.0))


def test_malformed_costs_and_caps_are_rejected():
    S = np.full((2, 2), 0.5)
    with pytest.raises(ValueError, match="at least 2 entries"):
        solve_budget(S, [1.0])
    with pytest.raises(ValueError, match="> 0"):
        solve_budget(S, np.zeros(10))
    with pytest.raises(ValueError, match="1-D"):
        solve_budget(S, np.ones((2, 5)))
    with pytest.raises(ValueError, match="NaN"):
        solve_budget(S, np.full(10, np.nan))
    with pytest.raises(ValueError, match="draft_cost_ms"):
        solve_budget(S, np.ones(10), draft_cost_ms=-1.0)
    with pytest.raises(ValueError, match="caps must have shape"):
        solve_budget(S, np.ones(10), caps=[1])
    with pytest.raises(ValueError, match=">= 0"):
        solve_budget(S, np.ones(10), caps=[1, -1])


def test_is_pure():
    S = np.cumprod(np.full((3, 3), 0.7), axis=1)
    table = np.linspace(1.0, 2.0, 13)
    S0, t0 = S.copy(), table.copy()
    first = solve_budget(S, table, 0.5)
    assert (solve_budget(S, table, 0.5) == first).all()
    assert (S == S0).all() and (table == t0).all()
    column = np.array([[-0.0], [0.5], [0.0]])  # one draft position: a transposed view is contiguous
    column.setflags(write=False)
    assert solve_budget_for_b(column, 1).tolist() == [0, 1, 0]
    assert np.signbit(column[0, 0])  # untouched


# -------------------------------------------------------------------------------------------- speed

def test_solver_time_for_64_requests_and_8_drafts():
    rng = np.random.default_rng(0)
    S = np.cumprod(rng.uniform(0.3, 1.0, (64, 8)), axis=1)
    table = 5.0 + 0.01 * np.arange(64 * 9 + 1)
    solve_budget(S, table, 0.5)
    runs = np.array(timeit.repeat(lambda: solve_budget(S, table, 0.5), number=200, repeat=7)) / 200
    print(f"\nsolve_budget R=64 K=8: median {np.median(runs) * 1e6:.1f} us, best {runs.min() * 1e6:.1f} us")
    assert np.median(runs) < 1e-3  # generous: this is a smoke bound, real figures come from benchmarks
