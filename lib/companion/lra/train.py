"""Training of the LRA classifiers: AdamW + OneCycle, best-dev checkpoint, density
tracking, DistributedDataParallel under ``torchrun``.

Definition
----------
:func:`train` runs ``steps`` optimiser steps of AdamW (betas 0.9/0.999, eps 1e-6, as the
paper's LRA runs) under a linear OneCycle learning-rate schedule. Each step draws a
*global* batch of ``batch_size`` examples with a seeded generator that every process
shares; under DistributedDataParallel process ``r`` of ``W`` takes the ``r``-th of ``W``
equal slices, so the averaged gradient equals the single-process gradient of the same
global batch. The loss is cross-entropy plus, for SBM attention,
``lam * mean density`` (:func:`companion.sbm.density_regularizer`).

Every ``eval_every`` steps (and at the end) the model is evaluated on the dev set; the
parameters with the best dev accuracy are kept and the test set is evaluated with them
("test accuracy at the best dev checkpoint"). The mean density of every layer and head
is recorded at every step (training batches) and at every evaluation.

Distributed: call inside a process group (``torch.distributed.init_process_group``,
gloo on CPU, nccl on GPU) or run ``torchrun --nproc_per_node=N -m companion.lra.train``;
evaluation shards the data over processes and all-reduces the counts. Losses and
densities in the history are all-reduced means over the global batch.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from companion._validate import check_int, check_number, describe
from companion.sbm import density_regularizer


@dataclass
class TrainConfig:
    """Hyper-parameters of :func:`train` (defaults: the paper's ListOps run).

    >>> TrainConfig(steps=10, batch_size=4).lr
    0.0005
    >>> TrainConfig(steps=0)
    Traceback (most recent call last):
        ...
    ValueError: steps: expected an int >= 1, got 0
    """

    steps: int = 5000
    batch_size: int = 128
    lr: float = 5e-4
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    pct_start: float = 0.1
    lam: float = 1e-4
    eval_every: int = 500
    eval_batch_size: int = 256
    grad_clip: float | None = None
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "batch_size", "eval_every", "eval_batch_size"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("seed", self.seed)
        check_number("lr", self.lr, minimum=0.0, min_open=True, expected="a positive float")
        check_number("lam", self.lam, minimum=0.0, expected="a nonnegative float")
        check_number("weight_decay", self.weight_decay, minimum=0.0)
        check_number("eps", self.eps, minimum=0.0, min_open=True)
        check_number("pct_start", self.pct_start, minimum=0.0, maximum=1.0, min_open=True,
                     max_open=True, expected="a fraction in (0, 1)")
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2):
            raise TypeError(f"betas: expected a pair (beta1, beta2), got {describe(self.betas)}")
        for i, beta in enumerate(self.betas):
            check_number(f"betas[{i}]", beta, minimum=0.0, maximum=1.0, max_open=True)
        if self.grad_clip is not None:
            check_number("grad_clip", self.grad_clip, minimum=0.0, min_open=True)


@dataclass
class TrainResult:
    """What :func:`train` measured.

    Attributes
    ----------
    losses, task_losses : per step, the total and the cross-entropy loss (global batch).
    densities : per step, ``[layers][heads]`` mean density over the global batch.
    evals : per evaluation, ``{"step", "dev_accuracy", "dev_density"}``.
    best_step, best_dev_accuracy : the kept checkpoint.
    test_accuracy, test_density : on the test set with the kept parameters;
        ``test_density`` is ``[layers][heads]``.
    seconds : wall time of the training loop (without final evaluation).

    >>> from companion.lra.model import LRAClassifier
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> model = LRAClassifier(5, 6, 2, attention="sbm", dim=8, heads=2, head_dim=4, ffn=8,
    ...                       num_layers=1, num_clusters=2)
    >>> tokens, labels = torch.randint(1, 5, (8, 6)), torch.arange(8) % 2
    >>> config = TrainConfig(steps=2, batch_size=4, eval_every=1)
    >>> result = train(model, (tokens, labels), (tokens, labels), (tokens, labels), config)
    >>> isinstance(result, TrainResult), len(result.losses), len(result.evals)
    (True, 2, 2)
    """

    losses: list = field(default_factory=list)
    task_losses: list = field(default_factory=list)
    densities: list = field(default_factory=list)
    evals: list = field(default_factory=list)
    best_step: int = -1
    best_dev_accuracy: float = float("nan")
    test_accuracy: float = float("nan")
    test_density: list = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def _world():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if _world()[1] > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def _split(data):
    """``(tokens, labels)`` or ``(tokens, tokens_2, labels)`` -> inputs tuple, labels."""
    if not isinstance(data, (tuple, list)) or len(data) not in (2, 3):
        raise ValueError("data: expected (tokens, labels) or (tokens, tokens_2, labels)")
    *inputs, labels = data
    for name, t in zip(("tokens", "tokens_2")[: len(inputs)] + ("labels",), (*inputs, labels)):
        if not isinstance(t, torch.Tensor) or t.dim() < 1:
            raise TypeError(f"data: expected tensors with a batch axis, got {describe(t)} "
                            f"for {name}")
    n = labels.shape[0]
    for t in inputs:
        if t.shape[0] != n:
            raise ValueError(f"data: {t.shape[0]} inputs but {n} labels")
    return tuple(inputs), labels


def evaluate(model: nn.Module, data, *, batch_size: int = 256, seed: int = 0):
    """Accuracy and ``[layers][heads]`` mean density of ``model`` on ``data``.

    Sharded over processes when a process group is initialised (each process takes
    every ``W``-th batch); SBM sampling uses a generator seeded with ``seed + rank``.

    >>> from companion.lra.model import LRAClassifier
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> model = LRAClassifier(5, 6, 2, attention="sbm", dim=8, heads=2, head_dim=4, ffn=8,
    ...                       num_layers=1, num_clusters=2)
    >>> tokens, labels = torch.randint(1, 5, (8, 6)), torch.arange(8) % 2
    >>> accuracy, density = evaluate(model, (tokens, labels))
    >>> 0 <= accuracy <= 1, len(density), len(density[0])  # [layers][heads]
    (True, 1, 2)
    """
    batch_size = check_int("batch_size", batch_size, minimum=1)
    seed = check_int("seed", seed)
    inputs, labels = _split(data)
    rank, world = _world()
    device = labels.device
    net = model.module if hasattr(model, "module") else model
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + rank)
    was_training = net.training
    net.eval()
    correct = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    dens = torch.zeros(net.num_layers, net.heads, dtype=torch.float64, device=device)
    with torch.no_grad():
        starts = list(range(0, labels.shape[0], batch_size))[rank::world]
        for s in starts:
            batch = [t[s:s + batch_size] for t in inputs]
            logits, densities = net(*batch, generator=gen)
            correct += (logits.argmax(-1) == labels[s:s + batch_size]).sum()
            count += logits.shape[0]
            per_input = [d.detach().to(torch.float64) for d in densities]
            dens += torch.stack([d[: logits.shape[0]].sum(0) for d in per_input])
    _all_reduce_sum(correct)
    _all_reduce_sum(count)
    _all_reduce_sum(dens)
    net.train(was_training)
    total = max(float(count), 1.0)
    return float(correct) / total, (dens / total).tolist()


def train(model: nn.Module, train_data, dev_data, test_data, config: TrainConfig, *,
          progress: bool = False) -> TrainResult:
    """Train ``model`` (an :class:`~companion.lra.model.LRAClassifier`, optionally
    wrapped in DDP) and evaluate it at its best dev checkpoint.

    Parameters
    ----------
    model : the classifier; under a process group wrap it in
        ``torch.nn.parallel.DistributedDataParallel`` first (or let :func:`main` do it).
    train_data, dev_data, test_data : ``(tokens, labels)`` (or two token tensors and
        labels for dual models), on the model's device, identical on every process.
    config : :class:`TrainConfig`. ``batch_size`` is the global batch; it must be
        divisible by the number of processes.
    progress : show a tqdm bar (rank 0 only).

    Returns
    -------
    TrainResult

    Complexity
    ----------
    ``steps`` forward/backward passes of ``batch_size / W`` examples per process, plus
    ``steps / eval_every`` dev evaluations.

    >>> from companion.lra.model import LRAClassifier
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> model = LRAClassifier(5, 6, 2, attention="sbm", dim=8, heads=2, head_dim=4, ffn=8,
    ...                       num_layers=1, num_clusters=2)
    >>> tokens, labels = torch.randint(1, 5, (8, 6)), torch.arange(8) % 2
    >>> config = TrainConfig(steps=3, batch_size=4, eval_every=1, lam=1e-3)
    >>> result = train(model, (tokens, labels), (tokens, labels), (tokens, labels), config)
    >>> result.best_step in (1, 2, 3), 0 <= result.test_accuracy <= 1
    (True, True)

    References
    ----------
    Cho et al., arXiv 2210.15541: the training objective with a penalty ``lam`` on the
    sampled graphs' density (settings from the authors' ``lra_config.py`` and
    ``run_tasks.sh``).
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config: expected a TrainConfig, got {describe(config)}")
    rank, world = _world()
    if config.batch_size % world:
        raise ValueError(
            f"batch_size: the global batch {config.batch_size} must divide evenly over "
            f"{world} processes")
    inputs, labels = _split(train_data)
    device = labels.device
    net = model.module if hasattr(model, "module") else model
    sbm = getattr(net, "attention", "dense") == "sbm"
    optimiser = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=config.betas,
                                  eps=config.eps, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimiser, max_lr=config.lr, total_steps=config.steps, pct_start=config.pct_start,
        anneal_strategy="linear")
    batch_gen = torch.Generator(device="cpu")
    batch_gen.manual_seed(config.seed)
    sample_gen = torch.Generator(device=device)
    sample_gen.manual_seed(config.seed * 1000 + 1 + rank)
    local = config.batch_size // world
    result = TrainResult()
    best_state = None
    steps = range(config.steps)
    if progress and rank == 0:
        from tqdm.auto import tqdm
        steps = tqdm(steps, desc=f"train ({getattr(net, 'attention', '?')})", leave=False)
    model.train()
    start = time.perf_counter()
    for step in steps:
        idx = torch.randint(labels.shape[0], (config.batch_size,), generator=batch_gen)
        idx = idx[rank * local:(rank + 1) * local].to(device)
        logits, densities = model(*[t[idx] for t in inputs], generator=sample_gen)
        task_loss = F.cross_entropy(logits, labels[idx])
        loss = task_loss + (density_regularizer(densities, config.lam) if sbm else 0.0)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        if config.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimiser.step()
        schedule.step()
        stats = torch.cat([torch.stack([loss.detach(), task_loss.detach()]).to(torch.float64),
                           torch.stack([d.detach().mean(0) for d in densities])
                           .to(torch.float64).reshape(-1)])
        stats = _all_reduce_sum(stats) / world
        result.losses.append(float(stats[0]))
        result.task_losses.append(float(stats[1]))
        result.densities.append(stats[2:].reshape(net.num_layers, net.heads).tolist())
        if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
            acc, dens = evaluate(model, dev_data, batch_size=config.eval_batch_size,
                                 seed=config.seed)
            result.evals.append({"step": step + 1, "dev_accuracy": acc, "dev_density": dens})
            if not acc <= result.best_dev_accuracy:  # first evaluation, or better
                result.best_dev_accuracy, result.best_step = acc, step + 1
                best_state = copy.deepcopy(net.state_dict())
    result.seconds = time.perf_counter() - start
    if best_state is not None:
        net.load_state_dict(best_state)
    result.test_accuracy, result.test_density = evaluate(
        model, test_data, batch_size=config.eval_batch_size, seed=config.seed + 7)
    return result


# ---------------------------------------------------------------------------- CLI
def _task_data(task: str, args, device):
    """Generate (train, dev, test), vocabulary size, classes, length, pad id for a task."""
    from companion.lra import listops, pathfinder

    if task == "listops":
        total = args.n_train + 2 * args.n_eval
        pairs = listops.generate(total, seed=args.seed, min_length=args.min_length,
                                 max_length=args.max_length, max_depth=args.max_depth)
        tokens, labels = listops.dataset(pairs, max_length=args.seq_len, device=device)
        vocab, classes, pad = listops.vocab_size(), 10, 0
    elif task == "pathfinder":
        total = args.n_train + 2 * args.n_eval
        data = pathfinder.generate(total, seed=args.seed, size=args.size,
                                   contour_length=args.contour_length)
        tokens = pathfinder.to_sequences(data.images).to(device)
        labels = data.labels.to(device)
        vocab, classes, pad = 256, 2, None
    else:
        raise ValueError(f"task: expected 'listops' or 'pathfinder', got {task!r}")
    a, b = args.n_train, args.n_train + args.n_eval
    splits = [(tokens[:a], labels[:a]), (tokens[a:b], labels[a:b]), (tokens[b:], labels[b:])]
    return splits, vocab, classes, tokens.shape[1], pad


def main(argv=None) -> dict:
    """``torchrun --nproc_per_node=N -m companion.lra.train --task listops ...``.

    Generates the task with the given seed (identically on every process), trains, and
    writes the :class:`TrainResult` as JSON to ``--out`` from rank 0.

    >>> import json, pathlib, tempfile
    >>> out = pathlib.Path(tempfile.mkdtemp()) / "result.json"
    >>> result = main(["--device", "cpu", "--n-train", "8", "--n-eval", "4", "--seq-len", "32",
    ...                "--min-length", "4", "--max-length", "30", "--max-depth", "2",
    ...                "--steps", "1", "--batch-size", "4", "--eval-every", "1",
    ...                "--clusters", "2", "--out", str(out)])
    test accuracy ... at step 1; wrote ...result.json
    >>> sorted(json.loads(out.read_text())) == sorted(result)
    True
    """
    from companion.devices import resolve_device
    from companion.lra.model import LRAClassifier

    p = argparse.ArgumentParser(prog="python -m companion.lra.train")
    p.add_argument("--task", choices=("listops", "pathfinder"), default="listops")
    p.add_argument("--attention", choices=("sbm", "dense"), default="sbm")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-train", type=int, default=96000)
    p.add_argument("--n-eval", type=int, default=2000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--min-length", type=int, default=500)
    p.add_argument("--max-length", type=int, default=2000)
    p.add_argument("--max-depth", type=int, default=10)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--contour-length", type=int, default=14)
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--lam", type=float, default=1e-4)
    p.add_argument("--clusters", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--out", default="lra_result.json")
    args = p.parse_args(argv)

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    device = resolve_device(args.device)
    if distributed:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if device.type == "cuda":
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(args.seed)
    splits, vocab, classes, length, pad = _task_data(args.task, args, device)
    model = LRAClassifier(vocab, length, classes, attention=args.attention,
                          num_clusters=args.clusters, dropout=args.dropout, pad_id=pad,
                          device=device)
    if distributed:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    config = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                         lam=args.lam, eval_every=args.eval_every, seed=args.seed)
    result = train(model, *splits, config, progress=True)
    out = {"args": vars(args), "result": result.to_dict()}
    if _world()[0] == 0:
        with open(args.out, "w") as fh:
            json.dump(out, fh)
        print(f"test accuracy {result.test_accuracy:.4f} at step {result.best_step}; "
              f"wrote {args.out}")
    if distributed:
        dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main()
