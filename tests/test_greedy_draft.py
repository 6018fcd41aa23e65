"""The all-greedy draft graph (manifest graph `draft_greedy`): what greedy drafting needs and nothing over
the vocabulary beyond it (no [R, V] distribution built or returned)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from dspark_trt.manifest import DRAFT_INPUTS, GREEDY_DRAFT_GRAPH, GREEDY_DRAFT_INPUTS, kv_names

PROMPTS = ["def fib(n):", "import os\n", "class Foo:"]


def _sessions(art: Path):
    import onnxruntime as ort

    m = json.loads((art / "manifest.json").read_text())
    return m, {g: ort.InferenceSession(str(art / m["graphs"][g]["file"]), providers=["CPUExecutionProvider"])
               for g in ("draft", GREEDY_DRAFT_GRAPH)}


def _feeds(m: dict, seed: int) -> dict:
    """A draft call over three requests (a 5-token catch-up, a 1-token and a 3-token one) at random past."""
    from dspark_trt.runtime.batch import pack_queries

    rng = np.random.default_rng(seed)
    vocab, slots = m["model"]["vocab_size"], m["limits"]["max_batch"]
    queries = [list(rng.integers(0, vocab, n)) for n in (5, 1, 3)]
    past_lens = [7, 3, 9]
    feeds = pack_queries(queries, past_lens, [2, 0, 5])
    feeds.update(temperature=np.zeros(3, np.float32), uniforms=np.full(3, 0.5, np.float32),
                 prev_survival=np.asarray([1.0, 0.6, 0.3], np.float32), draft_position=np.asarray([0, 1, 2], np.int64))
    d = m["draft"]
    shape = (max(past_lens), slots, d["num_kv_heads"], d["head_dim"])
    for name in kv_names(d["num_layers"], "past"):
        feeds[name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def test_a_fresh_export_has_the_greedy_draft_graph_hashed_and_checked(tiny_artifact):
    from dspark_trt.exporter.check import check_artifacts

    m = json.loads((Path(tiny_artifact) / "manifest.json").read_text())
    spec = m["graphs"][GREEDY_DRAFT_GRAPH]
    assert spec["file"] == "draft_greedy.onnx" and spec["file"] in m["files"]
    assert [io["name"] for io in spec["outputs"][:3]] == ["draft_token", "survival", "confidence_logit"]
    assert "draft_probs" not in {io["name"] for io in spec["outputs"]}
    assert {"temperature", "uniforms"}.isdisjoint(io["name"] for io in spec["inputs"])
    report = check_artifacts(tiny_artifact)
    assert report.ok, report.problems
    assert GREEDY_DRAFT_GRAPH in report.graphs


def test_check_catches_a_changed_greedy_draft_graph(tiny_artifact, tmp_path):
    from dspark_trt.exporter.check import check_artifacts

    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    with open(art / "draft_greedy.onnx", "ab") as f:
        f.write(b"\0")
    report = check_artifacts(art)
    assert any(p.startswith("draft_greedy.onnx:") for p in report.problems), report.problems


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_graph_returns_the_full_graphs_tokens_and_survivals(tiny_artifact, seed):
    """Same feeds (all rows greedy): the same argmax tokens, confidence (the head-less max-prob fallback,
    computed without a softmax over V) and survival within 1e-5, the same present KV."""
    m, sess = _sessions(Path(tiny_artifact))
    feeds = _feeds(m, seed)
    full = dict(zip([o.name for o in sess["draft"].get_outputs()], sess["draft"].run(None, feeds)))
    greedy_in = {k: v for k, v in feeds.items() if k in GREEDY_DRAFT_INPUTS or k.startswith("past_key_values.")}
    assert set(feeds) - set(greedy_in) == set(DRAFT_INPUTS) - set(GREEDY_DRAFT_INPUTS)
    out = sess[GREEDY_DRAFT_GRAPH]
    greedy = dict(zip([o.name for o in out.get_outputs()], out.run(None, greedy_in)))
    assert "draft_probs" not in greedy
    np.testing.assert_array_equal(greedy["draft_token"], full["draft_token"])
    np.testing.assert_allclose(greedy["confidence_logit"], full["confidence_logit"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(greedy["survival"], full["survival"], atol=1e-5, rtol=0)
    for name in kv_names(m["draft"]["num_layers"], "present"):
        np.testing.assert_allclose(greedy[name], full[name], atol=1e-6, rtol=0)


def test_greedy_step_with_a_confidence_head_matches_the_full_step():
    """The head path (with logit statistics) computes the same confidence in both flavours (eager torch)."""
    torch = pytest.importorskip("torch")
    from dspark_trt.exporter.graphs import DraftStep, GreedyDraftStep
    from dspark_trt.models.confidence_head import ConfidenceHead
    from dspark_trt.models.config import ModelConfig
    from dspark_trt.models.decoder import Decoder

    cfg = ModelConfig("llama", 97, 32, 64, 1, 2, 1, 16, tie_word_embeddings=True, max_position_embeddings=64)
    decoder = Decoder(cfg).init_weights(std=0.2, seed=3).eval()
    head = ConfidenceHead(32, 97, rank=8, max_draft=3, temperatures=[1.0, 1.5, 2.0],
                          stats=("log_max_prob", "entropy", "log_margin")).eval()
    with torch.no_grad():
        head.proj.weight.normal_(0, 0.3)
    full, greedy = DraftStep(decoder, head, head.temperatures), GreedyDraftStep(decoder, head, head.temperatures)
    m = {"model": {"vocab_size": 97}, "limits": {"max_batch": 6},
         "draft": {"num_kv_heads": 1, "head_dim": 16, "num_layers": 1}}
    feeds = {k: torch.from_numpy(v) for k, v in _feeds(m, 2).items()}
    past = [feeds.pop(n) for n in kv_names(1, "past")]
    with torch.no_grad():
        f = full(*(feeds[k] for k in DRAFT_INPUTS), *past)
        g = greedy(*(feeds[k] for k in GREEDY_DRAFT_INPUTS), *past)
    assert torch.equal(g[0], f[0])
    torch.testing.assert_close(g[1], f[2], atol=1e-5, rtol=0)  # survival
    torch.testing.assert_close(g[2], f[3], atol=1e-5, rtol=0)  # confidence logit
    assert len(g) == len(f) - 1  # no distribution


def test_greedy_generate_drafts_on_the_greedy_graph_only(tiny_artifact):
    from dspark_trt.runtime import GenerationConfig, Runtime

    with Runtime.load(tiny_artifact, backend="ort", profile="none") as rt:
        off = [r.token_ids for r in rt.generate(PROMPTS, GenerationConfig(max_new_tokens=16, spec="off"))]
        rt.backend.calls.clear()
        for spec in ("fixed:3", "adaptive"):
            got = [r.token_ids for r in rt.generate(PROMPTS, GenerationConfig(max_new_tokens=16, spec=spec))]
            assert got == off, spec
        calls = dict(rt.backend.calls)
    assert calls.get(GREEDY_DRAFT_GRAPH, 0) > 0 and calls.get("draft", 0) == 0, calls


def test_the_torch_backend_drafts_greedy_calls_on_the_greedy_module(tiny_artifact):
    """The eager reference runs the same two flavours (it builds them from the checkpoints)."""
    pytest.importorskip("torch")
    from dspark_trt.runtime import GenerationConfig, Runtime

    with Runtime.load(tiny_artifact, backend="torch", profile="none") as rt:
        off = [r.token_ids for r in rt.generate(PROMPTS[:2], GenerationConfig(max_new_tokens=12, spec="off"))]
        got = [r.token_ids for r in rt.generate(PROMPTS[:2], GenerationConfig(max_new_tokens=12, spec="fixed:3"))]
        calls = dict(rt.backend.calls)
    assert got == off
    assert calls.get(GREEDY_DRAFT_GRAPH, 0) > 0 and calls.get("draft", 0) == 0, calls


def test_a_step_mixing_greedy_and_sampled_rows_drafts_on_the_full_graph_and_stays_lossless(tiny_artifact):
    """Sampled rows need the distribution: a call holding one runs the full graph; the greedy rows beside
    them still produce the target's greedy text, and sampling with speculation follows the same draws."""
    from dspark_trt.runtime import GenerationConfig, Runtime

    greedy = GenerationConfig(max_new_tokens=16, spec="fixed:3")
    sampled = GenerationConfig(max_new_tokens=16, spec="fixed:3", temperature=0.8, seed=7)
    with Runtime.load(tiny_artifact, backend="ort", profile="none") as rt:
        want = [r.token_ids for r in rt.generate(PROMPTS, GenerationConfig(max_new_tokens=16, spec="off"))]
        rt.backend.calls.clear()
        out = rt.generate(PROMPTS + PROMPTS[:1], [greedy, greedy, greedy, sampled])
        calls = dict(rt.backend.calls)
    assert [r.token_ids for r in out[:3]] == want
    assert all(r.error is None for r in out) and len(out[3].token_ids) == 16
    assert calls.get("draft", 0) > 0, calls


def test_an_artifact_without_the_greedy_graph_still_runs(tiny_artifact, tmp_path):
    """Artifacts exported before the flavour existed: every draft call runs the full graph, output unchanged."""
    from dspark_trt.exporter.check import check_artifacts
    from dspark_trt.runtime import GenerationConfig, Runtime

    art = tmp_path / "old"
    shutil.copytree(tiny_artifact, art)
    m = json.loads((art / "manifest.json").read_text())
    del m["graphs"][GREEDY_DRAFT_GRAPH], m["files"]["draft_greedy.onnx"]
    (art / "manifest.json").write_text(json.dumps(m))
    (art / "draft_greedy.onnx").unlink()
    assert check_artifacts(art).ok
    cfg = GenerationConfig(max_new_tokens=16, spec="fixed:3")
    with Runtime.load(art, backend="ort", profile="none") as rt:
        assert not rt.backend.has_greedy_draft
        old = [r.token_ids for r in rt.generate(PROMPTS, cfg)]
        calls = dict(rt.backend.calls)
    with Runtime.load(tiny_artifact, backend="ort", profile="none") as rt:
        new = [r.token_ids for r in rt.generate(PROMPTS, cfg)]
    assert old == new
    assert calls.get("draft", 0) > 0 and GREEDY_DRAFT_GRAPH not in calls


def test_build_plans_an_engine_for_the_greedy_draft_graph(tiny_artifact, tmp_path):
    from dspark_trt.exporter.build import plan_build

    plan = plan_build(tiny_artifact, out_dir=tmp_path / "engines")
    assert list(plan["graphs"]) == ["draft", "target", GREEDY_DRAFT_GRAPH]
    g = plan["graphs"][GREEDY_DRAFT_GRAPH]
    assert g["engine"] == str(tmp_path / "engines" / "draft_greedy.engine")
    assert g["plugins"] == ["dspark::Survival"]
    assert set(g["profiles"][0]) == {io["name"] for io in
                                     json.loads((Path(tiny_artifact) / "manifest.json").read_text())
                                     ["graphs"][GREEDY_DRAFT_GRAPH]["inputs"]}
