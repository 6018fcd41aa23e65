"""Shared fixtures: a random tiny draft/target pair in HF layout and its exported artifact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    # Tiny test models gain nothing from intra-op threads, and on a 2-core machine torch's thread pool
    # fights ONNX Runtime's (and any other process) for the cores: one thread keeps tests fast and steady.
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
TINY_VOCAB = 300


def stop_process(proc, timeout: float) -> None:
    """Ask a server subprocess to stop (SIGINT, as Ctrl-C would); kill it if it does not within `timeout`."""
    import signal
    import subprocess

    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def make_tokenizer(path: Path, vocab: int = TINY_VOCAB) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
            "import os\nimport sys\n\nclass Foo:\n    def __init__(self):\n        self.x = 1\n"] * 20
    tok.train_from_iterator(text, trainer=trainer)
    tok.save(str(path))


def make_pair(root: Path, seed: int = 0, noise: float = 0.02, arch: str = "llama", vocab: int | None = None,
              dtype: str = "fp32") -> tuple[Path, Path]:
    """A random target and a draft that is a noisy copy of it (so drafts are often accepted).
    vocab: the models' vocabulary (default: the tokenizer's; larger = padded, as real checkpoints are);
    dtype: the weights' dtype on disk."""
    import torch

    from dspark_trt.models.checkpoint import save_decoder
    from dspark_trt.models.config import ModelConfig
    from dspark_trt.models.decoder import Decoder

    root.mkdir(parents=True, exist_ok=True)
    make_tokenizer(root / "tokenizer.json")
    v = vocab or max(json.loads((root / "tokenizer.json").read_text())["model"]["vocab"].values()) + 1
    cfg = ModelConfig(arch, v, 64, 128, 2, 4, 2, 16, tie_word_embeddings=True, max_position_embeddings=512,
                      qk_norm=arch == "qwen3")
    target = Decoder(cfg).init_weights(std=0.08, seed=seed).eval()
    draft = Decoder(cfg).eval()
    draft.load_state_dict(target.state_dict())
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    out = []
    for name, model in (("target", target), ("draft", draft)):
        d = root / name
        save_decoder(model, d, dtype=dtype)
        (d / "tokenizer.json").write_bytes((root / "tokenizer.json").read_bytes())
        out.append(d)
    return out[0], out[1]


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="session")
def tiny_artifact(tiny_pair, tmp_path_factory):
    from dspark_trt.exporter.export import export_artifacts

    out = tmp_path_factory.mktemp("artifact") / "tiny"
    return export_artifacts(tiny_pair[0], tiny_pair[1], out, max_draft=4, max_batch=8, max_context=256,
                            progress=False, debug_logits=True)


@pytest.fixture
def unwritable_dir(tmp_path):
    """A directory nothing can be created in: mode 0555 for a normal user; for root (whom modes do not
    stop) a sysfs path, which refuses new entries to everyone."""
    import os

    d = tmp_path / "readonly"
    d.mkdir()
    d.chmod(0o555)
    try:
        (d / "probe").mkdir()
    except OSError:
        yield d
        d.chmod(0o755)
        return
    (d / "probe").rmdir()
    d.chmod(0o755)
    sysfs = Path("/sys/kernel")
    try:
        (sysfs / "dspark-probe").mkdir()
    except OSError:
        if os.path.isdir(sysfs):
            yield sysfs
            return
    pytest.skip("no directory here refuses writes")


@pytest.fixture(autouse=True)
def _caches_mapped_on_first_use(request, monkeypatch):
    """Runtimes in tests map their host caches on first use rather than in a background thread: no cost is
    learned while that thread runs (Costs.learning), so what the tests of learning saw would depend on how
    long it ran on a busy CI machine. test_prefault.py tests the mapping, and the runtime's waiting for it."""
    if request.module.__name__.rpartition(".")[2] != "test_prefault":
        from dspark_trt.runtime import prefault

        monkeypatch.setattr(prefault, "prefault_in_background", lambda buffers: None)
