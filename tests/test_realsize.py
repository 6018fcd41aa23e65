"""Real-size checkpoints (issue 20): external weights, precisions, large vocabularies, the memory plan,
and the checkpoint layouts people ship (sharded, bf16 on disk, tied or not, EOS lists, chat templates)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import make_pair

from dspark_trt.errors import DsparkError


def _export(pair, out, **kw):
    from dspark_trt.exporter.export import export_artifacts

    kw = {"max_draft": 4, "max_batch": 4, "max_context": 128, "progress": False, **kw}
    return export_artifacts(pair[0], pair[1], out, **kw)


def _lossless(artifact, backend="ort", specs=("fixed:2", "adaptive"), tokens=20):
    """Greedy output of every speculative mode equals plain decoding's; returns the runtime's KV dtype."""
    from dspark_trt.runtime import GenerationConfig, Runtime

    prompts = ["def fib(n):", "import os\n", "class Foo:"]
    with Runtime.load(artifact, backend=backend, profile="none") as rt:
        off = rt.generate(prompts, GenerationConfig(max_new_tokens=tokens, temperature=0.0, spec="off"))
        assert all(r.error is None and len(r.token_ids) == tokens for r in off)
        for spec in specs:
            got = rt.generate(prompts, GenerationConfig(max_new_tokens=tokens, temperature=0.0, spec=spec))
            assert [r.token_ids for r in got] == [r.token_ids for r in off], spec
        return rt.target_kv.keys[0].dtype


# ------------------------------------------------------------------------------------- external data

@pytest.fixture(scope="module")
def external_artifact(tmp_path_factory):
    """The tiny pair with a list of EOS ids and a chat template, exported with --external-data always."""
    root = tmp_path_factory.mktemp("ext")
    pair = make_pair(root / "pair")
    (pair[0] / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 5], "bos_token_id": 0}))
    (pair[0] / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}))
    return _export(pair, root / "art", external_data="always")


def test_external_data_weights_sit_beside_each_graph_and_are_hashed(external_artifact):
    import onnx

    m = json.loads((external_artifact / "manifest.json").read_text())
    for graph in ("draft", "target"):
        data = f"{graph}.onnx.data"
        assert (external_artifact / data).stat().st_size > 100_000
        assert m["files"][data]["bytes"] == (external_artifact / data).stat().st_size
        model = onnx.load(str(external_artifact / f"{graph}.onnx"), load_external_data=False)
        big = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
        assert big and all(dict((kv.key, kv.value) for kv in t.external_data)["location"] == data for t in big)
        assert (external_artifact / f"{graph}.onnx").stat().st_size < (external_artifact / data).stat().st_size


def test_external_data_round_trips_export_check_generate(external_artifact):
    from dspark_trt.exporter.check import check_artifacts

    report = check_artifacts(external_artifact)
    assert report.problems == []
    _lossless(external_artifact)


def test_check_catches_a_changed_weights_file(external_artifact, tmp_path):
    from dspark_trt.exporter.check import check_artifacts

    copy = tmp_path / "art"
    shutil.copytree(external_artifact, copy)
    data = copy / "target.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[1000] ^= 0xFF
    data.write_bytes(bytes(raw))
    problems = check_artifacts(copy).problems
    assert any("target.onnx.data" in p and "sha256" in p for p in problems)


def test_external_data_modes():
    from dspark_trt.exporter.external_data import use_external

    assert use_external("always", 10) and not use_external("never", 10)
    assert not use_external("auto", 10 << 20) and use_external("auto", 3 << 30)
    with pytest.raises(DsparkError, match="over the 2 GB an ONNX file can hold inline: use --external-data auto"):
        use_external("never", 3 << 30)


def test_eos_list_special_tokens_and_chat_template_are_carried(external_artifact):
    from dspark_trt.exporter.tokenizer_files import read_chat_template
    from dspark_trt.runtime import Runtime

    m = json.loads((external_artifact / "manifest.json").read_text())
    tok = m["tokenizer"]
    assert tok["eos_token_ids"] == [0, 5] and tok["eos_token_id"] == 0
    assert tok["special_tokens"]["eos_token"] == {"content": "<|endoftext|>", "id": 0}
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (external_artifact / name).is_file() and name in m["files"]
    assert read_chat_template(external_artifact, tok).startswith("{% for m in messages %}")
    with Runtime.load(external_artifact, profile="none") as rt:
        assert rt.eos_ids == {0, 5}


# ------------------------------------------------------------------------------------- precisions

@pytest.mark.slow  # ~40-70 s: whole exports (default suite time)
def test_fp16_export_keeps_fp16_kv_and_generates_losslessly(tmp_path):
    pair = make_pair(tmp_path / "pair")
    art = _export(pair, tmp_path / "art", dtype="fp16")
    m = json.loads((art / "manifest.json").read_text())
    past = [i for i in m["graphs"]["target"]["inputs"] if i["name"].startswith("past_key_values")]
    assert {i["dtype"] for i in past} == {"float16"}
    assert _lossless(art, specs=("fixed:2",)) == np.float16


@pytest.mark.slow  # ~40-70 s: whole exports (default suite time)
def test_sharded_bf16_checkpoint_exports_bf16_which_ort_refuses_and_torch_runs(tmp_path):
    from dspark_trt.models.checkpoint import load_decoder
    from dspark_trt.runtime import Runtime

    pair = make_pair(tmp_path / "pair", dtype="bf16")
    # re-shard the bf16 target into several files with an index, as large checkpoints ship
    src = load_decoder(pair[0], "bf16")
    state = {k: v.clone() for k, v in src.state_dict().items() if k != "lm_head.weight"}
    (pair[0] / "model.safetensors").unlink()
    _write_shards(pair[0], state, shards=3)
    again = load_decoder(pair[0], "bf16")
    assert all((again.state_dict()[k] == v).all() for k, v in state.items())
    art = _export(pair, tmp_path / "art", dtype="bf16")
    with pytest.raises(DsparkError, match="bfloat16.*--backend trt"):
        Runtime.load(art, backend="ort", profile="none")
    assert _lossless(art, backend="torch", specs=("fixed:2",), tokens=12).name == "bfloat16"


def _write_shards(model_dir, state: dict, shards: int) -> None:
    from safetensors.torch import save_file

    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: state[k].contiguous() for k in part}, str(model_dir / fname))
        weight_map.update({k: fname for k in part})
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


# ------------------------------------------------------------------------------------- checkpoints

def _config(model_dir, **changes):
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_tied_and_untied_embeddings_load_both_ways(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from dspark_trt.models.checkpoint import load_decoder

    target, _ = make_pair(tmp_path / "pair")  # tied: no lm_head.weight on disk
    tied = load_decoder(target)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    state = load_file(str(target / "model.safetensors"))
    head = torch.randn_like(state["model.embed_tokens.weight"])
    save_file(dict(state, **{"lm_head.weight": head}), str(target / "model.safetensors"))
    assert load_decoder(target).lm_head.weight is not None  # tied config + a stored copy: the embedding wins
    _config(target, tie_word_embeddings=False)
    untied = load_decoder(target)
    assert torch.equal(untied.lm_head.weight, head)
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)
    save_file(state, str(target / "model.safetensors"))  # untied config, no lm_head on disk
    with pytest.raises(DsparkError, match="missing tensor 'lm_head.weight'.*tie_word_embeddings"):
        load_decoder(target)


@pytest.mark.parametrize("scaling, error", [
    ({"rope_type": "yarn", "factor": 4.0}, "rope_scaling.rope_type 'yarn' is not supported"),
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_scaling.rope_type 'dynamic' is not supported"),
    ({"rope_type": "llama3", "factor": 8.0}, "rope_scaling \\(llama3\\) is missing low_freq_factor"),
])
def test_unsupported_rope_scaling_is_refused_naming_the_field(tmp_path, scaling, error):
    from dspark_trt.models.config import load_config

    target, _ = make_pair(tmp_path / "pair")
    _config(target, rope_scaling=scaling)
    with pytest.raises(DsparkError, match=error):
        load_config(target)


def test_llama3_and_linear_rope_scaling_are_accepted(tmp_path):
    from dspark_trt.models.config import load_config

    target, _ = make_pair(tmp_path / "pair")
    _config(target, rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    assert load_config(target).rope_scaling["rope_type"] == "llama3"
    _config(target, rope_scaling={"type": "linear", "factor": 2.0})
    assert load_config(target).rope_scaling["rope_type"] == "linear"


def test_qwen2_sliding_window_exports_only_while_the_context_fits_the_window(tmp_path):
    pair = make_pair(tmp_path / "pair", arch="qwen2")
    for d in pair:
        _config(d, use_sliding_window=True, sliding_window=64, max_window_layers=1)
    with pytest.raises(DsparkError, match="sliding_window=64 .* shorter than --max-context 128: .* --max-context 64"):
        _export(pair, tmp_path / "art")
    for d in pair:  # Qwen2.5 ships use_sliding_window=false: the window is ignored, as transformers does
        _config(d, use_sliding_window=False, sliding_window=32768)
    from dspark_trt.models.config import load_config

    assert load_config(pair[0]).extra == {}


# ------------------------------------------------------------------------------------- large vocabulary

def test_llama3_vocab_128256_exports_and_generates_losslessly(tmp_path):
    pair = make_pair(tmp_path / "pair", vocab=128256)
    art = _export(pair, tmp_path / "art", max_batch=2)
    assert json.loads((art / "manifest.json").read_text())["model"]["vocab_size"] == 128256
    _lossless(art, tokens=12)


# ------------------------------------------------------------------------------------- memory plan

def _manifest(**limits):
    return {"limits": {"max_batch": 16, "max_context": 4096, "max_draft": 7, "max_tokens_per_step": 256, **limits},
            "model": {"dtype": "fp16", "vocab_size": 128256, "hidden_size": 2048, "num_layers": 16,
                      "num_kv_heads": 8, "head_dim": 64, "num_attention_heads": 32, "intermediate_size": 8192},
            "draft": {"num_layers": 2, "num_kv_heads": 8, "head_dim": 64},
            "files": {"target.onnx.data": {"bytes": 2_500_000_000}, "draft.onnx.data": {"bytes": 200_000_000}}}


def test_memory_plan_counts_weights_kv_and_activations():
    from dspark_trt.runtime.memory_plan import plan_memory

    plan = plan_memory(_manifest(), kv_itemsize=2, available=None)
    # KV: 2 (k, v) x (16 + 2 layers) x 4096 positions x 16 slots x 8 heads x 64 x 2 bytes
    assert plan.kv_cache == 2 * 18 * 4096 * 16 * 8 * 64 * 2
    assert plan.weights == 2_700_000_000 and plan.activations > 0 and plan.note is None


def test_memory_plan_lowers_max_batch_when_that_fits_and_says_so():
    from dspark_trt.runtime.memory_plan import plan_memory

    full = plan_memory(_manifest(), kv_itemsize=2, available=None)
    small = plan_memory(_manifest(), max_batch=1, kv_itemsize=2, available=None)
    room = int((small.total + (full.total - small.total) / 4) / 0.9)
    plan = plan_memory(_manifest(), kv_itemsize=2, available=room)
    assert 1 <= plan.max_batch < 16 and "max batch lowered from 16" in plan.note


def test_memory_plan_fails_in_one_line_naming_the_need_and_the_option():
    from dspark_trt.runtime.memory_plan import plan_memory

    with pytest.raises(DsparkError) as e:
        plan_memory(_manifest(), kv_itemsize=2, available=2 << 30)
    msg = str(e.value)
    assert "\n" not in msg and "needs" in msg and "GiB" in msg and "lower --max-context" in msg


def test_load_options_may_only_lower_the_exported_limits(tiny_artifact):
    from dspark_trt.runtime import Runtime

    with pytest.raises(DsparkError, match="--max-batch 9 exceeds the 8 the artifact was exported for"):
        Runtime.load(tiny_artifact, profile="none", max_batch=9)
    with pytest.raises(DsparkError, match="--max-context 512 exceeds the 256"):
        Runtime.load(tiny_artifact, profile="none", max_context=512)
    with Runtime.load(tiny_artifact, profile="none", max_context=64) as rt:
        assert rt.max_context == 64 and rt.target_kv.keys[0].shape[0] == 64


def test_runtime_load_refuses_an_artifact_that_does_not_fit(tiny_artifact, monkeypatch):
    from dspark_trt.runtime import Runtime

    monkeypatch.setenv("DSPARK_MEMORY_LIMIT_GB", "0.001")
    with pytest.raises(DsparkError, match="the artifact needs .* GiB .* but 0.00 GiB is available"):
        Runtime.load(tiny_artifact, profile="none")


# ------------------------------------------------------------------------------------- start-up profile

def test_a_quick_profile_is_replaced_by_its_refined_tables_at_close(tmp_path):
    from types import SimpleNamespace

    from dspark_trt.runtime.costs.table import CostTable
    from dspark_trt.runtime.costs.profiling import persist_refined, profile_path

    verify, draft = np.arange(33, dtype=float) * 10.0, np.arange(9, dtype=float)
    rt = SimpleNamespace(artifact_dir=tmp_path, backend=SimpleNamespace(name="ort"),
                         cost=CostTable(verify, draft, {"quick": True}))
    for _ in range(40):  # real calls take twice the quick profile's estimate
        rt.cost.observe_verify(8, 160.0)
        rt.cost.observe_draft(4, 8.0)
    saved = CostTable.load(persist_refined(rt))
    assert saved.meta["quick"] and saved.meta["refined_observations"] >= 16
    assert saved.verify_ms(8, corrected=False) > 1.5 * 80.0
    full = SimpleNamespace(artifact_dir=tmp_path / "x", backend=rt.backend, cost=CostTable(verify, draft, {}))
    assert persist_refined(full) is None and not profile_path(full.artifact_dir, "ort").exists()
