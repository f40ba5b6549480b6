"""Freed memory goes back to the operating system during long passes (glibc's malloc).

A corpus pass keeps small per-window results for the whole pass while every forward pass
allocates and frees large temporaries. glibc serves an allocation above its *mmap
threshold* with its own mapping, returned to the system on free, and one below from the
heap. The threshold is dynamic by default: freeing a mapped block raises it to that
block's size (up to 32 MiB on 64-bit), so after the first forward pass the temporaries
come from the heap too, between the small blocks that stay. A freed temporary then
leaves a hole that a later temporary of another size does not fit, and the heap grows
with every batch: on the 12-layer encoder at 20,000 windows, past 23 GiB.

Setting the threshold fixes it (mallopt(3): an explicit ``M_MMAP_THRESHOLD`` turns the
dynamic adjustment off): large temporaries are mapped and unmapped again, and the heap
holds only the small blocks. What is computed does not change, only where memory comes
from.
"""

from __future__ import annotations

import ctypes

from companion._validate import check_int

_M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
#: glibc's largest mmap threshold, ``DEFAULT_MMAP_THRESHOLD_MAX``: ``4 MiB * sizeof(long)``
#: (32 MiB on 64-bit), the upper limit mallopt(3) documents.
MMAP_THRESHOLD_MAX = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)
#: The threshold :func:`return_freed_memory` sets by default: above the per-window blocks
#: a pass keeps (tens of KiB) and below the forward pass's temporaries (MiB).
DEFAULT_MMAP_THRESHOLD = 256 << 10

_set_to: int | None = None


def set_malloc_thresholds(mmap_threshold: int, trim_threshold: int) -> bool:
    """Set glibc's mmap and trim thresholds (mallopt(3)) for this process, in bytes.

    Both are checked before either is set: ``mmap_threshold`` in
    ``[0, MMAP_THRESHOLD_MAX]``, ``trim_threshold`` at least 0. Returns True when glibc
    took both, False where ``mallopt`` is not available (another C library: nothing is
    changed) or refused one. Process-wide and permanent.

    >>> set_malloc_thresholds(-1, 0)
    Traceback (most recent call last):
    ValueError: mmap_threshold: expected an int in [0, 33554432], got -1
    """
    mmap_threshold = check_int("mmap_threshold", mmap_threshold, minimum=0,
                               maximum=MMAP_THRESHOLD_MAX)
    trim_threshold = check_int("trim_threshold", trim_threshold, minimum=0)
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
    ok &= mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    return bool(ok)


def return_freed_memory(mmap_threshold: int = DEFAULT_MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``mmap_threshold`` bytes for this process, and its
    trim threshold at the same, so that freed large blocks go back to the system.

    Process-wide and permanent; idempotent. Returns True when set (or already set to
    this value by an earlier call), False where glibc's ``mallopt`` is not available
    (another C library: nothing is changed).

    Parameters
    ----------
    mmap_threshold : bytes, in ``[0, MMAP_THRESHOLD_MAX]``.

    Complexity: O(1); afterwards each allocation above the threshold costs a mapping and
    its page faults (small beside the matrix products that fill it).

    >>> return_freed_memory(mmap_threshold=-1)
    Traceback (most recent call last):
    ValueError: mmap_threshold: expected an int in [0, 33554432], got -1
    >>> return_freed_memory() in (True, False)
    True
    """
    global _set_to
    if _set_to == mmap_threshold:
        return True
    ok = set_malloc_thresholds(mmap_threshold, mmap_threshold)
    if ok:
        _set_to = mmap_threshold
    return ok
