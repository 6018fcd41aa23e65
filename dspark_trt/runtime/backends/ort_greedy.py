"""The target graph's all-greedy twin for ONNX Runtime: the same graph without SampleAccept.

The target graph runs both acceptance ops on every verified row and picks per row (temperature <= 0:
GreedyAccept), so a step whose rows are all greedy still pays SampleAccept's [rows, V] work (softmaxes and
CDFs over the vocabulary) on a block of zeros. Wrapping the two in an `If` made sampled steps slower on ORT
(lab notes, issue 20), so the ORT backend instead runs a twin whose `accepted`/`next_token`
come from GreedyAccept alone (the per-row selection, SampleAccept and every input only they read dropped)
for calls with no sampling row. The exporter writes it beside the target's ORT graphs (hashed,
named in the manifest: exporter/greedy_twin.py); for artifacts from before that, the backend
derives it at load from the hashed graph the manifest names (when the onnx package is there). TensorRT
engines keep the one graph.

The twin holds its own copy of the weights, so it is made only for graphs whose weights are inline (under
the exporter's 1 GiB external-data threshold); `DSPARK_ORT_GREEDY_TARGET=0` turns it off (comparisons).
"""

from __future__ import annotations

import os

__all__ = ["greedy_twin_bytes", "wanted"]

_CACHE: dict[tuple, bytes | None] = {}  # serialized twins by (path, size, mtime): one derivation per process
_CACHE_MAX_BYTES = 64 << 20


def wanted() -> bool:
    return os.environ.get("DSPARK_ORT_GREEDY_TARGET", "1") != "0"


def greedy_twin_bytes(path) -> bytes | None:
    """The serialized twin of the target graph at `path` (None: the graph has no twin). A small graph's is
    kept and reused while the file is unchanged (tests and benches load the same artifact many times).
    None too without the onnx package (a runtime-only install): artifacts exported since the twins are
    written beside their graphs (exporter/greedy_twin.py) never come here."""
    try:
        import onnx
    except ImportError:
        return None

    st = os.stat(path)
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key in _CACHE:
        return _CACHE[key]
    from dspark_trt.exporter.greedy_twin import greedy_twin

    twin = greedy_twin(onnx.load(str(path)))
    data = None if twin is None else twin.SerializeToString()
    if st.st_size <= _CACHE_MAX_BYTES:  # a large target's copy is not kept once its session holds it
        _CACHE.clear()
        _CACHE[key] = data
    return data
