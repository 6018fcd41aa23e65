"""TensorRT backend: the draft and target engines built by `dspark-trt build`, KV caches on the GPU.

A DSpark artifact's engines (target with `aux_hidden`, block pass, sampling block pass, context graph) load
the same way; the target runs here, the drafter's graphs through `dspark_graphs()` (runtime/dspark_graphs.py)
in its drafter phase, its context cache a DeviceKVCache like the target's.

Written against the TensorRT 10.9+ / 11.x Python API (TensorRT cannot be installed where this was
written; every TensorRT call below is the documented one, and everything that does not need TensorRT is
a plain function with unit tests):
- `trt.Runtime(logger).deserialize_cuda_engine(data)` -> ICudaEngine, or None when the plan does not
  load (other TensorRT version / GPU; the manifest check below refuses those first, with a clear line).
- name-based I/O (10.0+; the binding-index API is gone): `engine.num_io_tensors`,
  `engine.get_tensor_name(i)`, `engine.get_tensor_mode(name)` (`trt.TensorIOMode.INPUT|OUTPUT`),
  `engine.get_tensor_dtype(name)`.
- `engine.create_execution_context()`; per run: `context.set_input_shape(name, dims)` -> bool (False when
  outside the optimisation profile), `context.get_tensor_shape(name)` (output shapes once every input
  shape is set; -1 where still unknown), `context.set_tensor_address(name, ptr)` -> bool,
  `context.execute_async_v3(stream_handle)` -> bool (enqueueV3, 8.5+; asynchronous on the stream).
- Engines built with JIT Python plugins call back into `dspark_trt.plugins.tensorrt_plugins`, which must
  be imported before deserializing (manifest `engines.<graph>.plugin_mode == "jit"`; only its JIT
  implementation is registered, see `plugins_for`); AOT engines carry their kernels and need no Python.
- TensorRT import, logger and GPU facts come from `dspark_trt.trt_env` (shared with the builder).

Device memory is PyTorch's (see device_kv.py for why): the runtime gets `make_kv_cache` -> DeviceKVCache,
whose `past()` views are bound to the engines by address with no copy, and whose `write()` scatters the
present outputs (one [2L, N, KVH, D] device buffer) in one kernel. Per run, the small host inputs
(tokens, positions, pack_index, ...) are copied to reusable device buffers, and only the non-KV outputs
(accepted, next_token, draft_token, draft_probs, survival, ...) come back to host numpy. Everything runs
on one CUDA stream shared by both engines and both caches, so ordering needs no extra synchronisation;
the one host sync per run is the copy of those small outputs. So `pip install 'dspark-trt[trt]'` needs a
CUDA build of torch next to it (the `export` extra).
"""

from __future__ import annotations

from collections import Counter
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from dspark_trt.errors import DsparkError
from dspark_trt.manifest_schema import GREEDY_DRAFT_GRAPH, engine_graphs
from dspark_trt.runtime.backends.device_kv import ALIGN_BYTES, PresentList, aligned_elems, torch_dtype
from dspark_trt.runtime.backends.trt_io import (GraphIO, _data, check_engine_io, graph_layers, graph_specs,
                                                 kv_dtype_for, kv_roles, output_shapes, pick_output_shape,
                                                 profile_problems, profile_ranges, resolve_dims, select_engines,
                                                 split_io, trt_dtype_name)
from dspark_trt.runtime.batch import ZeroRows


class _Scratch:
    """Grow-only buffers by name (device, or pinned host for output copies); views are 256-byte aligned."""

    def __init__(self, torch, device, pinned: bool = False):
        self.torch, self.device, self.pinned = torch, device, pinned
        self._bufs: dict[str, Any] = {}

    def get(self, name: str, shape: tuple, dtype):
        n = max(1, int(np.prod(shape)))
        buf = self._bufs.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < n:
            cap = max(n, 2 * buf.numel() if buf is not None and buf.dtype == dtype else n)
            buf = self.torch.empty(cap, dtype=dtype, device=self.device, pin_memory=self.pinned)
            self._bufs[name] = buf
        return buf[:int(np.prod(shape))].view(shape)


class _PresentBuffer:
    """All present outputs of a run in one allocation: [2L, N, KVH, D] with every layer's slice aligned."""

    def __init__(self, torch, device, n_tensors: int, row_shape: tuple, dtype):
        self.torch, self.device, self.n, self.row_shape, self.dtype = torch, device, n_tensors, tuple(row_shape), dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self._flat, self._cap, self._stride = None, 0, 0

    def get(self, n_tokens: int):
        row = int(np.prod(self.row_shape))
        if n_tokens > self._cap:
            self._cap = max(n_tokens, 2 * self._cap)
            self._stride = aligned_elems(self._cap * row, self.itemsize)
            self._flat = self.torch.empty(self.n * self._stride, dtype=self.dtype, device=self.device)
        inner = []  # contiguous strides of one [KVH, D] row
        acc = 1
        for size in reversed(self.row_shape):
            inner.insert(0, acc)
            acc *= size
        return self._flat.as_strided((self.n, n_tokens, *self.row_shape), (self._stride, row, *inner))


def _is_aligned(ptr: int, device, itemsize: int) -> bool:
    """Addresses bound to TensorRT keep cudaMalloc's 256-byte alignment (CPU stand-ins: the item size)."""
    return ptr % (ALIGN_BYTES if device.type == "cuda" else itemsize) == 0


class GraphRunner:
    """Binds one engine's execution context and runs it on host feeds + device KV (see module docstring).

    `context` needs only the four TensorRT calls named above, so the binding logic is exercised on CPU
    tensors in the tests with a stand-in context; on a GPU it is TensorRT's IExecutionContext.
    """

    def __init__(self, graph: str, context, io: GraphIO, engine_inputs: set[str] | None, profile: Mapping,
                 torch, device, stream=None, where: str = "ARTIFACT_DIR"):
        self.graph, self.context, self.io, self.profile, self.where = graph, context, io, profile, where
        self.torch, self.device, self.stream = torch, torch.device(device), stream
        self.bound_inputs = {s.name for s in io.inputs} if engine_inputs is None else set(engine_inputs)
        self.tdtype = {s.name: torch_dtype(torch, s.dtype) for s in io.inputs + io.all_outputs}
        self.ndtype = {s.name: np.dtype(s.dtype) for s in io.feeds if s.dtype != "bfloat16"}
        self.scratch = _Scratch(torch, self.device)
        self.host = _Scratch(torch, "cpu", pinned=self.device.type == "cuda")
        rows = {s.shape[1:] for s in io.present}
        if io.present and (len(rows) != 1 or not all(isinstance(d, int) for d in next(iter(rows)))):
            raise DsparkError(f"the {graph} graph's present KV outputs must all be [num_tokens, KVH, D] with static "
                              f"KVH and D: re-export the artifact")
        # None for a graph without present KV (a DSpark drafter's block pass and context graph)
        self.present_buf = (_PresentBuffer(torch, self.device, len(io.present), next(iter(rows)),
                                           self.tdtype[io.present[0].name]) if io.present else None)
        self.stream_handle = int(stream.cuda_stream) if stream is not None and self.device.type == "cuda" else 0

    def _on_stream(self):
        if self.stream is not None and self.device.type == "cuda":
            return self.torch.cuda.stream(self.stream)
        return nullcontext()

    def _device_past(self, name: str, p):
        torch = self.torch
        if (isinstance(p, torch.Tensor) and p.device == self.device and p.dtype == self.tdtype[name]
                and p.is_contiguous() and _is_aligned(p.data_ptr(), self.device, p.element_size())):
            return p  # a device cache view: bound as is
        src = p if isinstance(p, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(p))
        dst = self.scratch.get(name, tuple(src.shape), self.tdtype[name])
        dst.copy_(src, non_blocking=True)
        return dst

    def run(self, feeds: Mapping[str, np.ndarray], past: list) -> tuple[dict[str, np.ndarray], PresentList]:
        torch, io, ctx, g = self.torch, self.io, self.context, self.graph
        missing = [s.name for s in io.feeds if s.name in self.bound_inputs and s.name not in feeds]
        if missing:
            raise ValueError(f"{g} step is missing input {missing[0]!r}")
        if len(past) != len(io.past):
            raise ValueError(f"{g} step got {len(past)} past KV tensors; the graph has {len(io.past)}")
        shapes = {s.name: tuple(np.shape(feeds[s.name])) for s in io.feeds if s.name in feeds}
        shapes.update({s.name: tuple(p.shape) for s, p in zip(io.past, past)})
        dims = resolve_dims(io.inputs, shapes, g)
        bound_shapes = {n: sh for n, sh in shapes.items() if n in self.bound_inputs}
        problems = profile_problems(bound_shapes, self.profile, g)
        if problems:
            raise DsparkError(f"{problems[0]}: the step exceeds the limits the engines were built for "
                              f"(rebuild with `dspark-trt build {self.where}` after re-exporting with larger limits)")
        expected = output_shapes(io.all_outputs, dims)

        tensors = {}
        with self._on_stream():
            for s in io.feeds:
                if s.name not in self.bound_inputs:
                    continue
                if isinstance(feeds[s.name], ZeroRows):  # known zeros: a device memset, no host copy
                    dev = self.scratch.get(s.name, shapes[s.name], self.tdtype[s.name])
                    tensors[s.name] = dev.zero_()
                    continue
                host = np.asarray(feeds[s.name])
                want = self.ndtype.get(s.name)
                if want is not None and host.dtype != want:
                    host = host.astype(want)
                if not host.flags.c_contiguous or not host.flags.writeable:
                    host = np.array(host, order="C", copy=True)
                dev = self.scratch.get(s.name, shapes[s.name], self.tdtype[s.name])
                dev.copy_(torch.from_numpy(host), non_blocking=True)
                tensors[s.name] = dev
            for s, p in zip(io.past, past):
                if s.name in self.bound_inputs:
                    tensors[s.name] = self._device_past(s.name, p)
            for name in [s.name for s in io.inputs if s.name in self.bound_inputs]:
                if not ctx.set_input_shape(name, tuple(tensors[name].shape)):
                    raise DsparkError(f"TensorRT refused shape {list(tensors[name].shape)} for the {g} engine's input "
                                      f"{name!r}: rebuild with `dspark-trt build {self.where}`")

            out_shapes = {s.name: pick_output_shape(g, s.name, expected[s.name], ctx.get_tensor_shape(s.name),
                                                    self.where) for s in io.all_outputs}
            n_tokens = {out_shapes[s.name][0] for s in io.present}
            if len(n_tokens) > 1:
                raise DsparkError(f"the {g} engine's present KV outputs disagree on the token count: rebuild with "
                                  f"`dspark-trt build {self.where}`")
            stacked = self.present_buf.get(n_tokens.pop()) if io.present else None
            present = [stacked[i] for i in range(len(io.present))]
            for s, t in zip(io.present, present):
                if tuple(t.shape) != out_shapes[s.name]:
                    raise DsparkError(f"the {g} engine sizes {s.name!r} as {list(out_shapes[s.name])}, not "
                                      f"{list(t.shape)}: rebuild with `dspark-trt build {self.where}`")
                tensors[s.name] = t
            for s in io.outputs:
                tensors[s.name] = self.scratch.get(s.name, out_shapes[s.name], self.tdtype[s.name])

            for name, t in tensors.items():
                if not ctx.set_tensor_address(name, int(t.data_ptr())):
                    raise DsparkError(f"TensorRT refused the address of the {g} engine's tensor {name!r}")
            if not ctx.execute_async_v3(self.stream_handle):
                raise DsparkError(f"TensorRT failed to run the {g} engine (see the TensorRT log above; "
                                  f"DSPARK_TRT_VERBOSE=1 for more)")

            # Only the small outputs come back; one sync for all of them.
            staged = {}
            for s in io.outputs:
                dev = tensors[s.name]
                if dev.dtype == torch.bfloat16:
                    dev = dev.float()
                if self.device.type == "cuda":
                    host = self.host.get(s.name, tuple(dev.shape), dev.dtype)
                    host.copy_(dev, non_blocking=True)
                    staged[s.name] = host
                else:
                    staged[s.name] = dev
            if self.device.type == "cuda":
                (self.stream or torch.cuda.current_stream(self.device)).synchronize()
        named = {name: t.numpy().copy() for name, t in staged.items()}  # fresh arrays: buffers are reused
        return named, PresentList(present, stacked)


# ============================================================================ the backend


def import_torch_cuda(device: int = 0):
    """torch with a usable CUDA device, or a one-line DsparkError."""
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        raise DsparkError("the trt backend keeps its buffers and KV caches on the GPU with PyTorch, which is not "
                          "installed: pip install 'dspark-trt[trt,export]' (a CUDA build of torch)") from None
    if not torch.cuda.is_available():
        raise DsparkError(f"the trt backend needs CUDA in PyTorch, and torch {torch.__version__} sees no GPU: install "
                          f"a CUDA build of torch (https://pytorch.org) on a machine with an NVIDIA GPU")
    if device >= torch.cuda.device_count():
        raise DsparkError(f"CUDA device {device} does not exist (torch sees {torch.cuda.device_count()})")
    return torch


def plugins_for(selected: Mapping[str, tuple[Path, Mapping]], where: str):
    """The plugin module, registered for the engines about to be deserialized (None when none needs it).

    JIT-plugin engines call back into it. Only its JIT implementation is registered: TensorRT's creator
    then builds the JIT plugin for any creation request the runtime passes at deserialization (the open
    sources do not say which; with both registered an UNKNOWN request would fail)."""
    from dspark_trt import trt_env
    from dspark_trt.runtime.engine_check import needs_plugin_module

    if not any(needs_plugin_module(entry) for _, entry in selected.values()):
        return None
    return trt_env.load_plugins(("jit",), purpose=f"rebuild with `dspark-trt build {where}` (AOT plugins need "
                                                  f"no Python)")


def deserialize_failure(graph: str, path, where: str, errors, plugin_impls) -> str:
    """The one line for an engine TensorRT would not deserialize."""
    first = f": {errors[0]}" if errors else " (see the TensorRT log above)"
    if "aot" in plugin_impls and "jit" in plugin_impls:
        return (f"TensorRT could not load the {graph} engine {path}{first}; this process also registered the AOT "
                f"dspark plugins, so the JIT plugins may have been refused: load JIT engines in a fresh process, "
                f"or rebuild with `dspark-trt build {where}` (AOT)")
    return f"TensorRT could not load the {graph} engine {path}{first}: rebuild with `dspark-trt build {where}`"


def engine_io(trt, engine) -> list[tuple[str, bool, str]]:
    """(name, is_input, dtype name) of every I/O tensor of a deserialized engine (TensorRT 10+ API)."""
    out = []
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
        out.append((name, is_input, trt_dtype_name(engine.get_tensor_dtype(name))))
    return out


class TrtBackend:
    name = "trt"

    def __init__(self, artifact_dir, manifest, device: int = 0):
        from dspark_trt import trt_env

        where = str(artifact_dir)
        trt = trt_env.import_tensorrt(trt_env.backend_not_installed(where))
        gpu = trt_env.detect_gpu(device)
        if gpu is None:
            raise DsparkError(trt_env.BACKEND_NEEDS_GPU)
        selected = select_engines(manifest, artifact_dir, trt_env.tensorrt_version(trt), gpu.compute_capability)
        torch = import_torch_cuda(device)
        plugins = plugins_for(selected, where)
        dev = torch.device("cuda", device)
        torch.cuda.set_device(dev)  # TensorRT then uses the same (primary) CUDA context as torch
        self._logger = trt_env.make_logger(trt)
        self._trt_runtime = trt.Runtime(self._logger)
        self._engines = {}
        contexts = {}
        for g, (path, _entry) in selected.items():
            engine = self._trt_runtime.deserialize_cuda_engine(path.read_bytes())
            if engine is None:
                raise DsparkError(deserialize_failure(g, path, where, self._logger.errors,
                                                      plugins.registered_impls() if plugins else ()))
            context = engine.create_execution_context()
            if context is None:
                raise DsparkError(f"TensorRT could not create an execution context for the {g} engine (out of GPU "
                                  f"memory?)")
            self._engines[g] = engine
            contexts[g] = (context, engine_io(trt, engine))
        self._setup(artifact_dir, manifest, contexts, torch, dev, torch.cuda.Stream(device=dev))

    @classmethod
    def from_contexts(cls, artifact_dir, manifest, contexts: Mapping[str, tuple[Any, list | None]], torch,
                      device="cpu", stream=None) -> "TrtBackend":
        """A backend over given execution contexts ({graph: (context, engine_io or None)}): what __init__
        builds from TensorRT engines, and what the tests build from stand-ins on CPU tensors."""
        self = cls.__new__(cls)
        self._engines = {}
        self._setup(artifact_dir, manifest, contexts, torch, torch.device(device), stream)
        return self

    def _setup(self, artifact_dir, manifest, contexts, torch, device, stream) -> None:
        where = str(artifact_dir)
        self.artifact_dir, self.manifest, self.torch = artifact_dir, manifest, torch
        self.device, self.stream = device, stream
        required, optional = engine_graphs(_data(manifest))
        graphs = [g for g in (*required, *optional) if g in contexts]
        self.num_layers = {g: graph_layers(manifest, g) for g in graphs}
        self.runners = {}
        self.calls = Counter()  # runs per graph
        for g in graphs:
            ins, outs = graph_specs(manifest, g)
            io = split_io(ins, outs, self.num_layers[g], g, kv_roles(manifest, g))
            context, eio = contexts[g]
            bound = check_engine_io(g, io, eio, where) if eio is not None else None
            self.runners[g] = GraphRunner(g, context, io, bound, profile_ranges(manifest, g), torch, device, stream,
                                          where)

    def make_kv_cache(self, num_layers: int, max_context: int, slots: int, kv_heads: int, head_dim: int, dtype=None):
        """A device KV cache in the dtype the engines read (the runtime's dtype is its host stand-in:
        bf16 models get float32 on the host, bfloat16 here)."""
        from dspark_trt.runtime.backends.device_kv import DeviceKVCache

        kv = kv_dtype_for(self.manifest, num_layers, slots, kv_heads, head_dim) or dtype or "float32"
        return DeviceKVCache(num_layers, max_context, slots, kv_heads, head_dim, kv, device=self.device,
                             stream=self.stream, torch=self.torch)

    @property
    def has_greedy_draft(self) -> bool:
        return GREEDY_DRAFT_GRAPH in self.runners

    def run_graph(self, graph: str, feeds, past):
        self.calls[graph] += 1
        return self.runners[graph].run(feeds, past)

    def run_draft(self, feeds, past):
        return self.run_graph("draft", feeds, past)

    def run_draft_greedy(self, feeds, past):
        return self.run_graph(GREEDY_DRAFT_GRAPH, feeds, past)

    def run_target(self, feeds, past):
        return self.run_graph("target", feeds, past)

    def dspark_graphs(self):
        """A DSpark drafter's graphs on these engines (runtime/dspark_graphs.py), for its drafter phase."""
        from dspark_trt.runtime.dspark_graphs import TrtDsparkGraphs

        return TrtDsparkGraphs(self)
