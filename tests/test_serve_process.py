"""Shutdown and the real `dspark-trt serve` process (issue 19, items 5 and 7): live streams end with a final
error event and [DONE] (never a cut connection) when the server stops; the process prints its URL, logs one
access line per request, requires DSPARK_API_KEY when set, and holds its memory and /health latency under
overload requests."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import stop_process
from serve_helpers import HealthProbe, openai_error, rt, slow_steps  # noqa: F401 (fixtures)

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from dspark_trt.serve.limits import ServeLimits  # noqa: E402
from dspark_trt.serve.server import ServerThread, create_app  # noqa: E402

MODEL = "tiny"
# Peak memory the overload requests may add to the server process (a 10**8 max_tokens once added 3.5 GB).
OVERLOAD_MEMORY_BYTES = 256 * 1024 * 1024


def data_events(lines):
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def stream_then(url, body, action, headers=None):
    """Start a stream, read its first event, run `action` in a thread, return all data events."""
    with httpx.Client(timeout=60, headers=headers or {}) as c:
        with c.stream("POST", f"{url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            events = []
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
                    break
            t = threading.Thread(target=action)
            t.start()
            events += data_events(lines)
    t.join()
    return events


def test_stop_ends_live_requests_with_an_answer(rt, slow_steps):
    srv = ServerThread(create_app(rt, model_name=MODEL, limits=ServeLimits(shutdown_grace_s=0))).start()
    waiting = {}

    def non_stream():
        waiting["r"] = httpx.post(f"{srv.url}/v1/completions", timeout=60,
                                  json={"prompt": "import os\n", "max_tokens": 200, "temperature": 0, "spec": "off"})

    t = threading.Thread(target=non_stream)
    t.start()
    time.sleep(0.2)
    body = {"prompt": "def fib(n):", "max_tokens": 200, "temperature": 0, "stream": True, "spec": "off"}
    events = stream_then(srv.url, body, srv.stop)
    t.join()
    assert events[-1] == "[DONE]", events[-3:]
    last = json.loads(events[-2])
    assert last["error"]["code"] == "server_shutdown" and last["error"]["type"] == "server_error", last
    assert all("choices" in json.loads(e) for e in events[:-2])
    err = openai_error(waiting["r"], 503, code="server_shutdown")
    assert err["type"] == "server_error"
    assert not [s for s in rt.slots if s is not None] or rt.wait_idle(10)


def test_stop_lets_short_streams_finish_within_the_grace_period(rt, slow_steps):
    srv = ServerThread(create_app(rt, model_name=MODEL, limits=ServeLimits(shutdown_grace_s=30))).start()
    body = {"prompt": "def fib(n):", "max_tokens": 30, "temperature": 0, "stream": True, "spec": "off"}
    events = stream_then(srv.url, body, srv.stop)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("length", "stop")


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_serve_process_end_to_end(tiny_artifact, rt):
    port = _free_port()
    env = {**os.environ, "DSPARK_API_KEY": "k3y"}
    proc = subprocess.Popen([sys.executable, "-m", "dspark_trt.cli", "serve", str(tiny_artifact), "--port", str(port),
                             "--max-batch", "1", "--shutdown-grace", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    auth = {"authorization": "Bearer k3y"}
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert proc.poll() is None, proc.stdout.read()

        # The key (from $DSPARK_API_KEY) guards everything but /health.
        openai_error(httpx.get(f"{url}/v1/models"), 401, code="invalid_api_key")
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="k3y", max_retries=0, timeout=60)
        name = c.models.list().data[0].id
        msgs = [{"role": "user", "content": "def fib(n):"}]
        r = c.chat.completions.create(model=name, messages=msgs, max_tokens=6, temperature=0)
        streamed = "".join(ch.choices[0].delta.content or "" for ch in
                           c.chat.completions.create(model=name, messages=msgs, max_tokens=6, temperature=0,
                                                     stream=True))
        assert streamed == r.choices[0].message.content

        # Overload requests: answered, /health stays fast, memory stays flat.
        before = _peak_rss(proc.pid)
        big = json.dumps({"prompt": "x" * (5 * 1024 * 1024)}).encode()
        with HealthProbe(url) as probe:
            openai_error(httpx.post(f"{url}/v1/completions", content=big, headers=auth, timeout=60), 413)
            openai_error(httpx.post(f"{url}/v1/completions", headers=auth, timeout=60,
                                    content=(big[i:i + 65536] for i in range(0, len(big), 65536))), 413)
            for value in ("100000000", "1000000000", "1e30"):
                raw = f'{{"prompt": "def fib(n):", "max_tokens": {value}}}'.encode()
                openai_error(httpx.post(f"{url}/v1/completions", content=raw, headers=auth, timeout=60), 400,
                             "max_tokens")
            ok = httpx.post(f"{url}/v1/completions", headers=auth, timeout=60,
                            json={"prompt": "def fib(n):", "max_tokens": rt.max_context - 8, "seed": 3})
            assert ok.status_code == 200, ok.text
        probe.check()
        grown = _peak_rss(proc.pid) - before
        assert grown < OVERLOAD_MEMORY_BYTES, grown

        # SIGTERM while streams run: each ends with [DONE], not a cut connection. One batch slot: the first
        # stream runs, the other two wait in the queue behind it, so they surely meet the shutdown.
        body = {"model": name, "prompt": "def fib(n):", "max_tokens": rt.max_context - 8, "temperature": 0,
                "stream": True, "spec": "off"}
        queued, results, answered = [], [], threading.Semaphore(0)

        def waiter():
            with httpx.Client(timeout=60, headers=auth) as h:
                with h.stream("POST", f"{url}/v1/completions", json=body) as resp:
                    answered.release()  # the status line is in: the request is queued
                    results.append(data_events(resp.iter_lines()))

        def terminate():
            for _ in range(2):
                queued.append(threading.Thread(target=waiter))
                queued[-1].start()
            for _ in range(2):
                assert answered.acquire(timeout=60)
            proc.send_signal(signal.SIGTERM)

        events = stream_then(url, body, terminate, headers=auth)
        for t in queued:
            t.join()
        assert len(results) == 2
        for ev in [events, *results]:
            assert ev[-1] == "[DONE]", ev[-3:]
            last = json.loads(ev[-2])
            assert "error" in last or last["choices"][0]["finish_reason"] in ("length", "stop"), last
        for ev in results:
            assert json.loads(ev[-2])["error"]["code"] == "server_shutdown", ev[-3:]
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            stop_process(proc, timeout=30)
    out = proc.stdout.read()
    assert f"at {url} (OpenAI base URL {url}/v1" in out.splitlines()[0] or f"at {url}" in out, out[:2000]
    access = [line for line in out.splitlines() if re.search(r'"(GET|POST) /\S*" \d{3} [0-9.]+ ms tokens=', line)]
    assert any('"GET /v1/models" 401' in line for line in access), out[-3000:]
    assert any(re.search(r'"POST /v1/chat/completions" 200 [0-9.]+ ms tokens=\d+\+\d+', line) for line in access)
    assert sum('"POST /v1/completions" 413' in line for line in access) == 2
    assert sum('"POST /v1/completions" 400' in line for line in access) == 3
    assert len([line for line in access if "/health" not in line]) == 13, access  # one line per request
