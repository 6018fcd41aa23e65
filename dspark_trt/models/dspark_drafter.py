"""The DSpark draft step as a torch module, loaded from the checkpoint format vLLM loads.

One step for R requests (see `dspark_config` for the format):
1. `context_kv(aux, positions)`: target hidden states of the listed layers, concatenated ->
   `fc` -> `hidden_norm` -> per draft layer K = rope(k_norm(k_proj(c))), V = v_proj(c); these go into
   the draft's context cache at the verified positions (no input_layernorm: vLLM projects the
   normalised context directly).
2. `block(...)`: one parallel pass over the query block [anchor, mask, ..., mask] at positions
   p, p+1, ... (p = the anchor's position = the context length), attending to the cached context and
   to the block itself (causal or not, per config); returns the final-normed hidden states.
3. `markov(...)`: sequential over the N sampled rows: e_i = markov_w1[prev], logits_i =
   scale * (lm_head(h_i) + markov_w2 @ e_i) (with `dspark_draft_topk`: only the top-k base logits are
   corrected, every other logit is -inf), greedy token = argmax mapped to the target vocabulary
   (draft id + d2t[id]), prev = that token; confidence logit_i = proj([h_i ; e_i]), or without a
   confidence head logit(q_max) of the final draft logits (the ops' qmax_confidence).

Weight names are the checkpoint's (no `model.` prefix): `layers.*`, `fc`, `hidden_norm`, `norm`,
`markov_head.markov_w1/markov_w2`, `confidence_head.proj`, optional `embed_tokens` / `lm_head` (else the
target's), optional `d2t`; `t2d` and `mask_embedding` are ignored as vLLM does.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dspark_trt.errors import DsparkError
from dspark_trt.models.config import ModelConfig, load_config
from dspark_trt.models.decoder import DecoderLayer, RMSNorm, rope_inv_freq
from dspark_trt.models.dspark_config import DsparkConfig, load_dspark_config

IGNORED = ("t2d", "mask_embedding")
# Alternative names vLLM's DFlash loader maps (substring renames).
ALIASES = {"midlayer.": "layers.0.", "encoder.output_norm_enc.": "hidden_norm.", "encoder.fc.": "fc."}


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)


class DsparkConfidenceHead(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1, bias=True)


class DsparkDrafter(nn.Module):
    def __init__(self, cfg: DsparkConfig):
        super().__init__()
        self.cfg = cfg
        lc = cfg.layers
        self.embed_tokens = nn.Embedding(lc.vocab_size, lc.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(lc) for _ in range(lc.num_hidden_layers))
        self.fc = nn.Linear(cfg.target_hidden_size * len(cfg.aux_layers), lc.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.lm_head = nn.Linear(lc.hidden_size, cfg.draft_vocab_size, bias=False)
        self.markov_head = MarkovHead(lc.vocab_size, cfg.draft_vocab_size, cfg.markov_rank)
        self.confidence_head = None
        if cfg.enable_confidence_head:
            dim = lc.hidden_size + (cfg.markov_rank if cfg.confidence_head_with_markov else 0)
            self.confidence_head = DsparkConfidenceHead(dim)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("inv_freq", rope_inv_freq(lc), persistent=False)

    # ------------------------------------------------------------------------------------ pieces
    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[..., None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _v(self, v: torch.Tensor) -> torch.Tensor:
        return v * self.cfg.v_scale if self.cfg.v_scale is not None else v

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., len(aux_layers) * target_hidden] -> normalised context [..., hidden]."""
        return self.hidden_norm(self.fc(aux))

    def context_kv(self, aux: torch.Tensor, positions: torch.Tensor):
        """aux [T, F], positions [T] -> per layer keys and values [T, KVH, D] for the context cache."""
        c = self.context(aux)
        cos, sin = self.rope(positions, c.dtype)
        keys, values = [], []
        for layer in self.layers:
            a = layer.self_attn
            k = a.k_proj(c).unflatten(-1, (a.n_kv, a.head_dim))
            if a.k_norm is not None:
                k = a.k_norm(k)
            keys.append((k * cos + _rotate_half(k) * sin).to(k.dtype))
            values.append(self._v(a.v_proj(c).unflatten(-1, (a.n_kv, a.head_dim))))
        return keys, values

    def block(self, tokens, past_keys, past_values, slot_ids, past_lens):
        """Parallel pass over the query block.

        tokens [R, Q] (anchor then masks) at positions past_lens[r] + j; past_keys/values per layer
        [P, S, KVH, D] (position-major context cache, like the target's); slot_ids [R]; past_lens [R]
        context entries valid per request. -> final-normed hidden states [R, Q, hidden]."""
        r, q_len = tokens.shape
        positions = past_lens[:, None] + torch.arange(q_len, device=tokens.device)[None, :]
        x = self.embed_tokens(tokens)
        cos, sin = self.rope(positions, x.dtype)  # [R, Q, 1, D]
        qi = torch.arange(q_len, device=tokens.device)
        block_ok = (qi[None, :] <= qi[:, None]) if self.cfg.causal else torch.ones(q_len, q_len, dtype=torch.bool)
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            q, k, v = a.project(layer.input_layernorm(x), cos, sin)  # [R, Q, H, D], [R, Q, KVH, D]
            v = self._v(v)
            pk = past_keys[i].index_select(1, slot_ids).permute(1, 2, 0, 3)  # [R, KVH, P, D]
            pv = past_values[i].index_select(1, slot_ids).permute(1, 2, 0, 3)
            p = pk.shape[2]
            keys = torch.cat([pk, k.transpose(1, 2)], dim=2)  # [R, KVH, P+Q, D]
            vals = torch.cat([pv, v.transpose(1, 2)], dim=2)
            groups = a.n_heads // a.n_kv
            qg = q.transpose(1, 2).reshape(r, a.n_kv, groups * q_len, a.head_dim)
            scores = torch.matmul(qg, keys.transpose(-1, -2)) * (1.0 / math.sqrt(a.head_dim))
            past_ok = torch.arange(p, device=x.device)[None, None, :] < past_lens[:, None, None]  # [R, 1, P]
            mask = torch.cat([past_ok.expand(r, q_len, p), block_ok[None].expand(r, q_len, q_len)], dim=2)
            mask = mask[:, None, None].expand(r, a.n_kv, groups, q_len, p + q_len).reshape(
                r, a.n_kv, groups * q_len, p + q_len)
            scores = scores.float().masked_fill(~mask, torch.finfo(torch.float32).min)
            out = torch.matmul(torch.softmax(scores, dim=-1).to(vals.dtype), vals)
            out = out.reshape(r, a.n_heads, q_len, a.head_dim).transpose(1, 2).reshape(r, q_len, -1)
            x = x + a.o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    def sample_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, Q, H] block output -> [R, N, H]: the rows that predict draft tokens 1..N."""
        return hidden if self.cfg.sample_from_anchor else hidden[:, 1:]

    def base_logits(self, rows: torch.Tensor) -> torch.Tensor:
        return self.lm_head(rows).float() * self.cfg.logit_scale

    def confidence_base(self, rows: torch.Tensor) -> torch.Tensor:
        """proj's hidden-state part plus its bias, [R, N] float32 (zeros without a head)."""
        if self.confidence_head is None:
            return rows.new_zeros(rows.shape[:-1], dtype=torch.float32)
        w = self.confidence_head.proj.weight[0, : self.cfg.hidden_size].float()
        return rows.float() @ w + self.confidence_head.proj.bias.float()[0]

    def confidence_markov_weight(self) -> torch.Tensor:
        """proj's Markov-embedding part [r] float32 (zeros when the head does not use it)."""
        if self.confidence_head is None or not self.cfg.confidence_head_with_markov:
            return torch.zeros(self.cfg.markov_rank)
        return self.confidence_head.proj.weight[0, self.cfg.hidden_size:].float()

    @property
    def qmax_confidence(self) -> bool:
        """Head-less: the confidence logits are logit(q_max) (MarkovDraft's qmax_confidence)."""
        return self.confidence_head is None

    def markov(self, base: torch.Tensor, conf_base: torch.Tensor, anchor: torch.Tensor, return_logits: bool = False):
        """Greedy sequential Markov stage. base [R, N, Vd] float32 (scaled base logits), conf_base [R, N],
        anchor [R] target ids -> (draft tokens [R, N] target ids, confidence logits [R, N] float32: the
        head's, or logit(q_max) of each position's final logits without a head) and,
        with `return_logits`, each position's final draft-vocabulary logits [R, N, Vd] (tests only:
        the serving path never materialises them outside this loop)."""
        w1 = self.markov_head.markov_w1.weight.float()
        w2 = self.markov_head.markov_w2.weight.float()
        wc = self.confidence_markov_weight().to(base.device)
        k = self.cfg.draft_topk
        if k is not None:
            top_vals, top_idx = _topk_lowest(base, k)
        prev, tokens, conf, all_logits = anchor, [], [], []
        for i in range(base.shape[1]):
            e = w1[prev]  # [R, r]
            if k is None:
                logits = corr = base[:, i] + self.cfg.logit_scale * (e @ w2.T)
                draft_id = logits.argmax(dim=-1)
            else:
                corr = top_vals[:, i] + self.cfg.logit_scale * torch.einsum("rkd,rd->rk", w2[top_idx[:, i]], e)
                best = corr.max(dim=-1, keepdim=True).values
                cand = torch.where(corr == best, top_idx[:, i], torch.iinfo(torch.int64).max)
                draft_id = cand.min(dim=-1).values  # lowest vocabulary index among the maxima
                if return_logits:
                    logits = torch.full_like(base[:, i], float("-inf")).scatter(1, top_idx[:, i], corr)
            if return_logits:
                all_logits.append(logits)
            prev = draft_id + self.d2t[draft_id]
            tokens.append(prev)
            conf.append(_qmax_logit(corr) if self.qmax_confidence else conf_base[:, i] + e @ wc)
        out = torch.stack(tokens, 1), torch.stack(conf, 1)
        return out + (torch.stack(all_logits, 1),) if return_logits else out

    def draft(self, anchor, past_keys, past_values, slot_ids, past_lens):
        """One greedy draft step -> (tokens [R, N] target ids, confidences [R, N] = sigmoid of the
        confidence logits; q_max, clipped, without a head)."""
        q_len = self.cfg.query_len
        tokens = torch.full((anchor.shape[0], q_len), self.cfg.mask_token_id, dtype=torch.int64)
        tokens[:, 0] = anchor
        rows = self.sample_rows(self.block(tokens, past_keys, past_values, slot_ids, past_lens))
        toks, conf = self.markov(self.base_logits(rows), self.confidence_base(rows), anchor)
        return toks, torch.sigmoid(conf)

    def empty_cache(self, slots: int, length: int = 0, dtype=torch.float32):
        lc = self.cfg.layers
        shape = (length, slots, lc.num_key_value_heads, lc.head_dim)
        return ([torch.zeros(shape, dtype=dtype) for _ in self.layers],
                [torch.zeros(shape, dtype=dtype) for _ in self.layers])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _qmax_logit(logits: torch.Tensor) -> torch.Tensor:
    """logit(clip(q_max, 1e-6, 1 - 1e-6)) per row of logits (q_max = 1 where the row max is not finite):
    the ops' qmax_confidence for a greedy draft."""
    from dspark_trt.plugins.spec import QMAX_CLIP

    top = logits.amax(-1, keepdim=True)
    finite = top.isfinite()
    q = 1.0 / torch.exp(logits - torch.where(finite, top, 0.0)).sum(-1)
    q = torch.where(finite[:, 0], q, 1.0).clamp(QMAX_CLIP, 1 - QMAX_CLIP)
    return q.log() - (1 - q).log()


def _topk_lowest(x: torch.Tensor, k: int):
    """Top-k along the last axis, ties broken toward the lower index (ONNX TopK's rule)."""
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]
    return x.gather(-1, order), order


# ------------------------------------------------------------------------------------------ loading
def checkpoint_tensors(draft_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in the folder, as vLLM reads a draft folder."""
    from safetensors.torch import load_file

    files = sorted(Path(draft_dir).glob("*.safetensors"))
    if not files:
        raise DsparkError(f"no *.safetensors in {draft_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _target_tensor(target_dir: Path, target: ModelConfig, name: str) -> torch.Tensor:
    from safetensors import safe_open

    if name == "lm_head.weight" and target.tie_word_embeddings:
        name = "model.embed_tokens.weight"
    for f in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            if name in h.keys():
                return h.get_tensor(name)
    raise DsparkError(f"target {target_dir} has no tensor {name!r} to share with the DSpark draft")


def _rename(name: str) -> str:
    for old, new in ALIASES.items():
        name = name.replace(old, new)
    return name


def load_dspark_drafter(draft_dir: str | Path, target_dir: str | Path, dtype: str = "fp32") -> DsparkDrafter:
    """Load a DSpark draft folder for the target in `target_dir` (eval mode; weights in dtype, the rotary
    frequencies, a computed buffer, kept in float32 as checkpoint.load_decoder keeps them)."""
    target = load_config(target_dir)
    cfg = load_dspark_config(draft_dir, target)
    model = DsparkDrafter(cfg)
    expected = model.state_dict()
    state = {}
    for name, t in checkpoint_tensors(draft_dir).items():
        if any(s in name for s in IGNORED):
            continue
        name = _rename(name)
        if name.startswith("confidence_head.") and model.confidence_head is None:
            continue  # vLLM drops the head when enable_confidence_head is false
        if name == "d2t" and not cfg.reduced_vocab:
            if t.any():
                raise DsparkError(f"{draft_dir}: d2t is not all zeros but draft_vocab_size equals vocab_size")
            continue
        if name not in expected:
            raise DsparkError(f"{draft_dir}: unexpected tensor {name!r} for a {cfg.layers.num_hidden_layers}-layer "
                              "Qwen3DSparkModel")
        state[name] = t
    if cfg.reduced_vocab:
        for need in ("lm_head.weight", "d2t"):
            if need not in state:
                raise DsparkError(f"{draft_dir}: draft_vocab_size {cfg.draft_vocab_size} < vocab_size needs "
                                  f"a {need.split('.')[0]!r} tensor")
    target_dir = Path(target_dir)
    if "embed_tokens.weight" not in state:
        if cfg.layers.vocab_size != target.vocab_size:
            raise DsparkError(f"{draft_dir}: vocab_size {cfg.layers.vocab_size} differs from the target's, so "
                              "the draft must ship embed_tokens")
        state["embed_tokens.weight"] = _target_tensor(target_dir, target, "model.embed_tokens.weight")
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = _target_tensor(target_dir, target, "lm_head.weight")
    if model.confidence_head is not None and not any(k.startswith("confidence_head.") for k in state):
        model.confidence_head = None  # head enabled in config but absent: run head-less, as vLLM does
        expected = model.state_dict()
    state.setdefault("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))  # identity map
    for key in expected:
        if key not in state:
            raise DsparkError(f"{draft_dir}: missing tensor {key!r}")
        if tuple(state[key].shape) != tuple(expected[key].shape):
            raise DsparkError(f"{draft_dir}: tensor {key!r} has shape {tuple(state[key].shape)}, "
                              f"config.json implies {tuple(expected[key].shape)}")
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})
    if dtype == "fp32":
        return model.float().eval()
    from dspark_trt.models.checkpoint import torch_dtype

    model = model.to(torch_dtype(dtype))
    model.inv_freq = rope_inv_freq(cfg.layers)
    return model.eval()


