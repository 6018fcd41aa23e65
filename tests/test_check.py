"""`dspark-trt check`: synthetic artifacts (tiny ONNX graphs with a dspark op + manifest)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from dspark_trt.cli import cli
from dspark_trt.errors import DsparkError
from dspark_trt.exporter.check import check_artifacts
from dspark_trt.exporter.trt_support import ONNX_DTYPE_NAMES, load_op_table, support_for
from dspark_trt.manifest import Manifest

VOCAB, HIDDEN, K = 16, 8, 3
OPSET = 18


# ------------------------------------------------------------------------------------------ builders


def survival_function() -> onnx.FunctionProto:
    """dspark::Survival(c[R, K]) -> prod-cumulative survival, as plain ONNX: Exp(CumSum(Log(c), axis=1))."""
    axis = helper.make_node("Constant", [], ["axis"], value=helper.make_tensor("v", TensorProto.INT64, [], [1]))
    return helper.make_function(
        "dspark", "Survival", ["c"], ["s"],
        [axis, helper.make_node("Log", ["c"], ["logc"]), helper.make_node("CumSum", ["logc", "axis"], ["cs"]),
         helper.make_node("Exp", ["cs"], ["s"])],
        opset_imports=[helper.make_opsetid("", OPSET)])


def greedy_accept_function() -> onnx.FunctionProto:
    return helper.make_function(
        "dspark", "GreedyAccept", ["logits"], ["tokens"],
        [helper.make_node("ArgMax", ["logits"], ["tokens"], axis=-1, keepdims=0)],
        opset_imports=[helper.make_opsetid("", OPSET)])


def draft_model(*, input_dtype=TensorProto.INT64, extra_nodes=(), namespace="dspark", with_function=True,
                conf_shape=("num_requests", K)) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    emb = numpy_helper.from_array(rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32), "emb")
    w = numpy_helper.from_array(rng.standard_normal((HIDDEN, VOCAB)).astype(np.float32), "w_out")
    attrs = {"plugin_namespace": namespace} if namespace is not None else {}
    nodes = [
        helper.make_node("Gather", ["emb", "input_ids"], ["h"], name="embed"),
        helper.make_node("MatMul", ["h", "w_out"], ["logits"], name="lm_head"),
        helper.make_node("Sigmoid", ["conf_logits"], ["conf"], name="conf_sigmoid"),
        helper.make_node("Survival", ["conf"], ["survival"], name="survival", domain="dspark", **attrs),
        *extra_nodes,
    ]
    graph = helper.make_graph(
        nodes, "draft",
        [helper.make_tensor_value_info("input_ids", input_dtype, ["num_tokens"]),
         helper.make_tensor_value_info("conf_logits", TensorProto.FLOAT, list(conf_shape))],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["num_tokens", VOCAB]),
         helper.make_tensor_value_info("survival", TensorProto.FLOAT, ["num_requests", K])],
        initializer=[emb, w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("dspark", 1)],
                              functions=[survival_function()] if with_function else [])
    model.ir_version = 10
    return model


def target_model() -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    emb = numpy_helper.from_array(rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32), "emb")
    w = numpy_helper.from_array(rng.standard_normal((HIDDEN, VOCAB)).astype(np.float32), "w_out")
    nodes = [
        helper.make_node("Gather", ["emb", "input_ids"], ["h"], name="embed"),
        helper.make_node("MatMul", ["h", "w_out"], ["logits"], name="lm_head"),
        helper.make_node("GreedyAccept", ["logits"], ["next_tokens"], name="accept", domain="dspark",
                         plugin_namespace="dspark"),
    ]
    graph = helper.make_graph(
        nodes, "target",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["num_tokens"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["num_tokens", VOCAB]),
         helper.make_tensor_value_info("next_tokens", TensorProto.INT64, ["num_tokens"])],
        initializer=[emb, w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("dspark", 1)],
                              functions=[greedy_accept_function()])
    model.ir_version = 10
    return model


def manifest_sections() -> dict:
    return dict(
        model={"arch": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_layers": 1, "num_kv_heads": 1,
               "head_dim": HIDDEN, "dtype": "fp32", "max_context": 64},
        draft={"arch": "llama", "hidden_size": HIDDEN, "num_layers": 1, "num_kv_heads": 1, "head_dim": HIDDEN,
               "max_draft": K, "confidence": "head", "temperatures": [1.0, 1.1, 1.2]},
        limits={"max_batch": 4, "max_context": 64, "max_draft": K, "max_tokens_per_step": 16},
        dims={"num_tokens": {"min": 1, "opt": 8, "max": 16}, "num_requests": {"min": 1, "opt": 2, "max": 4},
              "past_len": {"min": 0, "opt": 32, "max": 64}},
        graphs={
            "draft": {"file": "draft.onnx",
                      "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["num_tokens"]},
                                 {"name": "conf_logits", "dtype": "float32", "shape": ["num_requests", K]}],
                      "outputs": [{"name": "logits", "dtype": "float32", "shape": ["num_tokens", VOCAB]},
                                  {"name": "survival", "dtype": "float32", "shape": ["num_requests", K]}]},
            "target": {"file": "target.onnx",
                       "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["num_tokens"]}],
                       "outputs": [{"name": "logits", "dtype": "float32", "shape": ["num_tokens", VOCAB]},
                                   {"name": "next_tokens", "dtype": "int64", "shape": ["num_tokens"]}]},
        },
        tokenizer={"file": "tokenizer.json", "eos_token_id": 2},
    )


def make_artifact(root: Path, *, draft: onnx.ModelProto | None = None, target: onnx.ModelProto | None = None,
                  edit=None) -> Path:
    """Write draft.onnx, target.onnx, tokenizer.json and a hashed manifest; `edit(sections)` may change the
    manifest sections before they are written."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    onnx.save(draft if draft is not None else draft_model(), root / "draft.onnx")
    onnx.save(target if target is not None else target_model(), root / "target.onnx")
    (root / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    sections = manifest_sections()
    if edit is not None:
        edit(sections)
    m = Manifest.create(**sections, tools={"dspark_trt": "0.1.0", "onnx": onnx.__version__})
    for name in ("draft.onnx", "target.onnx", "tokenizer.json"):
        m.record_file(root, name)
    m.save(root)
    return root


@pytest.fixture
def artifact(tmp_path) -> Path:
    return make_artifact(tmp_path / "art")


def _has(problems, *needles) -> bool:
    return any(all(n in p for n in needles) for p in problems)


# ------------------------------------------------------------------------------------------ data file


def test_data_file_records_source_and_covers_llm_ops():
    table = load_op_table()
    assert table["source"] == "onnx-tensorrt docs/operators.md"
    assert table["tensorrt_version"] and table["revision"]
    ops = table["ops"]
    for op in ("MatMul", "Gather", "Softmax", "CumSum", "ArgMax", "TopK", "Where", "Cast", "RMSNormalization"):
        assert ops[op]["supported"], op
    assert "NonExistentOp" not in ops
    assert not ops["Unique"]["supported"] and not ops["StringSplit"]["supported"]
    assert "10.14" in support_for("10.13").unsupported_reason("Attention")
    assert support_for("11.0").unsupported_reason("Attention") is None
    assert support_for("10.9").opset_max == 22 and support_for().opset_max == 24
    assert "10.15" in support_for("10.13").unsupported_reason("RMSNormalization")
    assert support_for().unsupported_reason("RMSNormalization") is None
    assert support_for().unsupported_reason("MadeUpOp")


def test_dtype_names_match_onnx():
    for num, name in ONNX_DTYPE_NAMES.items():
        onnx_name = TensorProto.DataType.Name(num).lower()
        expected = {"float": "float32", "double": "float64"}.get(onnx_name, onnx_name)
        assert name == expected


def test_bad_trt_version_is_a_user_error(artifact):
    with pytest.raises(DsparkError, match="not like"):
        check_artifacts(artifact, trt_version="eleven")
    with pytest.raises(DsparkError, match="10.0 and later"):
        check_artifacts(artifact, trt_version="8.6")


# ------------------------------------------------------------------------------------------ check


def test_good_artifact_passes(artifact):
    report = check_artifacts(artifact)
    assert report.ok, report.problems
    text = "\n".join(report.summary_lines())
    assert "draft.onnx" in text and "target.onnx" in text
    assert "Survival x1" in text and "GreedyAccept x1" in text
    assert "num_tokens 1/8/16" in text
    assert report.summary_lines()[-1] == "ok"
    # the standard ops inside the dspark function bodies are linted too
    assert {"Log", "CumSum", "Exp"} <= set(report.graphs["draft"].op_counts)


def test_unsupported_standard_op_reported(tmp_path):
    bad = helper.make_node("FrobnicateTensor", ["logits"], ["junk"], name="frob")
    model = draft_model(extra_nodes=[bad])
    model.graph.output.append(helper.make_tensor_value_info("junk", TensorProto.FLOAT, None))
    root = make_artifact(tmp_path / "a", draft=model, edit=lambda s: s["graphs"]["draft"]["outputs"].append(
        {"name": "junk", "dtype": "float32", "shape": []}))
    report = check_artifacts(root)
    assert not report.ok
    assert _has(report.problems, "draft.onnx", "frob", "FrobnicateTensor", "not in the TensorRT")


def test_unsupported_op_inside_function_body_reported(tmp_path):
    model = draft_model()
    fn = model.functions[0]
    fn.node.append(helper.make_node("Unique", ["s"], ["u"]))
    root = make_artifact(tmp_path / "a", draft=model)
    report = check_artifacts(root)
    assert _has(report.problems, "function dspark::Survival", "Unique", "unsupported")


def test_float64_input_reported(tmp_path):
    model = draft_model()
    model.graph.input[1].type.tensor_type.elem_type = TensorProto.DOUBLE
    model.graph.node[2].op_type = "Cast"
    del model.graph.node[2].attribute[:]
    model.graph.node[2].attribute.append(helper.make_attribute("to", TensorProto.FLOAT))
    root = make_artifact(tmp_path / "a", draft=model)
    report = check_artifacts(root)
    assert _has(report.problems, "draft.onnx", "input 'conf_logits'", "float64")
    assert _has(report.problems, "manifest says float32") or _has(report.problems, "is float64 in the graph")


def test_cast_to_rejected_dtype_reported(tmp_path):
    cast = helper.make_node("Cast", ["logits"], ["as_u32"], name="bad_cast", to=TensorProto.UINT32)
    model = draft_model(extra_nodes=[cast])
    root = make_artifact(tmp_path / "a", draft=model)
    report = check_artifacts(root)
    assert _has(report.problems, "bad_cast", "uint32")


def test_missing_plugin_namespace_reported(tmp_path):
    root = make_artifact(tmp_path / "a", draft=draft_model(namespace=None))
    report = check_artifacts(root)
    assert _has(report.problems, "draft.onnx", "survival", "dspark::Survival", "plugin_namespace")


def test_wrong_plugin_namespace_reported(tmp_path):
    root = make_artifact(tmp_path / "a", draft=draft_model(namespace="other"))
    assert _has(check_artifacts(root).problems, "plugin_namespace is 'other'")


def test_missing_function_body_reported(tmp_path):
    root = make_artifact(tmp_path / "a", draft=draft_model(with_function=False))
    report = check_artifacts(root)
    assert _has(report.problems, "draft.onnx", "dspark::Survival", "no model-local function")


def test_standard_op_name_in_dspark_domain_reported(tmp_path):
    model = draft_model()
    model.graph.node[3].op_type = "Softmax"
    model.functions[0].name = "Softmax"
    root = make_artifact(tmp_path / "a", draft=model)
    assert _has(check_artifacts(root).problems, "standard ONNX op name 'Softmax'")


def _with_plugin_attrs(**attrs) -> onnx.ModelProto:
    model = draft_model()
    model.graph.node[3].attribute.extend(helper.make_attribute(k, v) for k, v in attrs.items())
    return model


def test_plugin_attributes_the_parser_takes_pass(tmp_path):
    """onnx-tensorrt turns FLOAT, INT, STRING, FLOATS, INTS, STRINGS and TENSOR (float/int8-32/string/half/
    bf16/double) attributes into plugin fields: none of them is a problem."""
    ok = {"mode": b"fast", "names": [b"a", b"b"], "weights": helper.make_tensor("w", TensorProto.FLOAT, [2], [1, 2]),
          "ids": helper.make_tensor("i", TensorProto.INT32, [1], [3]), "scale": 0.5, "steps": [1, 2]}
    report = check_artifacts(make_artifact(tmp_path / "a", draft=_with_plugin_attrs(**ok)))
    assert not [p for p in report.problems if "plugin importer" in p], report.problems


@pytest.mark.parametrize("dtype", [TensorProto.INT64, TensorProto.BOOL, TensorProto.UINT8, TensorProto.UINT32,
                                   TensorProto.COMPLEX64])
def test_plugin_tensor_attributes_the_parser_rejects_reported(tmp_path, dtype):
    bad = helper.make_tensor("t", dtype, [1], [1])
    report = check_artifacts(make_artifact(tmp_path / "a", draft=_with_plugin_attrs(table=bad)))
    assert _has(report.problems, "attribute table", "tensor", "plugin importer takes tensors of")


def test_plugin_graph_attribute_reported(tmp_path):
    sub = helper.make_graph([], "g", [], [])
    report = check_artifacts(make_artifact(tmp_path / "a", draft=_with_plugin_attrs(body=sub)))
    assert _has(report.problems, "attribute body has type GRAPH", "plugin importer takes only")


def test_tampered_file_hash_reported(artifact):
    data = bytearray((artifact / "target.onnx").read_bytes())
    data[-1] ^= 0xFF
    (artifact / "target.onnx").write_bytes(bytes(data))
    report = check_artifacts(artifact)
    assert _has(report.problems, "target.onnx", "sha256", "changed after export")


def test_uncovered_dynamic_dim_reported(tmp_path):
    # conf_logits gets a dynamic second axis the manifest calls a dim that "dims" does not define
    model = draft_model(conf_shape=("num_requests", "draft_len"))

    def edit(s):
        s["graphs"]["draft"]["inputs"][1]["shape"] = ["num_requests", "draft_len"]

    root = make_artifact(tmp_path / "a", draft=model, edit=edit)
    report = check_artifacts(root)
    assert _has(report.problems, "conf_logits", "axis 1", "not in 'dims'")
    assert _has(report.problems, "manifest.json", "draft_len")


def test_unnamed_dynamic_dim_recorded_as_zero_reported(tmp_path):
    model = draft_model()
    model.graph.input[1].type.tensor_type.shape.dim[1].Clear()  # unnamed dynamic axis
    root = make_artifact(tmp_path / "a", draft=model,
                         edit=lambda s: s["graphs"]["draft"]["inputs"][1].__setitem__("shape", ["num_requests", 0]))
    assert _has(check_artifacts(root).problems, "conf_logits", "axis 1", "unnamed", "recorded as 0")


def test_input_missing_from_manifest_reported(tmp_path):
    root = make_artifact(tmp_path / "a", edit=lambda s: s["graphs"]["draft"]["inputs"].pop(1))
    assert _has(check_artifacts(root).problems, "conf_logits", "no optimisation profile")


def test_static_axis_with_ranged_dim_reported(tmp_path):
    root = make_artifact(tmp_path / "a", edit=lambda s: s["graphs"]["draft"]["inputs"][1].__setitem__(
        "shape", ["num_requests", "num_tokens"]))
    assert _has(check_artifacts(root).problems, "conf_logits", "axis 1", "static 3")


def test_opset_out_of_range_reported(tmp_path):
    model = draft_model()
    model.opset_import[0].version = 26
    root = make_artifact(tmp_path / "a", draft=model)
    assert _has(check_artifacts(root).problems, "opset 26")


def test_unrecorded_external_weights_reported(artifact):
    onnx.save_model(target_model(), artifact / "target.onnx", save_as_external_data=True,
                    all_tensors_to_one_file=True, location="target.onnx.data", size_threshold=0)
    m = Manifest.load(artifact)
    m.record_file(artifact, "target.onnx")
    m.save()
    report = check_artifacts(artifact)
    assert _has(report.problems, "target.onnx", "external weights file target.onnx.data", "not listed")
    m.record_file(artifact, "target.onnx.data")
    m.save()
    assert check_artifacts(artifact).ok


def test_missing_manifest_reported(artifact):
    (artifact / "manifest.json").unlink()
    report = check_artifacts(artifact)
    assert not report.ok
    assert _has(report.problems, "manifest.json not found")
    # the graphs are still linted by their default names
    assert set(report.graphs) == {"draft", "target"}


def test_missing_directory_is_a_user_error(tmp_path):
    with pytest.raises(DsparkError, match="does not exist"):
        check_artifacts(tmp_path / "nope")


def test_onnx_checker_failure_reported(tmp_path):
    model = draft_model()
    model.graph.node[1].input[1] = "no_such_tensor"
    root = make_artifact(tmp_path / "a", draft=model)
    assert _has(check_artifacts(root).problems, "draft.onnx: ONNX checker")


def test_problems_are_single_lines(tmp_path):
    model = draft_model(namespace=None, with_function=False)
    model.graph.node[1].input[1] = "no_such_tensor"
    root = make_artifact(tmp_path / "a", draft=model)
    report = check_artifacts(root)
    assert len(report.problems) >= 3
    assert all("\n" not in p for p in report.problems)


# ------------------------------------------------------------------------------------------ CLI


def test_cli_check_ok(artifact):
    result = CliRunner().invoke(cli, ["check", str(artifact)])
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1] == "ok"


def test_cli_check_problems_exit_1_one_line_each(tmp_path):
    root = make_artifact(tmp_path / "a", draft=draft_model(namespace=None, with_function=False))
    data = bytearray((root / "target.onnx").read_bytes())
    data[-1] ^= 0xFF
    (root / "target.onnx").write_bytes(bytes(data))
    report = check_artifacts(root)
    result = CliRunner().invoke(cli, ["check", str(root)])
    assert result.exit_code == 1
    problem_lines = [line for line in result.stderr.splitlines() if line.startswith("problem: ")]
    assert len(problem_lines) == len(report.problems) >= 3
    assert any("plugin_namespace" in line for line in problem_lines)
    assert any("sha256" in line for line in problem_lines)


def test_cli_check_missing_manifest_exit_1(artifact):
    (artifact / "manifest.json").unlink()
    result = CliRunner().invoke(cli, ["check", str(artifact)])
    assert result.exit_code == 1
    assert "manifest.json not found" in result.stderr
