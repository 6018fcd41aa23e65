"""uvicorn set up with the server's limits: timeouts, a request-head deadline, graceful shutdown.

uvicorn (0.2x-0.5x) has an idle keep-alive timeout but no timeout for reading a request head: a connection
that sends nothing, or a header line a byte at a time, stays open forever (slowloris). `GuardedH11` adds
one to uvicorn's h11 protocol: a connection must deliver a complete request head within header_timeout_s of
opening or of its previous response, else it is closed. It also answers a malformed or oversized request
head (uvicorn's plain-text 400) in OpenAI's error shape, and counts it.
"""

from __future__ import annotations

import json
import logging

from dspark_trt.serve.protocol import error_body

log = logging.getLogger("dspark_trt.serve")


def _protocol_class(header_timeout_s: float, max_header_bytes: int, on_bad_request=None):
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._head_cycle = self.cycle
            self._head_timer = None
            self._arm_head_deadline()

        def _arm_head_deadline(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_cycle = self.cycle
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_deadline)

        def _head_deadline(self) -> None:
            self._head_timer = None
            if self.cycle is self._head_cycle and not self.transport.is_closing():
                log.info("closing a connection that sent no complete request head within %g s", header_timeout_s)
                self.transport.close()  # no request in flight on it: nobody to answer

        def handle_events(self) -> None:
            super().handle_events()
            if self._head_timer is not None and self.cycle is not self._head_cycle:
                self._head_timer.cancel()  # a request head arrived
                self._head_timer = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.cycle is not None and self.cycle.response_complete:
                self._arm_head_deadline()

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            body = json.dumps(error_body(f"invalid HTTP request: the request line or headers are malformed or "
                                         f"longer than {max_header_bytes} bytes",
                                         code="invalid_http_request")).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()
            if on_bad_request is not None:
                on_bad_request(400)

    return GuardedH11


def make_server(app, sock, limits, log_level: str = "info", on_exit=None, on_bad_request=None):
    """A uvicorn.Server for `app` on the bound `sock`. on_exit: called (from the signal handler's thread)
    when SIGTERM/SIGINT or stop() asks the server to exit, before uvicorn starts its graceful shutdown.
    on_bad_request(status): called for each malformed request head answered outside the app."""
    import uvicorn

    try:
        http = _protocol_class(limits.header_timeout_s, limits.max_header_bytes, on_bad_request)
    except ImportError:  # pragma: no cover - uvicorn reorganised its internals
        log.warning("uvicorn's h11 protocol was not found: no request-head timeout")
        http = "h11"
    config = uvicorn.Config(app, host=sock.getsockname()[0], port=sock.getsockname()[1], log_level=log_level,
                            http=http, access_log=False, timeout_keep_alive=limits.keep_alive_s,
                            h11_max_incomplete_event_size=limits.max_header_bytes,
                            timeout_graceful_shutdown=int(limits.shutdown_grace_s) + 3)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if on_exit is not None:
                on_exit()
            super().handle_exit(sig, frame)

    return Server(config)
