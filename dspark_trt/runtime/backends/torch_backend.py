"""Eager torch backend: the numerical reference, running the same modules the graphs were exported from."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dspark_trt.errors import DsparkError


class TorchBackend:
    name = "torch"

    def __init__(self, artifact_dir, manifest: dict):
        try:
            import torch
        except ImportError:
            raise DsparkError("the torch backend needs PyTorch: pip install 'dspark-trt[export]'") from None
        from dspark_trt.exporter.build_modules import build_steps

        sources = manifest.get("sources") or {}
        for key in ("target", "draft"):
            if not sources.get(key) or not Path(sources[key]).is_dir():
                raise DsparkError(f"the torch backend loads the source checkpoints, and the {key} directory "
                                  f"{sources.get(key)!r} recorded in the manifest is not there: use --backend ort")
        self.torch = torch
        self.draft, self.target = build_steps(manifest)
        self.num_layers = {"draft": manifest["draft"]["num_layers"], "target": manifest["model"]["num_layers"]}

    def _run(self, module, outputs: list[str], n_layers: int, input_names: list[str], feeds, past):
        torch = self.torch
        args = [torch.from_numpy(np.ascontiguousarray(feeds[name])) for name in input_names]
        args += [torch.from_numpy(p) for p in past]
        with torch.no_grad():
            outs = module(*args)
        outs = [o.numpy() for o in outs]
        named = dict(zip(outputs, outs[:len(outputs)]))
        present = outs[len(outputs):len(outputs) + 2 * n_layers]
        return named, present

    def run_draft(self, feeds, past):
        from dspark_trt.manifest import DRAFT_INPUTS, DRAFT_OUTPUTS

        return self._run(self.draft, DRAFT_OUTPUTS, self.num_layers["draft"], DRAFT_INPUTS, feeds, past)

    def run_target(self, feeds, past):
        from dspark_trt.manifest import TARGET_INPUTS, TARGET_OUTPUTS

        return self._run(self.target, TARGET_OUTPUTS, self.num_layers["target"], TARGET_INPUTS, feeds, past)
