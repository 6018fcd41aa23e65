"""Cold starts from a cost profile on a simulated clock: deterministic, whatever else the machine runs.

    python scripts/simulate_start.py ARTIFACT --true good.json --start flat.json --concurrency 16 \
        --seeds 0,1,2,3 --mode off --mode fixed:1 --variant adaptive='{}' --variant lean='{"explore_budget": 0}'

A cold start's bench figures move by up to 0.1 from run to run (issue 22: one round of the flat profile's
64-request cell read 0.90, the next 0.76), so paired rounds cannot tell a mechanism worth 3% from noise.
Here every engine call runs for real (drafts, acceptances and greedy text are the real ones) but the clock
the runtime reads (time.perf_counter) advances by what the call costs under the TRUE profile instead of
the time it took:
  - a target call: the true profile's call-shape model (its fit times its per-width, per-kind offset), plus
    SWITCH_EXTRA plain calls of its width on each of the first calls after a switch of graphs;
  - a draft call: the true profile's draft table at its rows, scaled to its longest past by the profile's
    draft-past term (costs/draft_past.py; none in profiles measured before it), plus CATCH_UP_MS a token
    caught up;
  - each step's host work: PLAIN_HOST or SPEC_HOST (ms at 0 rows, ms a row), as the tiny pair's bench
    measured it (overhead 5% of a step at 16-64 requests plain, 9% drafting, 18% at 1 request).
The runtime starts from START with nothing learned, so what a mechanism changes in how it recovers shows
as a change in simulated tok/s, the same on every run. Requests run closed-loop at the concurrency (the
admission's batch capped there), 3x the concurrency of them (at least 64), each generating --tokens.
The world is a model: its true costs are the profile's (on this machine the real calls put drafting at
16 requests further below plain decoding than the profile does). Use it to rank mechanisms, then confirm
on the engines with `dspark-trt bench --start-profile`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from cost_sim import SimClock, submit_all_at_once  # noqa: E402  (the tests' simulated world)

SWITCH_EXTRA = (0.6, 0.3, 0.15)  # plain calls added to the 1st, 2nd, 3rd call after a switch of graphs
CATCH_UP_MS = 0.004
PLAIN_HOST = (0.17, 0.014)
SPEC_HOST = (0.6, 0.04)


class TrueCostEngines:
    """The real backend's calls, each advancing the clock by its true cost."""

    def __init__(self, real, clock: SimClock, truth):
        self.real, self.clock = real, clock
        self.truth, self.shape = truth, truth.call_shape
        self._graph, self._same = None, 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def _draft(self, run, feeds, past):
        out = run(feeds, past)
        rows, tokens = len(feeds["query_lens"]), int(feeds["tokens"].shape[0])
        ms = float(self.truth.draft_ms(rows, corrected=False, past=int(feeds["past_lens"].max())))
        self.clock.advance_ms(ms + CATCH_UP_MS * max(0, tokens - rows))
        return out

    def run_draft(self, feeds, past):
        return self._draft(self.real.run_draft, feeds, past)

    def run_draft_greedy(self, feeds, past):
        return self._draft(self.real.run_draft_greedy, feeds, past)

    def run_target(self, feeds, past):
        from dspark_trt.runtime.costs.overhead import load_bucket

        out = self.real.run_target(feeds, past)
        graph = getattr(self.real, "last_graph", None)
        self._same = self._same + 1 if graph == self._graph else 0
        self._graph = graph
        q, p = feeds["query_lens"], int(feeds["past_lens"].max())
        rows, longest, w = len(q), int(q.max()), load_bucket(len(q))
        ms = self.shape.base_ms(int(q.sum()), rows, longest, p) * math.exp(self.shape._offset(w, longest > 1))
        if graph is not None and self._same < len(SWITCH_EXTRA):
            plain = self.shape.base_ms(rows, rows, 1, p) * math.exp(self.shape._offset(w, False))
            ms += SWITCH_EXTRA[self._same] * plain
        self.clock.advance_ms(ms)
        return out


def on_true_costs(rt, truth) -> SimClock:
    """Put `rt` in the simulated world: its engine calls and each step's host work advance a new clock by
    their true cost. Point time.perf_counter at the clock (:func:`simulated_time`) while it runs."""
    import numpy as np

    clock = SimClock()
    rt.drafter.backend = rt.verifier.backend = TrueCostEngines(rt.backend, clock, truth)
    commit = rt.committer.commit

    def commit_with_host_time(batch, drafted, result, plan):
        a, b = SPEC_HOST if np.asarray(result.verify_lens).any() else PLAIN_HOST
        clock.advance_ms(a + b * len(batch.decode))
        return commit(batch, drafted, result, plan)

    rt.committer.commit = commit_with_host_time
    return clock


@contextmanager
def simulated_time(clock: SimClock):
    real_clock, time.perf_counter = time.perf_counter, clock
    try:
        yield
    finally:
        time.perf_counter = real_clock


def one_run(warm, start, truth, prompts, mode: str, tuning, concurrency: int, tokens: int,
            first: int = 512) -> tuple[float, float]:
    """Simulated output tok/s of one cold run: over the whole run, and over its first `first` tokens (from
    the submission to the end of the step that reached them, as the bench's first_tokens_tok_s)."""
    from dspark_trt.bench.latency import first_tokens_rate
    from dspark_trt.bench.start_profile import cold_runtime
    from dspark_trt.runtime import GenerationConfig

    rt = cold_runtime(warm, start, tuning)
    clock = on_true_costs(rt, truth)
    try:
        with simulated_time(clock):
            rt.admission.max_batch = concurrency
            cfg = GenerationConfig(max_new_tokens=tokens, spec=mode, stop_at_eos=False)
            reqs = submit_all_at_once(rt, [prompts[i % len(prompts)].ids for i in range(max(64, 3 * concurrency))],
                                      cfg)
            t0 = clock()
            for r in reqs:
                r.done.wait()
            ms = (clock() - t0) * 1e3
            timeline = list(rt.metrics.timeline)  # (simulated clock at each step's end, tokens out so far)
    finally:
        rt.close()
    first_rate = first_tokens_rate(timeline, [{"submitted_at": t0}], first)
    return sum(len(r.generated_ids) for r in reqs) / ms * 1e3, float("nan") if first_rate is None else first_rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--true", required=True, help="cost profile whose costs the simulated calls take")
    ap.add_argument("--start", required=True, help="cost profile every run starts from")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seeds", default="0,1,2,3", help="prompt seeds, one set of runs each")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--first", type=int, default=512, help="also report the rate over the first N tokens")
    ap.add_argument("--mode", action="append", default=[], help="off, fixed:K (repeatable); off always runs")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=JSON: adaptive with these RuntimeTuning fields (repeatable)")
    args = ap.parse_args()

    from dspark_trt.bench.prompts import corpus_prompts, prompt_budget
    from dspark_trt.bench.start_profile import runtime_from
    from dspark_trt.runtime.costs.table import CostTable
    from dspark_trt.runtime.tuning import RuntimeTuning

    runs = [("off", "off", None)] + [(m, m, None) for m in args.mode if m != "off"]
    for spec in args.variant:
        name, _, js = spec.partition("=")
        runs.append((name, "adaptive", RuntimeTuning.from_dict(json.loads(js or "{}"))))
    truth = CostTable.load(args.true)
    warm = runtime_from(args.artifact, "ort", args.start)
    ratios: dict[str, list[float]] = {}
    try:
        for seed in (int(s) for s in args.seeds.split(",")):
            prompts = corpus_prompts(warm.tokenizer.encode, warm.tokenizer.decode, 64, seed,
                                     prompt_budget(warm.max_context, args.tokens))
            both = {name: one_run(warm, args.start, truth, prompts, mode, tuning or warm.tuning,
                                  args.concurrency, args.tokens, args.first) for name, mode, tuning in runs}
            for i, what in enumerate(("whole run", f"first {args.first}")):
                rates = {n: r[i] for n, r in both.items()}
                print(f"seed {seed}, {what}: " + "  ".join(f"{n} {r:.0f} tok/s ({r / rates['off']:.3f})"
                                                          for n, r in rates.items()), flush=True)
                for n, r in rates.items():
                    ratios.setdefault((what, n), []).append(r / rates["off"])
    finally:
        warm.close()
    for what in ("whole run", f"first {args.first}"):
        print(f"{what}, geometric mean / off: " + "  ".join(
            f"{n} {math.exp(sum(map(math.log, v)) / len(v)):.3f}" for (w, n), v in ratios.items() if w == what))


if __name__ == "__main__":
    main()
