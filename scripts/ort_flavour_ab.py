"""Paired A/B of the ORT backend's graph flavours: standard graphs vs the artifact's ORT flavour, one process.

    PYTHONPATH=<tree> python scripts/ort_flavour_ab.py ARTIFACT --conc 1,16,64 --modes off,adaptive --rounds 4

ARTIFACT must have been exported with `--ort-flavour fused`. Both flavours' sessions are opened once;
each round runs every (concurrency, mode) cell once per flavour, the order alternating between rounds,
steps in this thread, greedy, EOS ignored, max(4, c) held-out prompts at concurrency c. One JSON line
per run: ms per step (`wall`, and `ort_target` / `ort_draft`, the time inside the sessions' run calls),
output tokens per second, and a hash of the generated tokens (equal across flavours when greedy is
unchanged). Ends with one summary line per cell: medians and ranges over rounds of fused/standard.

--engine N: instead, the graphs alone: N interleaved runs of each flavour's draft and target session on
the same synthetic packed feeds (R requests of Lq new tokens over a past of 120 positions, greedy), one
line per (graph, R, Lq) with min and median ms of each flavour and the median of the paired ratios.
On a shared machine the engine-only medians are steadier than whole generations.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path


class _Timed:
    """An InferenceSession proxy that adds the time of each `run` to acc[key]."""

    def __init__(self, sess, acc, key):
        self._sess, self._acc, self._key = sess, acc, key

    def __getattr__(self, name):
        return getattr(self._sess, name)

    def run(self, *a, **k):
        t = time.perf_counter()
        try:
            return self._sess.run(*a, **k)
        finally:
            self._acc[self._key] += time.perf_counter() - t


def run_once(rt, prompts, mode, conc, new_tokens):
    from dspark_trt.runtime import GenerationConfig

    rt.admission.max_batch = conc
    cfg = GenerationConfig(max_new_tokens=new_tokens, temperature=0.0, spec=mode, stop_at_eos=False)
    reqs = [rt.submit(p, cfg) for p in prompts]
    steps = 0
    t = time.perf_counter()
    while rt.step():
        steps += 1
    wall = time.perf_counter() - t
    assert all(r.finished for r in reqs)
    return steps, wall, [r.generated_ids for r in reqs]


ENGINE_SHAPES = ((1, 1), (1, 4), (16, 1), (16, 3), (64, 1), (64, 2), (4, 64))  # (R, Lq) per call; the last a prefill
ENGINE_PAST = 120


def engine_feeds(manifest, graph: str, r: int, lq: int, rng):
    import numpy as np

    from dspark_trt.manifest import kv_names
    from dspark_trt.runtime.batch import pack_queries, verify_rows

    facts = manifest["model"] if graph == "target" else manifest["draft"]
    vocab, slots = manifest["model"]["vocab_size"], manifest["limits"]["max_batch"]
    r = min(r, slots)
    feeds = pack_queries([list(rng.integers(0, vocab, lq)) for _ in range(r)], [ENGINE_PAST - 8] * r, list(range(r)))
    if graph == "target":
        vl = np.full(r, lq - 1)
        feeds["verify_index"] = verify_rows(feeds["query_lens"], vl)
        m = len(feeds["verify_index"])
        feeds.update(verify_lens=vl, draft_tokens=rng.integers(0, vocab, m), draft_probs=np.zeros((m, vocab), np.float32),
                     temperature=np.zeros(r, np.float32), accept_uniforms=rng.random(m, dtype=np.float32),
                     sample_uniforms=rng.random(r, dtype=np.float32))
    else:
        feeds.update(temperature=np.zeros(r, np.float32), uniforms=rng.random(r, dtype=np.float32),
                     prev_survival=np.ones(r, np.float32), draft_position=np.zeros(r, np.int64))
    shape = (ENGINE_PAST, slots, facts["num_kv_heads"], facts["head_dim"])
    dtype = np.float16 if manifest["model"]["dtype"] == "fp16" else np.float32
    past = [rng.standard_normal(shape).astype(dtype) for _ in range(2 * facts["num_layers"])]
    return {**feeds, **dict(zip(kv_names(facts["num_layers"], "past"), past))}


def engine_ab(artifact, reps: int) -> None:
    import numpy as np

    from dspark_trt.manifest import Manifest
    from dspark_trt.runtime.backends.ort import graph_file, open_session, session_options

    manifest = Manifest.load(artifact)
    opts = session_options()  # the backend's own
    rng = np.random.default_rng(0)
    for graph in ("target", "draft"):
        sessions = {name: open_session(Path(artifact) / graph_file(manifest, graph, flavour), opts)
                    for name, flavour in (("standard", "standard"), ("fused", "auto"))}
        for r, lq in ENGINE_SHAPES:
            feeds = engine_feeds(manifest, graph, r, lq, rng)
            times = {name: [] for name in sessions}
            for s in sessions.values():
                s.run(None, feeds)
            for rep in range(reps):
                for name in (list(sessions) if rep % 2 == 0 else list(sessions)[::-1]):
                    t = time.perf_counter()
                    sessions[name].run(None, feeds)
                    times[name].append((time.perf_counter() - t) * 1e3)
            ratio = [f / s for f, s in zip(times["fused"], times["standard"])]
            print(json.dumps({"engine": graph, "requests": r, "query_len": lq, "reps": reps,
                              "ms_min": {n: round(min(t), 3) for n, t in times.items()},
                              "ms_median": {n: round(statistics.median(t), 3) for n, t in times.items()},
                              "fused_over_standard_median": round(statistics.median(ratio), 3)}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--conc", default="1,16,64")
    ap.add_argument("--modes", default="off,adaptive")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--engine", type=int, default=0, metavar="N")
    args = ap.parse_args()
    if args.engine:
        return engine_ab(args.artifact, args.engine)

    from dspark_trt.bench.prompts import corpus_prompts
    from dspark_trt.runtime import Runtime
    from dspark_trt.runtime.backends.ort import graph_file, open_session, session_options

    rt = Runtime.load(args.artifact, backend="ort", profile="auto")
    rt._ensure_worker = lambda: None  # steps run here, in this thread
    be, acc = rt.backend, defaultdict(float)
    flavours = {}
    for flavour in ("standard", "auto"):
        sessions = {g: open_session(Path(args.artifact) / graph_file(rt.manifest, g, flavour), session_options())
                    for g in ("draft", "target")}
        flavours["fused" if flavour == "auto" else flavour] = {g: _Timed(s, acc, "ort_" + g) for g, s in sessions.items()}
    if graph_file(rt.manifest, "target") == graph_file(rt.manifest, "target", "standard"):
        raise SystemExit(f"{args.artifact} has no ORT flavour: export it with --ort-flavour fused")
    concs = [int(c) for c in args.conc.split(",")]
    prompts = [p.ids for p in corpus_prompts(rt.tokenizer.encode, rt.tokenizer.decode, max(4, max(concs)), 0, 60)]
    for name in flavours:  # warm-up: first shapes allocate
        be.sessions = flavours[name]
        run_once(rt, prompts[:4], "adaptive", 4, 16)
    cells = defaultdict(lambda: defaultdict(list))
    for rnd in range(args.rounds):
        for conc in concs:
            for mode in args.modes.split(","):
                order = list(flavours) if rnd % 2 == 0 else list(flavours)[::-1]
                for name in order:
                    be.sessions = flavours[name]
                    acc.clear()
                    batch = prompts[:max(4, conc)]
                    steps, wall, outs = run_once(rt, batch, mode, conc, args.new_tokens)
                    per = {k: round(v * 1e3 / steps, 3) for k, v in acc.items()}
                    row = {"flavour": name, "round": rnd, "conc": conc, "mode": mode, "steps": steps,
                           "ms_per_step": dict(per, wall=round(wall * 1e3 / steps, 3)),
                           "tok_s": round(sum(map(len, outs)) / wall, 1),
                           "tokens_sha": hashlib.sha256(str(outs).encode()).hexdigest()[:12]}
                    cells[(conc, mode)][name].append(row)
                    print(json.dumps(row), flush=True)
    for (conc, mode), by in cells.items():
        ratio = [f["ms_per_step"]["wall"] / s["ms_per_step"]["wall"] for f, s in zip(by["fused"], by["standard"])]
        med = {n: {k: round(statistics.median(r["ms_per_step"].get(k, 0.0) for r in rows), 3)
                   for k in ("wall", "ort_target", "ort_draft")} for n, rows in by.items()}
        tok = {n: round(statistics.median(r["tok_s"] for r in rows), 1) for n, rows in by.items()}
        same = len({r["tokens_sha"] for rows in by.values() for r in rows}) == 1
        print(json.dumps({"summary": True, "conc": conc, "mode": mode, "rounds": len(ratio),
                          "fused_over_standard_step": {"median": round(statistics.median(ratio), 3),
                                                       "min": round(min(ratio), 3), "max": round(max(ratio), 3)},
                          "ms_per_step_median": med, "tok_s_median": tok, "greedy_identical": same}), flush=True)


if __name__ == "__main__":
    main()
