"""Output directories that commands write (export's artifact, train-head's and calibrate's head).

- `check_out_dir`: before any work, one clear error when the directory cannot be written (under a regular
  file, on a read-only file system, no permission).
- `Staging`: a hidden temporary directory beside the destination (`.export-*`, `.head-*`), locked with
  flock while the command runs; it gets the user's normal umask permissions (mkdtemp's are 0700), and
  stale ones a killed command left behind (older than this one, not locked) are removed.
- `replace_dir`: move the finished directory into place (an existing one is swapped out, then removed).

Standard library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
from pathlib import Path

from dspark_trt.errors import DsparkError

LOCK_SUFFIX = ".lock"


def _reason(e: OSError) -> str:
    return e.strerror or str(e)


def _first_existing(path: Path) -> Path:
    for p in (path, *path.parents):
        if os.path.lexists(p):
            return p
    return Path("/")


def check_out_dir(out_dir, option: str = "--out") -> Path:
    """Raise DsparkError now, before any work, if `out_dir` (a directory to create or replace) cannot be
    written; creates its parent directories."""
    out = Path(out_dir).absolute()
    if out.exists() and not out.is_dir():
        raise DsparkError(f"{option} {out_dir} is a file, not a directory")
    anc = _first_existing(out.parent)
    if not anc.is_dir():
        raise DsparkError(f"{option} {out_dir} cannot be created: {anc} is a file, not a directory")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = tempfile.mkdtemp(prefix=".dspark-probe-", dir=out.parent)
        os.rmdir(probe)
    except OSError as e:
        raise DsparkError(f"{option} {out_dir} cannot be written: {_reason(e)} ({e.filename or out.parent})") from None
    return out


def normal_dir_mode() -> int:
    """The permissions `mkdir` gives a new directory under the current umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o777 & ~mask


def _locked(lock_path: Path) -> bool:
    """Whether another process holds the flock on lock_path (False when there is no lock file)."""
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing releases a lock we took
    return False


def clean_stale(parent, prefix: str, before: float) -> list[Path]:
    """Remove `prefix*` temporary directories in `parent` (and their lock files) that are older than
    `before` (a time.time()) and not locked by a running command. Returns what was removed."""
    removed = []
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return removed
    for p in entries:
        if not p.name.startswith(prefix) or p.name.endswith(LOCK_SUFFIX):
            continue
        lock = p.with_name(p.name + LOCK_SUFFIX)
        try:
            if p.is_symlink() or not p.is_dir() or p.lstat().st_mtime >= before or _locked(lock):
                continue
        except OSError:
            continue
        shutil.rmtree(p, ignore_errors=True)
        with contextlib.suppress(OSError):
            lock.unlink()
        removed.append(p)
    for lock in entries:  # lock files whose directory is gone
        if lock.name.startswith(prefix) and lock.name.endswith(LOCK_SUFFIX) and \
                not os.path.lexists(lock.with_name(lock.name[:-len(LOCK_SUFFIX)])):
            with contextlib.suppress(OSError):
                if lock.lstat().st_mtime < before and not _locked(lock):
                    lock.unlink()
    return removed


class Staging:
    """A new hidden directory `parent/prefix*` (`.path`), locked (flock on `<dir>.lock`) until `close()`,
    with normal permissions; stale siblings are cleaned first. `close()` removes it unless it was moved."""

    def __init__(self, parent, prefix: str):
        parent = Path(parent)
        start = time.time()
        self._fd, lock_name = tempfile.mkstemp(prefix=prefix, suffix=LOCK_SUFFIX, dir=parent)
        self._lock = Path(lock_name)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            self.path = self._lock.with_name(self._lock.name[:-len(LOCK_SUFFIX)])
            self.path.mkdir()
            os.chmod(self.path, normal_dir_mode())
        except BaseException:
            self._release()
            raise
        clean_stale(parent, prefix, before=start)

    def _release(self) -> None:
        with contextlib.suppress(OSError):
            self._lock.unlink()
        with contextlib.suppress(OSError):
            os.close(self._fd)

    def close(self) -> None:
        if self.path.exists():
            shutil.rmtree(self.path, ignore_errors=True)
        self._release()

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc) -> None:
        self.close()


def replace_dir(src: Path, dst: Path) -> None:
    """Move the finished `src` to `dst`; an existing `dst` is renamed aside first and removed after, so `dst`
    is never half-written (it is briefly absent)."""
    src, dst = Path(src), Path(dst)
    old = None
    if os.path.lexists(dst):
        old = src.with_name(src.name + ".old")
        os.rename(dst, old)
    try:
        os.rename(src, dst)
    except OSError:
        if old is not None:
            os.rename(old, dst)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def check_out_file(path, option: str) -> Path:
    """Raise DsparkError now, before any work, if the file `path` cannot be written; creates its parent."""
    p = Path(path).absolute()
    if p.is_dir():
        raise DsparkError(f"{option} {path} is a directory, not a file")
    anc = _first_existing(p.parent)
    if not anc.is_dir():
        raise DsparkError(f"{option} {path} cannot be created: {anc} is a file, not a directory")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".dspark-probe-", dir=p.parent)
        os.close(fd)
        os.unlink(probe)
        if p.exists():
            with open(p, "ab"):
                pass
    except OSError as e:
        raise DsparkError(f"{option} {path} cannot be written: {_reason(e)} ({e.filename or p.parent})") from None
    return p
