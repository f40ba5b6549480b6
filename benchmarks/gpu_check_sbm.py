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

``--device cpu --tiny`` runs the same code on the CPU at n = 256 / 5% (the CUDA tests are
then skipped, peak memory is not measured): a check of the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from companion.timing import call_seconds

ROOT = Path(__file__).resolve().parents[1]


def _measure(fn, device, repeats=5):
    """Median seconds of ``fn`` and its peak memory in MiB (CUDA only, else None)."""
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    peak = None
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    fn()
    sync()
    if cuda:
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    return call_seconds(fn, repeats=repeats, warmup=0, cuda_sync=cuda), peak


def timing(device, cases=((4096, 0.05), (8192, 0.01)), repeats=5) -> list[dict]:
    # The same workloads as the CPU benchmark (bench_sbm.workloads), on this device.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_sbm import workloads

    rows = []
    for n, density in cases:
        runs, info = workloads(n, density, seed=0, device=device)
        row = {"n": n, "density": density}
        for name, fn in runs.items():
            try:
                row[f"{name}_s"], row[f"{name}_peak_mb"] = _measure(fn, device, repeats)
            except torch.cuda.OutOfMemoryError as exc:  # report, do not hide
                row[f"{name}_error"] = f"out of memory: {exc}".splitlines()[0]
        row["edges_per_head"] = info.get("edges_per_head")
        for base in ("dense_masked", "sdpa"):
            if f"{base}_s" in row and "edge_s" in row:
                row[f"{base}_over_edge_time"] = row[f"{base}_s"] / row["edge_s"]
                if row["edge_peak_mb"] is not None and row[f"{base}_peak_mb"]:
                    row[f"edge_over_{base}_memory"] = (row["edge_peak_mb"]
                                                       / row[f"{base}_peak_mb"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--tiny", action="store_true",
                        help="n = 256 at 5%%, 2 repeats: a check of the script itself")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (run on a GPU machine, or pass "
              "--device cpu --tiny)")
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}", flush=True)
    import pytest

    code = pytest.main(["-q", "-rs", "-p", "no:cacheprovider",
                        str(ROOT / "tests" / "test_sbm.py"), "-k", "cuda"])
    rows = (timing(device, cases=((256, 0.05),), repeats=2) if args.tiny
            else timing(device))
    out_dir = Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "device": name,
        "tiny": bool(args.tiny),
        "torch": torch.__version__,
        "tests_exit_code": int(code),
        "timing": rows,
    }
    (out_dir / "gpu_sbm.json").write_text(json.dumps(result, indent=1))
    print(f"tests exit code {int(code)}; wrote {out_dir / 'gpu_sbm.json'}")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
