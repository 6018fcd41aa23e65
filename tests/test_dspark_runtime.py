"""A DSpark drafter through the real runtime (ORT backend): greedy output equals no speculation in every
mode, the drafter's context cache holds exactly the verified tokens, and the refusals are one line."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from dspark_trt.errors import DsparkError  # noqa: E402
from dspark_trt.manifest import load_manifest  # noqa: E402
from dspark_trt.runtime import GenerationConfig, Runtime  # noqa: E402
from dspark_trt.runtime.costs.table import CostTable  # noqa: E402
from tests.dspark_fixtures import ARTIFACT_VARIANTS as VARIANTS  # noqa: E402
from tests.dspark_fixtures import cached_artifact  # noqa: E402

PROMPTS = [[3, 17, 42, 8, 99], [64, 2, 7, 7, 30, 1, 9], [11, 12], [200, 150, 31, 77]]


# Each variant costs an export (about a minute here); the default suite runs one, `-m slow` the other.
@pytest.fixture(scope="module", params=[pytest.param(v, marks=pytest.mark.slow) if v != "full" else v
                                        for v in sorted(VARIANTS)])
def artifact(request, tmp_path_factory):
    return cached_artifact(tmp_path_factory, request.param, **VARIANTS[request.param])


def speculating_runtime(art) -> Runtime:
    """Verified tokens and draft calls nearly free next to a step's fixed cost, so adaptive speculates and
    accept/reject paths run."""
    rt = Runtime.load(art, profile="none")
    rt.cost = CostTable(np.r_[0.0, 1000.0 + 0.001 * np.arange(200)], np.linspace(0, 0.01, 17), bounds=(1.0, 1.0))
    return rt


def test_export_dispatches_on_the_draft_format_and_records_the_drafter_kind(artifact):
    m = load_manifest(artifact)
    assert m.validate() == [] and m.drafter_kind == "dspark"
    assert set(m.graphs) == {"draft", "draft_sample", "target", "dspark_context"}
    assert m.graphs["target"]["outputs"][-1]["name"] == "aux_hidden"
    headless = m.draft["dspark"]["draft_vocab_size"] < m.model["vocab_size"]
    assert m.draft["confidence"] == ("fallback" if headless else "head")
    assert m.draft["max_draft"] == m.draft["dspark"]["num_draft"]


def test_greedy_output_equals_no_speculation_in_every_mode(artifact):
    rt = speculating_runtime(artifact)
    n = rt.max_draft
    try:
        outs = {}
        for spec in ("off", "fixed:1", f"fixed:{n}", "adaptive"):
            res = rt.generate(PROMPTS, GenerationConfig(max_new_tokens=24, spec=spec, stop_at_eos=False))
            assert all(r.error is None for r in res)
            outs[spec] = [r.token_ids for r in res]
            if spec != "off":
                verified = sum(sum(r.stats["verified_counts"]) for r in res)
                accepted = sum(sum(r.stats["accepted_counts"]) for r in res)
                assert 0 < accepted < verified, spec  # drafts were verified, some accepted and some rejected
        # every mode at once, in one batch
        mixed = rt.generate(PROMPTS, [GenerationConfig(max_new_tokens=24, spec=s, stop_at_eos=False)
                                      for s in ("off", "adaptive", f"fixed:{n}", "fixed:2")])
    finally:
        rt.close()
    for spec, out in outs.items():
        assert out == outs["off"], spec
    assert [r.token_ids for r in mixed] == outs["off"]


def test_the_draft_context_holds_exactly_the_verified_tokens(artifact):
    """Every block pass the runtime makes drafts what a drafter fed from scratch with the target's hidden
    states of the sequence so far drafts: accepted tokens entered the context, rejected ones never did."""
    import torch

    from dspark_trt.models.checkpoint import load_decoder
    from dspark_trt.runtime.dspark_drafting import DsparkDrafting

    m = load_manifest(artifact)
    rt = speculating_runtime(artifact)
    drafting = rt.drafter.drafting
    calls = []
    block = drafting.draft

    def recording(slots, anchors, *rest):
        d = block(slots, anchors, *rest)
        calls.append((int(drafting.context_len[slots[0]]), d.tokens[0].tolist(), d.survival[0].copy()))
        return d

    drafting.draft = recording
    try:
        (res,) = rt.generate([PROMPTS[1]], GenerationConfig(max_new_tokens=24, spec=f"fixed:{rt.max_draft}",
                                                            stop_at_eos=False))
    finally:
        rt.close()
    seq = PROMPTS[1] + res.token_ids
    assert len(calls) >= 4 and res.stats["accepted"] > 0 and res.stats["accepted"] < res.stats["verified_tokens"] - res.stats["steps"]
    target = load_decoder(m["sources"]["target"])
    layers = m.draft["dspark"]["aux_layers"]
    with torch.no_grad():
        _, aux = target.forward_dense(torch.tensor([seq]), aux_layers=layers)
    fresh = DsparkDrafting.from_artifact(artifact)
    for ctx, tokens, survival in calls:
        fresh.release(0)
        fresh.observe(0, aux[0, :ctx].numpy(), 0)
        d = fresh.draft([0], [seq[ctx]])
        assert d.tokens[0].tolist() == tokens
        np.testing.assert_allclose(d.survival[0], survival, atol=1e-4)


def test_fixed_k_beyond_the_block_size_is_refused_in_one_line(artifact):
    rt = Runtime.load(artifact, profile="none")
    try:
        k = rt.max_draft + 1
        with pytest.raises(DsparkError, match=rf"^spec fixed:{k} exceeds the DSpark drafter's block size "
                                              rf"{rt.max_draft} \(it drafts that many tokens per pass\)$"):
            rt.submit(PROMPTS[0], GenerationConfig(spec=f"fixed:{k}"))
    finally:
        rt.close()


def test_bench_refuses_fixed_k_beyond_the_block_size_naming_the_block_size(artifact, tmp_path):
    from dspark_trt.bench.harness import run_bench
    from dspark_trt.manifest import load_manifest

    k = int(load_manifest(artifact)["limits"]["max_draft"]) + 1
    with pytest.raises(DsparkError, match=rf"--modes 'off,fixed:{k}': spec fixed:{k} exceeds the DSpark "
                                          rf"drafter's block size"):
        run_bench(artifact, modes=f"off,fixed:{k}", out_dir=tmp_path / "bench")


def test_the_torch_backend_runs_the_modules_and_matches_ort(artifact):
    """The numerical reference for a DSpark artifact: the target step (aux rows included) and the drafter's
    graphs as eager modules from the source checkpoints; greedy output equals the ORT backend's (standard
    graphs) in every mode, and a sampled request drafts on the sampling module."""
    out = {}
    for backend in ("torch", "ort"):
        rt = Runtime.load(artifact, backend=backend, profile="none")
        try:
            out[backend] = {spec: [o.token_ids for o in rt.generate(PROMPTS, GenerationConfig(max_new_tokens=12,
                                                                                              spec=spec))]
                            for spec in ("off", "fixed:3", "adaptive")}
            if backend == "torch":
                calls = rt.drafter.drafting.graphs.calls
                assert calls["draft"] > 0 and calls["dspark_context"] > 0
                rt.generate(PROMPTS[:1], GenerationConfig(max_new_tokens=6, spec="fixed:2", temperature=0.8, seed=1))
                assert calls["draft_sample"] > 0
        finally:
            rt.close()
    assert out["torch"] == out["ort"]
    assert out["torch"]["fixed:3"] == out["torch"]["off"] == out["torch"]["adaptive"]


def test_export_options_that_do_not_apply_are_refused(artifact, tmp_path):
    from dspark_trt.exporter.export import export_artifacts

    src = load_manifest(artifact)["sources"]
    with pytest.raises(DsparkError, match="^--head does not apply to the DSpark drafter"):
        export_artifacts(src["target"], src["draft"], tmp_path / "a", head_dir=tmp_path)
    with pytest.raises(DsparkError, match="^--dtype bf16: a DSpark drafter exports in fp32 or fp16"):
        export_artifacts(src["target"], src["draft"], tmp_path / "a", dtype="bf16")


@pytest.mark.slow
def test_an_fp16_dspark_artifact_runs_lossless_and_drafts_like_the_fp32_one(tmp_path_factory, tmp_path):
    """--dtype fp16: every graph's weights, the target's aux rows and both KV caches in fp16 (the Markov
    stage and the confidences in float32); greedy output with speculation equals off's, and mostly the
    fp32 artifact's. Exported with --external-data always (as a real-size target's graphs are): every
    graph's weights in its `.data` file, hashed in the manifest."""
    import onnx

    from tests.dspark_fixtures import ARTIFACT_VARIANTS, make_artifact

    artifact = cached_artifact(tmp_path_factory, "full", **ARTIFACT_VARIANTS["full"])
    art = make_artifact(tmp_path, dtype="fp16", external_data="always", **ARTIFACT_VARIANTS["full"])
    m = load_manifest(art)
    assert m.model["dtype"] == "fp16" and m.verify_hashes() == []
    for graph, spec in m.graphs.items():
        for file in (spec["file"], *([spec["ort"]["file"]] if "ort" in spec else [])):
            assert f"{file}.data" in m.files and (art / f"{file}.data").stat().st_size > 0, file
    for graph in ("target", "draft", "dspark_context"):
        inputs = {i.name: i.type.tensor_type.elem_type for i in onnx.load(str(art / m.graphs[graph]["file"])).graph.input}
        assert inputs["past_key_values.0.key" if graph != "dspark_context" else "aux_hidden"] == onnx.TensorProto.FLOAT16
    out = {}
    for a in (art, artifact):
        rt = Runtime.load(a, profile="none")
        try:
            assert rt.drafter.drafting.cache.keys[0].dtype == (np.float16 if a == art else np.float32)
            out[a] = {spec: [o.token_ids for o in rt.generate(PROMPTS, GenerationConfig(max_new_tokens=16, spec=spec))]
                      for spec in ("off", "fixed:3", "adaptive")}
        finally:
            rt.close()
    assert out[art]["fixed:3"] == out[art]["off"] and out[art]["adaptive"] == out[art]["off"]
    same = sum(a == b for x, y in zip(out[art]["off"], out[artifact]["off"]) for a, b in zip(x, y))
    assert same >= 0.9 * sum(len(x) for x in out[artifact]["off"])  # fp16 rounding may flip a near tie


def test_a_sampled_request_without_the_sampling_graph_is_refused_in_one_line(artifact):
    rt = Runtime.load(artifact, profile="none")
    rt.drafter.drafting.graphs.sessions.pop("draft_sample")  # as an artifact without the graph
    try:
        with pytest.raises(DsparkError, match=r"^.* has no DSpark sampling graph \(draft_sample\), which requests with "
                                              r"temperature > 0 draft with: re-export the artifact with "
                                              r"`dspark-trt export`, or run those requests with spec off$"):
            rt.submit(PROMPTS[0], GenerationConfig(temperature=0.7, spec="fixed:2"))
        rt.submit(PROMPTS[0], GenerationConfig(temperature=0.7, spec="off"))  # never drafts
    finally:
        rt.close()


def test_generate_compare_on_a_dspark_artifact(artifact, tmp_path):
    """The CLI end to end: profile at load, adaptive vs no speculation, identical greedy text."""
    import json
    import shutil
    import subprocess
    import sys

    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    out = subprocess.run([sys.executable, "-m", "dspark_trt.cli", "generate", str(art), "--prompt", "def fib(n):",
                          "--max-new-tokens", "12", "--compare", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)["summary"]
    assert summary["identical_to_off"] is True and summary["output_tokens"] > 0
    # the cost profile was measured at load (and saved, unless the machine was too busy for a steady one)
    # (cost_profile.json, or cost_profile.ort.spin.json where the idle machine's threads spin)
    assert any(art.glob("cost_profile*.json")) or "cost profile not saved" in out.stderr


def test_a_request_that_does_not_draft_costs_no_context_call(artifact):
    """Verified rows wait for the step their request drafts: where drafting does not pay (draft calls far
    dearer than a step, no room to explore), generation runs no context-graph call at all."""
    rt = Runtime.load(artifact, profile="none")
    rt.cost = CostTable(np.r_[0.0, 1.0 + 0.001 * np.arange(200)], np.r_[0.0, np.full(16, 1e6)], bounds=(1.0, 1.0))
    graphs = rt.drafter.drafting.graphs
    try:
        (res,) = rt.generate([PROMPTS[0]], GenerationConfig(max_new_tokens=24, spec="adaptive", stop_at_eos=False))
        (ref,) = rt.generate([PROMPTS[0]], GenerationConfig(max_new_tokens=24, spec="off", stop_at_eos=False))
    finally:
        rt.close()
    assert res.token_ids == ref.token_ids and res.stats["drafted_tokens"] == 0
    assert graphs.calls["dspark_context"] == 0


def test_held_back_context_rows_are_bounded_in_memory_largest_queues_first(artifact):
    """Requests that do not draft hold their verified rows back, whatever their length (no context call with
    the default bound); past pending_limit bytes the largest queues enter the cache until half is left,
    and the output is the same."""
    rt = Runtime.load(artifact, profile="none")
    rt.cost = CostTable(np.r_[0.0, 1.0 + 0.001 * np.arange(200)], np.r_[0.0, np.full(16, 1e6)], bounds=(1.0, 1.0))
    drafter, graphs = rt.drafter, rt.drafter.drafting.graphs
    cfg = GenerationConfig(max_new_tokens=70, spec="adaptive", stop_at_eos=False)
    try:
        free = rt.generate(PROMPTS, cfg)
        assert graphs.calls["dspark_context"] == 0 and drafter.pending_bytes == 0  # finished: nothing kept
        row = drafter.drafting.graphs.sessions["dspark_context"].get_inputs()[0].shape[-1] * 4
        drafter.pending_limit = 40 * row
        seen = []
        observe = drafter.observe

        def watched(batch, result):
            observe(batch, result)
            seen.append(drafter.pending_bytes)
        drafter.observe = watched
        bounded = rt.generate(PROMPTS, cfg)
    finally:
        rt.close()
    assert [o.token_ids for o in bounded] == [o.token_ids for o in free]
    assert graphs.calls["dspark_context"] > 0 and max(seen) <= 40 * row


def test_a_headless_artifact_drafts_with_the_drafted_tokens_probability(tmp_path_factory):
    """Without a confidence head the draft graph's confidence logits are logit(q_max) of each position's
    final draft logits (recomputed here from the plain-torch vLLM reference's logits), so survivals differ
    per request; the manifest says "fallback", which makes the runtime's correction fit a slope; greedy
    output with speculation is off's. (The head-less variant's export, shared with the `-m slow` tests.)"""
    import json
    from pathlib import Path

    import torch
    from safetensors.torch import load_file

    from dspark_trt.models.checkpoint import load_decoder
    from dspark_trt.runtime.dspark_drafting import DsparkDrafting
    from tests.dspark_reference import reference_step

    art = cached_artifact(tmp_path_factory, "reduced-headless", **VARIANTS["reduced-headless"])
    m = load_manifest(art)
    assert m.draft["confidence"] == "fallback"
    src = {k: Path(v) for k, v in m["sources"].items() if v}
    cfg = json.loads((src["draft"] / "config.json").read_text())
    w = load_file(str(src["draft"] / "model.safetensors"))
    t_state = load_file(str(src["target"] / "model.safetensors"))
    t_embed = t_state["model.embed_tokens.weight"]
    target = load_decoder(src["target"])
    drafting = DsparkDrafting.from_artifact(art)
    last = []
    for prompt in PROMPTS:
        with torch.no_grad():
            _, aux = target.forward_dense(torch.tensor([prompt]), aux_layers=m.draft["dspark"]["aux_layers"])
            toks, logits, conf = reference_step(cfg, w, aux[0, :-1], prompt[-1], t_embed,
                                                t_state.get("lm_head.weight", t_embed))
        drafting.release(0)
        drafting.observe(0, aux[0, :-1].numpy(), 0)
        d = drafting.draft([0], [prompt[-1]])
        assert conf is None and d.tokens[0].tolist() == toks
        q = torch.softmax(logits.double(), -1).amax(-1).clamp(1e-6, 1 - 1e-6)
        assert np.abs(d.confidence_logits[0] - torch.logit(q).numpy()).max() <= 1e-3
        last.append(float(d.survival[0, -1]))
    assert len(set(last)) == len(PROMPTS)  # a per-request signal, not 0.5 ** k

    rt = speculating_runtime(art)
    try:
        assert rt.survival_correction is not None and rt.survival_correction.fit_slope
        res = {spec: rt.generate(PROMPTS, GenerationConfig(max_new_tokens=16, spec=spec, stop_at_eos=False))
               for spec in ("off", "adaptive", f"fixed:{rt.max_draft}")}
    finally:
        rt.close()
    assert sum(sum(r.stats["accepted_counts"]) for r in res["adaptive"]) > 0  # it speculated
    assert all([r.token_ids for r in out] == [r.token_ids for r in res["off"]] for out in res.values())
