"""Where a DSpark drafter's graphs run: ONNX Runtime sessions or the trt backend's engines.

`DsparkDrafting` (runtime/dspark_drafting.py) takes one of these runners and calls
``run(graph, feeds, past) -> [outputs in graph order]`` for ``dspark_context`` (the context-KV precompute),
``draft`` (the greedy block pass) and ``draft_sample`` (the MarkovSample flavour). Both runners take host
numpy feeds and return host numpy outputs; ``past`` is the drafter's context cache as `past(length)` views
of its KV cache (host numpy for ORT; device tensors bound with no copy for TensorRT).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from dspark_trt.errors import DsparkError
from dspark_trt.manifest import kv_names
from dspark_trt.manifest_schema import DSPARK_CONTEXT_GRAPH, DSPARK_SAMPLE_GRAPH

BLOCK_GRAPH = "draft"


def no_graph(graph: str, where) -> str:
    """The one line for a DSpark graph the artifact does not have."""
    if graph == DSPARK_SAMPLE_GRAPH:
        return (f"{where} has no DSpark sampling graph ({graph}), which requests with temperature > 0 draft with: "
                f"re-export the artifact with `dspark-trt export`, or run those requests with spec off")
    return f"{where} has no DSpark {graph} graph: re-export the artifact with `dspark-trt export`"


class OrtDsparkGraphs:
    """The graphs on ONNX Runtime sessions (what every backend but trt drafts with)."""

    max_context_rows = None  # one context call takes any number of tokens

    def __init__(self, paths: dict, threads: int | None = None, where=None, spin: bool = False):
        from dspark_trt.runtime.backends.ort import open_session, session_options

        # The backend's options (spin: its decision, backends/ort.py): spinning pools that did not stop at
        # the end of a run kept the cores busy between these calls and the target's ran 2-3x slower.
        opts = session_options(threads, spin)
        self.sessions = {g: open_session(Path(p), opts) for g, p in paths.items() if p is not None}
        self.where = where if where is not None else Path(paths[BLOCK_GRAPH]).parent
        self.calls = Counter()

    @classmethod
    def from_manifest(cls, artifact_dir, manifest, threads: int | None = None, spin: bool = False) -> "OrtDsparkGraphs":
        """The graphs' ORT flavour where the artifact has one (the block pass fused; DSPARK_ORT_GRAPHS)."""
        from dspark_trt.runtime.backends.ort import graph_file, graph_flavour

        flavour = graph_flavour()
        return cls({g: Path(artifact_dir) / graph_file(manifest, g, flavour)
                    for g in (DSPARK_CONTEXT_GRAPH, BLOCK_GRAPH, DSPARK_SAMPLE_GRAPH) if g in manifest["graphs"]},
                   threads, where=artifact_dir, spin=spin)

    def has(self, graph: str) -> bool:
        return graph in self.sessions

    def missing(self, graph: str) -> str:
        return no_graph(graph, self.where)

    def geometry(self) -> tuple:
        """(layers, slots, kv heads, head dim) of the context cache the block pass reads."""
        past = [i for i in self.sessions[BLOCK_GRAPH].get_inputs() if i.name.startswith("past_key_values.")]
        return (len(past) // 2, *past[0].shape[1:])

    def run(self, graph: str, feeds: dict, past=()) -> list[np.ndarray]:
        self.calls[graph] += 1
        if past:
            feeds = dict(feeds, **dict(zip(kv_names(len(past) // 2, "past"), past)))
        return self.sessions[graph].run(None, feeds)


class TrtDsparkGraphs:
    """The graphs on the trt backend's engines (backends/trt.py GraphRunner). The block pass binds the
    drafter's device context cache (DeviceKVCache views) with no copy; everything else goes through host
    numpy: anchors, lengths and draws in, draft tokens, survivals and the context K/V of the verified
    tokens out (small: [R, N] per draft, [T, KVH, D] per layer per context call), which the drafter then
    writes into its device cache."""

    def __init__(self, backend):
        self.backend, self.where = backend, backend.artifact_dir
        context = backend.runners.get(DSPARK_CONTEXT_GRAPH)
        rng = context.profile.get("aux_hidden") if context is not None else None
        # the engine's profile bounds the tokens of one context call: larger ones are split
        self.max_context_rows = int(rng[2][0]) if rng else None

    def has(self, graph: str) -> bool:
        return graph in self.backend.runners

    def missing(self, graph: str) -> str:
        if graph in (self.backend.manifest.get("graphs") or {}):
            return (f"no TensorRT engine for the DSpark {graph} graph"
                    + (", which requests with temperature > 0 draft with" if graph == DSPARK_SAMPLE_GRAPH else "")
                    + f": rebuild with `dspark-trt build {self.where}`")
        return no_graph(graph, self.where)

    def geometry(self) -> tuple:
        past = self.backend.runners[BLOCK_GRAPH].io.past
        return (len(past) // 2, *past[0].shape[1:])

    def run(self, graph: str, feeds: dict, past=()) -> list[np.ndarray]:
        if graph not in self.backend.runners:
            raise DsparkError(self.missing(graph))
        named, _ = self.backend.run_graph(graph, feeds, list(past))
        return [named[s.name] for s in self.backend.runners[graph].io.outputs]
