"""The onnxruntime-genai peer: the same target checkpoint converted by onnxruntime-genai's own model
builder (fp32, CPU), plain greedy decoding in static batches, driven by a worker process.

The worker (:mod:`dspark_trt.bench.ortgenai_worker`, run as a script) may use another Python than the
bench's (``--peer-python``): onnxruntime-genai ships for few platforms and pins its own onnxruntime
floor, so it need not live in the environment that runs dspark-trt. The converted model is cached under
``$XDG_CACHE_HOME/dspark-trt/peers`` (default ``~/.cache``), keyed on the checkpoint's files and the
onnxruntime-genai version, so a second bench does not convert again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from dspark_trt.bench.peer_worker import WorkerClient
from dspark_trt.errors import DsparkError

WORKER = Path(__file__).with_name("ortgenai_worker.py")
MODE = "ortgenai:target"
LABEL = "onnxruntime-genai (its model builder, fp32 CPU), plain greedy, static batches"
INSTALL_HINT = "pip install 'dspark-trt[peers]', or point --peer-python at a Python that has onnxruntime-genai"


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dspark-trt" / "peers"


def probe(python: str) -> str | None:
    """onnxruntime-genai's version importable by ``python``, or None when it has none (or cannot run)."""
    try:
        r = subprocess.run([python, "-c", "import onnxruntime_genai as og; print(og.__version__)"],
                           capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = r.stdout.strip().splitlines()
    return lines[-1].strip() if r.returncode == 0 and lines else None


def require(python: str) -> str:
    """The version, or a one-line DsparkError naming what to install."""
    version = probe(python)
    if version is None:
        raise DsparkError(f"the onnxruntime-genai peer needs the onnxruntime-genai package in {python}: "
                          f"{INSTALL_HINT}")
    return version


def checkpoint_hash(model_dir) -> str:
    """sha256 over the names and contents of the files the model builder reads (config, weights, tokenizer)."""
    h = hashlib.sha256()
    for p in sorted(Path(model_dir).iterdir()):
        if p.is_file() and (p.suffix in (".json", ".safetensors", ".bin", ".model", ".txt")):
            h.update(p.name.encode() + b"\0")
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


def converted_model(python: str, target_dir, version: str, say=print) -> Path:
    """The target converted by onnxruntime-genai's model builder (fp32, CPU), from the cache or built now."""
    if not target_dir or not (Path(target_dir) / "config.json").is_file():
        raise DsparkError(f"the onnxruntime-genai peer needs the target checkpoint in HF layout; the manifest's "
                          f"sources.target ({target_dir!r}) has no config.json: re-export from an existing directory")
    out = cache_root() / f"ortgenai-{version}-fp32-cpu-{checkpoint_hash(target_dir)[:16]}"
    if (out / "genai_config.json").is_file():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    say(f"converting {target_dir} with onnxruntime-genai's model builder into {out}")
    r = subprocess.run([python, "-m", "onnxruntime_genai.models.builder", "-i", str(target_dir), "-o", str(tmp),
                        "-p", "fp32", "-e", "cpu", "-c", str(tmp / "hf-cache")], capture_output=True, text=True)
    if r.returncode != 0 or not (tmp / "genai_config.json").is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        last = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise DsparkError(f"onnxruntime-genai's model builder could not convert {target_dir}: {last[0]}")
    shutil.rmtree(tmp / "hf-cache", ignore_errors=True)
    os.replace(tmp, out)
    return out


def pad_id_for(model_dir: Path, prompts: list[list[int]]) -> int | None:
    """None when the model's pad id occurs in no prompt; else the smallest id that occurs in none (the
    graph masks every pad token it is given, so a prompt token equal to it would be dropped)."""
    config = json.loads((model_dir / "genai_config.json").read_text())["model"]
    used = {t for p in prompts for t in p}
    if int(config.get("pad_token_id", 0)) not in used:
        return None
    return next(i for i in range(int(config["vocab_size"])) if i not in used)


class OrtGenaiPeer:
    """The worker process holding the converted model; :meth:`run` measures one (concurrency, round)."""

    engine = "ortgenai"
    mode = MODE
    label = LABEL
    batching = "static batches of `concurrency` requests"

    def __init__(self, python: str, target_dir, prompts: list[list[int]], say=print):
        version = require(python)
        model = converted_model(python, target_dir, version, say)
        self.prompts = [list(map(int, p)) for p in prompts]
        pad = pad_id_for(model, self.prompts)
        self.worker = WorkerClient([python, str(WORKER), str(model)] + ([str(pad)] if pad is not None else []),
                                   "onnxruntime-genai")
        self.versions = {"onnxruntime-genai": self.worker.hello["version"],
                         "onnxruntime (peer process)": self.worker.hello["ort_version"]}
        self.info = {"model_dir": str(model), "python": python, "pad_token_id_override": pad}

    def run(self, concurrency: int, n_requests: int, max_new_tokens: int) -> dict:
        return self.worker.run(self.prompts, concurrency, n_requests, max_new_tokens)

    def close(self) -> None:
        self.worker.close()


def default_python() -> str:
    return sys.executable
