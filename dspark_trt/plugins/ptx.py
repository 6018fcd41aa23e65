"""The PTX ISA version of the AOT kernels embedded in TensorRT engines: pinned, not whatever Triton's ptxas knows.

An AOT plugin hands TensorRT PTX text; the PTX is compiled for the GPU by the driver's JIT when the engine
is loaded, and a driver refuses a PTX ISA newer than its CUDA version (PTX ISA 8.0 came with CUDA 12.0).
Triton otherwise stamps the newest ISA its bundled ptxas supports (Triton 3.9: ISA 9.x, CUDA 13 drivers
only), so an engine built on a box with a new Triton would not load under an older driver that runs the
same TensorRT. dspark-trt supports TensorRT >= 10.9 built for CUDA 12.x or 13.x, whose drivers are r525+
(CUDA 12.0): the kernels are emitted as ISA 8.0, or the oldest ISA that knows the target GPU when that
is newer (Blackwell). `triton.compile(..., options={"ptx_version": N})` sets it (an option of Triton's
CUDA backend since 3.0; `backends/nvidia/compiler.py` rewrites `.version` to it).

Pure functions, no imports beyond the standard library.
"""

from __future__ import annotations

import re

BASE_ISA = 80  # CUDA 12.0 drivers (r525+): the oldest TensorRT 10.9+ for CUDA 12 runs on

# The first PTX ISA that can target each architecture (PTX ISA manual, "PTX Target Architecture" notes).
MIN_ISA_FOR_ARCH = {
    75: 63, 80: 70, 86: 71, 87: 74, 89: 78, 90: 78,
    100: 86, 101: 86, 103: 88, 110: 90, 120: 87, 121: 88,
}

# The newest ISA each CUDA driver major.minor accepts (PTX ISA manual, release notes).
ISA_OF_CUDA = {(12, 0): 80, (12, 1): 81, (12, 2): 82, (12, 3): 83, (12, 4): 84, (12, 5): 85, (12, 6): 85,
               (12, 8): 87, (12, 9): 88, (13, 0): 90, (13, 1): 91}


def arch_number(compute_capability) -> int:
    """"9.0" / (9, 0) / "sm_90" / 90 -> 90."""
    if isinstance(compute_capability, int):
        return compute_capability
    if isinstance(compute_capability, (tuple, list)):
        return int(compute_capability[0]) * 10 + int(compute_capability[1])
    s = str(compute_capability).strip().lower().removeprefix("sm_").rstrip("a").rstrip("f")
    m = re.fullmatch(r"(\d+)\.(\d)", s)
    if m:
        return int(m.group(1)) * 10 + int(m.group(2))
    if s.isdigit():
        return int(s)
    raise ValueError(f"not a compute capability: {compute_capability!r}")


def ptx_isa_for(compute_capability) -> int:
    """The PTX ISA (as Triton's int, 80 = 8.0) to emit the AOT kernels in for this GPU."""
    arch = arch_number(compute_capability)
    known = [a for a in MIN_ISA_FOR_ARCH if a <= arch]
    need = MIN_ISA_FOR_ARCH[max(known)] if known else BASE_ISA
    if arch not in MIN_ISA_FOR_ARCH and arch > max(MIN_ISA_FOR_ARCH):
        need = max(need, max(ISA_OF_CUDA.values()))  # an architecture newer than this table
    return max(BASE_ISA, need)


def isa_string(isa: int) -> str:
    return f"{isa // 10}.{isa % 10}"


def min_cuda_driver(isa: int) -> str:
    """The oldest CUDA driver version whose JIT accepts PTX ISA `isa`."""
    for (major, minor), v in sorted(ISA_OF_CUDA.items()):
        if v >= isa:
            return f"{major}.{minor}"
    return "newer than 13.1"


def ptx_version_of(ptx: str) -> str | None:
    """The `.version` directive of a PTX module."""
    m = re.search(r"^\s*\.version\s+(\d+\.\d+)", ptx, re.M)
    return m.group(1) if m else None
