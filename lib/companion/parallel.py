"""Run one library function under ``torchrun`` with N processes, from a notebook.

A chapter runs in a Jupyter kernel: one process. Its heavy passes (the context-similarity
corpus pass, the LRA training jobs) are written for ``torch.distributed`` (each rank takes
its share, the results are all-reduced or gathered). :func:`torchrun_call` is the bridge:
it writes the arguments to a temporary folder, starts
``python -m torch.distributed.run --standalone --nproc-per-node N -m companion.parallel``,
whose ranks each initialise a process group (gloo on CPU, nccl on GPU), call the same
function with the same arguments, and rank 0 saves the return value, which the caller gets
back. With ``nproc == 1`` the function is called in-process and nothing is started, so a
chapter calls :func:`torchrun_call` unconditionally and the book's ``--nproc N``
(environment variable ``COMPANION_NPROC``, see :func:`requested_nproc`) decides.

The function must be importable by name (``"package.module:function"``), take its inputs
as keyword arguments that ``torch.save`` can write, and return the same value on rank 0
whatever the number of processes (that is the function's contract, and its tests').

>>> torchrun_call("statistics:fmean", {"data": [1.0, 2.0, 6.0]}, nproc=1)
3.0
>>> requested_nproc({"COMPANION_NPROC": "4"})
4
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from companion._validate import check_choice, check_int, describe

__all__ = ["torchrun_call", "requested_nproc", "resolve_target", "is_rank_zero"]

_ENV = "COMPANION_NPROC"


def requested_nproc(environ: Mapping[str, str] | None = None) -> int:
    """The number of processes the book asked for (``COMPANION_NPROC``, default 1).

    Raises ``ValueError`` naming the variable when it is not a positive integer.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(_ENV, "1").strip() or "1"
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{_ENV}: expected a positive integer, got {text!r}") from None
    if value < 1:
        raise ValueError(f"{_ENV}: expected a positive integer, got {text!r}")
    return value


def resolve_target(target: str):
    """The function named ``"package.module:function"``.

    Raises ``ValueError`` for a malformed name and ``ImportError``/``AttributeError`` with
    the name when it cannot be found.
    """
    if not isinstance(target, str):
        raise TypeError(f"target: expected a str 'package.module:function', got {describe(target)}")
    module, sep, name = target.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"target: expected 'package.module:function', got {target!r}")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise AttributeError(f"target: {module!r} has no function {name!r}")
    return fn


def is_rank_zero() -> bool:
    """True outside ``torch.distributed`` and on its rank 0 (the rank that reports)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def torchrun_call(target: str, kwargs: dict[str, Any], *, nproc: int = 1,
                  device: str = "cpu", threads_per_process: int | None = None,
                  timeout: float | None = None) -> Any:
    """Call ``target(**kwargs)`` under ``torchrun`` with ``nproc`` processes; rank 0's result.

    Parameters
    ----------
    target : ``"package.module:function"``, importable in a fresh interpreter.
    kwargs : keyword arguments, written with ``torch.save`` (tensors, numpy arrays, plain
        Python values, dataclasses of those).
    nproc : processes; 1 calls ``target`` here, in this process.
    device : "cpu" (gloo backend) or "cuda" (nccl; rank r uses GPU ``LOCAL_RANK``).
    threads_per_process : torch threads per rank (default: the machine's cores / nproc,
        at least 1), so that N ranks do not oversubscribe the CPU.
    timeout : seconds for the whole ``torchrun`` (None: no limit).

    Returns
    -------
    What ``target`` returned on rank 0.

    Raises
    ------
    RuntimeError
        ``torchrun`` failed; the message ends with the tail of its output.

    Complexity: one interpreter start and one ``import torch`` per rank (a few seconds),
    plus the function's own cost divided among the ranks.
    """
    fn = resolve_target(target)
    nproc = check_int("nproc", nproc, minimum=1)
    check_choice("device", device, ("cpu", "cuda"))
    if nproc == 1:
        return fn(**kwargs)
    import torch

    if threads_per_process is None:
        threads_per_process = max(1, (os.cpu_count() or 1) // nproc)
    threads_per_process = check_int("threads_per_process", threads_per_process, minimum=1)
    with tempfile.TemporaryDirectory(prefix="companion-torchrun-") as tmp:
        folder = Path(tmp)
        torch.save({"target": target, "kwargs": kwargs, "device": device,
                    "threads": threads_per_process}, folder / "call.pt")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "companion.parallel", str(folder)]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads_per_process))
        env.pop(_ENV, None)  # the ranks themselves never start another torchrun
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)
        # the ranks' own output (progress bars of rank 0) is shown once, after the fact
        if proc.stdout:
            sys.stderr.write(proc.stdout[-20_000:])
        if proc.returncode != 0 or not (folder / "result.pt").exists():
            raise RuntimeError(
                f"torchrun with {nproc} processes failed for {target} (exit "
                f"{proc.returncode}); last output:\n{proc.stdout[-3000:]}")
        return torch.load(folder / "result.pt", weights_only=False)


def _rank_main(folder: Path) -> int:
    import torch
    import torch.distributed as dist

    call = torch.load(folder / "call.pt", weights_only=False)
    torch.set_num_threads(int(call["threads"]))
    if call["device"] == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    try:
        result = resolve_target(call["target"])(**call["kwargs"])
        if dist.get_rank() == 0:
            partial = folder / "result.pt.tmp"
            torch.save(result, partial)
            partial.replace(folder / "result.pt")  # a result file is always whole
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(_rank_main(Path(sys.argv[1])))
