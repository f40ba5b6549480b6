"""Benchmark: the gradient-flow chapter's paper-scale work, this tree against a baseline commit.

The chapter's paper scale (issue 14: n = 200, H in {1, 10, 100}, 10 paths, dt = 5e-3,
T = 20, 2 threads) runs each simulation as two 5-path pieces on two worker processes with
one torch thread each (``gf.simulate_many``), so its time is the CPU time of a piece's step
times the number of piece-steps, halved. Measured here, one thread, baseline and ours
interleaved in one process (both see the same load):

- CPU ms per step of a 5-path piece of a 10-path run, for every H of the chapter and the
  two kinds of weights (OU with noise and the Itô sums; oscillating without);
- whether every recorded quantity of those runs is identical, bit for bit, and where
  not, the largest relative difference (the baseline's kernel exponentiates with
  ``exp2``, this tree's with ``exp`` on an Intel CPU with MKL and ``exp2`` elsewhere,
  ``KernelTuning.exponential_for``: the same numbers to rounding);
- ``gf.w2_sphere`` on the stability cell's shapes (near-identical clouds of 200 points);
- the start of ``gf.simulate_many`` on 2 workers: a first and a second call;
- the chapter's simulation seconds projected from these (main runs, 4001 steps each; the
  stability runs, 7 OU runs at H = 10 of 2001 steps; on 2 workers).

The baseline is the library at ``--baseline`` (default 1894721, the commit before this
work), read with ``git show`` into a temporary package. Writes
``benchmarks/results/gradient_flow_chapter.json`` and ``.md``.

    .venv/bin/python benchmarks/bench_gradient_flow_chapter.py [--quick] [--baseline REV]
"""
from __future__ import annotations

import argparse
import importlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from companion import gradient_flow as gf
from results_io import write_results

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lib/companion/gradient_flow"
FIELDS = ("times", "positions", "weights", "energy", "energy_rate", "slope_sq", "dissipation",
          "int_slope_sq", "int_dissipation", "int_energy_rate", "martingale",
          "residual_slope", "residual_dissipation", "final_tokens", "final_weights")
MAIN_STEPS, STAB_STEPS = 4001, 2001  # T / dt + 1 evaluations (the end state included)


def load_baseline(rev: str, folder: Path):
    """``companion.gradient_flow`` as of ``rev``, imported as ``gf_baseline``; or None."""
    files = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", rev,
                            PACKAGE + "/"], capture_output=True, text=True)
    if files.returncode != 0:
        return None
    target = folder / "gf_baseline"
    target.mkdir()
    for path in files.stdout.split():
        if not path.endswith(".py"):
            continue
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"],
                              capture_output=True, text=True, check=True).stdout
        (target / Path(path).name).write_text(
            text.replace("companion.gradient_flow", "gf_baseline"))
    sys.path.insert(0, str(folder))
    return importlib.import_module("gf_baseline")


def piece_run(mod, H, kind, steps, seed=0):
    """A 5-path piece of the chapter's 10-path run: ms CPU and wall per step, trajectory."""
    g = torch.Generator().manual_seed(seed)
    x = gf.octahedral_tokens(200, 0.05, g, paths=5)
    D = gf.initial_weights(H, 3, g, paths=5)
    process = mod.OrnsteinUhlenbeck() if kind == "OU" else mod.Oscillating()
    c0, w0 = time.process_time(), time.perf_counter()
    traj = mod.simulate(x, D, process, T=steps * 5e-3, dt=5e-3, record_every=5,
                        generator=torch.Generator().manual_seed(1),
                        tuning=mod.KernelTuning(plan_paths=10),
                        record_positions=(H == 100), record_weights=True)
    cpu = (time.process_time() - c0) / (steps + 1) * 1e3
    wall = (time.perf_counter() - w0) / (steps + 1) * 1e3
    return cpu, wall, traj


def same(a, b) -> bool:
    return all((getattr(a, k) is None and getattr(b, k) is None)
               or torch.equal(getattr(a, k), getattr(b, k)) for k in FIELDS)


def max_relative_difference(a, b) -> float:
    """Largest ``|a - b| / max |a|`` over the recorded quantities of two trajectories."""
    worst = 0.0
    for k in FIELDS:
        x, y = getattr(a, k), getattr(b, k)
        if x is None or y is None:
            continue
        scale = float(x.abs().max()) if x.numel() else 0.0
        if scale > 0:
            worst = max(worst, float((x - y).abs().max()) / scale)
    return worst


def w2_run(mod, reps):
    g = torch.Generator().manual_seed(3)
    x = gf.octahedral_tokens(200, 0.05, g, paths=20).view(2, 10, 200, 3)
    y = x + 1e-3 * torch.randn(x.shape, generator=g, dtype=x.dtype)
    y = y / y.norm(dim=-1, keepdim=True)
    best, out = float("inf"), None
    for _ in range(reps):
        c0 = time.process_time()
        out = mod.w2_sphere(x, y, cost="chordal")
        best = min(best, (time.process_time() - c0) / x.shape[:2].numel() * 1e3)
    return best, out


def start_many(mod):
    """Wall seconds of two consecutive one-step ``simulate_many`` calls on 2 workers."""
    g = torch.Generator().manual_seed(4)
    run = dict(tokens=gf.octahedral_tokens(20, paths=2, generator=g),
               weights=gf.initial_weights(2, 3, g, paths=2), process=mod.Frozen(),
               T=0.01, dt=0.01)
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        mod.simulate_many([run], workers=2)
        times.append(time.perf_counter() - t0)
    return times


def projected_seconds(ms):
    """The chapter's simulation seconds on 2 workers from CPU ms per piece-step."""
    main = sum(2 * MAIN_STEPS * ms[H, kind] for H in (1, 10, 100)
               for kind in ("OU", "oscillating", "oscillating"))  # OU, identical, spread
    stab = 7 * 2 * STAB_STEPS * ms[10, "OU"]
    return {"main_s": main / 2e3, "stability_s": stab / 2e3}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    ap.add_argument("--baseline", default="1894721", help="git revision of the baseline")
    args = ap.parse_args()
    torch.set_num_threads(1)
    reps = 2 if args.quick else 4
    steps = {1: 100, 10: 60, 100: 12} if args.quick else {1: 400, 10: 200, 100: 40}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="gf-baseline-") as tmp:
        base = load_baseline(args.baseline, Path(tmp))
        mods = {"ours": gf} if base is None else {"baseline": base, "ours": gf}
        rows, cpu_ms, identical = [], {name: {} for name in mods}, {}
        for H in (1, 10, 100):
            for kind in ("OU", "oscillating"):
                samples = {name: [] for name in mods}
                trajs = {}
                for rep in range(reps + 1):  # the first round warms up
                    for name, mod in mods.items():
                        cpu, wall, traj = piece_run(mod, H, kind, steps[H])
                        trajs[name] = traj
                        if rep:
                            samples[name].append(cpu)
                for name in mods:
                    cpu_ms[name][H, kind] = statistics.median(samples[name])
                row = {"heads": H, "weights": kind, "steps": steps[H],
                       **{f"{name}_cpu_ms_per_step": cpu_ms[name][H, kind] for name in mods}}
                if base is not None:
                    identical[H, kind] = same(trajs["baseline"], trajs["ours"])
                    row["speedup"] = cpu_ms["baseline"][H, kind] / cpu_ms["ours"][H, kind]
                    row["identical"] = identical[H, kind]
                    row["max_relative_difference"] = max_relative_difference(
                        trajs["baseline"], trajs["ours"])
                rows.append(row)
                print(row, flush=True)
        w2 = {}
        for name, mod in mods.items():
            w2[name] = w2_run(mod, reps)
        w2_identical = base is None or torch.equal(w2["baseline"][1], w2["ours"][1])
        starts = {name: start_many(mod) for name, mod in mods.items()}
    load_after = os.getloadavg()
    projected = {name: projected_seconds(cpu_ms[name]) for name in mods}
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "load_average_before": load_before, "load_average_after": load_after,
        "baseline": None if base is None else args.baseline,
        "pieces": rows,
        "all_identical": all(identical.values()) and w2_identical,
        "w2_ms_per_pair": {name: v[0] for name, v in w2.items()},
        "w2_identical": w2_identical,
        "simulate_many_start_s": starts,
        "projected_chapter_simulation_s": projected,
        "quick": args.quick,
    }
    names = list(mods)
    lines = [
        "## gradient_flow chapter at paper scale: CPU per step of a 5-path piece "
        "(1 thread, float64)",
        "",
        "| H | weights | " + " | ".join(f"{n} ms" for n in names)
        + (" | speedup | identical |" if base is not None else " |"),
        "|---|---|" + "---|" * len(names) + ("---|---|" if base is not None else ""),
    ]
    for r in rows:
        line = f"| {r['heads']} | {r['weights']} | " + " | ".join(
            f"{r[f'{n}_cpu_ms_per_step']:.2f}" for n in names) + " |"
        if base is not None:
            same_text = ("yes" if r["identical"] else f"no (max relative difference "
                         f"{r['max_relative_difference']:.1e})")
            line += f" {r['speedup']:.3f}x | {same_text} |"
        lines.append(line)
    lines += [
        "",
        "w2_sphere, ms CPU per pair of 200-point clouds: " + ", ".join(
            f"{n} {w2[n][0]:.2f}" for n in names)
        + ("" if base is None else f" (identical: {'yes' if w2_identical else '**no**'})."),
        "simulate_many on 2 workers, wall s of a first and a second call: " + "; ".join(
            f"{n} {a:.1f} then {b:.1f}" for n, (a, b) in starts.items()) + ".",
        "Projected chapter simulations on 2 workers (CPU per piece-step x piece-steps / 2): "
        + "; ".join(f"{n}: main {p['main_s']:.0f} s, stability {p['stability_s']:.0f} s"
                    for n, p in projected.items()) + ".",
        f"Machine: {result['machine']}; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after.",
    ]
    write_results("gradient_flow_chapter", result, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
