"""Let a process reuse the memory it frees for the next step's buffers (glibc malloc only).

The sidecar's front-end and a trainer rank allocate the same large buffers step after
step: ingest batches and responses as gRPC hands them over (megabytes), gRPC's own copies
of them, each rank's response as it is joined. With glibc's defaults those buffers rarely
land in memory the process already touched: chunks above the (dynamic) mmap threshold are
mapped and unmapped per allocation, and once the free top of a heap grows past the trim
threshold (twice the mmap threshold: ~10 MiB for 5 MiB responses) the heap is cut back to
a small pad. Every step's bytes are then faulted in anew, page by page (~1.5-2 us per
4 KiB page on the 2-core dev VM: in the 8k-token benchmark the front-end took 20-46k page
faults in 0.5 s and each rank 2-28k).

`retain_freed_memory` serves allocations up to 32 MiB from the heap from the start (the
value glibc's dynamic threshold grows to; setting it turns the growth off) and trims a
heap only once more than `max_bytes` is free at its top. Free chunks below the top were
never returned to the kernel anyway, so the resident size can stay at its peak: for a
process whose steps come and go at the same sizes, that peak is its working set.

A thread's heap other than the main one is at most 64 MiB and is unmapped whole once it
is free, whatever the trim threshold; a front-end, whose threads allocate many such
buffers at once, therefore also asks for one heap shared by all its threads
(`single_arena`). glibc fixes the number of heaps when a thread first needs one, so this
takes full effect only if set before the process starts threads that allocate (what
`rlfeed serve` does); set later, it only stops new heaps being made, and new threads share
the ones already there.
"""

from __future__ import annotations

import ctypes
import functools
import os

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

MAX_MMAP_THRESHOLD = 32 * 2**20
"""glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (half its per-thread heap size)."""

MAX_RETAINED_BYTES = 2**31 - 1
"""mallopt takes a C int."""


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """This process's C library if it is glibc, else None (musl, macOS, Windows)."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        libc = ctypes.CDLL(None)  # the symbols already loaded: glibc's malloc
    except (ValueError, OSError, AttributeError):
        return None
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    return libc


def retain_freed_memory(max_bytes: int, *, single_arena: bool = False) -> bool:
    """Serve allocations up to 32 MiB from the heap and trim a heap only once more than
    `max_bytes` (at most 2 GiB - 1) is free at its top; with `single_arena`, every thread
    started from now on allocates from the main heap. Process-wide, and it stays set.
    True if glibc took the settings (also under a malloc preloaded over glibc's, which
    they do not reach); False without glibc, or for max_bytes <= 0, which leaves the
    allocator alone."""
    libc = _glibc()
    if libc is None or not _retaining(max_bytes):
        return False
    mmap_set = libc.mallopt(_M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD)
    trim_set = libc.mallopt(_M_TRIM_THRESHOLD, max_bytes)
    arena_set = libc.mallopt(_M_ARENA_MAX, 1) if single_arena else 1
    return bool(mmap_set and trim_set and arena_set)


def retained_memory_environment(max_bytes: int) -> dict[str, str]:
    """The environment variables that start a process with `retain_freed_memory(max_bytes,
    single_arena=True)`'s settings already in place: glibc reads them before the first
    allocation. For a process rlfeed does not start itself, whose threads exist before any
    rlfeed code runs (a Ray actor's worker: a front-end actor), where the call would come
    too late for the one shared heap. Empty for max_bytes <= 0 (the allocator left alone)."""
    if not _retaining(max_bytes):
        return {}
    return {
        "MALLOC_ARENA_MAX": "1",
        "MALLOC_MMAP_THRESHOLD_": str(MAX_MMAP_THRESHOLD),
        "MALLOC_TRIM_THRESHOLD_": str(max_bytes),
    }


def _retaining(max_bytes: int) -> bool:
    """Whether `max_bytes` asks to retain freed memory (> 0); ValueError past mallopt's int."""
    if max_bytes > MAX_RETAINED_BYTES:
        raise ValueError(f"max_bytes must be at most {MAX_RETAINED_BYTES}, got {max_bytes}")
    return max_bytes > 0
