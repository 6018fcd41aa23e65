"""Slot compaction (phases/admission.py): requests in high slots move down into the holes finished requests
leave, because ONNX Runtime's decoding graph runs a call over a range of slots. A move copies a request's
caches; nothing a request generates may change."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from dspark_trt.runtime.backends.ort_decode import MirroredKVCache
from dspark_trt.runtime.kv_cache import KVCache
from dspark_trt.runtime.phases.admission import Admission
from dspark_trt.runtime.tuning import RuntimeTuning

PROMPTS = ["def fib(n):", "import os\n", "class Foo:", "x = [", "for i in"]
LENGTHS = [3, 26, 5, 30, 9]  # slots 0, 2 and 4 finish first: holes below live requests


def _admission(n_slots: int, moves: list) -> Admission:
    a = Admission(n_slots, n_slots, None, RuntimeTuning(), SimpleNamespace(shape=None), 64, SimpleNamespace())
    a.move_slot = lambda r, src, dst: moves.append((r.id, src, dst))
    return a


def test_the_highest_requests_move_into_the_lowest_holes_until_none_is_below_a_live_request():
    moves = []
    a = _admission(6, moves)
    reqs = [SimpleNamespace(id=i, slot=i) for i in range(6)]
    a.slots = [reqs[0], None, reqs[2], None, reqs[4], reqs[5]]
    a._compact()
    assert moves == [(5, 5, 1), (4, 4, 3)]
    assert [r.id if r else None for r in a.slots] == [0, 5, 2, 4, None, None]
    assert (reqs[5].slot, reqs[4].slot) == (1, 3) and a.moves == 2
    moves.clear()
    a._compact()  # dense already
    assert moves == []


def test_a_move_takes_the_host_rows_the_slot_major_copy_and_its_bookkeeping():
    rng = np.random.default_rng(0)
    cache = MirroredKVCache(2, 16, 4, 2, 3)
    for buf in (*cache.keys, *cache.values, *cache.slot_major):
        buf[...] = rng.standard_normal(buf.shape)
    cache.written_end[3], cache.stale_lo[3], cache.stale_hi[3] = 9, 6, 9
    before = [b.copy() for b in (*cache.keys, *cache.values, *cache.slot_major)]
    cache.move(3, 1, 7)
    n = len(cache.keys) * 2
    for old, new in zip(before[:n], (*cache.keys, *cache.values)):
        assert (new[:7, 1] == old[:7, 3]).all() and (new[7:, 1] == old[7:, 1]).all()
        assert (np.delete(new, 1, axis=1) == np.delete(old, 1, axis=1)).all()  # other slots untouched
    for old, new in zip(before[n:], cache.slot_major):
        assert (new[1, :, :7] == old[3, :, :7]).all() and (new[[0, 2, 3]] == old[[0, 2, 3]]).all()
    assert (cache.written_end[1], cache.stale_lo[1], cache.stale_hi[1]) == (9, 6, 9)
    assert (cache.written_end[3], cache.stale_lo[3], cache.stale_hi[3]) == (0, 16, 0)  # free: nothing stale
    plain = KVCache(1, 8, 3, 1, 2)
    plain.keys[0][:, 2] = 5.0
    plain.move(2, 0, 4)
    assert (plain.keys[0][:4, 0] == 5.0).all() and (plain.keys[0][4:, 0] == 0.0).all()


def _generate(rt, temperature: float, spec: str):
    from dspark_trt.runtime import GenerationConfig

    configs = [GenerationConfig(max_new_tokens=n, spec=spec, temperature=temperature, seed=3, stop_at_eos=False)
               for n in LENGTHS]
    return [r.token_ids for r in rt.generate(PROMPTS, configs)]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_requests_moved_between_slots_generate_exactly_what_they_would_have_in_place(tiny_artifact, temperature):
    from dspark_trt.runtime import Runtime

    with Runtime.load(tiny_artifact, profile="none") as rt:
        assert rt.admission.move_slot is not None  # the ORT backend's decoding graph: slots' order costs
        mover = rt.admission.move_slot
        # (a sampled adaptive request's draws follow its verify lengths, which follow timings: not comparable)
        for spec in ("off", "fixed:2", "adaptive") if temperature == 0 else ("off", "fixed:2"):
            rt.admission.move_slot, before = mover, rt.admission.moves
            moved = _generate(rt, temperature, spec)
            assert rt.admission.moves > before
            rt.admission.move_slot = None
            assert _generate(rt, temperature, spec) == moved, spec
            assert [len(t) for t in moved] == LENGTHS


def test_without_the_decoding_graph_requests_keep_their_slots(tiny_artifact, monkeypatch):
    from dspark_trt.runtime import Runtime

    monkeypatch.setenv("DSPARK_ORT_DECODE", "0")
    with Runtime.load(tiny_artifact, profile="none") as rt:
        assert rt.admission.move_slot is None


def test_a_dspark_drafters_context_and_pending_rows_move_with_its_request(tmp_path_factory):
    from dspark_trt.runtime import Runtime
    from tests.dspark_fixtures import ARTIFACT_VARIANTS, cached_artifact

    art = cached_artifact(tmp_path_factory, "full", **ARTIFACT_VARIANTS["full"])
    assert json.loads((art / "manifest.json").read_text())["draft"]["kind"] == "dspark"
    with Runtime.load(art, profile="none") as rt:
        mover = rt.admission.move_slot
        assert mover is not None
        for spec in ("fixed:2", "adaptive"):
            rt.admission.move_slot, before = mover, rt.admission.moves
            moved = _generate(rt, 0.0, spec)
            assert rt.admission.moves > before
            rt.admission.move_slot = None
            assert _generate(rt, 0.0, spec) == moved, spec
