"""Loading an artifact verifies it: every file the manifest lists must match its recorded sha256.

A graph that changed after export (a partial copy, a flipped block on disk, a hand edit) otherwise loads
and prints garbage. Hashing a 10 GB graph on every start is too slow, so a verified file is remembered by
its stat stamp (size, mtime, ctime, inode) in a small JSON file under the user's cache directory
(`$XDG_CACHE_HOME/dspark-trt/verified/`, default `~/.cache/...`), one per artifact directory: a file whose
stamp is unchanged is not hashed again; a touched file is hashed once more. The cache never lives in the
artifact directory, so a read-only artifact loads (and is verified) all the same; when the cache directory
itself cannot be written, every load hashes.

Standard library only (the runtime imports without torch).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from dspark_trt.errors import DsparkError
from dspark_trt.manifest import sha256_file, write_atomic

CACHE_VERSION = 1


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "dspark-trt" / "verified"


def cache_path(artifact_dir) -> Path:
    """The cache file of one artifact directory (keyed by its resolved path)."""
    key = hashlib.sha256(str(Path(artifact_dir).resolve()).encode()).hexdigest()[:32]
    return cache_dir() / f"{key}.json"


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _read_cache(path: Path, artifact: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or data.get("artifact") != artifact:
        return {}
    files = data.get("files")
    return files if isinstance(files, dict) else {}


def _changed(path: Path, what: str) -> DsparkError:
    return DsparkError(f"{path} {what}: the file changed after export, so the artifact would run a model other "
                       f"than the one exported; re-export it with `dspark-trt export ... --force` (or restore "
                       f"the original file)")


def verify_artifact(artifact_dir, manifest: dict) -> list[str]:
    """Check every file in manifest['files'] against its sha256 (cached by stat stamp); raise DsparkError
    naming the first file that is missing or changed. Returns the names that had to be hashed."""
    base = Path(artifact_dir).resolve()
    files = manifest.get("files") or {}
    where = cache_path(base)
    cached = _read_cache(where, str(base))
    verified: dict[str, dict] = {}
    hashed: list[str] = []
    for name, entry in sorted(files.items()):
        if not isinstance(entry, dict):
            continue  # Manifest.validate reports it
        path = base / name
        try:
            st = path.stat()
        except OSError:
            raise DsparkError(f"{path} is listed in manifest.json but missing: re-export the artifact with "
                              f"`dspark-trt export`") from None
        if isinstance(entry.get("bytes"), int) and st.st_size != entry["bytes"]:
            raise _changed(path, f"has {st.st_size} bytes, manifest.json records {entry['bytes']}")
        stamp = _stamp(st)  # taken before hashing: a write during hashing changes it, so it is hashed again
        hit = cached.get(name)
        if isinstance(hit, dict) and hit.get("stamp") == stamp and isinstance(hit.get("sha256"), str):
            digest = hit["sha256"]
        else:
            try:
                digest = sha256_file(path)
            except OSError as e:
                raise DsparkError(f"cannot read {path}: {e.strerror or e}") from None
            hashed.append(name)
        if digest != entry.get("sha256"):
            raise _changed(path, "does not match the sha256 recorded in manifest.json")
        verified[name] = {"stamp": stamp, "sha256": digest}
    if hashed:
        record = {"version": CACHE_VERSION, "artifact": str(base), "files": verified}
        try:
            write_atomic(where, (json.dumps(record, indent=1) + "\n").encode())
        except OSError:
            pass  # no writable cache directory: the next load hashes again
    return hashed
