"""The (fast, reference) pairs of the library, one module per science package.

Each module here (``hasse``, ``context_similarity``, ``gradient_flow``, ``sbm``) defines
``PAIRS``: a list of :class:`Pair`. ``tests/test_fast_equals_reference.py`` runs every pair
at every size it lists, in float32 and float64 (where the pair takes a dtype), on the CPU
and on CUDA when a device is present, and holds the fast path to the reference.

A pair says how to build one input (``make(size, dtype, device, generator)`` returns the
positional arguments both functions take), what to call (``fast`` and ``reference``), and
how close they must be: ``exact=True`` for results that must agree bit for bit (integer
and Boolean outputs, or a fast path that was bit-identical before), else ``rtol``/``atol``
per dtype. ``compare`` may be given instead, for outputs that are not tensors (it
raises ``AssertionError`` with a message when they differ).

``covers`` names the public library functions a pair holds to their reference, when
``fast`` is a wrapper (a lambda, a function of the test) rather than the library function
itself; ``test_every_fast_kernel_has_a_pair`` reads it: every public function of a fast
module (``KERNEL_MODULES`` there) is covered by some pair or says why it needs none.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Pair", "assert_same"]

#: Default tolerances per dtype for results computed in a different order.
TOLERANCES = {torch.float32: (1e-4, 1e-5), torch.float64: (1e-10, 1e-12)}


@dataclass(frozen=True)
class Pair:
    """One fast function and the reference it must equal."""

    name: str
    fast: Callable[..., Any]
    reference: Callable[..., Any]
    make: Callable[[Any, torch.dtype, torch.device, torch.Generator], tuple]
    sizes: Sequence[Any]
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.float64)
    exact: bool = False
    tolerances: dict = field(default_factory=lambda: dict(TOLERANCES))
    compare: Callable[[Any, Any, torch.dtype], None] | None = None
    cuda: bool = True
    covers: tuple = ()

    def covered(self) -> tuple:
        """The library functions this pair checks: ``covers``, and ``fast`` itself when
        it is a function of the library."""
        own = (self.fast,) if getattr(self.fast, "__module__", "").startswith("companion.") else ()
        return (*own, *self.covers)


def assert_same(fast: Any, reference: Any, *, exact: bool, rtol: float, atol: float,
                where: str = "result") -> None:
    """Fast and reference results agree: tensors (exactly or within tolerance), and
    tuples, lists and dicts of them, element by element."""
    if isinstance(reference, dict):
        assert isinstance(fast, dict) and fast.keys() == reference.keys(), (
            f"{where}: keys {sorted(fast)} != {sorted(reference)}")
        for key in reference:
            assert_same(fast[key], reference[key], exact=exact, rtol=rtol, atol=atol,
                        where=f"{where}[{key!r}]")
        return
    if isinstance(reference, (tuple, list)):
        assert isinstance(fast, (tuple, list)) and len(fast) == len(reference), (
            f"{where}: {len(fast)} items != {len(reference)}")
        for i, (f, r) in enumerate(zip(fast, reference)):
            assert_same(f, r, exact=exact, rtol=rtol, atol=atol, where=f"{where}[{i}]")
        return
    if isinstance(reference, torch.Tensor):
        assert isinstance(fast, torch.Tensor), f"{where}: {type(fast).__name__} is not a tensor"
        assert fast.shape == reference.shape, (
            f"{where}: shape {tuple(fast.shape)} != {tuple(reference.shape)}")
        fast, reference = fast.detach().cpu(), reference.detach().cpu()
        if exact:
            assert fast.dtype == reference.dtype, (
                f"{where}: dtype {fast.dtype} != {reference.dtype}")
            assert torch.equal(fast, reference), f"{where}: differs (exact comparison)"
        else:
            torch.testing.assert_close(fast, reference.to(fast.dtype), rtol=rtol, atol=atol,
                                       msg=lambda m: f"{where}: {m}")
        return
    if isinstance(reference, float) and not exact:
        assert abs(fast - reference) <= atol + rtol * abs(reference), (
            f"{where}: {fast} != {reference}")
        return
    assert fast == reference, f"{where}: {fast!r} != {reference!r}"
