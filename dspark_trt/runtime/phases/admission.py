"""Admission: the wait queue, the KV slots, and which requests take part in a step.

Also decides which arriving prompts wait a few steps to share a prefill call (prefill_batching.py).
Callers meet the worker under ``lock``: ``check_room`` and ``enqueue`` (the caller holds it), ``busy``,
``fail_all``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import NamedTuple

from dspark_trt.errors import DsparkError
from dspark_trt.runtime.prefill_batching import prefill_group_size, prefill_now
from dspark_trt.runtime.request import Request

__all__ = ["Admission", "QueueFullError", "StepBatch"]


class QueueFullError(DsparkError):
    """The runtime's wait queue is full; the caller should retry later (HTTP 429)."""


class StepBatch(NamedTuple):
    """The requests of one step."""

    started: float  # perf_counter when the step began (after admission)
    decode: list[Request]  # requests with one uncached token: they decode (and may draft) this step
    prefill: list[Request]  # requests with prompt tokens to feed this step (held ones left out)
    held: list[Request]  # arriving prompts that wait this step to share a later prefill call
    n_adaptive: int  # decode requests in adaptive mode
    past: int  # longest past of the decode requests (what the verify call attends over)


class Admission:
    def __init__(self, slots_total: int, max_batch: int, max_queue: int | None, tuning, costs,
                 query_len_max: int, metrics):
        self.slots: list[Request | None] = [None] * slots_total
        self.waiting: deque[Request] = deque()
        self.max_batch, self.max_queue = max_batch, max_queue
        self.lock = threading.Condition()
        self.tuning, self.costs, self.query_len_max, self.metrics = tuning, costs, query_len_max, metrics
        self.admitted = 0  # prompts admitted since the last step began
        self.arrivals = 0.0  # recent prompts admitted per step (EW), for prefill batching
        # move_slot(request, src, dst): moves a request's caches to another slot (set by the runtime where the
        # slots' order costs: ORT's decoding graph); None: requests keep their slot
        self.move_slot = None
        self.moves = 0

    # -- callers' side (under the lock) ----------------------------------------------------------------
    def check_room(self) -> None:
        """Raise QueueFullError when the queue is full; the caller holds the lock."""
        if self.max_queue is not None and len(self.waiting) >= self.max_queue:
            raise QueueFullError(f"queue is full ({self.max_queue} waiting requests)")

    def enqueue(self, req: Request) -> None:
        """Queue a request; the caller holds the lock."""
        self.waiting.append(req)
        self.lock.notify_all()

    def busy(self) -> bool:
        return bool(self.waiting) or any(self.slots)

    def fail_all(self, message: str) -> None:
        with self.lock:
            for i, r in enumerate(self.slots):
                if r is not None:
                    r.finish("error", message)
                    self.slots[i] = None
            while self.waiting:
                self.waiting.popleft().finish("error", message)

    # -- the worker's side -----------------------------------------------------------------------------
    def admit(self) -> StepBatch | None:
        """Fill free slots from the queue; the step's batch, or None when nothing runs."""
        with self.lock:
            for i, r in enumerate(self.slots):
                if r is not None and r.cancelled:
                    r.finish("cancelled")
                    self.slots[i] = None
            active = sum(r is not None for r in self.slots)
            while self.waiting and active < self.max_batch:
                req = self.waiting.popleft()
                if req.cancelled:
                    req.finish("cancelled")
                    continue
                req.slot = self.slots.index(None)
                req.stats.t_admit = time.perf_counter()
                self.slots[req.slot] = req
                active += 1
                self.admitted += 1
            if self.move_slot is not None:
                self._compact()
            self.metrics.queue_depth = len(self.waiting)
            running = [r for r in self.slots if r is not None]
        if not running:
            return None
        started = time.perf_counter()
        decode = [r for r in running if r.uncached == 1]
        prefill = [r for r in running if r.uncached > 1]
        self.arrivals += self.tuning.arrivals_alpha * (self.admitted - self.arrivals)
        self.admitted = 0
        held = self.hold_prompts(prefill, decode) if self.tuning.prefill_batching and decode and prefill else []
        if held:
            prefill = [r for r in prefill if r.target_len > 0]  # held: every prompt not yet started
        n_adaptive = sum(r.mode.kind == "adaptive" for r in decode)
        past = max((r.target_len for r in decode), default=0)
        return StepBatch(started, decode, prefill, held, n_adaptive, past)

    def _compact(self) -> None:
        """Move the requests of the highest slots into free lower ones. ONNX Runtime's decoding graph runs a
        call over a range of slots (a slot's cache is its batch row), so the holes finished requests leave
        below the last busy slot cost like live rows: in the open loop at 16 requests/s, plain calls of 8.7
        rows ran over 20.7 slots (7.8 ms) and of 16.6 rows over 30.4. A move copies a request's cache
        rows, once, in place of that every step."""
        slots = self.slots
        while True:
            hole = next((i for i, r in enumerate(slots) if r is None), None)
            top = next((i for i in range(len(slots) - 1, -1, -1) if slots[i] is not None), -1)
            if hole is None or hole > top:
                return
            r = slots[top]
            self.move_slot(r, top, hole)
            slots[hole], slots[top], r.slot = r, None, hole
            self.moves += 1

    def hold_prompts(self, prefill: list[Request], decode: list[Request]) -> list[Request]:
        """Prompts not yet started that wait this step to share a later prefill call (prefill_batching.py):
        only where they would get a call of their own anyway, i.e. where sharing saves a call."""
        shape = self.costs.shape
        fresh = [r for r in prefill if r.target_len == 0]
        if shape is None or not fresh:
            return []
        k = prefill_group_size(shape.ms(1, 1, 1, 0), self.arrivals, self.costs.rate, self.costs.tau_row)
        if prefill_now(len(fresh), max(r.prefill_wait for r in fresh), k, len(decode), self.tuning.prefill_max_wait):
            return []
        chunks = [min(r.uncached, self.tuning.prefill_chunk, self.query_len_max) for r in fresh]
        if not self.costs.split_prefill([1] * len(decode), [r.target_len for r in decode], chunks, [0] * len(fresh)):
            return []  # they would ride in the decode call: no call to save
        for r in fresh:
            r.prefill_wait += 1
        return fresh

    def release_finished(self) -> None:
        with self.lock:
            for i, r in enumerate(self.slots):
                if r is not None and r.finished:
                    self.slots[i] = None
                    self.metrics.requests_finished += 1
