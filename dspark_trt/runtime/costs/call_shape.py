"""What one packed engine call costs, by its shape rather than by its token count alone.

The packed attention (models/decoder.py) pads every request's query to the longest one in the call and
gathers every row's cache up to the call's longest past. So a call's time grows with:
  - the tokens N (projections, MLP, LM head),
  - rows x past, R * P (gathering the rows' caches),
  - the padded attention, R * Lq * (P + Lq) (Lq: the longest query in the call).
A table indexed by token count cannot tell a call of 32 one-token rows plus one 40-token prompt chunk
(every row padded to 40) from the same rows with the prompt in a call of its own (several times
cheaper on the tiny pair), nor one request verifying 7 drafts while 31 verify none from an even spread. This
model can, and the runtime uses it to decide when a prompt chunk gets its own call and how deep a
step's verification may go before padding every row to that depth stops paying.

Fit: non-negative least squares over the four features (every subset solved, the best feasible one
kept: four features make that exact and cheap), from calls of known shape timed by the profiler. Two
kinds of call are priced apart: plain calls (one query token a row) and verify calls (deeper). On ONNX
Runtime they run different graphs (plain calls the decoding graph, 0.65x the fit at 16 rows) and the
profile's depth slope at the widest calls can be a third too shallow (the tiny pair at 64 rows: verifying
2-3 tokens a row 25-35% dearer than the fit, one token 8% cheaper). So each kind starts, at each width
(rows, to the nearest power of two), from the fit's error on the profile's calls of that kind and width
(its profile offset), and once observed there follows its own calls: an exponentially weighted log ratio
(observed / predicted) per (width, kind). Where a kind was not observed, it is priced by its profile
offset plus what its calls said over theirs at the nearest width where they were: once one of its calls
was observed, never by the other kind's calls (before, by every call's drift). A level shared by both
kinds, learned from the kind a width mostly ran, priced the other kind by that stretch's errors (a profile
whose verify slope was flat had adaptive draft 7 deep at 16 requests while plain decoding was priced at
3x its cost); one kind's calls cannot tell the machine's speed from their own kind's error, and a kind
priced too cheaply is soon run and observed, one priced too dearly never. Calls soon after the engine
switched graphs are not learned from (tuning.settle_calls): they cost a switch's price, at 16 rows a
plain call 1.45x its settled time. Two kinds, not a level per depth: levels learned from a few calls of a
rarely run depth made it look cheap, and the planner drafted 7 deep at 41 rows for it.

A level per width and kind corrects the level, never the shape: a profile recorded with a flat verify curve
(every call as dear as a plain step, so extra verified tokens look free) would keep adaptive verifying
deep at any load (measured at 16 and 64 requests: 0.75x the best fixed K for a whole bench run). So every
``refit_every`` observed calls are checked: when, at some width, calls of different query depths (longest
query, to the nearest power of two) are off the model by levels more than ``refine_margin`` apart (and
by three standard errors: noise alone set refits off), the depth slope is wrong, and the call and token
coefficients are refitted to those calls (each divided by the machine's speed at the time, every call's
drift, and by its kind's profile offset; each width's mean log-ratio taken out: the level is the drift's job) together with what the model predicts now
on a grid of shapes, weighing as much as the calls (each refit moves the model about halfway; errors
relative to the prediction, since calls run from 1 to 50 ms). Each kind's level at each width then moves
by what the refit changed its calls by.

The past and padded-attention coefficients stay as the profile measured them. Within a window the past
grows with time while the machine's speed moves: a refit of the past term read that drift as a cost of
the past and moved the depth slope with it (a good profile then drafted deep at 64 requests). The padded
attention is the same trap, and a worse one: in the calls a running batch makes (decode rows, verify
queries of at most max_draft + 1) it is about rows x depth x past, the past's drift again, so refits set
it anywhere from twice the profile's to 0, often 0 within 30 refits of a mixed open loop. Where it
dominates, a prompt chunk padded into a wide decode call, the calls are almost never seen (the
verifier's split keeps them apart); the profile measured them. With it at 0 the split priced a 256-token
chunk among 57 decode rows at 28 ms, packed it, and the call took 1-2.7 s, step after step: whole
open-loop runs fell to a fifth of their throughput with queue waits of a minute (docs/lab-notes.md,
sixth session).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from dspark_trt.runtime.costs.overhead import load_bucket
from dspark_trt.runtime.tuning import DriftTuning

FEATURES = ("call", "tokens", "rows_x_past/100", "rows_x_longest_x_span/1000")

# Shapes (tokens, rows, longest, past) where a refit keeps the current predictions as its prior: decode
# and verify calls of every width and depth, and prompt chunks.
GRID = np.array([(r * q, r, q, p) for r in (1, 2, 4, 8, 16, 32, 64) for q in (1, 2, 4, 8) for p in (64, 256)]
                + [(q * r, r, q, 0) for r in (1, 4) for q in (32, 128)], dtype=np.float64)


def features(tokens, rows, longest, past) -> np.ndarray:
    """Feature rows [n, 4] for call shapes (scalars or equal-length arrays)."""
    n, r, q, p = (np.asarray(x, dtype=np.float64) for x in (tokens, rows, longest, past))
    n, r, q, p = np.broadcast_arrays(n, r, q, p)
    return np.stack([np.ones_like(n), n, r * p / 100.0, r * q * (p + q) / 1000.0], axis=-1)


def call_ms(c, tokens, rows, longest, past, pad=None):
    """The model's ms of calls before drift correction, from coefficients c (a list of floats where it runs
    every step); tokens and longest may be arrays. pad: the padded attention's coefficient, if not c[3]."""
    pad = c[3] if pad is None else pad
    return c[0] + c[1] * tokens + c[2] * rows * past / 100.0 + pad * rows * longest * (past + longest) / 1000.0


def fit_nonnegative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin ||x c - y|| subject to c >= 0, for a handful of columns (exhaustive over active sets)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    best, best_err = np.zeros(x.shape[1]), float(np.sum(y * y))
    for k in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), k):
            c, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if (c < 0).any():
                continue
            err = float(np.sum((x[:, cols] @ c - y) ** 2))
            if err < best_err:
                best_err, best = err, np.zeros(x.shape[1])
                best[list(cols)] = c
    return best


# The most a switch of graphs adds to a call, in plain calls of its width (tuning.settle_calls: the first
# plain call after one took 1.45x its settled time). A plain call's worth, not a share of the call: what a
# switch costs is the other graph's weights and caches brought back in, the same for a deep call as a shallow one.
SWITCH_EXTRA = 0.5


class CallShapeCost:
    """ms of one engine call from (tokens, rows, longest query, past length); see the module docstring."""

    STEP = math.log(4.0)  # a call's innovation counts as at most this
    # A level moved this far by one call is news, not noise (settled, shape_alpha caps a call's move at 7%).
    LEAP = math.log(1.1)

    def __init__(self, coef):
        c = np.asarray(coef, dtype=np.float64)
        if c.shape != (len(FEATURES),) or not np.isfinite(c).all() or (c < 0).any() or c.sum() <= 0:
            raise ValueError(f"call-shape coefficients must be {len(FEATURES)} finite values >= 0, not all 0; "
                             f"got {coef!r}")
        self.coef = c
        self.alpha = DriftTuning.shape_alpha  # EW weight of one observed call (CostTable.tune sets both)
        self.bounds = (math.log(DriftTuning.bound_low), math.log(DriftTuning.bound_high))
        # Log factors over the fit (module docstring), per kind: False plain (one query token a row), True
        # verifying. profile_offset[(width bucket, kind)]: the fit's error on the profile's calls of that kind
        # and width (round(log2(rows))); level[(width bucket, kind)]: the kind's own level at the width once
        # observed there. log_drift: every call (the machine's speed, for a kind not observed yet; what a
        # saved profile keeps).
        self.profile_offset: dict[tuple[int, bool], float] = {}
        self.level: dict[tuple[int, bool], float] = {}
        self._seen: dict[tuple[int, bool], int] = {}  # settled calls each level learned from
        self.log_drift = 0.0
        self.fitted = c  # the profile's fit, which refits move away from
        self.refits = 0
        self.moves = 0  # levels that moved by more than LEAP in one call, and refits (CostTable.moves)
        # The padded-attention coefficient of a prompt chunk among decode rows, learned from such calls (only
        # up): the profile's (coef[3]) is kept for everything else, the verify depth's padding included.
        self.chunk_padding = 0.0
        self.padding_raises = 0  # times such a call raised it
        self.refit_every = DriftTuning.shape_refit_every
        self.margin = math.log1p(DriftTuning.refine_margin)  # how far apart two depths' errors must be
        # since the last refit: (tokens, rows, longest, past, ms over the machine's speed then and the kind's
        # profile offset)
        self._calls: list = []
        self._table_parts: dict = {}  # table(): the past-free parts of a grid's table, per (rows, grid)
        self._offsets: dict = {}  # _offset() by (width bucket, kind): profile_offset is fixed once fitted

    @classmethod
    def from_points(cls, points) -> "CallShapeCost":
        """points: [[tokens, rows, longest, past, ms], ...] (medians or single timings)."""
        a = np.asarray(points, dtype=np.float64)
        if a.ndim != 2 or a.shape[1] != 5 or len(a) < len(FEATURES):
            raise ValueError(f"need at least {len(FEATURES)} call shapes as [tokens, rows, longest, past, ms]")
        model = cls(fit_nonnegative(features(*a[:, :4].T), a[:, 4]))
        model._profile_offsets(a)
        return model

    def _profile_offsets(self, a: np.ndarray) -> None:
        """Each kind's offset at each width the profile measured, from the fit's errors on its calls: one fit
        over both kinds cannot price ONNX Runtime's plain calls, which run a faster graph than verify calls
        (at 16 rows 0.65x the fit, verify calls 1.0-1.1x)."""
        base = features(*a[:, :4].T) @ self.coef
        self._offsets.clear()
        keys = [(load_bucket(int(r)), bool(q > 1)) for r, q in a[:, 1:3]]
        for key in set(keys):
            at = [i for i, k in enumerate(keys) if k == key and base[i] > 0]
            if at:
                self.profile_offset[key] = float(np.median(np.log(a[at, 4] / base[at])))

    @staticmethod
    def _nearest(keys, w: int, verifies: bool):
        """Of these (width bucket, kind) keys, the one of this kind nearest width w (None: none)."""
        mine = [k for k in keys if k[1] == verifies]
        return min(mine, key=lambda k: (abs(k[0] - w), k[0])) if mine else None

    def _offset(self, w: int, verifies: bool) -> float:
        """The profile's offset of a kind at a width (or at the nearest width it measured); asked for every
        observed call, so kept."""
        x = self._offsets.get((w, verifies))
        if x is None:
            near = self._nearest(self.profile_offset, w, verifies)
            x = self._offsets[(w, verifies)] = self.profile_offset[near] if near is not None else 0.0
        return x

    def _prior(self, w: int, verifies: bool) -> float:
        """A kind's log factor at a width where it was not observed: its profile offset plus what the kind's
        calls at the nearest width where they were observed said over theirs (every call's drift until one
        of its kind was observed)."""
        near = self._nearest(self.level, w, verifies)
        if near is None:
            return self._offset(w, verifies) + self.log_drift
        return self._offset(w, verifies) + self.level[near] - self._offset(*near)

    def drift(self, rows: int, longest):
        """The bounded log factor applied to calls of this many rows whose longest query is `longest` (an int,
        or an array of them)."""
        w = load_bucket(rows)
        if isinstance(longest, (int, float, np.number)):
            return self._kind_drift(w, longest > 1)
        return np.where(np.asarray(longest) > 1, self._kind_drift(w, True), self._kind_drift(w, False))

    def _kind_drift(self, w: int, verifies: bool) -> float:
        x = self.level.get((w, verifies))
        if x is None:
            x = self._prior(w, verifies)
        return min(max(x, self.bounds[0]), self.bounds[1])

    def observed(self, rows: int, plain: bool) -> bool:
        """Whether calls of this width and kind were observed (settled ones): priced by their own level."""
        return (load_bucket(rows), not plain) in self.level

    def ms(self, tokens: int, rows: int, longest: int, past: int, chunk: bool = False) -> float:
        """Predicted ms of one call (drift-corrected); chunk: a prompt chunk among decode rows."""
        return self.base_ms(tokens, rows, longest, past, chunk) * math.exp(self.drift(rows, longest))

    def base_ms(self, tokens: int, rows: int, longest: int, past: int, chunk: bool = False) -> float:
        """The fitted model's ms of one call, before drift correction."""
        return call_ms(self.coef, tokens, rows, longest, past, max(self.coef[3], self.chunk_padding) if chunk else None)

    def table(self, tokens: np.ndarray, rows: int, longest: np.ndarray, past: int) -> np.ndarray:
        """:meth:`ms` over arrays of token counts and longest queries, both non-decreasing, for one set of rows
        (drift-corrected); never decreasing either: the plain calls' level may say a plain call costs more
        than verifying, which no call does."""
        # This runs every step and the past moves every step, but the model is linear in the past: its two
        # parts are kept per grid (the caller's arrays, held so their ids stay theirs) until a refit.
        key = (rows, id(tokens), id(longest))
        parts = self._table_parts.get(key)
        if parts is None or parts[0] is not self.coef:
            c = self.coef.tolist()
            q = np.asarray(longest, dtype=np.float64)
            parts = (self.coef, tokens, longest, c[0] + c[1] * np.asarray(tokens, dtype=np.float64)
                     + c[3] * rows * q * q / 1000.0, c[2] * rows / 100.0 + c[3] * rows * q / 1000.0,
                     int(np.searchsorted(q, 1.0, side="right")))  # plain calls (longest 1) come first
            if len(self._table_parts) >= 256:
                self._table_parts.clear()
            self._table_parts[key] = parts
        _, _, _, fixed, per_past, plain = parts
        out = np.atleast_1d(fixed + per_past * past)
        w = load_bucket(rows)
        out[:plain] *= math.exp(self._kind_drift(w, False))
        out[plain:] *= math.exp(self._kind_drift(w, True))
        return np.maximum.accumulate(out, out=out)

    def depth_table(self, base: int, n_deep: int, past: int, max_depth: int) -> list[float]:
        """:meth:`table` of one call at depths j = 0..max_depth: `base` rows verify one token, `n_deep` rows
        1 + j. In plain Python: a few entries, asked between engine calls, where numpy's per-call cost was
        most of the draft-depth planner's time."""
        c = self.coef.tolist()
        rows = base + n_deep
        w = load_bucket(rows)
        plain, deep = math.exp(self._kind_drift(w, False)), math.exp(self._kind_drift(w, True))
        out, top = [], 0.0
        for j in range(max_depth + 1):
            top = max(top, call_ms(c, base + n_deep * (1 + j), rows, 1 + j, past) * (deep if j else plain))
            out.append(top)
        return out

    def observe(self, tokens: int, rows: int, longest: int, past: int, ms: float, chunk_among_rows=False,
                settled: bool = True) -> None:
        """Feed back a measured call: its kind's level at its width follows observed / predicted (bounded).
        chunk_among_rows: the call packed a prompt chunk with decode rows (the padded attention shows; its
        level stays the decode calls'). settled: False for a call soon after the engine switched graphs
        (tuning.settle_calls): it took up to a switch's price on top of its own, so it teaches only where that
        cannot explain its error (below). (Letting such calls teach as they were, so that an exploration's
        verify call priced verifying, made cold starts from a flat profile draft more: tau 1.32 against 1.10
        at 16.)
        Every call counts towards the next refit. (Refits from one step in cost_observe_every recovered from
        a flat profile in a run or four, not one; refits from every call had wandered the call and token
        coefficients down before they were weighed by the model's prediction and asked for three standard
        errors, see _apart.)"""
        if not (ms > 0 and math.isfinite(ms)):
            return
        lo, hi = self.bounds
        w, kind = load_bucket(rows), longest > 1
        own = self._kind_drift(w, kind)
        if chunk_among_rows:
            # Settled or not: such a call always follows plain calls, and padding errors are 3-5x, a switch's 1.1x.
            self._learn_padding(tokens, rows, longest, past, ms / math.exp(own))
        pred = self.base_ms(tokens, rows, longest, past, chunk_among_rows)
        if not pred > 0:
            return
        x = math.log(ms / pred)
        if not settled:
            # A switch adds at most SWITCH_EXTRA plain calls: a call dearer than the model even without that
            # teaches what is left (a kind priced far too cheaply, such as deep verification under a flat
            # profile, which drafted 5 deep for 8 steps at 16 requests before the first settled verify call;
            # taking a switch's price as a share of the call, 1.5x, it still drafted 7 deep for 12 steps at
            # 2x the model). Cheaper ones teach nothing: half of any noise would be learned and the other not.
            ms -= SWITCH_EXTRA * self.ms(rows, rows, 1, past)
            if not ms > 0 or (x := math.log(ms / pred)) <= own:
                return
        if not chunk_among_rows:
            # A level starts from its prior, which counts as one call, and averages its calls until there are
            # 1 / alpha of them (a profile 3x off is caught up with within a dozen calls), then follows them
            # exponentially weighted; one stalled call moves it by at most STEP times that weight.
            n = self._seen[(w, kind)] = self._seen.get((w, kind), 0) + 1
            weight = max(self.alpha, 1.0 / (n + 1))
            level = min(max(own + weight * min(max(x - own, -self.STEP), self.STEP), lo), hi)
            self.level[(w, kind)] = level
            self.moves += abs(level - own) > self.LEAP
            if self.refit_every > 0:
                # In the model's units: what the base should have said, the machine's speed at the time and the
                # kind's profile offset taken out (not its level: a refit is for what the levels cannot
                # explain, such as a flat profile's verify calls dearer with depth and plain calls cheaper).
                # Not a prompt chunk among decode rows: the padded attention that dominates it is not refitted.
                self._calls.append((tokens, rows, longest, past, ms / math.exp(self.log_drift + self._offset(w, kind))))
        self.log_drift = min(max(self.log_drift + self.alpha * (x - self.log_drift), lo), hi)
        if self.refit_every > 0 and len(self._calls) >= self.refit_every:
            self.refit()

    def _learn_padding(self, tokens: int, rows: int, longest: int, past: int, y: float) -> None:
        """A prompt chunk packed among decode rows (every row padded to the chunk) took y ms at its width's
        level: when the padded attention must be dearer to explain it, move the chunk's padding coefficient
        halfway there. Only ever up, and only for such calls: a profile that priced padding at 0 (recorded
        flat) packed every prompt chunk into the decode call at 4x the step time of `off` at 64 requests,
        while long chunks among many rows also cost 3-5x what a good profile's coefficient extrapolates
        from its 32-token chunks; raised for every call, it priced deeper verification 3.5x too dear and
        adaptive drafted less (lab notes, ninth session)."""
        f = features(tokens, rows, longest, past)
        pad = max(self.coef[3], self.chunk_padding)
        rest = float(f @ self.coef) - self.coef[3] * f[3]
        if f[3] <= 0 or y <= (rest + pad * f[3]) * math.exp(self.margin):
            return
        self.chunk_padding = pad + 0.5 * ((y - rest) / f[3] - pad)
        self.padding_raises += 1

    def refit(self) -> None:
        """Refit the depth slope to the calls since the last refit, when they show it wrong (module docstring)."""
        calls = np.asarray(self._calls, dtype=np.float64)
        self._calls = []
        if len(calls) < len(FEATURES):
            return
        x = features(*calls[:, :4].T)
        base = x @ self.coef
        width = np.array([load_bucket(int(r)) for r in calls[:, 1]])
        depth = np.array([load_bucket(int(q)) for q in calls[:, 2]])
        ok = base > 0
        log_ratio = np.zeros(len(calls))
        log_ratio[ok] = np.log(calls[ok, 4] / base[ok])
        keep, wrong, level = np.zeros(len(calls), dtype=bool), False, np.zeros(len(calls))
        for w in np.unique(width[ok]):
            at = ok & (width == w)
            groups = [log_ratio[at & (depth == q)] for q in np.unique(depth[at])]
            if len(groups) > 1:
                keep |= at
                wrong |= _apart(groups, self.margin)
                level[at] = log_ratio[at].mean()
        if not wrong:
            return
        x, y, base = x[keep], (base * np.exp(log_ratio - level))[keep], base[keep]  # levels out: the drift's job
        g = features(*GRID.T)
        gy = g @ self.coef
        # The past and padded-attention terms stay (module docstring): the calls cannot tell them from the
        # machine's drift over the window.
        fixed, free = [2, 3], [0, 1]
        xs, ys = np.vstack([x, g]), np.concatenate([y, gy])
        # Relative errors, relative to the model's prediction rather than the call's own time: weighing a call
        # by 1 / its time gave the slow ones (noise up) less say, and every refit moved the call and token
        # coefficients down (see _apart).
        weight = np.concatenate([1.0 / base, np.full(len(gy), math.sqrt(len(y) / len(gy))) / gy])
        slope = fit_nonnegative(xs[:, free] * weight[:, None], (ys - xs[:, fixed] @ self.coef[fixed]) * weight)
        coef = self.coef.copy()
        coef[free] = slope
        new = x @ coef
        if not (np.isfinite(coef).all() and coef.sum() > 0 and (new > 0).all()):
            return
        # Each kind's level at each width moves by what the refit changed its calls by:
        # the model predicts the calls it saw as before. The profile's offsets stay: the calls were refitted
        # net of them (observe), so the new slope is what the calls said on top of them.
        change = np.log(new / base)
        lo, hi = self.bounds
        keys = [(int(w), bool(q > 1)) for w, q in zip(width[keep], calls[keep, 2])]
        for key in set(keys):
            shift = float(np.mean([c for c, k in zip(change, keys) if k == key]))
            if key in self.level:
                self.level[key] = min(max(self.level[key] - shift, lo), hi)
        self.log_drift = min(max(self.log_drift - float(change.mean()), lo), hi)
        self.coef = coef
        self.refits += 1
        self.moves += 1

    def moved(self) -> float:
        """How far refits have moved the model from the profile's fit: the largest ratio of their
        predictions on the grid, as max(f, 1 / f) - 1."""
        g = features(*GRID.T)
        f = (g @ self.coef) / (g @ self.fitted)
        return float(np.max(np.maximum(f, 1.0 / f)) - 1.0)


def _apart(groups, margin: float) -> bool:
    """Whether the mean log ratios of two of these groups of calls (one width, depths apart) differ by more
    than `margin` and by more than three standard errors of the difference: with 15% noise, windows of a
    model that was right showed depths 25% apart by chance now and then, and every refit they set off moved
    the call and token coefficients a few percent down (in a simulation: 0.90x over 10 refits; over a bench
    run on the tiny pair the call term halved, and at one request adaptive then drafted at tau 1.9)."""
    means = [float(g.mean()) for g in groups]
    hi, lo = int(np.argmax(means)), int(np.argmin(means))
    spread = means[hi] - means[lo]
    if spread <= margin:
        return False
    var = float(np.var(np.concatenate([g - g.mean() for g in groups]))) if sum(len(g) for g in groups) > 2 else 0.0
    return spread > 3.0 * math.sqrt(var / len(groups[hi]) + var / len(groups[lo]))


def packed_shape(query_lens, past_lens) -> tuple[int, int, int, int]:
    """(tokens, rows, longest query, past attended) of one packed call."""
    return int(sum(query_lens)), len(query_lens), int(max(query_lens)), int(max(past_lens))
