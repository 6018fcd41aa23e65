"""MarkovDraft's Triton kernel == the numpy reference (and hence the ONNX body, see test_plugins_markov).

Without a GPU the kernel runs in the Triton interpreter on CPU tensors (TRITON_INTERPRET=1 is set here,
before triton is first imported), as in test_plugins_triton.
"""

import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

DEVICE = os.environ.get("DSPARK_TRITON_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE == "cpu" and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")
if DEVICE == "cpu" and not triton.knobs.runtime.interpret:
    pytest.skip("triton was imported before this module without TRITON_INTERPRET=1; run this file on its own "
                "(or with DSPARK_TRITON_DEVICE=cuda on a GPU)", allow_module_level=True)

from dspark_trt.plugins import launch  # noqa: E402
from dspark_trt.plugins import markov_kernels  # noqa: E402
from dspark_trt.plugins import reference as ref  # noqa: E402

ATTRS = ("steps", "logit_scale", "draft_topk", "qmax_confidence")


def run_kernel(case, dtype=torch.float32):
    t = {k: torch.from_numpy(np.ascontiguousarray(v)).to(DEVICE) for k, v in case.items() if k not in ATTRS}
    t["base_logits"], t["conf_base"] = t["base_logits"].to(dtype), t["conf_base"].to(dtype)
    toks, conf = markov_kernels.markov_draft(*t.values(), steps=case["steps"], logit_scale=case["logit_scale"],
                                             draft_topk=case["draft_topk"],
                                             qmax_confidence=case.get("qmax_confidence", 0))
    return toks.cpu().numpy(), conf.cpu().numpy()


@pytest.mark.parametrize("qmax", [0, 1])
@pytest.mark.parametrize("name", list(ref.markov_cases()))
def test_kernel_equals_the_reference(name, qmax):
    case = dict(ref.markov_cases(seed=0)[name], qmax_confidence=qmax)
    toks, conf = run_kernel(case)
    exp_toks, exp_conf = ref.markov_draft(**case)
    np.testing.assert_array_equal(toks, exp_toks)
    np.testing.assert_allclose(conf, exp_conf, rtol=1e-5, atol=1e-5)


def test_float16_inputs_and_topk_larger_than_the_vocabulary():
    case = ref.markov_cases(seed=3)["topk"]
    half = {**case, "base_logits": case["base_logits"].astype(np.float16),
            "conf_base": case["conf_base"].astype(np.float16)}
    toks, conf = run_kernel(half, torch.float16)
    exp_toks, exp_conf = ref.markov_draft(**half)
    np.testing.assert_array_equal(toks, exp_toks)
    np.testing.assert_allclose(conf, exp_conf, rtol=1e-5, atol=1e-5)
    every = {**case, "draft_topk": 500}  # k >= V selects everything: same as dense
    np.testing.assert_array_equal(run_kernel(every)[0], ref.markov_draft(**{**case, "draft_topk": 0})[0])


def test_launch_geometry_keeps_the_w2_tile_bounded():
    for vocab, rank in [(50, 6), (151936, 64), (32000, 256), (10, 300)]:
        cfg = launch.markov_launch(4, vocab, rank)
        assert cfg.grid == (4, 1, 1)
        assert cfg.constexprs["BLOCK_V"] * cfg.constexprs["BLOCK_K"] <= launch.MARKOV_TILE
        assert cfg.constexprs["BLOCK_K"] >= min(rank, launch.MAX_BLOCK_K)
    with pytest.raises(ValueError, match="rank <= 256"):
        markov_kernels.markov_draft(*[torch.zeros(1, 1, 4), torch.zeros(1, 1), torch.zeros(1, dtype=torch.int64),
                                      torch.zeros(4, 300), torch.zeros(4, 300), torch.zeros(300),
                                      torch.zeros(4, dtype=torch.int64)], steps=1)


AOT_SCRIPT = """
import json
from dspark_trt.plugins import kernels
ck = kernels.compile_ptx("MarkovDraft", target=("cuda", 80, 32), vocab=151936, rank=64, logit_scale=0.5,
                         draft_topk=8, input_dtypes={"base_logits": "bfloat16"})
cs = kernels.compile_ptx("MarkovSample", target=("cuda", 80, 32), vocab=32000, rank=16, draft_topk=0)
qmax = [kernels.compile_ptx(op, target=("cuda", 80, 32), vocab=32000, rank=16, draft_topk=4, qmax_confidence=1)
        for op in ("MarkovDraft", "MarkovSample")]
print("RESULT" + json.dumps(dict(qmax=[(c.name, len(kernels.ptx_entry_params(c.ptx, c.name)), "0f358637BD" in c.ptx)
                                       for c in qmax],
                                 name=ck.name, params=len(kernels.ptx_entry_params(ck.ptx, ck.name)),
                                 scalars=list(ck.scalars), warps=ck.num_warps, target=".target sm_80" in ck.ptx,
                                 sample=[cs.name, len(kernels.ptx_entry_params(cs.ptx, cs.name)), list(cs.scalars)])))
"""


def test_kernel_compiles_to_ptx_for_the_tensorrt_aot_plugin():
    """Native Triton (no GPU needed) compiles the kernel with the logit scale, top-k and qmax_confidence baked in;
    the PTX entry takes exactly the 7 inputs, the int32 R, N, V, K and the 2 outputs."""
    import json
    import subprocess

    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "ptxas" in proc.stderr.lower() and "not found" in proc.stderr.lower():
        pytest.skip("triton has no ptxas here")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert r["name"] == "markov_draft_kernel" and r["scalars"] == ["R", "N", "V", "K"]
    assert r["params"] == 7 + 4 + 2 and r["target"]
    assert r["sample"] == ["markov_sample_kernel", 9 + 5 + 3, ["R", "N", "V", "K", "T"]]
    # qmax_confidence is a constexpr like the top-k: same entry, and the kernel now clips at 1e-6 (0f358637BD)
    assert r["qmax"] == [["markov_draft_kernel", 7 + 4 + 2, True], ["markov_sample_kernel", 9 + 5 + 3, True]]


def run_sample_kernel(case):
    t = {k: torch.from_numpy(np.ascontiguousarray(v)).to(DEVICE) for k, v in case.items() if k not in ATTRS}
    out = markov_kernels.markov_sample(*t.values(), steps=case["steps"], logit_scale=case["logit_scale"],
                                       draft_topk=case["draft_topk"], qmax_confidence=case.get("qmax_confidence", 0))
    return [o.cpu().numpy() for o in out]


@pytest.mark.parametrize("qmax", [0, 1])
@pytest.mark.parametrize("name", list(ref.markov_sample_cases()))
def test_sampling_kernel_equals_the_reference(name, qmax):
    case = dict(ref.markov_sample_cases(seed=0)[name], qmax_confidence=qmax)
    toks, conf, probs = run_sample_kernel(case)
    exp_toks, exp_conf, exp_probs = ref.markov_sample(**case)
    np.testing.assert_array_equal(toks, exp_toks)
    np.testing.assert_allclose(conf, exp_conf, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(probs, exp_probs, rtol=1e-5, atol=1e-6)
