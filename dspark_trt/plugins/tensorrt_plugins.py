"""TensorRT plugins for the dspark ops (Python "quickly deployable plugins", ``tensorrt.plugin``).

``register(impls)`` registers ``dspark::Survival``, ``dspark::GreedyAccept``, ``dspark::SampleAccept``,
``dspark::MarkovDraft`` and ``dspark::MarkovSample``
with the implementations asked for ("aot", "jit"; idempotent, and more can be added later); call it
(``trt_env.load_plugins``) before parsing an ONNX file so the parser maps the dspark nodes
(``plugin_namespace="dspark"``) to these plugins instead of importing their function bodies.

Which implementation TensorRT creates is decided per creation request (``QuickPluginCreationRequest``,
TensorRT 10.9+, ``tensorrt/plugin/_lib.py`` ``_TemplatePluginCreator.create_plugin``): STRICT_AOT/JIT
(node attribute ``aot``) wins; with both implementations registered PREFER_AOT/JIT (network flags)
decides and UNKNOWN raises "has both AOT and JIT implementations"; with one registered, that one is
built for any request but the other STRICT one. What TensorRT's (closed) core passes when it
deserializes an engine with JIT plugins is not in the open sources, so a process that loads JIT engines
registers "jit" only (``TrtBackend``): the creator can then only build the JIT plugin.

API versions used (see /work/shared/notes/tensorrt.md):
* ``trtp.register`` / ``trtp.impl`` / ``trtp.autotune``: TensorRT >= 10.6;
* ``trtp.aot_impl`` (kernel embedded in the engine, no Python at runtime): TensorRT >= 10.9 (required).
  With both implementations registered a network must say which to use: node attribute ``aot`` (1/0,
  see spec.make_node) or network flag ``PREFER_AOT_PYTHON_PLUGINS`` / ``PREFER_JIT_PYTHON_PLUGINS``.
* An engine built with the JIT implementation needs this module imported wherever it is deserialized.

AOT plugin attributes are not serialized, so everything a kernel needs is baked in at build time:
the Survival temperatures are a constexpr tuple of the compiled kernel (as are the Markov ops' logit
scale, top-k and qmax_confidence), block sizes come from the
(static) vocabulary; R, J, M (packed rows) and V are int32 extra arguments from symbolic shapes.

This module is deliberately thin: shape rules (spec.output_dims), I/O type combinations
(spec.plugin_type_combinations), grids and block sizes (launch, used by kernels.compile_ptx and the
kernels' launchers) and kernel compilation (kernels.compile_ptx) are plain functions tested without
TensorRT. Never import this module from CPU
code paths.
"""

# No ``from __future__ import annotations`` here: tensorrt.plugin inspects the annotations of the
# decorated functions as objects.
from dspark_trt.errors import DsparkError


class TensorRTUnavailable(DsparkError, ModuleNotFoundError):
    """TensorRT is missing: a DsparkError (one clear line for the CLI) that is also an ImportError, so
    ``pytest.importorskip`` and ``except ImportError`` treat it as an absent optional dependency."""


try:  # TensorRT is an optional extra; fail with one clear line
    import tensorrt as trt
    import tensorrt.plugin as trtp
except Exception as exc:  # ImportError, or OSError when libnvinfer is missing
    raise TensorRTUnavailable("the dspark TensorRT plugins need TensorRT >= 10.9: install `dspark-trt[trt]` on a "
                      f"machine with an NVIDIA GPU ({type(exc).__name__}: "
                      f"{(str(exc).splitlines() or [''])[0]})") from exc

from typing import List, Tuple, Union  # noqa: E402

import numpy as np  # noqa: E402
import numpy.typing as npt  # noqa: E402

from dspark_trt.plugins import spec  # noqa: E402

if not all(hasattr(trtp, n) for n in ("register", "impl", "autotune", "aot_impl", "KernelLaunchParams")):
    raise TensorRTUnavailable(f"TensorRT {trt.__version__} lacks the Python plugin API dspark-trt uses (AOT "
                              f"plugins: >= 10.9): pip install -U 'dspark-trt[trt]'")
HAS_AOT = True  # checked above (kept for callers of the earlier API)

_FROM_TRT = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16", trt.int64: "int64",
             trt.int32: "int32"}
_TO_TRT = {v: k for k, v in _FROM_TRT.items()}


def _dims(desc) -> list:
    return [desc.shape_expr[i] for i in range(desc.ndim)]


def _outputs(op_name: str, *inputs) -> Tuple:
    op = spec.get_op(op_name)
    shapes = spec.output_dims(op_name, [_dims(d) for d in inputs])
    return tuple(trtp.from_shape_expr(tuple(s), dtype=_TO_TRT[t.dtypes[0]]) for s, t in zip(shapes, op.outputs))


def _autotune(op_name: str) -> List:
    return [trtp.AutoTuneCombination(c) for c in spec.plugin_type_combinations(op_name)]


def _input_dtypes(op_name: str, *inputs) -> dict:
    names = spec.get_op(op_name).input_names
    return {n: _FROM_TRT[d.dtype] for n, d in zip(names, inputs)}


def _static(expr):
    """The value of a constant shape expression, else None.

    ``trtp.ShapeExpr`` (TensorRT 10.6-11.1 ``tensorrt/plugin/_tensor.py``): ``is_fake`` and ``is_constant``
    are properties (``is_constant`` raises RuntimeError on a fake expression); ``constant_value()`` is a
    method that raises RuntimeError on a non-constant one."""
    if isinstance(expr, int):
        return expr
    try:
        if getattr(expr, "is_fake", False) or not expr.is_constant:
            return None
        return int(expr.constant_value())
    except (AttributeError, RuntimeError, ValueError, TypeError):
        return None


def _aot_result(op_name: str, inputs: tuple, grid_expr, scalar_exprs: dict, **compile_args):
    from dspark_trt.plugins import kernels

    ck = kernels.compile_ptx(op_name, input_dtypes=_input_dtypes(op_name, *inputs), **compile_args)
    params = trtp.KernelLaunchParams()
    params.grid_x = grid_expr
    params.block_x = ck.num_warps * 32
    params.shared_mem = ck.shared
    extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(scalar_exprs[s]) for s in ck.scalars])
    return ck.name.encode(), ck.ptx.encode(), params, extra


# trtp.Tensor.__cuda_array_interface__ raises ValueError for BF16, FP8 and INT4 (TensorRT 10.6-11.1,
# tensorrt/plugin/_tensor.py: numpy has no such dtypes). The autotune combinations advertise BF16, so
# those tensors are handed to torch as same-width integers and viewed back: (typestr, torch dtype).
_RAW_VIEWS = {trt.bfloat16: ("<i2", "bfloat16")}


class _RawCuda:
    """A __cuda_array_interface__ (v3) over a trtp.Tensor's buffer, typed as a same-width integer."""

    def __init__(self, tensor, typestr: str):
        itemsize = int(typestr[2:])
        shape = tuple(int(d) for d in tensor.shape)
        strides = tensor.strides
        self.__cuda_array_interface__ = {
            "shape": shape, "typestr": typestr, "data": (int(tensor.data_ptr), False), "version": 3,
            "strides": None if strides is None else tuple(int(s) * itemsize for s in strides)}


def _cuda(*tensors):
    import torch

    out = []
    for t in tensors:
        view = _RAW_VIEWS.get(t.dtype)
        if view is None:
            out.append(torch.as_tensor(t, device="cuda"))
        else:
            out.append(torch.as_tensor(_RawCuda(t, view[0]), device="cuda").view(getattr(torch, view[1])))
    return out


# ------------------------------------------------------------------------------------------ Survival
def survival_desc(logits: trtp.TensorDesc, prev: trtp.TensorDesc, start: trtp.TensorDesc,
                  temperatures: npt.NDArray[np.float32]) -> trtp.TensorDesc:
    return _outputs("Survival", logits, prev, start)[0]


def survival_autotune(logits: trtp.TensorDesc, prev: trtp.TensorDesc, start: trtp.TensorDesc,
                      outputs: Tuple[trtp.TensorDesc]) -> List[trtp.AutoTuneCombination]:
    return _autotune("Survival")


def survival_impl(logits: trtp.Tensor, prev: trtp.Tensor, start: trtp.Tensor,
                  temperatures: npt.NDArray[np.float32], outputs: Tuple[trtp.Tensor], stream: int) -> None:
    import torch

    from dspark_trt.plugins import kernels

    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        lt, pt, st, out = _cuda(logits, prev, start, outputs[0])
        kernels.survival(lt, pt, st, [float(t) for t in temperatures], out=out)


def survival_aot_impl(logits: trtp.TensorDesc, prev: trtp.TensorDesc, start: trtp.TensorDesc,
                      temperatures: npt.NDArray[np.float32], outputs: Tuple[trtp.TensorDesc], tactic: int
                      ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
    r, j = logits.shape_expr[0], logits.shape_expr[1]
    return _aot_result("Survival", (logits, prev, start), r, {"R": r, "J": j},
                       temperatures=[float(t) for t in temperatures])


# ------------------------------------------------------------------------------------- GreedyAccept
def greedy_accept_desc(logits: trtp.TensorDesc, draft_tokens: trtp.TensorDesc, verify_lens: trtp.TensorDesc
                       ) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
    return _outputs("GreedyAccept", logits, draft_tokens, verify_lens)


def greedy_accept_autotune(logits: trtp.TensorDesc, draft_tokens: trtp.TensorDesc, verify_lens: trtp.TensorDesc,
                           outputs: Tuple[trtp.TensorDesc]) -> List[trtp.AutoTuneCombination]:
    return _autotune("GreedyAccept")


def greedy_accept_impl(logits: trtp.Tensor, draft_tokens: trtp.Tensor, verify_lens: trtp.Tensor,
                       outputs: Tuple[trtp.Tensor], stream: int) -> None:
    import torch

    from dspark_trt.plugins import kernels

    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        lt, dt, vt, acc, nxt = _cuda(logits, draft_tokens, verify_lens, *outputs)
        kernels.greedy_accept(lt, dt, vt, out=(acc, nxt), check=False)


def greedy_accept_aot_impl(logits: trtp.TensorDesc, draft_tokens: trtp.TensorDesc,
                           verify_lens: trtp.TensorDesc, outputs: Tuple[trtp.TensorDesc], tactic: int
                           ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams,
                                      trtp.SymExprs]:
    r, m, v = verify_lens.shape_expr[0], logits.shape_expr[0], logits.shape_expr[1]
    return _aot_result("GreedyAccept", (logits, draft_tokens, verify_lens), r, {"R": r, "M": m, "V": v},
                       vocab=_static(v))


# ------------------------------------------------------------------------------------- SampleAccept
def sample_accept_desc(logits: trtp.TensorDesc, draft_probs: trtp.TensorDesc, draft_tokens: trtp.TensorDesc,
                       verify_lens: trtp.TensorDesc, temperature: trtp.TensorDesc,
                       accept_uniforms: trtp.TensorDesc, sample_uniforms: trtp.TensorDesc
                       ) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
    return _outputs("SampleAccept", logits, draft_probs, draft_tokens, verify_lens, temperature,
                    accept_uniforms, sample_uniforms)


def sample_accept_autotune(logits: trtp.TensorDesc, draft_probs: trtp.TensorDesc, draft_tokens: trtp.TensorDesc,
                           verify_lens: trtp.TensorDesc, temperature: trtp.TensorDesc,
                           accept_uniforms: trtp.TensorDesc, sample_uniforms: trtp.TensorDesc,
                           outputs: Tuple[trtp.TensorDesc]) -> List[trtp.AutoTuneCombination]:
    return _autotune("SampleAccept")


def sample_accept_impl(logits: trtp.Tensor, draft_probs: trtp.Tensor, draft_tokens: trtp.Tensor,
                       verify_lens: trtp.Tensor, temperature: trtp.Tensor, accept_uniforms: trtp.Tensor,
                       sample_uniforms: trtp.Tensor, outputs: Tuple[trtp.Tensor], stream: int) -> None:
    import torch

    from dspark_trt.plugins import kernels

    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        ts = _cuda(logits, draft_probs, draft_tokens, verify_lens, temperature, accept_uniforms, sample_uniforms,
                   *outputs)
        kernels.sample_accept(*ts[:7], out=tuple(ts[7:]), check=False)


def sample_accept_aot_impl(logits: trtp.TensorDesc, draft_probs: trtp.TensorDesc,
                           draft_tokens: trtp.TensorDesc, verify_lens: trtp.TensorDesc,
                           temperature: trtp.TensorDesc, accept_uniforms: trtp.TensorDesc,
                           sample_uniforms: trtp.TensorDesc, outputs: Tuple[trtp.TensorDesc], tactic: int
                           ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams,
                                      trtp.SymExprs]:
    r, m, v = verify_lens.shape_expr[0], logits.shape_expr[0], logits.shape_expr[1]
    inputs = (logits, draft_probs, draft_tokens, verify_lens, temperature, accept_uniforms, sample_uniforms)
    return _aot_result("SampleAccept", inputs, r, {"R": r, "M": m, "V": v}, vocab=_static(v))


# -------------------------------------------------------------------------------------- MarkovDraft
def markov_draft_desc(base_logits: trtp.TensorDesc, conf_base: trtp.TensorDesc, anchor: trtp.TensorDesc,
                      markov_w1: trtp.TensorDesc, markov_w2: trtp.TensorDesc, conf_w: trtp.TensorDesc,
                      d2t: trtp.TensorDesc, steps: int, logit_scale: float, draft_topk: int, qmax_confidence: int
                      ) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
    return _outputs("MarkovDraft", base_logits, conf_base, anchor, markov_w1, markov_w2, conf_w, d2t)


def markov_draft_autotune(base_logits: trtp.TensorDesc, conf_base: trtp.TensorDesc, anchor: trtp.TensorDesc,
                          markov_w1: trtp.TensorDesc, markov_w2: trtp.TensorDesc, conf_w: trtp.TensorDesc,
                          d2t: trtp.TensorDesc, outputs: Tuple[trtp.TensorDesc]) -> List[trtp.AutoTuneCombination]:
    return _autotune("MarkovDraft")


def markov_draft_impl(base_logits: trtp.Tensor, conf_base: trtp.Tensor, anchor: trtp.Tensor,
                      markov_w1: trtp.Tensor, markov_w2: trtp.Tensor, conf_w: trtp.Tensor, d2t: trtp.Tensor,
                      steps: int, logit_scale: float, draft_topk: int, qmax_confidence: int,
                      outputs: Tuple[trtp.Tensor], stream: int) -> None:
    import torch

    from dspark_trt.plugins import markov_kernels

    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        ts = _cuda(base_logits, conf_base, anchor, markov_w1, markov_w2, conf_w, d2t, *outputs)
        markov_kernels.markov_draft(*ts[:7], steps=int(steps), logit_scale=float(logit_scale),
                                    draft_topk=int(draft_topk), qmax_confidence=int(qmax_confidence),
                                    out=tuple(ts[7:]))


def markov_draft_aot_impl(base_logits: trtp.TensorDesc, conf_base: trtp.TensorDesc, anchor: trtp.TensorDesc,
                          markov_w1: trtp.TensorDesc, markov_w2: trtp.TensorDesc, conf_w: trtp.TensorDesc,
                          d2t: trtp.TensorDesc, steps: int, logit_scale: float, draft_topk: int,
                          qmax_confidence: int, outputs: Tuple[trtp.TensorDesc], tactic: int
                          ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams,
                                     trtp.SymExprs]:
    r, n, v = (base_logits.shape_expr[i] for i in range(3))
    k = markov_w1.shape_expr[1]
    inputs = (base_logits, conf_base, anchor, markov_w1, markov_w2, conf_w, d2t)
    return _aot_result("MarkovDraft", inputs, r, {"R": r, "N": n, "V": v, "K": k}, vocab=_static(v),
                       rank=_static(k), logit_scale=float(logit_scale), draft_topk=int(draft_topk),
                       qmax_confidence=int(qmax_confidence))


# ------------------------------------------------------------------------------------- MarkovSample
def markov_sample_desc(base_logits: trtp.TensorDesc, conf_base: trtp.TensorDesc, anchor: trtp.TensorDesc,
                       markov_w1: trtp.TensorDesc, markov_w2: trtp.TensorDesc, conf_w: trtp.TensorDesc,
                       d2t: trtp.TensorDesc, temperature: trtp.TensorDesc, uniforms: trtp.TensorDesc, steps: int,
                       logit_scale: float, draft_topk: int, qmax_confidence: int
                       ) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
    return _outputs("MarkovSample", base_logits, conf_base, anchor, markov_w1, markov_w2, conf_w, d2t, temperature,
                    uniforms)


def markov_sample_autotune(base_logits: trtp.TensorDesc, conf_base: trtp.TensorDesc, anchor: trtp.TensorDesc,
                           markov_w1: trtp.TensorDesc, markov_w2: trtp.TensorDesc, conf_w: trtp.TensorDesc,
                           d2t: trtp.TensorDesc, temperature: trtp.TensorDesc, uniforms: trtp.TensorDesc,
                           outputs: Tuple[trtp.TensorDesc]) -> List[trtp.AutoTuneCombination]:
    return _autotune("MarkovSample")


def markov_sample_impl(base_logits: trtp.Tensor, conf_base: trtp.Tensor, anchor: trtp.Tensor,
                       markov_w1: trtp.Tensor, markov_w2: trtp.Tensor, conf_w: trtp.Tensor, d2t: trtp.Tensor,
                       temperature: trtp.Tensor, uniforms: trtp.Tensor, steps: int, logit_scale: float,
                       draft_topk: int, qmax_confidence: int, outputs: Tuple[trtp.Tensor], stream: int) -> None:
    import torch

    from dspark_trt.plugins import markov_kernels

    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        ts = _cuda(base_logits, conf_base, anchor, markov_w1, markov_w2, conf_w, d2t, temperature, uniforms,
                   *outputs)
        markov_kernels.markov_sample(*ts[:9], steps=int(steps), logit_scale=float(logit_scale),
                                     draft_topk=int(draft_topk), qmax_confidence=int(qmax_confidence),
                                     out=tuple(ts[9:]))


def markov_sample_aot_impl(base_logits: trtp.TensorDesc, conf_base: trtp.TensorDesc, anchor: trtp.TensorDesc,
                           markov_w1: trtp.TensorDesc, markov_w2: trtp.TensorDesc, conf_w: trtp.TensorDesc,
                           d2t: trtp.TensorDesc, temperature: trtp.TensorDesc, uniforms: trtp.TensorDesc,
                           steps: int, logit_scale: float, draft_topk: int, qmax_confidence: int,
                           outputs: Tuple[trtp.TensorDesc], tactic: int
                           ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
    r, n, v = (base_logits.shape_expr[i] for i in range(3))
    t, k = markov_w1.shape_expr[0], markov_w1.shape_expr[1]
    inputs = (base_logits, conf_base, anchor, markov_w1, markov_w2, conf_w, d2t, temperature, uniforms)
    return _aot_result("MarkovSample", inputs, r, {"R": r, "N": n, "V": v, "K": k, "T": t}, vocab=_static(v),
                       rank=_static(k), logit_scale=float(logit_scale), draft_topk=int(draft_topk),
                       qmax_confidence=int(qmax_confidence))


# ------------------------------------------------------------------------------------- registration
_FUNCTIONS = {  # plugin id -> (register, autotune, JIT impl, AOT impl)
    "dspark::Survival": (survival_desc, survival_autotune, survival_impl, survival_aot_impl),
    "dspark::GreedyAccept": (greedy_accept_desc, greedy_accept_autotune, greedy_accept_impl,
                             greedy_accept_aot_impl),
    "dspark::SampleAccept": (sample_accept_desc, sample_accept_autotune, sample_accept_impl,
                             sample_accept_aot_impl),
    "dspark::MarkovDraft": (markov_draft_desc, markov_draft_autotune, markov_draft_impl, markov_draft_aot_impl),
    "dspark::MarkovSample": (markov_sample_desc, markov_sample_autotune, markov_sample_impl,
                             markov_sample_aot_impl),
}
REGISTERED = tuple(op.plugin_id for op in spec.OPS.values())
IMPLS = ("aot", "jit")
_registered: set = set()  # "desc", "aot", "jit": what this process has registered with tensorrt.plugin


def register(impls=IMPLS) -> frozenset:
    """Register the dspark plugins (shapes, autotune) once per process, plus each implementation in
    `impls` not registered yet ("aot": kernel embedded in the engine; "jit": Triton called from Python at
    run time). tensorrt.plugin keeps registrations for the life of the process; returns what is registered."""
    wanted = {str(i).lower() for i in impls}
    unknown = wanted - set(IMPLS)
    if unknown:
        raise DsparkError(f"unknown dspark plugin implementation(s) {sorted(unknown)}: choose from {IMPLS}")
    if "desc" not in _registered:
        for pid, (desc, tune, _, _) in _FUNCTIONS.items():
            trtp.register(pid)(desc)
            trtp.autotune(pid)(tune)
        _registered.add("desc")
    for kind in sorted(wanted - _registered):
        for pid, (_, _, jit, aot) in _FUNCTIONS.items():
            (trtp.aot_impl(pid)(aot) if kind == "aot" else trtp.impl(pid)(jit))
        _registered.add(kind)
    return registered_impls()


def registered_impls() -> frozenset:
    return frozenset(_registered & set(IMPLS))


def aot_kernel_facts(compute_capability) -> dict:
    """What an AOT engine's manifest entry records about its embedded kernels."""
    from dspark_trt.plugins import ptx

    return {"aot_kernels": {"compiler": f"triton {triton_version()}",
                            "ptx_isa": ptx.isa_string(ptx.ptx_isa_for(compute_capability))}}


def triton_version() -> str:
    """The installed Triton's version, read without importing it (importing triton fixes, for the whole
    process, whether its kernels are interpreted)."""
    from importlib import metadata

    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return "not installed"
