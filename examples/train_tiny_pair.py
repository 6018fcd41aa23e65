"""Train the bundled tiny draft/target pair on the Python standard library (2 CPU cores, < 2 hours).

Stages (each resumable; checkpoints under examples/models/_checkpoints):
  1. byte-level BPE tokenizer, vocab 4096, on the training split;
  2. target: Llama, ~11M parameters, next-token loss;
  3. draft: Llama, 1 layer, distilled from the target's logits (KL);
  4. evaluation on the held-out split: loss of each, greedy acceptance per draft position, tau.
Usage: python examples/train_tiny_pair.py [--target-steps 600] [--draft-steps 700] [--out examples/models]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from dspark_trt.models.checkpoint import save_decoder
from dspark_trt.models.config import ModelConfig
from dspark_trt.models.decoder import Decoder
from dspark_trt.training.corpus import read_texts, stdlib_files

VOCAB = 4096
SEQ = 256
TARGET = ModelConfig("llama", VOCAB, 384, 1024, 6, 6, 2, 64, rope_theta=10000.0, tie_word_embeddings=True,
                     max_position_embeddings=2048)
DRAFT = ModelConfig("llama", VOCAB, 192, 640, 1, 3, 1, 64, rope_theta=10000.0, tie_word_embeddings=True,
                    max_position_embeddings=2048)


# A code model's chat template: system and user messages become Python comments, assistant messages stay
# code, and the reply continues as code (`dspark-trt serve` renders it for /v1/chat/completions).
CHAT_TEMPLATE = ("{% for message in messages %}\n"
                 "{% if message['role'] == 'assistant' %}\n"
                 "{{ message['content'] }}\n"
                 "{% else %}\n"
                 "# {{ message['content'] | replace('\\n', '\\n# ') }}\n"
                 "{% endif %}\n"
                 "{% endfor %}\n")


def train_tokenizer(out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = out / "tokenizer.json"
    if path.is_file():
        return path
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=True,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(read_texts(stdlib_files("train")), trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def encode_split(tok_path: Path, split: str, cache: Path) -> np.ndarray:
    from tokenizers import Tokenizer

    f = cache / f"{split}.npy"
    if f.is_file():
        return np.load(f)
    tok = Tokenizer.from_file(str(tok_path))
    eot = tok.token_to_id("<|endoftext|>")
    ids = []
    for enc in tok.encode_batch(read_texts(stdlib_files(split))):
        ids.extend(enc.ids + [eot])
    arr = np.asarray(ids, dtype=np.int16)
    np.save(f, arr)
    return arr


def batches(data: np.ndarray, batch: int, seed: int):
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - SEQ - 1, batch)
        x = np.stack([data[s:s + SEQ + 1] for s in starts]).astype(np.int64)
        yield torch.from_numpy(x)


def lr_at(step: int, total: int, peak: float) -> float:
    warm = max(1, total // 20)
    if step < warm:
        return peak * (step + 1) / warm
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm))))


def train(name: str, model: Decoder, data, steps: int, peak_lr: float, ckpt_dir: Path, teacher: Decoder | None,
          batch: int, seed: int):
    ckpt = ckpt_dir / f"{name}.ckpt.pt"
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.05)
    start = 0
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    gen = batches(data, batch, seed)
    for _ in range(start):  # replay the sampler so a resumed run sees the same batches
        next(gen)
    bar = tqdm(range(start, steps), initial=start, total=steps, desc=f"train {name}")
    for step in bar:
        x = next(gen)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, peak_lr)
        logits = model.forward_dense(x[:, :-1])
        if teacher is None:
            loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        else:
            with torch.no_grad():
                t_logp = F.log_softmax(teacher.forward_dense(x[:, :-1]), -1)
            loss = F.kl_div(F.log_softmax(logits, -1).flatten(0, 1), t_logp.flatten(0, 1), log_target=True,
                            reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % 25 == 0 or step + 1 == steps:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, ckpt)
    return model


@torch.no_grad()
def heldout_loss(model: Decoder, data: np.ndarray, n_batches: int = 20) -> float:
    gen = batches(data, 8, seed=1234)
    losses = []
    for _ in range(n_batches):
        x = next(gen)
        losses.append(F.cross_entropy(model.forward_dense(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).item())
    return float(np.mean(losses))


@torch.no_grad()
def greedy_acceptance(target: Decoder, draft: Decoder, data: np.ndarray, k: int = 7, n: int = 256, ctx: int = 128):
    """Draft k tokens greedily after n held-out contexts; count the prefix the target's argmax agrees with."""
    rng = np.random.default_rng(7)
    starts = rng.integers(0, len(data) - ctx - 1, n)
    x = torch.from_numpy(np.stack([data[s:s + ctx] for s in starts]).astype(np.int64))
    seq = x
    for _ in range(k):
        nxt = draft.forward_dense(seq)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    t_pred = target.forward_dense(seq)[:, ctx - 1:-1].argmax(-1)
    match = (t_pred == seq[:, ctx:]).int()
    accepted = match.cumprod(1)  # 1 while every earlier position matched
    reached = torch.cat([torch.ones(n, 1, dtype=torch.int32), accepted[:, :-1]], 1)
    per_pos = (accepted.sum(0).float() / reached.sum(0).clamp(min=1).float()).tolist()
    return {"conditional_acceptance": per_pos, "cumulative_acceptance": accepted.float().mean(0).tolist(),
            "tau": float(1 + accepted.sum(1).float().mean()), "k": k, "contexts": n}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).parent / "models"))
    ap.add_argument("--target-steps", type=int, default=450)
    ap.add_argument("--draft-steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    ckpt = out / "_checkpoints"
    ckpt.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    tok = train_tokenizer(ckpt)
    train_ids, held_ids = encode_split(tok, "train", ckpt), encode_split(tok, "heldout", ckpt)
    print(f"tokens: train {len(train_ids):,} heldout {len(held_ids):,}")

    target = Decoder(TARGET).init_weights(seed=args.seed)
    train("target", target, train_ids, args.target_steps, 2e-3, ckpt, None, args.batch, args.seed)
    target.eval()
    draft = Decoder(DRAFT).init_weights(seed=args.seed + 1)
    train("draft", draft, train_ids, args.draft_steps, 3e-3, ckpt, target, args.batch, args.seed + 1)
    draft.eval()

    for name, model in (("stdlib-target", target), ("stdlib-draft", draft)):
        save_decoder(model, out / name, dtype="fp16")
        (out / name / "tokenizer.json").write_bytes(tok.read_bytes())
        (out / name / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "model_max_length": 2048,
             "chat_template": CHAT_TEMPLATE}) + "\n")
        (out / name / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}) + "\n")

    # Evaluate the saved (fp16-rounded) weights as users will load them.
    from dspark_trt.models.checkpoint import load_decoder
    target, draft = load_decoder(out / "stdlib-target"), load_decoder(out / "stdlib-draft")
    report = {
        "target_params": target.num_parameters(), "draft_params": draft.num_parameters(),
        "target_heldout_loss": heldout_loss(target, held_ids), "draft_heldout_loss": heldout_loss(draft, held_ids),
        "greedy": greedy_acceptance(target, draft, held_ids),
        "train_tokens": int(len(train_ids)), "heldout_tokens": int(len(held_ids)),
        "target_steps": args.target_steps, "draft_steps": args.draft_steps, "batch": args.batch, "seq": SEQ,
        "wall_minutes": round((time.time() - t0) / 60, 1),
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
