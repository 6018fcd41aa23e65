"""torch -> ONNX for the packed draft/target graphs, with dynamic dims and the dspark functions attached."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch

from dspark_trt.exporter.graphs import (DraftStep, GreedyDraftDecodeStep, GreedyDraftStep, TargetDecodeStep,
                                        TargetStep)
from dspark_trt.manifest import (DECODE_INPUTS, DRAFT_DECODE_INPUTS, DRAFT_INPUTS, DRAFT_OUTPUTS,
                                 GREEDY_DRAFT_DECODE_INPUTS, GREEDY_DRAFT_INPUTS, GREEDY_DRAFT_OUTPUTS, TARGET_INPUTS,
                                 TARGET_OUTPUTS, kv_names)

# Example sizes used for tracing; all distinct and >= 2 so no dim is specialised or aliased.
EX_QUERY_LENS = [4, 1, 2]  # R = 3, Lq = 4, N = 7
EX_VERIFY_LENS = [1, 0, 2]  # M = 6
EX_PAST = 5


def dim_names() -> dict[str, str]:
    return {"N": "num_tokens", "R": "num_requests", "Lq": "query_len", "P": "past_len", "M": "verify_rows"}


def _packed_examples(num_slots: int):
    from dspark_trt.models.decoder import make_packed_index

    ql = EX_QUERY_LENS
    pack, unpack = make_packed_index(ql)
    n = sum(ql)
    return {
        "tokens": torch.arange(n, dtype=torch.int64) % 7,
        "positions": torch.tensor([EX_PAST + j for q in ql for j in range(q)], dtype=torch.int64),
        "pack_index": pack, "unpack_index": unpack,
        "query_lens": torch.tensor(ql, dtype=torch.int64),
        "past_lens": torch.tensor([EX_PAST] * len(ql), dtype=torch.int64),
        "slot_ids": torch.tensor([0, 2, 1], dtype=torch.int64) % num_slots,
    }


def _past(decoder, num_slots: int, dtype):
    cfg = decoder.config
    shape = (EX_PAST, num_slots, cfg.num_key_value_heads, cfg.head_dim)
    return [torch.zeros(shape, dtype=dtype) for _ in range(2 * cfg.num_hidden_layers)]


def _dynamic_shapes(input_names, num_layers):
    d = torch.export.Dim
    n, r, lq, p, m = d("num_tokens", min=1), d("num_requests", min=1), d("query_len", min=1), \
        d("past_len", min=1), d("verify_rows", min=1)
    spec = {"tokens": {0: n}, "positions": {0: n}, "pack_index": {0: r, 1: lq}, "unpack_index": {0: n},
            "query_lens": {0: r}, "past_lens": {0: r}, "slot_ids": {0: r}, "temperature": {0: r},
            "uniforms": {0: r}, "prev_survival": {0: r}, "draft_position": {0: r}, "verify_index": {0: m},
            "verify_lens": {0: r}, "draft_tokens": {0: m}, "draft_probs": {0: m}, "accept_uniforms": {0: m},
            "sample_uniforms": {0: r}}
    shapes = [spec[name] for name in input_names]
    shapes.append(tuple({0: p} for _ in range(2 * num_layers)))
    return tuple(shapes)


def _draft_examples(num_slots: int) -> dict:
    ex = _packed_examples(num_slots)
    ex.update(temperature=torch.tensor([0.0, 0.7, 1.0]), uniforms=torch.tensor([0.1, 0.5, 0.9]),
              prev_survival=torch.tensor([1.0, 0.5, 0.25]), draft_position=torch.tensor([0, 1, 2], dtype=torch.int64))
    return ex


def export_draft(step: DraftStep, path: Path, num_slots: int, dtype, external_data: str = "auto") -> list[str]:
    args = tuple(_draft_examples(num_slots)[k] for k in DRAFT_INPUTS) + tuple(_past(step.decoder, num_slots, dtype))
    return _export(step, args, DRAFT_INPUTS, DRAFT_OUTPUTS, step.num_layers, path, external_data)


def export_greedy_draft(step: DraftStep, path: Path, num_slots: int, dtype, external_data: str = "auto") -> list[str]:
    """The all-greedy flavour of `step` (exporter/graphs.GreedyDraftStep), over the same modules."""
    greedy = GreedyDraftStep(step.decoder, step.head, step.temperatures).eval()
    args = tuple(_draft_examples(num_slots)[k] for k in GREEDY_DRAFT_INPUTS) + \
        tuple(_past(step.decoder, num_slots, dtype))
    return _export(greedy, args, GREEDY_DRAFT_INPUTS, GREEDY_DRAFT_OUTPUTS, step.num_layers, path, external_data)


def export_target(step: TargetStep, path: Path, num_slots: int, dtype, vocab: int,
                  external_data: str = "auto") -> list[str]:
    ex = _packed_examples(num_slots)
    vl = EX_VERIFY_LENS
    m = sum(v + 1 for v in vl)
    starts = []
    off = 0
    for q in EX_QUERY_LENS:
        off += q
        starts.append(off)
    # the last (L_r + 1) packed tokens of each request are scored
    verify_index = torch.tensor([s - (v + 1) + j for s, v in zip(starts, vl) for j in range(v + 1)], dtype=torch.int64)
    ex.update(verify_index=verify_index, verify_lens=torch.tensor(vl, dtype=torch.int64),
              draft_tokens=torch.zeros(m, dtype=torch.int64), draft_probs=torch.full((m, vocab), 1.0 / vocab),
              temperature=torch.tensor([0.0, 0.7, 1.0]), accept_uniforms=torch.full((m,), 0.5),
              sample_uniforms=torch.tensor([0.1, 0.5, 0.9]))
    args = tuple(ex[k] for k in TARGET_INPUTS) + tuple(_past(step.decoder, num_slots, dtype))
    outputs = TARGET_OUTPUTS + (["logits"] if step.debug_logits else [])
    return _export(step, args, TARGET_INPUTS, outputs, step.num_layers, path, external_data)


def _slot_major_caches(step, rows: int, rows_dim, max_context: int, dtype):
    """A decoding graph's example caches ([rows, KVH, max_context, D], past and present alike) and their
    dynamic shapes: rows_dim rows, the position axis the runtime's context (its --max-context, at most the
    exported one)."""
    cfg = step.decoder.config
    ctx = torch.export.Dim("max_context", min=2, max=max_context)
    n = 2 * step.num_layers
    caches = tuple(torch.zeros(rows, cfg.num_key_value_heads, max_context, cfg.head_dim, dtype=dtype) for _ in range(n))
    return caches, tuple({0: rows_dim, 2: ctx} for _ in range(n))


def export_target_decode(step: TargetDecodeStep, path: Path, max_context: int, dtype, vocab: int,
                         external_data: str = "auto") -> list[str]:
    """The ORT flavour's decoding graph (exporter/graphs.TargetDecodeStep): rows, tokens a row and the
    caches' position axis (the runtime's context, up to max_context: the rotary tables' length) dynamic."""
    rows, t = 3, 2
    m = rows * t
    d = torch.export.Dim
    r, q, mm = d("num_requests", min=1), d("query_len", min=1), d("verify_rows", min=1)
    caches, cache_dims = _slot_major_caches(step, rows, r, max_context, dtype)
    args = (torch.arange(m).reshape(rows, t) % 7, torch.tensor([EX_PAST, 0, EX_PAST + 2]),
            torch.full((rows,), t - 1), torch.zeros(m, dtype=torch.int64), torch.full((m, vocab), 1.0 / vocab),
            torch.tensor([0.0, 0.7, 1.0]), torch.full((m,), 0.5), torch.tensor([0.1, 0.5, 0.9])) + caches
    shapes = ({0: r, 1: q}, {0: r}, {0: r}, {0: mm}, {0: mm}, {0: r}, {0: mm}, {0: r}, cache_dims)
    outputs = TARGET_OUTPUTS + (["aux_hidden"] if step.aux_layers else [])
    return _export(step, args, DECODE_INPUTS, outputs, step.num_layers, path, external_data, shapes)


def export_draft_decode(step, path: Path, max_context: int, dtype, external_data: str = "auto") -> list[str]:
    """A draft decoding graph (exporter/graphs.DraftDecodeStep or GreedyDraftDecodeStep): rows, tokens a row
    and the caches' position axis dynamic, as export_target_decode."""
    rows, t = 3, 2
    ex = {"tokens": torch.arange(rows * t).reshape(rows, t) % 7, "past_lens": torch.tensor([EX_PAST, 0, EX_PAST + 2]),
          **{k: v for k, v in _draft_examples(rows).items()
             if k in ("temperature", "uniforms", "prev_survival", "draft_position")}}
    greedy = isinstance(step, GreedyDraftDecodeStep)
    names = GREEDY_DRAFT_DECODE_INPUTS if greedy else DRAFT_DECODE_INPUTS
    d = torch.export.Dim
    r, q = d("num_requests", min=1), d("query_len", min=1)
    caches, cache_dims = _slot_major_caches(step, rows, r, max_context, dtype)
    args = tuple(ex[k] for k in names) + caches
    shapes = tuple({0: r, 1: q} if k == "tokens" else {0: r} for k in names) + (cache_dims,)
    outputs = GREEDY_DRAFT_OUTPUTS if greedy else DRAFT_OUTPUTS
    return _export(step, args, names, outputs, step.num_layers, path, external_data, shapes)


def _export(module, args, input_names, output_names, num_layers, path: Path, external_data: str,
            dynamic_shapes=None) -> list[str]:
    """Export and save one graph; returns the files written (the .onnx, and its .data when external)."""
    from dspark_trt.exporter.external_data import save_program
    from dspark_trt.plugins.onnx_functions import attach_functions

    names = list(input_names) + kv_names(num_layers, "past")
    target = module.__class__.__name__ in ("TargetStep", "TargetDecodeStep")
    if target:
        outs = list(output_names[:2]) + kv_names(num_layers, "present") + list(output_names[2:])
    else:
        outs = list(output_names) + kv_names(num_layers, "present")
    # torch.onnx logs "torchvision is not installed. Skipping torchvision::..." on every export: noise here.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, args, dynamo=True, input_names=names, output_names=outs,
                                    dynamic_shapes=dynamic_shapes or _dynamic_shapes(input_names, num_layers),
                                    optimize=True,
                                    verbose=False)
    return save_program(program, path, external_data, attach_functions)
