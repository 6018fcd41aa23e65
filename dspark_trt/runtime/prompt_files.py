"""Reading user prompt files (text lines or JSONL), shared by `generate` and `bench`."""

from __future__ import annotations

import json
from pathlib import Path

from dspark_trt.errors import DsparkError


def read_prompt_file(path) -> list[tuple[str, str]]:
    """[(text, source)] from a JSONL file with a "prompt" field per line, or a text file with one prompt per
    non-empty line (a line may be a JSON string literal, for prompts with newlines)."""
    p = Path(path)
    if not p.is_file():
        raise DsparkError(f"prompts file {path} does not exist (give text lines or JSONL with \"prompt\")")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DsparkError(f"prompts file {path} is unreadable ({e})") from None
    first = next((ln.strip() for ln in lines if ln.strip()), "")
    jsonl = p.suffix == ".jsonl" or first.startswith("{")
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if jsonl:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                raise DsparkError(f"{path}:{n} is not valid JSON (a .jsonl prompts file needs one "
                                  f"{{\"prompt\": ...}} object per line)") from None
            text = obj.get("prompt") if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise DsparkError(f"{path}:{n} has no string \"prompt\" field")
        else:
            text = line
            if line.startswith('"') and line.endswith('"') and len(line) >= 2:
                try:
                    text = json.loads(line)
                except json.JSONDecodeError:
                    text = line
        if text:
            out.append((text, f"{p.name}:{n}"))
    if not out:
        raise DsparkError(f"prompts file {path} has no prompts")
    return out
