"""Time one all-greedy draft call on the full draft graph and on the greedy flavour, interleaved.

    python scripts/draft_flavour_timing.py ARTIFACT [--batch 1 8 32] [--past 128] [--repeats 60]

Both graphs run on ONNX Runtime (the ort backend's sessions) with the same feeds: R one-token rows at
the given past, every row greedy. Calls alternate full/greedy (which one goes first alternates too), so
machine noise hits both alike; medians and the paired ratio (median of per-pair greedy/full) are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main() -> None:
    from dspark_trt.manifest import GREEDY_DRAFT_INPUTS, Manifest
    from dspark_trt.runtime.backends.ort import OrtBackend
    from dspark_trt.runtime.batch import pack_queries

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=60)
    a = ap.parse_args()
    m = Manifest.load(a.artifact)
    be = OrtBackend(a.artifact, m)
    if not be.has_greedy_draft:
        raise SystemExit(f"{a.artifact} has no draft_greedy graph: re-export it")
    d, slots, vocab = m.draft, m.limits["max_batch"], m.model["vocab_size"]
    print(f"{a.artifact}: V={vocab}, draft {d['num_layers']} layers x {d['hidden_size']}, "
          f"confidence {d['confidence']}, past {a.past}, {a.repeats} pairs")
    rng = np.random.default_rng(0)
    for r in a.batch:
        r = min(r, slots)
        feeds = pack_queries([[int(t)] for t in rng.integers(0, vocab, r)], [a.past] * r, list(range(r)))
        feeds.update(temperature=np.zeros(r, np.float32), uniforms=np.full(r, 0.5, np.float32),
                     prev_survival=np.ones(r, np.float32), draft_position=np.zeros(r, np.int64))
        greedy_feeds = {k: v for k, v in feeds.items() if k in GREEDY_DRAFT_INPUTS}
        past = [np.zeros((a.past, slots, d["num_kv_heads"], d["head_dim"]), np.float32)
                for _ in range(2 * d["num_layers"])]
        runs = {"full": lambda: be.run_draft(feeds, past), "greedy": lambda: be.run_draft_greedy(greedy_feeds, past)}
        for fn in runs.values():  # warm up both
            for _ in range(3):
                fn()
        ms = {"full": [], "greedy": []}
        for i in range(a.repeats):
            for name in (("full", "greedy") if i % 2 == 0 else ("greedy", "full")):
                t = time.perf_counter()
                runs[name]()
                ms[name].append((time.perf_counter() - t) * 1e3)
        full, greedy = statistics.median(ms["full"]), statistics.median(ms["greedy"])
        ratio = statistics.median(g / f for g, f in zip(ms["greedy"], ms["full"]))
        print(f"R={r:3d}: full {full:8.3f} ms  greedy {greedy:8.3f} ms  paired greedy/full {ratio:.3f}")


if __name__ == "__main__":
    main()
