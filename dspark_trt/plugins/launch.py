"""Launch geometry for the dspark Triton kernels: plain functions, no torch/triton imports.

The JIT launchers (kernels.py), the AOT TensorRT plugins (tensorrt_plugins.py) and the tests all take
grids and block sizes from here. One program per request row (Survival) or per request (accept ops);
the vocabulary is walked in BLOCK_V chunks so any V works, and request offsets are summed in BLOCK_R
chunks so any R works.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_BLOCK_V = 4096
MIN_BLOCK = 16
MAX_BLOCK_J = 64
BLOCK_R = 256


def next_power_of_2(n: int) -> int:
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def clamp_block(n: int, lo: int, hi: int) -> int:
    """next_power_of_2(n) clamped to [lo, hi] (lo, hi powers of two)."""
    return max(lo, min(hi, next_power_of_2(n)))


@dataclass(frozen=True)
class Launch:
    grid: tuple[int, int, int]
    num_warps: int
    constexprs: dict

    @property
    def threads(self) -> int:
        return 32 * self.num_warps


def survival_launch(rows: int, cols: int) -> Launch:
    """Survival: one program per row of [R, J]; J walked in BLOCK_J chunks (J is small: <= Kmax)."""
    block_j = clamp_block(cols, MIN_BLOCK, MAX_BLOCK_J)
    return Launch(grid=(max(int(rows), 0), 1, 1), num_warps=1, constexprs={"BLOCK_J": block_j})


def accept_block_v(vocab: int) -> int:
    return clamp_block(vocab, MIN_BLOCK, MAX_BLOCK_V)


def accept_num_warps(block_v: int) -> int:
    return 8 if block_v >= 4096 else 4 if block_v >= 1024 else 2 if block_v >= 256 else 1


def accept_launch(requests: int, vocab: int) -> Launch:
    """GreedyAccept / SampleAccept: one program per request; V walked in BLOCK_V chunks."""
    block_v = accept_block_v(vocab)
    return Launch(grid=(max(int(requests), 0), 1, 1), num_warps=accept_num_warps(block_v),
                  constexprs={"BLOCK_V": block_v, "BLOCK_R": BLOCK_R})


def aot_survival_launch() -> Launch:
    """AOT (TensorRT) variant: sizes fixed at build time (J is walked in chunks, so any J works); the
    grid is the dynamic R, set symbolically by the plugin."""
    return survival_launch(0, 1)


def aot_accept_launch(vocab: int | None) -> Launch:
    """AOT (TensorRT) variant: block sizes from the vocabulary when it is static in the engine (it is
    for real models), else the largest block; V itself is a runtime argument, so any V is correct. The
    grid is the dynamic R, set symbolically by the plugin."""
    return accept_launch(0, MAX_BLOCK_V if vocab is None else vocab)


MARKOV_TILE = 16384  # elements of one [BLOCK_V, BLOCK_K] markov_w2 tile held in registers
MAX_BLOCK_K = 256


def markov_launch(requests: int, vocab: int, rank: int) -> Launch:
    """MarkovDraft: one program per request walks its N positions in order; the draft vocabulary is
    walked in BLOCK_V chunks of markov_w2 rows, the rank K in one BLOCK_K vector (K <= MAX_BLOCK_K)."""
    block_k = clamp_block(rank, MIN_BLOCK, MAX_BLOCK_K)
    block_v = clamp_block(vocab, MIN_BLOCK, max(MIN_BLOCK, MARKOV_TILE // block_k))
    num_warps = 4 if block_v * block_k >= 4096 else 2 if block_v * block_k >= 1024 else 1
    return Launch(grid=(max(int(requests), 0), 1, 1), num_warps=num_warps,
                  constexprs={"BLOCK_V": block_v, "BLOCK_K": block_k})
