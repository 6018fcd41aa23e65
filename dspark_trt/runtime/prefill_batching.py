"""When to prefill arriving prompts: now, or a few steps later together with the next ones.

Every engine call reads all of the model's weights once, so a call has a fixed cost (c0 in
costs/call_shape.py; on a CPU a sizeable share of a whole decode step even at 64 rows). A
prompt that arrives while others decode cannot share their call cheaply (the packed attention would
pad every decode row to the prompt's length), so it gets a call of its own, and under a steady stream
of arrivals every step pays one extra c0. Prompts that wait for each other share that cost; the price
is that a waiting request makes no progress.

With arrivals at lambda per step, a group of k prompts costs c0 * lambda / k ms of extra calls per step,
and about (k - 1) / 2 requests stand waiting, each forgoing tau tokens a step (tau: what a decoding
request emits per step), worth tau / rate ms at the current output rate. The sum is least at

    k* = sqrt(2 * c0 * lambda * rate / tau)

and a group of k + 1 beats a group of k exactly when k (k + 1) < k*^2. So the waiting prompts are
prefilled as soon as their number k satisfies k (k + 1) >= k*^2 (or the oldest has waited max_wait
steps, tuning.RuntimeTuning.prefill_max_wait). At low load k* < sqrt(2) and nothing waits.
"""

from __future__ import annotations

import math

from dspark_trt.runtime.tuning import RuntimeTuning


def prefill_group_size(call_ms: float, arrivals_per_step: float, rate: float, tau: float) -> float:
    """k*: the number of waiting prompts worth one prefill call (see the module docstring).

    call_ms: fixed cost of one engine call (ms); arrivals_per_step: recent prompts admitted per step;
    rate: recent output tokens per ms; tau: recent tokens a decoding request emits per step.
    Anything unknown or non-positive gives 1 (prefill at once).
    """
    if not (call_ms > 0 and arrivals_per_step > 0 and rate > 0 and tau > 0):
        return 1.0
    if not all(math.isfinite(x) for x in (call_ms, arrivals_per_step, rate, tau)):
        return 1.0
    return max(1.0, math.sqrt(2.0 * call_ms * arrivals_per_step * rate / tau))


def prefill_now(waiting: int, oldest_wait: int, group_size: float, decoding: int,
                max_wait: int = RuntimeTuning.prefill_max_wait) -> bool:
    """Whether the `waiting` prompts are prefilled this step.

    oldest_wait: steps the longest-waiting of them has waited; group_size: k* from
    :func:`prefill_group_size`; decoding: requests that decode this step (with none, waiting saves
    nothing: the call would run alone anyway); max_wait: steps a prompt may wait for company, whatever
    the model says (a bound on added latency).
    """
    if waiting <= 0:
        return False
    return decoding == 0 or waiting * (waiting + 1) >= group_size ** 2 or oldest_wait >= max_wait
