"""Mapping the host KV caches' pages before decoding first writes them.

The caches are allocated zeroed and lazily (np.zeros): a page is mapped the first time something writes
to it. Position-major, every new position of a request writes a page of its own in each of the 2L
tensors, so until the cache has been used once, decoding pays a page fault for every layer's key and
value at every step. On a VM those faults are dear (measured here: 20-190 us each, the hypervisor backing
the page too): at 16 requests 13% of a first closed-loop run went to them (194 ms of KV writes against 22
in the run after), at one request 7%.

So the runtime maps the pages in a background thread at load (Linux's MADV_POPULATE_WRITE, which faults
pages in writable without touching their contents, so the worker may write the cache at the same time),
at the lowest priority, a chunk at a time. Elsewhere (no such madvise) nothing changes: pages are mapped
on first use, as before.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading

__all__ = ["prefault", "prefault_in_background"]

MADV_POPULATE_WRITE = 23  # Linux >= 5.14
CHUNK_BYTES = 1 << 20  # per madvise call: a few ms of faults, so the worker's threads get the cores back soon

_madvise = None


def _libc_madvise():
    global _madvise
    if _madvise is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        _madvise = libc.madvise
    return _madvise


def prefault(buffers, stop: threading.Event | None = None) -> bool:
    """Map every whole page of each numpy array in `buffers` without changing its contents. Returns
    False where the platform cannot (not Linux, or a kernel without MADV_POPULATE_WRITE); stop: set to
    end early (the runtime closing)."""
    if not sys.platform.startswith("linux"):
        return False
    madvise, page = _libc_madvise(), mmap.PAGESIZE
    for buf in buffers:
        start = -(-buf.ctypes.data // page) * page  # the whole pages inside the array
        end = (buf.ctypes.data + buf.nbytes) // page * page
        for lo in range(start, end, CHUNK_BYTES):
            if stop is not None and stop.is_set():
                return True
            if madvise(lo, min(CHUNK_BYTES, end - lo), MADV_POPULATE_WRITE) != 0:
                return False  # EINVAL: an older kernel; the pages still map on first use
    return True


def prefault_in_background(buffers) -> tuple[threading.Thread, threading.Event] | None:
    """prefault(buffers) in a daemon thread at the lowest priority; (thread, stop event), or None when
    there is nothing to do."""
    buffers = [b for b in buffers if b.nbytes >= mmap.PAGESIZE]
    if not buffers or not sys.platform.startswith("linux"):
        return None
    stop = threading.Event()

    def run():
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only, on Linux
        except (OSError, AttributeError):
            pass
        prefault(buffers, stop)

    thread = threading.Thread(target=run, name="dspark-kv-prefault", daemon=True)
    thread.start()
    return thread, stop
