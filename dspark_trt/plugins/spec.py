"""The one specification of the dspark custom ops (ONNX domain ``dspark``, version 1).

Every implementation follows this file: the numpy reference (ground truth), the ONNX function bodies
(ONNX Runtime, and TensorRT when no plugin is registered), the Triton kernels and the TensorRT plugin
registration. Import-light: numpy-free, torch-free; ``onnx`` is imported only by :func:`make_node`.

Conventions shared by the accept ops
------------------------------------
Rows are packed: request ``r`` owns the ``L_r + 1`` consecutive rows ``o_r .. o_r + L_r`` of ``logits``
(and of ``draft_probs`` / ``draft_tokens`` / ``accept_uniforms``), where
``o_r = sum_{s<r} (L_s + 1)`` and ``L_r = verify_lens[r] >= 0``, so ``M = sum_r (L_r + 1)``. Row
``o_r + j`` is the target distribution that verifies draft token ``x_{j+1}``, stored at
``draft_tokens[o_r + j]`` (j < L_r); the last row of a request gives the bonus token and its
``draft_tokens`` / ``draft_probs`` / ``accept_uniforms`` entries are ignored. Offsets are computed
inside each op from ``verify_lens`` (a cumulative sum); nothing else describes the layout. Inputs
that break ``M = sum_r (L_r + 1)`` are undefined behaviour in the engine (the numpy reference and the
torch launchers raise ValueError; the ONNX bodies and the plugins do not check, to avoid a sync).

* ArgMax ties resolve to the lowest index, identically in every implementation; a row that is all
  ``-inf`` has argmax 0. NaN logits are undefined behaviour (the result is some in-range index).
* A draft token outside ``[0, V)`` never matches (greedy) and has p(x) = q(x) = 0 (sampling), so it is
  rejected.
* All arithmetic is float32 (float16/bfloat16 inputs are converted first). Index arithmetic in the ONNX
  bodies is done in float32 where a reduction or a cumulative sum is needed (exact below 2**24, far
  above any vocabulary or row count) because those float ops are the ones every backend supports.

Version 2 (reserved, not implemented): ``SampleAccept`` gains optional trailing inputs ``top_k`` int64
[R] and ``top_p`` float [R] (appended after ``sample_uniforms`` so version-1 graphs stay valid; an
absent or empty input means no truncation). Do not use those input positions for anything else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

DOMAIN = "dspark"
VERSION = 1
PLUGIN_NAMESPACE = "dspark"
PLUGIN_VERSION = "1"

QMAX_CLIP = 1e-6
"""qmax_confidence clips the drafted token's probability to [QMAX_CLIP, 1 - QMAX_CLIP] before the logit."""

FLOAT_TYPES = ("float32", "float16", "bfloat16")
"""Floating inputs that carry model outputs (logits, probabilities) may use any of these."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtypes: tuple[str, ...]
    shape: tuple[str, ...]
    doc: str
    optional: bool = False


@dataclass(frozen=True)
class AttrSpec:
    name: str
    type: str  # ONNX AttributeProto type name: "FLOATS", "STRING", ...
    doc: str
    required: bool = True
    default: Any = None


@dataclass(frozen=True)
class OpSpec:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    attributes: tuple[AttrSpec, ...]
    doc: str
    domain: str = DOMAIN
    version: int = VERSION
    reserved_inputs: tuple[TensorSpec, ...] = field(default=())

    @property
    def plugin_id(self) -> str:
        """The TensorRT plugin id, ``namespace::name``."""
        return f"{PLUGIN_NAMESPACE}::{self.name}"

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def attr(self, name: str) -> AttrSpec:
        for a in self.attributes:
            if a.name == name:
                return a
        raise KeyError(f"{self.name} has no attribute {name!r}")


_F = FLOAT_TYPES
_F32 = ("float32",)
_I64 = ("int64",)

SURVIVAL = OpSpec(
    name="Survival",
    inputs=(
        TensorSpec("logits", _F, ("R", "J"), "confidence-head logits of J consecutive draft positions"),
        TensorSpec("prev", _F, ("R",), "survival before column 0 (1.0 at the first draft position)"),
        TensorSpec("start", _I64, ("R",), "0-based draft position of column 0"),
    ),
    outputs=(TensorSpec("survival", _F32, ("R", "J"),
                        "S[r,j] = prev[r] * prod_{i<=j} sigmoid(logits[r,i] / T[start[r]+i])"),),
    attributes=(AttrSpec("temperatures", "FLOATS",
                         "per-position calibration temperatures (> 0), length Kmax; positions past the end "
                         "use the last value, negative positions the first"),),
    doc="Running survival of the confidence head, computed in log space: log-sigmoid "
        "(min(x, 0) - log(1 + exp(-|x|))), cumulative sum along J, exp, times prev. prev = 0 gives 0; "
        "logits of +inf contribute a factor 1 and -inf a factor 0.",
)

GREEDY_ACCEPT = OpSpec(
    name="GreedyAccept",
    inputs=(
        TensorSpec("logits", _F, ("M", "V"), "packed target logits, M = sum_r (L_r + 1)"),
        TensorSpec("draft_tokens", _I64, ("M",), "row o_r + j holds x_{j+1} (j < L_r); last row ignored"),
        TensorSpec("verify_lens", _I64, ("R",), "L_r >= 0 draft tokens verified for request r"),
    ),
    outputs=(
        TensorSpec("accepted", _I64, ("R",), "a_r: longest prefix with argmax(row o_r + j) == x_{j+1}"),
        TensorSpec("next_token", _I64, ("R",), "argmax of row o_r + a_r (correction or bonus token)"),
    ),
    attributes=(),
    doc="Greedy verification: accept the longest prefix the target's argmax agrees with, then emit the "
        "target's argmax at the first disagreement (or after the last draft token).",
)

SAMPLE_ACCEPT = OpSpec(
    name="SampleAccept",
    inputs=(
        TensorSpec("logits", _F, ("M", "V"), "packed target logits, M = sum_r (L_r + 1)"),
        TensorSpec("draft_probs", _F, ("M", "V"), "q rows aligned like draft_tokens; last row ignored"),
        TensorSpec("draft_tokens", _I64, ("M",), "row o_r + j holds x_{j+1} (j < L_r); last row ignored"),
        TensorSpec("verify_lens", _I64, ("R",), "L_r >= 0 draft tokens verified for request r"),
        TensorSpec("temperature", _F32, ("R",), "sampling temperature; T <= 0 means greedy (one-hot p)"),
        TensorSpec("accept_uniforms", _F32, ("M",), "u in [0, 1) for the test of row o_r + j (j < L_r)"),
        TensorSpec("sample_uniforms", _F32, ("R",), "u in [0, 1) for the correction/bonus draw"),
    ),
    outputs=(
        TensorSpec("accepted", _I64, ("R",), "a_r: number of accepted draft tokens"),
        TensorSpec("next_token", _I64, ("R",), "the correction (after a rejection) or bonus token"),
    ),
    attributes=(),
    reserved_inputs=(
        TensorSpec("top_k", _I64, ("R",), "version 2: keep the k most likely tokens (0 = all)", optional=True),
        TensorSpec("top_p", _F32, ("R",), "version 2: nucleus mass (1.0 = all)", optional=True),
    ),
    doc="Lossless speculative sampling. p_j = softmax(logits_j / T_r) (one-hot of the lowest-index "
        "argmax when T_r <= 0 or when the row maximum of logits / T_r is not finite). Accept x_{j+1} "
        "while u < min(1, p(x)/q(x)) (q(x) = 0: accept iff p(x) > 0). At the first rejection, at row j, "
        "draw from w = max(p_j - q_j, 0) (w = p_j if that sums to 0); after L_r acceptances draw the "
        "bonus from p at row o_r + L_r; L_r = 0 is plain sampling. The draw is by inverse CDF over the "
        "unnormalised w: the smallest index i with cumsum(w)[i] > u * sum(w), clamped to the last index "
        "with w > 0. With T_r <= 0 and one-hot q the result equals GreedyAccept.",
)

MARKOV_DRAFT = OpSpec(
    name="MarkovDraft",
    inputs=(
        TensorSpec("base_logits", _F, ("R", "N", "V"),
                   "the DSpark block pass's draft-vocabulary logits of the N sampled rows, already times "
                   "logit_scale (the model's lm_head output)"),
        TensorSpec("conf_base", _F, ("R", "N"), "confidence-head logit from the hidden state: w_h . h_i + b"),
        TensorSpec("anchor", _I64, ("R",), "the anchor token (target vocabulary): prev before position 0"),
        TensorSpec("markov_w1", _F32, ("T", "K"), "Markov embedding table, one row per target token"),
        TensorSpec("markov_w2", _F32, ("V", "K"), "Markov projection to the draft vocabulary"),
        TensorSpec("conf_w", _F32, ("K",), "confidence-head weight on the Markov embedding (zeros: none)"),
        TensorSpec("d2t", _I64, ("V",), "draft id i is target id i + d2t[i] (zeros: same vocabulary)"),
    ),
    outputs=(
        TensorSpec("draft_tokens", _I64, ("R", "N"), "greedy draft tokens, target vocabulary"),
        TensorSpec("confidence_logits", _F32, ("R", "N"),
                   "conf_base[r,i] + conf_w . e_i, or with qmax_confidence = 1 logit(q_max) of the "
                   "position's draft distribution (feed to Survival for calibrated survivals)"),
    ),
    attributes=(
        AttrSpec("steps", "INT", "N, the number of sequential positions (must equal base_logits dim 1)"),
        AttrSpec("logit_scale", "FLOAT", "the model's logit scale, applied to the Markov bias", required=False,
                 default=1.0),
        AttrSpec("draft_topk", "INT", "k > 0: only the k largest base logits of a position are candidates "
                 "(ties at the k-th value: lower index first); 0: every logit", required=False, default=0),
        AttrSpec("qmax_confidence", "INT", "1: the confidence logits are logit(clip(q_max, 1e-6, 1 - 1e-6)) of "
                 "each position's final draft distribution (for drafters without a confidence head; conf_base "
                 "and conf_w are then ignored); 0: the confidence head's logits", required=False, default=0),
    ),
    doc="The sequential stage of a DSpark draft step (greedy). For i = 0..N-1 with prev_0 = anchor: "
        "e_i = markov_w1[prev_i]; x_i = base_logits[r,i] + logit_scale * (markov_w2 @ e_i), -inf outside "
        "the top-k candidates when draft_topk > 0; d_i = lowest-index argmax of x_i; draft token "
        "t_i = d_i + d2t[d_i]; prev_{i+1} = t_i; confidence logit c_i = conf_base[r,i] + conf_w . e_i, or with "
        "qmax_confidence = 1 c_i = log(p_i) - log(1 - p_i), p_i = clip(max softmax(x_i), 1e-6, 1 - 1e-6) "
        "(q_max, the drafted token's probability; 1 when the row maximum of x_i is not finite). "
        "Only [R, N] tokens and logits leave the op; no [R, N, V] probabilities.",
)

MARKOV_SAMPLE = OpSpec(
    name="MarkovSample",
    inputs=MARKOV_DRAFT.inputs + (
        TensorSpec("temperature", _F32, ("R",), "sampling temperature; T <= 0 means greedy (one-hot q)"),
        TensorSpec("uniforms", _F32, ("R", "N"), "u in [0, 1) for the draw at each position"),
    ),
    outputs=MARKOV_DRAFT.outputs + (
        TensorSpec("draft_probs", _F32, ("R", "N", "T"),
                   "q of each position in the target vocabulary (0 outside the draft vocabulary): the "
                   "SampleAccept draft_probs rows"),
    ),
    attributes=MARKOV_DRAFT.attributes,
    doc="MarkovDraft with sampling, for requests with T > 0 (greedy batches use MarkovDraft and move no "
        "[R, N, V] tensor). x_i as in MarkovDraft; q_i = softmax(x_i / T_r), one-hot of the lowest-index "
        "argmax when T_r <= 0 or the row maximum of x_i / T_r is not finite; d_i = the smallest index "
        "with cumsum(q_i) > u[r,i] * sum(q_i), clamped to the last index with q_i > 0; token "
        "t_i = d_i + d2t[d_i]; prev_{i+1} = t_i; draft_probs[r,i,d + d2t[d]] = q_i[d]. With qmax_confidence "
        "= 1, c_i is MarkovDraft's formula with p_i = max softmax(x_i / T'), T' = T_r if T_r > 0 else 1 (1 "
        "when the row maximum of x_i / T' is not finite): max q_i for sampled rows, MarkovDraft's q_max for "
        "T_r <= 0 rows. It is not q_i(d_i): a confidence that depends on the token it scores would make "
        "'verify t_i?' depend on t_i, which speculative sampling cannot allow (runtime/controller.py).",
)

OPS: dict[str, OpSpec] = {op.name: op for op in (SURVIVAL, GREEDY_ACCEPT, SAMPLE_ACCEPT, MARKOV_DRAFT,
                                                 MARKOV_SAMPLE)}

# Node attributes that the TensorRT ONNX parser consumes itself (they are not op attributes):
# plugin_namespace selects the plugin, plugin_version its version, aot (0/1) forces the JIT or AOT
# implementation of a Python plugin for that node (TensorRT >= 10.9).
PARSER_ATTRIBUTES = {"plugin_namespace": "STRING", "plugin_version": "STRING", "aot": "INT"}


TRT_TYPE_NAMES = {"float32": "FP32", "float16": "FP16", "bfloat16": "BF16", "int64": "INT64", "int32": "INT32"}


def plugin_type_combinations(op_name: str) -> list[str]:
    """TensorRT ``AutoTuneCombination`` io_types strings (inputs then outputs, one type per position):
    each floating model input independently float32/float16/bfloat16, the other I/O fixed."""
    import itertools

    op = get_op(op_name)
    io = (*op.inputs, *op.outputs)
    choices = [t.dtypes if t.dtypes == FLOAT_TYPES else t.dtypes[:1] for t in io]
    return [", ".join(TRT_TYPE_NAMES[d] for d in combo) for combo in itertools.product(*choices)]


def get_op(op_name: str) -> OpSpec:
    try:
        return OPS[op_name]
    except KeyError:
        raise KeyError(f"unknown dspark op {op_name!r}; known: {sorted(OPS)}") from None


def make_node(op_name: str, inputs: Sequence[str], outputs: Sequence[str], name: str | None = None,
              **attrs: Any):
    """An ONNX NodeProto for a dspark op: domain ``dspark``, ``plugin_namespace="dspark"`` set.

    ``attrs`` are the op's attributes (validated against the spec; declared defaults fill in missing
    optional ones) plus, optionally, the parser attributes ``aot`` (0/1) and ``plugin_version``.
    """
    import onnx.helper

    op = get_op(op_name)
    n_in = len(op.inputs)
    if len(inputs) != n_in:
        raise ValueError(f"{op_name} takes {n_in} inputs ({', '.join(op.input_names)}), got {len(inputs)}")
    if len(outputs) != len(op.outputs):
        raise ValueError(f"{op_name} has {len(op.outputs)} outputs ({', '.join(op.output_names)}), "
                         f"got {len(outputs)}")
    known = {a.name for a in op.attributes}
    unknown = set(attrs) - known - set(PARSER_ATTRIBUTES)
    if unknown:
        raise ValueError(f"{op_name} has no attribute(s) {sorted(unknown)}; it takes {sorted(known) or 'none'}")
    if attrs.get("plugin_namespace", PLUGIN_NAMESPACE) != PLUGIN_NAMESPACE:
        raise ValueError(f"plugin_namespace must be {PLUGIN_NAMESPACE!r}")
    final: dict[str, Any] = {}
    for a in op.attributes:
        if a.name in attrs:
            final[a.name] = _check_attr(op_name, a, attrs[a.name])
        elif a.required:
            raise ValueError(f"{op_name} needs attribute {a.name!r} ({a.type}): {a.doc}")
        elif a.default is not None:
            final[a.name] = a.default
    for key in ("aot", "plugin_version"):
        if key in attrs:
            final[key] = int(attrs[key]) if key == "aot" else str(attrs[key])
    final["plugin_namespace"] = PLUGIN_NAMESPACE
    return onnx.helper.make_node(op_name, list(inputs), list(outputs), name=name, domain=DOMAIN, **final)


def _check_attr(op_name: str, a: AttrSpec, value: Any) -> Any:
    if a.type == "INT":
        if int(value) != value or int(value) < (1 if a.name == "steps" else 0):
            raise ValueError(f"{op_name}.{a.name} must be an integer >= {1 if a.name == 'steps' else 0}, got {value!r}")
        if a.name == "qmax_confidence" and int(value) > 1:
            raise ValueError(f"{op_name}.qmax_confidence must be 0 or 1, got {value!r}")
        return int(value)
    if a.type == "FLOAT":
        return float(value)
    if a.type == "FLOATS":
        vals = [float(v) for v in value]
        if a.name == "temperatures":
            check_temperatures(vals, where=f"{op_name}.temperatures")
        return vals
    return value


def check_temperatures(temperatures: Sequence[float], where: str = "temperatures") -> list[float]:
    """Survival temperatures: a non-empty list of finite values > 0."""
    vals = [float(t) for t in temperatures]
    if not vals:
        raise ValueError(f"{where} must not be empty")
    bad = [t for t in vals if not (t > 0.0 and t < float("inf"))]
    if bad:
        raise ValueError(f"{where} must be finite and > 0, got {bad}")
    return vals


def output_dims(op_name: str, input_dims: Sequence[Sequence[Any]]) -> list[tuple[Any, ...]]:
    """Shape rule: output dims from input dims, by the symbolic names in the spec.

    Works on anything dims are made of (ints here; ``trtp.ShapeExpr`` in the TensorRT registration).
    Raises ValueError on a rank mismatch.
    """
    op = get_op(op_name)
    if len(input_dims) != len(op.inputs):
        raise ValueError(f"{op_name} takes {len(op.inputs)} inputs, got {len(input_dims)}")
    symbols: dict[str, Any] = {}
    for t, dims in zip(op.inputs, input_dims):
        if len(dims) != len(t.shape):
            raise ValueError(f"{op_name}.{t.name} must have rank {len(t.shape)} {list(t.shape)}, "
                             f"got rank {len(dims)}")
        for sym, d in zip(t.shape, dims):
            symbols.setdefault(sym, d)
    return [tuple(symbols[s] for s in t.shape) for t in op.outputs]


def check_concrete_shapes(op_name: str, shapes: Mapping[str, Sequence[int]]) -> dict[str, int]:
    """Check concrete input shapes (by input name) for consistency; return the symbol sizes.

    For the accept ops this also needs ``M`` to be consistent between inputs; ``M = sum(L_r + 1)``
    depends on values and is checked by the implementations.
    """
    op = get_op(op_name)
    sizes: dict[str, int] = {}
    for t in op.inputs:
        if t.name not in shapes:
            raise ValueError(f"{op_name}: missing input {t.name!r}")
        dims = tuple(int(d) for d in shapes[t.name])
        if len(dims) != len(t.shape):
            raise ValueError(f"{op_name}.{t.name} must have rank {len(t.shape)} {list(t.shape)}, got {list(dims)}")
        for sym, d in zip(t.shape, dims):
            if sizes.setdefault(sym, d) != d:
                raise ValueError(f"{op_name}.{t.name}: dim {sym} is {d}, but another input has {sym}={sizes[sym]}")
    return sizes
