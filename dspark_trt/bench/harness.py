"""`dspark-trt bench`: closed-loop throughput vs concurrency for every speculation mode.

Method
- One runtime (the artifact, one backend) serves every run. Prompts are fixed token-id lists (see
  :mod:`dspark_trt.bench.prompts`), identical for every mode and concurrency.
- A run = (mode, concurrency c): c simulated users, each submitting a request and, as soon as it finishes,
  the next one (closed loop: c requests in flight), until max(num_prompts, WAVES * c) requests are done
  (at least WAVES waves, so a run measures the steady state rather than one start-up and one ramp-down
  of a single wave); request i uses prompt i mod num_prompts and sampling seed seed + i. Every request generates exactly
  max_new_tokens tokens (EOS does not stop it), so every mode emits the same tokens.
- For each concurrency the modes run in turn (interleaved), ``rounds`` times with the mode order rotated
  each round, so slow machine drift hits all modes alike; a (mode, c) row aggregates its rounds.
- Concurrency above the artifact's max batch is capped to it (said on the console and in results.json).

Outputs (in ``out_dir``; when it already holds results, in a new ``out_dir/run-YYYYmmdd-HHMMSS``
subdirectory instead, never overwriting, unless ``force=True``): results.json, results.md,
throughput.png. results.json and results.md are rewritten after each concurrency level, so an
interrupted benchmark keeps what it measured (``"complete": false``).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import shlex
import sys
import threading
import time
from pathlib import Path

import numpy as np

from dspark_trt.errors import DsparkError

# The CLI's defaults (dspark_trt/cli.py `bench`): --quick replaces an option only while it has this value.
DEFAULT_CONCURRENCY = "1,2,4,8,16,32,64"
DEFAULT_MODES = "off,fixed:1,fixed:2,fixed:3,fixed:4,fixed:5,fixed:6,fixed:7,adaptive"
DEFAULT_NUM_PROMPTS = 64
DEFAULT_MAX_NEW_TOKENS = 64
QUICK = {"concurrency": "1,4,16", "modes": "off,fixed:2,fixed:4,adaptive", "num_prompts": 12, "max_new_tokens": 32}
RESULT_FILES = ("results.json", "results.md", "throughput.png")
WARMUP_TOKENS = 8
WAVES = 3  # each run completes at least this many requests per user

__all__ = ["run_bench", "apply_quick", "requests_per_run", "parse_concurrency", "parse_modes", "resolve_out_dir", "summarize_requests",
           "run_metrics", "DEFAULT_CONCURRENCY", "DEFAULT_MODES", "QUICK"]


# ------------------------------------------------------------------------------------------ arguments

def apply_quick(concurrency, modes, num_prompts, max_new_tokens) -> tuple[str, str, int, int]:
    """The --quick preset: each of the four options still at its CLI default takes the QUICK value."""
    return (QUICK["concurrency"] if str(concurrency) == DEFAULT_CONCURRENCY else str(concurrency),
            QUICK["modes"] if str(modes) == DEFAULT_MODES else str(modes),
            QUICK["num_prompts"] if int(num_prompts) == DEFAULT_NUM_PROMPTS else int(num_prompts),
            QUICK["max_new_tokens"] if int(max_new_tokens) == DEFAULT_MAX_NEW_TOKENS else int(max_new_tokens))


def requests_per_run(num_prompts: int, concurrency: int) -> int:
    """Requests completed in one (mode, concurrency) run: every prompt once, and at least WAVES per user."""
    return max(int(num_prompts), WAVES * int(concurrency))


def parse_concurrency(value) -> list[int]:
    """'1,2,4' -> [1, 2, 4] (sorted, duplicates dropped); a bad value is a DsparkError."""
    items = [s.strip() for s in str(value).split(",")] if not isinstance(value, (list, tuple)) else list(value)
    out = []
    for s in items:
        try:
            c = int(s)
        except (TypeError, ValueError):
            c = 0
        if c < 1 or str(s).strip() != str(c):
            raise DsparkError(f"--concurrency {value!r}: {s!r} is not a positive integer "
                              f"(give comma-separated levels, e.g. 1,4,16)")
        out.append(c)
    return sorted(set(out))


def parse_modes(value, max_draft: int | None = None) -> list[str]:
    """'off,fixed:2,adaptive' -> canonical mode names in the given order, duplicates dropped (fixed:0 is off).
    With ``max_draft``, fixed:K above it is a DsparkError naming the re-export."""
    from dspark_trt.runtime.config import parse_spec

    items = [s.strip() for s in str(value).split(",")] if not isinstance(value, (list, tuple)) else list(value)
    out: list[str] = []
    for s in items:
        try:
            mode = str(parse_spec(s, max_draft))
        except DsparkError as e:
            raise DsparkError(f"--modes {value!r}: {e}") from None
        if mode not in out:
            out.append(mode)
    if not out:
        raise DsparkError(f"--modes {value!r} names no mode (use off, fixed:K, adaptive)")
    return out


def resolve_out_dir(out_dir, force: bool = False) -> tuple[Path, str | None]:
    """Where to write: ``out_dir`` unless it already holds results (then a new timestamped subdirectory,
    unless ``force``). Returns (directory, note for the console or None). Creates nothing."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise DsparkError(f"--out {out} is a file, not a directory; give a directory")
    existing = [f for f in RESULT_FILES if (out / f).exists()]
    if not existing or force:
        return out, (f"overwriting results in {out} (force)" if existing else None)
    stamp = _dt.datetime.now().strftime("run-%Y%m%d-%H%M%S")
    sub, n = out / stamp, 2
    while sub.exists():
        sub, n = out / f"{stamp}-{n}", n + 1
    return sub, f"{out} already holds results ({', '.join(existing)}): writing into {sub} instead"


# --------------------------------------------------------------------------------------------- stats

def _pct(values, q: float):
    v = [x for x in values if x is not None]
    return float(np.percentile(v, q)) if v else None


def median_interval(values, level: float = 0.9) -> tuple[float, float, float] | None:
    """A distribution-free confidence interval for the median of ``values``' population: (lo, hi, coverage).

    The k-th smallest and k-th largest values cover the median with probability 1 - 2 P(B <= k - 1),
    B ~ Binomial(n, 1/2) (the sign test); k is the largest giving at least ``level``. With too few values
    for ``level`` (n <= 4 at 0.9) it is the whole range, with the lower coverage it has. None for n < 2."""
    v = sorted(float(x) for x in values if x is not None)
    n = len(v)
    if n < 2:
        return None

    def coverage(k: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n

    k = 1
    while k + 1 <= n // 2 and coverage(k + 1) >= level:
        k += 1
    return v[k - 1], v[n - k], coverage(k)


def summarize_requests(requests: list[dict], wall_s: float) -> dict:
    """Per-request records (``generated_tokens``, ``latency_s``, optional ``time_to_first_token_s``) of one
    or more runs with total measured wall time ``wall_s`` -> throughput and per-user statistics.

    - output_tok_s: all generated tokens / wall time of the runs (first submission to last completion).
    - per-user tok/s of a request: generated tokens / its latency (submission to last token, prefill
      included). p50 is the median; p90 is the tail, the rate 90% of requests reached or beat (the 10th
      percentile of the rates), like a p90 latency.
    - tpot_ms (time per output token) of a request: (latency - time to first token) / (generated - 1);
      p50 median, p90 the 90th percentile (the slow tail). Without TTFT (peers): latency / generated.
    """
    gen = [int(r["generated_tokens"]) for r in requests]
    lat = [float(r["latency_s"]) for r in requests]
    rates = [g / t for g, t in zip(gen, lat) if t > 0]
    tpot, ttft = [], []
    for r, g, t in zip(requests, gen, lat):
        f = r.get("time_to_first_token_s")
        if f is not None:
            ttft.append(f * 1e3)
            if g > 1:
                tpot.append((t - f) / (g - 1) * 1e3)
        elif g > 0:
            tpot.append(t / g * 1e3)
    total = sum(gen)
    return {
        "requests": len(requests),
        "generated_tokens": total,
        "wall_s": wall_s,
        "output_tok_s": total / wall_s if wall_s > 0 else 0.0,
        "per_user_tok_s_p50": _pct(rates, 50),
        "per_user_tok_s_p90": _pct(rates, 10),
        "per_user_tok_s_mean": float(np.mean(rates)) if rates else None,
        "tpot_ms_p50": _pct(tpot, 50),
        "tpot_ms_p90": _pct(tpot, 90),
        "ttft_ms_p50": _pct(ttft, 50),
        "ttft_ms_p90": _pct(ttft, 90),
        "latency_s_p50": _pct(lat, 50),
        "latency_s_p90": _pct(lat, 90),
    }


def steady_window(timeline: list, requests: list[dict]) -> tuple[int, float] | None:
    """(tokens, seconds) generated while the closed loop ran at full concurrency, or None.

    The window runs from the first completion (before it, every request started together: one prefill
    wave) to the last submission (after it, no request replaces a finished one and the batch drains, so
    the run's length turns on its slowest last requests). ``timeline``: (time, output tokens so far) at the
    end of every runtime step; ``requests``: records with ``submitted_at`` and ``done_at`` (same clock).
    The window is cut at step ends inside it. None when it holds fewer than two steps (e.g. a single wave).
    """
    done = [r["done_at"] for r in requests if r.get("done_at") is not None]
    submitted = [r["submitted_at"] for r in requests if r.get("submitted_at") is not None]
    if not done or not submitted:
        return None
    start, end = min(done), max(submitted)
    inside = [(t, n) for t, n in timeline if start <= t <= end]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    (t0, n0), (t1, n1) = inside[0], inside[-1]
    return n1 - n0, t1 - t0


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
                 temperature: float, seed: int, bar=None) -> tuple[list[dict], float]:
    """``concurrency`` users, each submitting its next request as soon as its last one finished."""
    from dspark_trt.runtime.config import GenerationConfig

    results: list[dict | None] = [None] * n_requests
    errors: list[str] = []
    counter = iter(range(n_requests))
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
            results[i] = {"token_ids": res.token_ids, "submitted_at": submitted, "done_at": done, **{
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


def _measure(rt, prompts, mode, concurrency, n_requests, max_new_tokens, temperature, seed, bar) -> dict:
    _wait_idle(rt)
    rt.metrics.reset()
    reqs, wall = _closed_loop(rt, prompts, mode, concurrency, n_requests, max_new_tokens, temperature, seed, bar)
    _wait_idle(rt)
    corr = getattr(rt, "survival_correction", None)
    return {"requests": reqs, "wall_s": wall, "snapshot": rt.metrics.snapshot(),
            "step_log": [dict(r) for r in rt.metrics.step_log], "timeline": list(rt.metrics.timeline),
            "survival_correction": corr.report() if corr is not None else None}


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


# ------------------------------------------------------------------------------------------ reporting

def _version(dist: str):
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _command_line(args: dict) -> str:
    """The command that reproduces this run: the real argv when run through the CLI, else the equivalent
    explicit `dspark-trt bench` call."""
    argv = list(sys.argv)
    prog = Path(argv[0]).name if argv else ""
    if "bench" in argv[1:] and (prog in ("dspark-trt", "dspark_trt", "__main__.py", "cli.py")):
        return "dspark-trt " + shlex.join(argv[1:])
    parts = ["dspark-trt", "bench", str(args["artifact_dir"]), "--backend", args["backend"],
             "--concurrency", args["concurrency"], "--modes", args["modes"],
             "--num-prompts", str(args["num_prompts"]), "--max-new-tokens", str(args["max_new_tokens"]),
             "--temperature", f"{args['temperature']:g}", "--seed", str(args["seed"])]
    if args.get("prompts_file"):
        parts += ["--prompts-file", str(args["prompts_file"])]
    parts += ["--out", str(args["out_dir"])]
    if args.get("peers"):
        parts.append("--peers")
    return shlex.join(parts)


def _env(rt, manifest: dict, backend: str, artifact_dir, command: str, peers: bool) -> dict:
    dists = ["dspark-trt", "numpy", "onnxruntime", "onnxruntime-gpu", "tokenizers", "tensorrt"]
    if peers:
        dists += ["torch", "transformers"]
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    cost = rt.cost
    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command,
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "load_avg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {d: v for d in dists if (v := _version(d))},
        "backend": backend,
        "ort_providers": [s.get_providers() for s in getattr(rt.backend, "sessions", {}).values()][:1] or None,
        "artifact": {
            "dir": str(Path(artifact_dir).resolve()),
            "model": {k: manifest.get("model", {}).get(k) for k in ("arch", "num_layers", "vocab_size", "dtype")},
            "limits": manifest.get("limits"),
            "sources": manifest.get("sources"),
            "sha256": {k: v.get("sha256") for k, v in sorted(manifest.get("files", {}).items())
                       if isinstance(v, dict)},
            "engines": manifest.get("engines"),
        },
        "cost_profile": ({"verify_ms": [round(x, 4) for x in cost.verify_table(corrected=False).tolist()],
                          "draft_ms": [round(x, 4) for x in cost.draft_table(corrected=False).tolist()],
                          "meta": getattr(cost, "meta", None)} if cost is not None else None),
    }


def _fmt(x, spec: str = ".1f", none: str = "-") -> str:
    if x is None:
        return none
    return format(x, spec)


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
        held, picks, held_rounds = _held_out(ad, [r for r in (off, *fixed) if r is not None])
        interval = median_interval(held_rounds)
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


def _held_out(ad: dict | None, baselines: list[dict]) -> tuple[float | None, list[str], list[float]]:
    """Adaptive over the baseline a tuner would pick, judged on rounds it was not picked on.

    For each round: the baseline (off or a fixed K) with the highest median over the *other* rounds,
    and adaptive's throughput over that baseline's in this round; the median of those ratios. The
    in-sample ratio divides by the best of eight noisy medians, which overstates the best arm by about
    the noise (the winner's curse): with every arm equally fast it would put adaptive ~1-2 noise widths
    below 1. Returns (median, picks, the per-round ratios); (None, [], []) with fewer than two rounds."""
    n = len(ad["round_output_tok_s"]) if ad else 0
    if n < 2 or not baselines or any(len(r["round_output_tok_s"]) != n for r in baselines):
        return None, [], []

    def others(r: dict, i: int) -> float:
        return float(np.median([x for j, x in enumerate(r["round_output_tok_s"]) if j != i]))

    ratios, picks = [], []
    for i in range(n):
        pick = max(baselines, key=lambda r: others(r, i))
        if pick["round_output_tok_s"][i] > 0:
            ratios.append(ad["round_output_tok_s"][i] / pick["round_output_tok_s"][i])
            picks.append(pick["mode"])
    return (float(np.median(ratios)) if ratios else None), picks, ratios


DEFINITIONS = """\
- **output tok/s**: steady-state throughput at the concurrency: tokens generated per second while
  `concurrency` requests are in flight (closed loop: a new request is submitted as one finishes; every
  request generates exactly max-new-tokens tokens), i.e. from the first completion (before it all requests
  started together in one prefill wave) to the last submission (after it the batch drains, and the run's
  length turns on its slowest last requests: a mode whose request latencies vary more would lose
  throughput it does not lose in steady state); the median over rounds (one round hit by a burst of
  outside load moves it little). **whole run** is the older figure, all tokens / wall time from the
  first submission to the last completion, summed over rounds.
- **per-user tok/s**: per request, generated tokens / latency (submission to last token, prefill
  included). p50 is the median; **p90 is the tail**: 90% of requests were at least this fast (the 10th
  percentile of the rates).
- **TPOT**: time per output token of a request after its first, (latency - TTFT) / (tokens - 1); median.
- **tau**: mean tokens emitted per decode step per request (accepted drafts + the target's token).
- **accept/pos**: accepted / verified at each draft position (given the earlier ones were accepted).
- **verified/step**: target rows scored per engine step (every request's own token + verified drafts).
- **solver µs**: verify-budget solver time per decode step (0 outside adaptive).
- **overhead**: fraction of step wall time spent outside the draft and target engines.
- **oracle goodput**: modelled cost of the hindsight oracle's steps / modelled cost of the actual steps, under
  the artifact's profiled cost table. The oracle emits the same tokens, but drafts and verifies exactly the
  drafts that ended up accepted and nothing more; 1.0 means no modelled time went to rejected drafts.
- **adaptive / max(off, best fixed)**: adaptive's output tok/s over the highest of the baselines' (off
  and every fixed K); **per round**: the same two modes' ratio in each round (they ran in the same
  pass over the modes), lowest-highest, a direct view of the run's noise.
- **adaptive / held-out pick**: for each round, the baseline with the highest median over the *other*
  rounds, and adaptive's throughput over that baseline's in this round; the median over rounds (picks:
  the baseline picked for each round). This is what tuning K on some runs and deploying it would have
  given. The in-sample ratio divides by the highest of eight noisy figures, which overstates the best
  baseline by about the noise (the winner's curse: with every mode equally fast it would still put
  adaptive a noise width or two below 1); the held-out ratio does not, but judges adaptive against a
  pick that may not be the truly best baseline where several are within noise. Needs 2 or more rounds.
- **its interval**: a distribution-free confidence interval for the median of the per-round held-out
  ratios (sign test: the k-th lowest to the k-th highest round, k as large as still covers 90%), with its
  coverage; with 5 rounds it is the lowest to the highest round (94%), with 3 or 4 rounds it covers less
  (75%, 88%). An interval that spans a threshold means the run cannot tell which side the mode is on.
- **engine drift**: how much faster the same mode's engine calls ran in its fastest round than in its
  slowest, measured against the profiled cost of the same calls (median over modes). The calls and the
  profile are the same across rounds, so this is the machine: on a shared CPU the same engine call can
  run 1.5x slower for a second at a time. Differences between modes well below it need many rounds.
"""


def render_markdown(result: dict) -> str:
    env, runs, settings = result["env"], result["runs"], result["settings"]
    L = [f"# dspark-trt bench: {Path(env['artifact']['dir']).name} ({env['backend']})", ""]
    if not result.get("complete", True):
        L += ["**Incomplete**: the benchmark was interrupted or is still running.", ""]
    L += ["```bash", env["command"], "```", ""]
    vers = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
    L += [f"{env['date']} | {env['cpu']} ({env['cpu_count']} CPUs, load avg at start "
          f"{_fmt((env.get('load_avg_start') or [None])[0], '.2f')}) | {env['platform']} | Python {env['python']} | {vers}", ""]
    L += [f"Prompts: {settings['prompts_source']} ({settings['num_prompts']} prompts, "
          f"{settings['prompt_tokens_min']}-{settings['prompt_tokens_max']} tokens); max new tokens "
          f"{settings['max_new_tokens']}; temperature {settings['temperature']:g}; seed {settings['seed']}; "
          f"rounds {settings['rounds']}; requests per run max(num prompts, {WAVES} x concurrency).", ""]
    for note in result.get("notes", []):
        L.append(f"- {note}")
    if result.get("notes"):
        L.append("")
    L += ["## Results", "",
          "| conc | mode | output tok/s | whole run | per-user tok/s p50 | p90 | TPOT ms | tau | accept/pos "
          "| verified/step | solver µs | overhead | oracle goodput | greedy = off |",
          "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in runs:
        acc = " ".join(_fmt(a, ".2f") for a in r["acceptance_per_position"])
        L.append(f"| {r['concurrency']} | {r['mode']} | {_fmt(r['output_tok_s'])} "
                 f"| {_fmt(r['output_tok_s_whole_run'])} | {_fmt(r['per_user_tok_s_p50'])} "
                 f"| {_fmt(r['per_user_tok_s_p90'])} | {_fmt(r['tpot_ms_p50'], '.2f')} | {_fmt(r['tau'], '.2f')} "
                 f"| {acc} | {_fmt(r['verified_tokens_per_step'], '.2f')} | {_fmt(r['solver_us_per_step'], '.0f')} "
                 f"| {_fmt(r['overhead_frac'], '.1%')} | {_fmt(r['oracle_goodput_frac'], '.1%')} "
                 f"| {_fmt(r.get('greedy_match_off'), '.0%')} |")
    L += ["", "## Adaptive vs. the alternatives", "",
          "| conc | off tok/s | best fixed | its tok/s | adaptive tok/s | adaptive / max(off, best fixed) "
          "| per round | adaptive / held-out pick | its interval | picks | adaptive / off | engine drift |",
          "|---:|---:|---|---:|---:|---:|---|---:|---|---|---:|---:|"]
    for s in result["summary"]:
        per_round = s.get("adaptive_over_best_rounds") or []
        spread = f"{min(per_round):.2f}-{max(per_round):.2f}" if per_round else "-"
        L.append(f"| {s['concurrency']} | {_fmt(s['off_tok_s'])} | {s['best_fixed'] or '-'} | {_fmt(s['best_fixed_tok_s'])} "
                 f"| {_fmt(s['adaptive_tok_s'])} | {_fmt(s['adaptive_over_best'], '.3f')} | {spread} "
                 f"| {_fmt(s.get('adaptive_over_best_held_out'), '.3f')} | {_interval(s)} "
                 f"| {' '.join(s.get('held_out_picks') or []) or '-'} "
                 f"| {_fmt(s['adaptive_over_off'], '.3f')} | {_drift(s.get('engine_drift'))} |")
    if result.get("peers"):
        L += ["", "## Peers at concurrency 1 (same prompts, same token counts; whole-run throughput for every row)", "",
              "| system | output tok/s | per-user tok/s p50 | TPOT ms | speed-up over transformers target | greedy = our off |",
              "|---|---:|---:|---:|---:|---:|"]
        for p in result["comparison_c1"]:
            L.append(f"| {p['label']} | {_fmt(p['output_tok_s'])} | {_fmt(p['per_user_tok_s_p50'])} "
                     f"| {_fmt(p['tpot_ms_p50'], '.2f')} | {_fmt(p.get('speedup_over_hf_target'), '.2f')}x "
                     f"| {_fmt(p.get('greedy_match_off'), '.0%')} |")
        assisted = next((p for p in result["peers"] if p.get("assistant")), None)
        if assisted:
            L += ["", f"transformers assisted generation settings: {assisted['assistant']} "
                      f"(device {assisted['device']}, {assisted['threads']} torch threads)."]
    L += ["", "## Definitions", "", DEFINITIONS, "## README snippet", "", "````markdown", readme_snippet(result), "````", ""]
    return "\n".join(L)


def _interval(s: dict) -> str:
    iv, cov = s.get("adaptive_over_best_held_out_interval"), s.get("adaptive_over_best_held_out_coverage")
    return f"{iv[0]:.2f}-{iv[1]:.2f} ({cov:.0%})" if iv and cov is not None else "-"


def _drift(x) -> str:
    return f"{x - 1:.0%}" if x is not None else "-"


def readme_snippet(result: dict) -> str:
    env = result["env"]
    L = ["```bash", env["command"], "```", "",
         f"{env['cpu']}, backend {env['backend']}, {result['settings']['max_new_tokens']} new tokens per request, "
         f"temperature {result['settings']['temperature']:g}:", "",
         "| concurrency | off tok/s | best fixed K | adaptive tok/s | adaptive / best | adaptive / best, held out "
         "| its interval | adaptive / off | engine drift |",
         "|---:|---:|---|---:|---:|---:|---|---:|---:|"]
    for s in result["summary"]:
        L.append(f"| {s['concurrency']} | {_fmt(s['off_tok_s'])} | {s['best_fixed'] or '-'} | {_fmt(s['adaptive_tok_s'])} "
                 f"| {_fmt(s['adaptive_over_best'], '.2f')} | {_fmt(s.get('adaptive_over_best_held_out'), '.2f')} "
                 f"| {_interval(s)} | {_fmt(s['adaptive_over_off'], '.2f')} | {_drift(s.get('engine_drift'))} |")
    return "\n".join(L)


def _write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("results.json", json.dumps(result, indent=1, default=_json_default) + "\n"),
                       ("results.md", render_markdown(result))):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, out / name)


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


# ------------------------------------------------------------------------------------------------ run

def run_bench(artifact_dir, backend: str = "ort", concurrency: str = DEFAULT_CONCURRENCY, modes: str = DEFAULT_MODES,
              num_prompts: int = DEFAULT_NUM_PROMPTS, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
              temperature: float = 0.0, seed: int = 0, prompts_file=None, out_dir="bench-results",
              quick: bool = False, peers: bool = False, echo=None, *, rounds: int = 1, force: bool = False,
              progress: bool = True, command: str | None = None, warmup: bool = True) -> Path:
    """Run the benchmark and write results.json, results.md and throughput.png; returns their directory.

    ``quick`` replaces concurrency, modes, num_prompts and max_new_tokens by :data:`QUICK` where they
    still have the CLI defaults (fixed:K above the artifact's max draft is dropped from the preset).
    ``peers`` adds transformers plain and assisted generation at batch 1 on the manifest's source
    checkpoints (concurrency 1 is added to the levels if missing). ``rounds`` repeats each concurrency's
    interleaved pass over the modes. ``force`` overwrites results already in ``out_dir`` (default: write
    into a new timestamped subdirectory). ``command`` overrides the recorded command line.
    """
    from dspark_trt.runtime.runtime import load_manifest

    say = echo or (lambda s: print(s, file=sys.stderr))
    if int(rounds) < 1:
        raise DsparkError(f"rounds must be >= 1, got {rounds}")
    if int(num_prompts) < 1 or int(max_new_tokens) < 1:
        raise DsparkError("--num-prompts and --max-new-tokens must be >= 1")
    args = dict(artifact_dir=artifact_dir, backend=backend, concurrency=concurrency, modes=modes,
                num_prompts=num_prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                prompts_file=prompts_file, out_dir=out_dir, peers=peers)
    quick_modes = bool(quick) and str(modes) == DEFAULT_MODES
    if quick:
        concurrency, modes, num_prompts, max_new_tokens = apply_quick(concurrency, modes, num_prompts, max_new_tokens)
    # Syntax first (no artifact needed), then against the artifact.
    levels = parse_concurrency(concurrency)
    if not quick_modes:
        parse_modes(modes)
    manifest = load_manifest(artifact_dir)
    lim = manifest["limits"]
    max_batch, max_draft, max_context = int(lim["max_batch"]), int(lim["max_draft"]), int(lim["max_context"])
    if quick_modes:
        modes = ",".join(m for m in QUICK["modes"].split(",")
                         if not m.startswith("fixed:") or int(m[6:]) <= max_draft)
    mode_list = parse_modes(modes, max_draft)
    notes: list[str] = []
    if peers and 1 not in levels:
        levels = [1] + levels
        notes.append("concurrency 1 added for the peer comparison (--peers)")
    over = [c for c in levels if c > max_batch]
    if over:
        levels = sorted({min(c, max_batch) for c in levels})
        note = (f"concurrency {', '.join(map(str, over))} exceed{'s' if len(over) == 1 else ''} the artifact's "
                f"max batch {max_batch}: measured at {max_batch} instead (re-export with --max-batch "
                f"{max(over)} to measure {'it' if len(over) == 1 else 'them'})")
        notes.append(note)
        say(f"note: {note}")
    args.update(concurrency=",".join(map(str, levels)), modes=",".join(mode_list), num_prompts=num_prompts,
                max_new_tokens=max_new_tokens)
    out, out_note = resolve_out_dir(out_dir, force)
    if out_note:
        say(f"note: {out_note}")
    cmd = command or _command_line(args)

    # Prompts (before loading engines: a bad prompts file fails fast).
    from dspark_trt.bench.prompts import MIN_TOKENS, corpus_prompts, file_prompts, prompt_budget
    from dspark_trt.runtime.tokenizer import load_tokenizer

    tok = load_tokenizer(Path(artifact_dir) / manifest.get("tokenizer", {}).get("file", "tokenizer.json"))
    max_len = prompt_budget(max_context, max_new_tokens)
    if prompts_file:
        file_max = prompt_budget(max_context, max_new_tokens, max_tokens=max_context)
        prompts, cut = file_prompts(prompts_file, tok.encode, tok.decode, int(num_prompts), file_max)
        source = f"{prompts_file}"
        if cut:
            notes.append(f"{cut} prompt(s) from {prompts_file} kept only their last {file_max} tokens "
                         f"(max context {max_context} - max new tokens {max_new_tokens})")
            say(f"note: {notes[-1]}")
        if len(prompts) < int(num_prompts):
            notes.append(f"{prompts_file} has {len(prompts)} prompts (fewer than --num-prompts {num_prompts})")
    else:
        prompts = corpus_prompts(tok.encode, tok.decode, int(num_prompts), int(seed), max_len,
                                 min_len=min(MIN_TOKENS, max_len))
        source = f"held-out stdlib split, seeded snippets (seed {seed})"
    lens = [len(p.ids) for p in prompts]
    settings = {"prompts_source": source, "num_prompts": len(prompts), "prompt_tokens_min": min(lens),
                "prompt_tokens_max": max(lens), "prompt_tokens_mean": float(np.mean(lens)),
                "max_new_tokens": int(max_new_tokens), "temperature": float(temperature), "seed": int(seed),
                "rounds": int(rounds), "concurrency": levels, "modes": mode_list,
                "concurrency_requested": str(concurrency), "max_batch": max_batch, "max_draft": max_draft,
                "requests_per_run": {c: requests_per_run(len(prompts), c) for c in levels}}

    from tqdm.auto import tqdm

    from dspark_trt.runtime.runtime import Runtime

    rt = Runtime.load(artifact_dir, backend=backend, profile="auto")
    try:
        env = _env(rt, manifest, backend, artifact_dir, cmd, peers)
        cost = None
        if rt.cost is not None:
            cost = (np.array(rt.cost.verify_table(corrected=False)), np.array(rt.cost.draft_table(corrected=False)))
        else:
            notes.append("no cost profile: oracle goodput not computed")
        result = {"format": "dspark-trt/bench", "version": 1, "complete": False, "env": env, "settings": settings,
                  "notes": notes, "prompts": [p.to_dict() for p in prompts], "runs": [], "summary": []}
        total = sum(requests_per_run(len(prompts), c) for c in levels) * len(mode_list) * int(rounds)
        peer_reqs = len(prompts) * 2 if peers else 0
        with tqdm(total=total + peer_reqs, desc="bench", unit="req", disable=not progress, dynamic_ncols=True) as bar:
            if warmup:
                bar.set_postfix_str("warm-up")
                _warmup(rt, prompts, mode_list, max(levels), float(temperature), int(seed))
            off_c1 = None
            for c in levels:
                raw = {m: [] for m in mode_list}
                for rnd in range(int(rounds)):
                    order = mode_list[rnd % len(mode_list):] + mode_list[:rnd % len(mode_list)]
                    for m in order:
                        bar.set_postfix_str(f"c={c} {m} round {rnd + 1}/{rounds}")
                        raw[m].append(_measure(rt, prompts, m, c, requests_per_run(len(prompts), c), int(max_new_tokens),
                                               float(temperature), int(seed), bar))
                rows = _aggregate(raw, c, max_draft, cost, float(temperature))
                if c == 1 and "off" in raw:
                    off_c1 = raw["off"][0]["requests"]
                result["runs"].extend(rows)
                result["summary"] = _summary(result["runs"], [x for x in levels if x <= c])
                _write(out, result)
                best = max(rows, key=lambda r: r["output_tok_s"])
                line = (f"concurrency {c}: " + ", ".join(f"{r['mode']} {r['output_tok_s']:.1f}" for r in rows)
                        + f" tok/s (best {best['mode']})")
                bar.write(line) if progress else say(line)
            if peers:
                bar.set_postfix_str("peers (transformers, batch 1)")
                result["peers"] = _run_peers(manifest, prompts, int(max_new_tokens), float(temperature), int(seed),
                                             off_c1, bar)
                result["comparison_c1"] = _comparison(result["runs"], result["peers"])
        result["complete"] = True
        env["load_avg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
        _write(out, result)
        from dspark_trt.bench.plots import plot_throughput

        plot_throughput(result["runs"], out / "throughput.png",
                        title=f"{Path(artifact_dir).name} | {backend} | {env['cpu']} | {max_new_tokens} new tokens",
                        peers=result.get("peers"))
    finally:
        rt.close()
    return out


def _aggregate(raw: dict, c: int, max_draft: int, cost, temperature: float) -> list[dict]:
    rows = []
    off = raw.get("off")
    for mode, runs in raw.items():
        reqs = [r for run in runs for r in run["requests"]]
        row = {"mode": mode, "concurrency": c, "rounds": len(runs)}
        row.update(summarize_requests(reqs, sum(run["wall_s"] for run in runs)))
        row.update(run_metrics([s for run in runs for s in run["step_log"]], [run["snapshot"] for run in runs],
                               max_draft, cost, speculative=mode != "off"))
        whole = [sum(r["generated_tokens"] for r in run["requests"]) / run["wall_s"] for run in runs]
        windows = [steady_window(run.get("timeline", []), run["requests"]) for run in runs]
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
        row = {"mode": p["mode"], "concurrency": 1, "label": p["label"], "device": p["device"],
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
        for p in peers]
    base = next((p["output_tok_s"] for p in peers if p["mode"] == "hf:target"), None)
    for r in rows:
        r["speedup_over_hf_target"] = r["output_tok_s"] / base if base and r.get("output_tok_s") else None
    return rows
