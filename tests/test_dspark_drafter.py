"""DSpark drafters from vLLM's checkpoint format: import, refusals, and parity with a plain reference."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dspark_trt.errors import DsparkError
from dspark_trt.models.checkpoint import load_decoder
from dspark_trt.models.dspark_config import is_dspark_dir
from dspark_trt.models.dspark_drafter import load_dspark_drafter
from tests.dspark_fixtures import draft_config, draft_tensors, make_draft, make_target, write_draft
from tests.dspark_reference import reference_step

VARIANTS = {
    "full-vocab, head with markov": dict(),
    "reduced vocab (d2t)": dict(draft_vocab=70),
    "head-less": dict(head=False, head_tensors=False),
    "head enabled, tensors absent": dict(head=True, head_tensors=False),
    "head without markov, causal": dict(head_with_markov=False, causal=True),
    "1+N fill-in layout": dict(sample_from_anchor=False),
    "top-k Markov": dict(topk=7),
    "own embed and lm_head, logit scale": dict(own_embed=True, own_lm_head=True, logit_scale=0.7),
    "reduced vocab + top-k": dict(draft_vocab=70, topk=5),
}


def fill_context(drafter, target, prompts, slots, cache_len=32):
    """Run the target over each prompt, store the drafter's context K/V for all but the last token."""
    keys, values = drafter.empty_cache(max(slots) + 1, cache_len)
    for prompt, s in zip(prompts, slots):
        _, aux = target.forward_dense(torch.tensor([prompt]), aux_layers=drafter.cfg.aux_layers)
        ctx = aux[0, :-1]
        k, v = drafter.context_kv(ctx, torch.arange(len(prompt) - 1))
        for layer in range(len(keys)):
            keys[layer][: len(prompt) - 1, s] = k[layer]
            values[layer][: len(prompt) - 1, s] = v[layer]
    return keys, values


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_draft_step_matches_the_vllm_reference(variant, arch, tmp_path):
    kw = dict(VARIANTS[variant])
    tensor_kw = {k: kw.pop(k) for k in ("own_embed", "own_lm_head", "head_tensors") if k in kw}
    cfg = draft_config(**kw)
    tensors = draft_tensors(cfg, seed=3, **tensor_kw)
    target_dir = make_target(tmp_path, arch=arch, tie=arch == "llama")
    draft_dir = write_draft(tmp_path, cfg, tensors)
    target = load_decoder(target_dir)
    drafter = load_dspark_drafter(draft_dir, target_dir)

    prompts = [[3, 17, 42, 8, 99, 23, 11], [64, 2, 7, 7, 30]]
    slots = [2, 0]
    keys, values = fill_context(drafter, target, prompts, slots)
    anchor = torch.tensor([p[-1] for p in prompts])
    past_lens = torch.tensor([len(p) - 1 for p in prompts])
    with torch.no_grad():
        hidden = drafter.block(torch.cat([anchor[:, None], torch.full((2, drafter.cfg.query_len - 1),
                                          drafter.cfg.mask_token_id)], 1), keys, values, torch.tensor(slots), past_lens)
        rows = drafter.sample_rows(hidden)
        toks, conf_logits, logits = drafter.markov(drafter.base_logits(rows), drafter.confidence_base(rows), anchor,
                                                   return_logits=True)
        toks2, conf2 = drafter.draft(anchor, keys, values, torch.tensor(slots), past_lens)
    assert torch.equal(toks, toks2) and torch.allclose(torch.sigmoid(conf_logits), conf2)

    t_state = load_file(str(target_dir / "model.safetensors"))
    t_embed = t_state["model.embed_tokens.weight"]
    t_head = t_state.get("lm_head.weight", t_embed)
    for r, prompt in enumerate(prompts):
        with torch.no_grad():
            _, aux = target.forward_dense(torch.tensor([prompt]), aux_layers=drafter.cfg.aux_layers)
            ref_toks, ref_logits, ref_conf = reference_step(cfg, tensors, aux[0, :-1], prompt[-1], t_embed, t_head)
        assert toks[r].tolist() == ref_toks
        finite = torch.isfinite(ref_logits)
        assert torch.equal(finite, torch.isfinite(logits[r]))
        assert (logits[r][finite] - ref_logits[finite]).abs().max() <= 1e-4
        if ref_conf is None:  # head-less: logit(q_max) of the reference's final logits
            assert drafter.confidence_head is None
            q = torch.softmax(ref_logits.double(), -1).amax(-1).clamp(1e-6, 1 - 1e-6)
            assert (conf_logits[r] - torch.logit(q)).abs().max() <= 1e-3
        else:
            assert (torch.sigmoid(conf_logits[r]) - ref_conf).abs().max() <= 1e-4


def test_reduced_vocab_drafts_are_target_ids(tmp_path):
    target_dir = make_target(tmp_path)
    draft_dir = make_draft(tmp_path, draft_vocab=40, seed=1)
    drafter = load_dspark_drafter(draft_dir, target_dir)
    d2t = load_file(str(draft_dir / "model.safetensors"))["d2t"]
    allowed = set((torch.arange(40) + d2t).tolist())
    keys, values = fill_context(drafter, load_decoder(target_dir), [[1, 2, 3, 4]], [0])
    toks, _ = drafter.draft(torch.tensor([4]), keys, values, torch.tensor([0]), torch.tensor([3]))
    assert set(toks[0].tolist()) <= allowed


def test_decoder_emits_aux_hidden_states_only_when_asked(tmp_path):
    transformers = pytest.importorskip("transformers")
    target_dir = make_target(tmp_path)
    ours = load_decoder(target_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir).eval()
    tokens = torch.tensor([[5, 9, 33, 2, 71]])
    with torch.no_grad():
        hs = hf(tokens, output_hidden_states=True).hidden_states  # [embeddings, after layer 1, ..., final norm]
        assert torch.is_tensor(ours.forward_dense(tokens))
        logits, aux = ours.forward_dense(tokens, aux_layers=(0, 1, 3))
        _, _, aux4 = ours.forward_dense(tokens, return_hidden=True, aux_layers=(4,))
    assert torch.allclose(aux, torch.cat([hs[0], hs[1], hs[3]], -1), atol=1e-5)
    assert torch.allclose(ours.model.norm(aux4), hs[4], atol=1e-5)  # HF's last entry is after the final norm
    with pytest.raises(DsparkError, match="capture point 5"):
        ours.forward_dense(tokens, aux_layers=(5,))


def test_packed_path_emits_the_same_aux_states(tmp_path):
    from dspark_trt.models.decoder import PackedBatch, make_packed_index

    target = load_decoder(make_target(tmp_path))
    tokens = [4, 8, 15, 16, 23]
    keys, values = target.empty_cache(1, 0)
    pack, unpack = make_packed_index([5])
    batch = PackedBatch(torch.tensor(tokens), torch.arange(5), pack, unpack, torch.tensor([5]), torch.tensor([0]),
                        torch.tensor([0]), keys, values)
    with torch.no_grad():
        assert len(target.forward_packed(batch)) == 3
        h, _, _, aux = target.forward_packed(batch, aux_layers=(1, 3))
        _, dense_aux = target.forward_dense(torch.tensor([tokens]), aux_layers=(1, 3))
    assert torch.allclose(aux, dense_aux[0], atol=1e-5)


def _refusal(tmp_path, match, tensors_kw=None, **cfg_kw):
    target_dir = make_target(tmp_path)
    cfg = draft_config(**{k: v for k, v in cfg_kw.items() if k != "_patch"})
    for k, v in cfg_kw.get("_patch", {}).items():
        cfg[k] = v
    d = write_draft(tmp_path, cfg, draft_tensors(cfg, **(tensors_kw or {})))
    with pytest.raises(DsparkError, match=match) as e:
        load_dspark_drafter(d, target_dir)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("patch, match", [
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"dflash_config": {"target_layer_ids": [0], "mask_token_id": 5, "use_swa": True}}, "use_swa"),
    ({"markov_head_type": "gated"}, "markov_head_type"),
    ({"architectures": ["DSparkDraftModel"]}, "architectures"),
    ({"model_type": "deepseek_v4"}, "model_type"),
    ({"dflash_config": {"target_layer_ids": [0, 9], "mask_token_id": 5}}, "target_layer_ids entry 9"),
    ({"dflash_config": {"target_layer_ids": [0, 2]}}, "mask_token_id"),
    ({"target_hidden_size": 64}, "target_hidden_size"),
    ({"is_neox_style": False}, "is_neox_style"),
    ({"block_size": None}, "block_size"),
    ({"use_aux_hidden_state": False}, "use_aux_hidden_state"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
])
def test_unsupported_variants_are_refused_naming_the_field(patch, match, tmp_path):
    _refusal(tmp_path, match, _patch=patch)


def test_reduced_vocab_without_d2t_is_refused(tmp_path):
    target_dir = make_target(tmp_path)
    cfg = draft_config(draft_vocab=50)
    t = draft_tensors(cfg)
    del t["d2t"]
    with pytest.raises(DsparkError, match="'d2t'"):
        load_dspark_drafter(write_draft(tmp_path, cfg, t), target_dir)


def test_unknown_tensor_is_refused(tmp_path):
    target_dir = make_target(tmp_path)
    cfg = draft_config()
    t = draft_tensors(cfg)
    t["layers.0.self_attn.attention_sink_bias"] = torch.zeros(4)
    with pytest.raises(DsparkError, match="attention_sink_bias"):
        load_dspark_drafter(write_draft(tmp_path, cfg, t), target_dir)


def test_alias_names_and_target_layer_precedence(tmp_path):
    target_dir = make_target(tmp_path)
    cfg = draft_config(layers=1, target_layer_ids=(2, 0))  # vLLM sorts the capture points
    t = {k.replace("layers.0.", "midlayer.").replace("fc.", "encoder.fc."): v for k, v in draft_tensors(cfg).items()}
    drafter = load_dspark_drafter(write_draft(tmp_path, cfg, t), target_dir)
    assert drafter.cfg.aux_layers == (1, 3)
    assert is_dspark_dir(tmp_path / "dspark") and not is_dspark_dir(target_dir)
    cfg2 = draft_config(target_layer_ids=(1,))
    cfg2["dspark_target_layer_ids"] = [3]  # dflash_config.target_layer_ids wins
    d2 = write_draft(tmp_path, cfg2, draft_tensors(cfg2), name="d2")
    assert load_dspark_drafter(d2, target_dir).cfg.aux_layers == (2,)
    assert json.loads((d2 / "config.json").read_text())["dspark_target_layer_ids"] == [3]


def test_separate_mask_embedding_file_is_refused(tmp_path):
    target_dir = make_target(tmp_path)
    d = make_draft(tmp_path)
    (d / "mask_embedding.pt").write_bytes(b"")
    with pytest.raises(DsparkError, match="mask_embedding.pt"):
        load_dspark_drafter(d, target_dir)
