"""GPU check for SBM attention: the correctness tests on CUDA, then a short timing.

Prepared for the device tool (one short run on a lent GPU); not run in sessions without
one.  Usage, from the repository root on the GPU machine:

    .venv/bin/python benchmarks/gpu_check_sbm.py          # or: python benchmarks/...

1. Runs ``tests/test_sbm.py -k cuda``: the same Monte Carlo, dense-reference, gradcheck
   and straight-through-estimator tests as on CPU, with every tensor on CUDA.
2. Times forward + backward (batch 1, 2 heads, head_dim 32, k = 128) of fastRG sampling
   + edge attention against dense masked attention and dense SDPA at n = 4096 / 5% and
   n = 8192 / 1%, with peak memory from ``torch.cuda.max_memory_allocated``.

Writes ``$OUT/gpu_sbm.json`` when ``OUT`` is set (else ``benchmarks/results/``), prints
a table, and exits non-zero if a test failed.  About a minute on one H100-class GPU.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _measure(fn, device, repeats=5):
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), peak


def timing(device) -> list[dict]:
    # The same workloads as the CPU benchmark (bench_sbm.workloads), on this device.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_sbm import workloads

    rows = []
    for n, density in ((4096, 0.05), (8192, 0.01)):
        runs, info = workloads(n, density, seed=0, device=device)
        row = {"n": n, "density": density}
        for name, fn in runs.items():
            try:
                row[f"{name}_s"], row[f"{name}_peak_mb"] = _measure(fn, device)
            except torch.cuda.OutOfMemoryError as exc:  # report, do not hide
                row[f"{name}_error"] = f"out of memory: {exc}".splitlines()[0]
        row["edges_per_head"] = info.get("edges_per_head")
        for base in ("dense_masked", "sdpa"):
            if f"{base}_s" in row and "edge_s" in row:
                row[f"{base}_over_edge_time"] = row[f"{base}_s"] / row["edge_s"]
                row[f"edge_over_{base}_memory"] = row["edge_peak_mb"] / row[f"{base}_peak_mb"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (run on a GPU machine)")
        return 2
    device = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    import pytest

    code = pytest.main(["-q", "-rs", str(ROOT / "tests" / "test_sbm.py"), "-k", "cuda"])
    rows = timing(device)
    out_dir = Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "tests_exit_code": int(code),
        "timing": rows,
    }
    (out_dir / "gpu_sbm.json").write_text(json.dumps(result, indent=1))
    print(f"tests exit code {int(code)}; wrote {out_dir / 'gpu_sbm.json'}")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
