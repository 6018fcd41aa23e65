"""Budget solver for adaptive verification: how many draft tokens to verify, and which.

Pure and stateless (numpy only). The stateful parts — stale survivals, the cost table, metrics — live
in :mod:`dspark_trt.runtime.controller` and :mod:`dspark_trt.runtime.costs.table`.

The problem
-----------
R running requests each drafted up to K tokens. ``survival[r, k-1] = S_{r,k} = prod_{i<=k} c_{r,i}`` is
the head's probability that draft token k of request r is accepted (the whole prefix 1..k survives),
so verifying slot (r, k) adds S_{r,k} expected tokens. Every request verifies one token anyway (its
next/bonus token), so a step with budget B verifies ``R + B`` tokens and costs
``draft_cost_ms + verify_cost_ms[R + B]``. The solver maximises expected output tokens per ms::

    B* = argmax_{B in 0..R*K}  (N + sum_{j<B} S_sorted[j]) / (draft_cost_ms + verify_cost_ms[R + B])

For a fixed B the numerator is maximised by the B largest survivals, whatever the cost curve, so
scanning every B with one sort and one cumsum is exact. Ties are broken by earlier draft position
(then lower request index); since S is non-increasing along a row, the admitted slots form a prefix of
every request, which gives its verify length L_r. B = 0 (plain decoding) is always a candidate, and
among equal objectives the smallest B wins.

Why the allocation is lossless under sampling only if B does not depend on the current drafts
--------------------------------------------------------------------------------------------
Speculative sampling stays exactly target-distributed when the decision "verify draft token x_k"
is made without looking at x_k (a stopping rule): it may depend on x_1..x_{k-1} and on independent
randomness, but not on x_k. S_{r,k} depends on x_1..x_{k-1} (the head scores x_k's position from the
hidden state that predicts it) but not on x_k. With B fixed, slot (r, k) is admitted iff fewer than B
slots outrank it; later slots of the same request (r, j > k), which are functions of x_k, never
outrank it (they are no larger, and ties go to the earlier position), so admission of x_k depends
only on slots that never depend on x_k. Choosing B from the *live* survivals breaks this: B* is a
function of S_{r,k+1} = S_{r,k} * c_{r,k+1}, a function of x_k, so whether x_k is verified at all
would depend on x_k. :func:`solve_budget` on live survivals is therefore only for greedy decoding
(lossless under any policy); for sampling, size B with :func:`best_budget` from information that does
not depend on the current drafts (the previous step's survivals) and allocate with
:func:`solve_budget_for_b` on the live ones. The controller does exactly that.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "MONOTONE_ATOL",
    "SMALL_SLOTS",
    "best_budget",
    "cap_depth",
    "best_draft_depth",
    "even_spread",
    "extend_linear",
    "marginal_survival",
    "solve_budget",
    "solve_budget_for_b",
    "table_lookup",
]

#: How much a survival row may increase (or leave [0, 1]) before it is rejected as malformed. Rows
#: within this tolerance are repaired with a running minimum (which keeps S_{r,k} a function of
#: positions <= k only, so the lossless argument above still holds).
MONOTONE_ATOL = 1e-5
_INT64_MAX = np.iinfo(np.int64).max
#: Up to this many slots (R x K) the controller solves in pure Python (:func:`solve_small`): there each
#: numpy call costs more than the arithmetic it does, several times more right after an engine call
#: has evicted the caches.
SMALL_SLOTS = 64


def _survival(survival) -> np.ndarray:
    """Validate a (R, K) survival matrix; return float64, exactly non-increasing along rows, in [0, 1].

    Written for speed (this runs every step): NaN/inf are caught by the comparisons, which are all
    False for NaN, and only then diagnosed.
    """
    S = np.asarray(survival, dtype=np.float64)
    if S.ndim != 2:
        raise ValueError(f"survival must be a 2-D array (R requests, K draft positions); got shape {S.shape}")
    if S.size == 0:
        return S
    hi, lo = S[:, 0].max(), S[:, -1].min()
    worst = 0.0
    if S.shape[1] > 1:
        rise = S[:, 1:] - S[:, :-1]
        worst = rise.max()
        if not worst <= MONOTONE_ATOL:
            if not np.isfinite(S).all():
                raise ValueError("survival contains NaN or infinite values")
            r, k = np.unravel_index(int(np.argmax(rise)), rise.shape)
            raise ValueError(
                f"survival rows must be non-increasing (S_k = prod_(i<=k) c_i); row {r} rises by {worst:.6g} "
                f"from position {k + 1} to {k + 2}")
    if not (lo >= -MONOTONE_ATOL and hi <= 1.0 + MONOTONE_ATOL):
        if not np.isfinite(S).all():
            raise ValueError("survival contains NaN or infinite values")
        raise ValueError(f"survival values must be probabilities in [0, 1]; got range [{S.min():.6g}, {S.max():.6g}]")
    if worst > 0.0:  # rises within tolerance: repair with a running minimum (still causal along the row)
        S = np.minimum.accumulate(S, axis=1)
        hi, lo = S[:, 0].max(), S[:, -1].min()
    if lo < 0.0 or hi > 1.0:
        S = np.clip(S, 0.0, 1.0)
    return S


def _caps(caps, R: int, K: int) -> np.ndarray | None:
    if caps is None:
        return None
    c = np.asarray(caps)
    if c.shape != (R,):
        raise ValueError(f"caps must have shape ({R},), one per request; got {c.shape}")
    if c.size and (not np.issubdtype(c.dtype, np.integer)):
        if not np.isfinite(c).all() or (c != np.round(c)).any():
            raise ValueError("caps must be whole numbers of draft tokens")
    c = c.astype(np.int64)
    if c.size and c.min() < 0:
        raise ValueError("caps must be >= 0")
    return np.minimum(c, K)


def _rank(S: np.ndarray, caps: np.ndarray | None):
    """Admission order of all slots (flat k-major indices, so r = idx % R) and the allowed capacity.

    k-major flattening + a stable ascending sort of -S breaks ties by earlier position, then lower
    request index. For non-negative float64 (no -0.0) the IEEE bit pattern read as int64 orders like
    the value, and numpy's stable int64 sort is about twice as fast as its float sort. Slots beyond a
    request's cap sort last and are never admitted (capacity excludes them).
    """
    R, K = S.shape
    flat = S.T.flatten()  # always a copy (ravel would be a view of the input when R or K is 1), index k*R + r
    flat += 0.0  # -0.0 -> +0.0, so the bit patterns are ordered
    key = -flat.view(np.int64)
    if caps is None:
        capacity = R * K
    else:
        allowed = (np.arange(K)[:, None] < caps[None, :]).ravel()
        key[~allowed] = _INT64_MAX
        capacity = int(caps.sum())
    order = np.argsort(key, kind="stable")
    return order, flat, capacity


def extend_linear(table, indices) -> np.ndarray:
    """``table[indices]``, extrapolating linearly from the last two entries beyond the table's end."""
    v = np.asarray(table, dtype=np.float64)
    if v.ndim != 1:
        raise ValueError(f"cost table must be 1-D (indexed by count); got shape {v.shape}")
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size and idx.min() < 0:
        raise ValueError("cost table indices must be >= 0")
    n = v.size
    if idx.size == 0 or idx.max() < n:
        return v[idx]
    if n < 2:
        raise ValueError(f"cost table needs at least 2 entries to extrapolate to index {int(idx.max())}; it has {n}")
    beyond = v[-1] + (idx - (n - 1)) * (v[-1] - v[-2])
    return np.where(idx < n, v[np.minimum(idx, n - 1)], beyond)


def _verify_costs(verify_cost_ms, start: int, count: int) -> np.ndarray:
    """verify_cost_ms[start : start + count] with linear extrapolation (fast path for the solver)."""
    v = np.asarray(verify_cost_ms, dtype=np.float64)
    if v.ndim != 1:
        raise ValueError(f"verify_cost_ms must be 1-D (indexed by verified-token count); got shape {v.shape}")
    n = v.size
    end = start + count
    if end <= n:
        return v[start:end]
    if n < 2:
        raise ValueError(f"verify_cost_ms needs at least 2 entries to extrapolate to {end - 1} tokens; it has {n}")
    out = np.empty(count)
    inside = max(0, n - start)
    out[:inside] = v[start:n]
    out[inside:] = v[-1] + np.arange(max(start, n) - (n - 1), end - (n - 1)) * (v[-1] - v[-2])
    return out


def _objective_curve(R, flat, order, capacity, verify_cost_ms, draft_cost_ms, n_emitting):
    """Objective for every B in 0..capacity: (N + top-B survival sum) / (draft + verify[R + B])."""
    d = float(draft_cost_ms)
    if not 0.0 <= d < np.inf:
        raise ValueError(f"draft_cost_ms must be finite and >= 0; got {draft_cost_ms}")
    N = R if n_emitting is None else float(n_emitting)
    if not 0.0 <= N < np.inf:
        raise ValueError(f"n_emitting must be finite and >= 0; got {n_emitting}")
    gains = np.empty(capacity + 1)
    gains[0] = N
    gains[1:] = flat[order[:capacity]]
    np.cumsum(gains, out=gains)
    denom = _verify_costs(verify_cost_ms, R, capacity + 1) + d
    if not denom.min() > 0.0:  # also catches NaN
        if np.isnan(denom).any():
            raise ValueError("verify_cost_ms contains NaN")
        raise ValueError("step cost (draft_cost_ms + verify_cost_ms[R + B]) must be > 0 for every candidate B")
    gains /= denom
    return gains


def _max_budget(max_budget) -> int | None:
    if max_budget is None:
        return None
    if not float(max_budget) == int(max_budget):
        raise ValueError(f"max_budget must be a whole number of tokens; got {max_budget}")
    return max(0, int(max_budget))


def _best(S, caps, verify_cost_ms, draft_cost_ms, n_emitting, max_budget=None):
    order, flat, capacity = _rank(S, caps)
    if max_budget is not None:
        capacity = min(capacity, max_budget)
    obj = _objective_curve(S.shape[0], flat, order, capacity, verify_cost_ms, draft_cost_ms, n_emitting)
    B = int(np.argmax(obj))  # first maximum: the smallest B among ties
    return B, float(obj[B]), order


def _lengths(order, B: int, R: int) -> np.ndarray:
    return np.bincount(order[:B] % R, minlength=R).astype(np.int64) if R else np.zeros(0, np.int64)


def best_budget(survival, verify_cost_ms, draft_cost_ms: float = 0.0, n_emitting=None, *, caps=None,
                max_budget=None) -> tuple[int, float]:
    """The exact optimal budget B* and its objective (expected output tokens per ms).

    Arguments as in :func:`solve_budget`. Use it to size B from one survival matrix (e.g. stale rows)
    and allocate with :func:`solve_budget_for_b` from another (the live rows). With R = 0 there is
    nothing to run: returns (0, 0.0).
    """
    S = _survival(survival)
    R, K = S.shape
    if R == 0:
        return 0, 0.0
    B, obj, _ = _best(S, _caps(caps, R, K), verify_cost_ms, draft_cost_ms, n_emitting, _max_budget(max_budget))
    return B, obj


def solve_budget_for_b(survival, budget: int, *, caps=None) -> np.ndarray:
    """Verify lengths (R,) of the top-``budget`` slots of ``survival`` (no cost model involved).

    Slots are admitted in descending survival, ties to the earlier position, so each request's admitted
    slots form a prefix. ``budget`` is clipped to [0, number of slots allowed by ``caps``]; slots with
    zero survival are admitted if the budget reaches them (the budget was fixed in advance).
    """
    S = _survival(survival)
    R, K = S.shape
    if not float(budget) == int(budget):
        raise ValueError(f"budget must be a whole number of tokens; got {budget}")
    if R == 0:
        return np.zeros(0, np.int64)
    order, _, capacity = _rank(S, _caps(caps, R, K))
    return _lengths(order, min(max(int(budget), 0), capacity), R)


def solve_budget(survival, verify_cost_ms, draft_cost_ms: float = 0.0, n_emitting=None, *, caps=None,
                 max_budget=None) -> np.ndarray:
    """Per-request verify lengths L (R,) that maximise expected output tokens per ms of step time.

    survival: (R, K) floats in [0, 1], non-increasing along each row (S_{r,k} = prod_{i<=k} c_{r,i}).
    verify_cost_ms: 1-D, ``verify_cost_ms[t]`` = ms of a verify step over t tokens in total; the step
        verifies R + B tokens (one next/bonus token per request plus the budget). Beyond the table's end
        it is extrapolated linearly from the last two entries.
    draft_cost_ms: the step's drafting cost, added to every candidate's denominator.
    n_emitting: N, requests that emit a token this step (default R).
    caps: optional (R,) ints, the most drafts request r may verify (near max_new_tokens or the context
        end); slots beyond a cap are never admitted.
    max_budget: optional global cap on B, the drafts verified this step over all requests (vLLM's
        ``max_total_logits - num_reqs``: the engine's most tokens per step less those verified anyway).

    Uses the live survivals to choose B, so it is lossless for greedy decoding only; see the module
    docstring for sampling. Exact over B in 0..R*K; ties resolve to the smallest B.
    """
    S = _survival(survival)
    R, K = S.shape
    if R == 0:
        return np.zeros(0, np.int64)
    B, _, order = _best(S, _caps(caps, R, K), verify_cost_ms, draft_cost_ms, n_emitting, _max_budget(max_budget))
    return _lengths(order, B, R)


def rows_valid(rows: list[list[float]]) -> bool:
    """True when survival rows (lists) are already what :func:`_survival` returns them as: probabilities in
    [0, 1], non-increasing along each row, no NaN (which fails every comparison). Anything else goes the
    numpy way, which repairs or explains."""
    for row in rows:
        prev = 1.0
        for x in row:
            if not 0.0 <= x <= prev:
                return False
            prev = x
    return True


def solve_small(rows: list[list[float]], caps: list[int] | None, verify_cost_ms, draft_cost_ms: float,
                n_emitting=None, max_budget: int | None = None) -> tuple[int, list[int]] | None:
    """(B*, verify lengths) of :func:`solve_budget` in pure Python, for a few valid rows (see rows_valid).

    The same computation as the numpy path, in the same order: slots ranked by survival, ties to the
    earlier position then the lower request (a stable sort of the k-major slots), the objective's
    numerator summed in rank order, the same cost table extrapolation, the first maximum. So the result
    is identical, not just close. Returns None where the numpy path must answer instead (a cost table or
    draft cost it would reject, or too short to extrapolate): it raises the error that explains.
    """
    R = len(rows)
    d = float(draft_cost_ms)
    N = float(R if n_emitting is None else n_emitting)
    if not (0.0 <= d < math.inf and 0.0 <= N < math.inf):
        return None
    vals, slot, order = _rank_small(rows, caps)
    if max_budget is not None:
        del order[max(0, int(max_budget)):]
    if isinstance(verify_cost_ms, np.ndarray):
        if verify_cost_ms.ndim != 1:
            return None
        table = verify_cost_ms.tolist()
    else:
        table = [float(x) for x in verify_cost_ms]
    n = len(table)
    end = R + len(order) + 1
    if end > n:
        if n < 2:
            return None
        last, slope = table[-1], table[-1] - table[-2]
        table = table + [last + m * slope for m in range(1, end - n + 1)]
    g = N
    best_obj, best = -math.inf, 0
    for b in range(len(order) + 1):
        if b:
            g += vals[order[b - 1]]
        denom = table[R + b] + d
        if not denom > 0.0:
            return None
        obj = g / denom
        if obj > best_obj:
            best_obj, best = obj, b
    return best, _lengths_small(slot, order, best, R)


def solve_small_for_b(rows: list[list[float]], caps: list[int] | None, budget: int) -> list[int]:
    """:func:`solve_budget_for_b` in pure Python for a few valid rows (see rows_valid): the same lengths."""
    _, slot, order = _rank_small(rows, caps)
    return _lengths_small(slot, order, min(max(int(budget), 0), len(order)), len(rows))


def _rank_small(rows: list[list[float]], caps: list[int] | None) -> tuple[list[float], list[int], list[int]]:
    """:func:`_rank` in pure Python: the allowed slots' survivals and requests (k-major), and their
    admission order (descending survival; a stable sort, so ties keep the k-major order)."""
    vals, slot = [], []
    for k in range(len(rows[0]) if rows else 0):
        for r, row in enumerate(rows):
            if caps is None or k < caps[r]:
                vals.append(row[k])
                slot.append(r)
    return vals, slot, sorted(range(len(vals)), key=vals.__getitem__, reverse=True)


def _lengths_small(slot: list[int], order: list[int], budget: int, R: int) -> list[int]:
    lengths = [0] * R
    for i in order[:budget]:
        lengths[slot[i]] += 1
    return lengths


def cap_depth(lengths, survival, call_ms, fixed_ms: float = 0.0, base_gain: float = 0.0) -> int:
    """The depth cap d that maximises expected output per ms when every row is padded to its longest.

    The budget above prices verified tokens by count; a packed engine call that pads each row to the
    call's longest query (models/decoder.py) also pays for depth: one request verifying 7 drafts makes
    every row cost 8. For each cap d from max(lengths) down to 1, expected output is
    ``base_gain + sum_r S_{r, <= min(L_r, d)}`` and the step costs ``fixed_ms + call_ms(extra tokens,
    d)``, with ``call_ms(tokens, depth)`` the verify call's time for ``tokens`` verified drafts whose
    longest row verifies ``depth``. Returns the best d (ties keep the deeper cap; 0 only when nothing
    is admitted). Capping only removes later slots of a request, which never outrank earlier ones, so
    it keeps the allocation's lossless structure.
    """
    L = np.asarray(lengths, dtype=np.int64)
    deepest = int(L.max()) if L.size else 0
    if deepest <= 0:
        return 0
    S = np.asarray(survival, dtype=np.float64)
    # Expected accepted drafts of each row at each cap d = 1..deepest: cumulative survival at min(L, d).
    cum = np.concatenate([np.zeros((len(L), 1)), np.cumsum(S[:, :deepest], axis=1)], axis=1)
    capped = np.minimum(L[None, :], np.arange(1, deepest + 1)[:, None])  # (deepest, R)
    gain = base_gain + cum[np.arange(len(L))[None, :], capped].sum(axis=1)
    ms = fixed_ms + np.array([float(call_ms(int(t), d)) for d, t in enumerate(capped.sum(axis=1), start=1)])
    rate = np.divide(gain, ms, out=np.full(deepest, np.inf), where=ms > 0)
    # The deepest cap unless a shallower one is strictly better (ties keep the deeper cap).
    best = deepest
    for d in range(deepest - 1, 0, -1):
        if rate[d - 1] > rate[best - 1] * (1 + 1e-9):
            best = d
    return best


# ------------------------------------------------------------------------------------------------------
# The runtime's planning around the budget: pure functions of a step's survivals and costs.

def table_lookup(table: np.ndarray, x):
    """table[x] for integer x >= 0; beyond the end, linear from the last two entries at index >= 1."""
    n = table.size
    if isinstance(x, (int, np.integer)):  # fast path: called every step
        if x < 0:
            raise ValueError(f"sizes must be whole numbers >= 0; got {x!r}")
        if x < n:
            return float(table[x])
        return float(table[-1] + (x - (n - 1)) * (table[-1] - table[-2] if n >= 3 else 0.0))
    xa = np.asarray(x)
    if xa.size and (xa.min() < 0 or not np.all(xa == np.floor(xa))):
        raise ValueError(f"sizes must be whole numbers >= 0; got {x!r}")
    xi = xa.astype(np.int64)
    slope = table[-1] - table[-2] if n >= 3 else 0.0
    out = np.where(xi < n, table[np.minimum(xi, n - 1)], table[-1] + (xi - (n - 1)) * slope)
    return float(out) if out.ndim == 0 else out


def marginal_survival(requests: int, admitted_sum: float, budget: int, table: np.ndarray, draft_ms: float,
                      span: int = 4, n_emitting=None) -> float:
    """The survival at which one more verified draft breaks even at this step's solution: the step's
    expected output per ms times the marginal cost of a verified token, averaged over `span` tokens.

    The runtime spans a layer of the call (one more token for each of its rows): with padding every
    layer deeper costs a jump that only a whole layer shares, and a solution sits at a layer's end
    whenever the rows verify alike, where a span of a few tokens would charge the next jump to them and
    stop every request drafting. Unlike the weakest admitted survival, this does not rise when the
    solver admits everything that was drafted, so drafting depth cannot ratchet down. n_emitting: the
    solve's N (default `requests`); `requests` still indexes the table.
    """
    t = requests + budget
    cost = draft_ms + table_lookup(table, t)
    if cost <= 0:
        return 0.0
    rate = ((requests if n_emitting is None else n_emitting) + admitted_sum) / cost
    return max(0.0, rate * (table_lookup(table, t + span) - table_lookup(table, t)) / span)


def best_draft_depth(profile, n_adaptive: int, verify_ms, draft_ms: float, plain_ms: float, spec_ms: float,
                     others: float = 0.0) -> tuple[int, float]:
    """(best draft depth j, its drafting rate over the plain rate) before anything is drafted.

    With n_adaptive requests expected to keep j drafts each (survival `profile`, length K), output per
    ms is ``n (1 + sum_{i<j} S_i) / (overhead_j + j draft_ms + verify_ms[j])`` (verify_ms: K + 1 costs of
    the verify call at depth j; overhead_j: plain_ms for j = 0, spec_ms otherwise). Drafting far past
    the best j is waste. Tokens of requests that do not draft adaptively add the same to every j and
    belong in verify_ms and the gain's constant: ``others``, the tokens they emit (N counts every row
    that emits a token, as in the budget solver).
    """
    # Plain Python: a few entries, asked every few steps between engine calls, where numpy's per-call cost
    # (cold caches after the engine ran) made the planner ~100 us a plan.
    prof = profile.tolist() if hasattr(profile, "tolist") else list(profile)
    verify = verify_ms.tolist() if hasattr(verify_ms, "tolist") else list(verify_ms)
    others, draft_ms, spec_ms = float(others), float(draft_ms), float(spec_ms)
    rate0 = (others + n_adaptive) / max(float(plain_ms) + verify[0], 1e-9)
    best, best_rate, top, kept = 0, rate0, 0.0, 0.0
    for j in range(1, len(prof) + 1):
        kept += prof[j - 1]
        rate = (others + n_adaptive * (1.0 + kept)) / max(spec_ms + j * draft_ms + verify[j], 1e-9)
        top = max(top, rate)
        if rate > best_rate:
            best, best_rate = j, rate
    return best, (top / rate0 if prof and rate0 > 0 else 0.0)


def even_spread(n: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Token counts 0..n-1 over `rows` rows and the longest row when they are spread evenly (every row
    verifies one token anyway): the least padding a count can cost in a packed call."""
    t = np.arange(n, dtype=np.float64)
    return t, 1.0 + np.ceil(np.maximum(t - rows, 0.0) / rows)
