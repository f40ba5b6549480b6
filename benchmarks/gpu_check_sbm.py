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
HEADS, HEAD_DIM, CLUSTERS = 2, 32, 128


def _memberships(n, density, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    qm = torch.sigmoid(torch.randn(1, HEADS, n, CLUSTERS, generator=g))
    km = torch.sigmoid(torch.randn(1, HEADS, n, CLUSTERS, generator=g))
    s = torch.softmax(torch.randn(HEADS, CLUSTERS * CLUSTERS, generator=g), -1)
    s = s.reshape(HEADS, CLUSTERS, CLUSTERS)
    total = (qm.sum(2)[..., None, :] @ s @ km.sum(2)[..., :, None]).reshape(1, HEADS)
    qm = qm * (density * n * n / total)[..., None, None]
    return qm.to(device), s.to(device), km.to(device)


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
    from companion.sbm import (
        dense_masked_attention,
        edge_attention,
        edge_probabilities,
        fastrg_sample,
    )

    rows = []
    for n, density in ((4096, 0.05), (8192, 0.01)):
        qm, s, km = _memberships(n, density, device)
        q, k, v = (
            torch.randn(1, HEADS, n, HEAD_DIM, device=device, requires_grad=True) for _ in range(3)
        )
        gen = torch.Generator(device=device).manual_seed(1)
        info = {}

        def clear():
            for t in (q, k, v):
                t.grad = None

        def edge():
            edges = fastrg_sample(qm, s, km, gen)
            edge_attention(q, k, v, edges).sum().backward()
            info["edges_per_head"] = edges[0].numel() / HEADS
            clear()

        def dense_masked():
            p = edge_probabilities(qm, s, km)
            mask = torch.bernoulli(p.clamp_(0, 1), generator=gen).bool()
            del p
            dense_masked_attention(q, k, v, mask).sum().backward()
            clear()

        def sdpa():
            torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward()
            clear()

        row = {"n": n, "density": density}
        for name, fn in (("edge", edge), ("dense_masked", dense_masked), ("sdpa", sdpa)):
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
