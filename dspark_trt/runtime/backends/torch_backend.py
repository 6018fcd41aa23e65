"""Eager torch backend: the numerical reference, running the same modules the graphs were exported from.

`device` ("cpu", "cuda", "cuda:1") and `dtype` ("fp32", "fp16", "bf16"; default: the manifest's) choose
where and in what precision the modules run. The runtime's interface stays numpy: inputs and the past KV
entries go to the device (the KV entries in the module dtype), outputs come back as numpy, floating ones as float32
(numpy has no bfloat16; the host KV cache keeps the manifest's dtype and casts on write).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from dspark_trt.errors import DsparkError

DTYPES = ("fp32", "fp16", "bf16")


class TorchBackend:
    name = "torch"

    def __init__(self, artifact_dir, manifest: dict, device: str = "cpu", dtype: str | None = None):
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
        self.device = check_device(torch, device)
        self.dtype = dtype or manifest["model"]["dtype"]
        if self.dtype not in DTYPES:
            raise DsparkError(f"torch backend dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.dtype == "fp16" and self.device.type == "cpu":
            raise DsparkError("the torch backend runs fp16 on CUDA only (CPU kernels lack half precision "
                              "coverage): use dtype fp32 or bf16 on CPU, or device cuda")
        self.torch = torch
        self.artifact_dir = artifact_dir
        steps_manifest = dict(manifest, model=dict(manifest["model"], dtype=self.dtype))
        self.calls = Counter()
        self.num_layers = {"target": manifest["model"]["num_layers"]}
        self._manifest, self._dspark = steps_manifest, None
        if manifest["draft"].get("kind") == "dspark":  # its drafter's modules run in its drafter phase
            from dspark_trt.runtime.backends.torch_dspark import load_dspark_modules

            self.target, self._dspark = load_dspark_modules(steps_manifest, self.device)
            self.has_greedy_draft = False
        else:
            from dspark_trt.exporter.graphs import GreedyDraftStep

            self.draft, self.target = (m.to(self.device) for m in build_steps(steps_manifest))
            self.draft_greedy = GreedyDraftStep(self.draft.decoder, self.draft.head, self.draft.temperatures).eval()
            self.has_greedy_draft = True  # the modules themselves: no exported flavour needed
            self.num_layers["draft"] = manifest["draft"]["num_layers"]
        self._float = next(self.target.parameters()).dtype

    def _to_device(self, a: np.ndarray, kv: bool = False):
        t = _to_torch(self.torch, np.ascontiguousarray(a)).to(self.device)
        return t.to(self._float) if kv else t  # the graphs' other float inputs are float32 at any dtype

    def _to_host(self, t) -> np.ndarray:
        t = t.detach()
        if t.is_floating_point() and t.dtype != self.torch.float64:
            t = t.float()
        return t.cpu().numpy()

    def _run(self, graph: str, module, outputs: list[str], n_layers: int, input_names: list[str], feeds, past):
        self.calls[graph] += 1  # runs per graph name, as the ort backend counts them
        args = [self._to_device(feeds[name]) for name in input_names]
        args += [self._to_device(p, kv=True) for p in past]
        with self.torch.no_grad():
            outs = module(*args)
        outs = [self._to_host(o) for o in outs]
        named = dict(zip(outputs, outs[:len(outputs)]))
        present = outs[len(outputs):len(outputs) + 2 * n_layers]
        if graph == "target" and self._dspark is not None:
            named["aux_hidden"] = outs[-1]  # DsparkTargetStep's last output
        return named, present

    def run_draft(self, feeds, past):
        from dspark_trt.manifest import DRAFT_INPUTS, DRAFT_OUTPUTS

        return self._run("draft", self.draft, DRAFT_OUTPUTS, self.num_layers["draft"], DRAFT_INPUTS, feeds, past)

    def run_draft_greedy(self, feeds, past):
        from dspark_trt.manifest import GREEDY_DRAFT_GRAPH, GREEDY_DRAFT_INPUTS, GREEDY_DRAFT_OUTPUTS

        return self._run(GREEDY_DRAFT_GRAPH, self.draft_greedy, GREEDY_DRAFT_OUTPUTS, self.num_layers["draft"],
                         GREEDY_DRAFT_INPUTS, feeds, past)

    def run_target(self, feeds, past):
        from dspark_trt.manifest import TARGET_INPUTS, TARGET_OUTPUTS

        return self._run("target", self.target, TARGET_OUTPUTS, self.num_layers["target"], TARGET_INPUTS, feeds, past)

    def dspark_graphs(self):
        """A DSpark drafter's graphs as eager modules (backends/torch_dspark.py), for its drafter phase."""
        from dspark_trt.runtime.backends.torch_dspark import TorchDsparkGraphs

        return TorchDsparkGraphs(self, self._dspark, self._manifest)


def check_device(torch, device):
    """torch.device, or a one-line DsparkError when it is not usable here."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise DsparkError(f"torch backend device {device!r}: use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DsparkError(f"torch backend device {device!r}: torch {torch.__version__} sees no CUDA GPU "
                              f"(a CPU build of torch, or no NVIDIA driver)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DsparkError(f"CUDA device {dev.index} does not exist (torch sees {torch.cuda.device_count()})")
    elif dev.type != "cpu":
        raise DsparkError(f"torch backend device {device!r}: use cpu, cuda or cuda:N")
    return dev


def _to_torch(torch, a: np.ndarray):
    """numpy -> torch without a copy; ml_dtypes.bfloat16 (the host KV cache of a bf16 artifact) by bits."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)
