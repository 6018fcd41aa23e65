"""Helpers shared by the server tests: the runtime and in-process server fixtures, OpenAI error-shape
checks and a /health latency probe."""

from __future__ import annotations

import statistics
import threading
import time

import pytest

MODEL = "tiny"


@pytest.fixture(scope="module")
def rt(tiny_artifact):
    from dspark_trt.runtime import Runtime

    runtime = Runtime.load(tiny_artifact, backend="ort")
    yield runtime
    runtime.close()


@pytest.fixture
def slow_steps(rt, monkeypatch):
    """Each target step takes at least 5 ms, so a 200-token request surely outlives its client (or a stop)."""
    run = rt.backend.run_target

    def slow(*a, **kw):
        time.sleep(0.005)
        return run(*a, **kw)

    monkeypatch.setattr(rt.backend, "run_target", slow)


@pytest.fixture(scope="module")
def server(rt):
    from dspark_trt.serve.server import ServerThread, create_app

    with ServerThread(create_app(rt, model_name=MODEL)) as srv:
        yield srv

# /health bounds that hold on a busy 2-core machine; before issue 19 a 5 MB prompt stalled it 5-8 s. The
# median is the goal (< 100 ms); the worst single probe is a stall guard: in one CI run a probe took 1.4 s
# while a 2 MB prompt tokenized (the tokenizer releases the GIL - measured: longest pause 34 ms in-process -
# but holds a core, and the test client, the server's loop and the tokenizer share two).
HEALTH_MEDIAN_S = 0.1
HEALTH_MAX_S = 2.5


def openai_error(resp, status, param=None, code=None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    if 400 <= status < 500:
        assert err["type"] == "invalid_request_error" or status == 429
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


class HealthProbe:
    """Polls /health on its own connection while the block runs; records each answer's latency."""

    def __init__(self, url):
        self.url, self.latencies, self.failures = url, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import httpx

        with httpx.Client(timeout=30) as c:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                r = c.get(f"{self.url}/health")
                self.latencies.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    self.failures.append(r.status_code)
                time.sleep(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def check(self):
        assert not self.failures, self.failures
        assert len(self.latencies) >= 3, self.latencies
        med, worst = statistics.median(self.latencies), max(self.latencies)
        assert med < HEALTH_MEDIAN_S and worst < HEALTH_MAX_S, (med, worst)
