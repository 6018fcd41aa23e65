"""Training a DSpark drafter: the many-blocks training pass, the verified rollout, the example script's
stages, and the shipped stdlib drafter."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dspark_trt.models.checkpoint import load_decoder
from dspark_trt.models.dspark_drafter import load_dspark_drafter
from dspark_trt.training.dspark_blocks import block_hidden, block_tokens, markov_logits, sample_anchors
from dspark_trt.training.dspark_rollout import acceptance_summary, rollout
from tests.dspark_fixtures import make_draft, make_target
from tests.dspark_reference import reference_step

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "examples" / "models"


def load_script():
    spec = importlib.util.spec_from_file_location("train_dspark_draft", ROOT / "examples" / "train_dspark_draft.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def pair(tmp_path):
    target_dir = make_target(tmp_path, arch="llama", tie=True)
    return load_decoder(target_dir), target_dir, tmp_path


@pytest.mark.parametrize("causal", [False, True])
def test_every_block_of_the_training_pass_equals_the_serving_block_pass(pair, causal):
    target, target_dir, tmp = pair
    drafter = load_dspark_drafter(make_draft(tmp, causal=causal, block_size=4), target_dir)
    x = torch.randint(0, 120, (2, 24), generator=torch.Generator().manual_seed(1))
    anchors = sample_anchors(2, 24, 5, drafter.cfg.query_len, torch.Generator().manual_seed(2))
    _, aux = target.forward_dense(x, aux_layers=drafter.cfg.aux_layers)
    blocks = block_tokens(x, anchors, drafter.cfg.query_len, drafter.cfg.mask_token_id)
    with torch.no_grad():
        together = block_hidden(drafter, aux, blocks, anchors)
        for b in range(2):
            for m, a in enumerate(anchors[b].tolist()):
                keys, values = drafter.context_kv(aux[b, :a], torch.arange(a))
                alone = drafter.block(blocks[b, m][None], [k[:, None] for k in keys], [v[:, None] for v in values],
                                      torch.tensor([0]), torch.tensor([a]))
                torch.testing.assert_close(together[b, m], alone[0], atol=1e-5, rtol=1e-4)


def test_anchors_leave_a_context_and_room_for_the_whole_block():
    anchors = sample_anchors(64, 30, 20, 7, torch.Generator().manual_seed(0))
    assert anchors.min() >= 1 and anchors.max() + 7 - 1 <= 29
    assert all(len(set(row.tolist())) == 20 for row in anchors)


def test_teacher_forced_markov_logits_follow_the_serving_markov_stage(pair):
    target, target_dir, tmp = pair
    drafter = load_dspark_drafter(make_draft(tmp, block_size=4), target_dir)
    rows = torch.randn(3, 4, drafter.cfg.hidden_size)
    anchor = torch.tensor([4, 9, 77])
    with torch.no_grad():
        drafts, _, served = drafter.markov(drafter.base_logits(rows), drafter.confidence_base(rows), anchor,
                                           return_logits=True)
        forced = markov_logits(drafter, rows, torch.cat([anchor[:, None], drafts[:, :-1]], 1))
    torch.testing.assert_close(forced, served, atol=1e-5, rtol=1e-5)


def test_rollout_drafts_what_the_serving_step_drafts_and_verifies_with_the_target(pair):
    target, target_dir, tmp = pair
    drafter = load_dspark_drafter(make_draft(tmp, block_size=4), target_dir)
    ctx = torch.randint(0, 120, (3, 10), generator=torch.Generator().manual_seed(4))
    ro = rollout(drafter, target, ctx)
    for r in range(3):
        seq = ctx[r].tolist()
        for i, d in enumerate(ro.drafts[r].tolist()):
            greedy = int(target.forward_dense(torch.tensor([seq]))[0, -1].argmax())
            assert bool(ro.matched[r, i]) == (greedy == d)
            seq.append(d)
    summary = acceptance_summary(ro.accepted)
    assert summary["tau"] == pytest.approx(1 + ro.accepted.sum(1).float().mean().item())
    assert ro.features.shape == (3, 4, drafter.cfg.hidden_size + drafter.cfg.markov_rank)


def test_the_example_script_trains_resumes_and_writes_a_loadable_draft_and_report(pair):
    script = load_script()
    _, target_dir, tmp = pair
    out = tmp / "models"
    (out / "_checkpoints").mkdir(parents=True)
    (out / "stdlib-target").symlink_to(target_dir)
    stream = np.random.default_rng(0).integers(1, 120, 6000).astype(np.int16)
    np.save(out / "_checkpoints" / "train.npy", stream)  # the token cache encode_split reads
    np.save(out / "_checkpoints" / "heldout.npy", stream[:3000])
    argv = ["--out", str(out), "--batch", "2", "--anchors", "4", "--block", "4", "--layers", "1",
            "--markov-rank", "8", "--target-layer-ids", "0,2", "--head-contexts", "8", "--head-batch", "4",
            "--head-epochs", "5", "--calib-contexts", "4", "--save-every", "1"]
    script.main(argv + ["--steps", "2"])
    assert torch.load(out / "_checkpoints" / "dspark_draft.ckpt.pt", weights_only=False)["step"] == 2
    (out / "_checkpoints" / "dspark_head.ckpt.pt").unlink()
    script.main(argv + ["--steps", "3"])  # resumes at step 2
    assert torch.load(out / "_checkpoints" / "dspark_draft.ckpt.pt", weights_only=False)["step"] == 3
    draft_dir = out / "stdlib-dspark-draft"
    assert sorted(p.name for p in draft_dir.iterdir()) == ["config.json", "model.safetensors"]
    drafter = load_dspark_drafter(draft_dir, target_dir)
    assert drafter.confidence_head is not None and drafter.cfg.num_draft == 4
    report = json.loads((out / "reports" / "dspark_draft_report.json").read_text())
    assert report["greedy"]["k"] == 4 and report["greedy"]["contexts"] == 256
    assert {"mean_ece_before", "mean_auroc"} <= set(report["calibration"]["summary"])



def test_the_shipped_stdlib_drafter_drafts_for_the_stdlib_target():
    from tokenizers import Tokenizer

    from dspark_trt.training.corpus import read_texts, stdlib_files

    draft_dir, target_dir = MODELS / "stdlib-dspark-draft", MODELS / "stdlib-target"
    drafter, target = load_dspark_drafter(draft_dir, target_dir), load_decoder(target_dir).eval()
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    ids = []
    for text in read_texts(stdlib_files("heldout")[:4]):
        ids.extend(tok.encode(text).ids)
    starts = np.random.default_rng(0).integers(0, len(ids) - 65, 24)
    ctx = torch.tensor([ids[s:s + 64] for s in starts])
    ro = rollout(drafter, target, ctx)
    summary = acceptance_summary(ro.accepted)
    assert summary["conditional_acceptance"][0] > 0.4
    assert summary["tau"] > 2.0

    # The file read by tensor name, as vLLM's loader reads it, drafts the same tokens and confidences.
    raw = json.loads((draft_dir / "config.json").read_text())
    tensors = {k: v.float() for k, v in load_file(str(draft_dir / "model.safetensors")).items()}
    with torch.no_grad():
        _, aux = target.forward_dense(ctx[:2, :-1], aux_layers=drafter.cfg.aux_layers)
        for r in range(2):
            toks, _, conf = reference_step(raw, tensors, aux[r], int(ctx[r, -1]), target.model.embed_tokens.weight,
                                           target.lm_head.weight)
            assert toks == ro.drafts[r].tolist()
            assert (conf - torch.sigmoid(ro.conf_logits[r])).abs().max() <= 1e-4
