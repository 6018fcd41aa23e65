"""The artifact manifest: load/save, validation, hashes, profiles."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from dspark_trt.errors import DsparkError
from dspark_trt.manifest import MANIFEST_VERSION, Manifest, sha256_file

K = 3


def sections() -> dict:
    return dict(
        model={"arch": "llama", "vocab_size": 32, "hidden_size": 8, "num_layers": 2, "num_kv_heads": 1,
               "head_dim": 8, "dtype": "fp16", "max_context": 128},
        draft={"arch": "llama", "hidden_size": 8, "num_layers": 1, "num_kv_heads": 1, "head_dim": 8,
               "max_draft": K, "confidence": "head", "temperatures": [1.0, 1.2, 1.5]},
        limits={"max_batch": 4, "max_context": 128, "max_draft": K, "max_tokens_per_step": 16},
        dims={"num_tokens": {"min": 1, "opt": 8, "max": 16}, "num_requests": {"min": 1, "opt": 2, "max": 4},
              "past_len": {"min": 0, "opt": 64, "max": 128}},
        graphs={
            "draft": {"file": "draft.onnx",
                      "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["num_tokens"]},
                                 {"name": "past_key_values.0.key", "dtype": "float16",
                                  "shape": ["num_requests", 1, "past_len", 8]}],
                      "outputs": [{"name": "logits", "dtype": "float16", "shape": ["num_tokens", 32]}]},
            "target": {"file": "target.onnx",
                       "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["num_tokens"]}],
                       "outputs": [{"name": "logits", "dtype": "float16", "shape": ["num_tokens", 32]}]},
        },
        tokenizer={"file": "tokenizer.json", "eos_token_id": None},
    )


@pytest.fixture
def art(tmp_path):
    for name, payload in (("draft.onnx", b"draft-bytes"), ("target.onnx", b"target-bytes" * 100),
                          ("tokenizer.json", b"{}")):
        (tmp_path / name).write_bytes(payload)
    m = Manifest.create(**sections())
    for name in ("draft.onnx", "target.onnx", "tokenizer.json"):
        m.record_file(tmp_path, name)
    m.save(tmp_path)
    return tmp_path


def test_roundtrip_and_fields(art):
    m = Manifest.load(art)
    assert m.validate() == []
    assert m["format"] == "dspark-trt-artifact" and m.format_version == MANIFEST_VERSION == 1
    assert m.path == art
    assert set(m.tools) >= {"dspark_trt", "torch", "onnx", "onnxscript", "onnxruntime"}
    assert m.model["dtype"] == "fp16" and m.limits["max_draft"] == K
    assert m.engines == {}
    raw = json.loads((art / "manifest.json").read_text())
    assert raw == m.data


def test_save_is_atomic_and_leaves_no_temp_files(art):
    m = Manifest.load(art)
    m.data["limits"]["max_batch"] = 8
    m.save()
    assert Manifest.load(art).limits["max_batch"] == 8
    assert sorted(p.name for p in art.iterdir() if p.name.startswith(".")) == []


def test_sha256_and_hashes(art):
    assert sha256_file(art / "draft.onnx") == hashlib.sha256(b"draft-bytes").hexdigest()
    m = Manifest.load(art)
    assert m.file_hashes()["target.onnx"] == hashlib.sha256(b"target-bytes" * 100).hexdigest()
    assert m.files["target.onnx"]["bytes"] == 1200
    assert m.verify_hashes(art) == []


def test_verify_hashes_reports_tamper_size_and_missing(art):
    m = Manifest.load(art)
    (art / "draft.onnx").write_bytes(b"draft-bytez")          # same size, different content
    (art / "target.onnx").write_bytes(b"short")               # different size
    os.remove(art / "tokenizer.json")
    problems = m.verify_hashes(art)
    assert len(problems) == 3
    assert any(p.startswith("draft.onnx:") and "sha256" in p for p in problems)
    assert any(p.startswith("target.onnx:") and "size" in p for p in problems)
    assert any(p.startswith("tokenizer.json:") and "missing" in p for p in problems)


def test_artifact_key_excludes_cost_profile(art):
    m = Manifest.load(art)
    key = m.artifact_key()
    (art / "cost_profile.json").write_text("{}")
    m.record_file(art, "cost_profile.json")
    assert m.artifact_key() == key
    assert set(key) == {"draft.onnx", "target.onnx", "tokenizer.json"}


def test_profiles_from_dims(art):
    m = Manifest.load(art)
    prof = m.profiles("draft")
    assert prof["input_ids"] == ((1,), (8,), (16,))
    assert prof["past_key_values.0.key"] == ((1, 1, 0, 8), (2, 1, 64, 8), (4, 1, 128, 8))
    assert m.profiles("target") == {"input_ids": ((1,), (8,), (16,))}


def test_load_errors_are_one_line_dsparkerrors(tmp_path):
    with pytest.raises(DsparkError, match="does not exist"):
        Manifest.load(tmp_path / "missing-dir")
    with pytest.raises(DsparkError, match="manifest.json not found"):
        Manifest.load(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(DsparkError, match="not valid JSON"):
        Manifest.load(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "something-else", "format_version": 1}))
    with pytest.raises(DsparkError, match="key 'format'"):
        Manifest.load(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "dspark-trt-artifact", "format_version": 2}))
    with pytest.raises(DsparkError, match="key 'format_version' is 2.*upgrade"):
        Manifest.load(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "dspark-trt-artifact"}))
    with pytest.raises(DsparkError, match="format_version"):
        Manifest.load(tmp_path)


def test_strict_load_names_the_problem(art):
    data = json.loads((art / "manifest.json").read_text())
    del data["model"]["vocab_size"]
    (art / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(DsparkError, match=r"model\.vocab_size"):
        Manifest.load(art)
    assert "model.vocab_size: missing or not an integer" in Manifest.load(art, strict=False).validate()


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d["dims"].__setitem__("num_tokens", {"min": 4, "opt": 2, "max": 16}), "dims.num_tokens: needs min <= opt <= max"),
    (lambda d: d["dims"].pop("past_len"), "dim 'past_len' is not defined"),
    (lambda d: d["model"].__setitem__("dtype", "fp64"), "model.dtype"),
    (lambda d: d["draft"].__setitem__("temperatures", [1.0]), "draft.temperatures: 1 values"),
    (lambda d: d["draft"].__setitem__("confidence", "maybe"), "draft.confidence"),
    (lambda d: d["limits"].__setitem__("max_draft", 5), "limits.max_draft"),
    (lambda d: d["graphs"].pop("target"), "graphs.target: missing"),
    (lambda d: d["graphs"]["draft"]["inputs"][0].__setitem__("dtype", "float64"), "graphs.draft.inputs.input_ids.dtype"),
    (lambda d: d["graphs"]["draft"]["inputs"][0].__setitem__("shape", [1.5]), "graphs.draft.inputs.input_ids.shape"),
    (lambda d: d["files"]["draft.onnx"].__setitem__("sha256", "xyz"), "files.draft.onnx.sha256"),
    (lambda d: d["files"].pop("draft.onnx"), "graphs.draft.file: 'draft.onnx' is not listed"),
    (lambda d: d["model"].__setitem__("num_layers", True), "model.num_layers"),
    (lambda d: d.pop("tokenizer"), "tokenizer: missing"),
    (lambda d: d.__setitem__("engines", {"draft": {"file": "engines/draft.engine"}}), "engines.draft.sha256"),
])
def test_validate_reports(art, mutate, needle):
    m = Manifest.load(art)
    mutate(m.data)
    problems = m.validate()
    assert any(needle in p for p in problems), problems


def test_record_engine_validates(art):
    m = Manifest.load(art)
    m.record_engine("draft", file="engines/draft.engine", sha256="a" * 64, tensorrt_version="10.9.0.34",
                    gpu_name="NVIDIA H200", compute_capability="9.0", plugin_mode="aot")
    assert m.validate() == []
    m.save()
    assert Manifest.load(art).engines["draft"]["compute_capability"] == "9.0"


def test_manifest_module_imports_without_heavy_deps():
    import subprocess
    import sys

    code = ("import sys; import dspark_trt.manifest, dspark_trt.runtime.engine_check; "
            "bad = [m for m in ('torch', 'onnx', 'tensorrt') if m in sys.modules]; print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_drafter_kind_defaults_to_classic_and_dspark_needs_its_facts():
    def draft_problems(m):
        return [p for p in m.validate() if p.startswith("draft")]

    old = Manifest.create(**sections())
    assert "kind" not in old.draft and old.drafter_kind == "classic" and draft_problems(old) == []
    s = sections()
    s["draft"]["kind"] = "dspark"
    m = Manifest.create(**s)
    assert m.drafter_kind == "dspark"
    assert draft_problems(m) == ["draft.dspark: missing or not an object (required when draft.kind is 'dspark')"]
    m.draft["dspark"] = {"kind": "dspark", "aux_layers": [2, 5], "num_draft": 3, "query_len": 3, "markov_rank": 8,
                         "draft_vocab_size": 32}
    assert draft_problems(m) == []
    m.draft["dspark"]["aux_layers"] = []
    m.draft["dspark"]["markov_rank"] = "8"
    assert draft_problems(m) == ["draft.dspark.markov_rank: missing or not an integer",
                            "draft.dspark.aux_layers: missing or not a non-empty list of layer capture points"]
    m.draft["kind"] = "eagle"
    assert draft_problems(m) == ["draft.kind: 'eagle', expected one of classic, dspark"]
