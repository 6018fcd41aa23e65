"""One request's state inside the runtime."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from dspark_trt.runtime.config import GenerationConfig, SpecMode
from dspark_trt.runtime.draws import RequestDraws


@dataclass
class RequestStats:
    steps: int = 0  # verify steps after the prompt was processed
    generated: int = 0
    verified_tokens: int = 0
    drafted_tokens: int = 0
    # Predicted vs measured over the steps this request decoded in (runtime/explain.py): expected accepted
    # drafts (its survivals over its verified slots) vs accepted; the steps' modelled ms (with a cost
    # profile) vs their wall time up to their commit.
    predicted_accepted: float = 0.0
    accepted: int = 0
    predicted_step_ms: float = 0.0
    measured_step_ms: float = 0.0
    accepted_per_position: list = field(default_factory=list)  # times draft position k was accepted
    verified_per_position: list = field(default_factory=list)  # times draft position k was verified
    t_submit: float = 0.0
    t_admit: float = 0.0  # when it got a batch slot
    t_first: float = 0.0
    t_end: float = 0.0

    def to_dict(self) -> dict:
        dec = max(1, self.steps)
        acc = [a / v if v else 0.0 for a, v in zip(self.accepted_per_position, self.verified_per_position)]
        elapsed = max(1e-9, self.t_end - self.t_submit) if self.t_end else 0.0
        decode_time = max(1e-9, self.t_end - self.t_first) if self.t_end and self.t_first else 0.0
        return {
            "steps": self.steps,
            "generated_tokens": self.generated,
            "tau": (self.generated - 1) / dec if self.steps else 0.0,
            "accepted_per_position": acc,
            "accepted_counts": list(self.accepted_per_position),
            "verified_counts": list(self.verified_per_position),
            "verified_tokens": self.verified_tokens,
            "drafted_tokens": self.drafted_tokens,
            "predicted_accepted": self.predicted_accepted,
            "accepted": self.accepted,
            "predicted_step_ms": self.predicted_step_ms,
            "measured_step_ms": self.measured_step_ms,
            "tokens_per_s": self.generated / elapsed if elapsed else 0.0,
            "decode_tokens_per_s": (self.generated - 1) / decode_time if decode_time and self.generated > 1 else 0.0,
            "time_to_first_token_s": (self.t_first - self.t_submit) if self.t_first else None,
            "queue_wait_s": (self.t_admit - self.t_submit) if self.t_admit else None,
            "latency_s": elapsed,
        }


@dataclass
class Request:
    id: int
    prompt_ids: list[int]
    config: GenerationConfig
    mode: SpecMode
    max_draft: int
    tokens: list[int] = field(default_factory=list)
    slot: int = -1
    target_len: int = 0
    draft_len: int = 0
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    cancelled: bool = False
    stats: RequestStats = field(default_factory=RequestStats)
    done: threading.Event = field(default_factory=threading.Event)
    pieces: "queue.Queue | None" = None  # committed token ids for streaming, None when not streaming
    delivered: list = field(default_factory=list)  # perf_counter of each put on `pieces` (exact delivery times)
    prefill_wait: int = 0  # steps its prompt has waited to share a prefill call (prefill_batching.py)

    def __post_init__(self):
        self.tokens = list(self.prompt_ids)
        # Uniform draws come from per-request streams indexed by what they decide, so a request's sample
        # depends on its own seed and verify lengths, never on its batch neighbours, and no draw is
        # ever used twice: acceptance tests by generated-token offset (a step consumes offsets up to its
        # first rejection and the next step starts after it); draft and residual/bonus draws by counters.
        # The streams are generated as they are read (draws.py): nothing here grows with max_new_tokens.
        self.uniforms = RequestDraws(self.config.seed, self.max_draft) if self.sampling else None
        self.sample_draws = 0
        self.draft_rounds = 0
        self.stats.accepted_per_position = [0] * self.max_draft
        self.stats.verified_per_position = [0] * self.max_draft
        self.stats.t_submit = time.perf_counter()

    @property
    def generated_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    @property
    def sampling(self) -> bool:
        return self.config.temperature > 0

    def accept_draws(self, count: int) -> np.ndarray:
        if self.uniforms is None:
            return np.zeros(count, dtype=np.float32)
        return self.uniforms.accept.take(self.stats.generated, count)

    def sample_draw(self) -> float:
        if self.uniforms is None:
            return 0.0
        u = self.uniforms.sample.take(self.sample_draws, 1)[0]
        self.sample_draws += 1
        return float(u)

    def draft_draw(self, k: int) -> float:
        if self.uniforms is None:
            return 0.5
        return float(self.uniforms.draft.row(self.draft_rounds)[k])

    @property
    def uncached(self) -> int:
        return len(self.tokens) - self.target_len

    def remaining(self) -> int:
        return self.config.max_new_tokens - self.stats.generated

    def finish(self, reason: str, error: str | None = None) -> None:
        self.finished, self.finish_reason, self.error = True, reason, error
        self.stats.t_end = time.perf_counter()
        if self.pieces is not None:
            self.pieces.put(None)
        self.done.set()
