"""Numpy reference of the dspark ops: readable, float32, the ground truth for every other implementation.

See :mod:`dspark_trt.plugins.spec` for the contract. Inputs may be numpy arrays or anything
``np.asarray`` accepts; floating inputs are converted to float32 first.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from dspark_trt.plugins.spec import QMAX_CLIP, check_temperatures

F32 = np.float32


# --------------------------------------------------------------------------------------------- helpers
def request_offsets(verify_lens, num_rows: int | None = None) -> np.ndarray:
    """o_r = sum_{s<r} (L_s + 1); checks L_r >= 0 and, given num_rows, M == sum_r (L_r + 1)."""
    lens = np.asarray(verify_lens, dtype=np.int64).reshape(-1)
    if (lens < 0).any():
        raise ValueError(f"verify_lens must be >= 0, got {lens[lens < 0][:4].tolist()}")
    sizes = lens + 1
    ends = np.cumsum(sizes)
    if num_rows is not None and int(ends[-1] if len(ends) else 0) != num_rows:
        raise ValueError(f"packed rows: sum(verify_lens + 1) = {int(ends[-1]) if len(ends) else 0} "
                         f"but there are {num_rows} rows")
    return ends - sizes


def argmax_lowest(x) -> np.ndarray:
    """Row-wise argmax over the last axis; ties -> lowest index; an all -inf row -> 0."""
    x = np.asarray(x, dtype=F32)
    hit = x == x.max(axis=-1, keepdims=True)
    return hit.argmax(axis=-1).astype(np.int64)  # first True; all False (NaN row) -> 0


def log_sigmoid(x) -> np.ndarray:
    """log(sigmoid(x)) = min(x, 0) - log1p(exp(-|x|)): stable, exact at +-inf."""
    x = np.asarray(x, dtype=F32)
    with np.errstate(over="ignore", invalid="ignore"):
        return (np.minimum(x, F32(0)) - np.log1p(np.exp(-np.abs(x)))).astype(F32)


def target_probs(logits, temperature) -> tuple[np.ndarray, np.ndarray]:
    """p = softmax(logits / T) per row (float32), one-hot of argmax_lowest where T <= 0 or the row
    maximum of logits / T is not finite. Returns (p [n, V], argmax [n])."""
    lf = np.asarray(logits, dtype=F32)
    t = np.asarray(temperature, dtype=F32).reshape(-1)
    am = argmax_lowest(lf)
    positive = t > 0
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        z = lf / np.where(positive, t, F32(1))[:, None]
        zmax = z.max(axis=-1, keepdims=True)
        finite = np.abs(zmax) < np.inf
        e = np.exp(z - np.where(finite, zmax, F32(0)))
        p = e / e.sum(axis=-1, keepdims=True)
    greedy = ~positive[:, None] | ~finite
    onehot = (np.arange(lf.shape[-1])[None, :] == am[:, None]).astype(F32)
    return np.where(greedy, onehot, p).astype(F32), am


def inverse_cdf(weights, u) -> np.ndarray:
    """Per row of w >= 0 ([..., V]): the smallest i with cumsum(w)[i] > u * sum(w), clamped to the last
    index with w > 0 (0 if there is none). u has the leading shape of w."""
    w = np.asarray(weights, dtype=F32)
    u = np.asarray(u, dtype=F32)
    c = np.cumsum(w, axis=-1, dtype=F32)
    thr = u * w.sum(axis=-1, dtype=F32)
    count = (c <= thr[..., None]).sum(axis=-1)
    positive = w > 0
    last = np.where(positive.any(axis=-1), w.shape[-1] - 1 - positive[..., ::-1].argmax(axis=-1), 0)
    return np.minimum(count, last).astype(np.int64)


# ----------------------------------------------------------------------------------------------- ops
def survival(logits, prev, start, temperatures: Sequence[float]) -> np.ndarray:
    """S[r,j] = prev[r] * prod_{i<=j} sigmoid(logits[r,i] / T[start[r]+i]) (float32 [R, J])."""
    temps = np.asarray(check_temperatures(temperatures), dtype=F32)
    x = np.asarray(logits, dtype=F32)
    if x.ndim != 2:
        raise ValueError(f"Survival.logits must be [R, J], got shape {x.shape}")
    r, j = x.shape
    prev = np.asarray(prev, dtype=F32).reshape(r)
    start = np.asarray(start, dtype=np.int64).reshape(r)
    pos = np.clip(start[:, None] + np.arange(j)[None, :], 0, len(temps) - 1)
    with np.errstate(over="ignore", invalid="ignore"):
        log_s = np.cumsum(log_sigmoid(x / temps[pos]), axis=1, dtype=F32)
        return (prev[:, None] * np.exp(log_s)).astype(F32)


def greedy_accept(logits, draft_tokens, verify_lens) -> tuple[np.ndarray, np.ndarray]:
    """(accepted [R], next_token [R]), int64. See spec.GREEDY_ACCEPT."""
    lf = np.asarray(logits, dtype=F32)
    tokens = np.asarray(draft_tokens, dtype=np.int64).reshape(-1)
    lens = np.asarray(verify_lens, dtype=np.int64).reshape(-1)
    offs = request_offsets(lens, lf.shape[0])
    am = argmax_lowest(lf)
    accepted = np.zeros(len(lens), np.int64)
    next_token = np.zeros(len(lens), np.int64)
    for r, (o, n) in enumerate(zip(offs, lens)):
        a = 0
        while a < n and am[o + a] == tokens[o + a]:
            a += 1
        accepted[r], next_token[r] = a, am[o + a]
    return accepted, next_token


def sample_accept(logits, draft_probs, draft_tokens, verify_lens, temperature, accept_uniforms,
                  sample_uniforms) -> tuple[np.ndarray, np.ndarray]:
    """(accepted [R], next_token [R]), int64. See spec.SAMPLE_ACCEPT."""
    acc, nxt, _ = sample_accept_with_margin(logits, draft_probs, draft_tokens, verify_lens, temperature,
                                            accept_uniforms, sample_uniforms)
    return acc, nxt


def sample_accept_with_margin(logits, draft_probs, draft_tokens, verify_lens, temperature, accept_uniforms,
                              sample_uniforms) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`sample_accept` plus, per request, how far its random draws were from a decision boundary.

    margin[r] is the smallest of |u - min(1, p(x)/q(x))| over the accept tests made (p(x) for q(x) = 0,
    unless p(x) = 0 is exact) and, for the final draw, the distance of u * total to the neighbouring
    CDF values divided by total. Another float32 implementation (different summation order, exp,
    division) can legitimately pick a different outcome only when this is within a few float32
    rounding errors of 0.
    """
    lf = np.asarray(logits, dtype=F32)
    q = np.asarray(draft_probs, dtype=F32)
    tokens = np.asarray(draft_tokens, dtype=np.int64).reshape(-1)
    lens = np.asarray(verify_lens, dtype=np.int64).reshape(-1)
    temp = np.asarray(temperature, dtype=F32).reshape(-1)
    ua = np.asarray(accept_uniforms, dtype=F32).reshape(-1)
    us = np.asarray(sample_uniforms, dtype=F32).reshape(-1)
    m, v = lf.shape
    if q.shape != lf.shape:
        raise ValueError(f"draft_probs shape {q.shape} != logits shape {lf.shape}")
    offs = request_offsets(lens, m)
    if not (len(tokens) == len(ua) == m and len(temp) == len(us) == len(lens)):
        raise ValueError("SampleAccept: draft_tokens/accept_uniforms need M entries, "
                         "temperature/sample_uniforms R entries")
    if len(lens) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    row_req = np.repeat(np.arange(len(lens)), lens + 1)  # request of each row
    j_row = np.arange(m) - offs[row_req]  # position of each row inside its request
    draft_row = j_row < lens[row_req]  # the row verifies a draft token
    p, _ = target_probs(lf, temp[row_req])

    # the accept test of every draft row: u < min(1, p(x)/q(x)); q(x) = 0: accept iff p(x) > 0
    valid = (tokens >= 0) & (tokens < v)
    x = np.where(valid, tokens, 0)
    px = np.where(valid, p[np.arange(m), x], F32(0))
    qx = np.where(valid, q[np.arange(m), x], F32(0))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ratio = np.minimum(F32(1), px / np.where(qx > 0, qx, F32(1))).astype(F32)
    ok = np.where(qx > 0, ua < ratio, px > 0)

    # a_r = position of the first stop row (a rejected draft row, or the last row) of each request
    stop = ~draft_row | ~ok
    accepted = np.minimum.reduceat(np.where(stop, j_row, m), offs).astype(np.int64)

    # final draw at row o_r + a_r: residual max(p - q, 0) after a rejection (p if it sums to 0),
    # otherwise the bonus token from p
    final = offs + accepted
    w = p[final].copy()
    resid = np.maximum(p[final] - q[final], F32(0))
    use_resid = (accepted < lens) & (resid.sum(axis=1, dtype=F32) > 0)
    w[use_resid] = resid[use_resid]
    next_token = inverse_cdf(w, us)

    # margins: accept tests actually made (draft rows up to and including the first rejection) + draw
    exact_zero = ~valid | (lf[np.arange(m), x] == -np.inf) | ~(temp[row_req] > 0)
    row_margin = np.where(qx > 0, np.abs(ua.astype(np.float64) - ratio),
                          np.where(exact_zero & (px == 0), np.inf, px.astype(np.float64)))
    made = draft_row & (j_row <= accepted[row_req])
    margin = np.minimum.reduceat(np.where(made, row_margin, np.inf), offs)
    margin = np.minimum(margin, _cdf_margin(w, us))
    return accepted, next_token, margin


def _cdf_margin(w: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Per row: distance of u * total to the nearest CDF value (or 0) below/above it, over total."""
    c = np.cumsum(w.astype(np.float64), axis=-1)
    total = c[..., -1]
    thr = np.asarray(u, np.float64) * total
    below = np.where(c <= thr[..., None], c, 0.0).max(axis=-1)  # 0 when no cdf value is <= thr
    above = np.where(c > thr[..., None], c, np.inf).min(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        margin = np.minimum(thr - below, above - thr) / total
    return np.where(total > 0, margin, np.inf)


# ------------------------------------------------------------------------------------ test batches
def random_accept_batch(rng: np.random.Generator, verify_lens, vocab: int, *, temperature=1.0,
                        match_prob: float = 0.6, logit_scale: float = 3.0) -> dict[str, np.ndarray]:
    """A random packed batch for the accept ops (inputs named as in the spec).

    Draft tokens follow the row argmax with probability ``match_prob`` (so prefixes get accepted),
    otherwise they are drawn from q. ``temperature`` is a scalar or a per-request sequence.
    """
    lens = np.asarray(verify_lens, dtype=np.int64)
    r = len(lens)
    m = int((lens + 1).sum())
    logits = (rng.standard_normal((m, vocab)) * logit_scale).astype(F32)
    q_logits = logits + rng.standard_normal((m, vocab)).astype(F32) * F32(1.5)
    q = np.exp(q_logits - q_logits.max(-1, keepdims=True))
    q = (q / q.sum(-1, keepdims=True)).astype(F32)
    am = argmax_lowest(logits)
    cdf = np.cumsum(q, axis=-1)
    sampled = np.minimum((cdf < rng.random((m, 1))).sum(-1), vocab - 1)
    tokens = np.where(rng.random(m) < match_prob, am, sampled).astype(np.int64)
    temp = np.broadcast_to(np.asarray(temperature, dtype=F32), (r,)).copy()
    return dict(logits=logits, draft_probs=q, draft_tokens=tokens, verify_lens=lens, temperature=temp,
                accept_uniforms=rng.random(m).astype(F32), sample_uniforms=rng.random(r).astype(F32))


def redraw_near_boundaries(inputs: dict, rng: np.random.Generator, tol: float = 2e-4,
                           rounds: int = 50) -> dict:
    """Redraw the uniforms of requests whose SampleAccept draws lie within ``tol`` of a decision
    boundary (see :func:`sample_accept_with_margin`), so that float32 implementations that differ in
    summation order must agree exactly. Returns a new input dict."""
    out = {k: np.array(v, copy=True) for k, v in inputs.items()}
    lens = out["verify_lens"]
    offs = request_offsets(lens, out["logits"].shape[0])
    for _ in range(rounds):
        _, _, margin = sample_accept_with_margin(**out)
        near = np.flatnonzero(margin < tol)
        if not len(near):
            return out
        for r in near:
            o, n = offs[r], lens[r]
            out["accept_uniforms"][o:o + n] = rng.random(n).astype(F32)
            out["sample_uniforms"][r] = F32(rng.random())
    raise RuntimeError(f"could not move the draws of {len(near)} requests away from decision boundaries")


def accept_cases(seed: int = 0, large_vocab: int = 32771) -> dict[str, dict[str, np.ndarray]]:
    """Named SampleAccept input batches covering the edge cases (GreedyAccept uses the logits,
    draft_tokens and verify_lens of the same batches). Deterministic for a seed."""
    rng = np.random.default_rng(seed)
    cases: dict[str, dict[str, np.ndarray]] = {}
    cases["random"] = random_accept_batch(rng, [0, 3, 1, 5, 2, 8], 50)
    cases["all_L0"] = random_accept_batch(rng, [0, 0, 0, 0], 20)
    cases["K_max"] = random_accept_batch(rng, [8, 8, 8], 40, match_prob=0.9)
    cases["large_vocab"] = random_accept_batch(rng, [3, 0], large_vocab, match_prob=0.8)

    # every draft token accepted: greedy (tokens = argmax) and sampling (q = p, so min(1, p/q) = 1)
    b = random_accept_batch(rng, [4, 8, 1], 30, temperature=[0.0, 0.8, 1.3])
    rows = np.repeat(np.arange(3), b["verify_lens"] + 1)
    p, am = target_probs(b["logits"], b["temperature"][rows])
    b["draft_probs"] = p
    b["draft_tokens"] = am
    cases["all_accepted"] = b

    # the first draft token always rejected: p(x) = 0 (logit -inf) and x is not the argmax
    b = random_accept_batch(rng, [3, 5, 2], 30, temperature=[1.0, 0.0, 0.5])
    for o in request_offsets(b["verify_lens"]):
        x = (argmax_lowest(b["logits"][o]) + 1) % 30
        b["draft_tokens"][o] = x
        b["logits"][o, x] = -np.inf
    cases["first_rejected"] = b

    # ties: few distinct logit values, so argmax ties are everywhere
    b = random_accept_batch(rng, [2, 4, 0, 3], 24, temperature=[0.0, 1.0, 0.0, 0.7], match_prob=0.7)
    b["logits"] = np.round(b["logits"] / 3.0).astype(F32)
    b["draft_tokens"] = np.where(rng.random(len(b["draft_tokens"])) < 0.7, argmax_lowest(b["logits"]),
                                 b["draft_tokens"])
    cases["ties"] = b

    # -inf logits, including whole rows (argmax 0, p one-hot at 0)
    b = random_accept_batch(rng, [3, 2, 1], 16, temperature=[1.0, 0.0, 0.9])
    b["logits"][rng.random(b["logits"].shape) < 0.3] = -np.inf
    b["logits"][[1, 4]] = -np.inf
    cases["neg_inf"] = b

    # temperatures near and at 0, negative (greedy), large
    cases["temperatures"] = random_accept_batch(rng, [2, 3, 1, 4, 2], 40,
                                                temperature=[1e-4, 0.0, 0.7, 2.0, -1.0])

    # draft tokens outside [0, V) are always rejected; q(x) = 0 with p(x) > 0 is always accepted
    b = random_accept_batch(rng, [2, 3, 2], 20)
    offs = request_offsets(b["verify_lens"])
    b["draft_tokens"][offs[0]] = -1
    b["draft_tokens"][offs[1] + 1] = 20 + 3
    o = offs[2]
    b["draft_probs"][o, b["draft_tokens"][o]] = 0.0
    b["draft_probs"][o] /= b["draft_probs"][o].sum()
    cases["invalid_tokens_and_q_zero"] = b

    # q concentrated on one token / q with zeros where p > 0
    b = random_accept_batch(rng, [3, 3, 2], 12, temperature=[1.0, 1.5, 0.6])
    q = np.zeros_like(b["draft_probs"])
    q[np.arange(len(q)), b["draft_tokens"] % 12] = 1.0
    b["draft_probs"] = q
    cases["q_one_hot"] = b
    return cases


def survival_cases(seed: int = 0) -> dict[str, tuple]:
    """Named Survival inputs (logits, prev, start, temperatures)."""
    rng = np.random.default_rng(seed)
    temps = [0.7, 1.0, 1.3, 2.0, 0.5]
    cases = {}
    cases["one_column"] = (rng.standard_normal((7, 1)).astype(F32) * 3, rng.random(7).astype(F32),
                           rng.integers(0, 5, 7), temps)
    cases["many_columns"] = (rng.standard_normal((4, 9)).astype(F32) * 3, np.ones(4, F32),
                             np.array([0, 2, 4, 7]), temps)
    x = rng.standard_normal((5, 4)).astype(F32)
    x[0, 1], x[1, 0], x[2, 3], x[3] = np.inf, -np.inf, -np.inf, [40.0, -40.0, 100.0, -100.0]
    cases["extremes"] = (x, np.array([1.0, 0.5, 0.0, 1.0, 0.25], F32), np.array([-2, 0, 1, 3, 9]), temps)
    cases["tiny_temperature"] = (rng.standard_normal((3, 70)).astype(F32), np.ones(3, F32),
                                 np.zeros(3, np.int64), [1e-4, 1.0])
    return cases


# ------------------------------------------------------------------------------------- MarkovDraft
def topk_mask(x, k: int) -> np.ndarray:
    """Boolean mask of the k largest entries along the last axis, ties at the k-th value broken toward
    the lower index (ONNX TopK's order); k <= 0 or k >= V selects everything."""
    x = np.asarray(x, dtype=F32)
    v = x.shape[-1]
    if k <= 0 or k >= v:
        return np.ones(x.shape, dtype=bool)
    order = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    mask = np.zeros(x.shape, dtype=bool)
    np.put_along_axis(mask, order, True, axis=-1)
    return mask


def qmax_logit(x, temperature) -> np.ndarray:
    """The qmax_confidence logit: logit(clip(q_max, 1e-6, 1 - 1e-6)) per row, q_max = max softmax(x / T'),
    T' = T where T > 0 else 1 (1 where the row maximum of x / T' is not finite)."""
    t = np.asarray(temperature, dtype=F32).reshape(-1)
    p, _ = target_probs(x, np.where(t > 0, t, F32(1)))
    q = np.clip(p.max(axis=-1), F32(QMAX_CLIP), F32(1 - QMAX_CLIP))
    return (np.log(q) - np.log(F32(1) - q)).astype(F32)


def markov_draft(base_logits, conf_base, anchor, markov_w1, markov_w2, conf_w, d2t, *, steps: int,
                 logit_scale: float = 1.0, draft_topk: int = 0, qmax_confidence: int = 0
                 ) -> tuple[np.ndarray, np.ndarray]:
    """MarkovDraft: greedy sequential Markov stage of a DSpark draft step -> (draft_tokens [R, N] int64,
    confidence_logits [R, N] float32). See spec.MARKOV_DRAFT."""
    base = np.asarray(base_logits, dtype=F32)
    if base.ndim != 3 or base.shape[1] != steps:
        raise ValueError(f"MarkovDraft.base_logits must be [R, {steps}, V], got shape {base.shape}")
    cb = np.asarray(conf_base, dtype=F32)
    w1, w2 = np.asarray(markov_w1, dtype=F32), np.asarray(markov_w2, dtype=F32)
    wc, d2t = np.asarray(conf_w, dtype=F32), np.asarray(d2t, dtype=np.int64)
    r, n, _ = base.shape
    cand = topk_mask(base, draft_topk)
    prev = np.asarray(anchor, dtype=np.int64).reshape(r)
    tokens, conf = np.zeros((r, n), np.int64), np.zeros((r, n), F32)
    for i in range(n):
        e = w1[prev]  # [R, K]
        x = base[:, i] + F32(logit_scale) * (e @ w2.T)
        x = np.where(cand[:, i], x, F32(-np.inf))
        d = argmax_lowest(x)
        prev = d + d2t[d]
        tokens[:, i] = prev
        conf[:, i] = qmax_logit(x, np.ones(r, F32)) if qmax_confidence else cb[:, i] + e @ wc
    return tokens, conf


def markov_sample(base_logits, conf_base, anchor, markov_w1, markov_w2, conf_w, d2t, temperature, uniforms, *,
                  steps: int, logit_scale: float = 1.0, draft_topk: int = 0, qmax_confidence: int = 0):
    """MarkovSample -> (draft_tokens [R, N] int64, confidence_logits [R, N], draft_probs [R, N, T] float32).
    See spec.MARKOV_SAMPLE."""
    base = np.asarray(base_logits, dtype=F32)
    if base.ndim != 3 or base.shape[1] != steps:
        raise ValueError(f"MarkovSample.base_logits must be [R, {steps}, V], got shape {base.shape}")
    cb = np.asarray(conf_base, dtype=F32)
    w1, w2 = np.asarray(markov_w1, dtype=F32), np.asarray(markov_w2, dtype=F32)
    wc, d2t = np.asarray(conf_w, dtype=F32), np.asarray(d2t, dtype=np.int64)
    temp, u = np.asarray(temperature, dtype=F32), np.asarray(uniforms, dtype=F32)
    r, n, v = base.shape
    cand = topk_mask(base, draft_topk)
    to_target = np.arange(v) + d2t
    prev = np.asarray(anchor, dtype=np.int64).reshape(r)
    tokens, conf = np.zeros((r, n), np.int64), np.zeros((r, n), F32)
    probs = np.zeros((r, n, w1.shape[0]), F32)
    for i in range(n):
        e = w1[prev]
        x = np.where(cand[:, i], base[:, i] + F32(logit_scale) * (e @ w2.T), F32(-np.inf))
        q, _ = target_probs(x, temp)
        d = inverse_cdf(q, u[:, i])
        prev = to_target[d]
        tokens[:, i] = prev
        conf[:, i] = qmax_logit(x, temp) if qmax_confidence else cb[:, i] + e @ wc
        probs[:, i, to_target] = q
    return tokens, conf, probs


def markov_sample_cases(seed: int = 0) -> dict[str, dict]:
    """Named MarkovSample inputs: the MarkovDraft cases plus temperatures (greedy rows included) and uniforms."""
    rng = np.random.default_rng(seed + 100)
    cases = {}
    for name, c in markov_cases(seed).items():
        r, n = c["conf_base"].shape
        temp = rng.choice(np.array([0.0, 0.5, 1.0, 1.7], F32), r)
        temp[0] = 1.0
        cases[name] = dict(c, temperature=temp, uniforms=rng.random((r, n)).astype(F32))
    return cases


def markov_cases(seed: int = 0) -> dict[str, dict]:
    """Named MarkovDraft inputs (keyword arguments of `markov_draft`)."""
    rng = np.random.default_rng(seed)

    def case(r, n, v, t, k, *, topk=0, reduced=False, scale=1.0):
        d2t = np.zeros(v, np.int64)
        if reduced:
            keep = np.sort(rng.choice(t, size=v, replace=False))
            d2t = keep - np.arange(v)
        return dict(base_logits=(rng.standard_normal((r, n, v)) * 2).astype(F32),
                    conf_base=rng.standard_normal((r, n)).astype(F32), anchor=rng.integers(0, t, r),
                    markov_w1=rng.standard_normal((t, k)).astype(F32), markov_w2=rng.standard_normal((v, k)).astype(F32),
                    conf_w=rng.standard_normal(k).astype(F32), d2t=d2t, steps=n, logit_scale=scale, draft_topk=topk)

    cases = {"dense": case(3, 4, 50, 50, 6), "one_step": case(2, 1, 33, 33, 4),
             "reduced_vocab": case(3, 5, 40, 90, 8, reduced=True), "topk": case(4, 4, 60, 60, 5, topk=3),
             "topk_reduced_scaled": case(2, 6, 30, 70, 4, topk=7, reduced=True, scale=0.6),
             "large_vocab": case(2, 3, 5000, 5000, 16, topk=0), "zero_rank_weights": case(2, 3, 20, 20, 3),
             "non_finite": case(3, 3, 24, 24, 4)}
    z = cases["zero_rank_weights"]
    z["markov_w1"][:] = 0.0  # no bias: pure base argmax; base has ties -> lowest index
    z["base_logits"][:, :, 5:9] = 10.0
    t = cases["topk"]
    t["base_logits"][0, 0, [2, 7, 11, 40]] = 9.0  # four-way tie at the top with k = 3: indices 2, 7, 11
    nf = cases["non_finite"]["base_logits"]
    nf[0, 1] = -np.inf  # no finite logit: token 0, q_max = 1
    nf[1, 0, [3, 9]] = np.inf  # +inf ties: the lowest index, q_max = 1
    nf[2, 2, 5:] = -np.inf
    return cases
