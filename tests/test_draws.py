"""A request's sampling uniforms: seeded, independent of how they are read, and drawn as they are read, so
nothing a request holds grows with the max_new_tokens it asked for."""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest

from dspark_trt.runtime.config import GenerationConfig, parse_spec
from dspark_trt.runtime.draws import RequestDraws, UniformStream
from dspark_trt.runtime.request import Request


def test_a_draw_depends_only_on_seed_kind_and_offset():
    one = UniformStream(7, 0)
    whole = one.take(0, 500)
    pieces = UniformStream(7, 0)
    got = np.concatenate([pieces.take(0, 3), pieces.take(3, 1), pieces.take(4, 200), pieces.take(204, 296)])
    assert (got == whole).all()
    # Re-reading an overlapping range and skipping ahead give the same values at the same offsets.
    again = UniformStream(7, 0)
    assert (again.take(10, 5) == whole[10:15]).all() and (again.take(12, 5) == whole[12:17]).all()
    assert (again.take(300, 7) == whole[300:307]).all()
    assert whole.dtype == np.float32 and 0.0 <= whole.min() and whole.max() < 1.0
    # Other seeds and other kinds are other streams.
    assert not (UniformStream(8, 0).take(0, 500) == whole).all()
    assert not (UniformStream(7, 1).take(0, 500) == whole).all()


def test_rows_are_consecutive_slices_of_the_stream():
    rows = UniformStream(3, 2, width=4)
    flat = UniformStream(3, 2).take(0, 40)
    for i in range(10):
        assert (rows.row(i) == flat[4 * i:4 * i + 4]).all()


def test_reading_behind_the_kept_start_is_refused():
    s = UniformStream(1, 0)
    s.take(0, 4)
    s.take(1000, 4)  # past the first chunk: what lies before it is dropped
    with pytest.raises(ValueError):
        s.take(0, 1)


def test_memory_follows_reads_not_requests():
    s = UniformStream(5, 0)
    for g in range(0, 100_000, 3):  # a long generation reading a few draws per step
        s.take(g, 5)
    assert s._buf.nbytes < 64 * 1024


def test_a_huge_max_new_tokens_allocates_nothing_at_submit():
    """max_new_tokens=10**9 with sampling once allocated GBs at submit (issue 19, item 1)."""
    cfg = GenerationConfig(max_new_tokens=10 ** 9, temperature=1.0, seed=11, spec="fixed:3")
    tracemalloc.start()
    t0 = time.perf_counter()
    req = Request(0, [1, 2, 3], cfg, parse_spec(cfg.spec, 3), 3)
    req.accept_draws(4), req.sample_draw(), req.draft_draw(2)
    elapsed = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 256 * 1024, peak
    assert elapsed < 0.5


def test_request_draws_are_seeded():
    a, b = RequestDraws(42, 3), RequestDraws(42, 3)
    assert (a.accept.take(0, 10) == b.accept.take(0, 10)).all()
    assert (a.draft.row(5) == b.draft.row(5)).all() and len(a.draft.row(0)) == 3
    with pytest.raises(ValueError):
        RequestDraws(-1, 3)
