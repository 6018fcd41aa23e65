"""The server under bad input and overload (issue 19, items 1-5): every failure is an answer in OpenAI's
error shape naming the field, the event loop stays responsive (/health) while big bodies are refused or
big prompts tokenized, errors never break a keep-alive connection and every status is counted, a key can
be required, and slow clients are cut off. Real HTTP against uvicorn in a thread (ServerThread)."""

from __future__ import annotations

import json
import logging
import socket
import time

import pytest
from serve_helpers import MODEL, HealthProbe, openai_error, rt, server  # noqa: F401 (fixtures)

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from dspark_trt.runtime import Runtime  # noqa: E402
from dspark_trt.serve.limits import ServeLimits  # noqa: E402
from dspark_trt.serve.server import ServerThread, create_app  # noqa: E402



def post(srv, body, path="/v1/completions", **kw):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{srv.url}{path}", content=data, headers={"content-type": "application/json"},
                      timeout=120, **kw)


# ---------------------------------------------------------------------- item 1: max_tokens
@pytest.mark.parametrize("value", [10 ** 9, 10 ** 30])
def test_max_tokens_beyond_the_context_is_a_400_naming_it(rt, server, value):
    err = openai_error(post(server, {"prompt": "def fib(n):", "max_tokens": value}), 400, "max_tokens",
                       "context_length_exceeded")
    assert str(rt.max_context) in err["message"]


def test_max_tokens_must_fit_with_the_prompt_exactly(rt, server):
    ids = [5] * (rt.max_context - 4)
    openai_error(post(server, {"prompt": ids, "max_tokens": 5, "temperature": 0}), 400, "max_tokens")
    r = post(server, {"prompt": ids, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4
    # Unset, max_tokens is OpenAI's 16, clamped to what the context has left.
    r = post(server, {"prompt": ids, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4


@pytest.mark.parametrize("value", ["1e30", "2.5", "16.0", '"16"', "true", "-3", "0", "null"])
def test_max_tokens_must_be_a_positive_integer(server, value):
    r = post(server, f'{{"prompt": "x", "max_tokens": {value}}}'.encode())
    if value == "null":  # null is "not set"
        assert r.status_code == 200
    else:
        openai_error(r, 400, "max_tokens")


def test_sampling_with_a_huge_max_tokens_is_cheap_and_answered(rt, server):
    """Sampling (temperature 1, the default) with max_tokens = all the context: answered, no memory spike."""
    room = rt.max_context - len(rt.tokenizer.encode("def fib(n):"))
    r = post(server, {"prompt": "def fib(n):", "max_tokens": room, "seed": 1, "spec": "fixed:2"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


# ---------------------------------------------------------------------- item 2: body size, off-loop work
def test_a_5mb_body_is_a_413_and_health_stays_fast(server):
    prompt = "x" * (5 * 1024 * 1024)
    body = json.dumps({"prompt": prompt}).encode()
    with HealthProbe(server.url) as probe:
        for _ in range(2):
            err = openai_error(post(server, body), 413, code="request_too_large")
            assert "2097152" in err["message"]

        def chunked():  # no Content-Length: the limit is enforced while reading
            for i in range(0, len(body), 65536):
                yield body[i:i + 65536]

        r = httpx.post(f"{server.url}/v1/completions", content=chunked(), timeout=120)
        openai_error(r, 413, code="request_too_large")
        time.sleep(0.2)
    probe.check()
    assert 'dspark_http_responses_total{code="413"}' in httpx.get(f"{server.url}/metrics").text


def test_health_stays_fast_while_a_big_prompt_is_tokenized(server):
    """A 2 MB prompt (just under the default body limit): parsed and tokenized in a worker thread (seconds
    on a busy machine), then refused for its length, while /health keeps answering."""
    prompt = "def fib(n):\n    return n if n < 2 else fib(n - 1)\n" * 40_000
    with HealthProbe(server.url) as probe:
        time.sleep(0.1)
        r = post(server, {"prompt": prompt, "max_tokens": 4})
        time.sleep(0.1)
    openai_error(r, 400, "prompt", "context_length_exceeded")
    assert len(probe.latencies) >= 5, probe.latencies  # /health answered all along
    probe.check()


# ---------------------------------------------------------------------- item 3: bad fields
BAD_FIELDS = [
    (b'{"prompt": "x", "seed": -1}', "seed"),
    (b'{"prompt": "x", "seed": 1.5}', "seed"),
    (b'{"prompt": "x", "seed": 18446744073709551616}', "seed"),
    (b'{"prompt": "x", "spec": "fixed:\xc2\xb2"}', "spec"),
    (b'{"prompt": "x", "spec": "fixed:-1"}', "spec"),
    (b'{"prompt": "x", "spec": "greedy"}', "spec"),
    (b'{"prompt": "x", "spec": 3}', "spec"),
    (b'{"prompt": "\\ud800"}', "prompt"),
    (b'{"prompt": ["ok", "a\\udfffb"]}', "prompt.1"),
    (b'{"prompt": "x", "stop": ["\\ud800"]}', "stop.0"),
    (b'{"prompt": "x", "n": -1}', "n"),
    (b'{"prompt": "x", "n": 0}', "n"),
    (b'{"prompt": "x", "n": "2"}', "n"),
    (b'{"prompt": "x", "temperature": 2.5}', "temperature"),
    (b'{"prompt": "x", "temperature": "hot"}', "temperature"),
    (b'{"prompt": "x", "temperature": NaN}', None),
    (b'{"prompt": "x", "temperature": Infinity}', None),
    (b'{"prompt": "x", "top_p": 0}', "top_p"),
    (b'{"prompt": "x", "top_p": 1.5}', "top_p"),
    (b'{"prompt": "x", "stream": 1}', "stream"),
    (b'{"prompt": "x", "stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p", "q"]}',
     "stop"),
    (b'{"prompt": "x", "model": 7}', "model"),
    (b'{"prompt": [1.5, 2]}', "prompt"),
    (b'{"prompt": [-1]}', "prompt"),
    (b'\xff\xfe{"prompt": "x"}', None),
    (b'{"prompt": "x"' + b', "a": [' * 100_000, None),
    (b'[' * 100_000 + b']' * 100_000, None),
]


@pytest.mark.parametrize("body,param", BAD_FIELDS, ids=[b[:40].decode("utf-8", "replace") for b, _ in BAD_FIELDS])
def test_bad_fields_are_a_400_naming_the_field(server, body, param):
    openai_error(post(server, body), 400, param)


def test_bad_fields_through_the_openai_client(server):
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    for kw, param in [({"seed": -1}, "seed"), ({"extra_body": {"spec": "fixed:²"}}, "spec"),
                      ({"max_tokens": 10 ** 9}, "max_tokens"), ({"n": -1}, "n"), ({"temperature": 3}, "temperature")]:
        args = {"model": MODEL, "prompt": "x", "max_tokens": 2, **kw}
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(**args)
        assert e.value.body["param"] == param


# ---------------------------------------------------------------------- item 4: errors keep the connection
def test_errors_keep_the_connection_and_every_status_is_counted(rt, server, monkeypatch):
    submit = rt.submit

    def flaky(ids, config, stream=False):
        if config.max_new_tokens == 3:
            raise RuntimeError("boom")  # a bug, as a MemoryError or a tokenizer crash once was
        return submit(ids, config, stream=stream)

    monkeypatch.setattr(rt, "submit", flaky)
    ports = []
    http = httpx.Client(event_hooks={"response": [
        lambda r: ports.append(r.extensions["network_stream"].get_extra_info("client_addr")[1])]})
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, http_client=http)
    before = dict(server.app.state.stats.responses)
    with pytest.raises(openai.InternalServerError) as e:
        c.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0)
    assert e.value.body["type"] == "server_error" and "boom" in e.value.body["message"]
    assert c.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0).usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt="x", seed=-1)
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("nope")
    assert c.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0).usage.completion_tokens == 2
    assert len(ports) == 5 and len(set(ports)) == 1, ports  # one keep-alive connection throughout
    http.close()
    after = server.app.state.stats.responses
    assert {k: after.get(k, 0) - before.get(k, 0) for k in (200, 400, 404, 500)} == {200: 2, 400: 1, 404: 1, 500: 1}
    metrics = httpx.get(f"{server.url}/metrics").text
    for code in (200, 400, 404, 500):
        assert f'dspark_http_responses_total{{code="{code}"}}' in metrics, code


def test_a_bug_mid_stream_ends_the_stream_with_an_error_event(server, monkeypatch):
    from dspark_trt.serve.text import TextStream

    def broken(self, ids):
        raise RuntimeError("decoder exploded")

    monkeypatch.setattr(TextStream, "push", broken)
    body = {"prompt": "def fib(n):", "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["type"] == "server_error" and "decoder exploded" in err["message"]
        monkeypatch.undo()
        assert c.post(f"{server.url}/v1/completions", json={**body, "stream": False}).status_code == 200


# ---------------------------------------------------------------------- item 5: API key, timeouts
def test_api_key_guards_every_route_but_health(rt):
    with ServerThread(create_app(rt, model_name=MODEL, limits=ServeLimits(api_key="s3cret"))) as srv:
        assert httpx.get(f"{srv.url}/health").status_code == 200
        for method, path in [("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL}"), ("GET", "/metrics"),
                             ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/nope")]:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
                r = httpx.request(method, f"{srv.url}{path}", headers=headers, json={"prompt": "x"})
                openai_error(r, 401, code="invalid_api_key")
                assert r.headers["www-authenticate"] == "Bearer"
        ok = httpx.get(f"{srv.url}/metrics", headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and 'dspark_http_responses_total{code="401"} 18' in ok.text
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0).choices


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> float | None:
    """Seconds until the server closed `sock` (sending `trickle` a byte per 0.1 s meanwhile), or None."""
    sock.settimeout(0.1)
    t0 = time.monotonic()
    i = 0
    while time.monotonic() - t0 < seconds:
        if i < len(trickle):
            try:
                sock.sendall(trickle[i:i + 1])
            except OSError:
                return time.monotonic() - t0
            i += 1
        try:
            data = sock.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            return time.monotonic() - t0
        if data == b"":
            return time.monotonic() - t0
    return None


def test_slow_clients_are_cut_off(rt):
    limits = ServeLimits(header_timeout_s=0.5, body_timeout_s=0.5, keep_alive_s=0.5)
    with ServerThread(create_app(rt, model_name=MODEL, limits=limits)) as srv:
        addr = ("127.0.0.1", srv.port)
        # A connection that sends nothing, and one that trickles a request head (slowloris).
        with socket.create_connection(addr) as idle:
            assert _closed_within(idle, 5.0) is not None
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
        with socket.create_connection(addr) as slow:
            took = _closed_within(slow, 5.0, trickle=head)
            assert took is not None and took < 4.0, took
        # A body that never completes: 408 in OpenAI's shape, then the connection closes.
        with socket.create_connection(addr) as partial:
            partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: 100\r\n\r\n{\"prompt\":")
            partial.settimeout(5.0)
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                chunk = partial.recv(65536)
                if not chunk:
                    break
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 408"), reply
            assert b'"request_timeout"' in reply
        # A keep-alive connection left idle after its response is closed too.
        with socket.create_connection(addr) as kept:
            kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            kept.settimeout(5.0)
            assert kept.recv(65536).startswith(b"HTTP/1.1 200")
            assert _closed_within(kept, 5.0) is not None
        assert httpx.get(f"{srv.url}/health").status_code == 200  # and the server is fine


def test_an_oversized_request_head_is_a_400_in_openai_shape(rt):
    with ServerThread(create_app(rt, model_name=MODEL, limits=ServeLimits(max_header_bytes=4096))) as srv:
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8000)  # no end of head in sight
            s.settimeout(5.0)
            reply = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, reply
        err = json.loads(body)["error"]
        assert err["code"] == "invalid_http_request" and "4096" in err["message"]
        assert httpx.get(f"{srv.url}/health").status_code == 200
        assert 'dspark_http_responses_total{code="400"} 1' in httpx.get(f"{srv.url}/metrics").text


# ---------------------------------------------------------------------- item 7 (in process): access log
def test_one_access_line_per_request(rt, server, caplog):
    n_prompt = len(rt.tokenizer.encode("def fib(n):"))
    with caplog.at_level(logging.INFO, logger="dspark_trt.serve.access"):
        post(server, {"prompt": "def fib(n):", "max_tokens": 3, "temperature": 0})
        post(server, {"prompt": "x", "seed": -1})
        httpx.get(f"{server.url}/health")
        deadline = time.monotonic() + 5
        while len(caplog.records) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    lines = [r.getMessage() for r in caplog.records if r.name == "dspark_trt.serve.access"]
    assert len(lines) == 3, lines
    ok, bad, health = lines
    import re

    assert re.search(r'"POST /v1/completions" 200 [0-9.]+ ms tokens=' + f"{n_prompt}" + r'\+3$', ok), ok
    assert re.search(r'"POST /v1/completions" 400 [0-9.]+ ms tokens=-$', bad), bad
    assert re.search(r'"GET /health" 200 [0-9.]+ ms tokens=-$', health), health
