"""`dspark-trt build`: dry-run plan, the no-TensorRT refusal, engine compatibility checks."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from click.testing import CliRunner

from dspark_trt.cli import cli, main
from dspark_trt.errors import DsparkError
from dspark_trt.exporter.build import NOT_INSTALLED, build_engines, plan_build
from dspark_trt.manifest import Manifest
from dspark_trt.runtime.engine_check import check_engine_compat, engine_path, needs_plugin_module, verify_engine_file
import fake_tensorrt  # noqa: E402  (tests/ is on sys.path under pytest)
from test_check import draft_model, make_artifact  # noqa: E402

HAVE_TRT = importlib.util.find_spec("tensorrt") is not None


@pytest.fixture
def artifact(tmp_path):
    return make_artifact(tmp_path / "art")


# ------------------------------------------------------------------------------------------ plan


def test_plan_profiles_match_dims(artifact):
    plan = plan_build(artifact)
    m = Manifest.load(artifact)
    assert set(plan["graphs"]) == {"draft", "target"}
    for g, entry in plan["graphs"].items():
        assert len(entry["profiles"]) == 1
        profile = entry["profiles"][0]
        assert set(profile) == {io["name"] for io in m.graphs[g]["inputs"]}
        for name, (mn, op, mx) in m.profiles(g).items():
            assert profile[name] == {"min": list(mn), "opt": list(op), "max": list(mx)}
    assert plan["graphs"]["draft"]["profiles"][0]["conf_logits"] == {"min": [1, 3], "opt": [2, 3], "max": [4, 3]}
    assert plan["graphs"]["target"]["profiles"][0]["input_ids"] == {"min": [1], "opt": [8], "max": [16]}


def test_plan_is_strongly_typed_without_precision_flags(artifact):
    plan = plan_build(artifact)
    for entry in plan["graphs"].values():
        assert entry["strongly_typed"] and "STRONGLY_TYPED" in entry["network_flags"]
        assert entry["builder_flags"] == []
        assert not any(f in json.dumps(entry["builder_flags"]) for f in ("FP16", "BF16", "INT8"))
        assert entry["precision"]["export_dtype"] == "fp32" and entry["precision"]["onnx_dtype"] == "float32"
        assert entry["memory_pool_limits"]["WORKSPACE"] > 0
        assert "EXPLICIT_BATCH" not in entry["network_flags"]  # gone in TensorRT 11


def test_plan_plugins_and_modes(artifact, tmp_path):
    plan = plan_build(artifact)
    assert plan["plugin_mode"] == "aot"
    assert plan["tensorrt"]["min_version"] == "10.9"
    assert plan["plugins"]["module"] == "dspark_trt.plugins.tensorrt_plugins"
    assert plan["graphs"]["draft"]["plugins"] == ["dspark::Survival"]
    assert plan["graphs"]["target"]["plugins"] == ["dspark::GreedyAccept"]
    assert set(plan["plugins"]["ops"]) <= {"dspark::Survival", "dspark::GreedyAccept", "dspark::SampleAccept"}
    assert "PREFER_AOT_PYTHON_PLUGINS" in plan["graphs"]["draft"]["network_flags"]

    jit = plan_build(artifact, plugin_mode="jit", out_dir=tmp_path / "eng")
    assert "PREFER_JIT_PYTHON_PLUGINS" in jit["graphs"]["target"]["network_flags"]
    assert "PREFER_AOT_PYTHON_PLUGINS" not in jit["graphs"]["target"]["network_flags"]
    assert jit["graphs"]["draft"]["engine"] == str(tmp_path / "eng" / "draft.engine")
    assert plan["graphs"]["draft"]["engine"] == str(artifact / "engines" / "draft.engine")
    with pytest.raises(DsparkError, match="plugin-mode"):
        plan_build(artifact, plugin_mode="fast")


def test_plan_needs_a_valid_artifact(tmp_path):
    with pytest.raises(DsparkError, match="does not exist"):
        plan_build(tmp_path / "nothing")


def test_cli_dry_run_prints_json(artifact):
    result = CliRunner().invoke(cli, ["build", str(artifact), "--dry-run", "--plugin-mode", "jit"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["plugin_mode"] == "jit"
    assert plan["graphs"]["draft"]["profiles"][0]["input_ids"]["max"] == [16]


# ------------------------------------------------------------------------------------------ no TensorRT here


@pytest.mark.skipif(HAVE_TRT, reason="TensorRT is installed on this machine")
def test_build_without_tensorrt_is_one_line_error(artifact):
    with pytest.raises(DsparkError) as info:
        build_engines(artifact)
    assert str(info.value) == NOT_INSTALLED
    assert "\n" not in str(info.value)
    assert not (artifact / "engines").exists()


@pytest.mark.skipif(HAVE_TRT, reason="TensorRT is installed on this machine")
def test_cli_build_without_tensorrt_exits_1(artifact, capsys):
    with pytest.raises(SystemExit) as info:
        main(["build", str(artifact)])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert err == f"error: {NOT_INSTALLED}\n"
    result = CliRunner().invoke(cli, ["build", str(artifact)])
    assert result.exit_code == 1 and isinstance(result.exception, DsparkError)


# ------------------------------------------------------------------------------------------ engine compat


def _with_engine(artifact, trt="10.9.0.34", cc="9.0"):
    m = Manifest.load(artifact)
    (artifact / "engines").mkdir(exist_ok=True)
    (artifact / "engines" / "draft.engine").write_bytes(b"engine")
    from dspark_trt.manifest import sha256_file

    m.record_engine("draft", file="engines/draft.engine", sha256=sha256_file(artifact / "engines" / "draft.engine"),
                    tensorrt_version=trt, gpu_name="NVIDIA H200", compute_capability=cc, plugin_mode="aot")
    m.save()
    return Manifest.load(artifact)


def test_engine_compat_accepts_match(artifact):
    m = _with_engine(artifact)
    entry = check_engine_compat(m, "draft", "10.9.0.34", "9.0")
    assert entry["gpu_name"] == "NVIDIA H200" and not needs_plugin_module(entry)
    assert check_engine_compat(m, "draft", "10.9.0", (9, 0))["plugin_mode"] == "aot"
    assert check_engine_compat(m.data, "draft", "10.9.0.34", "sm_90")
    assert verify_engine_file(m, "draft") == engine_path(m, "draft") == artifact / "engines" / "draft.engine"


def test_engine_compat_refuses_other_trt(artifact):
    m = _with_engine(artifact)
    with pytest.raises(DsparkError) as info:
        check_engine_compat(m, "draft", "10.13.0.35", "9.0")
    msg = str(info.value)
    assert "built with TensorRT 10.9.0.34 for compute capability 9.0" in msg
    assert "this machine has TensorRT 10.13.0.35" in msg
    assert f"rebuild with `dspark-trt build {artifact}`" in msg and "\n" not in msg


def test_engine_compat_refuses_other_gpu(artifact):
    m = _with_engine(artifact)
    with pytest.raises(DsparkError, match=r"compute capability 8\.9 \(GPU architecture differ"):
        check_engine_compat(m, "draft", "10.9.0.34", "8.9")


def test_engine_compat_missing_engine_and_tampered_file(artifact):
    m = _with_engine(artifact)
    with pytest.raises(DsparkError, match="no TensorRT engine for the target graph.*dspark-trt build"):
        check_engine_compat(m, "target", "10.9.0.34", "9.0")
    (artifact / "engines" / "draft.engine").write_bytes(b"other")
    with pytest.raises(DsparkError, match="sha256"):
        verify_engine_file(m, "draft")


def test_check_reports_engine_entries(artifact):
    from dspark_trt.exporter.check import check_artifacts

    _with_engine(artifact)
    report = check_artifacts(artifact)
    assert report.ok, report.problems
    assert any(line.startswith("engine draft:") for line in report.summary_lines())
    (artifact / "engines" / "draft.engine").unlink()
    assert any("engines.draft" in p for p in check_artifacts(artifact).problems)


# ------------------------------------------------------------------------------------------ real builds


@pytest.mark.trt
@pytest.mark.skipif(not HAVE_TRT, reason="needs TensorRT and an NVIDIA GPU (pytest -m trt)")
def test_build_engines_from_function_bodies(tmp_path):
    root = make_artifact(tmp_path / "art")
    paths = build_engines(root, plugin_mode="none")
    assert [p.name for p in paths] == ["draft.engine", "target.engine"]
    m = Manifest.load(root)
    import tensorrt as trt

    from dspark_trt.runtime.engine_check import detect_gpu

    gpu = detect_gpu()
    for g in ("draft", "target"):
        entry = check_engine_compat(m, g, trt.__version__, gpu.compute_capability)
        assert entry["plugin_mode"] == "none"
        verify_engine_file(m, g)


@pytest.mark.trt
@pytest.mark.skipif(not HAVE_TRT, reason="needs TensorRT and an NVIDIA GPU (pytest -m trt)")
def test_build_engines_with_aot_plugins(tmp_path):
    pytest.importorskip("dspark_trt.plugins.tensorrt_plugins")
    root = make_artifact(tmp_path / "art", draft=draft_model())
    build_engines(root, plugin_mode="aot")
    m = Manifest.load(root)
    assert m.engines["draft"]["plugin_layers"] >= 1
    assert m.engines["target"]["plugin_mode"] == "aot"


# ------------------------------------------------------------------------------------------ builder code path
# Against tests/fake_tensorrt.py: the TensorRT API as its sources define it (enum values per version, the
# parser creating plugins for nodes with plugin_namespace, the creator refusing an UNKNOWN request).
PLUGIN_MOD = "dspark_trt.plugins.tensorrt_plugins"


@pytest.fixture
def fresh_plugins(monkeypatch):
    """A fake tensorrt in sys.modules and the plugin module imported afresh against it (a TensorRT plugin
    registry lives as long as its process; here as long as the fake)."""

    def install(version="10.9.0.34", **kw):
        trt = fake_tensorrt.make(version, **kw)
        fake_tensorrt.install(monkeypatch, trt)
        sys.modules.pop(PLUGIN_MOD, None)
        return trt

    yield install
    sys.modules.pop(PLUGIN_MOD, None)


@pytest.mark.parametrize("version, flags", [("10.9.0.34", (1 << 1) | (1 << 3)),   # STRONGLY_TYPED=1, PREFER_AOT=3
                                            ("11.1.0.4", (1 << 0) | (1 << 2))])   # 11.x: 0 and 2
def test_trt_builder_code_path_against_fake_api(artifact, version, flags):
    from dspark_trt.exporter import trt_builder

    entry = plan_build(artifact)["graphs"]["draft"]
    trt = fake_tensorrt.make(version)
    data, info = trt_builder.build_engine(trt, "draft", entry)
    assert data == b"serialized" and info["plugin_layers"] == 0  # plugin module not loaded: function body
    assert ("create_network", flags) in trt.calls
    assert ("set_shape", "conf_logits", (1, 3), (2, 3), (4, 3)) in trt.calls
    assert ("pool", "workspace", entry["memory_pool_limits"]["WORKSPACE"]) in trt.calls

    with pytest.raises(DsparkError, match="failed to build the draft engine"):
        trt_builder.build_engine(fake_tensorrt.make(version, build_ok=False), "draft", entry)
    with pytest.raises(DsparkError, match="'extra' has no optimisation profile"):
        trt_builder.build_engine(fake_tensorrt.make(version, inputs=("input_ids", "conf_logits", "extra")),
                                 "draft", entry)


def _plugin_layers(trt, graph_entry):
    from dspark_trt.exporter import trt_builder

    trt.calls.clear()
    parsed = {}
    real_parser = trt.OnnxParser

    def spy(network, logger):
        parsed["network"] = network
        return real_parser(network, logger)

    trt.OnnxParser = spy
    try:
        trt_builder.build_engine(trt, "draft", graph_entry)
    finally:
        trt.OnnxParser = real_parser
    return [layer.what for layer in parsed["network"].layers if layer.type == "plugin_v3"]


def test_plugin_modes_pick_the_implementation_or_the_function_body(tmp_path, fresh_plugins):
    from dspark_trt import trt_env

    root = make_artifact(tmp_path / "art", draft=draft_model())
    trt = fresh_plugins()
    trt_env.load_plugins(("aot", "jit"))  # this process has both (an AOT build, then a JIT one)
    assert _plugin_layers(trt, plan_build(root, plugin_mode="aot")["graphs"]["draft"]) == [("dspark::Survival", "aot")]
    assert _plugin_layers(trt, plan_build(root, plugin_mode="jit")["graphs"]["draft"]) == [("dspark::Survival", "jit")]
    # "none" means the function bodies, even with the plugins registered
    none = plan_build(root, plugin_mode="none")["graphs"]["draft"]
    assert none["strip_plugin_namespace"] and "PREFER_AOT_PYTHON_PLUGINS" not in none["network_flags"]
    assert _plugin_layers(trt, none) == []
    assert ("parse", none["onnx"]) in trt.calls  # external weights resolve next to the original file

    # what "none" did before: the parser creates the plugin with an UNKNOWN request, which fails
    from dspark_trt.exporter import trt_builder

    with pytest.raises(DsparkError, match="has both AOT and JIT implementations"):
        trt_builder.build_engine(trt, "draft", dict(none, strip_plugin_namespace=False))


def test_without_plugin_namespace_strips_only_the_dspark_nodes(tmp_path):
    import onnx

    from dspark_trt.exporter.trt_builder import without_plugin_namespace

    model = draft_model()
    model.graph.node[0].attribute.extend([onnx.helper.make_attribute("plugin_namespace", "other")])
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    out = onnx.load_from_string(without_plugin_namespace(path))
    attrs = {n.name: [a.name for a in n.attribute] for n in out.graph.node}
    assert attrs["survival"] == [] and attrs["embed"] == ["plugin_namespace"]
    assert [f.name for f in out.functions] == ["Survival"]


def test_build_engines_records_plugin_mode_and_aot_kernels(tmp_path, fresh_plugins, monkeypatch):
    from dspark_trt import trt_env

    root = make_artifact(tmp_path / "art", draft=draft_model())
    fresh_plugins("11.1.0.4")
    monkeypatch.setattr(trt_env, "detect_gpu", lambda device=0: trt_env.GpuInfo("NVIDIA H200", "9.0"))
    build_engines(root, plugin_mode="aot")
    entry = Manifest.load(root).engines["draft"]
    assert entry["plugin_mode"] == "aot" and entry["plugin_layers"] == 1 and entry["tensorrt_version"] == "11.1.0.4"
    assert entry["aot_kernels"]["ptx_isa"] == "8.0" and entry["aot_kernels"]["compiler"].startswith("triton ")
    assert sys.modules[PLUGIN_MOD].registered_impls() == {"aot"}  # an AOT build registers AOT only

    build_engines(root, plugin_mode="jit")
    entry = Manifest.load(root).engines["draft"]
    assert entry["plugin_mode"] == "jit" and "aot_kernels" not in entry


def test_trt_builder_reports_missing_gpu(artifact):
    from dspark_trt.exporter import trt_builder

    with pytest.raises(DsparkError, match=r"needs an NVIDIA GPU.*could not initialise CUDA \(error 35, "
                                          r"cudaErrorInsufficientDriver"):
        trt_builder.build_engine(fake_tensorrt.make(gpu=False), "draft", plan_build(artifact)["graphs"]["draft"])
