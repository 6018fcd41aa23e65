"""Drafting with a DSpark drafter (runtime/dspark_drafting.py): the second implementation of the drafter
phase, beside the classic one in phases/drafter.py.

A DSpark drafter drafts all of its N = block size positions in one parallel block pass conditioned on
the target's hidden states, so a step makes one draft call for every drafting row (greedy rows on the
greedy graph; rows with temperature > 0 on the sampling graph, which returns q in the target vocabulary
for SampleAccept), whatever depth they verify. Its context cache is fed after commit (`observe`): the
target's `aux_hidden` rows of the tokens that verification made context, i.e. prompt chunks and, per
decode row, the anchor plus the accepted drafts; rejected drafts never enter it. Every request that may
draft is observed every step (it never has to catch up), and a request leaving its slot releases it.
"""

from __future__ import annotations

import time

import numpy as np

from dspark_trt.manifest_schema import DSPARK_SAMPLE_GRAPH
from dspark_trt.runtime.costs.catch_up import CatchUpRate
from dspark_trt.runtime.phases.drafter import Draft, DraftRound, draft_room, drafting_rows
from dspark_trt.runtime.request import Request
from dspark_trt.runtime.config import fixed_k_limit

# Verified aux rows all slots together may hold back (bytes) before the largest queues enter the context
# cache anyway. Bounded in memory, not in rows a slot: a request that never drafts again (high load, where
# plain decoding wins) then finishes without a context call, where a per-slot row limit made every such
# request pay its context KV (measured: 5% of the wall at 64 requests on the bundled pair).
PENDING_BYTES = 256 << 20

__all__ = ["DsparkDrafter"]


class DsparkDrafter:
    """Call order: ``draft(batch, depth, cost)`` once per step, ``observe(batch, result)`` after commit."""

    sequential = False  # any draft depth is one block pass (the depth planner prices it so)

    def __init__(self, drafting, tuning, limits, correction, costs, metrics):
        self.drafting, self.tuning = drafting, tuning
        self.max_draft, self.max_context, _ = limits
        self.correction, self.costs, self.metrics = correction, costs, metrics
        self.spec_limit = fixed_k_limit("dspark", self.max_draft)
        self._pending: dict[int, list[tuple[np.ndarray, int]]] = {}  # slot -> verified aux rows not yet in the cache
        self.pending_bytes = 0
        self.pending_limit = PENDING_BYTES
        self.catch_up_rate = CatchUpRate()

    def move_slot(self, r: Request, src: int, dst: int) -> None:
        """Request r moves from slot src to dst (admission.py's compaction): its context cache, context length
        and pending rows go with it."""
        self.drafting.move(src, dst)
        if src in self._pending:
            self._pending[dst] = self._pending.pop(src)

    def refusal(self, config, mode) -> str | None:
        """Why a request cannot run (checked at submit), or None: a sampled request that may draft needs
        the sampling graph."""
        if config.temperature > 0 and mode.kind != "off" and not self.drafting.can_sample:
            return self.drafting.graphs.missing(DSPARK_SAMPLE_GRAPH)
        return None

    def cap(self, r: Request, depth: int) -> int:
        """Most drafts request r gets this step: fixed:K -> K; adaptive -> the whole block when the depth
        planner drafts at all (the block costs the same at any depth; the budget solver picks the prefix)."""
        k = r.mode.k if r.mode.kind == "fixed" else (self.max_draft if depth > 0 else 0)
        return max(0, min(k, draft_room(r, self.max_context)))

    def draft(self, batch, depth, cost) -> DraftRound:
        spec = drafting_rows(batch.decode, depth.steps, self.cap, depth.rows)
        if not spec:
            return DraftRound({}, 0.0, 0.0, 0.0)
        t0 = time.perf_counter()
        # The rows verified since a slot last drafted enter its context first. More than one step's worth
        # (a request that decoded a while without drafting, an exploration) is the price of switching into
        # drafting: timed apart, as the classic drafter's catch-up, and not part of the block pass's cost.
        # A new request's prompt is paid once by each request that drafts, not per step: timed apart too.
        behind = {r.id: self._pending_rows(r.slot) for r in spec}
        self._flush([r.slot for r in spec])
        flush_ms = (time.perf_counter() - t0) * 1e3
        rows = sum(behind.values())
        if self.costs.learning:
            self.catch_up_rate.observe(rows, flush_ms)
        prompt_ms = flush_ms * sum(behind[r.id] for r in spec if r.stats.steps <= 1) / rows if rows else 0.0
        far = max((behind[r.id] for r in spec if r.stats.steps > 1), default=0) > self.max_draft + 1
        switch_ms = flush_ms - prompt_ms if far else 0.0
        out, engine_ms = {}, flush_ms
        greedy = [r for r in spec if not r.sampling]
        sampled = [r for r in spec if r.sampling]
        for group in (greedy, sampled):  # greedy rows never move [rows, N, V] probabilities
            if not group:
                continue
            t = time.perf_counter()
            d = self._block(group)
            engine_ms += (time.perf_counter() - t) * 1e3
            survival = d.survival.astype(np.float64)
            corrected = self.correction.apply(survival) if self.correction is not None else survival
            tokens = d.tokens.tolist()
            for i, r in enumerate(group):
                n = self.cap(r, depth.steps)
                probs = list(d.probs[i, :n]) if r.sampling else []
                out[r.id] = Draft(tokens[i][:n], probs, d.survival[i, :n].astype(np.float32),
                                  corrected[i, :n].tolist())
                r.draft_rounds += 1
                r.stats.drafted_tokens += n
        full = (time.perf_counter() - t0) * 1e3 - switch_ms - prompt_ms
        table = self.costs.table
        if table is not None and self.costs.observing:
            table.observe_draft(len(spec), full, max(r.target_len for r in spec))
        return DraftRound(out, engine_ms, full, switch_ms, prompt_ms)

    def _block(self, reqs: list[Request]):
        """One block pass (their context flushed); anchors are the requests' last tokens, at position context
        length = target_len."""
        slots = [r.slot for r in reqs]
        anchors = [r.tokens[-1] for r in reqs]
        if not any(r.sampling for r in reqs):
            return self.drafting.draft(slots, anchors)
        temps = np.asarray([r.config.temperature for r in reqs], dtype=np.float32)
        uniforms = np.asarray([[r.draft_draw(k) for k in range(self.max_draft)] for r in reqs], dtype=np.float32)
        return self.drafting.draft(slots, anchors, temps, uniforms)

    def observe(self, batch, result) -> None:
        """After commit: the verified tokens' aux rows join their request's draft context, lazily.

        Rows wait in a per-slot queue and enter the context cache in one batched context call just before
        the slot drafts (or, once the queues hold more than pending_limit bytes, the largest queues until
        they hold half of it): a request that does not draft (high load, where plain decoding wins) costs
        no context call, and one that finishes without drafting again never makes one."""
        if result.aux is None:
            return
        nd = len(batch.decode)
        for i, r in enumerate(result.order):
            if r.mode.kind == "off":
                continue  # it never drafts: no context to keep
            if r.finished:
                self.drafting.release(r.slot)
                self._drop(r.slot)
                continue
            if i < nd:
                kept = 1 + int(min(result.accepted[i], result.verify_lens[i]))  # the anchor and the accepted drafts
            else:
                kept = result.query_lens[i]  # a prompt chunk: all of it
            if kept:
                start, queue = int(result.past_lens[i]), self._pending.setdefault(r.slot, [])
                if queue and queue[-1][1] + queue[-1][0].shape[0] != start:
                    self._drop(r.slot)  # rows of an earlier request on this slot (cancelled between steps)
                    queue = self._pending.setdefault(r.slot, [])
                rows = result.aux[i][:kept]
                queue.append((rows, start))
                self.pending_bytes += rows.nbytes
        if self.pending_bytes > self.pending_limit:
            sizes = sorted(((sum(a.nbytes for a, _ in q), s) for s, q in self._pending.items()), reverse=True)
            largest, left = [], self.pending_bytes
            for size, slot in sizes:
                if left <= self.pending_limit // 2:
                    break
                largest.append(slot)
                left -= size
            self._flush(largest)

    def _drop(self, slot: int) -> list | None:
        queue = self._pending.pop(slot, None)
        if queue:
            self.pending_bytes -= sum(a.nbytes for a, _ in queue)
        return queue

    def catch_up_ms(self, reqs) -> float:
        """Modelled ms of writing the rows `reqs` have waiting into the draft's context."""
        return self.catch_up_rate.ms(sum(self._pending_rows(r.slot) for r in reqs))

    def _pending_rows(self, slot) -> int:
        return sum(a.shape[0] for a, _ in self._pending.get(slot, ()))

    def _flush(self, slots) -> None:
        """Write the waiting rows of `slots` into the context cache (one context-graph call)."""
        items = []
        for slot in slots:
            queue = self._drop(slot)
            if queue:  # contiguous segments: one item per slot
                items.append((slot, np.concatenate([a for a, _ in queue]), queue[0][1]))
        self.drafting.observe_many(items)

    def prepare_call(self, batch: int, past: int):
        """A zero-argument function making one block pass of `batch` rows at `past` context tokens, as the
        cost profile times it (costs/profiling.py); the slots' context lengths are left as they were."""
        d = self.drafting
        slots = np.arange(batch, dtype=np.int64)
        anchors = np.ones(batch, dtype=np.int64)
        past = max(1, min(past, self.max_context - 1))

        def call() -> None:
            saved = d.context_len[slots].copy()
            d.context_len[slots] = past
            try:
                d.draft(slots, anchors)
            finally:
                d.context_len[slots] = saved
        return call
