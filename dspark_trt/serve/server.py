"""OpenAI-compatible HTTP server around one Runtime (FastAPI + uvicorn).

    app = create_app(runtime, model_name="tiny")       # the ASGI app; the caller owns the runtime
    with ServerThread(app) as srv:                      # uvicorn in a thread on a free 127.0.0.1 port
        openai.OpenAI(base_url=srv.url + "/v1", api_key="x").completions.create(...)
    serve("artifacts/tiny", port=8000)                  # what `dspark-trt serve` runs

Endpoints: POST /v1/completions (JSON or SSE stream), GET /v1/models, GET /v1/models/{id}, GET /health,
GET /metrics (Prometheus text). Concurrent requests are batched by the runtime's worker; this module only
translates. Every request gets an answer: 400 for a bad body (OpenAI error shape, validation errors
included), 404 for an unknown model or path, 429 when the runtime's queue is full, 500/503 for engine
failures or a closed runtime. A client that goes away (stream or not) cancels its requests, which frees
their KV slots at the runtime's next step.
"""

# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations at definition time,
# and the request model is imported inside create_app (FastAPI stays an optional dependency).
import asyncio
import json
import secrets
import socket
import threading
import time
import uuid
from pathlib import Path

from dspark_trt.errors import DsparkError


def _require_web():
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:  # pragma: no cover - the [serve] extra is missing
        raise DsparkError(f"serving needs FastAPI and uvicorn ({e.name} is missing): "
                          "pip install 'dspark-trt[serve]'") from None


# ---------------------------------------------------------------------- runtime <-> asyncio bridge
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


class _ServerStats:
    """Counters kept by the HTTP layer (touched only from the event loop)."""

    def __init__(self):
        self.finished: dict[str, int] = {}
        self.rejected = 0
        self.responses: dict[int, int] = {}
        self.prompt_tokens = 0
        self.decode_tokens = 0  # generated tokens after the first, summed over finished requests
        self.decode_steps = 0  # decode steps, summed over finished requests
        self.cancelled = 0  # requests cancelled because their client went away

    def cancel(self) -> None:
        self.cancelled += 1
        self.finished["cancelled"] = self.finished.get("cancelled", 0) + 1

    def finish(self, req) -> None:
        reason = req.finish_reason or "error"
        self.finished[reason] = self.finished.get(reason, 0) + 1
        if req.stats.steps:
            self.decode_tokens += max(0, req.stats.generated - 1)
            self.decode_steps += req.stats.steps


class _StatusCounter:
    """Pure ASGI middleware counting responses by status (BaseHTTPMiddleware would break stream cancel)."""

    def __init__(self, app, stats: _ServerStats):
        self.app, self.stats = app, stats

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                code = int(message["status"])
                self.stats.responses[code] = self.stats.responses.get(code, 0) + 1
            await send(message)

        await self.app(scope, receive, counting_send)


def _sse_response_class():
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


# ---------------------------------------------------------------------- the app
def create_app(runtime, model_name: str | None = None, *, max_prompts: int = 64):
    """The FastAPI app serving `runtime` (a dspark_trt.runtime.Runtime). The caller owns the runtime:
    the app never closes it. model_name: the id clients pass as `model` (default: the artifact folder name).
    max_prompts: most prompts one request may carry."""
    _require_web()
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from dspark_trt.runtime.config import GenerationConfig, parse_spec
    from dspark_trt.runtime.runtime import QueueFullError
    from dspark_trt.serve.prometheus import CONTENT_TYPE, render_metrics
    from dspark_trt.serve.protocol import CompletionRequest, OpenAIError, error_body, validation_message
    from dspark_trt.serve.text import TextStream

    rt = runtime
    name = model_name or Path(str(getattr(rt, "artifact_dir", "dspark"))).name or "dspark"
    created = int(time.time())
    stats = _ServerStats()
    SSEResponse = _sse_response_class()

    app = FastAPI(title="dspark-trt", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_StatusCounter, stats=stats)
    app.state.runtime = rt
    app.state.model_name = name
    app.state.stats = stats
    app.state.inflight = {}  # completion id -> list of runtime Requests (for tests and debugging)

    # ------------------------------------------------------------------ errors, all in OpenAI's shape
    @app.exception_handler(OpenAIError)
    async def _openai_error(request, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        message, param = validation_message(list(exc.errors()))
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return JSONResponse(error_body(message, kind), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"),
                            status_code=500)

    # ------------------------------------------------------------------ small endpoints
    def _model_card() -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "dspark-trt",
                "max_model_len": int(getattr(rt, "max_context", 0))}

    @app.get("/health")
    async def health():
        if getattr(rt, "_closed", False):
            return JSONResponse({"status": "closed"}, status_code=503)
        return {"status": "ok", "model": name}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id != name:
            raise OpenAIError(404, f"the model `{model_id}` does not exist", param="model", code="model_not_found")
        return _model_card()

    @app.get("/metrics")
    async def metrics():
        snap = rt.metrics.snapshot()
        hist = dict(getattr(rt.metrics, "budget_hist", {}) or {})
        server = {"finished": dict(stats.finished), "rejected": stats.rejected, "responses": dict(stats.responses),
                  "prompt_tokens": stats.prompt_tokens, "decode_tokens": stats.decode_tokens,
                  "decode_steps": stats.decode_steps, "active": sum(s is not None for s in list(rt.slots)),
                  "max_batch": rt.max_batch}
        return PlainTextResponse(render_metrics(snap, server, hist), media_type=CONTENT_TYPE)

    # ------------------------------------------------------------------ completions
    def _prepare(body: CompletionRequest):
        body.check_supported()
        if body.model is not None and body.model != name:
            raise OpenAIError(404, f"the model `{body.model}` does not exist; this server serves `{name}`",
                              param="model", code="model_not_found")
        prompts = body.prompts()
        if len(prompts) > max_prompts:
            raise OpenAIError(400, f"at most {max_prompts} prompts per request, got {len(prompts)}", param="prompt")
        try:
            parse_spec(body.spec, rt.max_draft)
        except DsparkError as e:
            raise OpenAIError(400, str(e), param="spec") from None
        ids_list = []
        for p in prompts:
            try:
                ids = rt.tokenizer.encode(p) if isinstance(p, str) else rt.encode(p)
            except DsparkError as e:
                raise OpenAIError(400, str(e), param="prompt") from None
            if not ids:
                raise OpenAIError(400, "prompt encodes to no tokens", param="prompt")
            if len(ids) >= rt.max_context:
                raise OpenAIError(400, f"prompt has {len(ids)} tokens; this model's maximum context length is "
                                  f"{rt.max_context} tokens", param="prompt", code="context_length_exceeded")
            ids_list.append(ids)
        temperature = 1.0 if body.temperature is None else float(body.temperature)
        seed = body.seed if body.seed is not None else (secrets.randbits(31) if temperature > 0 else 0)
        config = GenerationConfig(max_new_tokens=int(body.max_tokens or 16), temperature=temperature,
                                  spec=body.spec, seed=int(seed), stop=body.stop_list())
        return ids_list, config

    def _submit_all(ids_list, config):
        reqs = []
        try:
            for ids in ids_list:
                reqs.append(rt.submit(ids, config, stream=True))
        except QueueFullError as e:
            for r in reqs:
                rt.cancel(r)
            stats.rejected += 1
            raise OpenAIError(429, f"server is busy: {e}; retry later", type="rate_limit_error",
                              code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None
        except DsparkError as e:
            for r in reqs:
                rt.cancel(r)
            if getattr(rt, "_closed", False):
                raise OpenAIError(503, f"server is shutting down: {e}", type="server_error") from None
            raise OpenAIError(400, str(e)) from None
        stats.prompt_tokens += sum(len(i) for i in ids_list)
        return reqs

    def _bridge(reqs) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        for i, r in enumerate(reqs):
            threading.Thread(target=_forward, args=(rt, r, loop, queue, i), daemon=True,
                             name=f"dspark-http-{r.id}").start()
        return queue

    def _cancel_unfinished(reqs) -> None:
        for r in reqs:
            if not r.finished and not r.cancelled:
                rt.cancel(r)
                stats.cancel()

    def _usage(ids_list, reqs) -> dict:
        p = sum(len(i) for i in ids_list)
        c = sum(len(r.generated_ids) for r in reqs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    async def _watch_disconnect(request: Request) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        ids_list, config = _prepare(body)
        reqs = _submit_all(ids_list, config)
        cid = f"cmpl-{uuid.uuid4().hex}"
        now = int(time.time())
        app.state.inflight[cid] = reqs
        queue = _bridge(reqs)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            def on_close():
                _cancel_unfinished(reqs)
                app.state.inflight.pop(cid, None)

            return SSEResponse(_stream(cid, now, ids_list, reqs, queue, config, include_usage), on_close=on_close,
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watcher = asyncio.ensure_future(_watch_disconnect(request))
        try:
            remaining = len(reqs)
            while remaining:
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    _cancel_unfinished(reqs)  # nobody is listening any more
                    return JSONResponse(error_body("client disconnected"), status_code=499)
                _, item = getter.result()
                if item is None:
                    remaining -= 1
        finally:
            watcher.cancel()
            _cancel_unfinished(reqs)
            app.state.inflight.pop(cid, None)
        choices = []
        for i, r in enumerate(reqs):
            stats.finish(r)
            if r.finish_reason == "error":
                raise OpenAIError(500, f"generation failed: {r.error}", type="server_error")
            res = rt.result(r)
            choices.append({"index": i, "text": res.text, "logprobs": None, "finish_reason": res.finish_reason})
        return {"id": cid, "object": "text_completion", "created": now, "model": name, "choices": choices,
                "usage": _usage(ids_list, reqs)}

    async def _stream(cid, now, ids_list, reqs, queue, config, include_usage):
        def event(obj) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        def chunk(index, text, finish_reason=None) -> str:
            return event({"id": cid, "object": "text_completion", "created": now, "model": name,
                          "choices": [{"index": index, "text": text, "logprobs": None,
                                       "finish_reason": finish_reason}]})

        texts = [TextStream(rt.tokenizer.decode, config.stop) for _ in reqs]
        try:
            remaining = len(reqs)
            while remaining:
                index, item = await queue.get()
                if item is not None:
                    piece = texts[index].push(item)
                    if piece:
                        yield chunk(index, piece)
                    continue
                remaining -= 1
                r = reqs[index]
                stats.finish(r)
                if r.finish_reason == "error":
                    yield event(error_body(f"generation failed: {r.error}", "server_error"))
                    break
                yield chunk(index, texts[index].finish(r.finish_reason), r.finish_reason)
            else:
                if include_usage:
                    yield event({"id": cid, "object": "text_completion", "created": now, "model": name,
                                 "choices": [], "usage": _usage(ids_list, reqs)})
            yield "data: [DONE]\n\n"
        finally:  # also runs when the client goes away (the stream task is cancelled)
            _cancel_unfinished(reqs)
            app.state.inflight.pop(cid, None)

    return app


# ---------------------------------------------------------------------- running it
def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise DsparkError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class ServerThread:
    """uvicorn serving `app` in a background thread, on 127.0.0.1 and a free port unless told otherwise.

        with ServerThread(app) as srv:
            httpx.get(srv.url + "/health")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        _require_web()
        import uvicorn

        self.app = app
        self.sock = _bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(app, host=host, port=self.port, log_level=log_level, timeout_graceful_shutdown=3)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="dspark-uvicorn")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise DsparkError("the HTTP server failed to start (see the log above)")
            if time.monotonic() > deadline:
                self.stop()
                raise DsparkError(f"the HTTP server did not start within {timeout:.0f} s")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout)
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def serve(artifact_dir, backend: str = "ort", host: str = "127.0.0.1", port: int = 8000,
          max_batch: int | None = None, max_queue: int | None = 256, model_name: str | None = None,
          log_level: str = "info", max_context: int | None = None) -> None:
    """Load the artifact and serve it until interrupted (Ctrl-C); what `dspark-trt serve` runs."""
    _require_web()
    import uvicorn

    from dspark_trt.runtime import Runtime

    sock = _bind(host, port)  # bind first: a busy port fails fast, before the engines load
    try:
        rt = Runtime.load(artifact_dir, backend=backend, max_batch=max_batch, max_queue=max_queue,
                          max_context=max_context)
        try:
            app = create_app(rt, model_name=model_name or Path(artifact_dir).resolve().name)
            config = uvicorn.Config(app, host=host, port=sock.getsockname()[1], log_level=log_level,
                                    timeout_graceful_shutdown=5)
            uvicorn.Server(config).run(sockets=[sock])
        finally:
            rt.close()
    finally:
        sock.close()
