"""The target graph's all-greedy twin: the same graph without SampleAccept (runtime/backends/ort_greedy.py
says why ONNX Runtime runs it).

The exporter writes the twins of the target's ORT flavour and of its decoding graph (`target.greedy.ort.onnx`,
`target.decode.greedy.ort.onnx`; graphs.target.ort.greedy and .decode_greedy, hashed) when their weights are
inline: written here, the runtime opens them as they are, without the onnx package (a runtime-only install
has none) and without deriving them at every load (0.85 s of a 1.45 s load on the tiny pair).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["greedy_twin", "greedy_twin_file", "write_greedy_twins"]

_SELECTED = ("accepted", "next_token")


def greedy_twin_file(file: str) -> str:
    """`target.ort.onnx` -> `target.greedy.ort.onnx` (and the decoding graph's alike)."""
    return f"{file.removesuffix('.ort.onnx')}.greedy.ort.onnx"


def write_greedy_twins(graphs: dict, out_dir: Path) -> list[str]:
    """Write the all-greedy twins of the target's ORT flavour and of its decoding graph (those whose weights
    are inline: a twin holds its own copy) into out_dir and name them in graphs["target"]["ort"] as "greedy"
    and "decode_greedy"; returns the files written."""
    import onnx

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


def _subgraph_inputs(node) -> set[str]:
    """Names read inside a node's subgraph attributes (If/Loop bodies), which a dead-node pass must keep."""
    names: set[str] = set()
    for attr in node.attribute:
        for g in list(attr.graphs) + ([attr.g] if attr.HasField("g") else []):
            for n in g.node:
                names.update(n.input)
                names |= _subgraph_inputs(n)
    return names


def greedy_twin(model):
    """The all-greedy twin of a target ModelProto (a new proto), or None when the graph does not end in
    the expected per-row selection ``Where(cond, GreedyAccept out, SampleAccept out)`` for both outputs."""
    import onnx

    twin = onnx.ModelProto()
    twin.CopyFrom(model)
    g = twin.graph
    producer = {out: n for n in g.node for out in n.output}
    rename: dict[str, str] = {}
    for name in _SELECTED:
        where = producer.get(name)
        if where is None or where.op_type != "Where" or len(where.input) != 3:
            return None
        greedy = producer.get(where.input[1])
        sample = producer.get(where.input[2])
        if greedy is None or greedy.op_type != "GreedyAccept" or sample is None or sample.op_type != "SampleAccept":
            return None
        rename[where.input[1]] = name
    selectors = {id(producer[name]) for name in _SELECTED}
    nodes = [n for n in g.node if id(n) not in selectors]
    for n in nodes:
        if n.op_type == "GreedyAccept":
            for i, out in enumerate(n.output):
                if out in rename:
                    n.output[i] = rename[out]
    # Dead nodes: keep what the outputs need, walking back from them.
    needed = {o.name for o in g.output}
    kept = []
    for n in reversed(nodes):
        if any(out in needed for out in n.output):
            kept.append(n)
            needed.update(n.input)
            needed |= _subgraph_inputs(n)
    kept.reverse()
    del g.node[:]
    g.node.extend(kept)
    for field in (g.input, g.initializer):
        keep = [x for x in field if x.name in needed]
        del field[:]
        field.extend(keep)
    keep_vi = [v for v in g.value_info if v.name in needed]
    del g.value_info[:]
    g.value_info.extend(keep_vi)
    used = {(n.domain, n.op_type) for n in kept}
    funcs = [f for f in twin.functions if (f.domain, f.name) in used]
    del twin.functions[:]
    twin.functions.extend(funcs)
    return twin
