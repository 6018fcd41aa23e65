"""Timing the engines for a cost profile: round-robin over the measurement sizes, robust to the slow
tail that other processes add (outliers dropped, extra rounds until the spread settles).

:func:`profile_points` feeds :meth:`dspark_trt.runtime.costs.table.CostTable.from_measurements`.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from dspark_trt.runtime.costs.table import measurement_points

__all__ = ["drop_outliers", "profile_points", "relative_spread"]


def relative_spread(values) -> float:
    """IQR / median of some timings (0 for fewer than two): how far apart repeated timings of one point are."""
    v = np.asarray(values, dtype=np.float64)
    if v.size < 2:
        return 0.0
    q1, med, q3 = np.percentile(v, [25, 50, 75])
    return float((q3 - q1) / med) if med > 0 else 0.0


def drop_outliers(values, keep_quantile: float = 100.0) -> list[float]:
    """The timings at or below this percentile of them: preemption by other processes only ever adds
    time, so the slow tail is noise and the low part is the engine's cost."""
    v = np.asarray(values, dtype=np.float64)
    if v.size < 2 or keep_quantile >= 100:
        return v.tolist()
    return v[v <= np.percentile(v, keep_quantile)].tolist()


def profile_points(measure_verify: Callable[[int], float], measure_draft: Callable[[int], float],
                   max_tokens: int, max_batch: int, repeats: int, progress: bool = True, *,
                   warmup: int = 0, verify_at: list[int] | None = None, draft_at: list[int] | None = None,
                   max_spread: float | None = None, max_repeats: int | None = None,
                   keep_quantile: float = 100.0, stats: dict | None = None,
                   ) -> tuple[dict[int, list[float]], dict[int, list[float]]]:
    """Time the engines at :func:`measurement_points` sizes; returns (verify_points, draft_points).

    Calls ``measure_verify(t) -> ms`` and ``measure_draft(b) -> ms`` ``repeats`` times at every point
    (after ``warmup`` discarded calls per point), round-robin over the points so slow drift during
    profiling (clocks, thermals) spreads over all sizes instead of biasing one. ``verify_at`` /
    ``draft_at`` override the sizes. Feed the result to :meth:`CostTable.from_measurements`.

    Robust measurement: each point keeps only its timings at or below the ``keep_quantile`` percentile
    (:func:`drop_outliers`). With ``max_spread``, further round-robin rounds (over the points still
    unsettled, in the same order) follow until every point's kept timings have a relative spread
    (:func:`relative_spread`) of at most ``max_spread``, or ``max_repeats`` timings. ``stats``, if given,
    receives ``spread`` (median over points of the final spreads), ``spread_max`` and ``rounds``.
    """
    if int(repeats) < 1:
        raise ValueError(f"repeats must be >= 1; got {repeats}")
    vpts = sorted(set(verify_at)) if verify_at else measurement_points(max_tokens)
    dpts = sorted(set(draft_at)) if draft_at else measurement_points(max_batch)
    jobs = [("verify", measure_verify, t) for t in vpts] + [("draft", measure_draft, b) for b in dpts]
    out: dict[str, dict[int, list[float]]] = {"verify": {t: [] for t in vpts}, "draft": {b: [] for b in dpts}}
    cap = max(int(repeats), int(max_repeats or repeats))

    def spread(name, size) -> float:
        return relative_spread(drop_outliers(out[name][size], keep_quantile))

    def time_round(todo, count: bool, bar) -> None:
        for name, fn, size in todo:
            ms = float(fn(size))
            if not (0.0 < ms < math.inf):
                raise ValueError(f"measure_{name}({size}) returned {ms!r}; expected positive milliseconds")
            if count:
                out[name][size].append(ms)
            bar.update(1)

    from tqdm.auto import tqdm  # lazy: keeps runtime import light

    rounds = int(repeats)
    with tqdm(total=len(jobs) * (int(repeats) + int(warmup)), desc="profiling step costs", unit="run",
              disable=not progress) as bar:
        for rep in range(int(warmup) + int(repeats)):
            time_round(jobs, rep >= int(warmup), bar)
        while max_spread is not None and rounds < cap:
            todo = [j for j in jobs if spread(j[0], j[2]) > max_spread]
            if not todo:
                break
            bar.total += len(todo)
            time_round(todo, True, bar)
            rounds += 1
    spreads = [spread(name, size) for name, _, size in jobs]
    if stats is not None:
        stats.update(spread=float(np.median(spreads)), spread_max=float(max(spreads)), rounds=rounds)
    if keep_quantile < 100:
        for name in out:
            out[name] = {k: drop_outliers(v, keep_quantile) for k, v in out[name].items()}
    return out["verify"], out["draft"]
