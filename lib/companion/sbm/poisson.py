"""Poisson counts and uniforms for the fastRG sampler, on one device.

:class:`_RandomSource` gives the sampler its uniforms, its Poisson counts and its index
compaction: on CPU from numpy's PCG64 (seeded by the caller's ``torch.Generator``), the
counts by inversion of that stream (:func:`_poisson_by_inversion`); elsewhere from
torch's generator and kernels. The inversion gives the exact law up to float64 rounding
of the Poisson CDF, and its counts do not depend on how the rates are blocked.
"""

from __future__ import annotations

import numpy as np
import torch

from companion._validate import check_int

# rates above this get numpy's own Poisson sampler (transformed rejection) instead of
# inversion, whose number of passes grows with the rate
_INVERSION_MAX_RATE = 16.0
# rates per block of the inversion (:func:`_poisson_by_inversion`): its uniforms (512 KiB
# of float64) and its passes' arrays within a core's L2 cache
_INVERSION_BLOCK = 1 << 16
# count dtypes the inversion writes directly (others are converted from int64)
_NUMPY_COUNT_DTYPES = {torch.int64: np.int64, torch.float32: np.float32,
                       torch.float64: np.float64}


class _RandomSource:
    """Uniforms, Poisson counts and index compaction for the sampler, on one device.

    On CPU with ``cpu_uniforms="numpy"`` (the default of :class:`FastRGTuning`) the
    uniforms come from numpy's PCG64, seeded by one 63-bit draw from the caller's
    ``torch.Generator`` (or torch's global one), so a graph stays reproducible from the
    torch seed; numpy's generator and ``np.flatnonzero`` are faster than torch's CPU
    Mersenne Twister and ``torch.nonzero``, the two costs that dominated the key draws
    (``benchmarks/bench_sbm.py`` records the measurements).  The Poisson counts
    then come by inversion of the same stream (:func:`_poisson_by_inversion`) unless
    ``cpu_poisson="torch"``.  Otherwise (CUDA, or ``cpu_uniforms="torch"``) torch's own
    generator and kernels are used.
    """

    def __init__(self, device: torch.device, generator: torch.Generator | None,
                 cpu_uniforms: str, cpu_poisson: str = "inversion"):
        self.device, self.generator = device, generator
        self.rng = None
        if device.type == "cpu" and cpu_uniforms == "numpy":
            seed = int(torch.randint(0, 2**63 - 1, (1,), generator=generator))
            self.rng = np.random.Generator(np.random.PCG64(seed))
        self.inversion = self.rng is not None and cpu_poisson == "inversion"

    def uniform(self, size: int) -> torch.Tensor:
        """``size`` float64 uniforms in ``[0, 1)``."""
        if self.rng is not None:
            return torch.from_numpy(self.rng.random(size))
        return torch.rand(size, generator=self.generator, device=self.device, dtype=torch.float64)

    def nonzero(self, mask: torch.Tensor) -> torch.Tensor:
        """Indices of the true entries of a 1-D bool tensor, as int64."""
        if self.rng is not None:
            return torch.from_numpy(np.flatnonzero(mask.numpy()))
        return torch.nonzero(mask).squeeze(1)

    def poisson(self, rates: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """Independent ``Poisson(rates)`` counts for a 1-D float32 or float64 tensor (the
        rates taken as float64 numbers: float32 ones give the counts of their exact float64
        copy), as int64 or as numbers of the floating ``dtype`` (the same counts, rounded as
        a conversion from int64 would round them)."""
        if self.inversion:
            # float32 / float64 written directly; other dtypes converted from int64
            np_dtype = _NUMPY_COUNT_DTYPES.get(dtype, np.int64)
            counts = torch.from_numpy(_poisson_by_inversion(rates.numpy(), self.rng, np_dtype))
            return counts.to(dtype)
        return torch.poisson(rates.to(torch.float64), generator=self.generator).to(dtype)


def _poisson_by_inversion(rates: np.ndarray, rng: np.random.Generator,
                          dtype=np.int64, block: int = _INVERSION_BLOCK) -> np.ndarray:
    """Independent ``Poisson(rates)`` counts from one PCG64 uniform per rate.

    Inversion: the count is the least ``c`` with ``u < F(c) = sum_{i <= c} e^{-r}
    r^i / i!``, found by subtracting the terms from ``u`` one pass at a time.  ``e^{-r}
    >= 1 - r`` decides most zero counts of small rates without an exponential (``u < 1 -
    r``).  The first pass runs over every remaining rate (most of them have a count of at
    least one), the later ones over the rates still undecided.  Rates above 16 (many
    passes) take numpy's own sampler instead, after all the uniforms, so the stream stays
    in a fixed order.  Exact up to float64 rounding of ``F`` (about ``1e-16`` in
    probability).

    The rates are taken ``block`` at a time (:func:`_invert_block`): the same uniforms
    in the same order and the same arithmetic per rate, so the counts do not depend on
    ``block``, but the dozen passes of a block over its rates, uniforms and partial sums
    stay in a core's cache: the default 2**16 rates (512 KiB of uniforms) fit a core's
    L2 (measurements at the ci model's pair grid and fastRG's cells:
    ``benchmarks/bench_sbm.py``).

    Parameters
    ----------
    rates : 1-D float64, or float32 (read as their exact float64 values: the counts of
        ``rates.astype(np.float64)`` bit for bit, without that copy).
    rng : the PCG64 generator the uniforms come from.
    dtype : of the counts (int64, or a float dtype that holds them as numbers).
    block : rates per block, at least 1.

    >>> rng = np.random.Generator(np.random.PCG64(0))
    >>> _poisson_by_inversion(np.array([0.0, 0.5, 40.0]), rng).dtype
    dtype('int64')
    """
    block = check_int("block", block, minimum=1)
    counts = np.empty(rates.size, dtype)
    u = np.empty(min(block, rates.size))
    large = []
    for start in range(0, rates.size, block):
        stop = min(start + block, rates.size)
        uniforms = u[:stop - start]
        rng.random(out=uniforms)
        found = _invert_block(rates[start:stop], uniforms, counts[start:stop])
        if found is not None:
            large.append(found + start)
    if large:
        where = np.concatenate(large)  # in index order, as one pass over all rates gave
        counts[where] = rng.poisson(rates[where])
    return counts


def _invert_block(rates: np.ndarray, u: np.ndarray, counts: np.ndarray):
    """:func:`_poisson_by_inversion` on one block: writes ``counts`` (a view of the
    block's counts) from the block's uniforms ``u`` (consumed), except at rates above
    16, whose positions in the block it returns (None if there is none)."""
    # u < 1 - r <= e^{-r}: count 0; 1 - r in float64 for float32 rates too (of their
    # exact float64 copies: a plain cast and an in-place subtract, which skip numpy's
    # mixed-dtype loop)
    if rates.dtype == np.float64:
        one_minus = np.subtract(1.0, rates)
    else:
        one_minus = rates.astype(np.float64)
        np.subtract(1.0, one_minus, out=one_minus)
    candidate = np.greater_equal(u, one_minus)
    del one_minus
    live = np.flatnonzero(candidate)
    # pass 1 below writes the count 1 of every candidate whose u >= F(0); most are (at
    # r = 0.25, 88 %), so every candidate starts at 1 and the others are set back to 0
    counts[...] = candidate
    del candidate
    r = rates.take(live).astype(np.float64, copy=False)
    # every rate above the limit is a candidate (1 - r < 0 <= u), so the candidates'
    # maximum decides whether there is one (a quarter of the rates at r = 0.25, not all)
    large = None
    if r.size and not r.max() <= _INVERSION_MAX_RATE:
        is_large = r > _INVERSION_MAX_RATE
        large = live[is_large]
        small = np.flatnonzero(~is_large)
        live, r = live.take(small), r.take(small)
    term = np.exp(-r)
    rest = u.take(live)
    rest -= term  # u - F(0)
    # pass 1 over every candidate: counts >= 1 where u >= F(0), else 0 (the large rates'
    # 1 is overwritten by their own sampler)
    counts[live.take(np.flatnonzero(rest < 0))] = 0
    passes = 1
    term *= r
    rest -= term  # u - F(1)
    while live.size:
        keep = np.flatnonzero(rest >= 0)  # u >= F(c): the count is above c
        # take with indices: several times faster than four boolean-mask selections
        live, r, term, rest = live.take(keep), r.take(keep), term.take(keep), rest.take(keep)
        passes += 1
        counts[live] = passes
        # guards a u in the last rounding gap below the float64 F(inf)
        if passes > 16 * _INVERSION_MAX_RATE:
            break
        term *= r
        term /= passes
        rest -= term
    return large
