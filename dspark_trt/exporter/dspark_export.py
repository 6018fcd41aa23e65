"""Export a DSpark drafter (see models/dspark_drafter.py) as two ONNX graphs.

* ``dspark_context.onnx``: aux [T, F] (the target's hidden states at the drafter's capture points),
  positions [T] -> ``context.{i}.key`` / ``context.{i}.value`` [T, KVH, D] per draft layer: the
  context-KV precompute. The runtime writes them into the draft's context cache at the verified
  positions (and rolls back nothing: rejected positions are simply overwritten next step).
* ``dspark_draft.onnx``: anchor [R], past_lens [R] (context entries per request = the anchor's
  position), slot_ids [R], the context cache ``past_key_values.{i}.key/value`` [P, S, KVH, D] ->
  ``draft_tokens`` [R, N] (target ids), ``confidence_logits`` [R, N] (the confidence head's, or
  logit(q_max) for a drafter without one: the ops' qmax_confidence) and ``survival`` [R, N]. One
  parallel block pass, then the dspark ops MarkovDraft (the sequential stage) and Survival (calibrated
  running product of the confidences). Greedy drafting: no [R, N, V] tensor leaves the graph.
* ``dspark_draft_sample.onnx`` (optional): the same with MarkovSample for batches with sampled requests:
  inputs + ``temperature`` [R], ``uniforms`` [R, N]; outputs + ``draft_probs`` [R, N, V_target] (q for
  the lossless SampleAccept; T <= 0 rows draw greedily with a one-hot q).

Both graphs carry the dspark ONNX functions, so ONNX Runtime runs them as exported; TensorRT maps the
dspark nodes to the plugins in plugins/tensorrt_plugins.py.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dspark_trt.exporter.graphs import accept, call_op
from dspark_trt.models.dspark_drafter import DsparkDrafter

CONTEXT_FILE = "dspark_context.onnx"
DRAFT_FILE = "dspark_draft.onnx"
CONTEXT_INPUTS = ["aux_hidden", "positions"]
DRAFT_INPUTS = ["anchor", "past_lens", "slot_ids"]
DRAFT_OUTPUTS = ["draft_tokens", "confidence_logits", "survival"]
SAMPLE_FILE = "dspark_draft_sample.onnx"
SAMPLE_INPUTS = ["temperature", "uniforms"]
EX_PAST = 6  # example context length for tracing (distinct from every other example size)


def context_names(num_layers: int) -> list[str]:
    return [f"context.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


def past_names(num_layers: int) -> list[str]:
    return [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


def markov_op(inputs: list, steps: int, logit_scale: float, draft_topk: int, qmax_confidence: bool = False):
    """MarkovDraft (7 inputs) or MarkovSample (9: + temperature, uniforms): one custom ONNX node under
    export, the numpy reference in eager mode."""
    r = inputs[0].shape[0]
    sample = len(inputs) == 9
    name = "MarkovSample" if sample else "MarkovDraft"
    attrs = {"steps": int(steps), "logit_scale": float(logit_scale), "draft_topk": int(draft_topk),
             "qmax_confidence": int(qmax_confidence)}
    dtypes = [torch.int64, torch.float32] + ([torch.float32] if sample else [])
    shapes = [[r, steps], [r, steps]] + ([[r, steps, inputs[3].shape[0]]] if sample else [])
    if torch.onnx.is_in_onnx_export():
        return torch.onnx.ops.symbolic_multi_out(f"dspark::{name}", inputs, attrs=dict(attrs, plugin_namespace="dspark"),
                                                 dtypes=dtypes, shapes=shapes, version=1)
    from dspark_trt.plugins import reference

    fn = reference.markov_sample if sample else reference.markov_draft
    outs = fn(*[x.detach().cpu().numpy() for x in inputs], **attrs)
    return tuple(torch.from_numpy(np.asarray(o)) for o in outs)


class DsparkContextGraph(nn.Module):
    def __init__(self, drafter: DsparkDrafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, aux_hidden, positions):
        keys, values = self.drafter.context_kv(aux_hidden, positions)
        return tuple(t for kv in zip(keys, values) for t in kv)


class DsparkDraftGraph(nn.Module):
    """The block pass + MarkovDraft (greedy flavour) or + MarkovSample (sample=True: two more inputs,
    temperature [R] and uniforms [R, N], and one more output, draft_probs [R, N, V_target])."""

    def __init__(self, drafter: DsparkDrafter, temperatures: list[float] | None = None, sample: bool = False,
                 block: nn.Module | None = None):
        super().__init__()
        self.drafter = drafter
        self.block = block  # the block pass's ORT flavour (models/ort_fused_dspark.py); None: drafter.block
        self.sample = sample
        self.temperatures = [float(t) for t in (temperatures or [1.0] * drafter.cfg.num_draft)]

    def forward(self, anchor, past_lens, slot_ids, *rest):
        sampling, past = (rest[:2], rest[2:]) if self.sample else ((), rest)
        d, cfg = self.drafter, self.drafter.cfg
        r = anchor.shape[0]
        masks = torch.full_like(anchor, cfg.mask_token_id)[:, None].expand(r, cfg.query_len - 1)
        tokens = torch.cat([anchor[:, None], masks], dim=1)
        block = d.block if self.block is None else self.block
        hidden = block(tokens, list(past[0::2]), list(past[1::2]), slot_ids, past_lens)
        rows = d.sample_rows(hidden)
        w1 = d.markov_head.markov_w1.weight.float()
        w2 = d.markov_head.markov_w2.weight.float()
        toks, conf, *probs = markov_op([d.base_logits(rows), d.confidence_base(rows), anchor, w1, w2,
                                        d.confidence_markov_weight(), d.d2t, *sampling], cfg.num_draft,
                                       cfg.logit_scale, cfg.draft_topk or 0, d.qmax_confidence)
        ones = torch.ones_like(past_lens, dtype=torch.float32)
        (surv,) = call_op("Survival", [conf, ones, torch.zeros_like(past_lens)],
                          {"temperatures": self.temperatures}, [torch.float32], [[r, cfg.num_draft]])
        return (toks, conf, surv, *probs)


def _export(module, args, input_names, output_names, dynamic_shapes, path: Path, external_data: str) -> list[str]:
    """Export and save one graph (weights in `<file>.data` when external_data says so: see
    exporter/external_data.py); returns the files written."""
    from dspark_trt.exporter.external_data import save_program
    from dspark_trt.plugins.onnx_functions import attach_functions

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, args, dynamo=True, input_names=input_names, output_names=output_names,
                                    dynamic_shapes=dynamic_shapes, optimize=True, verbose=False)
    return save_program(program, Path(path), external_data, attach_functions)


def export_dspark(drafter: DsparkDrafter, out_dir: str | Path, num_slots: int,
                  temperatures: list[float] | None = None, sample: bool = False,
                  ort_fused_positions: int = 0, external_data: str = "auto") -> dict[str, Path]:
    """Write the graphs into out_dir; returns {"context": path, "draft": path} (+ "sample": the
    MarkovSample flavour of the draft graph, for batches with sampled requests, when sample=True).
    ort_fused_positions > 0 also writes the ORT flavour of the draft (and sample) graph, its block pass
    fused (models/ort_fused_dspark.py; rotary tables for that many positions plus one block), as
    "draft_ort" ("sample_ort") beside the standard files."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    drafter = drafter.eval()  # in its dtype (load_dspark_drafter); the Markov stage and confidences in float32
    dtype = drafter.lm_head.weight.dtype
    cfg = drafter.cfg
    layers = cfg.layers.num_hidden_layers
    dim = torch.export.Dim
    t, r, p = dim("num_tokens", min=1), dim("num_requests", min=1), dim("past_len", min=1)

    feat = cfg.target_hidden_size * len(cfg.aux_layers)
    ctx_args = (torch.randn(EX_PAST + 1, feat, dtype=dtype), torch.arange(EX_PAST + 1, dtype=torch.int64))
    _export(DsparkContextGraph(drafter), ctx_args, CONTEXT_INPUTS, context_names(layers),
            ({0: t}, {0: t}), out_dir / CONTEXT_FILE, external_data)

    ex_r = 3 if num_slots >= 3 else num_slots
    kv_shape = (EX_PAST, num_slots, cfg.layers.num_key_value_heads, cfg.layers.head_dim)
    past = tuple(torch.randn(kv_shape, dtype=dtype) for _ in range(2 * layers))
    draft_args = (torch.tensor([3, 1, 4][:ex_r], dtype=torch.int64),
                  torch.tensor([EX_PAST, 2, 4][:ex_r], dtype=torch.int64),
                  torch.tensor([2, 0, 1][:ex_r], dtype=torch.int64) % num_slots, *past)
    shapes = ({0: r}, {0: r}, {0: r}, tuple({0: p} for _ in range(2 * layers)))  # *past is one vararg
    paths = {"context": out_dir / CONTEXT_FILE}
    blocks = {"": None}
    if ort_fused_positions:
        from dspark_trt.models.ort_fused_dspark import FusedDsparkBlock

        blocks["_ort"] = FusedDsparkBlock(drafter, ort_fused_positions + cfg.query_len).eval()
    for suffix, block in blocks.items():
        paths["draft" + suffix] = out_dir / flavour_file(DRAFT_FILE, block)
        _export(DsparkDraftGraph(drafter, temperatures, block=block), draft_args, DRAFT_INPUTS + past_names(layers),
                DRAFT_OUTPUTS, shapes, paths["draft" + suffix], external_data)
    if sample:
        n = cfg.num_draft
        sample_args = draft_args[:3] + (torch.tensor([0.0, 0.7, 1.0][:ex_r]), torch.rand(ex_r, n)) + past
        shapes = ({0: r}, {0: r}, {0: r}, ({0: r}, {0: r}, *({0: p} for _ in range(2 * layers))))  # one vararg
        for suffix, block in blocks.items():
            paths["sample" + suffix] = out_dir / flavour_file(SAMPLE_FILE, block)
            _export(DsparkDraftGraph(drafter, temperatures, sample=True, block=block), sample_args,
                    DRAFT_INPUTS + SAMPLE_INPUTS + past_names(layers), DRAFT_OUTPUTS + ["draft_probs"], shapes,
                    paths["sample" + suffix], external_data)
    return paths


def flavour_file(file: str, block) -> str:
    """The standard graph's file, or (with a fused block) its ORT flavour's: exporter/ort_flavour.ort_file."""
    from dspark_trt.exporter.ort_flavour import ort_file

    return file if block is None else ort_file(Path(file).stem)


# ------------------------------------------------------------------ the target graph with aux outputs
TARGET_FILE = "target_aux.onnx"
DECODE_FILE = "target_aux.decode.ort.onnx"  # its ORT decoding graph (exporter/ort_flavour.export_ort_decode)


class DsparkTargetStep(nn.Module):
    """exporter.graphs.TargetStep plus one output: `aux_hidden` [N, len(aux_layers) * hidden], the target's
    hidden states at the drafter's capture points for every packed token (only this flavour has it)."""

    def __init__(self, decoder, aux_layers):
        super().__init__()
        self.decoder = decoder
        self.aux_layers = tuple(aux_layers)
        self.num_layers = decoder.config.num_hidden_layers

    def forward(self, tokens, positions, pack_index, unpack_index, query_lens, past_lens, slot_ids,
                verify_index, verify_lens, draft_tokens, draft_probs, temperature, accept_uniforms,
                sample_uniforms, *past):
        from dspark_trt.models.decoder import PackedBatch

        batch = PackedBatch(tokens, positions, pack_index, unpack_index, query_lens, past_lens, slot_ids,
                            list(past[0::2]), list(past[1::2]))
        hidden, keys, values, aux = self.decoder.forward_packed(batch, aux_layers=self.aux_layers)
        logits = self.decoder.lm_head(hidden[verify_index]).float()
        accepted, next_token = accept(logits, draft_tokens, verify_lens, draft_probs, temperature,
                                      accept_uniforms, sample_uniforms)
        present = [t for kv in zip(keys, values) for t in kv]
        return (accepted, next_token, *present, aux)


def export_target_with_aux(decoder, aux_layers, path: str | Path, num_slots: int, ort_fused_positions: int = 0,
                           external_data: str = "auto") -> list[str]:
    """The target graph of a DSpark artifact (same inputs and example sizes as exporter.onnx_export), in
    the decoder's dtype. ort_fused_positions > 0: its ORT flavour instead (models/ort_fused.py, rotary
    tables that long). Returns the files written."""
    from dspark_trt.exporter import onnx_export as ox
    from dspark_trt.manifest import TARGET_INPUTS, TARGET_OUTPUTS, kv_names

    decoder = decoder.eval()
    dtype = decoder.lm_head.weight.dtype
    if ort_fused_positions:
        from dspark_trt.models.ort_fused import FusedDecoder

        decoder = FusedDecoder(decoder, ort_fused_positions).eval()
    step = DsparkTargetStep(decoder, aux_layers)
    ex = ox._packed_examples(num_slots)
    vl, ql = ox.EX_VERIFY_LENS, ox.EX_QUERY_LENS
    m = sum(v + 1 for v in vl)
    ends = np.cumsum(ql).tolist()
    ex.update(verify_index=torch.tensor([e - (v + 1) + j for e, v in zip(ends, vl) for j in range(v + 1)]),
              verify_lens=torch.tensor(vl), draft_tokens=torch.zeros(m, dtype=torch.int64),
              draft_probs=torch.full((m, decoder.config.vocab_size), 1.0 / decoder.config.vocab_size),
              temperature=torch.tensor([0.0, 0.7, 1.0]), accept_uniforms=torch.full((m,), 0.5),
              sample_uniforms=torch.tensor([0.1, 0.5, 0.9]))
    args = tuple(ex[k] for k in TARGET_INPUTS) + tuple(ox._past(decoder, num_slots, dtype))
    layers = step.num_layers
    outputs = list(TARGET_OUTPUTS) + kv_names(layers, "present") + ["aux_hidden"]
    return _export(step, args, list(TARGET_INPUTS) + kv_names(layers, "past"), outputs,
                   ox._dynamic_shapes(TARGET_INPUTS, layers), Path(path), external_data)
