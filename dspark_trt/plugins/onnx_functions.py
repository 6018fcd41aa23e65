"""Model-local ONNX functions for the dspark ops: bodies in plain, vectorised standard ONNX.

ONNX Runtime inlines these bodies; TensorRT imports a dspark node as a plugin when one is registered
(``plugin_namespace="dspark"``) and otherwise imports the body, so one ONNX file serves both.

Body design (what the TensorRT parser supports well, no Loop/Scan):
* per-row math, ReduceMax/ReduceSum along V, CumSum along rows or V;
* request offsets by CumSum of ``verify_lens + 1``; each row's request id by scattering a 1 at every
  request's last row (ScatterElements, no reduction, unique indices) and an exclusive CumSum;
* the accepted length as the count of rows before the first "stop" row of a segment, from global
  CumSums gathered at segment bounds (the last row of each request is always a stop);
* lowest-index argmax as ``V - max(where(x == rowmax, V - iota, 0))``;
* integer counts/indices that go through a reduction or cumsum are float32 (exact below 2**24) and cast
  to int64 for Gather. Work is O(M * V) like the ops themselves; nothing is O(R * M).

The Survival body reads the node attribute ``temperatures`` by attribute reference
(``Constant(value_floats=@temperatures)``), which ONNX Runtime and the TensorRT parser (OnnxAttrs with
local functions) both resolve.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from dspark_trt.errors import DsparkError
from dspark_trt.plugins.spec import DOMAIN, OPS, QMAX_CLIP, VERSION, check_temperatures

MIN_OPSET = 18  # ReduceMax/ReduceMin with axes as an input
DEFAULT_OPSET = 18


class _Body:
    """A tiny node-list builder with unique value names."""

    def __init__(self, prefix: str):
        import onnx.helper

        self.helper = onnx.helper
        self.nodes: list = []
        self.prefix = prefix
        self.count = 0

    def _name(self, hint: str) -> str:
        self.count += 1
        return f"{self.prefix}_{hint}_{self.count}"

    def op(self, op_type: str, *inputs: str, hint: str | None = None, **attrs) -> str:
        out = self._name(hint or op_type.lower())
        self.nodes.append(self.helper.make_node(op_type, list(inputs), [out], **attrs))
        return out

    def const(self, value, dtype: str = "float32", hint: str = "c") -> str:
        import numpy as np
        import onnx.numpy_helper

        out = self._name(hint)
        tensor = onnx.numpy_helper.from_array(np.asarray(value, dtype=dtype), name=out)
        self.nodes.append(self.helper.make_node("Constant", [], [out], value=tensor))
        return out

    def rename(self, src: str, dst: str) -> None:
        self.nodes.append(self.helper.make_node("Identity", [src], [dst]))


def _float(b: _Body, x: str) -> str:
    import onnx

    return b.op("Cast", x, to=onnx.TensorProto.FLOAT, hint="f32")


def _int64(b: _Body, x: str) -> str:
    import onnx

    return b.op("Cast", x, to=onnx.TensorProto.INT64, hint="i64")


def _dim(b: _Body, x: str, axis: int) -> str:
    """Scalar int64 size of one dim."""
    d = b.op("Shape", x, start=axis, end=axis + 1)
    return b.op("Squeeze", d, b.const([0], "int64"))


def _unsq(b: _Body, x: str, axis: int) -> str:
    return b.op("Unsqueeze", x, b.const([axis], "int64"))


def _lowest_argmax(b: _Body, lf: str, vf: str, iota_vf: str) -> str:
    """Lowest-index argmax per row of [M, V] float -> [M] int64 (all -inf row -> 0)."""
    rmax = b.op("ReduceMax", lf, b.const([1], "int64"), keepdims=1)
    # (V - index) where the row max is, else 0: as a product, not a Where, whose broadcast over [M, V] is
    # ONNX Runtime's slowest kernel in a verify step at V = 128256 (the values are identical).
    score = b.op("Mul", _float(b, b.op("Equal", lf, rmax)), b.op("Sub", vf, iota_vf))
    smax = b.op("ReduceMax", score, b.const([1], "int64"), keepdims=0)
    idx = b.op("Where", b.op("Greater", smax, b.const(0.0)), b.op("Sub", vf, smax), b.const(0.0))
    return _int64(b, idx)


def _rows(b: _Body, lens: str, m: str) -> dict[str, str]:
    """Packed-row bookkeeping from verify_lens [R] int64 and the scalar row count m.

    Returns names of offs / last [R] int64 (first and last row of each request) and, per row [M],
    rid (request id, int64) and draft_row (bool: the row verifies a draft token).
    """
    zero_i = b.const(0, "int64")
    sizes = b.op("Add", _float(b, lens), b.const(1.0))
    ends_f = b.op("CumSum", sizes, zero_i)
    offs = _int64(b, b.op("Sub", ends_f, sizes))
    last = b.op("Sub", _int64(b, ends_f), b.const(1, "int64"))
    zeros_m = b.op("ConstantOfShape", _unsq(b, m, 0), value=b.helper.make_tensor("v", 1, [1], [0.0]))
    ones_r = b.op("ConstantOfShape", b.op("Shape", lens), value=b.helper.make_tensor("v", 1, [1], [1.0]))
    is_last = b.op("ScatterElements", zeros_m, last, ones_r, axis=0)
    rid = _int64(b, b.op("CumSum", is_last, zero_i, exclusive=1))
    offs_row = b.op("Gather", offs, rid, axis=0)
    j_row = b.op("Sub", b.op("Range", zero_i, m, b.const(1, "int64")), offs_row)
    draft_row = b.op("Less", j_row, b.op("Gather", lens, rid, axis=0))
    return {"offs": offs, "last": last, "rid": rid, "offs_row": offs_row, "draft_row": draft_row}


def _accepted(b: _Body, rows: dict[str, str], reject: str) -> str:
    """a_r = number of rows of request r before its first stop row (a rejected draft row or the last
    row, which always stops) -> [R] int64."""
    zero_i = b.const(0, "int64")
    stop = _float(b, b.op("Or", b.op("Not", rows["draft_row"]), reject))
    c_incl = b.op("CumSum", stop, zero_i)
    c_excl = b.op("Sub", c_incl, stop)
    stops_so_far = b.op("Sub", c_incl, b.op("Gather", c_excl, rows["offs_row"], axis=0))
    in_prefix = _float(b, b.op("Equal", stops_so_far, b.const(0.0)))
    p_incl = b.op("CumSum", in_prefix, zero_i)
    p_excl = b.op("Sub", p_incl, in_prefix)
    acc = b.op("Sub", b.op("Gather", p_incl, rows["last"], axis=0), b.op("Gather", p_excl, rows["offs"], axis=0))
    return _int64(b, acc)


def _vocab(b: _Body, logits: str) -> tuple[str, str, str]:
    v = _dim(b, logits, 1)
    iota = b.op("Range", b.const(0, "int64"), v, b.const(1, "int64"))
    return v, _float(b, v), _float(b, iota)


def _survival_body(b: _Body) -> list[str]:
    import onnx

    lf = _float(b, "logits")
    prev = _float(b, "prev")
    temps = b._name("temperatures")
    attr = onnx.AttributeProto()
    attr.name, attr.ref_attr_name, attr.type = "value_floats", "temperatures", onnx.AttributeProto.FLOATS
    node = b.helper.make_node("Constant", [], [temps])
    node.attribute.append(attr)
    b.nodes.append(node)
    kmax1 = b.op("Sub", b.op("Shape", temps), b.const([1], "int64"))  # [1]
    j = _dim(b, "logits", 1)
    cols = b.op("Range", b.const(0, "int64"), j, b.const(1, "int64"))
    pos = b.op("Add", _unsq(b, "start", 1), _unsq(b, cols, 0))
    pos = b.op("Min", b.op("Max", pos, b.const(0, "int64")), kmax1)
    x = b.op("Div", lf, b.op("Gather", temps, pos, axis=0))
    softplus_neg_abs = b.op("Log", b.op("Add", b.const(1.0), b.op("Exp", b.op("Neg", b.op("Abs", x)))))
    log_sig = b.op("Sub", b.op("Min", x, b.const(0.0)), softplus_neg_abs)
    cum = b.op("CumSum", log_sig, b.const(1, "int64"))
    b.rename(b.op("Mul", _unsq(b, prev, 1), b.op("Exp", cum)), "survival")
    return ["temperatures"]


def _greedy_body(b: _Body) -> list[str]:
    lf = _float(b, "logits")
    _, vf, iota_vf = _vocab(b, "logits")
    am = _lowest_argmax(b, lf, vf, iota_vf)
    rows = _rows(b, "verify_lens", _dim(b, "logits", 0))
    acc = _accepted(b, rows, b.op("Not", b.op("Equal", am, "draft_tokens")))
    b.rename(acc, "accepted")
    final_row = b.op("Add", rows["offs"], acc)
    b.rename(b.op("Gather", am, final_row, axis=0), "next_token")
    return []


def _sample_body(b: _Body) -> list[str]:
    lf = _float(b, "logits")
    q = _float(b, "draft_probs")
    v, vf, iota_vf = _vocab(b, "logits")
    m = _dim(b, "logits", 0)
    zero_f, one_f = b.const(0.0), b.const(1.0)
    am = _lowest_argmax(b, lf, vf, iota_vf)

    zero_i = b.const(0, "int64")
    lens = "verify_lens"
    rows = _rows(b, lens, m)
    rid = rows["rid"]

    # p per row: softmax(logits / T), or one-hot of the argmax (T <= 0 or non-finite row max)
    t_row = b.op("Gather", "temperature", rid, axis=0)
    positive = b.op("Greater", t_row, zero_f)
    z = b.op("Div", lf, _unsq(b, b.op("Where", positive, t_row, one_f), 1))
    zmax = b.op("ReduceMax", z, b.const([1], "int64"), keepdims=1)
    finite = b.op("Less", b.op("Abs", zmax), b.const(float("inf")))
    e = b.op("Exp", b.op("Sub", z, b.op("Where", finite, zmax, zero_f)))
    p_soft = b.op("Div", e, b.op("ReduceSum", e, b.const([1], "int64"), keepdims=1))
    # Greedy rows (T <= 0 or a non-finite row max) use the one-hot of the argmax instead of p_soft. It
    # is never built as [M, V]: only the gathered p(x) per row, and the R final rows below, need it (a
    # [M, V] one-hot and Where cost as much as the lm_head itself at V = 128256).
    greedy = b.op("Squeeze", b.op("Or", b.op("Not", _unsq(b, positive, 1)), b.op("Not", finite)), b.const([1], "int64"))

    # accept tests
    x = "draft_tokens"
    valid = b.op("And", b.op("GreaterOrEqual", x, zero_i), b.op("Less", x, v))
    xc = _unsq(b, b.op("Where", valid, x, zero_i), 1)
    px_soft = b.op("Squeeze", b.op("GatherElements", p_soft, xc, axis=1), b.const([1], "int64"))
    px_greedy = _float(b, b.op("Equal", x, am))
    px = b.op("Where", valid, b.op("Where", greedy, px_greedy, px_soft), zero_f)
    qx = b.op("Where", valid, b.op("Squeeze", b.op("GatherElements", q, xc, axis=1), b.const([1], "int64")), zero_f)
    q_pos = b.op("Greater", qx, zero_f)
    ratio = b.op("Min", b.op("Div", px, b.op("Where", q_pos, qx, one_f)), one_f)
    accept = b.op("Or", b.op("And", q_pos, b.op("Less", "accept_uniforms", ratio)),
                  b.op("And", b.op("Not", q_pos), b.op("Greater", px, zero_f)))  # (Where has no bool in ORT)
    acc = _accepted(b, rows, b.op("Not", accept))
    b.rename(acc, "accepted")

    # final draw at row o_r + a_r: residual after a rejection (p if it sums to 0), else the bonus from p
    final_row = b.op("Add", rows["offs"], acc)
    onehot_f = _float(b, b.op("Equal", _unsq(b, b.op("Range", zero_i, v, b.const(1, "int64")), 0),
                              _unsq(b, b.op("Gather", am, final_row, axis=0), 1)))
    pf = b.op("Where", _unsq(b, b.op("Gather", greedy, final_row, axis=0), 1), onehot_f,
              b.op("Gather", p_soft, final_row, axis=0))
    qf = b.op("Gather", q, final_row, axis=0)
    resid = b.op("Max", b.op("Sub", pf, qf), zero_f)
    rs = b.op("ReduceSum", resid, b.const([1], "int64"), keepdims=0)
    use_resid = b.op("And", b.op("Less", acc, lens), b.op("Greater", rs, zero_f))
    w = b.op("Where", _unsq(b, use_resid, 1), resid, pf)
    total = b.op("ReduceSum", w, b.const([1], "int64"), keepdims=1)
    thr = b.op("Mul", _unsq(b, "sample_uniforms", 1), total)
    cdf = b.op("CumSum", w, b.const(1, "int64"))
    count = b.op("ReduceSum", _float(b, b.op("LessOrEqual", cdf, thr)), b.const([1], "int64"), keepdims=0)
    last_nz = b.op("ReduceMax", b.op("Where", b.op("Greater", w, zero_f), iota_vf, zero_f),
                   b.const([1], "int64"), keepdims=0)
    b.rename(_int64(b, b.op("Min", count, last_nz)), "next_token")
    return []


def _ref_constant(b: _Body, attr_name: str, field: str, attr_type) -> str:
    """Constant(<field>=@attr_name): the node's attribute value inside the body."""
    import onnx

    out = b._name(attr_name)
    attr = onnx.AttributeProto()
    attr.name, attr.ref_attr_name, attr.type = field, attr_name, attr_type
    node = b.helper.make_node("Constant", [], [out])
    node.attribute.append(attr)
    b.nodes.append(node)
    return out


def _softmax(b: _Body, z: str, zero_f: str) -> tuple[str, str]:
    """Row softmax of [R, V] z -> (soft [R, V], finite [R, 1]: the row max is finite; soft is not
    meaningful where it is not)."""
    zmax = b.op("ReduceMax", z, b.const([1], "int64"), keepdims=1)
    finite = b.op("Less", b.op("Abs", zmax), b.const(float("inf")))
    ex = b.op("Exp", b.op("Sub", z, b.op("Where", finite, zmax, zero_f)))
    return b.op("Div", ex, b.op("ReduceSum", ex, b.const([1], "int64"), keepdims=1)), finite


def _qmax_logit(b: _Body, soft: str, finite: str) -> str:
    """qmax_confidence: logit(clip(q_max, 1e-6, 1 - 1e-6)), q_max = max of the soft row (1 where the row
    max is not finite)."""
    one_f = b.const(1.0)
    qmax = b.op("ReduceMax", soft, b.const([1], "int64"), keepdims=0)
    p = b.op("Where", b.op("Squeeze", finite, b.const([1], "int64")), qmax, one_f)
    p = b.op("Clip", p, b.const(QMAX_CLIP), b.const(1 - QMAX_CLIP))
    return b.op("Sub", b.op("Log", p), b.op("Log", b.op("Sub", one_f, p)))


def _markov_body(b: _Body, steps: int, sample: bool = False, qmax: bool = False) -> list[str]:
    """MarkovDraft (sample=False) / MarkovSample, unrolled over the `steps` positions (no Loop: the
    TensorRT parser imports every node). `qmax` (the nodes' qmax_confidence) is built in like `steps`,
    so graphs without it compute no extra softmax."""
    import onnx

    base = _float(b, "base_logits")  # [R, N, V]
    cb = _float(b, "conf_base")  # [R, N]
    scale = _ref_constant(b, "logit_scale", "value_float", onnx.AttributeProto.FLOAT)
    k = _ref_constant(b, "draft_topk", "value_int", onnx.AttributeProto.INT)
    zero_i, one_i = b.const(0, "int64"), b.const(1, "int64")
    v = _dim(b, "base_logits", 2)
    iota = b.op("Range", zero_i, v, one_i)
    vf, iota_vf = _float(b, v), _float(b, iota)
    # top-k candidates, once for all positions: the k-th (value, index) in TopK's order is the threshold
    k_eff = b.op("Min", b.op("Max", k, one_i), v)
    top = [b._name("topk_values"), b._name("topk_indices")]
    b.nodes.append(b.helper.make_node("TopK", [base, _unsq(b, k_eff, 0)], top, axis=-1, largest=1, sorted=1))
    kth = b.op("Sub", k_eff, one_i)
    thr_val = _unsq(b, b.op("Gather", top[0], kth, axis=2), 2)
    thr_idx = _unsq(b, b.op("Gather", top[1], kth, axis=2), 2)
    cand = b.op("Or", b.op("Greater", base, thr_val),
                b.op("And", b.op("Equal", base, thr_val), b.op("LessOrEqual", iota, thr_idx)))
    cand = b.op("Or", cand, b.op("Equal", k, zero_i))
    neg_inf = b.const(float("-inf"))
    w2t = b.op("Transpose", "markov_w2", perm=[1, 0])  # [K, V]
    if sample:
        zero_f, one_f = b.const(0.0), b.const(1.0)
        positive = b.op("Greater", "temperature", zero_f)
        safe_t = _unsq(b, b.op("Where", positive, "temperature", one_f), 1)
        to_target = _unsq(b, b.op("Add", iota, "d2t"), 0)  # [1, V]
        r_dim = _dim(b, "base_logits", 0)
        t_dim = _dim(b, "markov_w1", 0)
        rt_shape = b.op("Concat", _unsq(b, r_dim, 0), _unsq(b, t_dim, 0), axis=0)
        zeros_rt = b.op("ConstantOfShape", rt_shape, value=b.helper.make_tensor("v", 1, [1], [0.0]))
        idx_rv = b.op("Expand", to_target, b.op("Concat", _unsq(b, r_dim, 0), _unsq(b, v, 0), axis=0))
    prev, toks, confs, probs = "anchor", [], [], []
    for i in range(steps):
        ii = b.const(i, "int64")
        e = b.op("Gather", "markov_w1", prev, axis=0)  # [R, K]
        x = b.op("Add", b.op("Gather", base, ii, axis=1), b.op("Mul", scale, b.op("MatMul", e, w2t)))
        x = b.op("Where", b.op("Gather", cand, ii, axis=1), x, neg_inf)
        d = _lowest_argmax(b, x, vf, iota_vf)
        if sample:  # q = softmax(x / T) (one-hot of the argmax if T <= 0 or the max is not finite); inverse CDF
            soft, finite = _softmax(b, b.op("Div", x, safe_t), zero_f)
            greedy = b.op("Or", b.op("Not", _unsq(b, positive, 1)), b.op("Not", finite))
            onehot = _float(b, b.op("Equal", _unsq(b, iota, 0), _unsq(b, d, 1)))
            q = b.op("Where", greedy, onehot, soft)
            u = b.op("Gather", "uniforms", ii, axis=1)
            thr = b.op("Mul", _unsq(b, u, 1), b.op("ReduceSum", q, b.const([1], "int64"), keepdims=1))
            count = b.op("ReduceSum", _float(b, b.op("LessOrEqual", b.op("CumSum", q, one_i), thr)),
                         b.const([1], "int64"), keepdims=0)
            last_nz = b.op("ReduceMax", b.op("Where", b.op("Greater", q, zero_f), iota_vf, zero_f),
                           b.const([1], "int64"), keepdims=0)
            d = _int64(b, b.op("Min", count, last_nz))
            probs.append(_unsq(b, b.op("ScatterElements", zeros_rt, idx_rv, q, axis=1), 1))
        elif qmax:
            soft, finite = _softmax(b, x, b.const(0.0))
        prev = b.op("Add", d, b.op("Gather", "d2t", d, axis=0))
        toks.append(_unsq(b, prev, 1))
        if qmax:  # sampled rows: soft is q at T; T <= 0 rows: safe_t = 1, so soft is MarkovDraft's softmax
            c = _qmax_logit(b, soft, finite)
        else:
            c = b.op("Add", b.op("Gather", cb, ii, axis=1),
                     b.op("ReduceSum", b.op("Mul", e, "conf_w"), b.const([1], "int64"), keepdims=0))
        confs.append(_unsq(b, c, 1))
    b.rename(b.op("Concat", *toks, axis=1), "draft_tokens")
    b.rename(b.op("Concat", *confs, axis=1), "confidence_logits")
    if sample:
        b.rename(b.op("Concat", *probs, axis=1), "draft_probs")
    return ["steps", "logit_scale", "draft_topk", "qmax_confidence"]


_BODIES = {"Survival": _survival_body, "GreedyAccept": _greedy_body, "SampleAccept": _sample_body,
           "MarkovDraft": _markov_body, "MarkovSample": _markov_body}
MARKOV_OPS = ("MarkovDraft", "MarkovSample")


def function_proto(op_name: str, temperatures: Sequence[float] | None = None, opset: int = DEFAULT_OPSET,
                   steps: int | None = None, qmax_confidence: int = 0):
    """The FunctionProto (domain ``dspark``, name = op name) of one op.

    For Survival, ``temperatures`` given makes it the attribute's default (nodes may then omit it);
    otherwise the attribute is required on every node. The body always reads the node's value.
    MarkovDraft's body is unrolled over ``steps`` positions and built for ``qmax_confidence`` (every
    MarkovDraft/MarkovSample node of a model must carry the same values).
    """
    import onnx.helper

    if op_name not in OPS:
        raise DsparkError(f"unknown dspark op {op_name!r}; known: {', '.join(sorted(OPS))}")
    if opset < MIN_OPSET:
        raise DsparkError(f"dspark ONNX functions need opset >= {MIN_OPSET}, the model uses {opset}; "
                          f"export with opset_version >= {MIN_OPSET}")
    op = OPS[op_name]
    b = _Body(op_name.lower())
    if op_name in MARKOV_OPS:
        if not steps or steps < 1:
            raise DsparkError(f"the {op_name} function body needs steps >= 1 (the node attribute)")
        attrs = _markov_body(b, int(steps), sample=op_name == "MarkovSample", qmax=bool(qmax_confidence))
    else:
        attrs = _BODIES[op_name](b)
    attribute_names, attribute_protos = list(attrs), []
    if op_name == "Survival" and temperatures is not None:
        temps = check_temperatures(temperatures, where="Survival temperatures")
        attribute_names = []
        attribute_protos = [onnx.helper.make_attribute("temperatures", temps)]
    return onnx.helper.make_function(
        DOMAIN, op_name, op.input_names, op.output_names, b.nodes,
        opset_imports=[onnx.helper.make_opsetid("", opset)],
        attributes=attribute_names, attribute_protos=attribute_protos,
        doc_string=op.doc)


def function_protos(ops_used: Iterable[str], temperatures: Sequence[float] | None = None,
                    opset: int = DEFAULT_OPSET, steps: int | None = None, qmax_confidence: int = 0) -> list:
    """FunctionProtos for the given op names (deduplicated, spec order)."""
    wanted = set(ops_used)
    unknown = wanted - set(OPS)
    if unknown:
        raise DsparkError(f"unknown dspark op(s) {sorted(unknown)}; known: {', '.join(sorted(OPS))}")
    return [function_proto(name, temperatures, opset, steps=steps, qmax_confidence=qmax_confidence)
            for name in OPS if name in wanted]


def _iter_nodes(graph):
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.g is not None and attr.HasField("g"):
                yield from _iter_nodes(attr.g)
            for g in attr.graphs:
                yield from _iter_nodes(g)


def dspark_nodes(model) -> list:
    """All nodes of the dspark domain in the model's graph (subgraphs included) and local functions."""
    nodes = [n for n in _iter_nodes(model.graph) if n.domain == DOMAIN]
    for f in model.functions:
        if f.domain != DOMAIN:
            nodes.extend(n for n in f.node if n.domain == DOMAIN)
    return nodes


def model_opset(model, domain: str = "") -> int | None:
    for o in model.opset_import:
        if o.domain == domain or (domain == "" and o.domain == "ai.onnx"):
            return int(o.version)
    return None


def attach_functions(model, temperatures: Sequence[float] | None = None):
    """Add the FunctionProto of every dspark op the model uses and opset_import ('dspark', 1).

    Existing dspark functions of the same name are replaced (so re-attaching updates the bodies). The
    bodies use the model's default-domain opset (>= 18). Every dspark node must name a known op and carry
    ``plugin_namespace="dspark"``. Returns the model (modified in place).
    """
    import onnx.helper

    nodes = dspark_nodes(model)
    used: list[str] = []
    steps, qmax = None, set()
    for n in nodes:
        if n.op_type not in OPS:
            raise DsparkError(f"node {n.name or n.op_type!r} uses unknown dspark op {n.op_type!r}; "
                              f"known: {', '.join(sorted(OPS))}")
        ns = [a for a in n.attribute if a.name == "plugin_namespace"]
        if not ns or ns[0].s.decode() != DOMAIN:
            raise DsparkError(f"dspark node {n.name or n.op_type!r} lacks plugin_namespace=\"{DOMAIN}\"; "
                              f"build dspark nodes with dspark_trt.plugins.spec.make_node")
        if n.op_type == "Survival" and temperatures is None:
            if not any(a.name == "temperatures" for a in n.attribute):
                raise DsparkError(f"Survival node {n.name!r} has no temperatures attribute")
        if n.op_type in MARKOV_OPS:
            node_steps = next((a.i for a in n.attribute if a.name == "steps"), None)
            if node_steps is None or (steps is not None and node_steps != steps):
                raise DsparkError(f"{n.op_type} node {n.name!r}: every MarkovDraft/MarkovSample node of a model "
                                  f"needs the same steps attribute (found {node_steps} and {steps})")
            steps = node_steps
            qmax.add(next((a.i for a in n.attribute if a.name == "qmax_confidence"), 0))
        if n.op_type not in used:
            used.append(n.op_type)
    if not used:
        return model
    if len(qmax) > 1:
        raise DsparkError("every MarkovDraft/MarkovSample node of a model needs the same qmax_confidence attribute")
    opset = model_opset(model)
    if opset is None:
        opset = DEFAULT_OPSET
        model.opset_import.append(onnx.helper.make_opsetid("", opset))
    have = model_opset(model, DOMAIN)
    if have is None:
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, VERSION))
    elif have != VERSION:
        raise DsparkError(f"model imports domain {DOMAIN!r} version {have}; this dspark-trt provides version "
                          f"{VERSION}")
    new = function_protos(used, temperatures=temperatures, opset=opset, steps=steps,
                          qmax_confidence=max(qmax, default=0))
    keep = [f for f in model.functions if not (f.domain == DOMAIN and f.name in set(used))]
    del model.functions[:]
    model.functions.extend(keep + new)
    if model.ir_version < 9 and temperatures is not None:
        model.ir_version = 9  # attribute defaults in FunctionProto (attribute_proto) need IR >= 9
    return model
