"""Triton kernels for the dspark ops, their torch launchers, and AOT (PTX) compilation for TensorRT.

Kernel argument order is the TensorRT AOT plugin ABI: input pointers, then int32 scalars (passed by
TensorRT as ``trtp.SymIntExprs``), then output pointers, then constexprs. The same kernels serve the JIT
launchers below, the TensorRT JIT plugin (``@trtp.impl``) and the AOT plugin (``@trtp.aot_impl``).

* ``survival_kernel``: one program per row; the temperatures are a constexpr tuple baked into the
  kernel (TensorRT does not serialize plugin attributes for AOT plugins).
* ``greedy_accept_kernel`` / ``sample_accept_kernel``: one program per request; the request offset is
  summed from ``verify_lens`` in BLOCK_R chunks (O(R) per program: negligible next to the O(V) row
  passes for any realistic R), the vocabulary is walked in BLOCK_V chunks, and the
  draft rows are walked with a ``while`` loop that stops at the first rejection. Offsets and draft
  counts are clamped to the M packed rows (scalar ``M``): TensorRT runs plugins while timing tactics on
  inputs of unspecified contents, and no ``verify_lens`` may then send a read out of bounds.
* AOT PTX is emitted in a pinned PTX ISA (plugins/ptx.py), not the newest Triton's ptxas knows.

Tests run these on CPU with the Triton interpreter. Interpretation is per process: ``TRITON_INTERPRET=1``
must be set before ``triton`` is first imported (triton's own library functions are decorated then), so
a process either interprets every kernel or none; AOT compilation needs a native process.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Sequence

import triton
import triton.language as tl

from dspark_trt.plugins import launch
from dspark_trt.plugins.markov_kernels import AOT_LAYOUT as _MARKOV_LAYOUT
from dspark_trt.plugins.markov_kernels import SAMPLE_AOT_LAYOUT as _MARKOV_SAMPLE_LAYOUT
from dspark_trt.plugins.markov_kernels import markov_draft_kernel, markov_sample_kernel  # noqa: F401 (AOT by name)
from dspark_trt.plugins.spec import check_temperatures


def interpreting() -> bool:
    """Is Triton running kernels in its CPU interpreter? `triton.knobs` (Triton >= 3.4) when present,
    else the TRITON_INTERPRET variable that older releases read at import."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# ------------------------------------------------------------------------------------------ helpers
@triton.jit
def _request_rows(lens_ptr, r, M, BLOCK_R: tl.constexpr):
    """(o_r, n_r): request r's first packed row o_r = sum_{s<r} (L_s + 1) and its draft count n_r = L_r,
    clamped so that rows o_r .. o_r + n_r lie in [0, M). Valid inputs (L >= 0, sum(L + 1) == M) are
    unchanged; any other int64 data (TensorRT times plugins on inputs of unspecified contents) stays in
    bounds instead of faulting."""
    acc = tl.zeros([BLOCK_R], dtype=tl.int64)
    for s0 in range(0, r, BLOCK_R):
        idx = s0 + tl.arange(0, BLOCK_R)
        ls = tl.load(lens_ptr + idx, mask=idx < r, other=0).to(tl.int64)
        acc += tl.where(idx < r, tl.minimum(tl.maximum(ls, 0), M) + 1, 0)
    last = tl.maximum(M - 1, 0).to(tl.int64)
    o = tl.minimum(tl.sum(acc, axis=0), last)
    n = tl.load(lens_ptr + r).to(tl.int64)
    n = tl.minimum(tl.maximum(n, 0), last - o)
    return o, n


@triton.jit
def _row_argmax(row_ptr, V, BLOCK_V: tl.constexpr):
    """Lowest-index argmax of one row (all -inf -> 0)."""
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        m = offs < V
        x = tl.load(row_ptr + offs, mask=m, other=float("-inf")).to(tl.float32)
        bmax = tl.max(x, axis=0)
        bidx = tl.min(tl.where(m & (x == bmax), offs, V), axis=0)
        better = bmax > best_val
        best_idx = tl.where(better, bidx, best_idx)
        best_val = tl.where(better, bmax, best_val)
    return best_idx


@triton.jit
def _row_stats(row_ptr, V, T, BLOCK_V: tl.constexpr):
    """For p = softmax(logits / T): (argmax, shift, sum, greedy) with p_i = exp(x_i/t - shift) / sum,
    or greedy (one-hot of argmax) when T <= 0 or max(logits / T) is not finite."""
    t = tl.where(T > 0, T, 1.0)
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    zmax = tl.full([], float("-inf"), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        m = offs < V
        x = tl.load(row_ptr + offs, mask=m, other=float("-inf")).to(tl.float32)
        bmax = tl.max(x, axis=0)
        bidx = tl.min(tl.where(m & (x == bmax), offs, V), axis=0)
        better = bmax > best_val
        best_idx = tl.where(better, bidx, best_idx)
        best_val = tl.where(better, bmax, best_val)
        zmax = tl.maximum(zmax, tl.max(x / t, axis=0))
    finite = tl.abs(zmax) < float("inf")
    greedy = (T > 0) == 0
    greedy = greedy | (finite == 0)
    shift = tl.where(finite, zmax, 0.0)
    total = tl.full([], 0.0, tl.float32)
    v_soft = tl.where(greedy, 0, V)  # greedy rows need no sum
    for v0 in range(0, v_soft, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        m = offs < V
        x = tl.load(row_ptr + offs, mask=m, other=float("-inf")).to(tl.float32)
        total += tl.sum(tl.where(m, tl.exp(x / t - shift), 0.0), axis=0)
    return best_idx, shift, tl.where(greedy, 1.0, total), greedy


@triton.jit
def _probs(x, offs, t, shift, total, am, greedy):
    p = tl.exp(x / t - shift) / total
    return tl.where(greedy, tl.where(offs == am, 1.0, 0.0), p)


@triton.jit
def _accept_test(logits_ptr, q_ptr, draft_ptr, ua_ptr, row, active, V, t, am, shift, total, greedy):
    """Is draft token x = draft[row] accepted: u < min(1, p(x)/q(x)) (q(x) = 0: p(x) > 0)."""
    x = tl.load(draft_ptr + row, mask=active, other=-1)
    valid = active & (x >= 0) & (x < V)
    xc = tl.where(valid, x, 0)
    lx = tl.load(logits_ptr + row * V + xc, mask=valid, other=0.0).to(tl.float32)
    px = _probs(lx, xc, t, shift, total, am.to(tl.int64), greedy)
    px = tl.where(valid, px, 0.0)
    qx = tl.load(q_ptr + row * V + xc, mask=valid, other=0.0).to(tl.float32)
    u = tl.load(ua_ptr + row, mask=active, other=1.0)
    q_pos = qx > 0
    ratio = tl.minimum(px / tl.where(q_pos, qx, 1.0), 1.0)
    ok = tl.where(q_pos, u < ratio, px > 0)
    return ok & active


# ------------------------------------------------------------------------------------------ kernels
@triton.jit
def survival_kernel(logits_ptr, prev_ptr, start_ptr, R, J, out_ptr,
                    TEMPS: tl.constexpr, NT: tl.constexpr, BLOCK_J: tl.constexpr):
    r = tl.program_id(0)
    prev = tl.load(prev_ptr + r).to(tl.float32)
    start = tl.load(start_ptr + r).to(tl.int64)
    base = r.to(tl.int64) * J
    carry = tl.full([], 0.0, tl.float32)
    for j0 in range(0, J, BLOCK_J):
        cols = j0 + tl.arange(0, BLOCK_J)
        m = cols < J
        x = tl.load(logits_ptr + base + cols, mask=m, other=0.0).to(tl.float32)
        pos = tl.minimum(tl.maximum(start + cols, 0), NT - 1)
        temp = tl.full([BLOCK_J], TEMPS[0], tl.float32)
        for i in tl.static_range(1, NT):
            temp = tl.where(pos == i, TEMPS[i], temp)
        y = x / temp
        log_sig = tl.minimum(y, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(y)))
        cs = tl.cumsum(tl.where(m, log_sig, 0.0), axis=0) + carry
        tl.store(out_ptr + base + cols, prev * tl.exp(cs), mask=m)
        carry = tl.min(cs, axis=0)  # log-survival is non-increasing along J


@triton.jit
def greedy_accept_kernel(logits_ptr, draft_ptr, lens_ptr, R, M, V_in, accepted_ptr, next_ptr,
                         BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr):
    r = tl.program_id(0)
    o, n = _request_rows(lens_ptr, r, M, BLOCK_R)
    V = tl.where(M > 0, V_in, 0)  # no rows: read nothing
    j = o * 0
    am = _row_argmax(logits_ptr + o * V, V, BLOCK_V).to(tl.int64)
    tok = tl.load(draft_ptr + o, mask=n > 0, other=-1).to(tl.int64)
    while (j < n) & (am == tok):
        j += 1
        am = _row_argmax(logits_ptr + (o + j) * V, V, BLOCK_V).to(tl.int64)
        tok = tl.load(draft_ptr + o + j, mask=j < n, other=-1).to(tl.int64)
    tl.store(accepted_ptr + r, j)
    tl.store(next_ptr + r, am)


@triton.jit
def sample_accept_kernel(logits_ptr, q_ptr, draft_ptr, lens_ptr, temp_ptr, ua_ptr, us_ptr, R, M, V_in,
                         accepted_ptr, next_ptr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr):
    r = tl.program_id(0)
    o, n = _request_rows(lens_ptr, r, M, BLOCK_R)
    V = tl.where(M > 0, V_in, 0)  # no rows: read nothing
    T = tl.load(temp_ptr + r).to(tl.float32)
    t = tl.where(T > 0, T, 1.0)
    j = o * 0
    am, shift, total, greedy = _row_stats(logits_ptr + o * V, V, T, BLOCK_V)
    ok = _accept_test(logits_ptr, q_ptr, draft_ptr, ua_ptr, o, n > 0, V, t, am, shift, total, greedy)
    while ok:
        j += 1
        am, shift, total, greedy = _row_stats(logits_ptr + (o + j) * V, V, T, BLOCK_V)
        ok = _accept_test(logits_ptr, q_ptr, draft_ptr, ua_ptr, o + j, j < n, V, t, am, shift, total, greedy)

    # final draw at row o + j: the residual max(p - q, 0) after a rejection (p if it sums to 0),
    # the bonus from p otherwise; inverse CDF over the unnormalised weights.
    row = o + j
    rejected = j < n
    am64 = am.to(tl.int64)
    p_ptr = logits_ptr + row * V
    qrow_ptr = q_ptr + row * V
    tot_res = tl.full([], 0.0, tl.float32)
    tot_p = tl.full([], 0.0, tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        m = offs < V
        x = tl.load(p_ptr + offs, mask=m, other=float("-inf")).to(tl.float32)
        p = tl.where(m, _probs(x, offs, t, shift, total, am64, greedy), 0.0)
        qv = tl.load(qrow_ptr + offs, mask=tl.where(rejected, m, False), other=0.0).to(tl.float32)
        tot_res += tl.sum(tl.maximum(p - qv, 0.0), axis=0)
        tot_p += tl.sum(p, axis=0)
    use_res = rejected & (tot_res > 0)
    thr = tl.load(us_ptr + r).to(tl.float32) * tl.where(use_res, tot_res, tot_p)
    carry = tl.full([], 0.0, tl.float32)
    first = tl.full([], 0, tl.int32) + V
    last_nz = tl.full([], -1, tl.int32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        m = offs < V
        x = tl.load(p_ptr + offs, mask=m, other=float("-inf")).to(tl.float32)
        p = tl.where(m, _probs(x, offs, t, shift, total, am64, greedy), 0.0)
        qv = tl.load(qrow_ptr + offs, mask=tl.where(rejected, m, False), other=0.0).to(tl.float32)
        w = tl.where(use_res, tl.maximum(p - qv, 0.0), p)
        cs = tl.cumsum(w, axis=0) + carry
        first = tl.minimum(first, tl.min(tl.where(m & (cs > thr), offs, V), axis=0))
        last_nz = tl.maximum(last_nz, tl.max(tl.where(m & (w > 0), offs, -1), axis=0))
        carry = tl.max(cs, axis=0)
    tl.store(accepted_ptr + r, j)
    tl.store(next_ptr + r, tl.maximum(tl.minimum(first, last_nz), 0).to(tl.int64))


# --------------------------------------------------------------------------------- torch launchers
# No FMA contraction: keeps the float32 arithmetic closest to the numpy reference (and the choice is
# explicit instead of Triton's changing default).
FP_FUSION = False

def _torch():
    import torch

    return torch


def _check_rows(verify_lens, rows: int) -> None:
    if verify_lens.numel() and (verify_lens < 0).any().item():
        raise ValueError("verify_lens must be >= 0")
    total = int((verify_lens.to(_torch().int64) + 1).sum().item()) if verify_lens.numel() else 0
    if total != rows:
        raise ValueError(f"packed rows: sum(verify_lens + 1) = {total} but logits has {rows} rows")


def survival(logits, prev, start, temperatures: Sequence[float], out=None):
    """Survival on torch tensors (any device Triton runs on; CPU under TRITON_INTERPRET=1)."""
    torch = _torch()
    temps = tuple(check_temperatures(temperatures))
    rows, cols = logits.shape
    if out is None:
        out = torch.empty((rows, cols), dtype=torch.float32, device=logits.device)
    if rows == 0 or cols == 0:
        return out
    cfg = launch.survival_launch(rows, cols)
    survival_kernel[cfg.grid](logits.contiguous(), prev.contiguous(), start.contiguous(), rows, cols, out,
                              TEMPS=temps, NT=len(temps), num_warps=cfg.num_warps,
                              enable_fp_fusion=FP_FUSION, **cfg.constexprs)
    return out


def greedy_accept(logits, draft_tokens, verify_lens, out=None, check: bool = True):
    """GreedyAccept on torch tensors -> (accepted, next_token) int64 [R]."""
    torch = _torch()
    rows, vocab = logits.shape
    n_req = verify_lens.shape[0]
    if check:
        _check_rows(verify_lens, rows)
    acc, nxt = out if out is not None else (
        torch.empty(n_req, dtype=torch.int64, device=logits.device),
        torch.empty(n_req, dtype=torch.int64, device=logits.device))
    if n_req == 0:
        return acc, nxt
    cfg = launch.accept_launch(n_req, vocab)
    greedy_accept_kernel[cfg.grid](logits.contiguous(), draft_tokens.contiguous(), verify_lens.contiguous(),
                                   n_req, rows, vocab, acc, nxt, num_warps=cfg.num_warps,
                                   enable_fp_fusion=FP_FUSION, **cfg.constexprs)
    return acc, nxt


def sample_accept(logits, draft_probs, draft_tokens, verify_lens, temperature, accept_uniforms,
                  sample_uniforms, out=None, check: bool = True):
    """SampleAccept on torch tensors -> (accepted, next_token) int64 [R]."""
    torch = _torch()
    rows, vocab = logits.shape
    n_req = verify_lens.shape[0]
    if check:
        _check_rows(verify_lens, rows)
        if tuple(draft_probs.shape) != (rows, vocab):
            raise ValueError(f"draft_probs shape {tuple(draft_probs.shape)} != logits shape {(rows, vocab)}")
    acc, nxt = out if out is not None else (
        torch.empty(n_req, dtype=torch.int64, device=logits.device),
        torch.empty(n_req, dtype=torch.int64, device=logits.device))
    if n_req == 0:
        return acc, nxt
    cfg = launch.accept_launch(n_req, vocab)
    f32 = torch.float32
    sample_accept_kernel[cfg.grid](
        logits.contiguous(), draft_probs.contiguous(), draft_tokens.contiguous(), verify_lens.contiguous(),
        temperature.to(f32).contiguous(), accept_uniforms.to(f32).contiguous(),
        sample_uniforms.to(f32).contiguous(), n_req, rows, vocab, acc, nxt, num_warps=cfg.num_warps,
        enable_fp_fusion=FP_FUSION, **cfg.constexprs)
    return acc, nxt


# ------------------------------------------------------------------------------ AOT for TensorRT
TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int64": "i64", "int32": "i32"}

# kernel, then per argument: ("in", spec input name) | ("scalar", symbol) | ("out", spec output name)
AOT_LAYOUT = {
    "Survival": ("survival_kernel", [("in", "logits"), ("in", "prev"), ("in", "start"), ("scalar", "R"),
                                     ("scalar", "J"), ("out", "survival")]),
    "GreedyAccept": ("greedy_accept_kernel", [("in", "logits"), ("in", "draft_tokens"), ("in", "verify_lens"),
                                              ("scalar", "R"), ("scalar", "M"), ("scalar", "V"),
                                              ("out", "accepted"), ("out", "next_token")]),
    "SampleAccept": ("sample_accept_kernel", [("in", "logits"), ("in", "draft_probs"), ("in", "draft_tokens"),
                                              ("in", "verify_lens"), ("in", "temperature"),
                                              ("in", "accept_uniforms"), ("in", "sample_uniforms"),
                                              ("scalar", "R"), ("scalar", "M"), ("scalar", "V"),
                                              ("out", "accepted"), ("out", "next_token")]),
    "MarkovDraft": _MARKOV_LAYOUT,
    "MarkovSample": _MARKOV_SAMPLE_LAYOUT,
}


@dataclass(frozen=True)
class CompiledKernel:
    name: str
    ptx: str
    num_warps: int
    shared: int
    scalars: tuple[str, ...]  # symbols of the int32 scalar args, in order (TensorRT extra args)


def kernel_arg_names(kernel) -> list[str]:
    import inspect

    return list(inspect.signature(getattr(kernel, "fn", kernel)).parameters)


def aot_signature(op_name: str, input_dtypes: dict[str, str] | None = None) -> dict[str, str]:
    """Triton signature (arg name -> type) of an op's kernel; input dtypes by spec input name
    (defaults: the first dtype the spec allows, i.e. float32 / int64)."""
    from dspark_trt.plugins.spec import get_op

    op = get_op(op_name)
    kernel_name, layout = AOT_LAYOUT[op_name]
    arg_names = kernel_arg_names(globals()[kernel_name])
    dtypes = {t.name: t.dtypes[0] for t in (*op.inputs, *op.outputs)}
    for k, v in (input_dtypes or {}).items():
        allowed = next(t.dtypes for t in op.inputs if t.name == k)
        if v not in allowed:
            raise ValueError(f"{op_name}.{k}: dtype {v} not in {allowed}")
        dtypes[k] = v
    sig = {}
    for arg, (kind, what) in zip(arg_names, layout):
        sig[arg] = "i32" if kind == "scalar" else "*" + TRITON_TYPES[dtypes[what]]
    for arg in arg_names[len(layout):]:
        sig[arg] = "constexpr"
    return sig


def aot_constexprs(op_name: str, vocab: int | None = None, temperatures: Sequence[float] | None = None,
                   rank: int | None = None, logit_scale: float = 1.0, draft_topk: int = 0,
                   qmax_confidence: int = 0) -> dict:
    if op_name in ("MarkovDraft", "MarkovSample"):
        cfg = launch.markov_launch(0, launch.MAX_BLOCK_V if vocab is None else vocab, rank or launch.MAX_BLOCK_K)
        return {"SCALE": float(logit_scale), "TOPK": int(draft_topk), **cfg.constexprs,
                "QMAX": int(qmax_confidence)}
    if op_name == "Survival":
        temps = tuple(check_temperatures(temperatures if temperatures is not None else []))
        cfg = launch.aot_survival_launch()
        return {"TEMPS": temps, "NT": len(temps), **cfg.constexprs}
    return dict(launch.aot_accept_launch(vocab).constexprs)  # vocab None: not static, largest block


def aot_num_warps(op_name: str, vocab: int | None = None, rank: int | None = None) -> int:
    if op_name in ("MarkovDraft", "MarkovSample"):
        return launch.markov_launch(0, launch.MAX_BLOCK_V if vocab is None else vocab,
                                    rank or launch.MAX_BLOCK_K).num_warps
    if op_name == "Survival":
        return launch.aot_survival_launch().num_warps
    return launch.aot_accept_launch(vocab).num_warps


def compile_ptx(op_name: str, *, input_dtypes: dict[str, str] | None = None, vocab: int | None = None,
                temperatures: Sequence[float] | None = None, target: tuple[str, int, int] | None = None,
                **markov) -> CompiledKernel:
    """Compile an op's kernel to PTX for the TensorRT AOT plugin.

    target: (backend, compute capability as int, warp size), e.g. ("cuda", 90, 32); default: the current
    device. Triton >= 3.3 appends two hidden scratch-pointer parameters to every kernel; TensorRT passes
    only inputs, extra args and outputs, so they are removed from the PTX entry (after checking the
    kernel needs no scratch memory and never reads them).
    """
    from triton.backends.compiler import GPUTarget

    from dspark_trt.plugins import ptx as ptx_isa

    if interpreting():
        raise RuntimeError("compile_ptx needs native Triton; it was imported with TRITON_INTERPRET=1")
    kernel_name, layout = AOT_LAYOUT[op_name]
    kernel = globals()[kernel_name]
    sig = aot_signature(op_name, input_dtypes)
    consts = aot_constexprs(op_name, vocab, temperatures, **markov)  # rank, logit_scale, draft_topk, qmax_confidence
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=consts)
    if target is None:
        target = _current_target()
    # PTX ISA pinned to what the drivers of the supported TensorRT range accept (plugins/ptx.py).
    options = {"num_warps": aot_num_warps(op_name, vocab, markov.get("rank")), "enable_fp_fusion": FP_FUSION,
               "ptx_version": ptx_isa.ptx_isa_for(int(target[1]))}
    compiled = triton.compile(src, target=GPUTarget(*target), options=options)
    md = compiled.metadata
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        raise RuntimeError(f"{kernel_name} needs Triton scratch memory, which TensorRT AOT plugins cannot pass")
    ptx = compiled.asm["ptx"]
    ptx = strip_hidden_params(ptx, md.name, len(layout))
    return CompiledKernel(name=md.name, ptx=ptx, num_warps=md.num_warps, shared=md.shared,
                          scalars=tuple(w for k, w in layout if k == "scalar"))


def _current_target() -> tuple:
    t = triton.runtime.driver.active.get_current_target()
    return (t.backend, t.arch, t.warp_size)


_ENTRY = re.compile(r"(\.entry\s+(?P<name>[\w$]+)\s*\()(?P<params>[^)]*)(\))", re.S)


def ptx_entry_params(ptx: str, kernel_name: str) -> list[str]:
    """Parameter names of the PTX entry ``kernel_name``."""
    for m in _ENTRY.finditer(ptx):
        if m.group("name") == kernel_name:
            return [p.strip().split()[-1] for p in m.group("params").split(",") if p.strip()]
    raise ValueError(f"no .entry {kernel_name} in the PTX")


def strip_hidden_params(ptx: str, kernel_name: str, visible: int) -> str:
    """Drop entry parameters after the first ``visible`` ones, if the body never references them."""
    for m in _ENTRY.finditer(ptx):
        if m.group("name") != kernel_name:
            continue
        params = [p for p in m.group("params").split(",") if p.strip()]
        if len(params) < visible:
            raise ValueError(f"{kernel_name} has {len(params)} PTX parameters, expected >= {visible}")
        hidden = [p.strip().split()[-1] for p in params[visible:]]
        body = ptx[m.end():]
        used = [h for h in hidden if re.search(rf"\b{re.escape(h)}\b", body)]
        if used:
            raise RuntimeError(f"{kernel_name} reads hidden parameters {used}; cannot launch it from TensorRT")
        kept = ",".join(params[:visible])
        if not kept.endswith("\n"):
            kept += "\n"
        return ptx[:m.start()] + m.group(1) + kept + m.group(4) + ptx[m.end():]
    raise ValueError(f"no .entry {kernel_name} in the PTX")
