"""`dspark-trt profile`: measure an artifact's step costs and save them next to it."""

from __future__ import annotations

from pathlib import Path

from dspark_trt.runtime.costs.profiling import measure, profile_path
from dspark_trt.runtime.runtime import Runtime


def profile_artifact(artifact_dir, backend: str = "ort", repeats: int = 5) -> Path:
    rt = Runtime.load(artifact_dir, backend=backend, profile="none")
    try:
        table = measure(rt, repeats=repeats)
        return table.save(profile_path(artifact_dir, backend))
    finally:
        rt.close()
