"""How a draft call's cost grows with the tokens cached per row (the draft table is timed at one past).

The profile times draft calls by batch at ``profile.past`` cached tokens (128); at serving contexts a
call attends over far more. On the tiny pair, a 64-row draft call took 3.36 ms at past 128 and 6.16 ms at
past 900 (16 rows: 1.07 and 1.67 ms; one row: 0.24 and 0.26). Priced at past 128, drafting at high load
looked half its cost: the runtime's drift correction learned the level back per batch size, but only from
calls it made, and every change of load (pasts differ by load) or cold start began from the cheap price.

So the profile also times a few batch sizes at a long past, each beside the same size at the profile's
past (round-robin, the low quantile kept, as the call shapes), and the draft table's price is scaled by

    factor(b, past) = 1 + rel(b) * (past - past0)

with rel(b) the relative growth per cached token: the growth in ms per token over the cost at past0, each
measured at those sizes and interpolated in between.
A ratio, not an absolute term: it applies alike to the profiled table and to one the runtime refined
(drift-corrected at the profile's past), and the drift learns from observed calls divided by it. A quick
start-up profile (a large model) and profiles measured before it have no such points: factor 1, as before.
"""

from __future__ import annotations

import numpy as np

__all__ = ["DraftPast"]

FLOOR = 0.5  # a factor never prices a call below half its profiled cost (pasts shorter than past0)


class DraftPast:
    """``points``: ``{"past0", "past", "batch": [...], "ms_past0": [...], "ms_past": [...]}`` as the
    profile stores them (costs/profiling.py); None or malformed: factor 1 everywhere."""

    def __init__(self, points: dict | None):
        self.past0 = 0
        self._rel: list[float] = []  # rel(b) at b = 0 .. the largest batch measured (clamped beyond it)
        try:
            past0, past = int(points["past0"]), int(points["past"])
            b = np.asarray(points["batch"], dtype=np.float64)
            short = np.asarray(points["ms_past0"], dtype=np.float64)
            long_ = np.asarray(points["ms_past"], dtype=np.float64)
        except (KeyError, TypeError, ValueError):
            return
        if past <= past0 or b.ndim != 1 or not (b.shape == short.shape == long_.shape) or not (short > 0).all():
            return
        order = np.argsort(b)
        slope = np.maximum(0.0, (long_ - short) / (past - past0))  # ms per cached token
        # The growth and the cost at past0 each linear in the batch between measured sizes (attention reads
        # grow with rows x past): their ratio, not an interpolated ratio, is exact for costs linear in the
        # rows. Tabulated once per batch: the call test asks at every draft call.
        grid = np.arange(int(b.max()) + 1, dtype=np.float64)
        rel = np.interp(grid, b[order], slope[order]) / np.interp(grid, b[order], short[order])
        self.past0, self._rel = past0, rel.tolist()

    def factor(self, batch, past) -> float:
        """A draft call of `batch` rows at `past` cached tokens over the same call at the profile's past."""
        if past is None or not self._rel:
            return 1.0
        rel = self._rel[min(max(int(batch), 0), len(self._rel) - 1)]
        return max(FLOOR, 1.0 + rel * (past - self.past0))

    @staticmethod
    def points(past0: int, past: int, batches: list[int], ms_past0: list[float], ms_past: list[float]) -> dict:
        return {"past0": int(past0), "past": int(past), "batch": [int(b) for b in batches],
                "ms_past0": [float(x) for x in ms_past0], "ms_past": [float(x) for x in ms_past]}
