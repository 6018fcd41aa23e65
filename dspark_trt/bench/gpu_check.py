"""The Python stages of scripts/gpu_check.sh, the one prepared check for a GPU machine.

    python -m dspark_trt.bench.gpu_check STAGE --artifact DIR [--device cuda|cpu]

Stages (the shell runs each in its own process, so a TensorRT engine is always loaded in a process that
did not build it, and the Triton interpreter is on for the CPU dry run only):
  kernels      the Triton acceptance kernels (Survival, GreedyAccept, SampleAccept) against the numpy
               reference, natively on CUDA (under TRITON_INTERPRET=1 on CPU, with smaller batches);
  lossless     the torch backend (CUDA fp16; CPU bf16 in the dry run): greedy output of adaptive and
               fixed:K speculation equals spec off, token for token;
  timing       fixed:K against adaptive at 1 and 32 requests (output tokens/s, short runs);
  trt-build    `build_engines` in --mode aot|jit into the artifact (copy one artifact per mode);
  trt-compare  load those engines (backend trt) and compare greedy output with ONNX Runtime.

Each stage prints one line `RESULT {json}` and exits 1 when its check fails, 0 otherwise (2: skipped).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

PROMPTS = ["def fib(n):", "import os\n", "class Stack:\n    def __init__(self):", "for i in range(10):",
           "with open(path) as f:", "try:\n    import numpy", "def main():\n    args =", "x = [i * i for i in"]
TOL = 2e-4
SKIPPED = 2


def _result(stage: str, ok: bool, **facts) -> int:
    print("RESULT " + json.dumps({"stage": stage, "ok": bool(ok), **facts}, default=str), flush=True)
    return 0 if ok else 1


# ------------------------------------------------------------------------------------------ (a) kernels
def check_kernels(device: str) -> int:
    import torch

    from dspark_trt.plugins import kernels
    from dspark_trt.plugins import reference as ref

    cuda = device.startswith("cuda")
    rng = np.random.default_rng(0)
    on = lambda b: {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in b.items()}  # noqa: E731
    failures, checked = [], []

    for name, (x, prev, start, temps) in ref.survival_cases().items():
        got = kernels.survival(*on(dict(x=x, p=prev, s=np.asarray(start, np.int64))).values(), temps)
        if not np.allclose(got.cpu().numpy(), ref.survival(x, prev, start, temps), rtol=2e-5, atol=1e-30):
            failures.append(f"survival/{name}")
        checked.append(f"survival/{name}")

    sizes = [(64, 152064), (32, 32000), (8, 300)] if cuda else [(6, 300), (3, 4099)]
    for n_req, vocab in sizes:
        lens = rng.integers(0, 9, n_req)
        temp = rng.choice([0.0, 0.7, 1.0], n_req)
        b = ref.redraw_near_boundaries(ref.random_accept_batch(rng, lens, vocab, temperature=temp, match_prob=0.8),
                                       rng, tol=TOL)
        t = on(b)
        greedy = [v.cpu().tolist() for v in kernels.greedy_accept(t["logits"], t["draft_tokens"], t["verify_lens"])]
        if greedy != [e.tolist() for e in ref.greedy_accept(b["logits"], b["draft_tokens"], b["verify_lens"])]:
            failures.append(f"greedy/{n_req}x{vocab}")
        sample = [v.cpu().tolist() for v in kernels.sample_accept(**t)]
        if sample != [e.tolist() for e in ref.sample_accept(**b)]:
            failures.append(f"sample/{n_req}x{vocab}")
        checked += [f"greedy/{n_req}x{vocab}", f"sample/{n_req}x{vocab}"]
        if cuda and vocab == 32000:  # bf16 logits natively (the JIT plugin path's dtype)
            rounded = ref.redraw_near_boundaries(dict(b, logits=t["logits"].bfloat16().float().cpu().numpy()), rng,
                                                 tol=TOL)
            tb = on(rounded)
            tb["logits"] = tb["logits"].bfloat16()
            if [v.cpu().tolist() for v in kernels.sample_accept(**tb)] != [e.tolist() for e in
                                                                          ref.sample_accept(**rounded)]:
                failures.append("sample/bf16")
            checked.append("sample/bf16")
    return _result("kernels", not failures, device=device, interpreted=kernels.interpreting(), checked=checked,
                   failures=failures)


# ------------------------------------------------------------------------------------------ (b) lossless
def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_lossless(artifact: str, device: str, dtype: str, max_new_tokens: int) -> int:
    from dspark_trt.runtime import GenerationConfig, Runtime

    rt = Runtime.load(artifact, backend="torch", profile="none", backend_options={"device": device, "dtype": dtype})
    try:
        k = rt.max_draft
        runs = {}
        for spec in ("off", f"fixed:{k}", "adaptive"):
            cfg = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, spec=spec, stop_at_eos=False)
            runs[spec] = [r.token_ids for r in rt.generate(PROMPTS, cfg)]
    finally:
        rt.close()
    diffs = {spec: {p: _first_difference(out, runs["off"][i]) for i, (p, out) in enumerate(zip(PROMPTS, outs))
                    if out != runs["off"][i]} for spec, outs in runs.items() if spec != "off"}
    ok = not any(diffs.values())
    return _result("lossless", ok, device=device, dtype=dtype, prompts=len(PROMPTS), max_new_tokens=max_new_tokens,
                   first_differences=diffs)


# ------------------------------------------------------------------------------------------ (c) timing
def check_timing(artifact: str, backend: str, device: str, dtype: str, max_new_tokens: int,
                 concurrency: list[int], profile: str = "auto") -> int:
    from dspark_trt.runtime import GenerationConfig, Runtime

    options = {"device": device, "dtype": dtype} if backend == "torch" else None
    rt = Runtime.load(artifact, backend=backend, profile=profile, backend_options=options)
    rows = []
    try:
        k = rt.max_draft
        for n in concurrency:
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
            for spec in (f"fixed:{k}", "adaptive", "off"):
                cfg = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, spec=spec, stop_at_eos=False)
                rt.generate(prompts[:1], GenerationConfig(max_new_tokens=2, spec=spec))  # warm the shapes
                t0 = time.perf_counter()
                out = rt.generate(prompts, cfg)
                dt = time.perf_counter() - t0
                tokens = sum(len(r.token_ids) for r in out)
                rows.append({"requests": n, "spec": spec, "tokens": tokens, "seconds": round(dt, 4),
                             "tok_per_s": round(tokens / dt, 1)})
    finally:
        rt.close()
    by = {(r["requests"], r["spec"]): r["tok_per_s"] for r in rows}
    ratios = {n: round(by[(n, "adaptive")] / by[(n, f"fixed:{k}")], 3) for n in concurrency}
    # A measurement, not a gate: the check fails only if a run produced nothing.
    return _result("timing", all(r["tokens"] > 0 for r in rows), backend=backend, device=device, dtype=dtype,
                   profile=profile, rows=rows, adaptive_over_fixed=ratios)


# ------------------------------------------------------------------------------------------ (d) TensorRT
def trt_build(artifact: str, mode: str) -> int:
    from dspark_trt.exporter.build import build_engines
    from dspark_trt.manifest import Manifest

    t0 = time.perf_counter()
    paths = build_engines(artifact, plugin_mode=mode)
    engines = Manifest.load(artifact).engines
    facts = {g: {k: e.get(k) for k in ("plugin_mode", "plugin_layers", "tensorrt_version", "compute_capability",
                                       "aot_kernels")} for g, e in engines.items()}
    ok = len(paths) == 2 and all(f["plugin_mode"] == mode and (f["plugin_layers"] or 0) >= 1 for f in facts.values())
    return _result("trt-build", ok, mode=mode, seconds=round(time.perf_counter() - t0, 1), engines=facts)


def trt_compare(artifact: str, max_new_tokens: int) -> int:
    from dspark_trt.runtime import GenerationConfig, Runtime

    outs = {}
    for backend in ("ort", "trt"):
        rt = Runtime.load(artifact, backend=backend, profile="none")
        try:
            outs[backend] = {spec: [r.token_ids for r in rt.generate(PROMPTS, GenerationConfig(
                max_new_tokens=max_new_tokens, temperature=0.0, spec=spec, stop_at_eos=False))]
                for spec in ("off", "adaptive")}
        finally:
            rt.close()
    diffs = {spec: {p: _first_difference(a, b) for p, a, b in zip(PROMPTS, outs["trt"][spec], outs["ort"][spec])
                    if a != b} for spec in ("off", "adaptive")}
    loaded_in = sys.modules.get("dspark_trt.plugins.tensorrt_plugins")
    impls = sorted(loaded_in.registered_impls()) if loaded_in else []
    return _result("trt-compare", not any(diffs.values()), first_differences=diffs, plugin_impls_registered=impls)


# ------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dspark_trt.bench.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("stage", choices=["kernels", "lossless", "timing", "trt-build", "trt-compare"])
    p.add_argument("--artifact")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="torch backend dtype (default: fp16 on CUDA, bf16 on CPU)")
    p.add_argument("--backend", default="torch", help="timing: torch | ort | trt")
    p.add_argument("--mode", default="aot", choices=["aot", "jit"])
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--concurrency", default="1,32")
    p.add_argument("--profile", default="auto", choices=["auto", "none"],
                   help="timing: measure the step costs at start-up (auto) or use the per-token estimate")
    a = p.parse_args(argv)
    dtype = a.dtype or ("fp16" if a.device.startswith("cuda") else "bf16")
    if a.stage != "kernels" and not a.artifact:
        p.error(f"{a.stage} needs --artifact")
    from dspark_trt.errors import DsparkError

    try:
        if a.stage == "kernels":
            return check_kernels(a.device)
        if a.stage == "lossless":
            return check_lossless(a.artifact, a.device, dtype, a.max_new_tokens)
        if a.stage == "timing":
            return check_timing(a.artifact, a.backend, a.device, dtype, a.max_new_tokens,
                                [int(c) for c in a.concurrency.split(",")], a.profile)
        if a.stage == "trt-build":
            return trt_build(a.artifact, a.mode)
        return trt_compare(a.artifact, a.max_new_tokens)
    except DsparkError as e:
        return _result(a.stage, False, error=str(e))


if __name__ == "__main__":
    sys.exit(main())
