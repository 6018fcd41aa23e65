"""TensorRT for DSpark artifacts: the build plan, engine builds against the fake TensorRT API, and the
runtime on the trt backend's binding logic with stand-in execution contexts.

TensorRT is not installed here, so (as in test_trt_backend.py) the engines are `FakeContext`s that run the
exported ONNX graphs through ONNX Runtime behind the real GraphRunner binding code and device caches on CPU
tensors; the real build + load + greedy parity with ORT is `@pytest.mark.trt` (GPU with TensorRT only).
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

import fake_tensorrt  # noqa: E402  (tests/ is on sys.path under pytest)
from test_build import PLUGIN_MOD  # noqa: E402
from test_trt_backend import FakeContext, _ort_fn  # noqa: E402

from dspark_trt.errors import DsparkError  # noqa: E402
from dspark_trt.exporter.build import build_engines, plan_build  # noqa: E402
from dspark_trt.manifest import Manifest, load_manifest  # noqa: E402
from dspark_trt.runtime import GenerationConfig, Runtime  # noqa: E402
from dspark_trt.runtime.backends import trt_io  # noqa: E402
from dspark_trt.runtime.costs.table import CostTable  # noqa: E402
from tests.dspark_fixtures import ARTIFACT_VARIANTS, cached_artifact  # noqa: E402

HAVE_TRT = importlib.util.find_spec("tensorrt") is not None
GRAPHS = ("draft", "target", "dspark_context", "draft_sample")
PROMPTS = [[3, 17, 42, 8, 99], [64, 2, 7, 7, 30, 1, 9], [11, 12], [200, 150, 31, 77]]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """A private copy of the shared DSpark artifact (builds and runtimes here write into it)."""
    src = cached_artifact(tmp_path_factory, "full", **ARTIFACT_VARIANTS["full"])
    dst = tmp_path_factory.mktemp("trt-dspark") / "art"
    shutil.copytree(src, dst)
    return dst


@pytest.fixture
def fresh_plugins(monkeypatch):
    """The fake tensorrt in sys.modules and the plugin module imported afresh against it (as in test_build)."""

    def install(version="10.9.0.34"):
        trt = fake_tensorrt.make(version)
        fake_tensorrt.install(monkeypatch, trt)
        sys.modules.pop(PLUGIN_MOD, None)
        return trt

    yield install
    sys.modules.pop(PLUGIN_MOD, None)


def speculating(rt: Runtime) -> Runtime:
    """Verified tokens and draft calls nearly free next to a step's fixed cost: adaptive speculates."""
    rt.cost = CostTable(np.r_[0.0, 1000.0 + 0.001 * np.arange(200)], np.linspace(0, 0.01, 17), bounds=(1.0, 1.0))
    return rt


# ------------------------------------------------------------------------------------------ the build plan


def test_plan_lists_the_four_dspark_graphs_with_their_profiles_never_the_ort_flavour(artifact):
    m = load_manifest(artifact)
    assert m.graphs["target"]["ort"]["file"].endswith(".ort.onnx")  # the ORT-only flavour exists...
    plan = plan_build(artifact)
    assert list(plan["graphs"]) == ["draft", "target", "dspark_context", "draft_sample"]
    for g, entry in plan["graphs"].items():
        assert entry["onnx"] == str(artifact / m.graphs[g]["file"]) and ".ort." not in entry["onnx"]  # ...unused
        assert entry["engine"] == str(artifact / "engines" / f"{g}.engine")
        (profile,) = entry["profiles"]
        assert set(profile) == {io["name"] for io in m.graphs[g]["inputs"]}
        for name, (mn, op, mx) in m.profiles(g).items():
            assert profile[name] == {"min": list(mn), "opt": list(op), "max": list(mx)}
    lim, d = m.limits, m.draft
    r, p, t = lim["max_batch"], lim["max_context"], lim["max_tokens_per_step"]
    kv = [r, d["num_kv_heads"], d["head_dim"]]  # static slots, KV heads, head dim
    draft = plan["graphs"]["draft"]["profiles"][0]
    for name in ("anchor", "past_lens", "slot_ids"):
        assert draft[name] == {"min": [1], "opt": [min(8, r)], "max": [r]}
    assert draft["past_key_values.1.value"] == {"min": [1, *kv], "opt": [min(256, p), *kv], "max": [p, *kv]}
    sample = plan["graphs"]["draft_sample"]["profiles"][0]
    assert sample["uniforms"]["max"] == [r, d["max_draft"]] and sample["temperature"]["max"] == [r]
    context = plan["graphs"]["dspark_context"]["profiles"][0]
    feat = m.graphs["dspark_context"]["inputs"][0]["shape"][1]
    assert context["aux_hidden"]["max"] == [t, feat] and context["positions"]["max"] == [t]
    assert plan["graphs"]["target"]["profiles"][0]["tokens"]["max"] == [t]

    ops = {g: e["plugins"] for g, e in plan["graphs"].items()}
    assert ops == {"draft": ["dspark::MarkovDraft", "dspark::Survival"],
                   "draft_sample": ["dspark::MarkovSample", "dspark::Survival"],
                   "target": ["dspark::GreedyAccept", "dspark::SampleAccept"], "dspark_context": []}
    assert "PREFER_AOT_PYTHON_PLUGINS" in plan["graphs"]["draft"]["network_flags"]
    assert plan["graphs"]["dspark_context"]["network_flags"] == ["STRONGLY_TYPED"]


def test_build_records_an_engine_per_graph_against_the_fake_api(artifact, tmp_path, fresh_plugins, monkeypatch):
    from dspark_trt import trt_env

    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    trt = fresh_plugins("10.9.0.34")
    monkeypatch.setattr(trt_env, "detect_gpu", lambda device=0: trt_env.GpuInfo("NVIDIA H200", "9.0"))
    paths = build_engines(art, plugin_mode="aot")
    assert [p.name for p in paths] == [f"{g}.engine" for g in ("draft", "target", "dspark_context", "draft_sample")]
    parsed = [c[1] for c in trt.calls if c[0] == "parse"]
    assert parsed and not any(".ort." in str(p) for p in parsed)
    m = Manifest.load(art)
    assert set(m.engines) == set(GRAPHS)
    for g, e in m.engines.items():
        assert e["plugin_mode"] == "aot" and e["onnx_sha256"] == m.files[m.graphs[g]["file"]]["sha256"]
        assert e["profiles"] == plan_build(art)["graphs"][g]["profiles"]
    assert m.engines["draft"]["plugin_layers"] == 2 and m.engines["dspark_context"]["plugin_layers"] == 0
    assert "aot_kernels" in m.engines["draft_sample"]
    assert sys.modules[PLUGIN_MOD].registered_impls() == {"aot"}

    # what the trt backend loads: the four engines; the sampling one only where it was built
    assert set(trt_io.select_engines(m, art, "10.9.0.34", "9.0")) == set(GRAPHS)
    del m.engines["draft_sample"]
    assert set(trt_io.select_engines(m, art, "10.9.0.34", "9.0")) == set(GRAPHS) - {"draft_sample"}
    del m.engines["dspark_context"]
    with pytest.raises(DsparkError, match="no TensorRT engine for the dspark_context graph"):
        trt_io.select_engines(m, art, "10.9.0.34", "9.0")


# ------------------------------------------------------------------------------------------ runtime on fakes


def fake_trt_runtime(art: Path, graphs=GRAPHS) -> Runtime:
    """A Runtime on TrtBackend.from_contexts: the real binding code and device caches (CPU tensors), the
    engines FakeContexts running the standard ONNX graphs through ONNX Runtime."""
    torch = pytest.importorskip("torch")
    import onnxruntime as ort

    from dspark_trt.runtime.backends.trt import TrtBackend
    from dspark_trt.runtime.tokenizer import load_tokenizer

    m = load_manifest(art)
    sessions = {g: ort.InferenceSession(str(art / m.graphs[g]["file"]), providers=["CPUExecutionProvider"])
                for g in graphs}
    contexts = {}
    for g in graphs:
        spec = m.graphs[g]
        eio = [(io["name"], True, io["dtype"]) for io in spec["inputs"]]
        eio += [(io["name"], False, io["dtype"]) for io in spec["outputs"]]
        contexts[g] = (FakeContext(g, m.data, fn=_ort_fn(sessions)), eio)
    be = TrtBackend.from_contexts(art, m, contexts, torch)
    return Runtime(art, m, be, load_tokenizer(art / "tokenizer.json"))


def generate(rt: Runtime, specs, prompts=PROMPTS, **kw) -> dict:
    out = {}
    for spec in specs:
        res = rt.generate(prompts, GenerationConfig(max_new_tokens=20, spec=spec, stop_at_eos=False, **kw))
        assert all(r.error is None for r in res), [r.error for r in res]
        out[spec] = [r.token_ids for r in res]
    return out


def test_runtime_on_fake_trt_engines_matches_the_ort_backend(artifact, monkeypatch):
    from dspark_trt.runtime.backends.device_kv import DeviceKVCache
    from dspark_trt.runtime.dspark_graphs import TrtDsparkGraphs

    specs = ("off", "fixed:3", "adaptive")
    monkeypatch.setenv("DSPARK_ORT_GRAPHS", "standard")  # the graphs TensorRT builds from
    with speculating(Runtime.load(artifact, backend="ort", profile="none")) as rt:
        want = generate(rt, specs)
    with speculating(fake_trt_runtime(artifact)) as rt:
        drafting = rt.drafter.drafting
        assert isinstance(drafting.graphs, TrtDsparkGraphs) and isinstance(drafting.cache, DeviceKVCache)
        assert "aux_hidden" in [s.name for s in rt.backend.runners["target"].io.outputs]  # copied to the host
        got = generate(rt, specs)
        calls = dict(rt.backend.calls)
        # a context call larger than the engine's profile is split: same drafts
        drafting.graphs.max_context_rows = 3
        split = generate(rt, ["adaptive"])
    assert got == want
    assert all(out == want["off"] for out in want.values())
    assert split["adaptive"] == want["off"]
    # the drafter ran on the engines: context K/V and greedy block passes, no sampling graph
    assert calls["target"] > 0 and calls["dspark_context"] > 0 and calls["draft"] > 0
    assert calls.get("draft_sample", 0) == 0


def test_sampled_requests_draft_on_the_sampling_engine(artifact, monkeypatch):
    monkeypatch.setenv("DSPARK_ORT_GRAPHS", "standard")
    kw = dict(temperature=0.8, seed=7)
    with speculating(Runtime.load(artifact, backend="ort", profile="none")) as rt:
        want = generate(rt, ["fixed:3"], PROMPTS[:1], **kw)
    with speculating(fake_trt_runtime(artifact)) as rt:
        got = generate(rt, ["fixed:3"], PROMPTS[:1], **kw)
        assert rt.backend.calls["draft_sample"] > 0
    assert got == want


def test_a_sampled_request_without_the_sampling_engine_is_refused_in_one_line(artifact):
    with fake_trt_runtime(artifact, graphs=("draft", "target", "dspark_context")) as rt:
        with pytest.raises(DsparkError, match=r"^no TensorRT engine for the DSpark draft_sample graph, which "
                                              r"requests with temperature > 0 draft with: rebuild with "
                                              rf"`dspark-trt build {artifact}`$"):
            rt.submit(PROMPTS[0], GenerationConfig(temperature=0.7, spec="adaptive"))
        (res,) = rt.generate([PROMPTS[0]], GenerationConfig(max_new_tokens=4, temperature=0.7, spec="off",
                                                   stop_at_eos=False))
        assert res.error is None and len(res.token_ids) == 4  # spec off never drafts: nothing missing


# ------------------------------------------------------------------------------------------ real engines


@pytest.mark.trt
@pytest.mark.skipif(not HAVE_TRT, reason="needs TensorRT and an NVIDIA GPU (pip install 'dspark-trt[trt]')")
def test_trt_engines_for_a_dspark_artifact_greedy_match_ort(artifact, tmp_path, monkeypatch):
    """Build the four engines on this GPU, load them with the trt backend, compare greedy output with the ORT
    backend. Runs only on a machine with an NVIDIA GPU and TensorRT (`pytest -m trt`)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU visible to a CUDA build of torch")
    from dspark_trt.runtime.backends.device_kv import DeviceKVCache

    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    build_engines(art, plugin_mode="aot")
    specs = ("off", "fixed:3", "adaptive")
    monkeypatch.setenv("DSPARK_ORT_GRAPHS", "standard")
    with speculating(Runtime.load(art, backend="ort", profile="none")) as rt:
        want = generate(rt, specs)
    with speculating(Runtime.load(art, backend="trt", profile="none")) as rt:
        assert isinstance(rt.drafter.drafting.cache, DeviceKVCache) and rt.drafter.drafting.cache.device.type == "cuda"
        got = generate(rt, specs)
        calls = dict(rt.backend.calls)
    assert got == want
    assert calls["dspark_context"] > 0 and calls["draft"] > 0
