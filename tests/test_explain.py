"""Issue 22 item 5: the runtime explains itself, predicted against measured, per step and summed."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np

from dspark_trt.runtime import GenerationConfig, Runtime
from dspark_trt.runtime.costs.table import CostTable
from dspark_trt.runtime.explain import Explainer, apart
from dspark_trt.runtime.tuning import RuntimeTuning

FIELDS = ("predicted_accepted", "accepted", "predicted_step_ms", "measured_step_ms")


def _explainer(window=4):
    logger = logging.getLogger("test-explain")
    return Explainer(window, 0.25, logger), logger


def test_apart_means_beyond_the_tolerance_and_for_counts_beyond_their_noise():
    assert not apart(11.0, 10.0, 0.25) and apart(13.0, 10.0, 0.25) and apart(7.0, 10.0, 0.25)
    assert apart(5.0, 0.0, 0.25) and not apart(0.0, 0.0, 0.25)
    assert not apart(2.0, 4.0, 0.25, count=True)  # 2 expected, 4 seen: a 100% gap, well within the noise
    assert apart(100.0, 160.0, 0.25, count=True)


def test_a_window_apart_warns_once_and_the_first_window_is_not_judged(caplog):
    ex, logger = _explainer()
    with caplog.at_level(logging.WARNING, logger=logger.name):
        for _ in range(4):  # start-up window: far apart, not judged
            ex.record(10.0, 10, 50.0, 10.0)
        assert not caplog.records
        for _ in range(4):  # agreeing window
            ex.record(10.0, 10, 10.5, 10.0)
        assert not caplog.records
        for _ in range(12):  # three windows with the step ms 2x over: one warning
            ex.record(10.0, 11, 20.0, 10.0)
    assert len(caplog.records) == 1 and ex.warned
    msg = caplog.records[0].getMessage()
    assert "20.00 ms per step and 10.00 ms" in msg and "+100%" in msg and "accepted drafts" not in msg


def test_windows_apart_only_now_and_then_never_warn(caplog):
    """A good profile while the drift catches up, or a burst draining: a window apart between agreeing
    ones is not a profile that does not match the machine."""
    ex, logger = _explainer()
    with caplog.at_level(logging.WARNING, logger=logger.name):
        for k in range(40):
            ms = 16.0 if (k // 4) % 3 == 2 else 10.0  # every third window 60% over
            ex.record(10.0, 10, ms, 10.0)
    assert not caplog.records and not ex.warned


def test_accepted_drafts_far_from_the_survivals_warn_and_steps_without_a_profile_skip_the_ms(caplog):
    ex, logger = _explainer()
    with caplog.at_level(logging.WARNING, logger=logger.name):
        for _ in range(12):
            ex.record(1.0, 20, None, 12.0)  # underconfident survivals: 4 expected per window, 80 accepted
        assert not caplog.records  # the start-up window and two judged ones: not yet three in a row
        for _ in range(8):
            ex.record(1.0, 20, None, 12.0)
    assert len(caplog.records) == 1
    msg = caplog.records[0].getMessage()
    assert "predicted 4.0 accepted drafts and 80 were accepted" in msg and "ms per step" not in msg


def test_generate_reports_predicted_and_measured_per_request_and_in_the_metrics(tiny_artifact, caplog):
    """A cost profile 100x too slow (beyond what the drift correction may fix) and survivals far below what
    verification accepts (the test pair's fallback confidence, not recalibrated): both show, summed per
    request, in the runtime's metrics and per step; the one warning names the cost profile (the first
    window apart; how far the accepted drafts are apart in it depends on the text)."""
    tuning = replace(RuntimeTuning(), explain_window=8)
    rt = Runtime.load(tiny_artifact, profile="none", recalibrate=False, tuning=tuning)
    rt.cost = CostTable(np.arange(200, dtype=float) * 100.0 + 1000.0 * (np.arange(200) > 0),
                        np.full(20, 500.0) * (np.arange(20) > 0))
    try:
        with caplog.at_level(logging.WARNING, logger="dspark_trt.runtime"):
            out = rt.generate(["def fib(n):", "import os\n"], GenerationConfig(max_new_tokens=96, spec="fixed:3"))
        snap = rt.metrics.snapshot()
        log = list(rt.metrics.step_log)
    finally:
        rt.close()
    for o in out:
        st = o.stats
        assert all(f in st for f in FIELDS)
        assert st["accepted"] == sum(st["accepted_counts"]) > 10
        assert 0 <= st["predicted_accepted"] < st["accepted"] / 4
        assert st["measured_step_ms"] > 0 and st["predicted_step_ms"] > 10 * st["measured_step_ms"]
    assert snap["accepted"] == sum(snap["accepted_per_position"])
    assert snap["predicted_step_ms"] > 10 * snap["measured_step_ms"] > 0
    decode_steps = [s for s in log if s["decode_requests"]]
    assert abs(sum(s["predicted_accepted"] for s in decode_steps) - snap["predicted_accepted"]) < 1e-6
    assert abs(sum(s["measured_ms"] for s in decode_steps) - snap["measured_step_ms"]) < 1e-6
    warnings = [r for r in caplog.records if r.name == "dspark_trt.runtime" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "re-measure it with `dspark-trt profile`" in warnings[0].getMessage()
