"""Benchmark: the chapter's corpus cell (issue 14), one batch at a time against lanes.

The chapter's context-similarity cell runs ``analyse_corpus(where=("pre_wo", "post_wo"),
per_window=(True, False))`` on each half of the windows (the second half tracking tokens
and continuing the post-W_O statistics). Three ways to run it (:class:`CaptureSettings`):

- ``serial``: one batch at a time, its forward pass on all intra-op threads, then its
  two updates (pre- and post-W_O statistics) one after the other, on all threads too;
- ``side_by_side``: one batch at a time, the two updates side by side, one intra-op
  thread each (``lanes=1``; the default before lanes);
- ``lanes``: the default, two batches in flight on two threads with one intra-op thread
  each, each batch's forward and updates on its lane, the parts added in batch order.

Interleaved repeats in one process on windows of the paper's setting (128 tokens,
percentile 1, batch 16), wall clock and process CPU time, the load average before and
after, and whether every sum and per-window part is identical to ``serial``'s.
Writes ``benchmarks/results/context_similarity_corpus.json`` and ``.md``.

    .venv/bin/python benchmarks/bench_context_similarity_corpus.py [--quick] [--windows 192]

``--quick`` (``make bench BENCH_ARGS=--quick``): 64 windows, 2 repeats.
"""
from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from companion.context_similarity import CaptureSettings, analyse_corpus, load_encoder
from companion.corpora import load_corpus, windows
from results_io import write_results


def corpus_cell(model, tokenizer, wins, settings):
    """The chapter's cell: (pre-W_O stats of both halves, post-W_O stats)."""
    half = max(1, len(wins) // 2)
    opts = dict(tokenizer=tokenizer, batch_size=16, percentile=1.0, attention_threshold=0.1,
                device="cpu", where=("pre_wo", "post_wo"), per_window=(True, False),
                progress=False, settings=settings)
    stats, post = analyse_corpus(model, wins[:half], **opts)
    chosen = stats.token_lift().argmax(-1)
    held, post = analyse_corpus(model, wins[half:], track_tokens=chosen, into=(None, post),
                                **opts)
    return stats.merge(held), post


def same(a, b) -> bool:
    sums = all(torch.equal(x, b.tensors()[n]) for n, x in a.tensors().items())
    if not a.per_window:
        return sums
    wa, wb = a.window_sums(), b.window_sums()
    return sums and wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="64 windows, 2 repeats")
    parser.add_argument("--windows", type=int, default=None, help="default 192 (64 quick)")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (2 quick)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    for name in ("windows", "repeats"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name}: expected a positive integer, got {getattr(args, name)}")
    args.windows = args.windows if args.windows is not None else (64 if args.quick else 192)
    args.repeats = args.repeats if args.repeats is not None else (2 if args.quick else 3)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_encoder(device="cpu")
    wins = windows(load_corpus("brown"), tokenizer, 128, max_windows=args.windows, seed=0)
    runs = {"serial": CaptureSettings(lanes=1, side_by_side_updates=False),
            "side_by_side": CaptureSettings(lanes=1),
            "lanes": CaptureSettings()}
    load_before = os.getloadavg()[0]
    out = {name: corpus_cell(model, tokenizer, wins, s) for name, s in runs.items()}  # warm
    identical = {name: all(same(x, y) for x, y in zip(out["serial"], out[name]))
                 for name in runs if name != "serial"}
    wall = {name: [] for name in runs}
    cpu = {name: [] for name in runs}
    for r in range(args.repeats):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            t0, c0 = time.perf_counter(), time.process_time()
            corpus_cell(model, tokenizer, wins, runs[name])
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    load_after = os.getloadavg()[0]
    n = len(wins)

    def ratios(old, new):  # best over best, and the median of the per-repeat ratios
        per_repeat = sorted(a / b for a, b in zip(wall[old], wall[new]))
        return min(wall[old]) / min(wall[new]), per_repeat[len(per_repeat) // 2]

    ratio = {f"{old}/{new}": ratios(old, new)
             for old, new in (("side_by_side", "lanes"), ("serial", "lanes"),
                              ("serial", "side_by_side"))}
    machine = (f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
               f"load average {load_before:.2f} before, {load_after:.2f} after")
    result = dict(windows=n, threads=args.threads, repeats=args.repeats, identical=identical,
                  machine=machine, cores=os.cpu_count(), torch=torch.__version__,
                  load_before=load_before, load_after=load_after, wall=wall, cpu=cpu,
                  ratio_best=({k: v[0] for k, v in ratio.items()}),
                  ratio_median=({k: v[1] for k, v in ratio.items()}))
    lines = [
        "# Context similarity: the chapter's corpus cell, one batch at a time against lanes",
        "",
        f"{n} windows of 128 tokens from `brown`, batch 16, {args.threads} torch threads, "
        f"best of {args.repeats}, interleaved. Load average (1 min) {load_before:.2f} before, "
        f"{load_after:.2f} after. Sums and per-window parts identical to serial's: "
        + ", ".join(f"{k} {v}" for k, v in identical.items()) + ".",
        "",
        f"Machine: {machine}.",
        "",
        "| run | best s (wall) | ms/window | best s (CPU) |",
        "|---|---|---|---|",
    ]
    for name in runs:
        lines.append(f"| {name} | {min(wall[name]):.2f} | {1e3 * min(wall[name]) / n:.1f} | "
                     f"{min(cpu[name]):.2f} |")
    lines += [""] + [f"{k}: {best:.3f} (best, wall), {median:.3f} (median of the per-repeat "
                     "ratios)." for k, (best, median) in ratio.items()]
    print("\n".join(lines))
    write_results("context_similarity_corpus", result, "\n".join(lines) + "\n")
    identical = all(identical.values())
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
