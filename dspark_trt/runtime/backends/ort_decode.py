"""Decoding on ONNX Runtime without gathering the past: the ORT flavour's `decode` graph.

The packed target graph reads a position-major host cache ([P, S, KVH, D], the manifest's contract) and
gathers every row's past into a batch before attending: at 16-64 one-token rows a quarter of the call
(lab notes, thirteenth session). The decode graph (exporter/graphs.TargetDecodeStep) is one
GroupQueryAttention node a layer over slot-major caches ([S, KVH, max_context, D], row b = slot b), bound
once and shared between past and present, so each layer reads the past where it lies and writes only the
new entries. It runs the calls whose rows all bring one token and verify no drafts (plain decoding) and
the calls of one row verifying its drafts (one request speculating; ONNX Runtime's attention takes several
new tokens a row only in a one-row batch): at 1-64 one-token rows 1.3x-1.5x faster than the packed graph.
The draft has decoding graphs too (exporter/graphs.DraftDecodeStep, and its all-greedy one), run for the
calls of one request (its drafting calls and its catch-up): 1.02-1.04x the tokens/s at one request. Its
one-token calls of 4-16 rows measured faster alone (0.67 against 0.76 ms at 16 rows) but made runs 2-4%
slower (each drafting step's first call, ragged, runs the packed graph, so the next syncs the copy; the
target's packed calls ran 4% slower beside the draft's copy), so those stay on the packed graph.

So a model's cache is kept twice (MirroredKVCache): the host cache every other call reads and writes,
and the slot-major copy, brought up to date from it just before a decode call reads a slot; a decode
call's own entries are written by the graph into the copy, and into the host cache just before a packed
call reads their slot. The
rows of a call are a range of the copy's slots in order; a slot in that range that is not in the call
runs as a dummy row whose entry lands past anything its request has written (its last written position
+ 1), where the next real write overwrites it before anything reads it; a call that would need a dummy at
the end of the context runs the packed graph instead. Since a dummy row costs what a live one does, the
runtime keeps the busy slots at the bottom (phases/admission.py moves requests down into the holes
finished ones leave). DSPARK_ORT_DECODE=0 turns this off (comparisons; the cache is then kept once).
"""

from __future__ import annotations

import os
import time

import numpy as np

from dspark_trt.runtime.kv_cache import KVCache


_NUMPY = {"tensor(int64)": np.int64, "tensor(float)": np.float32, "tensor(float16)": np.float16}  # ORT's type names


def wanted() -> bool:
    return os.environ.get("DSPARK_ORT_DECODE", "1") != "0"


class DecodeEntries:
    """The new entries of a decode-graph call: already in the slot-major copy (the graph wrote them), which
    the host cache takes from there when a packed call next reads their slot (MirroredKVCache.sync_host).
    Iterating gathers them ([N, KVH, D] per cache, interleaved like `present`): tests compare them."""

    def __init__(self, slot_major, slots, positions):
        self.slot_major, self.slots, self.positions = slot_major, slots, positions

    def __iter__(self):
        return (buf[self.slots, :, self.positions] for buf in self.slot_major)

    def __len__(self) -> int:
        return len(self.slot_major)


class MirroredKVCache(KVCache):
    """The host cache plus its slot-major copy (`slot_major`, interleaved like `present`, each
    [slots, kv_heads, max_context, head_dim]), each brought up to date from the other lazily. A packed call's
    write goes to the host cache and widens the slot's stale span [stale_lo, stale_hi) over the positions it
    wrote, and sync() copies a slot's stale span below its length just before a decode call reads it. So
    steps that only verify drafts (fixed K at 16-64 requests) write one cache, as without the copy, and a
    request that decodes plainly after drafting pays for its drafted entries once: a switch's cost
    (`sync_ms`), which the runtime keeps out of what it learns a call costs (a plain check after drafting at
    16 requests synced 2-4 ms of entries and taught the cost model plain calls twice their price). The other
    way alike: a decode call's entries stay in the copy, widening the slot's host span [host_lo, host_hi),
    and sync_host() copies it below the slot's length just before a packed call reads the slot (gathering
    and writing them to the host cache after every decode call was 31 us a call, 3% of a one-request step).
    Every call brings its slots up to date before it runs, so a slot is stale one way at most. Positions at
    or past a request's length are never read before they are written again, so a sync leaves nothing
    stale. `written_end`: each slot's last written position + 1 (where a dummy row may write)."""

    def __init__(self, num_layers: int, max_context: int, slots: int, kv_heads: int, head_dim: int,
                 dtype=np.float32):
        super().__init__(num_layers, max_context, slots, kv_heads, head_dim, dtype)
        shape = (slots, kv_heads, max_context, head_dim)
        self.slot_major = [np.zeros(shape, dtype=dtype) for _ in range(2 * num_layers)]
        self._sm_flat = [b.reshape(slots * kv_heads * max_context, head_dim) for b in self.slot_major]
        self._host_rows = [f.reshape(-1, head_dim) for f in self._flat]  # (position, slot, head) rows
        self.kv_heads = kv_heads
        self.written_end = np.zeros(slots, dtype=np.int64)
        self.stale_lo = np.full(slots, max_context, dtype=np.int64)  # the copy's: empty while stale_lo >= stale_hi
        self.stale_hi = np.zeros(slots, dtype=np.int64)
        self.host_lo = np.full(slots, max_context, dtype=np.int64)  # the host cache's, alike
        self.host_hi = np.zeros(slots, dtype=np.int64)
        self.sync_ms = 0.0  # time spent in both syncs so far: a switch's cost, which callers keep out of call prices

    def buffers(self) -> list[np.ndarray]:
        return [*super().buffers(), *self.slot_major]

    def release(self) -> None:
        super().release()
        self.slot_major, self._sm_flat, self._host_rows = [], [], []

    def move(self, src: int, dst: int, length: int) -> None:
        super().move(src, dst, length)
        for buf in self.slot_major:
            buf[dst, :, :length] = buf[src, :, :length]
        for a, empty in ((self.written_end, 0), (self.stale_lo, self.max_context), (self.stale_hi, 0),
                         (self.host_lo, self.max_context), (self.host_hi, 0)):
            a[dst], a[src] = a[src], empty

    def write(self, present, positions, slots) -> None:
        positions = np.asarray(positions, dtype=np.int64)
        slots = np.asarray(slots, dtype=np.int64)
        self.written_end[slots] = positions + 1  # packed rows ascend within a slot: the last one wins
        if isinstance(present, DecodeEntries):  # in the copy already: the host cache takes them at sync_host
            lo, hi = self.host_lo, self.host_hi
        else:
            super().write(present, positions, slots)
            lo, hi = self.stale_lo, self.stale_hi
        np.minimum.at(lo, slots, positions)
        np.maximum.at(hi, slots, positions + 1)

    def sync(self, slots: np.ndarray, lengths: np.ndarray) -> None:
        """Bring the copy's rows of these slots up to date over their first `lengths` positions."""
        self._sync(slots, lengths, self.stale_lo, self.stale_hi, to_host=False)

    def sync_host(self, slots: np.ndarray, lengths: np.ndarray) -> None:
        """Bring the host cache's rows of these slots up to date over their first `lengths` positions."""
        self._sync(slots, lengths, self.host_lo, self.host_hi, to_host=True)

    def _sync(self, slots, lengths, lo, hi, to_host: bool) -> None:
        start, end = lo[slots], np.minimum(hi[slots], lengths)
        lo[slots], hi[slots] = self.max_context, 0
        stale = start < end
        if not stale.any():
            return
        t = time.perf_counter()
        slots, start, counts = slots[stale], start[stale], (end - start)[stale]
        slot_of = np.repeat(slots, counts)
        pos = np.repeat(start - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())
        heads = np.arange(self.kv_heads)
        host = ((pos * self.slots + slot_of)[:, None] * self.kv_heads + heads).ravel()
        copy = ((slot_of[:, None] * self.kv_heads + heads) * self.max_context + pos[:, None]).ravel()
        for sm, rows in zip(self._sm_flat, self._host_rows):
            if to_host:
                rows[host] = sm[copy]
            else:
                sm[copy] = rows[host]
        self.sync_ms += (time.perf_counter() - t) * 1e3

    @property
    def nbytes(self) -> int:
        return 2 * super().nbytes


class DecodePath:
    """Runs the calls a decoding graph takes over a MirroredKVCache: one token in every row (plain decoding,
    or a drafting call) with no drafts to verify, or one row with several tokens (one request verifying its
    drafts, or the draft catching one request up): ONNX Runtime's attention takes several new tokens a row
    only in a one-row batch. The graph's inputs are its session's other than the caches, its outputs the
    ones other than present, bound after the caches."""

    def __init__(self, session, cache: MirroredKVCache, num_layers: int, max_rows: int | None = None):
        """max_rows: the most rows of a call it takes (None: any)."""
        import onnxruntime as ort

        self._ort = ort
        self.session = session
        self.cache = cache
        self.inputs = [i.name for i in session.get_inputs() if not i.name.startswith("past_key_values.")]
        self.outputs = [o.name for o in session.get_outputs() if not o.name.startswith("present.")]
        # Outputs of one row per call row ([rows, fixed...]) are bound once per binding to buffers of ours:
        # binding them anew and converting ORT's arrays cost ~0.07 ms a call, a quarter of a one-row
        # draft call. The others (aux_hidden: a row per token) are bound unallocated every run.
        rows_dim = {i.name: i.shape for i in session.get_inputs()}["past_lens"][0]
        self._row_outputs = {o.name: (tuple(o.shape[1:]), _NUMPY[o.type]) for o in session.get_outputs()
                             if o.name in self.outputs and o.type in _NUMPY and o.shape and o.shape[0] == rows_dim
                             and all(isinstance(d, int) for d in o.shape[1:])}
        self._other_outputs = [name for name in self.outputs if name not in self._row_outputs]
        self.past_names = [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
        self.present_names = [n.replace("past_key_values", "present") for n in self.past_names]
        self.max_rows = max_rows
        self._bound: dict[tuple[int, int], object] = {}  # (first slot, rows) -> a binding of those slots

    def takes(self, feeds: dict) -> bool:
        slots, lens = feeds["slot_ids"], feeds.get("verify_lens")
        rows, tokens, context = len(slots), len(feeds["tokens"]), self.cache.max_context
        if self.max_rows is not None and rows > self.max_rows:
            return False
        if tokens == rows:  # one token a row: nothing verified, dummies (if any) inside the context
            lo, hi = int(slots.min()), int(slots.max()) + 1
            return (lens is None or not lens.any()) and (
                hi - lo == rows or int(self.cache.written_end[lo:hi].max()) < context)
        return rows == 1 and (lens is None or int(lens[0]) == tokens - 1) and \
            int(feeds["past_lens"][0]) + tokens <= context

    def _binding(self, lo: int, rows: int):
        """(a binding of slots lo..lo + rows, the buffers its one-row-per-row outputs land in)."""
        bound = self._bound.get((lo, rows))
        if bound is None:
            io = self.session.io_binding()
            value = self._ort.OrtValue.ortvalue_from_numpy
            for past, present, buf in zip(self.past_names, self.present_names, self.cache.slot_major):
                view = value(buf[lo:lo + rows])  # a view: no copy
                io.bind_ortvalue_input(past, view)
                io.bind_ortvalue_output(present, view)
            outs = {name: np.empty((rows, *shape), dtype) for name, (shape, dtype) in self._row_outputs.items()}
            for name, buf in outs.items():
                io.bind_ortvalue_output(name, value(buf))
            bound = self._bound[(lo, rows)] = (io, outs)
        return bound

    def run(self, feeds: dict) -> tuple[dict, list[np.ndarray]]:
        """-> (the graph's outputs for the call's rows (a target's accepted, next_token and, for a DSpark
        target, aux_hidden; a draft's tokens and survivals); their new entries [N, KVH, D] per cache,
        interleaved)."""
        slots = np.asarray(feeds["slot_ids"], dtype=np.int64)
        lo, hi = int(slots.min()), int(slots.max()) + 1
        rows = hi - lo
        if rows == len(slots) and (slots == np.arange(lo, hi)).all():
            full = {k: feeds[k] for k in self.inputs}
            full["tokens"] = feeds["tokens"].reshape(rows, -1)
        else:  # one token a row: dummy rows for the slots in range that the call leaves out
            at = slots - lo
            full = {}
            for k in self.inputs:
                v = np.asarray(feeds[k])
                full[k] = np.zeros((rows, *v.shape[1:]), dtype=v.dtype)
                full[k][at] = v
            missing = np.ones(rows, dtype=bool)
            missing[at] = False
            full["past_lens"][missing] = self.cache.written_end[lo:hi][missing]
            full["tokens"] = full["tokens"][:, None]
        self.cache.sync(slots, np.asarray(feeds["past_lens"], dtype=np.int64))
        io, mine = self._binding(lo, rows)
        for k in self.inputs:
            io.bind_cpu_input(k, np.ascontiguousarray(full[k]))
        others = self._other_outputs
        for name in others:  # unallocated again: a run keeps the last one's, whose tokens may differ
            io.bind_output(name)
        self.session.run_with_iobinding(io)
        outs = {name: buf.copy() for name, buf in mine.items()}  # copies: the next run writes the buffers
        if others:  # bound last, in this order (a name bound again keeps its place)
            outs.update(zip(others, (v.numpy() for v in io.get_outputs()[-len(others):])))
        if rows != len(slots):  # one token a row: the call's rows out of the range's
            outs = {name: v[slots - lo] for name, v in outs.items()}
        token_slots = np.repeat(slots, len(feeds["tokens"]) // len(slots))
        return outs, DecodeEntries(self.cache.slot_major, token_slots, feeds["positions"])
