"""Open-loop results: the issue's goals against the measured rows, results.json/results.md, latency.png."""

from __future__ import annotations

import statistics
from pathlib import Path

from dspark_trt.bench.latency import median_interval
from dspark_trt.bench.results import _fmt, write_results

TPOT_GOAL, TTFT_GOAL, TOK_GOAL = 1.03, 1.10, 0.97


def goals(entries: list[dict], temperatures) -> list[dict]:
    """Per rate, adaptive against the baselines (off and every fixed K measured at that rate):
    - tpot: adaptive's TPOT p50 / the lowest baseline TPOT p50 <= 1.03;
    - ttft: adaptive's TTFT p99 / off's <= 1.10;
    - throughput (overloaded rates only): adaptive's output tok/s / the highest baseline's >= 0.97;
    - with every request at temperature 1.0: adaptive >= off in tok/s, and TPOT p50 <= off's.
    ``holds`` is None where a figure is missing (e.g. no adaptive row). Each goal also has its figure
    round by round (``*_by_round``, see :func:`paired`): whether the run could tell."""
    out = []
    all_t1 = [t for t, _ in temperatures] == [1.0]
    for rate in sorted({e["rate"] for e in entries}):
        rows = {e["mode"]: e for e in entries if e["rate"] == rate}
        ad, off = rows.get("adaptive"), rows.get("off")
        base = [e for m, e in rows.items() if m == "off" or m.startswith("fixed:")]
        g = {"rate": rate, "load": (ad or off or {}).get("load"), "overloaded": (ad or off or {}).get("overloaded")}
        tp = [e for e in base if e["tpot_ms"]["p50"] is not None]
        best_tpot = min(tp, key=lambda e: e["tpot_ms"]["p50"]) if tp else None
        g["best_tpot_mode"] = best_tpot["mode"] if best_tpot else None
        g["tpot_ratio"] = _ratio(ad and ad["tpot_ms"]["p50"], best_tpot and best_tpot["tpot_ms"]["p50"])
        g["tpot_holds"] = None if g["tpot_ratio"] is None else g["tpot_ratio"] <= TPOT_GOAL
        g["ttft_p99_ratio"] = _ratio(ad and ad["ttft_ms"]["p99"], off and off["ttft_ms"]["p99"])
        g["ttft_holds"] = None if g["ttft_p99_ratio"] is None else g["ttft_p99_ratio"] <= TTFT_GOAL
        best_tok = max(base, key=lambda e: e["output_tok_s"]) if base else None
        g["best_tok_mode"] = best_tok["mode"] if best_tok else None
        g["tok_ratio"] = _ratio(ad and ad["output_tok_s"], best_tok and best_tok["output_tok_s"])
        g["tok_holds"] = (None if g["tok_ratio"] is None or not g["overloaded"] else g["tok_ratio"] >= TOK_GOAL)
        g["tpot_by_round"] = paired(ad, best_tpot, "round_tpot_p50_ms", TPOT_GOAL, at_most=True)
        g["ttft_by_round"] = paired(ad, off, "round_ttft_p99_ms", TTFT_GOAL, at_most=True)
        g["tok_by_round"] = paired(ad, best_tok, "round_output_tok_s", TOK_GOAL, at_most=False) if g["overloaded"] else None
        if all_t1:
            g["t1_tok_over_off"] = _ratio(ad and ad["output_tok_s"], off and off["output_tok_s"])
            g["t1_tpot_over_off"] = _ratio(ad and ad["tpot_ms"]["p50"], off and off["tpot_ms"]["p50"])
            g["t1_holds"] = (None if g["t1_tok_over_off"] is None or g["t1_tpot_over_off"] is None
                             else g["t1_tok_over_off"] >= 1.0 and g["t1_tpot_over_off"] <= 1.0)
            g["t1_tok_by_round"] = paired(ad, off, "round_output_tok_s", 1.0, at_most=False)
            g["t1_tpot_by_round"] = paired(ad, off, "round_tpot_p50_ms", 1.0, at_most=True)
        out.append(g)
    return out


def _ratio(a, b):
    return a / b if a is not None and b else None


def paired(ad: dict | None, base: dict | None, key: str, limit: float, at_most: bool) -> dict | None:
    """Adaptive's figure over the baseline's, round by round (the two ran the same arrivals in the same
    round), with a distribution-free interval for their median (latency.median_interval, 90% where the
    rounds allow) and a verdict: ``holds`` or ``fails`` when the whole interval lies on one side of the
    limit (at_most: the ratio must be <= limit; else >=), ``undecided`` when it spans it: the run's noise
    is larger than the distance to the goal. None with fewer than two paired rounds."""
    a, b = (ad or {}).get(key) or [], (base or {}).get(key) or []
    rounds = [x / y for x, y in zip(a, b) if x is not None and y] if len(a) == len(b) else []
    interval = median_interval(rounds)
    if interval is None:
        return None
    lo, hi, coverage = interval
    good, bad = (hi <= limit, lo > limit) if at_most else (lo >= limit, hi < limit)
    return {"rounds": rounds, "median": statistics.median(rounds), "interval": [lo, hi], "coverage": coverage,
            "verdict": "holds" if good else "fails" if bad else "undecided"}


def write_open(out: Path, result: dict) -> None:
    write_results(out, result, render_open(result))


def _p(d: dict, spec: str = ".1f") -> str:
    return " / ".join(_fmt(d.get(k), spec) for k in ("p50", "p90", "p99"))


def _yes(x) -> str:
    return "-" if x is None else ("holds" if x else "**fails**")


def render_open(result: dict) -> str:
    env, s = result["env"] or {}, result["settings"]
    L = [f"# dspark-trt bench, open loop: {Path((env.get('artifact') or {}).get('dir', '?')).name} "
         f"({env.get('backend', '?')}, {s['driver']})", ""]
    if not result.get("complete", True):
        L += ["**Incomplete**: the benchmark was interrupted or is still running.", ""]
    L += ["```bash", env.get("command", ""), "```", ""]
    L += [f"{env.get('date')} | {env.get('cpu')} ({env.get('cpu_count')} CPUs, load avg at start "
          f"{_fmt((env.get('load_avg_start') or [None])[0], '.2f')}) | Python {env.get('python')}", ""]
    temps = ", ".join(f"{t['value']:g} ({t['weight']:.0%})" for t in s["temperature"])
    length = " (at most ".join(x for x in (f"{s['duration_s']:g} s of arrivals" if s.get("duration_s") else "",
                                            f"{s['num_prompts']} requests" if s.get("num_prompts") else "") if x)
    length += ")" if "(" in length else ""
    cap = result.get("capacity") or {}
    how = f"given ({cap['given']})" if cap.get("given") else "mode off, burst"
    L += [f"Workload {s['workload']}; temperature {temps}; Poisson arrivals (seed {s['seed']}), {length} per "
          f"(rate, mode), {s['rounds']} round(s), modes interleaved; SLO: TTFT <= {s['slo_ttft_ms']:g} ms and "
          f"TPOT <= {s['slo_tpot_ms']:g} ms. Capacity ({how}): {_fmt(cap.get('req_s'), '.2f')} req/s, "
          f"{_fmt(cap.get('tok_s'))} tok/s.", ""]
    L += [f"- {n}" for n in result.get("notes", [])] + ([""] if result.get("notes") else [])
    L += ["## Results (latencies in ms, p50 / p90 / p99)", "",
          "| rate req/s | load | mode | output tok/s | whole run | req/s | TTFT | TPOT | ITL | queue wait | completed "
          "| failed | goodput req/s | in SLO | tau |", "|---:|---:|---|---:|---:|---:|---|---|---|---|---:|---:|---:|---:|---:|"]
    for e in result["open_loop"]:
        L.append(f"| {e['rate']:.2f} | {_fmt(e.get('load'), '.2f')} | {e['mode']} | {_fmt(e['output_tok_s'])} "
                 f"| {_fmt(e.get('output_tok_s_whole_run'))} "
                 f"| {_fmt(e['req_s'], '.2f')} | {_p(e['ttft_ms'], '.0f')} | {_p(e['tpot_ms'])} | {_p(e['itl_ms'])} "
                 f"| {_p(e['queue_wait_ms'], '.0f')} | {e['completed']} | {e['failed']} | {_fmt(e['goodput'], '.2f')} "
                 f"| {_fmt(e.get('goodput_frac'), '.0%')} | {_fmt(e.get('tau'), '.2f')} |")
    L += ["", "## Goals (adaptive against the baselines measured in the same run)", "",
          f"| rate req/s | load | TPOT p50 / best ({TPOT_GOAL}) | best | TTFT p99 / off ({TTFT_GOAL}) "
          f"| tok/s / best ({TOK_GOAL}, overloaded only) | best |" + (" temp 1.0: tok/s / off, TPOT / off |"
                                                                         if any("t1_holds" in g for g in result["goals"]) else ""),
          "|---:|---:|---|---|---|---|---|" + ("---|" if any("t1_holds" in g for g in result["goals"]) else "")]
    for g in result["goals"]:
        row = (f"| {g['rate']:.2f} | {_fmt(g.get('load'), '.2f')} | {_fmt(g['tpot_ratio'], '.3f')} {_yes(g['tpot_holds'])} "
               f"| {g['best_tpot_mode'] or '-'} | {_fmt(g['ttft_p99_ratio'], '.3f')} {_yes(g['ttft_holds'])} "
               f"| {_fmt(g['tok_ratio'], '.3f')} {_yes(g['tok_holds'])} | {g['best_tok_mode'] or '-'} |")
        if "t1_holds" in g:
            row += (f" {_fmt(g['t1_tok_over_off'], '.3f')}, {_fmt(g['t1_tpot_over_off'], '.3f')} "
                    f"{_yes(g['t1_holds'])} |")
        L.append(row)
    L += _render_by_round(result["goals"])
    L += ["", DEFINITIONS]
    return "\n".join(L) + "\n"


BY_ROUND = (("tpot_by_round", "TPOT p50 / best"), ("ttft_by_round", "TTFT p99 / off"),
            ("tok_by_round", "tok/s / best"), ("t1_tok_by_round", "temp 1.0: tok/s / off"),
            ("t1_tpot_by_round", "temp 1.0: TPOT / off"))


def _render_by_round(goal_rows: list[dict]) -> list[str]:
    """The goals paired round by round: median, interval (coverage), verdict; nothing with one round."""
    cols = [(k, name) for k, name in BY_ROUND if any(g.get(k) for g in goal_rows)]
    if not cols:
        return []
    L = ["", "### Round by round (the same arrivals for every mode in a round)", "",
         "| rate req/s | " + " | ".join(name for _, name in cols) + " |", "|---:|" + "---|" * len(cols)]
    for g in goal_rows:
        cells = []
        for k, _ in cols:
            p = g.get(k)
            cells.append("-" if not p else f"{p['median']:.3f} [{p['interval'][0]:.3f}, {p['interval'][1]:.3f}] "
                         f"({p['coverage']:.0%}) " + (p["verdict"] if p["verdict"] != "fails" else "**fails**"))
        L.append(f"| {g['rate']:.2f} | " + " | ".join(cells) + " |")
    return L


DEFINITIONS = """\
## Definitions
- Latencies count from each request's scheduled arrival. **TTFT**: to its first token; **TPOT**: (last
  token - first token) / (tokens - 1); **ITL**: gaps between successive deliveries of tokens (a speculative
  step delivers several tokens at once); **queue wait**: to admission into a batch slot (in process only).
- **output tok/s**: tokens delivered while requests were arriving (schedule start to the last arrival) /
  that span, over rounds: the drain after the last arrival, whose length turns on the last few answers, is
  left out; at an overloading rate it is what the mode sustains with a queue. **whole run**: all tokens /
  (schedule start to the last answer). **req/s**: completed requests / whole-run time. **goodput**:
  completed requests meeting both SLOs per second of whole-run time; **in SLO**: their share of all
  requests sent. **load**: rate / the measured capacity (mode off, see results.json `capacity`).
- **Round by round**: each goal's ratio in each round (adaptive and the baseline ran the same arrivals
  in it), the median over rounds and a distribution-free interval for it (sign test: the k-th lowest to
  the k-th highest round, as much as 90% coverage allows; with 3-4 rounds the whole range, 75%/88%).
  **holds** / **fails**: the whole interval is on one side of the goal; **undecided**: it spans the goal,
  the run's noise is wider than the distance to it (more rounds narrow it).
- **tau** (in process only): tokens a decode step emitted per request. results.json also carries the
  runtime's `predicted_accepted` / `accepted` drafts and `predicted_step_ms` / `measured_step_ms`, summed
  over requests (each request's share of the steps it decoded in).
"""


def plot_latency(entries: list[dict], path, title: str = "") -> Path:
    """Three panels, one line per mode over the rates: TPOT p50 and TTFT p99 against achieved output tok/s,
    and goodput against the offered rate (matplotlib, lazy)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from dspark_trt.bench.plots import _mode_key

    modes = sorted({e["mode"] for e in entries}, key=_mode_key)
    fixed = [m for m in modes if m.startswith("fixed:")]
    cmap = plt.get_cmap("viridis")
    colors = {m: cmap(0.15 + 0.7 * i / max(1, len(fixed) - 1)) for i, m in enumerate(fixed)}
    colors.update({"off": "black", "adaptive": "tab:red"})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    for m in modes:
        rows = sorted((e for e in entries if e["mode"] == m), key=lambda e: e["rate"])
        style = dict(color=colors.get(m), marker="o", ms=4, label=m, lw=2.4 if m in ("off", "adaptive") else 1.2,
                     ls="--" if m == "off" else "-")
        x = [e["output_tok_s"] for e in rows]
        axes[0].plot(x, [e["tpot_ms"]["p50"] for e in rows], **style)
        axes[1].plot(x, [e["ttft_ms"]["p99"] for e in rows], **style)
        axes[2].plot([e["rate"] for e in rows], [e["goodput"] for e in rows], **style)
    for ax, xl, yl, t in ((axes[0], "achieved output tokens / s", "TPOT p50 (ms)", "time per output token"),
                          (axes[1], "achieved output tokens / s", "TTFT p99 (ms)", "time to first token, tail"),
                          (axes[2], "offered rate (requests / s)", "goodput (requests / s in SLO)", "goodput")):
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.set_title(t)
        ax.grid(True, alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8, ncol=2)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
