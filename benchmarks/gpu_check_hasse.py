"""GPU check for the Hasse chapter (one short prepared script, ~1-3 min on one GPU).

1. FlexAttention (``torch.compile(flex_attention)`` with ``create_block_mask``) with the
   named mask_mods against SDPA with the dense mask, at sequence lengths 1024 and 4096
   (block two-stream and butterfly at comparable sizes), float32 and bfloat16.
2. ``reachability_limit`` by float squaring on the GPU (``method="matmul"``) against the
   CPU bitset method at n = 2048, 4096 for causal, sliding window (64) and random
   (p = 4/n): equal R and depth, and both timings.

Usage (device machine): ``python benchmarks/gpu_check_hasse.py`` (writes
``$OUT/gpu_check_hasse.json`` when ``OUT`` is set, else ``benchmarks/results/``).
``--device cpu --quick`` runs the same code eagerly on the CPU at small sizes (a smoke
test of the script itself; FlexAttention is then unfused and slow).
"""
from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from pathlib import Path

import torch

from companion.hasse import masks as M
from companion.hasse.masked_transformer import flex_vs_sdpa
from companion.hasse.reachability import reachability_limit


def flex_cases(size: int):
    n_b2s = size // 2 + 1  # block two-stream on n tokens has about 2n positions
    n_bf = size // 3 + 1
    return {
        "causal": (M.causal_mask_mod, M.causal(size)),
        "sliding_window_64": (M.sliding_window_mask_mod(64), M.sliding_window(size, 64)),
        "block_causal_64": (M.block_causal_mask_mod(64), M.block_causal(size, 64)),
        "prefix_lm_256": (M.prefix_lm_mask_mod(256), M.prefix_lm(size, min(256, size))),
        "block_two_stream_16": (
            M.block_two_stream_mask_mod(n_b2s, 16),
            M.block_two_stream_mask(n_b2s, 16),
        ),
        "butterfly": (M.butterfly_mask_mod(n_bf), M.butterfly_mask(n_bf)),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    if on_gpu and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested but CUDA is not available")
    sizes = [128] if args.quick else [1024, 4096]
    dtypes = [torch.float32] + ([torch.bfloat16] if on_gpu else [])
    report = {"device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
              "torch": torch.__version__, "flex": [], "reachability": []}
    for size in sizes:
        for name, (mod, dense) in flex_cases(size).items():
            for dtype in dtypes:
                start = time.perf_counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    res = flex_vs_sdpa(mod, dense, n_heads=4, head_dim=64, device=device,
                                       dtype=dtype, compile=on_gpu,
                                       generator=torch.Generator().manual_seed(0))
                tol = 1e-4 if dtype == torch.float32 else 3e-2
                row = {"mask": name, "positions": dense.shape[0], "dtype": str(dtype),
                       **res, "tolerance": tol, "ok": res["max_abs_diff"] <= tol
                       and res["empty_rows_zero"],
                       "seconds_incl_compile": time.perf_counter() - start}
                report["flex"].append(row)
                print(json.dumps(row), flush=True)
    for n in ([256] if args.quick else [2048, 4096]):
        for name, mask in [("causal", M.causal(n)), ("window64", M.sliding_window(n, 64)),
                           ("random4/n", M.random_mask(n, 4 / n,
                                                       generator=torch.Generator().manual_seed(n)))]:
            start = time.perf_counter()
            r_cpu, d_cpu = reachability_limit(mask, method="bitset")
            t_cpu = time.perf_counter() - start
            mask_dev = mask.to(device)
            if on_gpu:
                torch.cuda.synchronize()
            start = time.perf_counter()
            r_dev, d_dev = reachability_limit(mask_dev, method="matmul")
            if on_gpu:
                torch.cuda.synchronize()
            t_dev = time.perf_counter() - start
            row = {"mask": name, "n": n, "depth_cpu_bitset": d_cpu, "depth_device_matmul": d_dev,
                   "R_equal": bool(torch.equal(r_cpu, r_dev.cpu())), "cpu_bitset_s": t_cpu,
                   "device_matmul_s": t_dev}
            report["reachability"].append(row)
            print(json.dumps(row), flush=True)
    report["all_ok"] = all(r["ok"] for r in report["flex"]) and all(
        r["R_equal"] and r["depth_cpu_bitset"] == r["depth_device_matmul"]
        for r in report["reachability"])
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else (
        Path(__file__).resolve().parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check_hasse.json").write_text(json.dumps(report, indent=2))
    print("all_ok", report["all_ok"])


if __name__ == "__main__":
    main()
