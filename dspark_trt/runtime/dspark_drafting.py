"""Drafting with a DSpark drafter: the draft's context cache kept in step with the target.

The exported graphs (exporter/dspark_export.py) run on a graph runner (runtime/dspark_graphs.py: ONNX
Runtime sessions, or the trt backend's engines) with numpy feeds and outputs (no torch here):

* after every target pass, `observe(slot, aux, start)` runs the context-KV graph on the target's
  auxiliary hidden states of the tokens that are now verified context (the anchor and the accepted
  drafts, at positions start, start + 1, ...) and writes the K/V into the slot's rows of the context
  cache; the slot's context length becomes start + len(aux). Rejected drafts never enter the cache, and
  `rollback` only lowers the length (rows past it are masked in the draft graph and overwritten later);
* `draft(slots, anchors)` runs one parallel block pass for all requests: the anchor sits at position
  context length, and the graph returns N greedy draft tokens (target ids), confidence logits and the
  calibrated survivals, [R, N] each.

The runtime's drafter phase for this drafter (runtime/phases/dspark_drafter.py) drives it: one
`observe_many` per step for the tokens verification made context, one `draft` for all drafting rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

from dspark_trt.errors import DsparkError
from dspark_trt.manifest_schema import DSPARK_CONTEXT_GRAPH, DSPARK_SAMPLE_GRAPH
from dspark_trt.runtime.kv_cache import KVCache


class DsparkDraft(NamedTuple):
    tokens: np.ndarray  # [R, N] int64, target vocabulary
    confidence_logits: np.ndarray  # [R, N] float32 (head-less drafter: logit of the drafted token's probability)
    survival: np.ndarray  # [R, N] float32: running product of the calibrated confidences
    probs: np.ndarray | None = None  # [R, N, V_target] q of each draft (sampling flavour only)


class DsparkDrafting:
    """graphs: where the graphs run (runtime/dspark_graphs.py: ORT sessions or TensorRT engines);
    make_cache(layers, max_context, slots, kv_heads, head_dim, dtype): the context cache (the runtime's
    host KVCache, or the trt backend's device cache, which the block pass engine then reads in place);
    dtype: the artifact's (manifest model.dtype), the context cache's and the aux rows'."""

    def __init__(self, graphs, *, num_slots: int, max_context: int, make_cache=KVCache, dtype=np.float32):
        self.graphs = graphs
        self.num_layers, slots, kv_heads, head_dim = graphs.geometry()
        if isinstance(slots, int) and slots != num_slots:
            raise DsparkError(f"the DSpark draft graph in {graphs.where} was exported for {slots} cache slots, "
                              f"not {num_slots}")
        self.num_slots, self.max_context = num_slots, max_context
        self.dtype = np.dtype(dtype)
        self.cache = make_cache(self.num_layers, max_context, num_slots, kv_heads, head_dim, self.dtype)
        self.context_len = np.zeros(num_slots, np.int64)

    @classmethod
    def from_files(cls, context_path: str | Path, draft_path: str | Path, *, num_slots: int, max_context: int,
                   sample_path: str | Path | None = None, threads: int | None = None) -> "DsparkDrafting":
        """The graphs on ONNX Runtime, the context cache in host memory."""
        from dspark_trt.runtime.dspark_graphs import OrtDsparkGraphs

        graphs = OrtDsparkGraphs({DSPARK_CONTEXT_GRAPH: context_path, "draft": draft_path,
                                  DSPARK_SAMPLE_GRAPH: sample_path}, threads)
        return cls(graphs, num_slots=num_slots, max_context=max_context)

    @classmethod
    def from_artifact(cls, artifact_dir: str | Path, threads: int | None = None) -> "DsparkDrafting":
        """From an artifact written by exporter/dspark_artifact.py (manifest draft.kind == "dspark"), on ORT."""
        from dspark_trt.manifest import load_manifest
        from dspark_trt.runtime.dspark_graphs import OrtDsparkGraphs

        m = load_manifest(artifact_dir)
        if m.drafter_kind != "dspark":
            raise DsparkError(f"{artifact_dir} holds a {m.drafter_kind} drafter, not a DSpark one")
        from dspark_trt.runtime.kv_cache import kv_numpy_dtype

        return cls(OrtDsparkGraphs.from_manifest(artifact_dir, m, threads), num_slots=m.limits["max_batch"],
                   max_context=m.limits["max_context"], dtype=kv_numpy_dtype(m.model["dtype"]))

    @property
    def can_sample(self) -> bool:
        return self.graphs.has(DSPARK_SAMPLE_GRAPH)

    def _check_room(self, slot: int, start: int, t: int) -> None:
        if start > self.context_len[slot]:
            raise DsparkError(f"slot {slot}: context rows {self.context_len[slot]}..{start - 1} were never observed")
        if start + t > self.max_context:
            raise DsparkError(f"slot {slot}: context of {start + t} tokens exceeds max_context {self.max_context}")

    def observe(self, slot: int, aux: np.ndarray, start: int) -> None:
        """Verified context: aux [T, F] hidden states of the target at positions start .. start + T - 1."""
        self._check_room(slot, start, aux.shape[0])
        self.observe_many([(slot, aux, start)])
        self.context_len[slot] = start + aux.shape[0]

    def observe_many(self, items) -> None:
        """observe() for several slots in one context-graph call: items are (slot, aux [T, F], start). A call
        larger than the graph runner takes (a TensorRT profile's token count) is split into several."""
        items = [(s, a, st) for s, a, st in items if a.shape[0]]
        if not items:
            return
        for slot, aux, start in items:
            self._check_room(slot, start, aux.shape[0])
        aux = np.ascontiguousarray(np.concatenate([a for _, a, _ in items]), self.dtype)
        positions = np.concatenate([np.arange(st, st + a.shape[0], dtype=np.int64) for _, a, st in items])
        slots = np.concatenate([np.full(a.shape[0], s, np.int64) for s, a, _ in items])
        step = self.graphs.max_context_rows or len(aux)
        for lo in range(0, len(aux), step):
            rows = slice(lo, lo + step)
            kv = self.graphs.run(DSPARK_CONTEXT_GRAPH, {"aux_hidden": aux[rows], "positions": positions[rows]})
            self.cache.write(kv, positions[rows], slots[rows])
        for slot, a, start in items:
            self.context_len[slot] = start + a.shape[0]

    def rollback(self, slot: int, length: int) -> None:
        """Forget the context past `length` (a request restarted or truncated)."""
        self.context_len[slot] = min(int(self.context_len[slot]), int(length))

    def release(self, slot: int) -> None:
        self.context_len[slot] = 0

    def move(self, src: int, dst: int) -> None:
        """Slot src's context goes to slot dst (the runtime's slot compaction); src is left empty."""
        self.cache.move(src, dst, int(self.context_len[src]))
        self.context_len[dst] = self.context_len[src]
        self.release(src)

    def draft(self, slots, anchors, temperature=None, uniforms=None) -> DsparkDraft:
        """One block pass for the given slots; anchors [R] are the tokens at position context_len[slot].

        With temperature [R] (and uniforms [R, N] in [0, 1)) and some T > 0, the sampling graph draws the
        drafts and returns q (`probs`) for SampleAccept; otherwise the greedy graph runs (no [R, N, V])."""
        slots = np.asarray(slots, np.int64)
        past_lens = self.context_len[slots]
        if (past_lens < 1).any():
            raise DsparkError("a DSpark drafter needs at least one observed context token per request")
        past = self.cache.past(int(past_lens.max()))
        feeds = {"anchor": np.asarray(anchors, np.int64), "past_lens": past_lens, "slot_ids": slots}
        if temperature is not None and (np.asarray(temperature) > 0).any():
            if not self.can_sample:
                raise DsparkError(self.graphs.missing(DSPARK_SAMPLE_GRAPH))
            feeds["temperature"] = np.asarray(temperature, np.float32)
            feeds["uniforms"] = np.asarray(uniforms, np.float32)
            return DsparkDraft(*self.graphs.run(DSPARK_SAMPLE_GRAPH, feeds, past))
        tokens, conf, surv = self.graphs.run("draft", feeds, past)
        return DsparkDraft(tokens, conf, surv)
