"""Drafting: the draft model proposes tokens for the requests that speculate this step.

First the draft catches up on tokens it has not seen (a prompt, the previous verify's accepted tokens,
text generated while the request did not draft); then it drafts one token per call for every request
still drafting. An adaptive request continues only while its predicted next survival clears the last
solve's break-even survival, and a further call is made only if its expected surplus pays for its time.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from dspark_trt.runtime.batch import pack_queries, token_slots
from dspark_trt.runtime.costs.catch_up import CatchUpRate
from dspark_trt.runtime.request import Request
from dspark_trt.runtime.survival_correction import SurvivalCorrection

__all__ = ["Draft", "DraftRound", "Drafter", "draft_room", "drafting_rows"]


def draft_room(r: Request, max_context: int) -> int:
    """Drafts request r has room for: the target always adds one token, within its answer and the context."""
    return min(r.remaining() - 1, max_context - len(r.tokens) - 1)


def drafting_rows(decode: list[Request], steps: int, cap, only=None) -> list[Request]:
    """The rows that draft this step: fixed-K ones, and adaptive ones when the plan drafts (most steps at
    high load plan none: no per-row test then), each while cap(r, steps) leaves it room. only: the ids of
    the adaptive rows that draft (an exploration's, DepthPlan.rows); None: all of them."""
    return [r for r in decode
            if (r.mode.kind == "fixed" or (steps and r.mode.kind == "adaptive" and (only is None or r.id in only)))
            and cap(r, steps) > 0]


class Draft(NamedTuple):
    """One request's drafts of this step."""

    tokens: list[int]  # drafted tokens
    probs: list  # the draft's distribution per drafted token ([V] rows) for a sampling request; empty for greedy
    survival: np.ndarray  # survival per drafted token, as the head scored it
    corrected: list[float]  # survivals as the solver sees them (online-corrected)


class DraftRound(NamedTuple):
    """What drafting produced this step."""

    drafts: dict[int, Draft]  # by request id; requests that did not draft are absent
    engine_ms: float  # engine time of all draft calls (catch-up included)
    priced_ms: float  # full time of the drafting calls the cost tables price (feeds, engine, KV write)
    switch_ms: float  # time feeding the draft text generated while it did not draft (a switch's cost)
    prompt_ms: float = 0.0  # time feeding the draft new prompts (once per request that drafts, not per step)

    @property
    def catch_up_ms(self) -> float:
        """Time feeding the draft text it had not seen (a switch's catch-up and new prompts): not a step's cost."""
        return self.switch_ms + self.prompt_ms


class Drafter:
    """The classic autoregressive draft: one engine call per drafted position.

    Call order: ``draft(batch, depth, cost)`` once per step, ``observe(batch, result)`` after commit.
    runtime/phases/dspark_drafter.py is the other implementation of this interface.
    """

    sequential = True  # a draft depth of j costs j draft calls (the depth planner prices it so)
    spec_limit = None  # what bounds fixed:K in its refusal (None: the artifact's max draft length)

    def __init__(self, backend, kv, tuning, limits, controller, correction: SurvivalCorrection | None, costs, metrics):
        self.backend, self.kv, self.tuning = backend, kv, tuning
        self.max_draft, self.max_context, self.max_tokens_per_step = limits
        self.controller, self.correction, self.costs, self.metrics = controller, correction, costs, metrics
        self._priced_ms = 0.0
        self._timings: list[tuple[int, float, int]] = []  # this step's draft calls (batch, ms, past), fed back after drafting
        self.catch_up_rate = CatchUpRate()

    def move_slot(self, r: Request, src: int, dst: int) -> None:
        """Request r moves from slot src to dst (admission.py's compaction): its draft cache goes with it."""
        self.kv.move(src, dst, r.draft_len)

    def cap(self, r: Request, depth: int) -> int:
        """Most tokens request r drafts this step."""
        k = r.mode.k if r.mode.kind == "fixed" else min(self.max_draft, depth)
        return max(0, min(k, draft_room(r, self.max_context)))

    def draft(self, batch, depth, cost) -> DraftRound:
        spec = drafting_rows(batch.decode, depth.steps, self.cap, depth.rows)
        if not spec:
            return DraftRound({}, 0.0, 0.0, 0.0)
        return self.run(spec, depth.steps, stop_early=not depth.exploring)

    def observe(self, batch, result) -> None:
        """After commit: nothing to do, the classic draft catches up on committed tokens when it drafts."""

    def catch_up_ms(self, reqs) -> float:
        """Modelled ms of feeding the draft what `reqs` hold that it has not seen, but for the one token a
        request feeds in its drafting call."""
        behind = sum(max(0, len(r.tokens) - r.draft_len - 1) for r in reqs)
        return self.catch_up_rate.ms(behind, self._token_ceiling())

    def _token_ceiling(self) -> float | None:
        """The most a catch-up token is priced at: twice what one more row costs a drafting call (the cost
        table's slope). Feeding a token costs about a row's work (measured: 0.3-0.8x of it), so a rate far
        above this was timed cold: a server's first catch-up, its caches still being mapped, cost 13x the
        slope, and priced every later one out of reach (adaptive never explored, so never drafted again)."""
        table = self.costs.table
        if table is None or table.max_batch < 2:
            return None
        n = table.max_batch
        return 2.0 * max(0.0, float(table.draft_ms(n) - table.draft_ms(1))) / (n - 1)

    def prepare_call(self, batch: int, past: int):
        """A zero-argument function making one drafting call of `batch` rows at `past` cached tokens
        (engine call plus the KV write), as the cost profile times it (costs/profiling.py)."""
        feeds = pack_queries([[1]] * batch, [past] * batch, list(range(batch)))
        feeds.update(temperature=np.zeros(batch, np.float32), uniforms=np.full(batch, 0.5, np.float32),
                     prev_survival=np.ones(batch, np.float32), draft_position=np.zeros(batch, np.int64))
        cache = self.kv.past(past)

        def call() -> None:
            _, present = self.backend.run_draft(feeds, cache)
            self.kv.write(present, feeds["positions"], token_slots(feeds))
        return call

    def run(self, reqs: list[Request], depth: int, stop_early: bool = True) -> DraftRound:
        """Catch the draft up, then draft for `reqs` (up to `depth` tokens for adaptive ones; stop_early:
        adaptive ones stop once another draft would not pay, keep_drafting; else, exploring, all `depth`)."""
        self._priced_ms = 0.0
        caps = {r.id: self.cap(r, depth) for r in reqs}
        engine_ms, switch_ms, prompt_ms = self._catch_up(reqs)
        toks = {r.id: [] for r in reqs}
        probs = {r.id: [] for r in reqs}
        surv = {r.id: [] for r in reqs}
        # A sampled request's drafts must not decide whether other requests draft on: their extra slots
        # would then compete for the budget depending on the sampled tokens, and "verify x_k" would depend
        # on x_k. So the call test counts sampled adaptive requests by their caps, known before drafting.
        sampled_caps = [caps[r.id] for r in reqs if r.sampling and r.mode.kind == "adaptive"]
        current = list(reqs)
        queries = [r.tokens[r.draft_len:] for r in current]
        prev = {r.id: 1.0 for r in reqs}
        # Survivals as the solver will see them (online-corrected), kept up as drafting goes.
        shifts = self.correction.active_shifts() if self.correction is not None else None
        slope = self.correction.active_slope() if self.correction is not None else 1.0
        corr = {r.id: [] for r in reqs}
        k = 0
        while current:
            outs, ms = self.run_draft(current, queries, [prev[r.id] for r in current], [k] * len(current))
            engine_ms += ms
            nxt, nq = [], []
            # Plain lists: indexing numpy per request per call costs more than the bookkeeping itself.
            drafted, survivals, dist = outs["draft_token"].tolist(), outs["survival"].tolist(), outs.get("draft_probs")
            for i, r in enumerate(current):
                rid = r.id
                r.draft_len += len(queries[i])
                t, s = drafted[i], survivals[i]
                toks[rid].append(t)
                if r.sampling:  # greedy acceptance never reads the draft's distribution
                    probs[rid].append(dist[i])
                surv[rid].append(s)
                cr = corr[rid]
                cr.append(SurvivalCorrection.corrected_next(shifts, k, prev[rid], s, cr[-1] if cr else 1.0, slope))
                prev[rid] = s
                if len(toks[rid]) < caps[rid]:
                    nxt.append(r)
                    nq.append([t])
            if stop_early:
                keep = self.keep_drafting([r for r in nxt if r.mode.kind == "adaptive"], corr, k + 1,
                                          test_call=not any(r.mode.kind != "adaptive" for r in nxt),
                                          sampled_caps=sampled_caps)
                nq = [q for r, q in zip(nxt, nq) if r.mode.kind != "adaptive" or r.id in keep]
                nxt = [r for r in nxt if r.mode.kind != "adaptive" or r.id in keep]
            # Tokens fed this call are in the draft cache only provisionally: roll back to the committed
            # prefix; commit advances draft_len by what the target accepts.
            current, queries = nxt, nq
            k += 1
        for r in reqs:
            r.draft_len = len(r.tokens)
            r.draft_rounds += 1
        # Fed back once the step's drafting is done: each feed invalidates the corrected draft table,
        # which the draft loop reads between calls.
        for b, ms, past in self._timings:
            self.costs.table.observe_draft(b, ms, past)
        self._timings.clear()
        out = {r.id: Draft(toks[r.id], probs[r.id], np.asarray(surv[r.id], dtype=np.float32), corr[r.id])
               for r in reqs}
        for r in reqs:
            r.stats.drafted_tokens += len(toks[r.id])
        return DraftRound(out, engine_ms, self._priced_ms, switch_ms, prompt_ms)

    def _catch_up(self, reqs: list[Request]) -> tuple[float, float, float]:
        """Feed tokens the draft has not seen; returns (engine ms, ms of it that is a switch's cost, ms of
        it that is new prompts).

        A drafting step itself catches up at most max_draft + 1 tokens a request; anything longer (a
        prompt, the text generated while the request did not draft) is fed first, in calls of only the
        requests that are that far behind: in the drafting call every row would be padded to it
        (models/decoder.py), which costs far more than the extra call of the small draft model."""
        limit = self.max_draft + 1
        engine_ms = switch_ms = prompt_ms = 0.0
        while True:
            behind = {r.id: len(r.tokens) - r.draft_len for r in reqs}
            far = [r for r in reqs if behind[r.id] > limit]
            if not far and sum(behind.values()) <= self.max_tokens_per_step:
                break
            group, used = [], 0
            for r in sorted(far or reqs, key=lambda r: -behind[r.id]):
                c = min(behind[r.id] - 1, self.tuning.prefill_chunk)  # keep one token for the drafting call
                if c > 0 and used + c <= self.max_tokens_per_step:
                    group.append((r, c))
                    used += c
            if not group:
                break
            qs = [r.tokens[r.draft_len:r.draft_len + c] for r, c in group]
            t = time.perf_counter()
            _, ms = self.run_draft([r for r, _ in group], qs, [1.0] * len(group), [0] * len(group), observe=False,
                                   need_probs=False)
            engine_ms += ms
            # Neither share is the steady state the planner models, so both stay out of the step overhead:
            # a new prompt is paid once by each request that drafts at all (a burst of arrivals made the
            # first drafting steps look 20x dearer than they are), the text generated while a request did
            # not draft once per switch into drafting.
            fed = sum(c for _, c in group)
            ms = (time.perf_counter() - t) * 1e3
            if self.costs.learning:
                self.catch_up_rate.observe(fed, ms)
            switch_ms += ms * sum(c for r, c in group if r.stats.steps > 1) / fed
            prompt_ms += ms * sum(c for r, c in group if r.stats.steps <= 1) / fed
            for r, c in group:
                r.draft_len += c
        return engine_ms, switch_ms, prompt_ms

    def keep_drafting(self, reqs: list[Request], corrected: dict, drafted: int, test_call: bool = True,
                      sampled_caps=()) -> set:
        """Adaptive requests worth another draft step, by marginal value.

        A drafted token pays only if the solver admits it, i.e. if its survival clears theta, the
        break-even survival of the last solve (solver.marginal_survival, in corrected units). The next
        token's survival is predicted as S_k times the running profile's conditional acceptance at k+1,
        and a request keeps drafting iff that clears theta * stop_factor. With test_call the call itself
        is made only if the expected surplus sum (S_pred - theta) is worth its time at the runtime's
        recent output rate (tokens per ms); without (fixed-K requests draft anyway) only the per-request
        test applies. Sampled requests take part in the call test by what is known before drafting: each
        of `sampled_caps` (their caps) above `drafted` counts the running profile's survival at the next
        position, and one row of the call; their own drafts never decide whether the others draft on.
        Stopping rules that look only at positions <= k keep sampling lossless.
        """
        if not reqs:
            return set()
        conds = self.controller.conditional_acceptance(self.max_draft)
        cond = conds[drafted] if drafted < len(conds) else 0.0
        theta = self.costs.break_even
        bar = theta * self.tuning.stop_factor
        keep, surplus, rows = set(), 0.0, 0
        for r in reqs:
            p = corrected[r.id][-1] * cond
            if p >= bar:
                keep.add(r.id)
                if not r.sampling:
                    rows += 1
                    surplus += max(0.0, p - theta)
        table, rate = self.costs.table, self.costs.rate
        if keep and self.tuning.call_test and test_call and table is not None and rate > 0:
            sampled = sum(1 for cap in sampled_caps if cap > drafted)  # caps <= max_draft: prior[drafted] exists
            if sampled:
                surplus += sampled * max(0.0, float(self.controller.prior_row(self.max_draft)[drafted]) - theta)
            past = max(r.draft_len for r in reqs)
            if surplus < rate * table.draft_ms(max(1, rows + sampled), past=past):
                return set()
        return keep

    def run_draft(self, reqs, queries, prev_survival, positions, observe: bool = True, need_probs: bool = True):
        """One draft call; returns (outputs, engine ms). observe: a drafting call the cost tables price;
        need_probs: the caller may read draft_probs of sampling rows (catch-up calls read nothing).

        A call with no sampling row (or whose outputs are not read) runs the all-greedy graph when the
        artifact has one: it neither builds nor returns the [R, V] distribution."""
        t0 = time.perf_counter()
        feeds = pack_queries(queries, [r.draft_len for r in reqs], [r.slot for r in reqs])
        greedy = getattr(self.backend, "has_greedy_draft", False) and \
            not (need_probs and any(r.sampling for r in reqs))
        if not greedy:
            feeds["temperature"] = np.asarray([r.config.temperature for r in reqs], dtype=np.float32)
            feeds["uniforms"] = np.asarray([r.draft_draw(k) for r, k in zip(reqs, positions)], dtype=np.float32)
        feeds["prev_survival"] = np.asarray(prev_survival, dtype=np.float32)
        feeds["draft_position"] = np.asarray(positions, dtype=np.int64)
        t = time.perf_counter()
        run = self.backend.run_draft_greedy if greedy else self.backend.run_draft
        outs, present = run(feeds, self.kv.past(int(feeds["past_lens"].max())))
        ms = (time.perf_counter() - t) * 1e3
        self.kv.write(present, feeds["positions"], token_slots(feeds))
        if observe:
            full = (time.perf_counter() - t0) * 1e3
            self._priced_ms += full
            if self.costs.table is not None and self.costs.observing:
                # The full call (feeds, engine, KV write): on a CPU the part outside the engine is a
                # sizeable share of a small draft call, and the planner must weigh what it really costs.
                self._timings.append((len(reqs), full, int(feeds["past_lens"].max())))
        return outs, ms
