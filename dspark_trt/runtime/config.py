"""Per-request generation settings."""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass, field

from dspark_trt.errors import DsparkError


@dataclass(frozen=True)
class SpecMode:
    kind: str  # "off" | "fixed" | "adaptive"
    k: int = 0  # draft length for "fixed"

    def __str__(self) -> str:
        return f"fixed:{self.k}" if self.kind == "fixed" else self.kind


def spec_syntax(spec: str) -> SpecMode:
    """``"off"`` | ``"fixed:K"`` (K >= 0) | ``"adaptive"``, case and surrounding spaces ignored. The one
    parser of the syntax; `parse_spec` adds the artifact's limits."""
    s = str(spec).strip().lower()
    if s in ("off", "adaptive"):
        return SpecMode(s)
    if re.fullmatch(r"fixed:[0-9]+", s):  # ASCII digits only: "²".isdigit() is True, int("²") fails
        return SpecMode("fixed", int(s[6:]))
    raise DsparkError(f"spec {spec!r} is not one of off, fixed:K, adaptive")


def fixed_k_limit(drafter_kind: str, max_draft: int) -> str | None:
    """What bounds fixed:K for this drafter, for the refusal of a larger K (None: the default text)."""
    if drafter_kind == "dspark":
        return f"the DSpark drafter's block size {max_draft} (it drafts that many tokens per pass)"
    return None


def parse_spec(spec: str | SpecMode, max_draft: int | None = None, limit: str | None = None) -> SpecMode:
    """limit: what bounds K, for the refusal (default: the artifact's max draft length)."""
    mode = spec if isinstance(spec, SpecMode) else spec_syntax(spec)
    if mode.kind == "fixed":
        if mode.k == 0:
            return SpecMode("off")
        if max_draft is not None and mode.k > max_draft:
            limit = limit or f"the artifact's max draft length {max_draft}; re-export with --max-draft {mode.k}"
            raise DsparkError(f"spec fixed:{mode.k} exceeds {limit}")
    return mode


@dataclass
class GenerationConfig:
    max_new_tokens: int = 64
    temperature: float = 0.0
    spec: str = "adaptive"  # "off" | "fixed:K" | "adaptive"
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    stop_at_eos: bool = True

    def validate(self, max_draft: int | None = None, limit: str | None = None) -> SpecMode:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise DsparkError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise DsparkError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.seed is not None and (not isinstance(self.seed, numbers.Integral) or isinstance(self.seed, bool) or self.seed < 0):
            raise DsparkError(f"seed must be an integer >= 0, got {self.seed!r}")
        return parse_spec(self.spec, max_draft, limit)
