"""Refuse a draft that is not cheaper than its target (a swapped --target / --draft exports silently and
then runs adaptive speculation at a fraction of plain decoding's speed)."""

from __future__ import annotations

from dspark_trt.errors import DsparkError


def parameter_count(cfg) -> int:
    """Parameters of a decoder from its config (embeddings, attention, MLP, norms, untied LM head)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    attn = h * q + 2 * h * kv + q * h
    if cfg.qkv_bias:
        attn += q + 2 * kv
    if cfg.o_bias:
        attn += h
    per_layer = attn + 3 * h * cfg.intermediate_size + 2 * h + (2 * hd if cfg.qk_norm else 0)
    embed = cfg.vocab_size * h
    return embed + cfg.num_hidden_layers * per_layer + h + (0 if cfg.tie_word_embeddings else embed)


def _describe(cfg) -> str:
    return (f"{cfg.num_hidden_layers} layers x {cfg.hidden_size} hidden, "
            f"{parameter_count(cfg) / 1e6:.2f}M parameters")


def check_draft_cheaper(target_cfg, draft_cfg, target_dir, draft_dir) -> None:
    """DsparkError when the draft has more parameters, more layers or a wider hidden size than the target."""
    larger = []
    if parameter_count(draft_cfg) > parameter_count(target_cfg):
        larger.append("more parameters")
    if draft_cfg.num_hidden_layers > target_cfg.num_hidden_layers:
        larger.append("more layers")
    if draft_cfg.hidden_size > target_cfg.hidden_size:
        larger.append("a wider hidden size")
    if larger:
        raise DsparkError(
            f"the draft is not cheaper than the target: --draft {draft_dir} ({_describe(draft_cfg)}) has "
            f"{', '.join(larger)} than --target {target_dir} ({_describe(target_cfg)}); were --target and "
            f"--draft swapped? Pass --allow-large-draft to export it anyway")
