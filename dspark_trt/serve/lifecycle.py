"""Graceful shutdown: live requests get a grace period, then end with an answer, never a cut connection.

`Drain.begin()` (called from the SIGTERM/SIGINT handler, any thread) starts the grace period. When it
ends, every registered request queue receives the DRAINED sentinel: a stream then sends an error event
and `data: [DONE]`, a waiting non-streaming request answers 503. Requests that finish within the grace
period are answered normally.
"""

from __future__ import annotations

import asyncio

DRAINED = object()  # queued as (-1, DRAINED) into every live request's queue when the grace period ends
SHUTDOWN_MESSAGE = "the server is shutting down; this completion was cut short"


class Drain:
    def __init__(self, grace_s: float):
        self.grace_s = float(grace_s)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.queues: set[asyncio.Queue] = set()
        self.draining = False
        self.expired = False

    def register(self, queue: asyncio.Queue) -> None:
        """Called on the event loop for each live request's queue."""
        self.loop = asyncio.get_running_loop()
        self.queues.add(queue)
        if self.expired:
            queue.put_nowait((-1, DRAINED))

    def unregister(self, queue: asyncio.Queue) -> None:
        self.queues.discard(queue)

    def begin(self) -> None:
        """Start the grace period (thread-safe; a second call does nothing)."""
        if self.draining:
            return
        self.draining = True
        loop = self.loop
        if loop is None or loop.is_closed():
            self.expired = True  # no request ever ran: nothing to wait for
            return
        try:
            loop.call_soon_threadsafe(lambda: loop.call_later(self.grace_s, self._expire))
        except RuntimeError:  # the loop is gone
            self.expired = True

    def _expire(self) -> None:
        self.expired = True
        for q in list(self.queues):
            q.put_nowait((-1, DRAINED))
