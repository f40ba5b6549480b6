"""Reading trajectories: power-law fits and orders, bootstrap intervals over Monte Carlo
paths, Wasserstein distances on the sphere, stability constants and clustering measures.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from companion._validate import check_choice, check_int, check_number, check_tensor, describe
from companion.gradient_flow.kernels import worker_pool

__all__ = [
    "PowerLawFit",
    "bootstrap_mean_band",
    "bootstrap_over_paths",
    "fit_power_law",
    "gronwall_bound",
    "lipschitz_constant",
    "loglog_order",
    "pairwise_inner_stats",
    "spectral_norms",
    "w2_sphere",
    "weight_sensitivity",
]


# ---------------------------------------------------------------------- power-law fit
@dataclass(frozen=True)
class PowerLawFit:
    """``values ≈ prefactor * H ** exponent`` with bootstrap percentile intervals.

    Examples
    --------
    >>> fit = fit_power_law([1, 10, 100], [2.0, 0.2, 0.02], n_boot=20)
    >>> round(fit.exponent, 6), fit.level
    (-1.0, 0.95)
    """

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

    Examples
    --------
    >>> fit = fit_power_law([1, 10, 100], [2.0, 0.2, 0.02], n_boot=20)
    >>> round(fit.prefactor, 6), round(fit.exponent, 6)
    (2.0, -1.0)
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


def bootstrap_mean_band(values, per_path_scale=None, *, n_boot: int = 2000,
                        level: float = 0.95, seed: int = 0):
    """Path mean of ``values`` with its pointwise percentile bootstrap interval.

    The resampling of :func:`bootstrap_over_paths` (paths drawn with replacement, the same
    draws for every leading index), vectorised over the leading axes: a band around a
    curve of path means.

    Parameters
    ----------
    values : ``[..., P]`` (tensor or array-like), paths on the last axis, ``P >= 1``.
    per_path_scale : ``[P]`` or None. With a scale the statistic is the ratio of path
        means ``mean(values) / mean(per_path_scale)``, both resampled with the same paths.
    n_boot : replicates. level : confidence level in (0, 1). seed : numpy seed (>= 0).

    Returns
    -------
    ``(mean, lo, hi)``, numpy arrays of shape ``[...]``. Complexity O(n_boot * values).

    >>> m, lo, hi = bootstrap_mean_band(np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]))
    >>> m.tolist(), bool(lo[0] < 2.0 < hi[0]), float(lo[1]), float(hi[1])
    ([2.0, 0.0], True, 0.0, 0.0)
    """
    v = _as_float_array("values", values)
    if v.ndim < 1 or v.shape[-1] < 1:
        raise ValueError(f"values: expected [..., paths] with at least one path, got "
                         f"shape {v.shape}")
    if per_path_scale is None:
        scale = np.ones(v.shape[-1])
    else:
        scale = _as_float_array("per_path_scale", per_path_scale)
        if scale.shape != (v.shape[-1],):
            raise ValueError(f"per_path_scale: expected shape [{v.shape[-1]}] (one value per "
                             f"path), got {scale.shape}")
    n_boot = check_int("n_boot", n_boot, 1)
    level = check_number("level", level, minimum=0.0, maximum=1.0, min_open=True,
                         max_open=True)
    seed = check_int("seed", seed, minimum=0)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, v.shape[-1], size=(n_boot, v.shape[-1]))
    reps = v[..., idx].mean(-1) / scale[idx].mean(-1)  # [..., n_boot]
    percent = 100 * level
    lo, hi = np.percentile(reps, [(100 - percent) / 2, (100 + percent) / 2], axis=-1)
    return v.mean(-1) / scale.mean(), lo, hi


# ------------------------------------------------------------------- W2 and stability
def _pairwise_distances(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``|x_i - y_j|`` for ``x [n, d]``, ``y [m, d]``: ``np.linalg.norm`` of the
    differences over the last axis, bit for bit.

    For ``d < 8`` NumPy sums the ``d`` squares of a row one after the other (its pairwise
    summation starts blocks of 8 only from 8 terms), so the squares are added here in that
    order one coordinate at a time, on ``[n, m]`` planes instead of an ``[n, m, d]``
    array (no ``[n, m, d]`` temporary and no per-row reduction), the same numbers.
    """
    d = x.shape[-1]
    if d >= 8:
        return np.linalg.norm(x[:, None, :] - y[None, :, :], axis=-1)
    total = None
    for a in range(d):
        diff = x[:, a, None] - y[None, :, a]
        square = diff * diff
        total = square if total is None else total + square
    return np.sqrt(total)


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

    Examples
    --------
    The distance is between empirical measures: the order of the points does not matter.

    >>> from companion.gradient_flow.simulation import uniform_sphere
    >>> x = uniform_sphere(4, 3, torch.Generator().manual_seed(0))
    >>> float(w2_sphere(x, x.flip(0)))
    0.0
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
            chord = _pairwise_distances(xs[b], ys[b])
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
        for future in [worker_pool().submit(solve, range(w, xs.shape[0], workers))
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

    Examples
    --------
    >>> lipschitz_constant(torch.zeros(1, 2, 3, 3))  # zero weights: a zero field
    tensor([0.])
    """
    lam = spectral_norms(weights)
    return (lam * (2 + 3 * lam)).mean(-1)


def weight_sensitivity(weights: torch.Tensor) -> torch.Tensor:
    """``K`` with ``|v_D(x) - v_D'(x)| <= K max_h ||D_h - D'_h||_2``.

    ``K = (1/H) sum_h (1 + lambda_h)`` with ``lambda_h = ||D_h||_2`` of ``D``.

    (``|D a - D' a'| <= |D - D'| + lambda |a - a'|`` and the softmax mean moves by at most
    ``sqrt(Var logits) <= |D - D'|``.) weights ``[..., H, d, d]`` -> ``[...]``.

    Examples
    --------
    >>> weight_sensitivity(torch.zeros(1, 2, 3, 3))
    tensor([1.])
    """
    return (1 + spectral_norms(weights)).mean(-1)


def gronwall_bound(times, lipschitz, initial_distance, forcing=None) -> torch.Tensor:
    """Grönwall bound ``e(t) <= e^{int L} e(0) + int_0^t e^{int_s^t L} k(s) ds``.

    ``times [R]``, ``lipschitz [R, ...]`` (L at each record), ``initial_distance [...]``,
    ``forcing [R, ...]`` or None (the term ``K |D - D'|``). Integrals by the trapezoid
    rule on the record grid. Returns ``[R, ...]``.

    Examples
    --------
    With ``L = 1`` and no forcing the bound is ``e^t e(0)``:

    >>> gronwall_bound(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0]), 1.0)
    tensor([1.0000, 2.7183])
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
    """Min and mean of ``<x_i, x_j>`` over pairs ``i != j`` for tokens ``[..., n, d]``.

    Examples
    --------
    >>> pairwise_inner_stats(torch.eye(3))  # orthogonal tokens
    {'min': tensor(0.), 'mean': tensor(0.)}
    """
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

