"""The ORT flavour of the draft and target graphs: the same I/O, fewer nodes (models/ort_fused.py).

`dspark-trt export --ort-flavour fused` writes `draft.ort.onnx` and `target.ort.onnx` beside the standard
graphs and records each under `graphs.<graph>.ort` ({"file", "flavour"}) with its sha256 in `files`.
The ORT backend runs that file when the entry is there and the standard one otherwise (artifacts from
before the flavour existed); TensorRT always builds from the standard graph.

The target's flavour also has a decoding graph, `target.decode.ort.onnx` (graphs.target.ort.decode;
exporter/graphs.TargetDecodeStep, runtime/backends/ort_decode.py), and so have the draft's two graphs
(`draft.decode.ort.onnx`, `draft_greedy.decode.ort.onnx`; DraftDecodeStep): their own I/O, fixed by the code
that runs them.

The target's flavour and its decoding graph also get their all-greedy twins (`target.greedy.ort.onnx`,
`target.decode.greedy.ort.onnx`; graphs.target.ort.greedy and .decode_greedy; runtime/backends/ort_greedy.py)
when their weights are inline: written here, the runtime opens them as they are, without the onnx package
(a runtime-only install has none) and without deriving them at every load (0.85 s of a 1.45 s load).
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


def greedy_twin_file(file: str) -> str:
    """`target.ort.onnx` -> `target.greedy.ort.onnx` (and the decoding graph's alike)."""
    return f"{file.removesuffix('.ort.onnx')}.greedy.ort.onnx"


def write_greedy_twins(graphs: dict, out_dir: Path) -> list[str]:
    """Write the all-greedy twins of the target's ORT flavour and of its decoding graph (those whose weights
    are inline: a twin holds its own copy) into out_dir and name them in graphs["target"]["ort"] as "greedy"
    and "decode_greedy"; returns the files written."""
    import onnx

    from dspark_trt.runtime.backends.ort_greedy import greedy_twin

    spec = graphs["target"].get("ort")
    written = []
    for key, twin_key in (("file", "greedy"), ("decode", "decode_greedy")):
        file = spec.get(key) if spec else None
        if file is None or (Path(out_dir) / f"{file}.data").exists():
            continue
        twin = greedy_twin(onnx.load(str(Path(out_dir) / file)))
        if twin is None:
            continue
        name = greedy_twin_file(file)
        onnx.save(twin, str(Path(out_dir) / name))
        spec[twin_key] = name
        written.append(name)
    return written


def check_flavour(flavour: str) -> None:
    if flavour not in ORT_FLAVOURS:
        raise DsparkError(f"--ort-flavour {flavour!r}: choose one of {', '.join(ORT_FLAVOURS)}")
