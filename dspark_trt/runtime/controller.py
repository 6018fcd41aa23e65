"""The thin stateful wrapper around the budget solver that the runtime calls once per step.

``AdaptiveController().plan(live_survival, request_ids, sampling_mask, cost, draft_batch)`` returns the
verify length of every adaptive request: the budget solver (:mod:`dspark_trt.runtime.solver`) on the
step's cost curve. (Fixed-K and off requests need no controller: the verify planner gives them what
they drafted, up to K.) Call order: ``plan`` once per step; ``prior_row`` / ``conditional_acceptance``
read the running survival profile between steps; ``reset`` forgets it.

Adaptive and lossless
---------------------
Greedy decoding is lossless under any verification policy, so when no request samples the controller
uses the exact optimum of the live survivals (:func:`solve_budget`). When some request samples, the
budget B must not depend on that request's current draft tokens (see the solver's module docstring:
S_{r,k+1} is a function of x_k, so a B sized from live survivals would make "verify x_k" depend on
x_k). The controller therefore sizes B with :func:`best_budget` on a *sizing matrix* whose rows are:

- for a sampling request seen last step: its survival row from the previous step (stale, as vLLM does);
- for a sampling request not seen before: a prior row, the exponentially weighted mean survival profile
  of earlier steps (a fixed geometric profile before any step);
- for a greedy request: its live row. Its drafts are functions of its own context only (independent of
  the sampling requests' draft randomness), so using them cannot make admission of a sampled x_k depend
  on x_k; this only makes the sizing less stale.

and then admits the top-B slots of the *live* survivals (:func:`solve_budget_for_b`). No input of B
depends on the current sampled drafts, and with B fixed, admission of slot (r, k) depends
only on slots that never depend on x_k; so each sampled request's verify length is a stopping rule
("verify x_k?" is decided from x_1..x_{k-1} and independent quantities) and speculative sampling
stays exactly target-distributed. The price is staleness, not bias: B is sized for last step's
confidence, the allocation within B still follows the live one.

Caps: a request near max_new_tokens or the context end (or one that drafted fewer than K tokens) can
verify at most ``caps[r]`` drafts; caps are applied as an allocation constraint in both the sizing and
the allocation (slots beyond a cap are never admitted, and B is sized only over slots that can be
used). The live values past a cap are placeholders, so the row kept for the next step's sizing
continues the row's last per-position ratio there instead (a cap-0 row is replaced by the prior).
"""

from __future__ import annotations

from typing import Hashable, Protocol, Sequence

import numpy as np

from dspark_trt.runtime.solver import (SMALL_SLOTS, _best, _lengths, _survival, best_budget, rows_valid,
                                       solve_budget_for_b, solve_small, solve_small_for_b)
from dspark_trt.runtime.tuning import RuntimeTuning

__all__ = ["AdaptiveController", "CostModel"]

#: Survival profile used for new requests before any step has been seen: S_k = 0.7^k (first draft
#: token accepted ~70% of the time, the seventh <10%, in line with vLLM's reported per-position rates).
DEFAULT_PRIOR_ACCEPTANCE = RuntimeTuning.prior_acceptance


class CostModel(Protocol):
    """What the controller needs from a cost model (``CostTable`` provides it)."""

    def verify_table(self) -> np.ndarray: ...

    def draft_ms(self, batch: int) -> float: ...


class AdaptiveController:
    """Plans verify lengths each step; keeps the stale survivals and the prior profile.

    prior_survival: 1-D survival profile for new requests before any step (default 0.7^k).
    prior_decay: weight of one row (one request's step) in the running mean profile used as the prior.
        A step of R rows weighs ``1 - (1 - prior_decay)^R``, and at least R / (rows seen so far), so the
        profile is a plain mean until it has seen ~1/prior_decay rows. Weighting by rows, not steps, keeps
        a stretch of near-empty steps (a batch draining; by then mostly the requests that were slowest
        because they were least predictable) from replacing what dozens of full steps measured.
    prior_rows: rows the starting profile counts as in that mean (0: the first step's rows replace it).
    """

    def __init__(self, *, prior_survival=None, prior_decay: float = RuntimeTuning.prior_decay,
                 prior_acceptance: float = DEFAULT_PRIOR_ACCEPTANCE, small_slots: int = SMALL_SLOTS,
                 prior_rows: int = 0):
        if not 0 < prior_decay <= 1:
            raise ValueError(f"prior_decay must be in (0, 1]; got {prior_decay}")
        if prior_rows < 0:
            raise ValueError(f"prior_rows must be >= 0; got {prior_rows}")
        self.prior_decay, self.prior_rows = float(prior_decay), int(prior_rows)
        self.prior_acceptance = float(prior_acceptance)
        self._initial_prior = None if prior_survival is None else self._check_row(prior_survival)
        self.small_slots = small_slots  # up to this many slots the greedy plan runs in plain Python
        self.reset()

    # -- state ----------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget stale rows and the running prior."""
        self._rows = np.zeros((0, 0))  # last step's survivals, one row per request ...
        self._row_of: dict[Hashable, int] = {}  # ... found by request id
        self._mean: np.ndarray | None = None
        self._seen = self.prior_rows  # rows folded into the running mean profile, the starting one's included
        self._cond: list[float] | None = None  # its conditional acceptances (conditional_acceptance)

    @staticmethod
    def _check_row(row) -> np.ndarray:
        r = np.asarray(row, dtype=np.float64)
        if r.ndim != 1 or not np.isfinite(r).all() or r.min(initial=0) < 0 or r.max(initial=0) > 1:
            raise ValueError("prior_survival must be a 1-D array of probabilities")
        return np.minimum.accumulate(r)

    def prior_row(self, K: int) -> np.ndarray:
        """The sizing row for a request with no previous row: running mean profile, else the starting one."""
        if self._mean is None:
            return self.starting_row(K)
        return _fit_width(self._mean[None, :], K, self.prior_acceptance)[0]

    def starting_row(self, K: int) -> np.ndarray:
        """The profile before any step: prior_survival, else prior_acceptance^k."""
        if self._initial_prior is None:
            return self.prior_acceptance ** np.arange(1, K + 1, dtype=np.float64)
        return _fit_width(self._initial_prior[None, :], K, self.prior_acceptance)[0]

    def conditional_acceptance(self, K: int) -> list[float]:
        """``[0, S_2/S_1, ..., S_K/S_(K-1)]`` of the prior profile (prior_row), as a list: the chance that
        draft k+1 is accepted given draft k was. Cached until the profile moves."""
        c = self._cond
        if c is None or len(c) != K:
            prior = self.prior_row(K).tolist()
            c = self._cond = [0.0] + [b / a if a > 0 else 0.0 for a, b in zip(prior, prior[1:])]
        return c

    def previous_row(self, request_id: Hashable) -> np.ndarray | None:
        """The survival row stored for ``request_id`` at the last step it was planned in (or None)."""
        i = self._row_of.get(request_id)
        return None if i is None else self._rows[i].copy()

    # -- planning -------------------------------------------------------------------------------------
    def plan(self, live_survival, request_ids: Sequence[Hashable], sampling_mask, cost: CostModel,
             draft_batch: int, caps=None, n_emitting=None, max_budget: int | None = None) -> np.ndarray:
        """Verify lengths (R,) for this step. Call once per step.

        live_survival: (R, K) this step's survivals. request_ids: R hashable ids (matched across steps,
        order may change). sampling_mask: (R,) bool, True where the request samples (temperature > 0).
        cost: a CostTable (``verify_table()``, ``draft_ms(b)``). draft_batch: requests in this step's
        draft run. caps: optional (R,) most drafts each request may verify. n_emitting: N of the objective,
        the tokens the step emits whatever B is (default R; the runtime counts every decode row, drafted
        or not, as vLLM does). max_budget: the most drafts the step may verify over all requests.
        """
        if max_budget is not None:
            max_budget = max(0, int(max_budget))
        planned = self._plan_small(live_survival, request_ids, sampling_mask, cost, draft_batch, caps, n_emitting,
                                   max_budget)
        if planned is not None:
            return planned
        S = np.asarray(live_survival, dtype=np.float64)
        if S.ndim != 2:
            raise ValueError(f"live_survival must be (R, K); got shape {S.shape}")
        S = _survival(S)  # validated once here; the solver's internals below do not repeat it
        R, K = S.shape
        ids = list(request_ids)
        if len(ids) != R:
            raise ValueError(f"got {len(ids)} request ids for {R} survival rows")
        row_of = {rid: i for i, rid in enumerate(ids)}
        if len(row_of) != R:
            raise ValueError("request ids must be unique within a step")
        sampling = np.asarray(sampling_mask, dtype=bool)
        if sampling.shape != (R,):
            raise ValueError(f"sampling_mask must have shape ({R},); got {sampling.shape}")
        capv = None if caps is None else np.minimum(_check_caps(caps, R), K)
        table = cost.verify_table()
        draft_ms = float(cost.draft_ms(int(draft_batch))) if draft_batch else 0.0
        if R == 0:
            lengths = np.zeros(0, np.int64)
        elif not sampling.any():
            B, _, order = _best(S, capv, table, draft_ms, n_emitting, max_budget)
            lengths = _lengths(order, B, R)
        else:
            sizing = S.copy()
            rows = np.flatnonzero(sampling)
            old = np.fromiter((self._row_of.get(ids[i], -1) for i in rows), np.int64, rows.size)
            known = old >= 0
            if known.any():
                sizing[rows[known]] = _fit_width(self._rows[old[known]], K)
            if not known.all():
                sizing[rows[~known]] = self.prior_row(K)
            budget, _ = best_budget(sizing, table, draft_ms, n_emitting, caps=capv, max_budget=max_budget)
            lengths = solve_budget_for_b(S, budget, caps=capv)
        self._remember(S, row_of, capv)
        return lengths

    # -- internals ------------------------------------------------------------------------------------
    def _remember(self, S: np.ndarray, row_of: dict, caps: np.ndarray | None) -> None:
        # Only this step's requests are kept: bounded memory; a request that skips a step falls back
        # to the prior, which is just as independent of its future drafts.
        if caps is None or not S.shape[1] or caps.min() >= S.shape[1]:
            rows = S.copy()
        else:
            rows = _beyond_caps(S, caps, self.prior_row(S.shape[1]))
        self._rows, self._row_of = rows, row_of
        self._cond = None
        if S.shape[0] and S.shape[1]:
            # S is validated (in [0, 1], non-increasing), its continuation past a cap and the prior are
            # too, so their mean and any blend of such means are: no clip or running minimum needed.
            R = rows.shape[0]
            mean = rows.sum(axis=0) / R
            self._seen += R
            old = self.prior_row(mean.size)  # what a step's mean rows are blended into
            w = max(R / self._seen, 1.0 - (1.0 - self.prior_decay) ** R)
            self._mean = (1 - w) * old + w * mean

    def _plan_small(self, live, request_ids, sampling_mask, cost: CostModel, draft_batch: int, caps,
                    n_emitting=None, max_budget: int | None = None) -> np.ndarray | None:
        """The plan in pure Python for up to solver.SMALL_SLOTS slots (same answer as the numpy path, see
        solver.solve_small; at 1 request sampling, the numpy path was ~0.2 ms a step, 4% of it). None when
        the numpy path must plan: too many slots, or input it would repair or reject (it then explains)."""
        rows = live.tolist() if isinstance(live, np.ndarray) else live
        if not isinstance(rows, list) or not rows or not isinstance(rows[0], list):
            return None
        R, K = len(rows), len(rows[0])
        if R * K > self.small_slots or K == 0 or any(len(row) != K for row in rows):
            return None
        ids = list(request_ids)
        row_of = {rid: i for i, rid in enumerate(ids)}
        if len(ids) != R or len(row_of) != R or len(sampling_mask) != R or not rows_valid(rows):
            return None
        cap_list = None
        if caps is not None:
            cap_list = caps.tolist() if isinstance(caps, np.ndarray) else list(caps)
            if len(cap_list) != R or not all(isinstance(c, int) and c >= 0 for c in cap_list):
                return None  # the numpy path validates whole numbers of other types (and explains)
            cap_list = [min(c, K) for c in cap_list]
        sizing = self._sizing_rows(rows, ids, sampling_mask, K) if any(sampling_mask) else rows
        if sizing is None:
            return None
        draft_ms = float(cost.draft_ms(int(draft_batch))) if draft_batch else 0.0
        solved = solve_small(sizing, cap_list, cost.verify_table(), draft_ms, n_emitting, max_budget)
        if solved is None:
            return None
        lengths = solved[1] if sizing is rows else solve_small_for_b(rows, cap_list, solved[0])
        self._remember_rows(rows, row_of, cap_list)
        return np.array(lengths, dtype=np.int64)

    def _sizing_rows(self, rows: list[list[float]], ids: list, sampling_mask, K: int) -> list[list[float]] | None:
        """The rows the budget is sized from, as the numpy path's: a sampling request's row of its last step
        (else the prior profile), so the budget never depends on its live drafts; the others' live rows.
        None where a stored row would have to be widened (the numpy path does that)."""
        sizing, prior = [], None
        for row, rid, samples in zip(rows, ids, sampling_mask):
            if not samples:
                sizing.append(row)
                continue
            i = self._row_of.get(rid)
            if i is None:
                prior = self.prior_row(K).tolist() if prior is None else prior
                sizing.append(prior)
            elif self._rows.shape[1] >= K:
                sizing.append(self._rows[i, :K].tolist())
            else:
                return None
        return sizing

    def _remember_rows(self, rows: list[list[float]], row_of: dict, caps: list[int] | None) -> None:
        """:meth:`_remember` for valid rows as lists (the small greedy path): the same rows kept, the same
        mean profile update, in plain Python."""
        R, K = len(rows), len(rows[0])
        if caps is not None and min(caps) < K:
            prior = None
            kept = []
            for row, cap in zip(rows, caps):
                if cap >= K:
                    kept.append(row)
                elif cap == 0:
                    if prior is None:
                        prior = self.prior_row(K).tolist()
                    kept.append(prior)
                else:  # continue the row's last per-position ratio past its cap (as _beyond_caps)
                    last, prev = row[cap - 1], (row[cap - 2] if cap >= 2 else 1.0)
                    ratio = 0.0 if prev <= 0.0 else min(last / max(prev, 1e-300), 1.0)
                    kept.append(row[:cap] + [last * ratio ** (k - cap + 1) for k in range(cap, K)])
            rows = kept
        self._rows, self._row_of = np.array(rows, dtype=np.float64), row_of
        mean = [sum(col) / R for col in zip(*rows)]
        self._seen += R
        w = max(R / self._seen, 1.0 - (1.0 - self.prior_decay) ** R)
        if w < 1.0:
            mean = [(1 - w) * a + w * b for a, b in zip(self.prior_row(K).tolist(), mean)]
        self._mean = np.array(mean)
        self._cond = [0.0] + [b / a if a > 0 else 0.0 for a, b in zip(mean, mean[1:])]


def _fit_width(rows: np.ndarray, K: int, prior_acceptance: float = DEFAULT_PRIOR_ACCEPTANCE) -> np.ndarray:
    """Survival rows (n, K') truncated or extended to K positions (extension repeats each row's last
    per-position ratio, so rows stay non-increasing)."""
    n, width = rows.shape
    if width >= K:
        return rows[:, :K]
    if width == 0:
        return np.tile(prior_acceptance ** np.arange(1, K + 1, dtype=np.float64), (n, 1))
    last = rows[:, -1]
    if width >= 2:
        prev = rows[:, -2]
        ratio = np.divide(last, prev, out=np.zeros_like(last), where=prev > 0)
    else:
        ratio = last
    ratio = np.clip(ratio, 0.0, 1.0)
    return np.hstack([rows, last[:, None] * ratio[:, None] ** np.arange(1, K - width + 1)])


def _beyond_caps(S: np.ndarray, caps: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """A copy of S whose positions at or beyond each request's cap hold an estimate, not a placeholder.

    Positions past a cap were not drafted (or cannot be verified); whatever the caller put there says
    nothing about how predictable the request is, so the row kept for next step's sizing (and the mean
    profile) continues the row's last per-position ratio instead; a row with cap 0 becomes the prior.
    """
    R, K = S.shape
    rows = np.arange(R)
    last = S[rows, np.maximum(caps - 1, 0)]
    prev = S[rows, np.maximum(caps - 2, 0)]
    prev[caps < 2] = 1.0
    ratio = np.minimum(last / np.maximum(prev, 1e-300), 1.0)
    ratio[prev <= 0.0] = 0.0
    k = np.arange(K)
    power = k[None, :] - caps[:, None] + 1  # > 0 exactly at the positions past the cap
    out = np.where(power > 0, last[:, None] * ratio[:, None] ** np.maximum(power, 0), S)
    out[caps == 0] = prior
    return out


def _check_caps(caps, R: int) -> np.ndarray:
    if isinstance(caps, np.ndarray) and caps.dtype == np.int64 and caps.shape == (R,):  # the runtime's
        if caps.size and caps.min() < 0:
            raise ValueError("caps must be >= 0")
        return caps
    c = np.asarray(caps)
    if c.shape != (R,):
        raise ValueError(f"caps must have shape ({R},); got {c.shape}")
    if c.size and (not np.issubdtype(c.dtype, np.integer)) and (c != np.round(c)).any():
        raise ValueError("caps must be whole numbers")
    c = c.astype(np.int64)
    if c.size and c.min() < 0:
        raise ValueError("caps must be >= 0")
    return c
