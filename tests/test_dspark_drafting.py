"""A greedy generation loop drafting with the exported DSpark graphs (runtime/dspark_drafting.py) and
verifying with the target: the output equals target-only greedy decoding, and after every accept /
reject the drafter's incrementally kept context cache drafts exactly what a fresh recompute does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")

from dspark_trt.errors import DsparkError  # noqa: E402
from dspark_trt.exporter.dspark_export import export_dspark  # noqa: E402
from dspark_trt.models.checkpoint import load_decoder  # noqa: E402
from dspark_trt.models.dspark_drafter import load_dspark_drafter  # noqa: E402
from dspark_trt.runtime.dspark_drafting import DsparkDrafting  # noqa: E402
from tests.dspark_fixtures import make_draft, make_target  # noqa: E402

SLOTS, MAX_CONTEXT, NEW = 3, 64, 14


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark_drafting")
    target_dir = make_target(root, seed=4)
    drafter = load_dspark_drafter(make_draft(root, seed=5, draft_vocab=80, block_size=3), target_dir)
    paths = export_dspark(drafter, root / "art", num_slots=SLOTS)
    return load_decoder(target_dir), drafter, paths


def target_greedy(target, prompt, n):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(target.forward_dense(torch.tensor([seq]))[0, -1].argmax()))
    return seq


def fresh_draft(drafter, target, seq):
    """The torch drafter with its context recomputed from scratch for seq (anchor = seq[-1])."""
    with torch.no_grad():
        _, aux = target.forward_dense(torch.tensor([seq[:-1]]), aux_layers=drafter.cfg.aux_layers)
        keys, values = drafter.empty_cache(1, len(seq) - 1)
        k, v = drafter.context_kv(aux[0], torch.arange(len(seq) - 1))
        for i in range(len(keys)):
            keys[i][:, 0], values[i][:, 0] = k[i], v[i]
        toks, _ = drafter.draft(torch.tensor([seq[-1]]), keys, values, torch.tensor([0]), torch.tensor([len(seq) - 1]))
    return toks[0].tolist()


def test_greedy_loop_with_dspark_drafts_equals_target_only_greedy(setup):
    target, drafter, paths = setup
    rt = DsparkDrafting.from_files(paths["context"], paths["draft"], num_slots=SLOTS, max_context=MAX_CONTEXT)
    prompts = {0: [3, 17, 42, 8, 99], 2: [64, 2, 7, 7, 30, 1, 9]}
    seqs, anchors = {}, {}
    with torch.no_grad():
        for slot, prompt in prompts.items():  # prefill: every prompt token becomes context
            logits, aux = target.forward_dense(torch.tensor([prompt]), aux_layers=drafter.cfg.aux_layers)
            rt.observe(slot, aux[0].numpy(), 0)
            seqs[slot] = list(prompt) + [int(logits[0, -1].argmax())]
        steps = accepted = 0
        while any(len(seqs[s]) < len(prompts[s]) + NEW for s in prompts):
            active = [s for s in prompts if len(seqs[s]) < len(prompts[s]) + NEW]
            d = rt.draft(active, [seqs[s][-1] for s in active])
            assert d.tokens.shape == d.survival.shape == (len(active), 3)
            assert np.all(np.diff(d.survival, axis=1) <= 1e-7) and np.all((d.survival > 0) & (d.survival < 1))
            for row, s in enumerate(active):
                drafts = d.tokens[row].tolist()
                assert drafts == fresh_draft(drafter, target, seqs[s])  # cache in step after accept/reject
                p = len(seqs[s]) - 1  # the anchor's position
                logits, aux = target.forward_dense(torch.tensor([seqs[s] + drafts]), aux_layers=drafter.cfg.aux_layers)
                a = 0
                while a < len(drafts) and int(logits[0, p + a].argmax()) == drafts[a]:
                    a += 1
                rt.observe(s, aux[0, p:p + a + 1].numpy(), p)  # anchor + accepted drafts become context
                seqs[s] += drafts[:a] + [int(logits[0, p + a].argmax())]
                accepted += a
            steps += 1
    for s, prompt in prompts.items():
        n = len(prompt) + NEW
        assert seqs[s][:n] == target_greedy(target, prompt, NEW)
    assert rt.context_len[1] == 0 and steps >= NEW // 4


def test_observe_and_draft_refuse_gaps_and_empty_context(setup):
    _, _, paths = setup
    rt = DsparkDrafting.from_files(paths["context"], paths["draft"], num_slots=SLOTS, max_context=8)
    with pytest.raises(DsparkError, match="never observed"):
        rt.observe(0, np.zeros((2, 2 * 48), np.float32), 3)
    with pytest.raises(DsparkError, match="at least one observed context token"):
        rt.draft([0], [5])
    rt.observe(0, np.zeros((5, 2 * 48), np.float32), 0)
    with pytest.raises(DsparkError, match="sampling graph"):
        rt.draft([0], [5], temperature=[0.7], uniforms=[[0.5, 0.5, 0.5]])
    rt.rollback(0, 2)
    assert rt.context_len[0] == 2
    with pytest.raises(DsparkError, match="exceeds max_context 8"):
        rt.observe(0, np.zeros((7, 2 * 48), np.float32), 2)
    with pytest.raises(DsparkError, match="exported for 3 cache slots"):
        DsparkDrafting.from_files(paths["context"], paths["draft"], num_slots=5, max_context=8)


def test_artifact_records_the_dspark_drafter_and_runs(tmp_path):
    from dspark_trt.exporter.dspark_artifact import export_dspark_artifact
    from dspark_trt.manifest import load_manifest

    target_dir = make_target(tmp_path, seed=4)
    draft_dir = make_draft(tmp_path, seed=5, block_size=2, head=False, head_tensors=False)
    (target_dir / "tokenizer.json").write_text('{"model": {"vocab": {}}, "added_tokens": []}')
    art = export_dspark_artifact(target_dir, draft_dir, tmp_path / "art", max_batch=2, max_context=32)
    m = load_manifest(art)
    assert m.validate() == [] and m.drafter_kind == "dspark"
    assert m.draft["max_draft"] == 2 and m.draft["confidence"] == "fallback"
    assert m.draft["dspark"]["aux_layers"] == [1, 3]
    assert set(m.graphs) == {"draft", "draft_sample", "target", "dspark_context"}
    assert m.graphs["target"]["outputs"][-1]["name"] == "aux_hidden"
    rt = DsparkDrafting.from_artifact(art)
    rt.observe(1, np.random.default_rng(0).standard_normal((4, 96)).astype(np.float32), 0)
    d = rt.draft([1], [7])
    q = 1.0 / (1.0 + np.exp(-d.confidence_logits.astype(np.float64)))  # head-less: q_max of each position
    assert d.tokens.shape == (1, 2) and ((q > 0) & (q < 1)).all() and d.probs is None
    assert np.allclose(d.survival, np.cumprod(q, axis=1), rtol=1e-4)
    g = rt.draft([1, 1], [7, 7], temperature=[0.0, 1.0], uniforms=np.full((2, 2), 0.3, np.float32))
    assert g.probs.shape == (2, 2, 120) and np.allclose(g.probs.sum(-1), 1.0, atol=1e-5)
    assert np.allclose(1.0 / (1.0 + np.exp(-g.confidence_logits[1])), g.probs[1].max(-1), atol=1e-5)  # T = 1
    assert g.tokens[0].tolist() == d.tokens[0].tolist()  # T = 0 rows draft greedily
    assert all(g.probs[i, j, g.tokens[i, j]] > 0 for i in range(2) for j in range(2))
    with pytest.raises(DsparkError, match="--force"):
        export_dspark_artifact(target_dir, draft_dir, art, max_batch=2, max_context=32)
