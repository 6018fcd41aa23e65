"""The TensorRT side of `dspark-trt build`: the only module that imports tensorrt (lazily, in functions).

Written against the TensorRT 10.9+ / 11.x Python API:
- `trt.Builder(logger)`; without a usable GPU it fails (CUDA initialization error 35, then pybind11
  "factory function returned nullptr"), reported as "needs an NVIDIA GPU".
- `builder.create_network(flags)` with `NetworkDefinitionCreationFlag.STRONGLY_TYPED` (10.x; the only
  typing mode in 11.x, where `EXPLICIT_BATCH` no longer exists) and `PREFER_AOT_PYTHON_PLUGINS` /
  `PREFER_JIT_PYTHON_PLUGINS` (10.9+; required when a Python plugin has both implementations).
- `trt.OnnxParser(network, logger).parse_from_file(path)` (external weights resolved relative to the file);
  errors via `parser.num_errors` / `parser.get_error(i)`.
- one `IOptimizationProfile` with `set_shape(name, min, opt, max)` per dynamic input;
  `config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, bytes)`; no FP16/BF16 builder flags
  (removed in 11; precision comes from the strongly typed ONNX graph).
- `builder.build_serialized_network(network, config)` -> IHostMemory (None on failure).
"""

from __future__ import annotations

import importlib
import os

from dspark_trt.errors import DsparkError


def import_tensorrt():
    """Import tensorrt or raise the one-line DsparkError that says how to get it."""
    from dspark_trt.exporter.build import NOT_INSTALLED

    try:
        import tensorrt as trt  # noqa: PLC0415 - lazy by design
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in ("tensorrt", "tensorrt_libs", "tensorrt_bindings"):
            raise DsparkError(NOT_INSTALLED) from None
        raise DsparkError(f"TensorRT failed to import ({e}): reinstall with pip install 'dspark-trt[trt]'") from None
    except (ImportError, OSError) as e:
        raise DsparkError(f"TensorRT is installed but failed to load ({' '.join(str(e).split())}): check the NVIDIA "
                          f"driver and the TensorRT libraries (pip install 'dspark-trt[trt]')") from None
    return trt


def tensorrt_version(trt) -> str:
    return str(getattr(trt, "__version__", "unknown"))


def make_logger(trt):
    level = trt.Logger.VERBOSE if os.environ.get("DSPARK_TRT_VERBOSE") else trt.Logger.WARNING
    return trt.Logger(level)


def create_builder(trt, logger):
    """trt.Builder, or DsparkError when CUDA cannot be initialised (no GPU / no driver)."""
    from dspark_trt.exporter.build import NEEDS_GPU

    try:
        builder = trt.Builder(logger)
    except Exception as e:  # TypeError: pybind11::init(): factory function returned nullptr
        raise DsparkError(f"{NEEDS_GPU}; TensorRT could not initialise CUDA ({' '.join(str(e).split())})") from None
    if builder is None:
        raise DsparkError(NEEDS_GPU)
    return builder


def load_plugins(module: str) -> None:
    """Import the module whose `tensorrt.plugin` decorators register the dspark plugins."""
    try:
        importlib.import_module(module)
    except Exception as e:
        raise DsparkError(f"cannot load the dspark TensorRT plugins ({module}: {type(e).__name__}: "
                          f"{' '.join(str(e).split())}); fix it, or build with the function bodies only "
                          f"(plugin_mode='none')") from None


def _network_flags(trt, names: list[str]) -> int:
    flags = 0
    for name in names:
        member = getattr(trt.NetworkDefinitionCreationFlag, name, None)
        if member is None:
            raise DsparkError(f"this TensorRT ({tensorrt_version(trt)}) has no network flag {name}: "
                              f"pip install -U 'dspark-trt[trt]'")
        flags |= 1 << int(member)
    return flags


def _parser_errors(parser) -> list[str]:
    out = []
    for i in range(parser.num_errors):
        err = parser.get_error(i)
        out.append(" ".join(str(err).split()))
    return out


def _count_plugin_layers(trt, network) -> int:
    kinds = {getattr(trt.LayerType, n) for n in ("PLUGIN_V3", "PLUGIN_V2", "PLUGIN") if hasattr(trt.LayerType, n)}
    return sum(1 for i in range(network.num_layers) if network.get_layer(i).type in kinds)


def build_engine(trt, graph: str, entry: dict, logger=None) -> tuple[bytes, dict]:
    """Parse entry['onnx'] and build a serialized engine per the plan entry (see build.plan_build)."""
    logger = logger or make_logger(trt)
    builder = create_builder(trt, logger)
    network = builder.create_network(_network_flags(trt, entry["network_flags"]))
    parser = trt.OnnxParser(network, logger)
    for name in entry.get("parser_flags", []):
        parser.set_flag(getattr(trt.OnnxParserFlag, name))

    if not parser.parse_from_file(str(entry["onnx"])):
        errors = _parser_errors(parser) or ["unknown parser error"]
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        raise DsparkError(f"TensorRT could not parse {entry['onnx']}: {errors[0]}{more}: run `dspark-trt check` "
                          f"on the artifact")

    plugin_layers = _count_plugin_layers(trt, network)

    config = builder.create_builder_config()
    for pool, limit in entry.get("memory_pool_limits", {}).items():
        config.set_memory_pool_limit(getattr(trt.MemoryPoolType, pool), int(limit))
    for flag in entry.get("builder_flags", []):
        config.set_flag(getattr(trt.BuilderFlag, flag))

    for shapes in entry["profiles"]:
        profile = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            tensor = network.get_input(i)
            rng = shapes.get(tensor.name)
            if rng is None:
                raise DsparkError(f"{graph}: network input {tensor.name!r} has no optimisation profile in the "
                                  f"manifest: re-export the artifact (dspark-trt check lists the gap)")
            if getattr(tensor, "is_shape_tensor", False):
                raise DsparkError(f"{graph}: input {tensor.name!r} is a shape tensor, which dspark-trt profiles "
                                  f"do not describe: export it as a data input")
            profile.set_shape(tensor.name, tuple(rng["min"]), tuple(rng["opt"]), tuple(rng["max"]))
        config.add_optimization_profile(profile)

    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise DsparkError(f"TensorRT failed to build the {graph} engine (see the TensorRT log above; "
                          f"DSPARK_TRT_VERBOSE=1 for more)")
    return bytes(memoryview(serialized)), {"plugin_layers": plugin_layers, "num_layers": network.num_layers}
