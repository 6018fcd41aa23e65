"""The runtime: continuous batching around a draft engine and a target engine.

``Runtime`` is a facade: load an artifact, submit / generate / stream requests, close; a worker thread
runs :meth:`Runtime.step` while requests are queued or running. A step is a few named phases, each a
small object in ``runtime/phases/`` (admission, depth planner, drafter, verify planner, verifier,
commit, learn); what a step costs is answered by ``runtime/costs/``, and every tuning value lives in
``runtime/tuning.py``. Numpy only: no torch on this path.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from dspark_trt.errors import DsparkError
from dspark_trt.manifest import Manifest, load_manifest
from dspark_trt.runtime.config import GenerationConfig
from dspark_trt.runtime.controller import AdaptiveController
from dspark_trt.runtime.costs.step import Costs
from dspark_trt.runtime.costs.switch import SwitchPrice
from dspark_trt.runtime.kv_cache import KVCache, kv_numpy_dtype
from dspark_trt.runtime.memory_plan import plan_for
from dspark_trt.runtime.metrics import Metrics
from dspark_trt.runtime.phases.admission import Admission, QueueFullError
from dspark_trt.runtime.phases.commit import Committer
from dspark_trt.runtime.phases.depth_planner import DepthPlanner
from dspark_trt.runtime.phases.drafter import Drafter
from dspark_trt.runtime.phases.learn import Learner
from dspark_trt.runtime.phases.verifier import Verifier
from dspark_trt.runtime.phases.verify_planner import VerifyPlanner
from dspark_trt.runtime.request import Request
from dspark_trt.runtime.survival_correction import SurvivalCorrection
from dspark_trt.runtime.tuning import RuntimeTuning

#: Seconds after the caches' mapping started that costs are learned again even if it has not finished: the
#: mapping thread runs at the lowest priority, and beside a CPU-heavy job it can take minutes, for which
#: the runtime would otherwise learn nothing (quiet, the tiny pair's takes ~9 s on these VMs).
MAPPING_GRACE_S = 15.0


__all__ = ["GenerationResult", "QueueFullError", "Runtime", "load_manifest"]


@dataclass
class GenerationResult:
    prompt: str | list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict
    error: str | None = None

    def to_dict(self) -> dict:
        d = {"prompt": self.prompt, "text": self.text, "token_ids": self.token_ids,
             "finish_reason": self.finish_reason, "stats": self.stats}
        if self.error:
            d["error"] = self.error
        return d


class Runtime:
    def __init__(self, artifact_dir, manifest: Manifest, backend, tokenizer, max_batch: int | None = None,
                 cost_table=None, max_queue: int | None = None, recalibrate: bool = True,
                 tuning: RuntimeTuning | None = None, max_context: int | None = None):
        t = (tuning or RuntimeTuning()).validate()
        if not recalibrate:
            t = dataclasses.replace(t, correction=dataclasses.replace(t.correction, enabled=False))
        self.tuning = t
        self.artifact_dir = Path(artifact_dir)
        self.manifest = manifest
        self.backend = backend
        self.profile_name = getattr(backend, "name", None)  # its cost profile's name; load() refines it
        self.tokenizer = tokenizer
        lim = manifest["limits"]
        self.slots_total = int(lim["max_batch"])
        kv_dtype = kv_numpy_dtype(manifest["model"]["dtype"])
        # max_batch / max_context may only lower the exported limits; both are fitted to memory first.
        self.memory_plan = plan_for(manifest, artifact_dir, backend, max_batch, max_context, kv_dtype)
        self.max_batch = self.memory_plan.max_batch
        self.max_context = self.memory_plan.max_context
        self.max_draft = int(lim["max_draft"])
        self.max_tokens_per_step = int(lim["max_tokens_per_step"])
        self.query_len_max = int(manifest["dims"]["query_len"]["max"])
        self.eos_id = manifest.get("tokenizer", {}).get("eos_token_id")
        # every id that ends a request (generation_config.json may list several, e.g. Llama 3 instruct)
        self.eos_ids = frozenset(manifest.get("tokenizer", {}).get("eos_token_ids")
                                 or ([self.eos_id] if self.eos_id is not None else []))
        self.vocab = int(manifest["model"]["vocab_size"])
        m, d = manifest["model"], manifest["draft"]
        # A backend may keep the caches itself (e.g. on the GPU for TensorRT); the default is host numpy.
        make_cache = getattr(backend, "make_kv_cache", None) or KVCache
        # ...or in a second layout as well (the ORT backend's decoding graphs: backends/ort_decode.py).
        self.target_kv = getattr(backend, "target_kv_cache", make_cache)(
            m["num_layers"], self.max_context, self.slots_total, m["num_kv_heads"], m["head_dim"], kv_dtype)
        self.metrics = Metrics(self.max_draft)
        self.costs = Costs(self.max_tokens_per_step, self.max_draft, t.overhead_window)
        self.costs.table = cost_table
        # The running survival profile and the stale rows that keep sampling lossless (controller.py).
        self.controller = AdaptiveController(prior_decay=t.prior_decay, prior_acceptance=t.prior_acceptance,
                                              prior_rows=t.prior_rows)
        c = t.correction
        # Without a confidence head the survivals are max probabilities: fit a slope on them too.
        self.survival_correction = (SurvivalCorrection(self.max_draft, c.damping, c.forget, c.max_step, c.bound,
                                                       c.warmup, fit_slope=d.get("confidence") == "fallback")
                                    if c.enabled else None)
        self.admission = Admission(self.slots_total, self.max_batch, max_queue, t, self.costs, self.query_len_max,
                                   self.metrics)
        self.drafter_kind = d.get("kind", "classic")
        self.draft_kv = None  # the classic draft's KV cache (a DSpark drafter keeps its own context cache)
        self.drafter = self._make_drafter(make_cache, kv_dtype)
        decoding_graph = hasattr(self.target_kv, "slot_major")  # ORT: the target decodes on a graph of its own
        if decoding_graph:  # its calls span a range of slots
            self.admission.move_slot = self._move_slot
        self.costs.switch = SwitchPrice(t.switch_calls if decoding_graph else 0.0, t.settle_calls)
        self.depth_planner = DepthPlanner(self.max_draft, t, self.controller, self.drafter.sequential,
                                          self.drafter.catch_up_ms)
        self.verify_planner = VerifyPlanner(self.max_draft, t, self.controller, self.survival_correction, self.costs)
        self.verifier = Verifier(backend, self.target_kv, t, (self.vocab, self.max_tokens_per_step, self.query_len_max),
                                 self.costs, self.metrics)
        self.committer = Committer(tokenizer, self.eos_ids, self.max_context, self.metrics, self.admission)
        self.learner = Learner(self.max_draft, t, self.survival_correction, self.costs, self.metrics,
                               self.depth_planner.exploration)
        self._lock = self.admission.lock
        self._next_id = 0
        self._worker: threading.Thread | None = None
        self._closed = False
        self._in_step = False
        # close() saves what the tables learned in place of the artifact's profile (costs/profiling.py
        # persist_refined); off for runtimes started from a profile that is not the artifact's own.
        self.persist_profile = True
        self._prefault = None  # (thread, stop) mapping the host caches' pages (prefault.py); load() starts it
        self._mapping_since = 0.0  # when it started (time.monotonic)

    def _move_slot(self, r, src: int, dst: int) -> None:
        self.target_kv.move(src, dst, r.target_len)
        self.drafter.move_slot(r, src, dst)

    def _make_drafter(self, make_cache, kv_dtype):
        """The drafter phase of the artifact's drafter kind (both implement draft / observe / prepare_call)."""
        limits = (self.max_draft, self.max_context, self.max_tokens_per_step)
        if self.drafter_kind == "dspark":
            from dspark_trt.runtime.dspark_drafting import DsparkDrafting
            from dspark_trt.runtime.dspark_graphs import OrtDsparkGraphs
            from dspark_trt.runtime.phases.dspark_drafter import DsparkDrafter

            # the backend's own engines where it has them (trt), else ONNX Runtime sessions
            on_backend = getattr(self.backend, "dspark_graphs", None)
            graphs = on_backend() if on_backend else OrtDsparkGraphs.from_manifest(
                self.artifact_dir, self.manifest, spin=getattr(self.backend, "spinning", False))
            drafting = DsparkDrafting(graphs, num_slots=self.slots_total, max_context=self.max_context,
                                      make_cache=make_cache, dtype=kv_dtype)
            return DsparkDrafter(drafting, self.tuning, limits, self.survival_correction, self.costs, self.metrics)
        d = self.manifest["draft"]
        self.draft_kv = getattr(self.backend, "draft_kv_cache", make_cache)(
            d["num_layers"], self.max_context, self.slots_total, d["num_kv_heads"], d["head_dim"], kv_dtype)
        return Drafter(self.backend, self.draft_kv, self.tuning, limits, self.controller, self.survival_correction,
                       self.costs, self.metrics)

    @property
    def cost(self):
        """The profiled cost tables (costs/table.py CostTable), or None: adaptive then prices by tokens."""
        return self.costs.table

    @cost.setter
    def cost(self, table) -> None:
        self.costs.table = table

    @property
    def draft_limit(self) -> str | None:
        """What bounds fixed:K, for the refusal of a larger K (None: the artifact's max draft length)."""
        return self.drafter.spec_limit

    @property
    def slots(self) -> list:
        return self.admission.slots

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, artifact_dir, backend: str = "ort", max_batch: int | None = None, profile: str = "auto",
             max_queue: int | None = None, recalibrate: bool = True, tuning: RuntimeTuning | None = None,
             backend_options: dict | None = None, max_context: int | None = None) -> "Runtime":
        """Load an exported artifact. profile: "auto" (load cost_profile.json or measure one at start-up),
        "load" (must exist), or "none" (adaptive then uses a per-token cost estimate). recalibrate: correct
        the draft's survivals online from what verification accepts (survival_correction.py). tuning:
        every scheduling knob (tuning.py; default RuntimeTuning()). backend_options: passed to the backend
        (torch: device, dtype); they also name its cost profile. max_batch / max_context may only lower
        what the artifact was exported for (memory_plan.py)."""
        from dspark_trt.runtime.artifact_verify import verify_artifact
        from dspark_trt.runtime.backends.base import make_backend
        from dspark_trt.runtime.tokenizer import load_tokenizer

        manifest = load_manifest(artifact_dir)
        if manifest.drafter_kind not in ("classic", "dspark"):
            raise DsparkError(f"{artifact_dir} holds a {manifest.drafter_kind!r} drafter, which this version "
                              "cannot run: upgrade dspark-trt or re-export the artifact")
        # the backend first: it says what to install or build, if anything
        be = make_backend(backend, artifact_dir, manifest, **(backend_options or {}))
        verify_artifact(artifact_dir, manifest)  # a file changed after export -> DsparkError naming it
        # The cost profile's name: spinning ORT threads time small calls 1.3-3x faster than sleeping ones, so
        # each regime keeps a profile of its own (backends/ort.py spin_decision); options name it too.
        if getattr(be, "spinning", False):
            backend = f"{backend}.spin"
        if backend_options:
            backend = ".".join([backend, *(str(v).replace(":", "") for _, v in sorted(backend_options.items()))])
        tok = load_tokenizer(Path(artifact_dir) / manifest.get("tokenizer", {}).get("file", "tokenizer.json"))
        rt = cls(artifact_dir, manifest, be, tok, max_batch=max_batch, max_queue=max_queue, recalibrate=recalibrate,
                 tuning=tuning, max_context=max_context)
        rt.profile_name = backend
        rt.prefault_caches()
        if profile != "none":
            from dspark_trt.runtime.costs.profiling import load_or_profile

            rt.cost = load_or_profile(rt, backend, measure_if_missing=(profile == "auto")).tune(rt.tuning.drift)
        return rt

    @classmethod
    def from_checkpoints(cls, target_dir, draft_dir, head_dir=None, max_draft: int = 7, max_batch: int = 16,
                         max_context: int = 1024, dtype: str = "fp32", profile: str = "none") -> "Runtime":
        """The eager torch reference straight from checkpoint directories (no export): for tests and
        for checking an exported artifact against its sources."""
        from dspark_trt.exporter.build_modules import load_steps
        from dspark_trt.exporter.export import manifest_facts
        from dspark_trt.models.confidence_head import has_head
        from dspark_trt.runtime.backends.torch_backend import TorchBackend
        from dspark_trt.runtime.tokenizer import load_tokenizer

        if head_dir is None and has_head(draft_dir):
            head_dir = draft_dir
        draft, _, head = load_steps(target_dir, draft_dir, head_dir, dtype, max_draft)
        manifest = manifest_facts(target_dir, draft_dir, head_dir if head is not None else None, draft.temperatures,
                                  max_draft=max_draft, max_batch=max_batch, max_context=max_context, dtype=dtype)
        be = TorchBackend(None, manifest)
        rt = cls(target_dir, manifest, be, load_tokenizer(Path(target_dir) / "tokenizer.json"))
        if profile != "none":
            from dspark_trt.runtime.costs.profiling import measure

            rt.cost = measure(rt, repeats=2, progress=False).tune(rt.tuning.drift)
        return rt

    # ------------------------------------------------------------------ submission
    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise DsparkError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab - 1})")
        return ids

    def submit(self, prompt, config: GenerationConfig | None = None, stream: bool = False) -> Request:
        """Queue a request (thread-safe). Errors that concern only this request finish it with an error."""
        config = config or GenerationConfig()
        mode = config.validate(self.max_draft, self.draft_limit)
        refusal = getattr(self.drafter, "refusal", None)
        why = refusal(config, mode) if refusal is not None else None
        if why:
            raise DsparkError(why)
        ids = self.encode(prompt)
        with self._lock:
            if self._closed:
                raise DsparkError("runtime is closed")
            self.admission.check_room()
            req = Request(self._next_id, ids, config, mode, self.max_draft)
            self._next_id += 1
            if stream:
                import queue

                req.pieces = queue.Queue()
            if not ids:
                req.finish("error", "prompt is empty")
            elif len(ids) >= self.max_context:
                req.finish("error", f"prompt has {len(ids)} tokens; the artifact's max context is {self.max_context}")
            else:
                self.admission.enqueue(req)
            self._ensure_worker()
        return req

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request is queued or running and the last step's metrics are recorded."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if not self.admission.busy() and not self._in_step:
                    return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.001)

    def cancel(self, req: Request) -> None:
        with self._lock:
            req.cancelled = True

    def wait(self, req: Request) -> GenerationResult:
        req.done.wait()
        return self.result(req)

    def result(self, req: Request, prompt=None) -> GenerationResult:
        ids = req.generated_ids
        text = self.tokenizer.decode(ids)
        if req.finish_reason == "stop" and req.config.stop:
            cut = min((text.find(s) for s in req.config.stop if s and s in text), default=-1)
            text = text[:cut] if cut >= 0 else text
        return GenerationResult(prompt if prompt is not None else req.prompt_ids, text, ids,
                                req.finish_reason or "", req.stats.to_dict(), req.error)

    def generate(self, prompts, config: GenerationConfig | list[GenerationConfig] | None = None) -> list[GenerationResult]:
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        plist = [prompts] if single else list(prompts)
        configs = config if isinstance(config, list) else [config or GenerationConfig()] * len(plist)
        reqs = [self.submit(p, c) for p, c in zip(plist, configs)]
        for r in reqs:
            r.done.wait()
        return [self.result(r, p) for r, p in zip(reqs, plist)]

    def stream(self, prompt, config: GenerationConfig | None = None) -> Iterator[str]:
        """Yield text pieces as tokens are committed."""
        req = self.submit(prompt, config, stream=True)
        from dspark_trt.runtime.tokenizer import IncrementalDecoder

        dec = IncrementalDecoder(self.tokenizer)
        try:
            while True:
                ids = req.pieces.get()
                if ids is None:
                    break
                piece = dec.push(ids)
                if piece:
                    yield piece
            tail = dec.flush()
            if tail:
                yield tail
            if req.error:
                raise DsparkError(req.error)
        finally:
            if not req.finished:
                self.cancel(req)

    # ------------------------------------------------------------------ worker
    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._loop, name="dspark-runtime", daemon=True)
            self._worker.start()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self.admission.busy():
                    self._lock.wait(timeout=1.0)
                if self._closed:
                    return
            try:
                self._in_step = True
                self.step()
            except Exception as e:  # an engine failure must not leave callers waiting forever
                self.admission.fail_all(f"{type(e).__name__}: {e}")
            finally:
                self._in_step = False

    def prefault_caches(self) -> None:
        """Start mapping the host KV caches' pages in the background, so that first writes do not fault
        (prefault.py); load() calls it."""
        from dspark_trt.runtime.prefault import prefault_in_background

        if self._prefault is None:
            self._prefault = prefault_in_background([b for c in self._host_caches() for b in c.buffers()])
            self._mapping_since = time.monotonic()

    def wait_prefaulted(self) -> None:
        """Block until prefault_caches() is done: before timing anything (the profiler, the bench)."""
        if self._prefault is not None:
            self._prefault[0].join()

    def close(self) -> None:
        if self._prefault is not None:
            self._prefault[1].set()
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._worker is not None:
            self._worker.join(timeout=10)
        self.admission.fail_all("runtime closed")
        if self.persist_profile and self.artifact_dir.is_dir() and (self.artifact_dir / "manifest.json").is_file():
            from dspark_trt.runtime.costs.profiling import persist_refined

            persist_refined(self)
        if self._worker is None or not self._worker.is_alive():  # a step still running keeps its caches
            self._release_caches()

    def _host_caches(self) -> list[KVCache]:
        """The KV caches in host memory: the target's, the classic draft's, a DSpark drafter's context cache."""
        drafting = getattr(self.drafter, "drafting", None)
        return [c for c in (self.target_kv, self.draft_kv, getattr(drafting, "cache", None)) if isinstance(c, KVCache)]

    def _release_caches(self) -> None:
        """Give the KV caches' memory back now (~0.8 GB a runtime at 64 slots x 1024 positions): the runtime's
        parts refer to one another, so without this it waited for the garbage collector, and a bench starting
        every run cold on a runtime of its own ran out of memory after ~25 of them."""
        for cache in self._host_caches():
            cache.release()
        release = getattr(self.backend, "release_caches", None)
        if release is not None:
            release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ one step
    def step(self) -> bool:
        """One step over the running requests; False when there are none."""
        batch = self.admission.admit()
        if batch is None:
            return False
        cost = self.costs.for_step(len(batch.decode), batch.past)
        self.costs.learning = (self._prefault is None or not self._prefault[0].is_alive()
                               or time.monotonic() - self._mapping_since > MAPPING_GRACE_S)
        depth = self.depth_planner.plan(batch, cost)
        # One step in cost_observe_every feeds the tables, and every exploring or checking step: it exists to
        # be seen.
        self.costs.observing = self.costs.learning and (depth.exploring or depth.checking
                                or self.metrics.steps % self.tuning.cost_observe_every == 0)
        # Prompt chunks that get a call of their own go first: their first tokens need not wait for the
        # decode rows' drafting and verification.
        ahead = self.verifier.prompts_ahead(batch)
        if ahead is not None:
            self.committer.commit_prompts(ahead.chunked, ahead.outs["next_token"])
        drafted = self.drafter.draft(batch, depth, cost)  # -> Draft named tuples, read by name
        plan = self.verify_planner.plan(batch, drafted, cost, depth.exploring)
        result = self.verifier.run(batch, drafted, plan, ahead)
        if result is None:
            return True
        self.committer.commit(batch, drafted, result, plan)
        self.drafter.observe(batch, result)  # after commit: what verification made context
        self.learner.learn(batch, depth, drafted, plan, result)  # after commit: it times the whole step
        return True
