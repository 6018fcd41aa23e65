"""A measured guard on the decision to speculate at all.

The solver and the draft-depth planner decide from a step-cost model and estimated survivals. Near the
point where drafting stops paying (high load on a CPU) a few points of error in either flip the
decision, and measured rates are the direct answer. Per load bucket (number of decode requests,
rounded to a power of two) the guard keeps the output rate (tokens per ms of step wall time) of steps
run with drafting ("spec") and without ("plain"), runs the cost model's choice until both arms are
measured and then the arm it is on unless the other is measurably faster, and now and then runs a short
trial of the arm it is not running so both rates stay current. When the cost model comes to prefer the
other arm by more than the margin (it learned the true costs from its calls, or from exploration), the
guard follows it unless measurement says that arm is the slower one: a guard that held on to the arm a
profile too pessimistic about drafting once chose would keep the runtime stuck after the model recovered. The runtime feeds it each arm's steady
decode work: without the prefill that lands on a step whichever arm runs, and without the draft
catching up on what it skipped after a switch into "spec" (at 64 requests, hundreds of tokens per
request after a long plain stretch). A switch that sticks pays that once; an 8-step trial that counted
it would weigh it as if it recurred every 8 steps and never find drafting worth its while. Switches
stay rare through the margin below, not through the measurement.

Rates are ratios of exponentially weighted sums (tokens / ms), not averages of per-step ratios, and an
arm takes over from the model's choice only if it leads by a margin plus z standard errors: one step of a
single request emits anywhere from 1 to K+1 tokens, so at low load a handful of steps says little,
while at high load every step averages over many requests and the guard decides quickly.

Trials cost throughput when one arm is clearly better, so their spacing grows with the measured gap:
a trial of trial_len steps comes after about trial_len * (gap / loss_budget - 1) steps of the better
arm, which keeps the expected loss near loss_budget (and the spacing within [min_every, max_every]).
The values live in tuning.GuardTuning.

Lossless sampling is unaffected: the arm of a step depends only on earlier steps' timings.
"""

from __future__ import annotations

import math

from dspark_trt.runtime.costs.overhead import load_bucket
from dspark_trt.runtime.tuning import GuardTuning

__all__ = ["SpecGuard"]


class _Rate:
    """Exponentially weighted sums of tokens and ms per step, for a ratio estimate and its error."""

    __slots__ = ("t", "m", "tt", "tm", "mm", "n", "alpha")

    def __init__(self, alpha: float):
        self.t = self.m = self.tt = self.tm = self.mm = self.n = 0.0
        self.alpha = alpha

    def add(self, tokens: float, ms: float) -> None:
        d = 1.0 - self.alpha
        self.t, self.m = d * self.t + tokens, d * self.m + ms
        self.tt, self.tm, self.mm = d * self.tt + tokens * tokens, d * self.tm + tokens * ms, d * self.mm + ms * ms
        self.n = d * self.n + 1.0

    @property
    def value(self) -> float | None:
        return self.t / self.m if self.m > 0 else None

    @property
    def stderr(self) -> float:
        """Delta-method standard error of t/m: residuals tokens - rate * ms, summed over the window."""
        if self.m <= 0 or self.n < 2:
            return math.inf
        r = self.t / self.m
        resid = max(0.0, self.tt - 2 * r * self.tm + r * r * self.mm)
        return math.sqrt(resid * self.n / (self.n - 1)) / self.m


class _Bucket:
    __slots__ = ("arm", "home", "left", "rate", "trial")

    def __init__(self, t: GuardTuning):
        self.arm = None  # the arm of the last step
        self.home = None  # the arm run outside trials
        self.left = t.first  # steps until the next trial (or until the running trial ends)
        self.trial: str | None = None  # the arm on trial, while one runs
        self.rate = {"spec": _Rate(t.alpha), "plain": _Rate(t.alpha)}


class SpecGuard:
    def __init__(self, tuning: GuardTuning | None = None):
        self.tuning = tuning or GuardTuning()
        self._b: dict[int, _Bucket] = {}

    def _preferred(self, b: _Bucket, model: str, lead: float = 0.0) -> tuple[str, float]:
        """The arm to run outside trials and its measured lead over the other (0 if unknown).

        Until both arms are measured: the model's. Then the home arm stays unless the other leads by
        the margin plus z standard errors (every switch into "spec" costs a draft catch-up, so following a
        model that flips near a tie costs more than either arm), or the model prefers the other arm by more
        than the margin (`lead`, its predicted relative gain) and measurement does not say it is slower."""
        rs, rp = b.rate["spec"], b.rate["plain"]
        vs, vp = rs.value, rp.value
        if vs is None or vp is None or vs <= 0 or vp <= 0 or b.home is None:
            return model, 0.0
        t = self.tuning
        noise = t.z * math.hypot(rs.stderr, rp.stderr)
        current = b.home
        if model != current and lead > t.margin:
            vm, vh = (vs, vp) if model == "spec" else (vp, vs)
            if not vh > vm * (1 + t.margin) + noise:
                current = model
        other = "plain" if current == "spec" else "spec"
        vc, vo = (vs, vp) if current == "spec" else (vp, vs)
        if vo > vc * (1 + t.margin) + noise:
            return other, vo / vc - 1
        return current, max(0.0, vc / vo - 1)

    def arm(self, n_decode: int, model: str = "spec", lead: float = 0.0) -> str:
        """The arm to run this step ("spec" or "plain") for this load; `model` is the cost model's choice and
        `lead` its predicted relative gain over the other arm."""
        t = self.tuning
        b = self._b.get(load_bucket(n_decode))
        if b is None:
            b = self._b[load_bucket(n_decode)] = _Bucket(t)
        pref, gap = self._preferred(b, model, lead)
        if b.trial is None:
            b.home = pref
        if b.left <= 0:
            if b.trial is not None:  # a trial ended: the better arm for a while
                b.trial = None
                b.left = int(min(t.max_every, max(t.min_every, t.trial_len * (gap / t.loss_budget - 1))))
            else:
                b.trial, b.left = ("plain" if b.home == "spec" else "spec"), t.trial_len
        b.left -= 1
        b.arm = b.trial or b.home
        return b.arm

    def record(self, n_decode: int, arm: str, tokens: float, ms: float) -> None:
        """Feed back a step that ran `arm`: output tokens and the ms of its decode work (see the module
        docstring for what the runtime leaves out)."""
        b = self._b.get(load_bucket(n_decode))
        if b is None or arm != b.arm or not (ms > 0 and tokens >= 0):
            return
        b.rate[arm].add(float(tokens), float(ms))

    def report(self) -> dict:
        return {1 << k: {"arm": b.arm, "spec_tok_per_ms": b.rate["spec"].value,
                         "plain_tok_per_ms": b.rate["plain"].value} for k, b in sorted(self._b.items())}
