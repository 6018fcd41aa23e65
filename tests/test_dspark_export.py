"""Exported DSpark graphs (context-KV precompute + block pass with MarkovDraft and Survival) on ONNX
Runtime == the torch draft module (which test_dspark_drafter holds to the vLLM reference)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from dspark_trt.exporter.dspark_export import context_names, export_dspark, past_names  # noqa: E402
from dspark_trt.models.checkpoint import load_decoder  # noqa: E402
from dspark_trt.models.dspark_drafter import load_dspark_drafter  # noqa: E402
from tests.dspark_fixtures import make_draft, make_target  # noqa: E402

SLOTS = 4
CACHE = 16
VARIANTS = {
    "head with markov": dict(),
    "reduced vocab + top-k, logit scale": dict(draft_vocab=70, topk=6, logit_scale=0.8),
    "head-less, causal, 1+N": dict(head=False, head_tensors=False, causal=True, sample_from_anchor=False),
}


def session(path):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark_export")
    target_dir = make_target(root)
    out = {}
    for i, (name, kw) in enumerate(VARIANTS.items()):
        drafter = load_dspark_drafter(make_draft(root, name=f"d{i}", seed=10 + i, **kw), target_dir)
        out[name] = (drafter, export_dspark(drafter, root / f"art{i}", num_slots=SLOTS, sample=i >= 1))
    return load_decoder(target_dir), out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_exported_graphs_match_the_torch_module(exported, variant):
    target, graphs = exported
    drafter, paths = graphs[variant]
    layers = drafter.cfg.layers.num_hidden_layers
    ctx, drf = session(paths["context"]), session(paths["draft"])
    assert [o.name for o in drf.get_outputs()] == ["draft_tokens", "confidence_logits", "survival"]

    prompts = [[3, 17, 42, 8, 99, 23, 11], [64, 2, 7, 7, 30], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    slots = [2, 0, 3]
    keys, values = drafter.empty_cache(SLOTS, CACHE)
    for prompt, s in zip(prompts, slots):
        with torch.no_grad():
            _, aux = target.forward_dense(torch.tensor([prompt]), aux_layers=drafter.cfg.aux_layers)
            pos = torch.arange(len(prompt) - 1)
            k_ref, v_ref = drafter.context_kv(aux[0, :-1], pos)
        got = ctx.run(None, {"aux_hidden": aux[0, :-1].numpy(), "positions": pos.numpy()})
        assert [o.name for o in ctx.get_outputs()] == context_names(layers)
        for i in range(layers):
            assert np.abs(got[2 * i] - k_ref[i].numpy()).max() <= 1e-4
            assert np.abs(got[2 * i + 1] - v_ref[i].numpy()).max() <= 1e-4
            keys[i][: len(prompt) - 1, s] = torch.from_numpy(got[2 * i])
            values[i][: len(prompt) - 1, s] = torch.from_numpy(got[2 * i + 1])

    anchor = torch.tensor([p[-1] for p in prompts])
    past_lens = torch.tensor([len(p) - 1 for p in prompts])
    with torch.no_grad():
        toks, conf = drafter.draft(anchor, keys, values, torch.tensor(slots), past_lens)
    p = int(past_lens.max()) + 1
    feeds = {"anchor": anchor.numpy(), "past_lens": past_lens.numpy(), "slot_ids": np.array(slots, np.int64)}
    for name, t in zip(past_names(layers), [t for kv in zip(keys, values) for t in kv]):
        feeds[name] = t[:p].numpy()
    g_toks, g_conf_logits, g_surv = drf.run(None, feeds)
    np.testing.assert_array_equal(g_toks, toks.numpy())
    g_conf = 1 / (1 + np.exp(-g_conf_logits))
    assert np.abs(g_conf - conf.numpy()).max() <= 1e-4
    np.testing.assert_allclose(g_surv, np.cumprod(conf.numpy(), axis=1), rtol=1e-4, atol=1e-6)
    if drafter.confidence_head is None:  # head-less: logit(q_max) of each position's final draft logits
        with torch.no_grad():
            masks = torch.full((3, drafter.cfg.query_len - 1), drafter.cfg.mask_token_id)
            tokens = torch.cat([anchor[:, None], masks], 1)
            rows = drafter.sample_rows(drafter.block(tokens, keys, values, torch.tensor(slots), past_lens))
            *_, logits = drafter.markov(drafter.base_logits(rows), drafter.confidence_base(rows), anchor,
                                        return_logits=True)
        q = torch.softmax(logits.double(), -1).amax(-1).clamp(1e-6, 1 - 1e-6)
        assert np.abs(g_conf_logits - torch.logit(q).numpy()).max() <= 1e-3
        assert np.unique(g_surv[:, -1]).size == len(prompts)  # a per-request signal, not 0.5 ** k


def test_draft_graph_uses_the_dspark_ops_and_no_vocab_sized_outputs(exported):
    _, graphs = exported
    _, paths = graphs["reduced vocab + top-k, logit scale"]
    model = onnx.load(str(paths["draft"]))
    dspark = [n for n in model.graph.node if n.domain == "dspark"]
    assert sorted(n.op_type for n in dspark) == ["MarkovDraft", "Survival"]
    markov = next(n for n in dspark if n.op_type == "MarkovDraft")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in markov.attribute}
    assert attrs["steps"] == 4 and attrs["draft_topk"] == 6 and abs(attrs["logit_scale"] - 0.8) < 1e-6
    assert {f.name for f in model.functions if f.domain == "dspark"} == {"MarkovDraft", "Survival"}
    for out in model.graph.output:
        assert len(out.type.tensor_type.shape.dim) == 2  # [R, N]: tokens, confidence logits, survival


def test_target_graph_with_aux_outputs_matches_the_decoder(exported, tmp_path):
    from dspark_trt.exporter.dspark_export import export_target_with_aux
    from dspark_trt.manifest import TARGET_INPUTS
    from dspark_trt.models.decoder import PackedBatch, make_packed_index

    target, graphs = exported
    drafter, _ = graphs["head with markov"]
    written = export_target_with_aux(target, drafter.cfg.aux_layers, tmp_path / "target_aux.onnx", num_slots=SLOTS)
    assert written == ["target_aux.onnx"]  # weights inline under --external-data auto at this size
    sess = session(tmp_path / written[0])
    assert sess.get_outputs()[-1].name == "aux_hidden"
    # two requests: a 5-token prefill in slot 1 and a 3-token verify after 4 cached tokens in slot 3
    ql, past_lens, slots = [5, 3], [0, 4], [1, 3]
    pack, unpack = make_packed_index(ql)
    tokens = torch.tensor([4, 8, 15, 16, 23, 42, 7, 1])
    positions = torch.tensor([0, 1, 2, 3, 4, 4, 5, 6])
    layers = target.config.num_hidden_layers
    keys, values = target.empty_cache(SLOTS, 4)
    g = torch.Generator().manual_seed(0)
    for t in keys + values:
        t[:, 3] = torch.randn(t[:, 3].shape, generator=g)
    with torch.no_grad():
        _, _, _, aux = target.forward_packed(PackedBatch(tokens, positions, pack, unpack, torch.tensor(ql),
                                                         torch.tensor(past_lens), torch.tensor(slots), keys, values),
                                             aux_layers=drafter.cfg.aux_layers)
    v = target.config.vocab_size
    feeds = dict(tokens=tokens, positions=positions, pack_index=pack, unpack_index=unpack, query_lens=torch.tensor(ql),
                 past_lens=torch.tensor(past_lens), slot_ids=torch.tensor(slots), verify_index=torch.tensor([4, 5, 6, 7]),
                 verify_lens=torch.tensor([0, 2]), draft_tokens=torch.tensor([0, 7, 1, 0]),
                 draft_probs=torch.full((4, v), 1.0 / v), temperature=torch.tensor([0.0, 0.0]),
                 accept_uniforms=torch.full((4,), 0.5), sample_uniforms=torch.tensor([0.5, 0.5]))
    feeds = {k: feeds[k].numpy() for k in TARGET_INPUTS}
    for i in range(layers):
        feeds[f"past_key_values.{i}.key"], feeds[f"past_key_values.{i}.value"] = keys[i].numpy(), values[i].numpy()
    out = sess.run(None, feeds)
    assert np.abs(out[-1] - aux.numpy()).max() <= 1e-4
    assert out[-1].shape == (8, 48 * len(drafter.cfg.aux_layers))


@pytest.mark.parametrize("variant", ["reduced vocab + top-k, logit scale", "head-less, causal, 1+N"])
def test_sampling_flavour_matches_the_reference_on_the_module_rows(exported, variant):
    from dspark_trt.plugins import reference as ref

    target, graphs = exported
    drafter, paths = graphs[variant]
    layers, n = drafter.cfg.layers.num_hidden_layers, drafter.cfg.num_draft
    prompts = [[3, 17, 42, 8, 99, 23, 11], [64, 2, 7, 7, 30]]
    slots = [1, 3]
    keys, values = drafter.empty_cache(SLOTS, CACHE)
    for prompt, s in zip(prompts, slots):
        with torch.no_grad():
            _, aux = target.forward_dense(torch.tensor([prompt]), aux_layers=drafter.cfg.aux_layers)
            k, v = drafter.context_kv(aux[0, :-1], torch.arange(len(prompt) - 1))
        for i in range(layers):
            keys[i][: len(prompt) - 1, s], values[i][: len(prompt) - 1, s] = k[i], v[i]
    anchor, past_lens = torch.tensor([p[-1] for p in prompts]), torch.tensor([len(p) - 1 for p in prompts])
    temperature = np.array([0.0, 0.8], np.float32)
    uniforms = np.random.default_rng(3).random((2, n)).astype(np.float32)
    feeds = {"anchor": anchor.numpy(), "past_lens": past_lens.numpy(), "slot_ids": np.array(slots, np.int64),
             "temperature": temperature, "uniforms": uniforms}
    p = int(past_lens.max())
    for name, t in zip(past_names(layers), [t for kv in zip(keys, values) for t in kv]):
        feeds[name] = t[:p].numpy()
    toks, conf, surv, probs = session(paths["sample"]).run(None, feeds)
    with torch.no_grad():
        tokens = torch.cat([anchor[:, None], torch.full((2, drafter.cfg.query_len - 1), drafter.cfg.mask_token_id)], 1)
        rows = drafter.sample_rows(drafter.block(tokens, keys, values, torch.tensor(slots), past_lens))
        greedy_toks, greedy_conf = drafter.draft(anchor, keys, values, torch.tensor(slots), past_lens)
        exp = ref.markov_sample(drafter.base_logits(rows).numpy(), drafter.confidence_base(rows).numpy(), anchor.numpy(),
                                drafter.markov_head.markov_w1.weight.numpy(), drafter.markov_head.markov_w2.weight.numpy(),
                                drafter.confidence_markov_weight().numpy(), drafter.d2t.numpy(), temperature, uniforms,
                                steps=n, logit_scale=drafter.cfg.logit_scale, draft_topk=drafter.cfg.draft_topk or 0,
                                qmax_confidence=int(drafter.qmax_confidence))
    np.testing.assert_array_equal(toks, exp[0])
    np.testing.assert_array_equal(toks[0], greedy_toks[0].numpy())  # T = 0: the greedy drafts
    assert np.abs(conf - exp[1]).max() <= 1e-4  # the Markov embeddings follow the sampled tokens
    assert np.abs(1 / (1 + np.exp(-conf[0])) - greedy_conf[0].numpy()).max() <= 1e-4
    assert probs.shape == (2, n, target.config.vocab_size)
    assert np.abs(probs - exp[2]).max() <= 1e-4 and (probs[0].max(-1) == 1).all()
    if drafter.confidence_head is None:  # the sampled row's confidence: the max of its q, not q of its draw
        q = np.clip(probs[1].max(-1).astype(np.float64), 1e-6, 1 - 1e-6)
        assert np.abs(conf[1] - np.log(q / (1 - q))).max() <= 1e-3
