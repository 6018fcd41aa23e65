"""dspark_trt.trt_env: one TensorRT set-up for the builder and the runtime backend (against
tests/fake_tensorrt.py, which follows TensorRT's sources), and the import layering it makes possible."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import fake_tensorrt
from dspark_trt import trt_env
from dspark_trt.errors import DsparkError

PLUGIN_MOD = trt_env.PLUGIN_MODULE


@pytest.fixture
def fake_trt(monkeypatch):
    trt = fake_tensorrt.make("10.9.0.34")
    fake_tensorrt.install(monkeypatch, trt)
    sys.modules.pop(PLUGIN_MOD, None)
    yield trt
    sys.modules.pop(PLUGIN_MOD, None)


def test_missing_tensorrt_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(DsparkError) as e:
        trt_env.import_tensorrt()
    assert str(e.value) == trt_env.NOT_INSTALLED
    with pytest.raises(DsparkError, match=r"dspark-trt build /art`$"):
        trt_env.import_tensorrt(trt_env.backend_not_installed("/art"))


def test_logger_keeps_errors_and_filters_by_level(capsys, monkeypatch):
    monkeypatch.delenv("DSPARK_TRT_VERBOSE", raising=False)
    trt = fake_tensorrt.make()
    logger = trt_env.make_logger(trt)
    assert isinstance(logger, trt.ILogger)
    logger.log(trt.ILogger.Severity.ERROR, "bad\n  thing")
    logger.log(trt.ILogger.Severity.INFO, "chatter")
    assert logger.errors == ["bad thing"]
    err = capsys.readouterr().err
    assert "[TensorRT] bad" in err and "chatter" not in err


def test_builder_without_driver_needs_an_nvidia_gpu():
    trt = fake_tensorrt.make(gpu=False)
    with pytest.raises(DsparkError) as e:
        trt_env.create_builder(trt, trt_env.make_logger(trt))
    msg = str(e.value)
    assert msg.startswith(trt_env.NEEDS_GPU) and "error 35" in msg and "\n" not in msg


def test_builder_failure_with_a_gpu_is_not_blamed_on_the_gpu(monkeypatch):
    trt = fake_tensorrt.make()

    def broken(logger):
        raise TypeError("pybind11::init(): factory function returned nullptr")

    trt.Builder = broken
    monkeypatch.setattr(trt_env, "detect_gpu", lambda device=0: trt_env.GpuInfo("NVIDIA H200", "9.0"))
    with pytest.raises(DsparkError, match="could not create a builder on this GPU"):
        trt_env.create_builder(trt, trt_env.make_logger(trt))
    monkeypatch.setattr(trt_env, "detect_gpu", lambda device=0: None)
    with pytest.raises(DsparkError, match="needs an NVIDIA GPU"):
        trt_env.create_builder(trt, trt_env.make_logger(trt))


def test_cuda_init_error_parsing():
    assert trt_env.cuda_init_error(["x", "Cuda Runtime (CUDA initialization failure with error: 100)"]) == 100
    assert trt_env.cuda_init_error(["no such line"]) is None


def test_load_plugins_registers_what_is_asked(fake_trt):
    mod = trt_env.load_plugins(("jit",))
    assert mod.registered_impls() == {"jit"}
    assert all(d.aot_impl_func is None for d in fake_trt.plugin.QDP_REGISTRY.values())


def test_load_plugins_failure_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.delitem(sys.modules, PLUGIN_MOD, raising=False)
    with pytest.raises(DsparkError) as e:
        trt_env.load_plugins(("aot",))
    assert "dspark-trt[trt]" in str(e.value) and "\n" not in str(e.value)


def test_trt_backend_loads_jit_engines_with_jit_only_plugins(fake_trt):
    """What TensorRT's core passes to the creator when deserializing a JIT engine is not in its open
    sources; with only the JIT implementation registered every request but STRICT_AOT builds JIT."""
    from dspark_trt.runtime.backends import trt as tb

    selected = {"draft": (Path("d.engine"), {"plugin_mode": "jit"}),
                "target": (Path("t.engine"), {"plugin_mode": "aot"})}
    mod = tb.plugins_for(selected, "/art")
    assert mod.registered_impls() == {"jit"}
    Q = fake_trt.QuickPluginCreationRequest
    for req in (None, Q.UNKNOWN, Q.PREFER_AOT, Q.PREFER_JIT, Q.STRICT_JIT):
        assert fake_trt.plugin.create_plugin("dspark::SampleAccept", req) == "jit"
    aot_only = {g: (p, {"plugin_mode": "aot"}) for g, (p, _) in selected.items()}
    assert tb.plugins_for(aot_only, "/art") is None

    msg = tb.deserialize_failure("draft", "d.engine", "/art", ["Error Code 3: plugin creator failed"],
                                 {"aot", "jit"})
    assert "plugin creator failed" in msg and "fresh process" in msg and "\n" not in msg
    assert "fresh process" not in tb.deserialize_failure("draft", "d.engine", "/art", [], {"jit"})


def test_imports_run_one_way():
    """exporter modules import nothing from runtime, runtime's engine check nothing from exporter, and
    trt_env (below both) neither; no module imports tensorrt at import time."""
    code = ("import sys\n"
            "import dspark_trt.trt_env\n"
            "assert not [m for m in sys.modules if m.startswith(('dspark_trt.exporter', 'dspark_trt.runtime'))]\n"
            "import dspark_trt.exporter.build, dspark_trt.exporter.trt_builder\n"
            "assert not [m for m in sys.modules if m.startswith('dspark_trt.runtime')], 'exporter -> runtime'\n"
            "for m in [m for m in sys.modules if m.startswith('dspark_trt.exporter')]: del sys.modules[m]\n"
            "import dspark_trt.runtime.engine_check, dspark_trt.runtime.backends.trt\n"
            "assert not [m for m in sys.modules if m.startswith('dspark_trt.exporter')], 'runtime -> exporter'\n"
            "assert 'tensorrt' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


LAYERS = {"errors": 0, "manifest": 0, "trt_env": 0, "models": 0, "plugins": 0, "exporter": 1, "training": 1,
          "runtime": 2, "bench": 3, "serve": 3, "cli": 4}


def test_no_module_imports_a_higher_layer_even_lazily():
    """DESIGN.md: models/plugins/manifest <- exporter/training <- runtime <- bench/serve <- cli, for
    imports inside functions too (the TensorRT set-up used to import runtime from exporter lazily)."""
    import ast

    root = Path(trt_env.__file__).parent
    bad = []
    for path in root.rglob("*.py"):
        own = path.relative_to(root).parts[0].removesuffix(".py")
        if own not in LAYERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                parts = name.split(".")
                if parts[0] == "dspark_trt" and len(parts) > 1 and LAYERS.get(parts[1], 0) > LAYERS[own]:
                    bad.append(f"{path.relative_to(root)}:{node.lineno} imports {name}")
    assert not bad, bad
