"""Simulating the coupled token/weight dynamics: initial conditions, weight processes and
the Euler scheme of :func:`simulate`.

Tokens move by the projected explicit Euler step of the multi-head model (the fast kernel
of :mod:`companion.gradient_flow.kernels`); the weights follow an SDE
:math:`dD_h = f_h(D_h, t)\\,dt + \\sigma\\,dW_h` with symmetric noise
:math:`dW = \\sqrt{dt}\\,(Z + Z^\\top)/2`, one of :class:`OrnsteinUhlenbeck`,
:class:`Oscillating` or :class:`Frozen`.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import math
import signal
import threading
from dataclasses import dataclass, field

import torch

from companion._validate import check_int, check_number, check_tensor
from companion.gradient_flow._checks import (check_positive, check_sign, check_tokens,
                                             check_weights, factory)
from companion.gradient_flow.kernels import KernelTuning, _path_workers, _Scratch, _step

__all__ = [
    "Frozen",
    "OrnsteinUhlenbeck",
    "Oscillating",
    "Trajectory",
    "initial_weights",
    "octahedral_tokens",
    "oscillating_target",
    "simulate",
    "simulate_many",
    "start_workers",
    "uniform_sphere",
]


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

    Examples
    --------
    >>> octahedral_tokens(6, noise=0.0).abs().sum(0).tolist()  # one vertex per token
    [2.0, 2.0, 2.0]
    """
    n = check_int("n", n, 1)
    noise = check_number("noise", noise, minimum=0.0)
    batch = () if paths is None else (check_int("paths", paths, 1),)
    kw = factory(dtype, device)
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

    Examples
    --------
    >>> x = uniform_sphere(5, 3, torch.Generator().manual_seed(0))
    >>> x.shape, bool(torch.allclose(x.norm(dim=-1), torch.ones(5, dtype=x.dtype)))
    (torch.Size([5, 3]), True)
    """
    n = check_int("n", n, 1)
    d = check_int("d", d, 2)
    batch = () if paths is None else (check_int("paths", paths, 1),)
    x = torch.randn(*batch, n, d, generator=generator, **factory(dtype, device))
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

    References
    ----------
    .. [1] A. Massucco, D. Del Grande, M. Carioni, C. Brune, C.-B. Schönlieb, "Multi-
       Headed Transformer Architectures as Time-dependent Wasserstein Gradient Flows",
       arXiv:2605.18870, Section 6: the experiments' initial weights (numbered per the
       authors' code README).

    Examples
    --------
    >>> D = initial_weights(2, 3, torch.Generator().manual_seed(0))
    >>> D.shape, torch.equal(D, D.transpose(-1, -2))  # [paths, heads, d, d], symmetric
    (torch.Size([1, 2, 3, 3]), True)
    """
    heads = check_int("heads", heads, 1)
    d = check_int("d", d, 2)
    paths = check_int("paths", paths, 1)
    z = torch.randn(paths, heads, d, d, generator=generator, **factory(dtype, device))
    return z + z.transpose(-1, -2)


# -------------------------------------------------------------------- weight processes
def oscillating_target(t: torch.Tensor, d: int) -> torch.Tensor:
    """The paper's non-integrable target ``F(t)`` (d = 2 or 3), batched over ``t``.

    d = 3: ``[[2+1.5 cos t, sin 2t, sin t], [sin 2t, 2+1.5 sin t, cos 2t],
    [sin t, cos 2t, 2+1.5 cos(t+pi/4)]]``; d = 2: ``[[2+1.5 cos t, sin 2t],
    [sin 2t, 2-1.5 cos t]]``. Returns ``t.shape + (d, d)``.

    References
    ----------
    .. [1] A. Massucco, D. Del Grande, M. Carioni, C. Brune, C.-B. Schönlieb, "Multi-
       Headed Transformer Architectures as Time-dependent Wasserstein Gradient Flows",
       arXiv:2605.18870, Section 6: the oscillating (non-integrable) regime (numbered
       per the authors' code README).

    Examples
    --------
    >>> oscillating_target(torch.tensor([0.0]), 2)
    tensor([[[3.5000, 0.0000],
             [0.0000, 0.5000]]])
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

    References
    ----------
    .. [1] A. Massucco, D. Del Grande, M. Carioni, C. Brune, C.-B. Schönlieb, "Multi-
       Headed Transformer Architectures as Time-dependent Wasserstein Gradient Flows",
       arXiv:2605.18870, Section 6: the Ornstein-Uhlenbeck (integrable) regime (numbered
       per the authors' code README).

    Examples
    --------
    >>> OrnsteinUhlenbeck()
    OrnsteinUhlenbeck(sigma2=2.0)
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

    References
    ----------
    .. [1] A. Massucco, D. Del Grande, M. Carioni, C. Brune, C.-B. Schönlieb, "Multi-
       Headed Transformer Architectures as Time-dependent Wasserstein Gradient Flows",
       arXiv:2605.18870, Section 6: the oscillating (non-integrable) regime (numbered
       per the authors' code README).

    Examples
    --------
    >>> Oscillating()
    Oscillating(phases='identical', sigma=0.0)
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
    """Weights held fixed: ``dD = 0``.

    Examples
    --------
    >>> x = uniform_sphere(4, 3, torch.Generator().manual_seed(0), paths=1)
    >>> D = initial_weights(2, 3, torch.Generator().manual_seed(1))
    >>> torch.equal(simulate(x, D, Frozen(), T=0.1, dt=0.05).final_weights, D)
    True
    """

    sigma: float = field(default=0.0, init=False)

    def drift(self, weights: torch.Tensor, t: float) -> None:
        return None


_PROCESSES = (OrnsteinUhlenbeck, Oscillating, Frozen)

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

    Examples
    --------
    >>> x = uniform_sphere(4, 3, torch.Generator().manual_seed(0), paths=1)
    >>> D = initial_weights(2, 3, torch.Generator().manual_seed(1))
    >>> simulate(x, D, Frozen(), T=0.1, dt=0.05).energy.shape  # [records, paths]
    torch.Size([3, 1])
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
    tuning: KernelTuning | None = None,
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
    tuning : :class:`KernelTuning` of the step kernel, or None (the defaults).

    Returns
    -------
    :class:`Trajectory`.

    Complexity: ``round(T/dt)`` steps of ``O(P H n^2 d)`` time each; memory
    ``O(P H n d)`` per step (scratch tensors reused by every step) plus the records. On CPU
    the steps run with the torch threads spent on independent paths, as in
    :func:`step_quantities`.

    References
    ----------
    .. [1] A. Massucco, D. Del Grande, M. Carioni, C. Brune, C.-B. Schönlieb, "Multi-
       Headed Transformer Architectures as Time-dependent Wasserstein Gradient Flows",
       arXiv:2605.18870, Eq. (5): the simulated system; Eq. (81): the energy-dissipation
       identity whose terms are recorded (numbered per the authors' code README).

    Examples
    --------
    >>> x = uniform_sphere(4, 3, torch.Generator().manual_seed(0), paths=1)
    >>> D = initial_weights(2, 3, torch.Generator().manual_seed(1))
    >>> trajectory = simulate(x, D, Frozen(), T=0.1, dt=0.05)
    >>> trajectory.times.tolist(), tuple(trajectory.positions.shape)  # [records, paths, n, d]
    ([0.0, 0.05, 0.1], (3, 1, 4, 3))
    """
    tokens = check_tokens(tokens)
    weights = check_weights(weights, tokens)
    if tuning is None:
        tuning = KernelTuning()
    elif not isinstance(tuning, KernelTuning):
        raise TypeError(f"tuning: expected a KernelTuning or None, got {type(tuning).__name__}")
    if not isinstance(process, _PROCESSES):
        raise TypeError(
            "process: expected OrnsteinUhlenbeck, Oscillating or Frozen, "
            f"got {type(process).__name__}"
        )
    T = check_positive("T", T)
    dt = check_positive("dt", dt)
    record_every = check_int("record_every", record_every, 1)
    sign = check_sign(sign)
    if isinstance(process, Oscillating) and tokens.shape[-1] not in (2, 3):
        raise ValueError(
            f"process: Oscillating is defined for d in (2, 3), got d = {tokens.shape[-1]}"
        )
    return _integrate(tokens, weights, process, T=T, dt=dt, record_every=record_every,
                      sign=sign, generator=generator, record_positions=record_positions,
                      record_weights=record_weights, progress=progress, tuning=tuning)


def _integrate(tokens, weights, process, *, T, dt, record_every, sign, generator,
               record_positions, record_weights, progress, tuning,
               noise_rows: tuple[int, int, int] | None = None, stop=None) -> Trajectory:
    """:func:`simulate` on checked arguments.

    ``noise_rows = (start, stop, total)``: these tokens and weights are the paths
    ``start:stop`` of a run of ``total`` paths; each step draws the noise of all ``total``
    paths (the same draws as the whole run) and uses its rows ``start:stop``, so that the
    paths come out as they do in the whole run (:func:`simulate_many`).
    ``stop``: None, or an event (``is_set()``) checked at every step; once set, the run
    raises :class:`_Stopped` (a worker of :func:`simulate_many` told to stop).
    """
    steps = max(1, round(T / dt))
    sigma = float(process.sigma)
    P, _n, d = tokens.shape
    rows = slice(0, P) if noise_rows is None else slice(noise_rows[0], noise_rows[1])
    drawn = P if noise_rows is None else noise_rows[2]
    H = weights.shape[1]
    x, D = tokens.clone(), weights.clone()
    kw = {"dtype": x.dtype, "device": x.device}
    # Running left-point integrals over the steps so far, named as the Trajectory fields:
    # int G^2 dt, int D dt (the dissipation), int dE/dt dt, and the martingale M_t.
    integrals = {k: torch.zeros(P, **kw) for k in ("int_slope_sq", "int_dissipation",
                                                    "int_energy_rate", "martingale")}
    instantaneous = ("energy", "energy_rate", "slope_sq", "dissipation")
    rec = {k: [] for k in (*instantaneous, *integrals)}
    times, pos, wts = [], [], []
    record_at = set(range(0, steps + 1, record_every)) | {steps}
    scratch = _Scratch()
    iterator = range(steps + 1)
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(iterator, desc=f"simulate H={H}", leave=False)
    with _path_workers(x.device) as workers:
        for k in iterator:
            if stop is not None and stop.is_set():
                raise _Stopped(f"stopped at step {k} of {steps}")
            t = k * dt
            last = k == steps
            drift = process.drift(D, t)
            noise = None
            if not last and sigma > 0:
                z = torch.randn(drawn, H, d, d, generator=generator, **kw)[rows]
                noise = math.sqrt(dt) * (z + z.transpose(-1, -2)) / 2
            q = _step(x, D, sign, drift, sigma, noise, scratch, workers, tuning)
            if k in record_at:
                times.append(t)
                for key in instantaneous:
                    rec[key].append(q[key].clone())
                for key, integral in integrals.items():
                    rec[key].append(integral.clone())
                if record_positions:
                    pos.append(x.clone())
                if record_weights:
                    wts.append(D.clone())
            if last:
                break
            integrals["int_slope_sq"] += q["slope_sq"] * dt
            integrals["int_dissipation"] += q["dissipation"] * dt
            integrals["int_energy_rate"] += q["energy_rate"] * dt
            integrals["martingale"] += q["martingale_increment"]
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



# ------------------------------------------------------------- several runs at once
_RUN_KEYS = ("tokens", "weights", "process", "T", "dt", "record_every", "sign",
             "generator", "record_positions", "record_weights", "tuning")


def simulate_many(runs, *, workers: int | None = None) -> list[Trajectory]:
    """Several independent :func:`simulate` runs, shared among worker processes.

    Every run is cut into ``workers`` pieces of consecutive paths, and the pieces of all
    runs are handed, largest first, to ``workers`` processes with one torch thread each.
    A piece draws the weight noise of all its run's paths at every step and keeps its own
    rows, so each path sees the draws of the whole run; as a step treats every path on its
    own, the trajectories are those of ``[simulate(**run) for run in runs]`` bit for bit
    (unless a step of some piece needs the max-shifted exponentials and its run's other
    pieces do not: then equal to rounding). Each run's ``generator`` ends in the state the
    serial run leaves it in.

    Parameters
    ----------
    runs : sequence of dicts, each the keyword arguments of :func:`simulate`
        (``tokens``, ``weights``, ``process``, ``T``, ``dt`` and any of
        ``record_every``, ``sign``, ``generator``, ``record_positions``,
        ``record_weights``, ``tuning``).
    workers : int >= 1 or None (the number of torch threads). With 1 worker, or tokens
        off the CPU, the runs are simulated here one after the other.

    Returns
    -------
    list of :class:`Trajectory`, one per run, in order. Time: about the runs' total
    ``P H n^2 steps`` shared by the workers, plus starting them (seconds) on the first
    call with this number of workers; the processes are kept for later calls.

    >>> g = torch.Generator().manual_seed(0)
    >>> run = dict(tokens=uniform_sphere(6, 3, g, paths=2), weights=initial_weights(2, 3, g,
    ...            paths=2), process=Frozen(), T=0.1, dt=0.05)
    >>> [t.energy.shape for t in simulate_many([run, run], workers=1)]
    [torch.Size([3, 2]), torch.Size([3, 2])]
    """
    runs = list(runs)
    for i, run in enumerate(runs):
        if not isinstance(run, dict):
            raise TypeError(f"runs[{i}]: expected a dict of simulate's arguments, got "
                            f"{type(run).__name__}")
        unknown = set(run) - set(_RUN_KEYS)
        if unknown:
            raise ValueError(f"runs[{i}]: unknown simulate arguments {sorted(unknown)}")
    workers = torch.get_num_threads() if workers is None else check_int("workers", workers, 1)
    if workers == 1 or not runs:
        return [simulate(**run) for run in runs]
    checked = [_checked_run(i, run) for i, run in enumerate(runs)]
    if any(run["tokens"].device.type != "cpu" for run in checked):
        return [simulate(**run) for run in runs]
    pieces = []  # (cost, run index, start, stop)
    for r, run in enumerate(checked):
        P, n, _ = run["tokens"].shape
        H = run["weights"].shape[1]
        steps = max(1, round(run["T"] / run["dt"]))
        cuts = max(1, min(workers, P))  # more workers than paths: a piece per path
        bounds = [round(k * P / cuts) for k in range(cuts + 1)]
        for a, b in zip(bounds, bounds[1:]):
            pieces.append(((b - a) * H * n * n * steps, r, a, b))
    pieces.sort(key=lambda piece: -piece[0])
    from concurrent.futures.process import BrokenProcessPool

    for attempt in (0, 1):  # a pool broken by a dead worker: once more on a fresh one
        try:
            pool = _healthy_pool(workers)
            with _interrupts_held():  # processes spawned here start with SIGINT blocked
                futures = [pool.executor.submit(_simulate_piece, checked[r], a, b)
                           for _, r, a, b in pieces]
            results = [future.result() for future in futures]
            break
        except BrokenProcessPool:  # the pieces are deterministic: the same results
            stop_workers()
            if attempt:
                raise
        except BaseException:  # an error or an interrupt: no piece is left running
            stop_workers()
            raise
    done = {(r, a): result for (_, r, a, _), result in zip(pieces, results)}
    out = []
    for r in range(len(checked)):
        parts = sorted((a, part) for (rr, a), part in done.items() if rr == r)
        trajectories = [part[0] for _, part in parts]
        generator = runs[r].get("generator")
        if generator is not None:  # as the serial run leaves it (every piece drew the same)
            generator.set_state(parts[0][1][1])
        out.append(_concatenate_paths(trajectories))
    return out


class _Stopped(RuntimeError):
    """A piece of :func:`simulate_many` ended early: its pool is being stopped."""


@dataclass
class _WorkerPool:
    """The kept worker processes of :func:`simulate_many` and the event that tells their
    running pieces to end (checked every step, so that a healthy pool's workers are never
    killed, least of all while they send a result; only a pool with a dead worker has its
    other workers terminated, see :func:`_wait_for_exits`)."""

    workers: int
    executor: object
    stop: object


_KEPT_POOLS: list[_WorkerPool] = []  # at most one: simulate_many's worker processes
_worker_stop = None  # in a worker process: its pool's stop event


def _initialize_worker(stop):
    """A worker of :func:`simulate_many`: one torch thread, and interrupts left to the
    caller (a notebook's kernel is interrupted with its whole process group; the caller
    then stops the workers itself). It was spawned with SIGINT blocked, so an interrupt
    while it started is dropped here."""
    global _worker_stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _worker_stop = stop
    torch.set_num_threads(1)


@contextlib.contextmanager
def _interrupts_held():
    """SIGINT blocked in this thread while inside (processes it spawns inherit the mask,
    so an interrupt while they import torch cannot kill them); an interrupt that arrived
    meanwhile is raised on leaving."""
    if (not hasattr(signal, "pthread_sigmask")
            or threading.current_thread() is not threading.main_thread()):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _is_broken(executor) -> bool:
    """Whether a ProcessPoolExecutor can take no more work: shut down, marked broken, or
    one of its processes has exited. The executor marks itself broken only once its
    manager thread has noticed the death, which on a busy machine can be after the next
    call has handed its pieces to the surviving workers, so the processes are asked too."""
    if getattr(executor, "_broken", False) or getattr(executor, "_shutdown_thread", False):
        return True
    return any(not process.is_alive() for process in _processes(executor))


def _processes(executor) -> list:
    """The worker processes of a ProcessPoolExecutor (none once it is shut down)."""
    return list((getattr(executor, "_processes", None) or {}).values())


def _healthy_pool(workers: int) -> _WorkerPool:
    """The kept pool of ``workers`` processes (spawned, one torch thread each), made now if
    there is none, if it has another number of workers (that one is stopped) or if it is
    broken (a worker died, e.g. interrupted while it started)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    if _KEPT_POOLS and (_KEPT_POOLS[0].workers != workers
                        or _is_broken(_KEPT_POOLS[0].executor)):
        stop_workers()
    if not _KEPT_POOLS:
        context = multiprocessing.get_context("spawn")
        stop = context.Event()
        executor = ProcessPoolExecutor(max_workers=workers, mp_context=context,
                                       initializer=_initialize_worker, initargs=(stop,))
        _KEPT_POOLS.append(_WorkerPool(workers, executor, stop))
    return _KEPT_POOLS[0]


def stop_workers() -> None:
    """Stop the worker processes of :func:`simulate_many` (a later call starts new ones).

    Running pieces end at their next step and queued ones are cancelled; this returns once
    the processes have exited (a worker still starting finishes its start first). If one
    of them died abnormally (killed), the others are terminated instead: they could wait
    for it for ever (see :func:`_wait_for_exits`). Called at interpreter exit; nothing
    happens when no workers are running.

    >>> stop_workers()
    >>> worker_pids()
    []
    """
    if not _KEPT_POOLS:
        return
    pool = _KEPT_POOLS.pop()
    pool.stop.set()
    executor = pool.executor
    processes = _processes(executor)
    manager = getattr(executor, "_executor_manager_thread", None)
    results = getattr(executor, "_result_queue", None)
    # shutdown(wait=True) would wait on the processes with no way out if a survivor waits
    # for a lock a killed worker held; they are waited for here, then its manager thread
    executor.shutdown(wait=False, cancel_futures=True)
    try:
        one_died = _wait_for_exits(processes)
    except BaseException:  # interrupted while waiting: no process may outlive its pool
        for process in processes:
            if process.is_alive():
                process.terminate()
        raise
    writer = getattr(results, "_writer", None)
    if writer is not None and one_died:
        # a worker terminated while it sent a result leaves the manager thread reading a
        # half-sent message; closing our end of the pipe lets it read the end of it
        writer.close()
    if manager is not None:
        manager.join()
    if results is not None:
        results.close()


def _wait_for_exits(processes) -> bool:
    """Wait until every worker process has exited; return whether one exited abnormally.

    Each is waited for (an event, no time limit) until one has exited abnormally (a
    non-zero exit code: killed, or crashed): an idle worker waits for work holding the
    call queue's lock, and one killed then never releases it, so the others would wait
    for it for ever; they are terminated then, as their pool is broken (its pieces are
    run again by :func:`simulate_many`, or were being stopped anyway)."""
    from multiprocessing.connection import wait

    alive, one_died = list(processes), False
    while alive:
        wait([process.sentinel for process in alive])
        alive = [process for process in alive if process.is_alive()]
        if not one_died and any(p.exitcode not in (0, None) for p in processes):
            one_died = True
            for process in alive:
                process.terminate()
    return one_died


atexit.register(stop_workers)


def worker_pids() -> list[int]:
    """The process ids of :func:`simulate_many`'s kept worker processes, sorted (empty when
    none are running).

    >>> start_workers(1)
    1
    >>> worker_pids()
    []
    """
    if not _KEPT_POOLS:
        return []
    return sorted(process.pid for process in _processes(_KEPT_POOLS[0].executor))


def start_workers(workers: int | None = None) -> int:
    """Start the worker processes of :func:`simulate_many` now, without waiting for them.

    They start in the background (an interpreter and ``import torch`` each, seconds), so
    that a later :func:`simulate_many` with as many workers finds them ready; a chapter
    calls this in its set-up. An interrupt meanwhile does not kill them. Workers kept for
    another number are stopped (one pool at a time); with 1 worker nothing is started.

    Parameters
    ----------
    workers : int >= 1 or None (the number of torch threads, as :func:`simulate_many`).

    Returns
    -------
    The number of workers.

    >>> start_workers(1)
    1
    """
    workers = torch.get_num_threads() if workers is None else check_int("workers", workers, 1)
    if workers > 1:
        from concurrent.futures.process import BrokenProcessPool

        for attempt in (0, 1):
            try:
                pool = _healthy_pool(workers)
                with _interrupts_held():  # one task each: a process spawned per task
                    for _ in range(workers):
                        pool.executor.submit(int)
                break
            except BrokenProcessPool:
                stop_workers()
                if attempt:
                    raise
    return workers


def _checked_run(i, run):
    """simulate's checks on one run of :func:`simulate_many`, defaults filled in."""
    full = {"record_every": 1, "sign": -1, "generator": None, "record_positions": True,
            "record_weights": False, "tuning": None, **run}
    missing = {"tokens", "weights", "process", "T", "dt"} - set(full)
    if missing:
        raise ValueError(f"runs[{i}]: missing simulate arguments {sorted(missing)}")
    full["tokens"] = check_tokens(full["tokens"])
    full["weights"] = check_weights(full["weights"], full["tokens"])
    full["T"] = check_positive("T", full["T"])
    full["dt"] = check_positive("dt", full["dt"])
    full["record_every"] = check_int("record_every", full["record_every"], 1)
    full["sign"] = check_sign(full["sign"])
    if not isinstance(full["process"], _PROCESSES):
        raise TypeError(f"runs[{i}]: process: expected OrnsteinUhlenbeck, Oscillating or "
                        f"Frozen, got {type(full['process']).__name__}")
    if full["tuning"] is None:
        full["tuning"] = KernelTuning()
    return full


def _simulate_piece(run, start, stop):
    """Worker: paths ``start:stop`` of one run; returns the trajectory and the state its
    generator ends in."""
    generator = run["generator"]
    total = run["tokens"].shape[0]
    traj = _integrate(run["tokens"][start:stop].clone(), run["weights"][start:stop].clone(),
                      run["process"], T=run["T"], dt=run["dt"],
                      record_every=run["record_every"], sign=run["sign"],
                      generator=generator, record_positions=run["record_positions"],
                      record_weights=run["record_weights"], progress=False,
                      tuning=dataclasses.replace(run["tuning"], plan_paths=total),
                      noise_rows=(start, stop, total), stop=_worker_stop)
    return traj, (None if generator is None else generator.get_state())


def _concatenate_paths(parts: list[Trajectory]) -> Trajectory:
    """One Trajectory from pieces of consecutive paths (record axis first, then paths)."""
    first = parts[0]
    fields = {}
    for name in Trajectory.__dataclass_fields__:
        value = getattr(first, name)
        if name in ("times", "dt", "sign") or value is None:
            fields[name] = value
        elif name in ("final_tokens", "final_weights"):
            fields[name] = torch.cat([getattr(p, name) for p in parts], 0)
        else:
            fields[name] = torch.cat([getattr(p, name) for p in parts], 1)
    return Trajectory(**fields)
