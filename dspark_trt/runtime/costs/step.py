"""What a step costs and what a millisecond is worth, as the step phases read them.

:class:`Costs` is the runtime's one holder of cost knowledge: the profiled tables with their drift
correction (``table``, a :class:`~dspark_trt.runtime.costs.table.CostTable`, or None without a profile),
the step time outside the priced calls by load (``overhead``), and what the last steps measured: the
output rate (tokens per ms, the value of a millisecond), the tokens a decoding request emits per step,
and the break-even survival of the last solve. ``for_step`` gives a :class:`StepCost`, the same
questions answered at this step's load and past length.
"""

from __future__ import annotations

import numpy as np

from dspark_trt.runtime.costs.call_shape import packed_shape
from dspark_trt.runtime.costs.overhead import OverheadByLoad
from dspark_trt.runtime.costs.switch import SwitchPrice
from dspark_trt.runtime.solver import even_spread
from dspark_trt.runtime.tuning import RuntimeTuning

__all__ = ["Costs", "StepCost"]


class Costs:
    def __init__(self, max_tokens_per_step: int, max_draft: int, overhead_window: int = RuntimeTuning.overhead_window):
        self.max_tokens_per_step, self.max_draft = max_tokens_per_step, max_draft
        self.table = None  # CostTable | None
        self.overhead = OverheadByLoad(overhead_window)
        self.switch = SwitchPrice(0.0, 1)  # what a switch of graphs costs (Runtime sets the prior where there are any)
        self.rate = 0.0  # recent output tokens per ms of step time (EW)
        self.tau_row = 0.0  # recent tokens a decoding request emits per step (EW)
        self.break_even = 0.0  # break-even (corrected) survival of the last solve
        self.observing = True  # this step's drafting and target calls are fed to the tables (Runtime.step)
        # False while the machine's timings are not its own (Runtime.step: the host caches' pages still being
        # mapped): no cost is learned from them. A server's first seconds ran 3-6x slow beside the mapping,
        # and what the call-shape levels, catch-up rate and step overheads learned then kept adaptive at
        # one request from drafting long after (exploring there cannot show them wrong fast enough).
        self.learning = True
        self._even_grid: dict = {}  # see StepCost.verify_table

    @property
    def shape(self):
        """The call-shape model (costs/call_shape.py), or None."""
        return self.table.call_shape if self.table is not None else None

    def for_step(self, n_decode: int, past: int) -> "StepCost":
        return StepCost(self, n_decode, past)

    def split_prefill(self, dec_lens, dec_past, pre_lens, pre_past) -> bool:
        """Whether prompt chunks are cheaper in a call of their own than padded into the decode call."""
        shape = self.shape
        if shape is None:
            return False
        mixed = shape.ms(*packed_shape(dec_lens + pre_lens, dec_past + pre_past), chunk=True)
        return shape.ms(*packed_shape(dec_lens, dec_past)) + shape.ms(*packed_shape(pre_lens, pre_past)) < mixed

    def prefill_share(self, lengths: list[int], past_lens: list[int], nd: int) -> float:
        """Modelled ms that the prompt chunks packed into a decode call added to it (0 without chunks)."""
        shape = self.shape
        if shape is None or nd == 0 or len(lengths) == nd:
            return 0.0
        whole = shape.ms(*packed_shape(lengths, past_lens), chunk=True)
        return max(0.0, whole - shape.ms(*packed_shape(lengths[:nd], past_lens[:nd])))

    def even_grid(self, n: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """solver.even_spread, kept per (n, rows): fixed for a shape, and asked for every step."""
        grid = self._even_grid.get((n, rows))
        if grid is None:
            if len(self._even_grid) >= 256:
                self._even_grid.clear()
            grid = self._even_grid[(n, rows)] = even_spread(n, rows)
        return grid


class StepCost:
    """Costs at one step's load: `n_decode` decode rows whose verify call attends over `past` tokens."""

    __slots__ = ("costs", "n_decode", "past")

    def __init__(self, costs: Costs, n_decode: int, past: int):
        self.costs, self.n_decode, self.past = costs, n_decode, past

    @property
    def table(self):
        return self.costs.table

    def overhead(self, kind: str) -> float:
        """Recent unpriced ms of a step without ("plain") or with ("spec") drafting at this load."""
        return self.costs.overhead(kind, self.n_decode)

    def depth_verify_ms(self, base: int, n_adaptive: int):
        """Verify call ms at draft depth j = 0..max_draft (a list, or an array without a call-shape model):
        `base` rows verify one token, `n_adaptive` rows 1 + j (every adaptive row padded to 1 + j)."""
        shape = self.costs.shape
        if shape is not None:
            return shape.depth_table(base, n_adaptive, self.past, self.costs.max_draft)
        j = np.arange(self.costs.max_draft + 1)
        return np.asarray(self.table.verify_ms(base + n_adaptive * (1 + j)), dtype=np.float64)

    def verify_table(self, extra_tokens: int, rows: int = 0) -> np.ndarray:
        """Verify cost by verified-token count, shifted by tokens other requests verify anyway.

        With a call-shape model the table is this step's: `rows` decode rows attending over this step's
        past, the extra tokens spread evenly over the rows (the least padding they can cost; the depth
        cap prices uneven depth). The profile's token table was measured with rows packed 8 tokens
        deep, so it charges each token a share of a row's cost that a fixed set of rows does not pay."""
        c = self.costs
        if c.table is None:
            n = c.max_tokens_per_step + 1
            return np.arange(n, dtype=np.float64) + 1.0  # no profile: cost proportional to tokens
        shape = c.shape
        if shape is not None and rows > 0:
            # As far as this step can reach (every row at full depth, plus the marginal span), not the
            # whole token range: this runs every step.
            n = min(c.max_tokens_per_step, extra_tokens + rows * (c.max_draft + 1) + 8) + 1
            t, longest = c.even_grid(n, rows)
            table = shape.table(t, rows, longest, self.past)
            table[0] = 0.0
        else:
            table = np.asarray(c.table.verify_table(), dtype=np.float64)
        return table[extra_tokens:] if extra_tokens < len(table) - 1 else table[-2:]
