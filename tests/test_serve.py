"""OpenAI-compatible server: the official `openai` client against a server started in-process (uvicorn in a
thread on a free 127.0.0.1 port), streaming and not, errors in OpenAI's shape, 429 under a full queue,
cancellation when a client goes away, a bounded load test, Prometheus metrics, and the `serve` command."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import stop_process

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from dspark_trt.errors import DsparkError  # noqa: E402
from dspark_trt.runtime import GenerationConfig, Runtime  # noqa: E402
from dspark_trt.serve.server import ServerThread, create_app, serve  # noqa: E402
from dspark_trt.serve.text import TextStream  # noqa: E402
from serve_helpers import MODEL, rt, server, slow_steps  # noqa: E402,F401 (fixtures)

PROMPTS = ["def fib(n):", "import os\n", "class Foo:\n    def __init__(self):", "x", "return self.x + 1\n"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def _offline(rt, prompts, n, **kw):
    return [r.text for r in rt.generate(prompts, GenerationConfig(max_new_tokens=n, spec="off", **kw))]


def _wait_for(cond, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def _assert_openai_error(resp, status, param=None):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if status == 400:
        assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
    return err


# ---------------------------------------------------------------------- basics
def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    h = httpx.get(f"{server.url}/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    _assert_openai_error(httpx.get(f"{server.url}/v1/nothing"), 404)


def test_completion_equals_offline_generate(rt, client):
    want = _offline(rt, PROMPTS, 12)
    for p, w in zip(PROMPTS[:3], want):
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0)
        assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
        assert len(r.choices) == 1 and r.choices[0].text == w and r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == len(rt.tokenizer.encode(p))
        assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
        assert r.model_extra["timings"]["queue_ms"] >= 0
    # A list of prompts is one choice per prompt, in order; every spec mode gives the same greedy text.
    for spec in ("off", "fixed:2", "adaptive"):
        r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0,
                                      extra_body={"spec": spec})
        assert [c.index for c in r.choices] == list(range(len(PROMPTS)))
        assert [c.text for c in r.choices] == want, spec
        assert r.usage.completion_tokens == 12 * len(PROMPTS)
    # Token-id prompts are accepted too.
    ids = rt.tokenizer.encode(PROMPTS[0])
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert r.choices[0].text == want[0]


def test_ignore_eos_runs_to_max_tokens(rt, client, monkeypatch):
    # Make the 4th greedy token an end-of-sequence id: by default the answer stops there, with
    # ignore_eos (vLLM's field, which open-loop benchmarks send) it runs to max_tokens as offline.
    from dspark_trt.runtime.config import GenerationConfig

    ids = rt.generate(PROMPTS[0], GenerationConfig(max_new_tokens=12, temperature=0, spec="off"))[0].token_ids
    monkeypatch.setattr(rt.committer, "eos_ids", frozenset({ids[3]}))
    stopped = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens <= 4
    full = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 12
    bad = httpx.post(f"{client.base_url}completions", json={"prompt": "x", "ignore_eos": "yes"})
    _assert_openai_error(bad, 400, param="ignore_eos")


def test_stream_equals_non_stream(rt, client):
    want = _offline(rt, PROMPTS[:2], 20)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0,
                                            stream=True))
    assert len(chunks) >= 2  # really streamed, not one blob
    assert "".join(c.choices[0].text for c in chunks) == want[0]
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    # Several prompts interleave by index; usage comes last when asked for.
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert chunks[-1].model_extra["timings"]["queue_ms"] >= 0  # the wait for a batch slot, server side
    texts = {0: "", 1: ""}
    finish = {}
    for c in chunks[:-1]:
        (ch,) = c.choices
        texts[ch.index] += ch.text
        if ch.finish_reason:
            finish[ch.index] = ch.finish_reason
    assert [texts[0], texts[1]] == want and finish == {0: "length", 1: "length"}


def test_sampling_is_reproducible_with_seed(client):
    # (adaptive sizes verification from live timing, so its samples are exact in distribution, not repeatable)
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0.8, seed=1234,
              extra_body={"spec": "fixed:2"})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


def _stop_case(rt):
    """A prompt and a stop string that occurs in the middle of its greedy output."""
    for p in PROMPTS:
        full = _offline(rt, [p], 24)[0]
        for i in range(1, len(full) - 2):
            s = full[i:i + 2]
            if full.find(s) == i and "\ufffd" not in full[:i + 2]:
                return p, s, full
    pytest.skip("no usable stop string in the tiny model's output")


def test_stop_strings_cut_like_the_runtime(rt, client):
    p, stop, full = _stop_case(rt)
    want = rt.generate([p], GenerationConfig(max_new_tokens=24, spec="off", stop=[stop]))[0]
    assert want.finish_reason == "stop" and want.text == full[:full.find(stop)]
    r = client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0, stop=stop)
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0, stop=[stop, "zzz"],
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_text_stream_holds_back_possible_stop_strings():
    decode = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731  one character per token
    ts = TextStream(decode, ["cde"])
    out = [ts.push([ord(c)]) for c in "abcdX"]
    assert "".join(out) == "abc"  # the last two characters could start "cde": held back until the end
    assert ts.finish("length") == "dX"
    ts = TextStream(decode, ["cd"])
    assert "".join(ts.push([ord(c)]) for c in "abcdef") == "ab"
    assert ts.finish("stop") == ""


# ---------------------------------------------------------------------- errors
BAD_BODIES = [
    (b"{", None),
    (b"[]", None),
    (b"", None),
    (b'{"max_tokens": 4}', "prompt"),
    (b'{"prompt": 3}', "prompt"),
    (b'{"prompt": []}', "prompt"),
    (b'{"prompt": [[]]}', "prompt"),
    (b'{"prompt": [999999]}', "prompt"),
    (b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),
    (b'{"prompt": "x", "max_tokens": "many"}', "max_tokens"),
    (b'{"prompt": "x", "temperature": -1}', "temperature"),
    (b'{"prompt": "x", "n": 2}', "n"),
    (b'{"prompt": "x", "best_of": 3}', "best_of"),
    (b'{"prompt": "x", "echo": true}', "echo"),
    (b'{"prompt": "x", "logprobs": 2}', "logprobs"),
    (b'{"prompt": "x", "top_p": 0.5}', "top_p"),
    (b'{"prompt": "x", "spec": "bogus"}', "spec"),
    (b'{"prompt": "x", "spec": "fixed:99"}', "spec"),
    (b'{"prompt": "x", "stop": 5}', "stop"),
    (b'{"prompt": "x", "stream": "yes please"}', "stream"),
]


@pytest.mark.parametrize("body,param", BAD_BODIES)
def test_invalid_bodies_get_400_in_openai_shape(server, body, param):
    r = httpx.post(f"{server.url}/v1/completions", content=body, headers={"content-type": "application/json"})
    _assert_openai_error(r, 400, param)


def test_errors_through_the_openai_client(rt, server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", n=2)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5] * rt.max_context)
    assert e.value.body["code"] == "context_length_exceeded"
    # The server is still fine afterwards.
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0).choices[0].text is not None


def test_full_queue_answers_429(tiny_artifact):
    """A runtime with one slot and a two-deep queue, hit by 12 concurrent long requests: every request gets an
    answer, 200 or 429 (OpenAI shape, Retry-After), and the server serves normally afterwards."""
    small = Runtime.load(tiny_artifact, backend="ort", max_batch=1, max_queue=2)
    try:
        with ServerThread(create_app(small, model_name=MODEL)) as srv:
            body = {"model": MODEL, "prompt": "def fib(n):", "max_tokens": 60, "temperature": 0, "spec": "off"}
            barrier = threading.Barrier(12)

            def one(_):
                barrier.wait()
                return httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)

            with ThreadPoolExecutor(12) as ex:
                answers = list(ex.map(one, range(12)))
            codes = [a.status_code for a in answers]
            assert set(codes) <= {200, 429} and codes.count(200) >= 1 and codes.count(429) >= 1, codes
            for a in answers:
                if a.status_code == 429:
                    err = _assert_openai_error(a, 429)
                    assert err["code"] == "rate_limit_exceeded" and a.headers["retry-after"]
                else:
                    assert a.json()["choices"][0]["finish_reason"] == "length"
            c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
            assert c.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0).usage.completion_tokens == 3
            metrics = httpx.get(f"{srv.url}/metrics").text
            assert f"dspark_requests_rejected_total {codes.count(429)}" in metrics
    finally:
        small.close()


def test_closed_runtime_answers_503(tiny_artifact):
    gone = Runtime.load(tiny_artifact, backend="ort", profile="none")
    with ServerThread(create_app(gone, model_name=MODEL)) as srv:
        gone.close()
        assert httpx.get(f"{srv.url}/health").status_code == 503
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        err = _assert_openai_error(r, 503)
        assert err["type"] == "server_error"


# ---------------------------------------------------------------------- client goes away
def _active(rt):
    return [s for s in rt.slots if s is not None]


def test_disconnect_mid_stream_cancels_and_frees_the_slot(rt, server, slow_steps):
    app = server.app
    stats = app.state.stats
    before = stats.cancelled
    body = {"model": MODEL, "prompt": "def fib(n):", "max_tokens": 200, "temperature": 0, "stream": True,
            "spec": "off"}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    break  # one chunk read; leaving the block closes the connection
    assert _wait_for(lambda: stats.cancelled == before + 1 and not _active(rt) and not app.state.inflight), \
        (stats.cancelled, _active(rt))
    assert stats.finished.get("cancelled", 0) >= 1


def test_disconnect_while_waiting_cancels_non_streaming(rt, server, slow_steps):
    app = server.app
    stats = app.state.stats
    before = stats.cancelled
    body = {"model": MODEL, "prompt": "import os\n", "max_tokens": 200, "temperature": 0, "spec": "off"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
    assert _wait_for(lambda: stats.cancelled == before + 1 and not _active(rt) and not app.state.inflight)


# ---------------------------------------------------------------------- load
def test_load_200_requests_from_32_threads(rt, client):
    prompts = [f"def f{i}(x):" for i in range(25)]
    want = dict(zip(prompts, _offline(rt, prompts, 6)))
    t0 = time.monotonic()

    def one(i):
        p = prompts[i % len(prompts)]
        if i % 4 == 0:
            chunks = client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0, stream=True)
            return p, "".join(c.choices[0].text for c in chunks)
        return p, client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).choices[0].text

    with ThreadPoolExecutor(32) as ex:
        results = list(ex.map(one, range(200)))
    elapsed = time.monotonic() - t0
    assert len(results) == 200
    bad = [(p, t) for p, t in results if t != want[p]]
    assert not bad, bad[:3]
    assert _wait_for(lambda: not _active(rt))
    print(f"200 requests from 32 threads in {elapsed:.1f} s")


# ---------------------------------------------------------------------- metrics
METRIC_LINE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="(\\.|[^"\\])*",?)*\})? '
                         r'(-?[0-9.e+-]+|NaN|[+-]Inf)$')


def test_metrics_in_prometheus_text_format(rt, server, client):
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for line in text.splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or METRIC_LINE.match(line), line
    values = {}
    for line in text.splitlines():
        if not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            values[k] = float(v)
    for name in ["dspark_requests_rejected_total", "dspark_output_tokens_total", "dspark_tau",
                 'dspark_acceptance_rate{position="1"}', "dspark_verified_tokens_per_step",
                 "dspark_verify_budget_per_step", "dspark_queue_depth", "dspark_step_ms_mean",
                 "dspark_engine_seconds_total", "dspark_step_seconds_total", "dspark_active_requests",
                 "dspark_predicted_accepted_total", "dspark_accepted_total", "dspark_predicted_step_seconds_total",
                 "dspark_measured_step_seconds_total"]:
        assert name in values, name
    assert values["dspark_measured_step_seconds_total"] > 0
    assert values['dspark_requests_total{finish_reason="length"}'] >= 1
    assert values["dspark_output_tokens_total"] >= 8
    assert values["dspark_tau"] >= 1.0
    assert values["dspark_verified_tokens_per_step"] >= 1.0
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        return
    names = {f.name for f in text_string_to_metric_families(text)}
    assert "dspark_tau" in names and "dspark_output_tokens" in names


# ---------------------------------------------------------------------- the serve command
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_refuses_a_busy_port_before_loading(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        with pytest.raises(DsparkError, match="cannot listen"):
            serve(tmp_path / "not-loaded", port=s.getsockname()[1])


def test_cli_serve_runs_and_stops(tiny_artifact, rt):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dspark_trt.cli", "serve", str(tiny_artifact), "--port",
                             str(port), "--max-batch", "4"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def up():
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        assert _wait_for(lambda: up() or proc.poll() is not None, timeout=90) and proc.poll() is None, \
            proc.stdout.read() if proc.poll() is not None else "server did not come up"
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        name = c.models.list().data[0].id
        assert name == os.path.basename(str(tiny_artifact))
        r = c.completions.create(model=name, prompt=PROMPTS[0], max_tokens=8, temperature=0)
        assert r.choices[0].text == _offline(rt, [PROMPTS[0]], 8)[0]
    finally:
        stop_process(proc, timeout=30)
    assert proc.returncode in (0, 1, -signal.SIGINT)
