"""Step time outside the calls the cost tables price, learned per load.

Scheduling, solving, committing and feeding new prompts to the draft: every step pays it whatever it
verifies, so it belongs in the constant of the solver's denominator (ignoring it under-values emitting
more tokens per step), and a drafting step pays more of it (the draft loop, the solver, the survival
bookkeeping), which the draft-depth planner must charge to drafting at all. The priced calls (every
drafting and target call, feeds and KV writes included: what the cost tables learn) are left out, or
the planner would charge their packing twice; so is the draft catching up on text generated while it
did not draft (a cost of switching, paid once).

Kept per load (decode requests, to the nearest power of two): most of it is per-request work, so a
figure learned at 64 requests (or in a warm-up) says little about 4, and one shared figure made drafting
look dear long after load fell.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from dspark_trt.runtime.tuning import RuntimeTuning

__all__ = ["OverheadByLoad", "load_bucket"]


def load_bucket(n: int) -> int:
    """A count of rows or requests to the nearest power of two, as its exponent: the load buckets of the
    step overhead, of exploration and of the call-shape drift."""
    return int(round(math.log2(max(1, n))))


class OverheadByLoad:
    """Unpriced ms per step, for steps without ("plain") and with ("spec") drafting, per load: the median
    of the last `window` steps of a kind and load. A median, because the steps are short and one of them
    now and then is slow for reasons that are not the step's (a garbage collection, the OS): with a mean,
    one 16 ms step among 0.4 ms ones priced every plain step at 1.8 ms for the next 20, and the planner
    drafted at a load where plain decoding was faster."""

    def __init__(self, window: int = RuntimeTuning.overhead_window):
        self.window = window
        self._recent: dict[tuple[str, int], deque] = {}
        self.ms: dict[tuple[str, int], float] = {}

    def observe(self, kind: str, n_decode: int, unpriced_ms: float) -> None:
        key = (kind, load_bucket(n_decode))
        recent = self._recent.setdefault(key, deque(maxlen=self.window))
        recent.append(max(0.0, unpriced_ms))
        self.ms[key] = statistics.median(recent)

    def __call__(self, kind: str, n_decode: int) -> float:
        """The figure at this load: its own, else the nearest load's of the same kind, else the other
        kind's (0 before any step)."""
        if not self.ms:
            return 0.0
        b = load_bucket(n_decode)
        own = self.ms.get((kind, b))
        if own is not None:
            return own
        key = min(self.ms, key=lambda k: (k[0] != kind, abs(k[1] - b), k[1]))
        return self.ms[key]
