"""The dspark op spec, launch geometry, import hygiene and the TensorRT registration (against a stub)."""

import importlib
import subprocess
import sys

import numpy as np
import pytest

from dspark_trt.errors import DsparkError
from dspark_trt.plugins import launch, spec


# ------------------------------------------------------------------------------------------------ spec
def test_ops_are_the_five_with_exact_signatures():
    assert list(spec.OPS) == ["Survival", "GreedyAccept", "SampleAccept", "MarkovDraft", "MarkovSample"]
    s, g, a = spec.OPS["Survival"], spec.OPS["GreedyAccept"], spec.OPS["SampleAccept"]
    assert s.input_names == ["logits", "prev", "start"] and s.output_names == ["survival"]
    assert [x.name for x in s.attributes] == ["temperatures"] and s.attr("temperatures").type == "FLOATS"
    assert g.input_names == ["logits", "draft_tokens", "verify_lens"]
    assert g.output_names == ["accepted", "next_token"]
    assert a.input_names == ["logits", "draft_probs", "draft_tokens", "verify_lens", "temperature",
                             "accept_uniforms", "sample_uniforms"]
    assert a.output_names == ["accepted", "next_token"]
    for op in spec.OPS.values():
        assert (op.domain, op.version, op.plugin_id) == ("dspark", 1, f"dspark::{op.name}")
        assert all(t.dtypes == ("int64",) for t in op.outputs
                   if t.name not in ("survival", "confidence_logits", "draft_probs"))
    m = spec.OPS["MarkovDraft"]
    assert m.input_names == ["base_logits", "conf_base", "anchor", "markov_w1", "markov_w2", "conf_w", "d2t"]
    assert m.output_names == ["draft_tokens", "confidence_logits"]
    assert [(x.name, x.type, x.required, x.default) for x in m.attributes] == [
        ("steps", "INT", True, None), ("logit_scale", "FLOAT", False, 1.0), ("draft_topk", "INT", False, 0),
        ("qmax_confidence", "INT", False, 0)]
    ms = spec.OPS["MarkovSample"]
    assert ms.input_names == m.input_names + ["temperature", "uniforms"] and ms.attributes == m.attributes
    assert ms.output_names == ["draft_tokens", "confidence_logits", "draft_probs"]
    assert ms.outputs[2].shape == ("R", "N", "T")
    assert s.outputs[0].dtypes == ("float32",) and s.outputs[0].shape == ("R", "J")


def test_sample_accept_reserves_top_k_top_p_for_version_2():
    reserved = spec.OPS["SampleAccept"].reserved_inputs
    assert [(t.name, t.dtypes, t.shape, t.optional) for t in reserved] == [
        ("top_k", ("int64",), ("R",), True), ("top_p", ("float32",), ("R",), True)]
    assert "top_k" in spec.__doc__ and "top_p" in spec.__doc__ and "Version 2" in spec.__doc__


def test_op_names_are_not_standard_onnx_ops():
    onnx = pytest.importorskip("onnx")
    standard = {s.name for s in onnx.defs.get_all_schemas_with_history()}
    for name in spec.OPS:
        assert name not in standard, f"{name} collides with a standard ONNX op (TensorRT matches op_type only)"


def test_make_node_sets_domain_namespace_and_checks_attributes():
    pytest.importorskip("onnx")
    node = spec.make_node("Survival", ["l", "p", "s"], ["out"], temperatures=[1, 0.5])
    attrs = {a.name: a for a in node.attribute}
    assert node.domain == "dspark" and node.op_type == "Survival"
    assert attrs["plugin_namespace"].s == b"dspark"
    assert list(attrs["temperatures"].floats) == [1.0, 0.5]
    node = spec.make_node("GreedyAccept", ["a", "b", "c"], ["x", "y"], aot=1, name="g")
    assert {a.name: a for a in node.attribute}["aot"].i == 1 and node.name == "g"
    with pytest.raises(ValueError, match="needs attribute 'temperatures'"):
        spec.make_node("Survival", ["l", "p", "s"], ["out"])
    with pytest.raises(ValueError, match="> 0"):
        spec.make_node("Survival", ["l", "p", "s"], ["out"], temperatures=[1.0, 0.0])
    with pytest.raises(ValueError, match="must not be empty"):
        spec.make_node("Survival", ["l", "p", "s"], ["out"], temperatures=[])
    with pytest.raises(ValueError, match="takes 3 inputs"):
        spec.make_node("GreedyAccept", ["a", "b"], ["x", "y"])
    with pytest.raises(ValueError, match="no attribute"):
        spec.make_node("GreedyAccept", ["a", "b", "c"], ["x", "y"], top_k=3)
    with pytest.raises(KeyError, match="unknown dspark op"):
        spec.make_node("ArgMax", ["a"], ["b"])


def test_output_dims_shape_rule():
    assert spec.output_dims("Survival", [(5, 3), (5,), (5,)]) == [(5, 3)]
    assert spec.output_dims("GreedyAccept", [(12, 100), (12,), (4,)]) == [(4,), (4,)]
    assert spec.output_dims("SampleAccept", [(12, 100), (12, 100), (12,), (4,), (4,), (12,), (4,)]) == [(4,), (4,)]
    symbolic = spec.output_dims("GreedyAccept", [("M", "V"), ("M",), ("R",)])
    assert symbolic == [("R",), ("R",)]
    with pytest.raises(ValueError, match="rank"):
        spec.output_dims("GreedyAccept", [(12,), (12,), (4,)])
    assert spec.check_concrete_shapes("GreedyAccept", {"logits": (9, 7), "draft_tokens": (9,),
                                                       "verify_lens": (2,)}) == {"M": 9, "V": 7, "R": 2}
    with pytest.raises(ValueError, match="dim M"):
        spec.check_concrete_shapes("GreedyAccept", {"logits": (9, 7), "draft_tokens": (8,), "verify_lens": (2,)})


def test_plugin_type_combinations():
    for name, op in spec.OPS.items():
        combos = spec.plugin_type_combinations(name)
        n_float = sum(t.dtypes == spec.FLOAT_TYPES for t in op.inputs)
        assert len(combos) == 3 ** n_float and len(set(combos)) == len(combos)
        for c in combos:
            types = [x.strip() for x in c.split(",")]
            assert len(types) == len(op.inputs) + len(op.outputs)
            assert set(types) <= {"FP32", "FP16", "BF16", "INT64"}
    assert spec.plugin_type_combinations("GreedyAccept")[0] == "FP32, INT64, INT64, INT64, INT64"


# ---------------------------------------------------------------------------------------------- launch
def test_next_power_of_2_and_clamp():
    assert [launch.next_power_of_2(n) for n in (0, 1, 2, 3, 5, 64, 65)] == [1, 1, 2, 4, 8, 64, 128]
    assert launch.clamp_block(3, 16, 64) == 16 and launch.clamp_block(1000, 16, 64) == 64


@pytest.mark.parametrize("vocab", [6, 50, 1000, 32000, 32771, 152064])
def test_accept_launch(vocab):
    cfg = launch.accept_launch(7, vocab)
    bv = cfg.constexprs["BLOCK_V"]
    assert cfg.grid == (7, 1, 1)
    assert bv & (bv - 1) == 0 and launch.MIN_BLOCK <= bv <= launch.MAX_BLOCK_V
    assert bv >= min(vocab, launch.MAX_BLOCK_V)  # one block when it fits, else the largest block
    assert cfg.constexprs["BLOCK_R"] == launch.BLOCK_R and cfg.num_warps in (1, 2, 4, 8)
    assert cfg.threads == 32 * cfg.num_warps
    assert launch.aot_accept_launch(vocab).constexprs == cfg.constexprs
    assert launch.aot_accept_launch(None).constexprs["BLOCK_V"] == launch.MAX_BLOCK_V


def test_survival_launch():
    assert launch.survival_launch(5, 1).grid == (5, 1, 1)
    assert launch.survival_launch(5, 1).constexprs == {"BLOCK_J": launch.MIN_BLOCK}
    assert launch.survival_launch(5, 40).constexprs == {"BLOCK_J": 64}
    assert launch.survival_launch(5, 1000).constexprs == {"BLOCK_J": launch.MAX_BLOCK_J}
    assert launch.survival_launch(0, 3).grid == (0, 1, 1)
    assert launch.aot_survival_launch().constexprs["BLOCK_J"] == launch.MIN_BLOCK


# ------------------------------------------------------------------------------------- import hygiene
def test_plugins_package_is_import_light():
    code = ("import sys, dspark_trt.plugins, dspark_trt.plugins.spec, dspark_trt.plugins.launch\n"
            "heavy = [m for m in ('torch', 'triton', 'tensorrt', 'onnx') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tensorrt_plugins_without_tensorrt_raises_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # makes `import tensorrt` fail like a missing package
    monkeypatch.delitem(sys.modules, "dspark_trt.plugins.tensorrt_plugins", raising=False)
    with pytest.raises(DsparkError) as err:
        importlib.import_module("dspark_trt.plugins.tensorrt_plugins")
    msg = str(err.value)
    assert "dspark-trt[trt]" in msg and "NVIDIA GPU" in msg and "\n" not in msg
    assert "dspark_trt.plugins.tensorrt_plugins" not in sys.modules
    assert isinstance(err.value, ImportError)  # so pytest.importorskip(...) skips instead of erroring
    with pytest.raises(pytest.skip.Exception):
        pytest.importorskip("dspark_trt.plugins.tensorrt_plugins")


# ------------------------------------------------------- TensorRT registration vs. tests/fake_tensorrt.py
PLUGIN_MOD = "dspark_trt.plugins.tensorrt_plugins"


@pytest.fixture
def plugins(monkeypatch):
    """The plugin module imported against a fresh fake TensorRT 10.9 (see tests/fake_tensorrt.py)."""
    import fake_tensorrt

    trt = fake_tensorrt.make("10.9.0.34")
    fake_tensorrt.install(monkeypatch, trt)
    sys.modules.pop(PLUGIN_MOD, None)
    yield importlib.import_module(PLUGIN_MOD), trt
    sys.modules.pop(PLUGIN_MOD, None)


def test_registration_against_the_plugin_api(plugins):
    mod, trt = plugins
    Desc = trt.plugin.TensorDesc
    assert trt.plugin.QDP_REGISTRY == {}  # importing registers nothing
    assert mod.register(["jit"]) == {"jit"}
    reg = trt.plugin.QDP_REGISTRY
    assert sorted(reg) == sorted(mod.REGISTERED) == sorted(op.plugin_id for op in spec.OPS.values())
    assert all(d.impl_func and d.autotune_func and d.aot_impl_func is None for d in reg.values())
    assert mod.register(["aot", "jit"]) == {"aot", "jit"} and mod.register(["jit"]) == {"aot", "jit"}  # idempotent
    assert all(d.aot_impl_func for d in reg.values())
    with pytest.raises(DsparkError, match="unknown dspark plugin implementation"):
        mod.register(["cuda"])

    out = reg["dspark::Survival"].register_func(Desc((5, 3), trt.float16), Desc((5,), trt.float32),
                                                Desc((5,), trt.int64), np.ones(2, np.float32))
    assert [e.constant_value() for e in out.shape_expr] == [5, 3] and out.dtype == trt.float32
    acc, nxt = reg["dspark::SampleAccept"].register_func(*[Desc(s, trt.float32) for s in
                                                           [(12, 100), (12, 100), (12,), (4,), (4,), (12,), (4,)]])
    assert [e.constant_value() for e in acc.shape_expr] == [4] and acc.dtype == nxt.dtype == trt.int64
    tune = reg["dspark::GreedyAccept"].autotune_func(None, None, None, None)
    assert [c[1] for c in tune] == spec.plugin_type_combinations("GreedyAccept")
    assert mod._input_dtypes("Survival", Desc((1, 1), trt.bfloat16), Desc((1,), trt.float32),
                             Desc((1,), trt.int64)) == {"logits": "bfloat16", "prev": "float32", "start": "int64"}


def test_markov_plugins_register_with_the_shapes_of_the_spec(plugins):
    mod, trt = plugins
    Desc = trt.plugin.TensorDesc
    mod.register(["aot", "jit"])
    reg = trt.plugin.QDP_REGISTRY
    markov_in = [Desc((4, 7, 500), trt.float16), Desc((4, 7), trt.float32), Desc((4,), trt.int64),
                 Desc((600, 32), trt.float32), Desc((500, 32), trt.float32), Desc((32,), trt.float32),
                 Desc((500,), trt.int64)]
    toks, conf = reg["dspark::MarkovDraft"].register_func(*markov_in, 7, 1.0, 0, 1)
    assert [e.constant_value() for e in toks.shape_expr] == [4, 7] == [e.constant_value() for e in conf.shape_expr]
    assert (toks.dtype, conf.dtype) == (trt.int64, trt.float32)
    *_, probs = reg["dspark::MarkovSample"].register_func(*markov_in, Desc((4,), trt.float32),
                                                          Desc((4, 7), trt.float32), 7, 1.0, 0, 1)
    assert [e.constant_value() for e in probs.shape_expr] == [4, 7, 600]  # in the target vocabulary
    assert probs.dtype == trt.float32
    # every function takes the spec's attributes by name, in order (TensorRT maps node attributes by name)
    import inspect

    for op in ("MarkovDraft", "MarkovSample"):
        d = reg[f"dspark::{op}"]
        attrs = [a.name for a in spec.OPS[op].attributes]
        for fn in (d.register_func, d.impl_func, d.aot_impl_func):
            params = list(inspect.signature(fn).parameters)
            n_in = len(spec.OPS[op].inputs)
            assert params[n_in:n_in + len(attrs)] == attrs, (op, fn.__name__)


def test_jit_only_registration_builds_jit_for_any_request(plugins):
    """A process loading JIT engines registers "jit" only: whatever creation request TensorRT passes at
    deserialization (UNKNOWN included), the creator builds the JIT plugin."""
    mod, trt = plugins
    mod.register(["jit"])
    Q = trt.QuickPluginCreationRequest
    for req in (None, Q.UNKNOWN, Q.PREFER_JIT, Q.PREFER_AOT, Q.STRICT_JIT):
        assert trt.plugin.create_plugin("dspark::GreedyAccept", req) == "jit"
    mod.register(["aot"])  # both: an UNKNOWN request is refused, as TensorRT's creator does
    with pytest.raises(ValueError, match="both AOT and JIT"):
        trt.plugin.create_plugin("dspark::GreedyAccept", Q.UNKNOWN)


def test_static_reads_constant_value_as_the_method_it_is(plugins):
    mod, trt = plugins
    E = trt.plugin.ShapeExpr
    assert mod._static(E(32000)) == 32000 and mod._static(7) == 7
    assert mod._static(E(None)) is None  # symbolic: constant_value() would raise
    assert mod._static(E(None, fake=True)) is None  # fake: is_constant itself raises
    assert mod._static(object()) is None


def test_bfloat16_tensors_reach_torch_without_cuda_array_interface(plugins):
    """trtp.Tensor.__cuda_array_interface__ raises for BF16; the JIT path reads such buffers as int16 and
    views them back. Checked on host memory with the same descriptor (numpy reads __array_interface__)."""
    torch = pytest.importorskip("torch")
    mod, trt = plugins
    src = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16) / 3
    t = trt.plugin.Tensor(src.data_ptr(), (3, 4), trt.bfloat16)
    with pytest.raises(ValueError, match="not supported"):
        t.__cuda_array_interface__
    desc = mod._RawCuda(t, mod._RAW_VIEWS[trt.bfloat16][0]).__cuda_array_interface__
    assert desc["typestr"] == "<i2" and desc["strides"] == (8, 2) and desc["data"][0] == src.data_ptr()

    class Host:
        __array_interface__ = desc

    back = torch.from_numpy(np.asarray(Host()).copy()).view(getattr(torch, mod._RAW_VIEWS[trt.bfloat16][1]))
    assert torch.equal(back, src)
    assert trt.float32 not in mod._RAW_VIEWS  # other dtypes keep TensorRT's own interface
