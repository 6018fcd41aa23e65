"""`dspark-trt export`: target + draft (+ confidence head) -> artifact directory (ONNX + manifest)."""

from __future__ import annotations

import shutil
from pathlib import Path

from dspark_trt.errors import DsparkError
from dspark_trt.exporter.draft_check import check_draft_cheaper
from dspark_trt.manifest import GREEDY_DRAFT_GRAPH, Manifest
from dspark_trt.outputs import Staging, check_out_dir, replace_dir

GREEDY_DRAFT_FILE = f"{GREEDY_DRAFT_GRAPH}.onnx"


def plan_dims(max_batch: int, max_draft: int, max_context: int) -> tuple[dict, dict]:
    """Dynamic dims (min/opt/max, the TensorRT profiles) and step limits for the runtime."""
    per_step = max(256, max_batch * (max_draft + 1))
    query_max = min(max(256, max_draft + 1), max_context)
    dims = {
        "num_tokens": {"min": 1, "opt": min(per_step, max(1, min(8, max_batch)) * (max_draft + 1)), "max": per_step},
        "num_requests": {"min": 1, "opt": min(8, max_batch), "max": max_batch},
        "query_len": {"min": 1, "opt": max_draft + 1, "max": query_max},
        "past_len": {"min": 1, "opt": min(256, max_context), "max": max_context},
        "verify_rows": {"min": 1, "opt": min(8, max_batch) * (max_draft + 1), "max": max_batch * (max_draft + 1)},
    }
    limits = {"max_batch": max_batch, "max_context": max_context, "max_draft": max_draft,
              "max_tokens_per_step": per_step}
    return dims, limits


def _io(model_path: Path) -> dict:
    import onnx

    from dspark_trt.exporter.trt_support import onnx_dtype_name

    m = onnx.load(str(model_path), load_external_data=False)

    def desc(v):
        t = v.type.tensor_type
        return {"name": v.name, "dtype": onnx_dtype_name(t.elem_type),
                "shape": [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]}

    return {"inputs": [desc(v) for v in m.graph.input], "outputs": [desc(v) for v in m.graph.output]}


def manifest_facts(target_dir, draft_dir, head_dir, temperatures, max_draft: int, max_batch: int,
                   max_context: int, dtype: str, graphs: dict | None = None) -> Manifest:
    """The manifest of an export: the models, limits and dims (graphs and files are added by export)."""
    from dspark_trt.models.config import load_config

    tcfg, dcfg = load_config(target_dir), load_config(draft_dir)
    dims, limits = plan_dims(max_batch, max_draft, max_context)
    from dspark_trt.exporter.tokenizer_files import tokenizer_facts

    m = Manifest.create(
        model={"arch": tcfg.model_type, "vocab_size": tcfg.vocab_size, "hidden_size": tcfg.hidden_size,
               "num_layers": tcfg.num_hidden_layers, "num_kv_heads": tcfg.num_key_value_heads,
               "head_dim": tcfg.head_dim, "dtype": dtype, "max_context": max_context,
               "num_attention_heads": tcfg.num_attention_heads, "intermediate_size": tcfg.intermediate_size},
        draft={"arch": dcfg.model_type, "hidden_size": dcfg.hidden_size, "num_layers": dcfg.num_hidden_layers,
               "num_kv_heads": dcfg.num_key_value_heads, "head_dim": dcfg.head_dim, "max_draft": max_draft,
               "confidence": "head" if head_dir is not None else "fallback",
               "temperatures": [float(t) for t in temperatures]},
        limits=limits, dims=dims, graphs=graphs or {}, tokenizer=tokenizer_facts(target_dir))
    m["sources"] = {"target": str(Path(target_dir).resolve()), "draft": str(Path(draft_dir).resolve()),
                    "head": str(Path(head_dir).resolve()) if head_dir is not None else None}
    return m


def export_artifacts(target_dir, draft_dir, out_dir, head_dir=None, max_draft: int = 7, max_batch: int = 64,
                     max_context: int = 1024, dtype: str = "fp32", overwrite: bool = False,
                     debug_logits: bool = False, progress: bool = True, allow_large_draft: bool = False,
                     external_data: str = "auto", ort_flavour: str = "fused") -> Path:
    """external_data: "auto" (weights over 1 GiB per graph go to `<graph>.onnx.data`), "always", "never".
    ort_flavour: "fused" also writes the graphs the ORT backend runs (exporter/ort_flavour.py; not for bf16,
    which ORT does not run), "none" leaves ORT on the standard graphs."""
    import torch
    from tqdm import tqdm

    from dspark_trt.exporter.build_modules import load_steps
    from dspark_trt.exporter.onnx_export import export_draft, export_greedy_draft, export_target
    from dspark_trt.exporter.ort_flavour import (check_flavour, decode_file, export_ort_decode, export_ort_draft_decode,
                                                 export_ort_graph, ort_file, record_ort_graph)
    from dspark_trt.exporter.greedy_twin import write_greedy_twins
    from dspark_trt.models.checkpoint import check_same_vocab, torch_dtype
    from dspark_trt.models.confidence_head import has_head
    from dspark_trt.models.config import load_config, sliding_window_problem

    target_dir, draft_dir, out_dir = Path(target_dir), Path(draft_dir), Path(out_dir)
    for name, d in (("--target", target_dir), ("--draft", draft_dir)):
        if not d.is_dir():
            raise DsparkError(f"{name} directory {d} does not exist")
    from dspark_trt.models.dspark_config import is_dspark_dir

    if is_dspark_dir(draft_dir):
        return _export_dspark(target_dir, draft_dir, out_dir, head_dir, max_batch, max_context, dtype, overwrite,
                              progress, ort_flavour, external_data)
    if head_dir is None and has_head(draft_dir):  # dspark_head/ subfolder, or a legacy top-level head
        head_dir = draft_dir
    if head_dir is not None and not Path(head_dir).is_dir():
        raise DsparkError(f"--head directory {head_dir} does not exist")
    check_flavour(ort_flavour)
    with_ort = ort_flavour == "fused" and dtype != "bf16"
    check_out_dir(out_dir, "--out")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise DsparkError(f"{out_dir} exists and is not empty; pass --force to overwrite it")
    check_same_vocab(target_dir, draft_dir)
    tok_src = target_dir / "tokenizer.json"
    if not tok_src.is_file():
        raise DsparkError(f"no tokenizer.json in {target_dir}: the artifact needs the target's tokenizer")
    tcfg, dcfg = load_config(target_dir), load_config(draft_dir)
    if not allow_large_draft:
        check_draft_cheaper(tcfg, dcfg, target_dir, draft_dir)
    for label, cfg in (("target", tcfg), ("draft", dcfg)):
        problem = sliding_window_problem(cfg, max_context, label)
        if problem:
            raise DsparkError(problem)
    if max_context > tcfg.max_position_embeddings:
        raise DsparkError(f"--max-context {max_context} exceeds the target's max_position_embeddings "
                          f"{tcfg.max_position_embeddings}")

    bar = tqdm(total=5, desc="export", disable=not progress, unit="stage")
    bar.set_postfix_str("loading models")
    draft_step, target_step, head = load_steps(target_dir, draft_dir, head_dir, dtype, max_draft, debug_logits)
    temperatures = draft_step.temperatures
    bar.update()
    # Write into a temporary directory next to the destination, then move into place: a failed export
    # never leaves a half-written artifact, and an existing one is replaced only when asked. The temporary
    # directory is locked while this export runs (ones a killed export left behind are removed) and has
    # the user's normal permissions.
    staging = Staging(out_dir.parent, ".export-")
    tmp = staging.path
    try:
        tdt = torch_dtype(dtype)
        bar.set_postfix_str("draft.onnx")
        written = export_draft(draft_step, tmp / "draft.onnx", max_batch, tdt, external_data)
        written += export_greedy_draft(draft_step, tmp / GREEDY_DRAFT_FILE, max_batch, tdt, external_data)
        if with_ort:
            for g in ("draft", GREEDY_DRAFT_GRAPH):
                written += export_ort_graph(g, draft_step, tmp, max_batch, tdt, tcfg.vocab_size, max_context,
                                            external_data)
                written += export_ort_draft_decode(g, draft_step, tmp, tdt, max_context, external_data)
        bar.update()
        bar.set_postfix_str("target.onnx")
        del draft_step  # free the draft's weights before tracing the target
        written += export_target(target_step, tmp / "target.onnx", max_batch, tdt, tcfg.vocab_size, external_data)
        if with_ort:
            written += export_ort_graph("target", target_step, tmp, max_batch, tdt, tcfg.vocab_size, max_context,
                                        external_data)
            written += export_ort_decode(target_step.decoder, tmp, tdt, tcfg.vocab_size, max_context, external_data)
        del target_step
        bar.update()
        bar.set_postfix_str("manifest")
        graphs = {"draft": {"file": "draft.onnx", **_io(tmp / "draft.onnx")},
                  GREEDY_DRAFT_GRAPH: {"file": GREEDY_DRAFT_FILE, **_io(tmp / GREEDY_DRAFT_FILE)},
                  "target": {"file": "target.onnx", **_io(tmp / "target.onnx")}}
        for g in graphs if with_ort else ():
            record_ort_graph(graphs, g, _io(tmp / ort_file(g)), decode=decode_file(g))
        if with_ort:
            written += write_greedy_twins(graphs, tmp)
        manifest = manifest_facts(target_dir, draft_dir, head_dir if head is not None else None, temperatures,
                                  max_draft=max_draft, max_batch=max_batch, max_context=max_context, dtype=dtype,
                                  graphs=graphs)
        for name in manifest["tokenizer"]["files"]:
            shutil.copyfile(target_dir / name, tmp / name)
        for name in written + manifest["tokenizer"]["files"]:
            manifest.record_file(tmp, name)
        manifest.save(tmp)
        bar.update()
        replace_dir(tmp, out_dir)
        bar.update()
    finally:
        bar.close()
        staging.close()
    del torch
    return out_dir


def _export_dspark(target_dir, draft_dir, out_dir, head_dir, max_batch, max_context, dtype, overwrite,
                   progress, ort_flavour, external_data) -> Path:
    """A DSpark drafter (vLLM's format): its block size is the draft length and its confidence head is in
    its checkpoint, so --max-draft and --head do not apply (exporter/dspark_artifact.py)."""
    from dspark_trt.exporter.dspark_artifact import export_dspark_artifact

    if head_dir is not None:
        raise DsparkError(f"--head does not apply to the DSpark drafter {draft_dir}: its confidence head is "
                          "part of its checkpoint")
    if dtype not in ("fp32", "fp16"):
        raise DsparkError(f"--dtype {dtype}: a DSpark drafter exports in fp32 or fp16 (bf16 is not supported "
                          "for DSpark drafters yet); pass --dtype fp16")
    return export_dspark_artifact(target_dir, draft_dir, out_dir, max_batch=max_batch, max_context=max_context,
                                  overwrite=overwrite, progress=progress, ort_flavour=ort_flavour, dtype=dtype,
                                  external_data=external_data)
