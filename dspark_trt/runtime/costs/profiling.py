"""Measure the real engines' step costs (verify by token count, draft by batch) for the budget solver."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from dspark_trt.errors import DsparkError
from dspark_trt.runtime.batch import pack_queries, token_slots, verify_rows

# What one measurement spans and which measurements a profile holds; a profile that differs is measured
# again. "shapes": target calls of varied shape for the call-shape model (call_shape.py).
TIMING = "call+kv-write;shapes"


def profile_path(artifact_dir, backend: str) -> Path:
    name = "cost_profile.json" if backend == "ort" else f"cost_profile.{backend}.json"
    return Path(artifact_dir) / name


def profile_meta(manifest: dict, backend: str) -> dict:
    files = manifest.get("files", {})
    import os

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


def _draft_feeds(rt, batch: int) -> dict:
    past = min(rt.tuning.profile.past, rt.max_context - 2)
    feeds = pack_queries([[1]] * batch, [past] * batch, list(range(batch)))
    feeds.update(temperature=np.zeros(batch, np.float32), uniforms=np.full(batch, 0.5, np.float32),
                 prev_survival=np.ones(batch, np.float32), draft_position=np.zeros(batch, np.int64))
    return feeds


def measure(rt, repeats: int | None = None, progress: bool = True, max_tokens: int | None = None,
            max_batch: int | None = None):
    """Time rt's engines (a Runtime: its backend, caches, limits and tuning.profile) into a CostTable."""
    from dspark_trt.runtime.costs.table import CostTable, profile_points

    max_tokens = max_tokens or min(rt.max_tokens_per_step, rt.slots_total * (rt.max_draft + 1))
    max_batch = max_batch or rt.slots_total

    p = rt.tuning.profile
    repeats = repeats or p.repeats

    def timer(run, make_feeds, cache, past_of=lambda size: p.past):
        # The full call as the runtime makes it: engine run plus writing the new KV entries back (the
        # runtime's drift correction observes the same span, with packing the feeds).
        def once(feeds, past) -> float:
            s = time.perf_counter()
            _, present = run(feeds, past)
            cache.write(present, feeds["positions"], token_slots(feeds))
            return (time.perf_counter() - s) * 1e3

        def ms(size: int) -> float:
            # A call of a millisecond or two is at the mercy of one scheduler hiccup: time cheap calls a
            # few times over and keep their median, so every measurement point weighs ~cheap_ms of work.
            feeds, past = make_feeds(rt, size), cache.past(past_of(size))
            times = [once(feeds, past)]
            extra = min(p.max_inner - 1, math.ceil(p.cheap_ms / max(times[0], 1e-3)) - 1)
            times += [once(feeds, past) for _ in range(max(0, extra))]
            return float(np.median(times))
        return ms

    time_verify = timer(rt.backend.run_target, _verify_feeds, rt.target_kv)
    time_draft = timer(rt.backend.run_draft, _draft_feeds, rt.draft_kv)
    vp, dp = profile_points(time_verify, time_draft, max_tokens, max_batch, repeats, progress=progress, warmup=1)
    layouts = shape_layouts(rt)
    time_shape = timer(rt.backend.run_target, lambda rt, i: _packed_verify_feeds(rt, *layouts[i]), rt.target_kv,
                       past_of=lambda i: layouts[i][1])
    shapes = []
    from tqdm.auto import tqdm  # lazy: keeps runtime import light

    for i in tqdm(range(len(layouts)), desc="profiling call shapes", unit="shape", disable=not progress):
        q, past = layouts[i]
        time_shape(i)  # warm-up: the first call of a new shape pays allocations
        ms = float(np.median([time_shape(i) for _ in range(max(1, repeats - 1))]))
        shapes.append([sum(q), len(q), max(q), past, ms])
    return CostTable.from_measurements(vp, dp, profile_meta(rt.manifest, rt.backend.name),
                                       max_tokens=max_tokens, max_batch=max_batch, shape_points=shapes)


def load_or_profile(rt, backend: str, measure_if_missing: bool = True, repeats: int | None = None,
                    progress: bool = True):
    from dspark_trt.runtime.costs.table import CostTable

    path = profile_path(rt.artifact_dir, backend)
    meta = profile_meta(rt.manifest, backend)
    try:
        return CostTable.load(path, expect=meta)
    except DsparkError:
        if not measure_if_missing:
            raise
    table = measure(rt, repeats=repeats, progress=progress)
    try:
        table.save(path)
    except OSError:
        pass  # a read-only artifact still runs; it just profiles again next time
    return table
