"""Drafting with a DSpark drafter on ONNX Runtime: the draft's context cache kept in step with the target.

The two exported graphs (exporter/dspark_export.py) are run here with numpy only (no torch):

* after every target pass, `observe(slot, aux, start)` runs the context-KV graph on the target's
  auxiliary hidden states of the tokens that are now verified context (the anchor and the accepted
  drafts, at positions start, start + 1, ...) and writes the K/V into the slot's rows; the slot's
  context length becomes start + len(aux). Rejected drafts never enter the cache, and `rollback`
  only lowers the length (rows past it are masked in the draft graph and overwritten later);
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


class DsparkDraft(NamedTuple):
    tokens: np.ndarray  # [R, N] int64, target vocabulary
    confidence_logits: np.ndarray  # [R, N] float32 (all 0 for a head-less drafter)
    survival: np.ndarray  # [R, N] float32: running product of the calibrated confidences
    probs: np.ndarray | None = None  # [R, N, V_target] q of each draft (sampling flavour only)


class DsparkDrafting:
    def __init__(self, context_path: str | Path, draft_path: str | Path, *, num_slots: int, max_context: int,
                 sample_path: str | Path | None = None, threads: int | None = None):
        from dspark_trt.runtime.backends.ort import open_session, session_options

        # The backend's options: with spinning intra-op pools these three sessions kept the cores busy
        # between their calls and the target's verify ran 2-3x slower (measured on 2 cores).
        opts = session_options(threads)
        self.context = open_session(Path(context_path), opts)
        self.draft_graph = open_session(Path(draft_path), opts)
        self.sample_graph = open_session(Path(sample_path), opts) if sample_path is not None else None
        past = [i for i in self.draft_graph.get_inputs() if i.name.startswith("past_key_values.")]
        self.num_layers = len(past) // 2
        _, slots, kv_heads, head_dim = past[0].shape
        if isinstance(slots, int) and slots != num_slots:
            raise DsparkError(f"{draft_path} was exported for {slots} cache slots, not {num_slots}")
        self.num_slots, self.max_context = num_slots, max_context
        shape = (max_context, num_slots, kv_heads, head_dim)
        self.keys = [np.zeros(shape, np.float32) for _ in range(self.num_layers)]
        self.values = [np.zeros(shape, np.float32) for _ in range(self.num_layers)]
        self.context_len = np.zeros(num_slots, np.int64)

    @classmethod
    def from_artifact(cls, artifact_dir: str | Path, threads: int | None = None) -> "DsparkDrafting":
        """From an artifact written by exporter/dspark_artifact.py (manifest draft.kind == "dspark")."""
        from dspark_trt.manifest import load_manifest

        m = load_manifest(artifact_dir)
        if m.drafter_kind != "dspark":
            raise DsparkError(f"{artifact_dir} holds a {m.drafter_kind} drafter, not a DSpark one")
        from dspark_trt.runtime.backends.ort import graph_file, graph_flavour

        d, flavour = Path(artifact_dir), graph_flavour()  # the block pass's ORT flavour where there is one
        sample = d / graph_file(m, "draft_sample", flavour) if "draft_sample" in m.graphs else None
        return cls(d / m.graphs["dspark_context"]["file"], d / graph_file(m, "draft", flavour),
                   num_slots=m.limits["max_batch"], max_context=m.limits["max_context"],
                   sample_path=sample, threads=threads)

    def observe(self, slot: int, aux: np.ndarray, start: int) -> None:
        """Verified context: aux [T, F] hidden states of the target at positions start .. start + T - 1."""
        t = aux.shape[0]
        if start > self.context_len[slot]:
            raise DsparkError(f"slot {slot}: context rows {self.context_len[slot]}..{start - 1} were never observed")
        if start + t > self.max_context:
            raise DsparkError(f"slot {slot}: context of {start + t} tokens exceeds max_context {self.max_context}")
        if t:
            kv = self.context.run(None, {"aux_hidden": np.ascontiguousarray(aux, np.float32),
                                         "positions": np.arange(start, start + t, dtype=np.int64)})
            for i in range(self.num_layers):
                self.keys[i][start:start + t, slot] = kv[2 * i]
                self.values[i][start:start + t, slot] = kv[2 * i + 1]
        self.context_len[slot] = start + t

    def observe_many(self, items) -> None:
        """observe() for several slots in one context-graph call: items are (slot, aux [T, F], start)."""
        items = [(s, a, st) for s, a, st in items if a.shape[0]]
        if not items:
            return
        for slot, aux, start in items:
            if start > self.context_len[slot]:
                raise DsparkError(f"slot {slot}: context rows {self.context_len[slot]}..{start - 1} were never observed")
            if start + aux.shape[0] > self.max_context:
                raise DsparkError(f"slot {slot}: context of {start + aux.shape[0]} tokens exceeds max_context "
                                  f"{self.max_context}")
        aux = np.concatenate([a for _, a, _ in items]).astype(np.float32, copy=False)
        positions = np.concatenate([np.arange(st, st + a.shape[0], dtype=np.int64) for _, a, st in items])
        kv = self.context.run(None, {"aux_hidden": np.ascontiguousarray(aux), "positions": positions})
        row = 0
        for slot, a, start in items:
            t = a.shape[0]
            for i in range(self.num_layers):
                self.keys[i][start:start + t, slot] = kv[2 * i][row:row + t]
                self.values[i][start:start + t, slot] = kv[2 * i + 1][row:row + t]
            self.context_len[slot] = start + t
            row += t

    def rollback(self, slot: int, length: int) -> None:
        """Forget the context past `length` (a request restarted or truncated)."""
        self.context_len[slot] = min(int(self.context_len[slot]), int(length))

    def release(self, slot: int) -> None:
        self.context_len[slot] = 0

    def draft(self, slots, anchors, temperature=None, uniforms=None) -> DsparkDraft:
        """One block pass for the given slots; anchors [R] are the tokens at position context_len[slot].

        With temperature [R] (and uniforms [R, N] in [0, 1)) and some T > 0, the sampling graph draws the
        drafts and returns q (`probs`) for SampleAccept; otherwise the greedy graph runs (no [R, N, V])."""
        slots = np.asarray(slots, np.int64)
        past_lens = self.context_len[slots]
        if (past_lens < 1).any():
            raise DsparkError("a DSpark drafter needs at least one observed context token per request")
        p = int(past_lens.max())
        feeds = {"anchor": np.asarray(anchors, np.int64), "past_lens": past_lens, "slot_ids": slots}
        for i in range(self.num_layers):
            feeds[f"past_key_values.{i}.key"] = self.keys[i][:p]
            feeds[f"past_key_values.{i}.value"] = self.values[i][:p]
        if temperature is not None and (np.asarray(temperature) > 0).any():
            if self.sample_graph is None:
                raise DsparkError("sampled requests need the DSpark sampling graph (export with sample=True)")
            feeds["temperature"] = np.asarray(temperature, np.float32)
            feeds["uniforms"] = np.asarray(uniforms, np.float32)
            return DsparkDraft(*self.sample_graph.run(None, feeds))
        tokens, conf, surv = self.draft_graph.run(None, feeds)
        return DsparkDraft(tokens, conf, surv)
