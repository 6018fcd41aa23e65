"""ONNX Runtime backend (CPU by default; CUDA when onnxruntime-gpu is installed)."""

from __future__ import annotations

import copy
import os
from collections import Counter
from pathlib import Path

import numpy as np

from dspark_trt.errors import DsparkError
from dspark_trt.manifest_schema import GREEDY_DRAFT_GRAPH, OPTIONAL_GRAPHS

GREEDY_TARGET = "target_greedy"  # the target's all-greedy twin, derived at load (backends/ort_greedy.py)
MODEL_OF = {"target": "target", GREEDY_TARGET: "target", "draft": "draft", GREEDY_DRAFT_GRAPH: "draft"}  # whose cache


def _providers(ort) -> list[str]:
    wanted = os.environ.get("DSPARK_ORT_PROVIDERS")
    if wanted:
        return wanted.split(",")
    available = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


def graph_flavour() -> str:
    """DSPARK_ORT_GRAPHS: "auto" (default: the artifact's ORT flavour where it has one) or "standard"
    (the graphs TensorRT builds from; for comparisons)."""
    flavour = os.environ.get("DSPARK_ORT_GRAPHS", "auto")
    if flavour not in ("auto", "standard"):
        raise DsparkError(f"DSPARK_ORT_GRAPHS={flavour!r}: use auto or standard")
    return flavour


def graph_file(manifest: dict, graph: str, flavour: str = "auto") -> str:
    """The file ORT runs for `graph`: its ORT flavour (graphs.<graph>.ort, exporter/ort_flavour.py) when the
    artifact has one, else the standard graph (artifacts exported before the flavour existed, or with
    --ort-flavour none)."""
    spec = manifest["graphs"][graph]
    ort_spec = spec.get("ort") if flavour == "auto" else None
    return ort_spec["file"] if isinstance(ort_spec, dict) else spec["file"]


def open_session(path: Path, opts):
    import onnxruntime as ort

    if not path.is_file():
        raise DsparkError(f"{path} is missing: re-export the artifact with `dspark-trt export`")
    try:
        return ort.InferenceSession(str(path), opts, providers=_providers(ort))
    except Exception as e:  # ORT raises its own exception types
        raise DsparkError(f"ONNX Runtime cannot load {path}: {str(e).splitlines()[0]}") from None


def _twin_session(twin: bytes, path: Path, opts):
    """A session over the all-greedy twin (backends/ort_greedy.py) derived from the graph at `path`."""
    import onnxruntime as ort

    try:
        return ort.InferenceSession(twin, opts, providers=_providers(ort))
    except Exception as e:  # ORT raises its own exception types
        raise DsparkError(f"ONNX Runtime cannot load the all-greedy twin of {path}: "
                          f"{str(e).splitlines()[0]}") from None


# Busy share of all cores under which the machine counts as idle at load (DSPARK_ORT_SPIN=auto): `yes`
# beside the server on 2 cores reads ~0.5, an idle VM 0.01-0.05.
SPIN_IDLE_BELOW = 0.2


def spin_decision(probe=None) -> tuple[bool, str]:
    """Whether ONNX Runtime's threads spin within a run, and why (DSPARK_ORT_SPIN: auto (default), 1, 0).

    Threads that sleep between parallel sections wake late: on an idle 2-core VM spinning within a run
    (and stopping at its end, force_spinning_stop) gave 1.29x plain decoding at 1 request, 1.13-1.16x
    speculation, 1.07-1.13x at 16 requests; with a CPU-heavy job on the same cores it lost 5-23% (lab
    notes, 2026-12-03). So auto spins when the cores were idle at load (cpu_load.busy_fraction below
    SPIN_IDLE_BELOW). The decision holds for the sessions' life: a job that starts later meets a
    spinning server (DSPARK_ORT_SPIN=0 on machines shared that way)."""
    mode = os.environ.get("DSPARK_ORT_SPIN", "auto").strip().lower()
    if mode in ("0", "1"):
        return mode == "1", f"DSPARK_ORT_SPIN={mode}"
    if mode != "auto":
        raise DsparkError(f"DSPARK_ORT_SPIN={mode!r}: use auto (spin when the cores are idle at load), 1 or 0")
    if probe is None:
        from dspark_trt.runtime.backends.cpu_load import busy_fraction as probe
    busy = probe()
    if busy is None:
        return False, "auto: the machine's load is unknown here"
    return busy < SPIN_IDLE_BELOW, f"auto: cores {busy:.0%} busy at load"


def session_options(threads: int | None = None, spin: bool = False):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = threads
    # Two sessions (draft, target) run alternately, each with its own intra-op pool: threads that spin
    # stop at the end of each run (force_spinning_stop), so one pool never spins while the other runs.
    value = "1" if spin else "0"
    opts.add_session_config_entry("session.intra_op.allow_spinning", value)
    opts.add_session_config_entry("session.inter_op.allow_spinning", value)
    if spin:
        opts.add_session_config_entry("session.force_spinning_stop", "1")
    return opts


class OrtBackend:
    name = "ort"

    def __init__(self, artifact_dir, manifest: dict, threads: int | None = None):
        if manifest["model"].get("dtype") == "bf16":
            raise DsparkError("ONNX Runtime has no bfloat16 kernels for these graphs (MatMul) and no numpy "
                              "bfloat16 inputs: run a bf16 artifact with --backend trt (or torch), or export "
                              "with --dtype fp16 / fp32 for ort")
        self.spinning, self.spin_reason = spin_decision()
        opts = session_options(threads, self.spinning)
        self.sessions = {}
        self.outputs = {}
        # A DSpark drafter's graphs run in its own drafter phase (runtime/dspark_drafting.py).
        if manifest["draft"].get("kind") == "dspark":
            graphs = ["target"]
        else:
            graphs = ["draft", "target"] + [g for g in OPTIONAL_GRAPHS if g in manifest["graphs"]]
        self.files = {}
        flavour = graph_flavour()
        for graph in graphs:
            self.files[graph] = graph_file(manifest, graph, flavour)
            sess = open_session(Path(artifact_dir) / self.files[graph], opts)
            self.sessions[graph] = sess
            self.outputs[graph] = [o.name for o in sess.get_outputs()]
        self.num_layers = {g: manifest["model" if g == "target" else "draft"]["num_layers"] for g in graphs}
        self.has_greedy_draft = GREEDY_DRAFT_GRAPH in self.sessions
        target_ort = manifest["graphs"]["target"].get("ort") if flavour == "auto" else None
        self._twins = target_ort if isinstance(target_ort, dict) else {}  # the exported twins' files, if any
        self._open_greedy_target(Path(artifact_dir), opts)
        self._open_decode(Path(artifact_dir), manifest, flavour, opts)
        self.calls = Counter()  # runs per graph (which graph ran is a fact tests and metrics can read)
        # The graph the last call ran on (the first calls after a switch of graphs are slower: tuning.settle_calls).
        self.last_graph = None

    def _twin(self, artifact_dir: Path, path: Path, key: str, opts):
        """A session over the all-greedy twin of the target graph at `path`: the artifact's file named by
        graphs.target.ort[key], else derived here (artifacts exported before twins were written); None where
        there is none."""
        from dspark_trt.runtime.backends import ort_greedy

        if not ort_greedy.wanted():
            return None
        if self._twins.get(key):
            return open_session(artifact_dir / self._twins[key], opts)
        if Path(f"{path}.data").exists():
            return None
        twin = ort_greedy.greedy_twin_bytes(path)
        return None if twin is None else _twin_session(twin, path, opts)

    def _open_greedy_target(self, artifact_dir: Path, opts) -> None:
        """The target's all-greedy twin (backends/ort_greedy.py), for targets whose weights are inline."""
        self.greedy_inputs = None
        sess = self._twin(artifact_dir, artifact_dir / self.files["target"], "greedy", opts)
        if sess is None:
            return
        self.sessions[GREEDY_TARGET] = sess
        self.outputs[GREEDY_TARGET] = [o.name for o in sess.get_outputs()]
        self.num_layers[GREEDY_TARGET] = self.num_layers["target"]
        self.greedy_inputs = {i.name for i in sess.get_inputs()}

    def _open_decode(self, artifact_dir: Path, manifest: dict, flavour: str, opts) -> None:
        """The decoding graphs over slot-major caches (backends/ort_decode.py) of the graphs that have one in
        the artifact, the target's all-greedy twin beside its own. A model's decode paths start once
        the runtime asks for its cache (target_kv_cache, draft_kv_cache)."""
        from dspark_trt.runtime.backends import ort_decode

        self.decode = {}  # graph -> DecodePath
        self._decode_sessions = {}
        if not ort_decode.wanted():
            return
        for graph in [g for g in self.sessions if g in MODEL_OF and g != GREEDY_TARGET]:
            ort_spec = manifest["graphs"][graph].get("ort") if flavour == "auto" else None
            file = ort_spec.get("decode") if isinstance(ort_spec, dict) else None
            if file is None:
                continue
            path = artifact_dir / file
            self._decode_sessions[graph] = open_session(path, opts)
            if graph == "target" and self.greedy_inputs is not None:
                twin = self._twin(artifact_dir, path, "decode_greedy", opts)
                if twin is not None:
                    self._decode_sessions[GREEDY_TARGET] = twin

    def kv_copies(self, max_context: int) -> dict[str, int]:
        """How many copies of each model's cache its *_kv_cache() keeps at this context (the memory plan
        counts them): two where it has a decoding graph (whose caches' position axis is the runtime's
        context)."""
        out = {}
        for model in ("target", "draft"):
            sess = self._decode_sessions.get(model)
            if sess is None:
                out[model] = 1
                continue
            axis = {i.name: i.shape for i in sess.get_inputs()}["past_key_values.0.key"][2]
            out[model] = 2 if not isinstance(axis, int) or axis == max_context else 1
        return out

    def release_caches(self) -> None:
        """Unbind the decoding paths from the runtime's caches (it closed): their bindings hold the cache
        buffers."""
        self.decode = {}

    def drop_kv_copies(self) -> None:
        """No decoding graphs, so each cache is kept once (the memory plan's choice when both do not fit)."""
        self._decode_sessions = {}

    def target_kv_cache(self, num_layers: int, max_context: int, slots: int, kv_heads: int, head_dim: int,
                        dtype=np.float32):
        """The target's host cache, mirrored slot-major for its decoding graph where it runs (kv_copies)."""
        return self._kv_cache("target", num_layers, max_context, slots, kv_heads, head_dim, dtype)

    def draft_kv_cache(self, num_layers: int, max_context: int, slots: int, kv_heads: int, head_dim: int,
                       dtype=np.float32):
        """The draft's host cache, mirrored slot-major for its decoding graphs where they run (kv_copies)."""
        return self._kv_cache("draft", num_layers, max_context, slots, kv_heads, head_dim, dtype)

    def for_another_runtime(self) -> "OrtBackend":
        """This backend's sessions for one more runtime: its decoding paths bind the caches of the runtime
        that asked for them, so a second runtime on the same backend would decode on the first one's."""
        other = copy.copy(self)
        other.decode, other._decode_sessions = {}, dict(self._decode_sessions)
        other.calls, other.last_graph = Counter(), None
        return other

    def _kv_cache(self, model: str, num_layers, max_context, slots, kv_heads, head_dim, dtype):
        from dspark_trt.runtime.backends.ort_decode import DecodePath, MirroredKVCache
        from dspark_trt.runtime.kv_cache import KVCache

        graphs = [g for g in self._decode_sessions if MODEL_OF[g] == model]
        if any(g in self.decode for g in graphs):
            raise DsparkError(f"this ONNX Runtime backend already decodes on another runtime's {model} cache: "
                              "give each runtime a backend of its own (backend.for_another_runtime())")
        if self.kv_copies(max_context)[model] == 1:
            for g in graphs:
                del self._decode_sessions[g]
            return KVCache(num_layers, max_context, slots, kv_heads, head_dim, dtype)
        cache = MirroredKVCache(num_layers, max_context, slots, kv_heads, head_dim, dtype)
        for g in graphs:  # the draft's: one request's calls only (ort_decode.py)
            self.decode[g] = DecodePath(self._decode_sessions[g], cache, num_layers, 1 if model == "draft" else None)
        return cache

    def _run(self, graph: str, feeds: dict, past: list[np.ndarray]):
        self.calls[graph] += 1
        n = self.num_layers[graph]
        names = [f"past_key_values.{i}.{kv}" for i in range(n) for kv in ("key", "value")]
        feeds = dict(feeds, **dict(zip(names, past)))
        if graph == GREEDY_TARGET:
            feeds = {k: v for k, v in feeds.items() if k in self.greedy_inputs}
        outs = self.sessions[graph].run(None, feeds)
        named = dict(zip(self.outputs[graph], outs))
        present = [named.pop(f"present.{i}.{kv}") for i in range(n) for kv in ("key", "value")]
        return named, present

    def _run_or_decode(self, graph: str, feeds: dict, past, path=None):
        """The call on the graph's decoding graph where that takes it (ort_decode.DecodePath.takes), else
        on the graph itself."""
        path = path or self.decode.get(graph)
        if path is not None and path.takes(feeds):
            self.calls[f"{graph}.decode"] += 1
            self.last_graph = f"{graph}.decode"
            return path.run(feeds)
        self.last_graph = graph
        if path is not None:  # the packed graph reads the host cache: decode calls' entries go there first
            path.cache.sync_host(np.asarray(feeds["slot_ids"], dtype=np.int64),
                                 np.asarray(feeds["past_lens"], dtype=np.int64))
        return self._run(graph, feeds, past)

    def run_draft(self, feeds, past):
        return self._run_or_decode("draft", feeds, past)

    def run_draft_greedy(self, feeds, past):
        """The draft step on the all-greedy graph (needs has_greedy_draft): no temperature/uniforms in,
        no draft_probs out."""
        return self._run_or_decode(GREEDY_DRAFT_GRAPH, feeds, past)

    def run_target(self, feeds, past):
        """The verify/prefill step; calls with no sampling row run the all-greedy twin where there is one."""
        greedy = self.greedy_inputs is not None and not (np.asarray(feeds["temperature"]) > 0).any()
        graph = GREEDY_TARGET if greedy else "target"
        return self._run_or_decode(graph, feeds, past, self.decode.get(graph) or self.decode.get("target"))
