"""Build the torch step modules (DraftStep, TargetStep) from checkpoint directories."""

from __future__ import annotations

from pathlib import Path

from dspark_trt.models.checkpoint import load_decoder
from dspark_trt.models.confidence_head import has_head, load_head


def pad_temperatures(temps: list[float] | None, k: int) -> list[float]:
    temps = [float(t) for t in (temps or [])] or [1.0]
    return (temps + [temps[-1]] * k)[:k]


def load_steps(target_dir, draft_dir, head_dir, dtype: str, max_draft: int, debug_logits: bool = False):
    from dspark_trt.exporter.graphs import DraftStep, TargetStep

    target = load_decoder(target_dir, dtype)
    draft = load_decoder(draft_dir, dtype)
    head = None
    if head_dir is not None and has_head(head_dir):
        head = load_head(head_dir).to(next(draft.parameters()).dtype)
    temps = pad_temperatures(head.temperatures if head is not None else None, max_draft)
    return DraftStep(draft, head, temps).eval(), TargetStep(target, debug_logits).eval(), head


def build_steps(manifest: dict):
    src = manifest["sources"]
    head_dir = src.get("head")
    draft, target, _ = load_steps(src["target"], src["draft"], head_dir if head_dir and Path(head_dir).is_dir() else None,
                                  manifest["model"]["dtype"], manifest["draft"]["max_draft"])
    if manifest["draft"]["confidence"] == "head":
        draft.temperatures = pad_temperatures(manifest["draft"]["temperatures"], manifest["draft"]["max_draft"])
    return draft, target
