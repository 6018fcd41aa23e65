"""The ORT flavour of a DSpark drafter's block pass (`DsparkDrafter.block`), from models/ort_fused.py's parts.

The block [anchor, mask, ..., mask] of every request is laid out as a packed batch of R x Q rows (all
queries the same length) and runs through the same fused attention, norms and MLP as the target's
flavour: qkv and gate/up as one MatMul each, RMSNorm and residual + RMSNorm as contrib ops, rotary as
RotaryEmbedding, the context cache read without concatenating it to the block's own keys. What the
block does differently is in the mask (non-causal blocks see the whole block) and in the values'
constant scale (folded into the fused projection). In eager mode it computes what `block` computes.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark_trt.models.decoder import PackedBatch
from dspark_trt.models.ort_fused import FusedAttention, FusedMLP, _attention_mask, add_rms_norm, rms_norm


class FusedDsparkBlock(nn.Module):
    """`block(tokens, past_keys, past_values, slot_ids, past_lens)` of a DsparkDrafter (same inputs and
    output); shares the drafter's embedding, norms and output projections, copies q/k/v and gate/up once.
    max_positions: the rotary tables' length (the context plus one block)."""

    def __init__(self, drafter, max_positions: int):
        super().__init__()
        cfg = drafter.cfg
        self.causal = bool(cfg.causal)
        self.eps = cfg.layers.rms_norm_eps
        self.embed_tokens = drafter.embed_tokens
        self.attn = nn.ModuleList(FusedAttention(layer.self_attn, cfg.v_scale) for layer in drafter.layers)
        self.mlp = nn.ModuleList(FusedMLP(layer.mlp) for layer in drafter.layers)
        self.norm_in = nn.ParameterList(layer.input_layernorm.weight for layer in drafter.layers)
        self.norm_post = nn.ParameterList(layer.post_attention_layernorm.weight for layer in drafter.layers)
        self.norm = drafter.norm
        dtype = drafter.lm_head.weight.dtype
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * drafter.inv_freq[None, :]
        self.register_buffer("cos_table", freqs.cos().to(dtype), persistent=False)
        self.register_buffer("sin_table", freqs.sin().to(dtype), persistent=False)

    def forward(self, tokens, past_keys, past_values, slot_ids, past_lens):
        r, q = tokens.shape
        rows = torch.arange(r * q, device=tokens.device)
        positions = (past_lens[:, None] + torch.arange(q, device=tokens.device)[None, :]).reshape(-1)
        batch = PackedBatch(tokens.reshape(-1), positions, rows.reshape(r, q), rows,
                            torch.full_like(past_lens, q), past_lens, slot_ids, past_keys, past_values)
        x = self.embed_tokens(batch.tokens)
        groups = self.attn[0].n_heads // self.attn[0].n_kv
        mask = _attention_mask(batch, x.device, self.causal).repeat(1, 1, groups, 1)
        tables = (self.cos_table, self.sin_table)
        h = rms_norm(x, self.norm_in[0], self.eps)
        n = len(self.attn)
        for i in range(n):
            a, _, _ = self.attn[i](h, batch, i, tables, mask)
            h, x = add_rms_norm(a, x, self.norm_post[i], self.eps)
            out_w = self.norm_in[i + 1] if i + 1 < n else self.norm.weight
            h, x = add_rms_norm(self.mlp[i](h), x, out_w, self.eps)
        return h.reshape(r, q, -1)
