"""vLLM worker for the bench's peer: run as a script by a Python that has vLLM (its CPU build on a
machine without a GPU), ``python vllm_worker.py CONFIG_JSON``. Imports only the standard library and vllm.

CONFIG_JSON: ``{"target": dir, "draft": dir or null, "k": K or 0, "max_num_seqs": n, "max_model_len": L,
"dtype": "float32"}``. With a draft and K > 0 the engine speculates with ``method="draft_model"`` and
``num_speculative_tokens=K`` (a fixed K: vLLM's CPU engine has no adaptive verification); else it decodes
plainly. Protocol as in ortgenai_worker.py: ``hello``, ``run`` (closed loop: ``concurrency`` requests in
flight through the engine's ``add_request``/``step``, request i on prompt i mod len(prompts), greedy,
``ignore_eos`` so every request generates exactly max_new_tokens), ``quit``.
"""

from __future__ import annotations

import json
import os
import sys
import time

try:
    from dspark_trt.bench.worker_loop import protocol_stream, serve
except ImportError:  # run as a script by a Python without dspark_trt: the sibling file
    from worker_loop import protocol_stream, serve


def _engine(cfg):
    from vllm import LLM

    kw = dict(model=cfg["target"], dtype=cfg.get("dtype", "float32"), max_num_seqs=int(cfg["max_num_seqs"]),
              max_model_len=int(cfg["max_model_len"]), seed=0)
    if cfg.get("draft") and int(cfg.get("k") or 0) > 0:
        kw["speculative_config"] = {"method": "draft_model", "model": cfg["draft"],
                                    "num_speculative_tokens": int(cfg["k"])}
    return LLM(**kw)


def _run(llm, msg):
    from vllm import SamplingParams

    prompts, c, n, m = msg["prompts"], int(msg["concurrency"]), int(msg["requests"]), int(msg["max_new_tokens"])
    params = SamplingParams(temperature=0.0, max_tokens=m, min_tokens=0, ignore_eos=True)
    engine = llm.llm_engine
    started: dict[str, float] = {}
    reqs: list[dict | None] = [None] * n
    nxt = 0
    t0 = time.perf_counter()

    def submit(i):
        started[str(i)] = time.perf_counter()
        engine.add_request(str(i), {"prompt_token_ids": prompts[i % len(prompts)]}, params)

    while nxt < min(c, n):
        submit(nxt)
        nxt += 1
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not out.finished:
                continue
            toks = list(out.outputs[0].token_ids)
            i = int(out.request_id)
            reqs[i] = {"token_ids": toks, "generated_tokens": len(toks),
                       "latency_s": time.perf_counter() - started[out.request_id]}
            if nxt < n:
                submit(nxt)
                nxt += 1
    return {"ok": True, "wall_s": time.perf_counter() - t0, "requests": reqs}


def main(argv) -> int:
    cfg = json.loads(argv[1])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; plenty for a small pair
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    out = protocol_stream()
    llm = _engine(cfg)

    def hello(msg):
        import vllm

        return {"ok": True, "version": vllm.__version__}

    return serve(out, {"hello": hello, "run": lambda msg: _run(llm, msg)})


if __name__ == "__main__":
    sys.exit(main(sys.argv))
