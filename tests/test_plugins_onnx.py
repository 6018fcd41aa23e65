"""The ONNX function bodies of the dspark ops on ONNX Runtime == the numpy reference."""

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import onnx.inliner  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from dspark_trt.errors import DsparkError  # noqa: E402
from dspark_trt.plugins import reference as ref  # noqa: E402
from dspark_trt.plugins.onnx_functions import attach_functions, function_protos  # noqa: E402
from dspark_trt.plugins.spec import OPS, make_node  # noqa: E402

TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16,
         "int64": TensorProto.INT64}
F32 = np.float32
TOL = 2e-4  # decision-boundary tolerance for sampling parity (see reference.sample_accept_with_margin)


def op_model(op_name, opset=18, float_type="float32", attach=True, **attrs):
    op = OPS[op_name]

    def vi(t):
        dtype = float_type if t.dtypes[0] == "float32" and len(t.dtypes) > 1 else t.dtypes[0]
        return helper.make_tensor_value_info(t.name, TYPES[dtype], list(t.shape))

    graph = helper.make_graph([make_node(op_name, op.input_names, op.output_names, name=op_name, **attrs)],
                              f"{op_name}_test", [vi(t) for t in op.inputs], [vi(t) for t in op.outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    if attach:
        attach_functions(model)
    return model


_SESSIONS = {}

# Attributes each op needs in a one-node test model.
NEEDED_ATTRS = {"Survival": {"temperatures": [1.0]}, "MarkovDraft": {"steps": 3}, "MarkovSample": {"steps": 2}}


def run(model, feeds: dict):
    key = model.SerializeToString()
    if key not in _SESSIONS:
        _SESSIONS[key] = ort.InferenceSession(key, providers=["CPUExecutionProvider"])
    sess = _SESSIONS[key]
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: _ort_value(v) for k, v in feeds.items() if k in names})


def _ort_value(v):
    if v.dtype.name == "bfloat16":  # numpy has no bfloat16; pass the bits with the ONNX type
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(v.view(np.uint16), TensorProto.BFLOAT16)
    return v


@pytest.fixture(scope="module")
def models():
    return {name: op_model(name, **NEEDED_ATTRS.get(name, {})) for name in OPS}


# ------------------------------------------------------------------------------------------- structure
@pytest.mark.parametrize("opset", [18, 21])
def test_models_pass_the_full_checker(opset):
    for name in OPS:
        model = op_model(name, opset=opset, **({"temperatures": [0.5, 1.0]} if name == "Survival"
                                                else NEEDED_ATTRS.get(name, {})))
        onnx.checker.check_model(model, full_check=True)
        (f,) = model.functions
        assert (f.domain, f.name) == ("dspark", name)
        assert [(o.domain, o.version) for o in f.opset_import] == [("", opset)]
        assert ("dspark", 1) in [(o.domain, o.version) for o in model.opset_import]
        assert {n.op_type for n in f.node} <= ALLOWED_BODY_OPS, {n.op_type for n in f.node} - ALLOWED_BODY_OPS
        if name == "Survival":
            assert list(f.attribute) == ["temperatures"]


# Standard ops the bodies may use: all imported natively by the TensorRT ONNX parser; no Loop/Scan/If.
# (MarkovDraft/MarkovSample add Concat, Expand, MatMul, TopK and Transpose: their bodies are unrolled
# over the draft positions.)
ALLOWED_BODY_OPS = {"Abs", "Add", "And", "Cast", "Concat", "Constant", "ConstantOfShape", "CumSum", "Div", "Equal",
                    "Exp", "Expand", "Gather", "GatherElements", "Greater", "GreaterOrEqual", "Identity", "Less", "LessOrEqual",
                    "Log", "MatMul", "Max", "Min", "Mul", "Neg", "Not", "Or", "Range", "ReduceMax", "ReduceSum",
                    "ScatterElements", "Shape", "Squeeze", "Sub", "TopK", "Transpose", "Unsqueeze", "Where"}


@pytest.mark.parametrize("float_type", ["float32", "float16"])
def test_bodies_use_only_ops_and_dtypes_tensorrt_imports(float_type):
    """Every node of the inlined bodies, with its inferred input dtypes, is in the TensorRT 10 ONNX op
    table bundled with the exporter (onnx-tensorrt docs/operators.md)."""
    try:
        from dspark_trt.exporter.trt_support import load_op_table, onnx_dtype_name
        table = load_op_table()["ops"]
    except Exception as exc:  # the exporter is developed in parallel; the table is its data file
        pytest.skip(f"TensorRT op table not available: {exc}")
    for name in OPS:
        model = op_model(name, float_type=float_type, **NEEDED_ATTRS.get(name, {}))
        flat = onnx.shape_inference.infer_shapes(onnx.inliner.inline_local_functions(model), strict_mode=True)
        types = {v.name: v.type.tensor_type.elem_type
                 for v in (*flat.graph.input, *flat.graph.value_info, *flat.graph.output)}
        for node in flat.graph.node:
            entry = table.get(node.op_type)
            assert entry and entry["supported"], (name, node.op_type)
            for inp in node.input[:1] if node.op_type not in ("Where",) else node.input[1:2]:
                assert onnx_dtype_name(types[inp]) in entry["types"], (name, node.op_type, onnx_dtype_name(types[inp]))


def test_attach_functions_is_idempotent_and_validates():
    model = op_model("GreedyAccept")
    attach_functions(model)
    assert [f.name for f in model.functions] == ["GreedyAccept"]
    assert [(o.domain, o.version) for o in model.opset_import].count(("dspark", 1)) == 1

    old = op_model("GreedyAccept", attach=False, opset=17)
    with pytest.raises(DsparkError, match="opset >= 18"):
        attach_functions(old)

    bare = op_model("GreedyAccept", attach=False)
    del bare.graph.node[0].attribute[:]  # no plugin_namespace
    with pytest.raises(DsparkError, match="plugin_namespace"):
        attach_functions(bare)

    unknown = op_model("GreedyAccept", attach=False)
    unknown.graph.node[0].op_type = "Greedy"
    with pytest.raises(DsparkError, match="unknown dspark op"):
        attach_functions(unknown)

    plain = helper.make_model(helper.make_graph([], "g", [], []))
    assert attach_functions(plain) is plain and not plain.functions
    with pytest.raises(DsparkError):
        function_protos(["Nope"])


def test_survival_temperatures_default_on_the_function():
    """function_protos(temperatures=...) makes them the default: a node without the attribute works."""
    op = OPS["Survival"]
    node = helper.make_node("Survival", op.input_names, op.output_names, domain="dspark",
                            plugin_namespace="dspark")
    graph = helper.make_graph([node], "g",
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["R", "J"]),
                               helper.make_tensor_value_info("prev", TensorProto.FLOAT, ["R"]),
                               helper.make_tensor_value_info("start", TensorProto.INT64, ["R"])],
                              [helper.make_tensor_value_info("survival", TensorProto.FLOAT, ["R", "J"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    temps = [0.5, 2.0]
    attach_functions(model, temperatures=temps)
    onnx.checker.check_model(model, full_check=True)
    assert [a.name for a in model.functions[0].attribute_proto] == ["temperatures"]
    x, prev, start = ref.survival_cases()["many_columns"][:3]
    (got,) = run(model, dict(logits=x, prev=prev, start=start))
    np.testing.assert_allclose(got, ref.survival(x, prev, start, temps), rtol=2e-5, atol=1e-30)
    # a node attribute still wins over the default
    model.graph.node[0].attribute.append(helper.make_attribute("temperatures", [3.0]))
    (got,) = run(model, dict(logits=x, prev=prev, start=start))
    np.testing.assert_allclose(got, ref.survival(x, prev, start, [3.0]), rtol=2e-5, atol=1e-30)


def test_inlined_twin_gives_the_same_results():
    b = ref.accept_cases(seed=5)["random"]
    model = op_model("SampleAccept")
    flat = onnx.inliner.inline_local_functions(model)
    assert not flat.functions and all(n.domain in ("", "ai.onnx") for n in flat.graph.node)
    onnx.checker.check_model(flat, full_check=True)
    for a, c in zip(run(model, b), run(flat, b)):
        assert a.tolist() == c.tolist()


# ---------------------------------------------------------------------------------------------- parity
@pytest.mark.parametrize("case", list(ref.survival_cases()))
def test_survival_parity(case):
    x, prev, start, temps = ref.survival_cases()[case]
    model = op_model("Survival", temperatures=temps)
    (got,) = run(model, dict(logits=x, prev=prev, start=np.asarray(start, np.int64)))
    exp = ref.survival(x, prev, start, temps)
    assert got.dtype == np.float32 and got.shape == exp.shape
    np.testing.assert_allclose(got, exp, rtol=2e-5, atol=1e-30)
    assert ((got == 0) == (exp == 0)).all()


CASES = ref.accept_cases(seed=0)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_accept_parity(case, models):
    b = CASES[case]
    acc, nxt = run(models["GreedyAccept"], b)
    exp_acc, exp_nxt = ref.greedy_accept(b["logits"], b["draft_tokens"], b["verify_lens"])
    assert acc.dtype == nxt.dtype == np.int64
    assert acc.tolist() == exp_acc.tolist() and nxt.tolist() == exp_nxt.tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_sample_accept_parity(case, models):
    b = ref.redraw_near_boundaries(CASES[case], np.random.default_rng(11), tol=TOL)
    acc, nxt = run(models["SampleAccept"], b)
    exp_acc, exp_nxt = ref.sample_accept(**b)
    assert acc.tolist() == exp_acc.tolist() and nxt.tolist() == exp_nxt.tolist()


def test_sample_accept_raw_draws_differ_only_at_boundaries(models):
    """Without moving draws: any disagreement must be a draw within TOL of a decision boundary."""
    rng = np.random.default_rng(21)
    b = ref.random_accept_batch(rng, rng.integers(0, 9, 64), 300, temperature=rng.uniform(0.3, 2.0, 64))
    acc, nxt = run(models["SampleAccept"], b)
    exp_acc, exp_nxt, margin = ref.sample_accept_with_margin(**b)
    differ = (acc != exp_acc) | (nxt != exp_nxt)
    assert (margin[differ] < TOL).all(), (np.flatnonzero(differ), margin[differ])
    assert differ.sum() <= 2


def test_sample_accept_greedy_equals_greedy_accept(models):
    for name, b in ref.accept_cases(seed=9).items():
        b = dict(b, temperature=np.zeros_like(b["temperature"]))
        q = np.zeros_like(b["draft_probs"])
        valid = (b["draft_tokens"] >= 0) & (b["draft_tokens"] < q.shape[1])
        q[np.flatnonzero(valid), b["draft_tokens"][valid]] = 1.0
        b["draft_probs"] = q
        s = run(models["SampleAccept"], b)
        g = run(models["GreedyAccept"], b)
        assert s[0].tolist() == g[0].tolist() and s[1].tolist() == g[1].tolist(), name


@pytest.mark.parametrize("float_type", ["float16", "bfloat16"])
def test_low_precision_logits(float_type):
    b = ref.redraw_near_boundaries(CASES["random"], np.random.default_rng(2), tol=TOL)
    to = {"float16": np.float16}.get(float_type)
    if to is None:
        pytest.importorskip("ml_dtypes")
        import ml_dtypes

        to = ml_dtypes.bfloat16
    low = dict(b, logits=b["logits"].astype(to), draft_probs=b["draft_probs"].astype(to))
    # the reference on the same (rounded) values, computed in float32
    rounded = dict(b, logits=low["logits"].astype(F32), draft_probs=low["draft_probs"].astype(F32))
    rounded = ref.redraw_near_boundaries(rounded, np.random.default_rng(3), tol=TOL)
    low.update(accept_uniforms=rounded["accept_uniforms"], sample_uniforms=rounded["sample_uniforms"])
    g = run(op_model("GreedyAccept", float_type=float_type), low)
    s = run(op_model("SampleAccept", float_type=float_type), low)
    eg = ref.greedy_accept(rounded["logits"], rounded["draft_tokens"], rounded["verify_lens"])
    es = ref.sample_accept(**rounded)
    assert [a.tolist() for a in g] == [a.tolist() for a in eg]
    assert [a.tolist() for a in s] == [a.tolist() for a in es]
