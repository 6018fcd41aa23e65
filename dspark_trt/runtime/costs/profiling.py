"""Measure the real engines' step costs (verify by token count, draft by batch) for the budget solver."""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from dspark_trt.errors import DsparkError
from dspark_trt.runtime.batch import pack_queries, token_slots, verify_rows
from dspark_trt.runtime.costs.draft_past import DraftPast

# What one measurement spans and which measurements a profile holds; a profile that differs is measured
# again. "shapes": target calls of varied shape for the call-shape model (call_shape.py), "settled": each
# timed after tuning.settle_calls untimed calls of its shape (profiles timed across graph switches priced
# plain calls 1.45-1.67x their settled time at 16 rows, verify calls 1.1x).
TIMING = "call+kv-write;shapes-settled;draft-past"
# What refits of the call-shape model may move, recorded in a refined profile's meta. Profiles refined
# before refits kept the past and padding coefficients could carry a padding cost refitted to 0 (prompt
# chunks then packed among wide decode calls, 1-2.7 s a step); without the mark they are measured again.
SHAPE_REFITS = "call,tokens"


def profile_path(artifact_dir, backend: str) -> Path:
    name = "cost_profile.json" if backend == "ort" else f"cost_profile.{backend}.json"
    return Path(artifact_dir) / name


def profile_name(rt) -> str:
    """The name a runtime's profile is saved and matched under (Runtime.profile_name: the backend, its thread
    regime and options), or the backend's name for runtimes built without load()."""
    return getattr(rt, "profile_name", None) or rt.backend.name


def profile_meta(manifest: dict, backend: str) -> dict:
    files = manifest.get("files", {})
    return {"artifact": {k: v.get("sha256") for k, v in sorted(files.items())}, "backend": backend,
            "cpu_count": os.cpu_count(), "timing": TIMING}


def _verify_feeds(rt, tokens: int) -> dict:
    """`tokens` tokens in rows of at most max_draft + 1 (dense verifies), each row at the profile's past."""
    per = rt.max_draft + 1
    r = max(1, min(rt.slots_total, math.ceil(tokens / per)))
    sizes = [tokens // r + (1 if i < tokens % r else 0) for i in range(r)]
    return _packed_verify_feeds(rt, sizes, min(rt.tuning.profile.past, rt.max_context - per - 1))


def _packed_verify_feeds(rt, query_lens: list[int], past: int) -> dict:
    """A target call over rows of these query lengths at this past (each row verifies up to max_draft)."""
    r = len(query_lens)
    feeds = pack_queries([[1] * n for n in query_lens], [past] * r, list(range(r)))
    vl = np.asarray([min(n - 1, rt.max_draft) for n in query_lens], dtype=np.int64)
    feeds["verify_index"] = verify_rows(feeds["query_lens"], vl)
    feeds["verify_lens"] = vl
    m = len(feeds["verify_index"])
    feeds.update(draft_tokens=np.ones(m, np.int64), draft_probs=np.zeros((m, rt.vocab), np.float32),
                 temperature=np.zeros(r, np.float32), accept_uniforms=np.zeros(m, np.float32),
                 sample_uniforms=np.zeros(r, np.float32))
    return feeds


def shape_layouts(rt) -> list[tuple[list[int], int]]:
    """Target-call layouts (query lengths, past) for the call-shape model: even verifies, one deep verify
    among single tokens, one prompt chunk among single tokens; few and many rows; short and long past."""
    deep = rt.max_draft + 1
    rows = sorted({1, min(4, rt.slots_total), min(16, rt.slots_total), rt.slots_total})
    chunk = min(32, rt.query_len_max)
    out = []
    for past in (32, 192):
        if past + chunk + 1 > rt.max_context:
            past = max(1, rt.max_context - chunk - 1)
        for r in rows:
            layouts = [[1] * r, [min(3, deep)] * r, [deep] * r, [deep] + [1] * (r - 1), [chunk] + [1] * (r - 1)]
            out += [(q, past) for q in layouts if sum(q) <= rt.max_tokens_per_step]
    return [(list(q), p) for q, p in dict.fromkeys((tuple(q), p) for q, p in out)]


def draft_past_layouts(rt) -> list[tuple[int, int]]:
    """(batch, past) of the draft calls that measure how the draft's cost grows with the past: one, a
    quarter of the slots and all of them, each at the profile's past and at a long one (8x it, within the
    context), in that order; none where the context leaves no longer past."""
    past0 = min(rt.tuning.profile.past, rt.max_context - 2)
    past = min(rt.max_context - 2, 8 * past0)
    if past <= past0:
        return []
    return [(b, x) for b in sorted({1, max(1, rt.slots_total // 4), rt.slots_total}) for x in (past0, past)]


def _draft_call(rt, batch: int):
    """One drafting call of `batch` rows, made by the runtime's drafter phase (either drafter kind)."""
    return rt.drafter.prepare_call(batch, min(rt.tuning.profile.past, rt.max_context - 2))


def measure(rt, repeats: int | None = None, progress: bool = True, max_tokens: int | None = None,
            max_batch: int | None = None):
    """Time rt's engines (a Runtime: its backend, caches, limits and tuning.profile) into a CostTable."""
    from dspark_trt.runtime.costs.measure import profile_points
    from dspark_trt.runtime.costs.table import CostTable

    max_tokens = max_tokens or min(rt.max_tokens_per_step, rt.slots_total * (rt.max_draft + 1))
    max_batch = max_batch or rt.slots_total
    rt.wait_prefaulted()  # its page faults would be timed with the calls

    p = rt.tuning.profile
    repeats = repeats or p.repeats

    def timer(run, make_feeds, cache, past_of=lambda size: p.past, all_times: bool = False):
        # The full call as the runtime makes it: engine run plus writing the new KV entries back (the
        # runtime's drift correction observes the same span, with packing the feeds).
        def once(feeds, past) -> float:
            s = time.perf_counter()
            if run is None:  # make_feeds gave a prepared call (the drafter phase's own: either drafter kind)
                feeds()
            else:
                _, present = run(feeds, past)
                cache.write(present, feeds["positions"], token_slots(feeds))
            return (time.perf_counter() - s) * 1e3

        def ms(size: int, settle: int = 0) -> float:
            # A call of a millisecond or two is at the mercy of one scheduler hiccup: time cheap calls a
            # few times over and keep their median, so every measurement point weighs ~cheap_ms of work.
            # How many times follows the fastest timing so far, not the first: on a loaded machine the
            # first timing of a 0.3 ms call can be 10x slower (a preempted thread), and judging by it left
            # that point with one or two timings and a median 10x too high.
            feeds, past = make_feeds(rt, size), (cache.past(past_of(size)) if cache is not None else None)
            for _ in range(settle):
                once(feeds, past)
            times = [once(feeds, past)]
            while len(times) < min(p.max_inner, math.ceil(p.cheap_ms / max(min(times), 1e-3))):
                times.append(once(feeds, past))
            return times if all_times else float(np.median(times))
        return ms

    time_verify = timer(rt.backend.run_target, _verify_feeds, rt.target_kv)
    time_draft = timer(None, _draft_call, None)
    # Robust points: round-robin over all sizes, a point is replayed until its kept timings (the slow
    # tail dropped) agree to within profile.max_spread or it has profile.max_repeats timings; the machine's
    # load around the measurement goes into the meta with the resulting spread.
    load_before = _loadavg()
    stats: dict = {}
    vp, dp = profile_points(time_verify, time_draft, max_tokens, max_batch, repeats, progress=progress, warmup=1,
                            max_spread=p.max_spread, max_repeats=p.max_repeats, keep_quantile=p.keep_quantile,
                            stats=stats)
    layouts = shape_layouts(rt)
    time_shape = timer(rt.backend.run_target, lambda rt, i: _packed_verify_feeds(rt, *layouts[i]), rt.target_kv,
                       past_of=lambda i: layouts[i][1], all_times=True)
    from tqdm.auto import tqdm  # lazy: keeps runtime import light

    # The call-shape model is fitted to all shapes at once, so they are timed in the same conditions:
    # round-robin over the shapes (as profile_points does for sizes), at least profile.shape_rounds times, and
    # each shape keeps a low quantile (profile.shape_quantile) of all its timings. On a loaded machine other
    # processes preempt the engine's threads, which only ever adds time and hits the multi-threaded
    # (larger) calls hardest: one such shape, timed at 10x its cost, pulled the whole least-squares fit
    # off (median error 0.7 with two busy processes on two cores; ~0.1 with the low quantile, loaded or
    # not). The runtime's online drift correction (per call width) then follows the machine's real load.
    # Each timing follows tuning.settle_calls untimed calls of its shape (at least one: it warms a new shape up):
    # timed right after another shape, a call paid for the switch (ONNX Runtime: another graph, its cache
    # copy brought up to date, caches cold), at 16 rows a plain call 1.45-1.67x its time in a run.
    # Draft calls at a long past beside the same batch at the profile's past, in the same rounds: how the
    # draft's cost grows with the context (costs/draft_past.py).
    pairs = draft_past_layouts(rt)
    time_pair = timer(None, lambda rt, i: rt.drafter.prepare_call(*pairs[i]), None, all_times=True)
    rounds = max(p.shape_rounds, repeats - 1)
    settle = max(1, rt.tuning.settle_calls)
    timings: list[list[float]] = [[] for _ in layouts]
    pair_timings: list[list[float]] = [[] for _ in pairs]
    with tqdm(total=(len(layouts) + len(pairs)) * rounds, desc="profiling call shapes", unit="run",
              disable=not progress) as bar:
        for _ in range(rounds):
            for i in range(len(layouts)):
                timings[i].extend(time_shape(i, settle))
                bar.update(1)
            for i in range(len(pairs)):
                pair_timings[i].extend(time_pair(i, settle))
                bar.update(1)
    shapes = [[sum(q), len(q), max(q), past, float(np.percentile(t, p.shape_quantile))]
              for (q, past), t in zip(layouts, timings)]
    pair_ms = [float(np.percentile(t, p.shape_quantile)) for t in pair_timings]
    draft_past = (DraftPast.points(pairs[0][1], pairs[1][1], [b for b, _ in pairs[::2]], pair_ms[::2], pair_ms[1::2])
                  if pairs else None)
    meta = dict(profile_meta(rt.manifest, profile_name(rt)), past=p.past, spread=round(stats["spread"], 4),
                spread_max=round(stats["spread_max"], 4), rounds=stats["rounds"],
                load={"before": load_before, "after": _loadavg()})
    return CostTable.from_measurements(vp, dp, meta, max_tokens=max_tokens, max_batch=max_batch,
                                       shape_points=shapes, draft_past=draft_past)


def _loadavg() -> list[float] | None:
    """The machine's 1, 5 and 15 minute load averages (None where the platform has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def spread_refusal(meta: dict, limit: float) -> str | None:
    """Why a measured profile should not be saved (its timings' spread above `limit`), or None."""
    spread = meta.get("spread")
    if spread is None or spread <= limit:
        return None
    load = (meta.get("load") or {}).get("after") or (meta.get("load") or {}).get("before")
    cores = meta.get("cpu_count") or os.cpu_count()
    busy = f"machine busy, load {load[0]:.1f} on {cores} cores" if load else "machine busy"
    return f"timings spread {spread:.0%} (over {limit:.0%}; {busy})"


def load_or_profile(rt, backend: str, measure_if_missing: bool = True, repeats: int | None = None,
                    progress: bool = True):
    from dspark_trt.runtime.costs.table import CostTable

    path = profile_path(rt.artifact_dir, backend)
    meta = profile_meta(rt.manifest, backend)
    try:
        table = CostTable.load(path, expect=meta)
        if not table.meta.get("refined_observations") or table.meta.get("shape_refits") == SHAPE_REFITS:
            return table
        if not measure_if_missing:
            raise DsparkError(f"{path} was refined by an older dspark-trt whose refits could zero its padding "
                              "cost; re-measure it with `dspark-trt profile`")
        print(f"note: {path.name} was refined by an older dspark-trt (its padding cost may be refitted to 0); "
              "measuring it again", file=sys.stderr)
    except DsparkError:
        if not measure_if_missing:
            raise
    table = quick_or_full_profile(rt, repeats=repeats, progress=progress)
    why = spread_refusal(table.meta, rt.tuning.profile.persist_spread)
    if why:
        # A starting point only for this run: saving it would make every later start plan with it.
        msg = f"cost profile not saved: {why}; it will be measured again next start"
        print(msg, file=sys.stderr)
        return table
    try:
        table.save(path)
    except OSError:
        pass  # a read-only artifact still runs; it just profiles again next time
    return table


# ------------------------------------------------------------------------------------------ start-up
START_BUDGET_S = 20.0  # a first load may spend about this long profiling; larger models get a quick profile


def quick_or_full_profile(rt, repeats: int | None = None, progress: bool = True, budget_s: float = START_BUDGET_S):
    """The profile a first load measures: the full one when it fits `budget_s`, else a quick one.

    Two probe calls (verify 1 and max tokens, timed once each after a warm-up) predict what the full
    profile would cost (its verify and draft points, `repeats` + 1 calls each, plus the call shapes).
    A large model on a small machine would spend minutes there (a 2.8 GB fp32 target on 2 cores: ~88
    calls of up to several seconds), so it gets a profile of a few points instead: verify at 1, K+1 and
    max tokens, draft at 1 and max batch, linear in between (the cost model's fit). It is marked
    `quick` in its meta and saved like any profile; the runtime's drift correction refines it online
    and `dspark-trt profile` replaces it with the full one.
    """
    from dspark_trt.runtime.costs.table import CostTable, measurement_points

    repeats = repeats or rt.tuning.profile.repeats
    max_tokens = min(rt.max_tokens_per_step, rt.slots_total * (rt.max_draft + 1))
    probe = _probe_verify(rt, [1, max_tokens])
    # Priced at the worst case: a point replays until its spread settles, up to profile.max_repeats.
    calls = max(repeats + 1, rt.tuning.profile.max_repeats)
    # the call shapes: ~2 x 16 calls' worth of mid-size ones per round, each after settle_calls untimed ones
    full_calls = [(t, calls) for t in measurement_points(max_tokens)] + [
        (max_tokens // 2, 2 * 16 * (1 + rt.tuning.settle_calls))]
    predicted_s = sum(n * np.interp(t, [1, max_tokens], probe) for t, n in full_calls) / 1e3
    if predicted_s <= budget_s:
        return measure(rt, repeats=repeats, progress=progress)
    verify_at = sorted({1, min(rt.max_draft + 1, max_tokens), max_tokens})
    draft_at = sorted({1, rt.slots_total})
    vp = {t: [probe[0] if t == 1 else probe[1]] for t in (1, max_tokens)}
    mid = [t for t in verify_at if t not in vp]
    vp.update(dict(zip(mid, ([v] for v in _probe_verify(rt, mid)))))
    dp = {b: [ms] for b, ms in zip(draft_at, _probe_draft(rt, draft_at))}
    meta = dict(profile_meta(rt.manifest, profile_name(rt)), quick=True)
    return CostTable.from_measurements(vp, dp, meta, max_tokens=max_tokens, max_batch=rt.slots_total)


REFINE_MIN_OBSERVATIONS = 16


def disagreement(cost) -> float:
    """How far observed calls are from the profile: the largest drift factor f at any observed size, as
    max(f, 1 / f) - 1 (0: they agree; 1: calls take twice, or half, the profiled time)."""
    factors = [f for d in cost.drift().values() for f in d["by_size"].values()]
    moved = 0.0
    if cost.call_shape is not None:  # the call-shape model's drift, per call width it observed, and its refits
        factors += [math.exp(x) for x in cost.call_shape.level.values()]
        moved = cost.call_shape.moved()
    return max([moved] + [max(f, 1.0 / f) - 1.0 for f in factors if f > 0])


def persist_refined(rt) -> Path | None:
    """At close: save the drift-corrected tables (what the runtime learned from real calls) in place of the
    profile, so the next start begins from them. A quick start-up profile is replaced once observed
    REFINE_MIN_OBSERVATIONS times; a full one only when its observed calls disagree with it by more than
    DriftTuning.refine_margin over at least DriftTuning.refine_observations calls (a profile measured on a
    busy machine, or a machine that changed since). The meta says so: ``refined_observations`` (calls
    learned from, summed over refinements) and ``refined_from`` (the profile's kind and how far apart)."""
    from dspark_trt.runtime.costs.overhead import load_bucket
    from dspark_trt.runtime.costs.table import CostTable
    from dspark_trt.runtime.tuning import DriftTuning

    cost = getattr(rt, "cost", None)
    if cost is None:
        return None
    seen = sum(d["observations"] for d in cost.drift().values())
    quick = bool(cost.meta.get("quick"))
    tuning = getattr(getattr(rt, "tuning", None), "drift", None) or DriftTuning()
    apart = disagreement(cost)
    if quick:
        if seen < REFINE_MIN_OBSERVATIONS:
            return None
    elif seen < tuning.refine_observations or apart <= tuning.refine_margin:
        return None
    tables = [np.maximum.accumulate(np.asarray(t, dtype=np.float64)) for t in (cost.verify_table(), cost.draft_table())]
    meta = dict(cost.meta, shape_refits=SHAPE_REFITS,
                refined_observations=int(cost.meta.get("refined_observations", 0)) + int(seen),
                refined_from=dict(cost.meta.get("refined_from") or {"kind": "quick" if quick else "full"},
                                  disagreement=round(apart, 4)))
    points = dict(cost.points)
    shape = cost.call_shape
    if shape is not None and (shape.level or shape.refits) and points.get("verify_shapes"):
        # The call shapes' timings as the model now predicts them (its refits), at one level for all widths
        # (its global drift): the model is fitted again from them at the next load, and that fit is linear
        # in the features, so levels that differ by width came back as coefficients of the terms that grow
        # with the rows. After a temperature-1.0 open loop a saved profile priced padding 8x and tokens at 0,
        # and adaptive then hardly drafted (lab notes, ninth session). Each width's level is learned again.
        # Each kind's profile offset at its width goes with its calls (plain and verify calls run different
        # graphs on ONNX Runtime; the next load starts from these calls' errors), at one level.
        def saved_ms(tokens, rows, longest, past):
            offset = shape.profile_offset.get((load_bucket(rows), longest > 1), 0.0)
            return shape.base_ms(tokens, rows, longest, past) * math.exp(shape.log_drift + offset)
        points["verify_shapes"] = [[*row[:4], saved_ms(*(int(v) for v in row[:4]))] for row in points["verify_shapes"]]
    try:
        return CostTable(*tables, meta, points=points).save(profile_path(rt.artifact_dir, profile_name(rt)))
    except OSError:
        return None  # a read-only artifact: refine again next time


def _probe(run, make_feeds, cache, rt, sizes: list[int], timings: int = 1) -> list[float]:
    """One warm-up call per size, then the least of `timings` timed calls (engine call plus the KV write, as
    `measure` times); run None: make_feeds gives a prepared call."""
    out = []
    for size in sizes:
        feeds, past = make_feeds(rt, size), (cache.past(rt.tuning.profile.past) if cache is not None else None)
        times = []
        for _ in range(1 + timings):
            s = time.perf_counter()
            if run is None:
                feeds()
            else:
                _, present = run(feeds, past)
                cache.write(present, feeds["positions"], token_slots(feeds))
            times.append((time.perf_counter() - s) * 1e3)
        out.append(min(times[1:]))
    return out


def _probe_verify(rt, sizes):
    return _probe(rt.backend.run_target, _verify_feeds, rt.target_kv, rt, sizes)


# Draft calls are cheap whatever the target's size, so the quick profile times each draft point this many
# times and keeps the least: one timing beside a CPU hog (README command 1 in a fresh clone while CI ran) read
# a 1-row draft call at 3.58 ms against 0.42 quiet, and adaptive did not draft at all in that first run. The
# runtime's drift correction learns what calls cost on the machine as it is from there.
QUICK_DRAFT_TIMINGS = 5


def _probe_draft(rt, sizes):
    return _probe(None, _draft_call, None, rt, sizes, timings=QUICK_DRAFT_TIMINGS)
