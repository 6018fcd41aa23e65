"""Prefill batching: arriving prompts wait for company only when a shared call saves more than the wait costs."""

from __future__ import annotations

import math

import pytest

from dspark_trt.runtime.prefill_batching import prefill_group_size, prefill_now
from dspark_trt.runtime.tuning import RuntimeTuning

MAX_WAIT = RuntimeTuning().prefill_max_wait


def _loss(k: int, call_ms: float, arrivals: float, rate: float, tau: float) -> float:
    """ms-equivalent per step of prefilling in groups of k: extra calls plus waiting requests' lost output."""
    return call_ms * arrivals / k + (k - 1) / 2 * tau / rate


def _group_the_rule_forms(call_ms, arrivals, rate, tau) -> int:
    size = prefill_group_size(call_ms, arrivals, rate, tau)
    return next(k for k in range(1, 1000) if prefill_now(k, 0, size, decoding=8))


def test_group_size_is_the_square_root_rule():
    assert prefill_group_size(7.0, 1.1, 1.2, 1.0) == pytest.approx(math.sqrt(2 * 7.0 * 1.1 * 1.2 / 1.0))


@pytest.mark.parametrize("call_ms, arrivals, rate, tau", [
    (7.0, 1.1, 1.2, 1.0),  # 64 requests on the tiny pair: groups of ~4
    (7.0, 0.45, 0.9, 1.8),  # 16 requests
    (7.0, 0.05, 0.28, 3.5),  # one request: nothing waits
    (50.0, 3.0, 2.0, 1.5),
    (1.0, 10.0, 5.0, 0.5),
])
def test_prompts_are_prefilled_in_the_group_size_that_costs_least(call_ms, arrivals, rate, tau):
    k = _group_the_rule_forms(call_ms, arrivals, rate, tau)
    best = min(range(1, 200), key=lambda j: _loss(j, call_ms, arrivals, rate, tau))
    assert _loss(k, call_ms, arrivals, rate, tau) == pytest.approx(_loss(best, call_ms, arrivals, rate, tau))


def test_at_low_load_nothing_waits():
    assert _group_the_rule_forms(7.0, 0.05, 0.28, 3.5) == 1


def test_at_high_load_prompts_wait_for_a_few_others():
    assert _group_the_rule_forms(7.0, 1.1, 1.2, 1.0) == 4


def test_with_nothing_decoding_a_prompt_never_waits():
    assert prefill_now(1, 0, group_size=100.0, decoding=0)


def test_no_prompt_waits_longer_than_max_wait_steps():
    assert not prefill_now(1, MAX_WAIT - 1, group_size=100.0, decoding=8)
    assert prefill_now(1, MAX_WAIT, group_size=100.0, decoding=8)


def test_nothing_waiting_means_no_call():
    assert not prefill_now(0, 0, group_size=1.0, decoding=0)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_unknown_or_nonsense_inputs_mean_prefill_at_once(bad):
    for args in ([bad, 1.0, 1.0, 1.0], [1.0, bad, 1.0, 1.0], [1.0, 1.0, bad, 1.0], [1.0, 1.0, 1.0, bad]):
        assert prefill_group_size(*args) == 1.0
