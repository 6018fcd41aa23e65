"""The ORT flavour of a DSpark drafter's block pass (`DsparkDrafter.block`), from models/ort_fused.py's parts.

The block [anchor, mask, ..., mask] of every request is laid out as a packed batch of R x Q rows (all
queries the same length) and runs through the same fused layers as the target's flavour (FusedLayers:
qkv and gate/up as one MatMul each, RMSNorm and residual + RMSNorm as contrib ops, rotary as
RotaryEmbedding, the context cache read without concatenating it to the block's own keys). What the
block does differently is in the mask (a non-causal block sees the whole block) and in the values'
constant scale (folded into the fused projection). In eager mode it computes what `block` computes.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark_trt.models.decoder import PackedBatch
from dspark_trt.models.ort_fused import FusedLayers


class FusedDsparkBlock(nn.Module):
    """`block(tokens, past_keys, past_values, slot_ids, past_lens)` of a DsparkDrafter (same inputs and
    output), sharing the drafter's weights. max_positions: the rotary tables' length (the context plus one
    block)."""

    def __init__(self, drafter, max_positions: int):
        super().__init__()
        cfg = drafter.cfg
        self.causal = bool(cfg.causal)
        self.embed_tokens = drafter.embed_tokens
        self.layers = FusedLayers(drafter.layers, drafter.norm, cfg.layers.rms_norm_eps, drafter.inv_freq,
                                  max_positions, drafter.lm_head.weight.dtype, cfg.v_scale)

    def forward(self, tokens, past_keys, past_values, slot_ids, past_lens):
        r, q = tokens.shape
        rows = torch.arange(r * q, device=tokens.device)
        positions = (past_lens[:, None] + torch.arange(q, device=tokens.device)[None, :]).reshape(-1)
        batch = PackedBatch(tokens.reshape(-1), positions, rows.reshape(r, q), rows,
                            torch.full_like(past_lens, q), past_lens, slot_ids, past_keys, past_values)
        h, _, _, _ = self.layers(self.embed_tokens(batch.tokens), batch, causal=self.causal)
        return h.reshape(r, q, -1)
