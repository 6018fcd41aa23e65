"""Online recalibration of the draft's survivals against what verification actually accepts.

The head is calibrated offline on held-out text, but a deployment's traffic differs: text the target
generates itself is more predictable than the calibration corpus (on the tiny pair, greedy acceptance
of generated continuations is well above the held-out figure), and the fallback confidence is not
calibrated at all. Survivals that are off by a constant factor make the budget solver verify too
little (or too much) at every load, which no cost model can repair.

Every verify step reveals the truth for the positions it checked: position k of a request was
*reached* if drafts 1..k-1 were accepted, and then accepted or not. So per draft position k we keep a
logit shift d_k and correct the conditional confidence c_k = S_k / S_{k-1} to

    c'_k = sigmoid(logit(c_k) + d_k),    S'_k = prod_{i<=k} c'_i,

fitting d_k by online logistic regression on the bias alone (recursive Newton with forgetting): after
each step, d_k += sum (accepted - c'_k) / (H_k + damping) over the reached positions, clipped to
+-max_step, where H_k is an exponentially forgetting sum of the curvature c'_k (1 - c'_k) of the
positions seen so far. It settles where the corrected confidence matches the observed acceptance rate
of the verified population. Early on (small H) it moves fast, so a badly underconfident head escapes
quickly; once H has built up (a window of ~1/forget steps) each step moves it little, which keeps the
noise of a few 0/1 outcomes out of the shift. Selecting which positions
get verified by their confidence does not bias it: a calibrated c satisfies E[accept | c] = c for any
selection made on c alone; the shift only moves calibration toward that. Positions never verified keep
the shift of the deepest verified one (a request's acceptances are correlated; an unverified deep
position is better guessed by its neighbour's bias than by none).

Drafters without a confidence head (``confidence: fallback``: c_k is the draft's max probability q_max)
also fit a shared slope b, as vLLM does for them (PR #52228: logit(q_max) with per-position intercepts
and one slope, refit by IRLS):

    c'_k = sigmoid(b * logit(c_k) + d_k),

by the same recursive Newton on (d_1..d_K, b) jointly (a forgetting sum of the full curvature matrix,
so the intercepts and the slope do not fight over the same signal). An offline-calibrated head keeps
b = 1: its ordering is what the calibration fitted, only its level drifts. A max probability is
neither calibrated nor on the right scale (a random draft's q_max is a fraction of a percent where
the target accepts most drafts), which a shift bounded to +-bound cannot repair alone.

Lossless sampling: the correction depends only on earlier steps' outcomes, and per position it is an
increasing function of c_k (b stays > 0), so S' stays non-increasing along a row and a function of positions <= k:
the solver's stopping-rule argument holds unchanged.
"""

from __future__ import annotations

import math

import numpy as np

from dspark_trt.runtime.tuning import CorrectionTuning as _T

__all__ = ["SurvivalCorrection"]

_EPS = 1e-7
_TINY = 1e-30  # below this a survival carries no usable ratio


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, _EPS, 1.0 - _EPS)
    return np.log(p) - np.log1p(-p)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def conditional(survival: np.ndarray) -> np.ndarray:
    """(R, K) survivals -> conditional confidences c_k = S_k / S_{k-1} (S_0 = 1), in [0, 1]."""
    s = np.asarray(survival, dtype=np.float64)
    prev = np.concatenate([np.ones_like(s[:, :1]), s[:, :-1]], axis=1)
    return np.clip(np.divide(s, prev, out=np.zeros_like(s), where=prev > _TINY), 0.0, 1.0)


class SurvivalCorrection:
    """Per-position logit shifts learned from verification outcomes.

    damping: pseudo-curvature added to H (keeps the first steps finite); forget: fraction of H dropped
    per step (memory of ~1/forget steps, so the shift keeps tracking a changing workload); max_step:
    largest change of a shift per step; bound: |d_k| limit (a factor of e^bound on the odds); warmup:
    observations of a position before its shift is applied (until then it is learned only); fit_slope:
    also fit the shared slope b (drafters without a head). Defaults: tuning.CorrectionTuning.
    """

    #: Range of the shared slope: > 0 keeps the correction increasing in c_k (lossless sampling).
    SLOPE_RANGE = (0.02, 4.0)

    def __init__(self, max_draft: int, damping: float = _T.damping, forget: float = _T.forget,
                 max_step: float = _T.max_step, bound: float = _T.bound, warmup: int = _T.warmup,
                 fit_slope: bool = False):
        if max_draft < 1:
            raise ValueError(f"max_draft must be >= 1; got {max_draft}")
        if not damping > 0 or not 0 < forget <= 1 or not max_step > 0 or not bound > 0:
            raise ValueError("damping, max_step and bound must be > 0 and forget in (0, 1]")
        self.max_draft, self.damping, self.forget, self.max_step, self.bound, self.warmup = (
            int(max_draft), float(damping), float(forget), float(max_step), float(bound), int(warmup))
        self.fit_slope = bool(fit_slope)
        self.reset()

    def reset(self) -> None:
        self.shift = np.zeros(self.max_draft)
        self.slope = 1.0
        self.hessian = np.zeros((self.max_draft + 1, self.max_draft + 1))  # (d_1..d_K, b): the slope fit's
        self._active = None  # cached active_shifts()
        self.curvature = np.zeros(self.max_draft)  # H_k
        self.seen = np.zeros(self.max_draft, dtype=np.int64)  # reached positions observed
        self.accepted = np.zeros(self.max_draft, dtype=np.int64)

    def _active_shift(self, k: int) -> np.ndarray:
        """Shifts for positions 1..k: learned ones once warm, else that of the deepest warm position."""
        warm = self.seen >= self.warmup
        out = np.where(warm, self.shift, 0.0)
        if warm.any():
            deepest = int(np.flatnonzero(warm)[-1])
            out[deepest + 1:] = self.shift[deepest]
        if k > self.max_draft:
            out = np.concatenate([out, np.full(k - self.max_draft, out[-1])])
        return out[:k]

    def active_slope(self) -> float:
        """The slope applied to logit(c_k) (1.0 until a position is warm, and always without fit_slope)."""
        return self.slope if (self.seen >= self.warmup).any() else 1.0

    def active_shifts(self) -> list[float] | None:
        """The shift applied at each position 0..max_draft-1 (None while no position is warm), for
        correcting survivals one draft step at a time (`corrected_next`)."""
        if self._active is None and (self.seen >= self.warmup).any():
            self._active = [float(x) for x in self._active_shift(self.max_draft)]
        return self._active

    @staticmethod
    def corrected_next(shifts: list[float] | None, k: int, prev_raw: float, raw: float, prev_corrected: float,
                       slope: float = 1.0) -> float:
        """Corrected S'_{k+1} from the raw S_k (prev_raw), S_{k+1} (raw) and the corrected S'_k: the
        same as `apply` on the whole row, one position at a time in plain floats (a draft loop calls
        this per request per draft step, where numpy's per-call overhead would dominate)."""
        if shifts is None:
            return raw
        if prev_raw <= _TINY or raw <= 0.0:
            return 0.0
        c = min(max(raw / prev_raw, _EPS), 1.0 - _EPS)
        z = slope * (math.log(c) - math.log1p(-c)) + shifts[min(k, len(shifts) - 1)]
        return prev_corrected * 0.5 * (1.0 + math.tanh(0.5 * z))

    def apply(self, survival) -> np.ndarray:
        """(R, K) raw survivals -> corrected survivals (float64, non-increasing along rows)."""
        s = np.asarray(survival, dtype=np.float64)
        if s.size == 0 or not (self.seen >= self.warmup).any():
            return s.copy()
        c = conditional(s)
        c2 = _sigmoid(self.slope * _logit(c) + self._active_shift(s.shape[1])[None, :])
        c2 = np.where(c > 0.0, c2, 0.0)  # a zero confidence (or an underflowed prefix) stays zero
        return np.cumprod(c2, axis=1)

    def observe(self, survival, verified, accepted) -> int:
        """Learn from one verify step: survival (R, K) raw rows the drafts were scored with, verified (R,)
        drafts each request verified, accepted (R,) how many of them were accepted. Returns the number
        of reached positions used."""
        s = np.asarray(survival, dtype=np.float64)
        if s.ndim != 2 or s.shape[0] == 0:
            return 0
        L = np.minimum(np.asarray(verified, dtype=np.int64), s.shape[1])
        a = np.minimum(np.asarray(accepted, dtype=np.int64), L)
        k = np.arange(min(s.shape[1], self.max_draft))[None, :]
        reached = k < np.minimum(a + 1, L)[:, None]  # position k+1 reached iff its prefix was accepted
        if not reached.any():
            return 0
        outcome = (k < a[:, None]) & reached
        c = conditional(s[:, :k.shape[1]])
        if self.fit_slope:
            return self._observe_with_slope(_logit(c), reached, outcome)
        pred = _sigmoid(_logit(c) + self.shift[None, :k.shape[1]])
        n = reached.sum(axis=0)
        grad = np.where(reached, outcome - pred, 0.0).sum(axis=0)
        curv = np.where(reached, pred * (1.0 - pred), 0.0).sum(axis=0)
        m = n.size
        self.curvature[:m] = (1.0 - self.forget) * self.curvature[:m] + curv
        step = np.clip(grad / (self.curvature[:m] + self.damping), -self.max_step, self.max_step)
        self.shift[:n.size] = np.clip(self.shift[:n.size] + step, -self.bound, self.bound)
        self.seen[:n.size] += n
        self._active = None
        self.accepted[:n.size] += outcome.sum(axis=0)
        return int(n.sum())

    def _observe_with_slope(self, x: np.ndarray, reached: np.ndarray, outcome: np.ndarray) -> int:
        """One recursive Newton (IRLS) step on (d_1..d_m, b) from the reached positions' logits x (R, m)."""
        m = x.shape[1]
        pred = _sigmoid(self.slope * x + self.shift[None, :m])
        resid = np.where(reached, outcome - pred, 0.0)
        w = np.where(reached, pred * (1.0 - pred), 0.0)
        K = self.max_draft
        grad = np.zeros(K + 1)
        grad[:m] = resid.sum(axis=0)
        grad[K] = float((resid * x).sum())
        curv = np.zeros((K + 1, K + 1))
        curv[np.arange(m), np.arange(m)] = w.sum(axis=0)
        curv[:m, K] = curv[K, :m] = (w * x).sum(axis=0)
        curv[K, K] = float((w * x * x).sum())
        self.hessian = (1.0 - self.forget) * self.hessian + curv
        step = np.linalg.solve(self.hessian + self.damping * np.eye(K + 1), grad)
        step = np.clip(step, -self.max_step, self.max_step)
        self.shift = np.clip(self.shift + step[:K], -self.bound, self.bound)
        self.slope = float(np.clip(self.slope + step[K], *self.SLOPE_RANGE))
        n = reached.sum(axis=0)
        self.curvature[:m] = (1.0 - self.forget) * self.curvature[:m] + curv[np.arange(m), np.arange(m)]
        self.seen[:m] += n
        self.accepted[:m] += outcome.sum(axis=0)
        self._active = None
        return int(n.sum())

    def report(self) -> dict:
        seen = np.maximum(self.seen, 1)
        return {"shift": [round(float(x), 4) for x in self.shift], "slope": round(self.slope, 4),
                "reached": self.seen.tolist(),
                "acceptance": [round(float(x), 4) for x in self.accepted / seen]}
