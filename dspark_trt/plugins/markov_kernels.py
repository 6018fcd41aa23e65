"""Triton kernel of MarkovDraft (the DSpark sequential stage) and its torch launcher.

Kernel argument order is the TensorRT AOT plugin ABI shared with `kernels.py`: input pointers, int32
scalars (R, N, V, K), output pointers, then constexprs (the logit scale and top-k are baked in, like the
Survival temperatures, because AOT plugin attributes are not serialized).

One program per request walks its N positions in order (each depends on the token drafted before it):
the top-k threshold of a position, when asked for, is found by TOPK passes over the row, each taking the
next (value desc, index asc) entry, so the candidate set equals ONNX TopK's with ties toward the lower
index; then one pass over the vocabulary adds the Markov bias (markov_w2 rows . e) and keeps the lowest
index maximum. Only the [R, N] tokens and confidence logits are written. With QMAX (the ops'
qmax_confidence) the same pass keeps an online softmax normaliser, so q_max costs no extra pass.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dspark_trt.plugins import launch


@triton.jit
def _kth_candidate(row_ptr, V, k, BLOCK_V: tl.constexpr):
    """(value, index) of the k-th entry of the row in (value desc, index asc) order (k >= 1)."""
    thr_val = tl.full([], float("inf"), tl.float32)
    thr_idx = tl.full([], -1, tl.int32)
    for _ in range(0, k):
        best_val = tl.full([], float("-inf"), tl.float32)
        best_idx = tl.full([], 0x7FFFFFFF, tl.int32)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            m = offs < V
            x = tl.load(row_ptr + offs, mask=m, other=float("-inf")).to(tl.float32)
            ok = m & ((x < thr_val) | ((x == thr_val) & (offs > thr_idx)))
            xv = tl.where(ok, x, float("-inf"))
            bmax = tl.max(xv, axis=0)
            bidx = tl.min(tl.where(ok & (xv == bmax), offs, 0x7FFFFFFF), axis=0)
            better = (bmax > best_val) | ((bmax == best_val) & (bidx < best_idx))
            best_idx = tl.where(better, bidx, best_idx)
            best_val = tl.where(better, bmax, best_val)
        thr_val, thr_idx = best_val, best_idx
    return thr_val, thr_idx


@triton.jit
def _bias_row(row_ptr, w2_ptr, e, offs, m, K, kk, km, thr_val, thr_idx, SCALE: tl.constexpr):
    """x = base + SCALE * (markov_w2 @ e) on one block of the vocabulary, -inf outside the candidates."""
    b = tl.load(row_ptr + offs, mask=m, other=float("-inf")).to(tl.float32)
    w2 = tl.load(w2_ptr + offs.to(tl.int64)[:, None] * K + kk[None, :], mask=m[:, None] & km[None, :],
                 other=0.0).to(tl.float32)
    x = b + SCALE * tl.sum(w2 * e[None, :], axis=1)
    cand = m & ((b > thr_val) | ((b == thr_val) & (offs <= thr_idx)))
    return tl.where(cand, x, float("-inf"))


@triton.jit
def _qmax_logit(p):
    """qmax_confidence: logit of p clipped to [1e-6, 1 - 1e-6] (spec.QMAX_CLIP)."""
    p = tl.minimum(tl.maximum(p, 1e-6), 1.0 - 1e-6)
    return tl.log(p) - tl.log(1.0 - p)


@triton.jit
def markov_draft_kernel(base_ptr, cb_ptr, anchor_ptr, w1_ptr, w2_ptr, wc_ptr, d2t_ptr, R, N, V, K,
                        tokens_ptr, conf_ptr,
                        SCALE: tl.constexpr, TOPK: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                        QMAX: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    km = kk < K
    wc = tl.load(wc_ptr + kk, mask=km, other=0.0).to(tl.float32)
    prev = tl.load(anchor_ptr + r).to(tl.int64)
    for i in range(0, N):
        slot = r * N + i
        row_ptr = base_ptr + slot * V
        thr_val = tl.full([], float("-inf"), tl.float32)
        thr_idx = tl.full([], 0x7FFFFFFF, tl.int32)
        if TOPK > 0:
            thr_val, thr_idx = _kth_candidate(row_ptr, V, tl.minimum(V, TOPK), BLOCK_V)
        e = tl.load(w1_ptr + prev * K + kk, mask=km, other=0.0).to(tl.float32)
        best_val = tl.full([], float("-inf"), tl.float32)
        best_idx = tl.full([], 0, tl.int32)
        shift = tl.full([], 0.0, tl.float32)  # QMAX: online softmax normaliser denom, relative to shift
        denom = tl.full([], 0.0, tl.float32)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            m = offs < V
            x = _bias_row(row_ptr, w2_ptr, e, offs, m, K, kk, km, thr_val, thr_idx, SCALE)
            bmax = tl.max(x, axis=0)
            bidx = tl.min(tl.where(m & (x == bmax), offs, V), axis=0)
            better = bmax > best_val
            best_idx = tl.where(better, bidx, best_idx)
            best_val = tl.where(better, bmax, best_val)
            if QMAX:
                new_shift = tl.where(tl.abs(best_val) < float("inf"), best_val, 0.0)
                denom = denom * tl.exp(shift - new_shift) + tl.sum(tl.where(m, tl.exp(x - new_shift), 0.0), axis=0)
                shift = new_shift
        tok = best_idx.to(tl.int64) + tl.load(d2t_ptr + best_idx).to(tl.int64)
        tl.store(tokens_ptr + slot, tok)
        if QMAX:  # q_max = exp(best - shift) / denom = 1 / denom; 1 when the row max is not finite
            conf = _qmax_logit(1.0 / tl.where(tl.abs(best_val) < float("inf"), denom, 1.0))
        else:
            conf = tl.load(cb_ptr + slot).to(tl.float32) + tl.sum(e * wc, axis=0)
        tl.store(conf_ptr + slot, conf)
        prev = tok


AOT_LAYOUT = ("markov_draft_kernel", [("in", "base_logits"), ("in", "conf_base"), ("in", "anchor"),
                                      ("in", "markov_w1"), ("in", "markov_w2"), ("in", "conf_w"), ("in", "d2t"),
                                      ("scalar", "R"), ("scalar", "N"), ("scalar", "V"), ("scalar", "K"),
                                      ("out", "draft_tokens"), ("out", "confidence_logits")])


def markov_draft(base_logits, conf_base, anchor, markov_w1, markov_w2, conf_w, d2t, *, steps: int,
                 logit_scale: float = 1.0, draft_topk: int = 0, qmax_confidence: int = 0, out=None):
    """MarkovDraft on torch tensors -> (draft_tokens int64 [R, N], confidence_logits float32 [R, N])."""
    import torch

    from dspark_trt.plugins.kernels import FP_FUSION

    r, n, v = base_logits.shape
    k = markov_w1.shape[1]
    if n != steps:
        raise ValueError(f"MarkovDraft.base_logits must be [R, {steps}, V], got {tuple(base_logits.shape)}")
    if k > launch.MAX_BLOCK_K:
        raise ValueError(f"MarkovDraft supports markov rank <= {launch.MAX_BLOCK_K}, got {k}")
    dev = base_logits.device
    tokens, conf = out if out is not None else (torch.empty((r, n), dtype=torch.int64, device=dev),
                                                torch.empty((r, n), dtype=torch.float32, device=dev))
    if r == 0 or n == 0:
        return tokens, conf
    cfg = launch.markov_launch(r, v, k)
    markov_draft_kernel[cfg.grid](
        base_logits.contiguous(), conf_base.contiguous(), anchor.contiguous(), markov_w1.contiguous(),
        markov_w2.contiguous(), conf_w.contiguous(), d2t.contiguous(), r, n, v, k, tokens, conf,
        SCALE=float(logit_scale), TOPK=int(draft_topk), QMAX=int(qmax_confidence), num_warps=cfg.num_warps,
        enable_fp_fusion=FP_FUSION, **cfg.constexprs)
    return tokens, conf


# ------------------------------------------------------------------------------------ MarkovSample
@triton.jit
def markov_sample_kernel(base_ptr, cb_ptr, anchor_ptr, w1_ptr, w2_ptr, wc_ptr, d2t_ptr, temp_ptr, u_ptr,
                         R, N, V, K, T, tokens_ptr, conf_ptr, probs_ptr,
                         SCALE: tl.constexpr, TOPK: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                         QMAX: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    km = kk < K
    wc = tl.load(wc_ptr + kk, mask=km, other=0.0).to(tl.float32)
    prev = tl.load(anchor_ptr + r).to(tl.int64)
    t = tl.load(temp_ptr + r).to(tl.float32)
    safe_t = tl.where(t > 0.0, t, 1.0)
    for i in range(0, N):
        slot = r * N + i
        row_ptr = base_ptr + slot * V
        thr_val = tl.full([], float("-inf"), tl.float32)
        thr_idx = tl.full([], 0x7FFFFFFF, tl.int32)
        if TOPK > 0:
            thr_val, thr_idx = _kth_candidate(row_ptr, V, tl.minimum(V, TOPK), BLOCK_V)
        e = tl.load(w1_ptr + prev * K + kk, mask=km, other=0.0).to(tl.float32)
        # pass 1: lowest-index argmax and the row max of x / T
        best_val = tl.full([], float("-inf"), tl.float32)
        best_idx = tl.full([], 0, tl.int32)
        zmax = tl.full([], float("-inf"), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            m = offs < V
            x = _bias_row(row_ptr, w2_ptr, e, offs, m, K, kk, km, thr_val, thr_idx, SCALE)
            bmax = tl.max(x, axis=0)
            bidx = tl.min(tl.where(m & (x == bmax), offs, V), axis=0)
            better = bmax > best_val
            best_idx = tl.where(better, bidx, best_idx)
            best_val = tl.where(better, bmax, best_val)
            zmax = tl.maximum(zmax, tl.max(x / safe_t, axis=0))
        finite = tl.abs(zmax) < float("inf")
        greedy = (t <= 0.0) | (tl.abs(zmax) == float("inf"))
        shift = tl.where(finite, zmax, 0.0)
        # pass 2: softmax normaliser
        denom = tl.full([], 0.0, tl.float32)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            m = offs < V
            x = _bias_row(row_ptr, w2_ptr, e, offs, m, K, kk, km, thr_val, thr_idx, SCALE)
            denom += tl.sum(tl.where(m, tl.exp(x / safe_t - shift), 0.0), axis=0)
        # pass 3: total of q (as the reference sums it) and the last index with q > 0
        total = tl.full([], 0.0, tl.float32)
        last_nz = tl.full([], 0, tl.int32)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            m = offs < V
            x = _bias_row(row_ptr, w2_ptr, e, offs, m, K, kk, km, thr_val, thr_idx, SCALE)
            q = tl.where(greedy, tl.where(offs == best_idx, 1.0, 0.0), tl.exp(x / safe_t - shift) / denom)
            q = tl.where(m, q, 0.0)
            total += tl.sum(q, axis=0)
            last_nz = tl.maximum(last_nz, tl.max(tl.where(q > 0, offs, 0), axis=0))
        # pass 4: zero the target-vocabulary row, then scatter q and walk the CDF
        probs_row = probs_ptr + slot * T
        for t0 in range(0, T, BLOCK_V):
            toffs = t0 + tl.arange(0, BLOCK_V)
            tl.store(probs_row + toffs, tl.zeros([BLOCK_V], tl.float32), mask=toffs < T)
        tl.debug_barrier()
        thr = tl.load(u_ptr + slot).to(tl.float32) * total
        carry = tl.full([], 0.0, tl.float32)
        count = tl.full([], 0, tl.int32)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            m = offs < V
            x = _bias_row(row_ptr, w2_ptr, e, offs, m, K, kk, km, thr_val, thr_idx, SCALE)
            q = tl.where(greedy, tl.where(offs == best_idx, 1.0, 0.0), tl.exp(x / safe_t - shift) / denom)
            q = tl.where(m, q, 0.0)
            cdf = tl.cumsum(q, axis=0) + carry
            count += tl.sum(tl.where(m & (cdf <= thr), 1, 0), axis=0)
            carry = tl.max(tl.where(m, cdf, 0.0), axis=0)
            tgt = offs.to(tl.int64) + tl.load(d2t_ptr + offs, mask=m, other=0).to(tl.int64)
            tl.store(probs_row + tgt, q, mask=m)
        d = tl.minimum(count, last_nz)
        tok = d.to(tl.int64) + tl.load(d2t_ptr + d).to(tl.int64)
        tl.store(tokens_ptr + slot, tok)
        if QMAX:  # max softmax(x / safe_t) = 1 / denom: q_max at T, or MarkovDraft's for T <= 0 rows
            conf = _qmax_logit(1.0 / tl.where(finite, denom, 1.0))
        else:
            conf = tl.load(cb_ptr + slot).to(tl.float32) + tl.sum(e * wc, axis=0)
        tl.store(conf_ptr + slot, conf)
        prev = tok


SAMPLE_AOT_LAYOUT = ("markov_sample_kernel", [("in", "base_logits"), ("in", "conf_base"), ("in", "anchor"),
                                              ("in", "markov_w1"), ("in", "markov_w2"), ("in", "conf_w"),
                                              ("in", "d2t"), ("in", "temperature"), ("in", "uniforms"),
                                              ("scalar", "R"), ("scalar", "N"), ("scalar", "V"), ("scalar", "K"),
                                              ("scalar", "T"), ("out", "draft_tokens"),
                                              ("out", "confidence_logits"), ("out", "draft_probs")])


def markov_sample(base_logits, conf_base, anchor, markov_w1, markov_w2, conf_w, d2t, temperature, uniforms, *,
                  steps: int, logit_scale: float = 1.0, draft_topk: int = 0, qmax_confidence: int = 0, out=None):
    """MarkovSample on torch tensors -> (draft_tokens [R, N], confidence_logits [R, N], draft_probs [R, N, T])."""
    import torch

    from dspark_trt.plugins.kernels import FP_FUSION

    r, n, v = base_logits.shape
    t_vocab, k = markov_w1.shape
    if n != steps:
        raise ValueError(f"MarkovSample.base_logits must be [R, {steps}, V], got {tuple(base_logits.shape)}")
    if k > launch.MAX_BLOCK_K:
        raise ValueError(f"MarkovSample supports markov rank <= {launch.MAX_BLOCK_K}, got {k}")
    dev = base_logits.device
    tokens, conf, probs = out if out is not None else (
        torch.empty((r, n), dtype=torch.int64, device=dev), torch.empty((r, n), dtype=torch.float32, device=dev),
        torch.empty((r, n, t_vocab), dtype=torch.float32, device=dev))
    if r == 0 or n == 0:
        return tokens, conf, probs
    cfg = launch.markov_launch(r, v, k)
    markov_sample_kernel[cfg.grid](
        base_logits.contiguous(), conf_base.contiguous(), anchor.contiguous(), markov_w1.contiguous(),
        markov_w2.contiguous(), conf_w.contiguous(), d2t.contiguous(), temperature.contiguous(),
        uniforms.contiguous(), r, n, v, k, t_vocab, tokens, conf, probs,
        SCALE=float(logit_scale), TOPK=int(draft_topk), QMAX=int(qmax_confidence), num_warps=cfg.num_warps,
        enable_fp_fusion=FP_FUSION, **cfg.constexprs)
    return tokens, conf, probs
