"""Random-weight Hugging Face checkpoints of a chosen size, written shard by shard in bounded memory.

For size, memory and checkpoint-format tests of the exporter and runtime (weights are noise: use a real
checkpoint for quality). Tensors are generated one at a time and written in shards, so peak memory
stays near one shard. `scripts/make_random_llama.py` is the command-line front end.
"""

from __future__ import annotations

import json
from pathlib import Path


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, v, inter = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    d = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
        if cfg["model_type"] == "qwen2":
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    shapes["model.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, h)
    return shapes


def write_checkpoint(out: Path, cfg: dict, dtype: str = "float32", shard_bytes: int = 1 << 30, seed: int = 0,
                     std: float = 0.02) -> Path:
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    dt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    gen = torch.Generator().manual_seed(seed)
    shards, cur, cur_bytes = [], {}, 0

    def flush():
        nonlocal cur, cur_bytes
        if cur:
            shards.append(cur)
            name = f"model-{len(shards):05d}.safetensors"
            save_file(cur, str(out / name), metadata={"format": "pt"})
            shards[-1] = (name, list(cur))
            cur, cur_bytes = {}, 0

    for name, shape in tensor_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=dt)
        elif name.endswith(".bias"):
            t = torch.zeros(shape, dtype=dt)
        else:
            t = (torch.randn(shape, generator=gen) * std).to(dt)
        nbytes = t.numel() * t.element_size()
        if cur and cur_bytes + nbytes > shard_bytes:
            flush()
        cur[name] = t
        cur_bytes += nbytes
    flush()
    total = sum((out / n).stat().st_size for n, _ in shards)
    if len(shards) == 1:
        (out / shards[0][0]).rename(out / "model.safetensors")
    else:
        weight_map = {k: n for n, keys in shards for k in keys}
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(dict(cfg, torch_dtype=dtype), indent=2) + "\n")
    return out


def llama_config(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                 model_type: str = "llama", tie: bool = False, max_pos: int = 4096) -> dict:
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[model_type]
    return {"architectures": [arch], "model_type": model_type, "vocab_size": vocab, "hidden_size": hidden,
            "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": hidden // heads, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0 if model_type == "llama" else 1000000.0, "tie_word_embeddings": tie,
            "max_position_embeddings": max_pos, "hidden_act": "silu"}
