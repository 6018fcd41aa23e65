"""The ORT flavour of the packed decoder: the same math as `Decoder.forward_packed`, in fewer, fused nodes.

ONNX Runtime's CPU kernels pay per node (about a third of a one-request target run is dispatch), and its
own optimizer does not recognise this decoder's RMSNorm or rotary patterns. So this flavour, exported
for the ORT backend only (TensorRT fuses by itself and keeps the standard graph), writes:
- RMSNorm as `com.microsoft` SimplifiedLayerNormalization, and residual add + RMSNorm as
  SkipSimplifiedLayerNormalization (one node instead of seven or eight);
- q/k/v as one MatMul over concatenated weights, gate/up as another;
- rotary embedding as `com.microsoft` RotaryEmbedding over cos/sin tables of the artifact's context;
- attention over the past without concatenating it to the new entries: scores against the past and
  against the new block are computed apart and joined (the scores are Lq*G wide, the past keys D wide,
  so the copy that remains is the small one).
Under export the contrib ops are single nodes (torch.onnx.ops.symbolic); in eager mode each one runs
the equivalent torch, so the flavour can be checked against the plain decoder without ONNX Runtime.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dspark_trt.models.decoder import Decoder, PackedBatch, apply_rope

MS = "com.microsoft"


def _exporting() -> bool:
    return torch.onnx.is_in_onnx_export()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _exporting():
        return torch.onnx.ops.symbolic("::SimplifiedLayerNormalization", [x, weight],
                                       attrs={"axis": -1, "epsilon": float(eps), "stash_type": 1},
                                       dtype=x.dtype, shape=x.shape, version=1)
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """-> (rms_norm(x + residual), x + residual)."""
    if _exporting():
        out, _, _, total = torch.onnx.ops.symbolic_multi_out(
            f"{MS}::SkipSimplifiedLayerNormalization", [x, residual, weight], attrs={"epsilon": float(eps)},
            dtypes=[x.dtype, torch.float32, torch.float32, x.dtype],
            shapes=[x.shape, [*x.shape[:-1], 1], [*x.shape[:-1], 1], x.shape], version=1)
        return out, total
    total = x + residual
    return rms_norm(total, weight, eps), total


def rotary(x: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
           num_heads: int) -> torch.Tensor:
    """x [B, T, heads * D], positions [B, T], tables [max_positions, D / 2] -> x rotated (non-interleaved)."""
    if _exporting():
        return torch.onnx.ops.symbolic(f"{MS}::RotaryEmbedding", [x, positions, cos_table, sin_table],
                                       attrs={"interleaved": 0, "num_heads": num_heads},
                                       dtype=x.dtype, shape=x.shape, version=1)
    cos = torch.cat([cos_table[positions]] * 2, dim=-1)[..., None, :]  # [B, T, 1, D]
    sin = torch.cat([sin_table[positions]] * 2, dim=-1)[..., None, :]
    return apply_rope(x.unflatten(-1, (num_heads, -1)), cos, sin).flatten(-2)


class FusedAttention(nn.Module):
    """v_scale: values scaled by a constant (a DSpark drafter's attention_value_scale), folded into the
    fused projection's weights."""

    def __init__(self, attn, v_scale: float | None = None):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = attn.n_heads, attn.n_kv, attn.head_dim
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        self.qkv = nn.Linear(qkv[0].in_features, sum(p.out_features for p in qkv), bias=qkv[0].bias is not None)
        v = 1.0 if v_scale is None else float(v_scale)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([qkv[0].weight, qkv[1].weight, qkv[2].weight * v]))
            if self.qkv.bias is not None:
                self.qkv.bias.copy_(torch.cat([qkv[0].bias, qkv[1].bias, qkv[2].bias * v]))
        self.qkv.to(attn.q_proj.weight.dtype)
        self.o_proj = attn.o_proj
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm

    def forward(self, x, batch: PackedBatch, layer: int, tables, mask):
        h, kvh, d = self.n_heads, self.n_kv, self.head_dim
        r, lq = batch.pack_index.shape
        groups = h // kvh
        pack = batch.pack_index
        q, k, v = self._qkv(x)
        # New keys rotated where they are packed (the cache's entries); queries rotated after padding.
        k = rotary(k[None], batch.positions[None], *tables, kvh)[0]
        q = rotary(q[pack], batch.positions[pack], *tables, h)  # [R, Lq, H * D]
        # Past of the active slots, gathered once and read by MatMul in place of a transpose (ONNX Runtime
        # folds the permutes into FusedMatMul): keys [R, KVH, D, P], values [R, KVH, P, D].
        past_k = batch.past_keys[layer].index_select(1, batch.slot_ids).permute(1, 2, 3, 0)
        past_v = batch.past_values[layer].index_select(1, batch.slot_ids).permute(1, 2, 0, 3)
        p = past_v.shape[2]
        # Query rows per KV head ordered (group, position): [R, KVH, G * Lq, D], pre-scaled.
        qg = q.reshape(r, lq, h, d).transpose(1, 2).reshape(r, kvh, groups * lq, d) * (1.0 / math.sqrt(d))
        new_k = k[pack].reshape(r, lq, kvh, d).permute(0, 2, 3, 1)  # [R, KVH, D, Lq]
        new_v = v[pack].reshape(r, lq, kvh, d).transpose(1, 2)  # [R, KVH, Lq, D]
        # Scores against the past and the new block apart: joining scores copies G*Lq columns, joining
        # the keys would copy the whole past again.
        scores = torch.cat([torch.matmul(qg, past_k), torch.matmul(qg, new_k)], dim=-1).float()
        probs = torch.softmax(scores.masked_fill(~mask, torch.finfo(torch.float32).min), dim=-1).to(new_v.dtype)
        out = torch.matmul(probs[..., :p], past_v) + torch.matmul(probs[..., p:], new_v)  # [R, KVH, G*Lq, D]
        out = out.reshape(r, h, lq, d).transpose(1, 2).reshape(r * lq, h * d)
        return self.o_proj(out[batch.unpack_index]), k.unflatten(-1, (kvh, d)), v.unflatten(-1, (kvh, d))

    def forward_decode(self, x, positions, seqlens, total, past_k, past_v, tables):
        """T new tokens in each of B rows over slot-major caches (x [B, T, hidden], positions [B, T], past
        [B, KVH, max_context, D], row b the cache's slot b): -> (attention output [B, T, hidden], the caches
        with the new entries written at positions). Under export a GroupQueryAttention node that reads the
        past in place and, with its present outputs bound to the same buffers, writes only the new entries
        (ONNX Runtime takes T > 1 only when B = 1)."""
        h, kvh = self.n_heads, self.n_kv
        q, k, v = self._qkv(x)
        k = rotary(k, positions, *tables, kvh)
        q = rotary(q, positions, *tables, h)
        out, present_k, present_v = group_query_attention(q, k, v, past_k, past_v, seqlens, total, h, kvh)
        return self.o_proj(out), present_k, present_v

    def _qkv(self, x):
        """(q, k, v) projected, q and k normed where the model has q/k norms."""
        h, kvh, d = self.n_heads, self.n_kv, self.head_dim
        q, k, v = self.qkv(x).split([h * d, kvh * d, kvh * d], dim=-1)
        if self.q_norm is not None:
            q = rms_norm(q.unflatten(-1, (h, d)), self.q_norm.weight, self.q_norm.eps).flatten(-2)
            k = rms_norm(k.unflatten(-1, (kvh, d)), self.k_norm.weight, self.k_norm.eps).flatten(-2)
        return q, k, v


def group_query_attention(q, k, v, past_k, past_v, seqlens, total, num_heads: int, kv_heads: int):
    """q [B, T, H*D], k/v [B, T, KVH*D] (rotated), past [B, KVH, Pmax, D], seqlens [B] int32 (each row's
    past length + T - 1: its new entries go at seqlens - T + 1 on), total: max(seqlens) + 1 as an int32
    scalar. Causal within the new tokens."""
    b, t, d = q.shape[0], q.shape[1], past_k.shape[-1]
    if _exporting():
        return torch.onnx.ops.symbolic_multi_out(
            f"{MS}::GroupQueryAttention", [q, k, v, past_k, past_v, seqlens, total],
            attrs={"num_heads": num_heads, "kv_num_heads": kv_heads, "scale": 1.0 / math.sqrt(d)},
            dtypes=[q.dtype, past_k.dtype, past_v.dtype], shapes=[q.shape, past_k.shape, past_v.shape], version=1)
    pos = seqlens.long()[:, None] - (t - 1) + torch.arange(t, device=q.device)[None, :]  # [B, T]
    rows = torch.arange(b, device=q.device)[:, None].expand(b, t)
    pk, pv = past_k.clone(), past_v.clone()
    pk[rows, :, pos] = k.view(b, t, kv_heads, d)
    pv[rows, :, pos] = v.view(b, t, kv_heads, d)
    g = num_heads // kv_heads
    qg = q.view(b, t, kv_heads, g, d).permute(0, 2, 3, 1, 4) * (1.0 / math.sqrt(d))  # [B, KVH, G, T, D]
    scores = torch.matmul(qg, pk.transpose(-1, -2)[:, :, None]).float()  # [B, KVH, G, T, Pmax]
    visible = torch.arange(pk.shape[2], device=q.device)[None, None, :] <= pos[:, :, None]  # [B, T, Pmax]
    scores = scores.masked_fill(~visible[:, None, None], torch.finfo(torch.float32).min)
    out = torch.matmul(torch.softmax(scores, dim=-1).to(pv.dtype), pv[:, :, None])  # [B, KVH, G, T, D]
    return out.permute(0, 3, 1, 2, 4).reshape(b, t, num_heads * d), pk, pv


class FusedMLP(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.inter = mlp.gate_proj.out_features
        self.gate_up = nn.Linear(mlp.gate_proj.in_features, 2 * self.inter, bias=False)
        with torch.no_grad():
            self.gate_up.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        self.gate_up.to(mlp.gate_proj.weight.dtype)
        self.down_proj = mlp.down_proj

    def forward(self, x):
        gate, up = self.gate_up(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(gate) * up)


class FusedLayers(nn.Module):
    """A stack of decoder layers in the ORT flavour (a target's, or a DSpark drafter's block pass): shares
    the layers' norms and output projections, copies q/k/v and gate/up once, and holds the rotary tables
    (max_positions long, from inv_freq: the same fp32 products as Decoder.rope, so each position's angles
    are bit-identical). v_scale: values scaled by a constant (folded into the fused projection)."""

    def __init__(self, layers, final_norm, eps: float, inv_freq, max_positions: int, dtype,
                 v_scale: float | None = None):
        super().__init__()
        self.eps = eps
        self.attn = nn.ModuleList(FusedAttention(layer.self_attn, v_scale) for layer in layers)
        self.mlp = nn.ModuleList(FusedMLP(layer.mlp) for layer in layers)
        self.norm_in = nn.ParameterList(layer.input_layernorm.weight for layer in layers)
        self.norm_post = nn.ParameterList(layer.post_attention_layernorm.weight for layer in layers)
        self.norm = final_norm
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos_table", freqs.cos().to(dtype), persistent=False)
        self.register_buffer("sin_table", freqs.sin().to(dtype), persistent=False)

    def forward(self, x, batch: PackedBatch, causal: bool = True, capture=()):
        """x: the embedded packed tokens -> (final-normed hidden states, new keys and values per layer,
        {k: the residual stream after k layers} for k in capture)."""
        attn = self.attn[0]
        mask = _attention_mask(batch, x.device, causal).repeat(1, 1, attn.n_heads // attn.n_kv, 1)  # rows as qg
        tables = (self.cos_table, self.sin_table)
        return self._layers(x, lambda i, h: self.attn[i](h, batch, i, tables, mask), capture)

    def _layers(self, x, attend, capture):
        """The stack around an attention: attend(i, normed x) -> (layer i's attention output, its new keys,
        values) -> (final-normed hidden states, keys and values per layer, {k: residual after k layers})."""
        captured = {0: x} if 0 in capture else {}
        h = rms_norm(x, self.norm_in[0], self.eps)
        keys, values = [], []
        n = len(self.attn)
        for i in range(n):
            a, k, v = attend(i, h)
            h, x = add_rms_norm(a, x, self.norm_post[i], self.eps)
            out_w = self.norm_in[i + 1] if i + 1 < n else self.norm.weight
            h, x = add_rms_norm(self.mlp[i](h), x, out_w, self.eps)
            keys.append(k)
            values.append(v)
            if i + 1 in capture:
                captured[i + 1] = x
        return h, keys, values, captured

    def forward_decode(self, x, past_lens, past, capture=()):
        """T new tokens in each of B rows over slot-major caches (FusedAttention.forward_decode): x
        [B, T, hidden] embedded, past_lens [B], past interleaved [k0, v0, k1, ...] each [B, KVH, Pmax, D]
        -> (final-normed hidden [B, T, hidden], the caches with the new entries written, {k: the residual
        stream after k layers} for k in capture)."""
        t = x.shape[1]
        positions = past_lens[:, None] + torch.arange(t, device=x.device)[None, :]
        seqlens = (past_lens + (t - 1)).to(torch.int32)
        total = (seqlens.max() + 1).to(torch.int32)
        tables = (self.cos_table, self.sin_table)
        h, keys, values, captured = self._layers(x, lambda i, h: self.attn[i].forward_decode(
            h, positions, seqlens, total, past[2 * i], past[2 * i + 1], tables), capture)
        return h, [t for kv in zip(keys, values) for t in kv], captured


class FusedDecoder(nn.Module):
    """`forward_packed` of a `Decoder` (same inputs, same outputs) in the ORT flavour; shares the
    decoder's embedding and lm_head (and, through FusedLayers, its norms and output projections)."""

    def __init__(self, decoder: Decoder, max_positions: int):
        super().__init__()
        cfg = decoder.config
        self.config = cfg
        self.embed_tokens = decoder.model.embed_tokens
        self.lm_head = decoder.lm_head
        self.layers = FusedLayers(decoder.model.layers, decoder.model.norm, cfg.rms_norm_eps, decoder.inv_freq,
                                  max_positions, decoder.lm_head.weight.dtype)
        self.check_aux_layers = decoder.check_aux_layers

    def forward_packed(self, batch: PackedBatch, aux_layers=()):
        """As Decoder.forward_packed, auxiliary hidden states included (the residual stream after k layers,
        which SkipSimplifiedLayerNormalization hands out as its sum output)."""
        aux_layers = self.check_aux_layers(aux_layers)
        h, keys, values, captured = self.layers(self.embed_tokens(batch.tokens), batch, capture=aux_layers)
        if aux_layers:
            return h, keys, values, torch.cat([captured[k] for k in aux_layers], dim=-1)
        return h, keys, values


def _attention_mask(batch: PackedBatch, device, causal: bool = True) -> torch.Tensor:
    """[R, 1, Lq, P+Lq], broadcast over KV heads: past position p is visible when p < past_len, new
    position j to query i when j <= i (any j when not causal) and j < query_len."""
    r, lq = batch.pack_index.shape
    p = batch.past_keys[0].shape[0]
    past_ok = torch.arange(p, device=device)[None, None, :] < batch.past_lens[:, None, None]  # [R, 1, P]
    qi = torch.arange(lq, device=device)
    new_ok = qi[None, None, :] < batch.query_lens[:, None, None]  # [R, 1, Lq]
    new_ok = new_ok & (qi[None, None, :] <= qi[None, :, None]) if causal else new_ok.expand(r, lq, lq)
    mask = torch.cat([past_ok.expand(r, lq, p), new_ok], dim=2)  # [R, Lq, P+Lq]
    return mask[:, None, :, :]
