"""The ORT backend's all-greedy target twin (runtime/backends/ort_greedy.py): a verify call with no sampling
row runs the target graph without SampleAccept, with the same outputs; a call holding one runs the full graph."""

from __future__ import annotations

import json

import onnx
import pytest

from dspark_trt.runtime.backends.ort import GREEDY_TARGET, graph_file
from dspark_trt.exporter.greedy_twin import greedy_twin

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


def _without_exported_twins(art, tmp_path):
    """A copy of the artifact as exported before the twins were written (their files and entries gone)."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(art, old)
    m = json.loads((old / "manifest.json").read_text())
    for key in ("greedy", "decode_greedy"):
        name = m["graphs"]["target"]["ort"].pop(key)
        m["files"].pop(name)
        (old / name).unlink()
    (old / "manifest.json").write_text(json.dumps(m))
    return old, m


def test_the_export_writes_the_twins_and_the_backend_opens_them_as_they_are(tiny_artifact, monkeypatch):
    from dspark_trt.runtime.backends import ort_greedy
    from dspark_trt.runtime.backends.ort import OrtBackend

    m = json.loads((tiny_artifact / "manifest.json").read_text())
    ort = m["graphs"]["target"]["ort"]
    assert (ort["greedy"], ort["decode_greedy"]) == ("target.greedy.ort.onnx", "target.decode.greedy.ort.onnx")
    assert {ort["greedy"], ort["decode_greedy"]} <= set(m["files"])  # hashed like every graph
    for name in (ort["greedy"], ort["decode_greedy"]):
        ops = {n.op_type for n in onnx.load(str(tiny_artifact / name)).graph.node}
        assert "GreedyAccept" in ops and "SampleAccept" not in ops
    monkeypatch.setattr(ort_greedy, "greedy_twin_bytes", lambda path: pytest.fail(f"{path} derived at load"))
    backend = OrtBackend(tiny_artifact, m)
    assert GREEDY_TARGET in backend.sessions and GREEDY_TARGET in backend._decode_sessions


def test_a_runtime_only_install_loads_without_the_onnx_package(tiny_artifact, tmp_path):
    """The runtime's dependencies do not include onnx (the export extra's): an artifact's exported twins are
    opened without it; an older artifact's, which would have to be derived, are simply not there."""
    import subprocess
    import sys

    old, _ = _without_exported_twins(tiny_artifact, tmp_path)
    code = ("import sys; sys.modules['onnx'] = None\n"
            "from dspark_trt.runtime import GenerationConfig, Runtime\n"
            "from dspark_trt.runtime.backends.ort import GREEDY_TARGET\n"
            "for art in sys.argv[1:]:\n"
            "    with Runtime.load(art, profile='none') as rt:\n"
            "        out = rt.generate(['def fib(n):'], GenerationConfig(max_new_tokens=8, spec='fixed:2'))[0]\n"
            "        print(GREEDY_TARGET in rt.backend.sessions, len(out.token_ids))\n")
    run = subprocess.run([sys.executable, "-c", code, str(tiny_artifact), str(old)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:2] == ["True 8", "False 8"]


def test_no_twin_for_weights_kept_beside_the_graph(tiny_artifact, tmp_path):
    """Weights in <graph>.onnx.data (large targets): the twin would be a second copy of them, so the exporter
    writes none and the backend derives none."""
    from dspark_trt.exporter.greedy_twin import write_greedy_twins
    from dspark_trt.runtime.backends.ort import OrtBackend

    art, m = _without_exported_twins(tiny_artifact, tmp_path)
    assert GREEDY_TARGET in OrtBackend(art, m).sessions  # derived at load, as before the export wrote them
    (art / f"{graph_file(m, 'target')}.data").write_bytes(b"")  # only its presence is read
    backend = OrtBackend(art, m)
    assert GREEDY_TARGET not in backend.sessions and backend.greedy_inputs is None
    graphs = json.loads(json.dumps(m["graphs"]))
    assert write_greedy_twins(graphs, art) == ["target.decode.greedy.ort.onnx"]  # the decoding graph's only
    assert "greedy" not in graphs["target"]["ort"]
