"""`bench --start-profile FILE` (every run starts cold from FILE), the first-tokens figure, `profile --out`,
and scripts/distort_profile.py: the tools that measure issue 22's recovery from a wrong profile."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from dspark_trt.bench.latency import first_tokens_rate
from dspark_trt.runtime.costs.call_shape import packed_shape
from dspark_trt.errors import DsparkError

ROOT = Path(__file__).resolve().parents[1]


def _distort_module():
    spec = importlib.util.spec_from_file_location("distort_profile", ROOT / "scripts" / "distort_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def good_profile(tiny_artifact, tmp_path_factory) -> Path:
    """The artifact's own profile, as a file outside it."""
    from dspark_trt.runtime.runtime import Runtime

    with Runtime.load(tiny_artifact) as rt:
        return rt.cost.save(tmp_path_factory.mktemp("profiles") / "good.json")


def _artifact_profiles(artifact) -> dict:
    return {p.name: p.read_bytes() for p in Path(artifact).glob("cost_profile*.json")}


def test_first_tokens_rate_is_tokens_over_the_time_to_the_step_that_reached_them():
    timeline = [(1.0, 100), (2.0, 400), (3.0, 700), (4.0, 900)]
    requests = [{"submitted_at": 0.5}, {"submitted_at": 0.75}]
    assert first_tokens_rate(timeline, requests, 512) == pytest.approx(700 / 2.5)
    assert first_tokens_rate(timeline, requests, 400) == pytest.approx(400 / 1.5)
    assert first_tokens_rate(timeline, requests, 901) is None  # the run never emitted that many
    assert first_tokens_rate(timeline, [], 100) is None


def test_distorted_profiles_price_drafting_dearer_or_verifying_flat(tiny_artifact, good_profile, tmp_path):
    from dspark_trt.runtime.costs.table import CostTable

    distort = _distort_module()
    good = json.loads(good_profile.read_text())
    dear = tmp_path / "dear.json"
    flat = tmp_path / "flat.json"
    assert distort.main([str(good_profile), str(dear), "--draft-scale", "3"]) == 0
    assert distort.main([str(good_profile), str(flat), "--flat-verify"]) == 0
    assert distort.main([str(good_profile), str(flat), "--flat-verify"]) == 1  # never overwrites
    base, d, f = CostTable.load(good_profile), CostTable.load(dear), CostTable.load(flat)
    np.testing.assert_allclose(d.draft_table(), 3 * np.asarray(base.draft_table()))
    np.testing.assert_allclose(d.verify_table(), base.verify_table())
    v = np.asarray(f.verify_table())[1:]
    assert np.ptp(v) == 0 and v[0] == pytest.approx(base.verify_table()[1])
    if f.call_shape is not None:  # the call-shape model was fitted to flat points: depth and width cost nothing
        assert f.call_shape.ms(64, 8, 8, 32) == pytest.approx(f.call_shape.ms(1, 1, 1, 32), rel=0.05)
    assert json.loads(dear.read_text())["meta"]["artifact"] == good["meta"]["artifact"]


def _cold_starts(good_profile, tmp_path, monkeypatch):
    """A start profile with draft costs 3x too high, and a spy on the runtimes every run starts cold on:
    (path, list of (fresh runtime, same engines, its draft table, calls observed, steps))."""
    from dspark_trt.bench import start_profile

    dear = tmp_path / "dear.json"
    _distort_module().main([str(good_profile), str(dear), "--draft-scale", "3"])
    started = []
    cold = start_profile.cold_runtime

    def spy(warm, path):
        rt = cold(warm, path)
        # what the run starts from: the start profile's tables, nothing observed, nothing explored
        # the same engines (sessions), bound to caches of its own (a cold runtime lives beside the others)
        started.append((rt is not warm, rt.backend.sessions is warm.backend.sessions, list(rt.cost.draft_table()),
                        sum(d["observations"] for d in rt.cost.drift().values()), rt.metrics.steps))
        return rt

    monkeypatch.setattr(start_profile, "cold_runtime", spy)
    return dear, started


def _all_cold(started, dear, runs: int) -> None:
    expected = list(np.asarray(json.loads(dear.read_text())["draft_ms"]))
    assert len(started) == runs
    for fresh, same_engines, draft, observed, steps in started:
        assert fresh and same_engines and observed == 0 and steps == 0
        np.testing.assert_allclose(draft, expected)


def test_every_run_starts_cold_from_the_start_profile_and_the_artifact_keeps_its_own(
        tiny_artifact, good_profile, tmp_path, monkeypatch):
    from dspark_trt.bench.harness import run_bench

    dear, started = _cold_starts(good_profile, tmp_path, monkeypatch)
    before = _artifact_profiles(tiny_artifact)
    out = run_bench(tiny_artifact, concurrency="1,4", modes="adaptive,off,fixed:2", num_prompts=8,
                    max_new_tokens=64, out_dir=tmp_path / "b", progress=False, rounds=2, start_profile=dear)
    assert _artifact_profiles(tiny_artifact) == before  # neither read nor written over
    _all_cold(started, dear, 2 * 3 * 2)  # levels x modes x rounds
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["start_profile"] == str(dear)
    assert any("started cold" in n for n in res["notes"])
    assert "--start-profile" in res["env"]["command"]
    for r in res["runs"]:
        assert len(r["round_first_tokens_tok_s"]) == 2 and r["first_tokens_tok_s"] > 0  # 8 x 64 = 512 tokens a run
        assert r["oracle"] is None
        assert r["greedy_match_off"] == 1.0
    for s in res["summary"]:
        assert s["first_tokens"] == 512 and s["adaptive_over_best_first_tokens"] > 0
    assert "first tokens" in (out / "results.md").read_text()


def test_a_cold_start_keeps_its_runtime_across_its_slices_while_the_other_modes_take_turns(
        tiny_artifact, good_profile, tmp_path, monkeypatch):
    """A cold start is one run from its start, and the modes still take turns slice by slice (a whole run a
    mode, one after the other, put equal modes ~8% apart by luck): each (mode, round) gets one cold runtime,
    which serves every slice of its run, the other modes' slices in between."""
    from dspark_trt.bench import start_profile
    from dspark_trt.bench.harness import run_bench

    dear, started = _cold_starts(good_profile, tmp_path, monkeypatch)
    served = []
    spy = start_profile.cold_runtime

    def counting(warm, path):
        rt = spy(warm, path)
        submit, mine = rt.submit, []
        served.append(mine)

        def count(ids, cfg, **kw):
            mine.append(cfg.spec)
            return submit(ids, cfg, **kw)
        rt.submit = count
        return rt

    monkeypatch.setattr(start_profile, "cold_runtime", counting)
    out = run_bench(tiny_artifact, concurrency="1", modes="adaptive,off", num_prompts=16, max_new_tokens=8,
                    out_dir=tmp_path / "b", progress=False, rounds=2, start_profile=dear, warmup=False)
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["slices_per_round"] == {"1": 2}
    _all_cold(started, dear, 2 * 2)  # modes x rounds, not slices
    assert sorted(len(s) for s in served) == [16] * 4  # each served its whole run: both slices
    assert all(len(set(s)) == 1 for s in served)  # of one mode
    # The cold runtimes live side by side on the warm one's engines, each on caches of its own.
    assert all(r["greedy_match_off"] == 1.0 for r in res["runs"])


def test_the_open_loop_starts_every_run_cold_from_the_start_profile_too(
        tiny_artifact, good_profile, tmp_path, monkeypatch):
    """Each open loop used to start from the profile the previous one saved, so consecutive runs differed."""
    from dspark_trt.bench.open_loop import run_open_loop

    dear, started = _cold_starts(good_profile, tmp_path, monkeypatch)
    before = _artifact_profiles(tiny_artifact)
    out = run_open_loop(tiny_artifact, rates="2", modes="adaptive,off", workload="short:prompt=8-16,out=4-8",
                        num_prompts=3, capacity="40", rounds=2, out_dir=tmp_path / "o", warmup=False,
                        progress=False, start_profile=dear)
    assert _artifact_profiles(tiny_artifact) == before
    _all_cold(started, dear, 2 * 2)  # modes x rounds
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["start_profile"] == str(dear) and any("started cold" in n for n in res["notes"])
    assert all(e["completed"] == 2 * 3 and e["failed"] == 0 for e in res["open_loop"])  # rounds x requests


def test_a_start_profile_must_fit_the_artifact(tiny_artifact, good_profile, tmp_path):
    from dspark_trt.bench.start_profile import check_start_profile
    from dspark_trt.runtime.runtime import load_manifest

    manifest = load_manifest(tiny_artifact)
    assert check_start_profile(good_profile, manifest) == good_profile
    with pytest.raises(DsparkError, match="no such file"):
        check_start_profile(tmp_path / "none.json", manifest)
    other = json.loads(good_profile.read_text())
    other["meta"]["artifact"] = {k: "0" * 64 for k in other["meta"]["artifact"]}
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(DsparkError, match="different artifact") as e:
        check_start_profile(tmp_path / "other.json", manifest)
    assert "\n" not in str(e.value)
    # measured with other threads or another backend is fine: that is a wrong start worth measuring
    other["meta"] = dict(json.loads(good_profile.read_text())["meta"], backend="ort.spin")
    (tmp_path / "spin.json").write_text(json.dumps(other))
    check_start_profile(tmp_path / "spin.json", manifest)


@pytest.mark.parametrize("extra, what", [(["--via-http"], "--start-profile starts every run cold in this process"),
                                         (["--peers"], "--start-profile measures our modes")])
def test_start_profile_refusals_are_one_line_errors(tiny_artifact, good_profile, tmp_path, capsys, extra, what):
    from dspark_trt.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", str(tiny_artifact), "--start-profile", str(good_profile), *extra, "--out", str(tmp_path / "o")])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {what}") and "\n" not in err, err


def test_profile_out_writes_elsewhere_and_never_over_a_file(tiny_artifact, tmp_path, capsys):
    from dspark_trt.cli import main

    before = _artifact_profiles(tiny_artifact)
    out = tmp_path / "mine.json"
    main(["profile", str(tiny_artifact), "--repeats", "1", "--out", str(out), "--force"])
    assert json.loads(out.read_text())["format"] == "dspark-trt/cost-profile"
    assert _artifact_profiles(tiny_artifact) == before
    for path, what in ((out, "already exists"), (tmp_path / "no" / "p.json", "its folder does not exist")):
        with pytest.raises(SystemExit) as e:
            main(["profile", str(tiny_artifact), "--out", str(path)])
        assert e.value.code == 1
        assert what in capsys.readouterr().err


def test_from_a_flat_profile_a_prompt_chunk_packed_among_decode_rows_teaches_the_padding_cost(
        tiny_artifact, good_profile, tmp_path):
    """Real engines, started from a profile recorded flat (padding priced at 0): the first prompt chunk that
    arrives while other requests decode is packed into their call; that call, observed at once, raises the
    price of packing a chunk. (Whether the model then splits depends on this machine's timings: on the tiny
    pair one packed call of 3 rows and a 64-token chunk can be cheaper than two calls; the split itself is
    specified in test_call_shape.py.) Greedy text is unchanged by whatever the cost model does."""
    import time

    from dspark_trt.bench.start_profile import runtime_from
    from dspark_trt.runtime import GenerationConfig

    flat = tmp_path / "flat.json"
    _distort_module().main([str(good_profile), str(flat), "--flat-verify"])
    long_prompt = list(range(5, 125))
    rt = runtime_from(tiny_artifact, "ort", flat)
    try:
        assert rt.cost.call_shape.coef[3] < 1e-9  # flat points: no padding term (up to rounding)
        decode, chunk = [1] * 3, [64]
        packed = packed_shape(decode + chunk, [60] * 3 + [0])
        flat_price = rt.cost.call_shape.base_ms(*packed, chunk=True)
        cfg = GenerationConfig(max_new_tokens=48, spec="off", stop_at_eos=False)
        first = [rt.submit([7 + i, 9, 13], cfg) for i in range(3)]
        while min(len(r.tokens) for r in first) < 4:
            time.sleep(0.001)
        late = rt.submit(long_prompt, cfg)
        for r in first + [late]:
            r.done.wait(60)
        shape = rt.cost.call_shape
        assert shape.padding_raises >= 1 and shape.chunk_padding > 0
        assert shape.base_ms(*packed, chunk=True) > flat_price  # packing a chunk is priced dearer than flat
        alone = rt.generate([long_prompt], cfg)[0]
        assert rt.result(late).token_ids == alone.token_ids
    finally:
        rt.close()


def test_the_simulated_open_loop_gives_the_same_run_every_time_on_its_own_clock(tiny_artifact, good_profile):
    """scripts/simulate_open.py: real engine calls, the true profile's time. Two runs of one schedule give the
    same records whatever the machine does meanwhile; requests wait for their arrival, and an idle runtime's
    clock jumps to the next one."""
    spec = importlib.util.spec_from_file_location("simulate_open", ROOT / "scripts" / "simulate_open.py")
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    from dspark_trt.bench.start_profile import runtime_from
    from dspark_trt.bench.workload import build_requests, parse_temperature, parse_workload
    from dspark_trt.runtime.costs.table import CostTable

    truth = CostTable.load(good_profile)
    warm = runtime_from(tiny_artifact, "ort", good_profile)
    try:
        items = build_requests(parse_workload("short:prompt=8-32,out=6-12"), 5, warm.tokenizer.encode, 0,
                               warm.max_context, parse_temperature("0:0.5,1.0:0.5"))
        arrivals = np.array([0.0, 0.0005, 0.001, 0.002, 5.0])  # the last comes long after the others finished
        first, wall = sim.run(warm, good_profile, truth, items, arrivals, "adaptive")
        again = sim.run(warm, good_profile, truth, items, arrivals, "adaptive")
    finally:
        warm.close()
    assert (first, wall) == again
    assert all(r["ok"] and r["generated_tokens"] == it.max_tokens for r, it in zip(first, items))
    assert all(r["arrival_s"] <= r["admitted_s"] < r["token_times_s"][0] for r in first)
    assert max(r["token_times_s"][-1] for r in first[:4]) < 5.0 < first[4]["token_times_s"][0] < 5.5
    assert wall == first[4]["token_times_s"][-1]
