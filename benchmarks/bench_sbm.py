"""Benchmark: SBM attention on sampled edges against dense masked attention and SDPA.

For n in {512, ..., 8192} and expected densities {1%, 5%, 20%} (batch 1, 2 heads,
head_dim 32, k = 128 clusters), forward + backward of

* ``edge``: fastRG sampling (:func:`companion.sbm.fastrg_sample`) + edge attention
  (:func:`companion.sbm.edge_attention`) -- cost O(edges);
* ``dense_masked``: the public code's path -- dense P, Bernoulli mask, softmax, mask,
  renormalise (:func:`companion.sbm.dense_masked_attention`) -- cost O(n^2);
* ``sdpa``: dense unmasked ``torch.nn.functional.scaled_dot_product_attention`` (a fused
  flash kernel on CPU too), the fastest dense baseline.

The two dense paths cost the same at every density (the mask only changes values), so
they are measured once per n (dense_masked at 5%) and their numbers are repeated.

Memory method.  torch's CPU allocator keeps no statistics and ``tracemalloc`` does not
see torch allocations, so each (n, method[, density]) runs in a fresh subprocess with
``MALLOC_MMAP_THRESHOLD_=65536`` (every buffer >= 64 KiB is its own mmap, returned to
the OS when freed, so the resident set tracks live tensors).  After the inputs exist,
the kernel's resident-set high-water mark is reset (``echo 5 > /proc/self/clear_refs``),
one forward + backward runs, and the peak is ``VmHWM - RSS before``: the memory the
method itself needed, gradients included.  Times are the median of repeated runs after
that first one, in the same subprocess.  Workers run with one torch thread
(``BENCH_THREADS`` to change): the machine is shared, and spin-waiting OpenMP threads on
an oversubscribed CPU were up to ten times slower in trials.

A second sweep times the sampler alone at a fixed expected edge count while n grows,
to show that its cost follows edges + n k, not n^2.

Run: ``.venv/bin/python benchmarks/bench_sbm.py [--quick]``; writes
``benchmarks/results/sbm.json`` and ``sbm.md`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HEADS, HEAD_DIM, CLUSTERS = 2, 32, 128
# one thread per worker: this machine is shared, and OpenMP threads that spin-wait on an
# oversubscribed CPU made every method up to 10x slower (and noisy) in trials
THREADS = int(os.environ.get("BENCH_THREADS", "1"))
RESULTS = Path(__file__).resolve().parent / "results"


# ---------------------------------------------------------------------------------------
# worker: one configuration in a fresh process
# ---------------------------------------------------------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _peak_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _memberships(n: int, density: float, seed: int):
    """Sigmoid memberships and softmax blocks, Qhat scaled so that mean(P) = density."""
    import torch

    g = torch.Generator().manual_seed(seed)
    qm = torch.sigmoid(torch.randn(1, HEADS, n, CLUSTERS, generator=g))
    km = torch.sigmoid(torch.randn(1, HEADS, n, CLUSTERS, generator=g))
    s = torch.softmax(torch.randn(HEADS, CLUSTERS * CLUSTERS, generator=g), -1)
    s = s.reshape(HEADS, CLUSTERS, CLUSTERS)
    total = (qm.sum(2)[..., None, :] @ s @ km.sum(2)[..., :, None]).reshape(1, HEADS)
    qm = qm * (density * n * n / total)[..., None, None]
    return qm, s, km


def worker(n: int, density: float, method: str, seed: int, budget_s: float) -> dict:
    import torch

    from companion.sbm import (
        dense_masked_attention,
        edge_attention,
        edge_probabilities,
        fastrg_sample,
    )

    torch.manual_seed(seed)
    qm, s, km = _memberships(n, density, seed)
    q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, requires_grad=True) for _ in range(3))
    gen = torch.Generator().manual_seed(seed + 1)
    info: dict = {}

    def run_edge():
        edges = fastrg_sample(qm, s, km, gen)
        edge_attention(q, k, v, edges).sum().backward()
        info["edges_per_head"] = edges[0].numel() / HEADS

    def run_dense_masked():
        p = edge_probabilities(qm, s, km)
        mask = torch.bernoulli(p.clamp_(0.0, 1.0), generator=gen).bool()
        del p
        dense_masked_attention(q, k, v, mask).sum().backward()

    def run_sdpa():
        torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward()

    run = {"edge": run_edge, "dense_masked": run_dense_masked, "sdpa": run_sdpa}[method]

    def clear_grads():
        for t in (q, k, v):
            t.grad = None

    clear_grads()
    before = _rss_bytes()
    exact = _reset_peak()
    t0 = time.perf_counter()
    run()
    first = time.perf_counter() - t0
    peak = _peak_bytes() - before if exact else _peak_bytes()
    clear_grads()
    times = []
    while len(times) < 2 or (sum(times) < budget_s and len(times) < 7):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
        clear_grads()
    out = {
        "n": n,
        "density": density,
        "method": method,
        "time_s": statistics.median(times),
        "times_s": times,
        "first_s": first,
        "peak_mb": peak / 2**20,
        "peak_method": "VmHWM after clear_refs" if exact else "ru_maxrss (absolute)",
    }
    if method == "edge":
        # split: sampler alone and attention alone (median of 3)
        samp, attn = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            edges = fastrg_sample(qm, s, km, gen)
            t1 = time.perf_counter()
            edge_attention(q, k, v, edges).sum().backward()
            attn.append(time.perf_counter() - t1)
            samp.append(t1 - t0)
            clear_grads()
        out.update(
            sample_s=statistics.median(samp),
            attention_s=statistics.median(attn),
            edges_per_head=info["edges_per_head"],
        )
    return out


def sampler_worker(n: int, edges: int, seed: int) -> dict:
    import torch

    from companion.sbm import fastrg_sample

    qm, s, km = _memberships(n, edges / (n * n), seed)
    gen = torch.Generator().manual_seed(seed)
    fastrg_sample(qm, s, km, gen)
    times, counts = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        e = fastrg_sample(qm, s, km, gen)
        times.append(time.perf_counter() - t0)
        counts.append(e[0].numel() / HEADS)
    return {
        "n": n,
        "expected_edges_per_head": edges,
        "edges_per_head": statistics.mean(counts),
        "sample_s": statistics.median(times),
        "dense_entries_per_head": n * n,
    }


# ---------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------
def _spawn(args: list[str], timeout: float) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(THREADS))
    cmd = [sys.executable, __file__, "--worker", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        return {"error": f"exit {proc.returncode}: {tail[0]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _available_bytes() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="n up to 2048, short sweeps")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, *rest = args.worker
        if kind == "sampler":
            res = sampler_worker(int(rest[0]), int(rest[1]), 0)
        else:
            res = worker(int(rest[0]), float(rest[1]), rest[2], 0, float(rest[3]))
        print(json.dumps(res))
        return

    sizes = [512, 1024, 2048] if args.quick else [512, 1024, 2048, 4096, 8192]
    densities = [0.01, 0.05, 0.20]
    budget = 0.5 if args.quick else 1.5
    rows, dense_rows = [], {}
    started = time.perf_counter()
    for n in sizes:
        for method in ("sdpa", "dense_masked"):
            # several n x n float32 tensors per head live at once in the dense path
            need = 10 * HEADS * n * n * 4
            if method == "dense_masked" and need > 0.5 * _available_bytes():
                dense_rows[(n, method)] = {"error": f"skipped: needs ~{need / 2**30:.1f} GiB"}
                continue
            res = _spawn(["attn", str(n), "0.05", method, str(budget)], timeout=600)
            dense_rows[(n, method)] = res
            print(
                f"n={n:5d} {method:13s} "
                + (
                    res["error"]
                    if "error" in res
                    else f"{res['time_s']:.4f} s  {res['peak_mb']:.1f} MB"
                ),
                flush=True,
            )
        for density in densities:
            res = _spawn(["attn", str(n), str(density), "edge", str(budget)], timeout=600)
            print(
                f"n={n:5d} edge {density:4.0%}      "
                + (
                    res["error"]
                    if "error" in res
                    else f"{res['time_s']:.4f} s  {res['peak_mb']:.1f} MB  "
                    f"({res['edges_per_head']:.0f} edges/head)"
                ),
                flush=True,
            )
            row = {
                "n": n,
                "density": density,
                "edge": res,
                "dense_masked": dense_rows[(n, "dense_masked")],
                "sdpa": dense_rows[(n, "sdpa")],
            }
            rows.append(row)

    sampler_sizes = [1024, 4096, 16384] if args.quick else [1024, 4096, 16384, 65536]
    sampler_edges = 100_000
    sampler = []
    for n in sampler_sizes:
        res = _spawn(["sampler", str(n), str(sampler_edges)], timeout=300)
        print(
            f"sampler n={n:6d} E={sampler_edges}: "
            + (res["error"] if "error" in res else f"{res['sample_s']:.4f} s"),
            flush=True,
        )
        sampler.append(res)

    summary = _summarise(rows, sampler)
    result = {
        "benchmark": "sbm",
        "config": {
            "heads": HEADS,
            "head_dim": HEAD_DIM,
            "clusters": CLUSTERS,
            "batch": 1,
            "sizes": sizes,
            "densities": densities,
            "quick": args.quick,
            "dense_measured_at_density": 0.05,
        },
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": _torch_threads(),
            "python": platform.python_version(),
            "load_average": os.getloadavg(),
        },
        "memory_method": "fresh subprocess per config, MALLOC_MMAP_THRESHOLD_=65536, "
        "peak = VmHWM (reset via /proc/self/clear_refs) - RSS before",
        "rows": rows,
        "sampler_sweep": sampler,
        "summary": summary,
        "wall_s": time.perf_counter() - started,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sbm.json").write_text(json.dumps(result, indent=1))
    md = _markdown(result)
    (RESULTS / "sbm.md").write_text(md)
    print()
    print(md)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _ok(res: dict) -> bool:
    return isinstance(res, dict) and "error" not in res


def _summarise(rows, sampler) -> dict:
    out: dict = {"targets": {}, "edge_time_slope_vs_edges": {}, "crossovers": {}}
    for row in rows:
        e, dm, sd = row["edge"], row["dense_masked"], row["sdpa"]
        if _ok(e) and _ok(dm):
            row["time_ratio_dense_masked"] = dm["time_s"] / e["time_s"]
            row["memory_ratio_dense_masked"] = e["peak_mb"] / max(dm["peak_mb"], 1e-9)
        if _ok(e) and _ok(sd):
            row["time_ratio_sdpa"] = sd["time_s"] / e["time_s"]
            row["memory_ratio_sdpa"] = e["peak_mb"] / max(sd["peak_mb"], 1e-9)
    by = {(r["n"], r["density"]): r for r in rows}
    r = by.get((4096, 0.05))
    if r and "time_ratio_dense_masked" in r:
        out["targets"]["n4096_d5_speedup_vs_dense_masked (>= 5)"] = r["time_ratio_dense_masked"]
        out["targets"]["n4096_d5_memory_fraction_of_dense_masked (<= 0.1)"] = r[
            "memory_ratio_dense_masked"
        ]
    r = by.get((8192, 0.01))
    if r and "time_ratio_sdpa" in r:
        out["targets"]["n8192_d1_speedup_vs_sdpa (> 1)"] = r["time_ratio_sdpa"]
    for n in sorted({r["n"] for r in rows}):
        pts = [
            (by[(n, d)]["edge"]["edges_per_head"], by[(n, d)]["edge"]["time_s"])
            for d in (0.01, 0.05, 0.20)
            if (n, d) in by and _ok(by[(n, d)]["edge"])
        ]
        if len(pts) >= 2:
            xs = [math.log(p[0]) for p in pts]
            ys = [math.log(p[1]) for p in pts]
            mx, my = statistics.mean(xs), statistics.mean(ys)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum(
                (x - mx) ** 2 for x in xs
            )
            out["edge_time_slope_vs_edges"][str(n)] = slope
        # crossover: the highest density at which the edge path still beats SDPA
        wins = [
            d
            for d in (0.01, 0.05, 0.20)
            if (n, d) in by and by[(n, d)].get("time_ratio_sdpa", 0) > 1
        ]
        out["crossovers"][str(n)] = {
            "edge_faster_than_sdpa_at": wins,
            "edge_faster_than_dense_masked_at": [
                d
                for d in (0.01, 0.05, 0.20)
                if (n, d) in by and by[(n, d)].get("time_ratio_dense_masked", 0) > 1
            ],
        }
    ok = [s for s in sampler if _ok(s)]
    if len(ok) >= 2:
        out["sampler_time_ratio_last_over_first"] = ok[-1]["sample_s"] / ok[0]["sample_s"]
        out["sampler_n_squared_ratio_last_over_first"] = (ok[-1]["n"] / ok[0]["n"]) ** 2
    return out


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def _markdown(result) -> str:
    lines = [
        "# SBM attention benchmark",
        "",
        f"Batch 1, {HEADS} heads, head_dim {HEAD_DIM}, k = {CLUSTERS}; forward + backward. "
        f"Machine: {result['machine']['cpus']} CPUs, {result['machine']['torch_threads']} "
        f"torch threads, load average at the end {result['machine']['load_average'][0]:.1f}. "
        "Times: median seconds. Memory: peak MiB above the inputs "
        "(fresh process, VmHWM reset before the call). Dense paths measured once per n.",
        "",
        "| n | density | edges/head | edge s (sample + attn) | dense masked s | SDPA s "
        "| dense masked / edge time | SDPA / edge time | edge MiB | dense masked MiB "
        "| SDPA MiB | edge / dense masked memory |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        e, dm, sd = r["edge"], r["dense_masked"], r["sdpa"]
        et = (
            f"{e['time_s']:.4f} ({e['sample_s']:.3f} + {e['attention_s']:.3f})"
            if _ok(e)
            else e.get("error", "-")
        )
        lines.append(
            f"| {r['n']} | {r['density']:.0%} | "
            f"{_fmt(e.get('edges_per_head') if _ok(e) else None, '.0f')} | {et} | "
            f"{_fmt(dm['time_s'], '.4f') if _ok(dm) else dm.get('error', '-')} | "
            f"{_fmt(sd['time_s'], '.4f') if _ok(sd) else sd.get('error', '-')} | "
            f"{_fmt(r.get('time_ratio_dense_masked'), '.2f')} | "
            f"{_fmt(r.get('time_ratio_sdpa'), '.2f')} | "
            f"{_fmt(e['peak_mb'] if _ok(e) else None, '.1f')} | "
            f"{_fmt(dm['peak_mb'] if _ok(dm) else None, '.1f')} | "
            f"{_fmt(sd['peak_mb'] if _ok(sd) else None, '.1f')} | "
            f"{_fmt(r.get('memory_ratio_dense_masked'), '.3f')} |"
        )
    s = result["summary"]
    lines += ["", "## Targets", ""]
    for key, val in s["targets"].items():
        lines.append(f"- {key}: **{val:.3f}**")
    lines += ["", "## Edge time against edges at fixed n (log-log slope; 1 = linear)", ""]
    for n, slope in s["edge_time_slope_vs_edges"].items():
        lines.append(f"- n = {n}: {slope:.2f}")
    lines += ["", "## Where the edge path wins", ""]
    for n, c in s["crossovers"].items():
        lines.append(
            f"- n = {n}: faster than SDPA at densities "
            f"{[f'{d:.0%}' for d in c['edge_faster_than_sdpa_at']] or 'none'}; faster than "
            f"dense masked at "
            f"{[f'{d:.0%}' for d in c['edge_faster_than_dense_masked_at']] or 'none'}"
        )
    lines += [
        "",
        "## Sampler alone at a fixed expected edge count",
        "",
        "| n | edges/head | dense entries/head | sample s |",
        "|---|---|---|---|",
    ]
    for r in result["sampler_sweep"]:
        if _ok(r):
            lines.append(
                f"| {r['n']} | {r['edges_per_head']:.0f} | "
                f"{r['dense_entries_per_head']:.2e} | {r['sample_s']:.4f} |"
            )
    if "sampler_time_ratio_last_over_first" in s:
        lines.append("")
        lines.append(
            f"Sampler time grew {s['sampler_time_ratio_last_over_first']:.1f}x while n^2 grew "
            f"{s['sampler_n_squared_ratio_last_over_first']:.0f}x (cost ~ edges + n k)."
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
