"""scripts/gpu_check.sh, the prepared GPU check: its CPU dry run end to end, and its GPU stages as tests
that run where there is a GPU (pytest -m gpu) or TensorRT (pytest -m trt)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
HAVE_CUDA = torch.cuda.is_available()
HAVE_TRT = importlib.util.find_spec("tensorrt") is not None


def _results(log: str) -> dict:
    return {r["stage"]: r for r in (json.loads(line.split("RESULT ", 1)[1]) for line in log.splitlines()
                                    if line.startswith("RESULT "))}


def test_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_cpu_dry_run_runs_every_cpu_stage(tiny_artifact, tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(SCRIPT), "--cpu-dry-run", "--artifact", str(tiny_artifact), "--out",
                           str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=600)
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    assert proc.stdout.strip().splitlines()[-1] in log  # everything went to the one log file
    res = _results(log)
    assert res["kernels"]["ok"] and res["kernels"]["interpreted"] and not res["kernels"]["failures"]
    assert len(res["kernels"]["checked"]) >= 8
    assert res["lossless"]["ok"] and res["lossless"]["dtype"] == "bf16"
    assert set(res["lossless"]["first_differences"]) == {"fixed:4", "adaptive"}
    assert {(r["requests"], r["spec"]) for r in res["timing"]["rows"]} >= {(1, "adaptive"), (4, "fixed:4")}
    if not HAVE_TRT:
        assert "stage d (build AOT/JIT engines, load, compare with ORT) skipped" in log
        for mode in ("aot", "jit"):
            plan = json.loads((tmp_path / "out" / f"build-plan-{mode}.json").read_text())
            assert plan["plugin_mode"] == mode


def test_stages_share_a_time_budget(tiny_artifact, tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_BUDGET_S="5")
    proc = subprocess.run(["bash", str(SCRIPT), "--cpu-dry-run", "--artifact", str(tiny_artifact), "--out",
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    log = (tmp_path / "gpu_check.log").read_text()
    assert proc.returncode == 1 and "stage kernels: not run, the 5s budget is spent" in log
    assert "failed: kernels lossless timing" in log


def test_lossless_stage_reports_a_difference(tiny_artifact, monkeypatch, capsys):
    """The lossless check can fail: a backend that changes one verified token is caught and located."""
    from dspark_trt.bench import gpu_check
    from dspark_trt.runtime import Runtime

    load = Runtime.load

    def corrupting(*a, **kw):
        rt = load(*a, **kw)
        run = rt.backend.run_target

        def run_target(feeds, past):
            outs, present = run(feeds, past)
            if feeds["verify_lens"].max() > 0:  # speculative steps only: spec off stays as it was
                outs = dict(outs, next_token=(outs["next_token"] + 1) % rt.vocab)
            return outs, present

        rt.backend.run_target = run_target
        return rt

    monkeypatch.setattr(Runtime, "load", corrupting)
    assert gpu_check.check_lossless(str(tiny_artifact), "cpu", "fp32", 6) == 1
    res = _results(capsys.readouterr().out)["lossless"]
    assert not res["ok"] and any(res["first_differences"].values())


def test_torch_backend_options_are_checked(tiny_artifact):
    from dspark_trt.errors import DsparkError
    from dspark_trt.runtime.backends.base import make_backend
    from dspark_trt.runtime.runtime import load_manifest

    m = load_manifest(tiny_artifact)
    with pytest.raises(DsparkError, match="fp16 on CUDA only"):
        make_backend("torch", tiny_artifact, m, device="cpu", dtype="fp16")
    with pytest.raises(DsparkError, match="choose one of fp32, fp16, bf16"):
        make_backend("torch", tiny_artifact, m, dtype="fp8")
    with pytest.raises(DsparkError, match="use cpu, cuda or cuda:N"):
        make_backend("torch", tiny_artifact, m, device="tpu")
    with pytest.raises(DsparkError, match="takes no options"):
        make_backend("ort", tiny_artifact, m, device="cuda")
    if not HAVE_CUDA:
        with pytest.raises(DsparkError, match="sees no CUDA GPU"):
            make_backend("torch", tiny_artifact, m, device="cuda")
    be = make_backend("torch", tiny_artifact, m, dtype="bf16")
    assert next(be.target.parameters()).dtype == torch.bfloat16 and be.device.type == "cpu"


# ------------------------------------------------------------------------------------- GPU / TensorRT
@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs an NVIDIA GPU with a CUDA build of torch (pytest -m gpu)")
def test_gpu_torch_backend_fp16_greedy_lossless(tiny_artifact, capsys):
    from dspark_trt.bench import gpu_check

    assert gpu_check.check_lossless(str(tiny_artifact), "cuda", "fp16", 32) == 0, capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs an NVIDIA GPU with a CUDA build of torch (pytest -m gpu)")
def test_gpu_kernels_natively(capsys):
    code = "import sys; from dspark_trt.bench import gpu_check; sys.exit(gpu_check.main(['kernels']))"
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="0"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.trt
@pytest.mark.skipif(not (HAVE_CUDA and HAVE_TRT), reason="needs TensorRT and an NVIDIA GPU (pytest -m trt)")
@pytest.mark.parametrize("mode", ["aot", "jit"])
def test_trt_engines_build_then_load_in_a_fresh_process(tiny_artifact, tmp_path, mode):
    import shutil

    art = tmp_path / mode
    shutil.copytree(tiny_artifact, art, ignore=shutil.ignore_patterns("engines"))
    for stage in (["trt-build", "--mode", mode], ["trt-compare"]):
        proc = subprocess.run([sys.executable, "-m", "dspark_trt.bench.gpu_check", *stage, "--artifact", str(art)],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
