"""The ORT backend's all-greedy target twin (runtime/backends/ort_greedy.py): a verify call with no sampling
row runs the target graph without SampleAccept, with the same outputs; a call holding one runs the full graph."""

from __future__ import annotations

import json

import onnx

from dspark_trt.runtime.backends.ort import GREEDY_TARGET, graph_file
from dspark_trt.runtime.backends.ort_greedy import greedy_twin

PROMPTS = ["def fib(n):", "import os\n", "class Foo:"]


def _target(art):
    m = json.loads((art / "manifest.json").read_text())
    return onnx.load(str(art / graph_file(m, "target")))


def test_the_twin_drops_sample_accept_and_what_only_it_reads(tiny_artifact):
    full = _target(tiny_artifact)
    twin = greedy_twin(full)
    ops = {n.op_type for n in twin.graph.node}
    assert "GreedyAccept" in ops and "SampleAccept" not in ops
    assert [f.name for f in twin.functions] == ["GreedyAccept"]
    inputs = {i.name for i in twin.graph.input}
    assert not inputs & {"draft_probs", "temperature", "accept_uniforms", "sample_uniforms"}
    assert {"tokens", "draft_tokens", "verify_lens"} <= inputs
    assert [o.name for o in twin.graph.output] == [o.name for o in full.graph.output]


def test_a_graph_without_the_per_row_selection_gets_no_twin(tiny_artifact):
    full = _target(tiny_artifact)
    for n in full.graph.node:
        if n.output[0] == "accepted":
            n.op_type = "Max"  # no longer Where(greedy, GreedyAccept, SampleAccept)
    assert greedy_twin(full) is None


def _generate(art, specs, temperature=0.0):
    from dspark_trt.runtime import GenerationConfig, Runtime

    with Runtime.load(art, profile="none") as rt:
        out = {s: [r.token_ids for r in rt.generate(PROMPTS, GenerationConfig(max_new_tokens=16, spec=s,
                                                                               temperature=temperature, seed=3))]
               for s in specs}
        return out, dict(rt.backend.calls)


def test_greedy_steps_run_the_twin_with_output_identical_to_the_full_graph(tiny_artifact, monkeypatch):
    specs = ("off", "fixed:2", "adaptive")
    out, calls = _generate(tiny_artifact, specs)
    assert calls.get(GREEDY_TARGET, 0) > 0 and calls.get("target", 0) == 0
    assert all(out[s] == out["off"] for s in specs)
    monkeypatch.setenv("DSPARK_ORT_GREEDY_TARGET", "0")
    without, calls = _generate(tiny_artifact, specs)
    assert GREEDY_TARGET not in calls and calls["target"] > 0
    assert without == out


def test_a_call_with_a_sampling_row_runs_the_full_graph(tiny_artifact):
    _, calls = _generate(tiny_artifact, ("fixed:2",), temperature=1.0)
    assert calls["target"] > 0 and GREEDY_TARGET not in calls


def test_no_twin_for_weights_kept_beside_the_graph(tiny_artifact, tmp_path):
    """Weights in <graph>.onnx.data (large targets): the twin would be a second copy of them, so none."""
    import shutil

    from dspark_trt.runtime.backends.ort import OrtBackend

    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    m = json.loads((art / "manifest.json").read_text())
    assert GREEDY_TARGET in OrtBackend(art, m).sessions
    (art / f"{graph_file(m, 'target')}.data").write_bytes(b"")  # only its presence is read
    backend = OrtBackend(art, m)
    assert GREEDY_TARGET not in backend.sessions and backend.greedy_inputs is None
