"""Train a small DSpark drafter (vLLM's `Qwen3DSparkModel` format) for the bundled stdlib target.

The drafter reads the frozen target's hidden states after layers `target_layer_ids`, shares the
target's embed_tokens/lm_head (absent from the checkpoint), drafts a block of N tokens in one pass and
corrects them with a rank-r Markov head; a confidence head estimates each draft's acceptance.

Stages (each resumable; checkpoints under <out>/_checkpoints, the same token cache as train_tiny_pair.py):
  1. drafter: M random anchors per training sequence, all blocks in one pass (dspark_blocks.py); each
     block [anchor, mask, ...] learns the target's next-token distributions at anchor..anchor+N-1 (KL,
     decayed over positions), the Markov head teacher-forced on the sequence's tokens;
  2. confidence head (drafter frozen): greedy draft steps on training contexts verified by the target;
     BCE of proj([h_i ; e_i]) against "draft i is accepted" on steps where drafts 1..i-1 were;
  3. save <out>/stdlib-dspark-draft (config.json + fp16 model.safetensors) and evaluate the saved
     checkpoint, loaded with load_dspark_drafter, on the held-out split: greedy acceptance per position,
     tau, head ECE/AUROC -> <out>/reports/dspark_draft_report.json.
Usage: python examples/train_dspark_draft.py [--steps 600] [--threads 1] [--out examples/models]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from train_tiny_pair import SEQ, batches, encode_split, lr_at  # noqa: E402

from dspark_trt.models.checkpoint import load_decoder  # noqa: E402
from dspark_trt.models.dspark_config import dspark_config_from_dict  # noqa: E402
from dspark_trt.models.dspark_drafter import DsparkDrafter, load_dspark_drafter  # noqa: E402
from dspark_trt.training.dspark_blocks import (block_hidden, block_tokens, markov_logits,  # noqa: E402
                                              position_weights, sample_anchors)
from dspark_trt.training.dspark_rollout import acceptance_summary, rollout  # noqa: E402

DRAFT_NAME = "stdlib-dspark-draft"
SHARED = ("embed_tokens.weight", "lm_head.weight", "d2t")  # from the target / the identity map: not saved
EVAL_CONTEXT = 128  # the classic draft's held-out evaluation (train_tiny_pair.greedy_acceptance)


def draft_config(target_cfg, *, layers: int, block: int, rank: int, target_layer_ids, mask_token_id: int) -> dict:
    return {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "vocab_size": target_cfg.vocab_size,
        "hidden_size": target_cfg.hidden_size, "intermediate_size": target_cfg.intermediate_size,
        "num_hidden_layers": layers, "num_attention_heads": target_cfg.num_attention_heads,
        "num_key_value_heads": target_cfg.num_key_value_heads, "head_dim": target_cfg.head_dim,
        "rms_norm_eps": 1e-6, "rope_theta": target_cfg.rope_theta, "max_position_embeddings": 2048,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float16",
        "target_hidden_size": target_cfg.hidden_size, "block_size": block,
        "dflash_config": {"target_layer_ids": list(target_layer_ids), "mask_token_id": mask_token_id,
                          "causal": False},
        "markov_rank": rank, "markov_head_type": "vanilla",
        "enable_confidence_head": True, "confidence_head_with_markov": True,
    }


def new_drafter(raw: dict, target, seed: int) -> DsparkDrafter:
    """Random draft stack (std 0.02, Markov correction w2 = 0) with the target's frozen embed/lm_head."""
    drafter = DsparkDrafter(dspark_config_from_dict(raw, target.config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            else:
                p.zero_()
        drafter.markov_head.markov_w2.weight.zero_()
        drafter.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        drafter.lm_head.weight.copy_(target.lm_head.weight)
    drafter.embed_tokens.weight.requires_grad_(False)
    drafter.lm_head.weight.requires_grad_(False)
    return drafter


def block_loss(drafter: DsparkDrafter, target, x: torch.Tensor, anchors: torch.Tensor, weights: torch.Tensor):
    """KL(target || draft) of every block slot, weighted by draft position; x [B, S] tokens."""
    cfg = drafter.cfg
    n = cfg.num_draft
    with torch.no_grad():
        t_logits, aux = target.forward_dense(x, aux_layers=cfg.aux_layers)
        predicted = anchors[..., None] + torch.arange(n)  # slot j predicts token (anchor + j) + 1
        flat = predicted.flatten(1)
        t_logits = t_logits.gather(1, flat[..., None].expand(-1, -1, t_logits.shape[-1]))  # [B, M * N, V]
        t_logp = F.log_softmax(t_logits, -1)
        prev = x.gather(1, flat).view_as(predicted)  # teacher forcing: the token before each predicted one
    hidden = block_hidden(drafter, aux, block_tokens(x, anchors, cfg.query_len, cfg.mask_token_id), anchors)
    logits = markov_logits(drafter, drafter.sample_rows(hidden.flatten(0, 1)).view(*predicted.shape, -1), prev)
    logp = F.log_softmax(logits.float(), -1).flatten(1, 2)
    kl = (t_logp.exp() * (t_logp - logp)).sum(-1).view_as(predicted)  # [B, M, N]
    with torch.no_grad():  # greedy agreement per position, for the progress bar
        agree = (logits.argmax(-1) == t_logits.argmax(-1).view_as(predicted)).float().mean((0, 1))
    return (kl.mean((0, 1)) * weights).sum() / weights.sum(), agree


def train_drafter(drafter, target, data, args, ckpt_dir: Path):
    ckpt = ckpt_dir / "dspark_draft.ckpt.pt"
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    start = 0
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        drafter.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    gen = batches(data, args.batch, args.seed)
    anchor_gen = torch.Generator().manual_seed(args.seed)
    weights = position_weights(drafter.cfg.num_draft, args.gamma)
    for _ in range(start):  # replay both samplers so a resumed run sees the same batches and anchors
        next(gen)
        sample_anchors(args.batch, SEQ, args.anchors, drafter.cfg.query_len, anchor_gen)
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="train dspark draft")
    for step in bar:
        x = next(gen)[:, :SEQ]
        anchors = sample_anchors(args.batch, SEQ, args.anchors, drafter.cfg.query_len, anchor_gen)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr)
        loss, agree = block_loss(drafter, target, x, anchors, weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", agree1=f"{agree[0]:.2f}", agreeN=f"{agree[-1]:.2f}")
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            torch.save({"model": drafter.state_dict(), "opt": opt.state_dict(), "step": step + 1}, ckpt)
    return drafter


def contexts(data: np.ndarray, n: int, length: int, seed: int) -> torch.Tensor:
    """n held-out windows of `length` tokens (the classic draft's evaluation draws with seed 7)."""
    starts = np.random.default_rng(seed).integers(0, len(data) - length - 1, n)
    return torch.from_numpy(np.stack([data[s:s + length] for s in starts]).astype(np.int64))


def train_head(drafter, target, data, args, ckpt_dir: Path):
    """Fit confidence_head.proj on greedy draft steps of training contexts (drafter frozen)."""
    ckpt = ckpt_dir / "dspark_head.ckpt.pt"
    head = drafter.confidence_head
    if ckpt.is_file():
        head.load_state_dict(torch.load(ckpt, weights_only=False)["head"])
        return
    feats, labels = [], []
    rng = np.random.default_rng(args.seed + 5)
    for _ in tqdm(range(args.head_contexts // args.head_batch), desc="head rollouts"):
        length = int(rng.integers(32, EVAL_CONTEXT + 1))
        ro = rollout(drafter, target, contexts(data, args.head_batch, length, int(rng.integers(1 << 31))))
        feats.append(ro.features[ro.reached])
        labels.append(ro.matched[ro.reached].float())
    x, y = torch.cat(feats), torch.cat(labels)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    with torch.no_grad():
        head.proj.weight.zero_()
        head.proj.bias.fill_(float(torch.logit(y.mean().clamp(0.01, 0.99))))
    for _ in tqdm(range(args.head_epochs), desc="head fit"):  # full-batch logistic regression
        loss = F.binary_cross_entropy_with_logits(head.proj(x).squeeze(-1), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    print(f"head: {len(y):,} verified drafts, acceptance {y.mean():.3f}, BCE {loss.item():.4f}")
    torch.save({"head": head.state_dict(), "examples": len(y), "bce": loss.item()}, ckpt)


def save_draft(drafter: DsparkDrafter, raw: dict, out: Path) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in drafter.state_dict().items() if k not in SHARED}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def evaluate(draft_dir: Path, target_dir: Path, held: np.ndarray, args) -> dict:
    """The saved checkpoint as users load it: greedy acceptance on the classic draft's held-out contexts,
    and the head's calibration on a larger held-out sample."""
    from dspark_trt.training.calibration import calibrate_arrays

    drafter, target = load_dspark_drafter(draft_dir, target_dir), load_decoder(target_dir).eval()
    greedy = rollout(drafter, target, contexts(held, 256, EVAL_CONTEXT, seed=7))
    rolls = [rollout(drafter, target, contexts(held, args.head_batch, EVAL_CONTEXT, seed=11 + i))
             for i in range(max(1, args.calib_contexts // args.head_batch))]
    cat = lambda f: torch.cat([f(r) for r in rolls]).double().numpy()  # noqa: E731
    calib = calibrate_arrays(cat(lambda r: r.conf_logits), cat(lambda r: r.accepted), cat(lambda r: r.top_prob))
    return {"greedy": acceptance_summary(greedy.accepted), "calibration": calib.to_dict(),
            "calibration_contexts": int(sum(r.drafts.shape[0] for r in rolls))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).parent / "models"))
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=8, help="training sequences per step")
    ap.add_argument("--anchors", type=int, default=32, help="blocks per sequence per step")
    ap.add_argument("--block", type=int, default=7, help="N draft tokens per block (block_size)")
    ap.add_argument("--layers", type=int, default=2, help="draft decoder layers")
    ap.add_argument("--markov-rank", type=int, default=32)
    ap.add_argument("--target-layer-ids", default="1,3,5", help="target layers the draft reads (0-based)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--gamma", type=float, default=4.0, help="loss weight of position k: exp(-(k-1)/gamma)")
    ap.add_argument("--head-contexts", type=int, default=2048)
    ap.add_argument("--head-batch", type=int, default=64)
    ap.add_argument("--head-epochs", type=int, default=300)
    ap.add_argument("--calib-contexts", type=int, default=1024)
    ap.add_argument("--save-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the machine is shared)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    ckpt = out / "_checkpoints"
    ckpt.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    target_dir = out / "stdlib-target"
    tok = target_dir / "tokenizer.json"
    train_ids, held_ids = encode_split(tok, "train", ckpt), encode_split(tok, "heldout", ckpt)
    print(f"tokens: train {len(train_ids):,} heldout {len(held_ids):,}")
    target = load_decoder(target_dir).eval().requires_grad_(False)
    raw = draft_config(target.config, layers=args.layers, block=args.block, rank=args.markov_rank,
                       target_layer_ids=[int(i) for i in args.target_layer_ids.split(",")],
                       mask_token_id=0)  # <|endoftext|>: the tokenizer's only special token
    drafter = new_drafter(raw, target, args.seed)
    train_drafter(drafter, target, train_ids, args, ckpt)
    with torch.no_grad():  # the head learns on the weights as they will be stored
        for p in drafter.parameters():
            p.copy_(p.half().float())
    drafter.eval().requires_grad_(False)
    drafter.confidence_head.requires_grad_(True)
    train_head(drafter, target, train_ids, args, ckpt)
    draft_dir = save_draft(drafter, raw, out / DRAFT_NAME)
    report = evaluate(draft_dir, target_dir, held_ids, args)
    classic = json.loads((out / "training_report.json").read_text())["greedy"] \
        if (out / "training_report.json").is_file() else None
    n_params = sum(p.numel() for k, p in drafter.state_dict().items() if k not in SHARED)
    report = {"draft_params": n_params, "draft_bytes": (draft_dir / "model.safetensors").stat().st_size,
              **report, "classic_draft_greedy": classic,
              "config": {k: raw[k] for k in ("num_hidden_layers", "block_size", "markov_rank", "dflash_config")},
              "steps": args.steps, "batch": args.batch, "anchors_per_seq": args.anchors, "seq": SEQ,
              "lr": args.lr, "gamma": args.gamma, "head_contexts": args.head_contexts, "threads": args.threads,
              "wall_minutes_this_run": round((time.time() - t0) / 60, 1)}
    (out / "reports").mkdir(exist_ok=True)
    (out / "reports" / "dspark_draft_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("greedy", "classic_draft_greedy")}, indent=2))
    print("calibration:", json.dumps(report["calibration"]["summary"], indent=None)[:600])


if __name__ == "__main__":
    main()
