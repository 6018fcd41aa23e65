"""Packing per-request queries into the engines' input layout (numpy only)."""

from __future__ import annotations

import numpy as np

SMALL_ROWS = 8  # up to this many rows of several tokens, pack_queries builds its feeds in plain Python


def pack_queries(queries: list[list[int]], past_lens: list[int], slots: list[int]) -> dict[str, np.ndarray]:
    """Packed feeds for N = sum(len(q)) new tokens from R requests (see models/decoder.py)."""
    R = len(queries)
    if all(len(q) == 1 for q in queries):
        # One new token a request (a drafting call after its first, a plain decode step): the same feeds
        # in a handful of numpy calls instead of a dozen (this runs several times a step, right after an
        # engine call).
        idx = np.arange(R, dtype=np.int64)
        past = np.asarray(past_lens, dtype=np.int64)
        return {"tokens": np.fromiter((q[0] for q in queries), dtype=np.int64, count=R), "positions": past.copy(),
                "pack_index": idx.reshape(R, 1), "unpack_index": idx, "query_lens": np.ones(R, dtype=np.int64),
                "past_lens": past, "slot_ids": np.asarray(slots, dtype=np.int64)}
    if R <= SMALL_ROWS:
        return _pack_small(queries, past_lens, slots)
    ql = np.fromiter((len(q) for q in queries), dtype=np.int64, count=R)
    past = np.asarray(past_lens, dtype=np.int64)
    lq = int(ql.max())
    starts = np.cumsum(ql) - ql
    j = np.arange(lq, dtype=np.int64)
    valid = j[None, :] < ql[:, None]
    pack_index = np.where(valid, starts[:, None] + j[None, :], 0)
    unpack_index = np.flatnonzero(valid.ravel()).astype(np.int64)
    positions = (past[:, None] + j[None, :])[valid]
    tokens = np.fromiter((t for q in queries for t in q), dtype=np.int64, count=int(ql.sum()))
    return {"tokens": tokens, "positions": positions, "pack_index": pack_index, "unpack_index": unpack_index,
            "query_lens": ql, "past_lens": past, "slot_ids": np.asarray(slots, dtype=np.int64)}


def _pack_small(queries: list[list[int]], past_lens: list[int], slots: list[int]) -> dict[str, np.ndarray]:
    """pack_queries' feeds built as lists: at a few rows a dozen numpy calls on tiny arrays cost more than
    the arithmetic (a verify call at one request spent ~40 us packing)."""
    lq = max(len(q) for q in queries)
    pack, unpack, positions, tokens, lens, start = [], [], [], [], [], 0
    for r, (q, past) in enumerate(zip(queries, past_lens)):
        n = len(q)
        pack.append([start + j if j < n else 0 for j in range(lq)])
        unpack.extend(range(r * lq, r * lq + n))
        positions.extend(range(past, past + n))
        tokens.extend(q)
        lens.append(n)
        start += n
    i64 = np.int64
    return {"tokens": np.array(tokens, dtype=i64), "positions": np.array(positions, dtype=i64),
            "pack_index": np.array(pack, dtype=i64).reshape(len(queries), lq),
            "unpack_index": np.array(unpack, dtype=i64), "query_lens": np.array(lens, dtype=i64),
            "past_lens": np.array(past_lens, dtype=i64), "slot_ids": np.array(slots, dtype=i64)}


def token_slots(feeds: dict[str, np.ndarray]) -> np.ndarray:
    return np.repeat(feeds["slot_ids"], feeds["query_lens"])


def verify_rows(query_lens: np.ndarray, verify_lens: np.ndarray) -> np.ndarray:
    """Packed indices of the last (L_r + 1) tokens of each request: the rows the acceptance ops score."""
    ends = np.cumsum(query_lens)
    counts = verify_lens + 1
    offsets = np.cumsum(counts) - counts
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(offsets, counts)
    return np.repeat(ends - counts, counts) + within


class ZeroRows(np.ndarray):
    """An all-zero feed the runtime never writes (the draft distribution of greedy verify rows): a backend
    that copies feeds to a device may zero its device buffer instead of copying [M, V] zeros."""


def zero_rows(shape: tuple, dtype=np.float32) -> ZeroRows:
    return np.zeros(shape, dtype=dtype).view(ZeroRows)
