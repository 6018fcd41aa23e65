"""Memory plan at load: what an artifact needs for max_batch x max_context, checked before allocating.

needed = weights (graph files; the sessions hold them once) + KV cache (target and draft, every slot,
max_context positions, in the KV dtype) + activations of the largest step (max_tokens_per_step packed
tokens through the widest layer, the attention scores of max_batch requests over max_context, and the
[verify_rows, V] logits and draft distributions in float32).

The graphs' KV inputs have a fixed slot axis (the exported max_batch) and a dynamic position axis, so
the KV cache shrinks only with max_context; a lower max_batch shrinks the activations. `plan_memory`
lowers max_batch when that alone makes it fit (and says so), else raises one line naming what is
needed and which option lowers it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dspark_trt.errors import DsparkError

ITEMSIZE = {"fp32": 4, "fp16": 2, "bf16": 2, "float32": 4, "float16": 2, "bfloat16": 2}
HEADROOM = 0.9  # plan to use at most this share of what is available
GIB = 2**30


@dataclass(frozen=True)
class MemoryPlan:
    weights: int
    kv_cache: int
    activations: int
    available: int | None
    max_batch: int
    max_context: int
    note: str | None = None

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations


def kv_bytes(manifest: dict, max_context: int, kv_itemsize: int, copies: dict | None = None) -> int:
    """copies: {"target": n, "draft": n}, 2 where the backend keeps that cache in a second layout too
    (ort_decode.py); 1 where absent."""
    slots = int(manifest["limits"]["max_batch"])
    total = 0
    copies = copies or {}
    for sec, n in ((manifest["model"], copies.get("target", 1)), (manifest["draft"], copies.get("draft", 1))):
        total += n * 2 * int(sec["num_layers"]) * max_context * slots * int(sec["num_kv_heads"]) * int(sec["head_dim"])
    return total * kv_itemsize


def activation_bytes(manifest: dict, max_batch: int, max_context: int) -> int:
    m, lim = manifest["model"], manifest["limits"]
    item = ITEMSIZE.get(m.get("dtype", "fp32"), 4)
    k = int(lim["max_draft"])
    tokens = min(int(lim["max_tokens_per_step"]), max(max_batch * (k + 1), 256))
    hidden = int(m["hidden_size"])
    inter = int(m.get("intermediate_size") or 4 * hidden)
    heads = max(1, int(m.get("num_attention_heads") or hidden // max(1, int(m["head_dim"]))))
    vocab = int(m["vocab_size"])
    layer = tokens * (4 * hidden + 3 * inter) * item  # one layer live at a time (residual, qkv, mlp)
    scores = max_batch * heads * (k + 1) * (max_context + k + 1) * 4  # float32 softmax over the context
    rows = max_batch * (k + 1)
    logits = 2 * rows * vocab * 4 + 2 * max_batch * vocab * 4  # verify logits + draft probs, draft [R, V]
    return int(layer + scores + logits)


def available_bytes() -> int | None:
    """Memory this process may still use: MemAvailable, capped by a cgroup limit (None if unknown)."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),):
        try:
            limit = Path(limit_file).read_text().strip()
            if limit != "max":
                room = int(limit) - int(Path(usage_file).read_text().strip())
                avail = room if avail is None else min(avail, room)
        except (OSError, ValueError):
            pass
    override = os.environ.get("DSPARK_MEMORY_LIMIT_GB")  # the whole budget, weights included (shared machines)
    if override:
        avail = int(float(override) * GIB)
    return avail


def weight_bytes(artifact_dir, manifest: dict) -> int:
    """Bytes of the standard graph files; a backend loads one flavour of each graph, and the ORT flavour
    (`<graph>.ort.onnx`, the same weights regrouped) is not counted twice."""
    files = manifest.get("files") or {}
    return sum(int(e.get("bytes", 0)) for name, e in files.items()
               if name.endswith((".onnx", ".onnx.data")) and ".ort.onnx" not in name and isinstance(e, dict))


def plan_memory(manifest: dict, artifact_dir=None, max_batch: int | None = None, max_context: int | None = None,
                kv_itemsize: int = 4, available: int | None = None, copies: dict | None = None) -> MemoryPlan:
    """Check (and fit) max_batch x max_context against `available` bytes (None: unknown, no check);
    see the module docstring."""
    lim = manifest["limits"]
    exp_batch, exp_ctx = int(lim["max_batch"]), int(lim["max_context"])
    if max_batch is not None and max_batch > exp_batch:
        raise DsparkError(f"--max-batch {max_batch} exceeds the {exp_batch} the artifact was exported for: "
                          f"re-export with --max-batch {max_batch}")
    if max_context is not None and max_context > exp_ctx:
        raise DsparkError(f"--max-context {max_context} exceeds the {exp_ctx} the artifact was exported for: "
                          f"re-export with --max-context {max_context}")
    batch, ctx = int(max_batch or exp_batch), int(max_context or exp_ctx)
    weights = weight_bytes(artifact_dir, manifest)
    kv = kv_bytes(manifest, ctx, kv_itemsize, copies)
    avail = available

    def plan(b: int, note=None) -> MemoryPlan:
        return MemoryPlan(weights, kv, activation_bytes(manifest, b, ctx), avail, b, ctx, note)

    p = plan(batch)
    if avail is None or p.total <= HEADROOM * avail:
        return p
    b = batch
    while b > 1:
        b = max(1, b // 2)
        q = plan(b)
        if q.total <= HEADROOM * avail:
            return plan(b, f"memory plan: max batch lowered from {batch} to {b} to fit {avail / GIB:.1f} GiB "
                           f"(needs {q.total / GIB:.2f} GiB)")
    raise DsparkError(
        f"the artifact needs {p.total / GIB:.2f} GiB (weights {weights / GIB:.2f}, KV cache {kv / GIB:.2f} for "
        f"{ctx} positions x {exp_batch} slots, activations {p.activations / GIB:.2f}) but {avail / GIB:.2f} GiB "
        f"is available: lower --max-context (the KV cache scales with it) or re-export with a smaller --max-batch")


def plan_for(manifest: dict, artifact_dir, backend, max_batch, max_context, kv_dtype) -> MemoryPlan:
    """The runtime's entry point (called once the backend holds the weights): plan against host memory (or the backend's own `memory_available()`,
    e.g. a GPU's; a backend without one that keeps the KV cache on a device is not checked here), and
    print the note when max_batch was lowered."""
    import sys

    import numpy as np

    if hasattr(backend, "memory_available"):
        avail = backend.memory_available()
    elif hasattr(backend, "make_kv_cache"):
        avail = None
    else:
        avail = available_bytes()
        if avail is not None and not os.environ.get("DSPARK_MEMORY_LIMIT_GB"):
            # the backend holds the weights already, so MemAvailable no longer counts them
            avail += weight_bytes(artifact_dir, manifest)
    itemsize = np.dtype(kv_dtype).itemsize
    copies_at = getattr(backend, "kv_copies", None)
    copies = copies_at(max_context or int(manifest["limits"]["max_context"])) if copies_at else {}
    mirrored = any(n > 1 for n in copies.values())
    plan = None
    try:
        plan = plan_memory(manifest, artifact_dir, max_batch, max_context, itemsize, avail, copies)
    except DsparkError:
        if not mirrored:
            raise
    if mirrored and (plan is None or plan.note):
        # The second copies are a speed-up, never worth a smaller batch: keep each cache once instead.
        backend.drop_kv_copies()
        print("memory plan: the KV caches are kept once (no slot-major copies for the ORT decoding graphs) "
              "to fit the memory available", file=sys.stderr)
        plan = plan_memory(manifest, artifact_dir, max_batch, max_context, itemsize, avail)
    if plan.note:
        print(plan.note, file=sys.stderr)
    return plan
