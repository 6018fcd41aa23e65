"""The exported graphs as torch modules: one draft step (and its all-greedy flavour) and one target
prefill/verify step.

Both run packed batches (see models/decoder.py). The dspark custom ops appear as single ONNX nodes
under export (torch.onnx.ops.symbolic) and run the numpy reference in eager mode, so the torch
backend and the ONNX graphs compute the same thing.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from dspark_trt.models.confidence_head import ConfidenceHead, draft_stats
from dspark_trt.models.decoder import Decoder, PackedBatch
from dspark_trt.plugins.spec import PLUGIN_NAMESPACE

FALLBACK_CLAMP = 1e-6


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def call_op(name: str, inputs: list, attrs: dict, out_dtypes: list, out_shapes: list):
    """A dspark op: one custom ONNX node under export, the numpy reference in eager mode."""
    if torch.onnx.is_in_onnx_export():
        attrs = dict(attrs, plugin_namespace=PLUGIN_NAMESPACE)
        if len(out_dtypes) == 1:
            return (torch.onnx.ops.symbolic(f"dspark::{name}", inputs, attrs=attrs, dtype=out_dtypes[0],
                                            shape=out_shapes[0], version=1),)
        return torch.onnx.ops.symbolic_multi_out(f"dspark::{name}", inputs, attrs=attrs, dtypes=out_dtypes,
                                                 shapes=out_shapes, version=1)
    from dspark_trt.plugins import reference

    fn = {"Survival": reference.survival, "GreedyAccept": reference.greedy_accept,
          "SampleAccept": reference.sample_accept}[name]
    args = [_numpy(x) for x in inputs] + ([list(attrs["temperatures"])] if name == "Survival" else [])
    outs = fn(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    device = inputs[0].device  # eager reference on the host; results go back where the inputs live
    return tuple(torch.from_numpy(np.asarray(o)).to(device=device, dtype=dt) for o, dt in zip(outs, out_dtypes))


class _PackedGraph(nn.Module):
    def __init__(self, decoder: Decoder):
        super().__init__()
        self.decoder = decoder
        self.num_layers = decoder.config.num_hidden_layers

    def run_decoder(self, tokens, positions, pack_index, unpack_index, query_lens, past_lens, slot_ids, past):
        batch = PackedBatch(tokens, positions, pack_index, unpack_index, query_lens, past_lens, slot_ids,
                            list(past[0::2]), list(past[1::2]))
        hidden, keys, values = self.decoder.forward_packed(batch)
        present = [t for kv in zip(keys, values) for t in kv]
        return hidden, present

    def logits(self, hidden):
        return self.decoder.lm_head(hidden).float()


class DraftStep(_PackedGraph):
    """One draft step: the next draft token of every request, its distribution, and the survival."""

    def __init__(self, decoder: Decoder, head: ConfidenceHead | None, temperatures: list[float]):
        super().__init__(decoder)
        self.head = head
        self.temperatures = [float(t) for t in temperatures]

    def forward(self, tokens, positions, pack_index, unpack_index, query_lens, past_lens, slot_ids,
                temperature, uniforms, prev_survival, draft_position, *past):
        h_last, prev_token, present = self.last_hidden(tokens, positions, pack_index, unpack_index, query_lens,
                                                       past_lens, slot_ids, past)
        return (*self.choose(h_last, prev_token, temperature, uniforms, prev_survival, draft_position), *present)

    def choose(self, h_last, prev_token, temperature, uniforms, prev_survival, draft_position):
        """From each request's last hidden state [R, H] and token: (token, probs, survival, confidence)."""
        logits = self.logits(h_last)  # [R, V]
        # Token choice in a handful of plain ops (the draft runs K times per step, so its per-call cost
        # matters): greedy = ArgMax (lowest index on ties, in torch and ONNX alike); sampling = inverse
        # CDF of softmax(logits / T) with the supplied uniform.
        greedy = (temperature <= 0)[:, None]
        safe_t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))[:, None]
        soft = torch.softmax(logits / safe_t, dim=-1)
        cdf = torch.cumsum(soft, dim=-1)
        sampled = (cdf < uniforms[:, None] * cdf[:, -1:]).sum(dim=-1).clamp(max=logits.shape[1] - 1)
        token = torch.where(temperature > 0, sampled, logits.argmax(dim=-1))
        onehot = (torch.arange(logits.shape[1], device=logits.device)[None, :] == token[:, None]).float()
        probs = torch.where(greedy, onehot, soft)
        conf, surv = self.confidence(h_last, prev_token, logits, prev_survival, draft_position,
                                     lambda: torch.softmax(logits, dim=-1).max(dim=-1).values)
        return token, probs, surv, conf

    def last_hidden(self, tokens, positions, pack_index, unpack_index, query_lens, past_lens, slot_ids, past):
        """(hidden state of each request's last token [R, H], that token [R], present KV)."""
        hidden, present = self.run_decoder(tokens, positions, pack_index, unpack_index, query_lens, past_lens,
                                           slot_ids, past)
        last = pack_index.gather(1, (query_lens - 1)[:, None])[:, 0]  # packed index of each request's last token
        return hidden[last], tokens[last], present

    def confidence(self, h_last, prev_token, logits, prev_survival, draft_position, max_prob):
        """(confidence logit [R], survival [R]); max_prob() -> max_v q(v) at temperature 1, read only
        without a head."""
        if self.head is not None:
            stats = draft_stats(logits, self.head.stats) if self.head.stats else None
            conf = self.head(h_last, prev_token, stats).float()
        else:
            # No head: the draft's own confidence, max_v q(v) at temperature 1. It never depends on the
            # drafted token itself (unlike q(x_k)), so it is also safe for lossless sampling.
            m = max_prob().clamp(FALLBACK_CLAMP, 1 - FALLBACK_CLAMP)
            conf = torch.log(m) - torch.log1p(-m)
        (surv,) = call_op("Survival", [conf[:, None], prev_survival, draft_position],
                          {"temperatures": self.temperatures}, [torch.float32], [[prev_survival.shape[0], 1]])
        return conf, surv[:, 0]


class GreedyDraftStep(DraftStep):
    """The draft step of a call whose rows are all greedy: the argmax token and the survival only.

    No [R, V] distribution leaves the graph and none is built: greedy acceptance never reads it, and at
    a 128k vocabulary building and copying it costs several times the draft model itself. Same modules
    (and parameter names) as DraftStep, so both graphs compute the same tokens and survivals.
    """

    def forward(self, tokens, positions, pack_index, unpack_index, query_lens, past_lens, slot_ids,
                prev_survival, draft_position, *past):
        h_last, prev_token, present = self.last_hidden(tokens, positions, pack_index, unpack_index, query_lens,
                                                       past_lens, slot_ids, past)
        return (*self.choose_greedy(h_last, prev_token, prev_survival, draft_position), *present)

    def choose_greedy(self, h_last, prev_token, prev_survival, draft_position):
        """(argmax token, survival, confidence) from each request's last hidden state and token."""
        logits = self.logits(h_last)  # [R, V]
        token = logits.argmax(dim=-1)

        def max_prob():  # max_v softmax(l)_v = 1 / sum_v exp(l_v - max l), a reduction with no [R, V] result
            top = logits.max(dim=-1, keepdim=True).values
            return 1.0 / torch.exp(logits - top).sum(dim=-1)

        conf, surv = self.confidence(h_last, prev_token, logits, prev_survival, draft_position, max_prob)
        return token, surv, conf


def _decode_last(step, tokens, past_lens, past):
    """A decode step's (last hidden state of each row [B, H], its last token [B], the caches): the fused
    layers over slot-major caches (models/ort_fused.FusedLayers.forward_decode)."""
    d = step.decoder
    hidden, present, _ = d.layers.forward_decode(d.embed_tokens(tokens), past_lens, list(past))
    return hidden[:, -1], tokens[:, -1], present


class DraftDecodeStep(DraftStep):
    """The draft step of the ORT flavour's `decode` graph (over a FusedDecoder): T new tokens in each of B
    rows over slot-major caches [B, KVH, max_context, D], row b cache slot b, read in place as
    TargetDecodeStep reads the target's; the same token choice and confidence as DraftStep from each row's
    last token. The ORT backend runs it for one request's calls, drafting and catch-up alike
    (runtime/backends/ort_decode.py)."""

    def forward(self, tokens, past_lens, temperature, uniforms, prev_survival, draft_position, *past):
        h_last, prev_token, present = _decode_last(self, tokens, past_lens, past)
        return (*self.choose(h_last, prev_token, temperature, uniforms, prev_survival, draft_position), *present)


class GreedyDraftDecodeStep(GreedyDraftStep):
    """DraftDecodeStep's all-greedy graph (GreedyDraftStep's outputs)."""

    def forward(self, tokens, past_lens, prev_survival, draft_position, *past):
        h_last, prev_token, present = _decode_last(self, tokens, past_lens, past)
        return (*self.choose_greedy(h_last, prev_token, prev_survival, draft_position), *present)


def accept(logits, draft_tokens, verify_lens, draft_probs, temperature, accept_uniforms, sample_uniforms):
    """The acceptance ops over the scored rows: (accepted, next_token) per request, greedy rows by
    GreedyAccept, sampled rows by SampleAccept (both computed; the graph picks per row)."""
    r = verify_lens.shape[0]
    g_acc, g_next = call_op("GreedyAccept", [logits, draft_tokens, verify_lens], {},
                            [torch.int64, torch.int64], [[r], [r]])
    s_acc, s_next = call_op("SampleAccept", [logits, draft_probs, draft_tokens, verify_lens, temperature,
                                             accept_uniforms, sample_uniforms], {},
                            [torch.int64, torch.int64], [[r], [r]])
    greedy = temperature <= 0
    return torch.where(greedy, g_acc, s_acc), torch.where(greedy, g_next, s_next)


class TargetStep(_PackedGraph):
    """Prefill and verification of a packed batch, ending in the acceptance ops (no full logits out)."""

    def __init__(self, decoder: Decoder, debug_logits: bool = False):
        super().__init__(decoder)
        self.debug_logits = debug_logits

    def forward(self, tokens, positions, pack_index, unpack_index, query_lens, past_lens, slot_ids,
                verify_index, verify_lens, draft_tokens, draft_probs, temperature, accept_uniforms,
                sample_uniforms, *past):
        hidden, present = self.run_decoder(tokens, positions, pack_index, unpack_index, query_lens, past_lens,
                                           slot_ids, past)
        logits = self.logits(hidden[verify_index])  # only the rows that are scored: [M, V]
        accepted, next_token = accept(logits, draft_tokens, verify_lens, draft_probs, temperature,
                                      accept_uniforms, sample_uniforms)
        extra = (logits,) if self.debug_logits else ()
        return (accepted, next_token, *present, *extra)


class TargetDecodeStep(nn.Module):
    """The target step of the ORT flavour's `decode` graph: T new tokens in each of B rows, every one of them
    scored (T = 1: plain decoding; T = 1 + drafts: verifying one request), over slot-major caches
    [B, KVH, max_context, D] whose row b is cache slot b (the ORT backend keeps them beside the host cache:
    runtime/backends/ort_decode.py). Attention is one GroupQueryAttention node a layer that reads the past
    in place, where the packed graph gathers every row's past first. The same acceptance ops as
    TargetStep over the same rows, so its tokens are the packed graph's, draw for draw."""

    def __init__(self, fused_decoder, aux_layers=()):
        """aux_layers: a DSpark target's capture points, output as `aux_hidden` [B * T, len * hidden] after
        the caches (as the packed DSpark target graph does: exporter/dspark_export.DsparkTargetStep)."""
        super().__init__()
        self.decoder = fused_decoder
        self.aux_layers = tuple(aux_layers)
        self.num_layers = fused_decoder.config.num_hidden_layers

    def forward(self, tokens, past_lens, verify_lens, draft_tokens, draft_probs, temperature, accept_uniforms,
                sample_uniforms, *past):
        d = self.decoder
        hidden, present, captured = d.layers.forward_decode(d.embed_tokens(tokens), past_lens, list(past),
                                                            capture=self.aux_layers)
        logits = d.lm_head(hidden.flatten(0, 1)).float()  # [B * T, V]
        accepted, next_token = accept(logits, draft_tokens, verify_lens, draft_probs, temperature,
                                      accept_uniforms, sample_uniforms)
        aux = (torch.cat([captured[k] for k in self.aux_layers], dim=-1).flatten(0, 1),) if self.aux_layers else ()
        return (accepted, next_token, *present, *aux)
