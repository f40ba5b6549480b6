"""Benchmark: the chapter's corpus cell (issue 14), updates one after the other against
side by side.

The chapter's context-similarity cell runs ``analyse_corpus(where=("pre_wo", "post_wo"),
per_window=(True, False))`` on each half of the windows (the second half tracking tokens
and continuing the post-W_O statistics). Its two updates per batch (pre- and post-W_O
statistics) run ``serial`` (one after the other, every op on all intra-op threads) or
``side_by_side`` (:class:`CaptureSettings` ``side_by_side_updates``, the default: one
thread each, one intra-op thread each). Interleaved repeats in one process on windows of
the paper's setting (128 tokens, percentile 1, batch 16), wall clock and process CPU time,
the load average before and after, and whether every sum and per-window part is identical.
Writes ``benchmarks/results/context_similarity_corpus.json`` and ``.md``.

    .venv/bin/python benchmarks/bench_context_similarity_corpus.py [--windows 96]
"""
from __future__ import annotations

import argparse
import os
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
    parser.add_argument("--windows", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_encoder(device="cpu")
    wins = windows(load_corpus("brown"), tokenizer, 128, max_windows=args.windows, seed=0)
    runs = {"serial": CaptureSettings(side_by_side_updates=False),
            "side_by_side": CaptureSettings()}
    load_before = os.getloadavg()[0]
    out = {name: corpus_cell(model, tokenizer, wins, s) for name, s in runs.items()}  # warm
    identical = all(same(x, y) for x, y in zip(out["serial"], out["side_by_side"]))
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
    ratio = min(wall["serial"]) / min(wall["side_by_side"])
    per_repeat = sorted(a / b for a, b in zip(wall["serial"], wall["side_by_side"]))
    result = dict(windows=n, threads=args.threads, repeats=args.repeats, identical=identical,
                  load_before=load_before, load_after=load_after, wall=wall, cpu=cpu,
                  ratio_serial_over_side_by_side=ratio,
                  median_ratio=per_repeat[len(per_repeat) // 2])
    lines = [
        "# Context similarity: the chapter's corpus cell, updates serial against side by side",
        "",
        f"{n} windows of 128 tokens from `brown`, batch 16, {args.threads} torch threads, "
        f"best of {args.repeats}, interleaved. Load average (1 min) {load_before:.2f} before, "
        f"{load_after:.2f} after. Sums and per-window parts identical: {identical}.",
        "",
        "| run | best s (wall) | ms/window | best s (CPU) |",
        "|---|---|---|---|",
    ]
    for name in runs:
        lines.append(f"| {name} | {min(wall[name]):.2f} | {1e3 * min(wall[name]) / n:.1f} | "
                     f"{min(cpu[name]):.2f} |")
    lines += ["", f"serial / side_by_side: {ratio:.3f} (best, wall), "
              f"{result['median_ratio']:.3f} (median of the per-repeat ratios)."]
    print("\n".join(lines))
    write_results("context_similarity_corpus", result, "\n".join(lines) + "\n")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
