"""The target graph's sampled acceptance behind an ONNX `If`: run only when some row samples.

The target step scores every row with GreedyAccept and SampleAccept and picks per row
(exporter/graphs.accept). SampleAccept works on [M, V]: softmax of the target logits, the draft's
distribution (all zeros for greedy rows), the residual. In a step whose rows are all greedy none of it is
read, and at V = 128256 it costs more than the target's lm_head on ONNX Runtime (docs/lab-notes.md). So
the export wraps SampleAccept and the two per-row Where nodes into
`If(any temperature > 0)`: then-branch = that computation unchanged, else-branch = GreedyAccept's outputs.
Outputs are identical either way (a greedy row always takes GreedyAccept's result).

`unwrap` restores the flat graph (the TensorRT build parses that: the parser's If import has limits on
branch I/O types that int64 outputs may not meet, and no machine here can try it).
"""

from __future__ import annotations

ANY_SAMPLED = "dspark_any_sampled"  # the If's condition tensor (a name the wrap owns)
_SUFFIX = "_sampled_branch"


OUTPUTS = ("accepted", "next_token")


def wrap(model) -> bool:
    """Wrap SampleAccept and the per-row selection of `model` (a target ModelProto, edited in place) into
    If(any sampled row). Returns False (model untouched) when the graph does not have that shape."""
    from onnx import TensorProto, helper

    g = model.graph
    nodes = list(g.node)
    sample = [n for n in nodes if n.op_type == "SampleAccept"]
    greedy = [n for n in nodes if n.op_type == "GreedyAccept"]
    outs = OUTPUTS
    select = {n.output[0]: n for n in nodes if n.op_type == "Where" and len(n.output) == 1 and n.output[0] in outs}
    if len(sample) != 1 or len(greedy) != 1 or set(select) != set(outs):
        return False
    sample, greedy = sample[0], greedy[0]
    # Each selection must be Where(greedy_row, GreedyAccept out, SampleAccept out), nothing else reading them.
    for i, name in enumerate(outs):
        w = select[name]
        if w.input[1] != greedy.output[i] or w.input[2] != sample.output[i]:
            return False
    readers = [n for n in nodes if n is not sample and n not in select.values()
               and set(n.input) & set(sample.output)]
    if readers:
        return False

    branch_nodes = [sample] + [select[n] for n in outs]
    for w in branch_nodes[1:]:
        w.output[0] += _SUFFIX
    sampled = helper.make_graph(branch_nodes, "sampled_rows", [],
                                [helper.make_tensor_value_info(n + _SUFFIX, TensorProto.INT64, None) for n in outs])
    all_greedy = helper.make_graph(
        [helper.make_node("Identity", [greedy.output[i]], [n + "_greedy_branch"]) for i, n in enumerate(outs)],
        "greedy_rows", [], [helper.make_tensor_value_info(n + "_greedy_branch", TensorProto.INT64, None) for n in outs])
    zero = helper.make_tensor(ANY_SAMPLED + "_zero", TensorProto.FLOAT, [], [0.0])
    g.initializer.append(zero)
    cond = [
        helper.make_node("Greater", ["temperature", zero.name], [ANY_SAMPLED + "_rows"]),
        helper.make_node("Cast", [ANY_SAMPLED + "_rows"], [ANY_SAMPLED + "_rows_f"], to=TensorProto.FLOAT),
        helper.make_node("ReduceMax", [ANY_SAMPLED + "_rows_f"], [ANY_SAMPLED + "_f"], keepdims=0),
        helper.make_node("Cast", [ANY_SAMPLED + "_f"], [ANY_SAMPLED], to=TensorProto.BOOL),
        helper.make_node("If", [ANY_SAMPLED], list(outs), then_branch=sampled, else_branch=all_greedy,
                         name="dspark_sampled_acceptance"),
    ]
    kept = [n for n in nodes if n is not sample and n not in select.values()]
    del g.node[:]
    g.node.extend(kept + cond)
    return True


def unwrap(model) -> bool:
    """Undo `wrap` in place (the flat graph: both acceptance ops on every row). False when not wrapped."""
    g = model.graph
    nodes = list(g.node)
    node = next((n for n in nodes if n.op_type == "If" and n.input and n.input[0] == ANY_SAMPLED), None)
    if node is None:
        return False
    sampled = next(a.g for a in node.attribute if a.name == "then_branch")
    restored = []
    for n in sampled.node:
        if n.output and n.output[0].endswith(_SUFFIX):
            n.output[0] = n.output[0][:-len(_SUFFIX)]
        restored.append(n)
    kept = [n for n in nodes if n is not node and not any(o.startswith(ANY_SAMPLED) for o in n.output)]
    del g.node[:]
    g.node.extend(kept + restored)
    keep_init = [t for t in g.initializer if not t.name.startswith(ANY_SAMPLED)]
    del g.initializer[:]
    g.initializer.extend(keep_init)
    return True
