"""onnxruntime-genai worker for the bench's peer: run as a script by any Python that has onnxruntime-genai
(``python ortgenai_worker.py MODEL_DIR``), so the peer can live in another virtual environment.

It imports only the standard library, numpy and onnxruntime_genai (never dspark_trt). Protocol: one JSON
object per line on stdin, one answer per line on stdout.

- ``{"cmd": "hello"}`` -> ``{"ok": true, "version": ..., "ort_version": ...}``
- ``{"cmd": "run", "prompts": [[ids], ...], "concurrency": c, "requests": n, "max_new_tokens": m}`` ->
  ``{"ok": true, "wall_s": ..., "requests": [{"token_ids", "generated_tokens", "latency_s"}]}``: request i
  uses prompt i mod len(prompts); static batches of ``c`` requests (the last may be smaller), greedy.
- ``{"cmd": "quit"}``

Every request generates exactly max_new_tokens tokens: ``min_length`` is set to the batch's full
length, which stops the EOS token from ending a sequence (onnxruntime-genai has no switch that ignores
EOS while still letting greedy pick it, so a request whose greedy continuation contains EOS differs
from the other systems there; the bench reports it as not identical). Prompts of a batch are padded on
the right with the pad token, which the model builder's graph masks out (the ids after the padded prompt
block are the request's generated tokens; left padding gave wrong tokens in 0.18).
"""

from __future__ import annotations

import json
import sys
import time

try:
    from dspark_trt.bench.worker_loop import protocol_stream, serve
except ImportError:  # run as a script by a Python without dspark_trt: the sibling file
    from worker_loop import protocol_stream, serve


def _batch(og, model, prompts, max_new_tokens, pad_id):
    import numpy as np

    width = max(len(p) for p in prompts)
    total = width + max_new_tokens
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=total, min_length=total, batch_size=len(prompts))
    gen = og.Generator(model, params)
    ids = np.full((len(prompts), width), pad_id, dtype=np.int32)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    gen.append_tokens(ids)
    while not gen.is_done():
        gen.generate_next_token()
    return [gen.get_sequence(i)[width:width + max_new_tokens].tolist() for i in range(len(prompts))]


def _run(og, model, msg, pad_id):
    prompts, c, n, m = msg["prompts"], int(msg["concurrency"]), int(msg["requests"]), int(msg["max_new_tokens"])
    reqs = []
    t0 = time.perf_counter()
    for start in range(0, n, c):
        batch = [prompts[i % len(prompts)] for i in range(start, min(n, start + c))]
        s = time.perf_counter()
        outs = _batch(og, model, batch, m, pad_id)
        lat = time.perf_counter() - s
        reqs += [{"token_ids": o, "generated_tokens": len(o), "latency_s": lat} for o in outs]
    return {"ok": True, "wall_s": time.perf_counter() - t0, "requests": reqs}


def main(argv) -> int:
    out = protocol_stream()
    model_dir = argv[1]
    pad_id = int(argv[2]) if len(argv) > 2 else None
    import onnxruntime_genai as og

    config = og.Config(model_dir)
    if pad_id is not None:  # an id no prompt contains: the graph masks every pad token it sees
        config.overlay(json.dumps({"model": {"pad_token_id": pad_id}}))
    with open(f"{model_dir}/genai_config.json") as f:
        pad = int(pad_id if pad_id is not None else json.load(f)["model"].get("pad_token_id", 0))
    model = og.Model(config)

    def hello(msg):
        import onnxruntime

        return {"ok": True, "version": og.__version__, "ort_version": onnxruntime.__version__}

    return serve(out, {"hello": hello, "run": lambda msg: _run(og, model, msg, pad)})


if __name__ == "__main__":
    sys.exit(main(sys.argv))
