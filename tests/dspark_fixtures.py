"""Random-weight checkpoints in vLLM's DSpark draft format (`Qwen3DSparkModel`), written by name.

The tensors are named and shaped from the format (qwen3_dspark.py / qwen3_dflash.py load_weights), not
from our module, so a naming mistake in the loader fails the tests.
"""

from __future__ import annotations

import json
from pathlib import Path

TARGET = dict(vocab=120, hidden=48, inter=96, layers=4, heads=4, kv_heads=2, head_dim=16)


def make_target(root: Path, arch: str = "qwen3", seed: int = 0, tie: bool = False, vocab: int = TARGET["vocab"]) -> Path:
    """A random target in HF layout (our Decoder's save path)."""
    from dspark_trt.models.checkpoint import save_decoder
    from dspark_trt.models.config import ModelConfig
    from dspark_trt.models.decoder import Decoder

    t = TARGET
    cfg = ModelConfig(arch, vocab, t["hidden"], t["inter"], t["layers"], t["heads"], t["kv_heads"],
                      t["head_dim"], tie_word_embeddings=tie, max_position_embeddings=256, qk_norm=arch == "qwen3")
    model = Decoder(cfg).init_weights(std=0.1, seed=seed).eval()
    d = root / "target"
    save_decoder(model, d, dtype="fp32")
    return d


def draft_config(*, vocab: int = TARGET["vocab"], draft_vocab: int | None = None, layers: int = 2,
                 target_layer_ids=(0, 2), block_size: int = 4, markov_rank: int = 8, head: bool = True,
                 head_with_markov: bool = True, causal: bool = False, topk: int | None = None,
                 sample_from_anchor: bool | None = None, mask_token_id: int = 5, **extra) -> dict:
    cfg = {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "vocab_size": vocab,
        "hidden_size": TARGET["hidden"], "intermediate_size": 64, "num_hidden_layers": layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 256, "hidden_act": "silu", "tie_word_embeddings": False,
        "target_hidden_size": TARGET["hidden"], "block_size": block_size,
        "dflash_config": {"target_layer_ids": list(target_layer_ids), "mask_token_id": mask_token_id,
                          "causal": causal},
        "markov_rank": markov_rank, "markov_head_type": "vanilla",
        "enable_confidence_head": head, "confidence_head_with_markov": head_with_markov,
    }
    if draft_vocab is not None:
        cfg["draft_vocab_size"] = draft_vocab
    if topk is not None:
        cfg["dspark_draft_topk"] = topk
    if sample_from_anchor is not None:
        cfg["sample_from_anchor"] = sample_from_anchor
    cfg.update(extra)
    return cfg


def draft_tensors(cfg: dict, *, seed: int = 0, own_embed: bool = False, own_lm_head: bool = False,
                  head_tensors: bool = True, placeholders: bool = True) -> dict:
    """Random tensors named as the checkpoint stores them (no `model.` prefix)."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.15):
        return torch.randn(*shape, generator=g) * std

    h, inter, r = cfg["hidden_size"], cfg["intermediate_size"], cfg["markov_rank"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    v = cfg["vocab_size"]
    vd = cfg.get("draft_vocab_size") or v
    n_aux = len(cfg["dflash_config"]["target_layer_ids"])
    t = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        t[p + "self_attn.q_proj.weight"] = rnd(nh * hd, h)
        t[p + "self_attn.k_proj.weight"] = rnd(nkv * hd, h)
        t[p + "self_attn.v_proj.weight"] = rnd(nkv * hd, h)
        t[p + "self_attn.o_proj.weight"] = rnd(h, nh * hd)
        t[p + "self_attn.q_norm.weight"] = 1 + rnd(hd)
        t[p + "self_attn.k_norm.weight"] = 1 + rnd(hd)
        t[p + "mlp.gate_proj.weight"] = rnd(inter, h)
        t[p + "mlp.up_proj.weight"] = rnd(inter, h)
        t[p + "mlp.down_proj.weight"] = rnd(h, inter)
        t[p + "input_layernorm.weight"] = 1 + rnd(h)
        t[p + "post_attention_layernorm.weight"] = 1 + rnd(h)
    t["fc.weight"] = rnd(h, cfg["target_hidden_size"] * n_aux)
    t["hidden_norm.weight"] = 1 + rnd(h)
    t["norm.weight"] = 1 + rnd(h)
    t["markov_head.markov_w1.weight"] = rnd(v, r, std=0.5)
    t["markov_head.markov_w2.weight"] = rnd(vd, r, std=0.5)
    if own_embed:
        t["embed_tokens.weight"] = rnd(v, h, std=0.5)
    if own_lm_head or vd < v:
        t["lm_head.weight"] = rnd(vd, h, std=0.5)
    if vd < v:  # draft id i -> target id i + d2t[i]: a sorted random subset of the target vocabulary
        keep = torch.sort(torch.randperm(v, generator=g)[:vd]).values
        t["d2t"] = keep - torch.arange(vd)
        if placeholders:
            t["t2d"] = torch.zeros(v, dtype=torch.bool)
    if head_tensors:
        width = h + (r if cfg.get("confidence_head_with_markov") else 0)
        t["confidence_head.proj.weight"] = rnd(1, width, std=0.3)
        t["confidence_head.proj.bias"] = rnd(1)
    if placeholders:
        t["mask_embedding"] = torch.zeros(h)
    return t


def write_draft(root: Path, cfg: dict, tensors: dict, name: str = "dspark") -> Path:
    from safetensors.torch import save_file

    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    return d


def make_draft(root: Path, *, seed: int = 0, name: str = "dspark", own_embed: bool = False,
               own_lm_head: bool = False, head_tensors: bool = True, **cfg_kw) -> Path:
    cfg = draft_config(**cfg_kw)
    return write_draft(root, cfg, draft_tensors(cfg, seed=seed, own_embed=own_embed, own_lm_head=own_lm_head,
                                                 head_tensors=head_tensors), name=name)


def agreeing_lm_heads(target_dir: Path, draft_dir: Path, seed: int = 0) -> None:
    """Rewrite the target's lm_head (and the draft's own, if any) so random drafts are often accepted.

    Row v becomes a_v * u + small noise: logits are then ~ a_v (u . h), so the argmax is one of two tokens
    (the largest or the smallest a_v) by the sign of u . h, for the target and for a draft projecting with
    the same rows. Greedy runs then see accepts and rejects alike; a reduced vocabulary keeps both tokens.
    The Markov correction is scaled down so it does not drown the shared preference."""
    import torch
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(seed)
    tpath, dpath = target_dir / "model.safetensors", draft_dir / "model.safetensors"
    t, d = load_file(str(tpath)), load_file(str(dpath))
    w = t["lm_head.weight"]
    v, h = w.shape
    keep = torch.arange(v)
    if "d2t" in d:
        keep = torch.arange(d["d2t"].shape[0]) + d["d2t"]
    a = torch.rand(v, generator=g)
    a[keep[0]], a[keep[-1]] = 2.0, -1.0
    u = torch.randn(h, generator=g)
    t["lm_head.weight"] = (a[:, None] * u[None, :] + 0.01 * torch.randn(v, h, generator=g)).contiguous()
    if "lm_head.weight" in d:
        d["lm_head.weight"] = t["lm_head.weight"][keep].contiguous()
    d["markov_head.markov_w2.weight"] = d["markov_head.markov_w2.weight"] * 0.05
    save_file(t, str(tpath), metadata={"format": "pt"})
    save_file(d, str(dpath), metadata={"format": "pt"})


def make_artifact(root: Path, *, arch: str = "llama", seed: int = 0, max_batch: int = 8, max_context: int = 96,
                  agree: bool = True, dtype: str = "fp32", external_data: str = "auto", **draft_kw) -> Path:
    """A runnable artifact: a random target (with a small BPE tokenizer) and a random DSpark drafter for it,
    exported by `dspark-trt export`'s library call (it dispatches on the draft's format). agree: the lm_heads
    rewritten so drafts are often, not always, accepted (agreeing_lm_heads)."""
    from conftest import TINY_VOCAB, make_tokenizer
    from dspark_trt.exporter.export import export_artifacts

    root.mkdir(parents=True, exist_ok=True)
    target_dir = make_target(root, arch=arch, seed=seed, vocab=TINY_VOCAB)  # the tokenizer's ids fit
    make_tokenizer(target_dir / "tokenizer.json")
    draft_dir = make_draft(root, seed=seed + 1, vocab=TINY_VOCAB, **draft_kw)
    if agree:
        agreeing_lm_heads(target_dir, draft_dir, seed=seed + 2)
    return export_artifacts(target_dir, draft_dir, root / "art", max_batch=max_batch, max_context=max_context,
                            progress=False, dtype=dtype, external_data=external_data)


def cached_artifact(tmp_path_factory, name: str, **kw) -> Path:
    """make_artifact once per test session (exports take tens of seconds; several test modules share one)."""
    root = tmp_path_factory.getbasetemp() / f"dspark-artifact-{name}"
    art = root / "art"
    if not (art / "manifest.json").is_file():
        import shutil

        shutil.rmtree(root, ignore_errors=True)
        make_artifact(root, **kw)
    return art


# The runnable artifacts the runtime tests share (cached_artifact names them)
ARTIFACT_VARIANTS = {
    # Llama target, full vocabulary (the draft shares the target's embeddings and lm_head), confidence head
    "full": dict(arch="llama", block_size=4),
    # Qwen3 target, reduced draft vocabulary with d2t, no confidence head (the online estimator instead)
    "reduced-headless": dict(arch="qwen3", block_size=3, draft_vocab=200, head=False, head_tensors=False),
}
