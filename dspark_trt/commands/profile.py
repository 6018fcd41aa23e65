"""`dspark-trt profile`: measure an artifact's step costs and save them next to it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dspark_trt.errors import DsparkError
from dspark_trt.runtime.costs.profiling import measure, profile_path, spread_refusal
from dspark_trt.runtime.runtime import Runtime
from dspark_trt.runtime.tuning import RuntimeTuning


def profile_artifact(artifact_dir, backend: str = "ort", repeats: int = 5, context: int | None = None,
                     force: bool = False, out=None) -> Path:
    """force: save the profile even if its timings spread too much (ProfileTuning.persist_spread).
    out: a new file to write instead of the artifact's profile (an existing one is refused before measuring).
    context: cached tokens per row in the profiled calls (default: ProfileTuning.past). A realistic
    serving context prices verify calls as they will run (vLLM profiles at 8192 by default); the
    call-shape model keeps how costs grow with the past either way."""
    if out is not None and Path(out).exists():
        raise DsparkError(f"--out {out} already exists; remove it or choose another file")
    if out is not None and not Path(out).resolve().parent.is_dir():
        raise DsparkError(f"--out {out}: its folder does not exist")
    tuning = RuntimeTuning()
    if context is not None:
        tuning = dataclasses.replace(tuning, profile=dataclasses.replace(tuning.profile, past=int(context)))
    rt = Runtime.load(artifact_dir, backend=backend, profile="none", tuning=tuning)
    if context is not None and not 1 <= context <= rt.max_context - rt.max_draft - 2:
        rt.close()
        raise DsparkError(f"--context {context} must be between 1 and {rt.max_context - rt.max_draft - 2} "
                          f"(the artifact's max context {rt.max_context} less a verify row)")
    try:
        table = measure(rt, repeats=repeats)
        why = spread_refusal(table.meta, rt.tuning.profile.persist_spread)
        if why and not force:
            raise DsparkError(f"cost profile not saved: {why}; profile again on a quieter machine, "
                              f"or pass --force to save it anyway")
        return table.save(Path(out) if out is not None else profile_path(artifact_dir, rt.profile_name))
    finally:
        rt.close()
