"""Hindsight oracle for verify allocation: how close a run came to verifying only what was accepted.

Given a run's step log (``Runtime.metrics.step_log``: one record per engine step with ``verify_lens``,
``accepted`` and ``drafted`` per decode request, ``target_tokens`` and ``prefill_tokens``), the oracle
replays every step with perfect hindsight: each request drafts exactly the tokens that ended up accepted
and verifies exactly those, nothing more. It emits the same tokens in the same number of steps (the
accepted prefix plus the target's own token per request), so the only difference is cost. Both the
actual steps and the oracle's steps are priced with the same step-cost model:

    step cost = sum over draft calls k of draft_ms(requests still drafting at call k)
              + verify_ms(tokens in the target step)

where the draft of a step runs call k = 0, 1, ... over the requests that drafted more than k tokens, and
the target step processes every decode request's own token, its verified drafts and any prompt chunk.

    goodput fraction = oracle cost / actual cost          (<= 1 for non-decreasing cost tables)

A fraction of 1 means the policy wasted nothing under the model; 0.8 means 20% of the modelled step time
went to drafting or verifying tokens that were rejected. The oracle is conditioned on the observed
acceptances: when a request's whole verified window was accepted, a longer window might have been
accepted too, which the log cannot tell, so the oracle never verifies more than the policy did. The
draft's catch-up feeding (tokens it has not seen yet) is priced as part of the first draft call in both.

Everything here is a pure function of plain data (step records and cost tables given as arrays indexed by
size, or callables), so it is testable on hand-made logs.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

import numpy as np

__all__ = ["as_cost_fn", "draft_batches", "draft_cost", "step_costs", "oracle_goodput"]

def as_cost_fn(cost) -> Callable[[int], float]:
    """A cost table as a function of size. ``cost`` is a callable ``size -> ms`` or an array indexed by
    size (index 0 = 0 ms); sizes beyond the array are extrapolated linearly from its last two entries
    (as :class:`dspark_trt.runtime.costs.table.CostTable` does)."""
    if callable(cost):
        return lambda n: float(cost(int(n))) if n > 0 else 0.0
    table = np.asarray(cost, dtype=np.float64)
    if table.ndim != 1 or table.size < 2:
        raise ValueError(f"a cost table must be 1-D with entries for sizes 0 and 1; got shape {table.shape}")
    last = table.size - 1
    slope = float(table[-1] - table[-2]) if table.size >= 3 else 0.0

    def fn(n: int) -> float:
        n = int(n)
        if n <= 0:
            return 0.0
        if n <= last:
            return float(table[n])
        return float(table[-1] + (n - last) * slope)

    return fn


def draft_batches(drafted: Iterable[int]) -> list[int]:
    """Batch size of each sequential draft call when request r drafts ``drafted[r]`` tokens:
    call k runs over the requests with more than k drafted tokens. ``[3, 1, 0] -> [2, 1, 1]``."""
    d = np.asarray([int(x) for x in drafted], dtype=np.int64)
    if d.size == 0 or d.max() <= 0:
        return []
    if d.min() < 0:
        raise ValueError(f"drafted counts must be >= 0; got {d.tolist()}")
    return [int((d > k).sum()) for k in range(int(d.max()))]


def draft_cost(drafted: Iterable[int], draft_ms) -> float:
    """Modelled draft time of one step (sum over its draft calls)."""
    fn = as_cost_fn(draft_ms)
    return float(sum(fn(b) for b in draft_batches(drafted)))


def _check(record: Mapping) -> tuple[list[int], list[int], list[int], int, int]:
    vl = [int(x) for x in record.get("verify_lens", [])]
    acc = [int(x) for x in record.get("accepted", [])]
    dr = [int(x) for x in record.get("drafted", [0] * len(vl))]
    n = int(record.get("decode_requests", len(vl)))
    if not (len(vl) == len(acc) == len(dr) == n):
        raise ValueError(f"step record has {n} decode requests but {len(vl)} verify lengths, {len(acc)} "
                         f"accepted counts and {len(dr)} drafted counts")
    for a, L, d in zip(acc, vl, dr):
        if not 0 <= a <= L <= d:
            raise ValueError(f"step record needs 0 <= accepted <= verify_len <= drafted; got {a}, {L}, {d}")
    if "target_tokens" in record:
        tokens = int(record["target_tokens"])
    else:
        tokens = n + sum(vl) + int(record.get("prefill_tokens", 0))
    if tokens < n + sum(vl):
        raise ValueError(f"step record has {tokens} target tokens, fewer than its {n} decode tokens plus "
                         f"{sum(vl)} verified drafts")
    return vl, acc, dr, n, tokens


def step_costs(record: Mapping, verify_ms, draft_ms) -> tuple[float, float]:
    """(actual, oracle) modelled ms of one step record."""
    vf, df = as_cost_fn(verify_ms), as_cost_fn(draft_ms)
    vl, acc, dr, _, tokens = _check(record)
    actual = draft_cost(dr, df) + vf(tokens)
    oracle = draft_cost(acc, df) + vf(tokens - sum(vl) + sum(acc))
    return actual, oracle


def oracle_goodput(step_log: Iterable[Mapping], verify_ms, draft_ms) -> dict:
    """Goodput of a run relative to the hindsight oracle, under the given cost tables.

    Returns ``{"fraction", "actual_ms", "oracle_ms", "steps", "wasted_verify_tokens",
    "wasted_draft_tokens", "emitted_tokens"}``; ``fraction`` is ``oracle_ms / actual_ms`` (1.0 for a run
    with no modelled cost, None for an empty log). ``emitted_tokens`` counts accepted drafts plus one
    token per decode request (what both the run and the oracle emit from decode steps).
    """
    vf, df = as_cost_fn(verify_ms), as_cost_fn(draft_ms)
    actual = oracle = 0.0
    steps = wasted_v = wasted_d = emitted = 0
    for rec in step_log:
        vl, acc, dr, n, tokens = _check(rec)
        actual += draft_cost(dr, df) + vf(tokens)
        oracle += draft_cost(acc, df) + vf(tokens - sum(vl) + sum(acc))
        steps += 1
        wasted_v += sum(vl) - sum(acc)
        wasted_d += sum(dr) - sum(acc)
        emitted += n + sum(acc)
    if steps == 0:
        fraction = None
    else:
        fraction = oracle / actual if actual > 0 else 1.0
    return {"fraction": fraction, "actual_ms": actual, "oracle_ms": oracle, "steps": steps,
            "wasted_verify_tokens": wasted_v, "wasted_draft_tokens": wasted_d, "emitted_tokens": emitted}
