"""benchmarks/bench_gradient_flow_public.py times simulate's kernel from inside simulate by
wrapping the kernel simulate calls: the wrapper must see every step, never count more time
than the call took, and put simulate's kernel back (also when the run fails)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from companion.gradient_flow import kernels, simulation

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))  # the script imports results_io and the baseline
    try:
        spec = importlib.util.spec_from_file_location("bench_gf_public_under_test",
                                                      BENCH / "bench_gradient_flow_public.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))
        sys.path[:] = [p for p in sys.path if p != str(BENCH / "baselines")]


def test_time_in_kernel_sees_every_step_and_puts_the_kernel_back(bench):
    x, D = bench.make_state(7, 3, 2)
    steps = 4
    total, inside = bench.time_public(x, D, steps)  # asserts steps + 1 kernel calls
    assert 0.0 < inside[0] <= total[0]  # wall time
    assert inside[1] <= total[1] + 1e-6  # CPU time (its clock ticks coarser)
    assert simulation._step is kernels._step
    with pytest.raises(RuntimeError, match="boom"):
        with bench.time_in_kernel() as tally:
            assert simulation._step is not kernels._step
            raise RuntimeError("boom")
    assert tally == {"seconds": 0.0, "cpu_seconds": 0.0, "calls": 0}
    assert simulation._step is kernels._step


def test_kernel_timing_calls_the_step_simulate_makes(bench):
    """time_kernel's step is simulate's first step: same energy, same velocity."""
    x, D = bench.make_state(9, 2, 2)
    drift, sigma, noise = bench.kernel_inputs(D)
    q = kernels.step_quantities(x, D, drift=drift, sigma=sigma, noise=noise)
    traj = simulation.simulate(x, D, simulation.OrnsteinUhlenbeck(), T=bench.DT, dt=bench.DT)
    assert torch.equal(traj.energy[0], q["energy"])
    assert bench.time_kernel(x, D, 2, kernels._Scratch())[0] > 0.0
