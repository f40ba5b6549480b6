"""Wall-clock timing of a call, the one way chapters and benchmarks time things.

``call_seconds(fn, repeats=5, warmup=1, reduce="median")`` runs ``fn()`` ``warmup`` times
untimed (first-call costs: allocation, kernel selection, caches), then ``repeats`` times
timed with :func:`time.perf_counter`, and reduces the repeats to one number: the
``"median"`` (robust on a shared machine) or the ``"min"`` (the best case, what the
hardware allows). On CUDA it synchronises before reading the clock, so asynchronous
kernels are counted.

:func:`call_times` returns the timed calls themselves (for a bootstrap over repeats, or
to keep timing while a time budget lasts); :func:`call_seconds` reduces them.

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

from companion._validate import check_bool, check_choice, check_int, check_number, describe

__all__ = ["call_seconds", "call_times", "REDUCTIONS"]

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
    check_choice("reduce", reduce, REDUCTIONS)
    times = call_times(fn, repeats=repeats, warmup=warmup, cuda_sync=cuda_sync)
    return float(statistics.median(times) if reduce == "median" else min(times))


def call_times(fn: Callable[[], object], *, repeats: int = 5, warmup: int = 1,
               cuda_sync: bool = False, budget_s: float | None = None,
               max_repeats: int | None = None) -> list[float]:
    """Seconds of every timed call of ``fn()``, in call order, after ``warmup`` untimed
    calls.

    Parameters
    ----------
    fn, warmup, cuda_sync : as for :func:`call_seconds`.
    repeats : timed calls, >= 1 (the least number with a ``budget_s``).
    budget_s : if given (seconds, >= 0), keep timing further calls while the timed calls
        so far add up to less than ``budget_s``, up to ``max_repeats`` calls in all.
    max_repeats : the most timed calls with a ``budget_s`` (default: ``repeats``); at
        least ``repeats``.

    Returns
    -------
    list of float, seconds, one per timed call.

    Complexity: ``warmup`` + between ``repeats`` and ``max_repeats`` calls of ``fn``.

    >>> len(call_times(lambda: None, repeats=2, warmup=0))
    2
    >>> len(call_times(lambda: None, repeats=1, budget_s=60.0, max_repeats=4))
    4
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable of no arguments, got {describe(fn)}")
    repeats = check_int("repeats", repeats, minimum=1)
    warmup = check_int("warmup", warmup, minimum=0)
    cuda_sync = check_bool("cuda_sync", cuda_sync)
    if budget_s is not None:
        budget_s = check_number("budget_s", budget_s, minimum=0.0)
    most = repeats if max_repeats is None else check_int("max_repeats", max_repeats,
                                                         minimum=repeats)
    sync = _cuda_synchronize if cuda_sync else _nothing
    for _ in range(warmup):
        fn()
    sync()
    times: list[float] = []
    while len(times) < repeats or (budget_s is not None and len(times) < most
                                   and sum(times) < budget_s):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def _nothing() -> None:
    return None


def _cuda_synchronize() -> None:
    import torch

    torch.cuda.synchronize()
