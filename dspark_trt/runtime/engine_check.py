"""Refuse TensorRT engines built for another TensorRT version or GPU architecture.

A serialized TensorRT engine only deserializes on the TensorRT version it was built with and runs only on
GPUs of the compute capability it was built for. `dspark-trt build` records both in the manifest
(`engines.<graph>`); the TRT backend calls `check_engine_compat` before deserializing.

Standard library only (the runtime imports without torch or tensorrt).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

from dspark_trt.errors import DsparkError
from dspark_trt.trt_env import PLUGIN_MODULE, GpuInfo, detect_gpu, version_key  # noqa: F401 (re-exported)


def _engines(manifest: Any) -> Mapping:
    data = manifest.data if hasattr(manifest, "data") else manifest
    engines = data.get("engines") if isinstance(data, Mapping) else None
    return engines if isinstance(engines, Mapping) else {}


def _artifact_label(manifest: Any) -> str:
    path = getattr(manifest, "path", None)
    return str(path) if path is not None else "ARTIFACT_DIR"


def _version_key(version: str, width: int = 3) -> tuple[int, ...]:
    return version_key(version, width)


def _cc_key(cc: Any) -> str:
    if isinstance(cc, (tuple, list)):
        return f"{int(cc[0])}.{int(cc[1])}"
    s = str(cc).strip()
    m = re.match(r"^(?:sm_?)?(\d+)\.?(\d)?$", s)
    if m and m.group(2) is None and len(m.group(1)) >= 2:  # "90" / "sm_90" -> "9.0"
        return f"{m.group(1)[:-1]}.{m.group(1)[-1]}"
    if m and m.group(2) is not None:
        return f"{m.group(1)}.{m.group(2)}"
    return s


def check_engine_compat(manifest: Any, graph: str, trt_version: str, compute_capability: Any) -> dict:
    """Return the manifest's engine entry for `graph` if it can run here; else raise DsparkError.

    `trt_version`: the installed TensorRT (`tensorrt.__version__`); major.minor.patch must match the build.
    `compute_capability`: this GPU's, as "9.0", (9, 0) or "sm_90"; must equal the build's.
    """
    where = _artifact_label(manifest)
    engines = _engines(manifest)
    entry = engines.get(graph)
    if not isinstance(entry, Mapping):
        raise DsparkError(f"no TensorRT engine for the {graph} graph in {where}: build them with "
                          f"`dspark-trt build {where}`")
    built_trt = str(entry.get("tensorrt_version", "?"))
    built_cc = _cc_key(entry.get("compute_capability", "?"))
    here_cc = _cc_key(compute_capability)
    trt_ok = _version_key(built_trt) == _version_key(trt_version)
    cc_ok = built_cc == here_cc
    if not (trt_ok and cc_ok):
        what = []
        if not trt_ok:
            what.append("TensorRT version")
        if not cc_ok:
            what.append("GPU architecture")
        raise DsparkError(
            f"engine for the {graph} graph was built with TensorRT {built_trt} for compute capability {built_cc}"
            f" ({entry.get('gpu_name', 'unknown GPU')}); this machine has TensorRT {trt_version} and compute "
            f"capability {here_cc} ({' and '.join(what)} differ): rebuild with `dspark-trt build {where}`")
    return dict(entry)


def engine_path(manifest: Any, graph: str, artifact_dir: str | Path | None = None) -> Path:
    """Absolute path of a recorded engine (entries are relative to the artifact dir when inside it)."""
    entry = _engines(manifest).get(graph)
    where = _artifact_label(manifest)
    if not isinstance(entry, Mapping) or not entry.get("file"):
        raise DsparkError(f"no TensorRT engine for the {graph} graph in {where}: build them with "
                          f"`dspark-trt build {where}`")
    p = Path(entry["file"])
    if p.is_absolute():
        return p
    base = Path(artifact_dir) if artifact_dir is not None else getattr(manifest, "path", None)
    if base is None:
        raise DsparkError("engine_path() needs the artifact directory")
    return Path(base) / p


def verify_engine_file(manifest: Any, graph: str, artifact_dir: str | Path | None = None) -> Path:
    """The engine file exists and matches its recorded sha256; returns its path."""
    from dspark_trt.manifest import sha256_file

    p = engine_path(manifest, graph, artifact_dir)
    where = _artifact_label(manifest)
    if not p.is_file():
        raise DsparkError(f"engine file {p} for the {graph} graph is missing: rebuild with `dspark-trt build {where}`")
    expected = _engines(manifest)[graph].get("sha256")
    if expected and sha256_file(p) != expected:
        raise DsparkError(f"engine file {p} does not match the sha256 recorded at build time: rebuild with "
                          f"`dspark-trt build {where}`")
    return p


def needs_plugin_module(entry: Mapping) -> bool:
    """JIT-plugin engines need `PLUGIN_MODULE` imported before deserialization; AOT engines do not."""
    return entry.get("plugin_mode") == "jit"
