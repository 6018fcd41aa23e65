"""The server's limits and timeouts, in one place (docs/serving.md lists them for users)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from dspark_trt.errors import DsparkError

API_KEY_ENV = "DSPARK_API_KEY"


@dataclass(frozen=True)
class ServeLimits:
    """max_body_bytes: a larger request body is answered 413 (before it is read, when Content-Length says so).
    header_timeout_s: a connection must deliver a complete request head this soon after it opens or after
    its previous response (slowloris guard; uvicorn has no such timeout), else it is closed.
    body_timeout_s: a request body must arrive completely this soon after its head, else 408 and close.
    keep_alive_s: an idle keep-alive connection is closed after this (uvicorn's timeout_keep_alive).
    max_header_bytes: the most bytes of a request head (h11_max_incomplete_event_size); more is a 400.
    shutdown_grace_s: on SIGTERM/SIGINT, live requests get this long to finish; then streams end with an
    error event and [DONE], waiting requests with a 503.
    prepare_threads: worker threads for parsing, tokenizing and chat templates (off the event loop).
    api_key: when set, every route but /health needs `Authorization: Bearer <api_key>` (else 401)."""

    max_body_bytes: int = 2 * 1024 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    max_header_bytes: int = 16 * 1024
    shutdown_grace_s: float = 5.0
    prepare_threads: int = 4
    api_key: str | None = None

    def __post_init__(self):
        for name in ("max_body_bytes", "max_header_bytes", "prepare_threads"):
            if int(getattr(self, name)) < 1:
                raise DsparkError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not float(getattr(self, name)) > 0:
                raise DsparkError(f"{name} must be > 0, got {getattr(self, name)}")
        if not float(self.shutdown_grace_s) >= 0:
            raise DsparkError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if self.api_key is not None and (not self.api_key or not self.api_key.isprintable()
                                         or not self.api_key.isascii() or " " in self.api_key):
            raise DsparkError("the API key must be non-empty printable ASCII without spaces")


def api_key_from(option: str | None) -> str | None:
    """--api-key, else $DSPARK_API_KEY, else None (no key required)."""
    if option:
        return option
    return os.environ.get(API_KEY_ENV) or None
