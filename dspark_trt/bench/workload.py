"""Open-loop workloads: requests with varied prompts, output lengths, text kinds and temperatures.

A workload names three distributions (see docs/open-loop.md):
- prompt length: log-uniform integers in [lo, hi] tokens, cut from held-out stdlib files at varied points:
  the prompt is the ``n`` tokens that *precede* a cut, and the cut sits inside a stretch of one text kind,
  so the continuation the models are asked for is of that kind;
- output length (``max_tokens``): log-uniform integers in [lo, hi] (many short answers, a long tail);
- text kind, by weight: ``code`` (a code line follows a code line), ``prose`` (inside a docstring or a
  comment block), ``data`` (inside a run of literal-only lines: codec tables, lists of constants: very
  repetitive, the most predictable).

Named workloads: ``mixed`` (prompts 16-256, outputs 16-512, code 0.5 / prose 0.3 / data 0.2), ``short``
(prompts 16-96, outputs 16-128, same mix: the --quick default). ``NAME:prompt=LO-HI,out=LO-HI`` overrides
the ranges, e.g. ``short:out=4-8``. The temperature of each request is drawn from ``--temperature``: one
value or a mix ``T:weight,...`` (``0:0.5,1.0:0.5``). Everything is drawn from the seed, so every mode of
a round sees exactly the same requests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from dspark_trt.errors import DsparkError

KINDS = ("code", "prose", "data")
_DATA = re.compile(r"""^\s*(['"\[\({]|-?\d|0x)""")


@dataclass(frozen=True)
class Workload:
    name: str
    prompt: tuple[int, int]
    out: tuple[int, int]
    kinds: dict = field(default_factory=lambda: {"code": 0.5, "prose": 0.3, "data": 0.2})

    def describe(self) -> str:
        mix = ", ".join(f"{k} {w:g}" for k, w in self.kinds.items())
        return (f"{self.name}: prompts {self.prompt[0]}-{self.prompt[1]} tokens, outputs {self.out[0]}-{self.out[1]} "
                f"tokens (both log-uniform), kinds {mix}")


WORKLOADS = {"mixed": Workload("mixed", (16, 256), (16, 512)), "short": Workload("short", (16, 96), (16, 128))}


@dataclass
class WorkItem:
    """One request of a workload."""

    ids: list[int]
    kind: str
    source: str
    max_tokens: int
    temperature: float
    seed: int

    def to_dict(self) -> dict:
        return {"kind": self.kind, "source": self.source, "prompt_tokens": len(self.ids),
                "max_tokens": self.max_tokens, "temperature": self.temperature}


def _range(spec: str, key: str, value: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", value.strip())
    lo, hi = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, 0)
    if not m or lo < 1 or hi < lo:
        raise DsparkError(f"--workload {spec!r}: {key}={value!r} is not a range LO-HI of positive integers")
    return lo, hi


def parse_workload(spec: str) -> Workload:
    """'mixed' | 'short' | 'NAME:prompt=LO-HI,out=LO-HI' -> a Workload (a bad spec is a DsparkError)."""
    name, _, rest = str(spec).strip().partition(":")
    if name not in WORKLOADS:
        raise DsparkError(f"--workload {spec!r}: unknown workload {name!r} (use {', '.join(WORKLOADS)}, "
                          f"optionally with :prompt=LO-HI,out=LO-HI)")
    w = WORKLOADS[name]
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq or key.strip() not in ("prompt", "out"):
            raise DsparkError(f"--workload {spec!r}: {part!r} is not prompt=LO-HI or out=LO-HI")
        w = replace(w, **{key.strip(): _range(spec, key.strip(), value)})
    return replace(w, name=str(spec).strip())


def parse_temperature(value) -> list[tuple[float, float]]:
    """'0.7' -> [(0.7, 1.0)]; '0:0.5,1.0:0.5' -> [(0.0, 0.5), (1.0, 0.5)] (weights normalised to sum 1)."""
    out = []
    for part in str(value).split(","):
        t, colon, w = part.strip().partition(":")
        try:
            temp, weight = float(t), float(w) if colon else 1.0
        except ValueError:
            temp = weight = -1.0
        if not (temp >= 0 and weight > 0):
            raise DsparkError(f"--temperature {value!r}: {part.strip()!r} is not T or T:WEIGHT "
                              f"(T >= 0, weight > 0), e.g. 0.7 or 0:0.5,1.0:0.5")
        out.append((temp, weight))
    total = sum(w for _, w in out)
    return [(t, w / total) for t, w in out]


def log_uniform(rng, lo: int, hi: int, size: int) -> np.ndarray:
    """Integers in [lo, hi] with log(n) uniform: as many 16-32 token answers as 256-512 token ones."""
    x = np.exp(rng.uniform(np.log(lo), np.log(hi + 1), size))
    return np.clip(np.floor(x).astype(np.int64), lo, hi)


# ----------------------------------------------------------------------------------------------- cutting

def classify_lines(text: str) -> list[tuple[int, str]]:
    """(character offset, kind) of every line: 'code', 'prose' (docstring or comment), 'data'
    (literal-only line), or 'blank'."""
    out, off, in_doc = [], 0, False
    for line in text.split("\n"):
        s = line.strip()
        quotes = s.count('"""') + s.count("'''")
        if not s:
            kind = "blank"
        elif in_doc or s.startswith(("#", '"""', "'''", 'r"""')):
            kind = "prose"
        elif _DATA.match(line):
            kind = "data"
        else:
            kind = "code"
        if quotes % 2 == 1:
            in_doc = not in_doc
        out.append((off, kind))
        off += len(line) + 1
    return out


def cut_points(text: str, kind: str) -> list[int]:
    """Offsets where a line of ``kind`` starts right after another line of ``kind`` (so the text after
    the cut continues that kind)."""
    lines = classify_lines(text)
    return [o for (_, k0), (o, k1) in zip(lines, lines[1:]) if k0 == kind and k1 == kind]


class _Corpus:
    """Held-out stdlib files, read and classified on first use."""

    def __init__(self, files, rng):
        self.files = [files[i] for i in rng.permutation(len(files))]
        self.cache: dict = {}

    def cuts(self, path: Path, kind: str) -> tuple[str, list[int]]:
        if path not in self.cache:
            try:
                self.cache[path] = Path(path).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                self.cache[path] = ""
        text = self.cache[path]
        return text, cut_points(text, kind) if text else []


def _short(path: Path) -> str:
    from dspark_trt.bench.prompts import _short as short

    return short(path)


def build_requests(workload: Workload, n: int, encode, seed: int, max_context: int, temperatures,
                   files=None, file_prompts: list | None = None) -> list[WorkItem]:
    """``n`` requests of ``workload`` drawn from ``seed`` (the first k are the same for any n >= k).
    ``file_prompts``: prompt token-id lists from --prompts-file (used in order, cycling) instead of the corpus."""
    # One stream per property, so the first k requests are the same whatever n is.
    r_p, r_o, r_k, r_t, rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(5))
    plens = log_uniform(r_p, *workload.prompt, n)
    olens = log_uniform(r_o, *workload.out, n)
    kinds = list(workload.kinds)
    probs = np.array([workload.kinds[k] for k in kinds], dtype=float)
    kind_of = r_k.choice(len(kinds), size=n, p=probs / probs.sum())
    temps = [t for t, _ in temperatures]
    temp_of = r_t.choice(len(temps), size=n, p=[w for _, w in temperatures])
    corpus = None
    if file_prompts is None:
        if files is None:
            from dspark_trt.training.corpus import stdlib_files

            files = stdlib_files("heldout")
        if not files:
            raise DsparkError("the held-out stdlib split is empty; give prompts with --prompts-file")
        corpus = _Corpus(list(files), rng)
    items, start = [], 0
    for i in range(n):
        out_len = int(min(olens[i], max_context - 2))
        room = max_context - 1 - out_len
        p_len = int(max(1, min(plens[i], room)))
        if corpus is None:
            ids = list(file_prompts[i % len(file_prompts)])[-p_len:]
            kind, source = "file", f"prompt {i % len(file_prompts) + 1}"
        else:
            kind = kinds[kind_of[i]]
            ids, source, start = _cut(corpus, kind, p_len, encode, rng, start)
        items.append(WorkItem(ids, kind, source, out_len, float(temps[temp_of[i]]), int(seed) * 100_003 + i))
    return items


def _cut(corpus: _Corpus, kind: str, n: int, encode, rng, start: int) -> tuple[list[int], str, int]:
    """The ``n`` tokens before a seeded cut point of ``kind`` in the next corpus file that has one."""
    files = corpus.files
    for step in range(len(files)):
        path = files[(start + step) % len(files)]
        text, cuts = corpus.cuts(path, kind)
        if not cuts:
            continue
        for _ in range(4):  # a cut near the top of a file may not have n tokens before it
            off = cuts[int(rng.integers(0, len(cuts)))]
            ids = encode(text[max(0, off - 16 * n - 64):off])[-n:]
            if len(ids) == n:
                line = text.count("\n", 0, off) + 1
                return ids, f"{_short(path)}:{line}", (start + step + 1) % len(files)
    raise DsparkError(f"no held-out stdlib file gives a {n}-token prompt before {kind} text; "
                      f"give prompts with --prompts-file or a shorter --workload prompt range")
