"""A DSpark artifact on the eager torch backend: the modules its graphs were exported from
(exporter/dspark_export.py), loaded from the source checkpoints the manifest records.

`load_dspark_modules` gives the target step (with its `aux_hidden` output) and the drafter's three graphs
as modules; `TorchDsparkGraphs` is the drafter phase's graph runner over them (the interface of
runtime/dspark_graphs.py: numpy in, numpy out)."""

from __future__ import annotations

from collections import Counter

from dspark_trt.errors import DsparkError
from dspark_trt.manifest_schema import DSPARK_CONTEXT_GRAPH, DSPARK_SAMPLE_GRAPH

INPUTS = {DSPARK_CONTEXT_GRAPH: ["aux_hidden", "positions"], "draft": ["anchor", "past_lens", "slot_ids"],
          DSPARK_SAMPLE_GRAPH: ["anchor", "past_lens", "slot_ids", "temperature", "uniforms"]}
FLOAT_INPUTS = {"aux_hidden"}  # in the modules' dtype, like the KV entries


def load_dspark_modules(manifest: dict, device):
    """(target step, {graph: module}) in manifest["model"]["dtype"], on device."""
    from dspark_trt.exporter.dspark_export import DsparkContextGraph, DsparkDraftGraph, DsparkTargetStep
    from dspark_trt.models.checkpoint import load_decoder
    from dspark_trt.models.dspark_drafter import load_dspark_drafter

    src, dtype = manifest["sources"], manifest["model"]["dtype"]
    target = load_decoder(src["target"], dtype)
    drafter = load_dspark_drafter(src["draft"], src["target"], dtype)
    step = DsparkTargetStep(target, drafter.cfg.aux_layers).eval().to(device)
    graphs = {DSPARK_CONTEXT_GRAPH: DsparkContextGraph(drafter), "draft": DsparkDraftGraph(drafter),
              DSPARK_SAMPLE_GRAPH: DsparkDraftGraph(drafter, sample=True)}
    return step, {g: m.eval().to(device) for g, m in graphs.items()}


class TorchDsparkGraphs:
    max_context_rows = None  # one context call takes any number of tokens

    def __init__(self, backend, modules: dict, manifest: dict):
        self.backend, self.modules = backend, modules
        self.where = backend.artifact_dir
        d = manifest["draft"]
        self._geometry = (d["num_layers"], manifest["limits"]["max_batch"], d["num_kv_heads"], d["head_dim"])
        self.calls = Counter()

    def has(self, graph: str) -> bool:
        return graph in self.modules

    def missing(self, graph: str) -> str:
        return f"the torch backend has no DSpark {graph} module for {self.where}"

    def geometry(self) -> tuple:
        return self._geometry

    def run(self, graph: str, feeds: dict, past=()) -> list:
        if graph not in self.modules:
            raise DsparkError(self.missing(graph))
        self.calls[graph] += 1
        be = self.backend
        args = [be._to_device(feeds[name], kv=name in FLOAT_INPUTS) for name in INPUTS[graph]]
        args += [be._to_device(p, kv=True) for p in past]
        with be.torch.no_grad():
            outs = self.modules[graph](*args)
        return [be._to_host(o) for o in outs]
