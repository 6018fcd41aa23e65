"""OpenAI-compatible HTTP server around one Runtime (FastAPI + uvicorn).

    app = create_app(runtime, model_name="tiny")       # the ASGI app; the caller owns the runtime
    with ServerThread(app) as srv:                      # uvicorn in a thread on a free 127.0.0.1 port
        openai.OpenAI(base_url=srv.url + "/v1", api_key="x").completions.create(...)
    serve("artifacts/tiny", port=8000)                  # what `dspark-trt serve` runs

Endpoints: POST /v1/completions and POST /v1/chat/completions (JSON or SSE stream), GET /v1/models,
GET /v1/models/{id}, GET /health, GET /metrics (Prometheus text). Concurrent requests are batched by the
runtime's worker; this module only translates. Every request gets an answer in OpenAI's error shape when it
fails: 400 for a bad body or field (naming it), 401 without the API key (when one is set), 404 for an unknown
model or path, 408/413 for a slow or too large body, 429 when the runtime's queue is full, 500 for a bug
(the connection stays usable), 503 for a closed runtime or a shutdown. Parsing, tokenizing and chat templates
run in worker threads, never on the event loop. Limits: limits.py; docs/serving.md.
"""

# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations at definition time.
import asyncio
import json
import logging
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dspark_trt.errors import DsparkError

ACCESS_LOGGER = "dspark_trt.serve.access"


def _require_web():
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:  # pragma: no cover - the [serve] extra is missing
        raise DsparkError(f"serving needs FastAPI and uvicorn ({e.name} is missing): "
                          "pip install 'dspark-trt[serve]'") from None


# ---------------------------------------------------------------------- the app
def create_app(runtime, model_name: str | None = None, *, max_prompts: int = 64, limits=None,
               chat_template=None, access_log: bool = True):
    """The FastAPI app serving `runtime` (a dspark_trt.runtime.Runtime). The caller owns the runtime:
    the app never closes it. model_name: the id clients pass as `model` (default: the artifact folder name).
    max_prompts: most prompts one request may carry. limits: a ServeLimits (default: its defaults).
    chat_template: a ChatTemplate (default: the artifact's, see chat.py). access_log: one line per request
    to the `dspark_trt.serve.access` logger."""
    _require_web()
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from dspark_trt.serve.chat import ChatTemplate
    from dspark_trt.serve.generation import ChatFormat, CompletionFormat, Generations, ServerStats, sse_response_class
    from dspark_trt.serve.lifecycle import Drain
    from dspark_trt.serve.limits import ServeLimits
    from dspark_trt.serve.middleware import ACCESS_KEY, ApiKeyAuth, BodyLimit, HTTPGuard
    from dspark_trt.serve.prepare import prepare_chat, prepare_completion
    from dspark_trt.serve.prometheus import CONTENT_TYPE, render_metrics
    from dspark_trt.serve.protocol import OpenAIError, error_body, validation_message

    # The tokenizer's batch API (which releases the GIL) would otherwise start a thread pool, and the
    # tokenizers library then warns in every process this one forks.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rt = runtime
    limits = limits or ServeLimits()
    name = model_name or Path(str(getattr(rt, "artifact_dir", "dspark"))).name or "dspark"
    if chat_template is None:
        chat_template = ChatTemplate.for_artifact(rt.artifact_dir) if getattr(rt, "artifact_dir", None) else \
            ChatTemplate()
    created = int(time.time())
    stats = ServerStats()
    drain = Drain(limits.shutdown_grace_s)
    inflight: dict = {}  # completion id -> list of runtime Requests (for tests and debugging)
    gens = Generations(rt, name, stats, drain, inflight)
    pool = ThreadPoolExecutor(limits.prepare_threads, thread_name_prefix="dspark-prepare")
    SSEResponse = sse_response_class()

    app = FastAPI(title="dspark-trt", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)
    # Added innermost first: HTTPGuard (counts, catches, logs) wraps the key check, which wraps the body limit.
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes, timeout_s=limits.body_timeout_s)
    if limits.api_key:
        app.add_middleware(ApiKeyAuth, key=limits.api_key)
    app.add_middleware(HTTPGuard, stats=stats, access_log=logging.getLogger(ACCESS_LOGGER) if access_log else None)
    app.state.runtime = rt
    app.state.model_name = name
    app.state.stats = stats
    app.state.inflight = inflight
    app.state.limits = limits
    app.state.drain = drain
    app.state.chat_template = chat_template

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

    # (No handler for Exception: Starlette's re-raises after answering, and uvicorn then drops the
    # keep-alive connection. HTTPGuard answers those with a JSON 500 instead.)

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

    # ------------------------------------------------------------------ completions, chat
    async def _answer(request: Request, prepare, fmt, *args):
        raw = await request.body()  # already read whole by BodyLimit, within its size and time limits
        loop = asyncio.get_running_loop()
        prepared = await loop.run_in_executor(pool, prepare, raw, rt, name, *args)
        access = request.scope.setdefault(ACCESS_KEY, {})
        if prepared.body.stream:
            events, on_close = gens.stream(prepared, fmt, access)
            return SSEResponse(events, on_close=on_close,
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await gens.collect(request, prepared, fmt, access)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _answer(request, prepare_completion, CompletionFormat(), max_prompts)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _answer(request, prepare_chat, ChatFormat(), chat_template)

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


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class ServerThread:
    """uvicorn serving `app` in a background thread, on 127.0.0.1 and a free port unless told otherwise.

        with ServerThread(app) as srv:
            httpx.get(srv.url + "/health")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        _require_web()
        from dspark_trt.serve.limits import ServeLimits
        from dspark_trt.serve.transport import make_server

        self.app = app
        self.sock = _bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        state = getattr(app, "state", None)
        drain = getattr(state, "drain", None)
        stats = getattr(state, "stats", None)
        self.drain = drain
        self.server = make_server(app, self.sock, getattr(state, "limits", None) or ServeLimits(), log_level,
                                  on_exit=drain.begin if drain is not None else None,
                                  on_bad_request=stats.count if stats is not None else None)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="dspark-uvicorn")

    @property
    def url(self) -> str:
        return _url(self.host, self.port)

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
        """Stop as SIGTERM would: live requests get the shutdown grace period, then an answer."""
        if self.drain is not None:
            self.drain.begin()
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


def _log_to_stderr(level: str) -> None:
    logger = logging.getLogger("dspark_trt.serve")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level.upper())


def _run_until_signalled(server, sock) -> None:
    """server.run(), and exit status 0 after a SIGTERM's graceful shutdown (uvicorn re-raises the signal once
    it has shut down, which would otherwise kill the process before the runtime is closed)."""
    import signal

    def stop_cleanly(signum, frame):
        raise SystemExit(0)

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, stop_cleanly) if main else None
    try:
        server.run(sockets=[sock])
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def serve(artifact_dir, backend: str = "ort", host: str = "127.0.0.1", port: int = 8000,
          max_batch: int | None = None, max_queue: int | None = 256, model_name: str | None = None,
          log_level: str = "info", limits=None, max_context: int | None = None) -> None:
    """Load the artifact and serve it until SIGTERM or Ctrl-C; what `dspark-trt serve` runs. limits: a
    ServeLimits (body size, timeouts, shutdown grace, API key); max_context may only lower the artifact's."""
    _require_web()
    from dspark_trt.runtime import Runtime
    from dspark_trt.serve.limits import ServeLimits
    from dspark_trt.serve.transport import make_server

    limits = limits or ServeLimits()
    sock = _bind(host, port)  # bind first: a busy port fails fast, before the engines load
    try:
        rt = Runtime.load(artifact_dir, backend=backend, max_batch=max_batch, max_queue=max_queue,
                          max_context=max_context)
        try:
            name = model_name or Path(artifact_dir).resolve().name
            app = create_app(rt, model_name=name, limits=limits)
            _log_to_stderr(log_level)
            server = make_server(app, sock, limits, log_level, on_exit=app.state.drain.begin,
                                 on_bad_request=app.state.stats.count)
            url = _url(*sock.getsockname()[:2])
            template = app.state.chat_template.origin
            print(f"dspark-trt: serving {name} at {url} (OpenAI base URL {url}/v1; chat template: {template}; "
                  f"API key {'required' if limits.api_key else 'not required'})", flush=True)
            _run_until_signalled(server, sock)
        finally:
            rt.close()
    finally:
        sock.close()
