"""Benchmark: companion.gradient_flow.simulate against the authors'-style einsum baseline.

One step of the multi-head model at the paper's size (n = 200 tokens on S^2, H = 100 heads,
10 Monte Carlo paths, OU weights, float64), measured in the same run and interleaved so
both see the same machine load. Also: agreement of every recorded quantity with the
baseline, the projected paper-scale wall time (4000 steps for each H in {1, 10, 100}), and
peak memory against n (each size in a fresh subprocess).

    .venv/bin/python benchmarks/bench_gradient_flow.py [--quick]

Also the machine's limit for the step: its work (``P H n^2 d`` multiply-adds for the logits,
``P H n^2`` exponentials, about 120 M and 40 M here) at this core's measured float64 GEMM rate
and vectorised exponential rate (the fastest of ``torch.exp``, ``torch.exp2`` and numpy's
``exp`` and ``exp2``, which the kernel's numpy backend uses), and the
fraction of that limit our step reaches.

Also where one step's time goes: self CPU time per torch operator of a warm step at 1 thread
(torch.profiler), with the number of calls per step.

Choices in the library made from one-off measurements (2 MiB-L2 Intel Xeon of the book's
CI; the code keeps the reason, the figures are here):

- ``KernelTuning.block_elements`` = 2**18 on CPU: at n = 200, H = 100, 10 paths, the
  kernel with ``exp``, medians of 5 interleaved runs: 55.8 ms per step at 1 thread,
  against 58.5 with 2**17, 60.5 with 2**19 and 75.2 with 2**16; at 2 threads 43.0,
  against 45.0, 40.2 and 59.4, with overlapping ranges;
- a step's own operations on one intra-op thread: with several, on the loaded 2-core
  machine, a step was 20x slower than on one thread;
- the contraction with the matrices as the left operand: ``[k, d H] @ [d H, n]`` ran 2.5x
  faster than ``[n, d H] @ [d H, k]`` for k = 3, 9 (MKL, float64);
- ``analysis._pairwise_distances`` one coordinate at a time on ``[n, m]`` planes: about
  6x faster than ``np.linalg.norm`` at n = 200, d = 3.

Writes benchmarks/results/gradient_flow.json and .md.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "baselines"))

from einsum_gradient_flow import einsum_step  # noqa: E402

from companion import gradient_flow as gf  # noqa: E402
from results_io import write_results  # noqa: E402

PAPER_STEPS = 4000  # T = 20, dt = 5e-3
TARGET_SPEEDUP = 30.0  # issue 16, per step at the paper's setting, 1 thread


def make_state(n, H, P, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = gf.octahedral_tokens(n, paths=P, generator=g)
    D = gf.initial_weights(H, 3, g, paths=P)
    return x, D, g


def time_ours(x, D, steps, dt=5e-3, cpu=False):
    """Seconds per step of simulate (all recorded quantities, records every 5 steps);
    with ``cpu`` also the process CPU seconds per step (all threads)."""
    g = torch.Generator().manual_seed(1)
    t0, c0 = time.perf_counter(), time.process_time()
    gf.simulate(x, D, gf.OrnsteinUhlenbeck(), T=steps * dt, dt=dt, record_every=5,
                generator=g)
    wall = (time.perf_counter() - t0) / (steps + 1)  # simulate also evaluates the end state
    return (wall, (time.process_time() - c0) / (steps + 1)) if cpu else wall


def time_many(x, D, steps, workers, dt=5e-3):
    """Wall seconds of ``gf.simulate_many`` running one run's paths on ``workers``
    processes: ``(start, total)``, a one-step call (spawning the workers, importing torch)
    and a call of ``steps`` steps on the same workers (simulate_many keeps them)."""
    def call(k):
        run = dict(tokens=x, weights=D, process=gf.OrnsteinUhlenbeck(), T=k * dt, dt=dt,
                   record_every=5, generator=torch.Generator().manual_seed(1))
        t0 = time.perf_counter()
        gf.simulate_many([run], workers=workers)
        return time.perf_counter() - t0
    return call(1), call(steps)


def time_baseline(x, D, dt=5e-3):
    proc = gf.OrnsteinUhlenbeck()
    z = torch.randn(D.shape, dtype=D.dtype)
    dW = dt**0.5 * (z + z.transpose(-1, -2)) / 2
    t0, c0 = time.perf_counter(), time.process_time()
    einsum_step(x, D, proc.drift(D, 0.0), proc.sigma, dW, dt)
    return time.perf_counter() - t0, time.process_time() - c0


def agreement(x, D, dt=5e-3):
    """Max relative difference of every quantity, ours vs baseline, on one state."""
    proc = gf.OrnsteinUhlenbeck()
    f = proc.drift(D, 0.0)
    z = torch.randn(D.shape, dtype=D.dtype, generator=torch.Generator().manual_seed(2))
    dW = dt**0.5 * (z + z.transpose(-1, -2)) / 2
    _, _, ref = einsum_step(x, D, f, proc.sigma, dW, dt)
    ours = gf.step_quantities(x, D, drift=f, sigma=proc.sigma, noise=dW)
    return {k: float(((ours[k] - ref[k]).abs().max() / ref[k].abs().max()).item())
            for k in ref}


def machine_limit(n, H, P, d=3, reps=5):
    """Seconds one step's work takes at this core's float64 GEMM and exponential rates.

    The rates are the best of ``reps`` runs in CPU time (a loaded machine takes the core
    away, not its speed): a 1024^3 GEMM (multiply-adds per second) and the fastest of
    torch's and numpy's ``exp`` and ``exp2`` over 2^16 cache-resident doubles (seconds per
    exponential). The
    work is the paper's step, ``P H n^2 d`` multiply-adds and ``P H n^2`` exponentials;
    the symmetric kernel needs only about half of the exponentials, reported apart.
    """
    a = torch.randn(1024, 1024, dtype=torch.float64)
    v = torch.randn(1 << 16, dtype=torch.float64)
    out = torch.empty_like(v)
    v_np, out_np = v.numpy(), out.numpy()
    exponentials = (lambda: torch.exp(v, out=out), lambda: torch.exp2(v, out=out),
                    lambda: np.exp(v_np, out=out_np), lambda: np.exp2(v_np, out=out_np))
    gemm, exps = [], []
    for _ in range(reps):
        t0 = time.process_time()
        a @ a
        gemm.append(time.process_time() - t0)
        for exponential in exponentials:
            t0 = time.process_time()
            for _ in range(200):
                exponential()
            exps.append((time.process_time() - t0) / (200 * v.numel()))
    macs_per_s = 1024**3 / min(gemm)
    s_per_exp = min(exps)
    work_macs, work_exps = P * H * n * n * d, P * H * n * n
    return {
        "gemm_gmacs_per_s": macs_per_s / 1e9,
        "exp_ns_per_element": s_per_exp * 1e9,
        "work_macs": work_macs,
        "work_exps": work_exps,
        "limit_s_per_step": work_macs / macs_per_s + work_exps * s_per_exp,
        "limit_half_exps_s_per_step": work_macs / macs_per_s + work_exps / 2 * s_per_exp,
    }


def step_profile(x, D, steps=3, top=8):
    """Self CPU milliseconds and calls per step of each torch operator in a warm
    paper-setting step (the call simulate makes every step: drift, noise, 1 thread), the
    ``top`` largest, plus the profiled step's total and its count of operator calls."""
    from torch.profiler import ProfilerActivity, profile

    from companion.gradient_flow.kernels import _Scratch, _step

    proc = gf.OrnsteinUhlenbeck()
    f = proc.drift(D, 0.0)
    z = torch.randn(D.shape, dtype=D.dtype, generator=torch.Generator().manual_seed(3))
    dW = 5e-3**0.5 * (z + z.transpose(-1, -2)) / 2
    scratch = _Scratch()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _step(x, D, -1, f, proc.sigma, dW, scratch)  # plans and buffers made once
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                _step(x, D, -1, f, proc.sigma, dW, scratch)
    finally:
        torch.set_num_threads(before)
    ops = [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
            "calls_per_step": e.count / steps} for e in prof.key_averages()]
    ops.sort(key=lambda o: -o["self_ms_per_step"])
    return {"total_ms_per_step": sum(o["self_ms_per_step"] for o in ops),
            "calls_per_step": sum(o["calls_per_step"] for o in ops), "ops": ops[:top]}


def peak_memory_mb(kind, n, H, P):
    """Peak resident memory increase (MB) of one step, measured in a fresh interpreter.

    Uses VmHWM from /proc (ru_maxrss is inherited across exec on Linux, so a child would
    start with this process's peak).
    """
    code = f"""
import sys, torch
sys.path.insert(0, {str(HERE / 'baselines')!r})
from companion import gradient_flow as gf
from einsum_gradient_flow import einsum_step
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
g = torch.Generator().manual_seed(0)
x = gf.octahedral_tokens({n}, paths={P}, generator=g)
D = gf.initial_weights({H}, 3, g, paths={P})
p = gf.OrnsteinUhlenbeck(); f = p.drift(D, 0.0); dW = 0.01 * (D + D)
gf.step_quantities(x[:, :2], D, drift=f, sigma=p.sigma, noise=dW)  # load kernels
before = hwm()
if {kind!r} == "ours":
    gf.step_quantities(x, D, drift=f, sigma=p.sigma, noise=dW)
else:
    einsum_step(x, D, f, p.sigma, dW, 5e-3)
print(hwm() - before)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, no memory scan")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: both 1 and torch's default)")
    args = ap.parse_args()
    n, H, P = 200, 100, 10
    # interleaved repeats: this machine's speed drifts by up to 1.3x within minutes, and
    # the ratio of one repeat's pair (taken a few seconds apart) follows it least
    reps = 1 if args.quick else 5
    ours_steps = 5 if args.quick else 10
    x, D, _ = make_state(n, H, P)

    default_threads = torch.get_num_threads()
    thread_settings = sorted({1, default_threads}) if args.threads is None else [args.threads]
    speed = {}
    for threads in thread_settings:
        torch.set_num_threads(threads)
        time_ours(x, D, 1)  # warm-up, then interleave so both see the same load
        base_t, ours_t, base_c, ours_c = [], [], [], []
        for _ in range(reps):
            wall, cpu = time_baseline(x, D)
            base_t.append(wall)
            base_c.append(cpu)
            wall, cpu = time_ours(x, D, ours_steps, cpu=True)
            ours_t.append(wall)
            ours_c.append(cpu)
        speed[threads] = {"baseline_s_per_step": statistics.median(base_t),
                          "ours_s_per_step": statistics.median(ours_t),
                          "baseline_runs_s": base_t, "ours_runs_s": ours_t,
                          # CPU seconds (all threads): less sensitive to other processes
                          "baseline_cpu_s_per_step": statistics.median(base_c),
                          "ours_cpu_s_per_step": statistics.median(ours_c)}
        speed[threads]["speedup"] = (speed[threads]["baseline_s_per_step"]
                                     / speed[threads]["ours_s_per_step"])
        # the ratio of each interleaved pair: the target's number (a slow spell of the
        # machine slows both calls of a pair alike)
        paired = [b / o for b, o in zip(base_t, ours_t)]
        speed[threads]["speedup_paired"] = statistics.median(paired)
        speed[threads]["speedup_paired_range"] = (min(paired), max(paired))
        speed[threads]["speedup_cpu"] = (speed[threads]["baseline_cpu_s_per_step"]
                                         / speed[threads]["ours_cpu_s_per_step"])
    torch.set_num_threads(1)
    limit = machine_limit(n, H, P)
    best = min(speed, key=lambda k: speed[k]["ours_s_per_step"])
    torch.set_num_threads(best)
    base = speed[best]["baseline_s_per_step"]
    ours = speed[best]["ours_s_per_step"]
    agree = agreement(x, D)

    per_h, cpu_h = {}, {}
    for h in (1, 10):
        xh, Dh, _ = make_state(n, h, P)
        per_h[h], cpu_h[h] = time_ours(xh, Dh, 20, cpu=True)
    per_h[100] = ours
    paper_ours = PAPER_STEPS * sum(per_h.values())
    # gf.simulate_many (issue 14): the runs' paths on worker processes, one thread each
    workers = max(1, min(os.cpu_count() or 1, default_threads))
    many = None
    if workers > 1:
        torch.set_num_threads(1)
        cpu_h[100] = time_ours(x, D, ours_steps, cpu=True)[1]
        torch.set_num_threads(default_threads)
        many_steps = 100 if args.quick else 400
        threads_s = time_ours(x, D, many_steps) * (many_steps + 1)  # then the processes
        start_s, many_s = time_many(x, D, many_steps, workers)
        many = {"workers": workers, "steps": many_steps, "start_s": start_s,
                "total_s": many_s, "threads_total_s": threads_s, "threads": default_threads,
                "speedup_vs_threads": threads_s / many_s,
                # the chapter's 3 regimes x H in {1, 10, 100}, from 1-thread CPU s/step
                "paper_chapter_runs_minutes_estimate":
                    (3 * PAPER_STEPS * sum(cpu_h.values()) / workers + start_s) / 60,
                "cpu_s_per_step_1_thread_by_heads": cpu_h}
        torch.set_num_threads(best)
    paper_base = PAPER_STEPS * base * (1 + 0.1 + 0.01)  # the baseline's cost is linear in H

    memory = []
    if not args.quick:
        for nn in (100, 200, 400):
            row = {"n": nn, "ours_mb": peak_memory_mb("ours", nn, H, P)}
            row["baseline_mb"] = peak_memory_mb("baseline", nn, H, P) if nn <= 200 else None
            row["dense_PHn2_mb"] = P * H * nn * nn * 8 / 2**20
            memory.append(row)

    profile_1 = step_profile(x, D)
    ours_1 = speed[1]["ours_cpu_s_per_step"] if 1 in speed else None
    limit["fraction_of_limit_1_thread"] = (limit["limit_s_per_step"] / ours_1
                                           if ours_1 else None)
    load = os.getloadavg()
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load average "
                   f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, "
                   f"{torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "cores": os.cpu_count(),
        "load_average": load,
        "torch": torch.__version__,
        "size": {"n": n, "heads": H, "paths": P, "dtype": "float64", "process": "OU"},
        "by_threads": speed, "threads_used_for_estimates": best,
        "baseline_s_per_step": base, "ours_s_per_step": ours, "speedup": base / ours,
        "max_relative_difference": agree,
        "ours_s_per_step_by_heads": per_h,
        "paper_scale_minutes": {"ours": paper_ours / 60, "baseline": paper_base / 60},
        "simulate_many": many,
        "memory": memory,
        "machine_limit": limit,
        "step_profile_1_thread": profile_1,
        "quick": args.quick,
    }
    lines = [
        "## gradient_flow: multi-head flow step, n=200, H=100, 10 paths (float64, OU)",
        "",
        f"{reps} interleaved repeats (one baseline step, then {ours_steps} of ours) per "
        "thread setting; seconds per step are medians over the repeats.",
        "",
        "| torch threads | einsum baseline ([P,H,n,n] tensors) s/step "
        "| companion.gradient_flow.simulate s/step | speedup: median of the repeats' "
        "ratios (min-max) | ratio of the medians | speedup in CPU time "
        "(baseline / ours CPU s/step) |",
        "|---|---|---|---|---|---|",
        *[f"| {k} | {v['baseline_s_per_step']:.3f} | {v['ours_s_per_step']:.4f} "
          f"| {v['speedup_paired']:.1f}x ({v['speedup_paired_range'][0]:.1f}-"
          f"{v['speedup_paired_range'][1]:.1f}) "
          f"| {v['speedup']:.1f}x | {v['speedup_cpu']:.1f}x "
          f"({v['baseline_cpu_s_per_step']:.3f} / {v['ours_cpu_s_per_step']:.4f}) |"
          for k, v in speed.items()],
        "",
        *([f"Target (issue 16): >= {TARGET_SPEEDUP:.0f}x the baseline at 1 thread "
           f"(median of the repeats' ratios): {speed[1]['speedup_paired']:.1f}x, "
           + ("met." if speed[1]["speedup_paired"] >= TARGET_SPEEDUP else "missed.")]
          if 1 in speed else []),
        f"Machine: {result['machine']}.",
        "",
        f"Max relative difference of recorded quantities: {max(agree.values()):.1e}.",
        f"Machine limit, 1 thread: {limit['work_macs'] / 1e6:.0f} M multiply-adds at "
        f"{limit['gemm_gmacs_per_s']:.1f} G/s (float64 GEMM) and "
        f"{limit['work_exps'] / 1e6:.0f} M exponentials at "
        f"{limit['exp_ns_per_element']:.2f} ns (vectorised exp): "
        f"{limit['limit_s_per_step'] * 1e3:.1f} ms per step "
        f"({limit['limit_half_exps_s_per_step'] * 1e3:.1f} ms with half the exponentials, "
        "as U^h is symmetric)"
        + (f"; ours ({ours_1 * 1e3:.1f} ms CPU per step) reaches "
           f"{limit['fraction_of_limit_1_thread']:.0%} of it." if ours_1 else "."),
        f"Paper-scale run ({best} thread(s); 4000 steps, H in {{1, 10, 100}}, 10 paths, "
        "one regime): "
        f"ours {paper_ours / 60:.1f} min, baseline {paper_base / 60:.1f} min (projected).",
    ]
    lines += ["", f"Where one step's time goes (torch.profiler, 1 thread, "
              f"{profile_1['total_ms_per_step']:.1f} ms of self CPU time per profiled step, "
              f"{profile_1['calls_per_step']:.0f} operator calls):", "",
              "| operator | self CPU ms per step | calls per step |", "|---|---|---|",
              *[f"| {o['op']} | {o['self_ms_per_step']:.1f} | {o['calls_per_step']:.0f} |"
                for o in profile_1["ops"]]]
    if many:
        lines += ["", f"gf.simulate_many, one paper-setting run (H = 100, {many['steps']} steps) "
                  f"on {many['workers']} processes: {many['total_s']:.1f} s (on workers kept "
                  f"from a first call, which started them in {many['start_s']:.1f} s), "
                  f"against simulate on {many['threads']} "
                  f"threads {many['threads_total_s']:.1f} s "
                  f"({many['speedup_vs_threads']:.2f}x). The chapter's 9 paper runs "
                  f"(3 regimes, H in {{1, 10, 100}}) from the 1-thread CPU time per step: "
                  f"about {many['paper_chapter_runs_minutes_estimate']:.1f} min on "
                  f"{many['workers']} processes."]
    if memory:
        lines += ["", "| n | ours peak MB | baseline peak MB | one P*H*n^2 float64 tensor MB |",
                  "|---|---|---|---|"]
        for r in memory:
            b = "-" if r["baseline_mb"] is None else f"{r['baseline_mb']:.0f}"
            lines.append(f"| {r['n']} | {r['ours_mb']:.0f} | {b} | {r['dense_PHn2_mb']:.0f} |")
    write_results("gradient_flow", result, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
