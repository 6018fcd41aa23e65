"""The ORT flavour of the draft and target graphs: the same I/O, fewer nodes (models/ort_fused.py).

`dspark-trt export --ort-flavour fused` writes `draft.ort.onnx` and `target.ort.onnx` beside the standard
graphs and records each under `graphs.<graph>.ort` ({"file", "flavour"}) with its sha256 in `files`.
The ORT backend runs that file when the entry is there and the standard one otherwise (artifacts from
before the flavour existed); TensorRT always builds from the standard graph.

The target's flavour also has a decoding graph, `target.decode.ort.onnx` (graphs.target.ort.decode;
exporter/graphs.TargetDecodeStep, runtime/backends/ort_decode.py), and so have the draft's two graphs
(`draft.decode.ort.onnx`, `draft_greedy.decode.ort.onnx`; DraftDecodeStep): their own I/O, fixed by the code
that runs them.

The target's flavour and its decoding graph also get their all-greedy twins (exporter/greedy_twin.py).
"""

from __future__ import annotations

from pathlib import Path

from dspark_trt.errors import DsparkError

ORT_FLAVOURS = ("fused", "none")  # the export option; a manifest records only "fused" (none = no entry)


def ort_file(graph: str) -> str:
    return f"{graph}.ort.onnx"


def export_ort_graph(graph: str, step, out_dir: Path, num_slots: int, dtype, vocab: int, max_positions: int,
                     external_data: str) -> list[str]:
    """Export the ORT flavour of a standard DraftStep ("draft" or its all-greedy graph "draft_greedy") or
    TargetStep ("target") to `<graph>.ort.onnx`; returns the files written. max_positions: the rotary
    tables' length (max context)."""
    from dspark_trt.exporter.graphs import DraftStep, TargetStep
    from dspark_trt.exporter.onnx_export import export_draft, export_greedy_draft, export_target
    from dspark_trt.manifest_schema import GREEDY_DRAFT_GRAPH
    from dspark_trt.models.ort_fused import FusedDecoder

    path = Path(out_dir) / ort_file(graph)
    fused = FusedDecoder(step.decoder, max_positions)
    if graph in ("draft", GREEDY_DRAFT_GRAPH):
        twin = DraftStep(fused, step.head, step.temperatures).eval()
        export = export_draft if graph == "draft" else export_greedy_draft
        return export(twin, path, num_slots, dtype, external_data)
    twin = TargetStep(fused, step.debug_logits).eval()
    return export_target(twin, path, num_slots, dtype, vocab, external_data)


def decode_file(graph: str) -> str:
    """The decoding graph of `graph` (target, draft, draft_greedy)."""
    return f"{graph}.decode.ort.onnx"


DECODE_FILE = decode_file("target")


def export_ort_draft_decode(graph: str, step, out_dir: Path, dtype, max_positions: int,
                            external_data: str) -> list[str]:
    """The draft's decoding graph (`graph`: "draft" or its all-greedy graph) from a standard DraftStep."""
    from dspark_trt.exporter.graphs import DraftDecodeStep, GreedyDraftDecodeStep
    from dspark_trt.exporter.onnx_export import export_draft_decode
    from dspark_trt.manifest_schema import GREEDY_DRAFT_GRAPH
    from dspark_trt.models.ort_fused import FusedDecoder

    cls = GreedyDraftDecodeStep if graph == GREEDY_DRAFT_GRAPH else DraftDecodeStep
    decode = cls(FusedDecoder(step.decoder, max_positions), step.head, step.temperatures).eval()
    return export_draft_decode(decode, Path(out_dir) / decode_file(graph), max_positions, dtype, external_data)


def export_ort_decode(decoder, out_dir: Path, dtype, vocab: int, max_positions: int, external_data: str,
                      aux_layers=(), file: str = DECODE_FILE) -> list[str]:
    """The target's decoding graph (new tokens, all scored, over slot-major caches max_positions long);
    aux_layers: a DSpark target's capture points (its `aux_hidden` output)."""
    from dspark_trt.exporter.graphs import TargetDecodeStep
    from dspark_trt.exporter.onnx_export import export_target_decode
    from dspark_trt.models.ort_fused import FusedDecoder

    decode = TargetDecodeStep(FusedDecoder(decoder, max_positions), aux_layers).eval()
    return export_target_decode(decode, Path(out_dir) / file, max_positions, dtype, vocab, external_data)


def record_ort_graph(graphs: dict, graph: str, io: dict, flavour: str = "fused", file: str | None = None,
                     decode: str | None = None) -> None:
    """Add graphs[graph]["ort"] after checking the flavour's I/O is the standard graph's, name for name.
    file: the flavour's file when it is not ort_file(graph); decode: the graph's decoding graph's file."""
    std = {k: graphs[graph][k] for k in ("inputs", "outputs")}
    if io != std:
        raise DsparkError(f"the ORT flavour of the {graph} graph changed its inputs or outputs: this is a bug "
                          f"in dspark_trt/models/ort_fused.py (export with --ort-flavour none meanwhile)")
    graphs[graph]["ort"] = {"file": file or ort_file(graph), "flavour": flavour}
    if decode is not None:
        graphs[graph]["ort"]["decode"] = decode


def check_flavour(flavour: str) -> None:
    if flavour not in ORT_FLAVOURS:
        raise DsparkError(f"--ort-flavour {flavour!r}: choose one of {', '.join(ORT_FLAVOURS)}")
