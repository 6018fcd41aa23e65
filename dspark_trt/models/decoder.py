"""An export-friendly decoder for Llama / Qwen2 / Qwen3 / Mistral checkpoints.

Two entry points share the same weights:
- `forward_dense(tokens[B, S])`: causal LM over whole sequences (training, reference).
- `forward_packed(batch)`: the serving path. New tokens of R requests are *packed* (N = sum of query
  lengths), so every linear layer sees exactly the real tokens; only attention works on a padded
  [R, Lq] block. The KV cache is explicit: past entries come in as tensors, new entries go out.

KV cache layout (per layer, keys and values alike): [P, S, KVH, D] — position-major over all S cache
slots. The runtime keeps one preallocated buffer per layer and passes `buffer[:P]`, a contiguous view,
so no copy is made between steps; the graph gathers the R active slots itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dspark_trt.errors import DsparkError
from dspark_trt.models.config import ModelConfig


@dataclass
class PackedBatch:
    """Inputs of one packed step. N new tokens from R requests, padded query length Lq."""

    tokens: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64 absolute positions
    pack_index: torch.Tensor  # [R, Lq] int64: packed index of the j-th new token of request r (0 where padded)
    unpack_index: torch.Tensor  # [N] int64: r * Lq + j for each packed token
    query_lens: torch.Tensor  # [R] int64
    past_lens: torch.Tensor  # [R] int64
    slot_ids: torch.Tensor  # [R] int64 cache slot of each request
    past_keys: list  # per layer [P, S, KVH, D]
    past_values: list


def make_packed_index(query_lens: list[int]):
    """pack_index [R, Lq] and unpack_index [N] for the given query lengths (numpy-free helper)."""
    lq = max(query_lens)
    pack, unpack, start = [], [], 0
    for r, n in enumerate(query_lens):
        pack.append([start + j if j < n else 0 for j in range(lq)])
        unpack.extend(r * lq + j for j in range(n))
        start += n
    return torch.tensor(pack, dtype=torch.int64), torch.tensor(unpack, dtype=torch.int64)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling
    if not scaling:
        return inv_freq
    factor = float(scaling.get("factor", 1.0))
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # Llama 3: keep high frequencies, divide low ones by `factor`, blend in between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, H, D]; cos/sin [..., T, 1, D]."""
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = h, kvh, d
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kvh * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kvh * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def project(self, x, cos, sin):
        """x [..., T, hidden] -> rotated q [..., T, H, D], k, v [..., T, KVH, D]."""
        q = self.q_proj(x).unflatten(-1, (self.n_heads, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (self.n_kv, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.n_kv, self.head_dim))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward_dense(self, x, cos, sin):
        b, s, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, D]
        k = k.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        v = v.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def forward_packed(self, x, cos, sin, batch: PackedBatch, layer: int):
        q, k_new, v_new = self.project(x, cos, sin)  # [N, H, D], [N, KVH, D]
        r, lq = batch.pack_index.shape
        groups = self.n_heads // self.n_kv
        # Past entries of the active slots: [P, S, KVH, D] -> [R, KVH, P, D]
        past_k = batch.past_keys[layer].index_select(1, batch.slot_ids).permute(1, 2, 0, 3)
        past_v = batch.past_values[layer].index_select(1, batch.slot_ids).permute(1, 2, 0, 3)
        p = past_k.shape[2]
        qp = q[batch.pack_index].transpose(1, 2)  # [R, H, Lq, D]
        keys = torch.cat([past_k, k_new[batch.pack_index].transpose(1, 2)], dim=2)  # [R, KVH, P+Lq, D]
        values = torch.cat([past_v, v_new[batch.pack_index].transpose(1, 2)], dim=2)
        # Group query heads per KV head instead of repeating KV: [R, KVH, G*Lq, D]
        qg = qp.reshape(r, self.n_kv, groups * lq, self.head_dim)
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * (1.0 / math.sqrt(self.head_dim))
        past_ok = torch.arange(p, device=x.device)[None, None, :] < batch.past_lens[:, None, None]  # [R, 1, P]
        qi = torch.arange(lq, device=x.device)
        new_ok = (qi[None, None, :] <= qi[None, :, None]) & (qi[None, None, :] < batch.query_lens[:, None, None])
        mask = torch.cat([past_ok.expand(r, lq, p), new_ok], dim=2)  # [R, Lq, P+Lq]
        mask = mask[:, None, None, :, :].expand(r, self.n_kv, groups, lq, p + lq).reshape(r, self.n_kv, groups * lq, p + lq)
        scores = scores.float().masked_fill(~mask, torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out = torch.matmul(probs, values)  # [R, KVH, G*Lq, D]
        out = out.reshape(r, self.n_heads, lq, self.head_dim).transpose(1, 2).reshape(r * lq, -1)
        return self.o_proj(out[batch.unpack_index]), k_new, v_new


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Backbone(nn.Module):
    """Named like HF's `model.*` so checkpoints load without renaming."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.float()[..., None] * self.inv_freq  # [..., T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)[..., None, :]  # [..., T, 1, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward_dense(self, tokens: torch.Tensor, return_hidden: bool = False, aux_layers=()):
        """tokens [B, S] from position 0 -> logits [B, S, V] (and final hidden states).

        `aux_layers` (capture points, see `check_aux_layers`) adds a last return value: the residual
        stream at each point, concatenated in the given order ([B, S, len(aux_layers) * hidden])."""
        aux_layers = self.check_aux_layers(aux_layers)
        x = self.model.embed_tokens(tokens)
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        cos, sin = self.rope(positions, x.dtype)
        captured = {0: x} if 0 in aux_layers else {}
        for i, layer in enumerate(self.model.layers):
            x = x + layer.self_attn.forward_dense(layer.input_layernorm(x), cos, sin)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i + 1 in aux_layers:
                captured[i + 1] = x
        h = self.model.norm(x)
        logits = self.lm_head(h)
        out = (logits, h) if return_hidden else (logits,)
        if aux_layers:
            out = out + (torch.cat([captured[k] for k in aux_layers], dim=-1),)
        return out if len(out) > 1 else out[0]

    def forward_packed(self, batch: PackedBatch, aux_layers=()):
        """-> final hidden states [N, hidden], new keys and values per layer ([N, KVH, D] each), and,
        only when `aux_layers` is given, the auxiliary hidden states [N, len(aux_layers) * hidden]
        (the residual stream at each capture point, in the given order) that a DSpark drafter reads."""
        aux_layers = self.check_aux_layers(aux_layers)
        x = self.model.embed_tokens(batch.tokens)
        cos, sin = self.rope(batch.positions, x.dtype)
        captured = {0: x} if 0 in aux_layers else {}
        new_keys, new_values = [], []
        for i, layer in enumerate(self.model.layers):
            attn, k, v = layer.self_attn.forward_packed(layer.input_layernorm(x), cos, sin, batch, i)
            x = x + attn
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            new_keys.append(k)
            new_values.append(v)
            if i + 1 in aux_layers:
                captured[i + 1] = x
        if aux_layers:
            aux = torch.cat([captured[k] for k in aux_layers], dim=-1)
            return self.model.norm(x), new_keys, new_values, aux
        return self.model.norm(x), new_keys, new_values

    def check_aux_layers(self, aux_layers) -> tuple[int, ...]:
        """Capture points for auxiliary hidden states: k = the residual stream after k decoder layers
        (0 = the embeddings, L = the last layer's output before the final norm). This is vLLM's
        aux-hidden-state numbering; a DFlash/DSpark `target_layer_ids` entry i is capture point i + 1."""
        aux_layers = tuple(int(k) for k in (aux_layers or ()))
        n = self.config.num_hidden_layers
        bad = [k for k in aux_layers if not 0 <= k <= n]
        if bad:
            raise DsparkError(f"auxiliary hidden-state capture point {bad[0]} is outside 0..{n} "
                              f"(the target has {n} layers)")
        return aux_layers

    def empty_cache(self, slots: int, length: int = 0, dtype=torch.float32):
        c = self.config
        shape = (length, slots, c.num_key_value_heads, c.head_dim)
        return ([torch.zeros(shape, dtype=dtype) for _ in range(c.num_hidden_layers)],
                [torch.zeros(shape, dtype=dtype) for _ in range(c.num_hidden_layers)])

    def init_weights(self, std: float = 0.02, seed: int | None = None) -> "Decoder":
        """HF-style initialisation for training from scratch (normal(0, std), zero biases)."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * std)
                    if getattr(m, "bias", None) is not None:
                        m.bias.zero_()
        return self

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
