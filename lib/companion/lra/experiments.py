"""The SBM-Transformer chapter's experiment driver: many seeded training runs, per-item
test records, bootstrap intervals, FLOP counts and peak-memory measurement.

Definition
----------
- :func:`compare_attentions` is the chapter's training: every task with dense and SBM
  attention over the same seeds, and a sweep of the density penalty (via :func:`run_jobs`).
- :func:`run_jobs` trains one :class:`~companion.lra.model.LRAClassifier` per
  :class:`TrainJob` (a task, an attention, a seed, a density penalty) with
  :func:`companion.lra.train.train`, in worker processes when several CPUs are free
  (each worker one torch thread; the jobs are independent and each is seeded by its
  own ``seed``, so the results do not depend on the number of workers or their order).
  Each run also records, per test item, whether the prediction is right, the
  negative log-likelihood of the true label and the mean density over layers and heads
  (:func:`per_item`).
- :func:`bootstrap` gives a percentile interval of a statistic of ``[seeds, items]``
  arrays, resampling seeds and test items (two-level bootstrap; paired arrays are
  resampled together).
- :func:`model_flops` counts the inference FLOPs of one input through the classifier
  (dense, or SBM at a given density), :func:`peak_memory` measures the resident-set
  peak of a callable, :func:`loglog_slope` fits a log-log slope with a bootstrap over
  repeated timings, :func:`poisson_dispersion` tests ``E[A] = P`` from Monte Carlo counts.
"""
from __future__ import annotations

import ctypes
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
import multiprocessing

import numpy as np
import torch

from companion._validate import check_bool, check_int
from companion.heap import set_malloc_thresholds
from companion.lra.model import LRAClassifier
from companion.lra.train import TrainConfig, TrainResult, train

__all__ = ["TrainJob", "RunRecord", "run_jobs", "compare_attentions", "Comparison", "ddp_jobs",
           "per_item", "bootstrap", "keep_freed_memory", "model_flops", "peak_memory",
           "loglog_slope", "poisson_dispersion", "spearman"]


@dataclass(frozen=True)
class TrainJob:
    """One training run: ``task`` names the entry of the data dict given to
    :func:`run_jobs`; the rest are the model and :class:`TrainConfig` settings.

    >>> g = torch.Generator().manual_seed(0)
    >>> tokens, labels = torch.randint(1, 5, (8, 6), generator=g), torch.arange(8) % 2
    >>> data = {"toy": [(tokens, labels)] * 3}
    >>> job = TrainJob("toy", "sbm", seed=0, lam=0.0, steps=1, vocab=5, classes=2, pad=0,
    ...                clusters=2, dropout=0.0, lr=1e-3, batch=4)
    >>> job.key
    ('toy', 'sbm', 0, 0.0)
    """

    task: str
    attention: str
    seed: int
    lam: float
    steps: int
    vocab: int
    classes: int
    pad: int | None
    clusters: int
    dropout: float
    lr: float
    batch: int
    eval_batch: int = 100

    @property
    def key(self):
        return (self.task, self.attention, self.seed, self.lam)


@dataclass
class RunRecord:
    """A trained model, its :class:`TrainResult` and per-test-item records
    (numpy arrays over the test split: ``correct`` bool, ``nll``, ``density``).

    >>> g = torch.Generator().manual_seed(0)
    >>> tokens, labels = torch.randint(1, 5, (8, 6), generator=g), torch.arange(8) % 2
    >>> data = {"toy": [(tokens, labels)] * 3}
    >>> job = TrainJob("toy", "sbm", seed=0, lam=0.0, steps=1, vocab=5, classes=2, pad=0,
    ...                clusters=2, dropout=0.0, lr=1e-3, batch=4)
    >>> record = run_jobs([job], data, device="cpu", workers=1, nproc=1)[job.key]
    >>> isinstance(record, RunRecord), record.correct.shape, record.density.shape
    (True, (8,), (8,))
    """

    model: LRAClassifier
    result: TrainResult
    correct: np.ndarray
    nll: np.ndarray
    density: np.ndarray
    seconds: float


def _build(job: TrainJob, seq_len: int, device) -> LRAClassifier:
    torch.manual_seed(job.seed)
    return LRAClassifier(job.vocab, seq_len, job.classes, attention=job.attention,
                         num_clusters=job.clusters, pad_id=job.pad, dropout=job.dropout,
                         device=device)


def per_item(model: LRAClassifier, tokens: torch.Tensor, labels: torch.Tensor, *,
             batch_size: int = 100, seed: int = 0):
    """Per test item: prediction right (bool), NLL of the true label, mean density over
    layers and heads (1 for dense). SBM graphs drawn with a generator seeded ``seed``.

    >>> from companion.lra.model import LRAClassifier
    >>> model = LRAClassifier(5, 6, 2, attention="dense", dim=8, heads=2, head_dim=4, ffn=8,
    ...                       num_layers=1)
    >>> tokens, labels = torch.randint(1, 5, (3, 6)), torch.tensor([0, 1, 1])
    >>> correct, nll, density = per_item(model, tokens, labels)
    >>> correct.dtype, bool((nll > 0).all()), density.tolist()  # dense: density 1
    (dtype('bool'), True, [1.0, 1.0, 1.0])
    """
    gen = torch.Generator(device=tokens.device).manual_seed(seed)
    was = model.training
    model.eval()
    correct, nll, dens = [], [], []
    with torch.no_grad():
        for s in range(0, len(labels), batch_size):
            logits, dd = model(tokens[s:s + batch_size], generator=gen)
            y = labels[s:s + batch_size]
            correct.append((logits.argmax(-1) == y).cpu())
            nll.append(torch.nn.functional.cross_entropy(logits, y, reduction="none").cpu())
            dens.append(torch.stack([d.mean(1) for d in dd]).mean(0).cpu())
    model.train(was)
    return (torch.cat(correct).numpy(), torch.cat(nll).double().numpy(),
            torch.cat(dens).double().numpy())


def _train_one(job: TrainJob, splits, device, progress: bool):
    t0 = time.perf_counter()
    model = _build(job, splits[0][0].shape[1], device)
    config = TrainConfig(steps=job.steps, batch_size=job.batch, lr=job.lr, lam=job.lam,
                         eval_every=max(job.steps // 5, 1), eval_batch_size=job.eval_batch,
                         seed=job.seed)
    result = train(model, *splits, config, progress=progress)
    correct, nll, dens = per_item(model, *splits[2], batch_size=job.eval_batch,
                                  seed=job.seed + 7)
    return model, result, correct, nll, dens, time.perf_counter() - t0


_DATA: dict = {}


def keep_freed_memory(*, mmap_threshold: int = 32 << 20, trim_threshold: int = 256 << 20) -> bool:
    """Let glibc's heap in this process reuse freed buffers instead of mapping fresh pages.

    By default glibc serves large buffers (from 128 KiB, a threshold it adapts) with their
    own mapping and returns the top of the heap to the system once more than twice that
    is free, so a training step that allocates and frees the same few-MiB buffers (the
    SBM heads' count matrices and Poisson uniforms) gets fresh zeroed pages each time:
    about 2,000 page faults per step of the ci Pathfinder model, and 10-15 % of its CPU
    time. With buffers below ``mmap_threshold`` taken from the heap and up to
    ``trim_threshold`` of free heap kept, the pages are reused. Only where memory comes
    from: every value computed is the same. Process-wide and permanent: for worker
    processes that only train (:func:`run_jobs` calls it in each one), not for a process
    that later measures memory (:func:`peak_memory`). Returns False where glibc's
    ``mallopt`` is not available (nothing is changed). ``mmap_threshold`` is at most
    glibc's ``DEFAULT_MMAP_THRESHOLD_MAX``, ``4 MiB * sizeof(long)`` (32 MiB on 64-bit):
    mallopt(3) documents it as the upper limit (the glibc 2.36 of our CI machine
    accepts more; other versions may refuse it), so it is checked here before anything
    is set and neither threshold changes on a refusal.

    >>> keep_freed_memory(mmap_threshold=-1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: mmap_threshold: expected an int in [0, ...], got -1
    >>> keep_freed_memory(mmap_threshold=(32 << 20) + 1)  # over 32 MiB: refused first
    Traceback (most recent call last):
    ValueError: mmap_threshold: expected an int in [0, 33554432], got 33554433
    """
    return set_malloc_thresholds(mmap_threshold, trim_threshold)


def _init_worker(data):
    torch.set_num_threads(1)
    keep_freed_memory()
    _DATA.clear()
    _DATA.update(data)


def _worker(job: TrainJob):
    model, result, correct, nll, dens, seconds = _train_one(job, _DATA[job.task], "cpu", False)
    return job, model.state_dict(), result, correct, nll, dens, seconds


def default_workers(n_jobs: int) -> int:
    """Worker processes for ``n_jobs`` CPU jobs: ``COMPANION_LRA_WORKERS`` if set, else
    one per CPU this process may run on, at most ``n_jobs``.

    Not the runner's torch-thread share (``COMPANION_TORCH_THREADS``): each worker runs
    one torch thread, and a book build that runs two chapters at once on two cores gives
    this chapter one thread, which ran its training one job after another even once the
    other chapter had finished. With one worker per CPU the operating system shares the
    cores while another chapter runs, and this chapter takes them all when it is alone.
    The results do not depend on the number of workers (:func:`run_jobs`).

    >>> 1 <= default_workers(3) <= 3
    True
    """
    n_jobs = check_int("n_jobs", n_jobs, minimum=0)
    env = os.environ.get("COMPANION_LRA_WORKERS")
    if env:
        return max(1, min(int(env), n_jobs))
    try:
        avail = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        avail = os.cpu_count() or 1
    return max(1, min(avail, n_jobs))


def ddp_jobs(jobs, data: dict, *, device: str = "cpu", progress: bool = False) -> list:
    """Train every job with DistributedDataParallel over the ranks of the current process
    group (a :func:`companion.parallel.torchrun_call` target; see :func:`run_jobs`).

    Every rank trains every job, in order, on its slice of each global batch
    (:func:`companion.lra.train.train`); rank ``r`` uses GPU ``LOCAL_RANK`` when
    ``device`` is "cuda". Returns, on every rank, ``[(job, state_dict, TrainResult,
    correct, nll, density, seconds)]`` with CPU tensors.

    >>> g = torch.Generator().manual_seed(0)
    >>> tokens, labels = torch.randint(1, 5, (8, 6), generator=g), torch.arange(8) % 2
    >>> data = {"toy": [(tokens, labels)] * 3}
    >>> job = TrainJob("toy", "sbm", seed=0, lam=0.0, steps=1, vocab=5, classes=2, pad=0,
    ...                clusters=2, dropout=0.0, lr=1e-3, batch=4)
    >>> [(row[0].key, row[2].best_step >= 0) for row in ddp_jobs([job], data)]  # 1 process
    [(('toy', 'sbm', 0, 0.0), True)]
    """
    import torch.distributed as dist
    from torch import nn

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    dev = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
           if device == "cuda" else torch.device("cpu"))
    out = []
    for job in jobs:
        t0 = time.perf_counter()
        splits = [tuple(x.to(dev) for x in split) for split in data[job.task]]
        model = _build(job, splits[0][0].shape[1], dev)
        net = model if world == 1 else nn.parallel.DistributedDataParallel(
            model, device_ids=[dev.index] if dev.type == "cuda" else None)
        config = TrainConfig(steps=job.steps, batch_size=job.batch, lr=job.lr, lam=job.lam,
                             eval_every=max(job.steps // 5, 1),
                             eval_batch_size=job.eval_batch, seed=job.seed)
        result = train(net, *splits, config, progress=progress and rank == 0)
        # every rank evaluates the whole test split: the same numbers everywhere
        correct, nll, dens = per_item(model, *splits[2], batch_size=job.eval_batch,
                                      seed=job.seed + 7)
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        out.append((job, state, result, correct, nll, dens, time.perf_counter() - t0))
    return out


def run_jobs(jobs, data: dict, *, device, workers: int | None = None,
             progress: bool = False, nproc: int | None = None) -> dict:
    """Train every job; returns ``{job.key: RunRecord}``.

    ``data`` maps a job's ``task`` to its ``[(train), (dev), (test)]`` splits of
    ``(tokens, labels)`` tensors on ``device``. With ``workers > 1`` (CPU only) the jobs
    run in that many spawned processes of one torch thread each, longest first.

    With ``nproc > 1`` (default: the book's ``--nproc``, environment variable
    ``COMPANION_NPROC``; see :mod:`companion.parallel`) every job is trained instead by
    DistributedDataParallel under ``torchrun`` with ``nproc`` processes (gloo on CPU,
    nccl with one GPU per process), :func:`ddp_jobs`. Each process takes ``1/nproc`` of
    every global batch, so ``batch`` must divide by ``nproc``; without dropout the result
    equals one process up to float rounding (the test), with dropout each process draws
    its own masks.

    >>> g = torch.Generator().manual_seed(0)
    >>> tokens, labels = torch.randint(1, 5, (8, 6), generator=g), torch.arange(8) % 2
    >>> data = {"toy": [(tokens, labels)] * 3}
    >>> job = TrainJob("toy", "sbm", seed=0, lam=0.0, steps=1, vocab=5, classes=2, pad=0,
    ...                clusters=2, dropout=0.0, lr=1e-3, batch=4)
    >>> sorted(run_jobs([job], data, device="cpu", workers=1, nproc=1))
    [('toy', 'sbm', 0, 0.0)]
    """
    from companion.parallel import requested_nproc, torchrun_call

    jobs = list(jobs)
    device = torch.device(device)
    nproc = requested_nproc() if nproc is None else check_int("nproc", nproc, minimum=1)
    if nproc > 1 and jobs:
        for job in jobs:
            if job.batch % nproc:
                raise ValueError(f"nproc: every job's batch must divide by nproc={nproc}; "
                                 f"job {job.key} has batch {job.batch}")
        cpu_data = {t: [tuple(x.cpu() for x in split) for split in splits]
                    for t, splits in data.items()}
        rows = torchrun_call("companion.lra.experiments:ddp_jobs",
                             {"jobs": jobs, "data": cpu_data, "device": device.type,
                              "progress": progress}, nproc=nproc, device=device.type)
        out = {}
        for job, state, result, correct, nll, dens, sec in rows:
            model = _build(job, data[job.task][0][0].shape[1], device)
            model.load_state_dict(state)
            model.eval()
            out[job.key] = RunRecord(model, result, correct, nll, dens, sec)
        return {job.key: out[job.key] for job in jobs}
    if workers is None:
        workers = 1 if device.type != "cpu" else default_workers(len(jobs))
    workers = check_int("workers", workers, minimum=1)
    out = {}
    if workers == 1 or len(jobs) <= 1:
        for job in jobs:
            model, result, correct, nll, dens, sec = _train_one(job, data[job.task], device,
                                                                progress)
            out[job.key] = RunRecord(model, result, correct, nll, dens, sec)
        return out
    if device.type != "cpu":
        raise ValueError("workers: worker processes are for CPU runs; use workers=1 on GPU")
    cpu_data = {t: [tuple(x.cpu() for x in split) for split in splits]
                for t, splits in data.items()}
    order = sorted(jobs, key=lambda j: -(j.steps * (3 if j.attention == "sbm" else 1)
                                         * cpu_data[j.task][0][0].shape[1]))
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                             initargs=(cpu_data,)) as pool:
        for job, state, result, correct, nll, dens, sec in pool.map(_worker, order):
            model = _build(job, data[job.task][0][0].shape[1], device)
            model.load_state_dict(state)
            model.eval()
            out[job.key] = RunRecord(model, result, correct, nll, dens, sec)
    return {job.key: out[job.key] for job in jobs}


# ------------------------------------------------------------ the chapter's training
ATTENTIONS = ("dense", "sbm")


@dataclass
class Comparison:
    """The runs of :func:`compare_attentions`: ``records`` maps ``(task, attention,
    seed, lam)`` to its :class:`RunRecord`; ``seconds`` is the wall time of all of them,
    ``workers`` the worker processes they ran in.

    >>> c = Comparison({("toy", "dense", 0, 0.0): "run"}, [0], 0.0, 1.0, 1)
    >>> c.runs("toy", "dense")
    ['run']
    """

    records: dict
    seeds: list
    lam: float
    seconds: float
    workers: int

    def runs(self, task: str, attention: str) -> list:
        """The :class:`RunRecord` of every seed of the main runs (penalty ``lam``)."""
        return [self.records[task, attention, s, self.lam] for s in self.seeds]


def compare_attentions(tasks: dict, *, seeds, lam: float, sweep_task: str, sweep_lambdas,
                       steps: dict, clusters: int, batch: int, lr: dict, dropout: dict,
                       device, workers: int | None = None,
                       progress: bool = False) -> Comparison:
    """Train every task with dense and with SBM attention from the same seeds, and the SBM
    model of ``sweep_task`` at every other density penalty (first seed only).

    Parameters
    ----------
    tasks : ``{task: (splits, vocab, classes, pad)}``, ``splits`` the ``[(train), (dev),
        (test)]`` pairs of ``(tokens, labels)`` on ``device``, ``pad`` the padding token
        (None: no padding).
    seeds : training seeds of the main runs (the data stay fixed).
    lam : the density penalty of the main runs.
    sweep_task, sweep_lambdas : the task and penalties of the lambda sweep (``lam`` among
        them is the main runs' and not trained twice).
    steps, lr, dropout : per task; clusters, batch : the same for every task.
    device, workers, progress : as for :func:`run_jobs`.

    Returns
    -------
    :class:`Comparison`.

    Examples
    --------
    >>> tokens, labels = torch.randint(1, 5, (8, 6)), torch.arange(8) % 2
    >>> data = {"toy": ([(tokens, labels)] * 3, 5, 2, None)}
    >>> one = {"toy": 1}
    >>> runs = compare_attentions(data, seeds=[0], lam=0.0, sweep_task="toy",
    ...                           sweep_lambdas=[0.0, 0.5], steps=one, clusters=2, batch=4,
    ...                           lr={"toy": 1e-3}, dropout={"toy": 0.0}, device="cpu",
    ...                           workers=1)
    >>> sorted(runs.records)
    [('toy', 'dense', 0, 0.0), ('toy', 'sbm', 0, 0.0), ('toy', 'sbm', 0, 0.5)]
    """
    seeds = list(seeds)
    if not seeds:
        raise ValueError("seeds: expected at least one training seed")
    if sweep_task not in tasks:
        raise ValueError(f"sweep_task: expected one of {sorted(tasks)}, got {sweep_task!r}")

    def job(task, attention, seed, lam_value):
        _, vocab, classes, pad = tasks[task]
        return TrainJob(task=task, attention=attention, seed=seed, lam=lam_value,
                        steps=steps[task], vocab=vocab, classes=classes, pad=pad,
                        clusters=clusters, dropout=dropout[task], lr=lr[task], batch=batch)

    jobs = [job(task, attention, s, lam) for task in tasks for attention in ATTENTIONS
            for s in seeds]
    jobs += [job(sweep_task, "sbm", seeds[0], value) for value in sweep_lambdas
             if value != lam]
    device = torch.device(device)
    if workers is None:
        workers = 1 if device.type != "cpu" else default_workers(len(jobs))
    started = time.perf_counter()
    records = run_jobs(jobs, {task: spec[0] for task, spec in tasks.items()}, device=device,
                       workers=workers, progress=progress)
    return Comparison(records, seeds, lam, time.perf_counter() - started, workers)


# ------------------------------------------------------------------------- statistics
def bootstrap(stat, arrays: dict, *, reps: int = 1000, seed: int = 0,
              level: float = 0.95, resample_seeds: bool = True) -> tuple[float, float]:
    """Percentile interval of ``stat(arrays)`` under a two-level bootstrap.

    ``arrays`` maps names to arrays of shape ``[S, N]`` (seeds x test items), all paired:
    one draw picks ``S`` seed rows and ``N`` item columns with replacement and applies
    them to every array. With one seed (or ``resample_seeds=False``) only items are
    resampled.

    >>> a = np.ones((3, 50))
    >>> bootstrap(lambda d: d["a"].mean(), {"a": a}, reps=20)
    (1.0, 1.0)
    """
    arrs = {k: np.asarray(v, dtype=float) for k, v in arrays.items()}
    shapes = {v.shape for v in arrs.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"arrays: expected paired [seeds, items] arrays, got shapes {shapes}")
    s, n = next(iter(shapes))
    rng = np.random.default_rng(seed)
    vals = np.empty(reps)
    for r in range(reps):
        rows = rng.integers(0, s, s) if (resample_seeds and s > 1) else np.arange(s)
        cols = rng.integers(0, n, n)
        vals[r] = stat({k: v[rows][:, cols] for k, v in arrs.items()})
    a = (1 - level) / 2
    return float(np.quantile(vals, a)), float(np.quantile(vals, 1 - a))


def spearman(x, y) -> float:
    """Spearman rank correlation (average ranks for ties); NaN when a side is constant.

    Examples
    --------
    >>> spearman([1, 2, 3], [10, 30, 20])
    0.5
    """
    from scipy.stats import rankdata

    rx, ry = rankdata(np.asarray(x, float)), rankdata(np.asarray(y, float))
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def model_flops(n_valid, density, *, attention: str, dim: int = 64,
                heads: int = 2, head_dim: int = 32, ffn: int = 128, num_layers: int = 2,
                clusters: int = 128, classes: int = 10) -> float:
    """Inference FLOPs (2 per multiply-add) of one input of ``n_valid`` tokens (numbers
    or numpy arrays of inputs; ``density`` is ignored for dense attention).

    Per layer: the QKV and output projections ``2 n dim (3 H d + H d)``, the FFN
    ``4 n dim ffn``, and per head the attention ``4 d E`` on ``E`` edges (dense: every
    valid pair, ``E = n^2``; SBM: ``E = density n^2``). SBM heads add the shared MLP on
    queries and keys (``8 n d^2``), the memberships ``sigmoid(MLP(.) C^T)``
    (``4 n d k``), ``C C^T`` (``2 k^2 d``) and ``Qhat S`` in fastRG (``2 n k^2``).
    The classifier adds ``2 (dim ffn + ffn classes)``. Embedding look-ups, LayerNorm,
    softmax and the O(E) index work of sampling are not counted (O(n) or O(E) each).

    >>> dense = model_flops(1024, None, attention="dense")
    >>> sbm = model_flops(1024, 0.1, attention="sbm")
    >>> sbm < dense, model_flops([512, 1024], [0.1, 0.1], attention="sbm").shape
    (True, (2,))

    References
    ----------
    Cho et al., arXiv 2210.15541: a cost linear in the number of edges (abstract); the
    architecture from the authors' ``lra_config.py``.
    """
    n = np.asarray(n_valid, dtype=float)
    per_layer = 2 * n * dim * 4 * heads * head_dim + 4 * n * dim * ffn
    edges = (1.0 if attention == "dense" else np.asarray(density, dtype=float)) * n * n
    head = 4 * head_dim * edges
    if attention == "sbm":
        head += (8 * n * head_dim ** 2 + 4 * n * head_dim * clusters
                 + 2 * clusters ** 2 * head_dim + 2 * n * clusters ** 2)
    total = num_layers * (per_layer + heads * head) + 2 * (dim * ffn + ffn * classes)
    return float(total) if np.ndim(total) == 0 else total


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("VmHWM not in /proc/self/status")


def peak_memory(fn) -> float | None:
    """Peak resident memory (bytes) that ``fn()`` adds on CPU, or None where it cannot be
    measured (not Linux).

    torch's CPU allocator keeps no statistics, so: glibc's ``mallopt`` sets the mmap
    threshold to 64 KiB (every larger buffer is its own mapping, returned to the system
    when freed, so the resident set follows live tensors), one warm-up call, then the
    kernel's high-water mark is reset (``/proc/self/clear_refs``) and
    ``VmHWM - RSS before`` is read after a second call. The threshold stays set: call
    this after the training of a chapter, not before.

    In a fresh process (the high-water mark is the process's own: what ran before in the
    same process, and the mmap threshold this sets, would change what it reads):

    >>> import subprocess, sys
    >>> code = ("import numpy as np; from companion.lra.experiments import peak_memory; "
    ...         "p = peak_memory(lambda: np.ones(1 << 22)); "  # 32 MiB of float64
    ...         "print(p is None or p > 16 * 2 ** 20)")
    >>> subprocess.run([sys.executable, "-c", code], capture_output=True,
    ...                text=True, check=True).stdout.strip()
    'True'
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 65536)  # M_MMAP_THRESHOLD
        fn()
        base = _rss()
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        fn()
        return float(max(_hwm() - base, 0))
    except OSError:
        return None


def loglog_slope(x, times, *, reps: int = 1000, seed: int = 0, paired: bool = False):
    """Least-squares slope of ``log(median time)`` on ``log x`` and a bootstrap interval.

    ``times`` is ``[len(x), R]``: ``R`` repeated timings at every ``x``. The bootstrap
    resamples, at every ``x``, its own repeats; with ``paired`` it resamples whole columns
    instead, the same ``R`` indices for every ``x``: for timings taken in rounds (column
    ``r`` is round ``r``, one call at every ``x``), where a slow spell of the machine
    falls on one round at every ``x`` and so shifts the medians but hardly the slope.

    >>> x = np.array([1e3, 1e4, 1e5])
    >>> slow_round = np.array([1.0, 1.0, 5.0, 1.0, 1.0])  # round 3: 5x slower everywhere
    >>> times = 1e-6 * x[:, None] * slow_round
    >>> slope, interval = loglog_slope(x, times, reps=200, paired=True)
    >>> round(slope, 6), [round(v, 6) for v in interval]
    (1.0, [1.0, 1.0])
    """
    paired = check_bool("paired", paired)
    x = np.log(np.asarray(x, float))
    t = np.asarray(times, float)
    fit = lambda tt: float(np.polyfit(x, np.log(np.median(tt, axis=1)), 1)[0])  # noqa: E731
    rng = np.random.default_rng(seed)
    r = t.shape[1]
    if paired:
        vals = [fit(t[:, rng.integers(0, r, r)]) for _ in range(reps)]
    else:
        vals = [fit(np.take_along_axis(t, rng.integers(0, r, t.shape), axis=1))
                for _ in range(reps)]
    return fit(t), (float(np.quantile(vals, 0.025)), float(np.quantile(vals, 0.975)))


def poisson_dispersion(counts: torch.Tensor, p: torch.Tensor, *, groups: int = 20,
                       reps: int = 1000, seed: int = 0):
    """``E[A] = P`` from ``R`` Monte Carlo draws, split into ``groups`` equal groups.

    Per group of ``r`` draws: the mean over entries of ``(mean count - P)^2 / (P / r)``,
    which is 1 (up to ``sqrt(2 / entries)``) when the counts have mean ``P`` and Poisson
    variance ``P``, and grows with any bias of the mean. Returns the mean over groups and
    a bootstrap interval over the groups. ``counts`` ``[R, entries]``, ``p``
    ``[entries]`` (entries with ``P > 0``).

    >>> g = torch.Generator().manual_seed(0)
    >>> p = torch.full((50,), 2.0)
    >>> counts = torch.poisson(p.expand(400, 50), generator=g)
    >>> value, (lo, hi) = poisson_dispersion(counts, p, reps=100)
    >>> 0.5 < value < 1.5, poisson_dispersion(counts + 1, p, reps=100)[0] > 10
    (True, True)
    """
    c = counts.double()
    p = p.double()
    groups = check_int("groups", groups, minimum=2)
    r = c.shape[0] // groups
    if r < 1:
        raise ValueError(f"counts: {c.shape[0]} draws cannot fill {groups} groups")
    means = c[: r * groups].reshape(groups, r, -1).mean(1)
    per_group = (((means - p) ** 2) / (p / r)).mean(-1).numpy()
    rng = np.random.default_rng(seed)
    boot = [per_group[rng.integers(0, groups, groups)].mean() for _ in range(reps)]
    return float(per_group.mean()), (float(np.quantile(boot, 0.025)),
                                     float(np.quantile(boot, 0.975)))
