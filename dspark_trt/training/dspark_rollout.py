"""Greedy DSpark draft steps verified by the target: acceptance, tau and confidence-head features.

One step per context, exactly as serving drafts it: the target's hidden states of context[:-1] fill
the draft's context cache, the last context token is the anchor, the block pass and the greedy Markov
stage draft N tokens, and the target's argmax after context + drafts[:i] verifies draft i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_trt.models.decoder import Decoder
from dspark_trt.models.dspark_drafter import DsparkDrafter


@dataclass
class BlockRollout:
    drafts: torch.Tensor  # [R, N] target token ids
    matched: torch.Tensor  # [R, N] bool: draft i equals the target's greedy token after context + drafts[:i]
    conf_logits: torch.Tensor  # [R, N] the confidence head's logits (logit(q_max) without a head)
    top_prob: torch.Tensor  # [R, N] max softmax probability of the draft's final logits (the no-head fallback)
    features: torch.Tensor  # [R, N, hidden (+ markov_rank)]: the confidence head's input [h_i ; e_i]

    @property
    def accepted(self) -> torch.Tensor:
        """[R, N] 1 while every draft up to and including i was accepted (prefix survival)."""
        return self.matched.int().cumprod(1)

    @property
    def reached(self) -> torch.Tensor:
        """[R, N] bool: every earlier draft was accepted, so draft i is verified on the greedy path."""
        acc = self.accepted
        return torch.cat([torch.ones_like(acc[:, :1]), acc[:, :-1]], 1).bool()


@torch.no_grad()
def rollout(drafter: DsparkDrafter, target: Decoder, contexts: torch.Tensor) -> BlockRollout:
    """contexts [R, C] token ids (C >= 2) -> one verified greedy draft step per row."""
    r, c = contexts.shape
    cfg = drafter.cfg
    _, aux = target.forward_dense(contexts[:, :-1], aux_layers=cfg.aux_layers)
    keys, values = drafter.context_kv(aux, torch.arange(c - 1).expand(r, c - 1))
    past_k = [k.transpose(0, 1).contiguous() for k in keys]  # position-major [P, R, KVH, D]
    past_v = [v.transpose(0, 1).contiguous() for v in values]
    anchor = contexts[:, -1]
    block = torch.full((r, cfg.query_len), cfg.mask_token_id, dtype=torch.int64)
    block[:, 0] = anchor
    rows = drafter.sample_rows(drafter.block(block, past_k, past_v, torch.arange(r), torch.full((r,), c - 1)))
    drafts, conf, logits = drafter.markov(drafter.base_logits(rows), drafter.confidence_base(rows), anchor,
                                          return_logits=True)
    prev = torch.cat([anchor[:, None], drafts[:, :-1]], 1)
    features = rows.float()
    if drafter.confidence_head is None or cfg.confidence_head_with_markov:
        features = torch.cat([features, drafter.markov_head.markov_w1.weight.float()[prev]], -1)
    greedy = target.forward_dense(torch.cat([contexts, drafts], 1))[:, c - 1:-1].argmax(-1)
    return BlockRollout(drafts, greedy == drafts, conf, torch.softmax(logits, -1).amax(-1), features)


def acceptance_summary(accepted: torch.Tensor) -> dict:
    """Per-position greedy acceptance and tau, in the terms of training_report.json's classic draft:
    tau = 1 + mean accepted prefix length (the target's bonus/correction token counted)."""
    n, k = accepted.shape
    reached = torch.cat([torch.ones(n, 1, dtype=accepted.dtype), accepted[:, :-1]], 1)
    return {"conditional_acceptance": (accepted.sum(0).float() / reached.sum(0).clamp(min=1).float()).tolist(),
            "cumulative_acceptance": accepted.float().mean(0).tolist(),
            "tau": float(1 + accepted.sum(1).float().mean()), "k": k, "contexts": n}
