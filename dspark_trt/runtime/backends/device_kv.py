"""KV caches that stay in device memory, for the TensorRT backend.

Same contract as `runtime.kv_cache.KVCache` (the host numpy cache):
- `past(length)` -> interleaved [k0, v0, k1, v1, ...], each a view [P, slots, KVH, D] of the first
  P = max(1, length) positions, with no copy;
- `write(present, positions, slots)` puts the new entries (each [N, KVH, D]) at (position, slot).

Device memory is PyTorch's (CUDA tensors; the same code runs on CPU tensors, which is how it is tested
where there is no GPU). Why torch rather than cuda-python: `write` is one scatter kernel for all layers
(`index_put_` through a strided view), the caching allocator and streams come for free, and the backend
binds the tensors to TensorRT by address (`tensor.data_ptr()`). torch is imported lazily: the host-only
runtime never imports this module's dependencies.

Layout: one flat allocation holding 2 * num_layers blocks [max_context, slots, KVH, D] (k0, v0, k1, ...),
each block starting on a 256-byte boundary (TensorRT reads bound addresses with cudaMalloc's alignment).
Position-major, so `block[:P]` is contiguous and can be bound directly as an engine input.
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np

from dspark_trt.errors import DsparkError
from dspark_trt.manifest_schema import MODEL_DTYPE_TO_ONNX

ALIGN_BYTES = 256

# manifest / numpy dtype names -> torch dtype attribute names
_TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "int64": "int64",
                 "int32": "int32", "bool": "bool", "uint8": "uint8", "int8": "int8", **MODEL_DTYPE_TO_ONNX}


def aligned_elems(n: int, itemsize: int, align: int = ALIGN_BYTES) -> int:
    """Smallest element count >= n whose byte size is a multiple of `align`."""
    if align % itemsize:
        raise ValueError(f"alignment {align} is not a multiple of the item size {itemsize}")
    step = align // itemsize
    return -(-int(n) // step) * step


def torch_dtype(torch, dtype):
    """A torch dtype from a torch dtype, numpy dtype, or name ("float16", "bf16", ...)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        name = dtype
    else:
        name = np.dtype(dtype).name
    attr = _TORCH_DTYPES.get(name)
    if attr is None:
        raise DsparkError(f"dtype {name!r} has no device representation here (use float32, float16 or bfloat16)")
    return getattr(torch, attr)


class PresentList(list):
    """The present KV entries of one engine run: a list of [N, KVH, D] views (k0, v0, k1, ...) that are
    slices of one [2L, N, KVH, D] strided tensor `stacked`, so a device cache writes them in one scatter."""

    def __init__(self, views, stacked=None):
        super().__init__(views)
        self.stacked = stacked


class DeviceKVCache:
    def __init__(self, num_layers: int, max_context: int, slots: int, kv_heads: int, head_dim: int,
                 dtype="float32", *, device="cuda", stream=None, torch=None):
        if torch is None:
            import torch  # noqa: PLC0415 - lazy: only device backends need it
        self.torch = torch
        self.device = torch.device(device)
        self.stream = stream
        self.num_layers = int(num_layers)
        self.max_context = int(max_context)
        self.slots = int(slots)
        self.dtype = torch_dtype(torch, dtype)
        self.block_shape = (self.max_context, self.slots, int(kv_heads), int(head_dim))
        block = int(np.prod(self.block_shape))
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.block_stride = aligned_elems(block, itemsize)
        n_blocks = 2 * self.num_layers
        try:
            with self._on_stream():
                self._flat = torch.zeros(n_blocks * self.block_stride, dtype=self.dtype, device=self.device)
        except RuntimeError as e:  # torch.cuda.OutOfMemoryError is a RuntimeError
            gib = n_blocks * self.block_stride * itemsize / 2**30
            raise DsparkError(f"cannot allocate {gib:.2f} GiB for a KV cache on {self.device} "
                              f"({' '.join(str(e).split())[:200]}): export the artifact with a smaller "
                              f"--max-context or --max-batch") from None
        h, d = self.block_shape[2], self.block_shape[3]
        # [2L, max_context, slots, KVH, D] over the padded blocks: the scatter target of `write`.
        self._all = self._flat.as_strided((n_blocks, *self.block_shape),
                                          (self.block_stride, self.slots * h * d, h * d, d, 1))
        self._blocks = [self._all[i] for i in range(n_blocks)]

    def _on_stream(self):
        if self.stream is not None and self.device.type == "cuda":
            return self.torch.cuda.stream(self.stream)
        return nullcontext()

    @property
    def keys(self) -> list:
        return self._blocks[0::2]

    @property
    def values(self) -> list:
        return self._blocks[1::2]

    @property
    def nbytes(self) -> int:
        return self._flat.numel() * self._flat.element_size()

    def past(self, length: int) -> list:
        """Interleaved [k0, v0, k1, v1, ...] device views of the first `length` positions (at least 1)."""
        n = max(1, int(length))
        if n > self.max_context:
            raise DsparkError(f"KV length {n} exceeds the cache's max context {self.max_context}")
        return [b[:n] for b in self._blocks]

    def _index(self, idx, limit: int, what: str):
        torch = self.torch
        if isinstance(idx, torch.Tensor):
            return idx.to(device=self.device, dtype=torch.int64)
        arr = np.asarray(idx, dtype=np.int64).reshape(-1)
        # A bad index on the device is a CUDA assert that poisons the whole context: check on the host.
        if arr.size and (arr.min() < 0 or arr.max() >= limit):
            raise ValueError(f"KV write {what} out of range: {arr.min()}..{arr.max()} (cache has {limit})")
        return torch.from_numpy(np.ascontiguousarray(arr)).to(self.device, non_blocking=True)

    def write(self, present, positions, slots) -> None:
        """present: interleaved new entries [N, KVH, D] (device tensors, ideally a PresentList, or numpy);
        positions / slots: [N] where each goes."""
        torch = self.torch
        if len(present) != 2 * self.num_layers:
            raise ValueError(f"KV write got {len(present)} present tensors, the cache has {2 * self.num_layers}")
        with self._on_stream():
            pos = self._index(positions, self.max_context, "positions")
            slot = self._index(slots, self.slots, "slots")
            stacked = getattr(present, "stacked", None)
            if stacked is not None:
                # One scatter for every layer: [2L, N, KVH, D] into [2L, C, S, KVH, D] at (pos, slot).
                self._all[:, pos, slot] = stacked.to(self.dtype)
                return
            for block, new in zip(self._blocks, present):
                if not isinstance(new, torch.Tensor):
                    new = torch.from_numpy(np.ascontiguousarray(new))
                block[pos, slot] = new.to(device=self.device, dtype=self.dtype)

    def to_host(self, length: int) -> list[np.ndarray]:
        """Host copies of `past(length)` (float32 for bfloat16 caches): for tests and debugging."""
        with self._on_stream():
            out = [t.float().cpu().numpy() if self.dtype == self.torch.bfloat16 else t.cpu().numpy().copy()
                   for t in self.past(length)]
        return out
