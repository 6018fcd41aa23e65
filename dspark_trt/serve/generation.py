"""Running one HTTP request's completions on the runtime: submit, bridge to the event loop, then answer
as one JSON body or as an SSE stream, for /v1/completions and /v1/chat/completions alike (the two differ
only in how a choice is written: `CompletionFormat`, `ChatFormat`).

The runtime's worker thread commits tokens into each request's thread-safe queue; one small forwarding
thread per request moves them into an asyncio queue. A client that goes away (stream or not) cancels its
requests, which frees their KV slots at the runtime's next step. At shutdown the drain (lifecycle.py)
ends what is still running with an answer: an error event and [DONE], or a 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid

from dspark_trt.errors import DsparkError
from dspark_trt.serve.lifecycle import DRAINED, SHUTDOWN_MESSAGE
from dspark_trt.serve.protocol import OpenAIError, error_body

log = logging.getLogger("dspark_trt.serve")


def _forward(runtime, req, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int) -> None:
    """Thread body: move one request's committed token lists into the event loop's queue (None ends it)."""
    while True:
        item = req.pieces.get()
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (index, item))
        except RuntimeError:  # the event loop is gone (server stopped): nobody will read this request
            runtime.cancel(req)
            return
        if item is None:
            return


class ServerStats:
    """Counters kept by the HTTP layer (touched only from the event loop)."""

    def __init__(self):
        self.finished: dict[str, int] = {}
        self.rejected = 0
        self.responses: dict[int, int] = {}
        self.prompt_tokens = 0
        self.decode_tokens = 0  # generated tokens after the first, summed over finished requests
        self.decode_steps = 0  # decode steps, summed over finished requests
        self.cancelled = 0  # requests cancelled because their client went away (or the server stopped)

    def count(self, status: int) -> None:
        """One more response with this HTTP status."""
        self.responses[status] = self.responses.get(status, 0) + 1

    def cancel(self) -> None:
        self.cancelled += 1
        self.finished["cancelled"] = self.finished.get("cancelled", 0) + 1

    def finish(self, req) -> None:
        reason = req.finish_reason or "error"
        self.finished[reason] = self.finished.get(reason, 0) + 1
        if req.stats.steps:
            self.decode_tokens += max(0, req.stats.generated - 1)
            self.decode_steps += req.stats.steps


class CompletionFormat:
    object, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl-"

    def choice(self, index: int, text: str, finish_reason: str) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def first_deltas(self, n: int) -> list[dict]:
        return []

    def delta(self, index: int, text: str, finish_reason=None) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


class ChatFormat:
    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    def choice(self, index: int, text: str, finish_reason: str) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}

    def first_deltas(self, n: int) -> list[dict]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(n)]

    def delta(self, index: int, text: str, finish_reason=None) -> dict:
        return {"index": index, "delta": {"content": text} if text or finish_reason is None else {},
                "logprobs": None, "finish_reason": finish_reason}


class Generations:
    """Submits prepared requests and answers them; one per app."""

    def __init__(self, rt, name: str, stats: ServerStats, drain, inflight: dict):
        self.rt, self.name, self.stats, self.drain, self.inflight = rt, name, stats, drain, inflight

    # ------------------------------------------------------------------ submitting
    def submit(self, prepared) -> list:
        from dspark_trt.runtime.runtime import QueueFullError

        rt, reqs = self.rt, []
        if self.drain.draining:
            raise OpenAIError(503, "the server is shutting down", type="server_error", code="server_shutdown")
        try:
            for ids, config in zip(prepared.ids_list, prepared.configs):
                reqs.append(rt.submit(ids, config, stream=True))
        except QueueFullError as e:
            self._cancel_all(reqs)
            self.stats.rejected += 1
            raise OpenAIError(429, f"server is busy: {e}; retry later", type="rate_limit_error",
                              code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None
        except DsparkError as e:
            self._cancel_all(reqs)
            if getattr(rt, "_closed", False):
                raise OpenAIError(503, f"server is shutting down: {e}", type="server_error") from None
            raise OpenAIError(400, str(e)) from None
        self.stats.prompt_tokens += prepared.prompt_tokens
        return reqs

    def _cancel_all(self, reqs) -> None:
        for r in reqs:
            self.rt.cancel(r)

    def bridge(self, reqs) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self.drain.register(queue)
        for i, r in enumerate(reqs):
            threading.Thread(target=_forward, args=(self.rt, r, loop, queue, i), daemon=True,
                             name=f"dspark-http-{r.id}").start()
        return queue

    def cancel_unfinished(self, reqs) -> None:
        for r in reqs:
            if not r.finished and not r.cancelled:
                self.rt.cancel(r)
                self.stats.cancel()

    def close(self, cid, reqs, queue) -> None:
        self.cancel_unfinished(reqs)
        self.drain.unregister(queue)
        self.inflight.pop(cid, None)

    @staticmethod
    def usage(prepared, reqs) -> dict:
        p = prepared.prompt_tokens
        c = sum(len(r.generated_ids) for r in reqs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    @staticmethod
    def timings(reqs) -> dict:
        """Server-side timings a client cannot see (as llama.cpp's server reports `timings`): queue_ms,
        the longest wait of the answer's requests for a batch slot."""
        waits = [r.stats.t_admit - r.stats.t_submit for r in reqs if r.stats.t_admit]
        return {"queue_ms": round(max(waits) * 1e3, 3) if waits else None}

    def start(self, prepared, fmt, access: dict):
        reqs = self.submit(prepared)
        cid = f"{fmt.id_prefix}{uuid.uuid4().hex}"
        self.inflight[cid] = reqs
        access["prompt_tokens"], access["completion_tokens"] = prepared.prompt_tokens, 0
        return cid, reqs, self.bridge(reqs)

    # ------------------------------------------------------------------ answering in one body
    async def collect(self, request, prepared, fmt, access: dict) -> dict:
        """The whole answer as one JSON body (raises OpenAIError for 499/500/503 outcomes)."""
        cid, reqs, queue = self.start(prepared, fmt, access)
        now = int(time.time())
        watcher = asyncio.ensure_future(_watch_disconnect(request))
        try:
            remaining = len(reqs)
            while remaining:
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    self.cancel_unfinished(reqs)  # nobody is listening any more
                    raise OpenAIError(499, "client disconnected")
                _, item = getter.result()
                if item is DRAINED:
                    self.cancel_unfinished(reqs)
                    raise OpenAIError(503, SHUTDOWN_MESSAGE, type="server_error", code="server_shutdown")
                if item is None:
                    remaining -= 1
        finally:
            watcher.cancel()
            self.close(cid, reqs, queue)
            access["completion_tokens"] = sum(len(r.generated_ids) for r in reqs)
        choices = []
        for i, r in enumerate(reqs):
            self.stats.finish(r)
            if r.finish_reason == "error":
                raise OpenAIError(500, f"generation failed: {r.error}", type="server_error")
            res = self.rt.result(r)
            choices.append(fmt.choice(i, res.text, res.finish_reason))
        return {"id": cid, "object": fmt.object, "created": now, "model": self.name, "choices": choices,
                "usage": self.usage(prepared, reqs), "timings": self.timings(reqs)}

    # ------------------------------------------------------------------ answering as a stream
    def stream(self, prepared, fmt, access: dict):
        """(SSE event generator, on_close callback) for a streamed answer."""
        from dspark_trt.serve.text import TextStream

        cid, reqs, queue = self.start(prepared, fmt, access)
        now = int(time.time())
        include_usage = prepared.body.include_usage

        def event(obj) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        def chunk(choices) -> str:
            return event({"id": cid, "object": fmt.chunk_object, "created": now, "model": self.name,
                          "choices": choices})

        def on_close():
            self.close(cid, reqs, queue)
            access["completion_tokens"] = sum(len(r.generated_ids) for r in reqs)

        async def events():
            texts = [TextStream(self.rt.tokenizer.decode, c.stop) for c in prepared.configs]
            try:
                try:
                    for d in fmt.first_deltas(len(reqs)):
                        yield chunk([d])
                    remaining = len(reqs)
                    while remaining:
                        index, item = await queue.get()
                        if item is DRAINED:
                            self.cancel_unfinished(reqs)
                            yield event(error_body(SHUTDOWN_MESSAGE, "server_error", None, "server_shutdown"))
                            break
                        if item is not None:
                            piece = texts[index].push(item)
                            if piece:
                                yield chunk([fmt.delta(index, piece)])
                            continue
                        remaining -= 1
                        r = reqs[index]
                        self.stats.finish(r)
                        if r.finish_reason == "error":
                            yield event(error_body(f"generation failed: {r.error}", "server_error"))
                            break
                        yield chunk([fmt.delta(index, texts[index].finish(r.finish_reason), r.finish_reason)])
                    else:
                        if include_usage:
                            yield event({"id": cid, "object": fmt.chunk_object, "created": now, "model": self.name,
                                         "choices": [], "usage": self.usage(prepared, reqs),
                                         "timings": self.timings(reqs)})
                except Exception as e:  # a bug mid-stream: the status line is out, so end with an error event
                    log.error("unhandled error in stream %s", cid, exc_info=e)
                    yield event(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"))
                yield "data: [DONE]\n\n"
            finally:  # also runs when the client goes away (the stream task is cancelled)
                on_close()

        return events(), on_close


async def _watch_disconnect(request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def sse_response_class():
    import anyio
    from starlette.responses import StreamingResponse

    class SSEResponse(StreamingResponse):
        """A stream that always watches for the client going away, whatever ASGI spec version the server
        reports (Starlette only listens for http.disconnect below spec 2.4), so the stream's generator is
        cancelled and its requests are freed promptly rather than at the next failed write."""

        media_type = "text/event-stream"

        def __init__(self, content, on_close=None, **kw):
            super().__init__(content, **kw)
            self.on_close = on_close

        async def __call__(self, scope, receive, send):
            try:
                async with anyio.create_task_group() as tg:
                    async def run_stream():
                        try:
                            await self.stream_response(send)
                        except OSError:  # the connection broke while writing
                            pass
                        tg.cancel_scope.cancel()

                    tg.start_soon(run_stream)
                    await self.listen_for_disconnect(receive)
                    tg.cancel_scope.cancel()
            finally:
                # The generator's own cleanup never runs if it was never started (client gone at once).
                if self.on_close is not None:
                    self.on_close()

    return SSEResponse
