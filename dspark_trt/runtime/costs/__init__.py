"""Step costs: profiled tables with drift correction (table), the call-shape model (call_shape), the
unpriced step overhead by load (overhead), measuring them (profiling), and the per-step view the
phases read (step)."""

from dspark_trt.runtime.costs.table import PROFILE_FILENAME, CostTable

__all__ = ["CostTable", "PROFILE_FILENAME"]
