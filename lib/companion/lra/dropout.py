"""Inverted dropout whose CPU masks come from numpy's PCG64 instead of torch's generator.

Definition
----------
In training, ``dropout(x, p) = x * m / (1 - p)`` with ``m_i ~ Bernoulli(1 - p)``
independent; in evaluation it is ``x`` (Srivastava et al., JMLR 2014; the "inverted"
scaling of :func:`torch.nn.functional.dropout`). The numbers are those of torch's CPU
dropout for the same mask: its ``noise = bernoulli(1 - p) / (1 - p)`` in ``x``'s dtype,
then ``x * noise``.

Only the mask's random source differs. Torch's CPU ``bernoulli_`` draws every element
from its Mersenne Twister one at a time, a large share of a small model's training step
(``benchmarks/bench_dropout.py`` measures both). Here one 64-bit PCG64 draw gives
two 32-bit integers ``u`` and an element is kept when ``u >= round(p 2^32)``: a keep
probability within ``2^-33`` of ``1 - p`` (torch's float uniform resolves ``2^-24``),
all elements independent. PCG64 is seeded by one 63-bit draw from torch's generator (the
global one unless ``generator`` is given), so ``torch.manual_seed`` still fixes the
masks, as it fixes torch's own dropout. On other devices, and in dtypes whose scaled mask
numpy cannot form as ATen does (float16, bfloat16), torch's dropout runs unchanged;
:func:`reference_dropout` is what torch computes for a given mask.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from companion._validate import check_bool, check_number, check_tensor

__all__ = ["Dropout", "dropout", "dropout_mask", "reference_dropout"]

# the dtypes whose scaled mask numpy forms as ATen does (for float16 ATen rounds a float32
# quotient to half, numpy would divide in half; bfloat16 has no numpy dtype)
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


def _check_p(p) -> float:
    return float(check_number("p", p, minimum=0.0, maximum=1.0,
                              expected="a probability in [0, 1]"))


def dropout_mask(shape, p: float, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """Bool tensor of ``shape``: True (kept) with probability ``1 - p``, independently.

    Parameters
    ----------
    shape : the mask's shape (a ``torch.Size`` or a tuple of ints).
    p : drop probability in ``[0, 1]``.
    generator : the CPU torch generator one 63-bit PCG64 seed is drawn from (None: the
        global one).

    Returns
    -------
    A CPU bool tensor of ``shape``.

    Complexity
    ----------
    One 64-bit draw per two elements and one comparison per element.

    >>> mask = dropout_mask((1000,), 0.25, generator=torch.Generator().manual_seed(0))
    >>> mask.shape, mask.dtype, 0.7 < mask.float().mean().item() < 0.8
    (torch.Size([1000]), torch.bool, True)
    """
    p = _check_p(p)
    shape = torch.Size(shape)
    numel = shape.numel()
    seed = int(torch.randint(0, 2**63 - 1, (1,), generator=generator))
    bits = np.random.Generator(np.random.PCG64(seed)).bit_generator.random_raw((numel + 1) // 2)
    u = bits.view(np.uint32)[:numel]
    # keep when u >= threshold: P(keep) = 1 - threshold / 2^32; p = 1 drops everything
    threshold = min(round(p * 2**32), 2**32)
    if threshold == 2**32:
        keep = np.zeros(numel, dtype=bool)
    else:
        keep = np.greater_equal(u, np.uint32(threshold))
    return torch.from_numpy(keep).reshape(shape)


def reference_dropout(x: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    """Torch's CPU dropout of ``x`` for a given keep ``mask``, as ATen computes it
    (``noise = mask / (1 - p)`` in ``x``'s dtype, then ``x * noise``; zeros at ``p = 1``).

    >>> reference_dropout(torch.tensor([2.0, 4.0]), torch.tensor([True, False]), 0.5)
    tensor([4., 0.])
    """
    p = _check_p(p)
    if p == 1.0:
        return x * torch.zeros_like(x)
    noise = mask.to(x.dtype)
    noise.div_(1.0 - p)
    return x * noise


def dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, *,
            generator: torch.Generator | None = None) -> torch.Tensor:
    """Inverted dropout of ``x`` (see the module docstring): ``x`` itself when not
    ``training`` or ``p == 0``; on CPU for float32 and float64 with a :func:`dropout_mask`,
    elsewhere :func:`torch.nn.functional.dropout` (``generator`` then unused: torch's
    dropout takes none).

    Parameters
    ----------
    x : tensor of any shape.
    p : drop probability in ``[0, 1]``.
    training : apply dropout (True) or return ``x``.
    generator : CPU torch generator the mask's seed is drawn from (None: the global one).

    Returns
    -------
    A tensor like ``x``, differentiable in ``x`` (gradient ``grad * mask / (1 - p)``).

    >>> torch.manual_seed(0) and None
    >>> y = dropout(torch.ones(8), 0.5)
    >>> sorted(set(y.tolist())) in ([0.0, 2.0], [2.0], [0.0])
    True
    """
    check_tensor("x", x, floating=True)
    p = _check_p(p)
    training = check_bool("training", training)
    if not training or p == 0.0:
        return x
    np_dtype = _NUMPY_DTYPES.get(x.dtype)
    if x.device.type != "cpu" or np_dtype is None or torch.jit.is_tracing() \
            or torch.compiler.is_compiling():
        return torch.nn.functional.dropout(x, p, True)
    if p == 1.0:
        return x * torch.zeros_like(x)
    keep = dropout_mask(x.shape, p, generator=generator).numpy()
    # the scaled mask in x's dtype as ATen forms it (bool -> dtype, then / (1 - p), which
    # is 0 or 1 / (1 - p) rounded to the dtype), in one pass: keep * that quotient
    scale = np_dtype(1.0) / np_dtype(1.0 - p)
    noise = np.multiply(keep, scale, dtype=np_dtype)
    # a constant factor: autograd's product rule gives the gradient grad * noise
    return x * torch.from_numpy(noise).reshape(x.shape)


class Dropout(nn.Module):
    """:class:`torch.nn.Dropout` with :func:`dropout`'s faster CPU masks (same ``p``,
    same train/eval behaviour, same numbers for the same mask).

    >>> layer = Dropout(0.1).eval()
    >>> x = torch.randn(3, 4)
    >>> layer(x) is x
    True
    """

    def __init__(self, p: float = 0.5):
        super().__init__()
        self.p = _check_p(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
