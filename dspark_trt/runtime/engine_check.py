"""Refuse TensorRT engines built for another TensorRT version or GPU architecture.

A serialized TensorRT engine only deserializes on the TensorRT version it was built with and runs only on
GPUs of the compute capability it was built for. `dspark-trt build` records both in the manifest
(`engines.<graph>`); the TRT backend calls `check_engine_compat` before deserializing.

Standard library only (the runtime imports without torch or tensorrt).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from dspark_trt.errors import DsparkError

# Python-plugin engines built in JIT mode call back into the registering module at run time.
PLUGIN_MODULE = "dspark_trt.plugins.tensorrt_plugins"


def _engines(manifest: Any) -> Mapping:
    data = manifest.data if hasattr(manifest, "data") else manifest
    engines = data.get("engines") if isinstance(data, Mapping) else None
    return engines if isinstance(engines, Mapping) else {}


def _artifact_label(manifest: Any) -> str:
    path = getattr(manifest, "path", None)
    return str(path) if path is not None else "ARTIFACT_DIR"


def _version_key(version: str, width: int = 3) -> tuple[int, ...]:
    nums = [int(x) for x in re.findall(r"\d+", str(version))[:width]]
    return tuple(nums + [0] * (width - len(nums)))


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


# ------------------------------------------------------------------------------------------ GPU facts


@dataclass(frozen=True)
class GpuInfo:
    name: str
    compute_capability: str  # "9.0"


def _detect_with_libcuda(device: int) -> GpuInfo | None:
    names = [n for n in (ctypes.util.find_library("cuda"), "libcuda.so.1", "libcuda.so", "nvcuda.dll") if n]
    lib = None
    for n in names:
        try:
            lib = ctypes.CDLL(n)
            break
        except OSError:
            continue
    if lib is None:
        return None
    try:
        if lib.cuInit(0) != 0:
            return None
        dev = ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(dev), int(device)) != 0:
            return None
        buf = ctypes.create_string_buffer(256)
        if lib.cuDeviceGetName(buf, 256, dev) != 0:
            return None
        major, minor = ctypes.c_int(), ctypes.c_int()
        # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75, _MINOR = 76 (cuda.h)
        if lib.cuDeviceGetAttribute(ctypes.byref(major), 75, dev) != 0:
            return None
        if lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev) != 0:
            return None
        return GpuInfo(buf.value.decode("utf-8", "replace"), f"{major.value}.{minor.value}")
    except (AttributeError, OSError):
        return None


def _detect_with_nvidia_smi(device: int) -> GpuInfo | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name,compute_cap", "--format=csv,noheader", f"--id={device}"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    line = out.strip().splitlines()[0] if out.strip() else ""
    if "," not in line:
        return None
    name, cc = (x.strip() for x in line.rsplit(",", 1))
    return GpuInfo(name, cc) if re.match(r"^\d+\.\d+$", cc) else None


def detect_gpu(device: int = 0) -> GpuInfo | None:
    """Name and compute capability of CUDA device `device` (after CUDA_VISIBLE_DEVICES), or None without a GPU.

    Uses the CUDA driver library directly (no torch / cuda-python needed), then `nvidia-smi`.
    """
    return _detect_with_libcuda(device) or _detect_with_nvidia_smi(device)
