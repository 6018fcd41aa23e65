"""Calibration and ranking metrics for confidence scores (numpy only).

Every function takes predicted probabilities `conf` in [0, 1] and observed outcomes `outcome`. Outcomes
may be soft (in [0, 1], e.g. expected acceptance 1 - TV) for ECE, Brier and the reliability bins; AUROC
needs binary outcomes.

Binning (ECE and reliability diagrams):
- "uniform" (default): 15 equal-width bins over [0, 1]; a score of exactly 1.0 falls in the last bin.
  This is the usual ECE of the calibration literature and of the DSpark paper's per-position figures.
- "quantile": equal-mass bins (each holds ~N/n_bins samples; ties stay together). Less dominated by the
  crowded low-confidence bin of deep draft positions, reported as an alternative.
ECE = sum_b (n_b / N) * |mean(conf in b) - mean(outcome in b)|, optionally sample-weighted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_BINS = 15


def _as_arrays(conf, outcome, weights=None):
    c = np.asarray(conf, dtype=np.float64).ravel()
    y = np.asarray(outcome, dtype=np.float64).ravel()
    if c.shape != y.shape:
        raise ValueError(f"conf has {c.size} values, outcome {y.size}")
    w = np.ones_like(c) if weights is None else np.asarray(weights, dtype=np.float64).ravel()
    if w.shape != c.shape:
        raise ValueError(f"weights has {w.size} values, conf {c.size}")
    return c, y, w


def bin_index(conf, n_bins: int = DEFAULT_BINS, strategy: str = "uniform") -> np.ndarray:
    """Bin of each score: 0..n_bins-1."""
    c = np.asarray(conf, dtype=np.float64).ravel()
    if strategy == "uniform":
        return np.clip(np.floor(c * n_bins).astype(np.int64), 0, n_bins - 1)
    if strategy == "quantile":
        if c.size == 0:
            return np.zeros(0, dtype=np.int64)
        edges = np.quantile(c, np.linspace(0.0, 1.0, n_bins + 1)[1:-1])
        return np.searchsorted(edges, c, side="right").astype(np.int64)
    raise ValueError(f"unknown binning strategy {strategy!r} (use 'uniform' or 'quantile')")


@dataclass
class ReliabilityBins:
    """Per-bin statistics; empty bins have count 0 and NaN means."""

    edges: np.ndarray  # [n_bins + 1] (uniform) or the quantile edges padded with 0 and 1
    count: np.ndarray  # [n_bins] summed weights
    mean_conf: np.ndarray  # [n_bins]
    mean_outcome: np.ndarray  # [n_bins]

    @property
    def ece(self) -> float:
        total = self.count.sum()
        if total <= 0:
            return float("nan")
        ok = self.count > 0
        return float(np.sum(self.count[ok] * np.abs(self.mean_conf[ok] - self.mean_outcome[ok])) / total)

    def to_dict(self) -> dict:
        clean = lambda a: [None if not np.isfinite(v) else float(v) for v in a]  # noqa: E731
        return {"edges": clean(self.edges), "count": clean(self.count), "mean_conf": clean(self.mean_conf),
                "mean_outcome": clean(self.mean_outcome)}


def reliability_bins(conf, outcome, n_bins: int = DEFAULT_BINS, strategy: str = "uniform",
                     weights=None) -> ReliabilityBins:
    c, y, w = _as_arrays(conf, outcome, weights)
    idx = bin_index(c, n_bins, strategy)
    count = np.bincount(idx, weights=w, minlength=n_bins)
    sc = np.bincount(idx, weights=w * c, minlength=n_bins)
    sy = np.bincount(idx, weights=w * y, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mc = np.where(count > 0, sc / np.where(count > 0, count, 1), np.nan)
        my = np.where(count > 0, sy / np.where(count > 0, count, 1), np.nan)
    if strategy == "uniform":
        edges = np.linspace(0.0, 1.0, n_bins + 1)
    else:
        inner = np.quantile(c, np.linspace(0.0, 1.0, n_bins + 1)[1:-1]) if c.size else np.zeros(n_bins - 1)
        edges = np.concatenate([[0.0], inner, [1.0]])
    return ReliabilityBins(edges, count, mc, my)


def ece(conf, outcome, n_bins: int = DEFAULT_BINS, strategy: str = "uniform", weights=None) -> float:
    """Expected calibration error (see module docstring for the binning)."""
    return reliability_bins(conf, outcome, n_bins, strategy, weights).ece


def brier(conf, outcome, weights=None) -> float:
    """Mean squared error between predicted probability and (soft) outcome."""
    c, y, w = _as_arrays(conf, outcome, weights)
    if w.sum() <= 0:
        return float("nan")
    return float(np.sum(w * (c - y) ** 2) / w.sum())


def log_loss(conf, outcome, weights=None, eps: float = 1e-7) -> float:
    """Binary cross-entropy with (soft) targets."""
    c, y, w = _as_arrays(conf, outcome, weights)
    if w.sum() <= 0:
        return float("nan")
    c = np.clip(c, eps, 1 - eps)
    return float(-np.sum(w * (y * np.log(c) + (1 - y) * np.log1p(-c))) / w.sum())


def rankdata(x) -> np.ndarray:
    """1-based ranks, ties get their average rank (scipy.stats.rankdata 'average')."""
    x = np.asarray(x, dtype=np.float64).ravel()
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    # Start index of each run of equal values.
    starts = np.flatnonzero(np.concatenate([[True], xs[1:] != xs[:-1]]))
    ends = np.concatenate([starts[1:], [xs.size]])
    avg = (starts + ends + 1) / 2.0  # mean of 1-based ranks starts+1 .. ends
    ranks = np.empty(x.size, dtype=np.float64)
    ranks[order] = np.repeat(avg, ends - starts)
    return ranks


def auroc(scores, labels) -> float:
    """Area under the ROC curve = P(score of a random positive > a random negative), ties count 1/2.

    Rank-based (Mann-Whitney U). NaN when only one class is present.
    """
    s = np.asarray(scores, dtype=np.float64).ravel()
    y = np.asarray(labels).ravel()
    if s.shape != y.shape:
        raise ValueError(f"scores has {s.size} values, labels {y.size}")
    yb = y.astype(np.float64)
    if not np.all((yb == 0) | (yb == 1)):
        raise ValueError("auroc needs binary labels (0/1)")
    pos = int(yb.sum())
    neg = yb.size - pos
    if pos == 0 or neg == 0:
        return float("nan")
    r = rankdata(s)
    u = r[yb == 1].sum() - pos * (pos + 1) / 2.0
    return float(u / (pos * neg))
