"""The command loop the peer workers (ortgenai_worker.py, vllm_worker.py) share; standard library only.

The workers run as scripts under another Python (a virtual environment with the peer engine and without
dspark_trt), which imports this file as a sibling module; under dspark_trt it is imported as usual.
Protocol: one JSON object per line on stdin (``{"cmd": ...}``), one JSON answer per line on stdout;
``quit`` (or the end of stdin) ends the loop, and an exception in a command becomes ``{"ok": false,
"error": ...}``, which the bench (peer_worker.WorkerClient) raises as a one-line error.
"""

from __future__ import annotations

import json
import os
import sys


def protocol_stream():
    """The real stdout for protocol lines; file descriptor 1 itself goes to stderr, so that nothing else
    (the engine's prints, its native code, processes it spawns) can write into the protocol."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def serve(out, handlers: dict, stdin=None) -> int:
    """Answer commands until ``quit``: handlers maps a command name to a function of the message that
    returns the answer (a dict with ``ok``)."""
    for line in stdin or sys.stdin:
        msg = json.loads(line)
        try:
            if msg["cmd"] == "quit":
                break
            handler = handlers.get(msg["cmd"])
            reply = handler(msg) if handler else {"ok": False, "error": f"unknown command {msg['cmd']!r}"}
        except Exception as e:  # reported to the bench, which raises it as a one-line error
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0
