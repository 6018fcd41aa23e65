"""Runtime counters for benchmarks and serving (read them; the runtime writes them)."""

from __future__ import annotations

import threading
import time
from collections import deque


class Metrics:
    def __init__(self, max_draft: int):
        self._lock = threading.Lock()
        self.max_draft = max_draft
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.step_ms = 0.0
        self.engine_ms = 0.0
        self.solver_us = 0.0
        self.verified_tokens = 0
        self.drafted_tokens = 0
        self.batch_requests = 0
        self.output_tokens = 0
        self.requests_finished = 0
        self.queue_depth = 0
        self.accepted_per_position = [0] * self.max_draft
        self.verified_per_position = [0] * self.max_draft
        self.budget_hist: dict[int, int] = {}
        self.last_step_ms = 0.0
        # Predicted vs measured (runtime/explain.py): expected vs accepted drafts over every step with
        # decode rows; modelled vs measured step ms over those with a cost profile.
        self.predicted_accepted = 0.0
        self.accepted = 0
        self.predicted_step_ms = 0.0
        self.measured_step_ms = 0.0
        self.last_engine_ms = 0.0
        # Per-step records for offline analysis (hindsight oracle, budgets): bounded.
        self.step_log: deque = deque(maxlen=200_000)
        # (perf_counter at the end of each step, output tokens so far): throughput over any window.
        self.timeline: deque = deque(maxlen=200_000)

    def log_step(self, record: dict) -> None:
        with self._lock:
            self.step_log.append(record)

    def record_acceptance(self, verify_len: int, accepted: int) -> None:
        with self._lock:
            for k in range(verify_len):
                self.verified_per_position[k] += 1
                if k < accepted:
                    self.accepted_per_position[k] += 1

    def record_step(self, wall_ms: float, engine_ms: float, solver_us: float, verified: int, requests: int,
                    drafted: int) -> None:
        with self._lock:
            self.steps += 1
            self.step_ms += wall_ms
            self.engine_ms += engine_ms
            self.solver_us += solver_us
            self.verified_tokens += verified
            self.drafted_tokens += drafted
            self.batch_requests += requests
            budget = verified - requests
            self.budget_hist[budget] = self.budget_hist.get(budget, 0) + 1
            self.last_step_ms, self.last_engine_ms = wall_ms, engine_ms
            self.timeline.append((time.perf_counter(), self.output_tokens))

    def record_prediction(self, predicted_accepted: float, accepted: int, predicted_ms: float | None,
                          measured_ms: float) -> None:
        with self._lock:
            self.predicted_accepted += predicted_accepted
            self.accepted += accepted
            if predicted_ms is not None:
                self.predicted_step_ms += predicted_ms
                self.measured_step_ms += measured_ms

    def snapshot(self) -> dict:
        with self._lock:
            steps = max(1, self.steps)
            acc = [a / v if v else 0.0 for a, v in zip(self.accepted_per_position, self.verified_per_position)]
            return {
                "steps": self.steps,
                "output_tokens": self.output_tokens,
                "requests_finished": self.requests_finished,
                "queue_depth": self.queue_depth,
                "verified_tokens": self.verified_tokens,
                "drafted_tokens": self.drafted_tokens,
                "verified_tokens_per_step": self.verified_tokens / steps,
                "budget_per_step": (self.verified_tokens - self.batch_requests) / steps,
                "requests_per_step": self.batch_requests / steps,
                "acceptance_per_position": acc,
                "accepted_per_position": list(self.accepted_per_position),
                "verified_per_position": list(self.verified_per_position),
                "step_ms_total": self.step_ms,
                "engine_ms_total": self.engine_ms,
                "solver_us_per_step": self.solver_us / steps,
                "step_ms_mean": self.step_ms / steps,
                "overhead_frac": (self.step_ms - self.engine_ms) / self.step_ms if self.step_ms else 0.0,
                "predicted_accepted": self.predicted_accepted,
                "accepted": self.accepted,
                "predicted_step_ms": self.predicted_step_ms,
                "measured_step_ms": self.measured_step_ms,
            }
