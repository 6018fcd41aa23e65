"""`dspark-trt bench` options: defaults, the --quick preset, parsing of levels, modes and the output folder."""

from __future__ import annotations

import datetime as _dt
from pathlib import Path

from dspark_trt.errors import DsparkError

# The CLI's defaults (dspark_trt/cli.py `bench`): --quick replaces an option only while it has this value.
DEFAULT_CONCURRENCY = "1,2,4,8,16,32,64"
DEFAULT_MODES = "off,fixed:1,fixed:2,fixed:3,fixed:4,fixed:5,fixed:6,fixed:7,adaptive"
DEFAULT_NUM_PROMPTS = 64
DEFAULT_MAX_NEW_TOKENS = 64
QUICK = {"concurrency": "1,4,16", "modes": "off,fixed:2,fixed:4,adaptive", "num_prompts": 12, "max_new_tokens": 32}
RESULT_FILES = ("results.json", "results.md", "throughput.png", "latency.png")
WARMUP_TOKENS = 8
WAVES = 3  # each run completes at least this many requests per user
FIRST_TOKENS = 512  # the start-up window of every run (first_tokens_tok_s)
SLICE_REQUESTS = 8  # the fewest requests in a slice of a run (run_slices)


def apply_quick(concurrency, modes, num_prompts, max_new_tokens) -> tuple[str, str, int, int]:
    """The --quick preset: each of the four options still at its CLI default takes the QUICK value."""
    return (QUICK["concurrency"] if str(concurrency) == DEFAULT_CONCURRENCY else str(concurrency),
            QUICK["modes"] if str(modes) == DEFAULT_MODES else str(modes),
            QUICK["num_prompts"] if int(num_prompts) == DEFAULT_NUM_PROMPTS else int(num_prompts),
            QUICK["max_new_tokens"] if int(max_new_tokens) == DEFAULT_MAX_NEW_TOKENS else int(max_new_tokens))


def requests_per_run(num_prompts: int, concurrency: int) -> int:
    """Requests completed in one (mode, concurrency) run: every prompt once, and at least WAVES per user."""
    return max(int(num_prompts), WAVES * int(concurrency))


def run_slices(n_requests: int, concurrency: int) -> list[tuple[int, int]]:
    """A run's requests [first, end) cut into the slices the modes take turns at within a round: as many as
    leave each slice WAVES requests per user and SLICE_REQUESTS in all (one slice at 16 requests and more).

    Why: on a shared 2-core VM the same mode's speed moves 7% (rms) between blocks of 64 one-request runs
    taken one after the other, but 1.9% between two halves interleaved 8 requests at a time (lab notes,
    thirtieth session); against the best of eight baselines, whole blocks put an arm as fast as the best
    ~8% below it by luck."""
    size = max(SLICE_REQUESTS, WAVES * int(concurrency))
    k = max(1, int(n_requests) // size)
    cuts = [round(i * int(n_requests) / k) for i in range(k + 1)]
    return list(zip(cuts, cuts[1:]))


def mode_order(names: list, turn: int) -> list:
    """The order the modes run in at this turn (round, or slice of a round): a Williams design, whose
    2n orders (n for an even n) put every mode right after every other mode equally often, and in every
    place equally often.

    Why not a rotation: rotated by one each turn, three modes always ran in one cyclic order (adaptive
    always after fixed:3, `off` always after adaptive), so whatever a run leaves the next one (learned
    tables, the graph in memory, a queue's tail) fell on one mode only. An 8-round open loop's ratios
    seemed to follow the order; 12 balanced rounds showed no such pattern, but only a balanced design
    can tell (lab notes, thirty-fourth and thirty-fifth sessions)."""
    n = len(names)
    if not n:
        return []
    base, lo, hi = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...
    while len(base) < n:
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    orders = [[(b + i) % n for b in base] for i in range(n)]
    if n % 2:
        orders += [o[::-1] for o in orders]
    return [names[i] for i in orders[turn % len(orders)]]


def parse_concurrency(value) -> list[int]:
    """'1,2,4' -> [1, 2, 4] (sorted, duplicates dropped); a bad value is a DsparkError."""
    items = [s.strip() for s in str(value).split(",")] if not isinstance(value, (list, tuple)) else list(value)
    out = []
    for s in items:
        try:
            c = int(s)
        except (TypeError, ValueError):
            c = 0
        if c < 1 or str(s).strip() != str(c):
            raise DsparkError(f"--concurrency {value!r}: {s!r} is not a positive integer "
                              f"(give comma-separated levels, e.g. 1,4,16)")
        out.append(c)
    return sorted(set(out))


def parse_modes(value, max_draft: int | None = None, limit: str | None = None) -> list[str]:
    """'off,fixed:2,adaptive' -> canonical mode names in the given order, duplicates dropped (fixed:0 is off).
    With ``max_draft``, fixed:K above it is a DsparkError naming the re-export."""
    from dspark_trt.runtime.config import parse_spec

    items = [s.strip() for s in str(value).split(",")] if not isinstance(value, (list, tuple)) else list(value)
    out: list[str] = []
    for s in items:
        try:
            mode = str(parse_spec(s, max_draft, limit))
        except DsparkError as e:
            raise DsparkError(f"--modes {value!r}: {e}") from None
        if mode not in out:
            out.append(mode)
    if not out:
        raise DsparkError(f"--modes {value!r} names no mode (use off, fixed:K, adaptive)")
    return out


def resolve_out_dir(out_dir, force: bool = False) -> tuple[Path, str | None]:
    """Where to write: ``out_dir`` unless it already holds results (then a new timestamped subdirectory,
    unless ``force``). Returns (directory, note for the console or None). Creates nothing."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise DsparkError(f"--out {out} is a file, not a directory; give a directory")
    existing = [f for f in RESULT_FILES if (out / f).exists()]
    if not existing or force:
        return out, (f"overwriting results in {out} (force)" if existing else None)
    stamp = _dt.datetime.now().strftime("run-%Y%m%d-%H%M%S")
    sub, n = out / stamp, 2
    while sub.exists():
        sub, n = out / f"{stamp}-{n}", n + 1
    return sub, f"{out} already holds results ({', '.join(existing)}): writing into {sub} instead"



# ------------------------------------------------------------------------------------------- open loop

# --quick with --rates/--via-http: two rates (one below the measured capacity, one overloading it), short
# requests, 6 s of arrivals per (rate, mode) but at most 100 requests (an overloaded run lasts until its
# backlog drains, so a cap on requests bounds it): the whole run in under 2 minutes on the tiny pair.
OPEN_QUICK = {"rates": "0.5x,2x", "duration": 6.0, "num_prompts": 100, "workload": "short", "modes": QUICK["modes"]}
AUTO_RATES = "0.25x,0.5x,0.75x,1x,1.5x,2x"
DEFAULT_WORKLOAD = "mixed"
DEFAULT_SLO_TTFT_MS = 1000.0
DEFAULT_SLO_TPOT_MS = 50.0


def parse_rates(value, quick: bool = False) -> list[tuple[float, bool]]:
    """'1,2.5' -> [(1.0, False), (2.5, False)] (requests/s); '0.5x,2x' -> [(0.5, True), (2.0, True)]
    (multiples of the measured capacity); 'auto' -> the quick pair or AUTO_RATES. Sorted, duplicates
    dropped; a bad value is a DsparkError."""
    text = str(value).strip().lower()
    if text == "auto":
        text = OPEN_QUICK["rates"] if quick else AUTO_RATES
    out = []
    for s in text.split(","):
        s = s.strip()
        rel = s.endswith("x")
        try:
            r = float(s[:-1] if rel else s)
        except ValueError:
            r = 0.0
        if not (r > 0 and r < float("inf")):
            raise DsparkError(f"--rates {value!r}: {s!r} is not a positive rate (requests/s, or a multiple of "
                              f"the measured capacity such as 0.5x; e.g. 1,2,4 or 0.5x,2x or auto)")
        out.append((r, rel))
    return sorted(set(out), key=lambda x: (x[1], x[0]))


def parse_capacity(value) -> tuple[float, str] | None:
    """--capacity: requests/s ('14.1'), or an earlier open-loop results.json (its measured capacity), so that
    relative rates mean the same in runs on different days. (capacity req/s, where it came from); None
    when not given; a bad value is a DsparkError."""
    if value is None:
        return None
    import json
    from pathlib import Path

    text = str(value).strip()
    try:
        cap = float(text)
    except ValueError:
        path = Path(text)
        if path.is_dir():
            path = path / "results.json"
        if not path.is_file():
            raise DsparkError(f"--capacity {value!r}: give requests/s (e.g. 14.1) or an open-loop results.json "
                              "(or its folder)") from None
        try:
            cap = float(json.loads(path.read_text())["capacity"]["req_s"])
        except (ValueError, KeyError, TypeError):
            raise DsparkError(f"--capacity {value!r}: {path} holds no measured capacity (capacity.req_s of an "
                              "open-loop `dspark-trt bench --rates` run)") from None
        source = str(path)
    else:
        source = "--capacity"
    if not (cap > 0 and cap < float("inf")):
        raise DsparkError(f"--capacity {value!r}: the capacity must be a positive number of requests/s")
    return cap, source
