"""companion.lra.dropout: torch's dropout numbers for a given mask, a Bernoulli mask law."""
from __future__ import annotations

import math

import pytest
import torch

from companion.lra.dropout import Dropout, dropout, dropout_mask, reference_dropout
from companion.lra.model import LRAClassifier

PS = (0.1, 0.25, 0.5, 0.9)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
@pytest.mark.parametrize("p", PS)
def test_reference_is_torch_dropout(p, dtype):
    """reference_dropout, given torch's own mask, is torch's CPU dropout bit for bit (the
    mask read off torch's output: x has no zeros)."""
    torch.manual_seed(3)
    x = torch.rand(7, 33, 5, dtype=dtype) + 0.5
    y = torch.nn.functional.dropout(x, p, True)
    mask = y != 0
    assert torch.equal(reference_dropout(x, mask, p), y)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("shape", ((7, 33, 5), (1,), (0, 4), (3, 1, 2, 9)))
def test_dropout_equals_reference_for_its_mask(p, dtype, shape):
    """Values and gradient equal torch's formula (autograd through reference_dropout) for
    the mask that the same seed draws, bit for bit; odd, single and empty shapes."""
    x = torch.randn(shape, dtype=dtype)
    grad = torch.randn(shape, dtype=dtype)
    torch.manual_seed(11)
    mask = dropout_mask(shape, p)
    xr = x.clone().requires_grad_(True)
    want = reference_dropout(xr, mask, p)
    want.backward(grad)
    torch.manual_seed(11)
    xf = x.clone().requires_grad_(True)
    got = dropout(xf, p)
    got.backward(grad)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, want)
    assert torch.equal(xf.grad, xr.grad)


def test_non_contiguous_input():
    x = torch.randn(6, 10).t()  # a transposed view
    torch.manual_seed(5)
    got = dropout(x, 0.3)
    torch.manual_seed(5)
    want = reference_dropout(x, dropout_mask(x.shape, 0.3), 0.3)
    assert torch.equal(got, want)


@pytest.mark.parametrize("p", (0.1, 0.5))
def test_mask_law(p):
    """Keep fraction within 5 binomial standard deviations of 1 - p over 2**20 elements,
    and no correlation between neighbours (the two halves of one 64-bit draw, and
    consecutive draws) beyond 5 standard errors. Fixed seed: the test is deterministic."""
    n = 1 << 20
    mask = dropout_mask((n,), p, generator=torch.Generator().manual_seed(0)).double()
    keep = 1 - p
    assert abs(mask.mean().item() - keep) < 5 * math.sqrt(keep * p / n)
    for lag in (1, 2):
        a, b = mask[:-lag] - keep, mask[lag:] - keep
        corr = (a * b).mean().item() / (keep * p)
        assert abs(corr) < 5 / math.sqrt(n), (lag, corr)


def test_masks_follow_the_torch_seed():
    shape = (64, 32)
    torch.manual_seed(1)
    a = dropout_mask(shape, 0.5)
    b = dropout_mask(shape, 0.5)  # the global generator moved on: another mask
    torch.manual_seed(1)
    assert torch.equal(dropout_mask(shape, 0.5), a)
    assert not torch.equal(a, b)
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    assert torch.equal(dropout_mask(shape, 0.5, generator=g1),
                       dropout_mask(shape, 0.5, generator=g2))


def test_identity_and_extremes():
    x = torch.randn(5, 7, requires_grad=True)
    assert dropout(x, 0.3, training=False) is x
    assert dropout(x, 0.0) is x
    zeros = dropout(x, 1.0)
    assert torch.equal(zeros, torch.zeros_like(x))
    zeros.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    assert not dropout_mask((100,), 1.0).any()
    assert dropout_mask((100,), 0.0).all()
    layer = Dropout(0.2).eval()
    assert layer(x) is x
    assert "p=0.2" in repr(layer)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_half_dtypes_take_torch_dropout(dtype):
    """float16 and bfloat16 run torch's own dropout: the same output for the same seed."""
    x = torch.rand(40, 40).to(dtype) + 1
    torch.manual_seed(2)
    y = dropout(x, 0.5)
    torch.manual_seed(2)
    assert torch.equal(y, torch.nn.functional.dropout(x, 0.5, True))


@pytest.mark.parametrize("p", (-0.1, 1.5, float("nan")))
def test_bad_p_is_named(p):
    with pytest.raises(ValueError, match="p: expected a probability in"):
        dropout(torch.zeros(3), p)
    with pytest.raises(ValueError, match="p: expected a probability in"):
        Dropout(p)
    with pytest.raises(ValueError, match="p: expected a probability in"):
        dropout_mask((3,), p)


def test_bad_inputs_are_named():
    with pytest.raises(TypeError, match="p: expected"):
        dropout(torch.zeros(3), "0.1")
    with pytest.raises(TypeError, match="x: expected a floating-point tensor"):
        dropout(torch.zeros(3, dtype=torch.long), 0.1)
    with pytest.raises(TypeError, match="x: expected a tensor"):
        dropout([1.0, 2.0], 0.1)
    with pytest.raises(TypeError, match="training"):
        dropout(torch.zeros(3), 0.1, training="yes")


def test_lra_model_uses_it_and_stays_seeded():
    """The LRA classifier's dropouts are this module's, and a training forward with
    dropout is reproducible from torch's seed (and differs between two draws)."""
    torch.manual_seed(0)
    model = LRAClassifier(12, 16, 3, attention="dense", dim=16, heads=2, head_dim=8,
                          ffn=32, num_layers=1, dropout=0.3)
    drops = [m for m in model.modules() if isinstance(m, (Dropout, torch.nn.Dropout))]
    assert drops and all(isinstance(m, Dropout) for m in drops)
    tokens = torch.randint(1, 12, (4, 16), generator=torch.Generator().manual_seed(1))
    model.train()
    torch.manual_seed(7)
    a, _ = model(tokens)
    b, _ = model(tokens)
    torch.manual_seed(7)
    c, _ = model(tokens)
    assert torch.equal(a, c) and not torch.equal(a, b)
