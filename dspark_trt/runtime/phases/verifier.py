"""Verification: one target step over the packed batch, decode verifications and prompt chunks together.

Decode rows come first (the last token plus the drafts each verifies), prompt chunks fill the rest of
the step's token budget. Prompt chunks get a call of their own when padding every decode row to the
chunk's length would cost more than a second call (costs/call_shape.py); that call then runs first, before
the decode rows draft (``prompts_ahead``), so a prompt's first token waits for neither their drafting nor
their verification.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from dspark_trt.runtime.batch import pack_queries, token_slots, verify_rows, zero_rows
from dspark_trt.runtime.costs.call_shape import packed_shape
from dspark_trt.runtime.request import Request

__all__ = ["PromptsAhead", "VerifyResult", "Verifier", "prompt_chunks"]


class VerifyResult(NamedTuple):
    """What the target's step returned, rows in `order`: decode requests first, then prompt chunks."""

    order: list[Request]
    chunked: list[tuple[Request, int]]  # prompt chunks fed: (request, tokens)
    verify_lens: np.ndarray  # drafts verified per row
    accepted: np.ndarray  # drafts accepted per row
    next_token: np.ndarray  # the target's token per row
    query_lens: list[int]  # tokens fed per row
    past_lens: list[int]  # cached tokens per row before the step
    calls: int  # target calls made (2 when the prompt chunks got their own)
    last_call_ms: float  # engine ms of the last call (the prompt chunks' own, when they got one)
    target_ms: float  # engine ms of all target calls
    target_tokens: int  # tokens fed to the target
    verified: int  # rows the acceptance ops scored
    priced_ms: float  # full time of the target calls (feeds, engine, KV write)
    prefill_model_ms: float = 0.0  # the cost model's ms for the prompt chunks (their own call or their share)
    aux: list | None = None  # per row, the target's aux_hidden of its fed tokens (graphs that have it: DSpark)
    switch_ms: float = 0.0  # time bringing a decode graph's cache copy up to date (a switch's cost, not priced)
    prompts_committed: bool = False  # the prompt chunks ran ahead and their tokens are committed already


class PromptsAhead(NamedTuple):
    """The step's prompt chunks, fed in a call of their own before the decode rows drafted."""

    chunked: list[tuple[Request, int]]  # (request, tokens)
    queries: list[list[int]]
    past_lens: list[int]
    outs: dict  # the call's outputs
    ms: float  # engine ms
    tokens: int
    full: float  # full ms (feeds, engine, KV write)
    synced: float  # ms of it syncing a cache copy
    verified: int  # rows the acceptance ops scored


def prompt_chunks(prefill, budget: int, chunk: int) -> list:
    """(request, tokens) of the prompt chunks a step feeds: each up to `chunk` tokens, in order, within the
    `budget` of tokens the decode rows leave."""
    out = []
    for r in prefill:
        n = min(r.uncached, chunk, budget)
        if n <= 0:
            break
        out.append((r, n))
        budget -= n
    return out


def chunk_queries(chunked) -> list[list[int]]:
    """The tokens each prompt chunk feeds: its request's next uncached ones."""
    return [r.tokens[r.target_len:r.target_len + n] for r, n in chunked]


class Verifier:
    """Call order: ``run(batch, drafted, plan)`` once per step."""

    def __init__(self, backend, kv, tuning, limits, costs, metrics):
        self.backend, self.kv, self.tuning, self.costs, self.metrics = backend, kv, tuning, costs, metrics
        self.vocab, self.max_tokens_per_step, self.query_len_max = limits
        self.chunk = min(tuning.prefill_chunk, self.query_len_max)  # most prompt tokens of a request in one call
        self._zeros: np.ndarray | None = None  # see _zero_probs
        self._graph, self._same = None, 0  # the graph of the last target call, and its calls before in a row
        self._graphs_called: set = set()  # by this runtime (a graph's first call teaches nothing: _call)
        self._prompts = False  # the last target call fed a prompt chunk

    def prompts_ahead(self, batch) -> PromptsAhead | None:
        """Feed the step's prompt chunks now, in a call of their own, when they would get one anyway (packing
        them among the decode rows costs more, decode rows priced at one token each: drafts only widen
        them); None otherwise (no chunk, no decode row, or packing is cheaper: they go with the verify call)."""
        if not (batch.prefill and batch.decode):
            return None
        nd = len(batch.decode)
        chunked = prompt_chunks(batch.prefill, self.max_tokens_per_step - nd, self.chunk)
        if not chunked:
            return None
        queries = chunk_queries(chunked)
        past_lens = [r.target_len for r, _ in chunked]
        if not self.costs.split_prefill([1] * nd, [r.target_len for r in batch.decode], [n for _, n in chunked],
                                        past_lens):
            return None
        outs, ms, tokens, m, full, synced = self._call([r for r, _ in chunked], queries, past_lens,
                                                       [0] * len(chunked), {}, False, True)
        return PromptsAhead(chunked, queries, past_lens, outs, ms, tokens, full, synced, m)

    def run(self, batch, drafted, plan, ahead: PromptsAhead | None = None) -> VerifyResult | None:
        """The target step; None when nothing was fed (no decode row and no room for a prompt chunk).
        ahead: the step's prompt chunks, already fed (prompts_ahead)."""
        decode, drafts, lengths = batch.decode, drafted.drafts, plan.lengths
        queries, vlens = [], []
        budget = self.max_tokens_per_step
        for r in decode:
            L = lengths.get(r.id, 0)
            q = [r.tokens[-1]] + drafts[r.id].tokens[:L] if L else [r.tokens[-1]]
            queries.append(q)
            vlens.append(L)
            budget -= len(q)
        if ahead is None:
            chunked = prompt_chunks(batch.prefill, budget, self.chunk)
            queries += chunk_queries(chunked)
        else:
            chunked = ahead.chunked
            queries += ahead.queries
        vlens += [0] * len(chunked)
        order = decode + [r for r, _ in chunked]
        if not order:
            return None
        nd = len(decode)
        query_lens = [len(q) for q in queries]
        # (fed ahead: their pasts before that call)
        past_lens = [r.target_len for r in decode] + (ahead.past_lens if ahead is not None
                                                       else [r.target_len for r, _ in chunked])
        groups = [range(len(order))]
        if ahead is not None or (nd and chunked and self.costs.split_prefill(
                query_lens[:nd], past_lens[:nd], query_lens[nd:], past_lens[nd:])):
            groups = [range(nd), range(nd, len(order))]
        accepted = np.zeros(len(order), dtype=np.int64)
        next_tok = np.zeros(len(order), dtype=np.int64)
        target_ms, target_tokens, verified, priced = 0.0, 0, 0, 0.0
        aux = None
        switch = 0.0
        for g in groups:
            if ahead is not None and g.start == nd:
                outs, ms, tokens, m, full, synced = (ahead.outs, ahead.ms, ahead.tokens, ahead.verified, ahead.full,
                                                     ahead.synced)
            else:
                # a prompt chunk packed among decode rows (the rows before nd): its padding shows (call_shape.py)
                outs, ms, tokens, m, full, synced = self._call([order[i] for i in g], [queries[i] for i in g],
                                                               [past_lens[i] for i in g], [vlens[i] for i in g],
                                                               drafts, g.start < nd < g.stop, g.stop > nd)
            accepted[g.start:g.stop] = outs["accepted"]
            next_tok[g.start:g.stop] = outs["next_token"]
            if "aux_hidden" in outs:
                aux = aux or [None] * len(order)
                aux[g.start:g.stop] = np.split(outs["aux_hidden"], np.cumsum(query_lens[g.start:g.stop])[:-1])
            target_ms += ms
            target_tokens += tokens
            verified += m
            priced += full
            switch += synced
        prefill_model = 0.0
        if chunked and self.costs.shape is not None:
            prefill_model = (self.costs.shape.ms(*packed_shape(query_lens[nd:], past_lens[nd:])) if len(groups) > 1
                             else self.costs.prefill_share(query_lens, past_lens, nd))
        return VerifyResult(order, chunked, np.asarray(vlens, dtype=np.int64), accepted, next_tok, query_lens,
                            past_lens, len(groups), ms, target_ms, target_tokens, verified, priced, prefill_model,
                            aux, switch, ahead is not None)

    def _call(self, order: list[Request], queries: list[list[int]], past_lens: list[int], vlens: list[int],
              drafts: dict, chunk_among: bool = False, prompts: bool = False):
        """One target call over these rows; returns (outputs, engine ms, tokens, verified rows, full ms, ms of it
        spent syncing a cache copy). chunk_among: the call packs a prompt chunk among decode rows (observed
        every time); prompts: it feeds a prompt chunk."""
        tv = time.perf_counter()  # the call's full cost: feeds, engine, KV write (a cache copy's sync aside)
        synced = getattr(self.kv, "sync_ms", 0.0)  # a MirroredKVCache's running total
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
                d = drafts[r.id]
                draft_tokens[row:row + L] = d.tokens[:L]
                if r.sampling:  # greedy acceptance never reads the draft's distribution
                    draft_probs[row:row + L] = d.probs[:L]
            if r.sampling:
                accept_u[row:row + L] = r.accept_draws(L)
                sample_u[i] = r.sample_draw()
            row += L + 1
        feeds.update(draft_tokens=draft_tokens, draft_probs=draft_probs, temperature=temps,
                     accept_uniforms=accept_u, sample_uniforms=sample_u)
        te = time.perf_counter()
        outs, present = self.backend.run_target(feeds, self.kv.past(max(past_lens)))
        ms = (time.perf_counter() - te) * 1e3
        # A call within tuning.settle_calls of a switch of graphs (backends that have several say which ran)
        # takes a switch's price, not its own: the call-shape model does not learn from it.
        graph = getattr(self.backend, "last_graph", None)  # this call's: run_target just ran
        self._same = self._same + 1 if graph == self._graph else 0
        self._graph = graph
        settled = self._same >= self.tuning.settle_calls
        # A graph's first call in this runtime pays its one-time set-up (a fresh process's first prompt took
        # 31.6 ms where the next took 10): it teaches nothing. Learned, it priced verifying at 1 request
        # ~1.6x too dear (3.4 against 2.0 ms), and one fresh start in three decoded its first request plainly.
        first = graph not in self._graphs_called
        self._graphs_called.add(graph)
        self.kv.write(present, feeds["positions"], token_slots(feeds))
        tokens = int(feeds["tokens"].shape[0])
        synced = getattr(self.kv, "sync_ms", 0.0) - synced
        full = (time.perf_counter() - tv) * 1e3 - synced
        table = self.costs.table
        shape = table.call_shape if table is not None else None
        learning = shape is not None and self.costs.learning and not first
        call = packed_shape([len(q) for q in queries], past_lens) if learning else None
        switch = self.costs.switch
        if learning and (self._same == 0 or switch.listening):
            # Before the call teaches the model: its excess over the model is the switch's price.
            _, rows, longest, past = call
            switch.observe(self._same, longest == 1,
                           not prompts and not (self._same == 0 and self._prompts) and shape.observed(rows, longest == 1),
                           full - shape.ms(*call), synced, shape.ms(rows, rows, 1, past))
        self._prompts = prompts
        if table is not None and self.costs.observing and not first:
            # The full call, not just the engine: the solver trades real milliseconds, and feeds and KV
            # writes grow with the tokens verified too.
            table.observe_verify(tokens, full)
        if learning:
            # Every call, unlike the tables (a feed rebuilds them): a few float operations, and at 64 requests
            # a bench run makes ~100 calls of full width, of which one in cost_observe_every taught the
            # plain and verify offsets too little to tell plain from drafting.
            shape.observe(*call, full, chunk_among, settled=settled)
        return outs, ms, tokens, int(m), full, synced

    def _zero_probs(self, rows: int) -> np.ndarray:
        """A [rows, V] block of zeros, the draft distribution of greedy rows (greedy acceptance never reads
        it; nothing writes to it). Kept between steps: a fresh one each step is megabytes the engine first
        pages in. A ZeroRows, so a device backend zeroes its buffer rather than copying it over (at
        V = 128256 and 512 rows, 262 MB a step). (Not flagged read-only: torch.from_numpy warns on
        read-only arrays.)"""
        if self._zeros is None or self._zeros.shape[0] < rows:
            grown = 2 * (0 if self._zeros is None else self._zeros.shape[0])
            self._zeros = zero_rows((max(rows, grown), self.vocab))
        return self._zeros[:rows]
