"""The command line: every command listed, one-line errors with exit 1, JSON output of generate."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from dspark_trt import __version__

COMMANDS = ["export", "check", "build", "generate", "profile", "train-head", "calibrate", "bench", "serve"]


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "dspark_trt.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_help_lists_every_command_and_version():
    out = run("--help")
    assert out.returncode == 0
    for cmd in COMMANDS:
        assert cmd in out.stdout
    v = run("--version")
    assert v.returncode == 0 and __version__ in v.stdout


def test_user_error_is_one_line_and_debug_shows_traceback(tmp_path):
    out = run("generate", str(tmp_path / "missing"), "--prompt", "x")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [f"error: artifact directory {tmp_path / 'missing'} does not exist: "
                                               "create it with `dspark-trt export`"]
    dbg = run("--debug", "generate", str(tmp_path / "missing"), "--prompt", "x")
    assert dbg.returncode != 0 and "Traceback" in dbg.stderr


def test_bad_option_value_exits_nonzero_without_traceback():
    out = run("generate", ".", "--temperature", "-1")
    assert out.returncode == 2 and "Traceback" not in out.stderr


def test_generate_json_and_compare(tiny_artifact):
    out = run("generate", str(tiny_artifact), "--prompt", "def fib(n):", "--prompt", "import os", "--max-new-tokens", "12",
              "--json", "--compare")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert len(data["results"]) == 2
    for r in data["results"]:
        assert set(r) >= {"prompt", "text", "token_ids", "stats"}
        assert set(r["stats"]) >= {"steps", "accepted_per_position", "tau", "verified_tokens", "tokens_per_s"}
        assert len(r["token_ids"]) == 12
    assert data["summary"]["identical_to_off"] is True


def test_generate_prints_text_and_speedup(tiny_artifact, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "class A:"}) + "\n")
    out = run("generate", str(tiny_artifact), "--prompts-file", str(prompts), "--max-new-tokens", "8", "--compare",
              "--spec", "fixed:2")
    assert out.returncode == 0, out.stderr
    assert "class A:" in out.stdout and "speed-up" in out.stdout and "identical" in out.stdout


def test_profile_writes_a_cost_profile(tiny_artifact, monkeypatch):
    # --force: the machine running the suite may be busy enough for the spread refusal (specified with fake
    # timings in test_robust_profile.py); this test is about what a profile holds. Sleeping threads: the
    # profile's name then does not depend on how busy the machine is (spinning ones write
    # cost_profile.ort.spin.json, tests/test_ort_threads.py).
    monkeypatch.setenv("DSPARK_ORT_SPIN", "0")
    out = run("profile", str(tiny_artifact), "--repeats", "1", "--force")
    assert out.returncode == 0, out.stderr
    prof = json.loads((tiny_artifact / "cost_profile.json").read_text())
    v = prof["verify_ms"]
    assert all(b >= a for a, b in zip(v, v[1:]))  # monotone
    assert prof["meta"]["backend"] == "ort" and prof["meta"]["past"] == 128  # the default profile context
    # Target calls of varied shape for the call-shape model: many rows and few, even and uneven depth,
    # a prompt chunk among decode rows; a fitted model that predicts them.
    shapes = np.asarray(prof["points"]["verify_shapes"])
    assert len(shapes) >= 10 and len(set(shapes[:, 1])) >= 3 and (shapes[:, 4] > 0).all()
    from dspark_trt.runtime.costs.table import CostTable

    model = CostTable.load(tiny_artifact / "cost_profile.json").call_shape
    pred = np.array([model.ms(*map(int, s[:4])) for s in shapes])
    assert np.median(np.abs(pred / shapes[:, 4] - 1)) < 0.5


def test_profile_context_beyond_the_artifact_is_one_line(tiny_artifact):
    out = run("profile", str(tiny_artifact), "--context", "100000")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().startswith("error: --context 100000 must be between 1 and")


@pytest.mark.parametrize("args", [["check", "/nonexistent/dir"], ["build", "/nonexistent/dir"]])
def test_commands_on_missing_dirs_fail_cleanly(args):
    out = run(*args)
    assert out.returncode == 1 and "Traceback" not in out.stderr and out.stderr.strip()


def test_generate_text_prompts_file_keeps_non_ascii(tiny_artifact, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text('# café\n"def f():\\n    return 1"\n', encoding="utf-8")
    out = run("generate", str(tiny_artifact), "--prompts-file", str(prompts), "--max-new-tokens", "4", "--spec", "off")
    assert out.returncode == 0, out.stderr
    assert "# café" in out.stdout and "def f():\n    return 1" in out.stdout


class _ClockedRuntime:
    """A runtime whose runs take set times on a fake clock: `spec_s(i)` for the i-th speculative run."""

    def __init__(self, clock, spec_s, off_s):
        self.clock, self.spec_s, self.off_s, self.spec_runs = clock, spec_s, off_s, 0

    def wait_prefaulted(self):
        pass

    def close(self):
        pass

    def generate(self, prompts, configs):
        from types import SimpleNamespace
        configs = configs if isinstance(configs, list) else [configs] * len(prompts)
        n = configs[0].max_new_tokens
        if n > 2:  # not the warm-up
            if configs[0].spec == "off":
                self.clock[0] += self.off_s
            else:
                self.clock[0] += self.spec_s(self.spec_runs)
                self.spec_runs += 1
        return [SimpleNamespace(token_ids=list(range(n)), error=None, prompt=p, text="x",
                                stats={"tau": 1.0, "steps": n, "generated_tokens": n}) for p in prompts]


@pytest.mark.parametrize("spec_s, off_s, rounds", [(0.1, 0.16, 10), (0.05, 0.075, 15), (2.0, 3.0, 3), (0.3, 0.45, 4)])
def test_compare_alternates_until_both_modes_ran_long_enough_and_reports_the_median_paired_ratio(
        monkeypatch, spec_s, off_s, rounds):
    from dspark_trt.commands import generate as gen
    from dspark_trt.runtime import runtime

    clock = [0.0]
    # One speculative run in the middle is hit by another job (10x slower): the median pair ignores it.
    fake = _ClockedRuntime(clock, lambda i: spec_s * (10 if i == 1 else 1), off_s)
    monkeypatch.setattr(runtime.Runtime, "load", classmethod(lambda cls, *a, **k: fake))
    monkeypatch.setattr("time.perf_counter", lambda: clock[0])
    lines = []
    summary = gen.run_generate("unused", ["def f():"], None, compare=True, echo=lines.append)
    assert summary["compare_rounds"] == rounds == fake.spec_runs
    assert summary["speedup_over_off"] == pytest.approx(off_s / spec_s)
    assert f"speed-up {off_s / spec_s:.2f}x (median of {rounds} paired runs)" in lines[-1]
