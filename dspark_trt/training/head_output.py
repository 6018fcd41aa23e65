"""Where `train-head` and `calibrate` write: always a new head directory, never one of their inputs.

The head (confidence_head.safetensors + confidence_head.json) is written into a hidden staging directory
beside `--out` and moved into place when complete, so a failed or killed run leaves the previous head (and
every input) as it was. An existing `--out` is replaced only with `--force`, and only when it holds nothing
but a head: `--out` pointing at a model directory is refused even with `--force`.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

from dspark_trt.errors import DsparkError
from dspark_trt.models.confidence_head import (HEAD_CONFIG, HEAD_SUBDIR, HEAD_WEIGHTS, LEGACY_HEAD_CONFIG,
                                               LEGACY_HEAD_WEIGHTS, head_files)
from dspark_trt.outputs import Staging, check_out_dir, replace_dir

HEAD_ENTRIES = (HEAD_SUBDIR, LEGACY_HEAD_WEIGHTS, LEGACY_HEAD_CONFIG)  # what a head directory may hold
STAGING_PREFIX = ".head-"


def check_head_out(out_dir, overwrite: bool, inputs: dict, command: str) -> Path:
    """Before any work: `out_dir` can be written, is none of `inputs` ({option: dir}), and is new or (with
    overwrite) a head directory. Returns its absolute path."""
    if out_dir is None:
        raise DsparkError(f"{command} writes the head to a new directory and never modifies its inputs: pass "
                          f"--out DIR (then export with --head DIR)")
    out = check_out_dir(out_dir, "--out")
    for option, d in inputs.items():
        if d is not None and Path(d).exists() and out.resolve() == Path(d).resolve():
            raise DsparkError(f"--out {out_dir} is the {option} directory: {command} never modifies its inputs; "
                              f"write the head to a new directory")
    if out.is_dir() and any(out.iterdir()):
        others = sorted(p.name for p in out.iterdir() if p.name not in HEAD_ENTRIES)
        if others:
            more = ", ..." if len(others) > 3 else ""
            raise DsparkError(f"--out {out_dir} holds files that are not a confidence head ({', '.join(others[:3])}"
                              f"{more}): give a new directory")
        if not overwrite:
            raise DsparkError(f"--out {out_dir} already holds a head; pass --force to replace it")
    return out


def write_head_dir(out: Path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` fills a staging directory, which then replaces `out` (atomically for readers)."""
    out = Path(out)
    with Staging(out.parent, STAGING_PREFIX) as tmp:
        write(tmp)
        replace_dir(tmp, out)
    return out


def copy_head(src, dst) -> None:
    """Copy the head in `src` (either layout) into `dst` in the current layout."""
    files = head_files(src)
    if files is None:
        raise DsparkError(f"no confidence head in {src}")
    (Path(dst) / HEAD_WEIGHTS).parent.mkdir(parents=True, exist_ok=True)
    for f, name in zip(files, (HEAD_WEIGHTS, HEAD_CONFIG)):
        shutil.copyfile(f, Path(dst) / name)
