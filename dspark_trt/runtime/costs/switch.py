"""What a switch of graphs costs, learned from the calls that pay it.

On ONNX Runtime plain calls run a decoding graph of their own and verify calls the packed graph. After the
other graph ran, a graph's first calls are slower (at 4 rows the decoding graph's next calls took 1.9, 1.5,
1.3 and 1.15x their settled time, the packed graph's first ~1.3x), and the decoding graph's cache copy is
brought up to date (backends/ort_decode.py). The depth planner charges that to a stretch of drafting started
from plain decoding, which pays two switches: into verifying and back (phases/depth_planner.py).

What it costs depends on the machine (caches, memory bandwidth, other tenants), so it is learned: a switch's
price is what the calls on the new graph until it settles (tuning.settle_calls) or the next switch took
beyond the call-shape model, cheaper ones too (noise goes both ways), plus the cache copy's syncing, in plain
calls of their width. The planner reads the mean price of a switch into verifying plus that of one back into
plain decoding, each direction its own mean. Each starts from half a prior (tuning.switch_calls where the backend
has several graphs, else 0) counted as PRIOR_WEIGHT switches, averages until there are 1 / alpha of them, then
follows them exponentially weighted. A switch teaches nothing when one of its calls is one the model cannot
price well, a prompt chunk in the call (padding errors of 3-5x) or a kind of call not yet observed at that
width (a flat profile's deep verify calls, priced far too cheaply, would read as a dear switch), and when it
followed a prompt chunk's call: those switches come whether anything drafts or not, and cost less (at 4
requests 0.52 plain calls back into plain decoding after a prompt chunk, 1.27 after verifying drafts).
"""

from __future__ import annotations

__all__ = ["SwitchPrice"]


class SwitchPrice:
    """Call order: ``observe(...)`` after every target call; ``calls`` is the current price."""

    PRIOR_WEIGHT = 4  # switches the prior counts as, per direction
    MAX_UNITS = 8.0  # most one switch may teach, in plain calls (a stalled call is not a switch's price)

    def __init__(self, prior_calls: float, settle_calls: int, alpha: float = 0.1):
        # Per direction (into plain decoding, into verifying): its mean price in plain calls, switches learned.
        self._mean = {True: prior_calls / 2.0, False: prior_calls / 2.0}
        self._count = {True: 0, False: 0}
        self.settle_calls, self.alpha = max(1, int(settle_calls)), alpha
        self._into: bool | None = None  # the switch under way: into plain decoding (None: none, or dropped)
        self._units = 0.0  # plain calls it has cost so far

    @property
    def calls(self) -> float:
        """A stretch of drafting's price, in plain calls of its width: a switch into verifying and one back."""
        return self._mean[True] + self._mean[False]

    @property
    def listening(self) -> bool:
        """A switch is under way: the next call's excess is part of its price."""
        return self._into is not None

    @property
    def switches(self) -> int:
        return self._count[True] + self._count[False]

    def observe(self, since: int, plain: bool, trusted: bool, excess_ms: float, synced_ms: float,
                plain_ms: float) -> None:
        """One target call. since: calls on its graph before it since another graph ran (0: it is the switch's
        first; the verifier's count, which also tells the model which calls settled); plain: a plain decoding
        call (one query token a row); trusted: the model prices it well (no prompt chunk, its kind observed
        at its width); excess_ms: its time beyond the model; synced_ms: time spent bringing a cache copy up
        to date for it; plain_ms: the model's plain call of its width."""
        if since == 0:
            self._close()  # another switch before it settled: what its calls cost is its price
            self._into, self._units = plain, 0.0
        if self._into is None:
            return
        if not trusted or not plain_ms > 0:
            self._into = None
            return
        self._units += (excess_ms + synced_ms) / plain_ms
        if since + 1 >= self.settle_calls:
            self._close()

    def _close(self) -> None:
        into, self._into = self._into, None
        if into is None:
            return
        n = self._count[into] = self._count[into] + 1
        weight = max(self.alpha, 1.0 / (n + self.PRIOR_WEIGHT))
        units = min(max(self._units, 0.0), self.MAX_UNITS)
        self._mean[into] += weight * (units - self._mean[into])
