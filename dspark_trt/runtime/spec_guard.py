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

Lossless sampling is unaffected: the arm of a step depends only on earlier steps' timings.
"""

from __future__ import annotations

import math

__all__ = ["SpecGuard"]

TRIAL_LEN = 8
SKIP = 2  # steps at the start of a segment that are not measured
MIN_EVERY, MAX_EVERY = 48, 1000
FIRST = 16  # steps of "spec" before the first trial of "plain" in a new bucket
LOSS_BUDGET = 0.01
MARGIN = 0.03  # "plain" must beat "spec" by this much to take over
ALPHA = 0.2


class _Bucket:
    __slots__ = ("arm", "left", "pos", "rate", "trial")

    def __init__(self):
        self.arm, self.left, self.pos, self.trial = "spec", FIRST, 0, False
        self.rate = {"spec": None, "plain": None}


class SpecGuard:
    def __init__(self):
        self._b: dict[int, _Bucket] = {}

    @staticmethod
    def bucket(n_decode: int) -> int:
        return int(round(math.log2(max(1, n_decode))))

    def _preferred(self, b: _Bucket) -> tuple[str, float]:
        rs, rp = b.rate["spec"], b.rate["plain"]
        if rs is None or rp is None:
            return "spec", 0.0
        if rp > rs * (1 + MARGIN):
            return "plain", rp / rs - 1
        return "spec", max(0.0, rs / rp - 1)

    def arm(self, n_decode: int) -> str:
        """The arm to run this step ("spec" or "plain") for this load."""
        b = self._b.setdefault(self.bucket(n_decode), _Bucket())
        if b.left <= 0:
            pref, gap = self._preferred(b)
            other = "plain" if pref == "spec" else "spec"
            if b.trial:  # a trial ended: back to the better arm for a while
                b.arm, b.trial = pref, False
                b.left = int(min(MAX_EVERY, max(MIN_EVERY, TRIAL_LEN * (gap / LOSS_BUDGET - 1))))
            else:
                b.arm, b.trial, b.left = other, True, TRIAL_LEN + SKIP
            b.pos = 0
        b.left -= 1
        b.pos += 1
        return b.arm

    def record(self, n_decode: int, arm: str, tokens_per_ms: float) -> None:
        """Feed back the output rate of a step that ran `arm`."""
        b = self._b.get(self.bucket(n_decode))
        if b is None or arm != b.arm or b.pos <= SKIP or not tokens_per_ms > 0:
            return
        old = b.rate[arm]
        b.rate[arm] = tokens_per_ms if old is None else (1 - ALPHA) * old + ALPHA * tokens_per_ms

    def report(self) -> dict:
        return {1 << k: {"arm": b.arm, "spec_tok_per_ms": b.rate["spec"], "plain_tok_per_ms": b.rate["plain"]}
                for k, b in sorted(self._b.items())}
