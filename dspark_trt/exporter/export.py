"""`dspark-trt export`: target + draft (+ confidence head) -> artifact directory (ONNX + manifest)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from dspark_trt.errors import DsparkError
from dspark_trt.manifest import Manifest


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


def _eos_id(tokenizer_path: Path):
    data = json.loads(tokenizer_path.read_text())
    for tok in data.get("added_tokens", []):
        if tok.get("content") in ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>"):
            return tok["id"]
    return None


def manifest_facts(target_dir, draft_dir, head_dir, temperatures, max_draft: int, max_batch: int,
                   max_context: int, dtype: str, graphs: dict | None = None) -> Manifest:
    """The manifest of an export: the models, limits and dims (graphs and files are added by export)."""
    from dspark_trt.models.config import load_config

    tcfg, dcfg = load_config(target_dir), load_config(draft_dir)
    dims, limits = plan_dims(max_batch, max_draft, max_context)
    tok = Path(target_dir) / "tokenizer.json"
    m = Manifest.create(
        model={"arch": tcfg.model_type, "vocab_size": tcfg.vocab_size, "hidden_size": tcfg.hidden_size,
               "num_layers": tcfg.num_hidden_layers, "num_kv_heads": tcfg.num_key_value_heads,
               "head_dim": tcfg.head_dim, "dtype": dtype, "max_context": max_context},
        draft={"arch": dcfg.model_type, "hidden_size": dcfg.hidden_size, "num_layers": dcfg.num_hidden_layers,
               "num_kv_heads": dcfg.num_key_value_heads, "head_dim": dcfg.head_dim, "max_draft": max_draft,
               "confidence": "head" if head_dir is not None else "fallback",
               "temperatures": [float(t) for t in temperatures]},
        limits=limits, dims=dims, graphs=graphs or {},
        tokenizer={"file": "tokenizer.json", "eos_token_id": _eos_id(tok) if tok.is_file() else None})
    m["sources"] = {"target": str(Path(target_dir).resolve()), "draft": str(Path(draft_dir).resolve()),
                    "head": str(Path(head_dir).resolve()) if head_dir is not None else None}
    return m


def export_artifacts(target_dir, draft_dir, out_dir, head_dir=None, max_draft: int = 7, max_batch: int = 64,
                     max_context: int = 1024, dtype: str = "fp32", overwrite: bool = False,
                     debug_logits: bool = False, progress: bool = True) -> Path:
    import torch
    from tqdm import tqdm

    from dspark_trt.exporter.build_modules import load_steps
    from dspark_trt.exporter.onnx_export import export_draft, export_target
    from dspark_trt.models.checkpoint import check_same_vocab, torch_dtype
    from dspark_trt.models.config import load_config

    target_dir, draft_dir, out_dir = Path(target_dir), Path(draft_dir), Path(out_dir)
    for name, d in (("--target", target_dir), ("--draft", draft_dir)):
        if not d.is_dir():
            raise DsparkError(f"{name} directory {d} does not exist")
    if head_dir is None and (draft_dir / "confidence_head.safetensors").is_file():
        head_dir = draft_dir
    if head_dir is not None and not Path(head_dir).is_dir():
        raise DsparkError(f"--head directory {head_dir} does not exist")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise DsparkError(f"{out_dir} exists and is not empty; pass --force to overwrite it")
    check_same_vocab(target_dir, draft_dir)
    tok_src = target_dir / "tokenizer.json"
    if not tok_src.is_file():
        raise DsparkError(f"no tokenizer.json in {target_dir}: the artifact needs the target's tokenizer")
    tcfg, dcfg = load_config(target_dir), load_config(draft_dir)
    if max_context > tcfg.max_position_embeddings:
        raise DsparkError(f"--max-context {max_context} exceeds the target's max_position_embeddings "
                          f"{tcfg.max_position_embeddings}")

    bar = tqdm(total=5, desc="export", disable=not progress, unit="stage")
    bar.set_postfix_str("loading models")
    draft_step, target_step, head = load_steps(target_dir, draft_dir, head_dir, dtype, max_draft, debug_logits)
    bar.update()
    # Write into a temporary directory next to the destination, then move into place: a failed export
    # never leaves a half-written artifact, and an existing one is replaced only when asked.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=out_dir.parent))
    try:
        tdt = torch_dtype(dtype)
        bar.set_postfix_str("draft.onnx")
        export_draft(draft_step, tmp / "draft.onnx", max_batch, tdt)
        bar.update()
        bar.set_postfix_str("target.onnx")
        export_target(target_step, tmp / "target.onnx", max_batch, tdt, tcfg.vocab_size)
        bar.update()
        shutil.copyfile(tok_src, tmp / "tokenizer.json")
        bar.set_postfix_str("manifest")
        graphs = {"draft": {"file": "draft.onnx", **_io(tmp / "draft.onnx")},
                  "target": {"file": "target.onnx", **_io(tmp / "target.onnx")}}
        manifest = manifest_facts(target_dir, draft_dir, head_dir if head is not None else None, draft_step.temperatures,
                                  max_draft=max_draft, max_batch=max_batch, max_context=max_context, dtype=dtype,
                                  graphs=graphs)
        for name in ("draft.onnx", "target.onnx", "tokenizer.json"):
            manifest.record_file(tmp, name)
        manifest.save(tmp)
        bar.update()
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
        bar.update()
    finally:
        bar.close()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    del torch
    return out_dir
