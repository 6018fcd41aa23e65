"""How busy the machine's cores are right now: what ONNX Runtime's spin decision reads at load (ort.py).

Linux: the share of all cores' time that was not idle over a short window, from /proc/stat. Elsewhere the
1-minute load average over the core count, where the OS has one; else unknown (None).
"""

from __future__ import annotations

import os
import time

__all__ = ["busy_fraction", "parse_cpu_line"]

PROBE_S = 0.1  # /proc/stat counts in 10 ms ticks: 10 per core over the window
REUSE_S = 30.0  # a process loading several runtimes probes once in this long

_last: tuple[float, float | None] | None = None  # (monotonic time, busy fraction) of the last probe


def parse_cpu_line(line: str) -> tuple[int, int]:
    """(busy, total) ticks from /proc/stat's aggregate "cpu" line (user nice system idle iowait irq softirq
    steal ...; guest time is already inside user). Idle and iowait are the idle part."""
    ticks = [int(x) for x in line.split()[1:9]]
    ticks += [0] * (8 - len(ticks))
    total = sum(ticks)
    return total - ticks[3] - ticks[4], total


def _proc_stat() -> tuple[int, int] | None:
    try:
        with open("/proc/stat") as f:
            line = f.readline()
    except OSError:
        return None
    return parse_cpu_line(line) if line.startswith("cpu ") else None


def busy_fraction(window_s: float = PROBE_S) -> float | None:
    """Share (0..1) of all cores' time spent busy over `window_s` (reused for REUSE_S), or None if unknown."""
    global _last
    now = time.monotonic()
    if _last is not None and now - _last[0] < REUSE_S:
        return _last[1]
    a = _proc_stat()
    if a is not None:
        time.sleep(window_s)
        b = _proc_stat()
        busy = (b[0] - a[0]) / (b[1] - a[1]) if b is not None and b[1] > a[1] else None
    elif hasattr(os, "getloadavg"):
        busy = os.getloadavg()[0] / (os.cpu_count() or 1)
    else:
        busy = None
    busy = None if busy is None else min(1.0, max(0.0, busy))
    _last = (time.monotonic(), busy)
    return busy
