"""Mapping the KV caches' pages ahead of first use (runtime/prefault.py): contents untouched, pages resident,
writes made meanwhile kept, and the runtime starting it at load and waiting for it before timing."""

import mmap
import sys

import numpy as np
import pytest

from dspark_trt.runtime import prefault as pf
from dspark_trt.runtime.costs.switch import SwitchPrice

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def _can_populate() -> bool:
    probe = np.zeros(4 * mmap.PAGESIZE, dtype=np.uint8)
    return pf.prefault([probe])


@linux_only
def test_prefault_maps_the_pages_and_leaves_the_contents():
    if not _can_populate():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    # 2 MiB of fresh anonymous memory (np.zeros might reuse heap pages that are already mapped)
    region = mmap.mmap(-1, 2 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    cache = np.frombuffer(region, dtype=np.float32).reshape(512, 8, 2, 64)
    cache[7, 3] = 1.5  # a page already written
    before = _resident_bytes()
    assert pf.prefault([cache])
    assert _resident_bytes() - before >= 0.9 * cache.nbytes - mmap.PAGESIZE
    expected = np.zeros_like(cache)
    expected[7, 3] = 1.5
    np.testing.assert_array_equal(cache, expected)


@linux_only
def test_writes_made_while_the_background_thread_maps_pages_are_kept():
    cache = np.zeros((1024, 16, 2, 64), dtype=np.float32)  # 8 MiB
    job = pf.prefault_in_background([cache])
    assert job is not None
    rng = np.random.default_rng(0)
    rows = rng.choice(1024 * 16, size=500, replace=False)
    flat = cache.reshape(1024 * 16, 128)
    for i, r in enumerate(rows):
        flat[r] = i + 1.0
    job[0].join()
    assert (flat[rows, 0] == np.arange(1, 501)).all()
    assert np.count_nonzero(flat) == 500 * 128


def test_a_stopped_prefault_maps_nothing_and_tiny_buffers_start_nothing():
    import threading

    stop = threading.Event()
    stop.set()
    region = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    cache = np.frombuffer(region, dtype=np.uint8)
    linux = sys.platform.startswith("linux")
    before = _resident_bytes() if linux else 0
    assert pf.prefault([cache], stop) is linux  # stopped before its first chunk (elsewhere: cannot at all)
    if linux:
        assert _resident_bytes() - before < 1 << 20
    assert pf.prefault_in_background([np.zeros(8, dtype=np.float32)]) is None


def test_the_runtime_maps_its_caches_at_load_and_the_profiler_waits_for_it(tiny_artifact, monkeypatch):
    from dspark_trt.runtime import runtime as runtime_module
    from dspark_trt.runtime.costs import profiling

    seen = []
    real = pf.prefault_in_background

    def record(buffers):
        seen.extend(buffers)
        return real(buffers)

    monkeypatch.setattr(pf, "prefault_in_background", record)
    rt = runtime_module.Runtime.load(tiny_artifact, backend="ort", profile="none")
    try:
        ids = {id(b) for b in seen}
        assert all(id(b) in ids for c in (rt.target_kv, rt.draft_kv) for b in (*c.keys, *c.values))
        calls = []
        wait = rt.wait_prefaulted
        rt.wait_prefaulted = lambda: calls.append(rt._prefault is not None) or wait()
        profiling.measure(rt, repeats=1, progress=False)
        assert len(calls) == 1
        assert rt._prefault is None or not rt._prefault[0].is_alive()  # done before any call was timed
    finally:
        rt.persist_profile = False
        rt.close()


def test_no_cost_is_learned_from_timings_taken_while_the_caches_are_being_mapped(tiny_artifact, monkeypatch):
    """A server's first seconds ran 3-6x slow beside the mapping, and what the cost model learned from them
    (call levels, step overheads, the draft's catch-up rate) kept adaptive at one request from drafting long
    after. So no cost is learned while the mapping runs, for at most MAPPING_GRACE_S."""
    import threading

    from cost_sim import profile_table
    from dspark_trt.runtime import GenerationConfig
    from dspark_trt.runtime import runtime as runtime_module
    from dspark_trt.runtime.runtime import Runtime

    release = threading.Event()

    def held(buffers):
        mapping = threading.Thread(target=release.wait, daemon=True)
        mapping.start()
        return mapping, threading.Event()

    monkeypatch.setattr(pf, "prefault_in_background", held)
    monkeypatch.setattr(runtime_module, "MAPPING_GRACE_S", 1e9)
    rt = Runtime.load(tiny_artifact, profile="none", max_batch=4)
    try:
        rt.persist_profile = False
        rt.cost = profile_table(lambda rows, tokens: 0.05, lambda rows, tokens: 2.0 + 0.01 * tokens,
                                rt.max_batch, 64, rt)
        rt.costs.switch = SwitchPrice(0.0, 1)  # made-up costs: drafting must start at once, prompts joining or not
        prompts = [[5 + i] + list(range(7, 27)) for i in range(2)]  # longer than a drafting call takes in
        config = GenerationConfig(max_new_tokens=12, spec="adaptive")
        rt.generate(prompts, config)
        assert not rt.costs.overhead.ms and rt.drafter.catch_up_rate.ms(100) == 0.0
        # A mapping that outlasts MAPPING_GRACE_S (a CPU-heavy job beside its low-priority thread) stops
        # holding learning back.
        monkeypatch.setattr(runtime_module, "MAPPING_GRACE_S", 0.0)
        rt.generate(prompts, config)
        assert rt.costs.overhead.ms and rt.drafter.catch_up_rate.ms(100) > 0.0
        release.set()
        rt.wait_prefaulted()
    finally:
        release.set()
        rt.close()


def test_closing_a_runtime_gives_its_caches_memory_back_at_once(tiny_artifact):
    """The runtime's parts refer to one another, so its KV caches used to wait for the garbage collector:
    a bench starting every run cold on a runtime of its own ran out of memory after ~25 runtimes. Closed,
    nothing may hold a cache buffer, the decoding graphs' bindings included."""
    import gc
    import weakref

    from dspark_trt.errors import DsparkError
    from dspark_trt.runtime.config import GenerationConfig
    from dspark_trt.runtime.runtime import Runtime

    rt = Runtime.load(tiny_artifact)
    rt.generate([[5, 6, 7]], GenerationConfig(max_new_tokens=4, spec="fixed:2"))  # decode paths bind the caches
    buffers = [weakref.ref(b) for c in (rt.target_kv, rt.draft_kv) for b in c.buffers()]
    assert buffers
    gc.disable()
    try:
        rt.close()
        rt.wait_prefaulted()  # the prefault thread, if still mapping, holds them until it stops
        assert all(ref() is None for ref in buffers)
    finally:
        gc.enable()
    with pytest.raises(DsparkError, match="closed"):
        rt.submit([5, 6], GenerationConfig(max_new_tokens=2))
