"""A simulated cost environment for the runtime: the real tiny engines' outputs (so drafts, acceptances and
greedy text are real), timed on a simulated clock by known true costs instead of the machine's.

``simulated(rt, monkeypatch, true_draft_ms, true_verify_ms)`` swaps the runtime's engines for ones that
advance the clock by the true cost of each call and points ``time.perf_counter`` at that clock, so every
measurement the runtime makes (call timings, step wall time) reads the true costs and
nothing else: no noise, no other tenant, the same result on every machine. A profile that differs from
the true costs (``profile_table``) is the starting point whose recovery the tests specify.
"""

from __future__ import annotations

import time

import numpy as np

from dspark_trt.runtime.costs.switch import SwitchPrice
from dspark_trt.runtime.costs.table import CostTable


class SimClock:
    def __init__(self):
        self.s = 1000.0

    def __call__(self) -> float:
        return self.s

    def advance_ms(self, ms: float) -> None:
        self.s += ms / 1e3


class CostedEngines:
    """The real backend's outputs; each call advances the clock by its true cost (ms) and is logged."""

    def __init__(self, real, clock: SimClock, draft_ms, verify_ms):
        self.real, self.clock, self.draft_ms, self.verify_ms = real, clock, draft_ms, verify_ms
        self.calls: list[tuple[str, int, int, float]] = []  # (kind, rows, tokens, ms)

    def __getattr__(self, name):
        return getattr(self.real, name)

    def _timed(self, kind, run, cost, feeds, past):
        out = run(feeds, past)
        rows, tokens = len(feeds["query_lens"]), int(feeds["tokens"].shape[0])
        ms = float(cost(rows, tokens))
        self.clock.advance_ms(ms)
        self.calls.append((kind, rows, tokens, ms))
        return out

    def run_draft(self, feeds, past):
        return self._timed("draft", self.real.run_draft, self.draft_ms, feeds, past)

    def run_target(self, feeds, past):
        return self._timed("verify", self.real.run_target, self.verify_ms, feeds, past)


def simulated(rt, monkeypatch, draft_ms, verify_ms, accept=None) -> CostedEngines:
    """Run rt's engine calls at these true costs (callables of (rows, tokens) -> ms) on a simulated clock;
    with `accept` (conditional acceptance by draft position) on FakePair engines instead of rt's own."""
    # Nothing is learned while the host caches are still being mapped (Runtime.step): a real thread whose
    # timing would otherwise decide how soon a simulated run starts learning (a CI run read the truth's rate
    # in test_cost_recovery 3% above its usual and failed a 0.93 bound).
    rt.wait_prefaulted()
    clock = SimClock()
    engines = CostedEngines(rt.backend if accept is None else FakePair(rt, accept), clock, draft_ms, verify_ms)
    rt.drafter.backend = rt.verifier.backend = engines
    rt.costs.switch = SwitchPrice(0.0, 1)  # these engines cost by shape alone: no switch of graphs to price
    monkeypatch.setattr(time, "perf_counter", clock)
    return engines


def submit_all_at_once(rt, prompts, config) -> list:
    """Submit every prompt before the worker's first step (it may step between separate submits, so which
    requests share a step, and which slot each takes, would depend on thread timing)."""
    with rt._lock:  # re-entrant: submit takes it too
        return [rt.submit(p, config) for p in prompts]


def generate_all_at_once(rt, prompts, config):
    """rt.generate, every request queued before the first step (on the simulated clock the runs must not
    depend on thread timing)."""
    reqs = submit_all_at_once(rt, prompts, config)
    for r in reqs:
        r.done.wait()
    return [rt.result(r, p) for r, p in zip(reqs, prompts)]


def profile_table(draft_ms, verify_ms, max_batch: int, max_tokens: int, rt) -> CostTable:
    """A cost profile (tables only) from cost functions of (rows, tokens): the draft table prices a call of
    b one-token rows, the verify table t tokens in rows of up to max_draft + 1, as the profiler measures."""
    per = rt.max_draft + 1
    d = [0.0] + [float(draft_ms(b, b)) for b in range(1, max_batch + 1)]
    v = [0.0] + [float(verify_ms(max(1, -(-t // per)), t)) for t in range(1, max_tokens + 1)]
    return CostTable(np.maximum.accumulate(v), np.maximum.accumulate(d)).tune(rt.tuning.drift)


def _unit(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A deterministic pseudo-random number in [0, 1) per (a, b) pair."""
    x = (a.astype(np.uint64) * np.uint64(2654435761) + b.astype(np.uint64) * np.uint64(40503) + np.uint64(12345))
    x ^= x >> np.uint64(13)
    x = x * np.uint64(0x5BD1E995) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(15)
    return (x & np.uint64(0xFFFFFF)).astype(np.float64) / float(1 << 24)


class FakePair:
    """Engines whose acceptance is known: the target's greedy next token is a fixed function of the last
    token; the draft proposes it at draft position k with probability ``accept[k]`` (given a pseudo-random
    draw of the token and its position), and reports exactly that as its confidence, so survivals are
    calibrated and only the costs can be wrong. Greedy text is the target's chain whatever is drafted."""

    name = "fake"

    def __init__(self, rt, accept):
        self.accept = np.asarray(accept, dtype=np.float64)
        self.vocab = rt.vocab
        m, d = rt.manifest["model"], rt.manifest["draft"]
        self._kv = {"target": (m["num_layers"], m["num_kv_heads"], m["head_dim"]),
                    "draft": (d["num_layers"], d["num_kv_heads"], d["head_dim"])}

    def next_token(self, t):
        return (np.asarray(t, dtype=np.int64) * 7 + 3) % (self.vocab - 2) + 1

    def _present(self, kind: str, n: int):
        layers, heads, dim = self._kv[kind]
        return [np.zeros((n, heads, dim), np.float32) for _ in range(2 * layers)]

    def run_draft(self, feeds, past):
        ends = np.cumsum(feeds["query_lens"]) - 1
        last, pos = feeds["tokens"][ends], feeds["positions"][ends]
        k = np.minimum(feeds["draft_position"], self.accept.size - 1)
        c = self.accept[k]
        right = self.next_token(last)
        token = np.where(_unit(last, pos) < c, right, right % (self.vocab - 2) + 1)
        survival = (feeds["prev_survival"].astype(np.float64) * c).astype(np.float32)
        probs = np.zeros((len(last), self.vocab), np.float32)
        return ({"draft_token": token, "survival": survival, "draft_probs": probs},
                self._present("draft", len(feeds["tokens"])))

    def run_target(self, feeds, past):
        toks, ql, vl = feeds["tokens"], feeds["query_lens"], feeds["verify_lens"]
        ends = np.cumsum(ql)
        accepted = np.zeros(len(ql), np.int64)
        nxt = np.zeros(len(ql), np.int64)
        for r, (end, L) in enumerate(zip(ends.tolist(), vl.tolist())):
            start = end - L - 1  # the token before the first draft
            a = 0
            while a < L and toks[start + a + 1] == self.next_token(toks[start + a]):
                a += 1
            accepted[r], nxt[r] = a, self.next_token(toks[start + a])
        return {"accepted": accepted, "next_token": nxt}, self._present("target", len(toks))
