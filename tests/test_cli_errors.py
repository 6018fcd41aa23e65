"""Bad input and a hostile environment end in one `error: ...` line and exit code 1, never a traceback."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from dspark_trt.errors import DsparkError


def run(*args):
    return subprocess.run([sys.executable, "-m", "dspark_trt.cli", *map(str, args)], capture_output=True, text=True)


PROGRESS = re.compile(r"^[\w ]+: +\d+%\|")  # tqdm bars (the first load of an artifact profiles it)


def one_error(out) -> str:
    """The single stderr line of a failed command (exit 1, no traceback), progress bars aside."""
    assert out.returncode == 1, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.strip().splitlines() if line.strip() and not PROGRESS.match(line)]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    return lines[0]


def test_corrupt_tokenizer_json(tiny_pair, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(tiny_pair[0], target)
    (target / "tokenizer.json").write_text('{"model": {"vocab": ')
    line = one_error(run("export", "--target", target, "--draft", tiny_pair[1], "--out", tmp_path / "art"))
    assert "tokenizer.json is not a valid tokenizer.json" in line
    from dspark_trt.runtime.tokenizer import load_tokenizer
    from dspark_trt.training.rollout import load_tokenizer as training_tokenizer

    with pytest.raises(DsparkError, match="is not a valid tokenizer file"):
        load_tokenizer(target / "tokenizer.json")
    with pytest.raises(DsparkError, match="is not a valid tokenizer file"):
        training_tokenizer(target)


def out_commands(tiny_pair, out):
    t, d = tiny_pair
    return {
        "export": ["export", "--target", t, "--draft", d, "--out", out],
        "train-head": ["train-head", "--target", t, "--draft", d, "--data", "stdlib:train", "--out", out],
        "calibrate": ["calibrate", "--target", t, "--draft", d, "--head", d, "--data", "stdlib:heldout", "--out", out],
    }


@pytest.mark.parametrize("command", ["export", "train-head", "calibrate"])
def test_out_under_a_regular_file(command, tiny_pair, tmp_path):
    (tmp_path / "file").write_text("x")
    line = one_error(run(*out_commands(tiny_pair, tmp_path / "file" / "out")[command]))
    assert f"--out {tmp_path / 'file' / 'out'} cannot be created: {tmp_path / 'file'} is a file" in line


@pytest.mark.parametrize("command", ["export", "train-head", "calibrate"])
def test_out_where_nothing_can_be_written(command, tiny_pair, unwritable_dir):
    line = one_error(run(*out_commands(tiny_pair, unwritable_dir / "out")[command]))
    assert f"--out {unwritable_dir / 'out'} cannot be written: " in line


def test_negative_seed_with_sampling(tiny_artifact):
    line = one_error(run("generate", tiny_artifact, "--prompt", "x", "--temperature", "1", "--seed", "-1"))
    assert line == "error: seed must be an integer >= 0, got -1"


def test_non_ascii_digit_in_spec(tiny_artifact):
    line = one_error(run("generate", tiny_artifact, "--prompt", "x", "--spec", "fixed:²"))
    assert line == "error: spec 'fixed:²' is not one of off, fixed:K, adaptive"
    line = one_error(run("bench", tiny_artifact, "--modes", "off,fixed:²"))
    assert "--modes 'off,fixed:²'" in line and "not one of off, fixed:K, adaptive" in line


def test_generate_exits_1_when_a_prompt_fails_without_echoing_it(tiny_artifact):
    out = run("generate", tiny_artifact, "--prompt", "def f():", "--prompt", "", "--max-new-tokens", "4",
              "--spec", "off")
    assert one_error(out) == "error: 1 of 2 prompts failed: prompt 2: prompt is empty"
    assert "--- 'def f():'" in out.stdout  # the good prompt's output is still printed

    long_prompt = "x = 1\n" * 400  # well over the artifact's 256-token context
    out = run("generate", tiny_artifact, "--prompt", long_prompt, "--max-new-tokens", "4", "--spec", "off")
    line = one_error(out)
    assert line.startswith("error: 1 of 1 prompts failed: prompt 1: prompt has ")
    assert "max context is 256" in line
    assert long_prompt not in out.stdout and long_prompt[:200] not in out.stdout + out.stderr
    assert "(2400 characters)" in out.stdout
