"""Request arrival times for the open loop: a seeded Poisson process."""

from __future__ import annotations

import math

import numpy as np

from dspark_trt.errors import DsparkError


def poisson_arrivals(rate: float, seed, n: int | None = None, duration: float | None = None) -> np.ndarray:
    """Arrival times in seconds from the start of a run: gaps independent and exponential with mean
    1 / ``rate`` (a Poisson process of ``rate`` requests per second), drawn from ``seed`` (an int or a
    sequence of ints). Exactly ``n`` arrivals, or every arrival before ``duration`` seconds (with both,
    whichever ends first). ``rate`` = inf: all at time 0 (a burst)."""
    if n is None and duration is None:
        raise DsparkError("give a run length: --num-prompts or --duration")
    if not rate > 0:
        raise DsparkError(f"arrival rate must be > 0 requests/s, got {rate}")
    cap = int(n) if n is not None else None
    if math.isinf(rate):
        return np.zeros(cap if cap is not None else 1)
    rng = np.random.default_rng(seed)
    if cap is None:  # enough gaps to pass `duration` with overwhelming probability, then cut
        cap = int(rate * duration + 10 * math.sqrt(rate * duration) + 10)
    times = np.cumsum(rng.exponential(1.0 / rate, cap))
    if duration is not None:
        times = times[times < duration]
    return times
