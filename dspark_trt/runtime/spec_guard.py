"""A measured guard on the decision to speculate at all.

The solver and the draft-depth planner decide from a step-cost model. When that model is wrong (on a
CPU in a steady closed loop, arriving prompts' prefill and the draft's catch-up make speculative steps
cost more than the table says), adaptive speculation can lose to plain decoding at high load. The guard
settles that question by measurement: per load bucket (number of decode requests, rounded to a power of
two) it keeps an exponentially weighted output rate (tokens per ms of step wall time) of steps run with
the model's plan ("spec") and of steps run without drafting ("plain"), runs the better arm, and now
and then a short trial of the other one so both rates stay current. The first steps of every segment
are not measured: switching into "spec" makes the draft catch up on everything it skipped.

Trials cost throughput when one arm is clearly better, so their spacing grows with the measured gap:
a trial of TRIAL_LEN steps comes after about TRIAL_LEN * (gap / LOSS_BUDGET - 1) steps of the better
arm, which keeps the expected loss near LOSS_BUDGET (and the spacing within [MIN_EVERY, MAX_EVERY]).

The guard is consulted whatever the model says: where the model would not draft but measurement says
speculating is faster by MARGIN, the guard runs "spec" (the runtime then drafts at the planner's
smallest depth); until both arms are measured it follows the model. Near a tie the model's estimate of
acceptance is the weak part (a few points of survival flip it), while the measured rates are direct.

Lossless sampling is unaffected: the arm of a step depends only on earlier steps' timings.
"""

from __future__ import annotations

import math

__all__ = ["SpecGuard"]

TRIAL_LEN = 8
SKIP = 2  # steps at the start of a segment that are not measured
MIN_EVERY, MAX_EVERY = 48, 1000
FIRST = 16  # steps of the model's arm before the first trial of the other in a new bucket
LOSS_BUDGET = 0.01
MARGIN = 0.03  # "plain" must beat "spec" by this much to take over
ALPHA = 0.2


class _Bucket:
    __slots__ = ("arm", "left", "pos", "rate", "trial")

    def __init__(self):
        self.arm = None  # the arm of the last step
        self.left, self.pos = FIRST, 0  # steps until the next trial (or until a trial ends); steps on this arm
        self.trial: str | None = None  # the arm on trial, while one runs
        self.rate = {"spec": None, "plain": None}


class SpecGuard:
    def __init__(self):
        self._b: dict[int, _Bucket] = {}

    @staticmethod
    def bucket(n_decode: int) -> int:
        return int(round(math.log2(max(1, n_decode))))

    @staticmethod
    def _preferred(b: _Bucket, model: str) -> tuple[str, float]:
        """The better arm and its measured lead; the model's arm unless the other leads by MARGIN."""
        rs, rp = b.rate["spec"], b.rate["plain"]
        if rs is None or rp is None:
            return model, 0.0
        if model == "spec" and rp > rs * (1 + MARGIN):
            return "plain", rp / rs - 1
        if model == "plain" and rs > rp * (1 + MARGIN):
            return "spec", rs / rp - 1
        return model, max(0.0, (rs / rp if model == "spec" else rp / rs) - 1)

    def arm(self, n_decode: int, model: str = "spec") -> str:
        """The arm to run this step ("spec" or "plain") for this load. `model` is the cost model's choice,
        followed unless measurement says the other arm is faster (and during trials of the other arm)."""
        b = self._b.setdefault(self.bucket(n_decode), _Bucket())
        pref, gap = self._preferred(b, model)
        if b.left <= 0:
            if b.trial is not None:  # a trial ended: the better arm for a while
                b.trial = None
                b.left = int(min(MAX_EVERY, max(MIN_EVERY, TRIAL_LEN * (gap / LOSS_BUDGET - 1))))
            else:
                b.trial, b.left = ("plain" if pref == "spec" else "spec"), TRIAL_LEN + SKIP
        b.left -= 1
        arm = b.trial or pref
        b.pos = b.pos + 1 if arm == b.arm else 1
        b.arm = arm
        return arm

    def record(self, n_decode: int, arm: str, tokens_per_ms: float) -> None:
        """Feed back the output rate of a step that ran `arm` (the first SKIP steps on an arm are not
        measured: switching into "spec" makes the draft catch up)."""
        b = self._b.get(self.bucket(n_decode))
        if b is None or arm != b.arm or b.pos <= SKIP or not tokens_per_ms > 0:
            return
        old = b.rate[arm]
        b.rate[arm] = tokens_per_ms if old is None else (1 - ALPHA) * old + ALPHA * tokens_per_ms

    def report(self) -> dict:
        return {1 << k: {"arm": b.arm, "spec_tok_per_ms": b.rate["spec"], "plain_tok_per_ms": b.rate["plain"]}
                for k, b in sorted(self._b.items())}
