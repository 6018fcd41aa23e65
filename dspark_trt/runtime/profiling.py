"""Measure the real engines' step costs (verify by token count, draft by batch) for the budget solver."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from dspark_trt.errors import DsparkError
from dspark_trt.runtime.batch import pack_queries, token_slots, verify_rows

PROFILE_PAST = 128
TIMING = "call+kv-write"  # what one measurement spans; a profile timed differently is measured again
CHEAP_MS = 5.0  # calls faster than this are timed several times per measurement (median)
MAX_INNER = 7


def profile_path(artifact_dir, backend: str) -> Path:
    name = "cost_profile.json" if backend == "ort" else f"cost_profile.{backend}.json"
    return Path(artifact_dir) / name


def profile_meta(manifest: dict, backend: str) -> dict:
    files = manifest.get("files", {})
    import os

    return {"artifact": {k: v.get("sha256") for k, v in sorted(files.items())}, "backend": backend,
            "cpu_count": os.cpu_count(), "timing": TIMING}


def _verify_feeds(rt, tokens: int) -> dict:
    per = rt.max_draft + 1
    r = max(1, min(rt.slots_total, math.ceil(tokens / per)))
    sizes = [tokens // r + (1 if i < tokens % r else 0) for i in range(r)]
    past = min(PROFILE_PAST, rt.max_context - per - 1)
    feeds = pack_queries([[1] * n for n in sizes], [past] * r, list(range(r)))
    vl = np.asarray([n - 1 for n in sizes], dtype=np.int64)
    feeds["verify_index"] = verify_rows(feeds["query_lens"], vl)
    feeds["verify_lens"] = vl
    m = len(feeds["verify_index"])
    feeds.update(draft_tokens=np.ones(m, np.int64), draft_probs=np.zeros((m, rt.vocab), np.float32),
                 temperature=np.zeros(r, np.float32), accept_uniforms=np.zeros(m, np.float32),
                 sample_uniforms=np.zeros(r, np.float32))
    return feeds


def _draft_feeds(rt, batch: int) -> dict:
    past = min(PROFILE_PAST, rt.max_context - 2)
    feeds = pack_queries([[1]] * batch, [past] * batch, list(range(batch)))
    feeds.update(temperature=np.zeros(batch, np.float32), uniforms=np.full(batch, 0.5, np.float32),
                 prev_survival=np.ones(batch, np.float32), draft_position=np.zeros(batch, np.int64))
    return feeds


def measure(rt, repeats: int = 3, progress: bool = True, max_tokens: int | None = None, max_batch: int | None = None):
    from dspark_trt.runtime.cost_model import CostTable, profile_points

    max_tokens = max_tokens or min(rt.max_tokens_per_step, rt.slots_total * (rt.max_draft + 1))
    max_batch = max_batch or rt.slots_total

    def timer(run, make_feeds, cache):
        # The full call as the runtime makes it: engine run plus writing the new KV entries back (the
        # runtime's drift correction observes the same span, with packing the feeds).
        def once(feeds, past) -> float:
            s = time.perf_counter()
            _, present = run(feeds, past)
            cache.write(present, feeds["positions"], token_slots(feeds))
            return (time.perf_counter() - s) * 1e3

        def ms(size: int) -> float:
            # A call of a millisecond or two is at the mercy of one scheduler hiccup: time cheap calls a
            # few times over and keep their median, so every measurement point weighs ~CHEAP_MS of work.
            feeds, past = make_feeds(rt, size), cache.past(PROFILE_PAST)
            times = [once(feeds, past)]
            extra = min(MAX_INNER - 1, math.ceil(CHEAP_MS / max(times[0], 1e-3)) - 1)
            times += [once(feeds, past) for _ in range(max(0, extra))]
            return float(np.median(times))
        return ms

    time_verify = timer(rt.backend.run_target, _verify_feeds, rt.target_kv)
    time_draft = timer(rt.backend.run_draft, _draft_feeds, rt.draft_kv)
    vp, dp = profile_points(time_verify, time_draft, max_tokens, max_batch, repeats, progress=progress, warmup=1)
    return CostTable.from_measurements(vp, dp, profile_meta(rt.manifest, rt.backend.name),
                                       max_tokens=max_tokens, max_batch=max_batch)


def load_or_profile(rt, backend: str, measure_if_missing: bool = True, repeats: int = 3, progress: bool = True):
    from dspark_trt.runtime.cost_model import CostTable

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


def profile_artifact(artifact_dir, backend: str = "ort", repeats: int = 5) -> Path:
    from dspark_trt.runtime.runtime import Runtime

    rt = Runtime.load(artifact_dir, backend=backend, profile="none")
    try:
        table = measure(rt, repeats=repeats)
        return table.save(profile_path(artifact_dir, backend))
    finally:
        rt.close()
