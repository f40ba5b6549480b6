"""Benchmark: SBM attention on sampled edges against dense masked attention and SDPA.

For n in {512, ..., 8192} and expected densities {1%, 5%, 20%} (batch 1, 2 heads,
head_dim 32, k = 128 clusters), forward + backward of

* ``edge``: fastRG sampling (:func:`companion.sbm.fastrg_sample`, int32 indices as
  :class:`companion.sbm.SBMAttention` samples them) + edge attention
  (:func:`companion.sbm.edge_attention`) -- cost O(edges);
* ``dense_masked``: the public code's path -- dense P, Bernoulli mask, softmax, mask,
  renormalise (:func:`companion.sbm.dense_masked_attention`) -- cost O(n^2);
* ``sdpa``: dense unmasked ``torch.nn.functional.scaled_dot_product_attention`` (a fused
  flash kernel on CPU too), the fastest dense baseline.

The two dense paths cost the same at every density (the mask only changes values), so
they are measured once per n (dense_masked at 5%) and their numbers are repeated.

Method. For each n, one subprocess times every method and a second one measures memory.
Times: one warm-up, then the median of repeated forward + backward runs with the normal
allocator (:func:`companion.timing.call_times`). Memory: torch's CPU allocator keeps no
statistics and ``tracemalloc`` does not see torch allocations, so the memory process
starts with ``MALLOC_MMAP_THRESHOLD_=65536`` (every buffer of 64 KiB or more is its own
mmap, unmapped when freed, so the resident set follows live tensors; the fixed threshold
would slow the timings, hence the separate process). After one warm-up it resets the
kernel's resident-set high-water mark (``echo 5 > /proc/self/clear_refs``), runs one
forward + backward, and reports ``VmHWM - RSS before``: the memory the method itself
needed, gradients included. Workers run with one torch thread (``BENCH_THREADS`` to
change): the machine is shared, and spin-waiting OpenMP threads on an oversubscribed CPU
were up to ten times slower in trials.

Issue 38's two speed-ups over SDPA (n = 4096 at 5 %, target 1.5; n = 8192 at 1 %,
target 5) are also timed head to head: edge and SDPA alternately in one worker, the order
reversed every other repeat, the median of the per-repeat ratios (the table's columns
come from workers that time one method after the other).  A second worker per
configuration times the edge path with the sampler's default int64 indices
(``fastrg_sample`` called without ``index_dtype``) the same way, reported beside it:
three indices per edge, 40 MB a call at n = 4096, 5 %, which the allocator hands back
after each call and the next call faults in again.

A second sweep times the sampler alone at a fixed expected edge count while n grows,
to show that its cost follows edges + n k, not n^2.

A third part times one training step (forward, backward, AdamW) of the chapter's LRA
model at ci scale (Pathfinder: batch 32, n = 100, 2 layers, 2 heads, d 32, k = 32
clusters) with SBM attention against the same model with dense SDPA attention, and the
SBM step with the sampler tuning of the first implementation (fastRG's cluster cells,
``torch.poisson`` counts, edge-list attention), interleaved in one process (ratios of
medians of wall and of CPU time), at 1 and 2 torch threads, each with the heap setting of
the chapter's training workers (``companion.lra.experiments.keep_freed_memory``) and
without it.  The attention rows also report the edge path's time per edge against the
memory-bandwidth bound of gathering one key and one value row per edge (``2 d`` float32
per edge and head, at the bandwidth of a large tensor copy measured in the same worker).
The step also reports its matrix-product FLOPs (``torch.utils.flop_counter``) for SBM and
dense, the SBM sampler's seconds per step, and from them a floor of SBM / dense: the SBM
GEMMs at the dense step's FLOP rate plus the sampler.

Choices in the library made from one-off measurements (CPU, one thread, on the 2-core
machine of the book's CI; not re-measured by this run, which times the whole paths they
are part of). The code keeps the reason; the figures are here:

* ``tensor_ops.stable_argsort``: numpy's 16-bit radix passes about ten times faster than
  ``torch.sort`` for millions of keys;
* ``tensor_ops.repeat_each``: numpy's ``repeat`` about 1.7 times faster than torch's
  ``repeat_interleave`` for a million cells of about 1.6 edges each, 4 times for 8,192
  rows of 200;
* ``tensor_ops.transposed_copy``: at [64, 100, 32] 74 against 110 us for torch's
  transposing copy (load 2.7); in tiles of 128 rows, [2, 8192, 128] float32 in 1.5
  against 15 ms for one sweep; GEMMs with a transposed second operand (``bmm``, also
  ``layer._count_attention_forward``'s ``K^T``) took about twice as long as with a
  contiguous one;
* ``graph_attention``: ``_flat_index`` by numpy about twice as fast as torch's integer
  add with ``alpha`` and its conversion; ``_is_sorted`` by numpy about three times
  faster than torch's compare and ``all``; the transposed CSR by scipy's CSR -> CSC
  conversion 12 against 30 ms (radix argsort, bincount and gather) at 1.7 M edges;
  ``index_select`` several times faster than advanced indexing; ``transpose_matmul`` by
  scipy's product with the CSR read as the CSC of the transpose, at 1.7 M edges and 32
  columns (float32, AMD EPYC), 7.4 ms per product against 6.8 ms for building the
  transposed CSR once plus 9.2 ms per product (values permuted, torch's CSR product), the
  same numbers bit for bit; at 2 threads 7.4 against 6.0 + 5.8 ms;
* ``poisson``: numpy's PCG64 about three times faster than torch's CPU Mersenne Twister
  and ``np.flatnonzero`` about nine times faster than ``torch.nonzero``; the inversion in
  blocks of 2**16 rates (512 KiB of uniforms, on a 2 MiB-L2 Xeon): 640,000 float32 rates
  near 0.25 (the ci model's pair grid) in 3.4 against 4.0 ms, 2**20 exponential rates
  of mean 1.6 (fastRG's cells at n = 4096, 5 %) in 19 against 32 ms; ``1 - r`` by a
  cast and an in-place subtract about three times faster than numpy's mixed-dtype
  subtract;
* ``fastrg._finite_sum``: one min/max pass in about a third of the time of the float64
  sum;
* ``key_draws``: the row sums of the contiguous float64 copy in a third of the time;
  the inverse-CDF search in sorted order several times faster than torch's random-order
  search; ``index_select`` about five times faster than ``take``; the numpy rejection
  round about a quarter faster than the torch one on numpy's uniforms;
* ``layer``: the ``-1e30`` bias by one fused add against a boolean mask several times
  slower (``zeros_like`` + ``masked_fill_`` about 15 times as long, the bool compare
  alone about 3 float passes); the exponential's subnormal range about ten times slower,
  and subnormal ``u`` on absent pairs made two [G, n, m] passes of the backward 5-10x
  slower on Intel processors.

Run: ``.venv/bin/python benchmarks/bench_sbm.py [--quick]``; writes
``benchmarks/results/sbm.json`` and ``sbm.md`` and prints the table.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from results_io import write_results

from companion.timing import call_seconds, call_times

HEADS, HEAD_DIM, CLUSTERS = 2, 32, 128
# one thread per worker: this machine is shared, and OpenMP threads that spin-wait on an
# oversubscribed CPU made every method up to 10x slower (and noisy) in trials
THREADS = int(os.environ.get("BENCH_THREADS", "1"))
# issue 38's speed-ups of the edge path over SDPA, (n, density): target; each timed head
# to head in a process of its own (versus_worker), VERSUS_REPEATS alternations
VERSUS_TARGETS = {(4096, 0.05): 1.5, (8192, 0.01): 5.0}
VERSUS_REPEATS = 9


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


def workloads(n: int, density: float, seed: int = 0, device=None):
    """The three timed workloads at one configuration, forward + backward each.

    Returns ``(runs, info)``: ``runs`` maps "edge" (fastRG sampling + edge attention),
    "dense_masked" (Bernoulli mask over dense P + dense masked attention) and "sdpa"
    (dense torch SDPA) to a callable; ``info["edges_per_head"]`` is set by the edge run.
    Shared with ``gpu_check_sbm.py`` so the GPU times the same work as the CPU benchmark.
    """
    import torch

    from companion.sbm import (
        dense_masked_attention,
        edge_attention,
        edge_probabilities,
        fastrg_sample,
    )

    device = torch.device(device or "cpu")
    torch.manual_seed(seed)
    qm, s, km = (t.to(device) for t in _memberships(n, density, seed))
    q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, device=device, requires_grad=True)
               for _ in range(3))
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    info: dict = {}

    def clear_grads():
        for t in (q, k, v):
            t.grad = None

    def run_edge(index_dtype=torch.int32):
        edges = fastrg_sample(qm, s, km, gen, index_dtype=index_dtype)
        edge_attention(q, k, v, edges).sum().backward()
        info["edges_per_head"] = edges[0].numel() / HEADS
        clear_grads()

    def run_dense_masked():
        p = edge_probabilities(qm, s, km)
        mask = torch.bernoulli(p.clamp_(0.0, 1.0), generator=gen).bool()
        del p
        dense_masked_attention(q, k, v, mask).sum().backward()
        clear_grads()

    def run_sdpa():
        torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward()
        clear_grads()

    last_edges: list = []

    def sample():
        """The sampler alone (its edges kept for :func:`attend`)."""
        last_edges[:] = [fastrg_sample(qm, s, km, gen, index_dtype=torch.int32)]

    def attend():
        """Edge attention alone, forward + backward, on the last sampled edges."""
        edge_attention(q, k, v, last_edges[0]).sum().backward()
        clear_grads()

    runs = {"edge": run_edge, "dense_masked": run_dense_masked, "sdpa": run_sdpa}
    info["sample"], info["attend"] = sample, attend
    info["edge_int64"] = lambda: run_edge(torch.int64)
    return runs, info


def job(n: int, density: float, method: str, mode: str, budget_s: float, seed: int = 0):
    """Time (``mode="time"``) or measure the peak memory (``mode="memory"``, in a process
    started with ``MALLOC_MMAP_THRESHOLD_=65536``) of one method at one configuration."""
    runs, info = workloads(n, density, seed)
    run = runs[method]
    out = {"n": n, "density": density, "method": method}
    # warm-up (first-call costs), also sizes the repeats
    first = call_seconds(run, repeats=1, warmup=0)
    if mode == "memory":
        before = _rss_bytes()
        exact = _reset_peak()
        run()
        out["peak_mb"] = (_peak_bytes() - before if exact else _peak_bytes()) / 2**20
        out["peak_method"] = "VmHWM after clear_refs" if exact else "ru_maxrss (absolute)"
        return out
    times = call_times(run, repeats=1 if first > 5 else 2, warmup=0, budget_s=budget_s,
                       max_repeats=7)
    out.update(time_s=statistics.median(times), times_s=times, first_s=first)
    if method == "edge":
        # split: sampler alone, then attention alone on the sampled edges
        repeats = 1 if first > 2 else 3
        out.update(
            sample_s=call_seconds(info["sample"], repeats=repeats, warmup=0),
            attention_s=call_seconds(info["attend"], repeats=repeats, warmup=0),
            edges_per_head=info["edges_per_head"],
        )
        edges = out["edges_per_head"] * HEADS
        out["ns_per_edge"] = 1e9 * out["time_s"] / max(edges, 1)
        out["attention_ns_per_edge"] = 1e9 * out["attention_s"] / max(edges, 1)
    return out


def worker(n: int, mode: str, jobs: list[tuple[str, float]], budget_s: float) -> list[dict]:
    """All jobs of one n and one mode in this process (one process per n and mode)."""
    results = []
    for method, density in jobs:
        try:
            results.append(job(n, density, method, mode, budget_s))
        except Exception as exc:  # reported in the table, never hidden
            msg = f"{type(exc).__name__}: {exc}".splitlines()[0]
            results.append({"n": n, "density": density, "method": method, "error": msg})
    return results


def sampler_worker(n: int, edges: int, seed: int) -> dict:
    import torch

    from companion.sbm import fastrg_sample

    qm, s, km = _memberships(n, edges / (n * n), seed)
    gen = torch.Generator().manual_seed(seed)
    counts = []

    def sample():
        counts.append(fastrg_sample(qm, s, km, gen)[0].numel() / HEADS)

    seconds = call_seconds(sample, repeats=3, warmup=1)
    counts = counts[1:]  # the warm-up's count
    return {
        "n": n,
        "expected_edges_per_head": edges,
        "edges_per_head": statistics.mean(counts),
        "sample_s": seconds,
        "dense_entries_per_head": n * n,
    }


def versus_worker(n: int, density: float, repeats: int, seed: int = 0,
                  edge: str = "edge") -> dict:
    """The edge path (sampling + attention) against SDPA at one configuration, timed in
    alternation (edge then SDPA, the order reversed every other repeat) after one warm-up
    of each, so that both meet the same machine state: the medians of each and the
    median of the per-repeat ratios SDPA / edge, with their spread.  ``edge``: "edge"
    (int32 indices, as the layer samples) or "edge_int64" (the sampler's default), each
    in a process of its own (their heaps differ)."""
    runs, info = workloads(n, density, seed)
    runs = {"edge": runs["edge"] if edge == "edge" else info[edge], "sdpa": runs["sdpa"]}
    times: dict = {name: [] for name in runs}
    for run in runs.values():  # warm-up
        run()
    for r in range(repeats):
        for name in (("edge", "sdpa") if r % 2 == 0 else ("sdpa", "edge")):
            t0 = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t0)
    ratios = [s / e for s, e in zip(times["sdpa"], times["edge"])]
    return {"n": n, "density": density, "repeats": repeats, "edge_path": edge,
            "times_s": times,
            "edge_s": statistics.median(times["edge"]),
            "sdpa_s": statistics.median(times["sdpa"]),
            "sdpa_over_edge": statistics.median(ratios),
            "sdpa_over_edge_min": min(ratios), "sdpa_over_edge_max": max(ratios),
            "load_average": os.getloadavg()}


def step_worker(repeats: int = 15, seed: int = 0, threads: int = 1,
                worker_heap: bool = True) -> dict:
    """One training step of the ci-scale LRA model: SBM (default tuning), SBM with the
    first implementation's sampler tuning, dense SDPA; interleaved, medians of wall and
    CPU time.  As the chapter's training workers run it: ``threads`` torch threads and,
    with ``worker_heap``, the workers' heap setting
    (:func:`companion.lra.experiments.keep_freed_memory`; without it: the process as
    before that setting), the optimiser of :class:`companion.lra.train.TrainConfig`."""
    import torch

    from companion.lra.model import LRAClassifier
    from companion.lra.train import TrainConfig
    from companion.sbm import FastRGTuning, density_regularizer
    from flop_counts import matrix_product_flops

    heap_set = False
    if worker_heap:
        from companion.lra.experiments import keep_freed_memory

        heap_set = keep_freed_memory()
    batch, n, clusters = 32, 100, 32
    torch.set_num_threads(threads)
    config = TrainConfig(lr=1e-3, batch_size=batch)
    tokens = torch.randint(0, 3, (batch, n), generator=torch.Generator().manual_seed(seed))
    labels = torch.randint(0, 2, (batch,), generator=torch.Generator().manual_seed(seed + 1))
    first_tuning = FastRGTuning(cell_grid="clusters", cpu_poisson="torch",
                                key_grid_max_entries=0)
    models = {}
    for name, attention, tuning in (("sbm", "sbm", None), ("sbm_first", "sbm", first_tuning),
                                    ("dense", "dense", None)):
        torch.manual_seed(seed)
        model = LRAClassifier(3, n, 2, attention=attention, num_clusters=clusters, pad_id=None,
                              dropout=0.0)  # the ci Pathfinder runs: no dropout
        if tuning is not None:
            for block in model.blocks:
                block.attn.sbm.tuning = tuning
        optimiser = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=config.betas,
                                      eps=config.eps, weight_decay=config.weight_decay)
        models[name] = (model, optimiser, torch.Generator().manual_seed(seed + 2))

    def step(name):
        model, optimiser, gen = models[name]
        logits, densities = model(tokens, generator=gen)
        loss = torch.nn.functional.cross_entropy(logits, labels)
        if name != "dense":
            loss = loss + density_regularizer(densities, config.lam)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()

    times: dict = {name: [] for name in models}
    cpu: dict = {name: [] for name in models}
    for name in models:  # warm-up
        step(name)
    for _ in range(repeats):
        for name in models:
            cpu0 = time.process_time()
            times[name].append(call_seconds(lambda: step(name), repeats=1, warmup=0))
            cpu[name].append(time.process_time() - cpu0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    med_cpu = {name: statistics.median(ts) for name, ts in cpu.items()}
    dispatch = {name: step_dispatch_counts(lambda: step(name),
                                           lambda: models[name][0](tokens, generator=gen))
                for name, gen in (("sbm", torch.Generator().manual_seed(seed + 3)),
                                  ("dense", None))}
    flops = {name: matrix_product_flops(lambda: step(name)) for name in ("sbm", "dense")}
    sampler_s = statistics.median(step_in_sampler(lambda: step("sbm"))
                                  for _ in range(repeats))
    sampler_flops = step_in_sampler(lambda: step("sbm"), "flops")
    flop_ratio = flops["sbm"] / flops["dense"]
    return {
        "batch": batch, "n": n, "clusters": clusters, "repeats": repeats, "threads": threads,
        "worker_heap": worker_heap, "worker_heap_set": heap_set,
        "step_s": med, "times_s": times, "step_cpu_s": med_cpu, "dispatch": dispatch,
        "sbm_over_dense": med["sbm"] / med["dense"],
        "sbm_first_over_dense": med["sbm_first"] / med["dense"],
        "sbm_over_dense_cpu": med_cpu["sbm"] / med_cpu["dense"],
        "gemm_flops_per_step": flops, "gemm_flops_sbm_over_dense": flop_ratio,
        "sampler_s_per_step": sampler_s, "sampler_gemm_flops_per_step": sampler_flops,
        # the SBM step if its GEMMs outside the sampler ran at the dense step's FLOP rate
        # (all of the dense step's time charged to its GEMMs) and its sampler, whose time
        # includes the rates' GEMMs, came on top
        "floor_sbm_over_dense": ((flops["sbm"] - sampler_flops) / flops["dense"]
                                 + sampler_s / med["dense"]),
        "load_average": os.getloadavg(),
    }


def step_in_sampler(step, measure: str = "seconds") -> float:
    """What one training ``step()`` spends in the SBM layers' sampler
    (:func:`companion.sbm.fastrg.poisson_pair_counts` and ``fastrg_sample`` as the layer
    calls them: the rates' GEMM, the uniforms and the Poisson inversion): its
    ``"seconds"``, or the ``"flops"`` of its matrix products (the rates' GEMMs, which
    :func:`flop_counts.matrix_product_flops` of the whole step counts too)."""
    from companion.sbm import layer
    from flop_counts import matrix_product_flops

    if measure not in ("seconds", "flops"):
        raise ValueError(f"measure: expected 'seconds' or 'flops', got {measure!r}")
    spent = [0.0]
    originals = {name: getattr(layer, name) for name in ("poisson_pair_counts",
                                                          "fastrg_sample")}

    def measured(function):
        def call(*args, **kwargs):
            if measure == "flops":
                out = []
                spent[0] += matrix_product_flops(lambda: out.append(function(*args, **kwargs)))
                return out[0]
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
        return call

    try:
        for name, function in originals.items():
            setattr(layer, name, measured(function))
        step()
    finally:
        for name, function in originals.items():
            setattr(layer, name, function)
    return spent[0]


def step_dispatch_counts(step, forward) -> dict:
    """Torch operators one warm training ``step()`` dispatches (torch.profiler events,
    nested ones included) and the autograd nodes of one ``forward()`` (its loss graph,
    every output summed): the per-step bookkeeping beside the arithmetic. Work done
    outside torch (numpy's random stream and strided copies in the SBM sampler and pair
    grid) is not an operator and is not counted."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ops = sum(event.count for event in prof.key_averages())
    logits, densities = forward()
    root = (logits.sum() + sum(d.sum() for d in densities)).grad_fn
    seen, todo = set(), [root]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(child for child, _ in node.next_functions)
    return {"ops_per_step": ops, "autograd_nodes_per_forward": len(seen)}


def copy_bandwidth_bytes_per_s() -> float:
    """Bytes per second of a large float32 tensor copy (read + write counted), one thread."""
    import torch

    src = torch.empty(1 << 26, dtype=torch.float32).fill_(1.0)  # 256 MiB
    dst = torch.empty_like(src)
    seconds = call_seconds(lambda: dst.copy_(src), repeats=3, warmup=1)
    return 2 * src.numel() * 4 / seconds


# ---------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------
def _spawn(args: list[str], timeout: float, strict_malloc: bool = False):
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS))
    if strict_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    cmd = [sys.executable, __file__, "--worker", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        return {"error": f"exit {proc.returncode}: {tail[0]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def step_benchmark(repeats: int, threads=(1, 2)) -> list[dict]:
    """The training step at each thread count, as the chapter's workers run it and without
    their heap setting (the process as before it), one worker process each; the first
    entry is the chapter's setting (one thread, the workers' heap)."""
    runs = []
    for count in threads:
        for heap in ("1", "0"):
            res = _spawn(["step", str(repeats), str(count), heap], timeout=900)
            res.setdefault("threads", count)
            res.setdefault("worker_heap", heap == "1")
            runs.append(res)
            if "error" in res:
                print(f"training step n=100, {count} thread(s): {res['error']}", flush=True)
                continue
            print(f"training step n=100, {count} thread(s), workers' heap {heap == '1'}: "
                  f"SBM / dense {res['sbm_over_dense']:.2f} wall, "
                  f"{res['sbm_over_dense_cpu']:.2f} CPU; first implementation / dense "
                  f"{res['sbm_first_over_dense']:.2f} (load {res['load_average'][0]:.1f}); "
                  f"ops per step SBM {res['dispatch']['sbm']['ops_per_step']}, dense "
                  f"{res['dispatch']['dense']['ops_per_step']}; autograd nodes SBM "
                  f"{res['dispatch']['sbm']['autograd_nodes_per_forward']}, dense "
                  f"{res['dispatch']['dense']['autograd_nodes_per_forward']}",
                  flush=True)
    return runs


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
        elif kind == "step":
            res = step_worker(int(rest[0]), threads=int(rest[1]), worker_heap=rest[2] == "1")
        elif kind == "bandwidth":
            res = {"copy_bytes_per_s": copy_bandwidth_bytes_per_s()}
        elif kind == "versus":
            res = versus_worker(int(rest[0]), float(rest[1]), int(rest[2]),
                                edge=rest[3] if len(rest) > 3 else "edge")
        else:
            n, mode, budget, *pairs = rest
            jobs = [(pairs[i], float(pairs[i + 1])) for i in range(0, len(pairs), 2)]
            res = worker(int(n), mode, jobs, float(budget))
        print(json.dumps(res))
        return

    sizes = [512, 1024, 2048] if args.quick else [512, 1024, 2048, 4096, 8192]
    densities = [0.01, 0.05, 0.20]
    budget = 0.5 if args.quick else 1.5
    rows = []
    started = time.perf_counter()
    for n in sizes:
        jobs = ["sdpa", "0.05"]
        # several n x n float32 tensors per head live at once in the dense path
        need = 10 * HEADS * n * n * 4
        dense_ok = need <= 0.5 * _available_bytes()
        if dense_ok:
            jobs += ["dense_masked", "0.05"]
        for density in densities:
            jobs += ["edge", str(density)]
        found: dict = {}
        for mode in ("time", "memory"):
            res = _spawn(
                ["attn", str(n), mode, str(budget), *jobs],
                timeout=900,
                strict_malloc=(mode == "memory"),
            )
            if isinstance(res, dict):  # the whole process failed
                res = [dict(res, method=m, density=float(d)) for m, d in zip(jobs[::2], jobs[1::2])]
            for r in res:
                found.setdefault((r["method"], r["density"]), {}).update(r)
        if not dense_ok:
            found[("dense_masked", 0.05)] = {"error": f"skipped: needs ~{need / 2**30:.1f} GiB"}
        for (method, density), r in sorted(found.items()):
            if "error" in r:
                text = r["error"]
            else:
                text = f"{r['time_s']:.4f} s  {r['peak_mb']:.1f} MiB"
            print(f"n={n:5d} {method:13s} {density:4.0%}  {text}", flush=True)
        for density in densities:
            rows.append(
                {
                    "n": n,
                    "density": density,
                    "edge": found[("edge", density)],
                    "dense_masked": found[("dense_masked", 0.05)],
                    "sdpa": found[("sdpa", 0.05)],
                }
            )

    # the two configurations of issue 38's speed-ups over SDPA, timed head to head
    versus = []
    for n, density in VERSUS_TARGETS:
        if n not in sizes:
            continue
        res = _spawn(["versus", str(n), str(density), str(VERSUS_REPEATS)], timeout=900)
        res.setdefault("n", n)
        res.setdefault("density", density)
        # the same head to head with the sampler's default int64 indices, reported beside
        wide = _spawn(["versus", str(n), str(density), str(VERSUS_REPEATS), "edge_int64"],
                      timeout=900)
        if _ok(res) and _ok(wide):
            res["edge_int64_s"] = wide["edge_s"]
            res["sdpa_over_edge_int64"] = wide["sdpa_over_edge"]
            res["sdpa_over_edge_int64_range"] = [wide["sdpa_over_edge_min"],
                                                 wide["sdpa_over_edge_max"]]
        versus.append(res)
        print(f"n={n:5d} edge vs SDPA interleaved {density:4.0%}: "
              + (res["error"] if "error" in res else
                 f"{res['sdpa_over_edge']:.3f} ({res['sdpa_over_edge_min']:.3f}-"
                 f"{res['sdpa_over_edge_max']:.3f})"), flush=True)

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

    steps = step_benchmark(7 if args.quick else 15)
    step = steps[0]
    bandwidth = _spawn(["bandwidth"], timeout=300)
    summary = _summarise(rows, sampler, step, bandwidth, versus)
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
            "torch_threads_per_worker": THREADS,
            "python": platform.python_version(),
            "torch": importlib.metadata.version("torch"),
            "load_average": os.getloadavg(),
        },
        "memory_method": "separate subprocess per n with MALLOC_MMAP_THRESHOLD_=65536; "
        "after a warm-up, peak = VmHWM (reset via /proc/self/clear_refs) - RSS before",
        "rows": rows,
        "sampler_sweep": sampler,
        "versus_sdpa": versus,
        "training_step": step,
        "training_steps": steps,
        "bandwidth": bandwidth,
        "summary": summary,
        "wall_s": time.perf_counter() - started,
    }
    write_results("sbm", result, _markdown(result))


def _ok(res: dict) -> bool:
    return isinstance(res, dict) and "error" not in res


def _summarise(rows, sampler, step=None, bandwidth=None, versus=()) -> dict:
    out: dict = {"targets": {}, "edge_time_slope_vs_edges": {}, "crossovers": {}}
    # the bound: one key and one value row (2 d float32) read per edge and head
    bytes_per_edge = 2 * HEAD_DIM * 4
    if _ok(bandwidth or {}):
        out["gather_bound_ns_per_edge"] = 1e9 * bytes_per_edge / bandwidth["copy_bytes_per_s"]
        for row in rows:
            if _ok(row["edge"]):
                row["edge_ns_over_bound"] = (row["edge"]["ns_per_edge"]
                                             / out["gather_bound_ns_per_edge"])
    if _ok(step or {}):
        out["targets"]["n100_ci_step_sbm_over_dense (<= 1.5)"] = step["sbm_over_dense"]
        out["targets"]["n100_ci_step_first_implementation_over_dense"] = step[
            "sbm_first_over_dense"]
        if "gemm_flops_sbm_over_dense" in step:
            out["targets"]["n100_ci_step_gemm_flops_sbm_over_dense"] = step[
                "gemm_flops_sbm_over_dense"]
            out["targets"]["n100_ci_step_floor_sbm_over_dense"] = step["floor_sbm_over_dense"]
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
    r = by.get((4096, 0.05))
    if r and "time_ratio_sdpa" in r:
        out["targets"]["n4096_d5_speedup_vs_sdpa (>= 1)"] = r["time_ratio_sdpa"]
    r = by.get((8192, 0.01))
    if r and "time_ratio_sdpa" in r:
        out["targets"]["n8192_d1_speedup_vs_sdpa (>= 3)"] = r["time_ratio_sdpa"]
    for v in versus:
        if _ok(v):
            target = VERSUS_TARGETS[(v["n"], v["density"])]
            out["targets"][f"n{v['n']}_d{round(100 * v['density'])}_speedup_vs_sdpa_"
                           f"interleaved (>= {target:g})"] = v["sdpa_over_edge"]
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
        f"Machine: {result['machine']['cpus']} CPUs (shared), "
        f"{result['machine']['torch_threads_per_worker']} torch thread per worker, "
        f"load average at the end {result['machine']['load_average'][0]:.1f}, "
        f"torch {result['machine']['torch']}. "
        "Times: median seconds. Memory: peak MiB above the inputs "
        "(separate process, VmHWM reset before the call). Dense paths measured once per n "
        "(their cost does not depend on the density).",
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
    versus = [v for v in result.get("versus_sdpa") or [] if _ok(v)]
    if versus:
        lines += ["", "## Edge path against SDPA, head to head", "",
                  "Each configuration in a worker of its own: one warm-up each, then "
                  f"{versus[0]['repeats']} alternations (edge then SDPA, the order "
                  "reversed every other repeat), medians, and the median of the "
                  "per-repeat ratios with their range (the targets of issue 38). The edge "
                  "path samples int32 indices, as the SBM layer does; the int64 columns, "
                  "from a worker of their own, use the sampler's default.", "",
                  "| n | density | edge s | SDPA s | SDPA / edge (median, min-max) | target "
                  "| edge s, int64 indices | SDPA / edge, int64 | load |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for v in versus:
            target = VERSUS_TARGETS[(v["n"], v["density"])]
            verdict = "met" if v["sdpa_over_edge"] >= target else "missed"
            lines.append(f"| {v['n']} | {v['density']:.0%} | {v['edge_s']:.4f} | "
                         f"{v['sdpa_s']:.4f} | {v['sdpa_over_edge']:.3f} "
                         f"({v['sdpa_over_edge_min']:.3f}-{v['sdpa_over_edge_max']:.3f}) | "
                         f">= {target:g}: {verdict} | {_fmt(v.get('edge_int64_s'), '.4f')} | "
                         f"{_fmt(v.get('sdpa_over_edge_int64'), '.3f')} | "
                         f"{v['load_average'][0]:.1f} |")
    lines += ["", "## Targets", ""]
    for key, val in s["targets"].items():
        lines.append(f"- {key}: **{val:.3f}**")
    if "gather_bound_ns_per_edge" in s:
        bound = s["gather_bound_ns_per_edge"]
        lines += ["", "## Time per edge against the gather bound", "",
                  f"Bound: {2 * HEAD_DIM * 4} bytes (one key and one value row, float32) per "
                  f"edge and head at the copy bandwidth "
                  f"{result['bandwidth']['copy_bytes_per_s'] / 1e9:.1f} GB/s = "
                  f"{bound:.2f} ns per edge.", "",
                  "| n | density | edge path ns/edge | attention alone ns/edge | x bound |",
                  "|---|---|---|---|---|"]
        for r in result["rows"]:
            e = r["edge"]
            if _ok(e):
                lines.append(f"| {r['n']} | {r['density']:.0%} | {e['ns_per_edge']:.1f} | "
                             f"{e['attention_ns_per_edge']:.1f} | "
                             f"{r['edge_ns_over_bound']:.0f} |")
    steps = [r for r in result.get("training_steps") or [] if _ok(r)]
    if steps:
        first = steps[0]
        lines += ["", "## One training step of the ci-scale LRA model (n = 100)", "",
                  f"Batch {first['batch']}, n = {first['n']}, k = {first['clusters']}; "
                  f"forward, backward and AdamW; {first['repeats']} interleaved repeats per "
                  "worker process, medians of wall and CPU time. Workers' heap: "
                  "`companion.lra.experiments.keep_freed_memory`, as the chapter's "
                  "training workers run (no: the process as before it).", "",
                  "| threads | workers' heap | SBM s | first implementation s | dense s "
                  "| SBM / dense (wall) | SBM / dense (CPU) | first / dense | load |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in steps:
            med = r["step_s"]
            lines.append(f"| {r['threads']} | {'yes' if r['worker_heap'] else 'no'} | "
                         f"{med['sbm']:.4f} | {med['sbm_first']:.4f} | {med['dense']:.4f} | "
                         f"{r['sbm_over_dense']:.2f} | {r['sbm_over_dense_cpu']:.2f} | "
                         f"{r['sbm_first_over_dense']:.2f} | {r['load_average'][0]:.1f} |")
        counts = first.get("dispatch")
        if counts:
            lines += ["", f"Torch operators per step: SBM {counts['sbm']['ops_per_step']}, "
                      f"dense {counts['dense']['ops_per_step']}; autograd nodes per forward: "
                      f"SBM {counts['sbm']['autograd_nodes_per_forward']}, dense "
                      f"{counts['dense']['autograd_nodes_per_forward']} (numpy's work in "
                      "the SBM sampler is not a torch operator and is not counted)."]
        if "gemm_flops_per_step" in first:
            f = first["gemm_flops_per_step"]
            lines += ["", f"Matrix-product FLOPs per step (torch.utils.flop_counter; dense "
                      f"SDPA as its GEMMs, the backward's recomputed scores included): SBM "
                      f"{f['sbm'] / 1e9:.3f} G, dense {f['dense'] / 1e9:.3f} G, ratio "
                      f"{first['gemm_flops_sbm_over_dense']:.3f}. The SBM sampler takes "
                      f"{1e3 * first['sampler_s_per_step']:.1f} ms per step "
                      f"({first['threads']} thread(s)), its rates' GEMMs "
                      f"{first['sampler_gemm_flops_per_step'] / 1e9:.3f} G of the SBM "
                      "FLOPs. Floor of SBM / dense, with the SBM GEMMs outside the sampler "
                      "at the dense step's FLOP rate (all of its time charged to its "
                      "GEMMs) and the sampler's time on top: "
                      f"{first['floor_sbm_over_dense']:.2f}; measured "
                      f"{first['sbm_over_dense']:.2f}."]
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
