"""Benchmark: what a user calls (``gf.simulate``) against its step kernel and the authors'
engine, in one run, at the paper's setting (issue 38).

n = 200 tokens on S^2, H = 100 heads, 10 Monte Carlo paths, float64, Ornstein–Uhlenbeck
weights, 1 torch thread. Three timings per repeat, interleaved so that all three see the
same machine load (this shared machine's speed drifts by up to 1.3x within minutes):

- **kernel**: the step kernel alone, ``companion.gradient_flow.kernels._step``, called as
  ``simulate`` calls it every step (drift, weight noise, the Itô term, scratch buffers and
  kernel plan reused from a warm-up call), ``KERNEL_STEPS`` calls on one state;
- **public path**: ``gf.simulate`` over ``SIMULATE_STEPS`` steps (records every 5 steps,
  positions recorded, as the chapter's paper runs), seconds per evaluated state (a run of
  ``k`` steps evaluates ``k + 1`` states);
- **authors' engine**: one step of ``benchmarks/baselines/einsum_gradient_flow.py``.

The authors' engine is represented by that einsum twin, reused as it stands: their
package ``attn_sphere`` (MIT) is not vendored in this repository, and the twin is the same
computation done the same way (every quantity of a step from dense
``[paths, heads, n, n]`` float64 tensors: logits, exponentials, softmax weights and the
bilinear forms of drift and noise), written from the paper's equations.

The ratios are medians of each repeat's own ratio (the pair or triple of one repeat is
taken seconds apart, so a slow spell slows all of them alike). A fourth number does not
depend on the drift at all: inside the same ``simulate`` calls, the share of the wall
time spent in the step kernel (:func:`time_in_kernel` wraps the kernel simulate calls and
adds up its time); ``simulate`` over that time is the public path's overhead factor
measured within one call.

Targets (issue 38, item 1): public path at most 1.15x its kernel, at least 30x faster
than the authors' engine, both at 1 thread.

    .venv/bin/python benchmarks/bench_gradient_flow_public.py [--quick]

Writes benchmarks/results/gradient_flow_public.json and .md.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "baselines"))

from einsum_gradient_flow import einsum_step  # noqa: E402

from companion import gradient_flow as gf  # noqa: E402
from companion.gradient_flow import simulation  # noqa: E402
from companion.gradient_flow.kernels import _Scratch, _step  # noqa: E402
from results_io import write_results  # noqa: E402

TARGET_OVER_KERNEL = 1.15  # issue 38: simulate at most 1.15x its step kernel
TARGET_OVER_ENGINE = 30.0  # issue 38: simulate at least 30x faster than the authors' engine
DT = 5e-3  # the paper's step
RECORD_EVERY = 5  # the paper's records


def make_state(n, H, P, seed=0):
    """The paper's initial condition: octahedral tokens, ``D_h = Z + Z^T`` weights."""
    g = torch.Generator().manual_seed(seed)
    return gf.octahedral_tokens(n, paths=P, generator=g), gf.initial_weights(H, 3, g, paths=P)


def kernel_inputs(D, dt=DT, seed=3):
    """The per-step arguments simulate hands the kernel at an OU step: the drift, sigma
    and one symmetric noise increment ``sqrt(dt) (Z + Z^T) / 2``."""
    process = gf.OrnsteinUhlenbeck()
    z = torch.randn(D.shape, dtype=D.dtype, generator=torch.Generator().manual_seed(seed))
    return process.drift(D, 0.0), process.sigma, math.sqrt(dt) * (z + z.transpose(-1, -2)) / 2


def time_kernel(x, D, steps, scratch):
    """Seconds per call of the step kernel on one intra-op thread, as simulate calls it
    (``scratch`` already holds the plan and buffers: simulate makes them at its first
    step)."""
    drift, sigma, noise = kernel_inputs(D)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            _step(x, D, -1, drift, sigma, noise, scratch, 1)
        return (time.perf_counter() - t0) / steps
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def time_in_kernel():
    """Inside: every step kernel call simulate makes is timed; yields a dict whose
    ``"seconds"`` and ``"calls"`` add up those calls. simulate's kernel is put back on
    leaving."""
    tally = {"seconds": 0.0, "calls": 0}
    kernel = simulation._step

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return kernel(*args, **kwargs)
        finally:
            tally["seconds"] += time.perf_counter() - t0
            tally["calls"] += 1

    simulation._step = timed
    try:
        yield tally
    finally:
        simulation._step = kernel


def time_public(x, D, steps):
    """``(seconds per evaluated state, seconds per state inside the kernel)`` of one
    ``gf.simulate`` call of ``steps`` OU steps (``steps + 1`` states evaluated)."""
    with time_in_kernel() as tally:
        t0 = time.perf_counter()
        gf.simulate(x, D, gf.OrnsteinUhlenbeck(), T=steps * DT, dt=DT,
                    record_every=RECORD_EVERY, generator=torch.Generator().manual_seed(1))
        wall = time.perf_counter() - t0
    assert tally["calls"] == steps + 1, tally
    return wall / (steps + 1), tally["seconds"] / (steps + 1)


def time_engine(x, D):
    """Seconds of one step of the authors' engine (the einsum twin)."""
    drift, sigma, noise = kernel_inputs(D)
    t0 = time.perf_counter()
    einsum_step(x, D, drift, sigma, noise, DT)
    return time.perf_counter() - t0


def cpu_steal():
    """``(steal, total)`` jiffies of all CPUs from /proc/stat, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except OSError:
        return None
    return fields[7], sum(fields)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats and steps")
    args = ap.parse_args()
    n, H, P = 200, 100, 10
    reps = 3 if args.quick else 7
    kernel_steps = 5 if args.quick else 10
    public_steps = 5 if args.quick else 10
    torch.set_num_threads(1)
    x, D = make_state(n, H, P)
    scratch = _Scratch()
    time_kernel(x, D, 1, scratch)  # the kernel's plan and buffers, as simulate's first step
    time_public(x, D, 1)
    load_before, steal_before = os.getloadavg(), cpu_steal()
    kernel_t, public_t, inside_t, engine_t = [], [], [], []
    for _ in range(reps):
        kernel_t.append(time_kernel(x, D, kernel_steps, scratch))
        wall, inside = time_public(x, D, public_steps)
        public_t.append(wall)
        inside_t.append(inside)
        engine_t.append(time_engine(x, D))
    load_after, steal_after = os.getloadavg(), cpu_steal()
    steal = None
    if steal_before and steal_after and steal_after[1] > steal_before[1]:
        steal = (steal_after[0] - steal_before[0]) / (steal_after[1] - steal_before[1])

    def paired(num, den):
        ratios = [a / b for a, b in zip(num, den)]
        return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}

    med = statistics.median
    result = {
        "size": {"n": n, "heads": H, "paths": P, "dtype": "float64", "process": "OU",
                 "dt": DT, "record_every": RECORD_EVERY, "torch_threads": 1},
        "repeats": reps, "kernel_steps": kernel_steps, "public_steps": public_steps,
        "kernel_s_per_step": med(kernel_t), "public_s_per_step": med(public_t),
        "engine_s_per_step": med(engine_t),
        "kernel_runs_s": kernel_t, "public_runs_s": public_t, "engine_runs_s": engine_t,
        "public_inside_kernel_runs_s": inside_t,
        "public_over_kernel": paired(public_t, kernel_t),
        "public_over_its_own_kernel_time": paired(public_t, inside_t),
        "engine_over_public": paired(engine_t, public_t),
        "engine_over_kernel": paired(engine_t, kernel_t),
        "load_average_before": load_before, "load_average_after": load_after,
        "steal_fraction": steal, "cores": os.cpu_count(), "torch": torch.__version__,
        "quick": args.quick,
    }
    over_kernel = result["public_over_kernel"]["median"]
    over_engine = result["engine_over_public"]["median"]

    def row(name, key):
        r = result[key]
        return f"| {name} | {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f}) |"

    steal_text = "" if steal is None else f", steal {steal:.0%} of the CPU time meanwhile"
    lines = [
        "## gradient_flow: public path (gf.simulate) against its kernel and the authors' "
        "engine, n=200, H=100, 10 paths (float64, OU, 1 thread)",
        "",
        f"{reps} interleaved repeats (kernel {kernel_steps} calls, simulate {public_steps} "
        "steps, one step of the engine); medians of the repeats (min-max).",
        "",
        "| | s/step |",
        "|---|---|",
        f"| step kernel (`kernels._step`, as simulate calls it) | {med(kernel_t):.4f} |",
        f"| public path (`gf.simulate`, per evaluated state) | {med(public_t):.4f} |",
        f"| authors' engine (einsum twin of `attn_sphere`) | {med(engine_t):.3f} |",
        "",
        "| ratio | median of the repeats' ratios (min-max) |",
        "|---|---|",
        row("public path / step kernel", "public_over_kernel"),
        row("public path / its own time inside the kernel (same calls)",
            "public_over_its_own_kernel_time"),
        row("authors' engine / public path", "engine_over_public"),
        row("authors' engine / step kernel", "engine_over_kernel"),
        "",
        f"Targets (issue 38): public path <= {TARGET_OVER_KERNEL}x its kernel: "
        f"{over_kernel:.3f}x, " + ("met" if over_kernel <= TARGET_OVER_KERNEL else "missed")
        + f"; >= {TARGET_OVER_ENGINE:.0f}x the authors' engine: {over_engine:.1f}x, "
        + ("met." if over_engine >= TARGET_OVER_ENGINE else "missed."),
        f"Machine: {os.cpu_count()} cores, load average {load_before[0]:.2f} before and "
        f"{load_after[0]:.2f} after (1 min){steal_text}; torch {torch.__version__}.",
    ]
    write_results("gradient_flow_public", result, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
