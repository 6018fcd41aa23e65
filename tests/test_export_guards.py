"""export refuses a draft larger than its target, cleans up after killed exports, and writes artifact
directories with the user's normal permissions."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dspark_trt.errors import DsparkError
from dspark_trt.exporter.draft_check import parameter_count
from dspark_trt.models.config import load_config


def make_sized_pair(root, small=(1, 32), large=(2, 64)):
    """Two random models sharing a tokenizer: `small` and `large` as (layers, hidden)."""
    import torch  # noqa: F401  (the decoder needs it)

    from conftest import make_tokenizer
    from dspark_trt.models.checkpoint import save_decoder
    from dspark_trt.models.config import ModelConfig
    from dspark_trt.models.decoder import Decoder

    root.mkdir(parents=True, exist_ok=True)
    make_tokenizer(root / "tokenizer.json")
    v = max(json.loads((root / "tokenizer.json").read_text())["model"]["vocab"].values()) + 1
    dirs = {}
    for name, (layers, hidden) in (("small", small), ("large", large)):
        cfg = ModelConfig("llama", v, hidden, 2 * hidden, layers, 4, 2, hidden // 4, tie_word_embeddings=True,
                          max_position_embeddings=512)
        d = root / name
        save_decoder(Decoder(cfg).init_weights(std=0.08, seed=layers).eval(), d)
        (d / "tokenizer.json").write_bytes((root / "tokenizer.json").read_bytes())
        dirs[name] = d
    return dirs["small"], dirs["large"]


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "dspark_trt.cli", *args], capture_output=True, text=True, **kw)


def test_parameter_count_matches_the_torch_model(tiny_pair):
    from dspark_trt.models.checkpoint import load_decoder

    model = load_decoder(tiny_pair[0])
    assert parameter_count(load_config(tiny_pair[0])) == sum(p.numel() for p in model.parameters())


def test_swapped_pair_is_refused_saying_which_is_which(tmp_path):
    small, large = make_sized_pair(tmp_path / "pair")
    out = cli("export", "--target", str(small), "--draft", str(large), "--out", str(tmp_path / "art"))
    assert out.returncode == 1 and "Traceback" not in out.stderr
    [line] = out.stderr.strip().splitlines()
    assert line.startswith("error: the draft is not cheaper than the target: ")
    assert f"--draft {large} (2 layers x 64 hidden" in line and f"--target {small} (1 layers x 32 hidden" in line
    assert "more parameters, more layers, a wider hidden size" in line and "--allow-large-draft" in line
    assert not (tmp_path / "art").exists()


@pytest.mark.slow  # ~40-70 s: whole exports (default suite time)
def test_allow_large_draft_exports_a_swapped_pair(tmp_path):
    from dspark_trt.exporter.export import export_artifacts

    small, large = make_sized_pair(tmp_path / "pair")
    with pytest.raises(DsparkError, match="not cheaper"):
        export_artifacts(small, large, tmp_path / "art", max_draft=2, max_batch=2, max_context=64, progress=False)
    out = export_artifacts(small, large, tmp_path / "art", max_draft=2, max_batch=2, max_context=64, progress=False,
                           allow_large_draft=True)
    assert json.loads((out / "manifest.json").read_text())["draft"]["num_layers"] == 2


@pytest.mark.slow  # ~40-70 s: whole exports (default suite time)
def test_killed_export_is_cleaned_by_the_next_one_which_has_normal_permissions(tiny_pair, tmp_path):
    from dspark_trt.exporter.export import export_artifacts

    parent = tmp_path / "artifacts"
    proc = subprocess.Popen([sys.executable, "-m", "dspark_trt.cli", "export", "--target", str(tiny_pair[0]),
                             "--draft", str(tiny_pair[1]), "--out", str(parent / "a"), "--max-batch", "2",
                             "--max-context", "64"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and not [p for p in parent.glob(".export-*") if p.is_dir()]:
        assert proc.poll() is None, "export finished before it could be killed"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    [killed] = [p for p in parent.glob(".export-*") if p.is_dir()]  # left behind, as kill -9 does

    # A running export's staging (locked), and one newer than the next export, are kept.
    live = parent / ".export-live"
    live.mkdir()
    lock = open(parent / ".export-live.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    old = time.time() - 3600
    for p in (killed, live):
        os.utime(p, (old, old))
    newer = parent / ".export-newer"
    newer.mkdir()
    os.utime(newer, (time.time() + 3600,) * 2)

    mask = os.umask(0o027)
    try:
        out = export_artifacts(tiny_pair[0], tiny_pair[1], parent / "b", max_draft=2, max_batch=2, max_context=64,
                               progress=False)
    finally:
        os.umask(mask)
        lock.close()
    assert not killed.exists() and not (parent / (killed.name + ".lock")).exists()
    assert live.is_dir() and newer.is_dir()
    assert sorted(p.name for p in parent.iterdir()) == [".export-live", ".export-live.lock", ".export-newer", "b"]
    assert (out.stat().st_mode & 0o777) == 0o750  # the umask's mode, not mkdtemp's 0700
