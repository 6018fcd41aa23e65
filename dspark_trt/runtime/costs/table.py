"""Step-time cost model: profiled verify/draft costs, monotone fit, online drift correction.

A :class:`CostTable` answers two questions for the budget solver: how long a verify step over t tokens
takes (``verify_ms(t)``, or the whole ``verify_table()`` indexed by t) and how long a draft step for a
batch of b requests takes (``draft_ms(b)``). It is built from measurements of the real engines
(`costs/measure.py` times them), saved next to the artifact as ``cost_profile.json`` and keyed to
it by ``meta`` (file sha256s and backend), so a profile never silently outlives the engines it timed.

Fit: median of the repeats at each measured point (robust to a stray slow run), then the
least-squares non-decreasing fit (pool-adjacent-violators, weighted by the number of repeats), then
linear interpolation to every integer, linear extrapolation beyond the last point (flat below the
first, where fixed overhead dominates). Isotonic rather than a running max: a running max turns one
slow median (a GC pause, a clock dip) into a permanent step up for every larger size, biasing the
solver toward smaller budgets across the whole range; isotonic regression pools the violating
neighbours into their weighted mean, so a bump only touches its own block and noise is as likely to be
corrected down as up. (A running min would bias the other way.)

Drift: vLLM profiles once at startup and its users see the curve drift at large batch (clocks, memory
fragmentation, other tenants). ``observe_verify`` / ``observe_draft`` feed measured step times back.
The correction is an exponentially weighted log-ratio observed/profiled: a global term (every
observation; a uniform slowdown seen at any sizes shifts the whole curve) plus a per-size residual
(per power-of-two bucket, interpolated in log-size between observed buckets: size-specific drift).
Each observation moves a prediction by at most a factor ``exp(max_step)`` (one 10x outlier cannot
wreck the table) and the factor stays within ``bounds``; only when ``catch_up`` observations in a row
each disagree with the table by more than ``refine_margin`` on the same side does the global term jump
to their median (a profile that is simply wrong, e.g. measured on a busy machine, is replaced after a
few calls instead of ~40). The factor curve is multiplied onto the
profiled table and followed by a running max, which keeps the corrected table non-decreasing whatever
the factors are (and raises no entry by more than the largest factor).
"""

from __future__ import annotations

import bisect
import json
import math
import os
from pathlib import Path

import numpy as np

from dspark_trt.errors import DsparkError
from dspark_trt.runtime.costs.draft_past import DraftPast
from dspark_trt.runtime.solver import table_lookup
from dspark_trt.runtime.tuning import DriftTuning as _D

__all__ = [
    "CostTable",
    "PROFILE_FILENAME",
    "isotonic_increasing",
    "table_lookup",
    "measurement_points",
]

PROFILE_FILENAME = "cost_profile.json"
FORMAT = "dspark-trt/cost-profile"
FORMAT_VERSION = 1


# ----------------------------------------------------------------------------------------------- fit

def measurement_points(max_n: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, 24, ... (two per octave) up to and including ``max_n``."""
    max_n = int(max_n)
    if max_n < 1:
        raise ValueError(f"max_n must be >= 1; got {max_n}")
    pts = {1, 2, 3}
    p = 4
    while p <= max_n:
        pts.update((p, p + p // 2))
        p *= 2
    return sorted(x for x in pts | {max_n} if x <= max_n)


def isotonic_increasing(y, weights=None) -> np.ndarray:
    """Weighted least-squares non-decreasing fit (pool adjacent violators)."""
    y = np.asarray(y, dtype=np.float64)
    w = np.ones_like(y) if weights is None else np.asarray(weights, dtype=np.float64)
    means: list[float] = []
    wts: list[float] = []
    sizes: list[int] = []
    for yi, wi in zip(y.tolist(), w.tolist()):
        means.append(yi)
        wts.append(wi)
        sizes.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            m2, w2, s2 = means.pop(), wts.pop(), sizes.pop()
            wsum = wts[-1] + w2
            means[-1] = (means[-1] * wts[-1] + m2 * w2) / wsum
            wts[-1] = wsum
            sizes[-1] += s2
    return np.repeat(np.asarray(means), sizes)


def _fit(points, n_max: int | None, what: str):
    """Median per point -> isotonic -> table indexed 0..n_max (index 0 = 0 ms: no step at all)."""
    if not points:
        raise ValueError(f"no {what} measurements")
    xs, meds, reps = [], [], []
    for key, values in points.items():
        x = int(key)
        vals = np.atleast_1d(np.asarray(values, dtype=np.float64))
        if x < 1 or x != float(key):
            raise ValueError(f"{what} measurement points must be integers >= 1; got {key!r}")
        if vals.size == 0 or not np.isfinite(vals).all() or vals.min() <= 0:
            raise ValueError(f"{what} measurements at {x} must be finite positive milliseconds; got {values!r}")
        xs.append(x)
        meds.append(float(np.median(vals)))
        reps.append(vals.size)
    order = np.argsort(xs)
    xs = np.asarray(xs)[order]
    fitted = isotonic_increasing(np.asarray(meds)[order], np.asarray(reps)[order])
    n_max = max(int(xs[-1]) if n_max is None else int(n_max), 2)
    grid = np.arange(1, n_max + 1, dtype=np.float64)
    table = np.zeros(n_max + 1)
    # Below the first point: flat (step times are dominated by fixed overhead at small sizes, and a
    # downward extrapolation could reach 0 ms); beyond the last point: linear from the last two.
    table[1:] = np.interp(grid, xs, fitted)
    if xs.size >= 2:
        above = grid > xs[-1]
        table[1:][above] = fitted[-1] + (grid[above] - xs[-1]) * (fitted[-1] - fitted[-2]) / (xs[-1] - xs[-2])
    medians = {int(x): float(m) for x, m in zip(xs, np.asarray(meds)[order])}
    return table, medians


# --------------------------------------------------------------------------------------------- drift

class _Drift:
    """Log correction = global EW log(observed / profiled) + per-size residual, both step-bounded.

    The global term is updated by every observation, so a uniform slowdown seen at any sizes shifts
    the whole curve quickly; the residual (one per power-of-two bucket of the size, interpolated in
    log-size between observed buckets and held flat outside them) captures size-specific drift such as
    slowdowns at large batch. Each term moves by at most ``max_step / 2`` per observation, so one
    observation moves any prediction by at most a factor ``exp(max_step)``; the total stays in ``bounds``.
    """

    NBUCKETS = 48

    def __init__(self, alpha: float, max_step: float, bounds: tuple[float, float],
                 residual_rate: float = _D.residual_rate, catch_up: int = _D.catch_up,
                 catch_up_margin: float = _D.refine_margin):
        # The residual learns slower than the global term (residual_rate < 1): while the global term is
        # still catching up with a uniform change, every residual sees part of that change, and a size
        # observed only then would keep the excess (an overshoot) until it is observed again. Slower
        # residuals keep that excess small; size-specific drift (fragmentation, large batch) is slow anyway.
        self.residual_rate = float(residual_rate)
        if not 0 < alpha <= 1:
            raise ValueError(f"drift alpha must be in (0, 1]; got {alpha}")
        if not max_step > 0:
            raise ValueError(f"drift max_step must be > 0; got {max_step}")
        lo, hi = bounds
        if not 0 < lo <= 1 <= hi:
            raise ValueError(f"drift bounds must satisfy 0 < lo <= 1 <= hi; got {bounds}")
        self.alpha, self.half_step = float(alpha), float(max_step) / 2
        self.log_lo, self.log_hi = math.log(lo), math.log(hi)
        self.catch_up, self.catch_up_band = int(catch_up), math.log1p(catch_up_margin)
        self.jumps = 0  # times the global term jumped (_caught_up): what plans made before it assumed is gone
        self.reset()

    def reset(self) -> None:
        self._grid: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.g = 0.0  # global log factor
        self.h = np.zeros(self.NBUCKETS)  # per-bucket residual log factor
        self.n = np.zeros(self.NBUCKETS, dtype=np.int64)
        self._streak: list[float] = []  # global log factors the latest observations asked for, all far on one side

    @property
    def active(self) -> bool:
        return bool(self.n.any())

    def _residual(self, log2x):
        seen = np.flatnonzero(self.n)
        if seen.size == 0:
            return np.zeros_like(np.asarray(log2x, dtype=np.float64))
        return np.interp(log2x, seen.astype(np.float64), self.h[seen])

    def _residual_at(self, b: int) -> float:
        """_residual at bucket b in plain Python, with np.interp's arithmetic (the same float): asked for
        every observed call, where numpy's per-call cost was most of the observation's."""
        if self.n[b]:
            return float(self.h[b])
        seen = np.flatnonzero(self.n).tolist()
        if not seen:
            return 0.0
        j = bisect.bisect_left(seen, b)
        if j == 0 or j == len(seen):  # held flat outside the observed buckets
            return float(self.h[seen[min(j, len(seen) - 1)]])
        lo, hi = seen[j - 1], seen[j]
        y0 = float(self.h[lo])
        slope = (float(self.h[hi]) - y0) / float(hi - lo)
        return slope * float(b - lo) + y0

    def log_factor(self, log2x) -> np.ndarray:
        return np.minimum(np.maximum(self.g + self._residual(log2x), self.log_lo), self.log_hi)

    def _step(self, current: float, target: float, alpha: float) -> float:
        return current + min(max(alpha * (target - current), -self.half_step), self.half_step)

    def observe(self, x: int, log_ratio: float) -> None:
        b = min(max(int(round(math.log2(x))), 0), self.NBUCKETS - 1)
        if self.n[b] == 0:  # start from what the neighbours say, so a newly seen size does not jump
            self.h[b] = self._residual_at(b)
        if not self._caught_up(log_ratio - self._residual_at(b)):
            self.g = min(max(self._step(self.g, log_ratio, self.alpha), self.log_lo), self.log_hi)
        h = self._step(self.h[b], log_ratio - self.g, self.alpha * self.residual_rate)
        self.h[b] = min(max(h, self.log_lo - self.g), self.log_hi - self.g)
        self.n[b] += 1

    def _caught_up(self, wanted: float) -> bool:
        """Jump the global term to the median of what the last `catch_up` observations asked for when each
        of them disagreed with it, at its arrival, by more than the band and on the same side: a profile
        that is simply wrong (measured on a busy machine, or 3x off) is replaced after a few calls instead
        of being walked towards at max_step per call. One outlier cannot trigger it, and noise scattered
        around the truth breaks the streak."""
        if self.catch_up <= 0:
            return False
        gap = wanted - self.g
        streak = self._streak
        if abs(gap) <= self.catch_up_band:
            streak.clear()
            return False
        if streak and (streak[-1] > self.g) != (gap > 0):
            streak.clear()
        streak.append(wanted)
        if len(streak) < self.catch_up:
            return False
        self.g = min(max(float(np.median(streak)), self.log_lo), self.log_hi)
        streak.clear()
        self.jumps += 1
        return True

    def report(self) -> dict:
        seen = np.flatnonzero(self.n)
        return {"global": float(math.exp(self.g)), "observations": int(self.n.sum()),
                "by_size": {1 << int(b): float(math.exp(self.log_factor(float(b)))) for b in seen}}

    def apply(self, base: np.ndarray) -> np.ndarray:
        """base x factor curve, then a running max. Runs once per step when fed back every step, so the
        factor is evaluated only at the power-of-two knots and interpolated linearly in log-size
        between them from cached per-size segment indices and weights (no per-entry log/exp)."""
        if not self.active:
            return base
        n = base.size
        grid = self._grid.get(n)
        if grid is None:
            lx = np.log2(np.arange(1, n, dtype=np.float64))
            seg = np.minimum(np.floor(lx).astype(np.int64), self.NBUCKETS - 2)
            grid = self._grid[n] = (seg, lx - seg)
        seg, w = grid
        knots = np.exp(self.log_factor(np.arange(self.NBUCKETS, dtype=np.float64)))
        slope = np.diff(knots)
        out = base.copy()
        out[1:] *= knots[seg] + w * slope[seg]
        return np.maximum.accumulate(out, out=out)


# --------------------------------------------------------------------------------------------- table

class CostTable:
    """Verify cost by verified-token count and draft cost by batch size, with online drift correction.

    ``verify_ms`` / ``draft_ms`` arrays are the profiled tables indexed by size (index 0 = 0 ms, no
    step); they must be non-decreasing. Build one with :meth:`from_measurements` or :meth:`load`.
    Drift parameters: ``alpha`` (EW weight of one observation), ``max_step`` (largest log-change of a
    bucket per observation), ``bounds`` (range of the correction factor); defaults and meaning in
    tuning.DriftTuning, applied whole by :meth:`tune`.
    """

    def __init__(self, verify_ms, draft_ms, meta: dict | None = None, *, points: dict | None = None,
                 alpha: float = _D.alpha, max_step: float = _D.max_step,
                 bounds: tuple[float, float] = (_D.bound_low, _D.bound_high)):
        self._base = {}
        for name, table in (("verify", verify_ms), ("draft", draft_ms)):
            t = np.array(table, dtype=np.float64)
            if t.ndim != 1 or t.size < 2:
                raise ValueError(f"{name} table must be 1-D with at least entries 0 and 1; got shape {t.shape}")
            if not np.isfinite(t).all() or t.min() < 0 or (np.diff(t) < 0).any():
                raise ValueError(f"{name} table must be finite, >= 0 and non-decreasing")
            t.setflags(write=False)
            self._base[name] = t
        self.meta = dict(meta or {})
        self.points = points or {}
        # Cost of a target call by its shape (call_shape.py), when the profile measured shapes.
        self.call_shape = None
        if self.points.get("verify_shapes"):
            from dspark_trt.runtime.costs.call_shape import CallShapeCost

            self.call_shape = CallShapeCost.from_points(self.points["verify_shapes"])
        self.draft_past = DraftPast(self.points.get("draft_past"))  # how draft calls grow with the past
        self._drift = {name: _Drift(alpha, max_step, bounds) for name in ("verify", "draft")}
        self._cache: dict[str, np.ndarray] = {}

    def tune(self, drift) -> "CostTable":
        """Apply a DriftTuning (runtime/tuning.py) to the drift correction; observations so far are reset."""
        bounds = (drift.bound_low, drift.bound_high)
        self._drift = {name: _Drift(drift.alpha, drift.max_step, bounds, drift.residual_rate, drift.catch_up,
                                    drift.refine_margin) for name in ("verify", "draft")}
        self._cache.clear()
        if self.call_shape is not None:
            self.call_shape.alpha = drift.shape_alpha
            self.call_shape.refit_every = drift.shape_refit_every
            self.call_shape.margin = math.log1p(drift.refine_margin)
            self.call_shape.bounds = (math.log(drift.bound_low), math.log(drift.bound_high))
        return self

    # -- construction -------------------------------------------------------------------------------
    @classmethod
    def from_measurements(cls, verify_points: dict[int, list[float]], draft_points: dict[int, list[float]],
                          meta: dict | None = None, *, max_tokens: int | None = None, max_batch: int | None = None,
                          shape_points=None, draft_past: dict | None = None, **drift_options) -> "CostTable":
        """Fit tables from raw repeats ``{size: [ms, ...]}`` (see module docstring for the fit).

        ``max_tokens`` / ``max_batch`` set the table lengths (default: the largest measured size);
        sizes beyond the last measured point are extrapolated linearly. ``shape_points``: target calls
        of known shape, ``[[tokens, rows, longest query, past, ms], ...]``, for the call-shape model.
        ``draft_past``: draft calls at two pasts (costs/draft_past.py, ``DraftPast.points``).
        """
        verify, vmed = _fit(verify_points, max_tokens, "verify")
        draft, dmed = _fit(draft_points, max_batch, "draft")
        points = {"verify": {str(k): [float(x) for x in np.atleast_1d(v)] for k, v in verify_points.items()},
                  "draft": {str(k): [float(x) for x in np.atleast_1d(v)] for k, v in draft_points.items()},
                  "verify_median": {str(k): v for k, v in vmed.items()},
                  "draft_median": {str(k): v for k, v in dmed.items()}}
        if shape_points:
            points["verify_shapes"] = [[float(x) for x in row] for row in shape_points]
        if draft_past:
            points["draft_past"] = draft_past
        return cls(verify, draft, meta, points=points, **drift_options)

    # -- queries ------------------------------------------------------------------------------------
    @property
    def max_tokens(self) -> int:
        return self._base["verify"].size - 1

    @property
    def max_batch(self) -> int:
        return self._base["draft"].size - 1

    def _table(self, name: str, corrected: bool) -> np.ndarray:
        if not corrected:
            return self._base[name]
        t = self._cache.get(name)
        if t is None:
            t = self._drift[name].apply(self._base[name])
            t.setflags(write=False)
            self._cache[name] = t
        return t

    @property
    def moves(self) -> int:
        """How many times the model moved at once (a drift's jump, a call-shape level's leap or refit): a plan
        made before the latest is made from costs that are gone. Counts up only."""
        n = sum(d.jumps for d in self._drift.values())
        return n + (self.call_shape.moves if self.call_shape is not None else 0)

    def verify_table(self, corrected: bool = True) -> np.ndarray:
        """Read-only array indexed by verified-token count t = 0..max_tokens (index 0 = 0 ms)."""
        return self._table("verify", corrected)

    def draft_table(self, corrected: bool = True) -> np.ndarray:
        """Read-only array indexed by draft batch size b = 0..max_batch (index 0 = 0 ms)."""
        return self._table("draft", corrected)

    def verify_ms(self, tokens, corrected: bool = True):
        """Predicted ms of a verify step over ``tokens`` tokens (scalar or array; linear beyond the table)."""
        return table_lookup(self._table("verify", corrected), tokens)

    def draft_ms(self, batch, corrected: bool = True, past: int | None = None):
        """Predicted ms of a draft step for ``batch`` requests (scalar or array; linear beyond the table);
        with ``past`` (a scalar batch), at that many cached tokens per row (costs/draft_past.py)."""
        ms = table_lookup(self._table("draft", corrected), batch)
        return ms if past is None else ms * self.draft_past.factor(batch, past)

    # -- drift --------------------------------------------------------------------------------------
    def _observe(self, name: str, size, ms) -> bool:
        size, ms = int(size), float(ms)
        if size < 1 or not (0.0 < ms < math.inf):  # also rejects NaN
            return False
        predicted = table_lookup(self._base[name], size)
        if not predicted > 0.0:
            return False
        self._drift[name].observe(size, math.log(ms / predicted))
        self._cache.pop(name, None)
        return True

    def observe_verify(self, tokens: int, ms: float) -> bool:
        """Feed back a measured verify step; returns False (and ignores it) if unusable (ms <= 0, NaN)."""
        return self._observe("verify", tokens, ms)

    def observe_draft(self, batch: int, ms: float, past: int | None = None) -> bool:
        """Feed back a measured draft step (at ``past`` cached tokens per row: the drift learns it as at the
        profile's past); returns False (and ignores it) if unusable."""
        return self._observe("draft", batch, ms / self.draft_past.factor(batch, past))

    def drift(self) -> dict[str, dict]:
        """Current correction factors (predicted = profiled x factor), for "verify" and "draft":
        ``{"global": f, "observations": n, "by_size": {power-of-two size: total factor at that size}}``."""
        return {name: d.report() for name, d in self._drift.items()}

    def reset_drift(self) -> None:
        for d in self._drift.values():
            d.reset()
        self._cache.clear()

    # -- persistence --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": FORMAT_VERSION, "meta": self.meta,
                "verify_ms": self._base["verify"].tolist(), "draft_ms": self._base["draft"].tolist(),
                "points": self.points}

    def save(self, path) -> Path:
        """Write the profiled (uncorrected) tables, raw points and meta as JSON (atomically)."""
        path = Path(path)
        if path.is_dir():
            path = path / PROFILE_FILENAME
        # Atomically: a reader (another process starting on the artifact) sees the old profile or the new
        # one, never part of one; one temporary per process, so two closing runtimes do not share it.
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "w") as f:
                f.write(json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def load(cls, path, expect: dict | None = None, **drift_options) -> "CostTable":
        """Load a saved profile; with ``expect``, every key of it must equal the profile's meta.

        A missing, unreadable or mismatched profile raises DsparkError naming the command that
        re-creates it.
        """
        path = Path(path)
        if path.is_dir():
            path = path / PROFILE_FILENAME
        backend = (expect or {}).get("backend") or "BACKEND"
        fix = f"re-run `dspark-trt profile {path.parent} --backend {backend}`"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise DsparkError(f"no cost profile at {path}; {fix}") from None
        except (OSError, ValueError) as e:
            raise DsparkError(f"cost profile {path} is unreadable ({e}); {fix}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != FORMAT_VERSION:
            raise DsparkError(f"{path} is not a version-{FORMAT_VERSION} dspark-trt cost profile; {fix}")
        meta = data.get("meta") or {}
        if expect is not None:
            want = json.loads(json.dumps(expect))  # tuples -> lists etc., as stored
            stale = sorted(k for k in want if meta.get(k) != want[k])
            if stale:
                raise DsparkError(f"cost profile {path} was measured for a different artifact or backend "
                                  f"(differs in: {', '.join(stale)}); {fix}")
        try:
            return cls(data["verify_ms"], data["draft_ms"], meta, points=data.get("points"), **drift_options)
        except (KeyError, TypeError, ValueError) as e:
            raise DsparkError(f"cost profile {path} is malformed ({e}); {fix}") from None
