"""Writing closed-loop results: the environment record, results.json, results.md and its definitions."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import sys
from pathlib import Path

import numpy as np

from dspark_trt.bench.options import WAVES


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
    if args.get("start_profile"):
        parts += ["--start-profile", str(args["start_profile"])]
    parts += ["--out", str(args["out_dir"])]
    if args.get("peers"):
        parts.append("--peers")
        if str(args.get("peer_engines") or "auto") != "auto":
            parts += ["--peer-engines", str(args["peer_engines"])]
        if args.get("peer_python"):
            parts += ["--peer-python", str(args["peer_python"])]
    return shlex.join(parts)


def _env(rt, manifest: dict, backend: str, artifact_dir, command: str, peers: bool) -> dict:
    dists = ["dspark-trt", "numpy", "onnxruntime", "onnxruntime-gpu", "tokenizers", "tensorrt"]
    if peers:
        dists += ["torch", "transformers"]
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    cost = getattr(rt, "cost", None)  # rt None: the runtime is in a server process (--via-http)
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
        "ort_providers": [s.get_providers() for s in getattr(getattr(rt, "backend", None), "sessions", {}).values()][:1]
        or None,
        "ort_spinning": getattr(getattr(rt, "backend", None), "spin_reason", None) and {
            "spinning": rt.backend.spinning, "why": rt.backend.spin_reason},
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


DEFINITIONS = """\
- **output tok/s**: steady-state throughput at the concurrency: tokens generated per second while
  `concurrency` requests are in flight (closed loop: a new request is submitted as one finishes; every
  request generates exactly max-new-tokens tokens), i.e. from the `concurrency`-th completion (before it
  all requests started together in one prefill wave) to the last submission (after it the batch drains, and
  the run's length turns on its slowest last requests: a mode whose request latencies vary more would lose
  throughput it does not lose in steady state), so whole waves; summed over a round's slices (at low
  concurrency the modes take turns a few requests at a time); the median over rounds (one round hit by a
  burst of outside load moves it little). **whole run** is the older figure, all tokens / wall time from the
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
- **adaptive / best, first tokens**: the same ratio over each run's first 512 output tokens (first submission
  to the step that reached them; median over rounds): the start-up window, where a cost model that starts
  wrong costs the most. With `--start-profile FILE` every run starts cold from FILE on a runtime of its own.
  **held out**: as for the steady ratio, against the baseline with the best first tokens in the other
  rounds, with the rounds' interval: a 512-token window moved 15-20% from round to round on this 2-core VM, so
  the in-sample ratio, over the luckiest of several baselines, reads low by about that much.
"""


def _slices_note(slices: dict | None) -> str:
    """Where the modes took turns within a round, and how finely (harness.py, options.run_slices)."""
    cut = {c: n for c, n in (slices or {}).items() if n > 1}
    if not cut:
        return ""
    return "; within a round the modes took turns in slices (" + ", ".join(
        f"{n} at concurrency {c}" for c, n in cut.items()) + ")"


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
          f"rounds {settings['rounds']}; requests per run max(num prompts, {WAVES} x concurrency)"
          + _slices_note(settings.get("slices_per_round")) + ".", ""]
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
          "| per round | adaptive / held-out pick | its interval | picks | adaptive / off | engine drift "
          "| adaptive / best, first tokens | held out, its interval |",
          "|---:|---:|---|---:|---:|---:|---|---:|---|---|---:|---:|---:|---|"]
    for s in result["summary"]:
        per_round = s.get("adaptive_over_best_rounds") or []
        spread = f"{min(per_round):.2f}-{max(per_round):.2f}" if per_round else "-"
        L.append(f"| {s['concurrency']} | {_fmt(s['off_tok_s'])} | {s['best_fixed'] or '-'} | {_fmt(s['best_fixed_tok_s'])} "
                 f"| {_fmt(s['adaptive_tok_s'])} | {_fmt(s['adaptive_over_best'], '.3f')} | {spread} "
                 f"| {_fmt(s.get('adaptive_over_best_held_out'), '.3f')} | {_interval(s)} "
                 f"| {' '.join(s.get('held_out_picks') or []) or '-'} "
                 f"| {_fmt(s['adaptive_over_off'], '.3f')} | {_drift(s.get('engine_drift'))} "
                 f"| {_fmt(s.get('adaptive_over_best_first_tokens'), '.3f')} "
                 f"| {_held_out_first(s)} |")
    if result.get("comparison_c1"):
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
    if result.get("peer_comparison"):
        L += ["", "## Peers across concurrency", "", peer_table(result), ""]
    L += ["", "## Definitions", "", DEFINITIONS, "## Headline (the command and the table docs/benchmarks.md quotes)", "", headline(result), ""]
    return "\n".join(L)


def peer_table(result: dict) -> str:
    """Our off / best fixed K / adaptive next to each multi-concurrency peer, whole-run tok/s, with our mode
    over the peer (the median of the per-round ratios, both ran in the same rounds, in brackets)."""
    peers = {p["mode"]: p["label"] for p in result.get("peers", []) if p.get("engine") not in (None, "hf")}
    L = ["Whole-run output tok/s (all tokens over the time from first submission to last completion, summed "
         "over rounds, for ours and the peers alike); ratios: ours / peer, the median per-round ratio in brackets. "
         "identical: the peer's greedy tokens equal our `off` tokens for every request.", "",
         "| conc | off | best fixed | adaptive | " + " | ".join(
             f"{m} | identical | off / it | best fixed / it | adaptive / it" for m in peers) + " |",
         "|---:|---:|---|---:|" + "---:|---|---:|---:|---:|" * len(peers)]
    for e in result["peer_comparison"]:
        ours = e["ours"]
        best = ours.get("best fixed")
        cells = [str(e["concurrency"]), _fmt((ours.get("off") or {}).get("output_tok_s")),
                 f"{best['mode']} {best['output_tok_s']:.1f}" if best else "-",
                 _fmt((ours.get("adaptive") or {}).get("output_tok_s"))]
        for m in peers:
            it = e["peers"].get(m) or {}
            cells += [_fmt(it.get("output_tok_s"), none=it.get("skipped") or "-"),
                      {True: "yes", False: "no"}.get(it.get("identical"), "-"),
                      _ratio(it, "off"), _ratio(it, "best_fixed"), _ratio(it, "adaptive")]
        L.append("| " + " | ".join(cells) + " |")
    L += [""] + [f"- `{m}`: {label}" for m, label in peers.items()]
    return "\n".join(L)


def _ratio(item: dict, name: str) -> str:
    r, rounds = item.get(f"{name}_over_peer"), item.get(f"{name}_over_peer_rounds") or []
    if r is None:
        return "-"
    return f"{r:.2f}" + (f" ({float(np.median(rounds)):.2f})" if rounds else "")


def _interval(s: dict) -> str:
    iv, cov = s.get("adaptive_over_best_held_out_interval"), s.get("adaptive_over_best_held_out_coverage")
    return f"{iv[0]:.2f}-{iv[1]:.2f} ({cov:.0%})" if iv and cov is not None else "-"


def _held_out_first(s: dict) -> str:
    r, iv = s.get("adaptive_over_best_first_tokens_held_out"), s.get("adaptive_over_best_first_tokens_held_out_interval")
    if r is None:
        return "-"
    return f"{r:.3f}" + (f", {iv[0]:.2f}-{iv[1]:.2f}" if iv else "")


def _drift(x) -> str:
    return f"{x - 1:.0%}" if x is not None else "-"


def headline(result: dict) -> str:
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
    write_results(out, result, render_markdown(result))


def write_results(out: Path, result: dict, markdown: str) -> None:
    """results.json and results.md, each replaced atomically (a reader never sees half a file)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("results.json", json.dumps(result, indent=1, default=_json_default) + "\n"),
                       ("results.md", markdown)):
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

