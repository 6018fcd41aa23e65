"""Saving exported graphs with their weights beside them (ONNX external data), without a full copy.

A protobuf cannot exceed 2 GB, and serializing a model with weights inlined costs one more full copy
of the weights in memory. So graphs are written by onnx_ir straight from the exported program (each
initializer streamed from the torch tensor that holds it into `<graph>.onnx.data`), and only the
weight-less graph is loaded back (`load_external_data=False`) for post-processing (attaching the
dspark functions). Small graphs may still be written inline (`never`, or `auto` below the threshold).
"""

from __future__ import annotations

from pathlib import Path

from dspark_trt.errors import DsparkError

MODES = ("auto", "always", "never")
# auto: weights above this go to a side file. Well under protobuf's 2 GB so the graph itself fits too.
AUTO_THRESHOLD_BYTES = 1 << 30
STREAM_BYTES = 128 << 20  # bytes onnx_ir may hold in flight while writing the side file
PROTOBUF_LIMIT_BYTES = 2 * 10**9 - 64 * 2**20  # leave room for the graph structure itself


def data_file_name(onnx_name: str) -> str:
    return f"{onnx_name}.data"


def initializer_bytes(ir_model) -> int:
    """Total bytes of an onnx_ir model's initializers (without materialising them)."""
    total = 0
    for v in ir_model.graph.initializers.values():
        c = v.const_value
        if c is not None:
            total += int(c.nbytes)
    return total


def use_external(mode: str, weight_bytes: int) -> bool:
    if mode not in MODES:
        raise DsparkError(f"--external-data {mode!r}: choose one of {', '.join(MODES)}")
    if mode == "always":
        return True
    if mode == "never":
        if weight_bytes > PROTOBUF_LIMIT_BYTES:
            raise DsparkError(f"the graph's weights take {weight_bytes / 1e9:.2f} GB, over the 2 GB an ONNX "
                              f"file can hold inline: use --external-data auto (or always)")
        return False
    return weight_bytes > AUTO_THRESHOLD_BYTES


def save_program(program, path: Path, mode: str, post_process) -> list[str]:
    """Write an exported torch ONNXProgram to `path` (+ a `.data` side file when external).

    `post_process(model_proto)` edits the weight-less ModelProto in place (e.g. attach_functions).
    Returns the file names written (relative to path's directory)."""
    import onnx

    path = Path(path)
    external = use_external(mode, initializer_bytes(program.model))
    data_name = data_file_name(path.name)
    if external:
        import onnx_ir as ir

        # onnx_ir writes the tensors to the side file one by one (one worker, a bounded amount in
        # flight); no protobuf with the weights inlined is ever built. Tensors under 256 bytes stay inline.
        ir.save(program.model, str(path), external_data=data_name, max_workers=1,
                max_in_flight_bytes=STREAM_BYTES)
        model = onnx.load(str(path), load_external_data=False)
        post_process(model)
        onnx.save(model, str(path))
        return [path.name, data_name]
    model = program.model_proto
    post_process(model)
    onnx.save(model, str(path))
    return [path.name]
