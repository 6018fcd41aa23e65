"""Triton kernels of the dspark ops == the numpy reference.

Without a GPU the kernels run in the Triton interpreter on CPU tensors (TRITON_INTERPRET=1 is set here,
before triton is first imported; interpretation is per process). With CUDA they run natively on the
GPU. Force a device with DSPARK_TRITON_DEVICE=cpu|cuda. AOT compilation to PTX (what the TensorRT
plugin embeds) is checked in a subprocess with native Triton, which needs no GPU.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")

DEVICE = os.environ.get("DSPARK_TRITON_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE == "cpu" and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")
if DEVICE == "cpu" and not triton.knobs.runtime.interpret:
    pytest.skip("triton was imported before this module without TRITON_INTERPRET=1; run this file on its own "
                "(or with DSPARK_TRITON_DEVICE=cuda on a GPU)", allow_module_level=True)

from dspark_trt.plugins import kernels  # noqa: E402
from dspark_trt.plugins import reference as ref  # noqa: E402

TOL = 2e-4
CASES = ref.accept_cases(seed=0)


def on_device(batch: dict) -> dict:
    return {k: torch.from_numpy(np.ascontiguousarray(v)).to(DEVICE) for k, v in batch.items()}


def as_lists(*tensors):
    return [t.cpu().tolist() for t in tensors]


# ------------------------------------------------------------------------------------------ Survival
@pytest.mark.parametrize("case", list(ref.survival_cases()))
def test_survival_parity(case):
    x, prev, start, temps = ref.survival_cases()[case]
    got = kernels.survival(*on_device(dict(x=x, p=prev, s=np.asarray(start, np.int64))).values(), temps)
    exp = ref.survival(x, prev, start, temps)
    assert got.dtype == torch.float32 and tuple(got.shape) == exp.shape
    np.testing.assert_allclose(got.cpu().numpy(), exp, rtol=2e-5, atol=1e-30)
    assert ((got.cpu().numpy() == 0) == (exp == 0)).all()


def test_survival_long_rows_and_empty():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 150)).astype(np.float32)  # J > MAX_BLOCK_J: walked in chunks
    prev, start = np.ones(3, np.float32), np.array([0, 1, 2])
    got = kernels.survival(*on_device(dict(x=x, p=prev, s=start)).values(), [1.0, 2.0])
    np.testing.assert_allclose(got.cpu().numpy(), ref.survival(x, prev, start, [1.0, 2.0]), rtol=1e-4,
                               atol=1e-30)
    empty = kernels.survival(*on_device(dict(x=np.zeros((0, 1), np.float32), p=np.zeros(0, np.float32),
                                             s=np.zeros(0, np.int64))).values(), [1.0])
    assert tuple(empty.shape) == (0, 1)


# ------------------------------------------------------------------------------------- accept ops
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_accept_parity(case):
    b = CASES[case]
    t = on_device(b)
    acc, nxt = kernels.greedy_accept(t["logits"], t["draft_tokens"], t["verify_lens"])
    exp = ref.greedy_accept(b["logits"], b["draft_tokens"], b["verify_lens"])
    assert acc.dtype == nxt.dtype == torch.int64
    assert as_lists(acc, nxt) == [e.tolist() for e in exp]


@pytest.mark.parametrize("case", list(CASES))
def test_sample_accept_parity(case):
    b = ref.redraw_near_boundaries(CASES[case], np.random.default_rng(11), tol=TOL)
    acc, nxt = kernels.sample_accept(**on_device(b))
    assert as_lists(acc, nxt) == [e.tolist() for e in ref.sample_accept(**b)]


def test_sample_accept_raw_draws_differ_only_at_boundaries():
    rng = np.random.default_rng(21)
    b = ref.random_accept_batch(rng, rng.integers(0, 9, 24), 300, temperature=rng.uniform(0.3, 2.0, 24))
    acc, nxt = kernels.sample_accept(**on_device(b))
    exp_acc, exp_nxt, margin = ref.sample_accept_with_margin(**b)
    differ = (acc.cpu().numpy() != exp_acc) | (nxt.cpu().numpy() != exp_nxt)
    assert (margin[differ] < TOL).all(), (np.flatnonzero(differ), margin[differ])


def test_sample_accept_greedy_equals_greedy_accept():
    for name, b in ref.accept_cases(seed=9).items():
        b = dict(b, temperature=np.zeros_like(b["temperature"]))
        q = np.zeros_like(b["draft_probs"])
        valid = (b["draft_tokens"] >= 0) & (b["draft_tokens"] < q.shape[1])
        q[np.flatnonzero(valid), b["draft_tokens"][valid]] = 1.0
        t = on_device(dict(b, draft_probs=q))
        s = kernels.sample_accept(**t)
        g = kernels.greedy_accept(t["logits"], t["draft_tokens"], t["verify_lens"])
        assert as_lists(*s) == as_lists(*g), name


def test_half_precision_inputs():
    b = ref.redraw_near_boundaries(CASES["random"], np.random.default_rng(2), tol=TOL)
    rounded = dict(b, logits=b["logits"].astype(np.float16).astype(np.float32),
                   draft_probs=b["draft_probs"].astype(np.float16).astype(np.float32))
    rounded = ref.redraw_near_boundaries(rounded, np.random.default_rng(3), tol=TOL)
    t = on_device(rounded)
    t["logits"], t["draft_probs"] = t["logits"].half(), t["draft_probs"].half()
    g = kernels.greedy_accept(t["logits"], t["draft_tokens"], t["verify_lens"])
    s = kernels.sample_accept(**t)
    assert as_lists(*g) == [e.tolist() for e in ref.greedy_accept(rounded["logits"], rounded["draft_tokens"],
                                                                   rounded["verify_lens"])]
    assert as_lists(*s) == [e.tolist() for e in ref.sample_accept(**rounded)]


def test_launchers_check_the_packed_layout():
    t = on_device(CASES["random"])
    bad = t["verify_lens"].clone()
    bad[0] += 1
    with pytest.raises(ValueError, match="packed rows"):
        kernels.greedy_accept(t["logits"], t["draft_tokens"], bad)
    with pytest.raises(ValueError, match=">= 0"):
        kernels.sample_accept(**dict(t, verify_lens=-t["verify_lens"]))


# --------------------------------------------------------------------------- AOT (PTX for TensorRT)
AOT_SCRIPT = textwrap.dedent("""
    import json, sys
    from dspark_trt.plugins import kernels, ptx
    out = {}
    for op, kw in [("Survival", dict(temperatures=[0.5, 1.0, 2.0])),
                   ("GreedyAccept", dict(vocab=32000)),
                   ("SampleAccept", dict(vocab=152064, input_dtypes={"logits": "bfloat16",
                                                                     "draft_probs": "float16"}))]:
        ck = kernels.compile_ptx(op, target=("cuda", 80, 32), **kw)
        layout = kernels.AOT_LAYOUT[op][1]
        out[op] = dict(name=ck.name, params=len(kernels.ptx_entry_params(ck.ptx, ck.name)),
                       visible=len(layout), scalars=list(ck.scalars), warps=ck.num_warps,
                       version=ptx.ptx_version_of(ck.ptx), target=".target sm_80" in ck.ptx)
    out["blackwell_isa"] = ptx.ptx_version_of(kernels.compile_ptx("GreedyAccept", vocab=64,
                                                                  target=("cuda", 100, 32)).ptx)

    # the TensorRT AOT glue, against a minimal stand-in for tensorrt.plugin (the real one needs a GPU)
    import functools, types
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "stub"
    for n in ("float32", "float16", "bfloat16", "int64", "int32"):
        setattr(trt, n, n)
    trtp = types.ModuleType("tensorrt.plugin")
    reg = {}
    for kind in ("register", "impl", "autotune", "aot_impl"):
        setattr(trtp, kind, lambda pid, kind=kind: (lambda fn: reg.setdefault((kind, pid), fn)))
    class Desc:
        def __init__(self, shape, dtype):
            self.shape_expr, self.ndim, self.dtype = list(shape), len(shape), dtype
    class Params:
        pass
    trtp.TensorDesc, trtp.Tensor, trtp.SymExprs, trtp.KernelLaunchParams = Desc, object, object, Params
    trtp.AutoTuneCombination = str
    trtp.SymInt32 = lambda e: ("i32", e)
    trtp.SymIntExprs = types.SimpleNamespace(from_tuple=list)
    trt.plugin = trtp
    sys.modules["tensorrt"], sys.modules["tensorrt.plugin"] = trt, trtp
    kernels.compile_ptx = functools.partial(kernels.compile_ptx, target=("cuda", 80, 32))
    import dspark_trt.plugins.tensorrt_plugins as plugins
    plugins.register(["aot"])
    assert ("impl", "dspark::SampleAccept") not in reg  # only what was asked for
    name, ptx, params, extra = reg[("aot_impl", "dspark::SampleAccept")](
        Desc((12, 300), "float16"), Desc((12, 300), "float32"), Desc((12,), "int64"), Desc((4,), "int64"),
        Desc((4,), "float32"), Desc((12,), "float32"), Desc((4,), "float32"), None, 0)
    out["aot_sample"] = dict(name=name.decode(), grid=params.grid_x, block=params.block_x,
                             extra=extra, fp16=".u16" in ptx.decode() or "f16" in ptx.decode())
    name, ptx, params, extra = reg[("aot_impl", "dspark::Survival")](
        Desc((6, 1), "float32"), Desc((6,), "float32"), Desc((6,), "int64"), [0.5, 2.0], None, 0)
    out["aot_survival"] = dict(name=name.decode(), grid=params.grid_x, block=params.block_x, extra=extra,
                               temps=all(c in ptx.decode() for c in ("0f3F000000", "0f40000000")))
    print("RESULT" + json.dumps(out))
""")


def test_kernels_compile_to_ptx_for_tensorrt_aot():
    """Native Triton compiles every kernel for sm_80 (no GPU needed); the entry takes exactly the
    inputs, the int32 extra args and the outputs, in the order TensorRT passes them."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", AOT_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0 and "ptxas" in proc.stderr.lower() and "not found" in proc.stderr.lower():
        pytest.skip("triton has no ptxas here")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert result["Survival"]["scalars"] == ["R", "J"]
    assert result["GreedyAccept"]["scalars"] == result["SampleAccept"]["scalars"] == ["R", "M", "V"]
    # the AOT plugin glue: grid = R, block = warps * 32, extra args = int32 (R, V) / (R, J) from shapes
    sample, surv = result.pop("aot_sample"), result.pop("aot_survival")
    assert sample["name"] == "sample_accept_kernel" and sample["grid"] == 4 and sample["fp16"]
    assert sample["extra"] == [["i32", 4], ["i32", 12], ["i32", 300]] and sample["block"] % 32 == 0
    assert surv["grid"] == 6 and surv["extra"] == [["i32", 6], ["i32", 1]] and surv["block"] == 32
    assert surv["temps"]  # temperatures 0.5 and 2.0 are baked into the PTX as constants
    # PTX ISA pinned (plugins/ptx.py): 8.0 for Ampere/Hopper, whatever Triton's ptxas knows; Blackwell 8.6
    assert result.pop("blackwell_isa") == "8.6"
    for op, r in result.items():
        assert r["params"] == r["visible"], (op, r)
        assert r["version"] == "8.0" and r["target"], (op, r)


def test_strip_hidden_params():
    ptx = (".visible .entry k(\n\t.param .u64 .ptr .global .align 1 k_param_0,\n\t.param .u32 k_param_1,\n"
           "\t.param .u64 .ptr .global .align 1 k_param_2,\n\t.param .u64 .ptr .global .align 1 k_param_3\n)\n"
           "{\n\tld.param.u64 %rd1, [k_param_0];\n\tld.param.u32 %r1, [k_param_1];\n}\n")
    out = kernels.strip_hidden_params(ptx, "k", 2)
    assert kernels.ptx_entry_params(out, "k") == ["k_param_0", "k_param_1"]
    assert out.endswith(ptx[ptx.index("{"):])
    with pytest.raises(RuntimeError, match="reads hidden parameters"):
        kernels.strip_hidden_params(ptx, "k", 0)
    with pytest.raises(ValueError, match="no .entry"):
        kernels.strip_hidden_params(ptx, "other", 2)


def test_aot_signature_follows_the_tensorrt_argument_order():
    from dspark_trt.plugins.spec import OPS

    for name, (kernel_name, layout) in kernels.AOT_LAYOUT.items():
        assert [w for k, w in layout if k == "in"] == OPS[name].input_names
        assert [w for k, w in layout if k == "out"] == OPS[name].output_names
        kinds = [k for k, _ in layout]
        assert kinds == sorted(kinds, key=["in", "scalar", "out"].index)  # inputs, extra args, outputs
    sig = kernels.aot_signature("SampleAccept", {"logits": "float16"})
    assert list(sig.values()) == ["*fp16", "*fp32", "*i64", "*i64", "*fp32", "*fp32", "*fp32", "i32", "i32", "i32",
                                  "*i64", "*i64", "constexpr", "constexpr"]
    sig = kernels.aot_signature("Survival")
    assert list(sig.values()) == ["*fp32", "*fp32", "*i64", "i32", "i32", "*fp32", "constexpr", "constexpr",
                                  "constexpr"]
    with pytest.raises(ValueError):
        kernels.aot_signature("GreedyAccept", {"verify_lens": "float32"})
    assert kernels.aot_constexprs("Survival", temperatures=[1, 2]) == {"TEMPS": (1.0, 2.0), "NT": 2,
                                                                       "BLOCK_J": 16}
    assert kernels.aot_constexprs("GreedyAccept", vocab=32000)["BLOCK_V"] == 4096


# ------------------------------------------------------------------------------------- GPU-only
def _needs_cuda():
    if not torch.cuda.is_available() or DEVICE != "cuda":
        pytest.skip("needs CUDA and native Triton (run on a GPU machine: pytest -m gpu)")


@pytest.mark.gpu
def test_gpu_large_batch_parity():
    _needs_cuda()
    rng = np.random.default_rng(0)
    lens = rng.integers(0, 9, 64)
    b = ref.random_accept_batch(rng, lens, 152064, temperature=rng.choice([0.0, 0.7, 1.0], 64), match_prob=0.8)
    b = ref.redraw_near_boundaries(b, rng, tol=TOL)
    t = on_device(b)
    assert as_lists(*kernels.greedy_accept(t["logits"], t["draft_tokens"], t["verify_lens"])) == [
        e.tolist() for e in ref.greedy_accept(b["logits"], b["draft_tokens"], b["verify_lens"])]
    assert as_lists(*kernels.sample_accept(**t)) == [e.tolist() for e in ref.sample_accept(**b)]


@pytest.mark.gpu
def test_gpu_bfloat16_logits():
    _needs_cuda()
    b = ref.redraw_near_boundaries(CASES["large_vocab"], np.random.default_rng(1), tol=TOL)
    t = on_device(b)
    t["logits"] = t["logits"].bfloat16()
    rounded = dict(b, logits=t["logits"].float().cpu().numpy())
    rounded = ref.redraw_near_boundaries(rounded, np.random.default_rng(2), tol=TOL)
    t.update(on_device({k: rounded[k] for k in ("accept_uniforms", "sample_uniforms")}))
    assert as_lists(*kernels.sample_accept(**t)) == [e.tolist() for e in ref.sample_accept(**rounded)]


# ------------------------------------------------------------------------------------- TensorRT
@pytest.mark.trt
@pytest.mark.parametrize("aot", [1, 0])
def test_tensorrt_engine_matches_reference(aot, tmp_path):
    """Build a TensorRT engine from an ONNX model with the dspark nodes, plugins registered, and run it."""
    trt = pytest.importorskip("tensorrt")
    onnx = pytest.importorskip("onnx")
    _needs_cuda()
    from dspark_trt import trt_env

    trt_env.load_plugins()  # registers dspark::* (both implementations: the node attribute `aot` picks)
    from onnx import TensorProto, helper

    from dspark_trt.plugins.onnx_functions import attach_functions
    from dspark_trt.plugins.spec import OPS, make_node

    op = OPS["SampleAccept"]
    types = {"float32": TensorProto.FLOAT, "int64": TensorProto.INT64}
    graph = helper.make_graph(
        [make_node("SampleAccept", op.input_names, op.output_names, aot=aot)], "g",
        [helper.make_tensor_value_info(t.name, types[t.dtypes[0]], ["M", 50] if t.shape == ("M", "V")
                                       else list(t.shape)) for t in op.inputs],
        [helper.make_tensor_value_info(t.name, types[t.dtypes[0]], list(t.shape)) for t in op.outputs])
    model = attach_functions(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    b = ref.redraw_near_boundaries(CASES["random"], np.random.default_rng(5), tol=TOL)

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    assert parser.parse(model.SerializeToString()), [parser.get_error(i) for i in range(parser.num_errors)]
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for name, v in b.items():
        profile.set_shape(name, v.shape, v.shape, tuple(2 * d if i == 0 else d for i, d in enumerate(v.shape)))
    config.add_optimization_profile(profile)
    engine = trt.Runtime(logger).deserialize_cuda_engine(builder.build_serialized_network(network, config))
    ctx = engine.create_execution_context()
    feeds = on_device(b)
    outs = {n: torch.empty(len(b["verify_lens"]), dtype=torch.int64, device="cuda") for n in op.output_names}
    for name, t in feeds.items():
        ctx.set_input_shape(name, tuple(t.shape))
        ctx.set_tensor_address(name, t.data_ptr())
    for name, t in outs.items():
        ctx.set_tensor_address(name, t.data_ptr())
    stream = torch.cuda.Stream()
    assert ctx.execute_async_v3(stream.cuda_stream)
    stream.synchronize()
    assert as_lists(outs["accepted"], outs["next_token"]) == [e.tolist() for e in ref.sample_accept(**b)]


# -------------------------------------------------------------- bounds: garbage verify_lens (autotuning)
GUARD = 3


def _guarded(a: np.ndarray, fill) -> torch.Tensor:
    """`a` as a view into a buffer with GUARD rows of `fill` before and after it: a read outside `a`'s rows
    sees `fill`, which the test below can recognise in the outputs."""
    big = np.empty((a.shape[0] + 2 * GUARD, *a.shape[1:]), dtype=a.dtype)
    big[:] = fill
    big[GUARD:GUARD + a.shape[0]] = a
    return torch.from_numpy(big).to(DEVICE)[GUARD:GUARD + a.shape[0]]


def _sentinel_batch(lens, vocab=40):
    """A packed batch whose last vocabulary column (the sentinel) never wins in a real row, and always wins
    (logits +1e30, draft probability 1) in the guard rows around it."""
    b = ref.random_accept_batch(np.random.default_rng(7), lens, vocab, temperature=0.8, match_prob=0.9)
    b["logits"][:, -1] = -1e30
    b = ref.redraw_near_boundaries(b, np.random.default_rng(8), tol=TOL)
    onehot = np.zeros(vocab, np.float32)
    onehot[-1] = 1.0
    rows = {"logits": 1e30 * onehot, "draft_probs": onehot, "draft_tokens": vocab - 1, "accept_uniforms": 0.0}
    t = {k: (_guarded(v, rows[k]) if k in rows else torch.from_numpy(v).to(DEVICE)) for k, v in b.items()}
    return b, t


def _run(op, t, lens):
    t = dict(t, verify_lens=torch.as_tensor(lens, dtype=torch.int64, device=DEVICE))
    if op == "greedy":
        out = kernels.greedy_accept(t["logits"], t["draft_tokens"], t["verify_lens"], check=False)
    else:
        out = kernels.sample_accept(**t, check=False)
    return as_lists(*out)


@pytest.mark.parametrize("op", ["greedy", "sample"])
def test_accept_kernels_stay_in_bounds_on_garbage_lengths(op):
    """TensorRT runs plugins while autotuning on inputs whose contents it does not specify: any int64
    verify_lens must keep every read inside the packed rows, and requests before a garbage length keep
    their exact results."""
    lens = np.array([2, 0, 3, 1])
    b, t = _sentinel_batch(lens)
    rows, vocab = b["logits"].shape
    if op == "greedy":
        want = [e.tolist() for e in ref.greedy_accept(b["logits"], b["draft_tokens"], b["verify_lens"])]
    else:
        want = [e.tolist() for e in ref.sample_accept(**b)]
    assert _run(op, t, lens) == want

    i64 = np.iinfo(np.int64)
    garbage = [np.array([2, 0, 3, 1 << 40]), np.array([2, 0, 3, -7]), np.array([-5, 1 << 62, -(1 << 62), 7]),
               np.array([i64.max, i64.min, i64.max, i64.max]),
               np.random.default_rng(3).integers(i64.min, i64.max, 4, dtype=np.int64)]
    for g in garbage:
        acc, nxt = _run(op, t, g)
        assert all(0 <= a < rows for a in acc), (g, acc)
        assert all(0 <= x < vocab - 1 for x in nxt), (g, nxt)  # the sentinel column: a guard row was read
    for g in garbage[:2]:  # only the last length is garbage: the first three requests are untouched
        acc, nxt = _run(op, t, g)
        assert acc[:3] == want[0][:3] and nxt[:3] == want[1][:3]


@pytest.mark.parametrize("op", ["greedy", "sample"])
def test_accept_kernels_read_nothing_without_rows(op):
    b, t = _sentinel_batch(np.array([1, 2]))
    empty = {k: (v[:0] if v.shape[0] == b["logits"].shape[0] else v) for k, v in t.items()}
    assert _run(op, empty, [5, -1]) == [[0, 0], [0, 0]]


def test_interpreting_without_triton_knobs(monkeypatch):
    """Triton < 3.4 has no triton.knobs: the TRITON_INTERPRET variable says the same."""
    assert kernels.interpreting() == (DEVICE == "cpu")
    monkeypatch.delattr(kernels.triton, "knobs")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.interpreting()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not kernels.interpreting()
