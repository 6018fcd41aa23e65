"""The interface every backend implements: run one draft step or one target step on numpy arrays."""

from __future__ import annotations

from typing import Protocol

import numpy as np

BACKENDS = ("ort", "torch", "trt")  # the one list of backend names (CLI choices, errors)


class Backend(Protocol):
    name: str

    def run_draft(self, feeds: dict[str, np.ndarray], past: list[np.ndarray]) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
        """-> (outputs by name, present KV entries interleaved [k0, v0, k1, ...], each [N, KVH, D])."""

    def run_target(self, feeds: dict[str, np.ndarray], past: list[np.ndarray]) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
        ...

    # Optional: the all-greedy draft flavour (manifest graph "draft_greedy"). A backend that sets
    # has_greedy_draft runs it with run_draft_greedy(feeds, past) (feeds without temperature and
    # uniforms; outputs without draft_probs); without the attribute every draft call uses run_draft.
    # has_greedy_draft: bool


def make_backend(name: str, artifact_dir, manifest: dict, **options):
    """options: backend-specific (torch: device="cuda", dtype="fp16"); the others take none."""
    from dspark_trt.errors import DsparkError

    if options and name != "torch":
        raise DsparkError(f"the {name} backend takes no options (got {', '.join(sorted(options))})")

    if name == "ort":
        from dspark_trt.runtime.backends.ort import OrtBackend
        return OrtBackend(artifact_dir, manifest)
    if name == "torch":
        from dspark_trt.runtime.backends.torch_backend import TorchBackend
        return TorchBackend(artifact_dir, manifest, **options)
    if name == "trt":
        from dspark_trt.runtime.backends.trt import TrtBackend
        return TrtBackend(artifact_dir, manifest)
    raise DsparkError(f"unknown backend {name!r} (use {', '.join(BACKENDS[:-1])} or {BACKENDS[-1]})")
