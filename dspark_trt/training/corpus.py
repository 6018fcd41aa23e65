"""The stdlib corpus: the running interpreter's standard library sources, split by a stable path hash."""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

from dspark_trt.errors import DsparkError

HELDOUT_PERCENT = 10


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str) -> str:
    """'heldout' for about 10% of files, chosen by a hash of the relative path (stable across runs)."""
    h = int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16)
    return "heldout" if h % 100 < HELDOUT_PERCENT else "train"


def stdlib_files(split: str = "train", root: Path | None = None) -> list[Path]:
    import os

    root = root or stdlib_root()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # site-packages holds installed third-party code, not the standard library: never descend into it
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if split == "all" or split_of(rel) == split:
                files.append(path)
    return sorted(files)


def read_texts(paths) -> list[str]:
    texts = []
    for p in paths:
        try:
            texts.append(Path(p).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return [t for t in texts if t.strip()]


def load_texts(data: str | Path) -> list[str]:
    """A directory of text/code files (recursively), one text file, or a JSONL with 'prompt'/'text' fields."""
    if str(data) in ("stdlib:train", "stdlib:heldout"):
        return read_texts(stdlib_files(str(data).split(":")[1]))
    path = Path(data)
    if path.is_dir():
        files = [p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in (".py", ".txt", ".md", ".jsonl", ".json", ".c", ".h", ".rs", ".js", ".ts", ".go", ".java", "")]
        texts = read_texts(f for f in files if f.suffix != ".jsonl")
        for f in files:
            if f.suffix == ".jsonl":
                texts.extend(_jsonl_texts(f))
        if not texts:
            raise DsparkError(f"no readable text files in {path}")
        return texts
    if path.is_file():
        return _jsonl_texts(path) if path.suffix == ".jsonl" else read_texts([path])
    raise DsparkError(f"data path {data} does not exist (give a directory of text files, a file, or a JSONL)")


def _jsonl_texts(path: Path) -> list[str]:
    texts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise DsparkError(f"{path}:{n} is not valid JSON") from None
        text = obj.get("prompt", obj.get("text")) if isinstance(obj, dict) else None
        if not isinstance(text, str):
            raise DsparkError(f"{path}:{n} has no string 'prompt' or 'text' field")
        texts.append(text)
    return texts
