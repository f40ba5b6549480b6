"""What the benchmarks count besides time, against closed forms.

``benchmarks/flop_counts.py``'s :func:`matrix_product_flops` gives the numerators and
denominators of the benchmarks' FLOP floors (issue 16: SBM / dense training step, context
similarity / bare forward), so it is held to the FLOPs of a matrix product and of attention
written out by hand: ``2 M N K`` per product, ``4 b h s^2 d`` for attention's forward (two
products) and ``10 b h s^2 d`` for its backward (five, with the recomputed scores). The CPU
flash kernel is not in ``torch.utils.flop_counter``'s table; without the benchmark's own
entries it would count as zero. ``bench_sbm.py``'s :func:`step_in_sampler` must see the
SBM layer's sampler calls (their time, and their FLOPs: ``G n m k`` multiply-adds for the
rates ``(Qhat S) Khat^T``) and put the layer's functions back.
"""
from __future__ import annotations

import doctest
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module", autouse=True)
def bench_on_path():
    """The scripts import their neighbours (results_io, flop_counts), also when called."""
    sys.path.insert(0, str(BENCH))
    yield
    sys.path.remove(str(BENCH))


def _load(name):
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench_sbm():
    return _load("bench_sbm")


@pytest.fixture(scope="module")
def flops():
    return _load("flop_counts").matrix_product_flops


def test_flop_counts_example():
    result = doctest.testmod(_load("flop_counts"))
    assert result.attempted >= 1 and result.failed == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows,inner,outer", [(7, 5, 3), (64, 33, 1)])
def test_linear_step_flops_are_three_products(flops, dtype, rows, inner, outer):
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(inner, outer, dtype=dtype)
    x = torch.randn(rows, inner, dtype=dtype, generator=g, requires_grad=True)

    def step():
        layer(x).square().sum().backward()

    # forward x W^T, backward grad W = g^T x and grad x = g W: three products of M N K
    assert flops(step) == 3 * 2 * rows * inner * outer


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("b,h,s,d", [(2, 3, 17, 8), (1, 1, 1, 4)])
def test_cpu_flash_attention_step_flops(flops, dtype, b, h, s, d):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, h, s, d, dtype=dtype, generator=g, requires_grad=True)
               for _ in range(3))

    def step():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # the dense model's CPU kernel
            torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward()

    assert flops(step) == (4 + 10) * b * h * s * s * d


def test_inference_and_empty_calls(flops):
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(3, 4, 6, generator=g), torch.randn(3, 6, 5, generator=g)
    with torch.inference_mode():
        assert flops(lambda: torch.bmm(a, b)) == 2 * 3 * 4 * 6 * 5
    assert flops(lambda: torch.bmm(a[:0], b[:0])) == 0
    assert flops(lambda: None) == 0


def test_step_in_sampler_sees_the_layer_sampler_and_restores_it(bench_sbm):
    from companion.sbm import SBMAttention, layer

    before = (layer.poisson_pair_counts, layer.fastrg_sample)
    torch.manual_seed(0)
    attention = SBMAttention(head_dim=4, num_heads=2, num_clusters=3)
    q = torch.randn(2, 2, 9, 4)
    calls = []

    def step():
        calls.append(len(calls))
        attention(q, q, q, generator=torch.Generator().manual_seed(0))

    assert bench_sbm.step_in_sampler(step) > 0.0
    assert bench_sbm.step_in_sampler(lambda: None) == 0.0
    assert calls == [0]
    # batch 2, heads 2, n = m = 9, k = 3: one [9, 3] @ [3, 9] product per group
    assert bench_sbm.step_in_sampler(step, "flops") == 2 * (2 * 2) * 9 * 9 * 3
    assert calls == [0, 1]
    with pytest.raises(ValueError, match="measure: expected"):
        bench_sbm.step_in_sampler(step, "bytes")
    assert (layer.poisson_pair_counts, layer.fastrg_sample) == before

    def failing():
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        bench_sbm.step_in_sampler(failing)
    assert (layer.poisson_pair_counts, layer.fastrg_sample) == before
