"""A request's uniform random draws, generated as they are read.

Sampling needs three kinds of uniforms per request: acceptance tests (indexed by generated-token offset),
residual/bonus samples (one per step) and draft samples (one row of max_draft per draft round). Each kind
is its own seeded stream (numpy PCG64 under SeedSequence(seed, spawn_key=(kind,))), so a draw depends only
on the request's seed, its kind and its offset: never on batch neighbours, on max_new_tokens, or on how
the reads were chunked. Streams are filled a chunk at a time and forget what lies before the last read,
so memory follows the tokens actually generated, never a number the caller asked for.
"""

from __future__ import annotations

import numpy as np

CHUNK = 64  # draws generated at a time


class UniformStream:
    """Float32 uniforms in [0, 1) at non-decreasing offsets of one seeded stream."""

    def __init__(self, seed: int, kind: int, width: int = 1):
        self.seed, self.kind, self.width = int(seed), int(kind), int(width)
        self._rng = None  # created on the first read (greedy requests never read)
        self._buf = np.empty(0, dtype=np.float32)
        self._start = 0  # stream offset of _buf[0]

    def take(self, offset: int, count: int) -> np.ndarray:
        """Draws [offset, offset + count) of the stream (a copy). Offsets never go back below an earlier
        read's start: what lies before it is dropped."""
        if offset < self._start:
            raise ValueError(f"draw offset {offset} is before the stream's kept start {self._start}")
        end = offset + count
        have = self._start + len(self._buf)
        if end > have:
            if self._rng is None:
                self._rng = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(self.kind,)))
            fresh = self._rng.random(max(end - have, CHUNK * self.width), dtype=np.float32)
            skip = min(offset - self._start, len(self._buf))
            self._buf = np.concatenate([self._buf[skip:], fresh])
            self._start += skip
        lo = offset - self._start
        return self._buf[lo:lo + count].copy()

    def row(self, index: int) -> np.ndarray:
        """Row `index` of the stream read as rows of `width` draws."""
        return self.take(index * self.width, self.width)


class RequestDraws:
    """The three streams of one sampling request (see the module docstring)."""

    ACCEPT, SAMPLE, DRAFT = 0, 1, 2

    def __init__(self, seed: int, max_draft: int):
        if int(seed) < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.accept = UniformStream(seed, self.ACCEPT)
        self.sample = UniformStream(seed, self.SAMPLE)
        self.draft = UniformStream(seed, self.DRAFT, width=max(1, max_draft))
