"""The paper's equations as plain code: the reference every fast kernel is tested against.

Two readings of one Euler step of the multi-head model, both without shifts, symmetry or
blocking:

- :func:`reference_step_quantities`: dense ``[P, H, n, n]`` torch tensors, every
  quantity formed from ``U^h_ij = exp(<x_i, D_h x_j>)`` exactly as printed (any dtype,
  any device).
- :func:`reference_step_loops`: plain Python loops over paths, heads and token pairs in
  float64 numpy, one line per equation (tiny sizes only).

No tuning and no speed: :mod:`companion.gradient_flow.kernels` is the fast path.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from companion.gradient_flow._checks import check_step_args

__all__ = ["reference_step_loops", "reference_step_quantities"]


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
    >>> from companion import gradient_flow as gf
    >>> x, D = gf.uniform_sphere(4, 3, g, paths=1), gf.initial_weights(1, 3, g)
    >>> reference_step_quantities(x, D)["Z"].shape
    torch.Size([1, 4, 1])
    """
    sign, sigma = check_step_args(tokens, weights, sign, drift, sigma, noise)
    x, D = tokens, weights
    P, n, d = x.shape
    H = D.shape[1]
    U = torch.exp(torch.einsum("pia,phab,pjb->phij", x, D, x))  # U^h_ij [P, H, n, n]
    Z = U.mean(-1)  # Z_ih = (1/n) sum_j U^h_ij, [P, H, n]
    Dx = torch.einsum("phab,pjb->phja", D, x)  # D_h x_j
    s = torch.einsum("phij,phja->phia", U, Dx) / n  # (1/n) sum_j U^h_ij D_h x_j
    xb = x.unsqueeze(1)
    vel = sign * _tangent(s / Z.unsqueeze(-1), xb).mean(1)  # v_i = sign/H sum_h P_xi[s/Z]
    grad = _tangent(s, xb).mean(1)  # g_i = 1/H sum_h Z_ih P_xi[s/Z]
    energy = U.sum((1, 2, 3)) / (2 * H * n * n)  # E
    mobility = 1.0 / (1.0 / Z).mean(1)  # b_i = [(1/H) sum_h 1/Z_ih]^-1, [P, n]
    slope_sq = (mobility * (vel * vel).sum(-1)).mean(-1)  # G^2 = (1/n) sum_i b_i |v_i|^2
    dissipation = -(grad * vel).sum(-1).mean(-1)  # D = -(1/n) sum_i <g_i, v_i>
    gram = torch.einsum("pia,pja->pij", x, x)
    # d_t E = 1/(2Hn^2) sum U^h_ij [x_i^T f_h x_j + sigma^2/4 (1 + <x_i, x_j>^2)]
    integrand = (sigma * sigma / 4) * (1 + gram * gram).unsqueeze(1).expand_as(U)
    if drift is not None:
        f = drift if drift.dim() == 4 else drift.unsqueeze(0).expand_as(D)
        integrand = integrand + torch.einsum("pia,phab,pjb->phij", x, f, x)
    energy_rate = (U * integrand).sum((1, 2, 3)) / (2 * H * n * n)
    if noise is not None and sigma > 0:
        xwx = torch.einsum("pia,phab,pjb->phij", x, sigma * noise, x)
        mart = (U * xwx).sum((1, 2, 3)) / (2 * H * n * n)  # dM
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



def reference_step_loops(x, D, f, sigma, dW, dt, sign):
    """One step of the model as float64 loops over paths, heads and tokens ``i, j``.

    Parameters
    ----------
    x : array ``[P, n, d]`` of unit vectors. D : ``[P, H, d, d]`` symmetric weights.
    f : ``[P, H, d, d]`` the weight drift ``f_h`` at this time (zeros for none).
    sigma : noise amplitude. dW : ``[P, H, d, d]`` the symmetric noise increment (zeros
        for none). dt : step. sign : -1 (descent) or +1 (clustering).

    Returns
    -------
    ``(quantities, x_next)``: the keys of :func:`step_quantities` but ``Z``
    (``velocity [P, n, d]``; ``energy``, ``energy_rate``, ``slope_sq``,
    ``dissipation``, ``martingale_increment`` ``[P]``) as numpy arrays, and the
    projected Euler step ``x_next = (x + dt v) / |x + dt v|``.

    Complexity: ``O(P H n^2 d)`` Python operations (n of a few tens at most).

    >>> x = np.array([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])
    >>> D = np.eye(3)[None, None]
    >>> out, _ = reference_step_loops(x, D, np.zeros_like(D), 0.0, np.zeros_like(D), 0.1, -1)
    >>> round(float(out["energy"][0]), 5)  # (2 e + 2) / (2 * 1 * 4)
    0.92957
    """
    x, D, f, dW = (np.asarray(a, dtype=np.float64) for a in (x, D, f, dW))
    P, n, d = x.shape
    H = D.shape[1]
    out = {k: np.zeros(P) for k in ("energy", "energy_rate", "slope_sq", "dissipation",
                                    "martingale_increment")}
    out["velocity"] = np.zeros_like(x)
    x_next = np.zeros_like(x)
    for p in range(P):
        U = np.zeros((H, n, n))  # U^h_ij = exp(<x_i, D_h x_j>)
        for h, i, j in itertools.product(range(H), range(n), range(n)):
            U[h, i, j] = math.exp(x[p, i] @ D[p, h] @ x[p, j])
        Z = U.sum(2) / n  # Z_ih = (1/n) sum_j U^h_ij, stored [h, i]
        vel = np.zeros((n, d))
        grad = np.zeros((n, d))
        for i in range(n):
            proj = np.eye(d) - np.outer(x[p, i], x[p, i])  # P_{x_i}
            for h in range(H):
                s = sum(U[h, i, j] * (D[p, h] @ x[p, j]) for j in range(n)) / n
                vel[i] += sign * proj @ (s / Z[h, i]) / H  # v_i
                grad[i] += proj @ s / H  # Z_ih (1/Z_ih) s: the tangent gradient g_i
        b = 1.0 / np.mean(1.0 / Z, axis=0)  # harmonic-mean mobility b_i
        out["velocity"][p] = vel
        out["energy"][p] = U.sum() / (2 * H * n * n)
        out["slope_sq"][p] = np.mean(b * (vel**2).sum(1))
        out["dissipation"][p] = -np.mean((grad * vel).sum(1))
        rate = dm = 0.0
        for h, i, j in itertools.product(range(H), range(n), range(n)):
            xi, xj = x[p, i], x[p, j]
            rate += U[h, i, j] * (xi @ f[p, h] @ xj + sigma**2 / 4 * (1 + (xi @ xj) ** 2))
            dm += U[h, i, j] * (xi @ (sigma * dW[p, h]) @ xj)
        out["energy_rate"][p] = rate / (2 * H * n * n)
        out["martingale_increment"][p] = dm / (2 * H * n * n)
        y = x[p] + dt * vel
        x_next[p] = y / np.linalg.norm(y, axis=1, keepdims=True)
    return out, x_next
