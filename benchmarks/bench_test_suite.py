"""Benchmark: does ``make test`` keep both cores busy? (issue 38, item 3)

Runs the test command of the Makefile's ``test`` target (read from the Makefile, so the
two cannot drift apart) and measures its wall time and the CPU time of the whole process
tree (pytest, its xdist workers and every process they start and wait for:
``RUSAGE_CHILDREN``). The floor is the CPU seconds over the cores: what a perfectly
packed run would take on this machine. The ratio wall / floor is the target's quantity,
at most 1.2: above it, a long test file runs alone at the end while a core idles, or the
suite waits on something other than computation.

The hypervisor's steal (``/proc/stat``) over the run is reported beside it: a shared
virtual machine's cores lose that share of their time, which slows wall and CPU alike
and so hardly moves the ratio.

    .venv/bin/python benchmarks/bench_test_suite.py [--quick] [--repeats N] [-- pytest args]

Extra pytest arguments after ``--`` replace the suite's paths (e.g. one test file, to try
the benchmark itself). Writes benchmarks/results/test_suite.json and .md.
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from results_io import write_results

ROOT = Path(__file__).resolve().parent.parent
TARGET = 1.2  # issue 38: make test at most 1.2x its CPU seconds over the cores


def test_command() -> list[str]:
    """The pytest command of the Makefile's ``test`` target, with this interpreter."""
    text = (ROOT / "Makefile").read_text()
    match = re.search(r"^test:.*\n\t\$\(PY\) (-m pytest[^\n]*)", text, flags=re.M)
    if match is None:
        raise SystemExit("Makefile: no `test:` target running `$(PY) -m pytest ...`")
    return [sys.executable, *shlex.split(match.group(1))]


def steal_counters() -> tuple[int, int] | None:
    """(steal, total) jiffies of all CPUs from /proc/stat, or None where there is none."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except OSError:
        return None
    values = [int(v) for v in fields[1:9]]
    return values[7], sum(values)


def run_once(cmd: list[str]) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    steal0 = steal_counters()
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    steal1 = steal_counters()
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"the test command failed (exit {proc.returncode}): "
                         f"{shlex.join(cmd)}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    cores = len(os.sched_getaffinity(0))
    steal = None
    if steal0 and steal1 and steal1[1] > steal0[1]:
        steal = 100.0 * (steal1[0] - steal0[0]) / (steal1[1] - steal0[1])
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    return {"wall_s": wall, "cpu_s": cpu, "cores": cores, "floor_s": cpu / cores,
            "ratio": wall / (cpu / cores), "steal_percent": steal,
            "load_average": Path("/proc/loadavg").read_text().split()[:3],
            "pytest": tail}


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of the suite (minutes each; the median is reported)")
    parser.add_argument("--quick", action="store_true",
                        help="accepted with the other benchmarks' (make bench "
                             "BENCH_ARGS=--quick): the suite runs once either way")
    parser.add_argument("pytest_args", nargs="*",
                        help="after --: paths or options replacing the suite's paths")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats: expected a positive int, got {args.repeats}")
    cmd = test_command() + list(args.pytest_args)
    runs = []
    for repeat in range(args.repeats):
        print(f"run {repeat + 1}/{args.repeats}: {shlex.join(cmd)}", flush=True)
        runs.append(run_once(cmd))
        r = runs[-1]
        print(f"  wall {r['wall_s']:.0f} s, CPU {r['cpu_s']:.0f} s on {r['cores']} cores "
              f"(floor {r['floor_s']:.0f} s): {r['ratio']:.2f}x; {r['pytest']}", flush=True)
    ratio = statistics.median(r["ratio"] for r in runs)
    result = {"command": shlex.join(cmd), "runs": runs, "ratio_median": ratio,
              "target": TARGET, "met": ratio <= TARGET,
              "whole_suite": not args.pytest_args}
    rows = "\n".join(
        f"| {i + 1} | {r['wall_s']:.0f} | {r['cpu_s']:.0f} | {r['cores']} | "
        f"{r['floor_s']:.0f} | {r['ratio']:.2f} | "
        f"{percent(r['steal_percent'])} | "
        f"{' '.join(r['load_average'])} |" for i, r in enumerate(runs))
    scope = "the whole suite" if not args.pytest_args else "a part of the suite: " + \
        " ".join(args.pytest_args)
    markdown = (
        "## make test: wall time against its CPU seconds over the cores\n\n"
        f"`{result['command']}` ({scope}).\n\n"
        "| run | wall s | CPU s | cores | floor s | wall / floor | steal % | load after |\n"
        "|---|---|---|---|---|---|---|---|\n" + rows + "\n\n"
        f"Median wall / floor **{ratio:.2f}** against the target of at most {TARGET}: "
        f"{'met' if result['met'] else 'not met'}.\n")
    write_results("test_suite", result, markdown)


if __name__ == "__main__":
    main()
