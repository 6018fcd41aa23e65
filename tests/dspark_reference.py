"""A plain PyTorch reference of one DSpark draft step, written from vLLM 0.32's source (tests only).

Sources read: `model_executor/models/qwen3_dflash.py` (context-KV precompute: hidden_norm(fc(aux)) ->
k_proj / k_norm / RoPE and v_proj per layer, no input_layernorm; query-block attention over the cached
context plus the block), `qwen3_dspark.py` (Markov head, confidence head, d2t, logit scale),
`v1/worker/gpu/spec_decode/dspark/speculator.py` (anchor-as-first query layout, sequential loop,
top-k variant) and `dflash/speculator.py` (query positions = last context position + 1 + offset).

One request at a time, straight from the checkpoint's tensor names; nothing is shared with
`dspark_trt.models.dspark_drafter`.
"""

from __future__ import annotations

import torch


def _rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    """Neox-style rotary embedding on [T, heads, D] at positions [T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    ang = pos.float()[:, None] * inv[None, :]  # [T, D/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference_step(cfg: dict, w: dict, aux_ctx: torch.Tensor, anchor: int, target_embed=None,
                   target_lm_head=None):
    """cfg: the draft's config.json; w: its tensors by checkpoint name; aux_ctx [p, F]: the target's
    auxiliary hidden states at positions 0..p-1 (capture points in ascending order); anchor: the token at
    position p. -> (tokens [N] target ids, final logits [N, Vd], confidences [N] or None)."""
    eps = cfg["rms_norm_eps"]
    theta = cfg.get("rope_theta", 1e6)
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    dfl = cfg.get("dflash_config") or {}
    causal = cfg.get("is_causal", dfl.get("causal", False))
    mask_id = dfl.get("mask_token_id", cfg.get("mask_token_id"))
    n = cfg["block_size"]
    from_anchor = cfg.get("sample_from_anchor", True)
    q_len = n if from_anchor else n + 1
    scale = cfg.get("logit_scale", 1.0)
    embed = w.get("embed_tokens.weight", target_embed)
    lm_head = w.get("lm_head.weight", target_lm_head)
    p = aux_ctx.shape[0]

    # context K/V (precompute_and_store_context_kv)
    c = _rms(aux_ctx @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    ctx_pos = torch.arange(p)
    ctx_k, ctx_v = [], []
    for i in range(cfg["num_hidden_layers"]):
        pre = f"layers.{i}.self_attn."
        k = (c @ w[pre + "k_proj.weight"].T).view(p, nkv, hd)
        ctx_k.append(_rope(_rms(k, w[pre + "k_norm.weight"], eps), ctx_pos, theta))
        ctx_v.append((c @ w[pre + "v_proj.weight"].T).view(p, nkv, hd))

    # query block
    ids = torch.tensor([anchor] + [mask_id] * (q_len - 1))
    pos = p + torch.arange(q_len)
    x = embed[ids].float()
    allowed = torch.ones(q_len, p + q_len, dtype=torch.bool)
    if causal:
        allowed[:, p:] = torch.tril(torch.ones(q_len, q_len, dtype=torch.bool))
    for i in range(cfg["num_hidden_layers"]):
        pre = f"layers.{i}."
        h = _rms(x, w[pre + "input_layernorm.weight"], eps)
        q = (h @ w[pre + "self_attn.q_proj.weight"].T).view(q_len, nh, hd)
        k = (h @ w[pre + "self_attn.k_proj.weight"].T).view(q_len, nkv, hd)
        v = (h @ w[pre + "self_attn.v_proj.weight"].T).view(q_len, nkv, hd)
        q = _rope(_rms(q, w[pre + "self_attn.q_norm.weight"], eps), pos, theta)
        k = _rope(_rms(k, w[pre + "self_attn.k_norm.weight"], eps), pos, theta)
        keys = torch.cat([ctx_k[i], k]).repeat_interleave(nh // nkv, dim=1)  # [p+Q, nh, hd]
        vals = torch.cat([ctx_v[i], v]).repeat_interleave(nh // nkv, dim=1)
        att = torch.einsum("qhd,khd->hqk", q, keys) / hd ** 0.5
        att = att.masked_fill(~allowed[None], float("-inf")).softmax(-1)
        o = torch.einsum("hqk,khd->qhd", att, vals).reshape(q_len, nh * hd)
        x = x + o @ w[pre + "self_attn.o_proj.weight"].T
        h = _rms(x, w[pre + "post_attention_layernorm.weight"], eps)
        gate = torch.nn.functional.silu(h @ w[pre + "mlp.gate_proj.weight"].T)
        x = x + (gate * (h @ w[pre + "mlp.up_proj.weight"].T)) @ w[pre + "mlp.down_proj.weight"].T
    hidden = _rms(x, w["norm.weight"], eps)
    sample_hidden = hidden if from_anchor else hidden[1:]

    # sequential Markov sampling (greedy)
    base = scale * (sample_hidden @ lm_head.T)
    w1, w2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
    d2t = w.get("d2t")
    topk = cfg.get("dspark_draft_topk")
    prev, tokens, logits_out, embeds = anchor, [], [], []
    for i in range(n):
        e = w1[prev]
        embeds.append(e)
        if topk is None:
            logits = base[i] + scale * (w2 @ e)
        else:
            vals, idx = torch.topk(base[i], topk)
            logits = torch.full_like(base[i], float("-inf"))
            logits[idx] = vals + scale * (w2[idx] @ e)
        draft_id = int(torch.argmax(logits))
        prev = draft_id + (int(d2t[draft_id]) if d2t is not None else 0)
        tokens.append(prev)
        logits_out.append(logits)

    conf = None
    if cfg.get("enable_confidence_head") and "confidence_head.proj.weight" in w:
        feats = sample_hidden
        if cfg.get("confidence_head_with_markov"):
            feats = torch.cat([sample_hidden, torch.stack(embeds)], dim=-1)
        conf = torch.sigmoid(feats.float() @ w["confidence_head.proj.weight"][0] + w["confidence_head.proj.bias"][0])
    return tokens, torch.stack(logits_out), conf
