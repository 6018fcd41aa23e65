"""Latency and throughput statistics of benchmark requests: percentiles, intervals, per-run summaries."""

from __future__ import annotations

import math

import numpy as np


def _pct(values, q: float):
    v = [x for x in values if x is not None]
    return float(np.percentile(v, q)) if v else None


def median_interval(values, level: float = 0.9) -> tuple[float, float, float] | None:
    """A distribution-free confidence interval for the median of ``values``' population: (lo, hi, coverage).

    The k-th smallest and k-th largest values cover the median with probability 1 - 2 P(B <= k - 1),
    B ~ Binomial(n, 1/2) (the sign test); k is the largest giving at least ``level``. With too few values
    for ``level`` (n <= 4 at 0.9) it is the whole range, with the lower coverage it has. None for n < 2."""
    v = sorted(float(x) for x in values if x is not None)
    n = len(v)
    if n < 2:
        return None

    def coverage(k: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n

    k = 1
    while k + 1 <= n // 2 and coverage(k + 1) >= level:
        k += 1
    return v[k - 1], v[n - k], coverage(k)


def summarize_requests(requests: list[dict], wall_s: float) -> dict:
    """Per-request records (``generated_tokens``, ``latency_s``, optional ``time_to_first_token_s``) of one
    or more runs with total measured wall time ``wall_s`` -> throughput and per-user statistics.

    - output_tok_s: all generated tokens / wall time of the runs (first submission to last completion).
    - per-user tok/s of a request: generated tokens / its latency (submission to last token, prefill
      included). p50 is the median; p90 is the tail, the rate 90% of requests reached or beat (the 10th
      percentile of the rates), like a p90 latency.
    - tpot_ms (time per output token) of a request: (latency - time to first token) / (generated - 1);
      p50 median, p90 the 90th percentile (the slow tail). Without TTFT (peers): latency / generated.
    """
    gen = [int(r["generated_tokens"]) for r in requests]
    lat = [float(r["latency_s"]) for r in requests]
    rates = [g / t for g, t in zip(gen, lat) if t > 0]
    tpot, ttft = [], []
    for r, g, t in zip(requests, gen, lat):
        f = r.get("time_to_first_token_s")
        if f is not None:
            ttft.append(f * 1e3)
            if g > 1:
                tpot.append((t - f) / (g - 1) * 1e3)
        elif g > 0:
            tpot.append(t / g * 1e3)
    total = sum(gen)
    return {
        "requests": len(requests),
        "generated_tokens": total,
        "wall_s": wall_s,
        "output_tok_s": total / wall_s if wall_s > 0 else 0.0,
        "per_user_tok_s_p50": _pct(rates, 50),
        "per_user_tok_s_p90": _pct(rates, 10),
        "per_user_tok_s_mean": float(np.mean(rates)) if rates else None,
        "tpot_ms_p50": _pct(tpot, 50),
        "tpot_ms_p90": _pct(tpot, 90),
        "ttft_ms_p50": _pct(ttft, 50),
        "ttft_ms_p90": _pct(ttft, 90),
        "latency_s_p50": _pct(lat, 50),
        "latency_s_p90": _pct(lat, 90),
    }


def steady_window(timeline: list, requests: list[dict]) -> tuple[int, float] | None:
    """(tokens, seconds) generated while the closed loop ran at full concurrency, or None.

    The window runs from the first completion (before it, every request started together: one prefill
    wave) to the last submission (after it, no request replaces a finished one and the batch drains, so
    the run's length turns on its slowest last requests). ``timeline``: (time, output tokens so far) at the
    end of every runtime step; ``requests``: records with ``submitted_at`` and ``done_at`` (same clock).
    The window is cut at step ends inside it. None when it holds fewer than two steps (e.g. a single wave).
    """
    done = [r["done_at"] for r in requests if r.get("done_at") is not None]
    submitted = [r["submitted_at"] for r in requests if r.get("submitted_at") is not None]
    if not done or not submitted:
        return None
    start, end = min(done), max(submitted)
    inside = [(t, n) for t, n in timeline if start <= t <= end]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    (t0, n0), (t1, n1) = inside[0], inside[-1]
    return n1 - n0, t1 - t0

