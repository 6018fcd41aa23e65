"""Exported graphs: ONNX Runtime agrees with the torch modules, and the artifact is well formed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspark_trt.errors import DsparkError
from dspark_trt.runtime.batch import pack_queries, verify_rows


def _feeds(manifest, vocab, rng):
    queries = [list(rng.integers(0, vocab, n)) for n in (5, 1, 3)]
    past = [7, 12, 0]
    slots = manifest["limits"]["max_batch"]
    feeds = pack_queries(queries, past, [slots - 1, 0, 1])
    vl = np.array([2, 0, 1])
    feeds["verify_index"] = verify_rows(feeds["query_lens"], vl)
    m = len(feeds["verify_index"])
    feeds.update(verify_lens=vl, draft_tokens=rng.integers(0, vocab, m), draft_probs=np.full((m, vocab), 1.0 / vocab, np.float32),
                 temperature=np.array([0.0, 0.8, 1.0], np.float32), accept_uniforms=rng.random(m, dtype=np.float32),
                 sample_uniforms=rng.random(3, dtype=np.float32))
    m_ = manifest["model"]
    shape = (max(past), manifest["limits"]["max_batch"], m_["num_kv_heads"], m_["head_dim"])
    kv = [rng.standard_normal(shape).astype(np.float32) for _ in range(2 * m_["num_layers"])]
    return feeds, kv


def _compare(artifact, rng_seed=0):
    import onnxruntime as ort
    import torch

    from dspark_trt.exporter.build_modules import build_steps
    from dspark_trt.manifest import TARGET_INPUTS

    manifest = json.loads((artifact / "manifest.json").read_text())
    vocab = manifest["model"]["vocab_size"]
    feeds, kv = _feeds(manifest, vocab, np.random.default_rng(rng_seed))
    sess = ort.InferenceSession(str(artifact / "target.onnx"), providers=["CPUExecutionProvider"])
    names = [f"past_key_values.{i}.{k}" for i in range(manifest["model"]["num_layers"]) for k in ("key", "value")]
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {**feeds, **dict(zip(names, kv))})))
    _, target = build_steps(manifest)
    target.debug_logits = True
    with torch.no_grad():
        ref = target(*[torch.from_numpy(np.asarray(feeds[k])) for k in TARGET_INPUTS], *[torch.from_numpy(k) for k in kv])
    ref_logits = ref[-1].numpy()
    assert np.abs(outs["logits"] - ref_logits).max() <= 1e-4
    assert (outs["accepted"] == ref[0].numpy()).all() and (outs["next_token"] == ref[1].numpy()).all()
    for i, name in enumerate(names):  # new KV entries
        assert np.abs(outs[name.replace("past_key_values", "present")] - ref[2 + i].numpy()).max() <= 1e-4


def test_target_logits_match_torch(tiny_artifact):
    _compare(tiny_artifact)


def test_checker_and_manifest(tiny_artifact):
    import onnx

    for g in ("draft.onnx", "draft_greedy.onnx", "target.onnx"):
        onnx.checker.check_model(str(tiny_artifact / g), full_check=True)
    m = json.loads((tiny_artifact / "manifest.json").read_text())
    assert m["format_version"] == 1 and m["limits"]["max_draft"] == 4
    assert {i["name"] for i in m["graphs"]["target"]["outputs"]} >= {"accepted", "next_token", "present.0.key"}
    assert set(m["files"]) == {"draft.onnx", "draft_greedy.onnx", "target.onnx", "draft.ort.onnx",
                               "draft_greedy.ort.onnx", "target.ort.onnx", "target.decode.ort.onnx",
                               "draft.decode.ort.onnx", "draft_greedy.decode.ort.onnx", "tokenizer.json",
                               "target.greedy.ort.onnx", "target.decode.greedy.ort.onnx"}
    from dspark_trt.exporter.check import check_artifacts

    report = check_artifacts(tiny_artifact)
    assert report.ok, report.problems


def test_verify_cost_grows_with_verified_tokens(tiny_artifact):
    """The linear layers see only the packed real tokens, so more verified tokens cost more."""
    import onnx

    model = onnx.load(str(tiny_artifact / "target.onnx"))
    tokens = next(i for i in model.graph.input if i.name == "tokens")
    assert tokens.type.tensor_type.shape.dim[0].dim_param == "num_tokens"


def test_export_refuses_to_overwrite(tiny_pair, tiny_artifact):
    from dspark_trt.exporter.export import export_artifacts

    with pytest.raises(DsparkError, match="--force"):
        export_artifacts(tiny_pair[0], tiny_pair[1], tiny_artifact, progress=False)


def test_export_cli_errors_are_one_line(tmp_path, tiny_pair):
    from click.testing import CliRunner

    from dspark_trt.cli import main

    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "dspark_trt.cli", "export", "--target", str(tmp_path / "nope"),
                          "--draft", str(tiny_pair[1]), "--out", str(tmp_path / "a")], capture_output=True, text=True)
    assert out.returncode == 1
    assert out.stderr.strip().startswith("error: --target directory") and "Traceback" not in out.stderr
    del CliRunner, main


def test_mismatched_vocab_is_rejected(tmp_path, tiny_pair):
    import shutil

    from dspark_trt.exporter.export import export_artifacts

    bad = tmp_path / "draft"
    shutil.copytree(tiny_pair[1], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["vocab_size"] += 5
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DsparkError, match="vocab_size"):
        export_artifacts(tiny_pair[0], bad, tmp_path / "out", progress=False)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_other_families_export_and_match(arch, tmp_path):
    from conftest import make_pair

    from dspark_trt.exporter.export import export_artifacts
    from dspark_trt.runtime import GenerationConfig, Runtime

    t, d = make_pair(tmp_path / "pair", arch=arch)
    art = export_artifacts(t, d, tmp_path / "art", max_draft=3, max_batch=4, max_context=128, progress=False,
                           debug_logits=True)
    _compare(art)
    cfg = GenerationConfig(max_new_tokens=64, spec="adaptive")
    with Runtime.load(art, profile="none") as ort_rt, Runtime.from_checkpoints(t, d, max_draft=3, max_batch=4,
                                                                              max_context=128) as ref:
        assert ort_rt.generate(["def f(x):"], cfg)[0].token_ids == ref.generate(["def f(x):"], GenerationConfig(max_new_tokens=64, spec="off"))[0].token_ids


@pytest.fixture(scope="module")
def stats_head_artifact(tiny_pair, tmp_path_factory):
    """The tiny pair with a random confidence head that also reads the draft statistics."""
    import torch

    from dspark_trt.exporter.export import export_artifacts
    from dspark_trt.models.confidence_head import DRAFT_STATS, ConfidenceHead

    root = tmp_path_factory.mktemp("stats-head")
    head = ConfidenceHead(64, json.loads((tiny_pair[1] / "config.json").read_text())["vocab_size"], rank=2,
                          max_draft=4, temperatures=[1.0, 1.3, 0.8, 1.1], stats=DRAFT_STATS)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        head.proj.weight.copy_(torch.randn(head.proj.weight.shape, generator=g) * 0.3)
        head.proj.bias.fill_(0.5)
    head.save(root / "head")
    return export_artifacts(tiny_pair[0], tiny_pair[1], root / "art", head_dir=root / "head", max_draft=4,
                            max_batch=8, max_context=256, progress=False)


def test_head_with_draft_stats_exports_and_matches_torch(stats_head_artifact):
    import onnxruntime as ort
    import torch

    from dspark_trt.exporter.build_modules import build_steps
    from dspark_trt.manifest import DRAFT_INPUTS

    art = stats_head_artifact
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["draft"]["confidence"] == "head"
    rng = np.random.default_rng(0)
    vocab = manifest["model"]["vocab_size"]
    feeds = pack_queries([list(rng.integers(0, vocab, n)) for n in (3, 1, 2)], [4, 9, 0], [2, 0, 5])
    feeds.update(temperature=np.array([0.0, 0.7, 1.0], np.float32), uniforms=rng.random(3, dtype=np.float32),
                 prev_survival=np.array([1.0, 0.6, 0.3], np.float32), draft_position=np.array([0, 1, 3]))
    d = manifest["draft"]
    kv = [rng.standard_normal((9, 8, d["num_kv_heads"], d["head_dim"])).astype(np.float32)
          for _ in range(2 * d["num_layers"])]
    names = [f"past_key_values.{i}.{k}" for i in range(d["num_layers"]) for k in ("key", "value")]
    sess = ort.InferenceSession(str(art / "draft.onnx"), providers=["CPUExecutionProvider"])
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {**feeds, **dict(zip(names, kv))})))
    draft, _ = build_steps(manifest)
    assert draft.head.stats
    with torch.no_grad():
        ref = draft(*[torch.from_numpy(np.asarray(feeds[k])) for k in DRAFT_INPUTS], *[torch.from_numpy(k) for k in kv])
    assert (outs["draft_token"] == ref[0].numpy()).all()
    assert np.abs(outs["confidence_logit"] - ref[3].numpy()).max() <= 1e-4
    assert np.abs(outs["survival"] - ref[2].numpy()).max() <= 1e-5
    assert np.ptp(outs["confidence_logit"]) > 1e-3  # the head is not a constant


def test_head_with_draft_stats_is_lossless_in_the_runtime(stats_head_artifact):
    from dspark_trt.runtime import GenerationConfig, Runtime

    rt = Runtime.load(stats_head_artifact, profile="none")
    try:
        prompts = ["def fib(n):", "import os\n", "class Foo:"]
        off = rt.generate(prompts, GenerationConfig(max_new_tokens=24, spec="off"))
        ada = rt.generate(prompts, GenerationConfig(max_new_tokens=24, spec="adaptive"))
        assert [o.token_ids for o in ada] == [o.token_ids for o in off]
    finally:
        rt.close()
