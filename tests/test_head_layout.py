"""Where the confidence head is stored: a `dspark_head/` subfolder of the draft directory, so the folder
stays loadable by vLLM (its loader globs the folder's top-level *.safetensors, non-recursively, and
fails on tensors the architecture lacks); heads written before, beside model.safetensors, keep loading."""

from __future__ import annotations

import glob
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from dspark_trt.errors import DsparkError
from dspark_trt.models.confidence_head import (HEAD_CONFIG, HEAD_WEIGHTS, LEGACY_HEAD_CONFIG, LEGACY_HEAD_WEIGHTS,
                                               ConfidenceHead, has_head, head_files, load_head, save_temperatures)

REPO = Path(__file__).resolve().parents[1]


def vllm_weight_files(folder: Path) -> list[str]:
    """The files vLLM's DefaultModelLoader reads for a local folder with load_format "auto"/"safetensors"."""
    return sorted(os.path.basename(f) for f in glob.glob(os.path.join(folder, "*.safetensors")))


def head(seed=0, **kw):
    torch.manual_seed(seed)
    h = ConfidenceHead(16, 40, rank=4, max_draft=3, **kw)
    with torch.no_grad():
        h.proj.weight.normal_()
    return h


def test_saved_head_stays_out_of_the_weight_files(tmp_path):
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(40, 16)}, str(tmp_path / "model.safetensors"))
    path = head().save(tmp_path)
    assert path == tmp_path / HEAD_WEIGHTS and (tmp_path / HEAD_CONFIG).is_file()
    assert vllm_weight_files(tmp_path) == ["model.safetensors"]
    loaded = load_head(tmp_path)
    assert torch.equal(loaded.proj.weight, head().proj.weight)


def test_legacy_top_level_heads_still_load_and_are_replaced_on_save(tmp_path):
    h = head(seed=1)
    h.save(tmp_path / "new")
    shutil.copy(tmp_path / "new" / HEAD_WEIGHTS, tmp_path / LEGACY_HEAD_WEIGHTS)
    shutil.copy(tmp_path / "new" / HEAD_CONFIG, tmp_path / LEGACY_HEAD_CONFIG)
    assert has_head(tmp_path) and head_files(tmp_path) == (tmp_path / LEGACY_HEAD_WEIGHTS,
                                                           tmp_path / LEGACY_HEAD_CONFIG)
    assert torch.equal(load_head(tmp_path).proj.weight, h.proj.weight)
    save_temperatures(tmp_path, [0.5, 1.5, 2.0])
    assert json.loads((tmp_path / LEGACY_HEAD_CONFIG).read_text())["temperatures"] == [0.5, 1.5, 2.0]
    with pytest.raises(DsparkError, match="--force"):
        head(seed=2).save(tmp_path, overwrite=False)
    head(seed=2).save(tmp_path)  # overwrite: new layout written, legacy files removed
    assert not (tmp_path / LEGACY_HEAD_WEIGHTS).exists() and not (tmp_path / LEGACY_HEAD_CONFIG).exists()
    assert head_files(tmp_path) == (tmp_path / HEAD_WEIGHTS, tmp_path / HEAD_CONFIG)
    assert torch.equal(load_head(tmp_path).proj.weight, head(seed=2).proj.weight)
    save_temperatures(tmp_path, [1.0, 1.0, 3.0])
    assert load_head(tmp_path).temperatures == [1.0, 1.0, 3.0]


def test_bundled_example_head_loads():
    d = REPO / "examples" / "models" / "stdlib-draft"
    if not has_head(d):
        pytest.skip("no bundled head")
    assert load_head(d).max_draft >= 1
