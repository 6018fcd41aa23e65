"""The closed loop: ``concurrency`` users each submitting their next request as soon as the last one
finished; per (mode, concurrency) aggregation over rounds, runtime measures, adaptive vs. the baselines."""

from __future__ import annotations

import threading
import time

import numpy as np

from dspark_trt.bench.latency import first_tokens_rate, median_interval, steady_window, summarize_requests
from dspark_trt.bench.options import FIRST_TOKENS, WARMUP_TOKENS
from dspark_trt.errors import DsparkError


def run_metrics(step_log: list[dict], snapshots: list[dict], max_draft: int, cost=None,
                speculative: bool = True) -> dict:
    """Runtime measures of one (mode, concurrency) over its rounds: from the step logs and the summed
    ``Metrics.snapshot()`` counters. ``cost``: (verify table, draft table) for the oracle, or None."""
    from dspark_trt.bench.oracle import oracle_goodput

    steps = sum(s["steps"] for s in snapshots)
    step_ms = sum(s["step_ms_total"] for s in snapshots)
    engine_ms = sum(s["engine_ms_total"] for s in snapshots)
    verified = sum(s["verified_tokens"] for s in snapshots)
    acc = np.zeros(max_draft, dtype=np.int64)
    ver = np.zeros(max_draft, dtype=np.int64)
    for s in snapshots:
        acc[:len(s["accepted_per_position"])] += s["accepted_per_position"]
        ver[:len(s["verified_per_position"])] += s["verified_per_position"]
    decode = [r for r in step_log if r["decode_requests"] > 0]
    n_dec = sum(r["decode_requests"] for r in decode)
    emitted = sum(r["decode_requests"] + sum(r["accepted"]) for r in decode)
    measured_engine = sum(r["draft_ms"] + r["target_ms"] for r in step_log)
    out = {
        "steps": steps,
        "decode_steps": len(decode),
        "tau": emitted / n_dec if n_dec else None,
        "acceptance_per_position": [float(a / v) if v else None for a, v in zip(acc, ver)],
        "verified_per_position": ver.tolist(),
        "verified_tokens_per_step": verified / steps if steps else None,
        "verify_budget_per_decode_request": (sum(sum(r["verify_lens"]) for r in decode) / n_dec) if n_dec else None,
        "requests_per_step": n_dec / len(decode) if decode else None,
        "solver_us_per_step": (sum(r["solver_us"] for r in decode) / len(decode)) if decode else None,
        "overhead_frac": (step_ms - engine_ms) / step_ms if step_ms > 0 else None,
        "step_ms_mean": step_ms / steps if steps else None,
        "oracle_goodput_frac": None,
        "oracle": None,
    }
    # Predicted vs measured, summed over the rounds (runtime/explain.py): how far the solver's survivals
    # and cost model were from what happened.
    for key in ("predicted_accepted", "accepted", "predicted_step_ms", "measured_step_ms"):
        out[key] = sum(s.get(key, 0) for s in snapshots)
    if cost is not None and step_log:
        o = oracle_goodput(step_log, cost[0], cost[1])
        o["modelled_over_measured"] = o["actual_ms"] / measured_engine if measured_engine > 0 else None
        out["oracle"] = o
        if speculative:
            out["oracle_goodput_frac"] = o["fraction"]
    return out


# ----------------------------------------------------------------------------------------- measuring

def _wait_idle(rt, timeout: float = 30.0) -> None:
    """Wait until the runtime's worker has finished its last step (requests complete inside a step,
    before the step's metrics are recorded)."""
    if not rt.wait_idle(timeout):
        raise DsparkError("the runtime did not go idle after a benchmark run (a step hung?); rerun with --debug")


def _closed_loop(rt, prompts, mode: str, concurrency: int, n_requests: int, max_new_tokens: int,
                 temperature: float, seed: int, bar=None, first: int = 0) -> tuple[list[dict], float]:
    """``concurrency`` users, each submitting its next request as soon as its last one finished; the
    requests are numbers first .. first + n_requests - 1 (request i: prompt i mod len(prompts), seed + i)."""
    from dspark_trt.runtime.config import GenerationConfig

    results: list[dict | None] = [None] * n_requests
    errors: list[str] = []
    counter = iter(range(first, first + n_requests))
    lock = threading.Lock()

    def user():
        while True:
            with lock:
                i = next(counter, None)
            if i is None or errors:
                return
            cfg = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, spec=mode,
                                   seed=seed + i, stop_at_eos=False)
            try:
                submitted = time.perf_counter()
                req = rt.submit(prompts[i % len(prompts)].ids, cfg)
                req.done.wait()
                done = time.perf_counter()
                res = rt.result(req)
            except Exception as e:  # surfaced below in the main thread
                errors.append(f"{type(e).__name__}: {e}")
                return
            if res.error:
                errors.append(res.error)
                return
            results[i - first] = {"token_ids": res.token_ids, "submitted_at": submitted, "done_at": done, **{
                k: res.stats.get(k) for k in ("generated_tokens", "latency_s", "time_to_first_token_s", "steps", "tau")}}
            if bar is not None:
                bar.update(1)

    threads = [threading.Thread(target=user, name=f"bench-user-{u}", daemon=True) for u in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise DsparkError(f"a request failed in mode {mode} at concurrency {concurrency}: {errors[0]}")
    return [r for r in results if r is not None], wall


def _measure(rt, prompts, mode, concurrency, n_requests, max_new_tokens, temperature, seed, bar,
             first: int = 0) -> dict:
    _wait_idle(rt)
    rt.metrics.reset()
    reqs, wall = _closed_loop(rt, prompts, mode, concurrency, n_requests, max_new_tokens, temperature, seed, bar,
                              first)
    _wait_idle(rt)
    corr = getattr(rt, "survival_correction", None)
    timeline = list(rt.metrics.timeline)
    return {"requests": reqs, "wall_s": wall, "snapshots": [rt.metrics.snapshot()],
            "step_log": [dict(r) for r in rt.metrics.step_log], "timeline": timeline,
            "window": steady_window(timeline, reqs, concurrency), "first_tokens": first_tokens_rate(timeline, reqs, FIRST_TOKENS),
            "survival_correction": corr.report() if corr is not None else None}


def merge_slices(parts: list[dict]) -> dict:
    """One round of a mode from its slices (options.run_slices), the other modes' slices run in between:
    requests, steps and counters together; the steady window the sum of the slices' windows, and the first
    tokens' rate over the slices' own time, laid end to end."""
    if len(parts) == 1:
        return parts[0]
    windows = [p["window"] for p in parts]
    stitched, tokens, seconds = [], 0, 0.0
    for p in parts:
        starts = [r["submitted_at"] for r in p["requests"] if r.get("submitted_at") is not None]
        if not starts or not p["timeline"]:
            continue
        t0 = min(starts)
        stitched += [(seconds + t - t0, tokens + k) for t, k in p["timeline"]]
        tokens, seconds = stitched[-1][1], stitched[-1][0]
    return {"requests": [r for p in parts for r in p["requests"]], "wall_s": sum(p["wall_s"] for p in parts),
            "snapshots": [s for p in parts for s in p["snapshots"]],
            "step_log": [r for p in parts for r in p["step_log"]], "timeline": stitched,
            "window": None if None in windows else (sum(w[0] for w in windows), sum(w[1] for w in windows)),
            "first_tokens": first_tokens_rate(stitched, [{"submitted_at": 0.0}], FIRST_TOKENS),
            "survival_correction": parts[-1]["survival_correction"]}


def _warmup(rt, prompts, modes, concurrency, temperature, seed) -> None:
    """One untimed wave mixing all modes at the largest concurrency (sessions, allocators, caches)."""
    from dspark_trt.runtime.config import GenerationConfig

    n = max(len(modes), concurrency)
    reqs = [rt.submit(prompts[i % len(prompts)].ids,
                      GenerationConfig(max_new_tokens=WARMUP_TOKENS, temperature=temperature, spec=modes[i % len(modes)],
                                       seed=seed + i, stop_at_eos=False)) for i in range(n)]
    for r in reqs:
        r.done.wait()
        if r.error:
            raise DsparkError(f"warm-up request failed: {r.error}")
    _wait_idle(rt)


def _summary(runs: list[dict], concurrency: list[int]) -> list[dict]:
    """Per concurrency: adaptive vs off and vs the best fixed K (in-sample and held out, see DEFINITIONS)."""
    out = []
    for c in concurrency:
        rows = {r["mode"]: r for r in runs if r["concurrency"] == c}
        fixed = [r for m, r in rows.items() if m.startswith("fixed:")]
        best = max(fixed, key=lambda r: r["output_tok_s"]) if fixed else None
        off = rows.get("off")
        ad = rows.get("adaptive")
        top = max([r for r in (off, best) if r is not None], key=lambda r: r["output_tok_s"], default=None)
        first = [r["first_tokens_tok_s"] for r in (off, *fixed) if r is not None and r.get("first_tokens_tok_s")]
        baselines = [r for r in (off, *fixed) if r is not None]
        held, picks, held_rounds = _held_out(ad, baselines)
        interval = median_interval(held_rounds)
        held_first, _, first_rounds = _held_out(ad, baselines, "round_first_tokens_tok_s")
        first_interval = median_interval(first_rounds)
        out.append({
            "concurrency": c,
            "off_tok_s": off["output_tok_s"] if off else None,
            "best_fixed": best["mode"] if best else None,
            "best_fixed_tok_s": best["output_tok_s"] if best else None,
            "adaptive_tok_s": ad["output_tok_s"] if ad else None,
            "adaptive_over_best": ad["output_tok_s"] / top["output_tok_s"] if ad and top else None,
            "adaptive_over_best_rounds": _paired(ad, top),
            "adaptive_over_best_held_out": held,
            "held_out_picks": picks,
            "adaptive_over_best_held_out_rounds": held_rounds,
            "adaptive_over_best_held_out_interval": list(interval[:2]) if interval else None,
            "adaptive_over_best_held_out_coverage": interval[2] if interval else None,
            "engine_drift": _engine_drift(rows.values()),
            "adaptive_over_off": ad["output_tok_s"] / off["output_tok_s"] if ad and off and off["output_tok_s"] else None,
            "first_tokens": FIRST_TOKENS,
            "adaptive_over_best_first_tokens": (ad["first_tokens_tok_s"] / max(first)
                                                if ad and ad.get("first_tokens_tok_s") and first else None),
            "adaptive_over_best_first_tokens_held_out": held_first,
            "adaptive_over_best_first_tokens_held_out_interval": list(first_interval[:2]) if first_interval else None,
        })
    return out


def _paired(a: dict | None, b: dict | None) -> list[float]:
    """a's throughput over b's, round by round (the two ran in the same pass over the modes)."""
    if not a or not b or len(a["round_output_tok_s"]) != len(b["round_output_tok_s"]):
        return []
    return [x / y for x, y in zip(a["round_output_tok_s"], b["round_output_tok_s"]) if y > 0]


def _engine_drift(rows) -> float | None:
    """How much the machine's speed moved between rounds: per mode, its fastest round's engine speed
    (profiled cost of its engine calls / their measured time) over its slowest round's; the median over
    modes. Same calls, same profile: what is left is the machine (on a shared CPU the same engine call
    can run 1.5x slower for a second). Differences between modes much below it need many rounds to show."""
    spreads = [max(v) / min(v) for r in rows if len(v := [x for x in r.get("round_engine_speed") or [] if x]) >= 2]
    return float(np.median(spreads)) if spreads else None


def _held_out(ad: dict | None, baselines: list[dict], key: str = "round_output_tok_s"
              ) -> tuple[float | None, list[str], list[float]]:
    """Adaptive over the baseline a tuner would pick, judged on rounds it was not picked on.

    For each round: the baseline (off or a fixed K) with the highest median over the *other* rounds,
    and adaptive's throughput over that baseline's in this round; the median of those ratios. The
    in-sample ratio divides by the best of eight noisy medians, which overstates the best arm by about
    the noise (the winner's curse): with every arm equally fast it would put adaptive ~1-2 noise widths
    below 1. key: the per-round figure (steady throughput, or the first tokens' rate: a 512-token window
    moved 15-20% from round to round on the 2-core VM). Returns (median, picks, the per-round ratios);
    (None, [], []) with fewer than two rounds, or a round without the figure."""
    mine = (ad or {}).get(key) or []
    theirs = [(r["mode"], r.get(key) or []) for r in baselines]
    n = len(mine)
    if n < 2 or not theirs or any(len(v) != n for _, v in theirs) \
            or any(x is None for v in (mine, *(v for _, v in theirs)) for x in v):
        return None, [], []

    def others(v: list, i: int) -> float:
        return float(np.median([x for j, x in enumerate(v) if j != i]))

    ratios, picks = [], []
    for i in range(n):
        mode, v = max(theirs, key=lambda b: others(b[1], i))
        if v[i] > 0:
            ratios.append(mine[i] / v[i])
            picks.append(mode)
    return (float(np.median(ratios)) if ratios else None), picks, ratios


def _aggregate(raw: dict, c: int, max_draft: int, cost, temperature: float) -> list[dict]:
    rows = []
    off = raw.get("off")
    for mode, runs in raw.items():
        reqs = [r for run in runs for r in run["requests"]]
        row = {"mode": mode, "concurrency": c, "rounds": len(runs)}
        row.update(summarize_requests(reqs, sum(run["wall_s"] for run in runs)))
        row.update(run_metrics([s for run in runs for s in run["step_log"]], [s for run in runs for s in run["snapshots"]],
                               max_draft, cost, speculative=mode != "off"))
        whole = [sum(r["generated_tokens"] for r in run["requests"]) / run["wall_s"] for run in runs]
        windows = [run["window"] for run in runs]
        row["output_tok_s_whole_run"] = row["output_tok_s"]
        row["steady_state"] = all(w is not None for w in windows)
        if row["steady_state"]:  # every round had a full-concurrency window: its rate is the round's figure
            row["round_output_tok_s"] = [w[0] / w[1] for w in windows]
        else:
            row["round_output_tok_s"] = whole
        # The median over rounds: a burst of load from outside (a shared machine) that hits one round of
        # one mode moves a sum of rounds by its whole size, the median little.
        row["output_tok_s"] = float(np.median(row["round_output_tok_s"]))
        row["round_output_tok_s_whole_run"] = whole
        first = [run["first_tokens"] for run in runs]
        row["round_first_tokens_tok_s"] = first
        row["first_tokens_tok_s"] = float(np.median(first)) if all(x is not None for x in first) else None
        row["round_engine_speed"] = [_engine_speed(run["step_log"], cost) for run in runs] if cost is not None else []
        # The runtime's online survival recalibration after this cell (learned from every mode so far).
        row["survival_correction"] = runs[-1].get("survival_correction")
        row["greedy_match_off"] = None
        if temperature == 0 and off is not None:
            same = total = 0
            for run, base in zip(runs, off):
                for a, b in zip(run["requests"], base["requests"]):
                    total += 1
                    same += a["token_ids"] == b["token_ids"]
            row["greedy_match_off"] = same / total if total else None
        rows.append(row)
    return rows


def _engine_speed(step_log: list[dict], cost) -> float | None:
    """Profiled cost of a run's engine calls over their measured time (1.0: as fast as when profiled): the
    per-round form of the row's ``oracle["modelled_over_measured"]`` (run_metrics, over all rounds)."""
    from dspark_trt.bench.oracle import oracle_goodput

    measured = sum(r["draft_ms"] + r["target_ms"] for r in step_log)
    return oracle_goodput(step_log, cost[0], cost[1])["actual_ms"] / measured if measured > 0 else None


def _run_peers(manifest, prompts, max_new_tokens, temperature, seed, off_c1, bar) -> list[dict]:
    from dspark_trt.bench.peers import run_peers

    src = manifest.get("sources") or {}
    raw = run_peers(src.get("target"), src.get("draft"), [p.ids for p in prompts], max_new_tokens, temperature,
                    seed, dtype=manifest.get("model", {}).get("dtype", "fp32"), bar=bar)
    rows = []
    for p in raw:
        row = {"engine": "hf", "mode": p["mode"], "concurrency": 1, "label": p["label"], "device": p["device"],
               "threads": p["threads"], "versions": {"torch": p["torch"], "transformers": p["transformers"]}}
        row.update(summarize_requests(p["requests"], p["wall_s"]))
        if "assistant" in p:
            row["assistant"] = p["assistant"]
        row["greedy_match_off"] = None
        if temperature == 0 and off_c1:
            same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(p["requests"], off_c1))
            row["greedy_match_off"] = same / len(p["requests"])
            row["greedy_mismatches"] = [i for i, (a, b) in enumerate(zip(p["requests"], off_c1))
                                        if a["token_ids"] != b["token_ids"]]
        row["identical"] = row["greedy_match_off"] == 1.0 if row["greedy_match_off"] is not None else None
        rows.append(row)
    return rows


def _comparison(runs, peers) -> list[dict]:
    c1 = {r["mode"]: r for r in runs if r["concurrency"] == 1}
    fixed = [r for m, r in c1.items() if m.startswith("fixed:")]
    picks = [("off", c1.get("off"), "dspark-trt off")]
    if fixed:
        best = max(fixed, key=lambda r: r["output_tok_s_whole_run"])
        picks.append((best["mode"], best, f"dspark-trt {best['mode']} (best fixed)"))
    picks.append(("adaptive", c1.get("adaptive"), "dspark-trt adaptive"))
    # Peers run one request at a time and are timed over the whole run; ours are compared the same way.
    rows = [{"mode": m, "label": label, "output_tok_s": r["output_tok_s_whole_run"],
             **{k: r.get(k) for k in ("per_user_tok_s_p50", "per_user_tok_s_p90", "tpot_ms_p50", "greedy_match_off")}}
            for m, r, label in picks if r is not None]
    rows += [{"mode": p["mode"], "label": p["label"], **{k: p.get(k) for k in (
        "output_tok_s", "per_user_tok_s_p50", "per_user_tok_s_p90", "tpot_ms_p50", "greedy_match_off")}}
        for p in peers if p["concurrency"] == 1 and p.get("output_tok_s")]
    base = next((p["output_tok_s"] for p in peers if p["mode"] == "hf:target"), None)
    for r in rows:
        r["speedup_over_hf_target"] = r["output_tok_s"] / base if base and r.get("output_tok_s") else None
    return rows
