"""Draft rollouts on real text: the data both head training and calibration learn from.

At a position t of a text, the context is the real tokens x_{t-C..t-1} (teacher forcing). The draft then
proposes x_1..x_K greedily, exactly as the runtime does (prefill + single-token steps on an explicit KV
cache, `Decoder.forward_packed`, so the hidden states come from the serving path), and one target
forward over context + drafts gives the target distribution p_k at every draft position. For draft position k (1-based):

- hidden[:, k-1]      h_k: the draft's final hidden state (after the final norm, the input of lm_head) at
                      the position whose logits predict x_k, i.e. the position fed x_{k-1};
- prev_token[:, k-1]  x_{k-1}: the token fed to the draft there (k = 1: the last context token);
- draft_token         x_k, the greedy draft token;
- label_expected      sum_v min(p_k(v), q_k(v)) = 1 - TV(p_k, q_k) (q: draft softmax at temperature 1);
- label_greedy        1[argmax p_k == x_k];
- fallback_conf       max_v q_k(v), the confidence the runtime uses when there is no head;
- draft_stats         `confidence_head.draft_stats` of q_k, all of DRAFT_STATS (a head picks its columns);
- survival_greedy     prod_{i<=k} label_greedy (the whole prefix 1..k survives greedy verification);
- survival_expected   prod_{i<=k} label_expected.

Texts are tokenized with the model's tokenizer.json and joined with the end-of-text token (as the bundled
pair was trained). Start positions and context lengths come from a seeded numpy generator; the models
run in fp32 on CPU with greedy argmax, so a rollout is deterministic for a given seed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dspark_trt.errors import DsparkError

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")


@dataclass
class Rollout:
    """Per-context, per-draft-position arrays, all shaped [N, K, ...]."""

    hidden: np.ndarray  # [N, K, H] float32
    prev_token: np.ndarray  # [N, K] int64
    draft_token: np.ndarray  # [N, K] int64
    label_expected: np.ndarray  # [N, K] float32
    label_greedy: np.ndarray  # [N, K] float32 (0/1)
    fallback_conf: np.ndarray  # [N, K] float32
    draft_stats: np.ndarray  # [N, K, len(DRAFT_STATS)] float32
    context_len: np.ndarray  # [N] int64, the context length used for each row
    context_end: np.ndarray  # [N] int64: row i's context is stream[context_end - context_len : context_end]
    info: dict = field(default_factory=dict)

    @property
    def n(self) -> int:
        return int(self.hidden.shape[0])

    @property
    def k(self) -> int:
        return int(self.hidden.shape[1])

    @property
    def survival_greedy(self) -> np.ndarray:
        return np.cumprod(self.label_greedy, axis=1)

    @property
    def survival_expected(self) -> np.ndarray:
        return np.cumprod(self.label_expected, axis=1)

    def stats_for(self, names) -> np.ndarray:
        """The draft-statistic columns a head uses, [N, K, len(names)]."""
        from dspark_trt.models.confidence_head import DRAFT_STATS, check_stats

        return self.draft_stats[..., [DRAFT_STATS.index(n) for n in check_stats(names)]]

    def labels(self, kind: str) -> np.ndarray:
        return {"expected": self.label_expected, "greedy": self.label_greedy}[_check_kind(kind)]

    def survival(self, kind: str) -> np.ndarray:
        return np.cumprod(self.labels(kind), axis=1)

    def reach_weight(self, kind: str) -> np.ndarray:
        """Probability that positions 1..k-1 survived (1 for k = 1): the weight of position k's label when
        the head learns the *conditional* acceptance c_k = P(accept k | 1..k-1 accepted)."""
        s = self.survival(kind)
        return np.concatenate([np.ones_like(s[:, :1]), s[:, :-1]], axis=1)

    def tau(self, kind: str = "greedy") -> float:
        """Mean accepted length, bonus token counted: 1 + sum_k S_k."""
        return float(1.0 + self.survival(kind).sum(axis=1).mean())


def _check_kind(kind: str) -> str:
    if kind not in ("expected", "greedy"):
        raise DsparkError(f"unknown label kind {kind!r} (use 'expected' or 'greedy')")
    return kind


# --------------------------------------------------------------------------- tokenization

def load_tokenizer(*model_dirs):
    """The first tokenizer.json found among the model directories."""
    from tokenizers import Tokenizer

    for d in model_dirs:
        path = Path(d) / "tokenizer.json" if d is not None else None
        if path is not None and path.is_file():
            try:
                return Tokenizer.from_file(str(path))
            except Exception as e:  # tokenizers raises its own exception type for a corrupt file
                raise DsparkError(f"{path} is not a valid tokenizer file ({str(e).splitlines()[0][:200]}): "
                                  f"restore it from the model's source") from None
    raise DsparkError(f"no tokenizer.json in {' or '.join(str(d) for d in model_dirs if d is not None)}")


def eos_token_id(tokenizer, model_dir=None) -> int | None:
    """The end-of-text id used to join documents: tokenizer_config.json's eos_token, else a known name."""
    names = []
    if model_dir is not None:
        cfg = Path(model_dir) / "tokenizer_config.json"
        if cfg.is_file():
            try:
                eos = json.loads(cfg.read_text()).get("eos_token")
                if isinstance(eos, dict):
                    eos = eos.get("content")
                if isinstance(eos, str):
                    names.append(eos)
            except json.JSONDecodeError:
                pass
    for name in [*names, *EOS_CANDIDATES]:
        tid = tokenizer.token_to_id(name)
        if tid is not None:
            return int(tid)
    return None


def tokenize_texts(tokenizer, texts, eos_id: int | None = None, max_tokens: int | None = None,
                   seed: int = 0, chunk: int = 64) -> np.ndarray:
    """Token stream of the texts joined by eos_id. With max_tokens, texts are taken in a seeded random
    order until about max_tokens tokens are collected (so a large corpus is not tokenized in full)."""
    texts = list(texts)
    order = np.arange(len(texts))
    if max_tokens is not None:
        order = np.random.default_rng(seed).permutation(len(texts))
    ids: list[int] = []
    for start in range(0, len(order), chunk):
        for enc in tokenizer.encode_batch([texts[i] for i in order[start:start + chunk]]):
            ids.extend(enc.ids)
            if eos_id is not None:
                ids.append(eos_id)
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    return np.asarray(ids, dtype=np.int64)


# --------------------------------------------------------------------------- rollout

def draft_greedy(draft, ctx, k: int):
    """Greedy K-token draft after each context row, with an explicit KV cache (the serving path,
    `Decoder.forward_packed`): one prefill of the contexts, then K-1 single-token steps.

    ctx [B, C] int64 -> (seq [B, C+K] = context + x_1..x_K, hidden [B, K, H] = h_1..h_K, logits [B, K, V]),
    where h_k / logits[:, k-1] are the draft's final hidden state / logits at the position fed x_{k-1}.
    """
    import torch

    from dspark_trt.models.decoder import PackedBatch, make_packed_index

    b, c = ctx.shape
    cfg = draft.config
    dtype = draft.model.embed_tokens.weight.dtype
    keys, values = draft.empty_cache(b, c + k, dtype=dtype)
    slots = torch.arange(b)
    no_past = [t[:0] for t in keys]
    pack, unpack = make_packed_index([c] * b)
    h, nk, nv = draft.forward_packed(PackedBatch(
        tokens=ctx.reshape(-1), positions=torch.arange(c).repeat(b), pack_index=pack, unpack_index=unpack,
        query_lens=torch.full((b,), c), past_lens=torch.zeros(b, dtype=torch.int64), slot_ids=slots,
        past_keys=no_past, past_values=no_past))
    for layer in range(cfg.num_hidden_layers):
        keys[layer][:c] = nk[layer].reshape(b, c, *nk[layer].shape[1:]).transpose(0, 1)
        values[layer][:c] = nv[layer].reshape(b, c, *nv[layer].shape[1:]).transpose(0, 1)
    h_last = h.reshape(b, c, -1)[:, -1]
    hiddens, logits_all, tokens = [], [], []
    one_pack, one_unpack = slots[:, None].clone(), slots.clone()
    for step in range(k):
        logits = draft.lm_head(h_last)
        nxt = logits.float().argmax(-1)
        hiddens.append(h_last)
        logits_all.append(logits)
        tokens.append(nxt)
        if step == k - 1:
            break
        pos = c + step
        h_last, nk, nv = draft.forward_packed(PackedBatch(
            tokens=nxt, positions=torch.full((b,), pos), pack_index=one_pack, unpack_index=one_unpack,
            query_lens=torch.ones(b, dtype=torch.int64), past_lens=torch.full((b,), pos), slot_ids=slots,
            past_keys=[t[:pos] for t in keys], past_values=[t[:pos] for t in values]))
        for layer in range(cfg.num_hidden_layers):
            keys[layer][pos] = nk[layer]
            values[layer][pos] = nv[layer]
    seq = torch.cat([ctx, torch.stack(tokens, 1)], dim=1)
    return seq, torch.stack(hiddens, 1), torch.stack(logits_all, 1)


def rollout(target, draft, stream: np.ndarray, num_contexts: int = 2048, max_draft: int = 7,
            context_len: int = 128, min_context_len: int | None = None, batch_size: int = 32, seed: int = 0,
            progress: bool = True, desc: str = "rollout") -> Rollout:
    """Draft K tokens greedily after `num_contexts` random contexts of `stream` and label them.

    Context lengths vary per batch, uniformly in [min_context_len, context_len] (default: context_len // 4),
    so the head sees short and long prompts alike. Models are torch Decoders (eval, fp32).
    """
    import torch
    from tqdm import tqdm

    from dspark_trt.models.confidence_head import draft_stats

    stream = np.asarray(stream, dtype=np.int64)
    vocab = min(draft.config.vocab_size, target.config.vocab_size)
    if stream.size and (stream.max() >= vocab or stream.min() < 0):
        raise DsparkError(f"the tokenizer produced id {int(stream.max())}, outside the models' vocabulary of {vocab}")
    k_max = int(max_draft)
    max_pos = min(draft.config.max_position_embeddings, target.config.max_position_embeddings)
    c_hi = min(int(context_len), max_pos - k_max, stream.size)
    if c_hi < 1:
        raise DsparkError(f"not enough text to roll out: {stream.size} tokens (need at least 1 context token)")
    c_lo = max(1, min(c_hi, int(min_context_len) if min_context_len else max(1, c_hi // 4)))
    rng = np.random.default_rng(seed)

    hidden, prev, drafted, lab_e, lab_g, fb, dstats, ctx_lens, ctx_ends = [], [], [], [], [], [], [], [], []
    n_batches = (num_contexts + batch_size - 1) // batch_size
    bar = tqdm(range(n_batches), desc=desc, unit="batch", disable=not progress, leave=False, mininterval=0.5)
    with torch.inference_mode():
        for b in bar:
            bsz = min(batch_size, num_contexts - b * batch_size)
            c = int(rng.integers(c_lo, c_hi + 1))
            ends = rng.integers(c, stream.size + 1, size=bsz)  # context = stream[end - c : end]
            ctx = torch.from_numpy(np.stack([stream[e - c:e] for e in ends]))
            seq, d_hidden_k, d_logits_k = draft_greedy(draft, ctx, k_max)
            # seq = context + x_1..x_K; positions c-1 .. c+K-2 (fed x_0..x_{K-1}) predict x_1..x_K.
            fed = seq[:, :-1]
            sl = slice(c - 1, c - 1 + k_max)
            q = torch.softmax(d_logits_k.float(), dim=-1)
            p = torch.softmax(target.forward_dense(fed)[:, sl].float(), dim=-1)
            x = seq[:, c:]
            hidden.append(d_hidden_k.float().numpy())
            prev.append(fed[:, sl].numpy())
            drafted.append(x.numpy())
            lab_e.append(torch.minimum(p, q).sum(-1).clamp(0.0, 1.0).numpy())
            lab_g.append((p.argmax(-1) == x).float().numpy())
            fb.append(q.max(-1).values.numpy())
            dstats.append(draft_stats(d_logits_k).numpy())
            ctx_lens.append(np.full(bsz, c, dtype=np.int64))
            ctx_ends.append(ends.astype(np.int64))
            bar.set_postfix(acc1=f"{np.concatenate(lab_g)[:, 0].mean():.2f}", refresh=False)
    bar.close()
    return Rollout(
        hidden=np.concatenate(hidden).astype(np.float32),
        prev_token=np.concatenate(prev).astype(np.int64),
        draft_token=np.concatenate(drafted).astype(np.int64),
        label_expected=np.concatenate(lab_e).astype(np.float32),
        label_greedy=np.concatenate(lab_g).astype(np.float32),
        fallback_conf=np.concatenate(fb).astype(np.float32),
        draft_stats=np.concatenate(dstats).astype(np.float32),
        context_len=np.concatenate(ctx_lens),
        context_end=np.concatenate(ctx_ends),
        info={"num_contexts": int(num_contexts), "max_draft": k_max, "context_len": [int(c_lo), int(c_hi)],
              "stream_tokens": int(stream.size), "seed": int(seed)},
    )


def distinct_contexts(stream_size: int, context_len: int, max_draft: int, max_pos: int) -> tuple[int, int]:
    """(distinct contexts, shortest context length) `rollout` can draw from a stream of this many tokens:
    one per token that ends a context of at least the shortest length (rollout's own bounds)."""
    c_hi = min(int(context_len), max_pos - int(max_draft), int(stream_size))
    if c_hi < 1:
        return 0, 1
    c_lo = max(1, c_hi // 4)
    return int(stream_size) - c_lo + 1, c_lo


def rollout_from_dirs(target_dir, draft_dir, data, num_contexts: int = 2048, max_draft: int = 7,
                      context_len: int = 128, batch_size: int = 32, seed: int = 0, progress: bool = True,
                      desc: str = "rollout", models=None, min_contexts: int = 0,
                      purpose: str = "roll out") -> Rollout:
    """Load target, draft, tokenizer and texts (`corpus.load_texts`), then `rollout`.

    models: optional (target, draft) already loaded, to skip loading; otherwise they are loaded after the
    data is checked. min_contexts: refuse data with fewer distinct contexts (a DsparkError saying how many
    it found and needs, "too small to {purpose}").
    """
    from dspark_trt.models.checkpoint import check_same_vocab, load_decoder
    from dspark_trt.models.config import load_config
    from dspark_trt.training.corpus import load_texts

    if not isinstance(seed, int) or seed < 0:
        raise DsparkError(f"--seed must be an integer >= 0, got {seed!r}")
    check_same_vocab(target_dir, draft_dir)
    tok = load_tokenizer(draft_dir, target_dir)
    eos = eos_token_id(tok, draft_dir)
    texts = load_texts(data)
    if not texts:
        raise DsparkError(f"no text found in {data}")
    # Enough text that contexts rarely overlap, without tokenizing a whole large corpus.
    budget = max(200_000, 8 * num_contexts * (context_len + max_draft))
    stream = tokenize_texts(tok, texts, eos, max_tokens=budget, seed=seed)
    if min_contexts:
        max_pos = min(load_config(target_dir).max_position_embeddings, load_config(draft_dir).max_position_embeddings)
        found, shortest = distinct_contexts(stream.size, context_len, max_draft, max_pos)
        if found < min_contexts:
            raise DsparkError(f"--data {data} is too small to {purpose}: its {stream.size} tokens hold {found} "
                              f"distinct contexts (one per token that ends a context of at least {shortest} "
                              f"tokens), and at least {min_contexts} are needed; give more text")
    if models is None:
        target, draft = load_decoder(target_dir), load_decoder(draft_dir)
    else:
        target, draft = models
    result = rollout(target, draft, stream, num_contexts=num_contexts, max_draft=max_draft, context_len=context_len,
                     batch_size=batch_size, seed=seed, progress=progress, desc=desc)
    result.info.update({"data": str(data), "texts": len(texts)})
    return result
