"""Benchmark: companion.lra.dropout against torch's CPU dropout, alone and in LRA training.

Both give the same numbers for the same mask (tests/test_lra_dropout.py); only the mask's
random source differs (torch's Mersenne Twister, element by element, against PCG64's
64-bit draws, two elements each). Measured in one process, interleaved, medians over
repeats, 1 torch thread (as the chapter's training workers run):

- ``kernel``: forward + backward of one dropout (p = 0.1) at the LRA model's activation
  shapes ``[32, n, 64]`` and ``[32, n, 128]`` (n = 64 for ListOps, 100 for Pathfinder);
- ``step``: one training step of the ci ListOps model (the SBM chapter's: batch 32,
  length 64, about 70 % padding, dropout 0.1, 32 clusters), dense and SBM, with torch's
  ``nn.Dropout`` against this module's ``Dropout`` in the same model (same weights, same
  batches).

Why the module exists, as first measured (2-core Xeon of the book's CI): torch's CPU
``bernoulli_`` took about 15 ns per element, a ``[32, 64, 128]`` float32 activation in
3.4 ms, and the 2-layer LRA model's seven dropouts about 10 ms of a 40 ms ListOps
training step.

Writes ``benchmarks/results/dropout.json`` and ``.md``.

    .venv/bin/python benchmarks/bench_dropout.py [--quick]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics

import torch

from companion.lra import listops
from companion.lra.dropout import Dropout, dropout
from companion.lra.experiments import keep_freed_memory
from companion.lra.model import LRAClassifier
from companion.sbm import density_regularizer
from companion.timing import call_seconds
from results_io import write_results


def _median_pair(a, b, repeats):
    """Medians of the seconds of ``a()`` and ``b()``, interleaved (order swapped every
    other repeat) after one warm-up call each."""
    a(), b()
    ta, tb = [], []
    for r in range(repeats):
        for fn, out in ((a, ta), (b, tb)) if r % 2 == 0 else ((b, tb), (a, ta)):
            out.append(call_seconds(fn, repeats=1, warmup=0))
    return statistics.median(ta), statistics.median(tb)


def kernel_rows(repeats):
    rows = []
    for shape in ((32, 64, 64), (32, 64, 128), (32, 100, 64), (32, 100, 128)):
        x = torch.randn(shape, requires_grad=True)
        g = torch.randn(shape)
        t_torch, t_ours = _median_pair(
            lambda: torch.nn.functional.dropout(x, 0.1, True).backward(g),
            lambda: dropout(x, 0.1, True).backward(g), repeats)
        rows.append({"shape": list(shape), "torch_s": t_torch, "ours_s": t_ours,
                     "speedup": t_torch / t_ours,
                     "torch_ns_per_element": 1e9 * t_torch / x.numel(),
                     "ours_ns_per_element": 1e9 * t_ours / x.numel()})
    return rows


def _swap_dropouts(model, cls):
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, (torch.nn.Dropout, Dropout)):
                setattr(module, name, cls(child.p))


def step_rows(repeats):
    pairs = listops.generate(600, seed=0, min_length=10, max_length=60, max_depth=4,
                             max_args=5)
    tokens, labels = listops.dataset(pairs, max_length=64)
    rows = []
    for attention in ("dense", "sbm"):
        runs = {}
        for source, cls in (("torch", torch.nn.Dropout), ("ours", Dropout)):
            torch.manual_seed(0)
            model = LRAClassifier(listops.vocab_size(), 64, 10, attention=attention,
                                  num_clusters=32, pad_id=0, dropout=0.1)
            _swap_dropouts(model, cls)
            optimiser = torch.optim.AdamW(model.parameters(), lr=2e-3, eps=1e-6,
                                          weight_decay=0.01)
            batches = torch.Generator().manual_seed(1)
            graphs = torch.Generator().manual_seed(2)

            def step(model=model, optimiser=optimiser, batches=batches, graphs=graphs):
                idx = torch.randint(len(labels), (32,), generator=batches)
                logits, densities = model(tokens[idx], generator=graphs)
                loss = torch.nn.functional.cross_entropy(logits, labels[idx])
                if attention == "sbm":
                    loss = loss + density_regularizer(densities, 1e-4)
                optimiser.zero_grad(set_to_none=True)
                loss.backward()
                optimiser.step()
            runs[source] = step
        t_torch, t_ours = _median_pair(runs["torch"], runs["ours"], repeats)
        rows.append({"attention": attention, "torch_dropout_s": t_torch,
                     "our_dropout_s": t_ours, "speedup": t_torch / t_ours,
                     "saved_ms": 1e3 * (t_torch - t_ours)})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    keep_freed_memory()  # as the chapter's training workers run
    load_before = os.getloadavg()
    kernel = kernel_rows(10 if args.quick else 40)
    step = step_rows(6 if args.quick else 30)
    load_after = os.getloadavg()
    result = {
        "benchmark": "dropout", "threads": 1, "cores": os.cpu_count(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch": torch.__version__, "load_average_before_after": [load_before, load_after],
        "kernel": kernel, "step": step,
    }
    lines = [
        "# Dropout: PCG64 masks (companion.lra.dropout) against torch's CPU dropout",
        "",
        f"1 torch thread, {os.cpu_count()} cores, torch {torch.__version__}; load average "
        f"(1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after. Interleaved "
        "medians; the same numbers for the same mask (tests).",
        "",
        "| p = 0.1, forward + backward | torch ms | ours ms | torch ns/elem | ours ns/elem "
        "| speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for r in kernel:
        lines.append(f"| {r['shape']} | {1e3 * r['torch_s']:.2f} | {1e3 * r['ours_s']:.2f} | "
                     f"{r['torch_ns_per_element']:.1f} | {r['ours_ns_per_element']:.1f} | "
                     f"{r['speedup']:.2f}x |")
    lines += ["", "| ci ListOps training step | torch's dropout ms | ours ms | saved ms "
              "| speed-up |", "|---|---|---|---|---|"]
    for r in step:
        lines.append(f"| {r['attention']} | {1e3 * r['torch_dropout_s']:.1f} | "
                     f"{1e3 * r['our_dropout_s']:.1f} | {r['saved_ms']:.1f} | "
                     f"{r['speedup']:.2f}x |")
    write_results("dropout", result, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
