"""Benchmark harness: oracle math, argument parsing, prompts, and a tiny end-to-end run (with peers)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspark_trt.bench.harness import (DEFAULT_CONCURRENCY, DEFAULT_MAX_NEW_TOKENS, DEFAULT_MODES, DEFAULT_NUM_PROMPTS,
                                      QUICK, _summary, apply_quick, median_interval, parse_concurrency, parse_modes,
                                      resolve_out_dir, steady_window, summarize_requests)
from dspark_trt.bench.oracle import as_cost_fn, draft_batches, draft_cost, oracle_goodput, step_costs
from dspark_trt.bench.prompts import corpus_prompts, file_prompts, prompt_budget, read_prompt_file
from dspark_trt.errors import DsparkError

VERIFY = np.arange(64, dtype=np.float64)  # 1 ms per target token
DRAFT = np.array([0.0, 2.0, 3.0, 4.0, 5.0])  # ms per draft call by batch size


def rec(verify_lens, accepted, drafted, prefill=0, **extra):
    n = len(verify_lens)
    return {"decode_requests": n, "prefill_tokens": prefill, "verify_lens": verify_lens, "accepted": accepted,
            "drafted": drafted, "target_tokens": n + sum(verify_lens) + prefill, "draft_ms": 0.0,
            "target_ms": 0.0, "solver_us": 0.0, **extra}


# ------------------------------------------------------------------------------------------- oracle

def test_draft_batches_and_cost():
    assert draft_batches([3, 1, 0]) == [2, 1, 1]
    assert draft_batches([0, 0]) == []
    assert draft_batches([]) == []
    assert draft_cost([3, 1, 0], DRAFT) == 3.0 + 2.0 + 2.0
    assert draft_cost([2, 2], lambda b: 10.0 * b) == 40.0


def test_cost_fn_extrapolates_linearly():
    f = as_cost_fn([0.0, 1.0, 3.0])
    assert (f(0), f(1), f(2), f(4)) == (0.0, 1.0, 3.0, 7.0)
    with pytest.raises(ValueError):
        as_cost_fn([1.0])


def test_step_costs_hand_computed():
    # Two decode requests: A drafted 4, verified 3, accepted 1; B drafted 1, verified 1, accepted 1; plus a
    # 5-token prompt chunk. Actual: draft calls over [2, 1, 1, 1] requests = 3 + 2 + 2 + 2 = 9 ms, target
    # 2 + 4 + 5 = 11 tokens = 11 ms. Oracle: draft [1, 1] -> one call over 2 = 3 ms, target 2 + 2 + 5 = 9 ms.
    actual, oracle = step_costs(rec([3, 1], [1, 1], [4, 1], prefill=5), VERIFY, DRAFT)
    assert actual == pytest.approx(20.0)
    assert oracle == pytest.approx(12.0)


def test_goodput_of_a_log():
    log = [rec([3, 1], [1, 1], [4, 1], prefill=5),  # 20 vs 12
           rec([2], [2], [2]),                       # perfect: 2+2 draft + 3 verify = 7 both
           rec([0, 0], [0, 0], [0, 0])]              # plain decoding: 2 ms both
    g = oracle_goodput(log, VERIFY, DRAFT)
    assert g["actual_ms"] == pytest.approx(29.0)
    assert g["oracle_ms"] == pytest.approx(21.0)
    assert g["fraction"] == pytest.approx(21.0 / 29.0)
    assert g["steps"] == 3
    assert g["wasted_verify_tokens"] == 2
    assert g["wasted_draft_tokens"] == 3
    assert g["emitted_tokens"] == (2 + 2) + (1 + 2) + 2
    assert oracle_goodput([rec([2], [2], [2])], VERIFY, DRAFT)["fraction"] == 1.0
    assert oracle_goodput([], VERIFY, DRAFT)["fraction"] is None


def test_goodput_never_exceeds_one_for_monotone_costs():
    rng = np.random.default_rng(0)
    verify = np.concatenate([[0.0], np.cumsum(rng.random(80))])
    draft = np.concatenate([[0.0], np.cumsum(rng.random(10))])
    log = []
    for _ in range(50):
        n = int(rng.integers(1, 6))
        d = rng.integers(0, 5, n)
        v = np.array([rng.integers(0, x + 1) for x in d])
        a = np.array([rng.integers(0, x + 1) for x in v])
        log.append(rec(v.tolist(), a.tolist(), d.tolist(), prefill=int(rng.integers(0, 4))))
        actual, oracle = step_costs(log[-1], verify, draft)
        assert oracle <= actual + 1e-12
    assert 0 < oracle_goodput(log, verify, draft)["fraction"] <= 1.0


def test_oracle_rejects_inconsistent_records():
    with pytest.raises(ValueError, match="accepted <= verify_len"):
        step_costs(rec([1], [2], [2]), VERIFY, DRAFT)
    bad = rec([1], [1], [1])
    bad["target_tokens"] = 1
    with pytest.raises(ValueError, match="target tokens"):
        step_costs(bad, VERIFY, DRAFT)


# --------------------------------------------------------------------------------------- arguments

def test_parse_arguments():
    assert parse_concurrency("4,1, 2,4") == [1, 2, 4]
    assert parse_modes("off,fixed:2,adaptive,fixed:0,off", 4) == ["off", "fixed:2", "adaptive"]
    for bad in ("0", "1,x", "", "2.5", "-1"):
        with pytest.raises(DsparkError, match="--concurrency"):
            parse_concurrency(bad)
    for bad in ("off,bogus", "fixed:", "fixed:-1"):
        with pytest.raises(DsparkError, match="--modes"):
            parse_modes(bad)
    with pytest.raises(DsparkError, match="max draft length 4"):
        parse_modes("fixed:7", 4)


def test_quick_preset_only_replaces_defaults():
    assert apply_quick(DEFAULT_CONCURRENCY, DEFAULT_MODES, DEFAULT_NUM_PROMPTS, DEFAULT_MAX_NEW_TOKENS) == (
        QUICK["concurrency"], QUICK["modes"], QUICK["num_prompts"], QUICK["max_new_tokens"])
    assert apply_quick("2", "off", 5, 7) == ("2", "off", 5, 7)


@pytest.mark.parametrize("args, what", [(["--concurrency", "1,zero"], "--concurrency"),
                                        (["--modes", "off,sometimes"], "--modes"),
                                        # open loop, refused before anything runs
                                        (["--rates", "fast"], "--rates"), (["--workload", "long"], "--workload"),
                                        (["--rates", "1", "--temperature", "hot"], "--temperature"),
                                        (["--rates", "1", "--modes", "sometimes"], "--modes"),
                                        (["--via-http", "--concurrency", "4"], "--concurrency belongs"),
                                        (["--duration", "5"], "--duration belongs to the open loop")])
def test_bad_values_are_one_line_errors(args, what, tmp_path, capsys):
    from dspark_trt.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", str(tmp_path / "no-artifact"), *args, "--out", str(tmp_path / "out")])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {what}") and "\n" not in err, err
    assert not (tmp_path / "out").exists()


def test_out_dir_is_never_overwritten(tmp_path):
    out = tmp_path / "res"
    assert resolve_out_dir(out) == (out, None)
    out.mkdir()
    (out / "other.txt").write_text("x")
    assert resolve_out_dir(out)[0] == out
    (out / "results.json").write_text("{}")
    sub, note = resolve_out_dir(out)
    assert sub.parent == out and sub.name.startswith("run-") and "already holds results" in note
    assert resolve_out_dir(out, force=True)[0] == out
    (tmp_path / "file").write_text("x")
    with pytest.raises(DsparkError, match="is a file"):
        resolve_out_dir(tmp_path / "file")


def test_summarize_requests_definitions():
    reqs = [{"generated_tokens": 10, "latency_s": t, "time_to_first_token_s": 0.1} for t in
            (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 10.0)]
    s = summarize_requests(reqs, wall_s=5.0)
    assert s["output_tok_s"] == pytest.approx(110 / 5.0)
    assert s["per_user_tok_s_p50"] == pytest.approx(10.0)
    assert s["per_user_tok_s_p90"] == pytest.approx(np.percentile([10.0] * 9 + [5.0, 1.0], 10))
    assert s["per_user_tok_s_p90"] < s["per_user_tok_s_p50"]  # p90 is the slow tail
    assert s["tpot_ms_p50"] == pytest.approx(900 / 9)
    peer = summarize_requests([{"generated_tokens": 4, "latency_s": 2.0}], wall_s=2.0)
    assert peer["tpot_ms_p50"] == pytest.approx(500.0) and peer["ttft_ms_p50"] is None


def test_steady_window_is_the_stretch_at_full_concurrency():
    """Two users, six requests: the window runs from the second completion (t=5.5, the opening wave done) to
    the last submission (t=8, after the fourth completion) and is cut at the step ends inside it; the opening
    wave and the drain are left out."""
    timeline = [(float(t), 10 * t) for t in range(1, 13)]  # 10 tokens per unit of time, steps end at 1..12
    reqs = [{"submitted_at": 0.0, "done_at": 4.0}, {"submitted_at": 0.0, "done_at": 5.5},
            {"submitted_at": 4.0, "done_at": 7.0}, {"submitted_at": 5.5, "done_at": 8.0},
            {"submitted_at": 7.0, "done_at": 11.0}, {"submitted_at": 8.0, "done_at": 12.0}]
    tokens, seconds = steady_window(timeline, reqs, 2)
    assert (tokens, seconds) == (20, 2.0)  # steps ending at 6..8


def _toy_closed_loop(users: int, n: int, new_tokens: int, prefill_s: float = 1.0, decode_s: float = 0.1):
    """A toy runtime's (timeline, requests): a step prefills one waiting prompt (prefill_s, its first token) and
    decodes a token for every started request; each user submits its next request the moment one finishes."""
    t, out, timeline, done, submitted = 0.0, 0, [], [], users
    waiting, active = [{"submitted_at": 0.0, "left": new_tokens} for _ in range(users)], []
    while waiting or active:
        t += prefill_s if waiting else decode_s
        for r in active:
            r["left"] -= 1
            out += 1
        if waiting:
            r = waiting.pop(0)
            r["left"] -= 1
            out += 1
            active.append(r)
        timeline.append((t, out))
        for r in [r for r in active if r["left"] == 0]:
            active.remove(r)
            r["done_at"] = t
            done.append(r)
            if submitted < n:
                waiting.append({"submitted_at": t, "left": new_tokens})
                submitted += 1
    return timeline, done


@pytest.mark.parametrize("users", [2, 4, 16])
def test_steady_window_of_three_waves_reads_the_rate_of_a_long_run(users):
    # Prompts prefilled one a step make the requests of a wave finish a step apart, wave after wave: a window
    # from the first completion took in two prefill stretches for one of decoding (19% low at two users).
    long_timeline, _ = _toy_closed_loop(users, 200 * users, 8)
    long_run = long_timeline[-1][1] / long_timeline[-1][0]
    tokens, seconds = steady_window(*_toy_closed_loop(users, 3 * users, 8), users)
    assert tokens / seconds == pytest.approx(long_run, rel=0.002)


def test_steady_window_slow_drain_does_not_count():
    """Same steady stretch, one straggler at the end: the whole-run rate drops, the steady rate does not."""
    fast = [(float(t), 10 * t) for t in range(1, 9)]
    slow = fast + [(float(t), 80 + t) for t in range(9, 20)]  # the drain: one request left, 1 token a step
    reqs = [{"submitted_at": 0.0, "done_at": 2.0}, {"submitted_at": 2.0, "done_at": 6.0},
            {"submitted_at": 6.0, "done_at": 19.0}]
    a, b = steady_window(fast, reqs, 1), steady_window(slow, reqs, 1)
    assert a == b and a[0] / a[1] == pytest.approx(10.0)


def test_steady_window_needs_a_full_concurrency_stretch():
    one_wave = [{"submitted_at": 0.0, "done_at": 5.0}, {"submitted_at": 0.0, "done_at": 6.0}]
    assert steady_window([(float(t), t) for t in range(1, 8)], one_wave, 2) is None
    assert steady_window([], [{"submitted_at": 3.0, "done_at": 1.0}], 1) is None
    assert steady_window([(1.0, 1)], [], 1) is None



def _cell(mode, rounds, c=8):
    return {"mode": mode, "concurrency": c, "round_output_tok_s": list(rounds),
            "output_tok_s": float(np.median(rounds))}


def test_summary_in_sample_best_is_the_luckiest_held_out_is_not():
    # Every mode is truly as fast (100 tok/s); the fixed modes' rounds carry noise, adaptive's none.
    runs = [_cell("off", [90, 90, 90]), _cell("fixed:1", [104, 96, 103]), _cell("fixed:2", [97, 104, 102]),
            _cell("fixed:3", [103, 101, 95]), _cell("adaptive", [100, 100, 100])]
    s, = _summary(runs, [8])
    # In sample: the highest median (fixed:1, 103) is the luckiest, and adaptive looks 3% slower.
    assert s["best_fixed"] == "fixed:1" and s["adaptive_over_best"] == pytest.approx(100 / 103)
    assert s["adaptive_over_best_rounds"] == pytest.approx([100 / 104, 100 / 96, 100 / 103])
    # Held out: round 1 against the best of rounds 2-3 (fixed:2, 103 there), and so on.
    assert s["held_out_picks"] == ["fixed:2", "fixed:1", "fixed:3"]
    assert s["adaptive_over_best_held_out"] == pytest.approx(np.median([100 / 97, 100 / 96, 100 / 95]))


def test_summary_held_out_pick_follows_a_majority_of_rounds():
    # Faster in two rounds of three is not luck to the held-out pick: fixed:2 is picked every round.
    runs = [_cell("off", [80, 80, 80]), _cell("fixed:2", [130, 100, 130]), _cell("fixed:3", [101, 101, 101]),
            _cell("adaptive", [101, 101, 101])]
    s, = _summary(runs, [8])
    assert s["best_fixed"] == "fixed:2" and s["adaptive_over_best"] == pytest.approx(101 / 130)
    assert s["held_out_picks"] == ["fixed:2"] * 3
    assert s["adaptive_over_best_held_out"] == pytest.approx(101 / 130)


def test_summary_held_out_keeps_a_real_loss():
    # A baseline that is faster in every round stays the pick, and the ratio shows the loss.
    runs = [_cell("off", [100, 96, 104]), _cell("fixed:1", [120, 115, 125]), _cell("adaptive", [100, 96, 104])]
    s, = _summary(runs, [8])
    assert s["held_out_picks"] == ["fixed:1"] * 3
    assert s["adaptive_over_best_held_out"] == pytest.approx(np.median([100 / 120, 96 / 115, 104 / 125]))
    assert s["adaptive_over_off"] == pytest.approx(1.0)


def test_summary_held_out_needs_two_rounds():
    s, = _summary([_cell("off", [80]), _cell("fixed:2", [90]), _cell("adaptive", [95])], [8])
    assert s["adaptive_over_best_held_out"] is None and s["held_out_picks"] == []
    assert s["adaptive_over_best"] == pytest.approx(95 / 90)


def test_summary_held_out_interval_spans_the_rounds_and_says_its_coverage():
    runs = [_cell("off", [100] * 5), _cell("fixed:1", [110, 120, 100, 115, 105]),
            _cell("adaptive", [121, 108, 110, 115, 99])]
    s, = _summary(runs, [8])
    assert s["held_out_picks"] == ["fixed:1"] * 5
    ratios = [121 / 110, 108 / 120, 110 / 100, 115 / 115, 99 / 105]
    assert s["adaptive_over_best_held_out_rounds"] == pytest.approx(ratios)
    assert s["adaptive_over_best_held_out_interval"] == pytest.approx([min(ratios), max(ratios)])
    assert s["adaptive_over_best_held_out_coverage"] == pytest.approx(1 - 2 / 32)


def test_summary_first_tokens_are_judged_held_out_too():
    """A cold start's first 512 tokens are one short window a round: against the luckiest baseline's median
    adaptive reads low; against the baseline that led the other rounds it does not."""
    def cell(mode, first):
        return dict(_cell(mode, [100, 100, 100]), round_first_tokens_tok_s=list(first),
                    first_tokens_tok_s=float(np.median(first)))

    runs = [cell("off", [70, 70, 70]), cell("fixed:3", [118, 96, 100]), cell("fixed:4", [95, 117, 102]),
            cell("adaptive", [100, 100, 100])]
    s, = _summary(runs, [8])
    assert s["adaptive_over_best_first_tokens"] == pytest.approx(100 / 102)  # fixed:4's median, its lucky round
    # Round 1 against fixed:4 (best of rounds 2-3), round 2 against fixed:3, round 3 against fixed:3 (107 > 106).
    assert s["adaptive_over_best_first_tokens_held_out"] == pytest.approx(np.median([100 / 95, 100 / 96, 100 / 100]))
    assert s["adaptive_over_best_first_tokens_held_out_interval"] == pytest.approx([100 / 100, 100 / 95])
    # A run without first tokens (no round reached 512) has no held-out figure either.
    runs[-1]["round_first_tokens_tok_s"] = [100, None, 100]
    s, = _summary(runs, [8])
    assert s["adaptive_over_best_first_tokens_held_out"] is None


def test_median_interval_is_the_sign_test_interval():
    # n = 10: the 2nd lowest to the 2nd highest covers 1 - 2 * 11/1024; the 3rd to the 8th would cover
    # only 1 - 2 * 56/1024 = 0.89, below 0.9.
    lo, hi, cov = median_interval(range(10, 0, -1))
    assert (lo, hi) == (2, 9) and cov == pytest.approx(1 - 22 / 1024)
    assert median_interval(range(10), level=0.8)[:2] == (2, 7)
    # Too few values for the level: the whole range, with the coverage it really has.
    assert median_interval([3, 1, 2]) == (1, 3, pytest.approx(0.75))
    assert median_interval([1.0]) is None and median_interval([]) is None
    assert median_interval([None, 2.0, 1.0]) == (1.0, 2.0, pytest.approx(0.5))


def test_engine_drift_is_the_median_over_modes_of_fastest_over_slowest_round():
    runs = [dict(_cell("off", [1, 1, 1]), round_engine_speed=[1.0, 0.8, 0.9]),
            dict(_cell("fixed:1", [1, 1, 1]), round_engine_speed=[0.5, 0.6, 0.55]),
            dict(_cell("fixed:2", [1, 1, 1]), round_engine_speed=[1.0, 1.0, 1.1]),
            dict(_cell("adaptive", [1, 1, 1]), round_engine_speed=[])]
    s, = _summary(runs, [8])
    assert s["engine_drift"] == pytest.approx(1.2)
    assert _summary([_cell("off", [1, 2]), _cell("adaptive", [1, 2])], [8])[0]["engine_drift"] is None


# ------------------------------------------------------------------------------------------ prompts

def _tok():
    # A byte-level stand-in tokenizer: one token per byte.
    return (lambda s: list(s.encode())), (lambda ids: bytes(ids).decode(errors="replace"))


def test_corpus_prompts_are_seeded_and_fit(tmp_path):
    files = []
    for i in range(3):
        f = tmp_path / f"m{i}.py"
        f.write_text("".join(f"def f{i}_{k}(x):\n    return x + {k}\n\n" for k in range(40)))
        files.append(f)
    (tmp_path / "empty.py").write_text("\n\n")
    files.append(tmp_path / "empty.py")
    enc, dec = _tok()
    a = corpus_prompts(enc, dec, 7, seed=3, max_len=30, min_len=20, files=files)
    b = corpus_prompts(enc, dec, 7, seed=3, max_len=30, min_len=20, files=files)
    c = corpus_prompts(enc, dec, 7, seed=4, max_len=30, min_len=20, files=files)
    assert [p.ids for p in a] == [p.ids for p in b] != [p.ids for p in c]
    assert len(a) == 7 and all(20 <= len(p.ids) <= 30 for p in a)
    assert all(p.text.strip() and p.source.split(":")[0].startswith("m") for p in a)
    assert prompt_budget(256, 200) == 56 and prompt_budget(256, 8) == 60
    with pytest.raises(DsparkError, match="no room"):
        prompt_budget(64, 64)


def test_prompt_files(tmp_path):
    enc, dec = _tok()
    txt = tmp_path / "p.txt"
    txt.write_text('def a():\n\n"line one\\nline two"\n' + "x" * 100 + "\n")
    assert [t for t, _ in read_prompt_file(txt)] == ["def a():", "line one\nline two", "x" * 100]
    prompts, cut = file_prompts(txt, enc, dec, 10, max_len=50)
    assert cut == 1 and len(prompts[2].ids) == 50 and prompts[0].source == "p.txt:1"
    jl = tmp_path / "p.jsonl"
    jl.write_text(json.dumps({"prompt": "import os\n"}) + "\n\n" + json.dumps({"prompt": "class A:"}) + "\n")
    assert [t for t, _ in read_prompt_file(jl)] == ["import os\n", "class A:"]
    assert len(file_prompts(jl, enc, dec, 1, 50)[0]) == 1
    jl.write_text(json.dumps({"text": "no prompt key"}) + "\n")
    with pytest.raises(DsparkError, match=r"p.jsonl:1 has no string \"prompt\""):
        read_prompt_file(jl)
    with pytest.raises(DsparkError, match="does not exist"):
        read_prompt_file(tmp_path / "missing.txt")


# ------------------------------------------------------------------------------------- end to end

def test_a_run_is_sliced_so_that_each_slice_keeps_three_waves_a_user_and_eight_requests():
    from dspark_trt.bench.options import run_slices

    assert run_slices(64, 1) == [(i, i + 8) for i in range(0, 64, 8)]
    assert run_slices(64, 4) == [(0, 13), (13, 26), (26, 38), (38, 51), (51, 64)]  # 12 requests at least
    assert run_slices(64, 16) == [(0, 64)] and run_slices(192, 64) == [(0, 192)]  # at load: one slice
    assert run_slices(3, 1) == [(0, 3)]  # too few to cut


def test_modes_take_turns_slice_by_slice_on_the_same_requests(tiny_artifact, tmp_path, monkeypatch):
    import dspark_trt.bench.harness as harness

    calls = []
    measure = harness._measure

    def recorded(rt, prompts, mode, c, n, *args):
        calls.append((mode, args[-1], n))  # (mode, first request, requests)
        return measure(rt, prompts, mode, c, n, *args)

    monkeypatch.setattr(harness, "_measure", recorded)
    out = harness.run_bench(tiny_artifact, concurrency="1", modes="off,adaptive", num_prompts=16, max_new_tokens=4,
                            out_dir=tmp_path / "b", progress=False, rounds=2, echo=lambda s: None)
    # Two slices of 8 requests a round; each slice runs every mode, the order rotated from slice to slice.
    assert calls == [("off", 0, 8), ("adaptive", 0, 8), ("adaptive", 8, 8), ("off", 8, 8),
                     ("off", 0, 8), ("adaptive", 0, 8), ("adaptive", 8, 8), ("off", 8, 8)]
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["slices_per_round"] == {"1": 2}
    for r in res["runs"]:  # a round is its slices together: all 16 requests, in order, once a round
        assert r["rounds"] == 2 and r["requests"] == 32 and r["generated_tokens"] == 32 * 4
        assert r["steady_state"] and len(r["round_output_tok_s"]) == 2 and r["greedy_match_off"] == 1.0
        assert r["output_tok_s_whole_run"] == pytest.approx(r["generated_tokens"] / r["wall_s"])


def test_a_round_of_slices_sums_their_windows_and_lays_their_first_tokens_end_to_end():
    from dspark_trt.bench.closed_loop import merge_slices

    def part(t0, done, timeline, window):
        return {"requests": [{"submitted_at": t0, "done_at": done}], "wall_s": done - t0, "snapshots": [{}],
                "step_log": [{"s": t0}], "timeline": timeline, "window": window, "first_tokens": None,
                "survival_correction": {"t": t0}}

    # Two slices 100 s apart (other modes ran between): 300 tokens in 1 s, then 300 more in 2 s.
    a = part(0.0, 1.0, [(0.5, 100), (1.0, 300)], (200, 0.5))
    b = part(100.0, 102.0, [(101.0, 200), (102.0, 300)], (100, 1.0))
    m = merge_slices([a, b])
    assert m["window"] == (300, 1.5) and m["wall_s"] == 3.0
    assert m["timeline"] == [(0.5, 100), (1.0, 300), (2.0, 500), (3.0, 600)]
    assert m["first_tokens"] == pytest.approx(600 / 3.0)  # FIRST_TOKENS = 512, reached at the second slice's end
    assert len(m["step_log"]) == 2 and m["survival_correction"] == {"t": 100.0}
    assert merge_slices([a, part(100.0, 102.0, [], None)])["window"] is None  # a slice without one: none
    assert merge_slices([a]) is a


RUN_KEYS = {"mode", "concurrency", "output_tok_s", "per_user_tok_s_p50", "per_user_tok_s_p90", "tpot_ms_p50", "tau",
            "acceptance_per_position", "verified_tokens_per_step", "solver_us_per_step", "overhead_frac",
            "oracle_goodput_frac", "greedy_match_off", "requests", "generated_tokens", "wall_s",
            "predicted_accepted", "accepted", "predicted_step_ms", "measured_step_ms"}


def test_tiny_bench_end_to_end_with_peers(tiny_artifact, tmp_path):
    pytest.importorskip("transformers")
    from click.testing import CliRunner

    from dspark_trt.bench.harness import run_bench
    from dspark_trt.cli import cli

    out = tmp_path / "bench"
    messages = []
    path = run_bench(tiny_artifact, concurrency="1,2,16", modes="off,fixed:2,adaptive", num_prompts=3,
                     max_new_tokens=8, out_dir=out, peers=True, peer_engines="hf", echo=messages.append,
                     progress=False, rounds=3)
    assert path == out
    assert any("exceeds the artifact's max batch 8" in m for m in messages)
    res = json.loads((out / "results.json").read_text())
    assert res["complete"] is True
    assert {"cpu", "cpu_count", "versions", "backend", "artifact", "command"} <= set(res["env"])
    assert res["env"]["command"].startswith("dspark-trt bench ")
    runs = res["runs"]
    assert [(r["concurrency"], r["mode"]) for r in runs] == [(c, m) for c in (1, 2, 8)
                                                             for m in ("off", "fixed:2", "adaptive")]
    for r in runs:
        assert RUN_KEYS <= set(r), RUN_KEYS - set(r)
        assert r["generated_tokens"] == r["requests"] * 8 and r["output_tok_s"] > 0
        assert r["output_tok_s_whole_run"] == pytest.approx(r["generated_tokens"] / r["wall_s"])
        assert r["steady_state"] is True  # three requests per user: a full-concurrency stretch in every round
        assert len(r["round_output_tok_s"]) == len(r["round_output_tok_s_whole_run"]) == r["rounds"]
        assert r["output_tok_s"] == pytest.approx(float(np.median(r["round_output_tok_s"])))  # median of rounds
        assert len(r["round_engine_speed"]) == 3 and all(x > 0 for x in r["round_engine_speed"])
        assert r["requests"] == 3 * max(3, 3 * r["concurrency"])  # 3 rounds of: every prompt, >= 3 waves a user
        assert len(r["acceptance_per_position"]) == 4
        assert r["greedy_match_off"] == 1.0  # greedy speculation is lossless
        if r["mode"] == "off":
            assert r["tau"] == 1.0 and r["oracle_goodput_frac"] is None
        else:
            assert 0 < r["oracle_goodput_frac"] <= 1.0 and r["tau"] >= 1.0
    assert [s["concurrency"] for s in res["summary"]] == [1, 2, 8]
    assert all(s["adaptive_over_off"] > 0 for s in res["summary"])
    for s in res["summary"]:  # three rounds: the interval is their whole range, 75% coverage
        lo, hi = s["adaptive_over_best_held_out_interval"]
        assert lo <= s["adaptive_over_best_held_out"] <= hi and s["adaptive_over_best_held_out_coverage"] == 0.75
        assert s["engine_drift"] >= 1.0
    # Peers: transformers plain and assisted greedy decoding reproduce our `off` tokens exactly.
    peers = {p["mode"]: p for p in res["peers"]}
    assert set(peers) == {"hf:target", "hf:assisted"}
    for p in peers.values():
        assert p["concurrency"] == 1 and p["generated_tokens"] == 3 * 8
        assert p["greedy_match_off"] == 1.0, p.get("greedy_mismatches")
    assert peers["hf:assisted"]["assistant"]["num_assistant_tokens"]
    assert {c["mode"] for c in res["comparison_c1"]} >= {"off", "adaptive", "hf:target", "hf:assisted"}
    md = (out / "results.md").read_text()
    assert res["env"]["command"] in md and "adaptive / max(off, best fixed)" in md and "## Headline" in md
    assert "transformers assisted generation" in md
    assert (out / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Through the CLI, into the same --out: the first results stay, the new ones go to a subdirectory.
    before = (out / "results.json").read_text()
    r = CliRunner().invoke(cli, ["bench", str(tiny_artifact), "--concurrency", "1", "--modes", "off",
                                 "--num-prompts", "1", "--max-new-tokens", "2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert (out / "results.json").read_text() == before
    sub = [d for d in out.iterdir() if d.is_dir() and d.name.startswith("run-")]
    assert len(sub) == 1 and (sub[0] / "results.md").is_file() and (sub[0] / "throughput.png").is_file()
    assert json.loads((sub[0] / "results.json").read_text())["runs"][0]["generated_tokens"] == 3 * 2  # 3 waves


@pytest.mark.parametrize("n", [2, 3, 4, 5, 9])
def test_modes_run_in_orders_where_each_follows_every_other_equally_often_and_holds_every_place(n):
    from collections import Counter

    from dspark_trt.bench.options import mode_order

    names = [f"m{i}" for i in range(n)]
    cycle = 2 * n if n % 2 else n
    orders = [mode_order(names, t) for t in range(cycle)]
    assert all(sorted(o) == names for o in orders)
    assert mode_order(names, cycle + 1) == orders[1]  # the design repeats
    follows = Counter((a, b) for o in orders for a, b in zip(o, o[1:]))
    assert set(follows) == {(a, b) for a in names for b in names if a != b}
    assert len(set(follows.values())) == 1
    for place in range(n):
        assert Counter(o[place] for o in orders) == Counter({m: cycle // n for m in names})
