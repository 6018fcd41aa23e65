"""`dspark-trt check DIR`: manifest schema and hashes, ONNX checker, TensorRT lint.

The TensorRT lint needs no TensorRT: it compares what the graphs use with the ONNX parser's documented
operator list (`trt_support`), and checks the conventions the dspark custom ops rely on (DESIGN.md 3):
every node in domain `dspark` carries `plugin_namespace` and has a model-local function with the same
(domain, name) whose body TensorRT and ONNX Runtime fall back to.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from dspark_trt.errors import DsparkError
from dspark_trt.exporter.check_io import check_io_against_manifest
from dspark_trt.exporter.trt_support import TrtSupport, onnx_dtype_name, support_for, version_at_least
from dspark_trt.manifest import GRAPHS, MANIFEST_NAME, Manifest
from dspark_trt.plugins.spec import DOMAIN as DSPARK_DOMAIN
from dspark_trt.plugins.spec import PLUGIN_NAMESPACE

STANDARD_DOMAINS = ("", "ai.onnx")
AOT_PLUGIN_MIN_TRT = "10.9"
DEFAULT_GRAPH_FILES = {g: f"{g}.onnx" for g in GRAPHS}
_MAX_PROBLEM_CHARS = 400
# Ops whose documented parser restrictions this check enforces itself (not listed as "restricted").
_SELF_CHECKED_RESTRICTIONS = {"Constant"}

# Attribute types the ONNX parser maps to plugin fields (notes/tensorrt.md): INT, FLOAT, STRING, INTS, FLOATS.
# What the ONNX parser turns into plugin fields (onnx-tensorrt >= 10.1, onnxOpImporters.cpp, the plugin
# importer's attribute switch): FLOAT, INT, STRING, FLOATS, INTS, STRINGS, and TENSOR of the element
# types below; it rejects TENSORS, GRAPH(S), SPARSE_TENSOR(S) and UNDEFINED, and tensors of UINT8/16/32/64,
# INT64, BOOL, COMPLEX64/128 or UNDEFINED ("is unsupported in plugin fields").
_PLUGIN_ATTR_TYPES = {1: "FLOAT", 2: "INT", 3: "STRING", 4: "TENSOR", 6: "FLOATS", 7: "INTS", 8: "STRINGS"}
_PLUGIN_TENSOR_DTYPES = {1: "FLOAT", 3: "INT8", 5: "INT16", 6: "INT32", 8: "STRING", 10: "FLOAT16", 11: "DOUBLE",
                         16: "BFLOAT16"}
_ATTR_TYPE_NAMES = {0: "UNDEFINED", 1: "FLOAT", 2: "INT", 3: "STRING", 4: "TENSOR", 5: "GRAPH", 6: "FLOATS",
                    7: "INTS", 8: "STRINGS", 9: "TENSORS", 10: "GRAPHS", 11: "SPARSE_TENSOR",
                    12: "SPARSE_TENSORS", 13: "TYPE_PROTO", 14: "TYPE_PROTOS"}


def _one_line(text: str) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= _MAX_PROBLEM_CHARS else s[: _MAX_PROBLEM_CHARS - 3] + "..."


@dataclass
class GraphStats:
    file: str
    nodes: int = 0
    op_counts: Counter = field(default_factory=Counter)   # standard-domain ops, bodies included
    dspark_ops: Counter = field(default_factory=Counter)  # dspark::Name -> node count
    functions: int = 0
    opset: int | None = None
    restricted_ops: set = field(default_factory=set)      # ops with documented parser restrictions


@dataclass
class CheckReport:
    """Result of `check_artifacts`: `ok`, `problems` (one line each), `summary_lines()`."""

    artifact_dir: Path
    trt: TrtSupport
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    graphs: dict[str, GraphStats] = field(default_factory=dict)
    profile_dims: dict[str, dict] = field(default_factory=dict)
    engines: dict[str, dict] = field(default_factory=dict)
    manifest_loaded: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    def problem(self, text: str) -> None:
        self.problems.append(_one_line(text))

    def warn(self, text: str) -> None:
        self.warnings.append(_one_line(text))

    def summary_lines(self) -> list[str]:
        lines = [f"artifact: {self.artifact_dir}" + ("" if self.manifest_loaded else " (no readable manifest)")]
        lines.append(f"tensorrt lint: TensorRT {self.trt.version} rules ({self.trt.source}, "
                     f"list for TensorRT {self.trt.list_version})")
        for g, st in self.graphs.items():
            dspark = ", ".join(f"{n} x{c}" for n, c in sorted(st.dspark_ops.items())) or "none"
            lines.append(f"{st.file}: {st.nodes} nodes, {len(st.op_counts)} standard op types, opset {st.opset}, "
                         f"{st.functions} local functions, dspark ops: {dspark}")
            if st.restricted_ops:
                lines.append(f"{st.file}: ops with documented TensorRT restrictions (see operators.md): "
                             f"{', '.join(sorted(st.restricted_ops))}")
        if self.profile_dims:
            dims = ", ".join(f"{n} {r.get('min')}/{r.get('opt')}/{r.get('max')}" for n, r in self.profile_dims.items())
            lines.append(f"profile dims (min/opt/max): {dims}")
        for g, e in self.engines.items():
            lines.append(f"engine {g}: {e.get('file')} (TensorRT {e.get('tensorrt_version')}, "
                         f"compute capability {e.get('compute_capability')}, {e.get('plugin_mode')} plugins)")
        lines.extend(f"warning: {w}" for w in self.warnings)
        lines.append("ok" if self.ok else f"{len(self.problems)} problem(s)")
        return lines


def check_artifacts(artifact_dir, trt_version: str | None = None) -> CheckReport:
    """Check an artifact directory; never raises for problems in the artifact, only for bad arguments."""
    trt = support_for(trt_version)  # DsparkError for a malformed / too old --trt-version
    base = Path(artifact_dir)
    if not base.is_dir():
        raise DsparkError(f"artifact directory {base} does not exist: export one with `dspark-trt export`")
    report = CheckReport(artifact_dir=base, trt=trt)

    manifest: Manifest | None = None
    try:
        manifest = Manifest.load(base, strict=False)
        report.manifest_loaded = True
    except DsparkError as e:
        report.problem(str(e))

    graph_specs: dict[str, dict] = {}
    if manifest is not None:
        for p in manifest.validate():
            report.problem(f"{MANIFEST_NAME}: {p}")
        for p in manifest.verify_hashes(base):
            report.problem(p)
        graphs = manifest.get("graphs")
        if isinstance(graphs, dict):
            graph_specs = {g: s for g, s in graphs.items() if isinstance(s, dict)}
        dims = manifest.get("dims")
        if isinstance(dims, dict):
            report.profile_dims = {n: r for n, r in dims.items() if isinstance(r, dict)}
        _check_tokenizer(report, manifest, base)
        _check_engines(report, manifest, base)

    files = {g: (s.get("file") if isinstance(s.get("file"), str) else None) for g, s in graph_specs.items()}
    if manifest is None:
        files = {g: f for g, f in DEFAULT_GRAPH_FILES.items() if (base / f).is_file()}
    recorded = set(manifest.files) if manifest is not None and isinstance(manifest.get("files"), dict) else None

    for g, fname in files.items():
        if not fname:
            continue
        path = base / fname
        if not path.is_file():
            if recorded is None or fname not in recorded:  # else verify_hashes already said it is missing
                report.problem(f"{fname}: graph file for '{g}' is missing from {base}")
            continue
        _check_graph(report, g, path, fname, graph_specs.get(g), manifest, recorded)
    return report


# ---------------------------------------------------------------------------------------------- manifest


def _check_tokenizer(report: CheckReport, manifest: Manifest, base: Path) -> None:
    tok = manifest.get("tokenizer")
    if isinstance(tok, dict) and isinstance(tok.get("file"), str) and tok["file"]:
        if not (base / tok["file"]).is_file():
            report.problem(f"{tok['file']}: tokenizer file named in the manifest is missing from {base}")
        elif tok["file"] not in manifest.files:
            report.warn(f"{tok['file']}: not listed in manifest files (no hash recorded)")


def _check_engines(report: CheckReport, manifest: Manifest, base: Path) -> None:
    from dspark_trt.manifest import sha256_file

    engines = manifest.get("engines")
    if not isinstance(engines, dict):
        return
    for g, e in engines.items():
        if not isinstance(e, dict) or not isinstance(e.get("file"), str):
            continue  # validate() reported it
        report.engines[g] = e
        p = Path(e["file"]) if Path(e["file"]).is_absolute() else base / e["file"]
        if not p.is_file():
            report.problem(f"engines.{g}: {e['file']} is missing: rebuild with `dspark-trt build {base}`")
        elif isinstance(e.get("sha256"), str) and sha256_file(p) != e["sha256"]:
            report.problem(f"engines.{g}: {e['file']} does not match its recorded sha256: rebuild with "
                           f"`dspark-trt build {base}`")


# ---------------------------------------------------------------------------------------------- graphs


def _check_graph(report: CheckReport, graph: str, path: Path, fname: str, spec: dict | None,
                 manifest: Manifest | None, recorded: set | None) -> None:
    import onnx

    stats = GraphStats(file=fname)
    report.graphs[graph] = stats

    # 1. ONNX checker, path form (works for models over 2 GB with external data).
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as e:  # ValidationError, InferenceError, protobuf DecodeError ...
        report.problem(f"{fname}: ONNX checker: {str(e).strip() or type(e).__name__}")

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:
        report.problem(f"{fname}: cannot be read as ONNX: {str(e).strip() or type(e).__name__}")
        return

    _lint_model(report, stats, fname, model)
    _check_external_data(report, fname, path, model, recorded)
    if spec is not None and manifest is not None:
        check_io_against_manifest(report, graph, fname, model, spec, manifest)


def _opset_of(opset_imports, domains=STANDARD_DOMAINS) -> int | None:
    for imp in opset_imports:
        if imp.domain in domains:
            return int(imp.version)
    return None


def _iter_subgraphs(node) -> Iterator:
    for attr in node.attribute:
        if attr.type == 5 and attr.HasField("g"):  # GRAPH
            yield attr.name, attr.g
        elif attr.type == 10:  # GRAPHS
            for i, sg in enumerate(attr.graphs):
                yield f"{attr.name}[{i}]", sg


def _node_label(node, scope: str) -> str:
    name = node.name or (node.output[0] if node.output else "?")
    dom = f"{node.domain}::" if node.domain not in STANDARD_DOMAINS else ""
    return f"{scope}node {name!r} ({dom}{node.op_type})"


def _lint_model(report: CheckReport, stats: GraphStats, fname: str, model) -> None:
    trt = report.trt
    functions = {(f.domain, f.name): f for f in model.functions}
    stats.functions = len(functions)

    opset = _opset_of(model.opset_import)
    stats.opset = opset
    if opset is not None:
        _check_opset(report, f"{fname}", opset)
    dspark_opset = _opset_of(model.opset_import, (DSPARK_DOMAIN,))

    linted_functions: set = set()

    def check_dtype(dtype_num: int, what: str) -> None:
        if dtype_num == 0:
            return
        name = onnx_dtype_name(dtype_num)
        reason = trt.dtype_problem(name)
        if reason:
            report.problem(f"{fname}: {what} has dtype {name}: {reason}")

    def check_value_infos(values, kind: str, scope: str) -> None:
        for vi in values:
            t = vi.type
            which = t.WhichOneof("value")
            if which is None:
                continue
            if which != "tensor_type":
                report.problem(f"{fname}: {scope}{kind} {vi.name!r} is a {which.replace('_type', '')}, "
                               f"TensorRT takes tensors only")
                continue
            check_dtype(t.tensor_type.elem_type, f"{scope}{kind} {vi.name!r}")

    def check_node_dtypes(node, label: str) -> None:
        for attr in node.attribute:
            if attr.name in ("to", "dtype", "output_dtype") and attr.type == 2:  # INT
                check_dtype(int(attr.i), f"{label} attribute {attr.name}")
            elif attr.type == 4 and node.op_type in ("Constant", "ConstantOfShape"):  # TENSOR
                check_dtype(attr.t.data_type, f"{label} attribute {attr.name}")
            elif attr.type == 11 and node.op_type == "Constant":
                report.problem(f"{fname}: {label} has a sparse constant: TensorRT rejects sparse_value")

    def check_dspark_node(node, label: str, has_function: bool) -> None:
        stats.dspark_ops[node.op_type] += 1
        attrs = {a.name: a for a in node.attribute}
        ns = attrs.get("plugin_namespace")
        if ns is None:
            report.problem(f"{fname}: {label} lacks string attribute plugin_namespace=\"{PLUGIN_NAMESPACE}\": "
                           f"TensorRT would not import it as the dspark plugin")
        elif ns.type != 3:
            report.problem(f"{fname}: {label} attribute plugin_namespace must be a STRING, "
                           f"got {_ATTR_TYPE_NAMES.get(ns.type, ns.type)}")
        elif ns.s.decode("utf-8", "replace") != PLUGIN_NAMESPACE:
            report.problem(f"{fname}: {label} plugin_namespace is {ns.s.decode('utf-8', 'replace')!r}, "
                           f"expected {PLUGIN_NAMESPACE!r} (plugins are registered as dspark::Name)")
        for a in node.attribute:
            if a.name == "plugin_namespace":
                continue
            if a.type not in _PLUGIN_ATTR_TYPES:
                report.problem(f"{fname}: {label} attribute {a.name} has type "
                               f"{_ATTR_TYPE_NAMES.get(a.type, a.type)}: the TensorRT plugin importer takes only "
                               f"{', '.join(_PLUGIN_ATTR_TYPES.values())}")
            elif a.type == 4 and a.t.data_type not in _PLUGIN_TENSOR_DTYPES:
                report.problem(f"{fname}: {label} attribute {a.name} is a {onnx_dtype_name(a.t.data_type)} tensor: "
                               f"the TensorRT plugin importer takes tensors of "
                               f"{', '.join(_PLUGIN_TENSOR_DTYPES.values())} only")
        if "." in node.op_type or not node.op_type:
            report.problem(f"{fname}: {label}: plugin names may not contain dots")
        if _is_standard_op_name(node.op_type):
            report.problem(f"{fname}: {label} reuses the standard ONNX op name {node.op_type!r}: the TensorRT "
                           f"parser matches built-ins on op_type alone; rename the op")
        if not has_function:
            report.problem(f"{fname}: {label} has no model-local function {DSPARK_DOMAIN}::{node.op_type}: "
                           f"add its FunctionProto so ONNX Runtime and TensorRT (without the plugin) can run it")

    def walk(nodes, scope: str, depth: int = 0) -> None:
        for node in nodes:
            stats.nodes += 1
            label = _node_label(node, scope)
            domain = node.domain
            fn = functions.get((domain, node.op_type))
            if domain == DSPARK_DOMAIN:
                check_dspark_node(node, label, fn is not None)
            elif domain in STANDARD_DOMAINS:
                if fn is None:
                    stats.op_counts[node.op_type] += 1
                    reason = trt.unsupported_reason(node.op_type)
                    if reason:
                        report.problem(f"{fname}: {label}: op {node.op_type} is {reason}")
                    elif trt.restrictions(node.op_type) and node.op_type not in _SELF_CHECKED_RESTRICTIONS:
                        stats.restricted_ops.add(node.op_type)
                    check_node_dtypes(node, label)
            elif fn is None:
                report.problem(f"{fname}: {label}: domain {domain!r} is not standard ONNX and the model has no "
                               f"local function for it: TensorRT would need a plugin")
            if fn is not None and (fn.domain, fn.name) not in linted_functions:
                linted_functions.add((fn.domain, fn.name))
                fn_opset = _opset_of(fn.opset_import)
                if fn_opset is not None:
                    _check_opset(report, f"{fname}: function {fn.domain}::{fn.name}", fn_opset)
                walk(fn.node, f"function {fn.domain}::{fn.name}: ", depth + 1)
            for attr_name, sub in _iter_subgraphs(node):
                sub_scope = f"{scope}{node.op_type} {node.name or ''}.{attr_name}: "
                check_value_infos(sub.input, "input", sub_scope)
                check_value_infos(sub.output, "output", sub_scope)
                for init in sub.initializer:
                    check_dtype(init.data_type, f"{sub_scope}initializer {init.name!r}")
                walk(sub.node, sub_scope, depth + 1)

    g = model.graph
    check_value_infos(g.input, "input", "")
    check_value_infos(g.output, "output", "")
    check_value_infos(g.value_info, "value", "")
    for init in g.initializer:
        check_dtype(init.data_type, f"initializer {init.name!r}")
    if len(g.sparse_initializer):
        report.problem(f"{fname}: has {len(g.sparse_initializer)} sparse initializers: TensorRT rejects them")
    walk(g.node, "")

    if stats.dspark_ops:
        if dspark_opset is None:
            report.problem(f"{fname}: uses dspark ops but has no opset import for domain {DSPARK_DOMAIN!r}")
        if not version_at_least(trt.version, AOT_PLUGIN_MIN_TRT):
            report.warn(f"{fname}: TensorRT {trt.version} has no AOT Python plugins (needs >= {AOT_PLUGIN_MIN_TRT}); "
                        f"dspark ops would build from their function bodies or JIT plugins")


def _check_opset(report: CheckReport, where: str, opset: int) -> None:
    trt = report.trt
    if opset < trt.opset_min or opset > trt.opset_max:
        report.problem(f"{where}: default-domain opset {opset} is outside {trt.opset_min}..{trt.opset_max} "
                       f"that TensorRT {trt.version} parses: export with an opset in that range")


_STANDARD_OP_NAMES: set | None = None


def _is_standard_op_name(op_type: str) -> bool:
    global _STANDARD_OP_NAMES
    if _STANDARD_OP_NAMES is None:
        import onnx.defs

        from dspark_trt.exporter.trt_support import load_op_table

        names = {s.name for s in onnx.defs.get_all_schemas_with_history() if s.domain in STANDARD_DOMAINS}
        names |= set(load_op_table()["ops"])
        _STANDARD_OP_NAMES = names
    return op_type in _STANDARD_OP_NAMES


def _check_external_data(report: CheckReport, fname: str, path: Path, model, recorded: set | None) -> None:
    """Every external-data file a graph references should be hashed in the manifest."""
    if recorded is None:
        return
    locations = set()

    def scan(graph) -> None:
        for init in graph.initializer:
            if init.data_location == 1:  # EXTERNAL
                for kv in init.external_data:
                    if kv.key == "location":
                        locations.add(kv.value)
        for node in graph.node:
            for _, sub in _iter_subgraphs(node):
                scan(sub)

    scan(model.graph)
    graph_dir = Path(fname).parent
    for loc in sorted(locations):
        rel = (graph_dir / loc).as_posix()
        if rel not in recorded:
            report.problem(f"{fname}: external weights file {rel} is not listed in manifest files (no hash recorded)")
