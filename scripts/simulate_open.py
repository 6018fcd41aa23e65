"""The open-loop bench on a simulated clock: deterministic, whatever else the machine runs.

    python scripts/simulate_open.py ARTIFACT --true good.json --rates 0.5x,1x,2x --modes off,fixed:3,adaptive \
        --workload mixed --temperature 0 --duration 10 --seeds 0,1,2

At capacity the open loop's figures move more from run to run than any rule moves them (issue 23: TPOT p50 at
1x ran 6.2-18.9 ms round to round at one rate; a few percent of throughput decide how long the queue grows).
Here, as in scripts/simulate_start.py, every engine call runs for real (drafts, acceptances, sampled and
greedy text are the real ones) but the clock the runtime reads advances by what each call costs under the
TRUE profile, plus each step's host work. Requests arrive on the bench's Poisson schedules with the bench's
workload; the runtime steps in this thread, and when it has nothing to do the clock jumps to the next
arrival. Each (rate, mode, seed) run gets a runtime of its own started from --start (default: the true
profile) with nothing learned. Relative rates are of the simulated capacity: `off` on a burst, as the bench
measures it. Use it to rank mechanisms, then confirm with `dspark-trt bench --rates`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from simulate_start import on_true_costs, simulated_time  # noqa: E402


def run(warm, start, truth, items, arrivals, mode: str, tuning=None) -> tuple[list[dict], float]:
    """One open-loop run: (records as the in-process bench writes them, simulated wall seconds)."""
    from dspark_trt.bench.inprocess import finish_record, new_record, run_end
    from dspark_trt.bench.start_profile import cold_runtime
    from dspark_trt.runtime.config import GenerationConfig

    rt = cold_runtime(warm, start, tuning)
    rt._ensure_worker = lambda: None  # the runtime steps in this thread, between arrivals
    clock = on_true_costs(rt, truth)
    records = [new_record(i, it, at) for i, (it, at) in enumerate(zip(items, arrivals))]
    reqs = []
    try:
        with simulated_time(clock):
            t0 = clock()
            while len(reqs) < len(items) or rt.admission.busy():
                while len(reqs) < len(items) and t0 + arrivals[len(reqs)] <= clock():
                    it, rec = items[len(reqs)], records[len(reqs)]
                    rec["sent_s"] = rec["arrival_s"]
                    cfg = GenerationConfig(max_new_tokens=it.max_tokens, temperature=it.temperature, spec=mode,
                                           seed=it.seed, stop_at_eos=False)
                    reqs.append(rt.submit(it.ids, cfg, stream=True))
                if rt.admission.busy():
                    rt.step()
                else:
                    clock.s = t0 + float(arrivals[len(reqs)])
    finally:
        rt.close()
    for rec, req in zip(records, reqs):
        counts = []
        while (ids := req.pieces.get()) is not None:
            counts.append(len(ids))
        rec["token_times_s"] = [d - t0 for d in req.delivered]
        rec["token_counts"], rec["generated_tokens"] = counts, sum(counts)
        rec["admitted_s"] = req.stats.t_admit - t0
        finish_record(rec, req)
    return records, run_end(records)


def figures(runs) -> dict:
    from dspark_trt.bench.latency import summarize_open, window_tok_s
    from dspark_trt.bench.open_loop import _spec_stats

    recs = [r for rs, _ in runs for r in rs]
    s, spec = summarize_open(recs, sum(w for _, w in runs)), _spec_stats(recs)
    return {"tok_s": window_tok_s(runs), "tpot_p50": s["tpot_ms"]["p50"], "ttft_p99": s["ttft_ms"]["p99"],
            "failed": s["failed"], "tau": spec["tau"],
            "accepted": spec["accepted"] / max(spec["predicted_accepted"], 1e-9)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--true", required=True, help="cost profile whose costs the simulated calls take")
    ap.add_argument("--start", help="cost profile every run starts from (default: --true)")
    ap.add_argument("--rates", default="0.5x,1x,2x")
    ap.add_argument("--modes", default="off,fixed:3,adaptive", help="off, fixed:K, adaptive")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=JSON: adaptive with these RuntimeTuning fields (repeatable)")
    ap.add_argument("--workload", default="mixed")
    ap.add_argument("--temperature", default="0")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals")
    ap.add_argument("--seeds", default="0,1,2", help="one schedule and request set each")
    args = ap.parse_args()

    from dspark_trt.bench.arrivals import poisson_arrivals
    from dspark_trt.bench.open_loop import capacity_from_burst
    from dspark_trt.bench.start_profile import runtime_from
    from dspark_trt.bench.workload import build_requests, parse_temperature, parse_workload
    from dspark_trt.runtime.costs.table import CostTable
    from dspark_trt.runtime.tuning import RuntimeTuning

    start = args.start or args.true
    truth = CostTable.load(args.true)
    runs = [(m, m, None) for m in args.modes.split(",")]
    for spec in args.variant:
        name, _, js = spec.partition("=")
        runs.append((name, "adaptive", RuntimeTuning.from_dict(json.loads(js or "{}"))))
    wl, temps = parse_workload(args.workload), parse_temperature(args.temperature)
    warm = runtime_from(args.artifact, "ort", start)
    try:
        def requests(stream, n):
            return build_requests(wl, n, warm.tokenizer.encode, stream, warm.max_context, temps)

        burst = requests(998, max(16, 2 * warm.slots_total))
        cap = capacity_from_burst(*run(warm, start, truth, burst, np.zeros(len(burst)), "off"),
                                  warm.slots_total)["req_s"]
        print(f"simulated capacity: {cap:.2f} req/s", flush=True)
        seeds = [int(s) for s in args.seeds.split(",")]
        for label in args.rates.split(","):
            rate = float(label[:-1]) * cap if label.endswith("x") else float(label)
            got: dict[str, list] = {name: [] for name, _, _ in runs}
            for seed in seeds:
                arr = poisson_arrivals(rate, [seed, 0], duration=args.duration)
                items = requests(seed * 1000, len(arr))
                for name, mode, tuning in runs:
                    got[name].append(run(warm, start, truth, items, arr, mode, tuning))
            fig = {name: figures(rs) for name, rs in got.items()}
            fixed = [n for n, m, _ in runs if m == "off" or m.startswith("fixed:")]
            best_tpot = min(fig[n]["tpot_p50"] for n in fixed)
            best_tok = max(fig[n]["tok_s"] for n in fixed)
            print(f"rate {label} ({rate:.2f} req/s, {len(seeds)} seeds):")
            for n, f in fig.items():
                print(f"  {n:>10}: tok/s {f['tok_s']:7.0f} ({f['tok_s'] / best_tok:.3f} best)  "
                      f"TPOT p50 {f['tpot_p50']:6.2f} ms ({f['tpot_p50'] / best_tpot:.3f} best, "
                      f"{f['tpot_p50'] / fig['off']['tpot_p50']:.3f} off)  TTFT p99 {f['ttft_p99']:7.1f} ms "
                      f"({f['ttft_p99'] / fig['off']['ttft_p99']:.3f} off)  tau {f['tau']:.2f}  accepted/predicted "
                      f"{f['accepted']:.2f}  failed {f['failed']}", flush=True)
    finally:
        warm.close()


if __name__ == "__main__":
    main()
