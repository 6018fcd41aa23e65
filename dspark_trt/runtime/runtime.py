"""The runtime: continuous batching around a draft engine and a target engine.

Each step: admit queued requests into free KV slots; draft for decoding requests (the draft first catches
up on tokens it has not seen); decide verify lengths (off / fixed:K / adaptive solver); run one target
step over the packed batch (prompt chunks and verifications together); commit accepted tokens plus the
target's token; free finished requests. Numpy only: no torch on this path.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np

from dspark_trt.errors import DsparkError
from dspark_trt.runtime.batch import pack_queries, token_slots, verify_rows
from dspark_trt.runtime.call_shape import packed_shape
from dspark_trt.runtime.config import GenerationConfig
from dspark_trt.runtime.cost_model import table_lookup
from dspark_trt.runtime.kv_cache import KVCache, kv_numpy_dtype
from dspark_trt.runtime.memory_plan import plan_for
from dspark_trt.runtime.metrics import Metrics
from dspark_trt.runtime.prefill_batching import prefill_group_size, prefill_now
from dspark_trt.runtime.request import Request
from dspark_trt.runtime.solver import cap_depth
from dspark_trt.runtime.spec_guard import SpecGuard, load_bucket
from dspark_trt.runtime.survival_correction import SurvivalCorrection

PREFILL_CHUNK = 256
OBSERVE_BATCH = 32  # verification outcomes buffered before the survival correction learns from them
OBSERVE_EVERY = 4  # feed one step in this many to the cost table's drift correction (it moves slowly anyway)
PLAN_EVERY = 8  # re-plan the adaptive draft length this often per batch shape (the profile moves slowly)
PROBE_EVERY = 8  # when drafting does not pay, still draft one token every this many steps ...
PROBE_REQUESTS = 4  # ... for this many adaptive requests (in turn): enough to track the survival profile
PLAN_HEADROOM = 1  # draft steps planned beyond the prior's optimum, so live survivals can ask for more
EXPLORE_EVERY = 8  # when the solver admits no draft this many steps running, verify one per request anyway
CALL_TEST = True  # make a further draft call only if its expected surplus pays for its time
GUARD_TIE = 0.2  # where the model says drafting loses by less than this, measurement (spec_guard) decides ...
GUARD_SURE = 0.25  # ... and where it says drafting wins by more than this, no trials of plain decoding are run
STOP_FACTOR = 1.0  # keep drafting while the next survival is predicted above this x the last break-even survival
PREFILL_BATCHING = True  # arriving prompts may wait a few steps to share a prefill call (prefill_batching.py)


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


def load_manifest(artifact_dir) -> dict:
    try:
        from dspark_trt.manifest import Manifest
    except ImportError:  # pragma: no cover - manifest module is part of the package
        Manifest = None
    path = Path(artifact_dir) / "manifest.json"
    if not Path(artifact_dir).is_dir():
        raise DsparkError(f"artifact directory {artifact_dir} does not exist: create it with `dspark-trt export`")
    if not path.is_file():
        raise DsparkError(f"no manifest.json in {artifact_dir}: create the artifact with `dspark-trt export`")
    if Manifest is not None and hasattr(Manifest, "load"):
        m = Manifest.load(artifact_dir)
        return m.data if hasattr(m, "data") else m.to_dict() if hasattr(m, "to_dict") else dict(m)
    return json.loads(path.read_text())


class Runtime:
    def __init__(self, artifact_dir, manifest: dict, backend, tokenizer, max_batch: int | None = None,
                 cost_table=None, max_queue: int | None = None, recalibrate: bool = True,
                 max_context: int | None = None):
        self.artifact_dir = Path(artifact_dir)
        self.manifest = manifest
        self.backend = backend
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
        self.target_kv = make_cache(m["num_layers"], self.max_context, self.slots_total, m["num_kv_heads"], m["head_dim"], kv_dtype)
        self.draft_kv = make_cache(d["num_layers"], self.max_context, self.slots_total, d["num_kv_heads"], d["head_dim"], kv_dtype)
        self.cost = cost_table
        from dspark_trt.runtime.controller import AdaptiveController

        self.controller = AdaptiveController("adaptive")
        # Online recalibration of survivals against verification outcomes (survival_correction.py).
        self.survival_correction = SurvivalCorrection(self.max_draft) if recalibrate else None
        self.metrics = Metrics(self.max_draft)
        self.slots: list[Request | None] = [None] * self.slots_total
        self.waiting: deque[Request] = deque()
        self.max_queue = max_queue
        self._lock = threading.Condition()
        self._next_id = 0
        self._worker: threading.Thread | None = None
        self._closed = False
        self._in_step = False
        self.admit_threshold = 0.0  # break-even (corrected) survival of the last solve
        self._rate = 0.0  # recent output tokens per ms of step time (EW), the value of a millisecond
        # Recent per-step time outside the calls the cost model prices (EW), for steps without and with
        # drafting: scheduling, solving, committing, and feeding new prompts to the draft. The priced calls
        # (every drafting call and target call, feeds and KV writes included: that is what the cost tables
        # learn) are not in it, or the planner would charge their packing twice; nor is the draft catching
        # up on text generated while it did not draft (a cost of switching, which the guard measures).
        # Every step pays it whatever it verifies, so it belongs in the constant of the solver's
        # denominator (ignoring it under-values emitting more tokens per step); and a drafting step pays
        # more of it (the draft loop, the solver, the survival bookkeeping, new prompts through the draft:
        # ~2.5 ms more at 32 requests here), which the draft-depth planner must charge to drafting at all.
        # Kept per load (decode requests, to the nearest power of two): most of it is per-request work, so
        # a figure learned at 64 requests (or in a warm-up) says little about 4, and one shared figure made
        # drafting look dear long after load fell.
        self._overhead: dict[tuple[str, int], float] = {}
        self._overhead_n: dict[tuple[str, int], int] = {}
        self._priced_ms = 0.0  # this step's full time in the calls the cost model prices
        self._switch_ms = 0.0  # ... and in feeding the draft text generated while it did not draft
        self._draft_timings: list[tuple[int, float]] = []  # this step's draft calls (batch, ms), see _draft
        # Measured check that speculating beats not speculating (spec_guard.py); None: trust the model.
        self.spec_guard: SpecGuard | None = SpecGuard()
        self._arm: str | None = None  # the guard's arm this step (None: the guard was not consulted)
        self.adaptive_steps = self.max_draft  # draft steps adaptive requests get this step
        self._since_probe = 0
        self._probing = False  # this step's drafting is a probe (drafting did not pay)
        self._spec_vs_plain = 1.0  # the model's best drafting rate over its plain rate, at the last plan
        self._probes = 0
        self._plan_cache: dict[tuple[int, int], _DepthPlan] = {}
        self._even_grid: dict = {}  # see _verify_table
        self._unverified_steps = 0
        self._past = 0  # longest past of this step's decoding requests (what the verify call attends over)
        self._outcomes: list = []  # (raw survival row, verified, accepted) not yet learned from
        # Recent prompts admitted per step and tokens a decoding request emits per step (EW), for
        # prefill batching.
        self._admitted = 0
        self._arrivals = 0.0
        self._tau_row = 0.0
        self._zeros: np.ndarray | None = None  # see _zero_probs

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, artifact_dir, backend: str = "ort", max_batch: int | None = None, profile: str = "auto",
             max_queue: int | None = None, recalibrate: bool = True,
             backend_options: dict | None = None, max_context: int | None = None) -> "Runtime":
        """Load an exported artifact. profile: "auto" (load cost_profile.json or measure one at start-up),
        "load" (must exist), or "none" (adaptive then uses a per-token cost estimate). recalibrate: correct
        the draft's survivals online from what verification accepts (survival_correction.py).
        backend_options: passed to the backend (torch: device, dtype); they also name its cost profile."""
        from dspark_trt.runtime.artifact_verify import verify_artifact
        from dspark_trt.runtime.backends.base import make_backend
        from dspark_trt.runtime.tokenizer import load_tokenizer

        manifest = load_manifest(artifact_dir)
        # the backend first: it says what to install or build, if anything
        be = make_backend(backend, artifact_dir, manifest, **(backend_options or {}))
        verify_artifact(artifact_dir, manifest)  # a file changed after export -> DsparkError naming it
        if backend_options:
            backend = ".".join([backend, *(str(v).replace(":", "") for _, v in sorted(backend_options.items()))])
        tok = load_tokenizer(Path(artifact_dir) / manifest.get("tokenizer", {}).get("file", "tokenizer.json"))
        rt = cls(artifact_dir, manifest, be, tok, max_batch=max_batch, max_queue=max_queue, recalibrate=recalibrate,
                 max_context=max_context)
        if profile != "none":
            from dspark_trt.runtime.profiling import load_or_profile

            rt.cost = load_or_profile(rt, backend, measure_if_missing=(profile == "auto"))
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
        manifest["files"] = {}
        be = TorchBackend(None, manifest)
        rt = cls(target_dir, manifest, be, load_tokenizer(Path(target_dir) / "tokenizer.json"))
        if profile != "none":
            from dspark_trt.runtime.profiling import measure

            rt.cost = measure(rt, repeats=2, progress=False)
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
        mode = config.validate(self.max_draft)
        ids = self.encode(prompt)
        with self._lock:
            if self._closed:
                raise DsparkError("runtime is closed")
            if self.max_queue is not None and len(self.waiting) >= self.max_queue:
                raise QueueFullError(f"queue is full ({self.max_queue} waiting requests)")
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
                self.waiting.append(req)
                self._lock.notify_all()
            self._ensure_worker()
        return req

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request is queued or running and the last step's metrics are recorded."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if not self.waiting and not any(self.slots) and not self._in_step:
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
                while not self._closed and not self.waiting and not any(self.slots):
                    self._lock.wait(timeout=1.0)
                if self._closed:
                    return
            try:
                self._in_step = True
                self.step()
            except Exception as e:  # an engine failure must not leave callers waiting forever
                self._fail_all(f"{type(e).__name__}: {e}")
            finally:
                self._in_step = False

    def _fail_all(self, message: str) -> None:
        with self._lock:
            for i, r in enumerate(self.slots):
                if r is not None:
                    r.finish("error", message)
                    self.slots[i] = None
            while self.waiting:
                self.waiting.popleft().finish("error", message)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._worker is not None:
            self._worker.join(timeout=10)
        self._fail_all("runtime closed")
        if self.artifact_dir.is_dir() and (self.artifact_dir / "manifest.json").is_file():
            from dspark_trt.runtime.profiling import persist_refined

            persist_refined(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ one step
    def _admit(self) -> list[Request]:
        with self._lock:
            for i, r in enumerate(self.slots):
                if r is not None and r.cancelled:
                    r.finish("cancelled")
                    self.slots[i] = None
            active = sum(r is not None for r in self.slots)
            while self.waiting and active < self.max_batch:
                req = self.waiting.popleft()
                if req.cancelled:
                    req.finish("cancelled")
                    continue
                req.slot = self.slots.index(None)
                self.slots[req.slot] = req
                active += 1
                self._admitted += 1
            self.metrics.queue_depth = len(self.waiting)
            return [r for r in self.slots if r is not None]

    def step(self) -> bool:
        active = self._admit()
        if not active:
            return False
        t0 = time.perf_counter()
        engine_ms = 0.0
        self._priced_ms = 0.0
        self._switch_ms = 0.0
        self._arm = None
        self._probing = False
        decode = [r for r in active if r.uncached == 1]
        prefill = [r for r in active if r.uncached > 1]
        self._arrivals += 0.1 * (self._admitted - self._arrivals)
        self._admitted = 0
        held = self._hold_prompts(prefill, decode) if PREFILL_BATCHING and decode and prefill else []
        if held:
            prefill = [r for r in prefill if r.target_len > 0]  # held: every prompt not yet started
        n_adaptive = sum(r.mode.kind == "adaptive" for r in decode)
        self._past = max((r.target_len for r in decode), default=0)  # the verify call attends this far
        if n_adaptive:
            self.adaptive_steps = self._plan_draft_steps(n_adaptive, len(decode))
        spec = [r for r in decode if r.mode.kind != "off" and self._draft_cap(r) > 0]
        if n_adaptive and self._probing:
            spec = self._probe_subset(spec)

        drafts, draft_ms = self._draft(spec) if spec else ({}, 0.0)
        engine_ms += draft_ms
        lengths, solver_us = self._lengths(decode, drafts, draft_ms)

        # Target step: decode verifications first, prompt chunks fill the rest of the token budget.
        queries, vlens = [], []
        budget = self.max_tokens_per_step
        for r in decode:
            L = lengths.get(r.id, 0)
            q = [r.tokens[-1]] + drafts[r.id][0][:L] if L else [r.tokens[-1]]
            queries.append(q)
            vlens.append(L)
            budget -= len(q)
        chunked = []
        for r in prefill:
            n = min(r.uncached, PREFILL_CHUNK, self.query_len_max, max(budget, 0))
            if n <= 0:
                break
            queries.append(r.tokens[r.target_len:r.target_len + n])
            vlens.append(0)
            chunked.append((r, n))
            budget -= n
        order = decode + [r for r, _ in chunked]
        if not order:
            return True
        nd = len(decode)
        lengths_all = [len(q) for q in queries]
        past_lens = [r.target_len for r in order]
        # Prompt chunks get a call of their own when padding every decode row to the chunk's length
        # would cost more than a second call (call_shape.py).
        groups = [range(len(order))]
        if nd and chunked and self._split_prefill(lengths_all[:nd], past_lens[:nd], lengths_all[nd:], past_lens[nd:]):
            groups = [range(nd), range(nd, len(order))]
        accepted = np.zeros(len(order), dtype=np.int64)
        next_tok = np.zeros(len(order), dtype=np.int64)
        target_ms, target_tokens, verified = 0.0, 0, 0
        for g in groups:
            outs, ms, tokens, m = self._run_target([order[i] for i in g], [queries[i] for i in g],
                                                   [past_lens[i] for i in g], [vlens[i] for i in g], drafts)
            accepted[g.start:g.stop] = outs["accepted"]
            next_tok[g.start:g.stop] = outs["next_token"]
            target_ms += ms
            target_tokens += tokens
            verified += m
        last_call_ms = ms  # the prompt chunks' own call when they got one
        engine_ms += target_ms
        vl = np.asarray(vlens, dtype=np.int64)

        if self.survival_correction is not None:
            # Outcomes are buffered and learned from every few steps: one vectorised update over more
            # rows instead of a numpy round per step.
            for i, r in enumerate(decode):
                if vl[i] > 0:
                    self._outcomes.append((drafts[r.id][2], int(vl[i]), int(accepted[i])))
            if len(self._outcomes) >= OBSERVE_BATCH or (self._outcomes and self.metrics.steps % OBSERVE_EVERY == 0):
                rows, vls, accs = zip(*self._outcomes)
                self._outcomes.clear()
                self.survival_correction.observe(_pad_rows(rows, self.max_draft), vls, accs)
        self.metrics.log_step({
            "decode_requests": nd, "prefill_tokens": int(sum(n for _, n in chunked)),
            "verify_lens": vl[:nd].tolist(), "accepted": [int(min(a, L)) for a, L in zip(accepted[:nd], vl[:nd])],
            "drafted": [len(drafts[r.id][0]) if r.id in drafts else 0 for r in decode],
            "draft_ms": draft_ms, "target_ms": target_ms, "target_tokens": target_tokens, "target_calls": len(groups),
            "prompts_held": len(held), "solver_us": solver_us})
        now = time.perf_counter()
        for i, r in enumerate(decode):
            a, L = int(accepted[i]), int(vl[i])
            new = (drafts[r.id][0][:a] if a else []) + [int(next_tok[i])]
            r.target_len += 1 + a
            if r.id in drafts:
                fed = len(drafts[r.id][0]) - 1  # the last drafted token was never fed to the draft
                r.draft_len = r.draft_len + min(a, fed)
            st = r.stats
            st.steps += 1
            st.verified_tokens += L + 1
            for k in range(L):
                st.verified_per_position[k] += 1
                if k < a:
                    st.accepted_per_position[k] += 1
            self.metrics.record_acceptance(L, a)
            self._commit(r, new, now)
        for j, (r, n) in enumerate(chunked):
            i = len(decode) + j
            r.target_len += n
            if r.uncached == 0:  # the whole prompt is in the cache: its last row gave the first token
                self._commit(r, [int(next_tok[i])], now)
        self._release_finished()
        wall_ms = (time.perf_counter() - t0) * 1e3
        if decode and wall_ms > 0:
            emitted = nd + int(sum(min(a, L) for a, L in zip(accepted[:nd], vl[:nd])))
            rate = emitted / wall_ms
            self._rate = rate if self._rate == 0 else 0.9 * self._rate + 0.1 * rate
            self._tau_row = emitted / nd if self._tau_row == 0 else 0.9 * self._tau_row + 0.1 * emitted / nd
            if self._arm is not None:
                # The guard compares the arms' steady decode work: prompts arrive whichever arm runs, in
                # lumps (a wave of finishes, prefill batching), and a trial of drafting opens with the draft
                # catching up on everything it skipped, which an 8-step trial would weigh as if it
                # recurred every 8 steps; a switch that sticks pays it once.
                prefill_ms = last_call_ms if len(groups) > 1 else self._prefill_share(lengths_all, past_lens, nd)
                self.spec_guard.record(nd, self._arm, emitted, wall_ms - prefill_ms - self._switch_ms)
            # A running mean for the first 20 steps of a kind, then EW: one slow first step (allocations,
            # lazy imports) must not dominate for the next hundred. Probe steps (a few requests catching
            # up and drafting one token) are not what a drafting step costs.
            if not self._probing:
                key = ("spec" if drafts else "plain", load_bucket(nd))
                n = self._overhead_n[key] = self._overhead_n.get(key, 0) + 1
                old = self._overhead.get(key, 0.0)
                unpriced = wall_ms - self._priced_ms - self._switch_ms
                self._overhead[key] = old + max(0.05, 1.0 / n) * (max(0.0, unpriced) - old)
        self.metrics.record_step(wall_ms, engine_ms, solver_us, verified, len(order),
                                 sum(len(d[0]) for d in drafts.values()))
        return True

    def _run_target(self, order: list[Request], queries: list[list[int]], past_lens: list[int], vlens: list[int],
                    drafts: dict):
        """One target call over these rows; returns (outputs, ms, tokens, verified rows)."""
        tv = time.perf_counter()  # the call's full cost: feeds, engine, KV write
        slots = [r.slot for r in order]
        feeds = pack_queries(queries, past_lens, slots)
        vl = np.asarray(vlens, dtype=np.int64)
        feeds["verify_index"] = verify_rows(feeds["query_lens"], vl)
        feeds["verify_lens"] = vl
        m = len(feeds["verify_index"])
        draft_tokens = np.zeros(m, dtype=np.int64)
        sampling = any(r.sampling for r in order)
        draft_probs = np.zeros((m, self.vocab), dtype=np.float32) if sampling else self._zero_probs(m)
        accept_u = np.zeros(m, dtype=np.float32)
        sample_u = np.zeros(len(order), dtype=np.float32)
        temps = np.asarray([r.config.temperature for r in order], dtype=np.float32)
        row = 0
        for i, r in enumerate(order):
            L = int(vl[i])
            if L:
                toks, probs = drafts[r.id][:2]
                draft_tokens[row:row + L] = toks[:L]
                if r.sampling:  # greedy acceptance never reads the draft's distribution
                    draft_probs[row:row + L] = probs[:L]
            if r.sampling:
                accept_u[row:row + L] = r.accept_draws(L)
                sample_u[i] = r.sample_draw()
            row += L + 1
        feeds.update(draft_tokens=draft_tokens, draft_probs=draft_probs, temperature=temps,
                     accept_uniforms=accept_u, sample_uniforms=sample_u)
        te = time.perf_counter()
        outs, present = self.backend.run_target(feeds, self.target_kv.past(max(past_lens)))
        ms = (time.perf_counter() - te) * 1e3
        self.target_kv.write(present, feeds["positions"], token_slots(feeds))
        tokens = int(feeds["tokens"].shape[0])
        full = (time.perf_counter() - tv) * 1e3
        self._priced_ms += full
        if self.cost is not None and self.metrics.steps % OBSERVE_EVERY == 0:
            # The full call, not just the engine: the solver trades real milliseconds, and feeds and KV
            # writes grow with the tokens verified too.
            self.cost.observe_verify(tokens, full)
            if self.cost.call_shape is not None:
                self.cost.call_shape.observe(*packed_shape([len(q) for q in queries], past_lens), full)
        return outs, ms, tokens, int(m)

    def _hold_prompts(self, prefill: list[Request], decode: list[Request]) -> list[Request]:
        """Prompts not yet started that wait this step to share a later prefill call (prefill_batching.py):
        only where they would get a call of their own anyway, i.e. where sharing saves a call."""
        shape = self.cost.call_shape if self.cost is not None else None
        fresh = [r for r in prefill if r.target_len == 0]
        if shape is None or not fresh:
            return []
        k = prefill_group_size(shape.ms(1, 1, 1, 0), self._arrivals, self._rate, self._tau_row)
        if prefill_now(len(fresh), max(r.prefill_wait for r in fresh), k, len(decode)):
            return []
        chunks = [min(r.uncached, PREFILL_CHUNK, self.query_len_max) for r in fresh]
        if not self._split_prefill([1] * len(decode), [r.target_len for r in decode], chunks, [0] * len(fresh)):
            return []  # they would ride in the decode call: no call to save
        for r in fresh:
            r.prefill_wait += 1
        return fresh

    def _zero_probs(self, rows: int) -> np.ndarray:
        """A [rows, V] block of zeros, the draft distribution of greedy rows (greedy acceptance never reads
        it; nothing writes to it). Kept between steps: a fresh one each step is megabytes the engine first
        pages in. (Not flagged read-only: torch.from_numpy warns on read-only arrays.)"""
        if self._zeros is None or self._zeros.shape[0] < rows:
            grown = 2 * (0 if self._zeros is None else self._zeros.shape[0])
            self._zeros = np.zeros((max(rows, grown), self.vocab), dtype=np.float32)
        return self._zeros[:rows]

    def _prefill_share(self, lengths: list[int], past_lens: list[int], nd: int) -> float:
        """Modelled ms that the prompt chunks packed into a decode call added to it (0 without chunks)."""
        shape = self.cost.call_shape if self.cost is not None else None
        if shape is None or nd == 0 or len(lengths) == nd:
            return 0.0
        whole = shape.ms(*packed_shape(lengths, past_lens))
        return max(0.0, whole - shape.ms(*packed_shape(lengths[:nd], past_lens[:nd])))

    def _split_prefill(self, dec_lens, dec_past, pre_lens, pre_past) -> bool:
        shape = self.cost.call_shape if self.cost is not None else None
        if shape is None:
            return False
        mixed = shape.ms(*packed_shape(dec_lens + pre_lens, dec_past + pre_past))
        return shape.ms(*packed_shape(dec_lens, dec_past)) + shape.ms(*packed_shape(pre_lens, pre_past)) < mixed

    # ------------------------------------------------------------------ drafting
    def _plan_draft_steps(self, n_adaptive: int, n_decode: int) -> int:
        """How many draft steps adaptive requests get this step, planned before drafting.

        Uses the running survival profile (which does not depend on this step's drafts) and the cost
        table: with R requests expected to keep j drafts each, throughput is
        R (1 + sum_{i<j} S_i) / (overhead + j draft_ms(R) + verify_ms(R (1 + j))); drafting far past the best j is
        waste. One step of headroom lets live survivals ask for more. When no drafting pays, draft
        nothing, but probe now and then so the profile keeps tracking the workload.
        """
        self._probing = False
        if self.cost is None:
            return self.max_draft
        key = (n_adaptive, n_decode)
        cached = self._plan_cache.get(key)
        if cached is None or cached.steps_left <= 0:
            cached = _DepthPlan(*self._plan_draft_steps_now(n_adaptive, n_decode), PLAN_EVERY)
        best, self._spec_vs_plain = cached.depth, cached.spec_vs_plain
        self._plan_cache[key] = cached._replace(steps_left=cached.steps_left - 1)
        if best == 0:
            # A probe is one step, not a plan: the plan stays "no drafting" between probes.
            self._since_probe += 1
            if self._since_probe >= PROBE_EVERY:
                self._since_probe = 0
                self._probing = True
                return 1
            return self._guarded(0, n_decode)
        self._since_probe = 0
        return self._guarded(min(self.max_draft, best + PLAN_HEADROOM), n_decode)

    def _guarded(self, steps: int, n_decode: int) -> int:
        """The model's draft depth, unless measurement says the other arm is faster at this load: no
        drafting where the model would draft, or the smallest planned depth where it would not."""
        if n_decode < 1 or self.spec_guard is None:
            return steps
        if steps <= 0 and self._spec_vs_plain < 1 - GUARD_TIE:
            return 0  # the model is sure drafting does not pay: no trials of it (probes still run)
        if steps > 0 and self._spec_vs_plain > 1 + GUARD_SURE:
            # The model is sure drafting pays (low load): a trial of plain steps would cost ~a third of
            # its steps' output for a decision that is not close.
            return steps
        self._arm = self.spec_guard.arm(n_decode, "spec" if steps > 0 else "plain")
        if self._arm == "plain":
            return 0
        return steps if steps > 0 else min(self.max_draft, 1 + PLAN_HEADROOM)

    def _plan_draft_steps_now(self, n_adaptive: int, n_decode: int) -> tuple[int, float]:
        """(best draft depth by the model, its best drafting rate over its plain rate)."""
        k = self.max_draft
        prof = np.asarray(self.controller.prior_row(k), dtype=np.float64)
        j = np.arange(k + 1)
        gain = n_adaptive * (1.0 + np.concatenate([[0.0], np.cumsum(prof)]))
        base = n_decode - n_adaptive
        shape = self.cost.call_shape
        if shape is not None:  # every adaptive row padded to 1 + j
            verify = shape.table(base + n_adaptive * (1 + j), n_decode, 1 + j, self._past)
        else:
            verify = np.asarray(self.cost.verify_ms(base + n_adaptive * (1 + j)), dtype=np.float64)
        plain, spec = self._overhead_ms("plain", n_decode), self._overhead_ms("spec", n_decode)
        cost = np.where(j > 0, spec, plain) + j * float(self.cost.draft_ms(n_adaptive)) + verify
        rate = gain / np.maximum(cost, 1e-9)
        ratio = float(rate[1:].max() / rate[0]) if k and rate[0] > 0 else 0.0
        return int(np.argmax(rate)), ratio

    def _probe_subset(self, spec: list[Request]) -> list[Request]:
        """On a probe step only PROBE_REQUESTS adaptive requests draft (taking turns): a draft call's
        cost grows with its batch, and a few rows are enough to keep the survival profile current."""
        adaptive = sorted((r for r in spec if r.mode.kind == "adaptive"), key=lambda r: r.id)
        if len(adaptive) <= PROBE_REQUESTS:
            return spec
        start = (self._probes * PROBE_REQUESTS) % len(adaptive)
        self._probes += 1
        chosen = {r.id for r in (adaptive + adaptive)[start:start + PROBE_REQUESTS]}
        return [r for r in spec if r.mode.kind != "adaptive" or r.id in chosen]

    def _draft_cap(self, r: Request) -> int:
        k = r.mode.k if r.mode.kind == "fixed" else min(self.max_draft, self.adaptive_steps)
        room_new = r.remaining() - 1  # the target always adds one token
        room_ctx = self.max_context - len(r.tokens) - 1
        return max(0, min(k, room_new, room_ctx))

    def _draft(self, reqs: list[Request]):
        """Run draft steps; returns ({request id: (tokens, probs: k rows [V] for a sampling request, none
        for a greedy one, survival [k], corrected survival [k])}, engine ms)."""
        caps = {r.id: self._draft_cap(r) for r in reqs}
        toks = {r.id: [] for r in reqs}
        probs = {r.id: [] for r in reqs}
        surv = {r.id: [] for r in reqs}
        engine_ms = 0.0
        # Catch-up: feed tokens the draft has not seen (prompt, previous verify's accepted tokens).
        # A drafting step itself catches up at most max_draft + 1 tokens a request; anything longer (a
        # prompt, the text generated while the request did not draft) is fed first, in calls of only the
        # requests that are that far behind: in the drafting call every row would be padded to it
        # (models/decoder.py), which costs far more than the extra call of the small draft model.
        limit = self.max_draft + 1
        # A sampled request's drafts must not decide whether other requests draft on (the call test sums
        # every request's surplus): their extra slots would then compete for the budget depending on the
        # sampled tokens, and "verify x_k" would depend on x_k. Decided before drafting, from the requests'
        # settings only.
        test_call = not any(r.sampling and r.mode.kind == "adaptive" for r in reqs)
        while True:
            behind = {r.id: len(r.tokens) - r.draft_len for r in reqs}
            far = [r for r in reqs if behind[r.id] > limit]
            if not far and sum(behind.values()) <= self.max_tokens_per_step:
                break
            group, used = [], 0
            for r in sorted(far or reqs, key=lambda r: -behind[r.id]):
                c = min(behind[r.id] - 1, PREFILL_CHUNK)  # keep at least one token for the drafting call
                if c > 0 and used + c <= self.max_tokens_per_step:
                    group.append((r, c))
                    used += c
            if not group:
                break
            qs = [r.tokens[r.draft_len:r.draft_len + c] for r, c in group]
            t = time.perf_counter()
            _, ms = self._run_draft([r for r, _ in group], qs, [1.0] * len(group), [0] * len(group), observe=False)
            engine_ms += ms
            # New prompts must reach the draft in any drafting regime: that share of the call stays in the
            # step overhead the planner charges to drafting. Requests that decoded a while without drafting
            # are the price of switching into drafting, which the guard measures, not the steady state the
            # planner models.
            switch = sum(c for r, c in group if r.stats.steps > 1)
            self._switch_ms += (time.perf_counter() - t) * 1e3 * switch / sum(c for _, c in group)
            for r, c in group:
                r.draft_len += c
        current = list(reqs)
        queries = [r.tokens[r.draft_len:] for r in current]
        prev = {r.id: 1.0 for r in reqs}
        # Survivals as the solver will see them (online-corrected), kept up as drafting goes.
        shifts = self.survival_correction.active_shifts() if self.survival_correction is not None else None
        corr = {r.id: [] for r in reqs}
        k = 0
        while current:
            outs, ms = self._run_draft(current, queries, [prev[r.id] for r in current], [k] * len(current))
            engine_ms += ms
            nxt, nq = [], []
            # Plain lists: indexing numpy per request per call costs more than the bookkeeping itself.
            drafted, survivals, dist = outs["draft_token"].tolist(), outs["survival"].tolist(), outs["draft_probs"]
            for i, r in enumerate(current):
                rid = r.id
                r.draft_len += len(queries[i])
                t, s = drafted[i], survivals[i]
                toks[rid].append(t)
                if r.sampling:  # greedy acceptance never reads the draft's distribution
                    probs[rid].append(dist[i])
                surv[rid].append(s)
                cr = corr[rid]
                cr.append(SurvivalCorrection.corrected_next(shifts, k, prev[rid], s, cr[-1] if cr else 1.0))
                prev[rid] = s
                if len(toks[rid]) < caps[rid]:
                    nxt.append(r)
                    nq.append([t])
            keep = self._keep_drafting([r for r in nxt if r.mode.kind == "adaptive"], corr, k + 1,
                                       test_call=test_call and not any(r.mode.kind != "adaptive" for r in nxt))
            nq = [q for r, q in zip(nxt, nq) if r.mode.kind != "adaptive" or r.id in keep]
            nxt = [r for r in nxt if r.mode.kind != "adaptive" or r.id in keep]
            # Tokens fed this call are in the draft cache only provisionally: roll back to the committed
            # prefix; _step advances draft_len by what the target accepts.
            current, queries = nxt, nq
            k += 1
        for r in reqs:
            r.draft_len = len(r.tokens)
            r.draft_rounds += 1
        for batch, ms in self._draft_timings:
            self.cost.observe_draft(batch, ms)
        self._draft_timings.clear()
        # probs stay a list of [V] rows (stacked into draft_probs by _run_target)
        out = {r.id: (toks[r.id], probs[r.id], np.asarray(surv[r.id], dtype=np.float32), corr[r.id])
               for r in reqs}
        for r in reqs:
            r.stats.drafted_tokens += len(toks[r.id])
        return out, engine_ms

    def _keep_drafting(self, reqs: list[Request], corrected: dict, drafted: int, test_call: bool = True) -> set:
        """Adaptive requests worth another draft step, by marginal value.

        A drafted token pays only if the solver admits it, i.e. if its survival clears theta, the
        break-even survival of the last solve (`_marginal_survival`, in corrected units). The next token's
        survival is predicted as S_k times the running profile's conditional acceptance at k+1, and a
        request keeps drafting iff that clears theta * STOP_FACTOR. With test_call the call itself is
        made only if the expected surplus sum (S_pred - theta) is worth its time at the runtime's recent
        output rate (tokens per ms); without (fixed-K requests draft anyway, or a sampled request is among
        them) only the per-request test applies. Stopping rules that look only at positions <= k keep
        sampling lossless.
        """
        if not reqs:
            return set()
        conds = self.controller.conditional_acceptance(self.max_draft)
        cond = conds[drafted] if drafted < len(conds) else 0.0
        theta = self.admit_threshold
        bar = theta * STOP_FACTOR
        keep, surplus = set(), 0.0
        for r in reqs:
            p = corrected[r.id][-1] * cond
            if p >= bar:
                keep.add(r.id)
                if p > theta:
                    surplus += p - theta
        if keep and CALL_TEST and test_call and self.cost is not None and self._rate > 0:
            if surplus < self._rate * self.cost.draft_ms(len(keep)):
                return set()
        return keep

    def _run_draft(self, reqs, queries, prev_survival, positions, observe: bool = True):
        t0 = time.perf_counter()
        feeds = pack_queries(queries, [r.draft_len for r in reqs], [r.slot for r in reqs])
        feeds["temperature"] = np.asarray([r.config.temperature for r in reqs], dtype=np.float32)
        feeds["uniforms"] = np.asarray([r.draft_draw(k) for r, k in zip(reqs, positions)], dtype=np.float32)
        feeds["prev_survival"] = np.asarray(prev_survival, dtype=np.float32)
        feeds["draft_position"] = np.asarray(positions, dtype=np.int64)
        t = time.perf_counter()
        outs, present = self.backend.run_draft(feeds, self.draft_kv.past(int(feeds["past_lens"].max())))
        ms = (time.perf_counter() - t) * 1e3
        self.draft_kv.write(present, feeds["positions"], token_slots(feeds))
        if observe:
            full = (time.perf_counter() - t0) * 1e3
            self._priced_ms += full
            if self.cost is not None and self.metrics.steps % OBSERVE_EVERY == 0:
                # The full call (feeds, engine, KV write): on a CPU the part outside the engine is a
                # sizeable share of a small draft call, and the planner must weigh what it really costs.
                # Fed back once the step's drafting is done (_draft): each feed invalidates the corrected
                # draft table, which the draft loop reads between calls (~0.1 ms a rebuild).
                self._draft_timings.append((len(reqs), full))
        return outs, ms

    # ------------------------------------------------------------------ verify lengths
    def _lengths(self, decode: list[Request], drafts: dict, draft_ms: float):
        lengths: dict[int, int] = {}
        adaptive = []
        for r in decode:
            if r.id not in drafts:
                continue
            n = len(drafts[r.id][0])
            if r.mode.kind == "fixed":
                lengths[r.id] = min(r.mode.k, n)
            elif r.mode.kind == "adaptive":
                adaptive.append(r)
        if not adaptive:
            return lengths, 0.0
        # Survivals as lists, not arrays: for a few requests the controller plans in plain Python
        # (solver.SMALL_SLOTS), where every numpy call would cost more than its arithmetic. Caps as int64,
        # which the controller takes without converting.
        K = self.max_draft
        rows = [drafts[r.id][3] for r in adaptive]  # online-corrected survivals
        caps = np.fromiter((len(s) for s in rows), dtype=np.int64, count=len(rows))
        live = [s + [0.0] * (K - len(s)) for s in rows]
        fixed_ms = draft_ms + self._overhead_ms("spec", len(decode))
        t = time.perf_counter_ns()
        others = len(decode) - len(adaptive) + sum(lengths.values())
        table = self._verify_table(others, len(decode))
        plan = self.controller.plan(live, [r.id for r in adaptive], [r.sampling for r in adaptive],
                                    _StepCost(table, fixed_ms), len(adaptive), caps=caps)
        solver_us = (time.perf_counter_ns() - t) / 1e3
        exploring = False
        if self.survival_correction is not None:
            # Exploration: survivals that are too pessimistic admit nothing, and then verification never
            # shows that they are wrong. Now and then verify the first draft of every request regardless
            # (a decision independent of the drafts, so sampling stays lossless).
            self._unverified_steps = self._unverified_steps + 1 if not plan.any() else 0
            if self._unverified_steps >= EXPLORE_EVERY:
                self._unverified_steps = 0
                plan = np.minimum(caps, 1)
                exploring = True
        if not exploring and plan.any() and self.cost is not None and self.cost.call_shape is not None:
            plan = self._cap_depth(plan, live, decode, lengths, drafts, fixed_ms)
        plan = plan.tolist()
        for r, L in zip(adaptive, plan):
            lengths[r.id] = L
        # Drafting further than the solver admits is wasted work: stop drafting next step once a
        # request's survival falls well below the weakest slot admitted now. Any stopping rule keeps
        # sampling lossless (it only removes later slots, which never outrank earlier ones).
        admitted = sum(sum(s[:L]) for s, L in zip(rows, plan))
        self.admit_threshold = self._marginal_survival(len(adaptive), admitted, sum(plan), table, fixed_ms,
                                                       span=max(4, len(decode)))
        return lengths, solver_us

    def _overhead_ms(self, kind: str, n_decode: int) -> float:
        """Recent time outside the priced calls of a step without ("plain") or with ("spec") drafting, at
        this load: its own figure, else the nearest load's of the same kind, else the other kind's."""
        if not self._overhead:
            return 0.0
        b = load_bucket(n_decode)
        own = self._overhead.get((kind, b))
        if own is not None:
            return own
        key = min(self._overhead, key=lambda k: (k[0] != kind, abs(k[1] - b), k[1]))
        return self._overhead[key]

    def _cap_depth(self, plan: np.ndarray, live: list, decode: list[Request], fixed: dict, drafts: dict,
                   fixed_ms: float) -> np.ndarray:
        """Cap adaptive verify lengths where padding every row to the deepest stops paying (solver.cap_depth)."""
        shape = self.cost.call_shape
        rows = len(decode)
        fixed_tokens, fixed_deep = sum(fixed.values()), max(fixed.values(), default=0)
        deepest = max(int(plan.max()), fixed_deep)
        if len(plan) == rows and deepest <= -(-int(plan.sum()) // rows):
            # Every row adaptive and the depths as even as they can be: the solver's table priced exactly
            # this shape, and every capped allocation costs at least its even spread, which the solver
            # already weighed; so no cap can do better (and skipping saves ~0.1 ms a step).
            return plan
        base = rows + sum(float(np.sum(drafts[rid][3][:L])) for rid, L in fixed.items() if L)

        def call_ms(extra: int, depth: int) -> float:
            return shape.ms(rows + fixed_tokens + extra, rows, 1 + max(depth, fixed_deep), self._past)

        d = cap_depth(plan, live, call_ms, fixed_ms, base)
        return np.minimum(plan, d)

    @staticmethod
    def _marginal_survival(requests: int, admitted_sum: float, budget: int, table: np.ndarray,
                           draft_ms: float, span: int = 4) -> float:
        """The survival at which one more verified draft breaks even at this step's solution: the
        step's expected output per ms times the marginal cost of a verified token, averaged over `span`
        tokens. The runtime spans a layer of the call (one more token for each of its rows): with padding
        every layer deeper costs a jump that only a whole layer shares, and a solution sits at a layer's
        end whenever the rows verify alike, where a span of a few tokens would charge the next jump to
        them and stop every request drafting. Unlike the weakest admitted survival, this does not rise
        when the solver admits everything that was drafted, so drafting depth cannot ratchet down."""
        t = requests + budget
        cost = draft_ms + table_lookup(table, t)
        if cost <= 0:
            return 0.0
        rate = (requests + admitted_sum) / cost
        return max(0.0, rate * (table_lookup(table, t + span) - table_lookup(table, t)) / span)

    def _verify_table(self, extra_tokens: int, rows: int = 0) -> np.ndarray:
        """Verify cost by verified-token count, shifted by tokens other requests verify anyway.

        With a call-shape model the table is this step's: `rows` decode rows attending over this step's
        past, the extra tokens spread evenly over the rows (the least padding they can cost; the depth
        cap prices uneven depth). The profile's token table was measured with rows packed 8 tokens
        deep, so it charges each token a share of a row's cost that a fixed set of rows does not pay."""
        if self.cost is None:
            n = self.max_tokens_per_step + 1
            return np.arange(n, dtype=np.float64) + 1.0  # no profile: cost proportional to tokens
        shape = self.cost.call_shape
        if shape is not None and rows > 0:
            # As far as this step can reach (every row at full depth, plus the marginal span), not the
            # whole token range: this runs every step.
            n = min(self.max_tokens_per_step, extra_tokens + rows * (self.max_draft + 1) + 8) + 1
            grid = self._even_grid.get((n, rows))
            if grid is None:  # token counts and the longest row of their even spread: fixed per (n, rows)
                if len(self._even_grid) >= 256:
                    self._even_grid.clear()
                t = np.arange(n, dtype=np.float64)
                grid = self._even_grid[(n, rows)] = (t, 1.0 + np.ceil(np.maximum(t - rows, 0.0) / rows))
            t, longest = grid
            table = shape.table(t, rows, longest, self._past)
            table[0] = 0.0
        else:
            table = np.asarray(self.cost.verify_table(), dtype=np.float64)
        return table[extra_tokens:] if extra_tokens < len(table) - 1 else table[-2:]

    # ------------------------------------------------------------------ committing
    def _commit(self, r: Request, new: list[int], now: float) -> None:
        if r.finished:
            return
        new = new[:max(0, r.remaining())]
        reason = None
        stop = next((i for i, t in enumerate(new) if t in self.eos_ids), None) if r.config.stop_at_eos else None
        if stop is not None:
            new = new[:stop + 1]
            reason = "stop"
        if not r.stats.generated and new:
            r.stats.t_first = now
        r.tokens.extend(new)
        r.stats.generated += len(new)
        self.metrics.output_tokens += len(new)
        if r.pieces is not None and new:
            r.pieces.put(new)
        if r.config.stop and self._hit_stop_string(r):
            reason = "stop"
        if reason is None and r.remaining() <= 0:
            reason = "length"
        if reason is None and len(r.tokens) >= self.max_context:
            reason = "length"
        if reason:
            r.finish(reason)

    def _hit_stop_string(self, r: Request) -> bool:
        text = self.tokenizer.decode(r.generated_ids)
        return any(s and s in text for s in r.config.stop)

    def _release_finished(self) -> None:
        with self._lock:
            for i, r in enumerate(self.slots):
                if r is not None and r.finished:
                    self.slots[i] = None
                    self.metrics.requests_finished += 1


class _DepthPlan(NamedTuple):
    """A cached draft-depth plan of one batch shape (Runtime._plan_draft_steps)."""

    depth: int  # best draft depth by the cost model
    spec_vs_plain: float  # its best drafting rate over its plain rate
    steps_left: int  # steps it is used for before it is made again


def _pad_rows(rows: list, width: int) -> np.ndarray:
    out = np.zeros((len(rows), width), dtype=np.float64)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row[:width]
    return out


class _StepCost:
    """This step's costs in the shape the controller reads (a verify table and the draft time)."""

    def __init__(self, table: np.ndarray, draft_ms: float):
        self._table, self._draft_ms = table, draft_ms

    def verify_table(self) -> np.ndarray:
        return self._table

    def draft_ms(self, batch: int) -> float:
        return self._draft_ms


class QueueFullError(DsparkError):
    """The runtime's wait queue is full; the caller should retry later (HTTP 429)."""
