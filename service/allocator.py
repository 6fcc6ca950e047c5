"""Keep freed heap memory in the front-end's process for reuse (glibc malloc only).

A front-end allocates the same large buffers step after step: each ingest batch as gRPC
hands it over (megabytes), each rank's response, and gRPC's own copies of both. With
glibc's defaults those buffers rarely land in memory the process already touched: chunks
above the (dynamic) mmap threshold are mapped and unmapped per allocation, and a heap
whose free top grows past the trim threshold (twice the mmap threshold, ~10 MiB for 5 MiB
responses) is handed back to the kernel. Every step's bytes are then faulted in anew, page
by page (~1.5-2 us per 4 KiB page on the 2-core dev VM: in `perf`, over a third of the
front-end's CPU in the 8k-token benchmark went to page faults).

`retain_freed_memory` serves buffers up to 32 MiB from the heap and keeps up to
`max_bytes` of freed heap for reuse. It only moves the point at which freed memory goes
back to the kernel; a busy sidecar reuses that memory within a step or two anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MAX_MMAP_THRESHOLD = 32 * 2**20
"""glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (half its per-thread heap size)."""


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library if it is glibc (it alone has gnu_get_libc_version), else None."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 (an AttributeError names a non-glibc libc)
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def retain_freed_memory(max_bytes: int) -> bool:
    """Serve allocations up to 32 MiB from the heap and hand freed heap memory back to the
    kernel only beyond `max_bytes` (process-wide; once per process is enough). True if
    applied: False without glibc, or for max_bytes <= 0 (the defaults are left alone)."""
    libc = _glibc()
    if libc is None or max_bytes <= 0:
        return False
    mmap_set = libc.mallopt(_M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD)
    trim_set = libc.mallopt(_M_TRIM_THRESHOLD, min(max_bytes, 2**31 - 1))
    return bool(mmap_set and trim_set)
