"""The call-shape cost model (runtime/call_shape.py) and the depth cap it drives (solver.cap_depth)."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_trt.runtime.costs.call_shape import CallShapeCost, features, fit_nonnegative, packed_shape
from dspark_trt.runtime.costs.table import CostTable
from dspark_trt.runtime.solver import cap_depth
from dspark_trt.runtime.tuning import DriftTuning

# Roughly what the tiny pair measures on this CPU: 6 ms a call, 0.3 ms a token, 0.3 ms per 100 past
# positions per row, 0.2 ms per 1000 padded attention entries.
MEASURED = np.array([6.0, 0.3, 0.3, 0.2])


def shapes():
    out = []
    for past in (32, 192):
        for rows in (1, 4, 16, 64):
            for q in ([1] * rows, [3] * rows, [8] * rows, [8] + [1] * (rows - 1), [32] + [1] * (rows - 1)):
                out.append(packed_shape(q, [past] * rows))
    return np.array(out, dtype=np.float64)


def test_fit_recovers_the_coefficients_of_noiseless_calls():
    x = shapes()
    ms = features(*x.T) @ MEASURED
    model = CallShapeCost.from_points(np.column_stack([x, ms]))
    np.testing.assert_allclose(model.coef, MEASURED, rtol=1e-6)
    assert model.ms(40, 16, 8, 100) == pytest.approx(float(features(40, 16, 8, 100) @ MEASURED))


def test_fit_never_returns_a_negative_coefficient():
    x = features(*shapes().T)
    y = x @ np.array([6.0, 0.3, -0.2, 0.2])  # a negative true term: the best feasible fit drops it
    c = fit_nonnegative(x, y)
    assert (c >= 0).all() and c[2] == 0
    unconstrained, *_ = np.linalg.lstsq(x, y, rcond=None)
    assert np.sum((x @ c - y) ** 2) >= np.sum((x @ unconstrained - y) ** 2) - 1e-9


def test_a_prompt_chunk_among_many_decode_rows_costs_more_mixed_than_in_its_own_call():
    m = CallShapeCost(MEASURED)
    decode, prompt = [1] * 32, [40]
    mixed = m.ms(*packed_shape(decode + prompt, [150] * 33))
    split = m.ms(*packed_shape(decode, [150] * 32)) + m.ms(*packed_shape(prompt, [0]))
    assert split < mixed
    # ... while next to a single decode row, one call is cheaper than two.
    one = m.ms(*packed_shape([1] + prompt, [150, 0]))
    assert one < m.ms(*packed_shape([1], [150])) + m.ms(*packed_shape(prompt, [0]))


def test_drift_follows_a_uniform_slowdown_and_is_bounded():
    m = CallShapeCost(MEASURED)
    base = m.ms(64, 32, 2, 100)
    for _ in range(300):
        m.observe(64, 32, 2, 100, 1.5 * base)
    assert m.ms(64, 32, 2, 100) == pytest.approx(1.5 * base, rel=1e-3)
    assert m.ms(8, 8, 1, 50) / float(features(8, 8, 1, 50) @ MEASURED) == pytest.approx(1.5, rel=1e-3)
    for _ in range(300):
        m.observe(64, 32, 2, 100, 1000 * base)
    assert m.ms(64, 32, 2, 100) == pytest.approx(DriftTuning.bound_high * base, rel=1e-3)
    m.observe(64, 32, 2, 100, float("nan"))  # ignored
    assert np.isfinite(m.ms(64, 32, 2, 100))


def test_drift_is_learned_per_call_width():
    """Many small calls running as predicted must not hide that 64-row calls run 30% slower: each width
    (rows, nearest power of two) has its own factor; a width never observed takes the global one."""
    m = CallShapeCost(MEASURED)
    wide, narrow, unseen = m.ms(64, 64, 1, 100), m.ms(8, 2, 4, 60), m.ms(16, 16, 1, 100)
    for i in range(1000):
        if i % 5 == 0:
            m.observe(64, 64, 1, 100, 1.3 * wide)
        else:
            m.observe(8, 2, 4, 60, narrow)
    assert m.ms(64, 64, 1, 100) == pytest.approx(1.3 * wide, rel=1e-3)
    assert m.ms(60, 60, 1, 100) / float(features(60, 60, 1, 100) @ MEASURED) == pytest.approx(1.3, rel=1e-3)
    assert m.ms(8, 2, 4, 60) == pytest.approx(narrow, rel=1e-3)
    assert 1.0 < m.ms(16, 16, 1, 100) / unseen < 1.3  # unseen width: the global factor, a blend


def _true_ms(tokens, rows, longest, past):
    return float(features(tokens, rows, longest, past) @ MEASURED)


def _run_calls(model, n, rng, rows=16, level=1.3):
    """n verify calls of one width, each a random depth and past, at `level` x the true cost (+-5% noise)."""
    for _ in range(n):
        q, past = int(rng.integers(1, 9)), int(rng.integers(64, 320))
        model.observe(rows * q, rows, q, past, level * _true_ms(rows * q, rows, q, past) * rng.lognormal(0, 0.05))


@pytest.mark.parametrize("refit", [True, False])
def test_a_flat_profile_learns_from_its_calls_that_deeper_verification_costs_more(refit):
    """A profile recorded flat (every call as dear as a plain step: extra verified tokens look free): a
    width's plain and verify calls get a level each, but the verify depths keep the flat slope; calls of
    different depths disagreeing with it trigger refits that learn the slope."""
    x = shapes()
    flat = CallShapeCost.from_points(np.column_stack([x, np.full(len(x), _true_ms(16, 16, 1, 200))]))
    if not refit:
        flat.refit_every = 0
    _run_calls(flat, 512, np.random.default_rng(0))
    plain, deep = flat.ms(16, 16, 1, 200), flat.ms(128, 16, 8, 200)
    if refit:
        assert 4 <= flat.refits <= 8
        assert plain == pytest.approx(1.3 * _true_ms(16, 16, 1, 200), rel=0.15)
        assert deep == pytest.approx(1.3 * _true_ms(128, 16, 8, 200), rel=0.15)
        assert flat.ms(512, 16, 32, 200) > 0.5 * _true_ms(512, 16, 32, 200)  # a depth it never ran, too
    else:  # plain and verify calls get a level each, but every verify depth the one flat slope
        assert plain == pytest.approx(1.3 * _true_ms(16, 16, 1, 200), rel=0.25)
        assert flat.ms(128, 16, 8, 200) / flat.ms(32, 16, 2, 200) == pytest.approx(1.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_model_that_is_right_stays_right_through_windows_of_noisy_calls(seed):
    """Calls at 1-64 rows whose times are the model's with 15% noise and a +-30% machine drift: windows
    whose depths look apart by chance refit now and then, but the coefficients do not wander (they fell to
    half over one bench run, and to 0.003 and 0 over a few)."""
    right = np.array([1.71, 0.072, 0.054, 0.107])
    m = CallShapeCost(right.copy())
    rng = np.random.default_rng(seed)
    for i in range(64 * 80):
        rows = int(rng.choice([1, 1, 1, 16, 64]))
        q = int(rng.choice([1, 2, 4, 8])) if rows == 1 else int(rng.choice([1, 3, 5]))
        past = 40 + (i % 64) * 2
        drift = 1.0 + 0.3 * np.sin(i / 50)
        m.observe(rows * q, rows, q, past, float(features(rows * q, rows, q, past) @ right) * rng.lognormal(0, 0.15) * drift)
    assert m.refits <= 10
    np.testing.assert_allclose(m.coef, right, rtol=0.1)


def test_refits_leave_the_padded_attention_cost_of_a_prompt_chunk_among_decode_rows_as_profiled():
    """A running batch: decode and verify calls (depth 1-8) of 8-64 rows whose past grows within each window
    while the machine speeds up (level 1.4 -> 0.7). Refits may follow the depth slope, but a 256-token prompt
    chunk among 57 decode rows stays priced far above a call of its own: packed, it took 1-2.7 s a step."""
    m = CallShapeCost(MEASURED)
    rng = np.random.default_rng(3)
    for i in range(64 * 40):
        level = 1.4 - 0.7 * (i % 64) / 63
        rows, past = int(rng.choice([8, 16, 32, 64])), 100 + 10 * (i % 64)
        q = [int(rng.integers(1, 9))] + [int(rng.integers(1, 3))] * (rows - 1)
        shape = packed_shape(q, [past] * rows)
        m.observe(*shape, level * _true_ms(*shape) * rng.lognormal(0, 0.05))
    assert m.refits > 0
    assert m.coef[3] == MEASURED[3]
    decode, prompt = [1] * 57, [256]
    mixed = m.ms(*packed_shape(decode + prompt, [600] * 57 + [0]))
    split = m.ms(*packed_shape(decode, [600] * 57)) + m.ms(*packed_shape(prompt, [0]))
    assert mixed > 5 * split


def _mixed_and_split(m, decode=57, chunk=256, past=600):
    d, c = [1] * decode, [chunk]
    mixed = m.ms(*packed_shape(d + c, [past] * decode + [0]), chunk=True)
    return mixed, m.ms(*packed_shape(d, [past] * decode)) + m.ms(*packed_shape(c, [0]))


def test_a_flat_profile_learns_what_packing_a_prompt_chunk_among_decode_rows_costs_from_one_such_call():
    """A profile recorded flat prices padding at 0, so packing a prompt chunk into the decode call looks
    free; packed, it took 4x `off`'s step time at 64 requests. One such call, observed at its true cost,
    raises the padding price of such calls (halfway) until the model splits; cheaper packed calls never
    lower it, decode calls never touch it, and it prices nothing else: the verify depth's padding stays
    the profile's (raised for every call, it priced deeper verification 3.5x too dear)."""
    x = shapes()
    flat = CallShapeCost.from_points(np.column_stack([x, np.full(len(x), _true_ms(16, 16, 1, 200))]))
    assert flat.coef[3] < 1e-9
    mixed, split = _mixed_and_split(flat)
    assert mixed <= split  # the flat model packs
    for q in ([1] * 64, [8] + [1] * 63, [4] * 32):  # decode and verify calls leave it alone
        flat.observe(*packed_shape(q, [300] * len(q)), 10 * _true_ms(*packed_shape(q, [300] * len(q))))
    assert flat.chunk_padding == 0 and flat.padding_raises == 0
    uneven = packed_shape([8] + [1] * 31, [300] * 32)
    before = flat.ms(*uneven)
    shape = packed_shape([1] * 57 + [256], [600] * 57 + [0])
    flat.observe(*shape, _true_ms(*shape), chunk_among_rows=True)
    assert flat.padding_raises == 1 and 0 < flat.chunk_padding < MEASURED[3]
    mixed, split = _mixed_and_split(flat)
    assert mixed > 5 * split
    assert flat.ms(*uneven) == pytest.approx(before, rel=0.05)  # the verify depth is priced as before
    raised = flat.chunk_padding
    flat.observe(*shape, 0.1 * _true_ms(*shape), chunk_among_rows=True)  # only ever up
    assert flat.chunk_padding == raised
    right = CallShapeCost(MEASURED)  # a model that prices it right is not moved by such calls
    right.observe(*shape, _true_ms(*shape), chunk_among_rows=True)
    assert right.padding_raises == 0 and right.coef[3] == MEASURED[3]


def test_a_right_shape_is_not_refitted_and_the_drift_keeps_the_level():
    """Calls of every depth off the model by the same factor (plus noise): nothing for a refit to fix."""
    m = CallShapeCost(MEASURED)
    _run_calls(m, 512, np.random.default_rng(1))
    assert m.refits == 0
    np.testing.assert_array_equal(m.coef, MEASURED)
    for q in (1, 4, 8):
        assert m.ms(16 * q, 16, q, 200) == pytest.approx(1.3 * _true_ms(16 * q, 16, q, 200), rel=0.05)


@pytest.mark.parametrize("coef", [[0, 0, 0, 0], [1, -1, 0, 0], [1, 2, 3], [np.nan, 1, 1, 1]])
def test_bad_coefficients_are_refused(coef):
    with pytest.raises(ValueError):
        CallShapeCost(coef)


def test_cost_table_keeps_the_measured_shapes_through_save_and_load(tmp_path):
    x = shapes()
    pts = np.column_stack([x, features(*x.T) @ MEASURED]).tolist()
    table = CostTable.from_measurements({1: [5.0], 8: [9.0]}, {1: [1.0], 4: [2.0]}, {"backend": "ort"}, shape_points=pts)
    loaded = CostTable.load(table.save(tmp_path / "p.json"), expect={"backend": "ort"})
    np.testing.assert_allclose(loaded.call_shape.coef, MEASURED, rtol=1e-6)
    assert CostTable.from_measurements({1: [5.0]}, {1: [1.0]}).call_shape is None  # old profiles: token table only


def test_a_malformed_shape_list_is_a_one_line_error(tmp_path):
    import json

    from dspark_trt.errors import DsparkError

    table = CostTable.from_measurements({1: [5.0], 8: [9.0]}, {1: [1.0]}, {"backend": "ort"})
    d = table.to_dict()
    d["points"]["verify_shapes"] = [[1, 2, 3]]
    (tmp_path / "p.json").write_text(json.dumps(d))
    with pytest.raises(DsparkError, match="malformed.*dspark-trt profile"):
        CostTable.load(tmp_path / "p.json")


# ------------------------------------------------------------------------------------- depth cap

def padded_call(rows: int, per_token: float, per_depth: float):
    """Verify call time: tokens cost per_token each; every extra unit of the longest row's depth costs
    per_depth for each of `rows` rows (padding)."""
    return lambda extra, depth: 10.0 + per_token * extra + per_depth * rows * depth


def test_without_a_padding_cost_the_solver_lengths_stand():
    S = np.array([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]] + [[0.9, 0.1, 0, 0, 0, 0, 0]] * 15)
    L = np.array([7] + [1] * 15)
    assert cap_depth(L, S, padded_call(16, 0.01, 0.0), fixed_ms=2.0, base_gain=16) == 7


def test_one_deep_request_among_many_shallow_ones_is_capped_when_padding_is_dear():
    S = np.array([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]] + [[0.9, 0.1, 0, 0, 0, 0, 0]] * 31)
    L = np.array([7] + [1] * 31)
    d = cap_depth(L, S, padded_call(32, 0.01, 0.05), fixed_ms=2.0, base_gain=32)
    assert 1 <= d < 7
    # Requests that all verify deep and are mostly accepted are worth their padding: nothing is capped.
    deep = np.tile([0.95, 0.93, 0.91, 0.9, 0.89, 0.88, 0.87], (32, 1))
    assert cap_depth(np.full(32, 7), deep, padded_call(32, 0.01, 0.05), fixed_ms=2.0, base_gain=32) == 7


def test_nothing_admitted_means_no_depth():
    assert cap_depth(np.zeros(4, dtype=int), np.ones((4, 3)), padded_call(4, 1.0, 1.0)) == 0


def test_table_agrees_with_single_calls_at_every_past_and_after_the_model_moves():
    """The table is asked every step with the step's past: whatever it keeps between steps, it says what
    single calls say, at any past, after a level moved and after a refit replaced the coefficients."""
    m = CallShapeCost(MEASURED)
    t, longest = np.arange(1, 40, dtype=float), np.ceil(np.arange(1, 40, dtype=float) / 5)  # both rising

    def agrees():
        for past in (0, 120, 500):
            np.testing.assert_allclose(m.table(t, 16, longest, past),
                                       [m.ms(int(a), 16, int(b), past) for a, b in zip(t, longest)], rtol=1e-12)

    agrees()
    m.observe(64, 16, 2, 100, 80.0)
    agrees()
    m.coef = MEASURED * np.array([1.0, 2.0, 1.0, 3.0])  # as a refit does: new coefficients
    agrees()


def test_a_kinds_profile_offset_is_the_nearest_measured_widths_and_stays_so():
    # Plain calls measured 0.65x the fit at every width, verify calls as fitted (ONNX Runtime's decode graph).
    x = shapes()
    ms = (features(*x.T) @ MEASURED) * np.where(x[:, 2] > 1, 1.0, 0.65)
    model = CallShapeCost.from_points(np.column_stack([x, ms]))
    for w in range(0, 9):  # widths 1..256 rows; measured: 1, 4, 16, 64 (buckets 0, 2, 4, 6)
        for verifies in (False, True):
            near = CallShapeCost._nearest(model.profile_offset, w, verifies)
            assert model._offset(w, verifies) == model.profile_offset[near]  # asked again: the same
            assert model._offset(w, verifies) == model.profile_offset[near]
    # one fit over both kinds sits between them: the offsets carry the difference, beyond the widest width too
    assert all(model._offset(w, True) - model._offset(w, False) > 0.25 for w in range(0, 9))
