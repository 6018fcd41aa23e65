"""Examples: the embedded app (a subprocess), the Triton Python-backend model (against a stand-in for Triton's
`triton_python_backend_utils`), and the Ray Serve scale-out app (2 local CPU replicas, when Ray is installed; about 30 s on a busy 2-core machine)."""

from __future__ import annotations

import importlib.util
import json
import re
import socket
import subprocess
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from conftest import stop_process

from dspark_trt.runtime import GenerationConfig, Runtime

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
TRITON_MODEL = EXAMPLES / "triton" / "model_repository" / "dspark"


@pytest.fixture(scope="module")
def rt(tiny_artifact):
    runtime = Runtime.load(tiny_artifact, backend="ort")
    yield runtime
    runtime.close()


def _greedy(rt, prompt, n, **kw):
    return rt.generate([prompt], GenerationConfig(max_new_tokens=n, spec="off", **kw))[0]


# ---------------------------------------------------------------------- embedded app
def test_embedded_app_streams_a_completion(tiny_artifact, rt):
    out = subprocess.run([sys.executable, str(EXAMPLES / "embedded_app.py"), str(tiny_artifact), "--prompt",
                          "def fib(n):", "--max-tokens", "12"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "def fib(n):" + _greedy(rt, "def fib(n):", 12).text + "\n"


def test_embedded_app_says_what_is_missing(tmp_path):
    out = subprocess.run([sys.executable, str(EXAMPLES / "embedded_app.py"), str(tmp_path / "nothing")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stderr.startswith("error: ") and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------- Triton Python backend
class _StandInTritonUtils:
    """A STAND-IN for Triton's `triton_python_backend_utils`, not Triton itself (nvidia-pytriton 0.7 pins
    numpy<2 and cannot be installed beside this project). It implements only the documented calls that
    model.py uses, with the documented meaning: Tensor(name, array).as_numpy(), get_input_tensor_by_name,
    InferenceResponse(output_tensors, error), TritonError, TritonModelException,
    using_decoupled_model_transaction_policy, TRITONSERVER_RESPONSE_COMPLETE_FINAL, and per request
    get_response_sender() -> sender with send(response=None, flags=0) and is_cancelled()."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class TritonModelException(Exception):
        pass

    class TritonError:
        def __init__(self, message):
            self._message = message

        def message(self):
            return self._message

    class Tensor:
        def __init__(self, name, array):
            self._name, self._array = name, np.asarray(array)

        def name(self):
            return self._name

        def as_numpy(self):
            return self._array

    class InferenceResponse:
        def __init__(self, output_tensors, error=None):
            self._outputs, self._error = list(output_tensors), error

        def output_tensors(self):
            return self._outputs

        def has_error(self):
            return self._error is not None

        def error(self):
            return self._error

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return request.inputs.get(name)

    @staticmethod
    def using_decoupled_model_transaction_policy(model_config):
        return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


class _Sender:
    def __init__(self):
        self.responses, self.flags = [], []
        self.final = threading.Event()
        self.cancelled = False

    def send(self, response=None, flags=0):
        assert not self.final.is_set(), "response sent after the final flag"
        self.responses.append(response)
        self.flags.append(flags)
        if flags & _StandInTritonUtils.TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            self.final.set()

    def is_cancelled(self):
        return self.cancelled


class _Request:
    def __init__(self, **inputs):
        pb = _StandInTritonUtils
        self.inputs = {}
        for name, value in inputs.items():
            if isinstance(value, str):
                arr = np.array([value.encode()], dtype=np.object_)
            elif isinstance(value, list):
                arr = np.array([v.encode() for v in value], dtype=np.object_)
            else:
                arr = np.array([value])
            self.inputs[name] = pb.Tensor(name, arr)
        self.sender = _Sender()

    def get_response_sender(self):
        return self.sender


def _config_from_pbtxt(text: str) -> dict:
    """The parts of config.pbtxt model.py reads, in the JSON form Triton passes as args['model_config']."""
    params = dict(re.findall(r'key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', text))
    decoupled = re.search(r"model_transaction_policy\s*\{\s*decoupled:\s*true", text) is not None
    return {"name": re.search(r'name:\s*"([^"]+)"', text).group(1),
            "model_transaction_policy": {"decoupled": decoupled},
            "parameters": {k: {"string_value": v} for k, v in params.items()}}


@pytest.fixture(scope="module")
def triton_model(tiny_artifact, monkeypatch_module):
    pb = types.ModuleType("triton_python_backend_utils")
    for k in dir(_StandInTritonUtils):
        if not k.startswith("__"):
            setattr(pb, k, getattr(_StandInTritonUtils, k))
    monkeypatch_module.setitem(sys.modules, "triton_python_backend_utils", pb)
    spec = importlib.util.spec_from_file_location("dspark_triton_model", TRITON_MODEL / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = _config_from_pbtxt((TRITON_MODEL / "config.pbtxt").read_text())
    monkeypatch_module.setenv("DSPARK_ARTIFACT_DIR", str(tiny_artifact))
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps(config), "model_repository": str(TRITON_MODEL),
                      "model_version": "1", "model_name": "dspark", "model_instance_kind": "CPU"})
    yield model
    model.finalize()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _texts(sender):
    out = []
    for r in sender.responses:
        if r is None or r.has_error():
            continue
        t = {x.name(): x.as_numpy() for x in r.output_tensors()}
        out.append((t["text"][0].decode(), t["finish_reason"][0].decode(), int(t["completion_tokens"][0])))
    return out


def test_triton_config_matches_model():
    text = (TRITON_MODEL / "config.pbtxt").read_text()
    cfg = _config_from_pbtxt(text)
    assert cfg["name"] == "dspark" and cfg["model_transaction_policy"]["decoupled"]
    assert re.search(r'backend:\s*"python"', text) and re.search(r"max_batch_size:\s*0", text)
    model_py = (TRITON_MODEL / "1" / "model.py").read_text()
    for name in re.findall(r'name:\s*"([^"]+)"', text)[1:]:
        assert f'"{name}"' in model_py, f"config.pbtxt declares {name} but model.py never uses it"


def test_triton_model_streams_responses_with_final_flag(triton_model, rt):
    """Requests in (several at once, as Triton batches them into one execute call), streamed responses out, the
    last one flagged final with its finish reason; the text adds up to what the runtime generates offline."""
    pb = _StandInTritonUtils
    prompts = ["def fib(n):", "import os\n", "import sys\n\nclass Foo:\n"]
    reqs = [_Request(prompt=p, max_tokens=np.int32(16), spec="adaptive") for p in prompts]
    assert triton_model.execute(reqs) is None  # decoupled: answered through the senders
    for p, r in zip(prompts, reqs):
        assert r.sender.final.wait(60)
        got = _texts(r.sender)
        want = _greedy(rt, p, 16).text
        if want[:len(want) // 2].replace("\ufffd", ""):  # (incomplete UTF-8 is held back until it completes)
            assert len(got) >= 2  # really streamed
        assert "".join(t for t, _, _ in got) == want
        assert [f for _, f, _ in got] == [""] * (len(got) - 1) + ["length"]
        assert got[-1][2] == 16
        assert r.sender.flags[-1] == pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        assert all(f == 0 for f in r.sender.flags[:-1])


def test_triton_model_errors_and_cancellation(triton_model, rt, monkeypatch):
    pb = _StandInTritonUtils
    run = triton_model.rt.backend.run_target

    def slow(*a, **kw):  # at least 5 ms a step: the 200-token request below surely outlives its cancellation
        time.sleep(0.005)
        return run(*a, **kw)

    monkeypatch.setattr(triton_model.rt.backend, "run_target", slow)
    bad = _Request(prompt="x", spec="bogus")
    empty = _Request(prompt="")
    triton_model.execute([bad, empty])
    for r in (bad, empty):
        assert r.sender.final.is_set() and len(r.sender.responses) == 1
        assert r.sender.responses[0].has_error() and r.sender.flags == [pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL]
    assert "spec" in bad.sender.responses[0].error().message()
    # A cancelled request stops early, frees its slot, and still gets the final flag.
    long = _Request(prompt="def fib(n):", max_tokens=np.int32(200), spec="off")
    triton_model.execute([long])
    deadline = time.monotonic() + 30
    while not long.sender.responses and time.monotonic() < deadline:
        time.sleep(0.01)
    long.sender.cancelled = True
    assert long.sender.final.wait(30)
    assert long.sender.flags[-1] == pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    got = _texts(long.sender)
    assert not got or got[-1][2] < 200
    deadline = time.monotonic() + 10
    while any(triton_model.rt.slots) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(triton_model.rt.slots)


# ---------------------------------------------------------------------- Ray Serve
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ray_serve_two_replicas(tiny_artifact, rt, tmp_path):
    pytest.importorskip("ray", reason="ray is not installed (pip install 'ray[serve]')")
    pytest.importorskip("ray.serve", reason="ray[serve] is not installed")
    httpx = pytest.importorskip("httpx")
    openai = pytest.importorskip("openai")
    port = _free_port()
    log = open(tmp_path / "ray.log", "w")
    proc = subprocess.Popen([sys.executable, str(EXAMPLES / "ray_serve_app.py"), str(tiny_artifact), "--replicas",
                             "2", "--port", str(port), "--num-cpus", "2", "--replica-cpus", "1"],
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        ready = False
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                ready = httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                ready = False
            if ready:
                break
            time.sleep(1)
        assert ready, (tmp_path / "ray.log").read_text()[-3000:]
        prompts = [f"def f{i}(x):" for i in range(24)]
        want = {p: _greedy(rt, p, 8).text for p in prompts}
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=2, timeout=120)

        def one(p):
            raw = client.completions.with_raw_response.create(model=Path(tiny_artifact).name, prompt=p,
                                                              max_tokens=8, temperature=0)
            return p, raw.parse().choices[0].text, raw.headers.get("x-dspark-replica")

        # On a loaded machine the second replica may still be starting when the first answers /health:
        # keep sending rounds until both have answered (or the deadline), checking every answer.
        replicas: set = set()
        deadline = time.monotonic() + 180
        while len(replicas) < 2 and time.monotonic() < deadline:
            with ThreadPoolExecutor(8) as ex:
                results = list(ex.map(one, prompts))
            assert all(text == want[p] for p, text, _ in results)
            replicas |= {r for _, _, r in results}
        assert len(replicas) == 2, replicas
        chunks = list(client.completions.create(model=Path(tiny_artifact).name, prompt=prompts[0], max_tokens=8,
                                                temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == want[prompts[0]]
    finally:
        stop_process(proc, timeout=60)
        log.close()
