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
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from dspark_trt.errors import DsparkError
from dspark_trt.manifest_schema import (CONFIDENCE_MODES, DRAFTER_KINDS, GRAPHS, GREEDY_DRAFT_GRAPH,  # noqa: F401
                                        IO_DTYPES, MANIFEST_FORMAT, MANIFEST_VERSION, MODEL_DTYPE_TO_ONNX,
                                        MODEL_DTYPES, OPTIONAL_GRAPHS, PLUGIN_MODES, _is_int, manifest_problems)

MANIFEST_NAME = "manifest.json"
# Graph I/O names: the contract between the exported graphs (exporter/graphs.py) and every backend.
PACKED_INPUTS = ["tokens", "positions", "pack_index", "unpack_index", "query_lens", "past_lens", "slot_ids"]
DRAFT_INPUTS = PACKED_INPUTS + ["temperature", "uniforms", "prev_survival", "draft_position"]
DRAFT_OUTPUTS = ["draft_token", "draft_probs", "survival", "confidence_logit"]
# The all-greedy draft flavour (graph GREEDY_DRAFT_GRAPH): no temperatures or draws in, no distribution out.
GREEDY_DRAFT_INPUTS = PACKED_INPUTS + ["prev_survival", "draft_position"]
GREEDY_DRAFT_OUTPUTS = ["draft_token", "survival", "confidence_logit"]
TARGET_INPUTS = PACKED_INPUTS + ["verify_index", "verify_lens", "draft_tokens", "draft_probs", "temperature",
                                 "accept_uniforms", "sample_uniforms"]
TARGET_OUTPUTS = ["accepted", "next_token"]
# The ORT flavour's decoding graph (graphs.target.ort.decode; exporter/graphs.TargetDecodeStep): tokens
# [rows, T], all scored; past and present slot-major [rows, KVH, max_context, D].
DECODE_INPUTS = ["tokens", "past_lens", "verify_lens", "draft_tokens", "draft_probs", "temperature",
                 "accept_uniforms", "sample_uniforms"]
# The draft's decoding graphs (graphs.draft.ort.decode, graphs.draft_greedy.ort.decode; DraftDecodeStep).
DRAFT_DECODE_INPUTS = ["tokens", "past_lens", "temperature", "uniforms", "prev_survival", "draft_position"]
GREEDY_DRAFT_DECODE_INPUTS = ["tokens", "past_lens", "prev_survival", "draft_position"]


def kv_names(num_layers: int, prefix: str) -> list[str]:
    """KV cache I/O names of a graph: prefix "past" (inputs) or "present" (outputs)."""
    if prefix == "past":
        return [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    return [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


# Files whose hash must not key cost profiles (the profile itself, written after the key is taken).
_NOT_IN_ARTIFACT_KEY = ("cost_profile.json",)

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

    def keys(self):  # with __getitem__: dict(manifest, ...) and {**manifest} work as on the JSON dict
        return self.data.keys()

    def __iter__(self):
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)

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
    def drafter_kind(self) -> str:
        """draft.kind, "classic" when absent (artifacts written before the field existed)."""
        return (self.data.get("draft") or {}).get("kind", "classic")

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
        return manifest_problems(self.data)

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
