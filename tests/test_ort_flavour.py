"""The ORT flavour (draft.ort.onnx / target.ort.onnx, exporter/ort_flavour.py) computes what the standard
graphs compute, is what the ORT backend runs, is recorded and hashed in the manifest, and artifacts
without it still load and run the standard graphs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from collections import Counter

import numpy as np
import pytest

from dspark_trt.errors import DsparkError
from dspark_trt.runtime.batch import pack_queries, verify_rows


def _session(path):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _run(path, feeds, kv, layers):
    sess = _session(path)
    names = [f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {**feeds, **dict(zip(names, kv))})))


def _kv(rng, past, slots, facts):
    shape = (past, slots, facts["num_kv_heads"], facts["head_dim"])
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(2 * facts["num_layers"])]


def target_parity(art, seed=0):
    """Largest |fused - standard| over logits and new KV entries of one packed verify step, after
    checking the acceptance outputs are equal (ragged queries, a fresh request, the last slot)."""
    m = json.loads((art / "manifest.json").read_text())
    rng = np.random.default_rng(seed)
    vocab, slots = m["model"]["vocab_size"], m["limits"]["max_batch"]
    feeds = pack_queries([list(rng.integers(0, vocab, n)) for n in (5, 1, 3)], [7, 12, 0], [slots - 1, 0, 1])
    vl = np.array([2, 0, 1])
    feeds["verify_index"] = verify_rows(feeds["query_lens"], vl)
    rows = len(feeds["verify_index"])
    feeds.update(verify_lens=vl, draft_tokens=rng.integers(0, vocab, rows),
                 draft_probs=np.full((rows, vocab), 1.0 / vocab, np.float32),
                 temperature=np.array([0.0, 0.8, 1.0], np.float32), accept_uniforms=rng.random(rows, dtype=np.float32),
                 sample_uniforms=rng.random(3, dtype=np.float32))
    kv = _kv(rng, 12, slots, m["model"])
    std = _run(art / m["graphs"]["target"]["file"], feeds, kv, m["model"]["num_layers"])
    fused = _run(art / m["graphs"]["target"]["ort"]["file"], feeds, kv, m["model"]["num_layers"])
    assert set(fused) == set(std)
    for name in ("accepted", "next_token"):
        assert (fused[name] == std[name]).all(), name
    return max(float(np.abs(fused[k] - std[k]).max()) for k in std if k not in ("accepted", "next_token"))


def draft_parity(art, seed=0):
    m = json.loads((art / "manifest.json").read_text())
    rng = np.random.default_rng(seed)
    vocab, slots = m["model"]["vocab_size"], m["limits"]["max_batch"]
    feeds = pack_queries([list(rng.integers(0, vocab, n)) for n in (3, 1, 2)], [4, 9, 0], [2, 0, slots - 1])
    feeds.update(temperature=np.array([0.0, 0.7, 1.0], np.float32), uniforms=rng.random(3, dtype=np.float32),
                 prev_survival=np.array([1.0, 0.6, 0.3], np.float32), draft_position=np.array([0, 1, 3]))
    kv = _kv(rng, 9, slots, m["draft"])
    std = _run(art / m["graphs"]["draft"]["file"], feeds, kv, m["draft"]["num_layers"])
    fused = _run(art / m["graphs"]["draft"]["ort"]["file"], feeds, kv, m["draft"]["num_layers"])
    assert (fused["draft_token"] == std["draft_token"]).all()
    return max(float(np.abs(fused[k] - std[k]).max()) for k in std if k != "draft_token")


def test_fused_graphs_match_the_standard_graphs(tiny_artifact):
    assert target_parity(tiny_artifact) <= 1e-4
    assert draft_parity(tiny_artifact) <= 1e-4


def test_fused_graphs_have_fewer_nodes_and_use_the_contrib_ops(tiny_artifact):
    import onnx

    m = json.loads((tiny_artifact / "manifest.json").read_text())
    for graph in ("draft", "target"):
        std = onnx.load(str(tiny_artifact / m["graphs"][graph]["file"]))
        fused = onnx.load(str(tiny_artifact / m["graphs"][graph]["ort"]["file"]))
        ops = Counter(f"{n.domain}:{n.op_type}" for n in fused.graph.node)
        assert len(fused.graph.node) < 0.8 * len(std.graph.node), graph
        assert ops["com.microsoft:SkipSimplifiedLayerNormalization"] == 2 * m[graph if graph == "draft" else "model"]["num_layers"]
        assert ops["com.microsoft:RotaryEmbedding"] > 0 and ops[":SimplifiedLayerNormalization"] == 1
        # the acceptance ops and their function bodies travel unchanged
        assert {f.name for f in fused.functions} == {f.name for f in std.functions}
        assert [n.op_type for n in fused.graph.node if n.domain == "dspark"] == \
            [n.op_type for n in std.graph.node if n.domain == "dspark"]


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


@pytest.mark.parametrize("arch,extra", [("llama", {}), ("llama", {"rope_scaling": LLAMA3_ROPE}),
                                        ("qwen2", {}), ("qwen3", {"qk_norm": True, "attention_bias": True})])
def test_fused_decoder_computes_the_packed_decoder_in_torch(arch, extra):
    """The flavour's math in eager torch (each contrib op's torch twin), for every family's options:
    biases on q/k/v (and o), q/k norms, scaled rotary; ragged queries, a fresh request, grouped KV heads."""
    import torch

    from dspark_trt.models.config import ModelConfig
    from dspark_trt.models.decoder import Decoder, PackedBatch, make_packed_index
    from dspark_trt.models.ort_fused import FusedDecoder

    cfg = ModelConfig(arch, 97, 64, 96, 2, 4, 2, 24, max_position_embeddings=256, **extra)
    dec = Decoder(cfg).init_weights(std=0.08, seed=0).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # random biases and norm weights, so every parameter matters
        for name, p in dec.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    fused = FusedDecoder(dec, 256).eval()
    query_lens, past_lens, slots, p = [3, 1, 2], [4, 7, 0], [3, 0, 4], 8
    pack, unpack = make_packed_index(query_lens)
    past = [[torch.randn(p, 5, 2, 24, generator=g) for _ in range(2)] for _ in range(2)]
    batch = PackedBatch(torch.randint(0, 97, (6,), generator=g),
                        torch.tensor([q0 + j for n, q0 in zip(query_lens, past_lens) for j in range(n)]), pack, unpack,
                        torch.tensor(query_lens), torch.tensor(past_lens), torch.tensor(slots), past[0], past[1])
    with torch.no_grad():
        (h, ks, vs), (fh, fks, fvs) = dec.forward_packed(batch), fused.forward_packed(batch)
    assert (h - fh).abs().max() <= 1e-5
    assert max((a - b).abs().max() for a, b in zip(ks + vs, fks + fvs)) <= 1e-5
    with torch.no_grad():  # a DSpark drafter's capture points: embeddings, a middle layer, the last layer
        aux, faux = dec.forward_packed(batch, aux_layers=(0, 2, 1))[-1], fused.forward_packed(batch, (0, 2, 1))[-1]
    assert faux.shape == (6, 3 * 64) and (aux - faux).abs().max() <= 1e-5
    with pytest.raises(DsparkError, match="capture point 3 is outside"):
        fused.forward_packed(batch, aux_layers=(3,))


@pytest.mark.slow
def test_qwen3_gqa_pair_fused_matches_standard(tmp_path):
    """Grouped-query attention (4 heads over 2 KV heads) with q/k norms, through the whole export."""
    from conftest import make_pair

    from dspark_trt.exporter.export import export_artifacts

    t, d = make_pair(tmp_path / "pair", arch="qwen3")
    art = export_artifacts(t, d, tmp_path / "art", max_draft=3, max_batch=4, max_context=64, progress=False,
                           debug_logits=True)
    cfg = json.loads((t / "config.json").read_text())
    assert cfg["num_attention_heads"] > cfg["num_key_value_heads"]
    assert target_parity(art, seed=1) <= 1e-4
    assert draft_parity(art, seed=1) <= 1e-4


@pytest.mark.slow
def test_bundled_target_fused_matches_standard(tmp_path):
    from pathlib import Path

    from dspark_trt.exporter.export import export_artifacts

    models = Path(__file__).resolve().parents[1] / "examples" / "models"
    art = export_artifacts(models / "stdlib-target", models / "stdlib-draft", tmp_path / "art", max_draft=4,
                           max_batch=8, max_context=256, progress=False, debug_logits=True)
    assert target_parity(art) <= 1e-4
    assert draft_parity(art) <= 1e-4


def _generate(art, monkeypatch, graphs: str):
    from dspark_trt.runtime import GenerationConfig, Runtime

    monkeypatch.setenv("DSPARK_ORT_GRAPHS", graphs)
    prompts = ["def fib(n):", "import os\n", "class Foo:"]
    with Runtime.load(art, profile="none") as rt:
        files = dict(rt.backend.files)
        out = {spec: [o.token_ids for o in rt.generate(prompts, GenerationConfig(max_new_tokens=24, spec=spec))]
               for spec in ("off", "adaptive")}
    return files, out


def test_greedy_is_identical_with_either_flavour(tiny_artifact, monkeypatch):
    files, fused = _generate(tiny_artifact, monkeypatch, "auto")
    assert files == {"draft": "draft.ort.onnx", "draft_greedy": "draft_greedy.ort.onnx", "target": "target.ort.onnx"}
    std_files, std = _generate(tiny_artifact, monkeypatch, "standard")
    assert std_files == {"draft": "draft.onnx", "draft_greedy": "draft_greedy.onnx", "target": "target.onnx"}
    assert fused == std
    assert fused["adaptive"] == fused["off"]


def test_manifest_records_and_hashes_the_flavour(tiny_artifact, tmp_path):
    from dspark_trt.manifest import Manifest

    m = Manifest.load(tiny_artifact)
    for graph in ("draft", "draft_greedy", "target"):
        entry = dict(m.graphs[graph]["ort"])
        # and its decoding graph (test_ort_decode.py), hashed too
        assert entry.pop("decode") == f"{graph}.decode.ort.onnx" and f"{graph}.decode.ort.onnx" in m.files
        if graph == "target":  # and the all-greedy twins of both (test_ort_greedy_target.py)
            assert {entry.pop("greedy"), entry.pop("decode_greedy")} <= set(m.files)
        assert entry == {"file": f"{graph}.ort.onnx", "flavour": "fused"}
        assert entry["file"] in m.files and m.files[entry["file"]]["sha256"]
    assert m.verify_hashes() == []
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    (art / "target.ort.onnx").write_bytes(b"changed")
    assert any("target.ort.onnx" in p for p in Manifest.load(art).verify_hashes())
    data = m.to_dict()
    data["files"].pop("draft.ort.onnx")
    data["graphs"]["target"]["ort"]["flavour"] = "turbo"
    problems = Manifest.from_dict(data).validate()
    assert any(p.startswith("graphs.draft.ort.file") and "no hash" in p for p in problems)
    assert any(p.startswith("graphs.target.ort.flavour") for p in problems)


def test_memory_plan_counts_the_weights_once(tiny_artifact):
    from dspark_trt.runtime.memory_plan import weight_bytes

    m = json.loads((tiny_artifact / "manifest.json").read_text())
    standard = sum((tiny_artifact / m["graphs"][g]["file"]).stat().st_size
                   for g in ("draft", "draft_greedy", "target"))  # the greedy draft is a session of its own
    assert weight_bytes(tiny_artifact, m) == standard


def test_an_artifact_without_the_flavour_loads_the_standard_graphs(tiny_artifact, tmp_path, monkeypatch):
    """What an export from before the flavour existed (or with --ort-flavour none) looks like."""
    art = tmp_path / "old"
    shutil.copytree(tiny_artifact, art)
    data = json.loads((art / "manifest.json").read_text())
    for graph in ("draft", "draft_greedy", "target"):
        data["files"].pop(data["graphs"][graph].pop("ort")["file"])
        (art / f"{graph}.ort.onnx").unlink()
    (art / "manifest.json").write_text(json.dumps(data))
    files, old = _generate(art, monkeypatch, "auto")
    assert files == {"draft": "draft.onnx", "draft_greedy": "draft_greedy.onnx", "target": "target.onnx"}
    assert old == _generate(tiny_artifact, monkeypatch, "auto")[1]


def test_flavour_choices_are_checked(tiny_pair, tmp_path, monkeypatch):
    from dspark_trt.exporter.export import export_artifacts
    from dspark_trt.runtime.backends.ort import graph_flavour

    with pytest.raises(DsparkError, match="--ort-flavour 'turbo'"):
        export_artifacts(tiny_pair[0], tiny_pair[1], tmp_path / "a", ort_flavour="turbo", progress=False)
    monkeypatch.setenv("DSPARK_ORT_GRAPHS", "fast")
    with pytest.raises(DsparkError, match="DSPARK_ORT_GRAPHS='fast'"):
        graph_flavour()


# ------------------------------------------------------------------ DSpark artifacts: the target's ORT flavour
@pytest.fixture(scope="module")
def dspark_artifact(tmp_path_factory):
    from tests.dspark_fixtures import ARTIFACT_VARIANTS, cached_artifact

    return cached_artifact(tmp_path_factory, "full", **ARTIFACT_VARIANTS["full"])


def test_dspark_target_flavour_matches_the_standard_graph_aux_outputs_included(dspark_artifact):
    from dspark_trt.manifest import Manifest

    m = Manifest.load(dspark_artifact)
    for graph, file in (("target", "target_aux.ort.onnx"), ("draft", "dspark_draft.ort.onnx"),
                        ("draft_sample", "dspark_draft_sample.ort.onnx")):
        entry = dict(m.graphs[graph]["ort"])
        if graph == "target":  # and its decode graph (test_ort_decode.py) and their greedy twins, hashed too
            for key in ("decode", "greedy", "decode_greedy"):
                assert m.files[entry.pop(key)]["sha256"]
        assert entry == {"file": file, "flavour": "fused"}
        assert m.files[file]["sha256"]
    assert "ort" not in m.graphs["dspark_context"] and m.verify_hashes() == []
    assert "aux_hidden" in [o["name"] if isinstance(o, dict) else o for o in m.graphs["target"]["outputs"]]
    assert target_parity(dspark_artifact) <= 1e-4


def dspark_draft_parity(art, graph: str, seed=0):
    """Largest |fused - standard| over the float outputs of one block pass (ragged context lengths, slots
    out of order), after checking the draft tokens are equal."""
    m = json.loads((art / "manifest.json").read_text())
    rng = np.random.default_rng(seed)
    sess = {k: _session(art / f) for k, f in (("std", m["graphs"][graph]["file"]),
                                                  ("fused", m["graphs"][graph]["ort"]["file"]))}
    past = [i for i in sess["std"].get_inputs() if i.name.startswith("past_key_values.")]
    slots, kvh, d = m["limits"]["max_batch"], past[0].shape[2], past[0].shape[3]
    feeds = {i.name: rng.standard_normal((11, slots, kvh, d)).astype(np.float32) for i in past}
    feeds.update(anchor=rng.integers(0, m["model"]["vocab_size"], 3), past_lens=np.array([11, 1, 6]),
                 slot_ids=np.array([slots - 1, 0, 2]))
    if graph == "draft_sample":
        feeds.update(temperature=np.array([0.0, 0.7, 1.0], np.float32),
                     uniforms=rng.random((3, m["draft"]["max_draft"]), dtype=np.float32))
    out = {k: dict(zip([o.name for o in s.get_outputs()], s.run(None, feeds))) for k, s in sess.items()}
    assert (out["fused"]["draft_tokens"] == out["std"]["draft_tokens"]).all()
    return max(float(np.abs(out["fused"][k] - out["std"][k]).max()) for k in out["std"] if k != "draft_tokens")


def test_dspark_drafter_flavour_matches_the_standard_graphs(dspark_artifact):
    import onnx

    m = json.loads((dspark_artifact / "manifest.json").read_text())
    for graph in ("draft", "draft_sample"):
        assert dspark_draft_parity(dspark_artifact, graph) <= 1e-4, graph
        std = onnx.load(str(dspark_artifact / m["graphs"][graph]["file"]))
        fused = onnx.load(str(dspark_artifact / m["graphs"][graph]["ort"]["file"]))
        assert len(fused.graph.node) < len(std.graph.node)
        assert [n.op_type for n in fused.graph.node if n.domain == "dspark"] == \
            [n.op_type for n in std.graph.node if n.domain == "dspark"]


def test_dspark_greedy_is_identical_with_either_flavour(dspark_artifact, monkeypatch):
    from dspark_trt.runtime.dspark_drafting import DsparkDrafting

    for graphs, suffix in (("auto", ".ort.onnx"), ("standard", ".onnx")):
        monkeypatch.setenv("DSPARK_ORT_GRAPHS", graphs)
        d = DsparkDrafting.from_artifact(dspark_artifact)
        files = [Path(d.graphs.sessions[g]._model_path).name for g in ("draft", "draft_sample")]
        assert files == [f"dspark_draft{suffix}", f"dspark_draft_sample{suffix}"], graphs
    files, fused = _generate(dspark_artifact, monkeypatch, "auto")
    assert files == {"target": "target_aux.ort.onnx"}
    std_files, std = _generate(dspark_artifact, monkeypatch, "standard")
    assert std_files == {"target": "target_aux.onnx"}
    assert fused == std
    assert fused["adaptive"] == fused["off"]


@pytest.mark.parametrize("causal,v_scale", [(False, None), (True, 0.5)])
def test_fused_dspark_block_computes_the_drafters_block_in_torch(tmp_path, causal, v_scale):
    """The drafter's block pass in the ORT flavour (eager torch): ragged context lengths, slots out of
    order, q/k norms (qwen3 layers), grouped KV heads, a causal or full block, scaled values."""
    import torch

    from dspark_trt.models.dspark_drafter import load_dspark_drafter
    from dspark_trt.models.ort_fused_dspark import FusedDsparkBlock
    from tests.dspark_fixtures import make_draft, make_target

    extra = {} if v_scale is None else {"dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": 5,
                                                          "causal": causal, "attention_value_scale": v_scale}}
    target = make_target(tmp_path / "target")
    drafter = load_dspark_drafter(make_draft(tmp_path, causal=causal, **extra), target).eval()
    assert drafter.cfg.causal == causal and drafter.cfg.v_scale == v_scale
    fused = FusedDsparkBlock(drafter, 64).eval()
    g = torch.Generator().manual_seed(0)
    lc = drafter.cfg.layers
    past_k, past_v = ([torch.randn(9, 5, lc.num_key_value_heads, lc.head_dim, generator=g) for _ in drafter.layers]
                      for _ in range(2))
    q = drafter.cfg.query_len
    tokens = torch.randint(0, lc.vocab_size, (3, q), generator=g)
    slot_ids, past_lens = torch.tensor([4, 0, 2]), torch.tensor([9, 1, 5])
    with torch.no_grad():
        want = drafter.block(tokens, past_k, past_v, slot_ids, past_lens)
        got = fused(tokens, past_k, past_v, slot_ids, past_lens)
    assert got.shape == want.shape and (got - want).abs().max() <= 1e-5
