"""`dspark-trt check`, the graph-I/O phase: each graph's inputs and outputs against `graphs.<graph>` in
the manifest (names, dtypes, ranks, static dims), and every dynamic input dim covered by a `dims` range,
one range per graph dim (the TensorRT optimisation profiles are derived from these).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dspark_trt.exporter.trt_support import onnx_dtype_name

if TYPE_CHECKING:
    from dspark_trt.exporter.check import CheckReport
    from dspark_trt.manifest import Manifest


def _onnx_dims(vi) -> list:
    """Per axis: int for a static dim, str dim_param, or None for an unnamed dynamic dim."""
    out = []
    for d in vi.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            out.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param:
            out.append(d.dim_param)
        else:
            out.append(None)
    return out


def check_io_against_manifest(report: CheckReport, graph: str, fname: str, model, spec: dict,
                               manifest: Manifest) -> None:
    """Graph I/O must match graphs.<graph> in the manifest, and every dynamic input dim needs a profile."""
    dims = manifest.get("dims") if isinstance(manifest.get("dims"), dict) else {}
    init_names = {i.name for i in model.graph.initializer}
    onnx_inputs = {vi.name: vi for vi in model.graph.input if vi.name not in init_names}
    onnx_outputs = {vi.name: vi for vi in model.graph.output}
    where = f"graphs.{graph}"

    def spec_list(kind: str) -> dict:
        out = {}
        for io in spec.get(kind) or []:
            if isinstance(io, dict) and isinstance(io.get("name"), str):
                out[io["name"]] = io
        return out

    spec_in, spec_out = spec_list("inputs"), spec_list("outputs")

    param_ranges: dict[str, tuple] = {}  # ONNX dim_param -> (manifest dim, range) first seen
    for name, vi in onnx_inputs.items():
        io = spec_in.get(name)
        if io is None:
            report.problem(f"{fname}: input {name!r} is not described in manifest {where}.inputs, so its dynamic "
                           f"dims have no optimisation profile")
            continue
        _compare_dtype(report, fname, "input", name, vi, io, where)
        if vi.type.WhichOneof("value") != "tensor_type" or not vi.type.tensor_type.HasField("shape"):
            continue
        odims = _onnx_dims(vi)
        mshape = io.get("shape") if isinstance(io.get("shape"), list) else None
        if mshape is None:
            continue
        if len(mshape) != len(odims):
            report.problem(f"{fname}: input {name!r} has rank {len(odims)}, manifest {where}.inputs says "
                           f"{len(mshape)} ({mshape})")
            continue
        for axis, (od, md) in enumerate(zip(odims, mshape)):
            label = f"{fname}: input {name!r} axis {axis}"
            if isinstance(od, int):
                if isinstance(md, str):
                    rng = dims.get(md)
                    if isinstance(rng, dict) and not (rng.get("min") == rng.get("max") == od):
                        report.problem(f"{label} is static {od} in the graph but manifest dim {md!r} ranges "
                                       f"{rng.get('min')}..{rng.get('max')}")
                elif isinstance(md, int) and md != od:
                    report.problem(f"{label} is {od} in the graph, manifest says {md}")
                continue
            # dynamic in the graph
            if isinstance(md, str):
                rng = dims.get(md)
                if not isinstance(rng, dict):
                    report.problem(f"{label} is dynamic ({od or 'unnamed'}) and manifest dim {md!r} is not in "
                                   f"'dims': no optimisation profile covers it")
                    continue
                if isinstance(od, str):
                    key = (rng.get("min"), rng.get("opt"), rng.get("max"))
                    first = param_ranges.setdefault(od, (md, key))
                    if first[1] != key:
                        report.problem(f"{label}: graph dim {od!r} is profiled as {md!r} {key} here but as "
                                       f"{first[0]!r} {first[1]} on another input; one graph dim needs one range")
            elif not isinstance(md, int) or md == 0:
                report.problem(f"{label} is dynamic ({od or 'unnamed'}) and not covered by the manifest dims"
                               + (" (recorded as 0)" if md == 0 else ""))
    for name in spec_in:
        if name not in onnx_inputs:
            report.problem(f"{fname}: manifest {where}.inputs names {name!r}, which the graph does not have")

    for name, vi in onnx_outputs.items():
        io = spec_out.get(name)
        if io is None:
            report.problem(f"{fname}: output {name!r} is not described in manifest {where}.outputs")
            continue
        _compare_dtype(report, fname, "output", name, vi, io, where)
    for name in spec_out:
        if name not in onnx_outputs:
            report.problem(f"{fname}: manifest {where}.outputs names {name!r}, which the graph does not have")


def _compare_dtype(report: CheckReport, fname: str, kind: str, name: str, vi, io: dict, where: str) -> None:
    if vi.type.WhichOneof("value") != "tensor_type":
        return
    actual = onnx_dtype_name(vi.type.tensor_type.elem_type)
    declared = io.get("dtype")
    if isinstance(declared, str) and declared != actual:
        report.problem(f"{fname}: {kind} {name!r} is {actual} in the graph, manifest {where}.{kind}s says {declared}")
