"""Baseline in the authors' style: one step of the multi-head model with full einsums.

Written from the equations of the fact sheet (never copied): every quantity is formed from
dense ``[paths, heads, n, n]`` float64 tensors (logits, exponentials, softmax weights and
the bilinear forms of the drift and of the noise), exactly as a direct transcription of

    U_ij^h = exp(<x_i, D_h x_j>),  Z_ih = (1/n) sum_j U_ij^h,
    v_i = sign/H sum_h P_{x_i}[(1/Z_ih)(1/n) sum_j U_ij^h D_h x_j],
    E = 1/(2Hn^2) sum U,  G^2 = (1/n) sum_i b_i |v_i|^2,  b_i = [(1/H) sum_h 1/Z_ih]^-1,
    dE/dt = 1/(2Hn^2) sum U [x_i^T f_h x_j + sigma^2/4 (1 + <x_i, x_j>^2)],
    dM = 1/(2Hn^2) sum U x_i^T (sigma dW_h) x_j.

Memory is several ``P H n^2`` float64 tensors (about 0.3 GB each at n = 200, H = 100,
P = 10). Used by benchmarks/bench_gradient_flow.py as the reference the library is timed
and checked against.
"""
from __future__ import annotations

import torch


def einsum_step(x, D, f, sigma, dW, dt, sign=-1):
    """One projected Euler / Euler–Maruyama step; returns (x_new, D_new, quantities)."""
    P, n, d = x.shape
    H = D.shape[1]
    logits = torch.einsum("pia,phab,pjb->phij", x, D, x)
    U = torch.exp(logits)
    del logits
    Z = U.mean(-1)  # [P, H, n]
    W = U / (n * Z.unsqueeze(-1))  # softmax weights
    Dx = torch.einsum("phab,pjb->phja", D, x)  # D_h x_j
    S = torch.einsum("phij,phja->phia", W, Dx)  # (1/Z)(1/n) sum_j U D_h x_j
    del W
    xb = x.unsqueeze(1)
    proj = S - (S * xb).sum(-1, keepdim=True) * xb
    vel = sign * proj.mean(1)
    energy = U.sum((1, 2, 3)) / (2 * H * n * n)
    mobility = 1.0 / (1.0 / Z).mean(1)
    slope_sq = (mobility * (vel**2).sum(-1)).mean(-1)
    grad = torch.einsum("phij,phja->phia", U, Dx) / n  # Z_ih * S_ih
    grad = (grad - (grad * xb).sum(-1, keepdim=True) * xb).mean(1)
    dissipation = -(grad * vel).sum(-1).mean(-1)
    gram = torch.einsum("pia,pja->pij", x, x)
    xfx = torch.einsum("pia,phab,pjb->phij", x, f, x)
    rate = (U * (xfx + sigma**2 / 4 * (1 + gram**2).unsqueeze(1))).sum((1, 2, 3))
    del xfx
    rate = rate / (2 * H * n * n)
    xwx = torch.einsum("pia,phab,pjb->phij", x, sigma * dW, x)
    mart = (U * xwx).sum((1, 2, 3)) / (2 * H * n * n)
    del xwx, U
    x_new = x + dt * vel
    x_new = x_new / x_new.norm(dim=-1, keepdim=True)
    D_new = D + dt * f + sigma * dW
    quantities = dict(velocity=vel, energy=energy, energy_rate=rate, slope_sq=slope_sq,
                      dissipation=dissipation, martingale_increment=mart)
    return x_new, D_new, quantities
