"""The target graph's all-greedy twin for ONNX Runtime: the same graph without SampleAccept.

The target graph runs both acceptance ops on every verified row and picks per row (temperature <= 0:
GreedyAccept), so a step whose rows are all greedy still pays SampleAccept's [rows, V] work (softmaxes and
CDFs over the vocabulary) on a block of zeros. Wrapping the two in an `If` made sampled steps slower on ORT
(lab notes, issue 20), so the ORT backend instead runs a twin whose `accepted`/`next_token`
come from GreedyAccept alone (the per-row selection, SampleAccept and every input only they read dropped),
and runs it for calls with no sampling row. The exporter writes it beside the target's ORT graphs (hashed,
named in the manifest: exporter/ort_flavour.write_greedy_twins); for artifacts from before that, the backend
derives it at load from the hashed graph the manifest names (when the onnx package is there). TensorRT
engines keep the one graph.

The twin holds its own copy of the weights, so it is made only for graphs whose weights are inline (under
the exporter's 1 GiB external-data threshold); `DSPARK_ORT_GREEDY_TARGET=0` turns it off (comparisons).
"""

from __future__ import annotations

import os

__all__ = ["greedy_twin", "greedy_twin_bytes", "wanted"]

_SELECTED = ("accepted", "next_token")
_CACHE: dict[tuple, bytes | None] = {}  # serialized twins by (path, size, mtime): one derivation per process
_CACHE_MAX_BYTES = 64 << 20


def wanted() -> bool:
    return os.environ.get("DSPARK_ORT_GREEDY_TARGET", "1") != "0"


def _subgraph_inputs(node) -> set[str]:
    """Names read inside a node's subgraph attributes (If/Loop bodies), which a dead-node pass must keep."""
    names: set[str] = set()
    for attr in node.attribute:
        for g in list(attr.graphs) + ([attr.g] if attr.HasField("g") else []):
            for n in g.node:
                names.update(n.input)
                names |= _subgraph_inputs(n)
    return names


def greedy_twin_bytes(path) -> bytes | None:
    """The serialized twin of the target graph at `path` (None: the graph has no twin). A small graph's is
    kept and reused while the file is unchanged (tests and benches load the same artifact many times).
    None too without the onnx package (a runtime-only install): artifacts exported since the twins are
    written beside their graphs (exporter/ort_flavour.write_greedy_twins) never come here."""
    try:
        import onnx
    except ImportError:
        return None

    st = os.stat(path)
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key in _CACHE:
        return _CACHE[key]
    twin = greedy_twin(onnx.load(str(path)))
    data = None if twin is None else twin.SerializeToString()
    if st.st_size <= _CACHE_MAX_BYTES:  # a large target's copy is not kept once its session holds it
        _CACHE.clear()
        _CACHE[key] = data
    return data


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
