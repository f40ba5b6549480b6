"""The measurements the paper's statements are tested with (one function per measurement).

The chapter and the falsifier tests call the same functions, so that a perturbation of the
measured object (the slope set to zero, tokens frozen, another weight-noise path) is judged
by exactly the quantity the chapter records. Every function takes per-path arrays (the
last axis is the Monte Carlo path: one independent initial token cloud, initial weights
and weight-noise path each) and :func:`path_interval` resamples those paths.

- :func:`edi_residual` and :func:`edi_relative_residual`: the discrete energy-dissipation
  identity (the authors' README, Eq. (81)) with the paper's slope ``G^2``, with the true
  dissipation, or with the slope set to zero.
- :func:`residual_order`: the order in ``dt`` at which a residual closes.
- :func:`stationary_law_weights`, :func:`tangential_share`: Theorem 4.16's stationarity of
  the omega-limit points for the energy at the limiting weight law.
- :func:`late_displacement`: how far the token cloud moves over the last fifth of a run;
  :func:`clustered_share`: how much of it sits in clusters.
- :func:`gronwall_ratio`: distance between perturbed and unperturbed trajectories over a
  Grönwall bound, where the bound is informative.
- :func:`mobility_range`: the range of the harmonic-mean mobility, whose bounds are the
  constants of the equivalence of ``W_{m,2}`` with ``W_2``.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from companion._validate import check_int, check_number, check_tensor
from companion.gradient_flow._checks import factory
from companion.gradient_flow.analysis import bootstrap_over_paths, loglog_order, w2_sphere
from companion.gradient_flow.kernels import step_quantities

# The sphere's diameter in the chordal metric: W_2 <= 2 always, so a bound above it says
# nothing about the trajectories.
DIAMETER = 2.0


def path_interval(statistic, *samples, n_boot: int = 2000, level: float = 0.95,
                  seed: int = 0) -> tuple[float, float]:
    """Expanded percentile bootstrap interval of ``statistic`` over independent paths.

    Each path (last axis) is one independent draw of what the paper's statements range
    over (initial tokens, initial weights, weight noise). With few paths a plain
    percentile interval is too short (it ignores the ``P - 1`` degrees of freedom of the
    spread); the expanded percentile interval (Hesterberg 2015) takes the bootstrap
    percentiles at ``Phi(± sqrt(P / (P - 1)) t_{P-1})`` instead of ``Phi(± z)``: for a
    95 % interval the 0.25 % and 99.75 % percentiles at ``P = 6``, 0.85 % and 99.15 % at
    ``P = 10``. See :func:`~companion.gradient_flow.analysis.bootstrap_over_paths`.

    >>> import numpy as np
    >>> lo, hi = path_interval(np.mean, np.array([1.0, 2.0, 3.0, 4.0]), n_boot=200)
    >>> lo < 2.5 < hi
    True
    """
    from scipy import stats

    level = check_number("level", level, minimum=0.0, maximum=1.0, min_open=True,
                         max_open=True)
    first = samples[0] if samples else None
    P = int(np.shape(_np(first))[-1]) if first is not None and np.ndim(_np(first)) else 0
    if P >= 2:
        z = math.sqrt(P / (P - 1)) * stats.t.ppf((1 + level) / 2, P - 1)
        level = float(2 * stats.norm.cdf(z) - 1)
        if level >= 1.0:  # two or three paths: the expanded level rounds to 1; the widest
            level = 1 - 1 / max(int(n_boot), 2)  # interval the replicates give is honest
    return bootstrap_over_paths(statistic, *samples, n_boot=n_boot, level=level, seed=seed)


def _np(a) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return a.detach().cpu().numpy()
    return np.asarray(a, dtype=float)


# ------------------------------------------------------------------- energy balance
_EDI_FORMS = ("slope", "dissipation", "zero")


def edi_residual(trajectory, form: str = "slope") -> torch.Tensor:
    """The energy-balance residual ``[R, P]`` of a :class:`Trajectory`, in one of three forms.

    ``"slope"``: ``E(t) - E(0) + int G^2 - int d_s E - M_t`` with the paper's
    harmonic-mean slope (the identity the authors discretise); ``"dissipation"``: the same
    with the true dissipation; ``"zero"``: the slope term left out (the falsifier "G^2 set
    to zero").

    >>> import torch
    >>> from companion import gradient_flow as gf
    >>> g = torch.Generator().manual_seed(0)
    >>> x, D = gf.octahedral_tokens(8, 0.05, g, paths=3), gf.initial_weights(1, 3, g, paths=3)
    >>> tr = gf.simulate(x, D, gf.Frozen(), T=0.5, dt=0.01, record_every=10)
    >>> edi_residual(tr).shape  # [records, paths]
    torch.Size([6, 3])
    >>> bool((edi_residual(tr, "zero")[-1] < edi_residual(tr)[-1]).all())
    True

    References
    ----------
    Massucco et al., arXiv 2605.18870, Eq. (81) (numbered in the authors' README): the
    energy-dissipation identity that is discretised.
    """
    if form not in _EDI_FORMS:
        raise ValueError(f"form: expected one of {_EDI_FORMS}, got {form!r}")
    if form == "slope":
        return trajectory.residual_slope
    if form == "dissipation":
        return trajectory.residual_dissipation
    # residual_slope = dE - sign int G^2 - int d_s E - M: add the slope term back
    return trajectory.residual_slope + trajectory.sign * trajectory.int_slope_sq


def edi_relative_residual(trajectory, form: str = "slope", *, n_boot: int = 2000,
                          level: float = 0.95, seed: int = 0):
    """Path-mean residual at the final time over the path-mean ``int_0^T G^2``.

    The identity tests the slope term only if its residual is small against that term:
    a residual of the size of ``int G^2`` cannot tell the identity with ``G^2`` from the
    one without it.

    Returns
    -------
    ``(value, (lo, hi))``: the ratio and its bootstrap interval over paths.

    >>> import torch
    >>> from companion import gradient_flow as gf
    >>> g = torch.Generator().manual_seed(0)
    >>> x, D = gf.octahedral_tokens(8, 0.05, g, paths=3), gf.initial_weights(1, 3, g, paths=3)
    >>> tr = gf.simulate(x, D, gf.Frozen(), T=0.5, dt=0.01, record_every=10)
    >>> abs(edi_relative_residual(tr, n_boot=50)[0]) < 0.1
    True
    >>> edi_relative_residual(tr, "zero", n_boot=50)[0] < -0.5
    True
    """
    r = _np(edi_residual(trajectory, form)[-1])
    s = _np(trajectory.int_slope_sq[-1])
    stat = lambda a, b: a.mean() / b.mean()  # noqa: E731
    return float(stat(r, s)), path_interval(stat, r, s, n_boot=n_boot, level=level,
                                            seed=seed)


def residual_order(dts, residuals, *, n_boot: int = 2000, level: float = 0.95,
                   seed: int = 0):
    """Log-log order in ``dt`` of the path mean of ``|residual|`` ``[len(dts), P]``.

    Returns ``(order, (lo, hi))`` with a bootstrap interval over paths (a path keeps its
    residuals at every ``dt`` together).

    >>> dts = [0.1, 0.05, 0.025]
    >>> res = [[0.01, 0.02, 0.04], [0.0025, 0.005, 0.01], [0.000625, 0.00125, 0.0025]]
    >>> order, (lo, hi) = residual_order(dts, res, n_boot=50)
    >>> round(order, 6)
    2.0
    """
    dts = np.asarray(dts, dtype=float)
    r = np.abs(_np(residuals))
    if r.ndim != 2 or r.shape[0] != dts.size:
        raise ValueError(f"residuals: expected [len(dts), paths] = [{dts.size}, P], got "
                         f"shape {r.shape}")
    stat = lambda v: loglog_order(dts, v.mean(-1))  # noqa: E731
    return float(stat(r)), path_interval(stat, r, n_boot=n_boot, level=level, seed=seed)


# -------------------------------------------------------------------- stationarity
def stationary_law_weights(heads: int, d: int, generator: torch.Generator | None = None, *,
                           paths: int = 1, sigma2: float = 2.0,
                           dtype: torch.dtype | None = None, device="cpu") -> torch.Tensor:
    """``heads`` draws of the Ornstein–Uhlenbeck weights' stationary law, per path.

    ``dD = (I - D) dt + sigma dW`` with ``dW = sqrt(dt) (Z + Z^T)/2`` has the stationary
    law ``I + (sigma / sqrt 2) (Z + Z^T)/2`` (``I + (Z + Z^T)/2`` for the paper's
    ``sigma^2 = 2``). A head average over many draws stands for the limiting weight law
    of Theorem 4.16. Returns ``[paths, heads, d, d]``.

    >>> import torch
    >>> W = stationary_law_weights(4, 3, torch.Generator().manual_seed(0), paths=2)
    >>> W.shape, torch.equal(W, W.transpose(-1, -2))
    (torch.Size([2, 4, 3, 3]), True)

    References
    ----------
    Massucco et al., arXiv 2605.18870, Theorem 4.16 (numbered in the authors' README): the
    limiting weight law of the omega-limit statement.
    """
    heads = check_int("heads", heads, 1)
    d = check_int("d", d, 2)
    paths = check_int("paths", paths, 1)
    sigma2 = check_number("sigma2", sigma2, minimum=0.0)
    kw = factory(dtype, device)
    z = torch.randn(paths, heads, d, d, generator=generator, **kw)
    eye = torch.eye(d, **kw)
    return eye + math.sqrt(sigma2 / 2) * (z + z.transpose(-1, -2)) / 2


def tangential_share(tokens: torch.Tensor, weights: torch.Tensor, *,
                     head_chunk: int | None = None) -> torch.Tensor:
    """Share of the attention pull that is tangent to the sphere, per path.

    With ``F_i = (1/H) sum_h (1/Z_ih) (1/n) sum_j U^h_ij D_h x_j`` (the pull whose tangent
    part, with a minus sign, is the velocity), returns
    ``sqrt(sum_i |P_{x_i} F_i|^2 / sum_i |F_i|^2)``: 0 exactly at a stationary point of the
    energy for these weights, and of order 0.1 to 0.2 for a uniformly random cloud.

    Parameters
    ----------
    tokens : ``[P, n, d]`` unit vectors. weights : ``[P, H, d, d]`` symmetric.
    head_chunk : heads per dense block (memory ``P * head_chunk * n^2`` floats); None
        keeps a block near 2e7 floats.

    Returns
    -------
    ``[P]``. Complexity ``O(P H n^2 d)``.

    >>> import torch
    >>> from companion import gradient_flow as gf
    >>> g = torch.Generator().manual_seed(0)
    >>> x, D = gf.octahedral_tokens(8, 0.05, g, paths=3), gf.initial_weights(1, 3, g, paths=3)
    >>> s = tangential_share(x, D)
    >>> s.shape, bool(((s >= 0) & (s <= 1)).all())
    (torch.Size([3]), True)

    References
    ----------
    Massucco et al., arXiv 2605.18870, Theorem 4.16 (numbered in the authors' README):
    omega-limit points are stationary points of the energy.
    """
    check_tensor("tokens", tokens, ndim=3, floating=True, shape_text="[P, n, d]")
    check_tensor("weights", weights, ndim=4, floating=True, shape_text="[P, H, d, d]")
    if weights.shape[0] != tokens.shape[0] or weights.shape[-1] != tokens.shape[-1]:
        raise ValueError(f"weights: expected [P, H, d, d] with P, d of tokens "
                         f"{tuple(tokens.shape)}, got {tuple(weights.shape)}")
    P, n = tokens.shape[0], tokens.shape[1]
    head_chunk = (max(1, int(2e7 // (P * n * n))) if head_chunk is None
                  else check_int("head_chunk", head_chunk, 1))
    pull = torch.zeros_like(tokens)
    for start in range(0, weights.shape[1], head_chunk):
        D = weights[:, start:start + head_chunk]
        Dx = torch.einsum("phab,pjb->phja", D, tokens)  # D_h x_j
        logits = torch.einsum("pia,phja->phij", tokens, Dx)  # <x_i, D_h x_j>
        pull += torch.einsum("phij,phja->pia", torch.softmax(logits, -1), Dx)
    pull = pull / weights.shape[1]
    tangent = pull - (pull * tokens).sum(-1, keepdim=True) * tokens
    return (tangent.pow(2).sum((-1, -2)) / pull.pow(2).sum((-1, -2))).sqrt()


# ------------------------------------------------------------------ settling, clusters
def late_displacement(positions: torch.Tensor, times, fraction: float = 0.8) -> torch.Tensor:
    """``W_2(mu_{fraction T}, mu_T)`` per path (chordal cost, exact assignment).

    positions ``[R, P, n, d]`` at ``times [R]``; the record nearest ``fraction * T``.
    Returns ``[P]``.

    >>> import torch
    >>> from companion import gradient_flow as gf
    >>> g = torch.Generator().manual_seed(0)
    >>> x, D = gf.octahedral_tokens(8, 0.05, g, paths=3), gf.initial_weights(1, 3, g, paths=3)
    >>> tr = gf.simulate(x, D, gf.Frozen(), T=0.5, dt=0.01, record_every=10)
    >>> d = late_displacement(tr.positions, tr.times)
    >>> d.shape, bool((d >= 0).all())
    (torch.Size([3]), True)
    """
    check_tensor("positions", positions, ndim=4, floating=True, shape_text="[R, P, n, d]")
    t = _np(times)
    fraction = check_number("fraction", fraction, minimum=0.0, maximum=1.0)
    k = int(np.argmin(np.abs(t - fraction * t[-1])))
    return w2_sphere(positions[k], positions[-1], cost="chordal")


def clustered_share(tokens: torch.Tensor, min_inner: float = 0.999) -> torch.Tensor:
    """Share of tokens that sit in a cluster: with another token at inner product above
    ``min_inner`` (GLPR's clustering criterion, 0.999). 1 when every token is in a
    cluster (however many clusters), small for a spread cloud. tokens ``[..., n, d]`` ->
    ``[...]``.

    >>> import torch
    >>> clustered_share(torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]))
    tensor(0.6667)
    """
    check_tensor("tokens", tokens, min_ndim=2, floating=True, shape_text="[..., n, d]")
    n = tokens.shape[-2]
    if n < 2:
        raise ValueError(f"tokens: expected n >= 2 tokens, got shape {tuple(tokens.shape)}")
    min_inner = check_number("min_inner", min_inner, minimum=-1.0, maximum=1.0)
    gram = tokens @ tokens.transpose(-1, -2)
    eye = torch.eye(n, dtype=torch.bool, device=tokens.device)
    nearest = gram.masked_fill(eye, -2.0).amax(-1)
    return (nearest > min_inner).to(tokens.dtype).mean(-1)


# ------------------------------------------------------------------------- stability
def gronwall_ratio(w2: torch.Tensor, bound: torch.Tensor, times) -> np.ndarray:
    """Per path, the largest ``W_2 / bound`` over records ``t > 0`` where the bound is
    below the sphere's diameter 2 (elsewhere ``W_2 <= 2`` holds trivially).

    w2, bound ``[R, P]``; returns ``[P]`` (NaN for a path with no informative record).

    >>> import torch
    >>> w2 = torch.tensor([[0.0, 0.0], [0.1, 0.5]])
    >>> bound = torch.tensor([[0.0, 0.0], [0.2, 3.0]])  # 3 > 2: not informative
    >>> gronwall_ratio(w2, bound, [0.0, 1.0])
    array([0.5, nan], dtype=float32)
    """
    w2, bound = _np(w2), _np(bound)
    t = _np(times)
    if w2.shape != bound.shape or w2.ndim != 2 or w2.shape[0] != t.size:
        raise ValueError(f"bound: expected the shape of w2 [R, P] with R = {t.size}, got "
                         f"{bound.shape} and {w2.shape}")
    informative = (bound < DIAMETER) & (t[:, None] > 0)
    ratio = np.where(informative, w2 / np.where(informative, bound, 1.0), -np.inf)
    worst = ratio.max(0)
    return np.where(np.isfinite(worst), worst, np.nan)


def mobility_range(tokens: torch.Tensor, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """Range of the harmonic-mean mobility ``b_i = [(1/H) sum_h 1/Z_ih]^{-1}`` per path,
    and the bounds ``e^{-max_h lambda_h}``, ``e^{max_h lambda_h}`` it must lie in.

    ``Z_ih`` is a mean of ``exp(<x_i, D_h x_j>)`` with ``|<x_i, D_h x_j>| <= lambda_h``,
    so ``b`` lies between those bounds; a metric with a mobility in ``[b_min, b_max]`` is
    within the factors ``b_max^{1/2}`` and ``b_min^{1/2}`` of ``W_2`` (the equivalence of
    ``W_{m,2}`` with ``W_2``). tokens ``[P, n, d]``, weights ``[P, H, d, d]``; returns a
    dict of ``[P]`` tensors: ``min``, ``max``, ``lower``, ``upper``.

    >>> import torch
    >>> from companion import gradient_flow as gf
    >>> g = torch.Generator().manual_seed(0)
    >>> x, D = gf.octahedral_tokens(8, 0.05, g, paths=3), gf.initial_weights(1, 3, g, paths=3)
    >>> m = mobility_range(x, D)
    >>> bool(((m["lower"] <= m["min"]) & (m["max"] <= m["upper"])).all())
    True
    """
    Z = step_quantities(tokens, weights)["Z"]  # [P, n, H]
    b = 1 / (1 / Z).mean(-1)
    lam = torch.linalg.matrix_norm(weights, ord=2).amax(-1)
    return {"min": b.amin(-1), "max": b.amax(-1), "lower": torch.exp(-lam),
            "upper": torch.exp(lam)}


# --------------------------------------------------------------- slope against heads
def tail_mean_slope(trajectory, tail_from: float) -> torch.Tensor:
    """Time mean of ``G^2`` over the records ``t >= tail_from``, per path ``[P]``.

    >>> import torch
    >>> from companion import gradient_flow as gf
    >>> g = torch.Generator().manual_seed(0)
    >>> x, D = gf.octahedral_tokens(8, 0.05, g, paths=3), gf.initial_weights(1, 3, g, paths=3)
    >>> tr = gf.simulate(x, D, gf.Frozen(), T=0.5, dt=0.01, record_every=10)
    >>> tail_mean_slope(tr, 0.25).shape
    torch.Size([3])
    """
    tail_from = check_number("tail_from", tail_from, minimum=0.0)
    keep = trajectory.times >= tail_from
    if not bool(keep.any()):
        raise ValueError(f"tail_from: expected at most T = {float(trajectory.times[-1]):g}, "
                         f"got {tail_from:g}")
    return trajectory.slope_sq[keep].mean(0)


def slope_exponent(heads, tails, *, n_boot: int = 2000, level: float = 0.95, seed: int = 0):
    """Exponent ``b`` of ``a H^b`` fitted (least squares in log-log) to the path-mean tail
    slope ``tails [len(heads), P]``, with its :func:`path_interval` (the ``P`` paths of
    each ``H`` are independent runs; a replicate resamples the paths of every ``H``).

    Returns ``(b, (lo, hi), a)``.

    >>> tails = [[1.0, 1.1, 0.9], [0.5, 0.55, 0.45], [0.25, 0.27, 0.23]]
    >>> b, (lo, hi), a = slope_exponent([1, 2, 4], tails, n_boot=50)
    >>> round(b, 6), round(a, 6)
    (-1.0, 1.0)

    References
    ----------
    Massucco et al., arXiv 2605.18870, Theorem 4.16 and Section 6 (numbered in the authors'
    README): ``G^2`` decays as ``O(1/H)``, fitted exponent ``b`` near -1 in the OU regime.
    """
    H = np.asarray(list(heads), dtype=float)
    t = _np(tails)
    if t.ndim != 2 or t.shape[0] != H.size:
        raise ValueError(f"tails: expected [len(heads), paths] = [{H.size}, P], got "
                         f"shape {t.shape}")
    stat = lambda v: loglog_order(H, v.mean(-1))  # noqa: E731
    b = float(stat(t))
    a = float(np.exp(np.mean(np.log(t.mean(-1)) - b * np.log(H))))
    return b, path_interval(stat, t, n_boot=n_boot, level=level, seed=seed), a


def worst_over_paths(values, *, n_boot: int = 2000, level: float = 0.95, seed: int = 0):
    """The largest of per-path ``values [P]`` (NaN paths left out) with the percentile
    bootstrap interval of that maximum over paths. Returns ``(max, (lo, hi))``.

    >>> worst_over_paths([0.1, 0.3, float("nan"), 0.2], n_boot=50)
    (0.3, (0.1, 0.3))
    """
    v = _np(values)
    v = v[np.isfinite(v)]
    if v.size < 2:
        raise ValueError(f"values: expected at least 2 finite per-path values, got {v.size}")
    return float(v.max()), path_interval(lambda a: a.max(), v, n_boot=n_boot, level=level,
                                         seed=seed)
