"""The ORT flavour's decoding graphs (target.decode.ort.onnx, draft.decode.ort.onnx, draft_greedy.decode.ort.onnx;
runtime/backends/ort_decode.py): one token a row, or one row of several, over slot-major caches they read
in place. They compute what the packed graphs compute, keep each model's two caches equal, never disturb a
slot that is not in their call, and are what the ORT backend runs for plain decoding rows and drafting
calls, with outputs identical to the packed graphs' in every mode."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from dspark_trt.runtime.batch import pack_queries, verify_rows


@pytest.mark.parametrize("arch,extra", [("llama", {}), ("qwen3", {"qk_norm": True, "attention_bias": True})])
@pytest.mark.parametrize("query_lens,past_lens", [([1, 1, 1], [4, 7, 0]), ([3], [5])])
def test_decode_layers_compute_the_packed_layers_in_torch(arch, extra, query_lens, past_lens):
    """Eager torch (GroupQueryAttention's torch twin): rows of equal new tokens over a slot-major cache (one
    token in three rows; three tokens in one row, causal among them) give the packed decoder's hidden
    states and new entries, written at their positions and nowhere else."""
    import torch

    from dspark_trt.models.config import ModelConfig
    from dspark_trt.models.decoder import Decoder, PackedBatch, make_packed_index
    from dspark_trt.models.ort_fused import FusedDecoder

    cfg = ModelConfig(arch, 97, 64, 96, 2, 4, 2, 24, max_position_embeddings=64, **extra)
    dec = Decoder(cfg).init_weights(std=0.08, seed=0).eval()
    fused = FusedDecoder(dec, 64).eval()
    g = torch.Generator().manual_seed(1)
    b, t, p = len(query_lens), query_lens[0], 8
    past = [[torch.randn(p, b, 2, 24, generator=g) for _ in range(2)] for _ in range(2)]
    tokens = torch.randint(0, 97, (b * t,), generator=g)
    positions = torch.tensor([q0 + j for q0 in past_lens for j in range(t)])
    pack, unpack = make_packed_index(query_lens)
    batch = PackedBatch(tokens, positions, pack, unpack, torch.tensor(query_lens), torch.tensor(past_lens),
                        torch.arange(b), past[0], past[1])
    slot_major = [buf.permute(1, 2, 0, 3).contiguous() for layer in zip(*past) for buf in layer]  # k0, v0, ...
    slot_major = [torch.cat([s, torch.randn(b, 2, 64 - p, 24, generator=g)], dim=2) for s in slot_major]
    with torch.no_grad():
        h, ks, vs = fused.forward_packed(batch)
        x = fused.embed_tokens(tokens).view(b, t, -1)
        dh, present, _ = fused.layers.forward_decode(x, torch.tensor(past_lens), slot_major)
    assert (h - dh.flatten(0, 1)).abs().max() <= 1e-5
    rows = torch.arange(b).repeat_interleave(t)
    for before, after, entry in zip(slot_major, present, [e for kv in zip(ks, vs) for e in kv]):
        assert (after[rows, :, positions] - entry).abs().max() <= 1e-5
        after = after.clone()
        after[rows, :, positions] = before[rows, :, positions]
        assert torch.equal(after, before)  # nothing else written


@functools.lru_cache(maxsize=4)
def _session(path: str):
    import onnxruntime as ort

    return ort.InferenceSession(path, providers=["CPUExecutionProvider"])


def _packed_call(art, m, cache, queries, past_lens, slots, temps, drafts=None, seed=0):
    """One target call on the packed ORT graph over the cache's host layout, every row scoring its last
    len(drafts[r]) + 1 tokens: (outputs, new entries, feeds). Decode calls' entries reach the host cache first,
    as the backend brings them before it runs the packed graph."""
    cache.sync_host(np.asarray(slots, np.int64), np.asarray(past_lens, np.int64))
    rng = np.random.default_rng(seed)
    sess = _session(str(art / m["graphs"]["target"]["ort"]["file"]))
    feeds = pack_queries(queries, list(past_lens), list(slots))
    vl = np.array([len(d) for d in drafts] if drafts else [0] * len(queries), np.int64)
    feeds["verify_index"] = verify_rows(feeds["query_lens"], vl)
    n, vocab = len(feeds["verify_index"]), m["model"]["vocab_size"]
    draft_tokens = np.zeros(n, np.int64)
    row = 0
    for r, L in enumerate(vl):
        draft_tokens[row:row + L] = drafts[r] if L else []
        row += L + 1
    probs = rng.random((n, vocab)).astype(np.float32)
    feeds.update(verify_lens=vl, draft_tokens=draft_tokens, draft_probs=probs / probs.sum(1, keepdims=True),
                 temperature=np.asarray(temps, np.float32), accept_uniforms=rng.random(n, dtype=np.float32),
                 sample_uniforms=rng.random(len(queries), dtype=np.float32))
    layers = m["model"]["num_layers"]
    names = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    outs = sess.run(None, {**feeds, **dict(zip(names, cache.past(int(max(past_lens)))))})
    named = dict(zip([o.name for o in sess.get_outputs()], outs))
    return named, [named[n.replace("past_key_values", "present")] for n in names], feeds


def _fill(cache, m, lens, rng):
    """Random prompts written as the runtime writes them: through cache.write."""
    for slot, n in lens.items():
        entries = [rng.standard_normal((n, m["model"]["num_kv_heads"], m["model"]["head_dim"])).astype(np.float32)
                   for _ in cache.slot_major]
        cache.write(entries, np.arange(n), np.full(n, slot))


def _decode_path(art, m, slots, graph="target"):
    import onnxruntime as ort

    from dspark_trt.runtime.backends.ort_decode import DecodePath, MirroredKVCache

    f = m["model" if graph == "target" else "draft"]
    cache = MirroredKVCache(f["num_layers"], m["limits"]["max_context"], slots, f["num_kv_heads"], f["head_dim"])
    sess = ort.InferenceSession(str(art / m["graphs"][graph]["ort"]["decode"]), providers=["CPUExecutionProvider"])
    return DecodePath(sess, cache, f["num_layers"]), cache


def _packed_draft_call(art, m, graph, cache, queries, past_lens, slots, temps, seed=0):
    """One call of the draft's packed ORT graph `graph` over the cache's host layout: (outputs, new entries,
    feeds); decode calls' entries reach the host cache first, as in _packed_call."""
    cache.sync_host(np.asarray(slots, np.int64), np.asarray(past_lens, np.int64))
    rng = np.random.default_rng(seed)
    sess = _session(str(art / m["graphs"][graph]["ort"]["file"]))
    feeds = pack_queries(queries, list(past_lens), list(slots))
    r = len(queries)
    feeds.update(temperature=np.asarray(temps, np.float32), uniforms=rng.random(r, dtype=np.float32),
                 prev_survival=rng.random(r, dtype=np.float32), draft_position=rng.integers(0, 3, r))
    names = [f"past_key_values.{i}.{kv}" for i in range(m["draft"]["num_layers"]) for kv in ("key", "value")]
    wanted = {i.name for i in sess.get_inputs()}
    run_feeds = {k: v for k, v in {**feeds, **dict(zip(names, cache.past(int(max(past_lens)))))}.items() if k in wanted}
    named = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, run_feeds)))
    return named, [named[n.replace("past_key_values", "present")] for n in names], feeds


@pytest.mark.parametrize("graph", ["draft", "draft_greedy"])
def test_the_drafts_decode_graphs_match_its_packed_graphs(tiny_artifact, graph):
    """The draft's drafting call (one token in rows out of slot order, a live slot between them run as a
    dummy) and one request's catch-up (several tokens in one row): tokens equal to the packed graph's for
    greedy and sampled rows, survivals, confidences and distributions within 1e-4, new entries within 1e-4,
    the slot left out untouched."""
    m = json.loads((tiny_artifact / "manifest.json").read_text())
    path, cache = _decode_path(tiny_artifact, m, m["limits"]["max_batch"], graph)
    rng = np.random.default_rng(4)
    vocab = m["model"]["vocab_size"]
    lens = {0: 9, 1: 5, 2: 12, 3: 3}
    _fill(cache, m, lens, rng)
    host_before = [buf[:, 1].copy() for buf in cache.keys + cache.values]
    temps = [0.0, 0.8, 1.0] if graph == "draft" else [0.0] * 3
    for seed, (queries, slots) in enumerate([([[t] for t in rng.integers(0, vocab, 3)], [3, 0, 2]),
                                             ([list(rng.integers(0, vocab, 5))], [2])]):
        slots = np.array(slots)
        past = np.array([lens[s] for s in slots])
        packed, new, feeds = _packed_draft_call(tiny_artifact, m, graph, cache, queries, past, slots,
                                                temps[:len(slots)], seed=seed)
        assert path.takes(feeds)
        outs, present = path.run(feeds)
        assert sorted(outs) == sorted(k for k in packed if not k.startswith("present."))
        assert (outs["draft_token"] == packed["draft_token"]).all()
        for k in outs.keys() - {"draft_token"}:
            assert np.abs(outs[k] - packed[k]).max() <= 1e-4, k
        assert max(float(np.abs(a - b).max()) for a, b in zip(present, new)) <= 1e-4
        cache.write(present, feeds["positions"], np.repeat(slots, len(queries[0])))
        for s_, q in zip(slots, queries):
            lens[s_] += len(q)
    assert all(np.array_equal(buf[:, 1], before) for buf, before in zip(cache.keys + cache.values, host_before))


def test_decode_graph_matches_the_packed_graph_and_leaves_other_slots_alone(tiny_artifact):
    """Rows out of slot order with a live slot between them (run as a dummy row): tokens equal to the packed
    graph's (greedy and sampled rows, the same draws), new entries within 1e-4 in both caches, and the
    slot left out still holds exactly what it held up to its length."""
    m = json.loads((tiny_artifact / "manifest.json").read_text())
    slots = m["limits"]["max_batch"]
    path, cache = _decode_path(tiny_artifact, m, slots)
    rng = np.random.default_rng(0)
    vocab = m["model"]["vocab_size"]
    lens = {0: 9, 1: 5, 2: 12, 3: 3}
    _fill(cache, m, lens, rng)
    host_before = [buf[:, 1].copy() for buf in cache.keys + cache.values]
    call_slots = np.array([3, 0, 2])
    positions = np.array([lens[s] for s in call_slots])
    packed, new, feeds = _packed_call(tiny_artifact, m, cache, [[t] for t in rng.integers(0, vocab, 3)], positions,
                                      call_slots, [0.0, 0.9, 1.0])
    assert path.takes(feeds)
    outs, present = path.run(feeds)
    assert (outs["next_token"] == packed["next_token"]).all() and (outs["accepted"] == 0).all()
    assert max(float(np.abs(a - b).max()) for a, b in zip(present, new)) <= 1e-4
    cache.write(present, positions, call_slots)
    assert not any(buf[positions, call_slots].any() for buf in cache.keys)  # in the copy only, until
    cache.sync_host(call_slots, positions + 1)  # a packed call reads these slots
    for buf, entry in zip([b for kv in zip(cache.keys, cache.values) for b in kv], present):
        assert np.array_equal(buf[positions, call_slots], entry)
    assert all(np.array_equal(buf[:, 1], before) for buf, before in zip(cache.keys + cache.values, host_before))
    assert list(cache.written_end[:4]) == [10, 5, 13, 4]


def test_the_copy_follows_the_host_cache_through_drafts_rollbacks_and_dummy_rows(tiny_artifact):
    """Random steps on four slots: packed calls writing prompts and drafts (some rejected, so later writes go
    back over them) and decode calls over random subsets (live slots left out run as dummy rows). Every
    decode call gives the packed graph's tokens and entries; a slot no decode call read was never copied,
    and syncing the others both ways leaves their copies equal to the host cache up to their lengths."""
    m = json.loads((tiny_artifact / "manifest.json").read_text())
    path, cache = _decode_path(tiny_artifact, m, m["limits"]["max_batch"])
    rng = np.random.default_rng(7)
    vocab = m["model"]["vocab_size"]
    length = {s: 0 for s in range(5)}
    for step in range(16):
        if step < 5 or rng.random() < 0.4:  # a prompt or a verify call on the host path
            slot = step if step < 5 else int(rng.integers(0, 5))
            n = int(rng.integers(2, 6))
            _, new, feeds = _packed_call(tiny_artifact, m, cache, [list(rng.integers(0, vocab, n))], [length[slot]],
                                         [slot], [0.0], seed=step)
            cache.write(new, feeds["positions"], np.full(n, slot))
            length[slot] += int(rng.integers(1, n + 1))  # drafts past it rejected: written over later
            continue
        call = np.sort(rng.choice(4, size=int(rng.integers(1, 4)), replace=False))  # slot 4 never decodes
        past = np.array([length[s] for s in call])
        packed, new, feeds = _packed_call(tiny_artifact, m, cache, [[int(t)] for t in rng.integers(0, vocab, len(call))],
                                          past, call, [0.0] * len(call), seed=step)
        assert path.takes(feeds)
        outs, present = path.run(feeds)
        assert (outs["next_token"] == packed["next_token"]).all()
        assert max(float(np.abs(a - b).max()) for a, b in zip(present, new)) <= 1e-4
        cache.write(present, past, call)
        for s_ in call:
            length[s_] += 1
    assert not any(c[4].any() for c in cache.slot_major)  # never read by a decode call: never copied
    lengths = np.array([length[s] for s in range(4)])
    cache.sync(np.arange(4), lengths)  # what the next decode call would do
    cache.sync_host(np.arange(4), lengths)  # and the next packed one
    host = [b for kv in zip(cache.keys, cache.values) for b in kv]
    for s_ in range(4):
        for h, c in zip(host, cache.slot_major):
            assert np.allclose(c[s_, :, :length[s_]], h[:length[s_], s_].transpose(1, 0, 2), atol=1e-4)


def test_one_request_verifying_its_drafts_matches_the_packed_graph(tiny_artifact):
    """One row, a bonus token and three drafts, in a slot other than the first: accepted counts and next
    tokens equal to the packed graph's for greedy and sampled rows over several draws, new entries within
    1e-4."""
    m = json.loads((tiny_artifact / "manifest.json").read_text())
    path, cache = _decode_path(tiny_artifact, m, m["limits"]["max_batch"])
    rng = np.random.default_rng(1)
    vocab = m["model"]["vocab_size"]
    _fill(cache, m, {0: 6, 2: 11}, rng)
    seen = set()
    for seed, temp in enumerate([0.0, 1.0, 1.0, 0.7, 1.0, 1.0]):
        query = list(rng.integers(0, vocab, 4))
        packed, new, feeds = _packed_call(tiny_artifact, m, cache, [query], [11], [2], [temp], drafts=[query[1:]],
                                          seed=seed)
        assert path.takes(feeds)
        outs, present = path.run(feeds)
        assert outs["accepted"] == packed["accepted"] and outs["next_token"] == packed["next_token"]
        assert max(float(np.abs(a - b).max()) for a, b in zip(present, new)) <= 1e-4
        seen.add(int(outs["accepted"][0]))
    assert len(seen) > 1  # the draws took different numbers of drafts


def test_decode_path_takes_plain_rows_and_one_request_verifying(tiny_artifact):
    m = json.loads((tiny_artifact / "manifest.json").read_text())
    path, cache = _decode_path(tiny_artifact, m, 4)

    def call(queries, past_lens, slots, verify_lens):
        return {**pack_queries(queries, past_lens, slots), "verify_lens": np.array(verify_lens)}

    assert path.takes(call([[1], [2]], [3, 4], [0, 1], [0, 0]))
    assert path.takes(call([[1, 2, 3]], [5], [3], [2]))  # one request verifying two drafts
    assert not path.takes(call([[1, 2], [2]], [3, 4], [0, 1], [1, 0]))  # ragged
    assert not path.takes(call([[1, 2], [2, 3]], [3, 4], [0, 1], [1, 1]))  # several rows of several tokens
    assert not path.takes(call([[1, 2, 3]], [0], [0], [0]))  # a prompt: its tokens are not all scored
    # a slot left out whose next entry would fall past the context: the packed graph instead
    cache.written_end[1] = cache.max_context
    assert not path.takes(call([[1], [2]], [3, 4], [0, 2], [0, 0]))
    assert not path.takes(call([[1, 2, 3]], [cache.max_context - 2], [0], [2]))  # past the context


@pytest.mark.parametrize("temperature,graph", [(0.0, "draft_greedy"), (0.9, "draft")])
def test_the_draft_runs_one_requests_calls_on_its_decode_graph_and_others_packed(tiny_artifact, monkeypatch,
                                                                                temperature, graph):
    """One request drafts on the decoding graphs (catch-up and drafting calls alike) with the tokens of the
    packed graphs, greedy and sampled (the same draws); drafting calls of several requests stay on the
    packed graph (they made runs at 4-16 requests 2-4% slower there)."""
    from dspark_trt.runtime import GenerationConfig, Runtime

    cfg = GenerationConfig(max_new_tokens=24, spec="fixed:3", temperature=temperature, seed=5)
    tokens = {}
    for decode in ("1", "0"):
        monkeypatch.setenv("DSPARK_ORT_DECODE", decode)
        with Runtime.load(tiny_artifact, profile="none") as rt:
            tokens[decode] = rt.generate(["def fib(n):"], cfg)[0].token_ids
            calls = dict(rt.backend.calls)
            if decode == "1":
                path = rt.backend.decode[graph]
                feeds = {**pack_queries([[1], [2]], [3, 4], [0, 1]), "prev_survival": np.ones(2, np.float32),
                         "draft_position": np.zeros(2, np.int64), "temperature": np.zeros(2, np.float32),
                         "uniforms": np.zeros(2, np.float32)}
                assert not path.takes(feeds)
                assert path.takes({**pack_queries([[1]], [3], [0]), **{k: feeds[k][:1] for k in (
                    "prev_survival", "draft_position", "temperature", "uniforms")}})
                assert calls.get(f"{graph}.decode", 0) > 0 and calls.get(graph, 0) == 0
    assert tokens["1"] == tokens["0"]


def _generate(art, monkeypatch, decode: str, temperature=0.0, spec_modes=("off", "fixed:2", "adaptive")):
    from dspark_trt.runtime import GenerationConfig, Runtime

    monkeypatch.setenv("DSPARK_ORT_DECODE", decode)
    prompts = ["def fib(n):", "import os\n", "class Foo:", "x = [", "for i in"]
    with Runtime.load(art, profile="none") as rt:
        out = {spec: [o.token_ids for o in rt.generate(
            prompts, GenerationConfig(max_new_tokens=20, spec=spec, temperature=temperature, seed=3))]
            for spec in spec_modes}
        calls = dict(rt.backend.calls)
        copies = (2 if "target" in rt.backend.decode else 1, 2 if "draft" in rt.backend.decode else 1)
    return out, calls, copies


def test_runtime_decodes_on_the_decode_graph_with_identical_outputs(tiny_artifact, monkeypatch):
    on, calls, copies = _generate(tiny_artifact, monkeypatch, "1")
    assert calls.get("target_greedy.decode", 0) > 0 and calls.get("draft_greedy.decode", 0) > 0 and copies == (2, 2)
    off, calls_off, copies_off = _generate(tiny_artifact, monkeypatch, "0")
    assert not any(k.endswith(".decode") for k in calls_off) and copies_off == (1, 1)
    assert on == off
    assert on["adaptive"] == on["off"] == on["fixed:2"]


def test_sampled_tokens_are_the_packed_graphs_draw_for_draw(tiny_artifact, monkeypatch):
    """Plain decoding and fixed K: adaptive's budget reads the step overheads it measures, so which drafts it
    verifies (and so which draws a sampled request uses) follows the machine's timing, not the graph; its
    sampling is checked in distribution (test_sampling_lossless.py)."""
    modes = ("off", "fixed:2")
    on, calls, _ = _generate(tiny_artifact, monkeypatch, "1", temperature=0.9, spec_modes=modes)
    assert calls.get("target.decode", 0) > 0
    off, _, _ = _generate(tiny_artifact, monkeypatch, "0", temperature=0.9, spec_modes=modes)
    assert on == off


def test_runtimes_sharing_one_backends_sessions_each_decode_on_their_own_caches(tiny_artifact):
    """The decoding paths bind the caches of the runtime that asked for them: a second runtime on the same
    backend object is refused (it would decode on the first one's caches), one on for_another_runtime()'s
    copy shares the sessions and keeps its own caches, whichever runs in between."""
    from dspark_trt.errors import DsparkError
    from dspark_trt.runtime.config import GenerationConfig
    from dspark_trt.runtime.runtime import Runtime

    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13]]
    cfg = GenerationConfig(max_new_tokens=16, spec="fixed:2")
    with Runtime.load(tiny_artifact, profile="none") as first:
        assert first.backend.decode  # the tiny artifact decodes on its decoding graphs
        expected = [o.token_ids for o in first.generate(prompts, cfg)]
        with pytest.raises(DsparkError, match="for_another_runtime"):
            Runtime(first.artifact_dir, first.manifest, first.backend, first.tokenizer)
        with Runtime(first.artifact_dir, first.manifest, first.backend.for_another_runtime(),
                     first.tokenizer) as second:
            assert second.backend.sessions is first.backend.sessions
            for rt in (second, first, second):
                assert [o.token_ids for o in rt.generate(prompts, cfg)] == expected


TWICE = {"target": 2, "draft": 2}


def test_a_shorter_context_shrinks_the_copy_and_tight_memory_drops_it(tiny_artifact, monkeypatch):
    from dspark_trt.runtime import GenerationConfig, Runtime
    from dspark_trt.runtime.memory_plan import HEADROOM, kv_bytes

    m = json.loads((tiny_artifact / "manifest.json").read_text())
    ctx = m["limits"]["max_context"]
    prompts, cfg = ["def f():", "import os\n"], GenerationConfig(max_new_tokens=12, spec="off")
    outs = {}
    for decode in ("1", "0"):  # --max-context below the exported one: the copy is that long
        monkeypatch.setenv("DSPARK_ORT_DECODE", decode)
        with Runtime.load(tiny_artifact, profile="none", max_context=ctx // 2) as rt:
            outs[decode] = [r.token_ids for r in rt.generate(prompts, cfg)]
            if decode == "1":
                assert rt.backend.calls["target_greedy.decode"] > 0
                assert rt.target_kv.slot_major[0].shape[2] == rt.draft_kv.slot_major[0].shape[2] == ctx // 2
                assert rt.memory_plan.kv_cache == kv_bytes(m, ctx // 2, 4, TWICE)
    assert outs["1"] == outs["0"]
    monkeypatch.setenv("DSPARK_ORT_DECODE", "1")
    one, two = kv_bytes(m, 64, 4), kv_bytes(m, 64, 4, TWICE)
    assert two - one == sum(2 * f["num_layers"] * 64 * m["limits"]["max_batch"] * f["num_kv_heads"] * f["head_dim"] * 4
                            for f in (m["model"], m["draft"]))
    with Runtime.load(tiny_artifact, profile="none") as rt:
        need_two = rt.memory_plan.total
        assert rt.backend.decode and rt.memory_plan.kv_cache == kv_bytes(m, ctx, 4, TWICE)
    need_one = need_two - (kv_bytes(m, ctx, 4, TWICE) - kv_bytes(m, ctx, 4))
    # room for everything with the cache kept once, not twice: the copy goes, the batch stays
    monkeypatch.setenv("DSPARK_MEMORY_LIMIT_GB", str((need_one + need_two) / 2 / HEADROOM / 2**30))
    with Runtime.load(tiny_artifact, profile="none") as rt:
        assert not rt.backend.decode and rt.max_batch == m["limits"]["max_batch"]
        assert not hasattr(rt.target_kv, "slot_major") and not hasattr(rt.draft_kv, "slot_major")
        assert rt.generate(["def f():"], GenerationConfig(max_new_tokens=4))[0].token_ids


def test_a_sync_copies_only_what_was_written_since_the_last(tiny_artifact):
    """A decode call copies the spans host writes touched since the slot's last sync, not everything from
    there on: the profiler alternates shapes at pasts 32 and 192 in the same slots, and copying 160
    positions a row before every call at 192 priced plain calls 1.7-2x what they cost in a run (adaptive
    then drafted on at 16 requests at 0.7x `off`)."""
    m = json.loads((tiny_artifact / "manifest.json").read_text())
    _, cache = _decode_path(tiny_artifact, m, 4)
    rng = np.random.default_rng(2)
    _fill(cache, m, {0: 200}, rng)
    cache.sync(np.array([0]), np.array([200]))
    assert (cache.stale_lo[0], cache.stale_hi[0]) == (cache.max_context, 0)
    entries = [rng.standard_normal((8, m["model"]["num_kv_heads"], m["model"]["head_dim"])).astype(np.float32)
               for _ in cache.slot_major]
    cache.write(entries, np.arange(32, 40), np.zeros(8, np.int64))
    assert (cache.stale_lo[0], cache.stale_hi[0]) == (32, 40)
    before = [c[0].copy() for c in cache.slot_major]
    spent = cache.sync_ms
    cache.sync(np.array([0]), np.array([192]))
    assert cache.sync_ms > spent  # timed: a switch's cost (the verifier keeps it out of call prices)
    spent = cache.sync_ms
    cache.sync(np.array([0]), np.array([192]))
    assert cache.sync_ms == spent  # nothing stale, nothing copied
    for c, b, e in zip(cache.slot_major, before, entries):
        changed = np.flatnonzero((c[0] != b).any(axis=(0, 2)))
        assert set(changed) <= set(range(32, 40)) and np.array_equal(c[0, :, 32:40], e.transpose(1, 0, 2))


def test_decode_entries_reach_the_host_cache_when_a_packed_call_reads_their_slot(tiny_artifact):
    """A decode call's entries stay in the copy (writing them to the host cache after every call was 3% of a
    one-request step); a packed call's sync_host copies them below the slot's length, and drops the rest (a
    rejected draft, written over before it is read), so a later packed write there is never overwritten."""
    from dspark_trt.runtime.backends.ort_decode import DecodeEntries

    m = json.loads((tiny_artifact / "manifest.json").read_text())
    _, cache = _decode_path(tiny_artifact, m, 4)
    rng = np.random.default_rng(3)
    _fill(cache, m, {1: 20}, rng)
    cache.sync(np.array([1]), np.array([20]))  # the decode call brings the copy up to date first
    for c in cache.slot_major:  # what a decode call verifying 5 tokens at positions 20-24 of slot 1 wrote
        c[1, :, 20:25] = rng.standard_normal(c[1, :, 20:25].shape)
    cache.write(DecodeEntries(cache.slot_major, np.ones(5, np.int64), np.arange(20, 25)), np.arange(20, 25),
                np.ones(5, np.int64))
    assert (cache.host_lo[1], cache.host_hi[1], cache.written_end[1]) == (20, 25, 25)
    assert not cache.keys[0][20:25, 1].any()
    cache.sync_host(np.array([1]), np.array([23]))  # two drafts rejected: the request holds 23 positions
    host = [b for kv in zip(cache.keys, cache.values) for b in kv]
    for h, c in zip(host, cache.slot_major):
        assert np.array_equal(h[20:23, 1], c[1, :, 20:23].transpose(1, 0, 2)) and not h[23:25, 1].any()
    assert (cache.host_lo[1], cache.host_hi[1]) == (cache.max_context, 0)
    new = [np.ones((2, m["model"]["num_kv_heads"], m["model"]["head_dim"]), np.float32) for _ in cache.slot_major]
    cache.write(new, np.arange(23, 25), np.ones(2, np.int64))  # the packed call's own entries
    cache.sync_host(np.array([1]), np.array([25]))
    assert all((h[23:25, 1] == 1).all() for h in host)
    assert (cache.stale_lo[1], cache.stale_hi[1]) == (23, 25)  # and the copy is stale there now


def test_a_dspark_artifact_decodes_on_the_decode_graph_with_its_capture_points(tmp_path_factory, monkeypatch):
    """A DSpark target's decode graph also hands out `aux_hidden` (the drafter's context), for the call's
    rows in order: plain and drafting runs give the packed graph's tokens, and the drafter sees the same
    context either way."""
    from dspark_trt.runtime import GenerationConfig, Runtime
    from tests.dspark_fixtures import ARTIFACT_VARIANTS, cached_artifact

    art = cached_artifact(tmp_path_factory, "full", **ARTIFACT_VARIANTS["full"])
    m = json.loads((art / "manifest.json").read_text())
    assert m["graphs"]["target"]["ort"]["decode"] == "target_aux.decode.ort.onnx"
    prompts = [[3, 17, 42, 8, 99], [64, 2, 7, 7, 30, 1, 9], [11, 12]]
    outs, calls = {}, {}
    for decode in ("1", "0"):
        monkeypatch.setenv("DSPARK_ORT_DECODE", decode)
        with Runtime.load(art, profile="none") as rt:
            outs[decode] = {spec: [r.token_ids for r in rt.generate(prompts, GenerationConfig(max_new_tokens=16, spec=spec))]
                            for spec in ("off", "fixed:2", "adaptive")}
            calls[decode] = dict(rt.backend.calls)
    assert any(k.endswith(".decode") for k in calls["1"]) and not any(k.endswith(".decode") for k in calls["0"])
    assert outs["1"] == outs["0"]
    # the capture points of one decode call against the packed graph's (rows out of slot order, a gap)
    path, cache = _decode_path(art, m, m["limits"]["max_batch"])
    rng = np.random.default_rng(3)
    lens = {0: 7, 1: 4, 2: 9}
    _fill(cache, m, lens, rng)
    call = np.array([2, 0])
    packed, new, feeds = _packed_call(art, m, cache, [[5], [9]], [lens[s] for s in call], call, [0.0, 0.0])
    got, present = path.run(feeds)
    assert (got["next_token"] == packed["next_token"]).all()
    assert got["aux_hidden"].shape == packed["aux_hidden"].shape
    assert np.abs(got["aux_hidden"] - packed["aux_hidden"]).max() <= 1e-4
