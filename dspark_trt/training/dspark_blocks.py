"""Training-time DSpark block pass: many query blocks per sequence in one forward.

At serving time a DSpark draft step is one block [anchor, mask, ..., mask] at positions p..p+Q-1 that
attends to the draft's context K/V of positions 0..p-1 (from the target's hidden states) and to itself.
For training, M anchors are drawn per sequence and all M blocks run in one pass: every block query
attends to the context positions before its own anchor and to the queries of its own block, never to
another block. `block_hidden` equals `DsparkDrafter.block` on each anchor separately (tests check it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark_trt.models.dspark_drafter import DsparkDrafter


def sample_anchors(batch: int, seq_len: int, per_seq: int, query_len: int, generator: torch.Generator) -> torch.Tensor:
    """[batch, per_seq] distinct anchor positions per sequence, sorted, in 1..seq_len - query_len, so that
    every block has a non-empty context and every predicted position has a target distribution."""
    hi = seq_len - query_len  # anchors 1..hi: the last slot of the last block reads position seq_len - 1
    choices = torch.stack([torch.randperm(hi, generator=generator)[:per_seq] + 1 for _ in range(batch)])
    return choices.sort(dim=1).values


def block_tokens(tokens: torch.Tensor, anchors: torch.Tensor, query_len: int, mask_token_id: int) -> torch.Tensor:
    """tokens [B, S], anchors [B, M] -> block inputs [B, M, Q]: the anchor token, then mask tokens."""
    out = torch.full((*anchors.shape, query_len), mask_token_id, dtype=tokens.dtype)
    out[..., 0] = tokens.gather(1, anchors)
    return out


def block_hidden(drafter: DsparkDrafter, aux: torch.Tensor, tokens: torch.Tensor,
                 anchors: torch.Tensor) -> torch.Tensor:
    """aux [B, S, F] target hidden states of every position; tokens [B, M, Q] block inputs; anchors [B, M].
    -> final-normed hidden states [B, M, Q, hidden] of every block, each block seeing the context
    positions < its anchor (its query slots sit at anchor + j)."""
    b, s, _ = aux.shape
    _, m, q_len = tokens.shape
    dev = aux.device
    ctx_keys, ctx_values = drafter.context_kv(aux, torch.arange(s, device=dev).expand(b, s))  # per layer [B, S, KVH, D]
    positions = (anchors[..., None] + torch.arange(q_len, device=dev)).reshape(b, m * q_len)
    x = drafter.embed_tokens(tokens.reshape(b, m * q_len))
    cos, sin = drafter.rope(positions, x.dtype)
    block_id = torch.arange(m, device=dev).repeat_interleave(q_len)
    qi = torch.arange(q_len, device=dev).repeat(m)
    in_block = block_id[:, None] == block_id[None, :]
    if drafter.cfg.causal:
        in_block = in_block & (qi[None, :] <= qi[:, None])
    see_ctx = torch.arange(s, device=dev)[None, None, :] < anchors.repeat_interleave(q_len, dim=1)[..., None]
    mask = torch.cat([see_ctx, in_block[None].expand(b, -1, -1)], dim=2)[:, None]  # [B, 1, MQ, S + MQ]
    for i, layer in enumerate(drafter.layers):
        a = layer.self_attn
        qh, kh, vh = a.project(layer.input_layernorm(x), cos, sin)
        keys = torch.cat([ctx_keys[i], kh], dim=1).transpose(1, 2)  # [B, KVH, S + MQ, D]
        values = torch.cat([ctx_values[i], drafter._v(vh)], dim=1).transpose(1, 2)
        groups = a.n_heads // a.n_kv
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(qh.transpose(1, 2), keys, values, attn_mask=mask)
        x = x + a.o_proj(out.transpose(1, 2).reshape(b, m * q_len, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x).reshape(b, m, q_len, -1)


def markov_logits(drafter: DsparkDrafter, rows: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """Teacher-forced Markov stage: rows [..., N, hidden] (the sampled rows), prev [..., N] the token before
    each predicted one -> final draft logits [..., N, V_draft] = scale * (lm_head(h) + markov_w2 @ w1[prev])."""
    e = drafter.markov_head.markov_w1(prev)
    return (drafter.lm_head(rows) + drafter.markov_head.markov_w2(e)) * drafter.cfg.logit_scale


def position_weights(n: int, gamma: float) -> torch.Tensor:
    """Loss weight of draft position k (1-based): exp(-(k - 1) / gamma); later positions count less since
    they are only reached after every earlier one was accepted (DFlash's decayed block loss)."""
    return torch.exp(-torch.arange(n, dtype=torch.float32) / gamma)

