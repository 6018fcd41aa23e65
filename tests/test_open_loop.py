"""Open-loop benchmark: arrivals, latency and goodput arithmetic, workloads, goals, and a --quick --via-http run."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from dspark_trt.bench.arrivals import poisson_arrivals
from dspark_trt.bench.latency import meets_slo, percentiles, request_latencies, summarize_open
from dspark_trt.bench.open_report import _render_by_round, goals
from dspark_trt.bench.options import parse_rates
from dspark_trt.bench.workload import (build_requests, classify_lines, cut_points, log_uniform, parse_temperature,
                                       parse_workload)
from dspark_trt.errors import DsparkError

# ------------------------------------------------------------------------------------------ arrivals


def test_poisson_arrivals_have_the_mean_rate_and_exponential_gaps():
    from scipy import stats

    rate = 5.0
    t = poisson_arrivals(rate, seed=[0, 1], n=20_000)
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert len(t) == 20_000 and np.all(gaps > 0)
    # Mean gap 1/rate within 3 standard errors (the sd of an exponential gap is its mean).
    assert abs(gaps.mean() - 1 / rate) < 3 * (1 / rate) / np.sqrt(len(gaps))
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential: coefficient of variation 1
    assert stats.kstest(gaps, "expon", args=(0, 1 / rate)).pvalue > 0.01
    # Counts in 1-second windows are Poisson: variance equals mean.
    counts = np.bincount(t.astype(int))[:-1]
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.15)


def test_poisson_arrivals_are_seeded_and_cut_at_the_duration():
    a = poisson_arrivals(2.0, seed=[3, 0], duration=50.0)
    assert np.array_equal(a, poisson_arrivals(2.0, seed=[3, 0], duration=50.0))
    assert not np.array_equal(a[:10], poisson_arrivals(2.0, seed=[3, 1], duration=50.0)[:10])
    assert a.max() < 50.0 and 60 < len(a) < 140  # 100 expected, sd 10
    assert len(poisson_arrivals(2.0, seed=0, n=7, duration=1000.0)) == 7
    assert np.array_equal(poisson_arrivals(float("inf"), seed=0, n=4), np.zeros(4))  # a burst
    with pytest.raises(DsparkError, match="run length"):
        poisson_arrivals(1.0, seed=0)
    with pytest.raises(DsparkError, match="> 0"):
        poisson_arrivals(0.0, seed=0, n=3)


# ----------------------------------------------------------------------------------- latency arithmetic

def rec(arrival, times, tokens, ok=True, admitted=None, **extra):
    return {"arrival_s": arrival, "sent_s": arrival, "admitted_s": admitted, "token_times_s": list(times),
            "generated_tokens": tokens, "ok": ok, "error": None if ok else "boom", **extra}


def test_percentiles_interpolate_linearly_and_skip_missing_values():
    assert percentiles(list(range(1, 101))) == pytest.approx({"p50": 50.5, "p90": 90.1, "p99": 99.01})
    assert percentiles([None, 4.0, None]) == {"p50": 4.0, "p90": 4.0, "p99": 4.0}
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}


def test_request_latencies_count_from_the_scheduled_arrival():
    lat = request_latencies(rec(1.0, [1.2, 1.3, 1.5], tokens=5, admitted=1.05))
    assert lat["ttft"] == pytest.approx(200.0) and lat["e2e"] == pytest.approx(500.0)
    assert lat["tpot"] == pytest.approx(300.0 / 4)  # 4 tokens after the first in 0.3 s (5 tokens, 3 deliveries)
    assert lat["itl"] == pytest.approx([100.0, 200.0]) and lat["queue"] == pytest.approx(50.0)
    one = request_latencies(rec(0.0, [0.1], tokens=1))
    assert one["tpot"] is None and one["itl"] == [] and one["queue"] is None
    over_http = dict(rec(0.0, [0.1], tokens=1), queue_ms=12.5)  # the server's figure, no admission stamp
    assert request_latencies(over_http)["queue"] == 12.5


def test_goodput_counts_completed_requests_within_both_slos_per_second():
    records = [rec(0.0, [0.1, 0.5], tokens=5),      # TTFT 100, TPOT 100: meets
               rec(0.0, [0.9, 1.0], tokens=3),      # TTFT 900: misses the TTFT limit
               rec(0.0, [0.1, 2.1], tokens=3),      # TPOT 1000: misses the TPOT limit
               rec(0.0, [0.2], tokens=1),           # one token: no TPOT, meets
               rec(0.0, [], tokens=0, ok=False)]    # failed
    s = summarize_open(records, wall_s=4.0, slo_ttft_ms=500, slo_tpot_ms=200)
    assert (s["completed"], s["failed"], s["requests"]) == (4, 1, 5)
    assert s["goodput"] == pytest.approx(2 / 4.0) and s["goodput_frac"] == pytest.approx(2 / 5)
    assert s["output_tok_s"] == pytest.approx(12 / 4.0) and s["req_s"] == pytest.approx(1.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(150.0)  # of 100, 900, 100, 200
    assert s["errors"] == ["boom"]
    assert summarize_open(records, 4.0)["goodput"] == pytest.approx(1.0)  # no limits: every completed request


def test_output_rate_counts_tokens_delivered_while_requests_arrive():
    from dspark_trt.bench.latency import window_tok_s

    # Arrivals at 0 and 2 s: the window is (0, 2]; the long answer's tokens after 2 s do not count.
    a = rec(0.0, [0.5, 1.5, 3.0], tokens=6, token_counts=[1, 2, 3])
    b = rec(2.0, [2.0, 9.0], tokens=4)  # no per-delivery counts (HTTP): 2 tokens per delivery
    assert window_tok_s([([a, b], 9.0)]) == pytest.approx((1 + 2 + 2) / 2.0)
    assert window_tok_s([([a, b], 9.0), ([rec(0.0, [1.0], 1), rec(4.0, [5.0], 1)], 5.0)]) == \
        pytest.approx((5 + 1) / (2.0 + 4.0))  # rounds pool tokens and spans
    # An answer with a token but no text delivered (over HTTP: its token decodes to nothing) adds nothing.
    assert window_tok_s([([a, b, rec(1.0, [], tokens=1)], 9.0)]) == pytest.approx(2.5)
    assert not meets_slo({"ttft": None, "tpot": None}, None, None)


def test_capacity_is_the_full_batch_token_rate_over_the_mean_answer_length():
    from dspark_trt.bench.open_loop import capacity_from_burst

    # max batch 2, a burst of 4: the batch is full until the 2nd completion (t=2); tokens every 0.5 s.
    recs = [rec(0.0, [0.5, 1.0], 2, token_counts=[1, 1]), rec(0.0, [1.0, 2.0], 4, token_counts=[2, 2]),
            rec(0.0, [2.5, 3.0], 2, token_counts=[1, 1]), rec(0.0, [2.5, 9.0], 8, token_counts=[4, 4])]
    cap = capacity_from_burst(recs, wall=9.0, max_batch=2)
    # window (1.0, 2.0]: 2 tokens of the 2nd request; 2 tok/s over a mean answer of 4 tokens
    assert cap["window_s"] == pytest.approx(1.0) and cap["tok_s"] == pytest.approx(2.0)
    assert cap["req_s"] == pytest.approx(0.5)
    # Over HTTP (no per-delivery counts) a request's tokens are spread over its deliveries.
    for r in recs:
        r.pop("token_counts")
    assert capacity_from_burst(recs, 9.0, 2)["tok_s"] == pytest.approx(2.0)
    # Too small a burst for a full-batch window: completed / wall time.
    assert capacity_from_burst(recs[:3], 9.0, 2)["req_s"] == pytest.approx(3 / 9.0)


# ------------------------------------------------------------------------------------------- options

def test_rates_temperature_and_workload_parsing():
    assert parse_rates("2,0.5,2") == [(0.5, False), (2.0, False)]
    assert parse_rates("2x,0.5x") == [(0.5, True), (2.0, True)]
    assert parse_rates("auto", quick=True) == [(0.5, True), (2.0, True)]
    assert len(parse_rates("auto")) > 2
    for bad in ("0", "-1", "fast", "inf", "1,,2"):
        with pytest.raises(DsparkError, match="--rates"):
            parse_rates(bad)
    assert parse_temperature("0.7") == [(0.7, 1.0)]
    assert parse_temperature("0:1,1.0:3") == [(0.0, 0.25), (1.0, 0.75)]
    for bad in ("hot", "-0.5", "1.0:0", "0:x"):
        with pytest.raises(DsparkError, match="--temperature"):
            parse_temperature(bad)
    w = parse_workload("short:out=4-8,prompt=10-12")
    assert (w.prompt, w.out) == ((10, 12), (4, 8)) and w.kinds == parse_workload("mixed").kinds
    for bad in ("long", "short:out=8-4", "short:len=1-2", "short:out=0-3"):
        with pytest.raises(DsparkError, match="--workload"):
            parse_workload(bad)


def test_capacity_is_a_number_or_an_earlier_runs_results(tmp_path):
    from dspark_trt.bench.options import parse_capacity

    assert parse_capacity(None) is None
    assert parse_capacity("14.5") == (14.5, "--capacity")
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text(json.dumps({"kind": "open_loop", "capacity": {"req_s": 9.25}}))
    assert parse_capacity(str(run / "results.json")) == (9.25, str(run / "results.json"))
    assert parse_capacity(str(run)) == (9.25, str(run / "results.json"))  # the run's folder will do
    (tmp_path / "closed.json").write_text(json.dumps({"kind": "closed_loop", "levels": []}))
    for bad, why in (("0", "positive"), ("-3", "positive"), ("nan", "positive"), ("fast", "requests/s"),
                     (str(tmp_path / "closed.json"), "no measured capacity")):
        with pytest.raises(DsparkError, match=why):
            parse_capacity(bad)


def test_given_capacity_replaces_the_probe_and_sets_the_loads(tiny_artifact, tmp_path):
    from dspark_trt.bench.open_loop import run_open_loop

    said = []
    out = run_open_loop(tiny_artifact, rates="0.5x,2x", modes="off", workload="short:prompt=8-16,out=4-8",
                        num_prompts=3, capacity="40", out_dir=tmp_path / "o", warmup=False, echo=said.append)
    res = json.loads((out / "results.json").read_text())
    assert res["capacity"]["req_s"] == 40.0 and res["capacity"]["given"] == "--capacity"
    assert not any("burst" in line for line in said)  # no probe ran
    assert [e["rate"] for e in res["open_loop"]] == [20.0, 80.0]
    assert [e["load"] for e in res["open_loop"]] == [0.5, 2.0]
    assert "Capacity (given (--capacity))" in (out / "results.md").read_text()


def test_cli_refuses_a_temperature_mix_in_the_closed_loop(tiny_artifact, tmp_path):
    from click.testing import CliRunner

    from dspark_trt.cli import cli

    r = CliRunner().invoke(cli, ["bench", str(tiny_artifact), "--temperature", "0:0.5,1:0.5",
                                 "--out", str(tmp_path)])
    assert r.exit_code != 0 and "needs the open loop" in str(r.exception)
    r = CliRunner().invoke(cli, ["bench", str(tiny_artifact), "--capacity", "10", "--out", str(tmp_path)])
    assert r.exit_code != 0 and "--capacity belongs to the open loop" in str(r.exception)


# ------------------------------------------------------------------------------------------ workload

TEXT = '''import os


def f(x):
    """Return x.

    More prose here.
    """
    y = x + 1
    return y

TABLE = (
    '\\x00'   # NULL
    '\\x01'   # START
    '\\x02'   # TEXT
)
# a comment
# another comment
'''


def test_lines_are_classified_by_text_kind_and_cut_inside_a_stretch_of_one_kind():
    kinds = [k for _, k in classify_lines(TEXT)]
    assert kinds[:4] == ["code", "blank", "blank", "code"]
    assert kinds[4:8] == ["prose", "blank", "prose", "prose"]  # the docstring, its closing quotes included
    assert kinds[8:10] == ["code", "code"] and kinds[12:15] == ["data"] * 3 and kinds[16:18] == ["prose"] * 2
    cut = cut_points(TEXT, "data")
    assert [TEXT[c:].split("\n")[0].strip() for c in cut] == ["'\\x01'   # START", "'\\x02'   # TEXT"]


def test_requests_follow_the_workload_distributions_and_the_seed():
    def encode(s):
        return list(s.encode())

    w = parse_workload("mixed")
    items = build_requests(w, 200, encode, seed=1, max_context=1024, temperatures=parse_temperature("0:0.5,1.0:0.5"))
    assert all(w.prompt[0] <= len(it.ids) <= w.prompt[1] and w.out[0] <= it.max_tokens <= w.out[1] for it in items)
    assert all(len(it.ids) + it.max_tokens < 1024 for it in items)
    kinds = {k: sum(it.kind == k for it in items) / len(items) for k in ("code", "prose", "data")}
    assert kinds == pytest.approx(w.kinds, abs=0.1)
    assert np.mean([it.temperature == 1.0 for it in items]) == pytest.approx(0.5, abs=0.1)
    # The first requests do not depend on how many are drawn (every rate of a round shares them).
    few = build_requests(w, 5, encode, seed=1, max_context=1024, temperatures=parse_temperature("0:0.5,1.0:0.5"))
    assert [(it.ids, it.max_tokens, it.temperature) for it in few] == \
        [(it.ids, it.max_tokens, it.temperature) for it in items[:5]]
    # Small contexts shrink outputs and prompts to fit.
    small = build_requests(w, 20, encode, seed=2, max_context=64, temperatures=[(0.0, 1.0)])
    assert all(len(it.ids) + it.max_tokens < 64 for it in small)
    x = log_uniform(np.random.default_rng(0), 16, 512, 20_000)
    assert x.min() >= 16 and x.max() <= 512 and np.mean(x < 91) == pytest.approx(0.5, abs=0.02)  # sqrt(16*512)


# --------------------------------------------------------------------------------------------- goals

def entry(rate, mode, tok, tpot50, ttft99, overloaded):
    return {"rate": rate, "mode": mode, "output_tok_s": tok, "tpot_ms": {"p50": tpot50}, "ttft_ms": {"p99": ttft99},
            "load": 2.0 if overloaded else 0.5, "overloaded": overloaded}


def test_goals_compare_adaptive_with_the_best_baseline_at_each_rate():
    rows = [entry(1, "off", 100, 10.0, 50, False), entry(1, "fixed:2", 110, 8.0, 55, False),
            entry(1, "adaptive", 108, 8.2, 56, False),
            entry(4, "off", 300, 30.0, 900, True), entry(4, "fixed:2", 320, 28.0, 800, True),
            entry(4, "adaptive", 305, 29.5, 1000, True)]
    g1, g4 = goals(rows, [(0.0, 1.0)])
    assert g1["best_tpot_mode"] == "fixed:2" and g1["tpot_ratio"] == pytest.approx(8.2 / 8.0) and g1["tpot_holds"]
    assert g1["ttft_p99_ratio"] == pytest.approx(56 / 50) and g1["ttft_holds"] is False
    assert g1["tok_holds"] is None  # not overloaded: the throughput goal does not apply
    assert g4["tpot_ratio"] == pytest.approx(29.5 / 28.0) and g4["tpot_holds"] is False
    assert g4["tok_ratio"] == pytest.approx(305 / 320) and g4["tok_holds"] is False
    assert "t1_holds" not in g4
    t1 = goals(rows, [(1.0, 1.0)])
    assert t1[0]["t1_holds"] is True and t1[1]["t1_holds"] is True  # adaptive beats off in both figures


def test_each_goal_is_also_judged_round_by_round_with_an_interval_that_says_whether_the_run_could_tell():
    def rounds(mode, tpot, ttft, tok):
        e = entry(4, mode, sum(tok) / len(tok), sorted(tpot)[2], sorted(ttft)[2], True)
        return {**e, "round_tpot_p50_ms": tpot, "round_ttft_p99_ms": ttft, "round_output_tok_s": tok}

    rows = [rounds("off", [10, 12, 9, 11, 10], [100, 150, 90, 120, 100], [300, 280, 310, 290, 300]),
            rounds("fixed:2", [9, 11, 8, 10, 9], [100, 150, 90, 120, 100], [330, 300, 340, 310, 320]),
            # TPOT: 1.01-1.04 of fixed:2 per round, spanning 1.03; TTFT 1.2-1.3 of off's every round;
            # tok/s: 0.97-0.99 of fixed:2 in every round
            rounds("adaptive", [9.09, 11.44, 8.32, 10.1, 9.27], [125, 180, 117, 150, 120],
                   [327, 292, 333, 304, 314])]
    (g,) = goals(rows, [(0.0, 1.0)])
    tpot, ttft, tok = g["tpot_by_round"], g["ttft_by_round"], g["tok_by_round"]
    assert tpot["rounds"] == pytest.approx([1.01, 1.04, 1.04, 1.01, 1.03])
    assert tpot["median"] == pytest.approx(1.03) and tpot["interval"] == pytest.approx([1.01, 1.04])
    assert tpot["coverage"] == pytest.approx(1 - 2 / 32) and tpot["verdict"] == "undecided"
    assert ttft["verdict"] == "fails" and ttft["interval"][0] == pytest.approx(1.2)
    assert tok["verdict"] == "holds" and tok["interval"][0] >= 0.97
    one = [{**e, "round_tpot_p50_ms": e["round_tpot_p50_ms"][:1]} for e in rows]
    assert goals(one, [(0.0, 1.0)])[0]["tpot_by_round"] is None  # one round cannot say
    assert "**fails**" in "\n".join(_render_by_round([g]))


# --------------------------------------------------------------------------------------------- end to end

OPEN_KEYS = {"rate", "mode", "output_tok_s", "ttft_ms", "tpot_ms", "completed", "failed", "goodput", "req_s",
             "itl_ms", "queue_wait_ms", "load", "goodput_frac"}


def test_quick_via_http_smoke_run_under_a_minute(tiny_artifact, tmp_path):
    from click.testing import CliRunner

    from dspark_trt.cli import cli

    out = tmp_path / "open"
    start = time.monotonic()
    r = CliRunner().invoke(cli, ["bench", str(tiny_artifact), "--quick", "--via-http", "--modes", "off,adaptive",
                                 "--duration", "1.5", "--workload", "short:prompt=8-24,out=4-16",
                                 "--temperature", "0:0.5,1.0:0.5", "--api-key", "s3cret", "--out", str(out)])
    elapsed = time.monotonic() - start
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert elapsed < 60, f"the smoke run took {elapsed:.0f} s"
    res = json.loads((out / "results.json").read_text())
    assert res["complete"] is True and res["kind"] == "open_loop" and res["settings"]["driver"] == "http"
    assert not any("s3cret" in p.read_text() for p in out.rglob("*") if p.is_file() and p.suffix != ".png")
    assert res["capacity"]["req_s"] > 0
    rows = res["open_loop"]
    assert sorted({e["mode"] for e in rows}) == ["adaptive", "off"] and len(rows) == 4
    loads = sorted({e["load"] for e in rows})
    assert loads == pytest.approx([0.5, 2.0]) and [e["overloaded"] for e in rows] == [False] * 2 + [True] * 2
    for e in rows:
        assert OPEN_KEYS <= set(e), OPEN_KEYS - set(e)
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert set(e[key]) == {"p50", "p90", "p99"}
            assert e[key]["p50"] <= e[key]["p90"] <= e[key]["p99"]
        # the key reached the server; (the arrival-window rate may be 0 at the overloading rate of so short a
        # run: every first token can come after the last of its ~1 s of arrivals)
        assert e["failed"] == 0 and e["completed"] >= 1 and e["output_tok_s_whole_run"] > 0 <= e["output_tok_s"]
        # below the capacity some request meets the SLOs; overloaded, none may (CI ran one at goodput 0)
        assert (0 <= e["goodput"] if e["overloaded"] else 0 < e["goodput"]) and e["goodput"] <= e["req_s"] + 1e-9
        q = e["queue_wait_ms"]  # the server's own figure, sent beside usage
        assert q["p50"] is not None and 0 <= q["p50"] <= q["p99"]
        assert set(e["by_temperature"]) <= {"0.0", "1.0"}
    assert [g["rate"] for g in res["goals"]] == sorted({e["rate"] for e in rows})
    assert (out / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "results.md").read_text()
    assert "## Goals" in md and "## Results" in md and (out / "server.log").is_file()


def test_in_process_runs_record_what_the_runtime_decided_and_predicted(tiny_artifact):
    """tau and the predicted/measured sums (issue 22's explain fields) per (rate, mode), in process."""
    from collections import namedtuple

    from dspark_trt.bench.inprocess import run_inprocess
    from dspark_trt.bench.open_loop import _spec_stats
    from dspark_trt.runtime import Runtime

    Item = namedtuple("Item", "ids kind temperature max_tokens seed")
    items = [Item([5 + i, 7, 9, 11], "code", t, 12, i) for i, t in enumerate((0.0, 0.0, 1.0))]
    with Runtime.load(tiny_artifact) as rt:
        records, wall = run_inprocess(rt, items, [0.0, 0.01, 0.02], "fixed:2")
    assert wall > 0 and all(r["ok"] and r["generated_tokens"] == 12 for r in records)
    assert all(r["spec"]["generated"] == 12 and r["spec"]["steps"] >= 1 for r in records)
    # Delivery times are the runtime's stamps, one per step that delivered: never two at once (an ITL of 0).
    for r in records:
        t = r["token_times_s"]
        assert len(t) == len(r["token_counts"]) and all(b > a for a, b in zip(t, t[1:])), t
    stats = _spec_stats(records)
    steps = sum(r["spec"]["steps"] for r in records)
    assert stats["tau"] == pytest.approx(3 * 11 / steps) and 1.0 <= stats["tau"] <= 3.0  # fixed:2: at most 3 a step
    assert 0 <= stats["accepted"] <= 2 * steps and stats["predicted_accepted"] > 0
    assert stats["measured_step_ms"] > 0 and stats["predicted_step_ms"] > 0
    assert _spec_stats([{k: v for k, v in r.items() if k != "spec"} for r in records]) == {}  # over HTTP
