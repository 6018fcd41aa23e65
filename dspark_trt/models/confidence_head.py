"""DSpark-style confidence head: c_k = sigmoid(w . [h_k ; e(x_{k-1}) ; s(q_k)] + b).

h_k is the draft's final hidden state at the position that predicts x_k, e a low-rank embedding of
the previous token x_{k-1} (the token fed to the draft at that position), and s(q_k) optional statistics
of the draft's own distribution q_k = softmax(lm_head(h_k)) at temperature 1 (`DRAFT_STATS`). The
statistics are an extension of the DSpark formula: a linear function of h_k cannot compute max_v q_k(v)
(a softmax of a linear map of h_k), yet for a small draft that is the strongest single signal of
acceptance. None of them depends on the sampled token x_k, so the Survival op stays admissible for
lossless sampling. A head without stats is exactly the DSpark form.

The head outputs the logit; the Survival op applies per-position temperatures and the running product
S_k = prod_{i<=k} c_i.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from dspark_trt.errors import DsparkError

# The head lives in a subfolder of the draft directory: vLLM (and transformers) read every top-level
# *.safetensors of a model folder (a non-recursive glob) and fail on tensors the architecture does not
# have, so a head file beside model.safetensors made our draft folders unloadable there. Artifacts
# written before keep loading: LEGACY_* (top level) are read when the subfolder has no head.
HEAD_SUBDIR = "dspark_head"
HEAD_WEIGHTS = f"{HEAD_SUBDIR}/confidence_head.safetensors"
HEAD_CONFIG = f"{HEAD_SUBDIR}/confidence_head.json"
LEGACY_HEAD_WEIGHTS = "confidence_head.safetensors"
LEGACY_HEAD_CONFIG = "confidence_head.json"
# Statistics of q = softmax(draft logits) that a head may use, in this order.
DRAFT_STATS = ("log_max_prob", "entropy", "log_margin")
DEFAULT_STATS = DRAFT_STATS


def check_stats(names) -> tuple[str, ...]:
    names = tuple(names or ())
    unknown = [n for n in names if n not in DRAFT_STATS]
    if unknown:
        raise DsparkError(f"unknown draft statistic {unknown[0]!r} (known: {', '.join(DRAFT_STATS)})")
    if len(set(names)) != len(names):
        raise DsparkError(f"draft statistics listed twice: {', '.join(names)}")
    return names


def draft_stats(logits: torch.Tensor, names=DRAFT_STATS) -> torch.Tensor:
    """[..., V] draft logits -> [..., len(names)] float32 statistics of q = softmax(logits):
    log_max_prob = log max_v q(v); entropy = -sum_v q log q; log_margin = log q_(1) - log q_(2)."""
    names = check_stats(names)
    logq = torch.log_softmax(logits.float(), dim=-1)
    cols = []
    for name in names:
        if name == "log_max_prob":
            cols.append(logq.max(dim=-1).values)
        elif name == "entropy":
            cols.append(-(logq.exp() * logq).sum(dim=-1))
        else:
            top2 = logq.topk(2, dim=-1).values
            cols.append(top2[..., 0] - top2[..., 1])
    if not cols:
        return logq.new_zeros(*logq.shape[:-1], 0)
    return torch.stack(cols, dim=-1)


class ConfidenceHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int = 64, max_draft: int = 7,
                 temperatures: list[float] | None = None, stats=()):
        super().__init__()
        self.hidden_size, self.vocab_size, self.rank, self.max_draft = hidden_size, vocab_size, rank, max_draft
        self.stats = check_stats(stats)
        self.token_embed = nn.Embedding(vocab_size, rank)
        # Input layout: [h (hidden_size) ; s (len(stats)) ; e(x_prev) (rank)].
        self.proj = nn.Linear(hidden_size + len(self.stats) + rank, 1)
        nn.init.normal_(self.token_embed.weight, std=0.02)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)
        self.temperatures = list(temperatures or [1.0] * max_draft)

    @property
    def dense_size(self) -> int:
        """Width of the dense features [h ; s] (standardised in training, folded into w and b)."""
        return self.hidden_size + len(self.stats)

    def forward(self, hidden: torch.Tensor, prev_token: torch.Tensor, stats: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [..., H], prev_token [...], stats [..., len(self.stats)] (`draft_stats` of the draft
        logits; required iff the head uses any) -> confidence logit [...] (before temperature)."""
        parts = [hidden]
        if self.stats:
            if stats is None or stats.shape[-1] != len(self.stats):
                raise DsparkError(f"this confidence head needs the draft statistics {', '.join(self.stats)}")
            parts.append(stats.to(hidden.dtype))
        parts.append(self.token_embed(prev_token).to(hidden.dtype))
        return self.proj(torch.cat(parts, dim=-1)).squeeze(-1)

    def meta(self) -> dict:
        formula = ("c_k = sigmoid((w . [h_k ; s(q_k) ; e(x_{k-1})] + b) / T_k)" if self.stats
                   else "c_k = sigmoid((w . [h_k ; e(x_{k-1})] + b) / T_k)")
        return {"hidden_size": self.hidden_size, "vocab_size": self.vocab_size, "rank": self.rank,
                "max_draft": self.max_draft, "stats": list(self.stats),
                "temperatures": [float(t) for t in self.temperatures], "formula": formula}

    def save(self, out_dir: str | Path, overwrite: bool = True) -> Path:
        from safetensors.torch import save_file

        out_dir = Path(out_dir)
        weights = out_dir / HEAD_WEIGHTS
        for existing in (weights, out_dir / LEGACY_HEAD_WEIGHTS):
            if existing.exists() and not overwrite:
                raise DsparkError(f"{existing} exists; pass --force to overwrite it")
        weights.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().float().contiguous() for k, v in self.state_dict().items()}, str(weights))
        (out_dir / HEAD_CONFIG).write_text(json.dumps(self.meta(), indent=2) + "\n")
        for legacy in (LEGACY_HEAD_WEIGHTS, LEGACY_HEAD_CONFIG):  # replaced: keep the folder vLLM-loadable
            (out_dir / legacy).unlink(missing_ok=True)
        return weights


def head_files(head_dir: str | Path) -> tuple[Path, Path] | None:
    """(weights, config) of the head in head_dir: the subfolder layout, else the legacy top-level files."""
    d = Path(head_dir)
    for w, c in ((HEAD_WEIGHTS, HEAD_CONFIG), (LEGACY_HEAD_WEIGHTS, LEGACY_HEAD_CONFIG)):
        if (d / w).is_file() and (d / c).is_file():
            return d / w, d / c
    return None


def has_head(head_dir: str | Path) -> bool:
    return head_files(head_dir) is not None


def load_head(head_dir: str | Path) -> ConfidenceHead:
    from safetensors.torch import load_file

    files = head_files(head_dir)
    if files is None:
        raise DsparkError(f"no {HEAD_WEIGHTS} + {HEAD_CONFIG} in {head_dir}: train one with `dspark-trt train-head`")
    weights, config = files
    meta = json.loads(config.read_text())
    head = ConfidenceHead(meta["hidden_size"], meta["vocab_size"], meta["rank"], meta["max_draft"],
                          meta.get("temperatures"), meta.get("stats") or ())
    try:
        head.load_state_dict(load_file(str(weights)))
    except RuntimeError as e:
        raise DsparkError(f"{weights} does not match {config}: {str(e).splitlines()[0]}") from None
    return head.eval()


def save_temperatures(head_dir: str | Path, temperatures: list[float]) -> None:
    files = head_files(head_dir)
    path = files[1] if files is not None else Path(head_dir) / HEAD_CONFIG
    meta = json.loads(path.read_text())
    meta["temperatures"] = [float(t) for t in temperatures]
    path.write_text(json.dumps(meta, indent=2) + "\n")
