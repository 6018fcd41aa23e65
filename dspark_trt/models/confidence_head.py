"""DSpark-style confidence head: c_k = sigmoid(w . [h_k ; e(x_{k-1})] + b).

h_k is the draft's final hidden state at the position that predicts x_k and e a low-rank embedding of
the previous token x_{k-1} (the token fed to the draft at that position). The head outputs the logit;
the Survival op applies per-position temperatures and the running product S_k = prod_{i<=k} c_i.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from dspark_trt.errors import DsparkError

HEAD_WEIGHTS = "confidence_head.safetensors"
HEAD_CONFIG = "confidence_head.json"


class ConfidenceHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int = 64, max_draft: int = 7,
                 temperatures: list[float] | None = None):
        super().__init__()
        self.hidden_size, self.vocab_size, self.rank, self.max_draft = hidden_size, vocab_size, rank, max_draft
        self.token_embed = nn.Embedding(vocab_size, rank)
        self.proj = nn.Linear(hidden_size + rank, 1)
        nn.init.normal_(self.token_embed.weight, std=0.02)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)
        self.temperatures = list(temperatures or [1.0] * max_draft)

    def forward(self, hidden: torch.Tensor, prev_token: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], prev_token [...] -> confidence logit [...] (before temperature)."""
        feats = torch.cat([hidden, self.token_embed(prev_token).to(hidden.dtype)], dim=-1)
        return self.proj(feats).squeeze(-1)

    def meta(self) -> dict:
        return {"hidden_size": self.hidden_size, "vocab_size": self.vocab_size, "rank": self.rank,
                "max_draft": self.max_draft, "temperatures": [float(t) for t in self.temperatures],
                "formula": "c_k = sigmoid((w . [h_k ; e(x_{k-1})] + b) / T_k)"}

    def save(self, out_dir: str | Path, overwrite: bool = True) -> Path:
        from safetensors.torch import save_file

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        weights = out_dir / HEAD_WEIGHTS
        if weights.exists() and not overwrite:
            raise DsparkError(f"{weights} exists; pass --force to overwrite it")
        save_file({k: v.detach().float().contiguous() for k, v in self.state_dict().items()}, str(weights))
        (out_dir / HEAD_CONFIG).write_text(json.dumps(self.meta(), indent=2) + "\n")
        return weights


def has_head(head_dir: str | Path) -> bool:
    d = Path(head_dir)
    return (d / HEAD_WEIGHTS).is_file() and (d / HEAD_CONFIG).is_file()


def load_head(head_dir: str | Path) -> ConfidenceHead:
    from safetensors.torch import load_file

    d = Path(head_dir)
    if not has_head(d):
        raise DsparkError(f"no {HEAD_WEIGHTS} + {HEAD_CONFIG} in {head_dir}: train one with `dspark-trt train-head`")
    meta = json.loads((d / HEAD_CONFIG).read_text())
    head = ConfidenceHead(meta["hidden_size"], meta["vocab_size"], meta["rank"], meta["max_draft"],
                          meta.get("temperatures"))
    try:
        head.load_state_dict(load_file(str(d / HEAD_WEIGHTS)))
    except RuntimeError as e:
        raise DsparkError(f"{d / HEAD_WEIGHTS} does not match {d / HEAD_CONFIG}: {str(e).splitlines()[0]}") from None
    return head.eval()


def save_temperatures(head_dir: str | Path, temperatures: list[float]) -> None:
    path = Path(head_dir) / HEAD_CONFIG
    meta = json.loads(path.read_text())
    meta["temperatures"] = [float(t) for t in temperatures]
    path.write_text(json.dumps(meta, indent=2) + "\n")
