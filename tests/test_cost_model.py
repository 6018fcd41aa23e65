"""The cost model: a monotone fit of profiled step times, keyed to its artifact, that follows drift."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_trt.errors import DsparkError
from dspark_trt.runtime.costs.measure import profile_points
from dspark_trt.runtime.costs.table import CostTable, isotonic_increasing, measurement_points
from dspark_trt.runtime.solver import solve_budget

META = {"backend": "trt", "files": {"target.onnx": "ab" * 32, "draft.onnx": "cd" * 32}}


def linear_verify(t):
    return 2.0 + 0.01 * t


def linear_draft(b):
    return 1.0 + 0.005 * b


def make_table(max_tokens=256, max_batch=64, **kw):
    v = {t: [linear_verify(t)] * 3 for t in measurement_points(max_tokens)}
    d = {b: [linear_draft(b)] * 3 for b in measurement_points(max_batch)}
    return CostTable.from_measurements(v, d, META, **kw)


def is_monotone(table):
    return bool((np.diff(table) >= 0).all())


# -------------------------------------------------------------------------------------------- fit

def test_measurement_points_cover_one_to_max_at_two_per_octave():
    assert measurement_points(1) == [1]
    assert measurement_points(10) == [1, 2, 3, 4, 6, 8, 10]
    assert measurement_points(64) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]


def test_linear_costs_are_reproduced_at_every_integer_and_extrapolated_linearly():
    table = make_table()
    t = np.arange(1, 257)
    assert table.verify_table()[1:] == pytest.approx(linear_verify(t))
    assert table.verify_ms(1000) == pytest.approx(linear_verify(1000))
    assert table.draft_ms(np.array([1, 5, 64, 200])) == pytest.approx(linear_draft(np.array([1, 5, 64, 200])))
    assert table.verify_ms(0) == 0.0 and table.draft_ms(0) == 0.0  # index 0: no step at all
    assert table.max_tokens == 256 and table.max_batch == 64


def test_median_of_repeats_ignores_a_stray_slow_run():
    table = CostTable.from_measurements({1: [1.0, 1.1, 50.0], 4: [2.0, 2.0, 2.1]}, {1: [1.0]}, META)
    assert table.verify_ms(1) == pytest.approx(1.1)
    assert table.verify_ms(4) == pytest.approx(2.0)


def test_a_slow_median_is_pooled_locally_not_propagated_to_every_larger_size():
    """Isotonic regression, not a running max: one bump must not raise the whole upper range."""
    pts = {t: [linear_verify(t)] for t in measurement_points(256)}
    pts[8] = [linear_verify(64)]  # point 8 measured as slow as point 64
    table = CostTable.from_measurements(pts, {1: [1.0]}, META).verify_table()
    assert is_monotone(table)
    assert table[128] == pytest.approx(linear_verify(128))
    assert table[256] == pytest.approx(linear_verify(256))
    assert table[8] < linear_verify(64)  # pooled with its neighbours


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.1, 100.0), min_size=1, max_size=12), st.data())
def test_any_noisy_profile_gives_non_decreasing_tables(medians, data):
    xs = sorted(data.draw(st.sets(st.integers(1, 300), min_size=len(medians), max_size=len(medians))))
    table = CostTable.from_measurements({x: [m] for x, m in zip(xs, medians)}, {1: [1.0], 3: [0.5]}, META)
    assert is_monotone(table.verify_table()) and is_monotone(table.draft_table())
    assert (table.verify_table()[1:] > 0).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-10.0, 10.0), min_size=1, max_size=15),
       st.lists(st.floats(0.5, 3.0), min_size=15, max_size=15))
def test_isotonic_fit_is_monotone_and_keeps_the_weighted_mean(y, w):
    y, w = np.array(y), np.array(w[: len(y)])
    fit = isotonic_increasing(y, w)
    assert (np.diff(fit) >= -1e-12).all()
    assert (fit * w).sum() == pytest.approx((y * w).sum(), abs=1e-6)
    if (np.diff(y) >= 0).all():
        assert fit == pytest.approx(y)


@pytest.mark.parametrize("verify, match", [
    ({}, "no verify measurements"),
    ({0: [1.0]}, "integers >= 1"),
    ({1: [float("nan")]}, "finite positive"),
    ({1: [-1.0]}, "finite positive"),
    ({1: []}, "finite positive"),
])
def test_bad_measurements_are_rejected(verify, match):
    with pytest.raises(ValueError, match=match):
        CostTable.from_measurements(verify, {1: [1.0]}, META)


def test_the_solver_consumes_the_table_directly():
    table = make_table()
    S = np.cumprod(np.full((8, 4), 0.8), axis=1)
    lengths = solve_budget(S, table.verify_table(), table.draft_ms(8))
    assert lengths.shape == (8,) and lengths.sum() > 0


# ------------------------------------------------------------------------------------ persistence

def test_save_load_round_trip_keyed_to_the_artifact(tmp_path):
    table = make_table()
    path = table.save(tmp_path)
    assert path.name == "cost_profile.json"
    loaded = CostTable.load(tmp_path, expect={"backend": "trt", "files": dict(META["files"])})
    assert (loaded.verify_table() == table.verify_table()).all()
    assert (loaded.draft_table() == table.draft_table()).all()
    assert loaded.meta == META
    assert loaded.points["verify_median"]["4"] == pytest.approx(linear_verify(4))


def test_a_profile_of_another_artifact_or_backend_is_refused_with_the_fix(tmp_path):
    make_table().save(tmp_path / "cost_profile.json")
    other_files = {"backend": "trt", "files": {**META["files"], "target.onnx": "ee" * 32}}
    with pytest.raises(DsparkError, match=r"re-run `dspark-trt profile .* --backend trt`") as e:
        CostTable.load(tmp_path / "cost_profile.json", expect=other_files)
    assert "files" in str(e.value)
    with pytest.raises(DsparkError, match=r"differs in: backend.*--backend ort"):
        CostTable.load(tmp_path, expect={**META, "backend": "ort"})


def test_missing_or_corrupt_profiles_say_how_to_recreate_them(tmp_path):
    with pytest.raises(DsparkError, match="no cost profile.*dspark-trt profile"):
        CostTable.load(tmp_path, expect=META)
    (tmp_path / "cost_profile.json").write_text("{not json")
    with pytest.raises(DsparkError, match="unreadable.*dspark-trt profile"):
        CostTable.load(tmp_path, expect=META)
    (tmp_path / "cost_profile.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(DsparkError, match="not a version-1"):
        CostTable.load(tmp_path)


# ------------------------------------------------------------------------------------------ drift

def test_a_uniformly_30_percent_slower_machine_is_tracked_within_5_percent_after_30_steps():
    rng = np.random.default_rng(0)
    table = make_table()
    truth = 1.3 * table.verify_table(corrected=False)
    for _ in range(30):  # observations at sizes spread over the whole range
        t = int(rng.integers(1, 257))
        table.observe_verify(t, truth[t])
    assert table.verify_table()[1:] / truth[1:] == pytest.approx(1.0, rel=0.05)
    assert table.drift()["verify"]["global"] == pytest.approx(1.3, rel=0.05)
    assert table.drift()["verify"]["observations"] == 30


def test_a_slowdown_seen_at_one_size_shifts_the_whole_curve():
    table = make_table()
    for _ in range(30):
        table.observe_verify(96, 1.3 * linear_verify(96))
    ratio = table.verify_table()[1:] / table.verify_table(corrected=False)[1:]
    assert ratio == pytest.approx(1.3, rel=0.05)


def test_draft_costs_drift_independently():
    table = make_table()
    for _ in range(30):
        table.observe_draft(16, 0.8 * linear_draft(16))
    assert table.draft_ms(16) == pytest.approx(0.8 * linear_draft(16), rel=0.05)
    assert table.verify_ms(16) == pytest.approx(linear_verify(16))
    assert table.drift()["verify"]["observations"] == 0


def test_noise_never_breaks_monotonicity_and_averages_out():
    rng = np.random.default_rng(1)
    table = make_table()
    base = table.verify_table(corrected=False)
    for _ in range(300):
        t = int(rng.integers(1, 257))
        table.observe_verify(t, base[t] * math.exp(rng.normal(0.0, 0.3)))
        assert is_monotone(table.verify_table())
    assert table.verify_table()[1:] / base[1:] == pytest.approx(1.0, rel=0.15)


def test_a_single_10x_spike_moves_the_table_by_a_bounded_amount():
    table = make_table(max_step=0.06)
    rng = np.random.default_rng(2)
    for _ in range(50):  # a settled, slightly slow machine
        t = int(rng.integers(1, 257))
        table.observe_verify(t, 1.1 * linear_verify(t))
    before = table.verify_table().copy()
    table.observe_verify(64, 10 * linear_verify(64))
    after = table.verify_table()
    assert (after / np.maximum(before, 1e-12))[1:].max() <= math.exp(0.06) + 1e-9
    assert is_monotone(after)


def test_correction_is_bounded_and_resettable():
    table = make_table(bounds=(0.5, 2.0))
    for _ in range(500):
        table.observe_verify(32, 100 * linear_verify(32))
    assert table.verify_ms(32) == pytest.approx(2.0 * linear_verify(32))
    table.reset_drift()
    assert table.verify_ms(32) == pytest.approx(linear_verify(32))
    assert table.drift()["verify"] == {"global": 1.0, "observations": 0, "by_size": {}}


def test_unusable_observations_are_ignored():
    table = make_table()
    assert not table.observe_verify(8, float("nan"))
    assert not table.observe_verify(8, 0.0)
    assert not table.observe_verify(0, 1.0)
    assert table.observe_verify(8, 1.0)
    assert table.drift()["verify"]["observations"] == 1


def test_the_corrected_table_is_read_only():
    table = make_table()
    with pytest.raises(ValueError):
        table.verify_table()[3] = 0.0


# ---------------------------------------------------------------------------------------- profile

def test_profile_points_drives_the_callables_round_robin_and_feeds_the_fit():
    calls = []

    def measure_verify(t):
        calls.append(("v", t))
        return linear_verify(t)

    def measure_draft(b):
        calls.append(("d", b))
        return linear_draft(b)

    verify, draft = profile_points(measure_verify, measure_draft, max_tokens=32, max_batch=8, repeats=3,
                                   progress=False, warmup=1)
    assert sorted(verify) == measurement_points(32) and sorted(draft) == measurement_points(8)
    assert all(len(v) == 3 for v in [*verify.values(), *draft.values()])
    per_round = len(verify) + len(draft)
    assert len(calls) == 4 * per_round  # 1 warmup + 3 repeats
    assert calls[:per_round] == calls[per_round: 2 * per_round]  # round-robin over all points
    table = CostTable.from_measurements(verify, draft, META)
    assert table.verify_ms(20) == pytest.approx(linear_verify(20))


def test_profile_points_shows_progress_and_rejects_nonsense_timings():
    verify, _ = profile_points(linear_verify, linear_draft, 4, 2, repeats=1, progress=True)
    assert sorted(verify) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"measure_draft\(1\) returned"):
        profile_points(linear_verify, lambda b: float("nan"), 4, 2, repeats=1, progress=False)


def test_a_profile_3x_off_is_replaced_after_a_few_calls_that_all_disagree():
    """Walking towards a 3x error at max_step per call would take ~40 calls; catch_up calls in a row that
    each disagree by more than refine_margin on the same side move the table to their median at once."""
    from dspark_trt.runtime.tuning import DriftTuning

    n = DriftTuning().catch_up
    table = make_table().tune(DriftTuning())
    for i in range(n):
        table.observe_draft(16, linear_draft(16) / 3)
        if i < n - 1:
            assert table.drift()["draft"]["global"] > 0.8  # bounded steps until the streak is complete
    assert table.draft_ms(16) == pytest.approx(linear_draft(16) / 3, rel=0.05)
    assert table.draft_ms(48) == pytest.approx(linear_draft(48) / 3, rel=0.05)


def test_a_run_of_calls_broken_by_one_agreeing_call_does_not_jump():
    from dspark_trt.runtime.tuning import DriftTuning

    n = DriftTuning().catch_up
    table = make_table().tune(DriftTuning())
    for i in range(4 * n):
        slow = i % n != n - 1  # every n-th call agrees with the profile
        table.observe_verify(64, (2.0 if slow else 1.0) * linear_verify(64))
    assert table.drift()["verify"]["global"] < 1.0 + 4 * n * 0.03


# -------------------------------------------------------------------------------------- draft past

def past_table(tmp_path=None):
    """Draft calls timed at past 128 and 1016: 1 row barely grows, 16 rows by half, 64 rows nearly double
    (the tiny pair measured 0.24 -> 0.26, 1.07 -> 1.67 and 3.36 -> 6.16 ms at past 128 -> 900)."""
    from dspark_trt.runtime.costs.draft_past import DraftPast

    pairs = DraftPast.points(128, 1016, [1, 16, 64], [1.0, 1.08, 1.32], [1.05, 1.62, 2.64])
    return make_table(draft_past=pairs)


def test_a_draft_call_is_priced_at_its_past_by_the_growth_measured_at_a_long_past():
    table = past_table()
    at = table.draft_ms
    assert at(64, past=128) == pytest.approx(at(64)) == pytest.approx(linear_draft(64))
    assert at(64, past=1016) == pytest.approx(2.0 * linear_draft(64))  # 1.32 -> 2.64: twice
    assert at(64, past=572) == pytest.approx(1.5 * linear_draft(64))  # linear in the past
    assert at(1, past=1016) == pytest.approx(1.05 * linear_draft(1))
    growth = [at(b, past=1016) / at(b) for b in (1, 16, 64)]
    assert growth == pytest.approx([1.05, 1.5, 2.0])  # measured at these sizes, interpolated in between
    assert growth[1] < at(32, past=1016) / at(32) < growth[2]
    assert at(64, past=0) >= 0.5 * at(64)  # shorter than the profile's past: cheaper, within reason
    assert make_table().draft_ms(64, past=1016) == pytest.approx(linear_draft(64))  # a profile without it


def test_the_drift_learns_draft_calls_at_long_pasts_as_the_level_at_the_profiles_past():
    """Calls that cost what the past term says teach the drift nothing; a machine 30% slower is learned
    whatever past its calls ran at, and priced at every past."""
    table = past_table()
    for _ in range(30):
        table.observe_draft(64, 2.0 * linear_draft(64), past=1016)
    assert table.draft_ms(64) == pytest.approx(linear_draft(64), rel=1e-6)
    for _ in range(40):
        table.observe_draft(64, 1.3 * 2.0 * linear_draft(64), past=1016)
    assert table.draft_ms(64, past=128) == pytest.approx(1.3 * linear_draft(64), rel=0.05)
    assert table.draft_ms(64, past=1016) == pytest.approx(1.3 * 2.0 * linear_draft(64), rel=0.05)


def test_the_draft_past_term_survives_a_save_and_load(tmp_path):
    table = past_table()
    loaded = CostTable.load(table.save(tmp_path))
    assert loaded.draft_ms(16, past=1016) == pytest.approx(table.draft_ms(16, past=1016))
    assert loaded.draft_ms(16, past=1016) == pytest.approx(1.5 * linear_draft(16))


def test_the_drift_residual_at_one_bucket_is_numpys_interpolation_to_the_last_bit():
    # Asked for every observed call in plain Python; the whole-table path (log_factor) stays numpy's.
    from dspark_trt.runtime.costs.table import _Drift

    rng = np.random.default_rng(0)
    d = _Drift(0.2, 0.5, (0.2, 5.0))
    for t in range(5000):
        if t % 400 == 0:
            d.reset()
        if rng.random() < 0.3:
            b = int(rng.integers(0, d.NBUCKETS))
            d.n[b] += 1
            d.h[b] = rng.normal()
        b = int(rng.integers(0, d.NBUCKETS))
        assert d._residual_at(b) == float(d._residual(float(b)))
