"""Multi-head attention dynamics on the sphere as a time-dependent Wasserstein gradient flow.

This module implements the particle model of Massucco, Del Grande, Carioni, Brune and
Schönlieb, *Multi-Headed Transformer Architectures as Time-dependent Wasserstein Gradient
Flows* (arXiv 2605.18870). ``n`` tokens ``x_i`` live on the unit sphere
:math:`S^{d-1}`; ``H`` heads carry symmetric matrices ``D_h`` that play the role of both
:math:`Q_h^\\top K_h` and (with a minus sign) the value matrix. With
:math:`U^h_{ij} = \\exp(\\langle x_i, D_h x_j\\rangle)` and
:math:`Z_{ih} = \\frac1n \\sum_j U^h_{ij}` the tokens move by

.. math::

    \\dot x_i = \\mathrm{sign} \\cdot \\frac1H \\sum_h P_{x_i}\\Big[\\frac{1}{Z_{ih}}
    \\frac1n \\sum_j U^h_{ij} D_h x_j\\Big], \\qquad P_x = I - x x^\\top,

with ``sign = -1`` the paper's gradient *descent* of the energy

.. math::

    E(t) = \\frac{1}{2 H n^2} \\sum_h \\sum_{i,j} U^h_{ij},

and ``sign = +1`` the clustering dynamics of Geshkovski, Letrouit, Polyanskiy and Rigollet.
The weights follow an SDE :math:`dD_h = f_h(D_h, t)\\,dt + \\sigma\\,dW_h` with symmetric
noise :math:`dW = \\sqrt{dt}\\,(Z + Z^\\top)/2`.

Energy balance. Write :math:`u_{ih} = P_{x_i} D_h a_{ih}` with
:math:`a_{ih} = \\sum_j w^h_{ij} x_j` the softmax mean of the tokens. The tangent
Wasserstein gradient of ``E`` at token ``i`` is
:math:`\\hat g_i = \\frac1H \\sum_h Z_{ih} u_{ih}` (``n`` times the Euclidean gradient),
so along the flow

.. math::

    dE = -\\mathcal D\\,dt + \\partial_t E\\,dt + dM_t, \\qquad
    \\mathcal D = -\\frac1n \\sum_i \\langle \\hat g_i, v_i\\rangle ,

where :math:`\\partial_t E = \\frac{1}{2Hn^2}\\sum U^h_{ij}[x_i^\\top f_h x_j +
\\frac{\\sigma^2}{4}(1 + \\langle x_i, x_j\\rangle^2)]` is the rate at fixed tokens (the
second term is the Itô correction of the symmetric noise) and
:math:`dM = \\frac{1}{2Hn^2} \\sum U^h_{ij}\\, x_i^\\top (\\sigma dW_h) x_j` the martingale.
The paper's numerics replace :math:`\\mathcal D` by the slope
:math:`G^2 = \\frac1n \\sum_i b_i |v_i|^2` with the harmonic-mean mobility
:math:`b_i = [\\frac1H \\sum_h 1/Z_{ih}]^{-1}`. For one head the two coincide; for
several distinct heads they do not, and the energy balance written with ``G^2`` holds only
as an inequality. :func:`simulate` records both residuals.

Implementation. :func:`step_quantities` reads the drift, energy, rates and slopes off
the softmax moments (:math:`\\sum_j U^h_{ij}`, :math:`\\sum_j U^h_{ij} x_j` and, with noise,
:math:`\\sum_{ij} U^h_{ij}(1 + \\langle x_i, x_j\\rangle^2)`). Because every ``D_h`` is
symmetric, so is every ``U^h``: a block of query rows is exponentiated once against the keys
at and after it, and the same exponentials are handed, transposed, to the later rows; a
step costs about :math:`H n^2 / 2` exponentials per path instead of :math:`H n^2`. All heads
of a block are one GEMM (``D_h x_i`` computed once and reused for every key), one
vectorised ``exp2`` and two GEMMs for the moments; no ``n x n`` matrix per head is stored
and memory is :math:`O(P H n d)` plus one cache-sized block. Weights so large that unshifted
exponentials could overflow take a max-shifted, row-chunked path.
:func:`reference_step_quantities` is the same step written as the equations above with
dense ``[P, H, n, n]`` tensors, the reference the kernel is tested against.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from companion._validate import check_choice, check_int, check_number, check_tensor, describe

__all__ = [
    "spectral_norms",
    "Frozen",
    "OrnsteinUhlenbeck",
    "Oscillating",
    "PowerLawFit",
    "Trajectory",
    "bootstrap_over_paths",
    "fit_power_law",
    "gronwall_bound",
    "initial_weights",
    "lipschitz_constant",
    "loglog_order",
    "octahedral_tokens",
    "oscillating_target",
    "pairwise_inner_stats",
    "reference_step_quantities",
    "simulate",
    "step_quantities",
    "uniform_sphere",
    "velocity",
    "w2_sphere",
    "weight_sensitivity",
]

DEFAULT_DTYPE = torch.float64


# --------------------------------------------------------------------------- helpers
def _check_positive(name: str, value) -> float:
    return check_number(name, value, minimum=0.0, min_open=True,
                        expected="a positive finite number")


def _check_sign(sign) -> int:
    sign = check_int("sign", sign, minimum=-1, maximum=1)
    if sign == 0:
        raise ValueError("sign: expected -1 (descent) or +1 (clustering), got 0")
    return sign


def _check_tokens(tokens) -> torch.Tensor:
    check_tensor("tokens", tokens, ndim=3, floating=True, finite=True,
                 shape_text="[paths, n, d]")
    if tokens.shape[-1] < 2:
        raise ValueError(f"tokens: expected dimension d >= 2, got d = {tokens.shape[-1]}")
    if tokens.shape[1] < 1:
        raise ValueError("tokens: expected at least one token (n >= 1)")
    norms = tokens.norm(dim=-1)
    tol = 1e-6 if tokens.dtype == torch.float64 else 1e-3
    if not torch.all((norms - 1).abs() <= tol):
        worst = (norms - 1).abs().max().item()
        raise ValueError(
            f"tokens: expected unit vectors on the sphere, max | |x| - 1 | = {worst:.3g}"
        )
    return tokens


def _check_weights(weights, tokens: torch.Tensor | None = None) -> torch.Tensor:
    check_tensor("weights", weights, ndim=4, floating=True, finite=True,
                 shape_text="[paths, heads, d, d]")
    if weights.shape[-1] != weights.shape[-2]:
        raise ValueError(
            "weights: expected a 4-D tensor [paths, heads, d, d] of square matrices, "
            f"got shape {tuple(weights.shape)}"
        )
    if weights.shape[-1] < 2:
        raise ValueError(f"weights: expected dimension d >= 2, got d = {weights.shape[-1]}")
    if weights.shape[1] < 1:
        raise ValueError("weights: expected at least one head")
    if tokens is not None:
        if weights.dtype != tokens.dtype or weights.device != tokens.device:
            raise TypeError(
                f"weights: expected dtype {tokens.dtype} on {tokens.device} like tokens, "
                f"got {weights.dtype} on {weights.device}"
            )
        if weights.shape[0] != tokens.shape[0] or weights.shape[-1] != tokens.shape[-1]:
            raise ValueError(
                f"weights: expected shape [{tokens.shape[0]}, heads, {tokens.shape[-1]}, "
                f"{tokens.shape[-1]}] to match tokens {tuple(tokens.shape)}, "
                f"got {tuple(weights.shape)}"
            )
    asym = (weights - weights.transpose(-1, -2)).abs().amax()
    scale = weights.abs().amax().clamp_min(1.0)
    tol = 1e-10 if weights.dtype == torch.float64 else 1e-5
    if asym > tol * scale:
        raise ValueError(
            f"weights: expected symmetric matrices D_h = D_h^T, max |D - D^T| = {asym.item():.3g}"
        )
    return weights


def _factory(dtype, device):
    from companion.devices import resolve_device

    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype: expected a floating torch.dtype or None, got {describe(dtype)}")
    return {"dtype": DEFAULT_DTYPE if dtype is None else dtype, "device": resolve_device(device)}


# ------------------------------------------------------------------ initial conditions
def octahedral_tokens(
    n: int,
    noise: float = 0.05,
    generator: torch.Generator | None = None,
    *,
    paths: int | None = None,
    dtype: torch.dtype | None = None,
    device="cpu",
) -> torch.Tensor:
    """Tokens at the six octahedron vertices ``±e_1, ±e_2, ±e_3`` of S^2, plus noise.

    Token ``i`` sits at vertex ``i mod 6`` (order ``+e1, -e1, +e2, -e2, +e3, -e3``), gets
    i.i.d. ``N(0, noise^2)`` perturbations in each coordinate and is renormalised. This is
    the paper's initial condition (n = 200, noise = 0.05).

    Parameters
    ----------
    n : int >= 1, number of tokens.
    noise : float >= 0, standard deviation of the perturbation.
    generator : torch.Generator on ``device`` or None.
    paths : int or None. None returns ``[n, 3]``; an int returns ``[paths, n, 3]`` with
        independent noise per path.
    dtype, device : of the result (float64, "cpu" by default).

    Returns
    -------
    Tensor ``[n, 3]`` or ``[paths, n, 3]`` of unit vectors. Complexity O(paths n).
    """
    n = check_int("n", n, 1)
    noise = check_number("noise", noise, minimum=0.0)
    batch = () if paths is None else (check_int("paths", paths, 1),)
    kw = _factory(dtype, device)
    vertices = torch.cat([torch.eye(3, **kw), -torch.eye(3, **kw)], 0)[[0, 3, 1, 4, 2, 5]]
    x = vertices[torch.arange(n, device=kw["device"]) % 6].expand(*batch, n, 3)
    x = x + noise * torch.randn(*batch, n, 3, generator=generator, **kw)
    return x / x.norm(dim=-1, keepdim=True)


def uniform_sphere(
    n: int,
    d: int,
    generator: torch.Generator | None = None,
    *,
    paths: int | None = None,
    dtype: torch.dtype | None = None,
    device="cpu",
) -> torch.Tensor:
    """``n`` i.i.d. uniform points on S^{d-1} (normalised Gaussians).

    Returns ``[n, d]`` (``paths=None``) or ``[paths, n, d]``. Complexity O(paths n d).
    """
    n = check_int("n", n, 1)
    d = check_int("d", d, 2)
    batch = () if paths is None else (check_int("paths", paths, 1),)
    x = torch.randn(*batch, n, d, generator=generator, **_factory(dtype, device))
    return x / x.norm(dim=-1, keepdim=True)


def initial_weights(
    heads: int,
    d: int,
    generator: torch.Generator | None = None,
    *,
    paths: int = 1,
    dtype: torch.dtype | None = None,
    device="cpu",
) -> torch.Tensor:
    """The paper's initial head matrices ``D_h(0) = Z + Z^T``, ``Z`` i.i.d. N(0, 1).

    Returns ``[paths, heads, d, d]`` symmetric matrices, independent over paths and heads.
    """
    heads = check_int("heads", heads, 1)
    d = check_int("d", d, 2)
    paths = check_int("paths", paths, 1)
    z = torch.randn(paths, heads, d, d, generator=generator, **_factory(dtype, device))
    return z + z.transpose(-1, -2)


# -------------------------------------------------------------------- weight processes
def oscillating_target(t: torch.Tensor, d: int) -> torch.Tensor:
    """The paper's non-integrable target ``F(t)`` (d = 2 or 3), batched over ``t``.

    d = 3: ``[[2+1.5 cos t, sin 2t, sin t], [sin 2t, 2+1.5 sin t, cos 2t],
    [sin t, cos 2t, 2+1.5 cos(t+pi/4)]]``; d = 2: ``[[2+1.5 cos t, sin 2t],
    [sin 2t, 2-1.5 cos t]]``. Returns ``t.shape + (d, d)``.
    """
    check_tensor("t", t, floating=True)
    d = check_int("d", d, minimum=2, maximum=3)
    if d == 3:
        c, s = torch.cos, torch.sin
        rows = [
            [2 + 1.5 * c(t), s(2 * t), s(t)],
            [s(2 * t), 2 + 1.5 * s(t), c(2 * t)],
            [s(t), c(2 * t), 2 + 1.5 * c(t + math.pi / 4)],
        ]
    elif d == 2:
        rows = [
            [2 + 1.5 * torch.cos(t), torch.sin(2 * t)],
            [torch.sin(2 * t), 2 - 1.5 * torch.cos(t)],
        ]
    else:
        raise ValueError(f"d: the oscillating target is defined for d in (2, 3), got d = {d}")
    return torch.stack([torch.stack(r, -1) for r in rows], -2)


@dataclass(frozen=True)
class OrnsteinUhlenbeck:
    """Integrable regime: ``dD = (I - D) dt + sigma dW``; stationary law ``I + sigma S/sqrt 2``.

    ``sigma2`` is the noise variance ``sigma^2`` (the paper uses 2, stationary law
    ``I + (Z + Z^T)/2``).
    """

    sigma2: float = 2.0

    def __post_init__(self):
        if isinstance(self.sigma2, bool) or not isinstance(self.sigma2, (int, float)):
            raise TypeError(f"sigma2: expected a float >= 0, got {self.sigma2!r}")
        if self.sigma2 < 0 or not math.isfinite(self.sigma2):
            raise ValueError(f"sigma2: expected a finite float >= 0, got {self.sigma2}")

    @property
    def sigma(self) -> float:
        return math.sqrt(self.sigma2)

    def drift(self, weights: torch.Tensor, t: float) -> torch.Tensor:
        eye = torch.eye(weights.shape[-1], dtype=weights.dtype, device=weights.device)
        return eye - weights


@dataclass(frozen=True)
class Oscillating:
    """Non-integrable regime: ``dD_h = (F(t + phi_h) - D_h) dt``, no noise.

    ``phases="identical"``: every head follows the same target ``F(t)`` (the paper's
    regime). ``phases="spread"``: head ``h`` follows ``F(t + 2 pi h / H)``; averaged over
    heads the oscillations cancel (the pitfall: the slope decays like 1/H again).
    """

    phases: str = "identical"

    def __post_init__(self):
        if self.phases not in ("identical", "spread"):
            raise ValueError(f"phases: expected 'identical' or 'spread', got {self.phases!r}")

    sigma: float = field(default=0.0, init=False)

    def drift(self, weights: torch.Tensor, t: float) -> torch.Tensor:
        heads, d = weights.shape[1], weights.shape[-1]
        tt = torch.full((heads,), float(t), dtype=weights.dtype, device=weights.device)
        if self.phases == "spread":
            tt = tt + 2 * math.pi * torch.arange(heads, dtype=weights.dtype,
                                                 device=weights.device) / heads
        return oscillating_target(tt, d).unsqueeze(0) - weights


@dataclass(frozen=True)
class Frozen:
    """Weights held fixed: ``dD = 0``."""

    sigma: float = field(default=0.0, init=False)

    def drift(self, weights: torch.Tensor, t: float) -> None:
        return None


_PROCESSES = (OrnsteinUhlenbeck, Oscillating, Frozen)


# ----------------------------------------------------------------- softmax moments
_LOG2E = 1.0 / math.log(2.0)
# Exponentials per block of the symmetric kernel: on CPU a block and its moments stay in
# one core's cache (measured best at n = 200, H = 100 on a 1 MiB-L2 core); elsewhere one
# block per group of paths (few, large kernel launches).
_BLOCK_ELEMENTS = {"cpu": 1 << 19}
_DEFAULT_BLOCK_ELEMENTS = 1 << 25


def _unshifted_exp_limit(dtype: torch.dtype, n: int, heads: int) -> float:
    """Largest ``c`` with every ``exp(l)``, ``|l| <= c``, and every sum of ``4 n^2 H`` of
    them representable as a normal number of ``dtype`` (no shift needed)."""
    info = torch.finfo(dtype)
    return min(math.log(info.max) - math.log(4.0 * n * n * heads), -math.log(info.tiny))


class _Scratch:
    """Scratch tensors reused by every step of one simulation.

    The same memory each step: no page faults for fresh pages and caches stay warm. A
    buffer is replaced when the shape, dtype or device asked for changes.
    """

    def __init__(self):
        self._tensors = {}

    def get(self, name: str, shape: tuple, kw: dict) -> torch.Tensor:
        t = self._tensors.get(name)
        if t is None or tuple(t.shape) != tuple(shape) or t.dtype != kw["dtype"] \
                or t.device != kw["device"]:
            t = self._tensors[name] = torch.empty(shape, **kw)
        return t


def _empty(scratch: _Scratch | None, name: str, shape: tuple, kw: dict) -> torch.Tensor:
    return torch.empty(shape, **kw) if scratch is None else scratch.get(name, shape, kw)


def _symmetric_exp_moments(tokens, weights, with_ito: bool, scratch: _Scratch | None = None,
                           workers: int = 1):
    """Unnormalised softmax moments from the upper triangle of each ``U^h``, or None.

    ``U^h_ij = exp(<x_i, D_h x_j>)`` is symmetric in ``(i, j)`` because ``D_h`` is, so
    each head needs only ``n (n + 1) / 2`` exponentials. Returns ``S [P, n, d + 1, H]``
    with ``S[p, i, 0, h] = sum_j U^h_ij`` and ``S[p, i, 1 + a, h] = sum_j U^h_ij x_ja``,
    and (``with_ito``) ``T [P] = sum_{h, i, j} U^h_ij (1 + <x_i, x_j>^2)``. None when the
    logits could leave the range where unshifted exponentials are exact to rounding
    (``|<x_i, D_h x_j>| <= |D_h|_F max |x|^2`` above :func:`_unshifted_exp_limit`).

    Layout: all heads of a block of query rows ``I`` are one GEMM against the keys
    ``j >= min I`` (logits ``[j, (i, h)]``, reusing ``D_h x_i`` for every key), one
    vectorised ``exp2`` (the weights carry ``log2 e``), one GEMM for the row sums over
    ``j`` and one batched GEMM that hands the same exponentials, transposed, to the rows
    ``j`` beyond the block. Per step: ``P H n (n + c) / 2`` exponentials for blocks of
    ``c`` rows, ``O(P H n d)`` memory besides one block per worker. Paths are independent:
    ``workers`` threads (each on one intra-op thread) take disjoint sets of paths, and every
    path's numbers are the same whatever the number of workers.
    """
    P, n, d = tokens.shape
    H = weights.shape[1]
    bound = (weights * weights).sum((-1, -2)).amax().sqrt() * (tokens * tokens).sum(-1).amax()
    if not bool(bound <= _unshifted_exp_limit(tokens.dtype, n, H)):
        return None
    target = _BLOCK_ELEMENTS.get(tokens.device.type, _DEFAULT_BLOCK_ELEMENTS)
    if P * n * n * H <= 4 * target:  # little work: whole matrices, paths in groups (fewer calls)
        rows, group = n, max(1, min(P, target // (n * n * H)))
        tasks = [slice(p0, min(P, p0 + group)) for p0 in range(0, P, group)]
    else:  # blocks of rows; at least three, or symmetry saves little
        rows, group = max(1, min(target // (n * H), -(-n // 3))), 1
        tasks = [slice(p, p + 1) for p in range(P)]
    workers = max(1, min(workers, len(tasks)))
    kw = {"dtype": tokens.dtype, "device": tokens.device}
    # queries[p, a, i, h] = log2(e) (D_h x_i)_a: computed once, read by every key block
    scaled = (weights * _LOG2E).permute(0, 2, 3, 1)  # [P, d, d, H]
    queries = torch.matmul(tokens.unsqueeze(1), scaled,
                           out=_empty(scratch, "queries", (P, d, n, H), kw))
    values_t = _empty(scratch, "values", (P, d + 1, n), kw)  # [1, x_j] per key
    values_t[:, 0] = 1.0
    values_t[:, 1:] = tokens.transpose(1, 2)
    sums = _empty(scratch, "sums", (P, n, d + 1, H), kw)
    head_sums = _empty(scratch, "head_sums", (P, n, n), kw) if with_ito else None  # [p, j, i]
    if with_ito and rows < n:
        head_sums.zero_()  # entries j < min I of i's block I stay 0

    def whole(ps, buffer, row_buffer):
        g = ps.stop - ps.start
        u = buffer[:g * n * n * H].view(g, n, n * H)  # u[., j, i H + h] = U^h_ij
        torch.bmm(tokens[ps], queries[ps].reshape(g, d, n * H), out=u).exp2_()
        r = row_buffer[:g * (d + 1) * n * H].view(g, d + 1, n * H)
        torch.bmm(values_t[ps], u, out=r)
        sums[ps] = r.view(g, d + 1, n, H).transpose(1, 2)
        if with_ito:
            torch.sum(u.view(g, n, n, H), -1, out=head_sums[ps])

    def blocks(ps, buffer, row_buffer):
        p = ps.start
        x_p, q_p, v_p, s_p = tokens[p], queries[p], values_t[p], sums[p]
        for i0 in range(0, n, rows):
            i1 = min(n, i0 + rows)
            c, m = i1 - i0, n - i0
            u = buffer[:m * c * H].view(m, c * H)  # u[j, i H + h] = U^h_ij, j >= i0
            torch.mm(x_p[i0:], q_p[:, i0:i1].reshape(d, c * H), out=u).exp2_()
            r = row_buffer[:(d + 1) * c * H].view(d + 1, c * H)
            torch.mm(v_p[:, i0:], u, out=r)
            r = r.view(d + 1, c, H).transpose(0, 1)
            if i0 == 0:
                s_p[:i1] = r
            else:  # rows of earlier blocks have handed over their part already
                s_p[i0:i1] += r
            u = u.view(m, c, H)
            if with_ito:
                torch.sum(u, -1, out=head_sums[p, i0:, i0:i1])
            if i1 < n:  # U^h_ji = U^h_ij: the block's exponentials serve the rows j >= i1
                s_p[i1:].baddbmm_(v_p[:, i0:i1].expand(m - c, d + 1, c), u[c:],
                                  beta=0.0 if i0 == 0 else 1.0)

    run = whole if rows == n else blocks

    def work(w):  # worker w: tasks w, w + workers, ...; its own block buffers
        buffer = _empty(scratch, f"block{w}", (group * n * rows * H,), kw)
        row_buffer = _empty(scratch, f"block_rows{w}", (group * (d + 1) * rows * H,), kw)
        if workers > 1:
            torch.set_num_threads(1)  # this thread's OpenMP and MKL settings
        for ps in tasks[w::workers]:
            run(ps, buffer, row_buffer)

    if workers == 1:
        work(0)
    else:
        for future in [_pool().submit(work, w) for w in range(workers)]:
            future.result()
    ito = None
    if with_ito:
        weights_ito = torch.bmm(tokens, tokens.transpose(1, 2),  # [p, j, i]: <x_j, x_i>
                                out=_empty(scratch, "ito_weights", (P, n, n), kw))
        weights_ito.mul_(weights_ito).add_(1.0)
        if rows < n:  # a pair in two different blocks is computed once and counts twice
            block = torch.arange(n, device=tokens.device) // rows
            weights_ito.mul_(torch.where(block[:, None] == block[None, :], 1.0,
                                         2.0).to(tokens.dtype))
        ito = head_sums.mul_(weights_ito).sum((1, 2))  # pairwise summation
    return sums, ito


_POOL = None


def _pool():
    """The worker threads of :func:`_symmetric_exp_moments` (created on first use)."""
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1),
                                   thread_name_prefix="gradient_flow")
    return _POOL


@contextlib.contextmanager
def _path_workers(device: torch.device):
    """Yield the number of path workers for a step on ``device`` and run the step's own
    tensor operations on one intra-op thread meanwhile (restored afterwards).

    A step is many small kernels: with several intra-op threads each one synchronises the
    threads, which on a loaded 2-core machine made a step 20x slower than on one thread.
    The caller's thread count is spent instead on independent paths, one thread each.
    """
    if device.type != "cpu":
        yield 1
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield before
    finally:
        torch.set_num_threads(before)


def _softmax_moments(queries, keys, values, max_chunk_elements: int = 1 << 25):
    """Row log-sum-exp and softmax means of ``values`` for logits ``queries @ keys^T``.

    queries ``[P, L, d]``, keys ``[P, n, d]``, values ``[P, n, E]`` ->
    (``lse [P, L]``, ``mean [P, L, E]``), shifted by each row's maximum, in row chunks
    of at most ``max_chunk_elements`` logits. The general path of :func:`step_quantities`
    for weights too large for :func:`_symmetric_exp_moments`.
    """
    P, L, d = queries.shape
    n = keys.shape[1]
    rows = max(1, max_chunk_elements // max(1, P * n))
    kt = keys.transpose(-1, -2)
    lses, means = [], []
    for start in range(0, L, rows):  # memory tiling of the stacked rows, not a loop over heads
        logits = torch.matmul(queries[:, start:start + rows], kt)
        rowmax = logits.amax(-1, keepdim=True)
        w = (logits - rowmax).exp_()
        total = w.sum(-1, keepdim=True)
        means.append(torch.matmul(w, values) / total)
        lses.append((rowmax + total.log()).squeeze(-1))
    return torch.cat(lses, 1), torch.cat(means, 1)


def _shifted_exp_moments(tokens, weights, with_ito: bool):
    """``(S0 [P, n, H], S1 [P, n, d, H], a [P, n, d, H], T [P] or None)`` from max-shifted
    softmax moments; ``S0 = sum_j U``, ``S1 = S0 a``, ``a`` the softmax mean of the tokens.
    ``a`` stays finite for any weights; ``S0``, ``S1`` and ``T`` overflow where the
    quantities themselves do."""
    P, n, d = tokens.shape
    H = weights.shape[1]
    cat = weights.permute(0, 2, 1, 3).reshape(P, d, H * d)  # cat[p, a, h d + b] = D_h[a, b]
    queries = torch.matmul(tokens, cat).view(P, n * H, d)  # rows (i, h): D_h x_i
    if with_ito:  # values x_j and the upper triangle of x_j x_j^T: enough for the Itô term
        iu = torch.triu_indices(d, d, device=tokens.device)
        values = torch.cat([tokens, tokens[..., iu[0]] * tokens[..., iu[1]]], -1)
    else:
        values = tokens
    lse, means = _softmax_moments(queries, tokens, values)
    s0 = lse.view(P, n, H).exp()
    means = means.view(P, n, H, -1)
    a = means[..., :d].permute(0, 1, 3, 2).contiguous()
    ito = None
    if with_ito:
        mult = torch.where(iu[0] == iu[1], 1.0, 2.0).to(tokens.dtype)
        xx = tokens[..., iu[0]] * tokens[..., iu[1]] * mult  # x_i^T C x_i = <xx, c>
        xcx = (means[..., d:] * xx.unsqueeze(2)).sum(-1)
        ito = (s0 * (1.0 + xcx)).sum((1, 2))
    return s0, s0.unsqueeze(2) * a, a, ito


def _check_step_args(tokens, weights, sign, drift, sigma, noise):
    _check_tokens(tokens)
    _check_weights(weights, tokens)
    sign = _check_sign(sign)
    sigma = check_number("sigma", sigma, minimum=0.0)
    for name, mats in (("drift", drift), ("noise", noise)):
        if mats is None:
            continue
        check_tensor(name, mats, ndim=(3, 4), floating=True, finite=True)
        if tuple(mats.shape) not in (tuple(weights.shape), tuple(weights.shape[1:])):
            raise ValueError(
                f"{name}: expected shape {tuple(weights.shape)} or "
                f"{tuple(weights.shape[1:])} like weights, got {tuple(mats.shape)}"
            )
        if mats.dtype != weights.dtype or mats.device != weights.device:
            raise TypeError(
                f"{name}: expected dtype {weights.dtype} on {weights.device} like "
                f"weights, got {mats.dtype} on {mats.device}"
            )
        # the rounding allowance of the weights' symmetry check, per dtype
        tol = 1e-10 if mats.dtype == torch.float64 else 1e-5
        asym = (mats - mats.transpose(-1, -2)).abs().amax()
        if asym > tol * (1 + mats.abs().amax()):
            raise ValueError(
                f"{name}: expected symmetric matrices, max |M - M^T| = {asym.item():.3g}"
            )
    return sign, sigma


def step_quantities(
    tokens: torch.Tensor,
    weights: torch.Tensor,
    *,
    sign: int = -1,
    drift: torch.Tensor | None = None,
    sigma: float = 0.0,
    noise: torch.Tensor | None = None,
    validate: bool = True,
) -> dict[str, torch.Tensor]:
    """Velocity and every energy-balance quantity at one state, batched over paths.

    The fast evaluation of :func:`reference_step_quantities` (same results to rounding):
    ``P H n (n + c) / 2`` exponentials (``U^h`` is symmetric) instead of ``P H n^2``,
    all heads of a block of ``c`` query rows in one GEMM, and every quantity read off the
    moments ``sum_j U^h_ij``, ``sum_j U^h_ij x_j`` (and, with noise, the Itô sum
    ``sum U^h_ij (1 + <x_i, x_j>^2)``). Weights so large that unshifted exponentials
    could overflow take a max-shifted path instead. On CPU the torch threads are spent on
    independent paths, one intra-op thread each (the results do not depend on the thread
    count); the setting is restored on return.

    Parameters
    ----------
    tokens : ``[P, n, d]`` unit vectors. weights : ``[P, H, d, d]`` symmetric.
    sign : -1 (descent, the paper) or +1 (GLPR clustering).
    drift : ``[P, H, d, d]`` or ``[H, d, d]`` symmetric weight drift ``f_h`` at this time,
        or None (0).
    sigma : noise amplitude of the weights. noise : the symmetric increment ``dW``
        ``[P, H, d, d]`` of this step (only for the martingale increment) or None.
    validate : check the arguments (``simulate`` checks once and passes False).

    Returns
    -------
    dict with ``velocity [P, n, d]`` and, per path ``[P]``: ``energy``, ``energy_rate``
    (``dE/dt`` at fixed tokens, Itô correction included), ``slope_sq`` (harmonic-mean
    ``G^2``), ``dissipation`` (``-(1/n) sum_i <g_i, v_i>``), ``martingale_increment``
    (``1/(2Hn^2) sum U x_i^T (sigma dW) x_j``, 0 without noise), and ``Z [P, n, H]``
    (token-major: row ``i`` holds the heads of token ``i``).

    Complexity: ``O(P H n^2 d)`` time, ``O(P H n d)`` memory besides one cache-sized
    block (no ``n x n`` matrix per head is stored).

    >>> g = torch.Generator().manual_seed(0)
    >>> x, D = uniform_sphere(5, 3, g, paths=2), initial_weights(3, 3, g, paths=2)
    >>> q = step_quantities(x, D)
    >>> r = reference_step_quantities(x, D)
    >>> bool(torch.allclose(q["velocity"], r["velocity"], rtol=1e-12, atol=1e-14))
    True
    """
    if validate:
        sign, sigma = _check_step_args(tokens, weights, sign, drift, sigma, noise)
    with _path_workers(tokens.device) as workers:
        return _step(tokens, weights, sign, drift, sigma, noise, None, workers)


def _step(tokens, weights, sign, drift, sigma, noise, scratch: _Scratch | None,
          workers: int = 1):
    """:func:`step_quantities` on checked arguments, with reusable scratch tensors."""
    P, n, d = tokens.shape
    H = weights.shape[1]
    with_ito = sigma > 0
    sym = _symmetric_exp_moments(tokens, weights, with_ito, scratch, workers)
    if sym is not None:
        sums, ito = sym
        s0 = sums[:, :, 0]  # [P, n, H]: n Z_ih
        s1 = sums[:, :, 1:]  # [P, n, d, H]: n Z_ih a_ih
        a = None  # s1 / s0, formed in place once s1 is read
    else:
        s0, s1, a, ito = _shifted_exp_moments(tokens, weights, with_ito)

    def stack(mats):  # [P, d H, d]: row b H + h holds M_h[b, :]
        if mats.dim() == 3:
            mats = mats.unsqueeze(0).expand(P, -1, -1, -1)
        return mats.permute(0, 2, 1, 3).reshape(P, d * H, d)

    # sum_h M_h a_ih (M symmetric) is one contraction over (b, h): a GEMM per path.
    weights_stacked = stack(weights)
    mats = [weights_stacked]
    if drift is not None:
        mats.append(stack(drift))
    if noise is not None and sigma > 0:
        mats.append(stack(noise))
    # n sum_h Z_ih M_h a_ih for M = D, f and dW in one GEMM
    zm = torch.matmul(s1.reshape(P, n, d * H), torch.cat(mats, -1)) / n
    sum_zm = zm[..., :d]
    if a is None:
        a = s1.div_(s0.unsqueeze(2))  # a_ih: softmax mean of the tokens
    sum_m = torch.matmul(a.reshape(P, n, d * H), weights_stacked)
    vel = (sign / H) * (sum_m - (tokens * sum_m).sum(-1, keepdim=True) * tokens)
    ghat = (sum_zm - (tokens * sum_zm).sum(-1, keepdim=True) * tokens) / H  # (1/H) sum_h Z u
    Z = s0 / n
    energy = Z.sum((1, 2)) / (2 * H * n)
    dissipation = -(ghat * vel).sum(-1).mean(-1)
    mobility = 1.0 / (1.0 / Z).mean(-1)  # b_i: harmonic mean over heads of Z_ih
    slope_sq = (mobility * (vel * vel).sum(-1)).mean(-1)
    # sum_{i,h} Z_ih x_i^T M_h a_ih, M_h symmetric: [P]
    k = 1
    if drift is not None:
        rate = (tokens * zm[..., k * d:(k + 1) * d]).sum((1, 2))
        k += 1
    else:
        rate = torch.zeros_like(energy)
    if with_ito:
        rate = rate + (sigma * sigma / 4.0) * ito / n
    energy_rate = rate / (2 * H * n)
    if noise is not None and sigma > 0:
        mart = sigma * (tokens * zm[..., k * d:(k + 1) * d]).sum((1, 2)) / (2 * H * n)
    else:
        mart = torch.zeros_like(energy)
    return {
        "velocity": vel,
        "energy": energy,
        "energy_rate": energy_rate,
        "slope_sq": slope_sq,
        "dissipation": dissipation,
        "martingale_increment": mart,
        "Z": Z,
    }


def _tangent(vectors: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """``P_x v = v - <x, v> x`` for vectors ``[..., d]`` at unit points ``[..., d]``."""
    return vectors - (vectors * points).sum(-1, keepdim=True) * points


def reference_step_quantities(
    tokens: torch.Tensor,
    weights: torch.Tensor,
    *,
    sign: int = -1,
    drift: torch.Tensor | None = None,
    sigma: float = 0.0,
    noise: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """:func:`step_quantities` written as the paper's equations, with dense tensors.

    Every quantity is formed from the ``[P, H, n, n]`` matrices
    ``U^h_ij = exp(<x_i, D_h x_j>)`` exactly as printed: ``Z_ih = (1/n) sum_j U^h_ij``,
    ``v_i = sign/H sum_h P_{x_i}[(1/Z_ih)(1/n) sum_j U^h_ij D_h x_j]``,
    ``E = 1/(2Hn^2) sum U``, ``G^2 = (1/n) sum_i b_i |v_i|^2`` with
    ``b_i = [(1/H) sum_h 1/Z_ih]^{-1}``, the dissipation ``-(1/n) sum_i <g_i, v_i>``
    with ``g_i = (1/H) sum_h P_{x_i}(1/n) sum_j U^h_ij D_h x_j``, the rate
    ``1/(2Hn^2) sum U^h_ij [x_i^T f_h x_j + sigma^2/4 (1 + <x_i, x_j>^2)]`` and the
    martingale increment ``1/(2Hn^2) sum U^h_ij x_i^T (sigma dW_h) x_j``. No shift, no
    symmetry, no blocking: the reference the fast kernel is tested against. Arguments and
    result as :func:`step_quantities`.

    Complexity: ``O(P H n^2 d)`` time and ``O(P H n^2)`` memory.

    >>> g = torch.Generator().manual_seed(0)
    >>> x, D = uniform_sphere(4, 3, g, paths=1), initial_weights(1, 3, g)
    >>> reference_step_quantities(x, D)["Z"].shape
    torch.Size([1, 4, 1])
    """
    sign, sigma = _check_step_args(tokens, weights, sign, drift, sigma, noise)
    x, D = tokens, weights
    P, n, d = x.shape
    H = D.shape[1]
    U = torch.exp(torch.einsum("pia,phab,pjb->phij", x, D, x))  # [P, H, n, n]
    Z = U.mean(-1)  # [P, H, n]
    Dx = torch.einsum("phab,pjb->phja", D, x)  # D_h x_j
    s = torch.einsum("phij,phja->phia", U, Dx) / n  # (1/n) sum_j U^h_ij D_h x_j
    xb = x.unsqueeze(1)
    vel = sign * _tangent(s / Z.unsqueeze(-1), xb).mean(1)
    grad = _tangent(s, xb).mean(1)
    energy = U.sum((1, 2, 3)) / (2 * H * n * n)
    mobility = 1.0 / (1.0 / Z).mean(1)  # [P, n]
    slope_sq = (mobility * (vel * vel).sum(-1)).mean(-1)
    dissipation = -(grad * vel).sum(-1).mean(-1)
    gram = torch.einsum("pia,pja->pij", x, x)
    integrand = (sigma * sigma / 4) * (1 + gram * gram).unsqueeze(1).expand_as(U)
    if drift is not None:
        f = drift if drift.dim() == 4 else drift.unsqueeze(0).expand_as(D)
        integrand = integrand + torch.einsum("pia,phab,pjb->phij", x, f, x)
    energy_rate = (U * integrand).sum((1, 2, 3)) / (2 * H * n * n)
    if noise is not None and sigma > 0:
        xwx = torch.einsum("pia,phab,pjb->phij", x, sigma * noise, x)
        mart = (U * xwx).sum((1, 2, 3)) / (2 * H * n * n)
    else:
        mart = torch.zeros_like(energy)
    return {
        "velocity": vel,
        "energy": energy,
        "energy_rate": energy_rate,
        "slope_sq": slope_sq,
        "dissipation": dissipation,
        "martingale_increment": mart,
        "Z": Z.transpose(1, 2),
    }


def velocity(tokens: torch.Tensor, weights: torch.Tensor, sign: int = -1) -> torch.Tensor:
    """Right-hand side ``dx_i/dt`` of the multi-head model.

    ``sign/H sum_h P_{x_i}[(1/Z_ih)(1/n) sum_j exp(<x_i, D_h x_j>) D_h x_j]`` for tokens
    ``[paths, n, d]`` and symmetric weights ``[paths, heads, d, d]``; returns
    ``[paths, n, d]`` (tangent to the sphere). ``sign=-1`` is the paper's descent,
    ``+1`` the GLPR clustering dynamics.

    Complexity: ``O(paths heads n^2 d)`` time, no ``n x n`` matrix stored on CPU.
    """
    return step_quantities(tokens, weights, sign=sign)["velocity"]


# --------------------------------------------------------------------------- simulate
@dataclass
class Trajectory:
    """Recorded quantities of :func:`simulate`; record axis first, then paths.

    times ``[R]``; positions ``[R, P, n, d]`` (None when not recorded); weights
    ``[R, P, H, d, d]`` (None unless ``record_weights``); per record and path ``[R, P]``:
    ``energy`` E, ``energy_rate`` (``dE/dt`` at fixed x), ``slope_sq`` (G^2, harmonic-mean
    mobility), ``dissipation`` (true), the cumulative integrals ``int_slope_sq``,
    ``int_dissipation``, ``int_energy_rate`` (left-point rule over every step),
    ``martingale`` (cumulative M_t), and the residuals
    ``residual_slope = dE - sign int G^2 - int dE/dt - M`` and
    ``residual_dissipation = dE + int D - int dE/dt - M``. ``final_weights [P, H, d, d]``.
    """

    times: torch.Tensor
    positions: torch.Tensor | None
    weights: torch.Tensor | None
    energy: torch.Tensor
    energy_rate: torch.Tensor
    slope_sq: torch.Tensor
    dissipation: torch.Tensor
    int_slope_sq: torch.Tensor
    int_dissipation: torch.Tensor
    int_energy_rate: torch.Tensor
    martingale: torch.Tensor
    residual_slope: torch.Tensor
    residual_dissipation: torch.Tensor
    final_tokens: torch.Tensor
    final_weights: torch.Tensor
    dt: float
    sign: int

    @property
    def energy_change(self) -> torch.Tensor:
        """``E(t) - E(0)`` per record and path."""
        return self.energy - self.energy[:1]


def simulate(
    tokens: torch.Tensor,
    weights: torch.Tensor,
    process,
    *,
    T: float,
    dt: float,
    record_every: int = 1,
    sign: int = -1,
    generator: torch.Generator | None = None,
    record_positions: bool = True,
    record_weights: bool = False,
    progress: bool = False,
) -> Trajectory:
    """Integrate the coupled token/weight dynamics and record the energy balance.

    Projected explicit Euler on the sphere, ``x <- (x + dt v) / |x + dt v|``, and
    Euler–Maruyama for the weights, ``D <- D + f(D, t) dt + sigma dW`` with
    ``dW = sqrt(dt) (Z + Z^T)/2``, both from the state at ``t_k``. The integrals in the
    energy balance use the left-point rule at every step (so they are consistent with the
    scheme to first order in ``dt``); records are taken at steps ``0, k, 2k, ...`` and at
    the last step.

    Parameters
    ----------
    tokens : ``[paths, n, d]`` unit vectors (d >= 2).
    weights : ``[paths, heads, d, d]`` symmetric, same dtype/device as ``tokens``.
    process : :class:`OrnsteinUhlenbeck`, :class:`Oscillating` or :class:`Frozen`.
    T, dt : horizon and step (> 0); ``round(T/dt)`` steps.
    record_every : int >= 1. sign : -1 (descent) or +1 (clustering).
    generator : torch.Generator for the weight noise (on the tokens' device) or None.
    record_positions, record_weights : store positions / weights at records.
    progress : show a tqdm bar.

    Returns
    -------
    :class:`Trajectory`.

    Complexity: ``round(T/dt)`` steps of ``O(P H n^2 d)`` time each; memory
    ``O(P H n d)`` per step (scratch tensors reused by every step) plus the records. On CPU
    the steps run with the torch threads spent on independent paths, as in
    :func:`step_quantities`.
    """
    tokens = _check_tokens(tokens)
    weights = _check_weights(weights, tokens)
    if not isinstance(process, _PROCESSES):
        raise TypeError(
            "process: expected OrnsteinUhlenbeck, Oscillating or Frozen, "
            f"got {type(process).__name__}"
        )
    T = _check_positive("T", T)
    dt = _check_positive("dt", dt)
    record_every = check_int("record_every", record_every, 1)
    sign = _check_sign(sign)
    if isinstance(process, Oscillating) and tokens.shape[-1] not in (2, 3):
        raise ValueError(
            f"process: Oscillating is defined for d in (2, 3), got d = {tokens.shape[-1]}"
        )
    steps = max(1, round(T / dt))
    sigma = float(process.sigma)
    P, _n, d = tokens.shape
    H = weights.shape[1]
    x, D = tokens.clone(), weights.clone()
    kw = {"dtype": x.dtype, "device": x.device}
    acc = {k: torch.zeros(P, **kw) for k in ("G", "D", "R", "M")}
    names = ("energy", "energy_rate", "slope_sq", "dissipation", "int_slope_sq",
             "int_dissipation", "int_energy_rate", "martingale")
    rec = {k: [] for k in names}
    times, pos, wts = [], [], []
    record_at = set(range(0, steps + 1, record_every)) | {steps}
    scratch = _Scratch()
    iterator = range(steps + 1)
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(iterator, desc=f"simulate H={H}", leave=False)
    with _path_workers(x.device) as workers:
        for k in iterator:
            t = k * dt
            last = k == steps
            drift = process.drift(D, t)
            noise = None
            if not last and sigma > 0:
                z = torch.randn(P, H, d, d, generator=generator, **kw)
                noise = math.sqrt(dt) * (z + z.transpose(-1, -2)) / 2
            q = _step(x, D, sign, drift, sigma, noise, scratch, workers)
            if k in record_at:
                times.append(t)
                for key, val in (("energy", q["energy"]), ("energy_rate", q["energy_rate"]),
                                 ("slope_sq", q["slope_sq"]), ("dissipation", q["dissipation"]),
                                 ("int_slope_sq", acc["G"]), ("int_dissipation", acc["D"]),
                                 ("int_energy_rate", acc["R"]), ("martingale", acc["M"])):
                    rec[key].append(val.clone())
                if record_positions:
                    pos.append(x.clone())
                if record_weights:
                    wts.append(D.clone())
            if last:
                break
            acc["G"] += q["slope_sq"] * dt
            acc["D"] += q["dissipation"] * dt
            acc["R"] += q["energy_rate"] * dt
            acc["M"] += q["martingale_increment"]
            x = x + dt * q["velocity"]
            x = x / x.norm(dim=-1, keepdim=True)
            if drift is not None:
                D = D + dt * drift
            if noise is not None:
                D = D + sigma * noise
    out = {k: torch.stack(v) for k, v in rec.items()}
    dE = out["energy"] - out["energy"][:1]
    base = dE - out["int_energy_rate"] - out["martingale"]
    return Trajectory(
        times=torch.tensor(times, **kw),
        positions=torch.stack(pos) if record_positions else None,
        weights=torch.stack(wts) if record_weights else None,
        residual_slope=base - sign * out["int_slope_sq"],
        residual_dissipation=base + out["int_dissipation"],
        final_tokens=x,
        final_weights=D,
        dt=dt,
        sign=sign,
        **out,
    )


# ---------------------------------------------------------------------- power-law fit
@dataclass(frozen=True)
class PowerLawFit:
    """``values ≈ prefactor * H ** exponent`` with bootstrap percentile intervals."""

    prefactor: float
    exponent: float
    exponent_ci: tuple[float, float] | None
    prefactor_ci: tuple[float, float] | None
    level: float
    n_boot: int


def _loglog_fit(logh: np.ndarray, logv: np.ndarray) -> tuple[float, float]:
    X = np.stack([np.ones_like(logh), logh], 1)
    (loga, b), *_ = np.linalg.lstsq(X, logv, rcond=None)
    return float(np.exp(loga)), float(b)


def fit_power_law(H, values, *, n_boot: int = 2000, level: float = 0.95,
                  seed: int = 0) -> PowerLawFit:
    """Least-squares fit of ``log v = log a + b log H`` with a bootstrap CI.

    Parameters
    ----------
    H : sequence of k >= 2 distinct positive head counts.
    values : ``[k]`` positive values, or ``[k, S]`` with ``S`` Monte Carlo samples per
        ``H`` (e.g. per-path tail means). The fit uses the mean over samples; the CI
        resamples the samples of each ``H`` independently with replacement (percentile
        bootstrap). With 1-D values there is no sample to resample and the CIs are None.
    n_boot : bootstrap replicates. level : confidence level in (0, 1). seed : numpy seed.

    Returns
    -------
    :class:`PowerLawFit`. Complexity O(n_boot k S).
    """
    level = check_number("level", level, minimum=0.0, maximum=1.0, min_open=True,
                         max_open=True)
    seed = check_int("seed", seed, minimum=0)
    h = _as_float_array("H", H).reshape(-1)
    v = _as_float_array("values", values)
    if h.size < 2 or np.any(h <= 0) or np.unique(h).size != h.size:
        raise ValueError(f"H: expected >= 2 distinct positive values, got {h.tolist()}")
    if v.ndim not in (1, 2) or v.shape[0] != h.size:
        raise ValueError(
            f"values: expected shape [{h.size}] or [{h.size}, samples], got {v.shape}"
        )
    if np.any(~np.isfinite(v)) or np.any(v <= 0):
        raise ValueError("values: expected finite positive numbers")
    n_boot = check_int("n_boot", n_boot, 1)
    logh = np.log(h)
    mean = v if v.ndim == 1 else v.mean(1)
    a, b = _loglog_fit(logh, np.log(mean))
    if v.ndim == 1 or v.shape[1] < 2:
        return PowerLawFit(a, b, None, None, level, 0)
    rng = np.random.default_rng(seed)
    S = v.shape[1]
    idx = rng.integers(0, S, size=(n_boot, h.size, S))
    boot_means = np.take_along_axis(v[None], idx, axis=2).mean(-1)  # [n_boot, k]
    X = np.stack([np.ones_like(logh), logh], 1)
    coef, *_ = np.linalg.lstsq(X, np.log(boot_means).T, rcond=None)  # [2, n_boot]
    q = [(1 - level) / 2 * 100, (1 + level) / 2 * 100]
    b_ci = tuple(float(c) for c in np.percentile(coef[1], q))
    a_ci = tuple(float(c) for c in np.exp(np.percentile(coef[0], q)))
    return PowerLawFit(a, b, b_ci, a_ci, level, n_boot)


def _as_float_array(name, a) -> np.ndarray:
    """Torch tensors (any device) or array-likes as a float64 numpy array, else TypeError."""
    if isinstance(a, torch.Tensor):
        check_tensor(name, a)
        a = a.detach().to("cpu", torch.float64).numpy()
    try:
        return np.asarray(a, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name}: expected numbers, got {describe(a)}") from exc


def loglog_order(x, y) -> float:
    """Least-squares slope of ``log y`` against ``log x`` (an order of convergence).

    ``x``, ``y``: 1-D, same length k >= 2, finite and positive.

    >>> round(loglog_order([1e-3, 1e-2, 1e-1], [2e-6, 2e-4, 2e-2]), 6)
    2.0
    """
    xs = _as_float_array("x", x).reshape(-1)
    ys = _as_float_array("y", y).reshape(-1)
    if xs.size < 2 or xs.size != ys.size:
        raise ValueError(f"x, y: expected two 1-D sequences of equal length >= 2, got "
                         f"{xs.size} and {ys.size} values")
    for name, a in (("x", xs), ("y", ys)):
        if np.any(~np.isfinite(a)) or np.any(a <= 0):
            raise ValueError(f"{name}: expected finite positive numbers, got {a.tolist()}")
    if np.unique(xs).size < 2:
        raise ValueError(f"x: expected at least two distinct values, got {xs.tolist()}")
    return _loglog_fit(np.log(xs), np.log(ys))[1]


def bootstrap_over_paths(statistic, *samples, n_boot: int = 2000, level: float = 0.95,
                         seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of ``statistic`` over Monte Carlo paths.

    Parameters
    ----------
    statistic : callable taking the arrays of ``samples`` (resampled) and returning a
        finite float, e.g. ``lambda r: r.mean()``.
    samples : one or more arrays (tensors or array-likes) whose *last* axis is the path
        axis, all with the same number ``P >= 2`` of paths. Paths are resampled with
        replacement, with the same indices in every array (paired: a path's values at
        several ``dt`` or ``H`` stay together).
    n_boot : replicates. level : confidence level in (0, 1). seed : numpy seed (>= 0).

    Returns
    -------
    ``(lo, hi)``. Replicates on which ``statistic`` is not finite are dropped; a
    ``ValueError`` is raised when fewer than half remain. Complexity O(n_boot * cost).

    >>> lo, hi = bootstrap_over_paths(lambda v: v.mean(), np.arange(10.0), seed=1)
    >>> 2.5 < lo < 4.5 < hi < 6.5
    True
    """
    if not callable(statistic):
        raise TypeError(f"statistic: expected a callable, got {describe(statistic)}")
    if not samples:
        raise ValueError("samples: expected at least one array with paths on the last axis")
    arrays = [_as_float_array(f"samples[{i}]", a) for i, a in enumerate(samples)]
    P = arrays[0].shape[-1] if arrays[0].ndim else 0
    for i, a in enumerate(arrays):
        if a.ndim < 1 or a.shape[-1] != P:
            raise ValueError(f"samples[{i}]: expected the path axis last with {P} paths like "
                             f"samples[0], got shape {a.shape}")
    if P < 2:
        raise ValueError(f"samples: expected at least 2 paths to resample, got {P}")
    n_boot = check_int("n_boot", n_boot, 1)
    level = check_number("level", level, minimum=0.0, maximum=1.0, min_open=True,
                         max_open=True)
    seed = check_int("seed", seed, minimum=0)
    rng = np.random.default_rng(seed)
    reps = []
    for _ in range(n_boot):
        idx = rng.integers(0, P, size=P)
        value = float(statistic(*(a[..., idx] for a in arrays)))
        if math.isfinite(value):
            reps.append(value)
    if len(reps) < max(1, n_boot // 2):
        raise ValueError(f"statistic: finite on only {len(reps)} of {n_boot} bootstrap "
                         "replicates")
    q = [(1 - level) / 2 * 100, (1 + level) / 2 * 100]
    lo, hi = np.percentile(np.asarray(reps), q)
    return float(lo), float(hi)


# ------------------------------------------------------------------- W2 and stability
def w2_sphere(x: torch.Tensor, y: torch.Tensor, cost: str = "geodesic") -> torch.Tensor:
    """Exact W_2 between two uniform empirical measures of equal size on the sphere.

    ``W_2(x, y)^2 = min_sigma (1/n) sum_i c(x_i, y_sigma(i))^2`` over permutations
    (for equal-size uniform measures an optimal plan is a permutation, Birkhoff), solved
    with ``scipy.optimize.linear_sum_assignment``. ``cost="geodesic"``:
    ``c = arccos <x, y>`` (great-circle distance); ``"chordal"``: ``c = |x - y|``.

    Parameters
    ----------
    x, y : ``[..., n, d]`` with equal shapes; leading dimensions are a batch.

    Returns
    -------
    Tensor of shape ``[...]`` on ``x``'s device (the assignment itself is solved on CPU
    in float64, the batch shared among ``torch.get_num_threads()`` worker threads).
    Complexity O(batch n^3).
    """
    from scipy.optimize import linear_sum_assignment

    check_tensor("x", x)
    check_tensor("y", y)
    if x.shape != y.shape or x.dim() < 2:
        raise ValueError(
            f"x, y: expected equal shapes [..., n, d], got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    check_choice("cost", cost, ("geodesic", "chordal"))
    xs = x.detach().to("cpu", torch.float64).reshape(-1, *x.shape[-2:]).numpy()
    ys = y.detach().to("cpu", torch.float64).reshape(-1, *y.shape[-2:]).numpy()
    out = np.empty(xs.shape[0])

    def solve(batch):  # scipy's assignment solver is not batched; it releases the GIL
        for b in batch:
            # |x - y| from differences, not 2 - 2<x, y>: exact 0 for equal points
            chord = np.linalg.norm(xs[b][:, None, :] - ys[b][None, :, :], axis=-1)
            if cost == "geodesic":
                c2 = (2 * np.arcsin(np.clip(chord / 2, 0.0, 1.0))) ** 2  # stable near 0
            else:
                c2 = chord**2
            r, c = linear_sum_assignment(c2)
            out[b] = math.sqrt(c2[r, c].mean())

    # the torch threads' worth of worker threads, each with its share of the batch
    workers = max(1, min(torch.get_num_threads(), xs.shape[0]))
    if workers == 1:
        solve(range(xs.shape[0]))
    else:
        for future in [_pool().submit(solve, range(w, xs.shape[0], workers))
                       for w in range(workers)]:
            future.result()
    return torch.as_tensor(out, dtype=x.dtype).reshape(x.shape[:-2]).to(x.device)


def spectral_norms(weights: torch.Tensor) -> torch.Tensor:
    """The spectral norm of each (symmetric) head matrix: its largest absolute eigenvalue.

    Parameters
    ----------
    weights : tensor [..., H, d, d]
        Symmetric matrices (the flow's D_h(t)).

    Returns
    -------
    tensor [..., H]

    >>> spectral_norms(torch.diag(torch.tensor([1.0, -3.0]))[None])
    tensor([3.])
    """
    check_tensor("weights", weights, min_ndim=3, floating=True, finite=True,
                 shape_text="[..., H, d, d]")
    if weights.shape[-1] != weights.shape[-2]:
        raise ValueError(
            f"weights: expected square matrices [..., H, d, d], got shape {tuple(weights.shape)}"
        )
    return torch.linalg.eigvalsh(weights).abs().amax(-1)


def lipschitz_constant(weights: torch.Tensor) -> torch.Tensor:
    """A Lipschitz constant of the velocity field in the max-over-tokens chordal metric.

    For a head with ``lambda = ||D_h||_2`` the map ``(x_i, X) -> P_{x_i} D_h a_h(x_i; X)``
    changes by at most ``lambda (2 + 3 lambda) max_j |x_j - y_j|``: the projection
    contributes ``lambda`` (``|x x^T - y y^T| = sin angle <= |x - y|``), and the softmax
    mean ``a`` is ``lambda``-Lipschitz in the query (its Jacobian is ``Cov_w D``) and
    ``(1 + 2 lambda)``-Lipschitz in the keys (Jacobian ``w_j [I + (x_j - a)(D x)^T]``),
    times ``|D_h| = lambda``. The velocity averages heads, so
    ``L = (1/H) sum_h lambda_h (2 + 3 lambda_h)``.

    weights ``[..., H, d, d]`` -> ``[...]``.
    """
    lam = spectral_norms(weights)
    return (lam * (2 + 3 * lam)).mean(-1)


def weight_sensitivity(weights: torch.Tensor) -> torch.Tensor:
    """``K`` with ``|v_D(x) - v_D'(x)| <= K max_h ||D_h - D'_h||_2``.

    ``K = (1/H) sum_h (1 + lambda_h)`` with ``lambda_h = ||D_h||_2`` of ``D``.

    (``|D a - D' a'| <= |D - D'| + lambda |a - a'|`` and the softmax mean moves by at most
    ``sqrt(Var logits) <= |D - D'|``.) weights ``[..., H, d, d]`` -> ``[...]``.
    """
    return (1 + spectral_norms(weights)).mean(-1)


def gronwall_bound(times, lipschitz, initial_distance, forcing=None) -> torch.Tensor:
    """Grönwall bound ``e(t) <= e^{int L} e(0) + int_0^t e^{int_s^t L} k(s) ds``.

    ``times [R]``, ``lipschitz [R, ...]`` (L at each record), ``initial_distance [...]``,
    ``forcing [R, ...]`` or None (the term ``K |D - D'|``). Integrals by the trapezoid
    rule on the record grid. Returns ``[R, ...]``.
    """
    times = torch.as_tensor(times)
    L = torch.as_tensor(lipschitz)
    check_tensor("times", times, ndim=1, floating=True, finite=True)
    check_tensor("lipschitz", L, min_ndim=1, floating=True, finite=True)
    if times.numel() < 1 or L.shape[0] != times.shape[0]:
        raise ValueError(
            f"lipschitz: expected [R, ...] with R = {times.numel()} records like times, got "
            f"shape {tuple(L.shape)}"
        )
    if forcing is not None and tuple(torch.as_tensor(forcing).shape[:1]) != (times.shape[0],):
        raise ValueError(
            f"forcing: expected [R, ...] with R = {times.numel()} records like times, got "
            f"shape {tuple(torch.as_tensor(forcing).shape)}"
        )
    dt = torch.diff(times).reshape(-1, *([1] * (L.dim() - 1)))
    cumL = torch.cat([torch.zeros_like(L[:1]), torch.cumsum(0.5 * (L[1:] + L[:-1]) * dt, 0)])
    bound = torch.exp(cumL) * initial_distance
    if forcing is not None:
        k = torch.as_tensor(forcing)
        # int_0^t e^{cumL(t) - cumL(s)} k(s) ds = e^{cumL(t)} int_0^t e^{-cumL(s)} k(s) ds
        g = torch.exp(-cumL) * k
        steps = torch.cumsum(0.5 * (g[1:] + g[:-1]) * dt, 0)
        integral = torch.cat([torch.zeros_like(g[:1]), steps])
        bound = bound + torch.exp(cumL) * integral
    return bound


def pairwise_inner_stats(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Min and mean of ``<x_i, x_j>`` over pairs ``i != j`` for tokens ``[..., n, d]``."""
    check_tensor("tokens", tokens, min_ndim=2, floating=True, shape_text="[..., n, d]")
    if tokens.shape[-2] < 2:
        raise ValueError(
            f"tokens: expected n >= 2 tokens for pairs, got shape {tuple(tokens.shape)}"
        )
    g = tokens @ tokens.transpose(-1, -2)
    n = tokens.shape[-2]
    off = ~torch.eye(n, dtype=torch.bool, device=tokens.device)
    vals = g[..., off]
    return {"min": vals.amin(-1), "mean": vals.mean(-1)}
