"""Predicted against measured: does the runtime's model of a step match what the step did?

Every step the verify plan predicts two things (phases/verify_planner.py): the drafts it expects to be
accepted (the sum of the survivals the solver saw over the verified slots) and the step's milliseconds
(the cost model at the chosen plan). The step then measures both: the drafts accepted, its wall time.
A runtime whose survivals or cost profile are wrong decides badly and cannot see why; these figures say
why (issue 22: a profile recorded on a loaded machine made adaptive stop drafting for good, silently).

:class:`Explainer` keeps the running sums (in Metrics and in each request's stats, per step in the step
log) and compares predicted with measured over consecutive windows of steps. When the sums of ``persist``
windows in a row are apart by more than the tolerance it logs one warning (once per runtime), naming which
of the two is off. The first window is not judged: it holds the start-up steps (first-call allocations).
One window apart is not enough: while the drift correction catches up (or the load changes, as when a
burst drains) a window can be 25-70% apart with a good profile on a quiet machine, and a warning there
sent users to re-measure a profile the runtime was already correcting. A count is judged apart only when
the gap is also beyond three standard deviations of a Poisson count of the predicted size, so a window
with few verified drafts cannot warn.
"""

from __future__ import annotations

import logging
import math

__all__ = ["Explainer", "apart"]

log = logging.getLogger("dspark_trt.runtime")


def apart(predicted: float, measured: float, tolerance: float, count: bool = False) -> bool:
    """Whether a predicted sum and its measured sum differ by more than `tolerance` of the measured one
    (of the predicted one when nothing was measured); for counts also by more than 3 sqrt(predicted)."""
    gap = abs(predicted - measured)
    scale = measured if measured > 0 else predicted
    if scale <= 0 or gap <= tolerance * scale:
        return False
    return not count or gap > 3.0 * math.sqrt(max(predicted, 1.0))


class Explainer:
    """Window sums of predicted vs measured; one warning per runtime when a window's are apart.

    Call ``record`` once per step with a prediction of its ms (steps without a cost profile pass
    ``predicted_ms=None`` and are compared on accepted drafts only).
    """

    def __init__(self, window: int, tolerance: float, logger: logging.Logger = log, persist: int = 3):
        self.window, self.tolerance, self.log, self.persist = int(window), float(tolerance), logger, int(persist)
        self.warned = False
        self.windows = 0  # windows completed
        self.streak = [0, 0]  # judged windows in a row apart: accepted drafts, step ms
        self._reset()

    def _reset(self) -> None:
        self.steps = 0
        self.timed = 0  # steps of the window with a predicted ms
        self.sums = [0.0, 0.0, 0.0, 0.0]  # predicted accepted, accepted, predicted ms, measured ms

    def record(self, predicted_accepted: float, accepted: int, predicted_ms: float | None, measured_ms: float) -> None:
        s = self.sums
        s[0] += predicted_accepted
        s[1] += accepted
        if predicted_ms is not None:
            s[2] += predicted_ms
            s[3] += measured_ms
            self.timed += 1
        self.steps += 1
        if self.steps >= self.window:
            self.windows += 1
            if self.windows > 1 and not self.warned:
                self._judge()
            self._reset()

    def _judge(self) -> None:
        pa, acc, pms, mms = self.sums
        now = (apart(pa, acc, self.tolerance, count=True),
               self.timed * 2 >= self.steps and apart(pms, mms, self.tolerance))
        self.streak = [n + 1 if a else 0 for n, a in zip(self.streak, now)]
        off = []
        if self.streak[0] >= self.persist:
            off.append(f"the survivals predicted {pa:.1f} accepted drafts and {acc:.0f} were accepted "
                       f"({_pct(pa, acc)}): the draft's confidence is miscalibrated for this traffic")
        if self.streak[1] >= self.persist:
            off.append(f"the cost model predicted {pms / self.timed:.2f} ms per step and {mms / self.timed:.2f} ms "
                       f"were measured ({_pct(pms, mms)}): the cost profile does not match this machine now "
                       f"(re-measure it with `dspark-trt profile`)")
        if off:
            self.warned = True
            self.log.warning("predicted vs measured over each of the last %d windows of %d steps: %s",
                             self.persist, self.steps, "; ".join(off))


def _pct(predicted: float, measured: float) -> str:
    if measured <= 0:
        return "none measured"
    return f"{100.0 * (predicted - measured) / measured:+.0f}%"
