"""Learning from a finished step: survival correction outcomes, the recent output rate, what an
exploration cost, the unpriced step overhead by load, and the step's metrics.

Runs after commit, so the step's wall time it measures covers the whole step.
"""

from __future__ import annotations

import time

import numpy as np

from dspark_trt.runtime.explain import Explainer

__all__ = ["Learner"]


def _pad_rows(rows: list, width: int) -> np.ndarray:
    out = np.zeros((len(rows), width), dtype=np.float64)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row[:width]
    return out


class Learner:
    """Call order: ``learn(batch, depth, drafted, plan, result)`` once per step, last."""

    def __init__(self, max_draft: int, tuning, correction, costs, metrics, exploration=None):
        self.max_draft, self.tuning, self.correction, self.costs, self.metrics = (
            max_draft, tuning, correction, costs, metrics)
        self.exploration = exploration  # the depth planner's ExplorationSchedule, settled after exploring
        self._outcomes: list = []  # (raw survival row, verified, accepted) not yet learned from
        self.explainer = Explainer(tuning.explain_window, tuning.explain_tolerance,
                                   persist=tuning.explain_persist)

    def learn(self, batch, depth, drafted, plan, result) -> None:
        decode, drafts = batch.decode, drafted.drafts
        nd = len(decode)
        vl, accepted = result.verify_lens, result.accepted
        if self.correction is not None:
            # Outcomes are buffered and learned from every few steps: one vectorised update over more
            # rows instead of a numpy round per step.
            for i, r in enumerate(decode):
                if vl[i] > 0:
                    self._outcomes.append((drafts[r.id].survival, int(vl[i]), int(accepted[i])))
            if (len(self._outcomes) >= self.tuning.correction.observe_batch
                    or (self._outcomes and self.metrics.steps % self.tuning.cost_observe_every == 0)):
                rows, vls, accs = zip(*self._outcomes)
                self._outcomes.clear()
                self.correction.observe(_pad_rows(rows, self.max_draft), vls, accs)
        acc = [int(min(a, L)) for a, L in zip(accepted[:nd], vl[:nd])]
        predicted_ms = (plan.predicted_ms + result.prefill_model_ms) if plan.predicted_ms is not None else None
        wall_ms = (time.perf_counter() - batch.started) * 1e3
        self.metrics.log_step({
            "decode_requests": nd, "prefill_tokens": int(sum(n for _, n in result.chunked)),
            "verify_lens": vl[:nd].tolist(), "accepted": acc,
            "drafted": [len(drafts[r.id].tokens) if r.id in drafts else 0 for r in decode],
            "draft_ms": drafted.engine_ms, "target_ms": result.target_ms, "target_tokens": result.target_tokens,
            "target_calls": result.calls, "prompts_held": len(batch.held), "solver_us": plan.solver_us,
            "plain_check": depth.checking, "explore": depth.exploring,
            "predicted_accepted": plan.predicted_accepted, "predicted_ms": predicted_ms, "measured_ms": wall_ms})
        if decode and wall_ms > 0:
            self._rates(batch, depth, drafted, plan, result, wall_ms)
            self.metrics.record_prediction(plan.predicted_accepted, sum(acc), predicted_ms, wall_ms)
            if self.costs.learning:  # a slow machine's first seconds are no news about the profile
                self.explainer.record(plan.predicted_accepted, sum(acc), predicted_ms, wall_ms)
        self.metrics.record_step(wall_ms, drafted.engine_ms + result.target_ms, plan.solver_us, result.verified,
                                 len(result.order), sum(len(d.tokens) for d in drafts.values()))

    def _rates(self, batch, depth, drafted, plan, result, wall_ms: float) -> None:
        nd = len(batch.decode)
        vl, accepted = result.verify_lens, result.accepted
        costs, a = self.costs, self.tuning.rate_alpha
        emitted = nd + int(sum(min(x, L) for x, L in zip(accepted[:nd], vl[:nd])))
        rate = emitted / wall_ms
        costs.rate = rate if costs.rate == 0 else (1 - a) * costs.rate + a * rate
        costs.tau_row = emitted / nd if costs.tau_row == 0 else (1 - a) * costs.tau_row + a * emitted / nd
        if not costs.learning:  # timings not the machine's own (Costs.learning): nothing learned from them
            return
        if depth.exploring and self.exploration is not None:
            # Its whole cost, the draft catching up on what it skipped included (that is what exploring
            # costs, and the budget bounds it), but not the prompts that arrived: they come in lumps (a wave
            # of finishes, prefill batching) whether it explores or not.
            prefill_ms = (result.last_call_ms if result.calls > 1
                          else costs.prefill_share(result.query_lens, result.past_lens, nd))
            gain = sum(int(min(accepted[i], vl[i])) for i, r in enumerate(batch.decode) if r.mode.kind == "adaptive")
            confirmed = self.exploration.confirms(emitted - gain, nd, plan.predicted_accepted, gain, depth.plain_ms,
                                                  wall_ms - prefill_ms - drafted.catch_up_ms)
            self.exploration.settle(nd, depth.charged_ms, wall_ms - prefill_ms - depth.plain_ms, confirmed)
        unpriced = wall_ms - drafted.priced_ms - result.priced_ms - drafted.catch_up_ms - result.switch_ms
        costs.overhead.observe("spec" if drafted.drafts else "plain", nd, unpriced)
