"""Wall-clock timing of a call, the one way chapters and benchmarks time things.

``call_seconds(fn, repeats=5, warmup=1, reduce="median")`` runs ``fn()`` ``warmup`` times
untimed (first-call costs: allocation, kernel selection, caches), then ``repeats`` times
timed with :func:`time.perf_counter`, and reduces the repeats to one number: the
``"median"`` (robust on a shared machine) or the ``"min"`` (the best case, what the
hardware allows). On CUDA it synchronises before reading the clock, so asynchronous
kernels are counted.

Speed claims in this book are ratios of two such numbers measured in the same run, never
absolute times (the machine may be busy).

>>> seconds = call_seconds(lambda: sum(range(1000)), repeats=3)
>>> seconds > 0
True
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from companion._validate import check_bool, check_choice, check_int, describe

__all__ = ["call_seconds", "REDUCTIONS"]

REDUCTIONS = ("median", "min")


def call_seconds(fn: Callable[[], object], *, repeats: int = 5, warmup: int = 1,
                 reduce: str = "median", cuda_sync: bool = False) -> float:
    """Seconds one call of ``fn()`` takes: ``reduce`` over ``repeats`` timed calls after
    ``warmup`` untimed ones.

    Parameters
    ----------
    fn : a callable of no arguments (wrap arguments with a lambda or functools.partial).
    repeats : timed calls, >= 1.
    warmup : untimed calls first, >= 0.
    reduce : "median" or "min" of the timed calls.
    cuda_sync : call ``torch.cuda.synchronize()`` before each clock reading.

    Returns
    -------
    float, seconds.

    Complexity: ``warmup + repeats`` calls of ``fn``.
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable of no arguments, got {describe(fn)}")
    repeats = check_int("repeats", repeats, minimum=1)
    warmup = check_int("warmup", warmup, minimum=0)
    check_choice("reduce", reduce, REDUCTIONS)
    cuda_sync = check_bool("cuda_sync", cuda_sync)
    sync = _cuda_synchronize if cuda_sync else _nothing
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return float(statistics.median(times) if reduce == "median" else min(times))


def _nothing() -> None:
    return None


def _cuda_synchronize() -> None:
    import torch

    torch.cuda.synchronize()
