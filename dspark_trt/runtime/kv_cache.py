"""Preallocated KV buffers, one per layer: [max_context, slots, kv_heads, head_dim].

Position-major so that `buffer[:P]` is a contiguous view the engines read without a copy; the engines
return only the new entries, which are written at (position, slot). Rejected draft tokens are rolled
back simply by not advancing a request's length.
"""

from __future__ import annotations

import numpy as np


class KVCache:
    def __init__(self, num_layers: int, max_context: int, slots: int, kv_heads: int, head_dim: int,
                 dtype=np.float32):
        shape = (max_context, slots, kv_heads, head_dim)
        self.keys = [np.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.values = [np.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.max_context = max_context
        self.slots = slots
        # The same buffers as [max_context * slots, kv_heads * head_dim] views, interleaved like
        # `present`: a write through one flat index is ~4x faster than numpy's (position, slot) pairs,
        # and rows of one flat axis ~2x faster again than rows of [kv_heads, head_dim].
        self._row = kv_heads * head_dim
        self._flat = [b.reshape(max_context * slots, self._row) for kv in zip(self.keys, self.values) for b in kv]

    def past(self, length: int) -> list[np.ndarray]:
        """Interleaved [k0, v0, k1, v1, ...] views of the first `length` positions (at least 1)."""
        n = max(1, length)
        return [buf[:n] for kv in zip(self.keys, self.values) for buf in kv]

    def write(self, present: list[np.ndarray], positions: np.ndarray, slots: np.ndarray) -> None:
        """present: interleaved new entries [N, KVH, D]; positions/slots: [N] where each one goes."""
        index = np.asarray(positions, dtype=np.int64) * self.slots + np.asarray(slots, dtype=np.int64)
        for buf, new in zip(self._flat, present):
            buf[index] = new.reshape(len(index), self._row)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot src's first `length` positions to slot dst (the slot compaction in admission.py)."""
        for buf in (*self.keys, *self.values):
            buf[:length, dst] = buf[:length, src]

    def buffers(self) -> list[np.ndarray]:
        """Every host buffer this cache holds (what the prefault maps and release drops)."""
        return [*self.keys, *self.values]

    def release(self) -> None:
        """Drop the buffers (the runtime closed): their memory goes back now, not when the garbage collector
        gets to the runtime's reference cycles."""
        self.keys, self.values, self._flat = [], [], []

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.keys) * 2


def kv_numpy_dtype(model_dtype: str):
    """The host KV cache's dtype: the graphs' own (bf16 as ml_dtypes.bfloat16, numpy having none), so a
    16-bit artifact's cache takes half the memory of a float32 one and is never converted per step."""
    if model_dtype == "bf16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({"fp32": np.float32, "fp16": np.float16}[model_dtype])
