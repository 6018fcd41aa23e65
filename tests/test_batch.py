"""Packing queries into the engines' feeds: one-token queries (every drafting call after the first, every
plain decode step) take a short path that must give exactly the general path's feeds."""

from __future__ import annotations

import numpy as np

from dspark_trt.runtime.batch import pack_queries, token_slots, verify_rows


def test_one_token_queries_pack_as_rows_of_one():
    f = pack_queries([[7], [3], [9]], [4, 0, 11], [2, 0, 5])
    expected = {"tokens": [7, 3, 9], "positions": [4, 0, 11], "pack_index": [[0], [1], [2]], "unpack_index": [0, 1, 2],
                "query_lens": [1, 1, 1], "past_lens": [4, 0, 11], "slot_ids": [2, 0, 5]}
    assert set(f) == set(expected)
    for k, v in expected.items():
        assert f[k].dtype == np.int64 and f[k].tolist() == v, k
    assert token_slots(f).tolist() == [2, 0, 5]
    assert verify_rows(f["query_lens"], np.zeros(3, np.int64)).tolist() == [0, 1, 2]
    f["positions"][0] = 99  # positions and past_lens are separate arrays
    assert f["past_lens"][0] == 4


def test_mixed_query_lengths_pad_to_the_longest():
    f = pack_queries([[1, 2, 3], [4], [5, 6]], [4, 9, 0], [2, 0, 5])
    assert f["tokens"].tolist() == [1, 2, 3, 4, 5, 6]
    assert f["positions"].tolist() == [4, 5, 6, 9, 0, 1]
    assert f["pack_index"].tolist() == [[0, 1, 2], [3, 0, 0], [4, 5, 0]]
    assert f["unpack_index"].tolist() == [0, 1, 2, 3, 6, 7]
    assert f["query_lens"].tolist() == [3, 1, 2] and token_slots(f).tolist() == [2, 2, 2, 0, 5, 5]


def test_one_token_queries_match_the_general_packing():
    # The general path on the same rows, reached by packing a two-token query and dropping it.
    queries, past, slots = [[7], [3], [9], [1]], [4, 0, 11, 2], [2, 0, 5, 1]
    fast = pack_queries(queries, past, slots)
    general = pack_queries(queries + [[1, 1]], past + [0], slots + [3])
    R = len(queries)
    assert fast["tokens"].tolist() == general["tokens"][:R].tolist()
    assert fast["positions"].tolist() == general["positions"][:R].tolist()
    assert fast["pack_index"].tolist() == general["pack_index"][:R, :1].tolist()
    # unpack_index indexes the padded [R, longest] layout: with one token a row, every row's first slot
    assert fast["unpack_index"].tolist() == (general["unpack_index"][:R] // 2).tolist()


def test_few_rows_are_packed_in_plain_python_exactly_as_numpy_packs_them(monkeypatch):
    import dspark_trt.runtime.batch as batch

    rng = np.random.default_rng(0)
    for _ in range(300):
        R = int(rng.integers(1, batch.SMALL_ROWS + 1))
        queries = [rng.integers(0, 500, int(rng.choice([0, 1, 2, 3, 5, 8]))).tolist() for _ in range(R)]
        if all(len(q) == 1 for q in queries) or not any(queries):
            continue
        past, slots = rng.integers(0, 300, R).tolist(), rng.integers(0, 64, R).tolist()
        small = pack_queries(queries, past, slots)
        monkeypatch.setattr(batch, "SMALL_ROWS", 0)
        general = pack_queries(queries, past, slots)
        monkeypatch.undo()
        assert small.keys() == general.keys()
        for k in general:
            assert small[k].dtype == general[k].dtype and small[k].shape == general[k].shape, k
            assert (small[k] == general[k]).all(), k
