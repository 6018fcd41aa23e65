"""`bench --start-profile FILE`: every run starts cold from a given cost profile.

Issue 22's question is how fast adaptive recovers from a profile that is wrong (measured on a busy machine,
draft costs too high, a flat verify curve). In an ordinary bench every mode shares one runtime, so the tables
adaptive starts a round with were already taught by the modes before it. Here each (mode, round) run gets a
runtime of its own on the same warmed-up engines, with FILE as its profile and nothing learned: what a server
started with that profile meets. The artifact's own profile is neither read nor written. (A DSpark drafter's
sessions belong to its runtime, so with one they are made again, cold, for every run.)

FILE must have been measured for this artifact's engines (the profile's ``meta.artifact``); its backend and
thread regime may differ: a profile recorded with sleeping threads and used by spinning ones is one of the
wrong starts worth measuring.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from dspark_trt.errors import DsparkError


def check_start_profile(path, manifest) -> Path:
    """FILE as a path, after loading it once: a one-line DsparkError if it is missing, malformed or measured
    for other engines."""
    from dspark_trt.runtime.costs.profiling import profile_meta
    from dspark_trt.runtime.costs.table import CostTable

    path = Path(path)
    if not path.is_file():
        raise DsparkError(f"--start-profile {path}: no such file (a cost_profile*.json written by "
                          f"`dspark-trt profile --out FILE`)")
    expect = {"artifact": profile_meta(manifest, "")["artifact"]}
    try:
        CostTable.load(path, expect=expect)
    except DsparkError as e:
        raise DsparkError(f"--start-profile: {e}") from None
    return path


def runtime_from(artifact_dir, backend: str, path: Path):
    """The bench's first runtime: the artifact's engines with the profile at `path`, warmed up by the bench;
    what it learns is dropped (every run gets a :func:`cold_runtime` on its engines)."""
    from dspark_trt.runtime.runtime import Runtime

    return _starting_from(Runtime.load(artifact_dir, backend=backend, profile="none"), path)


def cold_runtime(warm, path: Path, tuning=None):
    """A runtime on `warm`'s engines (their sessions warmed up: a new session's first calls pay allocations
    that would hit the window measured) with the profile at `path`, and nothing learned: fresh tables, step
    overheads, exploration credit, survival statistics. tuning: a RuntimeTuning (default: `warm`'s)."""
    from dspark_trt.runtime.runtime import Runtime

    share = getattr(warm.backend, "for_another_runtime", None)  # where the backend binds its runtime's caches
    backend = share() if share is not None else warm.backend
    rt = Runtime(warm.artifact_dir, warm.manifest, backend, warm.tokenizer, tuning=tuning or warm.tuning)
    rt.profile_name = warm.profile_name
    rt.prefault_caches()
    rt.wait_prefaulted()  # fresh caches: their page faults are not what a start profile is tested for
    return _starting_from(rt, path)


@contextmanager
def cold_run(warm, path: Path):
    """A :func:`cold_runtime` for one run, closed after it."""
    rt = cold_runtime(warm, path)
    try:
        yield rt
    finally:
        rt.close()


def _starting_from(rt, path: Path):
    """rt with the profile at `path`; it never saves what it learns over the artifact's profile."""
    from dspark_trt.runtime.costs.table import CostTable

    rt.persist_profile = False
    rt.cost = CostTable.load(path).tune(rt.tuning.drift)
    return rt
