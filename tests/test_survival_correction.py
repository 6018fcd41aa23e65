"""Online recalibration of survivals: a spec for SurvivalCorrection (pure numpy, no models)."""

import numpy as np
import pytest

from dspark_trt.runtime.survival_correction import SurvivalCorrection, conditional


def simulate(corr, true_c, head_c, steps=400, requests=8, verify=4, seed=0):
    """Requests whose draft position k is accepted with probability true_c[k] (given the prefix) while
    the head claims head_c[k]; every request verifies `verify` drafts per step."""
    rng = np.random.default_rng(seed)
    k = len(true_c)
    raw = np.tile(np.cumprod(head_c), (requests, 1))
    for _ in range(steps):
        acc = rng.random((requests, k)) < np.asarray(true_c)[None, :]
        accepted = np.minimum(np.argmin(np.hstack([acc, np.zeros((requests, 1), bool)]), axis=1), verify)
        corr.observe(raw, np.full(requests, verify), accepted)
    return raw


def test_no_observations_is_identity():
    s = np.array([[0.9, 0.5, 0.2], [0.3, 0.1, 0.0]])
    assert np.array_equal(SurvivalCorrection(3).apply(s), s)


def test_underconfident_head_is_raised_to_the_observed_acceptance():
    corr = SurvivalCorrection(4)
    raw = simulate(corr, true_c=[0.9, 0.85, 0.8, 0.8], head_c=[0.6, 0.6, 0.5, 0.5])
    c = conditional(corr.apply(raw))[0]
    assert c == pytest.approx([0.9, 0.85, 0.8, 0.8], abs=0.05)


def test_overconfident_head_is_lowered():
    corr = SurvivalCorrection(3)
    raw = simulate(corr, true_c=[0.4, 0.3, 0.3], head_c=[0.9, 0.9, 0.9], verify=3)
    c = conditional(corr.apply(raw))[0]
    assert c[0] == pytest.approx(0.4, abs=0.05)
    assert c[1] == pytest.approx(0.3, abs=0.08)  # fewer reached samples: looser


def test_a_calibrated_head_is_left_alone():
    corr = SurvivalCorrection(3)
    raw = simulate(corr, true_c=[0.7, 0.7, 0.7], head_c=[0.7, 0.7, 0.7], verify=3)
    assert np.abs(corr.shift).max() < 0.25
    assert corr.apply(raw)[0] == pytest.approx(raw[0], abs=0.04)


def test_only_reached_positions_are_learned_from():
    corr = SurvivalCorrection(4)
    s = np.array([[0.5, 0.25, 0.125, 0.0625]])
    # Verified 3, first rejected: only position 1 was reached (a rejection there).
    assert corr.observe(s, [3], [0]) == 1
    assert corr.seen.tolist() == [1, 0, 0, 0]
    assert corr.shift[0] < 0 and (corr.shift[1:] == 0).all()
    # Verified 2, both accepted: positions 1 and 2 reached and accepted; position 3 not verified.
    assert corr.observe(s, [2], [2]) == 2
    assert corr.seen.tolist() == [2, 1, 0, 0]
    assert corr.accepted.tolist() == [1, 1, 0, 0]
    # Nothing verified: nothing learned.
    assert corr.observe(s, [0], [0]) == 0


def test_unverified_deep_positions_borrow_the_deepest_learned_shift():
    corr = SurvivalCorrection(5)
    raw = simulate(corr, true_c=[0.9, 0.9, 0.9, 0.9, 0.9], head_c=[0.5] * 5, verify=2)
    assert (corr.seen[2:] == 0).all()
    c = conditional(corr.apply(raw))[0]
    assert c[2:] == pytest.approx([c[1]] * 3)
    assert c[1] > 0.8


def test_corrected_rows_are_survivals():
    rng = np.random.default_rng(1)
    corr = SurvivalCorrection(6)
    corr.shift[:] = rng.normal(0, 2, 6)
    corr.seen[:] = 100
    raw = np.cumprod(rng.random((50, 6)), axis=1)
    raw[3, 2:] = 0.0
    out = corr.apply(raw)
    assert ((out >= 0) & (out <= 1)).all()
    assert (np.diff(out, axis=1) <= 1e-12).all()
    assert (out[3, 2:] == 0).all()  # a zero stays zero


def test_shift_is_bounded_and_warmup_delays_use():
    corr = SurvivalCorrection(2, bound=1.0, warmup=5)
    s = np.array([[0.01, 0.001]])
    for i in range(4):
        corr.observe(s, [1], [1])
        assert np.array_equal(corr.apply(s), s)  # learned, not used yet
    for _ in range(200):
        corr.observe(s, [1], [1])
    assert corr.shift[0] == pytest.approx(1.0)
    assert not np.array_equal(corr.apply(s), s)


def test_one_position_at_a_time_equals_the_whole_row():
    rng = np.random.default_rng(2)
    corr = SurvivalCorrection(5)
    corr.shift[:] = rng.normal(0, 1.5, 5)
    corr.seen[:3] = 100  # positions 4, 5 borrow position 3's shift
    raw = np.cumprod(rng.random((20, 5)), axis=1)
    raw[4, 3:] = 0.0
    want = corr.apply(raw)
    shifts = corr.active_shifts()
    for r in range(20):
        prev_raw, prev = 1.0, 1.0
        for k in range(5):
            prev = SurvivalCorrection.corrected_next(shifts, k, prev_raw, raw[r, k], prev)
            prev_raw = raw[r, k]
            assert prev == pytest.approx(want[r, k], rel=1e-9, abs=1e-12)
    assert SurvivalCorrection(3).active_shifts() is None  # nothing learned: survivals pass through
    assert SurvivalCorrection.corrected_next(None, 0, 1.0, 0.4, 1.0) == 0.4


# ------------------------------------------------------------------------------ drafters without a head

def _headless_steps(rng, steps, requests=16, K=4, slope=0.4, intercepts=(3.0, 2.6, 2.2, 1.8)):
    """Max probabilities of a draft without a head (tiny, a spread of logits around -5) whose true
    acceptance is sigmoid(a_k + slope * logit(q_max)): the raw cumprod of q_max is no survival at all."""
    for _ in range(steps):
        x = rng.normal(-5.0, 1.5, (requests, K))
        q = 1.0 / (1.0 + np.exp(-x))
        p = 1.0 / (1.0 + np.exp(-(np.asarray(intercepts)[None, :] + slope * x)))
        ok = rng.random((requests, K)) < p
        accepted = np.where(ok.all(axis=1), K, np.argmin(ok, axis=1))
        yield np.cumprod(q, axis=1), np.full(requests, K), accepted, p


def _ece(conf, outcome, bins=10):
    conf, outcome = np.asarray(conf), np.asarray(outcome, dtype=float)
    idx = np.minimum((conf * bins).astype(int), bins - 1)
    return sum(abs(conf[idx == b].mean() - outcome[idx == b].mean()) * (idx == b).mean()
               for b in range(bins) if (idx == b).any())


def _calibration(corr, rng, steps=600):
    """ECE of the corrected conditional confidences at the reached positions of fresh steps, raw ECE too."""
    fitted, raw, outcomes = [], [], []
    for s, L, a, _ in _headless_steps(rng, steps):
        c_fit, c_raw = conditional(corr.apply(s)), conditional(s)
        k = np.arange(s.shape[1])[None, :]
        reached = k < np.minimum(a + 1, L)[:, None]
        fitted += c_fit[reached].tolist()
        raw += c_raw[reached].tolist()
        outcomes += (k < a[:, None])[reached].tolist()
    return _ece(fitted, outcomes), _ece(raw, outcomes)


def test_without_a_head_the_slope_and_intercepts_make_max_probabilities_calibrated():
    rng = np.random.default_rng(52228)
    corr = SurvivalCorrection(4, fit_slope=True)
    for s, L, a, _ in _headless_steps(rng, 600):
        corr.observe(s, L, a)
    fitted, raw = _calibration(corr, rng)
    assert raw > 0.3 and fitted < 0.03
    assert 0.25 < corr.slope < 0.6  # the true slope is 0.4
    shift_only = SurvivalCorrection(4)  # a per-position shift alone (bounded): not enough here
    for s, L, a, _ in _headless_steps(np.random.default_rng(52228), 600):
        shift_only.observe(s, L, a)
    assert _calibration(shift_only, np.random.default_rng(1))[0] > 2 * fitted
    assert shift_only.slope == 1.0


def test_the_fitted_slope_keeps_rows_survivals_and_the_one_step_path_equal():
    rng = np.random.default_rng(4)
    corr = SurvivalCorrection(4, fit_slope=True)
    for s, L, a, _ in _headless_steps(rng, 100):
        corr.observe(s, L, a)
    assert corr.active_slope() == corr.slope != 1.0
    s = next(_headless_steps(rng, 1))[0]
    rows = corr.apply(s)
    assert (np.diff(rows, axis=1) <= 1e-12).all() and (rows >= 0).all() and (rows <= 1).all()
    shifts, slope = corr.active_shifts(), corr.active_slope()
    for r in range(s.shape[0]):
        prev_raw, prev_c, out = 1.0, 1.0, []
        for k in range(s.shape[1]):
            prev_c = SurvivalCorrection.corrected_next(shifts, k, prev_raw, float(s[r, k]), prev_c, slope)
            prev_raw = float(s[r, k])
            out.append(prev_c)
        np.testing.assert_allclose(out, rows[r], rtol=1e-9, atol=1e-12)
