"""A random Llama target over 2 GB in fp32 (sharded safetensors) exports, checks and generates
losslessly. Minutes and ~4 GB of RAM: `pytest -m slow tests/test_realsize_slow.py`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAIR_TOKENIZER = REPO / "examples" / "models" / "stdlib-target"
DRAFT = REPO / "examples" / "models" / "stdlib-draft"


def _run(args: list[str], timeout: int) -> tuple[float, float]:
    """Run a dspark-trt command in a child process; returns (wall seconds, peak RSS in GB)."""
    code = ("import resource, runpy, sys; sys.argv = ['dspark-trt'] + sys.argv[1:]\n"
            "try:\n    runpy.run_module('dspark_trt.cli', run_name='__main__')\n"
            "finally:\n    print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)")
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t
    assert out.returncode == 0, out.stderr[-3000:]
    kb = int(out.stderr.rsplit("PEAK_RSS_KB", 1)[1].split()[0])
    return wall, kb / 1e6


@pytest.mark.slow
def test_random_llama_over_2gb_fp32_exports_checks_and_generates_losslessly(tmp_path):
    from dspark_trt.models.synthetic import llama_config, write_checkpoint
    from dspark_trt.runtime import GenerationConfig, Runtime

    target = tmp_path / "target"
    vocab = max(json.loads((PAIR_TOKENIZER / "tokenizer.json").read_text())["model"]["vocab"].values()) + 1
    write_checkpoint(target, llama_config(vocab, 1536, 24, 12, 4, 4864), shard_bytes=1 << 30)
    shutil.copyfile(PAIR_TOKENIZER / "tokenizer.json", target / "tokenizer.json")
    weights = sum(p.stat().st_size for p in target.glob("*.safetensors"))
    assert weights > 2.5e9 and (target / "model.safetensors.index.json").is_file()

    art = tmp_path / "art"
    wall, peak_gb = _run(["export", "--target", str(target), "--draft", str(DRAFT), "--out", str(art),
                          "--max-batch", "4", "--max-context", "512", "--max-draft", "4"], timeout=1800)
    print(f"\nexport: {wall:.0f} s, peak RSS {peak_gb:.2f} GB for {weights / 1e9:.2f} GB of weights")
    assert peak_gb <= 2 * weights / 1e9
    assert (art / "target.onnx.data").stat().st_size > 2.5e9
    _run(["check", str(art)], timeout=600)

    t = time.perf_counter()
    with Runtime.load(art) as rt:  # a fresh artifact: the start-up profile is the quick one
        first = rt.generate(["def fib(n):"], GenerationConfig(max_new_tokens=8, temperature=0.0, spec="fixed:2"))
        startup = time.perf_counter() - t
        off = rt.generate(["def fib(n):"], GenerationConfig(max_new_tokens=8, temperature=0.0, spec="off"))
    print(f"first generate of 8 tokens including load and profiling: {startup:.0f} s")
    assert first[0].token_ids == off[0].token_ids and len(off[0].token_ids) == 8
    saved = rt.profile_name  # "ort", or "ort.spin" where the idle machine's threads spin
    from dspark_trt.runtime.costs.profiling import profile_path

    quick = json.loads(profile_path(art, saved).read_text())["meta"].get("quick", False)
    print(f"start-up profile quick: {quick}")
    shutil.rmtree(tmp_path)  # GBs: do not leave them to pytest's tmp rotation
    assert startup <= 120  # goal 60 s on a quiet 2-core machine; headroom for a shared one
