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
kept: four features make that exact and cheap), from calls of known shape timed by the profiler. Online,
exponentially weighted log-ratios (observed / predicted) follow the machine's drift: one per call width
(rows, to the nearest power of two), starting from a global one. The profile's shapes cannot cover every
width the way a running batch does, and a single factor learned mostly from the many small calls (prompt
chunks, a few requests) left the widest calls dearer than predicted, a bias that falls unevenly on
plain and drafting steps. Within a width, plain calls (one query token a row) and verify calls (deeper)
each get an offset from the width's level once observed: the profile's depth slope at the widest calls
can be a third too shallow (the tiny pair at 64 rows: verifying 2-3 tokens a row 25-35% dearer than the
fit, one token 8% cheaper), and a width's single level, learned from the calls a running batch mostly
makes, then prices the other kind wrong in the direction that keeps it there (adaptive drafted at 64
requests where plain decoding was 1.2x faster). The depth planner checks plain steps now and then while
it drafts (phases/plain_check.py), and explores drafting while it does not (exploration.py), so the kind
it compares against is observed too. Offsets, not levels of their own: a kind seen only now and then is
measured against the width's level at that time, which the calls around it keep current (the machine's
speed moved 40% between waves of one run). The kind a width mostly ran among its last 16 calls moves the
level (net of its offset), the other kind learns its offset against it, and in a tie both happen: in a
stretch of one kind its calls cannot tell the level from their offset, and when both followed them the
other kind took the stretch's price (after drafting a while, plain decoding was priced as dear as
verifying, and adaptive drafted on at 16 requests at 0.88x `off`: plain checks could not move a median of
16); a rare kind's call that moved the level too handed its own error to the common kind's offset. Two
kinds, not an offset per depth: offsets learned from a few calls of a rarely run depth made it look cheap,
and the planner drafted 7 deep at 41 rows for it.

A factor per width corrects the level, never the shape: a profile recorded with a flat verify curve
(every call as dear as a plain step, so extra verified tokens look free) would keep adaptive verifying
deep at any load (measured at 16 and 64 requests: 0.75x the best fixed K for a whole bench run). So every
``refit_every`` observed calls are checked: when, at some width, calls of different query depths (longest
query, to the nearest power of two) are off the model by levels more than ``refine_margin`` apart (and
by three standard errors: noise alone set refits off), the depth slope is wrong, and the call and token
coefficients are refitted to those calls (each divided by its width's drift factor when observed, each
width's mean log-ratio taken out: the level is the drift's job) together with what the model predicts now
on a grid of shapes, weighing as much as the calls (each refit moves the model about halfway; errors
relative to the prediction, since calls run from 1 to 50 ms). Each width's drift then moves by what the
refit changed its calls' level by, and each kind's offset by what it changed that kind's calls by.

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
import statistics
from collections import deque

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


class CallShapeCost:
    """ms of one engine call from (tokens, rows, longest query, past length); see the module docstring."""

    STEP = math.log(1.5)  # a call's innovation counts as at most this in a kind's offset
    RECENT = 16  # a kind's offset: the median of its last RECENT innovations

    def __init__(self, coef):
        c = np.asarray(coef, dtype=np.float64)
        if c.shape != (len(FEATURES),) or not np.isfinite(c).all() or (c < 0).any() or c.sum() <= 0:
            raise ValueError(f"call-shape coefficients must be {len(FEATURES)} finite values >= 0, not all 0; "
                             f"got {coef!r}")
        self.coef = c
        self.alpha = DriftTuning.shape_alpha  # EW weight of one observed call (CostTable.tune sets both)
        self.bounds = (math.log(DriftTuning.bound_low), math.log(DriftTuning.bound_high))
        self.log_drift = 0.0  # global: for call widths not observed yet
        self.width_drift: dict[int, float] = {}  # per width bucket, round(log2(rows))
        # per (width bucket, verifies: longest query > 1): [log offset from the width's level, recent innovations]
        self.kind_offset: dict[tuple[int, bool], list] = {}
        self._recent_kinds: dict[int, deque] = {}  # per width bucket: the kinds of its last RECENT calls
        self.fitted = c  # the profile's fit, which refits move away from
        self.refits = 0
        # The padded-attention coefficient of a prompt chunk among decode rows, learned from such calls (only
        # up): the profile's (coef[3]) is kept for everything else, the verify depth's padding included.
        self.chunk_padding = 0.0
        self.padding_raises = 0  # times such a call raised it
        self.refit_every = DriftTuning.shape_refit_every
        self.margin = math.log1p(DriftTuning.refine_margin)  # how far apart two depths' errors must be
        self._calls: list = []  # since the last refit: (tokens, rows, longest, past, ms / drift factor then)

    @classmethod
    def from_points(cls, points) -> "CallShapeCost":
        """points: [[tokens, rows, longest, past, ms], ...] (medians or single timings)."""
        a = np.asarray(points, dtype=np.float64)
        if a.ndim != 2 or a.shape[1] != 5 or len(a) < len(FEATURES):
            raise ValueError(f"need at least {len(FEATURES)} call shapes as [tokens, rows, longest, past, ms]")
        return cls(fit_nonnegative(features(*a[:, :4].T), a[:, 4]))

    def drift(self, rows: int, longest=None):
        """The log drift factor applied to calls of this many rows; with `longest` (a call's longest query, or
        an array of them) plus the offset of each call's kind, plain or verifying, once that kind was
        observed at this width."""
        w = load_bucket(rows)
        own = self.width_drift.get(w, self.log_drift)
        if longest is None:
            return own
        if isinstance(longest, (int, float, np.number)):
            return self._kind_drift(w, own, longest > 1)
        return np.where(np.asarray(longest) > 1, self._kind_drift(w, own, True), self._kind_drift(w, own, False))

    def _kind_drift(self, w: int, own: float, verifies: bool) -> float:
        """The bounded log drift of one kind of call (plain or verifying) at width bucket w, level `own`."""
        offset = self.kind_offset.get((w, verifies))
        return min(max(own + (offset[0] if offset else 0.0), self.bounds[0]), self.bounds[1])

    def ms(self, tokens: int, rows: int, longest: int, past: int, chunk: bool = False) -> float:
        """Predicted ms of one call (drift-corrected); chunk: a prompt chunk among decode rows."""
        return self.base_ms(tokens, rows, longest, past, chunk) * math.exp(self.drift(rows, longest))

    def base_ms(self, tokens: int, rows: int, longest: int, past: int, chunk: bool = False) -> float:
        """The fitted model's ms of one call, before drift correction."""
        c = self.coef
        pad = max(c[3], self.chunk_padding) if chunk else c[3]
        return c[0] + c[1] * tokens + c[2] * rows * past / 100.0 + pad * rows * longest * (past + longest) / 1000.0

    def table(self, tokens: np.ndarray, rows: int, longest: np.ndarray, past: int) -> np.ndarray:
        """:meth:`ms` over arrays of token counts and longest queries, both non-decreasing, for one set of rows
        (drift-corrected); never decreasing either: the plain calls' offset may say a plain call costs more
        than verifying, which no call does."""
        c0, c1, c2, c3 = self.coef.tolist()  # Python floats: this runs every step, on a few dozen entries
        longest = np.asarray(longest, dtype=np.float64)
        base = (c0 + c2 * rows * past / 100.0) + c1 * tokens + (c3 * rows / 1000.0) * longest * (past + longest)
        return np.maximum.accumulate(np.atleast_1d(base * np.exp(self.drift(rows, longest))))

    def observe(self, tokens: int, rows: int, longest: int, past: int, ms: float, chunk_among_rows=False) -> None:
        """Feed back a measured call: the global drift and its width's follow observed / predicted (bounded).
        chunk_among_rows: the call packed a prompt chunk with decode rows (the padded attention shows).
        Every call counts towards the next refit. (Refits from one step in cost_observe_every recovered from
        a flat profile in a run or four, not one; refits from every call had wandered the call and token
        coefficients down before they were weighed by the model's prediction and asked for three standard
        errors, see _apart.)"""
        if not (ms > 0 and math.isfinite(ms)):
            return
        lo, hi = self.bounds
        w = load_bucket(rows)
        own = self.width_drift.get(w, self.log_drift)
        if chunk_among_rows:
            self._learn_padding(tokens, rows, longest, past, ms / math.exp(own))
        pred = self.base_ms(tokens, rows, longest, past, chunk_among_rows)
        if not pred > 0:
            return
        x = math.log(ms / pred)
        kind = longest > 1
        offset, majority, minority = None, True, False  # a chunk among decode rows teaches no kind's offset
        if not chunk_among_rows:
            offset = self.kind_offset.get((w, kind))
            if offset is None:
                offset = self.kind_offset[(w, kind)] = [0.0, deque([0.0], maxlen=self.RECENT)]
            recent = self._recent_kinds.setdefault(w, deque(maxlen=self.RECENT))
            recent.append(kind)
            share = 2 * recent.count(kind) - len(recent)
            majority, minority = share >= 0, share <= 0  # a tie is both
        if majority:
            # The level is the machine's speed at this width: it follows the calls the width mostly makes, net
            # of their kind's offset (module docstring).
            self.width_drift[w] = min(max(own + self.alpha * (x - own - (offset[0] if offset else 0.0)), lo), hi)
        if minority:
            # A kind's offset: the median of its calls' recent innovations (log ratio over the width's level
            # before the call, within a factor 1.5), an offset of 0 counting as one until RECENT calls were
            # seen. A median: plain calls seen only in a check now and then are few, and stalls happen (the
            # first plain call of a run took 8x its prediction, measured), which a mean carried for a while.
            offset[1].append(min(max(x - own, -self.STEP), self.STEP))
            offset[0] = statistics.median(offset[1])
        self.log_drift = min(max(self.log_drift + self.alpha * (x - self.log_drift), lo), hi)
        if self.refit_every > 0:
            # in the model's units: what the base should have said, the width's level at the time taken out
            self._calls.append((tokens, rows, longest, past, ms / math.exp(own)))
            if len(self._calls) >= self.refit_every:
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
        # Each width's drift moves by what the refit changed its calls' level by: the model predicts the
        # calls it saw, width by width, as before.
        change = np.log(new / base)
        lo, hi = self.bounds
        for w in np.unique(width[keep]):
            at = width[keep] == w
            own = self.width_drift.get(int(w), self.log_drift)
            self.width_drift[int(w)] = min(max(own - float(change[at].mean()), lo), hi)
            for kind in (False, True):  # and each kind's offset by its own calls' change
                offset = self.kind_offset.get((int(w), kind))
                mine = at & ((calls[keep, 2] > 1) == kind)
                if offset is not None and mine.any():
                    shift = float(change[mine].mean() - change[at].mean())
                    offset[1] = deque((v - shift for v in offset[1]), maxlen=self.RECENT)
                    offset[0] = statistics.median(offset[1])
        self.log_drift = min(max(self.log_drift - float(change.mean()), lo), hi)
        self.coef = coef
        self.refits += 1

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
