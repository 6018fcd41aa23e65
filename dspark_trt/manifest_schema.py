"""The manifest's schema: format constants and the checks behind `Manifest.validate` (standard library only)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

MANIFEST_FORMAT = "dspark-trt-artifact"
MANIFEST_VERSION = 1

GRAPHS = ("draft", "target")
# Graphs an artifact may add to GRAPHS, each built into an engine like them when present. draft_greedy:
# the classic draft step for calls whose rows are all greedy (no [R, V] distribution computed or returned);
# artifacts without it run every call on `draft`.
GREEDY_DRAFT_GRAPH = "draft_greedy"
OPTIONAL_GRAPHS = (GREEDY_DRAFT_GRAPH,)
# A DSpark artifact's graphs beyond GRAPHS (exporter/dspark_artifact.py): the context-KV precompute (always
# there) and the MarkovSample flavour of the draft graph (for batches with sampled requests; optional).
DSPARK_CONTEXT_GRAPH = "dspark_context"
DSPARK_SAMPLE_GRAPH = "draft_sample"
MODEL_DTYPES = ("fp32", "fp16", "bf16")
# Graph I/O dtypes a manifest may declare (all are TensorRT I/O types).
IO_DTYPES = ("int64", "int32", "float32", "float16", "bfloat16", "bool", "uint8")
# ONNX-style names of the export dtypes.
MODEL_DTYPE_TO_ONNX = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
CONFIDENCE_MODES = ("head", "fallback")
# draft.kind: "classic" (autoregressive draft, N sequential calls; the default, so artifacts written before
# the field existed load unchanged) or "dspark" (target-conditioned block drafter, `draft.dspark` holds its
# facts: models/dspark_config.DsparkConfig.summary()).
DRAFTER_KINDS = ("classic", "dspark")
DSPARK_INT_FIELDS = ("num_draft", "query_len", "markov_rank", "draft_vocab_size")
PLUGIN_MODES = ("aot", "jit", "none")
# graphs.<graph>.ort.flavour: the ORT backend's own graph beside the standard one (exporter/ort_flavour.py).
ORT_GRAPH_FLAVOURS = ("fused",)
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CC = re.compile(r"^\d+\.\d+$")


def engine_graphs(d: dict) -> tuple[list[str], list[str]]:
    """(required, optional) graphs that get a TensorRT engine, by drafter kind; optional ones only where the
    artifact has them. Always the standard graphs, never their ORT flavours (graphs.<g>.ort)."""
    graphs = d.get("graphs") or {}
    if (d.get("draft") or {}).get("kind") == "dspark":
        return [*GRAPHS, DSPARK_CONTEXT_GRAPH], [g for g in (DSPARK_SAMPLE_GRAPH,) if g in graphs]
    return list(GRAPHS), [g for g in OPTIONAL_GRAPHS if g in graphs]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def manifest_problems(d: dict) -> list[str]:
    """Schema problems, one line each naming the key; empty when the manifest is well formed."""
    problems: list[str] = []
    add = problems.append

    if d.get("format") != MANIFEST_FORMAT:
        add(f"format: {d.get('format')!r}, expected {MANIFEST_FORMAT!r}")
    if d.get("format_version") != MANIFEST_VERSION:
        add(f"format_version: {d.get('format_version')!r}, expected {MANIFEST_VERSION}")
    if not isinstance(d.get("created"), str):
        add("created: missing or not an ISO 8601 string")
    tools = d.get("tools")
    if not isinstance(tools, dict):
        add("tools: missing or not an object")
    else:
        for k, v in tools.items():
            if v is not None and not isinstance(v, str):
                add(f"tools.{k}: must be a version string or null")

    def section(name: str) -> dict | None:
        s = d.get(name)
        if not isinstance(s, dict):
            add(f"{name}: missing or not an object")
            return None
        return s

    def need_int(sec: dict, secname: str, key: str, minimum: int = 1) -> None:
        v = sec.get(key)
        if not _is_int(v):
            add(f"{secname}.{key}: missing or not an integer")
        elif v < minimum:
            add(f"{secname}.{key}: {v} is below {minimum}")

    def need_str(sec: dict, secname: str, key: str) -> None:
        if not isinstance(sec.get(key), str) or not sec.get(key):
            add(f"{secname}.{key}: missing or not a non-empty string")

    model = section("model")
    if model is not None:
        need_str(model, "model", "arch")
        for k in ("vocab_size", "hidden_size", "num_layers", "num_kv_heads", "head_dim", "max_context"):
            need_int(model, "model", k)
        if model.get("dtype") not in MODEL_DTYPES:
            add(f"model.dtype: {model.get('dtype')!r}, expected one of {', '.join(MODEL_DTYPES)}")

    draft = section("draft")
    if draft is not None:
        need_str(draft, "draft", "arch")
        for k in ("hidden_size", "num_layers", "num_kv_heads", "head_dim", "max_draft"):
            need_int(draft, "draft", k)
        kind = draft.get("kind", "classic")
        if kind not in DRAFTER_KINDS:
            add(f"draft.kind: {kind!r}, expected one of {', '.join(DRAFTER_KINDS)}")
        elif kind == "dspark":
            ds = draft.get("dspark")
            if not isinstance(ds, dict):
                add("draft.dspark: missing or not an object (required when draft.kind is 'dspark')")
            else:
                for k in DSPARK_INT_FIELDS:
                    need_int(ds, "draft.dspark", k)
                aux = ds.get("aux_layers")
                if not isinstance(aux, list) or not aux or not all(_is_int(a) and a >= 0 for a in aux):
                    add("draft.dspark.aux_layers: missing or not a non-empty list of layer capture points")
        if draft.get("confidence") not in CONFIDENCE_MODES:
            add(f"draft.confidence: {draft.get('confidence')!r}, expected one of {', '.join(CONFIDENCE_MODES)}")
        temps = draft.get("temperatures")
        if not isinstance(temps, list) or not all(_is_num(t) for t in temps):
            add("draft.temperatures: missing or not a list of numbers")
        else:
            if _is_int(draft.get("max_draft")) and len(temps) != draft["max_draft"]:
                add(f"draft.temperatures: {len(temps)} values, expected max_draft = {draft['max_draft']}")
            if any(t <= 0 for t in temps):
                add("draft.temperatures: every temperature must be > 0")

    limits = section("limits")
    if limits is not None:
        for k in ("max_batch", "max_context", "max_draft", "max_tokens_per_step"):
            need_int(limits, "limits", k)
        if draft is not None and _is_int(limits.get("max_draft")) and _is_int(draft.get("max_draft")) \
                and limits["max_draft"] != draft["max_draft"]:
            add(f"limits.max_draft: {limits['max_draft']} differs from draft.max_draft = {draft['max_draft']}")
        if model is not None and _is_int(limits.get("max_context")) and _is_int(model.get("max_context")) \
                and limits["max_context"] > model["max_context"]:
            add(f"limits.max_context: {limits['max_context']} exceeds model.max_context = "
                f"{model['max_context']}")

    dims = section("dims")
    if dims is not None:
        for name, rng in dims.items():
            if not isinstance(rng, dict) or not all(_is_int(rng.get(k)) for k in ("min", "opt", "max")):
                add(f"dims.{name}: must be an object with integer min, opt, max")
                continue
            if rng["min"] < 0:
                add(f"dims.{name}: min {rng['min']} is negative")
            if not rng["min"] <= rng["opt"] <= rng["max"]:
                add(f"dims.{name}: needs min <= opt <= max, got {rng['min']} / {rng['opt']} / {rng['max']}")

    files = section("files")
    if files is not None:
        for name, entry in files.items():
            if not isinstance(entry, dict):
                add(f"files.{name}: must be an object with sha256 and bytes")
                continue
            if not isinstance(entry.get("sha256"), str) or not _HEX64.match(entry["sha256"]):
                add(f"files.{name}.sha256: missing or not 64 lowercase hex digits")
            if not _is_int(entry.get("bytes")) or entry["bytes"] < 0:
                add(f"files.{name}.bytes: missing or not a non-negative integer")
            if Path(name).is_absolute() or ".." in Path(name).parts:
                add(f"files.{name}: must be a path relative to the artifact directory")

    graphs = section("graphs")
    if graphs is not None:
        for g in GRAPHS:
            if g not in graphs:
                add(f"graphs.{g}: missing")
        for g, spec in graphs.items():
            if not isinstance(spec, dict):
                add(f"graphs.{g}: must be an object with file, inputs, outputs")
                continue
            if not isinstance(spec.get("file"), str) or not spec.get("file"):
                add(f"graphs.{g}.file: missing or not a string")
            elif files is not None and spec["file"] not in files:
                add(f"graphs.{g}.file: {spec['file']!r} is not listed in manifest files (no hash recorded)")
            ort = spec.get("ort")  # the ORT backend's flavour of this graph (exporter/ort_flavour.py), optional
            if ort is not None:
                if not isinstance(ort, dict) or not isinstance(ort.get("file"), str) or not ort.get("file"):
                    add(f"graphs.{g}.ort: must be an object with file and flavour")
                else:
                    if files is not None and ort["file"] not in files:
                        add(f"graphs.{g}.ort.file: {ort['file']!r} is not listed in manifest files (no hash recorded)")
                    # its decoding graph (ort_flavour.decode_file) and the target's all-greedy twins of both
                    for key in ("decode", "greedy", "decode_greedy"):
                        f = ort.get(key)
                        if f is not None and (not isinstance(f, str) or (files is not None and f not in files)):
                            add(f"graphs.{g}.ort.{key}: {f!r} is not a file listed in manifest files")
                    if ort.get("flavour") not in ORT_GRAPH_FLAVOURS:
                        add(f"graphs.{g}.ort.flavour: {ort.get('flavour')!r}, expected one of "
                            f"{', '.join(ORT_GRAPH_FLAVOURS)}")
            for kind in ("inputs", "outputs"):
                ios = spec.get(kind)
                if not isinstance(ios, list) or not ios:
                    add(f"graphs.{g}.{kind}: missing or empty list")
                    continue
                seen = set()
                for i, io in enumerate(ios):
                    where = f"graphs.{g}.{kind}[{i}]"
                    if not isinstance(io, dict):
                        add(f"{where}: must be an object with name, dtype, shape")
                        continue
                    name = io.get("name")
                    if not isinstance(name, str) or not name:
                        add(f"{where}.name: missing or not a string")
                    else:
                        where = f"graphs.{g}.{kind}.{name}"
                        if name in seen:
                            add(f"{where}: duplicate name")
                        seen.add(name)
                    if io.get("dtype") not in IO_DTYPES:
                        add(f"{where}.dtype: {io.get('dtype')!r}, expected one of {', '.join(IO_DTYPES)}")
                    shape = io.get("shape")
                    if not isinstance(shape, list):
                        add(f"{where}.shape: missing or not a list")
                        continue
                    for dim in shape:
                        if isinstance(dim, str):
                            if kind == "inputs" and dims is not None and dim not in dims:
                                add(f"{where}.shape: dim {dim!r} is not defined in manifest 'dims' "
                                    f"(no optimisation profile for it)")
                        elif not _is_int(dim) or dim < 0:
                            add(f"{where}.shape: {dim!r} must be a dim name or a non-negative integer")

    tok = d.get("tokenizer")
    if not isinstance(tok, dict):
        add("tokenizer: missing or not an object")
    else:
        if not isinstance(tok.get("file"), str) or not tok.get("file"):
            add("tokenizer.file: missing or not a string")
        eos = tok.get("eos_token_id")
        if eos is not None and not _is_int(eos):
            add("tokenizer.eos_token_id: must be an integer or null")
        eos_ids = tok.get("eos_token_ids")
        if eos_ids is not None and not (isinstance(eos_ids, list) and all(_is_int(i) for i in eos_ids)):
            add("tokenizer.eos_token_ids: must be a list of integers")

    engines = d.get("engines")
    if engines is not None:
        if not isinstance(engines, dict):
            add("engines: must be an object")
        else:
            for g, e in engines.items():
                if not isinstance(e, dict):
                    add(f"engines.{g}: must be an object")
                    continue
                for k in ("file", "tensorrt_version", "gpu_name", "built"):
                    need_str(e, f"engines.{g}", k)
                if not isinstance(e.get("sha256"), str) or not _HEX64.match(e["sha256"]):
                    add(f"engines.{g}.sha256: missing or not 64 lowercase hex digits")
                if not isinstance(e.get("compute_capability"), str) or not _CC.match(e["compute_capability"]):
                    add(f"engines.{g}.compute_capability: {e.get('compute_capability')!r}, expected like '9.0'")
                if e.get("plugin_mode") not in PLUGIN_MODES:
                    add(f"engines.{g}.plugin_mode: {e.get('plugin_mode')!r}, expected one of "
                        f"{', '.join(PLUGIN_MODES)}")
    return problems
