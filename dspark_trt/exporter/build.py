"""`dspark-trt build DIR`: TensorRT engines for the draft and target graphs (and the all-greedy draft graph
when the artifact has one; for a DSpark drafter also its context and sampling graphs: one engine per graph,
built the same way, `manifest_schema.engine_graphs` says which).

`plan_build` says exactly what will be built and how, without TensorRT (`--dry-run` prints it);
`build_engines` checks the environment (TensorRT, GPU and plugins come from `dspark_trt.trt_env`, the
set-up the runtime backend shares), then hands each plan entry to `trt_builder` and records the engine
facts in the manifest (AOT engines also the Triton version and PTX ISA of their kernels).

Facts this relies on (notes/tensorrt.md):
- TensorRT 11 builds strongly typed networks only (no FP16/BF16 builder flags); precision is the ONNX
  dtype chosen at export. 10.x accepts the same STRONGLY_TYPED flag, so one code path serves both.
- dspark nodes carry plugin_namespace="dspark" and are imported as the Python plugins registered by
  `dspark_trt.plugins.tensorrt_plugins` (AOT: TensorRT >= 10.9; the network flag
  PREFER_AOT_PYTHON_PLUGINS / PREFER_JIT_PYTHON_PLUGINS picks the implementation). Without the plugin
  module the parser imports the model-local function bodies instead; plugin mode "none" hands the parser
  a copy without plugin_namespace, so it means the function bodies in any process.
- Engines are tied to the TensorRT version and the GPU's compute capability; both are recorded.
"""

from __future__ import annotations

from pathlib import Path

from dspark_trt import trt_env
from dspark_trt.errors import DsparkError
from dspark_trt.manifest import MODEL_DTYPE_TO_ONNX, Manifest, now_iso, sha256_file, write_atomic
from dspark_trt.manifest_schema import engine_graphs
from dspark_trt.trt_env import NEEDS_GPU, NOT_INSTALLED, PLUGIN_MODULE, PLUGIN_NAMESPACE  # noqa: F401 (re-exported)

PLUGINS = trt_env.PLUGIN_IDS
PLUGIN_MODES = ("aot", "jit", "none")
MIN_TENSORRT = {"aot": trt_env.MIN_TENSORRT, "jit": trt_env.MIN_TENSORRT, "none": trt_env.MIN_TENSORRT}
MIN_TENSORRT_REASON = {
    "aot": "AOT Python plugins (tensorrt.plugin.aot_impl) and NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS",
    "jit": "NetworkDefinitionCreationFlag.PREFER_JIT_PYTHON_PLUGINS (plugins with both AOT and JIT implementations)",
    "none": "the version dspark-trt supports ([trt] extra: tensorrt>=10.9)",
}
NETWORK_PLUGIN_FLAG = {"aot": "PREFER_AOT_PYTHON_PLUGINS", "jit": "PREFER_JIT_PYTHON_PLUGINS"}
DEFAULT_WORKSPACE_BYTES = 4 << 30


def _check_plugin_mode(plugin_mode: str) -> str:
    mode = str(plugin_mode).lower()
    if mode not in PLUGIN_MODES:
        raise DsparkError(f"--plugin-mode {plugin_mode!r}: choose one of {', '.join(PLUGIN_MODES)}")
    return mode


def _dspark_ops_in(path: Path) -> list[str] | None:
    """dspark op names a graph uses (function bodies included), or None if onnx is not installed."""
    try:
        import onnx
    except ImportError:
        return None
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:
        raise DsparkError(f"{path} cannot be read as ONNX ({str(e).strip() or type(e).__name__}): "
                          f"run `dspark-trt check`") from None
    found: set[str] = set()

    def scan(nodes) -> None:
        for n in nodes:
            if n.domain == PLUGIN_NAMESPACE:
                found.add(f"{PLUGIN_NAMESPACE}::{n.op_type}")
            for a in n.attribute:
                if a.type == 5:
                    scan(a.g.node)
                elif a.type == 10:
                    for g in a.graphs:
                        scan(g.node)

    scan(model.graph.node)
    for f in model.functions:
        if f.domain != PLUGIN_NAMESPACE:
            scan(f.node)
    return sorted(found)


def plan_build(artifact_dir, out_dir=None, plugin_mode: str = "aot",
               workspace_bytes: int = DEFAULT_WORKSPACE_BYTES) -> dict:
    """The build plan (JSON-serialisable); needs neither TensorRT nor a GPU."""
    mode = _check_plugin_mode(plugin_mode)
    base = Path(artifact_dir)
    manifest = Manifest.load(base)
    out = Path(out_dir) if out_dir is not None else base / "engines"
    dtype = manifest.model["dtype"]
    onnx_dtype = MODEL_DTYPE_TO_ONNX[dtype]

    graphs = {}
    all_ops: set[str] = set()
    required, optional = engine_graphs(manifest.data)
    for g in (*required, *optional):
        spec = manifest.graphs.get(g)
        if spec is None:
            raise DsparkError(f"{base}: the manifest has no {g} graph: re-export the artifact (`dspark-trt export`)")
        onnx_path = base / spec["file"]  # the standard graph: an ORT flavour (spec["ort"]) is never built
        if not onnx_path.is_file():
            raise DsparkError(f"{onnx_path} is missing: re-export the artifact (`dspark-trt export`)")
        ops = _dspark_ops_in(onnx_path)
        uses_plugins = ops is None or bool(ops)
        plugin_ops = list(PLUGINS) if ops is None else ops
        all_ops.update(plugin_ops)
        network_flags = ["STRONGLY_TYPED"]
        if mode in NETWORK_PLUGIN_FLAG and uses_plugins:
            network_flags.append(NETWORK_PLUGIN_FLAG[mode])
        io_dtypes = sorted({io["dtype"] for io in spec["inputs"] + spec["outputs"]})
        profile = {name: {"min": list(mn), "opt": list(op), "max": list(mx)}
                   for name, (mn, op, mx) in manifest.profiles(g).items()}
        graphs[g] = {
            "onnx": str(onnx_path),
            "onnx_sha256": manifest.files.get(spec["file"], {}).get("sha256"),
            "engine": str(out / f"{g}.engine"),
            "strongly_typed": True,
            "precision": {
                "export_dtype": dtype,
                "onnx_dtype": onnx_dtype,
                "io_dtypes": io_dtypes,
                "how": "strongly typed network: layer precisions follow the ONNX tensor dtypes chosen at export; "
                       "no FP16/BF16 builder flags (removed in TensorRT 11)",
            },
            "network_flags": network_flags,
            "builder_flags": [],
            "parser_flags": [],
            # "none": the parser reads a copy without plugin_namespace, so it imports the function bodies
            # even in a process where the plugin module is registered (it would otherwise create the plugin
            # with no AOT/JIT preference, which a plugin with both implementations refuses).
            "strip_plugin_namespace": mode == "none",
            "parser_note": ("dspark nodes carry plugin_namespace='dspark', so the parser imports them as plugins "
                            "when the plugin module is loaded and falls back to their local function bodies "
                            "otherwise (plugin mode 'none' strips the attribute from the parsed copy); "
                            "ENABLE_PLUGIN_OVERRIDE (TensorRT 10.15+) is only needed for plugins named "
                            "like standard ONNX ops, which `dspark-trt check` forbids"),
            "memory_pool_limits": {"WORKSPACE": int(workspace_bytes)},
            "profiles": [profile],
            "plugins": plugin_ops if mode != "none" else [],
            "plugin_ops_detected": ops is not None,
        }

    return {
        "artifact_dir": str(base),
        "out_dir": str(out),
        "plugin_mode": mode,
        "tensorrt": {"min_version": MIN_TENSORRT[mode], "why": MIN_TENSORRT_REASON[mode]},
        "plugins": {
            "module": PLUGIN_MODULE if mode != "none" else None,
            "ops": sorted(all_ops) if mode != "none" else [],
            "mode": mode,
            "note": {"aot": "AOT kernels are embedded in the engine; it runs on plain TensorRT with no Python",
                     "jit": "JIT plugins call back into Python: the plugin module must be imported wherever the "
                            "engine is deserialized",
                     "none": "plugin module not loaded: dspark ops build from their ONNX function bodies"}[mode],
        },
        "graphs": graphs,
        "manifest_update": ["engines.<graph>: file, sha256, tensorrt_version, gpu_name, compute_capability, "
                            "plugin_mode, built"],
    }


def _write_atomic(path: Path, data) -> None:
    write_atomic(path, bytes(data))


def _relative_to(path: Path, base: Path) -> str:
    try:
        return path.resolve().relative_to(base.resolve()).as_posix()
    except ValueError:
        return str(path.resolve())


def check_build_environment(plugin_mode: str = "aot"):
    """TensorRT importable and recent enough, and a GPU present; returns (tensorrt module, GpuInfo)."""
    from dspark_trt.exporter.trt_support import version_at_least

    mode = _check_plugin_mode(plugin_mode)
    trt = trt_env.import_tensorrt()
    version = trt_env.tensorrt_version(trt)
    if not version_at_least(version, MIN_TENSORRT[mode]):
        raise DsparkError(f"TensorRT {version} is installed; dspark-trt needs >= {MIN_TENSORRT[mode]} "
                          f"({MIN_TENSORRT_REASON[mode]}): pip install -U 'dspark-trt[trt]'")
    gpu = trt_env.detect_gpu()
    if gpu is None:
        raise DsparkError(NEEDS_GPU)
    return trt, gpu


def build_engines(artifact_dir, out_dir=None, plugin_mode: str = "aot",
                  workspace_bytes: int = DEFAULT_WORKSPACE_BYTES) -> list[Path]:
    """Build the engines on this machine's GPU, record them in the manifest, return their paths."""
    from dspark_trt.exporter import trt_builder

    trt, gpu = check_build_environment(plugin_mode)
    base = Path(artifact_dir)
    plan = plan_build(base, out_dir=out_dir, plugin_mode=plugin_mode, workspace_bytes=workspace_bytes)
    manifest = Manifest.load(base)

    # Never build from graphs (or their external weights) that changed after export.
    ignore = {manifest.tokenizer.get("file"), "cost_profile.json"}
    for problem in manifest.verify_hashes(base):
        if problem.split(": ", 1)[0] not in ignore:
            raise DsparkError(f"{problem.split(': ', 1)[0]} does not match the manifest (changed or missing after "
                              f"export): re-export the artifact, or run `dspark-trt check {base}`")

    mode = plan["plugin_mode"]
    kernel_facts = {}
    if mode != "none" and plan["plugins"]["ops"]:
        # Register the implementation this build uses (the other may already be there from earlier work in
        # this process; then the PREFER_* network flag in the plan picks).
        plugins = trt_env.load_plugins((mode,))
        if mode == "aot":
            kernel_facts = plugins.aot_kernel_facts(gpu.compute_capability)

    version = trt_env.tensorrt_version(trt)
    written = []
    for g, entry in plan["graphs"].items():
        engine_bytes, info = trt_builder.build_engine(trt, g, entry)
        path = Path(entry["engine"])
        _write_atomic(path, engine_bytes)
        manifest.record_engine(
            g, file=_relative_to(path, base), sha256=sha256_file(path), tensorrt_version=version,
            gpu_name=gpu.name, compute_capability=gpu.compute_capability, plugin_mode=mode, built=now_iso(),
            onnx_sha256=entry["onnx_sha256"], precision=entry["precision"]["export_dtype"],
            plugin_layers=info.get("plugin_layers"), profiles=entry["profiles"], **kernel_facts,
        )
        manifest.save(base)
        written.append(path)
    return written
