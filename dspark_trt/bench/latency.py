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


def steady_window(timeline: list, requests: list[dict], concurrency: int) -> tuple[int, float] | None:
    """(tokens, seconds) generated while the closed loop ran at full concurrency, or None.

    The window runs from the ``concurrency``-th completion (the opening wave done: before it every request
    started together) to the last submission (after it, no request replaces a finished one and the batch
    drains, so the run's length turns on its slowest last requests). In a closed loop of n requests the last
    submission follows the (n - concurrency)-th completion, so the window holds n - 2 x concurrency
    completions: whole waves. From the first completion instead, a run whose requests finish in step (plain
    decoding, prompts prefilled in chunks a few at a time) counted two prefill stretches for one of
    decoding, and read 15-20% below its whole run at 64 requests where drafting modes read level (lab
    notes, thirtieth session). ``timeline``: (time, output tokens so far) at the end of every runtime step;
    ``requests``: records with ``submitted_at`` and ``done_at`` (same clock). The window is cut at step
    ends inside it. None when it holds fewer than two steps (e.g. a single wave).
    """
    done = sorted(r["done_at"] for r in requests if r.get("done_at") is not None)
    submitted = [r["submitted_at"] for r in requests if r.get("submitted_at") is not None]
    if not done or not submitted:
        return None
    start, end = done[min(max(int(concurrency), 1), len(done)) - 1], max(submitted)
    inside = [(t, n) for t, n in timeline if start <= t <= end]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    (t0, n0), (t1, n1) = inside[0], inside[-1]
    return n1 - n0, t1 - t0



def first_tokens_rate(timeline: list, requests: list[dict], n: int) -> float | None:
    """Output tokens/s over a run's first ``n`` tokens: from its first submission to the end of the step
    that reached n (the start-up window, where a cost model that is wrong at first costs the most; issue
    22 measures recovery over the first 512 tokens). None when the run emitted fewer."""
    submitted = [r["submitted_at"] for r in requests if r.get("submitted_at") is not None]
    if not submitted:
        return None
    t0 = min(submitted)
    reached = next(((t, k) for t, k in timeline if k >= n), None)
    return reached[1] / (reached[0] - t0) if reached and reached[0] > t0 else None


# ------------------------------------------------------------------------------------------- open loop

def percentiles(values, qs=(50, 90, 99)) -> dict:
    """{'p50': ..., 'p90': ..., 'p99': ...} of ``values`` (numpy's linear interpolation); None for each
    when there are no values."""
    return {f"p{q:g}": _pct(values, q) for q in qs}


def request_latencies(rec: dict) -> dict:
    """One open-loop request record -> its latencies in ms, measured from its *scheduled* arrival (a client
    that fell behind its schedule does not hide the delay):

    - ttft: arrival to the first token; e2e: arrival to the last token;
    - tpot: (last token - first token) / (tokens - 1), None for a one-token answer;
    - itl: the gaps between successive deliveries (one delivery may carry several tokens: a speculative
      step commits them together, and that is when a streaming client sees them);
    - queue: arrival to admission into a batch slot (over HTTP: the server's own figure, from the request
      reaching its runtime, as `queue_ms`).
    """
    at, times, n = rec["arrival_s"], rec.get("token_times_s") or [], int(rec.get("generated_tokens") or 0)
    out = {"ttft": None, "tpot": None, "e2e": None, "itl": [], "queue": None}
    if rec.get("admitted_s") is not None:
        out["queue"] = (rec["admitted_s"] - at) * 1e3
    elif rec.get("queue_ms") is not None:
        out["queue"] = float(rec["queue_ms"])
    if not times:
        return out
    out["ttft"] = (times[0] - at) * 1e3
    out["e2e"] = (times[-1] - at) * 1e3
    if n > 1:
        out["tpot"] = (times[-1] - times[0]) / (n - 1) * 1e3
    out["itl"] = [(b - a) * 1e3 for a, b in zip(times, times[1:])]
    return out


def meets_slo(lat: dict, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """A completed request meets the SLO when its TTFT and its TPOT are within their limits (None: no limit;
    a one-token answer has no TPOT and meets any TPOT limit)."""
    if lat["ttft"] is None:
        return False
    if slo_ttft_ms is not None and lat["ttft"] > slo_ttft_ms:
        return False
    return slo_tpot_ms is None or lat["tpot"] is None or lat["tpot"] <= slo_tpot_ms


def tokens_between(rec: dict, t0: float, t1: float) -> float:
    """Tokens of one request delivered in (t0, t1]. Without per-delivery counts (over HTTP a chunk's token
    count is unknown) the request's tokens are spread evenly over its deliveries."""
    times = rec.get("token_times_s") or []
    if not times:  # e.g. over HTTP an answer whose only token decodes to no text
        return 0.0
    counts = rec.get("token_counts") or [int(rec.get("generated_tokens") or 0) / len(times)] * len(times)
    return float(sum(c for t, c in zip(times, counts) if t0 < t <= t1))


def window_tok_s(runs: list[tuple[list[dict], float]]) -> float | None:
    """Output tokens/s while requests were still arriving: tokens delivered between the schedule's start
    and its last arrival / that span, over all ``runs`` ((records, wall) each). It leaves out the drain
    after the last arrival, whose length turns on the last few answers (one 512-token answer decoding
    alone), and at an overloading rate it is the rate the server sustains with its queue never empty."""
    tokens = span = 0.0
    for records, _ in runs:
        end = max((r["arrival_s"] for r in records), default=0.0)
        tokens += sum(tokens_between(r, 0.0, end) for r in records if r.get("ok"))
        span += end
    return tokens / span if span > 0 else None


def summarize_open(records: list[dict], wall_s: float, slo_ttft_ms: float | None = None,
                   slo_tpot_ms: float | None = None) -> dict:
    """The figures of one (rate, mode) over its rounds: ``records`` from every round, ``wall_s`` the sum
    of the rounds' lengths (schedule start to the last answer). Counts are of completed requests;
    ``output_tok_s_whole_run`` and ``req_s`` are per second of the whole runs; goodput is completed
    requests meeting both SLOs per second of them (``goodput_frac``: their share of all requests sent,
    failed ones included). (The headline ``output_tok_s`` is :func:`window_tok_s`, set by the caller.)"""
    done = [r for r in records if r.get("ok")]
    lats = [request_latencies(r) for r in done]
    tokens = sum(int(r["generated_tokens"]) for r in done)
    good = sum(meets_slo(x, slo_ttft_ms, slo_tpot_ms) for x in lats)
    per_s = (lambda x: x / wall_s) if wall_s > 0 else (lambda x: 0.0)
    return {
        "requests": len(records), "completed": len(done), "failed": len(records) - len(done),
        "generated_tokens": tokens, "wall_s": wall_s,
        "output_tok_s": per_s(tokens), "output_tok_s_whole_run": per_s(tokens), "req_s": per_s(len(done)),
        "goodput": per_s(good), "goodput_frac": good / len(records) if records else None,
        "ttft_ms": percentiles([x["ttft"] for x in lats]),
        "tpot_ms": percentiles([x["tpot"] for x in lats]),
        "itl_ms": percentiles([g for x in lats for g in x["itl"]]),
        "e2e_ms": percentiles([x["e2e"] for x in lats]),
        "queue_wait_ms": percentiles([x["queue"] for x in lats]),
        "errors": sorted({str(r.get("error")) for r in records if not r.get("ok")})[:5],
    }
