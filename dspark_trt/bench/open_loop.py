"""`dspark-trt bench --rates ...`: the open loop. Requests arrive on their own (Poisson) schedule.

Method (docs/open-loop.md)
- A driver: the Runtime in this process (inprocess.py), or a `dspark-trt serve` subprocess driven over
  HTTP with streaming (http_driver.py, ``via_http``). Both time every delivery of tokens.
- Capacity: a burst of 2 x max batch requests in mode off, all sent at once; output tok/s while the
  batch is full over the mean answer length (capacity_from_burst), unless given (``capacity``: a number,
  or an earlier run's results.json, so that 0.5x means the same load in runs on different days). Rates
  given as multiples (``0.5x``) are multiples of it; every rate's load (rate / capacity) is recorded.
- For each rate: ``rounds`` rounds; in a round every mode runs the same arrival times (seeded Poisson,
  a run of ``num_prompts`` arrivals or of ``duration`` seconds) and the same requests (workload.py), modes
  in turn, in balanced orders (options.mode_order). A run lasts until its last request is answered.
- Latencies count from the scheduled arrival (a client that falls behind does not hide the delay).
- Output tok/s is counted while requests arrive (latency.window_tok_s); the whole-run figure is kept too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from dspark_trt.bench.arrivals import poisson_arrivals
from dspark_trt.bench.latency import request_latencies, summarize_open, tokens_between, window_tok_s
from dspark_trt.bench.options import (DEFAULT_SLO_TPOT_MS, DEFAULT_SLO_TTFT_MS, OPEN_QUICK, mode_order,
                                      parse_capacity, parse_modes, parse_rates)
from dspark_trt.bench.workload import build_requests, parse_temperature, parse_workload
from dspark_trt.errors import DsparkError
from dspark_trt.runtime.config import fixed_k_limit

WARMUP_TOKENS = 8


def run_open_loop(artifact_dir, *, backend: str = "ort", rates="auto", modes: str = OPEN_QUICK["modes"],
                  workload: str = "mixed", temperature="0", num_prompts: int | None = None,
                  duration: float | None = None, rounds: int = 1, seed: int = 0, slo_ttft_ms: float | None = None,
                  slo_tpot_ms: float | None = None, via_http: bool = False, api_key: str | None = None,
                  prompts_file=None, out_dir="bench-results", quick: bool = False, force: bool = False, echo=None,
                  progress: bool = True, command: str | None = None, warmup: bool = True,
                  capacity=None, start_profile=None) -> Path:
    """Run the open loop and write results.json (``open_loop`` list), results.md and latency.png.
    ``start_profile``: a cost profile file every (rate, mode, round) run starts cold from, on a runtime of its
    own on the warmed-up engines (in process only); the artifact's profile is neither read nor written, so
    consecutive runs start alike."""
    from dspark_trt.bench.open_report import goals, plot_latency, write_open
    from dspark_trt.bench.options import resolve_out_dir
    from dspark_trt.bench.results import _env
    from dspark_trt.runtime.runtime import load_manifest
    from dspark_trt.runtime.tokenizer import load_tokenizer

    say = echo or (lambda s: print(s, file=sys.stderr))
    if int(rounds) < 1:
        raise DsparkError(f"rounds must be >= 1, got {rounds}")
    if duration is not None and not duration > 0:
        raise DsparkError(f"--duration must be > 0 seconds, got {duration}")
    rate_list = parse_rates(rates, quick)
    given_capacity = parse_capacity(capacity)
    wl = parse_workload(workload)
    temps = parse_temperature(temperature)
    slo_ttft = DEFAULT_SLO_TTFT_MS if slo_ttft_ms is None else float(slo_ttft_ms)
    slo_tpot = DEFAULT_SLO_TPOT_MS if slo_tpot_ms is None else float(slo_tpot_ms)
    if not (quick and modes == OPEN_QUICK["modes"]):
        parse_modes(modes)  # syntax before the artifact is read
    manifest = load_manifest(artifact_dir)
    if start_profile is not None:
        from dspark_trt.bench.start_profile import check_start_profile

        if via_http:
            raise DsparkError("--start-profile starts every run cold in this process; drop --via-http")
        start_profile = check_start_profile(start_profile, manifest)
    lim = manifest["limits"]
    max_batch, max_draft, max_context = int(lim["max_batch"]), int(lim["max_draft"]), int(lim["max_context"])
    if quick and modes == OPEN_QUICK["modes"]:  # the preset drops fixed:K above the artifact's max draft
        modes = ",".join(m for m in modes.split(",") if not m.startswith("fixed:") or int(m[6:]) <= max_draft)
    mode_list = parse_modes(modes, max_draft, fixed_k_limit(manifest.drafter_kind, max_draft))
    if quick:  # 6 s of arrivals, at most 100 requests, unless given
        duration = OPEN_QUICK["duration"] if duration is None and num_prompts is None else duration
        num_prompts = OPEN_QUICK["num_prompts"] if num_prompts is None else num_prompts
    elif duration is None and num_prompts is None:
        duration = 30.0
    out, note = resolve_out_dir(out_dir, force)
    if note:
        say(f"note: {note}")
    tok = load_tokenizer(Path(artifact_dir) / manifest.get("tokenizer", {}).get("file", "tokenizer.json"))
    file_ids = None
    if prompts_file:
        from dspark_trt.bench.prompts import read_prompt_file

        file_ids = [ids for text, _ in read_prompt_file(prompts_file) if (ids := tok.encode(text))]
        if not file_ids:
            raise DsparkError(f"prompts file {prompts_file} has no prompts that tokenize to at least one token")

    def requests(stream: int, n: int):
        return build_requests(wl, n, tok.encode, seed * 1000 + stream, max_context, temps, file_prompts=file_ids)

    settings = {"kind": "open_loop", "driver": "http" if via_http else "in-process", "workload": wl.describe(),
                "prompts_source": str(prompts_file) if prompts_file else "held-out stdlib split, cut before text "
                "of each kind", "temperature": [{"value": t, "weight": w} for t, w in temps],
                "rates_requested": str(rates), "modes": mode_list, "rounds": int(rounds), "seed": int(seed),
                "num_prompts": num_prompts, "duration_s": duration, "slo_ttft_ms": slo_ttft, "slo_tpot_ms": slo_tpot,
                "max_batch": max_batch, "max_draft": max_draft, "quick": bool(quick),
                "capacity_given": given_capacity[1] if given_capacity else None,
                "start_profile": str(start_profile) if start_profile is not None else None}
    result = {"format": "dspark-trt/bench", "version": 1, "kind": "open_loop", "complete": False, "env": None,
              "settings": settings, "notes": [], "capacity": None, "open_loop": [], "goals": []}
    if via_http and backend != "ort":
        result["notes"].append(f"the server runs backend {backend}")
    if start_profile is not None:
        result["notes"].append(f"every run started cold from {start_profile} on a runtime of its own (engines "
                               "warmed up, nothing learned)")
    with _driver(artifact_dir, backend, via_http, api_key, out, start_profile) as drive:
        result["env"] = _env(drive.runtime, manifest, backend, artifact_dir, command or _command(), False)
        if warmup:
            drive.warmup(requests(999, max(len(mode_list), 4)), mode_list)
        if given_capacity is not None:
            cap, source = given_capacity
            result["capacity"] = {"req_s": cap, "tok_s": None, "mode": None, "given": source,
                                  "method": f"given ({source}), not measured in this run"}
            say(f"capacity (given, {source}): {cap:.2f} req/s")
        else:
            probe_items = requests(998, max(16, 2 * max_batch))
            recs, wall = drive.run(probe_items, np.zeros(len(probe_items)), "off")
            result["capacity"] = capacity_from_burst(recs, wall, max_batch)
            cap = result["capacity"]["req_s"]
            say(f"capacity (mode off, burst of {len(probe_items)}): {cap or 0:.2f} req/s")
        rows = _rates(rate_list, cap)
        if not rows:
            raise DsparkError("no rate to run: the capacity probe completed no request, so relative rates "
                              "(such as 0.5x) have no meaning; give absolute --rates")
        schedules = [[poisson_arrivals(rate, [int(seed), rnd, k], n=num_prompts, duration=duration)
                      for rnd in range(int(rounds))] for k, (rate, _) in enumerate(rows)]
        items = [requests(rnd, max(len(s[rnd]) for s in schedules)) for rnd in range(int(rounds))]
        result["requests_sample"] = [it.to_dict() for it in items[0][:8]]
        for k, (rate, label) in enumerate(rows):
            raw = {m: [] for m in mode_list}
            for rnd in range(int(rounds)):
                arr = schedules[k][rnd]
                for m in mode_order(mode_list, rnd):
                    if progress:
                        say(f"rate {rate:.2f}/s ({label}) round {rnd + 1}/{rounds} {m}: {len(arr)} requests")
                    recs, wall = drive.run(items[rnd][:len(arr)], arr, m)
                    raw[m].append((recs, wall, _loadavg()))
            entries = [_entry(rate, label, m, runs, cap, slo_ttft, slo_tpot) for m, runs in raw.items()]
            result["open_loop"].extend(entries)
            result["goals"] = goals(result["open_loop"], temps)
            write_open(out, result)
            say(f"rate {rate:.2f}/s: " + ", ".join(
                f"{e['mode']} {e['output_tok_s']:.0f} tok/s TPOT p50 {_ms(e['tpot_ms']['p50'])} "
                f"TTFT p99 {_ms(e['ttft_ms']['p99'])}" for e in entries))
    result["complete"] = True
    write_open(out, result)
    plot_latency(result["open_loop"], out / "latency.png",
                 title=f"{Path(artifact_dir).name} | {settings['driver']} | {wl.name} | temperature {temperature}")
    return out


def capacity_from_burst(records: list[dict], wall: float, max_batch: int) -> dict:
    """Requests/s the server sustains with a full batch, from a burst of about 2 x max_batch requests sent
    at once: output tokens/s between the first completion and the moment the queue empties (the batch is
    full all that time, and neither the first prefill wave nor the final drain, which a heavy tail of long
    answers stretches, is in it), over the mean answer length. Falls back to completed / wall time when
    that window holds fewer than two completions."""
    done = [r for r in records if r["ok"] and r["token_times_s"]]
    out = {"req_s": None, "tok_s": None, "requests": len(records), "wall_s": wall, "mode": "off", "window_s": None}
    if not done:
        return out
    mean_out = float(np.mean([r["generated_tokens"] for r in done]))
    ends = sorted(r["token_times_s"][-1] for r in done)
    k = len(records) - max_batch  # completions after which nothing waits any more
    if k >= 2 and k <= len(ends):
        t_a, t_b = ends[0], ends[k - 1]
        tokens = sum(tokens_between(r, t_a, t_b) for r in done)
        if t_b > t_a:
            out.update(tok_s=tokens / (t_b - t_a), req_s=tokens / (t_b - t_a) / mean_out, window_s=t_b - t_a,
                       method="a burst of 2 x max batch requests in mode off: output tok/s while the batch is full "
                              "(first completion to an empty queue) / mean answer length")
            return out
    out.update(tok_s=sum(r["generated_tokens"] for r in done) / wall, req_s=len(done) / wall,
               method="a burst of requests in mode off: completed / wall time")
    return out


def _loadavg() -> float | None:
    """The machine's 1-minute load average (other processes' work shows here on a shared machine)."""
    import os

    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _ms(x) -> str:
    return "-" if x is None else f"{x:.1f} ms"


def _command() -> str:
    import shlex

    return "dspark-trt " + shlex.join(sys.argv[1:])


def _rates(rate_list, cap) -> list[tuple[float, str]]:
    """(requests/s, label) per requested rate; relative ones resolved against the capacity."""
    rows = []
    for r, rel in rate_list:
        if rel:
            if cap:
                rows.append((r * cap, f"{r:g}x capacity"))
        else:
            rows.append((r, f"{r / cap:.2f}x capacity" if cap else "absolute"))
    return sorted(rows)


def _entry(rate, label, mode, runs, cap, slo_ttft, slo_tpot) -> dict:
    """One (rate, mode) row of results.json's ``open_loop`` list, over its rounds."""
    records = [r for recs, _, _ in runs for r in recs]
    wall = sum(w for _, w, _ in runs)
    e = {"rate": rate, "mode": mode, "label": label, "load": rate / cap if cap else None,
         "overloaded": (rate > cap) if cap else None, "rounds": len(runs)}
    e.update(summarize_open(records, wall, slo_ttft, slo_tpot))
    e["output_tok_s"] = window_tok_s([(recs, w) for recs, w, _ in runs])
    span = sum(max((r["arrival_s"] for r in recs), default=0.0) for recs, _, _ in runs)
    e["offered_req_s"] = (sum(len(recs) for recs, _, _ in runs) / span) if span > 0 else None
    e["round_output_tok_s"] = [window_tok_s([(recs, w)]) for recs, w, _ in runs]
    rounds = [summarize_open(recs, w) for recs, w, _ in runs]
    e["round_tpot_p50_ms"] = [r["tpot_ms"]["p50"] for r in rounds]
    e["round_ttft_p99_ms"] = [r["ttft_ms"]["p99"] for r in rounds]
    e["round_load_avg_1m"] = [x for _, _, x in runs]
    e["send_lag_ms_p99"] = float(np.percentile([(r["sent_s"] - r["arrival_s"]) * 1e3 for r in records
                                                if r["sent_s"] is not None] or [0.0], 99))
    e.update(_spec_stats(records))
    e["by_temperature"] = _groups(records, "temperature")
    e["by_kind"] = _groups(records, "kind")
    return e


def _spec_stats(records) -> dict:
    """In process only: tau (tokens a decode step emitted per request) and the runtime's predicted vs
    measured sums (accepted drafts, step ms; runtime/explain.py) over the requests that finished."""
    spec = [r["spec"] for r in records if r.get("spec") and r["ok"]]
    if not spec:
        return {}
    steps = sum(s["steps"] for s in spec)
    out = {"tau": sum(max(0, s["generated"] - 1) for s in spec) / steps if steps else None}
    for k in ("predicted_accepted", "accepted", "predicted_step_ms", "measured_step_ms"):
        out[k] = float(sum(s[k] for s in spec))
    return out


def _groups(records, key) -> dict:
    """TTFT and TPOT medians per value of ``key`` (temperature or text kind) over completed requests."""
    out = {}
    for value in sorted({r[key] for r in records}, key=str):
        lats = [request_latencies(r) for r in records if r[key] == value and r["ok"]]
        tpot = [x["tpot"] for x in lats if x["tpot"] is not None]
        ttft = [x["ttft"] for x in lats if x["ttft"] is not None]
        out[str(value)] = {"completed": len(lats), "tpot_ms_p50": float(np.median(tpot)) if tpot else None,
                           "ttft_ms_p50": float(np.median(ttft)) if ttft else None}
    return out


class _driver:
    """The runtime in process, or a serve subprocess over HTTP, behind one ``run``/``warmup`` interface."""

    def __init__(self, artifact_dir, backend, via_http, api_key, out: Path, start_profile=None):
        self.args = (artifact_dir, backend, via_http, api_key, out)
        self.start_profile = start_profile  # every run on a cold runtime from this profile (start_profile.py)
        self.runtime = self.server = None

    def __enter__(self):
        artifact_dir, backend, via_http, api_key, out = self.args
        if via_http:
            from dspark_trt.bench.http_driver import ServeProcess

            out.mkdir(parents=True, exist_ok=True)
            self.server = ServeProcess(artifact_dir, backend=backend, log_path=out / "server.log",
                                       api_key=api_key).start()
        elif self.start_profile is not None:
            from dspark_trt.bench.start_profile import runtime_from

            self.runtime = runtime_from(artifact_dir, backend, self.start_profile)
        else:
            from dspark_trt.runtime.runtime import Runtime

            self.runtime = Runtime.load(artifact_dir, backend=backend, profile="auto")
        if self.runtime is not None:
            self.runtime.wait_prefaulted()
        return self

    def __exit__(self, *exc):
        if self.server is not None:
            self.server.stop()
        if self.runtime is not None:
            self.runtime.close()

    def run(self, items, arrivals, mode):
        if self.server is not None:
            from dspark_trt.bench.http_driver import run_http

            return run_http(self.server.url, items, arrivals, mode, headers=self.server.headers())
        from dspark_trt.bench.inprocess import run_inprocess

        if not self.runtime.wait_idle(60):
            raise DsparkError("the runtime did not go idle between benchmark runs (a step hung?)")
        if self.start_profile is None:
            return run_inprocess(self.runtime, items, arrivals, mode)
        from dspark_trt.bench.start_profile import cold_run

        with cold_run(self.runtime, self.start_profile) as cold:
            return run_inprocess(cold, items, arrivals, mode)

    def warmup(self, items, modes) -> None:
        """One untimed burst, every mode, short answers (sessions, allocators, caches, the HTTP stack)."""
        from dataclasses import replace

        short = [replace(it, max_tokens=min(it.max_tokens, WARMUP_TOKENS)) for it in items]
        for i, m in enumerate(modes):
            recs, _ = self.run(short[i % len(short):] + short[:i % len(short)], np.zeros(len(short)), m)
            bad = [r["error"] for r in recs if not r["ok"]]
            if bad:
                raise DsparkError(f"warm-up request failed in mode {m}: {bad[0]}")

