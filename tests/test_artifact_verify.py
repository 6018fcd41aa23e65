"""Loading an artifact verifies every file against the manifest's sha256, cached by stat stamp."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from dspark_trt.errors import DsparkError
from dspark_trt.runtime.artifact_verify import cache_path, verify_artifact


@pytest.fixture
def artifact(tiny_artifact, tmp_path, monkeypatch):
    """A private copy of the tiny artifact and a private cache directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    dst = tmp_path / "art"
    shutil.copytree(tiny_artifact, dst, ignore=shutil.ignore_patterns("cost_profile*.json"))
    return dst


def manifest_of(art):
    return json.loads((art / "manifest.json").read_text())


def flip(path, n=4096):
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + n] = bytes(b ^ 0xFF for b in data[mid:mid + n])
    path.write_bytes(bytes(data))


def test_untouched_artifact_is_hashed_once_then_cached(artifact):
    m = manifest_of(artifact)
    assert verify_artifact(artifact, m) == sorted(m["files"])  # first load hashes every listed file
    assert verify_artifact(artifact, m) == []  # unchanged stamps: nothing hashed again


def test_touch_without_change_rehashes_that_file_once(artifact):
    m = manifest_of(artifact)
    verify_artifact(artifact, m)
    st = (artifact / "target.onnx").stat()
    os.utime(artifact / "target.onnx", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert verify_artifact(artifact, m) == ["target.onnx"]
    assert verify_artifact(artifact, m) == []


def test_changed_file_is_refused_naming_it_even_when_cached(artifact):
    m = manifest_of(artifact)
    verify_artifact(artifact, m)  # cached as good ...
    flip(artifact / "target.onnx")  # ... then 4 KB flipped in place (same size)
    with pytest.raises(DsparkError, match=r"target\.onnx does not match the sha256.*re-export"):
        verify_artifact(artifact, m)
    (artifact / "draft.onnx").write_bytes(b"short")
    with pytest.raises(DsparkError, match=r"draft\.onnx has 5 bytes"):
        verify_artifact(artifact, m)
    (artifact / "draft.onnx").unlink()
    with pytest.raises(DsparkError, match=r"draft\.onnx is listed in manifest.json but missing"):
        verify_artifact(artifact, m)


def test_verification_never_writes_into_the_artifact(artifact, tmp_path, monkeypatch):
    before = sorted(p.name for p in artifact.iterdir())
    verify_artifact(artifact, manifest_of(artifact))
    assert sorted(p.name for p in artifact.iterdir()) == before
    assert cache_path(artifact).is_file() and tmp_path / "cache" in cache_path(artifact).parents
    # No writable cache directory (here: under a regular file): it still verifies, by hashing every time.
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file" / "cache"))
    m = manifest_of(artifact)
    assert verify_artifact(artifact, m) == sorted(m["files"])
    assert verify_artifact(artifact, m) == sorted(m["files"])


def test_generate_refuses_a_flipped_graph_with_one_error_line(artifact, tmp_path):
    flip(artifact / "target.onnx")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-m", "dspark_trt.cli", "generate", str(artifact), "--prompt", "x",
                          "--max-new-tokens", "2"], capture_output=True, text=True, env=env)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "target.onnx" in lines[0]
    assert "re-export" in lines[0] and out.stdout == ""
