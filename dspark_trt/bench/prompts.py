"""Benchmark prompts: seeded snippets of the held-out stdlib split, or a user's file.

Prompts are token-id lists in the artifact's tokenizer, so every mode (and the transformers peers) sees
exactly the same input tokens. Default prompts: for prompt i, the next file of a seeded shuffle of the
held-out split (cycling), a seeded-random line start in it, and the first n tokens from there, n drawn
uniformly from [min_tokens, max_tokens] (capped so that prompt + max_new_tokens fits the context).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from dspark_trt.errors import DsparkError
from dspark_trt.runtime.prompt_files import read_prompt_file  # noqa: F401 (re-exported)

MIN_TOKENS = 20
MAX_TOKENS = 60


@dataclass
class Prompt:
    ids: list[int]
    text: str
    source: str  # "path:line" for corpus snippets, "file:line" for a user file

    def to_dict(self) -> dict:
        return {"source": self.source, "tokens": len(self.ids), "text": self.text}


def prompt_budget(max_context: int, max_new_tokens: int, max_tokens: int = MAX_TOKENS) -> int:
    """Longest prompt that leaves room for max_new_tokens in max_context."""
    room = int(max_context) - int(max_new_tokens)
    if room < 1:
        raise DsparkError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the artifact's max "
                          f"context {max_context}; use --max-new-tokens {max(1, max_context // 2)} or re-export "
                          f"with a larger --max-context")
    return min(int(max_tokens), room)


def corpus_prompts(encode: Callable[[str], list[int]], decode: Callable[[list[int]], str], num: int, seed: int,
                   max_len: int, min_len: int = MIN_TOKENS, files: list[Path] | None = None) -> list[Prompt]:
    """``num`` seeded snippets of the held-out stdlib split (or of ``files``)."""
    if files is None:
        from dspark_trt.training.corpus import stdlib_files

        files = stdlib_files("heldout")
    files = list(files)
    if not files:
        raise DsparkError("the held-out stdlib split is empty; give prompts with --prompts-file")
    min_len = max(1, min(int(min_len), int(max_len)))
    rng = np.random.default_rng(seed)
    order = [files[i] for i in rng.permutation(len(files))]
    cache: dict[Path, tuple[str, list[tuple[int, int]]] | None] = {}
    prompts: list[Prompt] = []
    misses = 0
    i = 0
    while len(prompts) < num:
        path = order[i % len(order)]
        i += 1
        if path not in cache:
            cache[path] = _load(path)
        n = int(rng.integers(min_len, max_len + 1))
        snippet = _snippet(*cache[path], rng, n, encode) if cache[path] else None
        if snippet is None:
            misses += 1
            if misses > 20 * num + len(order):
                raise DsparkError("could not cut enough prompts from the held-out stdlib split; "
                                  "give prompts with --prompts-file")
            continue
        ids, line = snippet
        prompts.append(Prompt(ids, decode(ids), f"{_short(path)}:{line}"))
    return prompts


def _load(path: Path) -> tuple[str, list[tuple[int, int]]] | None:
    """(text, [(line number, offset) of each non-blank line]) or None for an unreadable/empty file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    lines, off = [], 0
    for k, line in enumerate(text.split("\n"), 1):
        if line.strip():
            lines.append((k, off))
        off += len(line) + 1
    return (text, lines) if lines else None


def _snippet(text: str, lines: list[tuple[int, int]], rng, n: int, encode) -> tuple[list[int], int] | None:
    """n tokens from a seeded-random non-blank line start; None when the file does not give n tokens."""
    for _ in range(4):  # a start near the end of the file may not leave n tokens: try a few
        k, s = lines[int(rng.integers(0, len(lines)))]
        ids = encode(text[s:s + 16 * n + 64])[:n]
        if len(ids) == n:
            return ids, k
    return None


def _short(path: Path) -> str:
    try:
        from dspark_trt.training.corpus import stdlib_root

        return Path(path).relative_to(stdlib_root()).as_posix()
    except (ValueError, ImportError):
        return Path(path).name


def file_prompts(path, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str], num: int,
                 max_len: int) -> tuple[list[Prompt], int]:
    """The first ``num`` prompts of a user file (file order); prompts longer than ``max_len`` tokens keep
    their last ``max_len`` tokens. Returns (prompts, number truncated)."""
    prompts, truncated = [], 0
    for text, source in read_prompt_file(path)[:num]:
        ids = encode(text)
        if not ids:
            continue
        if len(ids) > max_len:
            ids, truncated = ids[-max_len:], truncated + 1
            text = decode(ids)
        prompts.append(Prompt(ids, text, source))
    if not prompts:
        raise DsparkError(f"prompts file {path} has no prompts that tokenize to at least one token")
    return prompts, truncated
