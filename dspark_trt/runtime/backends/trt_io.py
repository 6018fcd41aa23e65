"""The TensorRT backend's engine I/O, without TensorRT: graph tensor specs from the manifest, the split
into host inputs, KV caches and outputs, shapes from dims, optimisation-profile checks, engine selection
(TensorRT version and compute capability) and the engines' I/O checked against the manifest. Plain
functions, unit-tested on CPU; trt.py runs them against real engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from dspark_trt.errors import DsparkError
from dspark_trt.manifest import kv_names
from dspark_trt.manifest_schema import DSPARK_CONTEXT_GRAPH, MODEL_DTYPE_TO_ONNX, engine_graphs

PAST_PREFIX, PRESENT_PREFIX = "past_key_values.", "present."  # manifest.kv_names' prefixes
GRAPHS = ("draft", "target")


def no_engines_message(artifact_dir) -> str:
    return f"no TensorRT engines in {artifact_dir}: run `dspark-trt build {artifact_dir}` on this GPU"


# ============================================================================ pure logic (no TensorRT)


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output as the manifest records it (dims: names from manifest `dims`, or ints)."""

    name: str
    dtype: str
    shape: tuple
    is_input: bool

    @property
    def kind(self) -> str:
        """'feed' (host input), 'past' (KV input), 'present' (KV output) or 'output' (copied to host)."""
        if self.is_input:
            return "past" if self.name.startswith(PAST_PREFIX) else "feed"
        return "present" if self.name.startswith(PRESENT_PREFIX) else "output"


def _data(manifest: Any) -> Mapping:
    return manifest.data if hasattr(manifest, "data") else manifest


def graph_specs(manifest: Any, graph: str) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) of a graph from the manifest's `graphs.<graph>` I/O lists, in graph order."""
    try:
        spec = _data(manifest)["graphs"][graph]
        ins = [TensorSpec(io["name"], io["dtype"], tuple(io["shape"]), True) for io in spec["inputs"]]
        outs = [TensorSpec(io["name"], io["dtype"], tuple(io["shape"]), False) for io in spec["outputs"]]
    except (KeyError, TypeError):
        raise DsparkError(f"the manifest has no I/O for the {graph} graph: re-export the artifact "
                          f"(`dspark-trt export`)") from None
    return ins, outs


def graph_layers(manifest: Any, graph: str) -> int:
    d = _data(manifest)
    return int(d["model" if graph == "target" else "draft"]["num_layers"])


@dataclass(frozen=True)
class GraphIO:
    """A graph's tensors by role, each list in binding order."""

    feeds: list[TensorSpec]     # host numpy inputs, copied to device every run (graph order)
    past: list[TensorSpec]      # KV inputs, bound to cache views (k0, v0, k1, ...)
    outputs: list[TensorSpec]   # outputs copied back to host numpy (graph order)
    present: list[TensorSpec]   # KV outputs, left on the device (k0, v0, k1, ...)

    @property
    def inputs(self) -> list[TensorSpec]:
        return self.feeds + self.past

    @property
    def all_outputs(self) -> list[TensorSpec]:
        return self.outputs + self.present

    def binding_order(self) -> list[str]:
        return [s.name for s in self.feeds + self.past + self.outputs + self.present]


def kv_roles(manifest: Any, graph: str) -> tuple[bool, bool]:
    """(reads past KV, returns present KV) of a graph. A DSpark drafter's block pass reads its context cache
    and returns none; its context graph returns context.* K/V, which come back as host outputs (the drafter
    writes them into its cache at the verified positions, runtime/dspark_drafting.py)."""
    if ((_data(manifest).get("draft") or {}).get("kind") == "dspark") and graph != "target":
        return graph != DSPARK_CONTEXT_GRAPH, False
    return True, True


def split_io(inputs: list[TensorSpec], outputs: list[TensorSpec], num_layers: int, graph: str = "",
             roles: tuple[bool, bool] = (True, True)) -> GraphIO:
    """Sort a graph's tensors by role; past/present must be exactly the interleaved KV names of num_layers
    (or absent, where `roles` (kv_roles) says the graph has none)."""
    by_name = {s.name: s for s in inputs + outputs}
    past_in = [s.name for s in inputs if s.kind == "past"]
    present_out = [s.name for s in outputs if s.kind == "present"]
    for kind, got, has in (("past", past_in, roles[0]), ("present", present_out, roles[1])):
        want = kv_names(num_layers, kind) if has else []
        if sorted(got) != sorted(want):
            missing = sorted(set(want) - set(got))
            extra = sorted(set(got) - set(want))
            what = f"missing {missing[0]}" if missing else f"unexpected {extra[0]}"
            raise DsparkError(f"the {graph} graph's KV {kind} tensors do not match its {num_layers} layers "
                              f"({what}): re-export the artifact")
    return GraphIO(feeds=[s for s in inputs if s.kind == "feed"],
                   past=[by_name[n] for n in kv_names(num_layers, "past")] if roles[0] else [],
                   outputs=[s for s in outputs if s.kind == "output"],
                   present=[by_name[n] for n in kv_names(num_layers, "present")] if roles[1] else [])


def host_output_names(outputs: list[TensorSpec]) -> list[str]:
    """The outputs copied to host numpy: everything but the present KV entries."""
    return [s.name for s in outputs if s.kind == "output"]


def resolve_dims(inputs: list[TensorSpec], shapes: Mapping[str, tuple], graph: str = "") -> dict[str, int]:
    """Sizes of the named dims (num_tokens, num_requests, query_len, past_len, verify_rows, ...) from the
    shapes of the inputs actually passed; raises ValueError on a rank / static-dim / dim-name conflict."""
    dims: dict[str, int] = {}
    origin: dict[str, str] = {}
    for spec in inputs:
        if spec.name not in shapes:
            continue
        shape = tuple(int(n) for n in shapes[spec.name])
        if len(shape) != len(spec.shape):
            raise ValueError(f"{graph} input {spec.name!r} has shape {shape}; the graph expects rank "
                             f"{len(spec.shape)} {list(spec.shape)}")
        for axis, (d, n) in enumerate(zip(spec.shape, shape)):
            if isinstance(d, str):
                if d in dims and dims[d] != n:
                    raise ValueError(f"{graph} inputs disagree on {d}: {dims[d]} from {origin[d]!r}, {n} from "
                                     f"{spec.name!r}")
                dims.setdefault(d, n)
                origin.setdefault(d, spec.name)
            elif int(d) != n:
                raise ValueError(f"{graph} input {spec.name!r} has {n} at axis {axis}; the graph fixes it to {d}")
    return dims


def output_shapes(outputs: list[TensorSpec], dims: Mapping[str, int]) -> dict[str, tuple | None]:
    """Each output's shape from the input-derived dims (outputs are sized by num_requests, num_tokens,
    verify_rows and static ints); None when a dim does not appear in any input."""
    out: dict[str, tuple | None] = {}
    for spec in outputs:
        shape = []
        for d in spec.shape:
            if isinstance(d, str):
                if d not in dims:
                    shape = None
                    break
                shape.append(int(dims[d]))
            else:
                shape.append(int(d))
        out[spec.name] = tuple(shape) if shape is not None else None
    return out


def pick_output_shape(graph: str, name: str, from_manifest: tuple | None, from_engine, where: str = "") -> tuple:
    """The shape to allocate for an output: TensorRT's (`context.get_tensor_shape`) when fully known, checked
    against the manifest's; else the manifest's."""
    engine = tuple(int(n) for n in from_engine) if from_engine is not None else None
    if engine is not None and all(n >= 0 for n in engine):
        if from_manifest is not None and engine != tuple(from_manifest):
            raise DsparkError(f"the {graph} engine sizes output {name!r} as {list(engine)} but the artifact's graph "
                              f"says {list(from_manifest)}: rebuild with `dspark-trt build {where or 'ARTIFACT_DIR'}`")
        return engine
    if from_manifest is not None:
        return tuple(from_manifest)
    raise DsparkError(f"the size of the {graph} engine's output {name!r} depends on data, which dspark-trt does not "
                      f"support: re-export the artifact")


def profile_ranges(manifest: Any, graph: str) -> dict[str, tuple[tuple, tuple, tuple]]:
    """{input: (min, opt, max)}: the profile recorded with the built engine, else derived from manifest dims."""
    engines = _data(manifest).get("engines") or {}
    recorded = (engines.get(graph) or {}).get("profiles") if isinstance(engines, Mapping) else None
    if isinstance(recorded, list) and recorded and isinstance(recorded[0], Mapping):
        try:
            return {name: (tuple(r["min"]), tuple(r["opt"]), tuple(r["max"])) for name, r in recorded[0].items()}
        except (KeyError, TypeError):
            pass
    from dspark_trt.manifest import Manifest

    m = manifest if isinstance(manifest, Manifest) else Manifest(dict(_data(manifest)))
    return m.profiles(graph)


def profile_problems(shapes: Mapping[str, tuple], profile: Mapping[str, tuple], graph: str = "") -> list[str]:
    """One line per input whose shape is outside the engine's optimisation profile."""
    problems = []
    for name, shape in shapes.items():
        rng = profile.get(name)
        if rng is None:
            continue
        lo, _, hi = rng
        if len(lo) != len(shape) or any(not a <= n <= b for a, n, b in zip(lo, shape, hi)):
            problems.append(f"{graph} input {name!r} has shape {list(shape)}, outside the engine's profile "
                            f"{list(lo)}..{list(hi)}")
    return problems


_TRT_DTYPE_NAMES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT64": "int64", "INT32": "int32",
                    "INT8": "int8", "UINT8": "uint8", "BOOL": "bool", "FP8": "float8e4m3", "INT4": "int4",
                    "FP4": "float4"}


def trt_dtype_name(dtype) -> str:
    """A TensorRT DataType (`trt.float32`, printed "DataType.FLOAT") as the manifest's dtype name."""
    key = str(dtype).rsplit(".", 1)[-1].upper()
    return _TRT_DTYPE_NAMES.get(key, key.lower())


def check_engine_io(graph: str, io: GraphIO, engine_io: list[tuple[str, bool, str]], where: str) -> set[str]:
    """Compare the engine's I/O tensors (name, is_input, dtype name) with the artifact's graph; returns the
    input names the engine actually has (TensorRT may drop an input the network never reads)."""
    want = {s.name: (s.is_input, s.dtype) for s in io.inputs + io.all_outputs}
    got = {name: (bool(is_in), str(dt)) for name, is_in, dt in engine_io}
    problems = []
    for name, (is_in, dt) in want.items():
        if name not in got:
            if not is_in:
                problems.append(f"it has no output {name!r}")
            continue
        if got[name][0] != is_in:
            problems.append(f"{name!r} is an {'input' if got[name][0] else 'output'} of the engine")
        elif got[name][1] != dt:
            problems.append(f"{name!r} is {got[name][1]} in the engine, {dt} in the graph")
    for name in got:
        if name not in want:
            problems.append(f"the engine has {name!r}, which the graph does not")
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise DsparkError(f"the {graph} engine does not match the artifact's {graph} graph: {problems[0]}{more}: "
                          f"rebuild with `dspark-trt build {where}`")
    return {name for name, (is_in, _) in got.items() if is_in}


def _as_manifest(manifest: Any, artifact_dir):
    from dspark_trt.manifest import Manifest

    if isinstance(manifest, Manifest):
        return manifest if manifest.path is not None else Manifest(manifest.data, Path(artifact_dir))
    return Manifest(dict(manifest), Path(artifact_dir))


def select_engines(manifest: Any, artifact_dir, trt_version: str, compute_capability) -> dict[str, tuple[Path, dict]]:
    """{graph: (engine path, manifest engine entry)} for the graphs `engine_graphs` names, or DsparkError
    saying what to build: no engines, an engine for another TensorRT / GPU, one built from an older export,
    a missing or modified engine file. An optional graph (draft_greedy; a DSpark draft_sample) is included
    when the artifact has it and an engine was built for it (engines built before it existed run without
    it)."""
    from dspark_trt.runtime.engine_check import check_engine_compat, verify_engine_file

    m = _as_manifest(manifest, artifact_dir)
    if not m.engines:
        raise DsparkError(no_engines_message(artifact_dir))
    files = m.files
    out = {}
    required, optional = engine_graphs(m.data)
    for g in (*required, *(g for g in optional if g in m.engines)):
        entry = check_engine_compat(m, g, trt_version, compute_capability)
        onnx_file = (m.graphs.get(g) or {}).get("file")
        current = (files.get(onnx_file) or {}).get("sha256") if onnx_file else None
        if entry.get("onnx_sha256") and current and entry["onnx_sha256"] != current:
            raise DsparkError(f"the {g} engine was built from an earlier export of {onnx_file}: rebuild with "
                              f"`dspark-trt build {artifact_dir}`")
        out[g] = (verify_engine_file(m, g, artifact_dir), entry)
    return out


def kv_dtype_for(manifest: Any, num_layers: int, slots: int, kv_heads: int, head_dim: int) -> str | None:
    """The dtype the engines read KV in (their past inputs'), for the graph whose KV inputs have this
    geometry; the model dtype's name when no graph matches."""
    for g in GRAPHS:
        try:
            ins, _ = graph_specs(manifest, g)
        except DsparkError:
            continue
        past = [s for s in ins if s.kind == "past"]
        if len(past) == 2 * num_layers and all(tuple(s.shape[1:]) == (slots, kv_heads, head_dim) for s in past):
            return past[0].dtype
    dtype = (_data(manifest).get("model") or {}).get("dtype")
    return MODEL_DTYPE_TO_ONNX.get(dtype)


# ============================================================================ one engine, bound and run
