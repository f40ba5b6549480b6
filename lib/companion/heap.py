"""Where a long pass's memory comes from (glibc's malloc): a flat heap, few page faults.

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
holds only the small blocks (:func:`return_freed_memory`). What is computed does not
change, only where memory comes from.

A fresh mapping costs a page fault per 4 KiB page, each zeroed by the kernel: on the
12-layer encoder, about 25,000 faults and 14 % of a window's time (system time). The
faster arrangement keeps the pass's long-lived blocks out of the heap altogether
(:class:`MappedArena`: memory mappings of their own) and lets the heap reuse freed
temporaries without giving them back (:func:`reusing_freed_memory`): the heap then holds
only the temporaries, and a freed temporary's pages serve the next one.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading

from companion._validate import check_int

_M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
#: glibc's largest mmap threshold, ``DEFAULT_MMAP_THRESHOLD_MAX``: ``4 MiB * sizeof(long)``
#: (32 MiB on 64-bit), the upper limit mallopt(3) documents.
MMAP_THRESHOLD_MAX = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)
#: The threshold :func:`return_freed_memory` sets by default: above the per-window blocks
#: a pass keeps (tens of KiB) and below the forward pass's temporaries (MiB).
DEFAULT_MMAP_THRESHOLD = 256 << 10
#: mallopt(3) takes its value as a C ``int``: the largest trim threshold it can be given.
INT_MAX = 2**31 - 1

_current: tuple[int, int] | None = None  # the thresholds last set here (None: glibc's own)
_reusing = 0  # depth of reusing_freed_memory blocks
_reusing_lock = threading.Lock()


def set_malloc_thresholds(mmap_threshold: int, trim_threshold: int) -> bool:
    """Set glibc's mmap and trim thresholds (mallopt(3)) for this process, in bytes.

    Both are checked before either is set: ``mmap_threshold`` in
    ``[0, MMAP_THRESHOLD_MAX]``, ``trim_threshold`` in ``[0, INT_MAX]`` (mallopt takes a
    C ``int``). Returns True when glibc took both, False where ``mallopt`` is not
    available (another C library: nothing is changed) or refused one. Process-wide and
    permanent.

    >>> set_malloc_thresholds(-1, 0)
    Traceback (most recent call last):
    ValueError: mmap_threshold: expected an int in [0, 33554432], got -1
    """
    global _current
    mmap_threshold = check_int("mmap_threshold", mmap_threshold, minimum=0,
                               maximum=MMAP_THRESHOLD_MAX)
    # a larger value would reach mallopt cut to its low 32 bits (1 << 40 becomes 0)
    trim_threshold = check_int("trim_threshold", trim_threshold, minimum=0, maximum=INT_MAX)
    libc = _libc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
    ok &= libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    if ok:
        _current = (mmap_threshold, trim_threshold)
    return bool(ok)


def _libc():
    """glibc's shared library, or None (another C library, no ``mallopt``)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


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
    a page fault per page (:func:`reusing_freed_memory` avoids them during a pass).

    >>> return_freed_memory(mmap_threshold=-1)
    Traceback (most recent call last):
    ValueError: mmap_threshold: expected an int in [0, 33554432], got -1
    >>> return_freed_memory() in (True, False)
    True
    """
    if _current == (mmap_threshold, mmap_threshold):
        return True
    return set_malloc_thresholds(mmap_threshold, mmap_threshold)


@contextlib.contextmanager
def reusing_freed_memory():
    """Within the block, glibc's heap keeps freed blocks (up to ``MMAP_THRESHOLD_MAX``,
    32 MiB) for the next allocation instead of mapping fresh pages for it; on leaving,
    the free memory goes back to the system (``malloc_trim``) and the thresholds set
    before are restored (:func:`return_freed_memory`'s where glibc's own were in force:
    its adaptive threshold cannot be switched back on).

    For a long pass whose every step allocates and frees the same large temporaries:
    their pages are faulted in once, not at every step. Keep what the pass holds on to
    out of the heap (:class:`MappedArena`): a kept block between the temporaries would
    leave holes that later temporaries do not fit, and the heap would grow with every
    step. Process-wide; blocks may nest (the outermost one sets and restores). Does
    nothing where glibc's ``mallopt`` is not available.

    >>> with reusing_freed_memory():
    ...     pass
    """
    global _reusing
    with _reusing_lock:
        outer = _reusing == 0
        before = _current
        _reusing += 1
        if outer:
            set_malloc_thresholds(MMAP_THRESHOLD_MAX, INT_MAX)
    try:
        yield
    finally:
        with _reusing_lock:
            _reusing -= 1
            if outer and _current == (MMAP_THRESHOLD_MAX, INT_MAX):
                if before is None:
                    return_freed_memory()
                else:
                    set_malloc_thresholds(*before)
                _libc().malloc_trim(0)


class MappedArena:
    """CPU tensors kept for a long time, copied into anonymous memory mappings of their
    own, outside malloc's heap.

    Copies are carved one after the other from blocks of ``block_bytes`` (a larger
    tensor gets a mapping of its own), 64-byte aligned; a block goes back to the system
    when no tensor carved from it is left. Nothing is freed one tensor at a time: for
    results that live as long as the arena's owner (a corpus pass's per-window parts).

    Parameters
    ----------
    block_bytes : the size of each mapping, at least one page.

    Complexity: O(size) per :meth:`keep` (one copy); one ``mmap`` per block.

    >>> import torch
    >>> arena = MappedArena(block_bytes=4096)
    >>> t = arena.keep(torch.arange(6.0).reshape(2, 3))
    >>> t
    tensor([[0., 1., 2.],
            [3., 4., 5.]])
    >>> arena.n_blocks
    1
    """

    ALIGN = 64

    def __init__(self, block_bytes: int = 64 << 20):
        self.block_bytes = check_int("block_bytes", block_bytes, minimum=mmap.PAGESIZE)
        self._block = None  # the block being filled
        self._used = 0
        self.n_blocks = 0

    def __getstate__(self):  # a copy (pickle, deepcopy) starts empty: tensors carry their data
        return {"block_bytes": self.block_bytes}

    def __setstate__(self, state):
        self.__init__(state["block_bytes"])

    def keep(self, tensor):
        """A copy of the CPU tensor ``tensor`` in mapped memory (same dtype, shape and
        values; contiguous). A tensor on another device is returned as it is."""
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            return tensor
        if tensor.numel() == 0:
            return tensor.clone()
        # the copy is made here: the keeper only carves (no parallel region on a thread
        # whose OpenMP team would then spin beside this one)
        return _keeper().submit(self._carve, tensor).result().copy_(tensor)

    def _carve(self, tensor):
        """An uninitialised contiguous tensor like ``tensor`` in mapped memory."""
        nbytes = tensor.numel() * tensor.element_size()
        start = -(-self._used // self.ALIGN) * self.ALIGN
        if self._block is None or start + nbytes > len(self._block):
            size = max(self.block_bytes, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
            block = _anonymous_mapping(size)
            self.n_blocks += 1
            if size > self.block_bytes:  # a mapping of its own: the current block stays
                return _view(block, 0, tensor)
            self._block, start = block, 0
        self._used = start + nbytes
        return _view(self._block, start, tensor)


_keeper_pool = None


def _forget_keeper():  # a forked child has the pool but not its thread
    global _keeper_pool
    _keeper_pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_keeper)


def _keeper():
    """The one thread that carves every kept tensor: glibc gives it a malloc arena of
    its own, so the small blocks a kept tensor needs (its metadata) stay out of the heap
    of the threads whose temporaries come and go (one kept block there pins a hole that
    the next, larger temporary does not fit)."""
    global _keeper_pool
    with _reusing_lock:
        if _keeper_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            _keeper_pool = ThreadPoolExecutor(1, thread_name_prefix="mapped-arena")
        return _keeper_pool


def _anonymous_mapping(size: int):
    """``size`` bytes of private, zero-filled memory mapped for this process."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if flags and hasattr(mmap, "PROT_READ"):
        return mmap.mmap(-1, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return mmap.mmap(-1, size)  # Windows: an anonymous mapping of the paging file


def _view(block, offset: int, tensor):
    """A tensor of ``tensor``'s dtype and shape on ``block`` from ``offset`` (it keeps
    ``block`` alive)."""
    import torch

    out = torch.frombuffer(block, dtype=tensor.dtype, count=tensor.numel(), offset=offset)
    return out.view(tensor.shape)
