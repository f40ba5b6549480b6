"""Benchmark: limit reachability R, depth L* and Hasse diagram of attention masks.

Ours: ``companion.hasse.reachability.order_structure`` (bit-packed closure + transitive
reduction in one topological sweep, lockstep bit-parallel BFS for the depth).
Baselines, measured in the same run on the same masks:

- networkx: ``transitive_closure(G, reflexive=True)`` + ``condensation`` +
  ``transitive_reduction`` (no depth: networkx has no direct equivalent, so the baseline
  does strictly less work than ours);
- matmul: the same three results by repeated float squaring (``method="matmul"``).

Masks: causal, sliding window (width 64) and random (edge probability 4/n), for
n = 256, 1024, 4096, plus n = 8192 for ours alone (the scale target). Baselines run in a
child process under a time limit; a run that hits the limit is reported as a lower bound
(">= limit") and so is its speed-up ratio.

Long sequences (issue 16, target 5: n = 32768, each mask <= 30 s and <= 2 GiB):
``packed_order_structure`` from the mask's packed ``A`` (causal and sliding window from
their ``mask_mod``, packed a block of rows at a time; random from its edge list,
``masks.random_edges``), never an ``n x n`` bool array. Each mask runs in a fresh child
process, which reports its time (building ``A`` included) and its peak resident memory
(``ru_maxrss``, the interpreter and torch included; the memory after imports is given
too).

Choices in the library made from one-off measurements (the 2-core machine of the book's
CI; the code keeps the reason, the figures are here): ``packed_adjacency`` evaluates its
blocks on one intra-op thread, since synchronising threads for each small element-wise
operation made building ``A`` of a sliding window at n = 32768 2-3x slower on that
machine under load; the depth of interval masks in closed form (``hasse.depth``): a
sliding window of width 64 at n = 32768 has 521 levels, 0.1 s instead of 25 s by the
level-by-level search.

Usage: ``.venv/bin/python benchmarks/bench_reachability.py [--quick] [--long-only]
[--long-n N]``. Writes ``benchmarks/results/reachability.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import platform
import sys
import time

import numpy as np
import torch

from companion.hasse import masks as M
from companion.hasse.reachability import mask_graph, order_structure
from results_io import write_results



def make_mask(kind: str, n: int) -> torch.Tensor:
    if kind == "causal":
        return M.causal(n)
    if kind == "window64":
        return M.sliding_window(n, 64)
    if kind == "random4/n":
        return M.random_mask(n, 4.0 / n, generator=torch.Generator().manual_seed(n))
    raise ValueError(kind)


def run_networkx(kind: str, n: int):
    import networkx as nx

    mask = make_mask(kind, n)
    start = time.perf_counter()
    g = mask_graph(mask)
    closure = nx.transitive_closure(g, reflexive=True)
    cond = nx.condensation(g)
    hasse = nx.transitive_reduction(cond)
    seconds = time.perf_counter() - start
    return seconds, {
        "R_entries": closure.number_of_edges(),
        "classes": hasse.number_of_nodes(),
        "hasse_edges": hasse.number_of_edges(),
    }


def run_ours(kind: str, n: int, method: str = "bitset"):
    mask = make_mask(kind, n)
    start = time.perf_counter()
    res = order_structure(mask, method=method)
    seconds = time.perf_counter() - start
    return seconds, {
        "R_entries": int(res.R.sum()),
        "classes": res.hasse.number_of_nodes(),
        "hasse_edges": res.hasse.number_of_edges(),
        "depth": res.depth,
    }


def run_long(kind: str, n: int):
    """Time and peak memory of R (packed), depth and Hasse diagram at long n, in this
    (fresh) process."""
    import resource

    from companion.hasse.reachability import (packed_adjacency, packed_adjacency_from_edges,
                                              packed_order_structure)

    after_imports = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if kind == "random4/n":
        q, k = M.random_edges(n, 4.0 / n, generator=torch.Generator().manual_seed(n))
        packed = packed_adjacency_from_edges(q, k, n)
        del q, k
    else:
        mod = M.causal_mask_mod if kind == "causal" else M.sliding_window_mask_mod(64)
        packed = packed_adjacency(mod, n)
    built = time.perf_counter()
    res = packed_order_structure(packed)
    seconds = time.perf_counter() - start
    return seconds, {
        "build_A_s": built - start,
        "R_entries": int(np.bitwise_count(res.reach).sum()),
        "classes": res.hasse.number_of_nodes(),
        "hasse_edges": res.hasse.number_of_edges(),
        "depth": res.depth,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_after_imports_bytes": after_imports * 1024,
    }


def _child(conn, fn, args):
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    conn.send("ready")  # imports done: the time limit starts now
    conn.send(fn(*args))
    conn.close()


def timed_in_child(fn, args, limit: float):
    """Run ``fn(*args)`` in a child process; return (seconds, info) or (None, None) when
    the time limit is hit."""
    ctx = mp.get_context("spawn")  # fork after OpenMP initialisation can hang the child
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, fn, args))
    proc.start()
    child.close()
    if parent.poll(300.0):
        parent.recv()  # "ready"
    if parent.poll(limit):
        result = parent.recv()
        proc.join()
        return result
    proc.kill()
    proc.join()
    return None, None


def best_of(fn, args, repeats):
    best, info = math.inf, None
    for _ in range(repeats):
        seconds, info = fn(*args)
        best = min(best, seconds)
    return best, info


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="n = 256, 1024 and 8192 only")
    parser.add_argument("--limit", type=float, default=None, help="baseline time limit (s)")
    parser.add_argument("--long-only", action="store_true",
                        help="only the long-sequence rows (n = --long-n)")
    parser.add_argument("--long-n", type=int, default=32768, help="n of the long rows")
    args = parser.parse_args(argv)
    sizes = [256, 1024] if args.quick else [256, 1024, 4096]
    limit = args.limit or (30.0 if args.quick else 150.0)
    kinds = ["causal", "window64", "random4/n"]
    torch.set_num_threads(2)
    rows = []
    start_all = time.perf_counter()
    long_rows = []
    for kind in kinds:
        seconds, info = timed_in_child(run_long, (kind, args.long_n), 600.0)
        row = {"mask": kind, "n": args.long_n, "seconds": seconds, "timed_out": seconds is None,
               **(info or {})}
        long_rows.append(row)
        print(_format_long(row), flush=True)
    if args.long_only:
        report = {"benchmark": "reachability_long", "machine": _machine(), "long_rows": long_rows,
                  "wall_seconds": time.perf_counter() - start_all}
        write_results("reachability_long", report, _markdown_long(report))
        return
    for n in sizes + [8192]:
        for kind in kinds:
            repeats = 3 if n <= 1024 else 1
            ours_s, ours = best_of(run_ours, (kind, n), repeats)
            row = {"mask": kind, "n": n, "ours_s": ours_s, **ours}
            if n in sizes:
                nx_s, nx_info = timed_in_child(run_networkx, (kind, n), limit)
                row["networkx_s"] = nx_s
                row["networkx_lower_bound"] = nx_s is None
                if nx_info is not None:
                    row["agrees_with_networkx"] = all(
                        nx_info[key] == ours[key] for key in ("R_entries", "classes", "hasse_edges")
                    )
                mm_limit = limit if n <= 1024 else min(limit, 60.0)
                mm_s, mm_info = timed_in_child(run_ours, (kind, n, "matmul"), mm_limit)
                row["matmul_s"] = mm_s
                row["matmul_lower_bound"] = mm_s is None
                if mm_info is not None:
                    row["agrees_with_matmul"] = mm_info == ours
                row["speedup_vs_networkx"] = (nx_s if nx_s is not None else limit) / ours_s
                row["speedup_vs_matmul"] = (mm_s if mm_s is not None else mm_limit) / ours_s
                row["_limits"] = {"networkx": limit, "matmul": mm_limit}
            rows.append(row)
            print(_format_row(row), flush=True)

    growth = {}
    for kind in kinds:
        pts = [(r["n"], r["ours_s"]) for r in rows if r["mask"] == kind]
        x, y = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
        growth[kind] = float(np.polyfit(x, y, 1)[0])
    target = {r["mask"]: r["ours_s"] for r in rows if r["n"] == 8192}
    report = {
        "benchmark": "reachability",
        "quick": args.quick,
        "machine": _machine(),
        "baseline_time_limit_s": limit,
        "rows": rows,
        "growth_exponent_ours": growth,
        "target_n8192_seconds": target,
        "target_n8192_total_seconds": sum(target.values()),
        "long_rows": long_rows,
        "wall_seconds": time.perf_counter() - start_all,
    }
    write_results("reachability", report, _markdown(report) + "\n" + _markdown_long(report))


def _machine():
    return {
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "load_average_at_end": os.getloadavg(),
    }


_GIB = 2**30
LONG_TARGET_SECONDS, LONG_TARGET_BYTES = 30.0, 2 * _GIB


def _format_long(row):
    if row["timed_out"]:
        return f"{row['mask']:>10} n={row['n']}  timed out"
    return (f"{row['mask']:>10} n={row['n']}  {row['seconds']:.2f} s (A {row['build_A_s']:.2f} s)"
            f"  peak {row['peak_rss_bytes'] / _GIB:.2f} GiB  depth {row['depth']}"
            f"  classes {row['classes']}  hasse edges {row['hasse_edges']}")


def _markdown_long(report):
    machine = report["machine"]
    lines = [
        f"## Long sequences: packed R, depth and Hasse diagram "
        f"(target <= {LONG_TARGET_SECONDS:.0f} s and <= {LONG_TARGET_BYTES / _GIB:.0f} GiB each)",
        "",
        f"Machine: {machine['cpus']} CPUs, torch {machine['torch']}, load average at end "
        f"{', '.join(f'{x:.1f}' for x in machine['load_average_at_end'])}.",
        "",
        "| mask | n | seconds | of which A | peak RSS (GiB) | after imports (GiB) | depth "
        "| classes | Hasse edges | target |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["long_rows"]:
        if r["timed_out"]:
            lines.append(f"| {r['mask']} | {r['n']} | > 600 | | | | | | | missed |")
            continue
        met = r["seconds"] <= LONG_TARGET_SECONDS and r["peak_rss_bytes"] <= LONG_TARGET_BYTES
        lines.append(
            f"| {r['mask']} | {r['n']} | {r['seconds']:.2f} | {r['build_A_s']:.2f} "
            f"| {r['peak_rss_bytes'] / _GIB:.2f} | {r['rss_after_imports_bytes'] / _GIB:.2f} "
            f"| {r['depth']} | {r['classes']} | {r['hasse_edges']} "
            f"| {'met' if met else 'missed'} |")
    return "\n".join(lines) + "\n"


def _fmt_time(seconds, lower_bound, limit):
    if lower_bound:
        return f">= {limit:.0f}"
    return "-" if seconds is None else f"{seconds:.3f}"


def _fmt_ratio(row, key, lb_key):
    if key not in row:
        return "-"
    prefix = ">= " if row[lb_key] else ""
    return f"{prefix}{row[key]:.0f}x" if row[key] >= 10 else f"{prefix}{row[key]:.1f}x"


def _format_row(row):
    limits = row.get("_limits", {})
    return (
        f"{row['mask']:>10} n={row['n']:>5}  ours {row['ours_s']:.3f}s  depth {row['depth']:>4}"
        f"  classes {row['classes']:>5}  hasse edges {row['hasse_edges']:>5}"
        + (
            f"  networkx "
            f"{_fmt_time(row['networkx_s'], row['networkx_lower_bound'], limits['networkx'])}s"
            f" ({_fmt_ratio(row, 'speedup_vs_networkx', 'networkx_lower_bound')})"
            f"  matmul {_fmt_time(row['matmul_s'], row['matmul_lower_bound'], limits['matmul'])}s"
            f" ({_fmt_ratio(row, 'speedup_vs_matmul', 'matmul_lower_bound')})"
            if "networkx_s" in row
            else ""
        )
    )


def _markdown(report):
    lines = [
        "# Reachability benchmark: R, depth and Hasse diagram",
        "",
        f"Machine: {report['machine']['cpus']} CPUs, torch threads "
        f"{report['machine']['torch_threads']}, load average at end "
        f"{', '.join(f'{x:.1f}' for x in report['machine']['load_average_at_end'])}. "
        f"Baselines capped at {report['baseline_time_limit_s']:.0f} s "
        "(\">=\" marks a lower bound).",
        "",
        "| mask | n | ours (s) | depth | classes | Hasse edges | networkx (s) | speed-up "
        "| matmul (s) | speed-up | agrees |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lim = r.get("_limits", {})
        agrees = [r[k] for k in ("agrees_with_networkx", "agrees_with_matmul") if k in r]
        nx_time = _fmt_time(r.get("networkx_s"), r.get("networkx_lower_bound"), lim.get("networkx"))
        lines.append(
            f"| {r['mask']} | {r['n']} | {r['ours_s']:.3f} | {r['depth']} | {r['classes']} "
            f"| {r['hasse_edges']} "
            f"| {nx_time} "
            f"| {_fmt_ratio(r, 'speedup_vs_networkx', 'networkx_lower_bound')} "
            f"| {_fmt_time(r.get('matmul_s'), r.get('matmul_lower_bound'), lim.get('matmul', 0))} "
            f"| {_fmt_ratio(r, 'speedup_vs_matmul', 'matmul_lower_bound')} "
            f"| {'yes' if agrees and all(agrees) else ('-' if not agrees else 'NO')} |"
        )
    lines += [
        "",
        "Growth of our time with n (slope of log time vs log n): "
        + ", ".join(f"{k} {v:.2f}" for k, v in report["growth_exponent_ours"].items()),
        "",
        "n = 8192 (target 5 s per mask): "
        + ", ".join(f"{k} {v:.2f} s" for k, v in report["target_n8192_seconds"].items())
        + f"; all three {report['target_n8192_total_seconds']:.2f} s.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
