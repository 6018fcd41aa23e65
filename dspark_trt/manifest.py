"""The artifact manifest: the only contract between export time and run time.

`ARTIFACT/manifest.json` (format_version 1) records the model and draft facts, the runtime limits, the
dynamic dimensions (min/opt/max, from which the TensorRT optimisation profiles are derived), the I/O of
each graph, the sha256 of every file, and, after `dspark-trt build`, one entry per built engine.

This module needs only the standard library (the runtime imports it on edge installs).
"""

from __future__ import annotations

import copy
import datetime as _dt
import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from dspark_trt.errors import DsparkError

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "dspark-trt-artifact"
MANIFEST_VERSION = 1

GRAPHS = ("draft", "target")
MODEL_DTYPES = ("fp32", "fp16", "bf16")
# Graph I/O dtypes a manifest may declare (all are TensorRT I/O types).
IO_DTYPES = ("int64", "int32", "float32", "float16", "bfloat16", "bool", "uint8")
# ONNX-style names of the export dtypes.
MODEL_DTYPE_TO_ONNX = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
CONFIDENCE_MODES = ("head", "fallback")
PLUGIN_MODES = ("aot", "jit", "none")
# Graph I/O names: the contract between the exported graphs (exporter/graphs.py) and every backend.
PACKED_INPUTS = ["tokens", "positions", "pack_index", "unpack_index", "query_lens", "past_lens", "slot_ids"]
DRAFT_INPUTS = PACKED_INPUTS + ["temperature", "uniforms", "prev_survival", "draft_position"]
DRAFT_OUTPUTS = ["draft_token", "draft_probs", "survival", "confidence_logit"]
TARGET_INPUTS = PACKED_INPUTS + ["verify_index", "verify_lens", "draft_tokens", "draft_probs", "temperature",
                                 "accept_uniforms", "sample_uniforms"]
TARGET_OUTPUTS = ["accepted", "next_token"]


def kv_names(num_layers: int, prefix: str) -> list[str]:
    """KV cache I/O names of a graph: prefix "past" (inputs) or "present" (outputs)."""
    if prefix == "past":
        return [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    return [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


# Files whose hash must not key cost profiles (the profile itself, written after the key is taken).
_NOT_IN_ARTIFACT_KEY = ("cost_profile.json",)

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CC = re.compile(r"^\d+\.\d+$")
_TOOL_DISTRIBUTIONS = {"dspark_trt": "dspark-trt", "torch": "torch", "onnx": "onnx", "onnxscript": "onnxscript",
                       "onnxruntime": "onnxruntime"}


def now_iso() -> str:
    """Current UTC time as ISO 8601 with seconds precision."""
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def tool_versions(names: Iterable[str] = tuple(_TOOL_DISTRIBUTIONS)) -> dict[str, str | None]:
    """Installed versions of the exporting tools (None where not installed); imports none of them."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in names:
        if name == "dspark_trt":
            from dspark_trt import __version__

            out[name] = __version__
            continue
        try:
            out[name] = metadata.version(_TOOL_DISTRIBUTIONS.get(name, name))
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write bytes to a temporary file beside `path`, fsync, then rename: readers never see a half file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, streamed (graphs with external weights can be many GB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _manifest_path(artifact_dir: str | os.PathLike) -> Path:
    p = Path(artifact_dir)
    if p.suffix == ".json" and not p.is_dir():
        return p
    return p / MANIFEST_NAME


@dataclass
class Manifest:
    """A thin wrapper over the manifest dict; `data` is exactly what goes to JSON.

    Sections are reachable as attributes (`m.model`, `m.dims`, `m.graphs`, `m.files`, `m.engines`, ...)
    and by key (`m["limits"]["max_batch"]`).
    """

    data: dict[str, Any]
    path: Path | None = field(default=None, compare=False)  # artifact dir it was loaded from / saved to

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(cls, *, model: dict, draft: dict, limits: dict, dims: dict, graphs: dict,
               tokenizer: dict | None = None, tools: dict | None = None) -> "Manifest":
        """A new manifest with format fields, creation time and tool versions filled in.

        `files` starts empty: call `record_file(artifact_dir, name)` for each written file.
        """
        data = {
            "format": MANIFEST_FORMAT,
            "format_version": MANIFEST_VERSION,
            "created": now_iso(),
            "tools": dict(tools) if tools is not None else tool_versions(),
            "model": copy.deepcopy(model),
            "draft": copy.deepcopy(draft),
            "limits": copy.deepcopy(limits),
            "dims": copy.deepcopy(dims),
            "graphs": copy.deepcopy(graphs),
            "tokenizer": copy.deepcopy(tokenizer) if tokenizer is not None else {"file": "tokenizer.json",
                                                                                  "eos_token_id": None},
            "files": {},
        }
        return cls(data)

    @classmethod
    def from_dict(cls, data: dict, path: str | os.PathLike | None = None) -> "Manifest":
        return cls(copy.deepcopy(data), Path(path) if path is not None else None)

    def to_dict(self) -> dict:
        return copy.deepcopy(self.data)

    # ------------------------------------------------------------------ dict-like access
    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value

    def __contains__(self, key: object) -> bool:
        return key in self.data

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    @property
    def format_version(self) -> int:
        return self.data.get("format_version")

    @property
    def tools(self) -> dict:
        return self.data.setdefault("tools", {})

    @property
    def model(self) -> dict:
        return self.data["model"]

    @property
    def draft(self) -> dict:
        return self.data["draft"]

    @property
    def limits(self) -> dict:
        return self.data["limits"]

    @property
    def dims(self) -> dict:
        return self.data["dims"]

    @property
    def graphs(self) -> dict:
        return self.data["graphs"]

    @property
    def tokenizer(self) -> dict:
        return self.data.get("tokenizer") or {}

    @property
    def files(self) -> dict:
        return self.data.setdefault("files", {})

    @property
    def engines(self) -> dict:
        """Engine entries added by `dspark-trt build` (empty dict when none were built)."""
        return self.data.get("engines") or {}

    # ------------------------------------------------------------------ load / save
    @classmethod
    def load(cls, artifact_dir: str | os.PathLike, *, strict: bool = True) -> "Manifest":
        """Read ARTIFACT/manifest.json (a path to the JSON file itself is accepted too).

        Raises DsparkError for a missing file, bad JSON, or a wrong format / format_version. With
        `strict` (the default) it also raises when `validate()` finds problems, naming the first ones;
        `dspark-trt check` loads with strict=False and reports every problem itself.
        """
        path = _manifest_path(artifact_dir)
        if not path.is_file():
            if not path.parent.exists():
                raise DsparkError(f"artifact directory {path.parent} does not exist: create it with "
                                  f"`dspark-trt export`")
            raise DsparkError(f"{path} not found: this is not an exported artifact directory "
                              f"(run `dspark-trt export`)")
        try:
            text = path.read_text(encoding="utf-8")
            data = json.loads(text)
        except UnicodeDecodeError as e:
            raise DsparkError(f"{path} is not UTF-8 text: {e.reason}") from None
        except json.JSONDecodeError as e:
            raise DsparkError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}): "
                              f"re-export the artifact") from None
        if not isinstance(data, dict):
            raise DsparkError(f"{path}: top level must be a JSON object, got {type(data).__name__}")
        fmt = data.get("format")
        if fmt != MANIFEST_FORMAT:
            raise DsparkError(f"{path}: key 'format' is {fmt!r}, expected {MANIFEST_FORMAT!r}: "
                              f"not a dspark-trt artifact manifest")
        version = data.get("format_version")
        if version != MANIFEST_VERSION:
            if _is_int(version) and version > MANIFEST_VERSION:
                hint = "upgrade dspark-trt to read it"
            else:
                hint = "re-export the artifact with this dspark-trt"
            raise DsparkError(f"{path}: key 'format_version' is {version!r}, this dspark-trt reads "
                              f"{MANIFEST_VERSION}: {hint}")
        m = cls(data, path.parent)
        if strict:
            problems = m.validate()
            if problems:
                more = f" (and {len(problems) - 1} more; run `dspark-trt check`)" if len(problems) > 1 else ""
                raise DsparkError(f"{path}: {problems[0]}{more}")
        return m

    def save(self, artifact_dir: str | os.PathLike | None = None) -> Path:
        """Write ARTIFACT/manifest.json atomically (temp file in the same directory + rename)."""
        if artifact_dir is None:
            if self.path is None:
                raise DsparkError("Manifest.save() needs an artifact directory")
            artifact_dir = self.path
        path = _manifest_path(artifact_dir)
        text = json.dumps(self.data, indent=2, sort_keys=False, allow_nan=False) + "\n"
        write_atomic(path, text.encode("utf-8"))
        self.path = path.parent
        return path

    # ------------------------------------------------------------------ files and hashes
    def file_hashes(self) -> dict[str, str]:
        """{file name: sha256} for every file recorded in the manifest."""
        return {name: entry.get("sha256") for name, entry in sorted(self.files.items())
                if isinstance(entry, dict)}

    def record_file(self, artifact_dir: str | os.PathLike, name: str) -> dict:
        """Hash ARTIFACT/name and record {sha256, bytes} under files[name] (name relative, '/'-separated)."""
        p = Path(artifact_dir) / name
        if not p.is_file():
            raise DsparkError(f"cannot record {name}: {p} does not exist")
        entry = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        self.files[Path(name).as_posix()] = entry
        return entry

    def verify_hashes(self, artifact_dir: str | os.PathLike | None = None) -> list[str]:
        """One problem line per recorded file that is missing, has a different size, or a different sha256."""
        base = Path(artifact_dir) if artifact_dir is not None else self.path
        if base is None:
            raise DsparkError("Manifest.verify_hashes() needs an artifact directory")
        problems = []
        for name, entry in sorted(self.files.items()):
            if not isinstance(entry, dict):
                continue  # reported by validate()
            p = base / name
            if not p.is_file():
                problems.append(f"{name}: listed in manifest files but missing from {base}")
                continue
            size = p.stat().st_size
            if _is_int(entry.get("bytes")) and size != entry["bytes"]:
                problems.append(f"{name}: size {size} bytes, manifest says {entry['bytes']}: the file changed "
                                f"after export (re-export, or restore the original)")
                continue
            digest = sha256_file(p)
            if digest != entry.get("sha256"):
                problems.append(f"{name}: sha256 {digest[:12]}... does not match the manifest "
                                f"({str(entry.get('sha256'))[:12]}...): the file changed after export "
                                f"(re-export, or restore the original)")
        return problems

    def artifact_key(self) -> dict[str, str]:
        """File hashes identifying this artifact, used to key cost profiles.

        Every recorded file except the cost profile itself (which is written after the key is taken).
        Engines are keyed separately by their own manifest entries (`engines[graph]['sha256']`).
        """
        return {name: digest for name, digest in self.file_hashes().items() if name not in _NOT_IN_ARTIFACT_KEY}

    # ------------------------------------------------------------------ profiles
    def graph_inputs(self, graph: str) -> list[dict]:
        try:
            return list(self.graphs[graph]["inputs"])
        except (KeyError, TypeError):
            raise DsparkError(f"manifest has no graph {graph!r} with inputs (graphs: "
                              f"{sorted(self.data.get('graphs') or {})})") from None

    def profiles(self, graph: str) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """TensorRT optimisation profile of a graph: {input name: (min_shape, opt_shape, max_shape)}.

        A named dim takes its min/opt/max from `dims`; an int dim is static (same in all three).
        """
        out = {}
        for inp in self.graph_inputs(graph):
            mins, opts, maxs = [], [], []
            for d in inp["shape"]:
                if isinstance(d, str):
                    rng = self.dims.get(d)
                    if not isinstance(rng, dict):
                        raise DsparkError(f"graphs.{graph}: input {inp['name']!r} uses dim {d!r}, which is not in "
                                          f"manifest 'dims': re-export the artifact")
                    mins.append(int(rng["min"]))
                    opts.append(int(rng["opt"]))
                    maxs.append(int(rng["max"]))
                else:
                    mins.append(int(d))
                    opts.append(int(d))
                    maxs.append(int(d))
            out[inp["name"]] = (tuple(mins), tuple(opts), tuple(maxs))
        return out

    def graph_path(self, graph: str, artifact_dir: str | os.PathLike | None = None) -> Path:
        base = Path(artifact_dir) if artifact_dir is not None else self.path
        if base is None:
            raise DsparkError("Manifest.graph_path() needs an artifact directory")
        try:
            return base / self.graphs[graph]["file"]
        except (KeyError, TypeError):
            raise DsparkError(f"manifest has no graph {graph!r}") from None

    # ------------------------------------------------------------------ validation
    def validate(self) -> list[str]:
        """Schema problems, one line each naming the key; empty when the manifest is well formed."""
        d = self.data
        problems: list[str] = []
        add = problems.append

        if d.get("format") != MANIFEST_FORMAT:
            add(f"format: {d.get('format')!r}, expected {MANIFEST_FORMAT!r}")
        if d.get("format_version") != MANIFEST_VERSION:
            add(f"format_version: {d.get('format_version')!r}, expected {MANIFEST_VERSION}")
        if not isinstance(d.get("created"), str):
            add("created: missing or not an ISO 8601 string")
        tools = d.get("tools")
        if not isinstance(tools, dict):
            add("tools: missing or not an object")
        else:
            for k, v in tools.items():
                if v is not None and not isinstance(v, str):
                    add(f"tools.{k}: must be a version string or null")

        def section(name: str) -> dict | None:
            s = d.get(name)
            if not isinstance(s, dict):
                add(f"{name}: missing or not an object")
                return None
            return s

        def need_int(sec: dict, secname: str, key: str, minimum: int = 1) -> None:
            v = sec.get(key)
            if not _is_int(v):
                add(f"{secname}.{key}: missing or not an integer")
            elif v < minimum:
                add(f"{secname}.{key}: {v} is below {minimum}")

        def need_str(sec: dict, secname: str, key: str) -> None:
            if not isinstance(sec.get(key), str) or not sec.get(key):
                add(f"{secname}.{key}: missing or not a non-empty string")

        model = section("model")
        if model is not None:
            need_str(model, "model", "arch")
            for k in ("vocab_size", "hidden_size", "num_layers", "num_kv_heads", "head_dim", "max_context"):
                need_int(model, "model", k)
            if model.get("dtype") not in MODEL_DTYPES:
                add(f"model.dtype: {model.get('dtype')!r}, expected one of {', '.join(MODEL_DTYPES)}")

        draft = section("draft")
        if draft is not None:
            need_str(draft, "draft", "arch")
            for k in ("hidden_size", "num_layers", "num_kv_heads", "head_dim", "max_draft"):
                need_int(draft, "draft", k)
            if draft.get("confidence") not in CONFIDENCE_MODES:
                add(f"draft.confidence: {draft.get('confidence')!r}, expected one of {', '.join(CONFIDENCE_MODES)}")
            temps = draft.get("temperatures")
            if not isinstance(temps, list) or not all(_is_num(t) for t in temps):
                add("draft.temperatures: missing or not a list of numbers")
            else:
                if _is_int(draft.get("max_draft")) and len(temps) != draft["max_draft"]:
                    add(f"draft.temperatures: {len(temps)} values, expected max_draft = {draft['max_draft']}")
                if any(t <= 0 for t in temps):
                    add("draft.temperatures: every temperature must be > 0")

        limits = section("limits")
        if limits is not None:
            for k in ("max_batch", "max_context", "max_draft", "max_tokens_per_step"):
                need_int(limits, "limits", k)
            if draft is not None and _is_int(limits.get("max_draft")) and _is_int(draft.get("max_draft")) \
                    and limits["max_draft"] != draft["max_draft"]:
                add(f"limits.max_draft: {limits['max_draft']} differs from draft.max_draft = {draft['max_draft']}")
            if model is not None and _is_int(limits.get("max_context")) and _is_int(model.get("max_context")) \
                    and limits["max_context"] > model["max_context"]:
                add(f"limits.max_context: {limits['max_context']} exceeds model.max_context = "
                    f"{model['max_context']}")

        dims = section("dims")
        if dims is not None:
            for name, rng in dims.items():
                if not isinstance(rng, dict) or not all(_is_int(rng.get(k)) for k in ("min", "opt", "max")):
                    add(f"dims.{name}: must be an object with integer min, opt, max")
                    continue
                if rng["min"] < 0:
                    add(f"dims.{name}: min {rng['min']} is negative")
                if not rng["min"] <= rng["opt"] <= rng["max"]:
                    add(f"dims.{name}: needs min <= opt <= max, got {rng['min']} / {rng['opt']} / {rng['max']}")

        files = section("files")
        if files is not None:
            for name, entry in files.items():
                if not isinstance(entry, dict):
                    add(f"files.{name}: must be an object with sha256 and bytes")
                    continue
                if not isinstance(entry.get("sha256"), str) or not _HEX64.match(entry["sha256"]):
                    add(f"files.{name}.sha256: missing or not 64 lowercase hex digits")
                if not _is_int(entry.get("bytes")) or entry["bytes"] < 0:
                    add(f"files.{name}.bytes: missing or not a non-negative integer")
                if Path(name).is_absolute() or ".." in Path(name).parts:
                    add(f"files.{name}: must be a path relative to the artifact directory")

        graphs = section("graphs")
        if graphs is not None:
            for g in GRAPHS:
                if g not in graphs:
                    add(f"graphs.{g}: missing")
            for g, spec in graphs.items():
                if not isinstance(spec, dict):
                    add(f"graphs.{g}: must be an object with file, inputs, outputs")
                    continue
                if not isinstance(spec.get("file"), str) or not spec.get("file"):
                    add(f"graphs.{g}.file: missing or not a string")
                elif files is not None and spec["file"] not in files:
                    add(f"graphs.{g}.file: {spec['file']!r} is not listed in manifest files (no hash recorded)")
                for kind in ("inputs", "outputs"):
                    ios = spec.get(kind)
                    if not isinstance(ios, list) or not ios:
                        add(f"graphs.{g}.{kind}: missing or empty list")
                        continue
                    seen = set()
                    for i, io in enumerate(ios):
                        where = f"graphs.{g}.{kind}[{i}]"
                        if not isinstance(io, dict):
                            add(f"{where}: must be an object with name, dtype, shape")
                            continue
                        name = io.get("name")
                        if not isinstance(name, str) or not name:
                            add(f"{where}.name: missing or not a string")
                        else:
                            where = f"graphs.{g}.{kind}.{name}"
                            if name in seen:
                                add(f"{where}: duplicate name")
                            seen.add(name)
                        if io.get("dtype") not in IO_DTYPES:
                            add(f"{where}.dtype: {io.get('dtype')!r}, expected one of {', '.join(IO_DTYPES)}")
                        shape = io.get("shape")
                        if not isinstance(shape, list):
                            add(f"{where}.shape: missing or not a list")
                            continue
                        for dim in shape:
                            if isinstance(dim, str):
                                if kind == "inputs" and dims is not None and dim not in dims:
                                    add(f"{where}.shape: dim {dim!r} is not defined in manifest 'dims' "
                                        f"(no optimisation profile for it)")
                            elif not _is_int(dim) or dim < 0:
                                add(f"{where}.shape: {dim!r} must be a dim name or a non-negative integer")

        tok = d.get("tokenizer")
        if not isinstance(tok, dict):
            add("tokenizer: missing or not an object")
        else:
            if not isinstance(tok.get("file"), str) or not tok.get("file"):
                add("tokenizer.file: missing or not a string")
            eos = tok.get("eos_token_id")
            if eos is not None and not _is_int(eos):
                add("tokenizer.eos_token_id: must be an integer or null")

        engines = d.get("engines")
        if engines is not None:
            if not isinstance(engines, dict):
                add("engines: must be an object")
            else:
                for g, e in engines.items():
                    if not isinstance(e, dict):
                        add(f"engines.{g}: must be an object")
                        continue
                    for k in ("file", "tensorrt_version", "gpu_name", "built"):
                        need_str(e, f"engines.{g}", k)
                    if not isinstance(e.get("sha256"), str) or not _HEX64.match(e["sha256"]):
                        add(f"engines.{g}.sha256: missing or not 64 lowercase hex digits")
                    if not isinstance(e.get("compute_capability"), str) or not _CC.match(e["compute_capability"]):
                        add(f"engines.{g}.compute_capability: {e.get('compute_capability')!r}, expected like '9.0'")
                    if e.get("plugin_mode") not in PLUGIN_MODES:
                        add(f"engines.{g}.plugin_mode: {e.get('plugin_mode')!r}, expected one of "
                            f"{', '.join(PLUGIN_MODES)}")
        return problems

    # ------------------------------------------------------------------ engines
    def record_engine(self, graph: str, *, file: str, sha256: str, tensorrt_version: str, gpu_name: str,
                      compute_capability: str, plugin_mode: str, built: str | None = None, **extra: Any) -> dict:
        """Add or replace engines[graph] (file relative to the artifact dir when inside it)."""
        entry = {"file": file, "sha256": sha256, "tensorrt_version": tensorrt_version, "gpu_name": gpu_name,
                 "compute_capability": compute_capability, "plugin_mode": plugin_mode,
                 "built": built or now_iso(), **extra}
        engines = self.data.get("engines")
        if not isinstance(engines, dict):
            engines = self.data["engines"] = {}
        engines[graph] = entry
        return entry


def load_manifest(artifact_dir: str | os.PathLike, *, strict: bool = True) -> Manifest:
    """Shorthand for Manifest.load."""
    return Manifest.load(artifact_dir, strict=strict)
