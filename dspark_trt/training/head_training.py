"""`dspark-trt train-head`: fit the confidence head on real acceptance labels.

1. Roll the frozen draft out on the training texts (`rollout.py`): per context and draft position k,
   the draft's final hidden state h_k, the previous token x_{k-1}, statistics s(q_k) of the draft's
   distribution and the label.
2. Fit c_k = sigmoid(w . [h_k ; s(q_k) ; e(x_{k-1})] + b) by weighted binary cross-entropy on those
   features (precomputed once; the head is tiny, so thousands of Adam steps take seconds). With
   stats=() the head is the plain DSpark form on [h_k ; e(x_{k-1})].

Labels: "expected" (default) is the soft 1 - TV(p_target, q_draft) = sum_v min(p, q), the acceptance
probability under speculative sampling (DSpark); "greedy" is exact match of the greedy draft token with
the target's argmax.

c_k is the probability that position k is accepted *given positions 1..k-1 were* (DESIGN.md §1), so each
position's label is weighted by the probability that its prefix survived (1 for k = 1; for greedy labels
1[all earlier matched], for expected labels prod_{i<k} (1 - TV_i)). Training on unconditional labels would
make S_k = prod c_i the product of marginals, which underestimates survival (acceptances are correlated).

Capacity: the exported formula is linear in its features, which we keep exactly. To make the most of it
the dense features [h ; s] are standardised during training (per-dimension mean/std of the training
rows), and the standardisation is folded back into w and b when saving, so the saved head is the plain
formula.
The bias starts at the logit of the mean label; 10% of the contexts are held out and the weights with
the best held-out loss are kept (early stopping: the e(x_prev) table has vocab x rank parameters).

prev_embed=False (`--no-prev-embed`) keeps the e(x_prev) table at zero instead of learning it, so the
head is sigmoid(w . [h ; s] + b) in the unchanged exported form (the table and its weights are zeros).
With Adam every row of the table takes full-size steps whenever its token occurs, so rare tokens get
memorised: on the bundled pair (16k training contexts, vocab 4096) even a rank-1 table lowered held-out
AUROC at k = 1 (0.785 against 0.813 without it) and left a miscalibration temperature scaling could not
remove (ECE 0.028 against 0.017 at k = 1 on 8192 held-out contexts).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark_trt.errors import DsparkError
from dspark_trt.models.confidence_head import DEFAULT_STATS, HEAD_CONFIG, HEAD_WEIGHTS, ConfidenceHead, check_stats
from dspark_trt.training import metrics

DEFAULT_CONTEXTS = 4096  # rolled-out contexts; x max_draft labelled positions
DEFAULT_CONTEXT_LEN = 128
MIN_CONTEXTS = 256  # distinct contexts the training data must hold (fewer: memorised, not learned)

@dataclass
class FitStats:
    train_rows: int
    val_rows: int
    steps: int
    best_step: int
    train_loss: float
    val_loss: float
    val_loss_init: float  # constant predictor (mean label): the head must beat this
    val_auroc: float  # conditional AUROC of c_k vs the greedy match (rows whose prefix matched)
    val_auroc_fallback: float  # same for the draft's max probability

    def to_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in self.__dict__.items()}


def fit_head(hidden: np.ndarray, prev_token: np.ndarray, label: np.ndarray, weight: np.ndarray, vocab_size: int,
             rank: int = 64, max_draft: int | None = None, steps: int = 2000, seed: int = 0, lr: float = 3e-3,
             batch_size: int = 1024, weight_decay: float = 1e-2, val_fraction: float = 0.1,
             greedy_match: np.ndarray | None = None, fallback_conf: np.ndarray | None = None,
             stats: np.ndarray | None = None, stat_names=(), prev_embed: bool = True,
             progress: bool = True) -> tuple[ConfidenceHead, FitStats]:
    """Fit a ConfidenceHead on features shaped [N, K, H] / [N, K] (rows split into train/val by context).

    label: targets in [0, 1]; weight: per-row loss weights (rows with weight 0 are dropped).
    stats: [N, K, len(stat_names)] draft statistics (`draft_stats`), when the head uses any.
    greedy_match / fallback_conf (optional, [N, K]): only for the reported held-out AUROCs.
    prev_embed: learn the previous-token embedding e(x_prev); False keeps it (and its weights) at zero.
    """
    import torch
    from tqdm import tqdm

    stat_names = check_stats(stat_names)
    if stat_names and (stats is None or stats.shape[-1] != len(stat_names)):
        raise DsparkError(f"fit_head needs the draft statistics {', '.join(stat_names)}")
    n, k, h = hidden.shape
    dense = np.concatenate([hidden, stats.astype(hidden.dtype)], axis=-1) if stat_names else hidden
    max_draft = max_draft or k
    rng = np.random.default_rng(seed)
    n_val = int(round(n * val_fraction)) if n >= 10 else 0
    perm = rng.permutation(n)
    val_ctx, train_ctx = perm[:n_val], perm[n_val:]

    def rows(ctx):
        sel = (weight[ctx] > 0)
        return (dense[ctx][sel], prev_token[ctx][sel], label[ctx][sel], weight[ctx][sel])

    th, tp, ty, tw = rows(train_ctx)
    if ty.size == 0:
        raise DsparkError("no usable training rows (every label weight is 0)")
    mu = th.astype(np.float64).mean(0)
    sigma = th.astype(np.float64).std(0)
    sigma = np.where(sigma > 1e-6, sigma, 1.0)

    def tensors(hh, pp, yy, ww):
        return (torch.from_numpy(((hh - mu) / sigma).astype(np.float32)), torch.from_numpy(pp.astype(np.int64)),
                torch.from_numpy(yy.astype(np.float32)), torch.from_numpy(ww.astype(np.float32)))

    Xh, Xp, Y, W = tensors(th, tp, ty, tw)
    val = tensors(*rows(val_ctx)) if n_val else None

    def loss_of(model, xd, xp, y, w):
        z = model(xd[..., :h], xp, xd[..., h:] if stat_names else None)
        return (torch.nn.functional.binary_cross_entropy_with_logits(z, y, reduction="none") * w).sum() / w.sum()

    p0 = float(np.clip((ty * tw).sum() / tw.sum(), 1e-4, 1 - 1e-4))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        work = ConfidenceHead(h, vocab_size, rank, max_draft, stats=stat_names)
    with torch.no_grad():
        work.proj.bias.fill_(math.log(p0 / (1 - p0)))
        if not prev_embed:
            work.token_embed.weight.zero_()
    # Without prev_embed the table is not trained: zero inputs, so its weights in proj get zero gradient too.
    params = [p for name, p in work.named_parameters() if prev_embed or not name.startswith("token_embed.")]
    opt = _AdamW(params, weight_decay=weight_decay)
    lr_at = lambda s: lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / max(1, steps))))  # noqa: E731
    gen = torch.Generator().manual_seed(seed)
    bsz = min(batch_size, Y.numel())
    eval_every = max(1, steps // 40)

    def val_loss():
        if val is None or val[2].numel() == 0:
            return float("nan")
        with torch.no_grad():
            return float(loss_of(work, *val))

    init_val = val_loss()
    best = (init_val if math.isfinite(init_val) else math.inf, 0, {k_: v.clone() for k_, v in work.state_dict().items()})
    train_loss = float("nan")
    bar = tqdm(range(steps), desc="train head", unit="step", disable=not progress, leave=False, mininterval=0.5)
    for step in bar:
        idx = torch.randint(0, Y.numel(), (bsz,), generator=gen)
        loss = loss_of(work, Xh[idx], Xp[idx], Y[idx], W[idx])
        opt.zero_grad()
        loss.backward()
        opt.step(lr_at(step))
        train_loss = float(loss.detach())
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            vl = val_loss()
            if not math.isfinite(vl):  # no held-out rows: keep the last weights
                best = (math.inf, step + 1, {k_: v.clone() for k_, v in work.state_dict().items()})
            elif vl < best[0]:
                best = (vl, step + 1, {k_: v.clone() for k_, v in work.state_dict().items()})
            bar.set_postfix(loss=f"{train_loss:.4f}", val=f"{vl:.4f}", refresh=False)
    bar.close()
    work.load_state_dict(best[2])
    head = fold_standardization(work, mu, sigma)

    auc = auc_fb = float("nan")
    if n_val and greedy_match is not None:
        gm = greedy_match[val_ctx]
        reach = np.concatenate([np.ones_like(gm[:, :1]), np.cumprod(gm, 1)[:, :-1]], 1) > 0
        z = head_logits(head, hidden[val_ctx], prev_token[val_ctx], stats[val_ctx] if stat_names else None)
        auc = metrics.auroc(z[reach], gm[reach])
        if fallback_conf is not None:
            auc_fb = metrics.auroc(fallback_conf[val_ctx][reach], gm[reach])
    vloss = best[0] if math.isfinite(best[0]) else float("nan")
    val_init = float("nan")
    if val is not None and val[2].numel():
        yv, wv = val[2].numpy(), val[3].numpy()
        val_init = metrics.log_loss(np.full_like(yv, p0), yv, wv)
    fit = FitStats(int(Y.numel()), int(val[2].numel()) if val is not None else 0, int(steps), int(best[1]),
                     train_loss, float(vloss), float(val_init), float(auc), float(auc_fb))
    return head, fit


class _AdamW:
    """Plain AdamW (decoupled weight decay). torch.optim would import torch._dynamo on first use, which
    costs seconds per process for an optimiser of two tensors."""

    def __init__(self, params, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        import torch

        self.params, self.betas, self.eps, self.wd, self.t = params, betas, eps, weight_decay, 0
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self, lr: float):
        import torch

        self.t += 1
        b1, b2 = self.betas
        c1, c2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        with torch.no_grad():
            for p, m, v in zip(self.params, self.m, self.v):
                if p.grad is None:
                    continue
                g = p.grad
                p.mul_(1 - lr * self.wd)
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                p.addcdiv_(m / c1, (v / c2).sqrt_().add_(self.eps), value=-lr)


def fold_standardization(work: ConfidenceHead, mu: np.ndarray, sigma: np.ndarray) -> ConfidenceHead:
    """A head on raw dense features equal to `work` applied to ([h ; s] - mu) / sigma."""
    import torch

    head = ConfidenceHead(work.hidden_size, work.vocab_size, work.rank, work.max_draft, work.temperatures, work.stats)
    hs = work.dense_size
    w = work.proj.weight.detach().double()[0]
    b = work.proj.bias.detach().double()[0]
    s = torch.from_numpy(sigma).double()
    m = torch.from_numpy(mu).double()
    w_h = w[:hs] / s
    with torch.no_grad():
        head.token_embed.weight.copy_(work.token_embed.weight)
        head.proj.weight[0, :hs] = w_h.float()
        head.proj.weight[0, hs:] = w[hs:].float()
        head.proj.bias[0] = (b - (w_h * m).sum()).float()
    return head.eval()


def head_logits(head: ConfidenceHead, hidden: np.ndarray, prev_token: np.ndarray, stats: np.ndarray | None = None,
                chunk: int = 65536) -> np.ndarray:
    """Head logits (before temperature) for features [..., H] / [...] / [..., len(head.stats)] -> [...] float64."""
    import torch

    if head.stats and (stats is None or stats.shape[-1] != len(head.stats)):
        raise DsparkError(f"this confidence head needs the draft statistics {', '.join(head.stats)}")
    shape = prev_token.shape
    hh = hidden.reshape(-1, hidden.shape[-1])
    ss = stats.reshape(-1, stats.shape[-1]) if head.stats else None
    pp = prev_token.reshape(-1)
    f32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))  # noqa: E731
    out = []
    with torch.no_grad():
        for i in range(0, pp.size, chunk):
            out.append(head(f32(hh[i:i + chunk]), torch.from_numpy(np.ascontiguousarray(pp[i:i + chunk], dtype=np.int64)),
                            f32(ss[i:i + chunk]) if ss is not None else None).double().numpy())
    return (np.concatenate(out) if out else np.zeros(0)).reshape(shape)


def train_head(target_dir, draft_dir, data, out_dir=None, max_draft: int = 7, steps: int = 2000, rank: int = 64,
               labels: str = "expected", seed: int = 0, overwrite: bool = False, *, num_contexts: int | None = None,
               context_len: int | None = None, batch_size: int = 32, lr: float = 3e-3, stats=DEFAULT_STATS,
               prev_embed: bool = True, progress: bool = True) -> Path:
    """Train the confidence head of the draft into the new head directory `out_dir` (written atomically; an
    existing head there is replaced only with overwrite); returns the weights path. The head lives in a
    dspark_head/ subfolder (models/confidence_head.py), so a draft folder holding it still loads in vLLM.
    Never writes into the model directories.

    num_contexts x max_draft labelled positions are rolled out from `data` (see rollout.py).
    """
    import time

    from dspark_trt.models.checkpoint import check_same_vocab
    from dspark_trt.models.config import load_config
    from dspark_trt.training.head_output import check_head_out, write_head_dir
    from dspark_trt.training.rollout import rollout_from_dirs

    num_contexts = num_contexts or DEFAULT_CONTEXTS
    context_len = context_len or DEFAULT_CONTEXT_LEN

    if labels not in ("expected", "greedy"):
        raise DsparkError(f"unknown --labels {labels!r} (use 'expected' or 'greedy')")
    stats = check_stats(stats)
    out = check_head_out(out_dir, overwrite, {"--target": target_dir, "--draft": draft_dir}, "train-head")
    check_same_vocab(target_dir, draft_dir)
    vocab_size = load_config(draft_dir).vocab_size
    t0 = time.perf_counter()
    ro = rollout_from_dirs(target_dir, draft_dir, data, num_contexts=num_contexts, max_draft=max_draft,
                           context_len=context_len, batch_size=batch_size, seed=seed, progress=progress,
                           desc="rollout (train)", min_contexts=MIN_CONTEXTS, purpose="train a head on")
    t1 = time.perf_counter()
    head, fit_stats = fit_head(ro.hidden, ro.prev_token, ro.labels(labels), ro.reach_weight(labels),
                               vocab_size=vocab_size, rank=rank, max_draft=max_draft, steps=steps,
                               seed=seed, lr=lr, greedy_match=ro.label_greedy, fallback_conf=ro.fallback_conf,
                               stats=ro.stats_for(stats), stat_names=stats, prev_embed=prev_embed, progress=progress)
    t2 = time.perf_counter()

    def write(tmp: Path) -> None:
        head.save(tmp)
        meta = json.loads((tmp / HEAD_CONFIG).read_text())
        meta["training"] = {
            "labels": labels, "conditional": True, "data": str(data), "seed": seed, "rank": rank,
            "stats": list(stats), "prev_embed": bool(prev_embed),
            "rollout": ro.info, "fit": fit_stats.to_dict(),
            "acceptance_greedy": [float(v) for v in ro.label_greedy.mean(0)],
            "acceptance_expected": [float(v) for v in ro.label_expected.mean(0)],
            "tau_greedy": ro.tau("greedy"), "seconds": {"rollout": round(t1 - t0, 2), "fit": round(t2 - t1, 2)},
        }
        (tmp / HEAD_CONFIG).write_text(json.dumps(meta, indent=2) + "\n")

    write_head_dir(out, write)
    return Path(out_dir) / HEAD_WEIGHTS
