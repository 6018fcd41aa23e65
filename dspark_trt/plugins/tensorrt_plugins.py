"""TensorRT plugins for the dspark ops (Python "quickly deployable plugins", ``tensorrt.plugin``).

Importing this module registers ``dspark::Survival``, ``dspark::GreedyAccept``,
``dspark::SampleAccept``, ``dspark::MarkovDraft`` and ``dspark::MarkovSample``; import it before parsing an ONNX file so the parser maps the dspark nodes
(``plugin_namespace="dspark"``) to these plugins instead of importing their function bodies.

API versions used (see /work/shared/notes/tensorrt.md):
* ``trtp.register`` / ``trtp.impl`` / ``trtp.autotune``: TensorRT >= 10.6;
* ``trtp.aot_impl`` (kernel embedded in the engine, no Python at runtime): TensorRT >= 10.9. Both
  implementations are registered, so a network must say which to use: node attribute ``aot`` (1/0,
  see spec.make_node) or network flag ``PREFER_AOT_PYTHON_PLUGINS`` / ``PREFER_JIT_PYTHON_PLUGINS``.
* An engine built with the JIT implementation needs this module imported wherever it is deserialized.

AOT plugin attributes are not serialized, so everything a kernel needs is baked in at build time:
the Survival temperatures are a constexpr tuple of the compiled kernel, block sizes come from the
(static) vocabulary; R, J and V are int32 extra arguments from symbolic shapes.

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

if not hasattr(trtp, "register") or not hasattr(trtp, "impl"):
    raise TensorRTUnavailable(f"TensorRT {trt.__version__} has no Python plugin API (needs >= 10.6, AOT >= 10.9): "
                      "install `dspark-trt[trt]` with a newer TensorRT")
HAS_AOT = hasattr(trtp, "aot_impl")

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
    """The value of a constant shape expression, else None."""
    if isinstance(expr, int):
        return expr
    try:
        return int(expr.constant_value) if expr.is_constant else None
    except (AttributeError, ValueError, TypeError):
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


def _cuda(*tensors):
    import torch

    return [torch.as_tensor(t, device="cuda") for t in tensors]


# ------------------------------------------------------------------------------------------ Survival
@trtp.register("dspark::Survival")
def survival_desc(logits: trtp.TensorDesc, prev: trtp.TensorDesc, start: trtp.TensorDesc,
                  temperatures: npt.NDArray[np.float32]) -> trtp.TensorDesc:
    return _outputs("Survival", logits, prev, start)[0]


@trtp.autotune("dspark::Survival")
def survival_autotune(logits: trtp.TensorDesc, prev: trtp.TensorDesc, start: trtp.TensorDesc,
                      outputs: Tuple[trtp.TensorDesc]) -> List[trtp.AutoTuneCombination]:
    return _autotune("Survival")


@trtp.impl("dspark::Survival")
def survival_impl(logits: trtp.Tensor, prev: trtp.Tensor, start: trtp.Tensor,
                  temperatures: npt.NDArray[np.float32], outputs: Tuple[trtp.Tensor], stream: int) -> None:
    import torch

    from dspark_trt.plugins import kernels

    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        lt, pt, st, out = _cuda(logits, prev, start, outputs[0])
        kernels.survival(lt, pt, st, [float(t) for t in temperatures], out=out)


if HAS_AOT:
    @trtp.aot_impl("dspark::Survival")
    def survival_aot_impl(logits: trtp.TensorDesc, prev: trtp.TensorDesc, start: trtp.TensorDesc,
                          temperatures: npt.NDArray[np.float32], outputs: Tuple[trtp.TensorDesc], tactic: int
                          ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        r, j = logits.shape_expr[0], logits.shape_expr[1]
        return _aot_result("Survival", (logits, prev, start), r, {"R": r, "J": j},
                           temperatures=[float(t) for t in temperatures])


# ------------------------------------------------------------------------------------- GreedyAccept
@trtp.register("dspark::GreedyAccept")
def greedy_accept_desc(logits: trtp.TensorDesc, draft_tokens: trtp.TensorDesc, verify_lens: trtp.TensorDesc
                       ) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
    return _outputs("GreedyAccept", logits, draft_tokens, verify_lens)


@trtp.autotune("dspark::GreedyAccept")
def greedy_accept_autotune(logits: trtp.TensorDesc, draft_tokens: trtp.TensorDesc, verify_lens: trtp.TensorDesc,
                           outputs: Tuple[trtp.TensorDesc]) -> List[trtp.AutoTuneCombination]:
    return _autotune("GreedyAccept")


@trtp.impl("dspark::GreedyAccept")
def greedy_accept_impl(logits: trtp.Tensor, draft_tokens: trtp.Tensor, verify_lens: trtp.Tensor,
                       outputs: Tuple[trtp.Tensor], stream: int) -> None:
    import torch

    from dspark_trt.plugins import kernels

    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        lt, dt, vt, acc, nxt = _cuda(logits, draft_tokens, verify_lens, *outputs)
        kernels.greedy_accept(lt, dt, vt, out=(acc, nxt), check=False)


if HAS_AOT:
    @trtp.aot_impl("dspark::GreedyAccept")
    def greedy_accept_aot_impl(logits: trtp.TensorDesc, draft_tokens: trtp.TensorDesc,
                               verify_lens: trtp.TensorDesc, outputs: Tuple[trtp.TensorDesc], tactic: int
                               ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams,
                                          trtp.SymExprs]:
        r, v = verify_lens.shape_expr[0], logits.shape_expr[1]
        return _aot_result("GreedyAccept", (logits, draft_tokens, verify_lens), r, {"R": r, "V": v},
                           vocab=_static(v))


# ------------------------------------------------------------------------------------- SampleAccept
@trtp.register("dspark::SampleAccept")
def sample_accept_desc(logits: trtp.TensorDesc, draft_probs: trtp.TensorDesc, draft_tokens: trtp.TensorDesc,
                       verify_lens: trtp.TensorDesc, temperature: trtp.TensorDesc,
                       accept_uniforms: trtp.TensorDesc, sample_uniforms: trtp.TensorDesc
                       ) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
    return _outputs("SampleAccept", logits, draft_probs, draft_tokens, verify_lens, temperature,
                    accept_uniforms, sample_uniforms)


@trtp.autotune("dspark::SampleAccept")
def sample_accept_autotune(logits: trtp.TensorDesc, draft_probs: trtp.TensorDesc, draft_tokens: trtp.TensorDesc,
                           verify_lens: trtp.TensorDesc, temperature: trtp.TensorDesc,
                           accept_uniforms: trtp.TensorDesc, sample_uniforms: trtp.TensorDesc,
                           outputs: Tuple[trtp.TensorDesc]) -> List[trtp.AutoTuneCombination]:
    return _autotune("SampleAccept")


@trtp.impl("dspark::SampleAccept")
def sample_accept_impl(logits: trtp.Tensor, draft_probs: trtp.Tensor, draft_tokens: trtp.Tensor,
                       verify_lens: trtp.Tensor, temperature: trtp.Tensor, accept_uniforms: trtp.Tensor,
                       sample_uniforms: trtp.Tensor, outputs: Tuple[trtp.Tensor], stream: int) -> None:
    import torch

    from dspark_trt.plugins import kernels

    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        ts = _cuda(logits, draft_probs, draft_tokens, verify_lens, temperature, accept_uniforms, sample_uniforms,
                   *outputs)
        kernels.sample_accept(*ts[:7], out=tuple(ts[7:]), check=False)


if HAS_AOT:
    @trtp.aot_impl("dspark::SampleAccept")
    def sample_accept_aot_impl(logits: trtp.TensorDesc, draft_probs: trtp.TensorDesc,
                               draft_tokens: trtp.TensorDesc, verify_lens: trtp.TensorDesc,
                               temperature: trtp.TensorDesc, accept_uniforms: trtp.TensorDesc,
                               sample_uniforms: trtp.TensorDesc, outputs: Tuple[trtp.TensorDesc], tactic: int
                               ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams,
                                          trtp.SymExprs]:
        r, v = verify_lens.shape_expr[0], logits.shape_expr[1]
        inputs = (logits, draft_probs, draft_tokens, verify_lens, temperature, accept_uniforms, sample_uniforms)
        return _aot_result("SampleAccept", inputs, r, {"R": r, "V": v}, vocab=_static(v))


# -------------------------------------------------------------------------------------- MarkovDraft
@trtp.register("dspark::MarkovDraft")
def markov_draft_desc(base_logits: trtp.TensorDesc, conf_base: trtp.TensorDesc, anchor: trtp.TensorDesc,
                      markov_w1: trtp.TensorDesc, markov_w2: trtp.TensorDesc, conf_w: trtp.TensorDesc,
                      d2t: trtp.TensorDesc, steps: int, logit_scale: float, draft_topk: int
                      ) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
    return _outputs("MarkovDraft", base_logits, conf_base, anchor, markov_w1, markov_w2, conf_w, d2t)


@trtp.autotune("dspark::MarkovDraft")
def markov_draft_autotune(base_logits: trtp.TensorDesc, conf_base: trtp.TensorDesc, anchor: trtp.TensorDesc,
                          markov_w1: trtp.TensorDesc, markov_w2: trtp.TensorDesc, conf_w: trtp.TensorDesc,
                          d2t: trtp.TensorDesc, outputs: Tuple[trtp.TensorDesc]) -> List[trtp.AutoTuneCombination]:
    return _autotune("MarkovDraft")


@trtp.impl("dspark::MarkovDraft")
def markov_draft_impl(base_logits: trtp.Tensor, conf_base: trtp.Tensor, anchor: trtp.Tensor,
                      markov_w1: trtp.Tensor, markov_w2: trtp.Tensor, conf_w: trtp.Tensor, d2t: trtp.Tensor,
                      steps: int, logit_scale: float, draft_topk: int, outputs: Tuple[trtp.Tensor],
                      stream: int) -> None:
    import torch

    from dspark_trt.plugins import markov_kernels

    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        ts = _cuda(base_logits, conf_base, anchor, markov_w1, markov_w2, conf_w, d2t, *outputs)
        markov_kernels.markov_draft(*ts[:7], steps=int(steps), logit_scale=float(logit_scale),
                                    draft_topk=int(draft_topk), out=tuple(ts[7:]))


if HAS_AOT:
    @trtp.aot_impl("dspark::MarkovDraft")
    def markov_draft_aot_impl(base_logits: trtp.TensorDesc, conf_base: trtp.TensorDesc, anchor: trtp.TensorDesc,
                              markov_w1: trtp.TensorDesc, markov_w2: trtp.TensorDesc, conf_w: trtp.TensorDesc,
                              d2t: trtp.TensorDesc, steps: int, logit_scale: float, draft_topk: int,
                              outputs: Tuple[trtp.TensorDesc], tactic: int
                              ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams,
                                         trtp.SymExprs]:
        r, n, v = (base_logits.shape_expr[i] for i in range(3))
        k = markov_w1.shape_expr[1]
        inputs = (base_logits, conf_base, anchor, markov_w1, markov_w2, conf_w, d2t)
        return _aot_result("MarkovDraft", inputs, r, {"R": r, "N": n, "V": v, "K": k}, vocab=_static(v),
                           rank=_static(k), logit_scale=float(logit_scale), draft_topk=int(draft_topk))


# ------------------------------------------------------------------------------------- MarkovSample
@trtp.register("dspark::MarkovSample")
def markov_sample_desc(base_logits: trtp.TensorDesc, conf_base: trtp.TensorDesc, anchor: trtp.TensorDesc,
                       markov_w1: trtp.TensorDesc, markov_w2: trtp.TensorDesc, conf_w: trtp.TensorDesc,
                       d2t: trtp.TensorDesc, temperature: trtp.TensorDesc, uniforms: trtp.TensorDesc, steps: int,
                       logit_scale: float, draft_topk: int
                       ) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
    return _outputs("MarkovSample", base_logits, conf_base, anchor, markov_w1, markov_w2, conf_w, d2t, temperature,
                    uniforms)


@trtp.autotune("dspark::MarkovSample")
def markov_sample_autotune(base_logits: trtp.TensorDesc, conf_base: trtp.TensorDesc, anchor: trtp.TensorDesc,
                           markov_w1: trtp.TensorDesc, markov_w2: trtp.TensorDesc, conf_w: trtp.TensorDesc,
                           d2t: trtp.TensorDesc, temperature: trtp.TensorDesc, uniforms: trtp.TensorDesc,
                           outputs: Tuple[trtp.TensorDesc]) -> List[trtp.AutoTuneCombination]:
    return _autotune("MarkovSample")


@trtp.impl("dspark::MarkovSample")
def markov_sample_impl(base_logits: trtp.Tensor, conf_base: trtp.Tensor, anchor: trtp.Tensor,
                       markov_w1: trtp.Tensor, markov_w2: trtp.Tensor, conf_w: trtp.Tensor, d2t: trtp.Tensor,
                       temperature: trtp.Tensor, uniforms: trtp.Tensor, steps: int, logit_scale: float,
                       draft_topk: int, outputs: Tuple[trtp.Tensor], stream: int) -> None:
    import torch

    from dspark_trt.plugins import markov_kernels

    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        ts = _cuda(base_logits, conf_base, anchor, markov_w1, markov_w2, conf_w, d2t, temperature, uniforms,
                   *outputs)
        markov_kernels.markov_sample(*ts[:9], steps=int(steps), logit_scale=float(logit_scale),
                                     draft_topk=int(draft_topk), out=tuple(ts[9:]))


if HAS_AOT:
    @trtp.aot_impl("dspark::MarkovSample")
    def markov_sample_aot_impl(base_logits: trtp.TensorDesc, conf_base: trtp.TensorDesc, anchor: trtp.TensorDesc,
                               markov_w1: trtp.TensorDesc, markov_w2: trtp.TensorDesc, conf_w: trtp.TensorDesc,
                               d2t: trtp.TensorDesc, temperature: trtp.TensorDesc, uniforms: trtp.TensorDesc,
                               steps: int, logit_scale: float, draft_topk: int, outputs: Tuple[trtp.TensorDesc],
                               tactic: int) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams,
                                                     trtp.SymExprs]:
        r, n, v = (base_logits.shape_expr[i] for i in range(3))
        t, k = markov_w1.shape_expr[0], markov_w1.shape_expr[1]
        inputs = (base_logits, conf_base, anchor, markov_w1, markov_w2, conf_w, d2t, temperature, uniforms)
        return _aot_result("MarkovSample", inputs, r, {"R": r, "N": n, "V": v, "K": k, "T": t}, vocab=_static(v),
                           rank=_static(k), logit_scale=float(logit_scale), draft_topk=int(draft_topk))


REGISTERED = tuple(op.plugin_id for op in spec.OPS.values())
