"""Pure ASGI middleware around the app (outermost first): HTTPGuard, ApiKeyAuth, BodyLimit.

HTTPGuard counts every response by status, turns any exception that escapes the app into a JSON 500 in
OpenAI's shape (Starlette's own handler re-raises it, and uvicorn then resets a keep-alive connection), and
writes one access line per request. ApiKeyAuth answers 401 without the right bearer key. BodyLimit reads a
request body into memory up to a size limit (413 beyond it) and a deadline (408), so the app never sees a
body it has not fully received and a slow client cannot hold a request open.
(BaseHTTPMiddleware is not used: it breaks the cancellation of streams when a client goes away.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time

from dspark_trt.serve.protocol import error_body

log = logging.getLogger("dspark_trt.serve")
ACCESS_KEY = "dspark.access"  # scope key: a dict the handlers fill with token counts for the access line


async def send_json(send, status: int, body: dict, headers: list | None = None) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": data, "more_body": False})


class HTTPGuard:
    def __init__(self, app, stats, access_log: logging.Logger | None = None):
        self.app, self.stats, self.access_log = app, stats, access_log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = None
        info = scope.setdefault(ACCESS_KEY, {})

        async def counting_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                self.stats.count(status)
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception as exc:  # a bug: answer it, keep the connection (CancelledError is not caught)
            log.error("unhandled error in %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
            if status is None:
                await send_json(counting_send, 500, error_body(f"internal error: {type(exc).__name__}: {exc}",
                                                               "server_error"))
        finally:
            if self.access_log is not None:
                self._log(scope, status, (time.perf_counter() - t0) * 1e3, info)

    def _log(self, scope, status, ms, info) -> None:
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "-"
        tokens = (f"{info['prompt_tokens']}+{info['completion_tokens']}" if "prompt_tokens" in info else "-")
        self.access_log.info('%s "%s %s" %s %.1f ms tokens=%s', who, scope.get("method"), scope.get("path"),
                             status if status is not None else "-", ms, tokens)


class ApiKeyAuth:
    """Every route except `open_paths` needs `Authorization: Bearer <key>`."""

    def __init__(self, app, key: str, open_paths=("/health",)):
        self.app, self.expected, self.open_paths = app, f"Bearer {key}".encode(), set(open_paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path") not in self.open_paths:
            given = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
            if not secrets.compare_digest(given, self.expected):
                message = ("missing API key: send it as `Authorization: Bearer <key>`" if not given else
                           "incorrect API key")
                return await send_json(send, 401, error_body(message, "invalid_request_error", None,
                                                             "invalid_api_key"),
                                       [(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)


class BodyLimit:
    """Buffers request bodies of POST/PUT/PATCH/DELETE: at most `max_bytes` (413), all within `timeout_s`
    of the head (408, connection closed). The app then receives the whole body as one message, and the
    connection's later messages (http.disconnect) as they come."""

    METHODS = ("POST", "PUT", "PATCH", "DELETE")

    def __init__(self, app, max_bytes: int, timeout_s: float):
        self.app, self.max_bytes, self.timeout_s = app, int(max_bytes), float(timeout_s)

    def _too_large(self, send, size: str):
        mib = self.max_bytes / (1 << 20)
        return send_json(send, 413, error_body(f"request body is {size}; this server accepts at most "
                                               f"{self.max_bytes} bytes ({mib:.3g} MiB)", "invalid_request_error",
                                               None, "request_too_large"))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") not in self.METHODS:
            return await self.app(scope, receive, send)
        length = next((v for k, v in scope.get("headers", []) if k == b"content-length"), None)
        if length is not None and length.strip().isdigit() and int(length) > self.max_bytes:
            return await self._too_large(send, f"{int(length)} bytes")
        chunks, size = [], 0
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return await send_json(send, 408, error_body(f"the request body did not arrive within "
                                                             f"{self.timeout_s:g} s", "invalid_request_error",
                                                             None, "request_timeout"),
                                       [(b"connection", b"close")])
            if message["type"] == "http.disconnect":
                return  # the client went away before its request was complete: nobody to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                return await self._too_large(send, f"over {self.max_bytes} bytes")
            chunks.append(body)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return whole
            return await receive()

        await self.app(scope, replay, send)
