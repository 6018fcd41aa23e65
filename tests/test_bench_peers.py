"""Peers inside `bench`: which engines run, one-line errors when a peer's package is absent, the draft folder
a foreign engine gets, the converted-model cache, and the results rows, table and plot of a peer."""

from __future__ import annotations

import json
import os
import sys

import pytest

from dspark_trt.bench import peer_ortgenai, peer_runs, peer_vllm
from dspark_trt.errors import DsparkError


@pytest.fixture
def no_package_python(tmp_path):
    """A 'Python' in which no peer package imports (every probe exits 1)."""
    p = tmp_path / "python-without-peers"
    p.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named onnxruntime_genai' >&2\nexit 1\n")
    p.chmod(0o755)
    return str(p)


def test_peer_engines_option():
    assert peer_runs.parse_peer_engines("auto") == (["hf", "ortgenai", "vllm"], False)
    assert peer_runs.parse_peer_engines(" ortgenai, hf ,ortgenai") == (["ortgenai", "hf"], True)
    for bad in ("tensorrt", "hf,", ""):
        with pytest.raises(DsparkError, match="--peer-engines .* is not a peer engine"):
            peer_runs.parse_peer_engines(bad)
    assert peer_runs.fixed_ks(["off", "fixed:2", "adaptive", "fixed:5"]) == [2, 5]
    assert peer_vllm.modes_for([2, 5]) == ["vllm:off", "vllm:fixed:2", "vllm:fixed:5"]


def test_a_named_peer_without_its_package_is_a_one_line_error(no_package_python):
    for engine, package in (("ortgenai", "onnxruntime-genai"), ("vllm", "vllm")):
        with pytest.raises(DsparkError) as e:
            peer_runs.choose([engine], True, no_package_python, print)
        msg = str(e.value)
        assert f"needs the {package} package in {no_package_python}" in msg and "\n" not in msg
        assert "--peer-python" in msg


def test_auto_skips_an_absent_peer_with_a_note(no_package_python):
    said = []
    run, notes = peer_runs.choose(["ortgenai", "vllm"], False, no_package_python, said.append)
    assert run == []
    assert [n.split(":")[0] for n in notes] == ["peer ortgenai skipped", "peer vllm skipped"]
    assert said == [f"note: {n}" for n in notes]
    # Sampling: the greedy-only peers are left out whatever is installed (named: an error, one line).
    run, notes = peer_runs.choose(["ortgenai"], False, sys.executable, said.append, temperature=0.7)
    assert run == [] and "greedy decoding only" in notes[0]
    with pytest.raises(DsparkError, match="runs greedy decoding only"):
        peer_runs.choose(["vllm"], True, sys.executable, print, temperature=0.7)


def test_bad_peer_options_from_the_cli(tmp_path, capsys):
    from dspark_trt.cli import main

    for args, what in ((["--peer-engines", "hf,trt"], "error: --peer-engines"),
                       (["--rates", "1", "--peer-engines", "hf"], "error: --peer-engines belongs")):
        with pytest.raises(SystemExit) as e:
            main(["bench", str(tmp_path / "no-artifact"), *args, "--out", str(tmp_path / "out")])
        assert e.value.code == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith(what) and "\n" not in err, err


def test_cli_names_the_missing_peer_package(tiny_artifact, no_package_python, tmp_path, capsys):
    from dspark_trt.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", str(tiny_artifact), "--concurrency", "1", "--modes", "off", "--peer-engines", "ortgenai",
              "--peer-python", no_package_python, "--out", str(tmp_path / "out")])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the onnxruntime-genai peer needs the onnxruntime-genai package") and "\n" not in err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------- the draft another engine gets

def test_draft_copy_leaves_out_our_head_files(tmp_path):
    src = tmp_path / "draft"
    (src / "dspark_head").mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "confidence_head.safetensors",
                 "confidence_head.json", "dspark_head/confidence_head.safetensors"):
        (src / name).write_text(name)
    out = peer_vllm.draft_without_head(src, tmp_path / "copy")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (out / "model.safetensors").read_text() == "model.safetensors"
    assert not any(p.is_symlink() for p in out.iterdir())  # vLLM reads the path it is given, not a link's target
    assert sorted(p.name for p in src.iterdir()) == sorted(  # the source folder is left as it was
        ["config.json", "model.safetensors", "tokenizer.json", "confidence_head.safetensors",
         "confidence_head.json", "dspark_head"])
    with pytest.raises(DsparkError, match="has no config.json"):
        peer_vllm.draft_without_head(tmp_path / "missing", tmp_path / "copy2")


def test_head_file_names_match_the_head_module():
    pytest.importorskip("torch")
    from dspark_trt.models import confidence_head as ch

    assert set(peer_vllm.HEAD_ENTRIES) == {ch.HEAD_SUBDIR, ch.LEGACY_HEAD_WEIGHTS, ch.LEGACY_HEAD_CONFIG}
    assert ch.HEAD_WEIGHTS.startswith(ch.HEAD_SUBDIR + "/") and ch.HEAD_CONFIG.startswith(ch.HEAD_SUBDIR + "/")


# ------------------------------------------------------------------------------------ converted-model cache

def _checkpoint(d, weights=b"w1"):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(weights)
    return d


def test_converted_model_is_cached_by_checkpoint_hash(tmp_path, monkeypatch, no_package_python):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    a, b = _checkpoint(tmp_path / "a"), _checkpoint(tmp_path / "b", b"w2")
    assert peer_ortgenai.checkpoint_hash(a) != peer_ortgenai.checkpoint_hash(b)
    assert peer_ortgenai.checkpoint_hash(a) == peer_ortgenai.checkpoint_hash(_checkpoint(tmp_path / "a2"))
    # Not cached and the builder cannot run: one line, and no half-written cache entry.
    with pytest.raises(DsparkError, match="model builder could not convert") as e:
        peer_ortgenai.converted_model(no_package_python, a, "0.18.0", say=lambda s: None)
    assert "\n" not in str(e.value)
    root = tmp_path / "cache" / "dspark-trt" / "peers"
    assert not any(root.iterdir())
    # Cached: used as it is (the failing builder is never called).
    cached = root / f"ortgenai-0.18.0-fp32-cpu-{peer_ortgenai.checkpoint_hash(a)[:16]}"
    cached.mkdir()
    (cached / "genai_config.json").write_text("{}")
    assert peer_ortgenai.converted_model(no_package_python, a, "0.18.0") == cached
    with pytest.raises(DsparkError, match="has no config.json"):
        peer_ortgenai.converted_model(no_package_python, tmp_path / "none", "0.18.0")


def test_pad_id_avoids_prompt_tokens(tmp_path):
    (tmp_path / "genai_config.json").write_text(json.dumps({"model": {"pad_token_id": 0, "vocab_size": 8}}))
    assert peer_ortgenai.pad_id_for(tmp_path, [[1, 2], [3]]) is None
    assert peer_ortgenai.pad_id_for(tmp_path, [[0, 1, 2], [3]]) == 4


# ------------------------------------------------------------------------------------------ results schema

class FakePeer:
    engine, mode, label, batching, max_batch = "ortgenai", "ortgenai:target", "fake peer (test)", "static", 4
    versions, info = {"onnxruntime-genai": "0.0"}, {"model_dir": "/x", "python": "/py"}

    def run(self, concurrency, n_requests, max_new_tokens):
        return {"wall_s": 2.0, "requests": [{"token_ids": [7] * max_new_tokens, "generated_tokens": max_new_tokens,
                                             "latency_s": 1.0} for _ in range(n_requests)]}


def _ours(tokens):
    return {"requests": [{"token_ids": t} for t in tokens]}


def test_peer_rows_and_comparison():
    peer = FakePeer()
    assert peer_runs.measure(peer, 8, 24, 3) is None  # above its batch limit
    raw = {peer.mode: [peer_runs.measure(peer, 2, 4, 3), peer_runs.measure(peer, 2, 4, 3)]}
    same = peer_runs.rows_for_level([peer], raw, 2, [_ours([[7] * 3] * 4)] * 2, 0.0)[0]
    assert same["identical"] is True and same["greedy_match_off"] == 1.0
    assert same["output_tok_s"] == pytest.approx(24 / 4.0) and same["round_output_tok_s"] == [6.0, 6.0]
    assert {"engine", "mode", "concurrency", "label", "batching", "versions", "requests", "generated_tokens",
            "per_user_tok_s_p50", "tpot_ms_p50"} <= set(same) and "python" not in same
    differ = peer_runs.rows_for_level([peer], raw, 2, [_ours([[7] * 3] * 3 + [[7, 7, 8]])] * 2, 0.0)[0]
    assert differ["identical"] is False and differ["greedy_match_off"] == pytest.approx(6 / 8)
    assert peer_runs.rows_for_level([peer], raw, 2, None, 1.0)[0]["identical"] is None  # sampling: not compared
    skipped = peer_runs.rows_for_level([peer], {peer.mode: []}, 8, None, 0.0)[0]
    assert skipped["output_tok_s"] is None and skipped["skipped"] == "max batch 4"

    ours = [{"mode": m, "concurrency": 2, "output_tok_s": 2 * v, "output_tok_s_whole_run": v,
             "round_output_tok_s_whole_run": [v, v]} for m, v in (("off", 3.0), ("fixed:2", 9.0), ("adaptive", 12.0))]
    hf_row = {"engine": "hf", "mode": "hf:target", "concurrency": 1, "output_tok_s": 1.0}
    comp = peer_runs.comparison(ours, [hf_row, same])
    assert [e["concurrency"] for e in comp] == [2]  # the batch-1 transformers rows have their own table
    e = comp[0]
    assert e["ours"]["best fixed"] == {"mode": "fixed:2", "output_tok_s": 9.0, "steady_output_tok_s": 18.0}
    item = e["peers"]["ortgenai:target"]
    assert item["adaptive_over_peer"] == pytest.approx(2.0) and item["off_over_peer"] == pytest.approx(0.5)
    assert item["adaptive_over_peer_rounds"] == pytest.approx([2.0, 2.0]) and item["identical"] is True

    from dspark_trt.bench.results import peer_table

    unsupported = {"ortgenai:target": {"output_tok_s": None, "skipped": "max batch 4"}}
    table = peer_table({"peers": [hf_row, same, skipped],
                        "peer_comparison": comp + [{"concurrency": 8, "ours": {}, "peers": unsupported}]})
    assert "| 2 | 3.0 | fixed:2 9.0 | 12.0 | 6.0 | yes | 0.50 (0.50) | 1.50 (1.50) | 2.00 (2.00) |" in table
    assert "| 8 | - | - | - | max batch 4 | - | - | - | - |" in table and "`ortgenai:target`: fake peer (test)" in table


def test_plot_draws_a_peer_across_concurrency(tmp_path):
    pytest.importorskip("matplotlib")
    from dspark_trt.bench.plots import plot_throughput

    runs = [{"mode": "off", "concurrency": c, "output_tok_s": 10.0 * c} for c in (1, 2, 4)]
    peers = [{"mode": "ortgenai:target", "concurrency": c, "output_tok_s": 12.0 * c} for c in (1, 2)]
    peers.append({"mode": "ortgenai:target", "concurrency": 4, "output_tok_s": None, "skipped": "max batch 2"})
    peers.append({"mode": "hf:target", "concurrency": 1, "output_tok_s": 5.0})
    out = plot_throughput(runs, tmp_path / "t.png", peers=peers)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -------------------------------------------------------------------------------- a real onnxruntime-genai run

@pytest.mark.slow
def test_ortgenai_peer_in_a_tiny_bench(tiny_artifact, tmp_path, monkeypatch):
    """The real thing, where onnxruntime-genai is installed (DSPARK_PEER_PYTHON may name another venv's
    Python): converted by its builder, run at 1 and 2 requests, greedy tokens identical to our `off`."""
    python = os.environ.get("DSPARK_PEER_PYTHON", sys.executable)
    if peer_ortgenai.probe(python) is None:
        pytest.skip(f"onnxruntime-genai is not installed in {python} (set DSPARK_PEER_PYTHON)")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    from dspark_trt.bench.harness import run_bench

    out = run_bench(tiny_artifact, concurrency="1,2", modes="off,fixed:2,adaptive", num_prompts=3, max_new_tokens=8,
                    out_dir=tmp_path / "bench", peers=True, peer_engines="ortgenai", peer_python=python,
                    progress=False, echo=lambda s: None)
    res = json.loads((out / "results.json").read_text())
    rows = {p["concurrency"]: p for p in res["peers"]}
    assert set(rows) == {1, 2} and all(p["mode"] == "ortgenai:target" for p in rows.values())
    for c, p in rows.items():
        assert p["generated_tokens"] == max(3, 3 * c) * 8 and p["output_tok_s"] > 0
        assert p["identical"] is True and p["versions"]["onnxruntime-genai"]
    assert [e["concurrency"] for e in res["peer_comparison"]] == [1, 2]
    assert "## Peers across concurrency" in (out / "results.md").read_text()
    assert any((tmp_path / "cache" / "dspark-trt" / "peers").glob("ortgenai-*/genai_config.json"))


# ----------------------------------------------------------------------------------------- worker protocol

def test_worker_client_skips_stray_output_and_reports_a_crash_in_one_line():
    from dspark_trt.bench.peer_worker import WorkerClient

    echo = ("import json, sys\nprint('a library banner')\nfor line in sys.stdin:\n"
            "    msg = json.loads(line)\n    if msg['cmd'] == 'quit': break\n"
            "    print(json.dumps({'ok': True, 'got': msg['cmd']}), flush=True)\n")
    w = WorkerClient([sys.executable, "-c", echo], "echo")
    assert w.hello == {"ok": True, "got": "hello"}
    w.close()
    crash = ("import sys\nsys.stderr.write('Traceback (most recent call last):\\nValueError: 1 validation error\\n"
             "  Value error, the draft is refused\\nshutting down\\n')\nsys.exit(3)\n")
    with pytest.raises(DsparkError) as e:
        WorkerClient([sys.executable, "-c", crash], "fake")
    assert str(e.value) == ("the fake peer's worker stopped (exit 3): ValueError: 1 validation error "
                            "Value error, the draft is refused")


@pytest.mark.parametrize("worker", ["ortgenai", "vllm"])
def test_worker_scripts_run_standalone_beside_worker_loop(tmp_path, worker):
    """A peer's Python has the engine but no dspark_trt: the worker script must find its command loop
    (worker_loop.py) beside itself. Stub engines stand in for onnxruntime-genai and vLLM; `-S` keeps the
    site-packages (and with them dspark_trt) out."""
    from pathlib import Path

    from dspark_trt.bench.peer_worker import WorkerClient

    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / "onnxruntime.py").write_text("__version__ = '0.0-stub'\n")
    (stubs / "onnxruntime_genai.py").write_text(
        "__version__ = '0.0-stub'\nclass Config:\n    def __init__(self, d): pass\n"
        "    def overlay(self, s): pass\nclass Model:\n    def __init__(self, c): print('engine banner')\n")
    (stubs / "vllm.py").write_text(
        "__version__ = '0.0-stub'\nclass LLM:\n    def __init__(self, **kw): print('engine banner')\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "genai_config.json").write_text('{"model": {"pad_token_id": 0}}')
    script = Path(__file__).resolve().parents[1] / "dspark_trt" / "bench" / f"{worker}_worker.py"
    arg = str(model) if worker == "ortgenai" else '{"target": "t", "max_num_seqs": 1, "max_model_len": 8}'
    env = {"PYTHONPATH": str(stubs), "PATH": "/usr/bin:/bin"}
    w = WorkerClient([sys.executable, "-S", str(script), arg], worker, env=env)
    try:
        assert w.hello["ok"] and w.hello["version"] == "0.0-stub"
        with pytest.raises(DsparkError, match="unknown command 'nothing'"):
            w.ask({"cmd": "nothing"})
    finally:
        w.close()
    assert w.proc.returncode == 0
