"""Robust step-cost measurement (issue 22 item 1) and persisting what the runtime learned (item 2), as specs
with fake timers and fake runtimes: no real timing is asserted."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import numpy as np
import pytest

from dspark_trt.errors import DsparkError
from dspark_trt.runtime.costs import profiling
from dspark_trt.runtime.costs.measure import drop_outliers, profile_points, relative_spread
from dspark_trt.runtime.costs.table import CostTable
from dspark_trt.runtime.tuning import RuntimeTuning


def test_points_are_replayed_round_robin_until_their_spread_is_bounded():
    calls = []
    noisy = {"verify": 4}  # this point's first timings disagree; later ones agree
    seen = {}

    def timer(name):
        def ms(size):
            calls.append((name, size))
            k = seen[name, size] = seen.get((name, size), 0) + 1
            base = 1.0 + size
            if noisy.get(name) == size and k <= 4:
                return base * (1.0, 1.6, 2.2, 1.3)[k - 1]
            return base
        return ms

    stats = {}
    verify, draft = profile_points(timer("verify"), timer("draft"), 8, 2, repeats=3, progress=False, warmup=1,
                                   max_spread=0.1, max_repeats=10, keep_quantile=75, stats=stats)
    points = len(verify) + len(draft)
    first = calls[: 4 * points]
    # the first rounds interleave every point in the same order
    assert [first[i * points:(i + 1) * points] for i in range(4)] == [first[:points]] * 4
    # only the unsettled point is replayed after them, and only until it settles
    extra = calls[4 * points:]
    assert extra and set(extra) == {("verify", 4)}
    assert len(extra) < 10 - 3
    assert relative_spread(verify[4]) <= 0.1
    assert stats["rounds"] == 3 + len(extra) and stats["spread_max"] <= 0.1


def test_replays_stop_at_the_cap_and_the_spread_is_reported():
    rng = np.random.default_rng(0)
    stats = {}
    verify, _ = profile_points(lambda t: float(rng.uniform(1, 3)), lambda b: 1.0, 4, 1, repeats=2, progress=False,
                               max_spread=0.01, max_repeats=6, stats=stats)
    assert all(len(v) == 6 for v in verify.values())  # keep_quantile 100: every timing kept
    assert stats["rounds"] == 6 and stats["spread"] > 0.01


def test_slow_outliers_are_dropped_and_the_fit_follows_the_fast_timings():
    assert drop_outliers([1.0, 1.1, 9.0, 1.05], keep_quantile=75) == [1.0, 1.1, 1.05]
    assert drop_outliers([1.0, 9.0], keep_quantile=100) == [1.0, 9.0]
    stalls = iter([1.0, 1.0, 10.0, 1.0] * 100)  # every fourth call of a point is preempted
    verify, _ = profile_points(lambda t: next(stalls), lambda b: 1.0, 1, 1, repeats=4, progress=False,
                               keep_quantile=75)
    assert max(verify[1]) == 1.0
    assert CostTable.from_measurements(verify, {1: [1.0]}).verify_ms(1) == 1.0


def _fake_rt(tmp_path, spread, load=(3.9, 3.5, 3.0)):
    meta = {"spread": spread, "load": {"before": list(load), "after": list(load)}, "cpu_count": 2}
    table = CostTable(np.arange(9.0), np.arange(3.0), meta)
    return SimpleNamespace(artifact_dir=tmp_path, manifest={"files": {}}, tuning=RuntimeTuning(),
                           backend=SimpleNamespace(name="ort")), table


def test_a_profile_spread_too_wide_is_used_but_not_saved_saying_why(tmp_path, monkeypatch, capsys):
    rt, table = _fake_rt(tmp_path, spread=0.45)
    monkeypatch.setattr(profiling, "quick_or_full_profile", lambda rt, **kw: table)
    assert profiling.load_or_profile(rt, "ort") is table
    assert not profiling.profile_path(tmp_path, "ort").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["cost profile not saved: timings spread 45% (over 35%; machine busy, load 3.9 on 2 cores); "
                   "it will be measured again next start"]


def test_a_profile_within_the_spread_is_saved(tmp_path, monkeypatch, capsys):
    rt, table = _fake_rt(tmp_path, spread=0.05)
    monkeypatch.setattr(profiling, "quick_or_full_profile", lambda rt, **kw: table)
    profiling.load_or_profile(rt, "ort")
    assert profiling.profile_path(tmp_path, "ort").exists() and capsys.readouterr().err == ""


def test_a_profile_refined_before_refits_kept_the_padding_cost_is_measured_again(tmp_path, monkeypatch, capsys):
    """Refits used to move the padding coefficient (to 0 within a mixed open loop) and persist_refined saved
    the refitted shapes: such a profile would pack long prompt chunks among wide decode calls at every start."""
    rt, fresh = _fake_rt(tmp_path, spread=0.05)
    meta = dict(profiling.profile_meta(rt.manifest, "ort"), refined_observations=4000)
    CostTable(np.arange(9.0), np.arange(3.0), meta).save(profiling.profile_path(tmp_path, "ort"))
    with pytest.raises(DsparkError, match="re-measure it with `dspark-trt profile`"):
        profiling.load_or_profile(rt, "ort", measure_if_missing=False)
    monkeypatch.setattr(profiling, "quick_or_full_profile", lambda rt, **kw: fresh)
    assert profiling.load_or_profile(rt, "ort") is fresh
    assert "refined by an older dspark-trt" in capsys.readouterr().err
    # refined by this version (marked): loaded as it is
    meta["shape_refits"] = profiling.SHAPE_REFITS
    CostTable(np.arange(9.0), np.arange(3.0), meta).save(profiling.profile_path(tmp_path, "ort"))
    assert profiling.load_or_profile(rt, "ort", measure_if_missing=False).meta["refined_observations"] == 4000


class _Cache:
    def past(self, n):
        return n

    def write(self, present, positions, slots):
        pass


def test_measure_records_the_machines_load_and_the_spread(monkeypatch):
    loads = iter([(1.0, 0.5, 0.25), (2.0, 1.0, 0.5)] * 2)
    monkeypatch.setattr(profiling.os, "getloadavg", lambda: next(loads))
    layouts = [([1], 4), ([2, 1], 4), ([4], 4), ([1, 1], 32), ([3, 3], 32)]
    monkeypatch.setattr(profiling, "shape_layouts", lambda rt: layouts)
    monkeypatch.setattr(profiling, "_verify_feeds", lambda rt, t: {"positions": t})
    monkeypatch.setattr(profiling, "_draft_call", lambda rt, b: lambda: None)
    monkeypatch.setattr(profiling, "_packed_verify_feeds", lambda rt, q, past: {"positions": q})
    monkeypatch.setattr(profiling, "token_slots", lambda feeds: None)
    clock = (i * 1e-3 for i in itertools.count())  # every call takes 1 ms, exactly
    monkeypatch.setattr(profiling.time, "perf_counter", lambda: next(clock))
    run = lambda feeds, past: (None, None)  # noqa: E731
    rt = SimpleNamespace(backend=SimpleNamespace(run_target=run, run_draft=run, name="ort"), manifest={"files": {}},
                         target_kv=_Cache(), draft_kv=_Cache(), tuning=RuntimeTuning(), max_tokens_per_step=8,
                         slots_total=2, max_draft=3, wait_prefaulted=lambda: None, max_context=64,
                         drafter=SimpleNamespace(prepare_call=lambda b, past: lambda: None))
    table = profiling.measure(rt, repeats=2, progress=False)
    assert table.meta["load"] == {"before": [1.0, 0.5, 0.25], "after": [2.0, 1.0, 0.5]}
    assert table.meta["cpu_count"] == profiling.os.cpu_count()
    assert table.meta["spread"] == 0.0 and table.meta["rounds"] == 2
    assert table.meta["backend"] == "ort"
    # keyed by the runtime's profile name (its thread regime), so the next load matches what was saved
    rt.profile_name = "ort.spin"
    assert profiling.measure(rt, repeats=2, progress=False).meta["backend"] == "ort.spin"


def test_the_profile_command_refuses_a_wide_spread_unless_forced(tiny_artifact, tmp_path, monkeypatch):
    import shutil

    from dspark_trt.commands import profile as command

    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    profiling.profile_path(art, "ort").unlink(missing_ok=True)
    _, table = _fake_rt(tmp_path, spread=0.6)
    monkeypatch.setattr(command, "measure", lambda rt, repeats: table)
    with pytest.raises(DsparkError, match=r"^cost profile not saved: timings spread 60% .*pass --force") as e:
        command.profile_artifact(art)
    assert "\n" not in str(e.value) and not profiling.profile_path(art, "ort").exists()
    saved = command.profile_artifact(art, force=True)
    assert json.loads(saved.read_text())["meta"]["spread"] == 0.6


# ------------------------------------------------------------------------- item 2: persisting what was learned

def _closing_rt(tmp_path, table):
    return SimpleNamespace(artifact_dir=tmp_path, backend=SimpleNamespace(name="ort"), cost=table,
                           tuning=RuntimeTuning())


SHAPES = [[1, 1, 1, 32, 2.0], [8, 2, 4, 32, 6.0], [16, 16, 1, 32, 9.0], [32, 8, 4, 192, 30.0], [4, 4, 1, 192, 5.0]]


def _full_table():
    return CostTable(np.arange(33, dtype=float) * 10.0, np.arange(9, dtype=float) + 1.0, {"spread": 0.05},
                     points={"verify": {"8": [80.0]}, "verify_shapes": SHAPES})


def test_a_full_profile_that_observed_calls_contradict_is_refitted_and_saved_at_close(tmp_path):
    table = _full_table()
    path = table.save(profiling.profile_path(tmp_path, "ort"))
    model = table.call_shape
    for _ in range(60):  # real calls take twice the profiled time
        table.observe_verify(8, 160.0)
        table.observe_draft(4, 10.0)
        model.observe(8, 2, 4, 32, 2 * model.base_ms(8, 2, 4, 32))
    assert profiling.persist_refined(_closing_rt(tmp_path, table)) == path
    saved = CostTable.load(path)
    # the saved tables moved most of the way from the profile (80 ms, 5 ms) to the observations (160, 10)
    assert abs(saved.verify_ms(8, corrected=False) - 160.0) < 0.25 * 80.0
    assert abs(saved.draft_ms(4, corrected=False) - 10.0) < 0.25 * 5.0
    assert saved.meta["refined_observations"] == 120 and saved.meta["refined_from"]["kind"] == "full"
    assert saved.meta["shape_refits"] == profiling.SHAPE_REFITS
    assert saved.meta["refined_from"]["disagreement"] > 0.25 and saved.meta["spread"] == 0.05
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]
    # the call-shape model, fitted again from its timings scaled by the observed drift, moved too
    assert saved.call_shape.ms(8, 2, 4, 32) > 1.6 * model.base_ms(8, 2, 4, 32)


def test_a_full_profile_that_observed_calls_agree_with_is_left_untouched(tmp_path):
    table = _full_table()
    path = table.save(profiling.profile_path(tmp_path, "ort"))
    before = path.read_bytes(), path.stat().st_mtime_ns
    for _ in range(200):  # within the margin: 10% slower
        table.observe_verify(8, 88.0)
        table.observe_draft(4, 5.5)
    assert profiling.persist_refined(_closing_rt(tmp_path, table)) is None
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before


def test_too_few_observations_do_not_refit_a_full_profile(tmp_path):
    table = _full_table()
    for _ in range(10):
        table.observe_verify(8, 160.0)
    assert profiling.persist_refined(_closing_rt(tmp_path, table)) is None
    assert not profiling.profile_path(tmp_path, "ort").exists()


def test_a_failed_save_leaves_the_old_profile_whole(tmp_path, monkeypatch):
    path = _full_table().save(tmp_path / "cost_profile.json")
    before = path.read_bytes()

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr("dspark_trt.runtime.costs.table.os.replace", boom)
    with pytest.raises(OSError):
        CostTable(np.arange(5.0), np.arange(3.0)).save(path)
    assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]


def test_a_verify_slope_learned_from_calls_is_saved_at_close(tmp_path):
    """A profile whose verify shapes were all timed alike (flat): calls of several depths refit its slope,
    and the saved profile keeps it (its shapes as the model now predicts them)."""
    flat = [[r * q, r, q, p, 10.0] for r in (1, 4, 16) for q in (1, 2, 4, 8) for p in (32, 192)]
    table = CostTable(np.arange(33, dtype=float) * 10.0, np.arange(9, dtype=float) + 1.0, {"spread": 0.05},
                      points={"verify": {"8": [80.0]}, "verify_shapes": flat})
    path = table.save(profiling.profile_path(tmp_path, "ort"))
    model = table.call_shape
    assert model.ms(64, 16, 4, 100) == pytest.approx(model.ms(16, 16, 1, 100))
    rng = np.random.default_rng(5)
    for _ in range(512):  # each query position costs 2 ms, on top of a 4 ms call: twice as dear at depth 4
        q, past = int(rng.integers(1, 9)), int(rng.integers(32, 192))
        table.observe_verify(16 * q, 4.0 + 2.0 * q)  # as the verifier feeds both
        model.observe(16 * q, 16, q, past, 4.0 + 2.0 * q)
    assert model.refits > 0 and model.ms(64, 16, 4, 100) > 1.5 * model.ms(16, 16, 1, 100)
    assert profiling.disagreement(table) > 0.25
    assert profiling.persist_refined(_closing_rt(tmp_path, table)) == path
    saved = CostTable.load(path).call_shape
    assert saved.ms(64, 16, 4, 100) > 1.5 * saved.ms(16, 16, 1, 100)


def test_a_saved_profile_keeps_the_call_shape_coefficients_whatever_each_width_learned(tmp_path):
    """Widths that drifted apart (sampled calls at some loads, a busy spell at others) must not come back as
    coefficients: the saved shapes are the model at one level, so the next load fits the same coefficients
    (times that level). Saved with each width's own level, the fit turned the width differences into a
    padding cost 8x the profile's and a token cost of 0, and adaptive hardly drafted after it."""
    from dspark_trt.runtime.costs.call_shape import GRID, features

    shapes = [[float(t), float(r), float(q), float(p), 0.0] for t, r, q, p in GRID]
    coef = np.array([2.3, 0.07, 0.04, 0.1])
    for row in shapes:
        row[4] = float(features(*row[:4]) @ coef)
    table = CostTable(np.arange(33, dtype=float) * 10.0, np.arange(9, dtype=float) + 1.0, {"spread": 0.05},
                      points={"verify": {"8": [80.0]}, "verify_shapes": shapes})
    path = table.save(profiling.profile_path(tmp_path, "ort"))
    model = table.call_shape
    for _ in range(300):  # narrow calls as profiled, wide ones 3x dearer
        for rows, factor in ((1, 1.0), (4, 1.2), (16, 2.0), (64, 3.0)):
            model.observe(rows, rows, 1, 100, factor * model.base_ms(rows, rows, 1, 100))
        table.observe_verify(8, 160.0)
    assert profiling.persist_refined(_closing_rt(tmp_path, table)) == path
    saved = CostTable.load(path).call_shape
    level = saved.coef[0] / coef[0]
    np.testing.assert_allclose(saved.coef, level * coef, rtol=1e-6)
    assert level == pytest.approx(np.exp(model.log_drift), rel=1e-6)


def test_the_quick_profiles_draft_points_keep_the_least_of_several_timings(monkeypatch):
    """Beside a CPU hog a first load's single draft timing read a 1-row call at 3.58 ms against 0.42 quiet, and
    adaptive did not draft at all in that run. Draft calls are cheap whatever the target's size, so the quick
    profile times each draft point several times (after a warm-up) and keeps the least."""
    now = [0.0]
    ms = iter([50.0, 3.6, 0.45, 3.6, 0.5, 0.42,  # 1 row: warm-up, then five timings, two stalled
               60.0, 9.0, 1.1, 1.0, 9.5, 1.2])  # 8 rows
    assert profiling.QUICK_DRAFT_TIMINGS == 5

    def draft_call(rt, batch):
        def call():
            now[0] += next(ms) / 1e3
        return call

    monkeypatch.setattr(profiling.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(profiling, "_draft_call", draft_call)
    assert profiling._probe_draft(SimpleNamespace(), [1, 8]) == pytest.approx([0.42, 1.0])


def test_the_profile_measures_how_draft_calls_grow_with_the_past_and_prices_them_so(monkeypatch):
    """A draft call of b rows at past p costs 0.2 + 0.01 b + 4e-5 b (p - 128) ms here (the tiny pair's draft at
    64 rows: 3.36 ms at past 128, 6.16 at 900); the profile times three batch sizes at past 128 and 8x it and
    prices every draft call at its past."""
    def cost(b, past):
        return 0.2 + 0.01 * b + 4e-5 * b * (past - 128)

    now = [0.0]
    monkeypatch.setattr(profiling.time, "perf_counter", lambda: now[0])

    def call(ms):
        def run():
            now[0] += ms / 1e3
        return run

    def run_target(feeds, past):
        now[0] += 1e-3
        return None, None
    monkeypatch.setattr(profiling, "shape_layouts", lambda rt: [([1], 32), ([2], 32), ([1, 1], 192), ([4], 192)])
    monkeypatch.setattr(profiling, "_verify_feeds", lambda rt, t: {"positions": t})
    monkeypatch.setattr(profiling, "_packed_verify_feeds", lambda rt, q, past: {"positions": q})
    monkeypatch.setattr(profiling, "token_slots", lambda feeds: None)
    monkeypatch.setattr(profiling, "_draft_call", lambda rt, b: call(cost(b, 128)))
    rt = SimpleNamespace(backend=SimpleNamespace(run_target=run_target, name="ort"), manifest={"files": {}},
                         target_kv=_Cache(), tuning=RuntimeTuning(), max_tokens_per_step=16, slots_total=16,
                         max_draft=3, wait_prefaulted=lambda: None, max_context=2048,
                         drafter=SimpleNamespace(prepare_call=lambda b, past: call(cost(b, past))))
    table = profiling.measure(rt, repeats=2, progress=False)
    pairs = table.points["draft_past"]
    assert (pairs["past0"], pairs["past"], pairs["batch"]) == (128, 1024, [1, 4, 16])
    for b in (1, 4, 10, 16):
        for past in (128, 600, 1024, 1500):
            assert table.draft_ms(b, past=past) == pytest.approx(cost(b, past), rel=0.02), (b, past)
    assert profiling.draft_past_layouts(SimpleNamespace(**{**vars(rt), "max_context": 100})) == []
