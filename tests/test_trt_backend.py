"""TensorRT backend: pure binding/shape logic, the device KV cache, and the whole backend on CPU tensors.

TensorRT is not installed here, so:
- the "not installed" path is tested for real (TrtBackend, Runtime.load and the CLI);
- the binding logic runs through `TrtBackend.from_contexts` with `FakeContext`, a stand-in for
  IExecutionContext that implements the four calls the backend makes (set_input_shape, get_tensor_shape,
  set_tensor_address, execute_async_v3) by reading inputs from, and writing outputs to, the bound addresses
  of CPU tensors. It computes a toy model whose outputs depend on the KV cache contents, so the same toy run
  on the host (numpy KVCache) must give identical results;
- engine build + load + greedy parity with ONNX Runtime is `@pytest.mark.trt` (GPU with TensorRT only).
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dspark_trt.errors import DsparkError
from dspark_trt.runtime.backends import trt as tb
from dspark_trt.runtime.backends import trt_io as tio
from dspark_trt.runtime.backends.device_kv import PresentList, aligned_elems

REPO = Path(__file__).resolve().parents[1]
HAVE_TRT = importlib.util.find_spec("tensorrt") is not None

V, LAYERS, KVH, HD, SLOTS, CTX, K = 40, 2, 2, 4, 4, 64, 3
FEED_SHAPES = {
    "tokens": ["num_tokens"], "positions": ["num_tokens"], "pack_index": ["num_requests", "query_len"],
    "unpack_index": ["num_tokens"], "query_lens": ["num_requests"], "past_lens": ["num_requests"],
    "slot_ids": ["num_requests"], "temperature": ["num_requests"], "uniforms": ["num_requests"],
    "prev_survival": ["num_requests"], "draft_position": ["num_requests"], "verify_index": ["verify_rows"],
    "verify_lens": ["num_requests"], "draft_tokens": ["verify_rows"], "draft_probs": ["verify_rows", V],
    "accept_uniforms": ["verify_rows"], "sample_uniforms": ["num_requests"],
}
FLOATS = {"temperature", "uniforms", "prev_survival", "draft_probs", "accept_uniforms", "sample_uniforms",
          "survival", "confidence_logit"}
PACKED = ["tokens", "positions", "pack_index", "unpack_index", "query_lens", "past_lens", "slot_ids"]
DRAFT_IN = PACKED + ["temperature", "uniforms", "prev_survival", "draft_position"]
TARGET_IN = PACKED + ["verify_index", "verify_lens", "draft_tokens", "draft_probs", "temperature",
                      "accept_uniforms", "sample_uniforms"]
DRAFT_OUT = {"draft_token": ["num_requests"], "draft_probs": ["num_requests", V], "survival": ["num_requests"],
             "confidence_logit": ["num_requests"]}
TARGET_OUT = {"accepted": ["num_requests"], "next_token": ["num_requests"]}
HEX = "ab" * 32


def _io(name, shape, dtype=None):
    return {"name": name, "dtype": dtype or ("float32" if name in FLOATS else "int64"), "shape": list(shape)}


def _graph(file, feeds, outs, kv_dtype="float32"):
    ins = [_io(n, FEED_SHAPES[n]) for n in feeds]
    ins += [_io(f"past_key_values.{i}.{kv}", ["past_len", SLOTS, KVH, HD], kv_dtype)
            for i in range(LAYERS) for kv in ("key", "value")]
    o = [_io(n, s, "float32" if n in FLOATS else None) for n, s in outs.items()]
    o += [_io(f"present.{i}.{kv}", ["num_tokens", KVH, HD], kv_dtype) for i in range(LAYERS) for kv in ("key", "value")]
    return {"file": file, "inputs": ins, "outputs": o}


def toy_manifest(kv_dtype="float32") -> dict:
    from dspark_trt.exporter.export import plan_dims

    dims, limits = plan_dims(SLOTS, K, CTX)
    model = {"arch": "llama", "vocab_size": V, "hidden_size": 8, "num_layers": LAYERS, "num_kv_heads": KVH,
             "head_dim": HD, "dtype": {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[kv_dtype],
             "max_context": CTX}
    draft = {"arch": "llama", "hidden_size": 8, "num_layers": LAYERS, "num_kv_heads": KVH, "head_dim": HD,
             "max_draft": K, "confidence": "fallback", "temperatures": [1.0] * K}
    return {"format": "dspark-trt-artifact", "format_version": 1, "created": "2026-01-01T00:00:00+00:00",
            "tools": {}, "model": model, "draft": draft, "limits": limits, "dims": dims,
            "tokenizer": {"file": "tokenizer.json", "eos_token_id": None},
            "files": {n: {"sha256": HEX, "bytes": 1} for n in ("draft.onnx", "target.onnx", "tokenizer.json")},
            "graphs": {"draft": _graph("draft.onnx", DRAFT_IN, DRAFT_OUT, kv_dtype),
                       "target": _graph("target.onnx", TARGET_IN, TARGET_OUT, kv_dtype)}}


# ------------------------------------------------------------------------------------------- toy model


def _next(s: int) -> int:
    """The toy target's greedy token after a prefix whose KV sum is s."""
    return (s * 3 + 1) % V


def _drafted(s: int) -> int:
    """The toy draft's token: the target's, except for a quarter of the prefixes."""
    return _next(s) if s % 4 else (_next(s) + 1) % V


def toy_graph(graph: str, ins: dict) -> dict:
    """Deterministic stand-in for an engine, computed from the KV only: a token's "state" is the weighted sum
    of every KV entry of its prefix (the past of its request's slot up to past_len, then the request's new
    tokens up to it). Integer-valued floats keep every sum exact. Like a real model, the greedy tokens are a
    function of the prefix alone, so they do not depend on how steps are batched or how much is verified,
    and any KV cache error changes them."""
    tokens, positions = ins["tokens"], ins["positions"]
    ql, pl, slots = ins["query_lens"], ins["past_lens"], ins["slot_ids"]
    r = len(ql)
    pattern = np.arange(KVH * HD, dtype=np.float32).reshape(KVH, HD)
    present = []
    for layer in range(LAYERS):
        k = (tokens * (layer + 1) + positions).astype(np.float32)[:, None, None] + pattern
        present += [k, -0.5 * k]
    names = tio.kv_names(LAYERS, "past")
    weight = np.arange(1, 2 * LAYERS + 1, dtype=np.float64)
    per_token = sum(w * p.astype(np.float64).sum(axis=(1, 2)) for w, p in zip(weight, present))
    starts = np.cumsum(ql) - ql
    state = np.zeros(len(tokens), dtype=np.int64)  # prefix sum through each packed token
    for i in range(r):
        past = sum(w * float(ins[n][:pl[i], slots[i]].astype(np.float64).sum()) for w, n in zip(weight, names))
        seg = slice(starts[i], starts[i] + ql[i])
        state[seg] = np.rint(past + np.cumsum(per_token[seg])).astype(np.int64)
    out = {}
    last = starts + ql - 1
    if graph == "draft":
        tok = np.array([_drafted(int(state[j])) for j in last], dtype=np.int64)
        probs = np.full((r, V), 0.5 / V, dtype=np.float32)
        probs[np.arange(r), tok] += 0.5
        out.update(draft_token=tok, draft_probs=probs, survival=(ins["prev_survival"] * 0.9).astype(np.float32),
                   confidence_logit=(state[last] % 7).astype(np.float32))
    else:
        vi, vl, dt = ins["verify_index"], ins["verify_lens"], ins["draft_tokens"]
        acc, nxt, row = np.zeros(r, np.int64), np.zeros(r, np.int64), 0
        for i in range(r):
            pred = [_next(int(state[j])) for j in vi[row:row + vl[i] + 1]]
            a = 0
            while a < vl[i] and dt[row + a] == pred[a]:
                a += 1
            acc[i], nxt[i] = a, pred[a]
            row += vl[i] + 1
        out.update(accepted=acc, next_token=nxt)
    for i in range(LAYERS):
        out[f"present.{i}.key"], out[f"present.{i}.value"] = present[2 * i], present[2 * i + 1]
    return out


class ToyHostBackend:
    """The toy on numpy with the runtime's host KVCache: the reference."""

    name = "toy"

    def _run(self, graph, feeds, past):
        ins = dict(feeds, **dict(zip(tio.kv_names(LAYERS, "past"), past)))
        out = toy_graph(graph, ins)
        present = [out.pop(n) for n in tio.kv_names(LAYERS, "present")]
        return out, present

    def run_draft(self, feeds, past):
        return self._run("draft", feeds, past)

    def run_target(self, feeds, past):
        return self._run("target", feeds, past)


def _array_at(ptr: int, shape, dtype) -> np.ndarray:
    dt = np.dtype(dtype)
    n = int(np.prod(shape))
    buf = (ctypes.c_char * max(1, n * dt.itemsize)).from_address(ptr)
    return np.frombuffer(buf, dtype=dt, count=n).reshape(shape)


class FakeContext:
    """IExecutionContext stand-in over CPU tensors: the four calls GraphRunner makes, with TensorRT's
    contracts (bool results, output shapes from input shapes with -1 while unknown, execution reading and
    writing the bound addresses)."""

    def __init__(self, graph: str, manifest: dict, fn=toy_graph, dropped=()):
        spec = manifest["graphs"][graph]
        self.graph, self.fn = graph, fn
        self.inputs = {io["name"]: io for io in spec["inputs"] if io["name"] not in dropped}
        self.outputs = {io["name"]: io for io in spec["outputs"]}
        self.shapes, self.addrs, self.runs = {}, {}, 0
        self.refuse_shape, self.override_shape = set(), {}

    def set_input_shape(self, name, shape):
        if name in self.refuse_shape or name not in self.inputs:
            return False
        self.shapes[name] = tuple(int(n) for n in shape)
        return True

    def get_tensor_shape(self, name):
        if name in self.override_shape:
            return self.override_shape[name]
        return self._shape(name)

    def _shape(self, name):
        if name in self.inputs:
            return self.shapes.get(name, tuple(-1 if isinstance(d, str) else d for d in self.inputs[name]["shape"]))
        dims = {}
        for n, sh in self.shapes.items():
            for d, size in zip(self.inputs[n]["shape"], sh):
                if isinstance(d, str):
                    dims[d] = size
        return tuple(dims.get(d, -1) if isinstance(d, str) else d for d in self.outputs[name]["shape"])

    def set_tensor_address(self, name, ptr):
        if name not in self.inputs and name not in self.outputs:
            return False
        self.addrs[name] = int(ptr)
        return True

    def execute_async_v3(self, stream_handle):
        ins = {n: _array_at(self.addrs[n], self.shapes[n], io["dtype"]).copy() for n, io in self.inputs.items()}
        outs = self.fn(self.graph, ins)
        for n, io in self.outputs.items():
            dst = _array_at(self.addrs[n], self._shape(n), io["dtype"])
            dst[...] = outs[n]
        self.runs += 1
        return True


def fake_backend(manifest=None, engine_io=None):
    import torch

    manifest = manifest or toy_manifest()
    contexts = {g: (FakeContext(g, manifest), engine_io) for g in ("draft", "target")}
    return tb.TrtBackend.from_contexts("ART", manifest, contexts, torch, device="cpu")


def _draft_feeds(queries, past_lens, slots, prev=None):
    from dspark_trt.runtime.batch import pack_queries

    f = pack_queries(queries, past_lens, slots)
    r = len(queries)
    f.update(temperature=np.zeros(r, np.float32), uniforms=np.full(r, 0.5, np.float32),
             prev_survival=np.asarray(prev if prev is not None else [1.0] * r, np.float32),
             draft_position=np.zeros(r, np.int64))
    return f


# ------------------------------------------------------------------------------------------- pure logic


def test_split_io_roles_and_binding_order():
    m = toy_manifest()
    ins, outs = tio.graph_specs(m, "target")
    io = tio.split_io(ins, outs, LAYERS, "target")
    assert [s.name for s in io.feeds] == TARGET_IN
    assert [s.name for s in io.past] == tio.kv_names(LAYERS, "past")
    assert [s.name for s in io.outputs] == ["accepted", "next_token"]
    assert [s.name for s in io.present] == ["present.0.key", "present.0.value", "present.1.key", "present.1.value"]
    assert io.binding_order() == TARGET_IN + tio.kv_names(LAYERS, "past") + ["accepted", "next_token"] + \
        tio.kv_names(LAYERS, "present")
    assert tio.host_output_names(outs) == ["accepted", "next_token"]
    assert tio.host_output_names(tio.graph_specs(m, "draft")[1]) == list(DRAFT_OUT)
    with pytest.raises(DsparkError, match="missing past_key_values.2.key"):
        tio.split_io(ins, outs, LAYERS + 1, "target")
    with pytest.raises(DsparkError, match="no I/O for the draft graph"):
        tio.graph_specs({"graphs": {}}, "draft")


def test_resolve_dims_and_output_shapes_from_feeds():
    m = toy_manifest()
    ins, outs = tio.graph_specs(m, "target")
    from dspark_trt.runtime.batch import pack_queries, verify_rows

    f = pack_queries([[1, 2, 3], [4], [5, 6]], [5, 9, 0], [0, 3, 1])
    vl = np.array([2, 0, 1])
    f["verify_index"] = verify_rows(f["query_lens"], vl)
    f["verify_lens"] = vl
    m_rows = len(f["verify_index"])
    f.update(draft_tokens=np.zeros(m_rows, np.int64), draft_probs=np.zeros((m_rows, V), np.float32),
             temperature=np.zeros(3, np.float32), accept_uniforms=np.zeros(m_rows, np.float32),
             sample_uniforms=np.zeros(3, np.float32))
    shapes = {n: a.shape for n, a in f.items()}
    shapes.update({n: (10, SLOTS, KVH, HD) for n in tio.kv_names(LAYERS, "past")})
    dims = tio.resolve_dims(ins, shapes, "target")
    assert dims == {"num_tokens": 6, "num_requests": 3, "query_len": 3, "past_len": 10, "verify_rows": 6}
    got = tio.output_shapes(outs, dims)
    assert got["accepted"] == got["next_token"] == (3,)
    assert got["present.1.value"] == (6, KVH, HD)
    dspec = tio.graph_specs(m, "draft")[1]
    assert tio.output_shapes(dspec, dims)["draft_probs"] == (3, V)
    assert tio.output_shapes([tio.TensorSpec("x", "float32", ("mystery", 2), False)], dims) == {"x": None}

    with pytest.raises(ValueError, match="disagree on num_requests"):
        tio.resolve_dims(ins, dict(shapes, slot_ids=(4,)), "target")
    with pytest.raises(ValueError, match="fixes it to 4"):
        tio.resolve_dims(ins, dict(shapes, **{"past_key_values.0.key": (10, SLOTS, KVH, 5)}), "target")
    with pytest.raises(ValueError, match="rank"):
        tio.resolve_dims(ins, dict(shapes, tokens=(6, 1)), "target")


def test_pick_output_shape():
    assert tio.pick_output_shape("draft", "x", (3, V), (3, V)) == (3, V)
    assert tio.pick_output_shape("draft", "x", (3, V), (-1, V)) == (3, V)
    assert tio.pick_output_shape("draft", "x", None, [2, 5]) == (2, 5)
    with pytest.raises(DsparkError, match=r"sizes output 'x' as \[4, 40\].*rebuild with `dspark-trt build D`"):
        tio.pick_output_shape("draft", "x", (3, V), (4, V), "D")
    with pytest.raises(DsparkError, match="depends on data"):
        tio.pick_output_shape("draft", "x", None, (-1,))


def test_profiles_from_engine_entry_or_dims():
    m = toy_manifest()
    derived = tio.profile_ranges(m, "draft")
    assert derived["tokens"] == ((1,), (m["dims"]["num_tokens"]["opt"],), (m["dims"]["num_tokens"]["max"],))
    assert derived["past_key_values.0.key"] == ((1, SLOTS, KVH, HD), (CTX, SLOTS, KVH, HD), (CTX, SLOTS, KVH, HD))
    m["engines"] = {"draft": {"profiles": [{"tokens": {"min": [1], "opt": [2], "max": [3]}}]}}
    assert tio.profile_ranges(m, "draft") == {"tokens": ((1,), (2,), (3,))}
    assert tio.profile_problems({"tokens": (3,)}, {"tokens": ((1,), (2,), (3,))}) == []
    (p,) = tio.profile_problems({"tokens": (4,), "other": (9,)}, {"tokens": ((1,), (2,), (3,))}, "draft")
    assert "draft input 'tokens' has shape [4], outside the engine's profile [1]..[3]" == p


def test_trt_dtype_names():
    class DataType:  # how tensorrt prints its enum members
        def __init__(self, n):
            self.n = n

        def __str__(self):
            return f"DataType.{self.n}"

    assert [tio.trt_dtype_name(DataType(n)) for n in ("FLOAT", "HALF", "BF16", "INT64", "INT32", "BOOL")] == \
        ["float32", "float16", "bfloat16", "int64", "int32", "bool"]


def test_check_engine_io():
    m = toy_manifest()
    io = tio.split_io(*tio.graph_specs(m, "draft"), LAYERS, "draft")
    good = [(s.name, s.is_input, s.dtype) for s in io.inputs + io.all_outputs]
    assert tio.check_engine_io("draft", io, good, "ART") == {s.name for s in io.inputs}
    # TensorRT may drop an input the network never reads: bind only what the engine has
    assert "uniforms" not in tio.check_engine_io("draft", io, [t for t in good if t[0] != "uniforms"], "ART")
    bad = [(n, i, "float16" if n == "survival" else d) for n, i, d in good]
    with pytest.raises(DsparkError, match=r"'survival' is float16 in the engine, float32 in the graph: rebuild with "
                                          r"`dspark-trt build ART`"):
        tio.check_engine_io("draft", io, bad, "ART")
    with pytest.raises(DsparkError, match="no output 'survival'"):
        tio.check_engine_io("draft", io, [t for t in good if t[0] != "survival"], "ART")
    with pytest.raises(DsparkError, match=r"has 'logits'.*\(\+1 more\)"):
        tio.check_engine_io("draft", io, good + [("logits", False, "float32"), ("x", True, "int64")], "ART")


def test_kv_dtype_and_alignment():
    assert tio.kv_dtype_for(toy_manifest("bfloat16"), LAYERS, SLOTS, KVH, HD) == "bfloat16"
    assert tio.kv_dtype_for(toy_manifest(), LAYERS, SLOTS, KVH, HD) == "float32"
    assert tio.kv_dtype_for(toy_manifest("float16"), LAYERS + 5, SLOTS, KVH, HD) == "float16"  # model dtype
    assert aligned_elems(1, 4) == 64 and aligned_elems(64, 4) == 64 and aligned_elems(65, 2) == 128
    assert aligned_elems(0, 8) == 0


# ------------------------------------------------------------------------------------------- engines


def _with_engines(tmp_path, m, **over):
    from dspark_trt.manifest import sha256_file

    (tmp_path / "engines").mkdir(exist_ok=True)
    m["engines"] = {}
    for g in ("draft", "target"):
        p = tmp_path / "engines" / f"{g}.engine"
        p.write_bytes(f"plan {g}".encode())
        m["engines"][g] = {"file": f"engines/{g}.engine", "sha256": sha256_file(p), "tensorrt_version": "10.9.0.34",
                           "gpu_name": "NVIDIA H100", "compute_capability": "9.0", "plugin_mode": "aot",
                           "built": "2026-01-01T00:00:00+00:00", "onnx_sha256": HEX, **over}
    return m


def test_select_engines(tmp_path):
    m = toy_manifest()
    with pytest.raises(DsparkError) as e:
        tio.select_engines(m, tmp_path, "10.9.0", "9.0")
    assert str(e.value) == f"no TensorRT engines in {tmp_path}: run `dspark-trt build {tmp_path}` on this GPU"

    m = _with_engines(tmp_path, toy_manifest())
    sel = tio.select_engines(m, tmp_path, "10.9.0.34", (9, 0))
    assert sel["draft"][0] == tmp_path / "engines" / "draft.engine" and sel["target"][1]["plugin_mode"] == "aot"
    with pytest.raises(DsparkError, match=rf"TensorRT version differ.*rebuild with `dspark-trt build {tmp_path}`"):
        tio.select_engines(m, tmp_path, "10.12.0", "9.0")
    with pytest.raises(DsparkError, match="GPU architecture differ"):
        tio.select_engines(m, tmp_path, "10.9.0", "8.9")
    stale = _with_engines(tmp_path, toy_manifest(), onnx_sha256="cd" * 32)
    with pytest.raises(DsparkError, match="built from an earlier export of draft.onnx: rebuild"):
        tio.select_engines(stale, tmp_path, "10.9.0", "9.0")
    (tmp_path / "engines" / "target.engine").write_bytes(b"changed")
    with pytest.raises(DsparkError, match="does not match the sha256 recorded at build time"):
        tio.select_engines(m, tmp_path, "10.9.0", "9.0")
    (tmp_path / "engines" / "target.engine").unlink()
    with pytest.raises(DsparkError, match="is missing: rebuild"):
        tio.select_engines(m, tmp_path, "10.9.0", "9.0")
    del m["engines"]["target"]
    with pytest.raises(DsparkError, match="no TensorRT engine for the target graph"):
        tio.select_engines(m, tmp_path, "10.9.0", "9.0")


def test_select_engines_takes_the_greedy_draft_engine_when_one_was_built(tmp_path):
    from dspark_trt.manifest import sha256_file

    m = _with_engines(tmp_path, toy_manifest())
    m["graphs"]["draft_greedy"] = dict(m["graphs"]["draft"], file="draft_greedy.onnx")
    assert set(tio.select_engines(m, tmp_path, "10.9.0", "9.0")) == {"draft", "target"}  # built before it existed
    p = tmp_path / "engines" / "draft_greedy.engine"
    p.write_bytes(b"plan draft_greedy")
    m["engines"]["draft_greedy"] = dict(m["engines"]["draft"], file="engines/draft_greedy.engine",
                                        sha256=sha256_file(p))
    assert tio.select_engines(m, tmp_path, "10.9.0", "9.0")["draft_greedy"][0] == p
    m["engines"]["draft_greedy"]["tensorrt_version"] = "10.8.0"
    with pytest.raises(DsparkError, match="engine for the draft_greedy graph was built with TensorRT 10.8.0"):
        tio.select_engines(m, tmp_path, "10.9.0", "9.0")


# ------------------------------------------------------------------------------------------- without TensorRT


def _artifact(tmp_path) -> Path:
    d = tmp_path / "art"
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps(toy_manifest(), indent=1))
    return d


@pytest.mark.skipif(HAVE_TRT, reason="TensorRT is installed here")
def test_backend_without_tensorrt_says_what_to_install(tmp_path):
    d = _artifact(tmp_path)
    with pytest.raises(DsparkError) as e:
        tb.TrtBackend(d, toy_manifest())
    msg = str(e.value)
    assert "\n" not in msg and "pip install 'dspark-trt[trt]'" in msg and "NVIDIA GPU" in msg
    assert f"`dspark-trt build {d}`" in msg

    from dspark_trt.runtime.runtime import Runtime

    with pytest.raises(DsparkError, match=r"needs TensorRT, which is not installed"):
        Runtime.load(d, backend="trt")


def test_cli_generate_trt_is_one_line(tmp_path):
    d = _artifact(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "dspark_trt.cli", "generate", str(d), "--backend", "trt",
                        "--prompt", "x"], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    if not HAVE_TRT:
        assert "pip install 'dspark-trt[trt]'" in lines[0] and "dspark-trt build" in lines[0]
    else:  # a TensorRT machine: the artifact has no engines (or no GPU is visible)
        assert "dspark-trt build" in lines[0] or "GPU" in lines[0]


def test_module_imports_without_torch_or_tensorrt():
    code = ("import sys, dspark_trt.runtime.backends.trt, dspark_trt.runtime.backends.device_kv; "
            "print(sorted(m for m in ('torch', 'tensorrt') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stderr


# ------------------------------------------------------------------------------------------- device KV cache


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_device_kv_cache_matches_host_cache(device):
    torch = pytest.importorskip("torch")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU visible to a CUDA build of torch")
    from dspark_trt.runtime.backends.device_kv import DeviceKVCache
    from dspark_trt.runtime.kv_cache import KVCache

    host = KVCache(LAYERS, CTX, SLOTS, KVH, HD)
    stream = torch.cuda.Stream() if device == "cuda" else None
    dev = DeviceKVCache(LAYERS, CTX, SLOTS, KVH, HD, np.float32, device=device, stream=stream, torch=torch)
    rng = np.random.default_rng(0)
    for step in range(4):
        n = int(rng.integers(1, 9))
        pos = rng.choice(CTX, n, replace=False)
        slot = rng.integers(0, SLOTS, n)
        present = [rng.standard_normal((n, KVH, HD)).astype(np.float32) for _ in range(2 * LAYERS)]
        host.write(present, pos, slot)
        if step % 2:  # numpy entries
            dev.write(present, pos, slot)
        else:  # a stacked device buffer, one scatter for all layers
            stacked = torch.from_numpy(np.stack(present)).to(device)
            dev.write(PresentList([stacked[i] for i in range(2 * LAYERS)], stacked), pos, slot)
    for length in (0, 1, 17, CTX):
        views = dev.past(length)
        assert [tuple(v.shape) for v in views] == [(max(1, length), SLOTS, KVH, HD)] * (2 * LAYERS)
        assert all(v.is_contiguous() and v.device.type == device for v in views)
        for a, b in zip(dev.to_host(length), host.past(length)):
            np.testing.assert_array_equal(a, b)
    base = dev.past(1)[0].data_ptr() if device == "cpu" else 0  # cudaMalloc'd memory is 256-byte aligned
    assert all((v.data_ptr() - base) % 256 == 0 for v in dev.past(5))  # so is every block
    assert views[0].data_ptr() == dev.keys[0].data_ptr() and views[1].data_ptr() == dev.values[0].data_ptr()
    with pytest.raises(ValueError, match="positions out of range"):
        dev.write(present, np.full(len(present[0]), CTX), np.zeros(len(present[0]), np.int64))
    with pytest.raises(DsparkError, match="exceeds the cache's max context"):
        dev.past(CTX + 1)


def test_device_kv_cache_bfloat16():
    torch = pytest.importorskip("torch")
    from dspark_trt.runtime.backends.device_kv import DeviceKVCache

    dev = DeviceKVCache(1, 8, 2, 1, 4, "bfloat16", device="cpu", torch=torch)
    assert dev.past(3)[0].dtype == torch.bfloat16 and dev.nbytes >= 2 * 8 * 2 * 4 * 2
    new = [np.full((2, 1, 4), 1.5, np.float32), np.full((2, 1, 4), -2.0, np.float32)]
    dev.write(new, np.array([0, 2]), np.array([1, 0]))
    k, v = dev.to_host(3)
    assert k[0, 1, 0, 0] == 1.5 and v[2, 0, 0, 3] == -2.0 and k[1].sum() == 0


# ------------------------------------------------------------------------------------------- backend on CPU


def test_backend_binds_cache_views_and_matches_host():
    torch = pytest.importorskip("torch")
    from dspark_trt.runtime.batch import token_slots
    from dspark_trt.runtime.kv_cache import KVCache

    be = fake_backend()
    dev = be.make_kv_cache(LAYERS, CTX, SLOTS, KVH, HD, np.float32)
    host = KVCache(LAYERS, CTX, SLOTS, KVH, HD)
    ref = ToyHostBackend()
    steps = [([[3, 4, 5], [7, 8]], [0, 0], [2, 0]), ([[9], [1]], [3, 2], [2, 0]), ([[2, 6], [5]], [4, 3], [2, 0]),
             ([[1]], [6], [2])]
    kept = []
    for queries, past_lens, slots in steps:
        f = _draft_feeds(queries, past_lens, slots)
        p = max(past_lens)
        outs, present = be.run_draft(f, dev.past(p))
        want, want_present = ref.run_draft(f, host.past(p))
        assert set(outs) == set(DRAFT_OUT)
        for n in DRAFT_OUT:
            assert isinstance(outs[n], np.ndarray) and outs[n].dtype == want[n].dtype
            np.testing.assert_array_equal(outs[n], want[n])
        assert isinstance(present, PresentList) and len(present) == 2 * LAYERS
        for a, b in zip(present, want_present):
            np.testing.assert_array_equal(a.numpy(), b)
        # past inputs were bound with no copy: the engine read the cache's own memory
        ctx = be.runners["draft"].context
        for name, view in zip(tio.kv_names(LAYERS, "past"), dev.past(p)):
            assert ctx.addrs[name] == view.data_ptr()
        dev.write(present, f["positions"], token_slots(f))
        host.write(want_present, f["positions"], token_slots(f))
        kept.append((outs, {n: a.copy() for n, a in outs.items()}))
    for outs, copy in kept:  # host outputs are fresh arrays, not views of reused buffers
        for n in outs:
            np.testing.assert_array_equal(outs[n], copy[n])
    for a, b in zip(dev.to_host(CTX), host.past(CTX)):
        np.testing.assert_array_equal(a, b)

    # host numpy past (e.g. a host cache) is staged to the device and gives the same result
    f = _draft_feeds([[4]], [7], [2])
    a, _ = be.run_draft(f, host.past(7))
    b, _ = be.run_draft(f, dev.past(7))
    for n in DRAFT_OUT:
        np.testing.assert_array_equal(a[n], b[n])
    assert be.runners["draft"].context.runs == len(steps) + 2


def test_a_zero_rows_feed_is_zeroed_on_the_device_not_copied():
    """Greedy verify steps feed draft_probs as ZeroRows: the runner zeroes its device buffer (a memset)
    instead of copying [M, V] zeros from the host every step."""
    pytest.importorskip("torch")
    from dspark_trt.runtime.batch import ZeroRows, pack_queries, verify_rows

    be = fake_backend()
    f = pack_queries([[1, 2, 3], [4]], [5, 9], [0, 3])
    vl = np.array([2, 0])
    f.update(verify_index=verify_rows(f["query_lens"], vl), verify_lens=vl)
    m = len(f["verify_index"])
    f.update(draft_tokens=np.zeros(m, np.int64), temperature=np.zeros(2, np.float32),
             accept_uniforms=np.zeros(m, np.float32), sample_uniforms=np.zeros(2, np.float32))
    past = be.make_kv_cache(LAYERS, CTX, SLOTS, KVH, HD, np.float32).past(10)
    ctx = be.runners["target"].context
    be.run_target(dict(f, draft_probs=np.full((m, V), 0.25, np.float32)), past)  # the device buffer now holds 0.25
    assert _array_at(ctx.addrs["draft_probs"], (m, V), "float32").max() == 0.25
    # a ZeroRows whose host memory is not zero (never so in the runtime) shows that nothing was copied
    be.run_target(dict(f, draft_probs=np.full((m, V), 0.5, np.float32).view(ZeroRows)), past)
    assert not _array_at(ctx.addrs["draft_probs"], (m, V), "float32").any()


def test_backend_errors_and_shape_fallbacks():
    pytest.importorskip("torch")
    be = fake_backend()
    dev = be.make_kv_cache(LAYERS, CTX, SLOTS, KVH, HD, np.float32)
    f = _draft_feeds([[1, 2]], [0], [1])
    ctx = be.runners["draft"].context
    ctx.override_shape["draft_probs"] = (-1, V)  # unknown to the engine: sized from the manifest
    outs, _ = be.run_draft(f, dev.past(1))
    assert outs["draft_probs"].shape == (1, V)
    ctx.override_shape["draft_probs"] = (2, V)
    with pytest.raises(DsparkError, match="sizes output 'draft_probs' as"):
        be.run_draft(f, dev.past(1))
    ctx.override_shape.clear()
    ctx.refuse_shape.add("tokens")
    with pytest.raises(DsparkError, match="TensorRT refused shape \\[2\\] for the draft engine's input 'tokens'"):
        be.run_draft(f, dev.past(1))
    ctx.refuse_shape.clear()
    big = _draft_feeds([[1]] * (SLOTS + 1), [0] * (SLOTS + 1), list(range(SLOTS)) + [0])
    with pytest.raises(DsparkError, match=r"draft input '\w+' has shape \[5\b.*outside the engine's profile"):
        be.run_draft(big, dev.past(1))
    with pytest.raises(ValueError, match="missing input 'uniforms'"):
        be.run_draft({k: v for k, v in f.items() if k != "uniforms"}, dev.past(1))
    with pytest.raises(ValueError, match="got 3 past KV tensors"):
        be.run_draft(f, dev.past(1)[:3])


def test_backend_binds_only_engine_inputs():
    torch = pytest.importorskip("torch")
    m = toy_manifest()
    ins, outs = tio.graph_specs(m, "draft")
    eio = [(s.name, s.is_input, s.dtype) for s in ins + outs if s.name != "uniforms"]  # dropped by TensorRT
    be = tb.TrtBackend.from_contexts("ART", m, {"draft": (FakeContext("draft", m, dropped={"uniforms"}), eio),
                                                "target": (FakeContext("target", m), None)}, torch)
    f = _draft_feeds([[1, 2]], [0], [1])
    cache = be.make_kv_cache(LAYERS, CTX, SLOTS, KVH, HD)
    a, _ = be.run_draft({k: v for k, v in f.items() if k != "uniforms"}, cache.past(1))
    assert "uniforms" not in be.runners["draft"].context.addrs
    ref = fake_backend(m)
    b, _ = ref.run_draft(f, ref.make_kv_cache(LAYERS, CTX, SLOTS, KVH, HD).past(1))
    np.testing.assert_array_equal(a["draft_token"], b["draft_token"])


@pytest.mark.parametrize("spec", ["fixed:2", "adaptive", "off"])
def test_runtime_on_fake_engines_matches_host(tmp_path, spec):
    """The whole runtime loop (draft catch-up, drafting, verification, KV writes) on the TrtBackend with
    device caches gives the same tokens and the same cache contents as the host path."""
    pytest.importorskip("torch")
    from conftest import make_tokenizer
    from cost_sim import submit_all_at_once

    from dspark_trt.runtime.backends.device_kv import DeviceKVCache
    from dspark_trt.runtime.config import GenerationConfig
    from dspark_trt.runtime.kv_cache import KVCache
    from dspark_trt.runtime.runtime import Runtime
    from dspark_trt.runtime.tokenizer import load_tokenizer

    make_tokenizer(tmp_path / "tokenizer.json")
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    prompts = [[1, 2, 3, 4, 5], [7, 7], list(range(10, 30)), [3]]
    cfg = GenerationConfig(max_new_tokens=12, temperature=0.0, spec=spec)
    results, caches, slots = [], [], []
    for backend in (ToyHostBackend(), fake_backend()):
        with Runtime(tmp_path, toy_manifest(), backend, tok) as rt:
            # One submitted after another finished would take its slot, and overwrite the cache rows this
            # test compares, only when the machine is busy.
            reqs = submit_all_at_once(rt, prompts, cfg)
            out = [rt.wait(r) for r in reqs]
            caches.append((rt.target_kv, rt.draft_kv))
            slots.append([(r.slot, len(r.tokens)) for r in reqs])
        assert all(r.error is None for r in out), [r.error for r in out]
        results.append([r.token_ids for r in out])
    assert results[0] == results[1]
    assert all(len(ids) == 12 for ids in results[0])
    (ht, hd), (dt, dd) = caches
    assert isinstance(ht, KVCache) and isinstance(dt, DeviceKVCache) and isinstance(dd, DeviceKVCache)
    for host, dev in ((ht, dt), (hd, dd)):
        for a, b in zip(dev.to_host(CTX), host.past(CTX)):
            for (s_dev, n), (s_host, _) in zip(slots[1], slots[0]):
                np.testing.assert_array_equal(a[:n - 1, s_dev], b[:n - 1, s_host])


# ------------------------------------------------------------------------------------------- real engines


def _ort_fn(sessions):
    def run(graph, ins):
        sess = sessions[graph]
        outs = sess.run(None, {i.name: ins[i.name] for i in sess.get_inputs()})
        return dict(zip([o.name for o in sess.get_outputs()], outs))
    return run


@pytest.mark.slow
def test_fake_contexts_running_onnx_graphs_match_ort_backend(tiny_artifact):
    """The real exported graphs (ONNX Runtime behind FakeContext) through the TrtBackend binding logic and
    device caches on CPU: same greedy tokens as the ORT backend. Slow: exports the tiny artifact."""
    torch = pytest.importorskip("torch")
    import onnxruntime as ort

    from dspark_trt.runtime.config import GenerationConfig
    from dspark_trt.runtime.runtime import Runtime, load_manifest

    manifest = load_manifest(tiny_artifact)
    graphs = ("draft", "draft_greedy", "target")
    sessions = {g: ort.InferenceSession(str(Path(tiny_artifact) / manifest["graphs"][g]["file"]),
                                        providers=["CPUExecutionProvider"]) for g in graphs}
    contexts = {g: (FakeContext(g, manifest, fn=_ort_fn(sessions)), None) for g in graphs}
    be = tb.TrtBackend.from_contexts(tiny_artifact, manifest, contexts, torch)
    cfg = GenerationConfig(max_new_tokens=16, temperature=0.0, spec="fixed:3")
    prompts = ["def fib(n):", "import os\n"]
    with Runtime.load(tiny_artifact, backend="ort", profile="none") as rt:
        want = [r.token_ids for r in rt.generate(prompts, cfg)]
    from dspark_trt.runtime.tokenizer import load_tokenizer

    with Runtime(tiny_artifact, manifest, be, load_tokenizer(Path(tiny_artifact) / "tokenizer.json")) as rt:
        got = [r.token_ids for r in rt.generate(prompts, cfg)]
    assert got == want
    assert be.calls["draft_greedy"] > 0 and be.calls["draft"] == 0  # greedy drafting on the greedy engine


@pytest.mark.trt
@pytest.mark.skipif(not HAVE_TRT, reason="needs TensorRT and an NVIDIA GPU (pip install 'dspark-trt[trt]')")
def test_trt_engines_greedy_match_ort(tiny_artifact, tmp_path):
    """Build engines for the tiny artifact on this GPU, load them with the trt backend, compare greedy output
    with the ORT backend. Runs only on a machine with an NVIDIA GPU and TensorRT (`pytest -m trt`)."""
    pytest.importorskip("tensorrt", reason="needs TensorRT (pip install 'dspark-trt[trt]')")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU visible to a CUDA build of torch")
    import shutil

    from dspark_trt.exporter.build import build_engines
    from dspark_trt.runtime.backends.device_kv import DeviceKVCache
    from dspark_trt.runtime.config import GenerationConfig
    from dspark_trt.runtime.runtime import Runtime

    art = tmp_path / "tiny"
    shutil.copytree(tiny_artifact, art)  # building records engines in the manifest: keep the shared one clean
    build_engines(art, plugin_mode="aot")
    cfg = GenerationConfig(max_new_tokens=24, temperature=0.0, spec="adaptive")
    prompts = ["def fib(n):", "import os\n", "class Foo:"]
    with Runtime.load(art, backend="ort", profile="none") as rt:
        want = [r.token_ids for r in rt.generate(prompts, cfg)]
    with Runtime.load(art, backend="trt", profile="none") as rt:
        assert isinstance(rt.target_kv, DeviceKVCache) and rt.target_kv.device.type == "cuda"
        got = [r.token_ids for r in rt.generate(prompts, cfg)]
        calls = dict(rt.backend.calls)
    assert got == want
    assert calls.get("draft_greedy", 0) > 0  # the greedy draft engine was built and drafted
