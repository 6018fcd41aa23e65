"""Paired, interleaved in-process A/B of runtime tunings on one artifact (issue 22 item 6).

    python scripts/ab_tuning.py ARTIFACT --variant on='{}' --variant off='{"call_test": false}' \
        --requests 1,16,64 --rounds 3 --tokens 48 [--draft-scale 3]

Every round runs every variant on the same prompts at every request count, on a fresh Runtime (its own
learned state, as a new process starts), the variants' order alternating from round to round so that a
shared machine's slow drift falls on all of them alike. Loading is outside the timing. ``--draft-scale``
multiplies the profile's draft table (3: a profile 3x too pessimistic about drafting); the profile on
disk is never changed (nothing is persisted at close). Prints, per request count, each variant's median
output tok/s with its range over rounds and its median ratio to the first variant within a round (the
paired comparison); ``--json`` writes every run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def scaled_profile(cost, draft_scale: float):
    from dspark_trt.runtime.costs.table import CostTable

    return CostTable(cost.verify_table(corrected=False), cost.draft_table(corrected=False) * draft_scale, cost.meta,
                     points=cost.points)


def one_run(artifact, tuning_json: dict, prompts, tokens: int, draft_scale: float, mode: str) -> dict:
    from dspark_trt.runtime import GenerationConfig, Runtime
    from dspark_trt.runtime.tuning import RuntimeTuning

    rt = Runtime.load(artifact, backend="ort", profile="load", tuning=RuntimeTuning.from_dict(tuning_json))
    try:
        rt.cost = scaled_profile(rt.cost, draft_scale).tune(rt.tuning.drift)
        cfg = GenerationConfig(max_new_tokens=tokens, spec=mode, stop_at_eos=False)
        rt.generate(prompts[:2], GenerationConfig(max_new_tokens=8, spec=mode))  # warm the engines' shapes
        t, c = time.perf_counter(), time.process_time()
        outs = rt.generate(prompts, cfg)
        s, cpu = time.perf_counter() - t, time.process_time() - c
        n = sum(len(o.token_ids) for o in outs)
        return {"tok_s": n / s, "tok_cpu_s": n / cpu, "tokens": n, "seconds": s, "cpu_seconds": cpu,
                "tau": statistics.mean(o.stats["tau"] for o in outs),
                "explorations": rt.depth_planner.exploration.report() if hasattr(rt.depth_planner, "exploration") else None}
    finally:
        rt.cost = None  # never persist a refined (or scaled) profile next to the artifact
        rt.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--variant", action="append", required=True, help="name=JSON tuning (partial RuntimeTuning)")
    ap.add_argument("--requests", default="1,16,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--draft-scale", type=float, default=1.0)
    ap.add_argument("--mode", default="adaptive")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    variants = [(v.split("=", 1)[0], json.loads(v.split("=", 1)[1])) for v in a.variant]

    from dspark_trt.bench.prompts import corpus_prompts
    from dspark_trt.runtime.tokenizer import load_tokenizer

    tok = load_tokenizer(f"{a.artifact}/tokenizer.json")
    counts = [int(x) for x in a.requests.split(",")]
    pool = [p.ids for p in corpus_prompts(tok.encode, tok.decode, max(counts), seed=0, max_len=60)]
    one_run(a.artifact, variants[0][1], pool[:4], 16, a.draft_scale, a.mode)  # the process's one-time costs
    runs = []
    for rnd in range(a.rounds):
        for n in counts:
            order = variants if rnd % 2 == 0 else variants[::-1]
            for name, tuning in order:
                r = one_run(a.artifact, tuning, pool[:n], a.tokens, a.draft_scale, a.mode)
                runs.append({"round": rnd, "requests": n, "variant": name, **r})
                print(f"round {rnd} n={n:>3} {name:>12}: {r['tok_s']:8.1f} tok/s {r['tok_cpu_s']:8.1f} tok/cpu-s "
                      f"tau {r['tau'] or 0:.2f}", flush=True)
    for key, unit in (("tok_s", "tok/s of wall time"), ("tok_cpu_s", "tok per CPU-second of the process")):
        print(f"\ndraft scale {a.draft_scale}, {a.tokens} tokens/request, {a.rounds} rounds: {unit}, median "
              f"[min-max], and the median over rounds of the ratio to {variants[0][0]} in the same round")
        for n in counts:
            base = {r["round"]: r[key] for r in runs if r["requests"] == n and r["variant"] == variants[0][0]}
            cells = []
            for name, _ in variants:
                xs = [r for r in runs if r["requests"] == n and r["variant"] == name]
                v = [r[key] for r in xs]
                ratio = statistics.median(r[key] / base[r["round"]] for r in xs)
                cells.append(f"{name} {statistics.median(v):.0f} [{min(v):.0f}-{max(v):.0f}] x{ratio:.2f}")
            print(f"n={n:>3}: " + " | ".join(cells))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
