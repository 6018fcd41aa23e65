"""The TensorRT environment, in one place: import, logger, builder, GPU facts, plugin loading, messages.

Both the engine builder (exporter) and the TensorRT backend (runtime) set TensorRT up through this
module, so it sits next to manifest.py, below both layers. Standard library only at import time:
``tensorrt`` is imported inside functions (it is an optional extra and needs a GPU machine).

TensorRT facts used here (cited by the version that needs them):
- ``trt.ILogger`` subclasses with ``log(severity, msg)`` (TensorRT >= 8; ``ILogger.Severity``
  INTERNAL_ERROR=0 .. VERBOSE=4): the logger keeps the error lines so a failure can be explained.
- ``trt.Builder(logger)`` without a usable CUDA driver/GPU logs "CUDA initialization failure with error:
  35" (cudaErrorInsufficientDriver: no driver, or one older than TensorRT's CUDA runtime) or error 100
  (cudaErrorNoDevice), then pybind11 raises "factory function returned nullptr" (all 10.x/11.x).
- Python plugins (``tensorrt.plugin``): >= 10.6; AOT implementations: >= 10.9. The registering module
  must be imported before the ONNX parser runs, and wherever a JIT-plugin engine is deserialized.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

from dspark_trt.errors import DsparkError
from dspark_trt.plugins.spec import OPS, PLUGIN_NAMESPACE  # noqa: F401 (PLUGIN_NAMESPACE re-exported)

MIN_TENSORRT = "10.9"
PLUGIN_MODULE = "dspark_trt.plugins.tensorrt_plugins"
PLUGIN_IDS = tuple(op.plugin_id for op in OPS.values())  # every dspark op, Markov ops included
PLUGIN_IMPLS = ("aot", "jit")

NOT_INSTALLED = ("TensorRT is not installed: pip install 'dspark-trt[trt]' on a machine with an NVIDIA GPU "
                 "(engines must be built on the GPU they will run on)")
NEEDS_GPU = ("building TensorRT engines needs an NVIDIA GPU: none was found on this machine (engines must be "
             "built on the GPU they will run on)")
BACKEND_NEEDS_GPU = ("the trt backend needs an NVIDIA GPU and none was found (no driver, or CUDA_VISIBLE_DEVICES "
                     "hides it)")
_CUDA_INIT = re.compile(r"CUDA initialization failure with error:?\s*(\d+)", re.I)
_CUDA_ERRORS = {35: "cudaErrorInsufficientDriver: no NVIDIA driver, or one older than TensorRT's CUDA runtime",
                100: "cudaErrorNoDevice: no CUDA-capable GPU visible"}


def _one_line(text) -> str:
    return " ".join(str(text).split())


def backend_not_installed(artifact_dir) -> str:
    return (f"the trt backend needs TensorRT, which is not installed: pip install 'dspark-trt[trt]' on a machine "
            f"with an NVIDIA GPU, then build the engines there with `dspark-trt build {artifact_dir}`")


def import_tensorrt(not_installed: str = NOT_INSTALLED):
    """Import tensorrt or raise the one-line DsparkError that says how to get it."""
    try:
        import tensorrt as trt  # noqa: PLC0415 - lazy by design
    except ModuleNotFoundError as e:
        if (e.name or "tensorrt").split(".")[0] in ("tensorrt", "tensorrt_libs", "tensorrt_bindings"):
            raise DsparkError(not_installed) from None
        raise DsparkError(f"TensorRT failed to import ({e}): reinstall with pip install 'dspark-trt[trt]'") from None
    except (ImportError, OSError) as e:
        raise DsparkError(f"TensorRT is installed but failed to load ({_one_line(e)}): check the NVIDIA "
                          f"driver and the TensorRT libraries (pip install 'dspark-trt[trt]')") from None
    return trt


def tensorrt_version(trt) -> str:
    return str(getattr(trt, "__version__", "unknown"))


def version_key(version: str, width: int = 3) -> tuple[int, ...]:
    nums = [int(x) for x in re.findall(r"\d+", str(version))[:width]]
    return tuple(nums + [0] * (width - len(nums)))


def make_logger(trt):
    """A ``trt.ILogger`` that prints at WARNING (VERBOSE with DSPARK_TRT_VERBOSE=1) and keeps error lines."""

    class Logger(trt.ILogger):
        def __init__(self, level: int):
            trt.ILogger.__init__(self)
            self.level, self.errors = level, []

        def log(self, severity, msg):
            sev = int(severity)
            if sev <= 1:  # INTERNAL_ERROR, ERROR
                self.errors.append(_one_line(msg))
            if sev <= self.level:
                print(f"[TensorRT] {msg}", file=sys.stderr)

    return Logger(4 if os.environ.get("DSPARK_TRT_VERBOSE") else 2)


def cuda_init_error(messages) -> int | None:
    """The CUDA error number in TensorRT's "CUDA initialization failure with error: N" line, if logged."""
    for m in messages:
        hit = _CUDA_INIT.search(str(m))
        if hit:
            return int(hit.group(1))
    return None


def create_builder(trt, logger, needs_gpu: str = NEEDS_GPU):
    """trt.Builder, or a DsparkError saying it needs an NVIDIA GPU when CUDA cannot be initialised."""
    try:
        builder = trt.Builder(logger)
    except Exception as e:  # TypeError: pybind11::init(): factory function returned nullptr
        code = cuda_init_error(getattr(logger, "errors", []))
        if code is not None:
            why = _CUDA_ERRORS.get(code, "see the TensorRT log above")
            raise DsparkError(f"{needs_gpu}; TensorRT could not initialise CUDA (error {code}, {why})") from None
        if detect_gpu() is None:
            raise DsparkError(f"{needs_gpu}; TensorRT could not initialise CUDA ({_one_line(e)})") from None
        raise DsparkError(f"TensorRT could not create a builder on this GPU ({_one_line(e)}): see the TensorRT "
                          f"log above (DSPARK_TRT_VERBOSE=1 for more)") from None
    if builder is None:
        raise DsparkError(needs_gpu)
    return builder


# ------------------------------------------------------------------------------------------ plugins


def load_plugins(impls=PLUGIN_IMPLS, purpose: str = "build with the function bodies only (plugin_mode='none')"):
    """Import the dspark plugin module and register the given implementations ("aot", "jit").

    A process that deserializes JIT-plugin engines registers "jit" only: TensorRT's creator then has one
    implementation and builds it for any creation request (see tensorrt_plugins.register)."""
    try:
        module = importlib.import_module(PLUGIN_MODULE)
        module.register(impls)
    except DsparkError:
        raise
    except Exception as e:
        raise DsparkError(f"cannot load the dspark TensorRT plugins ({PLUGIN_MODULE}: {type(e).__name__}: "
                          f"{_one_line(e)}); fix it, or {purpose}") from None
    return module


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
