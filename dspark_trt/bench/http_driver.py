"""The open loop over HTTP: a real `dspark-trt serve` subprocess, driven as a streaming client would.

Each request is `POST /v1/completions` with ``stream: true`` (and ``stream_options.include_usage`` for the
token count), its prompt as token ids (the same tokens as in process), ``spec`` the mode, ``seed`` and
``temperature`` from the workload, and ``ignore_eos`` so every answer runs to its drawn length as in process
(a server without the field would stop at EOS, so counts come from the server's usage figure). A chunk's
arrival is the time a client sees its text; the queue wait (arrival at the runtime to a batch slot) comes
from the `timings` object the server sends beside it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from dspark_trt.bench.inprocess import new_record, run_end
from dspark_trt.errors import DsparkError


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`dspark-trt serve ARTIFACT` on 127.0.0.1 and a free port, its output in ``log_path``.

        with ServeProcess(art, backend="ort", log_path=out / "server.log") as srv:
            run_http(srv.url, items, arrivals, "adaptive")
    """

    def __init__(self, artifact_dir, backend: str = "ort", log_path=None, api_key: str | None = None,
                 extra_args: list[str] | None = None, start_timeout: float = 180.0):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.cmd = [sys.executable, "-m", "dspark_trt.cli", "serve", str(artifact_dir), "--backend", backend,
                    "--host", "127.0.0.1", "--port", str(self.port), *(extra_args or [])]
        if api_key:
            self.cmd += ["--api-key", api_key]
        self.log_path = Path(log_path) if log_path else None
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def start(self) -> "ServeProcess":
        import httpx

        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DsparkError(f"`{' '.join(self.cmd[2:])}` exited with code {self.proc.returncode} before "
                                  f"serving" + (f"; see {self.log_path}" if self.log_path else ""))
            try:
                if httpx.get(self.url + "/health", headers=self.headers(), timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise DsparkError(f"the server did not answer /health within {self.start_timeout:.0f} s")

    def stop(self, timeout: float = 20.0) -> None:
        import signal

        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def run_http(url: str, items, arrivals, mode: str, headers: dict | None = None,
             timeout_s: float = 600.0) -> tuple[list[dict], float]:
    """Send ``items[i]`` at ``arrivals[i]`` seconds to ``url`` (streaming); returns (records, wall seconds
    from the schedule's start to the last answer)."""
    import asyncio

    return asyncio.run(_run(url, items, arrivals, mode, headers or {}, timeout_s))


async def _run(url, items, arrivals, mode, headers, timeout_s):
    import asyncio

    import httpx

    records = [new_record(i, it, at) for i, (it, at) in enumerate(zip(items, arrivals))]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(timeout_s, connect=30.0)) as client:
        t0 = time.perf_counter()

        async def one(rec, item):
            delay = t0 + rec["arrival_s"] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rec["sent_s"] = time.perf_counter() - t0
            body = {"prompt": list(item.ids), "max_tokens": item.max_tokens, "temperature": item.temperature,
                    "seed": item.seed, "spec": mode, "stream": True, "stream_options": {"include_usage": True},
                    "ignore_eos": True}
            try:
                await _stream(client, body, rec, t0)
            except httpx.HTTPError as e:
                rec["ok"], rec["error"] = False, f"{type(e).__name__}: {e}"

        await asyncio.gather(*(one(r, it) for r, it in zip(records, items)))
    return records, run_end(records)


async def _stream(client, body: dict, rec: dict, t0: float) -> None:
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            try:
                text = json.loads(text)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            rec["error"] = f"HTTP {resp.status_code}: {text[:200]}"
            return
        finish = None
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                rec["error"] = str(obj["error"].get("message"))
                return
            if obj.get("usage"):
                rec["generated_tokens"] = int(obj["usage"]["completion_tokens"])
                rec["queue_ms"] = (obj.get("timings") or {}).get("queue_ms")
            for ch in obj.get("choices") or []:
                if ch.get("text"):
                    rec["token_times_s"].append(time.perf_counter() - t0)
                finish = ch.get("finish_reason") or finish
        rec["ok"] = finish is not None and rec["generated_tokens"] > 0
        if not rec["ok"]:
            rec["error"] = "the stream ended without a finish reason or usage"
