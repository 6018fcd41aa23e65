"""The TensorRT side of `dspark-trt build`: network, parser, profiles, serialized engine.

TensorRT itself is imported and set up by `dspark_trt.trt_env` (shared with the runtime backend).

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

from dspark_trt import trt_env
from dspark_trt.errors import DsparkError


def without_plugin_namespace(path, namespace: str = trt_env.PLUGIN_NAMESPACE) -> bytes:
    """The ONNX model at `path` (external weights left where they are) with `plugin_namespace` removed from
    every node of `namespace`'s domain, in graphs, subgraphs and function bodies: the TensorRT parser then
    imports each such node from its model-local function body, registered plugin or not."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)

    def strip(nodes) -> None:
        for n in nodes:
            if n.domain == namespace:
                keep = [a for a in n.attribute if a.name != "plugin_namespace"]
                del n.attribute[:]
                n.attribute.extend(keep)
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    strip(a.g.node)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    for g in a.graphs:
                        strip(g.node)

    strip(model.graph.node)
    for f in model.functions:
        strip(f.node)
    return model.SerializeToString()


def _network_flags(trt, names: list[str]) -> int:
    flags = 0
    for name in names:
        member = getattr(trt.NetworkDefinitionCreationFlag, name, None)
        if member is None:
            raise DsparkError(f"this TensorRT ({trt_env.tensorrt_version(trt)}) has no network flag {name}: "
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
    logger = logger or trt_env.make_logger(trt)
    builder = trt_env.create_builder(trt, logger)
    network = builder.create_network(_network_flags(trt, entry["network_flags"]))
    parser = trt.OnnxParser(network, logger)
    for name in entry.get("parser_flags", []):
        parser.set_flag(getattr(trt.OnnxParserFlag, name))

    if entry.get("strip_plugin_namespace"):
        # `OnnxParser.parse(model, path)`: path only locates external weights (TensorRT >= 8.0).
        ok = parser.parse(without_plugin_namespace(entry["onnx"]), str(entry["onnx"]))
    else:
        ok = parser.parse_from_file(str(entry["onnx"]))
    if not ok:
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
