"""The export-friendly decoder matches transformers' own implementation (fp32, 1e-4)."""

import json

import pytest
import torch

from dspark_trt.errors import DsparkError
from dspark_trt.models.checkpoint import load_decoder
from dspark_trt.models.decoder import PackedBatch, make_packed_index

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0)

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False, head_dim=24)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=None)),
}


def make_hf_checkpoint(family: str, path, seed: int = 0):
    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**BASE, **extra)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # random biases / norms so every parameter matters
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return model


def packed_step(model, tokens_per_req, past_lens, cache, slots):
    toks = torch.tensor([t for ts in tokens_per_req for t in ts])
    pos = torch.tensor([pl + j for ts, pl in zip(tokens_per_req, past_lens) for j in range(len(ts))])
    pack, unpack = make_packed_index([len(ts) for ts in tokens_per_req])
    p = max(past_lens)
    batch = PackedBatch(toks, pos, pack, unpack, torch.tensor([len(t) for t in tokens_per_req]),
                        torch.tensor(past_lens), torch.tensor(slots),
                        [k[:p] for k in cache[0]], [v[:p] for v in cache[1]])
    h, nk, nv = model.forward_packed(batch)
    tok_slots = torch.tensor([s for ts, s in zip(tokens_per_req, slots) for _ in ts])
    for layer in range(len(nk)):
        cache[0][layer][pos, tok_slots] = nk[layer]
        cache[1][layer][pos, tok_slots] = nv[layer]
    return model.lm_head(h)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(family, tmp_path):
    hf = make_hf_checkpoint(family, tmp_path)
    ours = load_decoder(tmp_path)
    torch.manual_seed(1)
    prompt = torch.randint(0, BASE["vocab_size"], (1, 12))
    with torch.no_grad():
        ref = hf(prompt).logits[0]
        dense = ours.forward_dense(prompt)[0]
        assert (dense - ref).abs().max() <= 1e-4
        # Packed prefill then 16 cached decode steps, against HF's own cache.
        cache = ours.empty_cache(slots=3, length=64)
        logits = packed_step(ours, [prompt[0].tolist()], [0], cache, [2])
        assert (logits - ref).abs().max() <= 1e-4
        out = hf(prompt, use_cache=True)
        past, seq = out.past_key_values, prompt[0].tolist()
        nxt = int(out.logits[0, -1].argmax())
        for _ in range(16):
            out = hf(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            mine = packed_step(ours, [[nxt]], [len(seq)], cache, [2])
            assert (mine[0] - out.logits[0, -1]).abs().max() <= 1e-4
            seq.append(nxt)
            nxt = int(out.logits[0, -1].argmax())


def test_ragged_batch_matches_single_requests(tmp_path):
    make_hf_checkpoint("qwen3", tmp_path)
    model = load_decoder(tmp_path)
    torch.manual_seed(2)
    reqs = [torch.randint(0, 97, (n,)).tolist() for n in (5, 1, 9)]
    with torch.no_grad():
        cache = model.empty_cache(slots=4, length=32)
        together = packed_step(model, reqs, [0, 0, 0], cache, [3, 0, 1])
        offset = 0
        for r in reqs:
            alone = model.forward_dense(torch.tensor([r]))[0]
            assert (together[offset:offset + len(r)] - alone).abs().max() <= 1e-4
            offset += len(r)


def test_unknown_model_type_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(DsparkError, match="model_type 'gpt2'"):
        load_decoder(tmp_path)


def test_missing_tensor_names_the_key(tmp_path):
    from safetensors.torch import load_file, save_file

    make_hf_checkpoint("llama", tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(DsparkError, match="model.layers.1.mlp.up_proj.weight"):
        load_decoder(tmp_path)
