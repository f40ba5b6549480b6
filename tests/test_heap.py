"""companion.heap: a fixed mmap threshold keeps a long pass's heap from growing.

The pattern of a corpus pass, in a fresh process each: a first large block is freed (as
the first forward pass's are), then every step allocates a large temporary a little
larger than the last, keeps a small block for good, and frees the temporary. With glibc's
dynamic threshold the freed first block raised the threshold, so the temporaries come
from the heap, each leaves a hole the next does not fit, and the resident memory grows by
about one temporary per step; with the threshold fixed it stays flat.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from companion import heap

# what both subprocess scripts start with
PRELUDE = textwrap.dedent("""
    import sys
    import torch

    def resident():
        return int(open("/proc/self/statm").read().split()[1]) * 4096
""")

PATTERN = PRELUDE + textwrap.dedent("""
    from companion.heap import return_freed_memory

    if sys.argv[1] == "fixed":
        assert return_freed_memory()
    kept = []
    first = torch.ones((16 << 20) // 8, dtype=torch.float64)  # a first large block, freed
    del first
    start = resident()
    for step in range(120):
        temporary = torch.ones((4 << 20) // 8 + step * 4096, dtype=torch.float64)
        kept.append(temporary[:2000].clone())  # 16 KB kept for good
        del temporary
    print(resident() - start)
""")


def _growth(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PATTERN, mode], capture_output=True,
                         text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_fixed_threshold_gives_the_temporaries_back():
    dynamic, fixed = _growth("dynamic"), _growth("fixed")
    if dynamic < 100 << 20:
        pytest.skip(f"this C library's heap did not grow ({dynamic >> 20} MiB): "
                    "nothing to fix here")
    # 120 temporaries of 4+ MiB: the dynamic heap keeps most of them, the fixed one none
    assert fixed < 32 << 20 < (dynamic >> 2), (dynamic >> 20, fixed >> 20)


def test_bad_threshold_is_refused():
    for bad in (-1, heap.MMAP_THRESHOLD_MAX + 1, 1.5, "1"):
        with pytest.raises((ValueError, TypeError), match="mmap_threshold"):
            heap.return_freed_memory(bad)


REUSE = PRELUDE + textwrap.dedent("""
    import contextlib
    import resource
    from companion.heap import MappedArena, return_freed_memory, reusing_freed_memory

    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def steps(kept, keep, first, last):
        # a forward pass's pattern: the same few large temporaries every step, one of a
        # size that varies with the data, and a small result kept for good
        for step in range(first, last):
            hidden = torch.ones((6 << 20) // 8, dtype=torch.float64)
            scores = torch.ones((4 << 20) // 8 + (step % 7) * 4096, dtype=torch.float64)
            kept[step] = keep(scores[:2000])  # 16 KB kept for good
            del scores
            wide = torch.ones((12 << 20) // 8, dtype=torch.float64)
            del hidden, wide

    kept = [None] * 140  # room for every step's block: no list grows in the heap
    arena = MappedArena(block_bytes=1 << 20)
    return_freed_memory()
    keep = {"reuse-heap": lambda t: t.clone()}.get(sys.argv[1], arena.keep)
    with (reusing_freed_memory() if sys.argv[1].startswith("reuse")
          else contextlib.nullcontext()):
        steps(kept, keep, 0, 20)  # the first steps: the heap takes up the working set
        start, before = resident(), faults()
        steps(kept, keep, 20, 140)
        growth, n_faults = resident() - start, faults() - before
    print(growth, n_faults)
""")


def _huge_pages_always() -> bool:
    """Whether the kernel backs every anonymous mapping with huge pages it can."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
            return "[always]" in fh.read()
    except OSError:
        return False


def _reuse_run(mode: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", REUSE, mode], capture_output=True,
                         text=True, check=True)
    growth, n_faults = out.stdout.strip().splitlines()[-1].split()
    return int(growth), int(n_faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_reusing_freed_memory_faults_each_temporary_in_once():
    # 120 steps of 22 MiB of temporaries (5,632 pages a step): mapped afresh every step
    # when they are given back, their pages reused inside the block. The kept blocks
    # (1.9 MB in all) in a MappedArena leave no holes, so the heap does not grow; kept
    # in the heap between the temporaries, they do leave holes, and it grows
    given_back, reused = _reuse_run("give-back"), _reuse_run("reuse")
    pages = 120 * ((22 << 20) // 4096)
    if not _huge_pages_always():  # else a fresh mapping may fault 2 MiB at a time
        assert given_back[1] > pages // 2, given_back
    assert reused[1] < pages // 20, reused
    assert reused[0] < 8 << 20 and given_back[0] < 8 << 20, (reused, given_back)
    if heap._libc() is not None:  # glibc
        in_heap = _reuse_run("reuse-heap")
        assert in_heap[0] > reused[0] + (16 << 20), (in_heap, reused)


def test_reusing_freed_memory_restores_the_thresholds():
    heap.return_freed_memory()
    state = heap._current
    with heap.reusing_freed_memory():
        if state is not None:  # glibc: the block's own setting
            assert heap._current == (heap.MMAP_THRESHOLD_MAX, heap.INT_MAX)
        with heap.reusing_freed_memory():  # nested: the outer block restores
            pass
        if state is not None:
            assert heap._current == (heap.MMAP_THRESHOLD_MAX, heap.INT_MAX)
    assert heap._current == state
    with pytest.raises(RuntimeError, match="inside"):
        with heap.reusing_freed_memory():
            raise RuntimeError("inside")  # an error inside restores them too
    assert heap._current == state


def test_trim_threshold_beyond_a_c_int_is_refused():
    # mallopt takes an int: 1 << 40 would arrive as 0 (trim at every free)
    with pytest.raises(ValueError, match="trim_threshold"):
        heap.set_malloc_thresholds(heap.DEFAULT_MMAP_THRESHOLD, 1 << 40)


def _heap_range():
    """The [start, end) of this process's brk heap, None if it has none."""
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            return start, end
    return None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.int64, torch.bool])
def test_mapped_arena_keeps_exact_copies(dtype):
    g = torch.Generator().manual_seed(0)
    arena = heap.MappedArena(block_bytes=4096)
    sources = [torch.randn(3, 5, 7, generator=g) * 10,     # odd sizes
               torch.randn(9, 4, generator=g).t(),          # not contiguous
               torch.tensor(2.5),                           # 0-d
               torch.zeros(0, 3),                           # empty
               torch.randn(700, 3, generator=g)]            # larger than a block
    kept = [arena.keep(s.to(dtype)) for s in sources]
    for s, k in zip(sources, kept):
        assert k.dtype == dtype and k.shape == s.shape
        assert torch.equal(k, s.to(dtype))
        assert k.is_contiguous()
    # the copies do not share memory with their sources or with each other
    kept[0].view(-1)[0] = not bool(kept[0].view(-1)[0]) if dtype == torch.bool else 99
    assert not torch.equal(kept[0], sources[0].to(dtype))
    spans = sorted((k.data_ptr(), k.data_ptr() + k.numel() * k.element_size())
                   for k in kept if k.numel())
    assert all(a_end <= b for (_, a_end), (b, _) in zip(spans, spans[1:]))
    assert all(k.data_ptr() % heap.MappedArena.ALIGN == 0 for k in kept if k.numel())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps")
def test_mapped_arena_lies_outside_the_heap():
    arena = heap.MappedArena(block_bytes=1 << 16)
    kept = [arena.keep(torch.full((100,), float(i), dtype=torch.float64))
            for i in range(200)]  # 800 B each, 832 with the alignment
    span = _heap_range()
    if span is not None:
        assert not any(span[0] <= k.data_ptr() < span[1] for k in kept)
    assert arena.n_blocks == -(-200 // ((1 << 16) // 832))  # whole copies per block
    assert [float(k[0]) for k in kept] == [float(i) for i in range(200)]


def test_mapped_arena_copies_and_pickles():
    import copy
    import pickle

    arena = heap.MappedArena(block_bytes=8192)
    t = arena.keep(torch.arange(10, dtype=torch.float64))
    assert torch.equal(pickle.loads(pickle.dumps(t)), t)
    again = copy.deepcopy(arena)
    assert again.block_bytes == 8192 and again.n_blocks == 0
    assert torch.equal(again.keep(t), t)


def test_mapped_arena_bad_input():
    with pytest.raises(ValueError, match="block_bytes"):
        heap.MappedArena(block_bytes=16)
    with pytest.raises(TypeError, match="tensor"):
        heap.MappedArena().keep([1.0, 2.0])
