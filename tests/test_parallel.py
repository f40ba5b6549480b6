"""companion.parallel: a library function under torchrun with 2 CPU processes gives what
one process gives (the sums all-reduced over gloo, the per-window parts in window order)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from companion.parallel import requested_nproc, resolve_target, torchrun_call


def rank_sum(values: torch.Tensor) -> dict:
    """Each rank sums its share of ``values`` (every world-th element); all-reduced."""
    import torch.distributed as dist

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    part = values[rank::world].sum().reshape(1)
    if world > 1:
        dist.all_reduce(part)
    return {"sum": part, "world": world}


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _tests_importable(monkeypatch):
    """The ranks import this module as ``tests.test_parallel``: the checkout on their path."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    monkeypatch.chdir(ROOT)


def test_one_process_calls_in_place():
    out = torchrun_call("tests.test_parallel:rank_sum", {"values": torch.arange(10.0)}, nproc=1)
    assert out["world"] == 1 and float(out["sum"]) == 45.0


def test_two_gloo_processes_equal_one():
    values = torch.arange(1, 12, dtype=torch.float64)
    two = torchrun_call("tests.test_parallel:rank_sum", {"values": values}, nproc=2,
                        threads_per_process=1, timeout=300)
    assert two["world"] == 2
    assert float(two["sum"]) == float(values.sum())


def test_failure_names_the_target():
    with pytest.raises(RuntimeError, match="rank_sum"):
        torchrun_call("tests.test_parallel:rank_sum", {"values": "not a tensor"}, nproc=2,
                      threads_per_process=1, timeout=300)


@pytest.mark.parametrize("text, message",
                         [("0", "positive"), ("two", "positive"), ("-1", "positive")])
def test_requested_nproc_rejects_bad_values(text, message):
    with pytest.raises(ValueError, match=f"COMPANION_NPROC.*{message}"):
        requested_nproc({"COMPANION_NPROC": text})


def test_requested_nproc_default_is_one():
    assert requested_nproc({}) == 1


@pytest.mark.parametrize("target, exc", [("math.hypot", ValueError), (":x", ValueError),
                                         ("math:nope", AttributeError), (3, TypeError)])
def test_resolve_target_bad_names(target, exc):
    with pytest.raises(exc, match="target"):
        resolve_target(target)


def test_bad_nproc_and_device():
    with pytest.raises(ValueError, match="nproc"):
        torchrun_call("statistics:fmean", {"data": [1.0]}, nproc=0)
    with pytest.raises(ValueError, match="device"):
        torchrun_call("statistics:fmean", {"data": [1.0]}, nproc=2, device="tpu")
