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

from companion import heap

PATTERN = textwrap.dedent("""
    import sys
    import torch
    from companion.heap import return_freed_memory

    def resident():
        return int(open("/proc/self/statm").read().split()[1]) * 4096

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
