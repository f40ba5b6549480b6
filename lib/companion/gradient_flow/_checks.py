"""Argument checks shared by the modules of :mod:`companion.gradient_flow`.

Tokens are unit vectors ``[paths, n, d]``, weights symmetric ``[paths, heads, d, d]``;
each check raises ``ValueError`` / ``TypeError`` naming the parameter.
"""
from __future__ import annotations

import torch

from companion._validate import check_int, check_number, check_tensor, describe

DEFAULT_DTYPE = torch.float64


def check_positive(name: str, value) -> float:
    return check_number(name, value, minimum=0.0, min_open=True,
                        expected="a positive finite number")


def check_sign(sign) -> int:
    sign = check_int("sign", sign, minimum=-1, maximum=1)
    if sign == 0:
        raise ValueError("sign: expected -1 (descent) or +1 (clustering), got 0")
    return sign


def check_tokens(tokens) -> torch.Tensor:
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


def check_weights(weights, tokens: torch.Tensor | None = None) -> torch.Tensor:
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


def factory(dtype, device):
    from companion.devices import resolve_device

    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype: expected a floating torch.dtype or None, got {describe(dtype)}")
    return {"dtype": DEFAULT_DTYPE if dtype is None else dtype, "device": resolve_device(device)}



def check_step_args(tokens, weights, sign, drift, sigma, noise):
    """Check the arguments of one step; returns ``(sign, sigma)`` as int and float."""
    check_tokens(tokens)
    check_weights(weights, tokens)
    sign = check_sign(sign)
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

