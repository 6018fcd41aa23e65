"""`dspark-trt bench`: closed-loop throughput vs concurrency for every speculation mode.

Method
- One runtime (the artifact, one backend) serves every run. Prompts are fixed token-id lists (see
  :mod:`dspark_trt.bench.prompts`), identical for every mode and concurrency.
- A run = (mode, concurrency c): c simulated users, each submitting a request and, as soon as it finishes,
  the next one (closed loop: c requests in flight), until max(num_prompts, WAVES * c) requests are done
  (at least WAVES waves, so a run measures the steady state rather than one start-up and one ramp-down
  of a single wave); request i uses prompt i mod num_prompts and sampling seed seed + i. Every request generates exactly
  max_new_tokens tokens (EOS does not stop it), so every mode emits the same tokens.
- For each concurrency the modes run in turn (interleaved), ``rounds`` times in balanced orders
  (options.mode_order), so slow machine drift hits all modes alike; a (mode, c) row aggregates its
  rounds. Within a round the modes take turns slice by slice (options.run_slices: 8 requests at a time
  at one request, one slice from 16 requests on), every mode's slice the same requests, the order
  changed each slice: the machine's speed moves within seconds, and whole runs taken one after the other
  were far apart by luck.
- Concurrency above the artifact's max batch is capped to it (said on the console and in results.json).

Outputs (in ``out_dir``; when it already holds results, in a new ``out_dir/run-YYYYmmdd-HHMMSS``
subdirectory instead, never overwriting, unless ``force=True``): results.json, results.md,
throughput.png. results.json and results.md are rewritten after each concurrency level, so an
interrupted benchmark keeps what it measured (``"complete": false``).
"""

from __future__ import annotations

import os
import sys
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from dspark_trt.bench.closed_loop import (_aggregate, _comparison, _measure, _run_peers, _summary,  # noqa: F401
                                          _warmup, merge_slices, run_metrics)
from dspark_trt.bench.latency import median_interval, steady_window, summarize_requests  # noqa: F401
from dspark_trt.bench.options import (DEFAULT_CONCURRENCY, DEFAULT_MAX_NEW_TOKENS, DEFAULT_MODES,  # noqa: F401
                                      DEFAULT_NUM_PROMPTS, QUICK, apply_quick, mode_order, parse_concurrency,
                                      parse_modes, requests_per_run, resolve_out_dir, run_slices)
from dspark_trt.bench.results import _command_line, _env, _write, render_markdown  # noqa: F401
from dspark_trt.errors import DsparkError
from dspark_trt.runtime.config import fixed_k_limit

__all__ = ["run_bench", "apply_quick", "requests_per_run", "parse_concurrency", "parse_modes", "resolve_out_dir",
           "summarize_requests", "run_metrics", "DEFAULT_CONCURRENCY", "DEFAULT_MODES", "QUICK"]


def run_bench(artifact_dir, backend: str = "ort", concurrency: str = DEFAULT_CONCURRENCY, modes: str = DEFAULT_MODES,
              num_prompts: int = DEFAULT_NUM_PROMPTS, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
              temperature: float = 0.0, seed: int = 0, prompts_file=None, out_dir="bench-results",
              quick: bool = False, peers: bool = False, echo=None, *, rounds: int = 1, force: bool = False,
              progress: bool = True, command: str | None = None, warmup: bool = True, peer_engines: str = "auto",
              peer_python: str | None = None, start_profile=None) -> Path:
    """Run the benchmark and write results.json, results.md and throughput.png; returns their directory.

    ``quick`` replaces concurrency, modes, num_prompts and max_new_tokens by :data:`QUICK` where they
    still have the CLI defaults (fixed:K above the artifact's max draft is dropped from the preset).
    ``peers`` adds other engines on the manifest's source checkpoints (``peer_engines``, see
    :mod:`dspark_trt.bench.peer_runs`: transformers at batch 1, for which concurrency 1 is added to the
    levels if missing; onnxruntime-genai and vLLM at every level, in the same rounds as our modes, their
    workers run by ``peer_python``, default this Python). ``rounds`` repeats each concurrency's
    interleaved pass over the modes. ``force`` overwrites results already in ``out_dir`` (default: write
    into a new timestamped subdirectory). ``command`` overrides the recorded command line.
    ``start_profile``: a cost profile file every run starts cold from, each (mode, round) on a runtime of its
    own on the warmed-up engines (:mod:`dspark_trt.bench.start_profile`), which serves all its slices of the
    round; no oracle.
    """
    from dspark_trt.runtime.runtime import load_manifest

    say = echo or (lambda s: print(s, file=sys.stderr))
    if int(rounds) < 1:
        raise DsparkError(f"rounds must be >= 1, got {rounds}")
    if int(num_prompts) < 1 or int(max_new_tokens) < 1:
        raise DsparkError("--num-prompts and --max-new-tokens must be >= 1")
    if peers:
        from dspark_trt.bench.peer_runs import parse_peer_engines

        engines, explicit = parse_peer_engines(peer_engines)
    args = dict(artifact_dir=artifact_dir, backend=backend, concurrency=concurrency, modes=modes,
                num_prompts=num_prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                prompts_file=prompts_file, out_dir=out_dir, peers=peers, peer_engines=peer_engines,
                peer_python=peer_python, start_profile=start_profile)
    quick_modes = bool(quick) and str(modes) == DEFAULT_MODES
    if quick:
        concurrency, modes, num_prompts, max_new_tokens = apply_quick(concurrency, modes, num_prompts, max_new_tokens)
    # Syntax first (no artifact needed), then against the artifact.
    levels = parse_concurrency(concurrency)
    if not quick_modes:
        parse_modes(modes)
    manifest = load_manifest(artifact_dir)
    if start_profile is not None:
        from dspark_trt.bench.start_profile import check_start_profile, cold_run, runtime_from

        if peers:
            raise DsparkError("--start-profile measures our modes from a cold start; run --peers separately")
        start_profile = check_start_profile(start_profile, manifest)
    lim = manifest["limits"]
    max_batch, max_draft, max_context = int(lim["max_batch"]), int(lim["max_draft"]), int(lim["max_context"])
    if quick_modes:
        modes = ",".join(m for m in QUICK["modes"].split(",")
                         if not m.startswith("fixed:") or int(m[6:]) <= max_draft)
    mode_list = parse_modes(modes, max_draft, fixed_k_limit(manifest.drafter_kind, max_draft))
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
    # Each level's run cut into the slices the modes take turns at.
    per_run = {c: requests_per_run(len(prompts), c) for c in levels}
    cuts = {c: run_slices(per_run[c], c) for c in levels}
    settings = {"prompts_source": source, "num_prompts": len(prompts), "prompt_tokens_min": min(lens),
                "prompt_tokens_max": max(lens), "prompt_tokens_mean": float(np.mean(lens)),
                "max_new_tokens": int(max_new_tokens), "temperature": float(temperature), "seed": int(seed),
                "rounds": int(rounds), "concurrency": levels, "modes": mode_list,
                "concurrency_requested": str(concurrency), "max_batch": max_batch, "max_draft": max_draft,
                "requests_per_run": per_run,
                "slices_per_round": {c: len(cuts[c]) for c in levels},
                "start_profile": str(start_profile) if start_profile is not None else None}
    peer_list = []
    if peers:
        from dspark_trt.bench import peer_runs

        python = str(peer_python or sys.executable)
        engines, skipped = peer_runs.choose(engines, explicit, python, say, float(temperature))
        notes += skipped
        settings.update(peer_engines=engines, peer_python=python)

    from tqdm.auto import tqdm

    from dspark_trt.runtime.runtime import Runtime

    if start_profile is not None:
        rt = runtime_from(artifact_dir, backend, start_profile)
        notes.append(f"every run started cold from {start_profile} on a runtime of its own (engines warmed "
                     "up, nothing learned; kept across the run's slices; no oracle or engine speed: the profile "
                     "is the thing under test)")
    else:
        rt = Runtime.load(artifact_dir, backend=backend, profile="auto")
    rt.wait_prefaulted()  # measure a runtime whose caches are mapped, as a server's are after its first minutes
    try:
        if peers:
            peer_list = peer_runs.start(engines, manifest, [p.ids for p in prompts], python,
                                        peer_runs.fixed_ks(mode_list), max_batch, say)
        env = _env(rt, manifest, backend, artifact_dir, cmd, peers)
        cost = None
        if start_profile is None and rt.cost is not None:
            cost = (np.array(rt.cost.verify_table(corrected=False)), np.array(rt.cost.draft_table(corrected=False)))
        elif start_profile is None:
            notes.append("no cost profile: oracle goodput not computed")
        result = {"format": "dspark-trt/bench", "version": 1, "complete": False, "env": env, "settings": settings,
                  "notes": notes, "prompts": [p.to_dict() for p in prompts], "runs": [], "summary": []}
        total = sum(per_run.values()) * len(mode_list) * int(rounds)
        peer_reqs = len(prompts) * 2 if peers and "hf" in engines else 0
        peer_reqs += sum(per_run[c] for c in levels for p in peer_list
                         if c <= p.max_batch) * int(rounds)
        with tqdm(total=total + peer_reqs, desc="bench", unit="req", disable=not progress, dynamic_ncols=True) as bar:
            if warmup:
                bar.set_postfix_str("warm-up")
                _warmup(rt, prompts, mode_list, max(levels), float(temperature), int(seed))
            off_c1 = None
            for c in levels:
                raw = {m: [] for m in mode_list}
                peer_raw = {p.mode: [] for p in peer_list}
                peer_by_mode = {p.mode: p for p in peer_list}
                names = mode_list + list(peer_by_mode)
                for rnd in range(int(rounds)):
                    parts = {m: [] for m in mode_list}
                    # A cold start is one run from its start: each mode's cold runtime serves all its slices
                    # of the round (the other modes' slices run in between), then is closed.
                    colds: dict = {}
                    with ExitStack() as round_runtimes:
                        for s, (first, end) in enumerate(cuts[c]):
                            turn = rnd * len(cuts[c]) + s
                            for m in mode_order(names, turn):
                                bar.set_postfix_str(f"c={c} {m} round {rnd + 1}/{rounds}"
                                                    + (f" slice {s + 1}/{len(cuts[c])}" if len(cuts[c]) > 1 else ""))
                                if m in peer_by_mode:  # other processes: a whole run, in the round's first slice
                                    run = peer_runs.measure(peer_by_mode[m], c, per_run[c], int(max_new_tokens)) if s == 0 else None
                                    if run is not None:
                                        peer_raw[m].append(run)
                                        bar.update(len(run["requests"]))
                                    continue
                                run_on = rt
                                if start_profile is not None:
                                    if m not in colds:
                                        colds[m] = round_runtimes.enter_context(cold_run(rt, start_profile))
                                    run_on = colds[m]
                                parts[m].append(_measure(run_on, prompts, m, c, end - first, int(max_new_tokens),
                                                         float(temperature), int(seed), bar, first))
                    for m in mode_list:
                        raw[m].append(merge_slices(parts[m]))
                rows = _aggregate(raw, c, max_draft, cost, float(temperature))
                if c == 1 and "off" in raw:
                    off_c1 = raw["off"][0]["requests"]
                result["runs"].extend(rows)
                result["summary"] = _summary(result["runs"], [x for x in levels if x <= c])
                if peer_list:
                    base = raw.get("off") or next(iter(raw.values()))
                    prow = peer_runs.rows_for_level(peer_list, peer_raw, c, base, float(temperature))
                    result.setdefault("peers", []).extend(prow)
                    result["peer_comparison"] = peer_runs.comparison(result["runs"], result["peers"])
                    rows_shown = rows + [r for r in prow if r.get("output_tok_s")]
                else:
                    rows_shown = rows
                _write(out, result)
                best = max(rows, key=lambda r: r["output_tok_s"])
                line = (f"concurrency {c}: " + ", ".join(f"{r['mode']} {r['output_tok_s']:.1f}" for r in rows_shown)
                        + f" tok/s (best {best['mode']})")
                bar.write(line) if progress else say(line)
            if peers and "hf" in engines:
                bar.set_postfix_str("peers (transformers, batch 1)")
                hf = _run_peers(manifest, prompts, int(max_new_tokens), float(temperature), int(seed), off_c1, bar)
                result["peers"] = hf + result.get("peers", [])
                result["comparison_c1"] = _comparison(result["runs"], result["peers"])
        result["complete"] = True
        env["load_avg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
        _write(out, result)
        from dspark_trt.bench.plots import plot_throughput

        plot_throughput(result["runs"], out / "throughput.png",
                        title=f"{Path(artifact_dir).name} | {backend} | {env['cpu']} | {max_new_tokens} new tokens",
                        peers=result.get("peers"))
    finally:
        if peer_list:
            peer_runs.close(peer_list)
        rt.close()
    return out

