"""Tests for companion.gradient_flow against independent float64 references."""
from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pytest
import torch

from companion import gradient_flow as gf

# Small problems: a second intra-op thread only adds contention on a shared machine.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


# The paper's equations as float64 loops over paths, heads, i, j (moved into the library).
reference_step = gf.reference_step_loops


@pytest.mark.parametrize("sign", [-1, 1])
def test_one_step_matches_handwritten_reference(sign):
    g = torch.Generator().manual_seed(1)
    P, H, n, d, dt = 2, 3, 5, 3, 0.05
    x = gf.uniform_sphere(n, d, g, paths=P)
    D = gf.initial_weights(H, d, g, paths=P)
    proc = gf.OrnsteinUhlenbeck(sigma2=2.0)
    f = proc.drift(D, 0.0)
    z = torch.randn(P, H, d, d, generator=g, dtype=torch.float64)
    dW = math.sqrt(dt) * (z + z.transpose(-1, -2)) / 2
    q = gf.step_quantities(x, D, sign=sign, drift=f, sigma=proc.sigma, noise=dW)
    ref, x_ref = reference_step(x.numpy(), D.numpy(), f.numpy(), proc.sigma, dW.numpy(), dt, sign)
    np.testing.assert_allclose(q["energy"].numpy(), ref["energy"], rtol=1e-12)
    np.testing.assert_allclose(q["energy_rate"].numpy(), ref["energy_rate"], rtol=1e-11,
                               atol=1e-13)
    np.testing.assert_allclose(q["slope_sq"].numpy(), ref["slope_sq"], rtol=1e-11)
    np.testing.assert_allclose(q["dissipation"].numpy(), ref["dissipation"], rtol=1e-11,
                               atol=1e-13)
    np.testing.assert_allclose(q["martingale_increment"].numpy(), ref["martingale_increment"],
                               rtol=1e-11, atol=1e-13)
    # One step of simulate is the projected Euler step of the reference.
    traj = gf.simulate(x, D, gf.Frozen(), T=dt, dt=dt, sign=sign)
    np.testing.assert_allclose(traj.positions[-1].numpy(), x_ref, rtol=0, atol=1e-13)
    np.testing.assert_allclose(gf.velocity(x, D, sign=sign).numpy(), ref["velocity"],
                               atol=1e-13)


# ------------------------------------------------------------------ both dtypes
def paper_target(t):
    """The oscillating target F(t) for d = 3, entry by entry as the paper prints it."""
    c, s = math.cos, math.sin
    return np.array([[2 + 1.5 * c(t), s(2 * t), s(t)],
                     [s(2 * t), 2 + 1.5 * s(t), c(2 * t)],
                     [s(t), c(2 * t), 2 + 1.5 * c(t + math.pi / 4)]])


def reference_drift(regime, D, t):
    """f_h(D_h, t): OU ``I - D``, oscillating (identical phases) ``F(t) - D``."""
    target = np.eye(D.shape[-1]) if regime == "ou" else paper_target(t)
    return target - D


REGIMES = {"ou": gf.OrnsteinUhlenbeck(sigma2=2.0), "oscillating": gf.Oscillating("identical")}
# Relative to the largest reference value of each quantity. Measured worst on this CPU:
# float64 6e-16 for one step and 1.3e-15 after four; float32 2.5e-7 and 6e-7 (a few
# ulps). The bounds leave a factor of about 8 over float32 rounding, so a kernel that
# loses precision in one dtype (a half-precision intermediate, unshifted exponentials)
# or mixes dtypes fails.
DTYPE_RTOL = {torch.float64: 1e-12, torch.float32: 5e-6}


def assert_close_scaled(actual, reference, rtol, scale=None, what=""):
    """``max |actual - reference| <= rtol * scale`` (default scale: ``max |reference|``)."""
    actual = actual.detach().to(torch.float64).numpy()
    reference = np.asarray(reference, dtype=np.float64)
    assert actual.shape == reference.shape, what
    scale = max(np.abs(reference).max(), 1e-300) if scale is None else scale
    err = np.abs(actual - reference).max()
    assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol:.1g} * {scale:.3g}"


def state_in(dtype, n, H, seed=11, P=2, d=3):
    """Tokens and weights rounded to ``dtype``; the reference reads the rounded values in
    float64, so a difference is the kernel's, not the rounding of its inputs."""
    g = torch.Generator().manual_seed(seed)
    x = gf.uniform_sphere(n, d, g, paths=P).to(dtype)
    x = x / x.norm(dim=-1, keepdim=True)
    D = gf.initial_weights(H, d, g, paths=P).to(dtype)
    return x, D


KERNEL_PATHS = ("whole", "blocks", "shifted", "reference")


def use_kernel_path(path, n, H):
    """One evaluation of step_quantities (or the library's plain reference).

    whole: every U^h in one block (the default at small sizes); blocks: symmetric blocks
    of 2 query rows (ragged last block for odd n); shifted: the max-shifted general path
    in row chunks of 13 logits; reference: gf.reference_step_quantities. Returns the
    function to call, with the KernelTuning that selects the path.
    """
    if path == "reference":
        return gf.reference_step_quantities
    tuning = {"whole": gf.KernelTuning(),
              "blocks": gf.KernelTuning(block_elements=2 * n * H),
              "shifted": gf.KernelTuning(exp_shift="always", shifted_chunk_elements=13)}[path]
    return functools.partial(gf.step_quantities, tuning=tuning)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("n, H", [(1, 1), (7, 1), (7, 3), (11, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_step_quantities_in_both_dtypes_match_float64_reference(dtype, n, H, regime, path):
    step = use_kernel_path(path, n, H)
    x, D = state_in(dtype, n, H)
    P, _, d = x.shape
    dt, t, sign = 0.05, 0.7, -1
    process = REGIMES[regime]
    f = process.drift(D, t)
    z = torch.randn(P, H, d, d, generator=torch.Generator().manual_seed(3), dtype=dtype)
    dW = math.sqrt(dt) * (z + z.transpose(-1, -2)) / 2 if process.sigma > 0 else None
    q = step(x, D, sign=sign, drift=f, sigma=process.sigma, noise=dW)
    assert all(v.dtype == dtype for v in q.values())

    x64, D64 = x.double().numpy(), D.double().numpy()
    dW64 = np.zeros((P, H, d, d)) if dW is None else dW.double().numpy()
    f64 = reference_drift(regime, D64, t)
    ref, _ = reference_step(x64, D64, f64, process.sigma, dW64, dt, sign)
    rtol = DTYPE_RTOL[dtype]
    for key in ("energy", "energy_rate", "slope_sq", "dissipation", "velocity"):
        assert_close_scaled(q[key], ref[key], rtol, what=key)
    if dW is None:
        assert torch.all(q["martingale_increment"] == 0)
    else:
        assert_close_scaled(q["martingale_increment"], ref["martingale_increment"], rtol,
                            what="martingale_increment")


QUANTITIES = ("velocity", "energy", "energy_rate", "slope_sq", "dissipation",
              "martingale_increment", "Z")


@pytest.mark.parametrize("path", ["whole", "blocks", "shifted"])
@pytest.mark.parametrize("P, n, H, d", [(1, 1, 1, 3), (3, 29, 1, 3), (2, 41, 9, 3),
                                        (2, 23, 5, 2), (1, 17, 3, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_fast_step_matches_the_plain_reference_step(dtype, P, n, H, d, path):
    """The kernel and the library's plain reference (dense [P, H, n, n] tensors, the
    paper's equations as printed) agree to the dtype's rounding, quantity by quantity,
    at odd sizes, one head, and d = 2, 3, 4, with drift and noise."""
    step = use_kernel_path(path, n, H)
    g = torch.Generator().manual_seed(n + H)
    x = gf.uniform_sphere(n, d, g, paths=P).to(dtype)
    x = x / x.norm(dim=-1, keepdim=True)
    D = gf.initial_weights(H, d, g, paths=P).to(dtype)
    z = torch.randn(P, H, d, d, generator=g).to(dtype)
    dW = 0.1 * (z + z.transpose(-1, -2))
    kw = dict(sign=1, drift=gf.OrnsteinUhlenbeck().drift(D, 0.0), sigma=1.3, noise=dW)
    fast = step(x, D, **kw)
    ref = gf.reference_step_quantities(x.double(), D.double(),
                                       **{**kw, "drift": kw["drift"].double(),
                                          "noise": dW.double()})
    for key in QUANTITIES:
        assert fast[key].shape == ref[key].shape, key
        assert_close_scaled(fast[key], ref[key].numpy(), DTYPE_RTOL[dtype], what=key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_large_weights_take_the_shifted_path(dtype, monkeypatch):
    """|D| = 100 makes exp(<x, D x>) overflow float32's safe range (not float64's): the
    float32 step switches to the max-shifted path by itself and stays exact to rounding."""
    calls = []
    import companion.gradient_flow.kernels as kernels

    orig = kernels._shifted_exp_moments  # a spy: counts the calls, changes nothing
    monkeypatch.setattr(kernels, "_shifted_exp_moments",
                        lambda *a: calls.append(1) or orig(*a))
    g = torch.Generator().manual_seed(5)
    x = gf.uniform_sphere(9, 3, g, paths=2)
    D = gf.initial_weights(2, 3, g, paths=2)
    D = 100 * D / torch.linalg.matrix_norm(D, ord=2, keepdim=True)
    fast = gf.step_quantities(x.to(dtype), D.to(dtype))
    ref = gf.reference_step_quantities(x.to(dtype).double(), D.to(dtype).double())
    assert len(calls) == (1 if dtype == torch.float32 else 0)
    for key in ("velocity", "energy", "slope_sq", "dissipation", "Z"):
        assert torch.isfinite(fast[key]).all(), key
        assert_close_scaled(fast[key], ref[key].numpy(), DTYPE_RTOL[dtype], what=key)


def test_velocity_and_simulate_read_the_same_step_bit_for_bit():
    """velocity() is step_quantities' velocity, and simulate's first record and first
    Euler step are step_quantities' numbers: identical bits, not just close."""
    g = torch.Generator().manual_seed(8)
    x = gf.octahedral_tokens(31, paths=2, generator=g)
    D = gf.initial_weights(5, 3, g, paths=2)
    q = gf.step_quantities(x, D)  # Frozen: no drift, no noise
    assert torch.equal(gf.velocity(x, D), q["velocity"])
    dt = 0.01
    traj = gf.simulate(x, D, gf.Frozen(), T=dt, dt=dt)
    for key in ("energy", "slope_sq", "dissipation"):
        assert torch.equal(traj.__dict__[key][0], q[key]), key
    y = x + dt * q["velocity"]
    assert torch.equal(traj.positions[1], y / y.norm(dim=-1, keepdim=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("blocks", [False, True], ids=["whole", "blocks"])
def test_every_step_of_simulate_reads_a_fresh_step_bit_for_bit(dtype, blocks):
    """simulate makes the kernel's layout once and reuses its views and buffers (the Itô
    head sums keep the zeros of the entries row blocks never write): at every recorded
    state its numbers are those of a fresh step_quantities call, bit for bit."""
    g = torch.Generator().manual_seed(12)
    n, H = 19, 4
    x = gf.octahedral_tokens(n, paths=3, generator=g).to(dtype)
    D = gf.initial_weights(H, 3, g, paths=3).to(dtype)
    tuning = gf.KernelTuning(block_elements=5 * n * H if blocks else None)
    process = gf.OrnsteinUhlenbeck()
    dt, steps = 0.01, 5
    traj = gf.simulate(x, D, process, T=steps * dt, dt=dt, record_weights=True,
                       generator=torch.Generator().manual_seed(2), tuning=tuning)
    assert traj.positions.shape[0] == steps + 1
    noise_draws = torch.Generator().manual_seed(2)  # simulate's draws, step by step
    for k in range(steps + 1):
        w, noise = traj.weights[k], None
        if k < steps:
            z = torch.randn(w.shape, generator=noise_draws, dtype=dtype)
            noise = math.sqrt(dt) * (z + z.transpose(-1, -2)) / 2
        q = gf.step_quantities(traj.positions[k], w, drift=process.drift(w, 0.0),
                               sigma=process.sigma, noise=noise, tuning=tuning)
        for key in ("energy", "energy_rate", "slope_sq", "dissipation"):
            assert torch.equal(getattr(traj, key)[k], q[key]), (k, key)
        if k == 0:  # the running sum starts at 0: its first term is the increment
            assert torch.equal(traj.martingale[1], q["martingale_increment"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_drift_symmetric_to_rounding_is_accepted_in_both_dtypes(dtype):
    """A drift Q diag Q^T is symmetric up to the dtype's rounding, like weights built the
    same way: both are accepted; a really asymmetric drift is refused in both dtypes."""
    x, D = state_in(dtype, 5, 2)
    g = torch.Generator().manual_seed(4)
    Q = torch.linalg.qr(torch.randn(2, 2, 3, 3, generator=g, dtype=torch.float64))[0]
    eig = torch.randn(2, 2, 3, generator=g, dtype=torch.float64)
    f = (Q.to(dtype) @ torch.diag_embed(eig.to(dtype)) @ Q.to(dtype).transpose(-1, -2))
    q = gf.step_quantities(x, D, drift=f)
    ref, _ = reference_step(x.double().numpy(), D.double().numpy(), f.double().numpy(), 0.0,
                            np.zeros((2, 2, 3, 3)), 0.05, -1)
    assert_close_scaled(q["energy_rate"], ref["energy_rate"], DTYPE_RTOL[dtype],
                        what="energy_rate")
    skew = f + 0.01 * torch.triu(torch.ones_like(f), 1)
    with pytest.raises(ValueError, match="drift: expected symmetric matrices"):
        gf.step_quantities(x, D, drift=skew)


def reference_simulate(x, D, regime, sigma, noise, steps, dt, sign):
    """float64 loop of the scheme: projected Euler for the tokens, Euler–Maruyama for the
    weights, left-point integrals of G^2, D and dE/dt, the martingale summed over steps.

    ``noise[k]`` is the symmetric increment dW of step k. Returns per-step records.
    """
    rec = {k: [] for k in ("x", "E", "rate", "G2", "diss", "intG", "intD", "intR", "M")}
    acc = {k: np.zeros(x.shape[0]) for k in ("intG", "intD", "intR", "M")}
    for k in range(steps + 1):
        t = k * dt
        f = reference_drift(regime, D, t)
        dW = noise[k] if noise and k < steps else np.zeros_like(D)
        out, x_next = reference_step(x, D, f, sigma, dW, dt, sign)
        rec["x"].append(x)
        for key, out_key in (("E", "energy"), ("rate", "energy_rate"), ("G2", "slope_sq"),
                             ("diss", "dissipation")):
            rec[key].append(out[out_key])
        for key in acc:
            rec[key].append(acc[key].copy())
        if k == steps:
            break
        acc["intG"] += out["slope_sq"] * dt
        acc["intD"] += out["dissipation"] * dt
        acc["intR"] += out["energy_rate"] * dt
        acc["M"] += out["martingale_increment"]
        x, D = x_next, D + dt * f + sigma * dW
    out = {k: np.stack(v) for k, v in rec.items()}
    base = out["E"] - out["E"][:1] - out["intR"] - out["M"]
    out["res_slope"] = base - sign * out["intG"]
    out["res_diss"] = base + out["intD"]
    return out, D


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("n, H", [(5, 1), (7, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_simulate_in_both_dtypes_matches_float64_reference(dtype, n, H, regime):
    x, D = state_in(dtype, n, H, seed=12)
    P, _, d = x.shape
    steps, dt, sign, seed = 4, 0.05, -1, 5
    process = REGIMES[regime]
    traj = gf.simulate(x, D, process, T=steps * dt, dt=dt, sign=sign,
                       generator=torch.Generator().manual_seed(seed))
    # The same draws as simulate (one randn per step but the last, in its dtype).
    draws = torch.Generator().manual_seed(seed)
    noise = []
    for _ in range(steps if process.sigma > 0 else 0):
        z = torch.randn(P, H, d, d, generator=draws, dtype=dtype).double().numpy()
        noise.append(math.sqrt(dt) * (z + z.transpose(0, 1, 3, 2)) / 2)
    ref, D_final = reference_simulate(x.double().numpy(), D.double().numpy(), regime,
                                      process.sigma, noise, steps, dt, sign)
    rtol = DTYPE_RTOL[dtype]
    assert traj.energy.dtype == dtype and traj.positions.dtype == dtype
    np.testing.assert_allclose(traj.times.numpy(), dt * np.arange(steps + 1), rtol=1e-6)
    assert_close_scaled(traj.positions, ref["x"], rtol, what="positions")
    assert_close_scaled(traj.final_weights, D_final, rtol, what="final_weights")
    energy_scale = np.abs(ref["E"]).max()
    for key, rkey in (("energy", "E"), ("energy_rate", "rate"), ("slope_sq", "G2"),
                      ("dissipation", "diss"), ("int_slope_sq", "intG"),
                      ("int_dissipation", "intD"), ("int_energy_rate", "intR"),
                      ("martingale", "M"), ("residual_slope", "res_slope"),
                      ("residual_dissipation", "res_diss")):
        # integrals, the martingale and residuals are differences of energy-sized terms
        scale = None if key in ("energy", "energy_rate", "slope_sq", "dissipation") \
            else energy_scale
        assert_close_scaled(getattr(traj, key), ref[rkey], rtol, scale, what=key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_shifted_path_matches_symmetric_kernel(dtype):
    g = torch.Generator().manual_seed(2)
    x = gf.uniform_sphere(17, 3, g, paths=2).to(dtype)
    x = x / x.norm(dim=-1, keepdim=True)
    D = gf.initial_weights(4, 3, g, paths=2).to(dtype)
    blocks = gf.KernelTuning(block_elements=3 * 17 * 4)  # blocks of 3 rows
    symmetric = gf.step_quantities(x, D, sigma=1.0, drift=D, tuning=blocks)
    # a small chunk budget forces several row chunks
    shifted_tuning = gf.KernelTuning(exp_shift="always", shifted_chunk_elements=100)
    shifted = gf.step_quantities(x, D, sigma=1.0, drift=D, tuning=shifted_tuning)
    for key in QUANTITIES:
        assert_close_scaled(shifted[key], symmetric[key].double().numpy(),
                            DTYPE_RTOL[dtype], what=key)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    g = torch.Generator().manual_seed(12)
    x = gf.uniform_sphere(40, 3, g, paths=2)
    D = gf.initial_weights(8, 3, g, paths=2)
    cpu = gf.step_quantities(x, D, sigma=1.0, drift=D)
    gpu = gf.step_quantities(x.cuda(), D.cuda(), sigma=1.0, drift=D.cuda())
    for key in ("velocity", "energy", "energy_rate", "slope_sq", "dissipation"):
        torch.testing.assert_close(gpu[key].cpu(), cpu[key], rtol=1e-10, atol=1e-12)
    gen = torch.Generator(device="cuda").manual_seed(0)
    traj = gf.simulate(x.cuda(), D.cuda(), gf.OrnsteinUhlenbeck(), T=0.2, dt=0.01,
                       generator=gen)
    assert traj.positions.device.type == "cuda"


def test_velocity_is_tangent_and_tokens_stay_on_sphere():
    g = torch.Generator().manual_seed(3)
    x = gf.octahedral_tokens(30, paths=2, generator=g)
    D = gf.initial_weights(5, 3, g, paths=2)
    v = gf.velocity(x, D)
    assert (v * x).sum(-1).abs().max() < 1e-13
    traj = gf.simulate(x, D, gf.OrnsteinUhlenbeck(), T=1.0, dt=0.02, generator=g)
    norms = traj.positions.norm(dim=-1)
    assert (norms - 1).abs().max() < 1e-13
    assert traj.positions.shape == (51, 2, 30, 3)


def test_energy_decreases_for_frozen_single_head_descent():
    g = torch.Generator().manual_seed(4)
    x = gf.uniform_sphere(40, 3, g, paths=3)
    D = gf.initial_weights(1, 3, g, paths=3)
    traj = gf.simulate(x, D, gf.Frozen(), T=2.0, dt=0.005)
    assert torch.all(torch.diff(traj.energy, dim=0) < 0)
    assert torch.all(traj.dissipation > 0)
    # for one head the harmonic-mean slope is the dissipation
    torch.testing.assert_close(traj.slope_sq, traj.dissipation, rtol=1e-12, atol=0)


def test_edi_residual_first_order_for_one_head():
    g = torch.Generator().manual_seed(5)
    x = gf.uniform_sphere(30, 3, g, paths=2)
    D = gf.initial_weights(1, 3, g, paths=2)
    res = [gf.simulate(x, D, gf.Frozen(), T=1.0, dt=dt, record_positions=False)
           .residual_slope[-1].abs() for dt in (0.02, 0.01, 0.005)]
    for coarse, fine in zip(res, res[1:]):
        ratio = coarse / fine
        assert torch.all((ratio > 1.8) & (ratio < 2.2)), ratio


def test_multi_head_slope_residual_stalls_but_dissipation_closes():
    g = torch.Generator().manual_seed(6)
    x = gf.uniform_sphere(30, 3, g, paths=2)
    D = gf.initial_weights(6, 3, g, paths=2)
    runs = [gf.simulate(x, D, gf.Frozen(), T=1.0, dt=dt, record_positions=False)
            for dt in (0.02, 0.01)]
    slope = [r.residual_slope[-1] for r in runs]
    diss = [r.residual_dissipation[-1].abs() for r in runs]
    assert torch.all(slope[1] < 0) and torch.all((slope[1] / slope[0] - 1).abs() < 0.1)
    assert torch.all(diss[0] / diss[1] > 1.8)
    assert torch.all(runs[1].int_slope_sq[-1] <= runs[1].int_dissipation[-1])


def test_martingale_has_zero_mean_and_ou_balance_is_first_order():
    P = 400
    means = []
    for dt in (0.05, 0.025):
        g = torch.Generator().manual_seed(7)
        x = gf.uniform_sphere(8, 3, g, paths=P)
        D = gf.initial_weights(2, 3, g, paths=P)
        traj = gf.simulate(x, D, gf.OrnsteinUhlenbeck(), T=1.0, dt=dt, generator=g,
                           record_positions=False)
        m = traj.martingale[-1]
        se = m.std() / math.sqrt(P)
        assert m.std() > 0
        assert m.mean().abs() <= 2 * se
        means.append(traj.residual_dissipation[-1].mean())
    # with Itô-corrected dE/dt the Monte Carlo mean of the residual is O(dt)
    assert 1.6 < (means[0] / means[1]).item() < 2.4


def test_ou_exponent_in_range_small():
    g = torch.Generator().manual_seed(0)
    heads = [1, 8, 64]
    P, n = 6, 12
    tails = []
    for H in heads:
        x = gf.octahedral_tokens(n, paths=P, generator=g)
        D = gf.initial_weights(H, 3, g, paths=P)
        traj = gf.simulate(x, D, gf.OrnsteinUhlenbeck(), T=8.0, dt=0.04, record_every=5,
                           generator=g, record_positions=False)
        tails.append(traj.slope_sq[traj.times >= 2.5].mean(0))
    fit = gf.fit_power_law(heads, torch.stack(tails), n_boot=500)
    assert -1.2 <= fit.exponent <= -0.8, fit
    assert fit.exponent_ci[0] <= fit.exponent <= fit.exponent_ci[1]


def test_fit_power_law_recovers_exact_law_and_ci():
    H = [1, 10, 100]
    fit = gf.fit_power_law(H, [3.0 * h**-0.7 for h in H])
    assert abs(fit.exponent + 0.7) < 1e-12 and abs(fit.prefactor - 3.0) < 1e-12
    assert fit.exponent_ci is None
    rng = np.random.default_rng(0)
    noisy = np.array([[2.0 * h**-1.0 * math.exp(rng.normal(0, 0.1)) for _ in range(50)]
                      for h in H])
    fit = gf.fit_power_law(H, noisy)
    assert fit.exponent_ci[0] < -1.0 < fit.exponent_ci[1]
    assert fit.exponent_ci[1] - fit.exponent_ci[0] < 0.1


def test_w2_sphere_against_brute_force_permutations():
    g = torch.Generator().manual_seed(8)
    x = gf.uniform_sphere(6, 3, g)
    y = gf.uniform_sphere(6, 3, g)
    for cost in ("geodesic", "chordal"):
        def c(a, b, cost=cost):
            ip = float(np.clip(a @ b, -1, 1))
            return math.acos(ip) if cost == "geodesic" else float(np.linalg.norm(a - b))
        xn, yn = x.numpy(), y.numpy()
        best = min(np.mean([c(xn[i], yn[s[i]]) ** 2 for i in range(6)])
                   for s in itertools.permutations(range(6)))
        assert abs(gf.w2_sphere(x, y, cost=cost).item() - math.sqrt(best)) < 1e-12
    assert gf.w2_sphere(x, x[torch.randperm(6, generator=g)]).item() < 1e-6


def test_w2_sphere_batch_on_two_threads_equals_item_by_item():
    """The batch is shared among worker threads: same numbers as one item at a time."""
    g = torch.Generator().manual_seed(10)
    x = gf.uniform_sphere(7, 3, g, paths=6).view(3, 2, 7, 3)
    y = gf.uniform_sphere(7, 3, g, paths=6).view(3, 2, 7, 3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batched = gf.w2_sphere(x, y)
    finally:
        torch.set_num_threads(before)
    assert batched.shape == (3, 2)
    single = torch.stack([torch.stack([gf.w2_sphere(x[a, b], y[a, b]) for b in range(2)])
                          for a in range(3)])
    assert torch.equal(batched, single)


@pytest.mark.parametrize("d", [2, 3, 7, 8, 9])
def test_pairwise_distances_are_numpys_norm_bit_for_bit(d):
    """w2_sphere's distances (squares added one coordinate at a time below 8 coordinates)
    equal np.linalg.norm of the differences bit for bit, at odd and empty sizes."""
    from companion.gradient_flow.analysis import _pairwise_distances

    rng = np.random.default_rng(d)
    for n, m in [(0, 3), (1, 1), (7, 5), (33, 33)]:
        x = rng.standard_normal((n, d)) * 10.0 ** rng.uniform(-6, 2)
        y = x[:m] + 1e-7 * rng.standard_normal((min(n, m), d)) if n >= m else \
            rng.standard_normal((m, d))
        expected = np.linalg.norm(x[:, None, :] - y[None, :, :], axis=-1)
        got = _pairwise_distances(x, y)
        assert got.shape == (n, y.shape[0])
        assert np.array_equal(got, expected)
        assert np.array_equal(got ** 2, expected ** 2)


def test_sign_plus_clusters_and_minus_spreads():
    g = torch.Generator().manual_seed(9)
    n = 32
    x = gf.uniform_sphere(n, 3, g, paths=1)
    eye = torch.eye(3, dtype=torch.float64).expand(1, 1, 3, 3)
    plus = gf.simulate(x, eye, gf.Frozen(), T=15, dt=0.1, sign=1, record_positions=False)
    assert gf.pairwise_inner_stats(plus.final_tokens)["min"].item() > 0.999
    minus = gf.simulate(x, eye, gf.Frozen(), T=15, dt=0.1, sign=-1, record_positions=False)
    assert abs(gf.pairwise_inner_stats(minus.final_tokens)["mean"].item() + 1 / (n - 1)) < 5e-3


def test_processes():
    D = gf.initial_weights(4, 3, torch.Generator().manual_seed(1), paths=2)
    ou = gf.OrnsteinUhlenbeck()
    torch.testing.assert_close(ou.drift(D, 0.0), torch.eye(3, dtype=D.dtype) - D)
    same = gf.Oscillating("identical").drift(D, 0.7) + D
    assert torch.allclose(same, same[:, :1].expand_as(same))
    assert torch.allclose(same[0, 0], gf.oscillating_target(torch.tensor(0.7, dtype=D.dtype), 3))
    spread = gf.Oscillating("spread").drift(D, 0.7) + D
    # head phases 2 pi h / H: the average over heads loses the first harmonic
    mean = spread.mean(1)[0]
    assert abs(mean[0, 0].item() - 2.0) < 1e-12 and abs(mean[0, 2].item()) < 1e-12
    assert gf.Frozen().drift(D, 1.0) is None
    assert torch.allclose(gf.oscillating_target(torch.tensor(0.3), 2),
                          gf.oscillating_target(torch.tensor(0.3), 2).T)


def test_octahedral_tokens():
    x = gf.octahedral_tokens(12, noise=0.0)
    assert x.shape == (12, 3) and x.dtype == torch.float64
    assert torch.equal(x[0], torch.tensor([1.0, 0, 0], dtype=torch.float64))
    assert torch.equal(x[1], torch.tensor([-1.0, 0, 0], dtype=torch.float64))
    assert torch.equal(x[6], x[0])
    y = gf.octahedral_tokens(200, paths=3, generator=torch.Generator().manual_seed(0))
    assert y.shape == (3, 200, 3) and (y.norm(dim=-1) - 1).abs().max() < 1e-14


def test_gronwall_bound_is_respected_for_token_perturbation():
    g = torch.Generator().manual_seed(10)
    x = gf.uniform_sphere(20, 3, g, paths=1)
    D = gf.initial_weights(3, 3, g, paths=1)
    y = x + 1e-4 * torch.randn(x.shape, generator=g, dtype=x.dtype)
    y = y / y.norm(dim=-1, keepdim=True)
    a = gf.simulate(x, D, gf.Frozen(), T=0.5, dt=0.005, record_every=10, record_weights=True)
    b = gf.simulate(y, D, gf.Frozen(), T=0.5, dt=0.005, record_every=10)
    sup = (a.positions - b.positions).norm(dim=-1).amax(-1)[:, 0]
    bound = gf.gronwall_bound(a.times, gf.lipschitz_constant(a.weights)[:, 0], sup[0])
    assert torch.all(sup <= bound * (1 + 1e-9))
    assert torch.all(gf.w2_sphere(a.positions[:, 0], b.positions[:, 0], cost="chordal")
                     <= sup + 1e-12)


def test_loglog_order_recovers_power_laws():
    x = np.array([1e-3, 1e-2, 1e-1])
    assert gf.loglog_order(x, 3 * x) == pytest.approx(1.0, abs=1e-12)
    assert gf.loglog_order(x, 0.5 * x**-0.5) == pytest.approx(-0.5, abs=1e-12)
    assert gf.loglog_order(torch.tensor(x), torch.tensor(np.ones(3))) == pytest.approx(0.0)


def test_bootstrap_over_paths_against_explicit_resampling():
    rng = np.random.default_rng(3)
    a, b = rng.normal(1.0, 0.3, size=(4, 12)), rng.normal(2.0, 0.1, size=12)
    def stat(u, v):
        return u.mean() / v.mean()

    lo, hi = gf.bootstrap_over_paths(stat, a, b, n_boot=500, level=0.9, seed=5)
    # The same replicates by hand: one index draw per replicate, shared by both arrays.
    ref_rng = np.random.default_rng(5)
    reps = []
    for _ in range(500):
        idx = ref_rng.integers(0, 12, size=12)
        reps.append(stat(a[:, idx], b[idx]))
    assert (lo, hi) == pytest.approx(tuple(np.percentile(reps, [5, 95])), rel=1e-12)
    assert lo < stat(a, b) < hi
    # Constant paths: a degenerate interval at the value.
    assert gf.bootstrap_over_paths(lambda v: v.mean(), np.full(5, 2.0)) == (2.0, 2.0)


def test_bootstrap_over_paths_coverage_of_a_mean():
    # The 95 % interval of a normal mean over 20 paths covers the true mean in most trials.
    rng = np.random.default_rng(0)
    hits = 0
    for trial in range(100):
        v = rng.normal(0.0, 1.0, size=20)
        lo, hi = gf.bootstrap_over_paths(lambda u: u.mean(), v, n_boot=400, seed=trial)
        hits += lo <= 0.0 <= hi
    assert hits >= 85


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x, D: gf.velocity(torch.ones(1, 4, 1, dtype=torch.float64),
                                  torch.ones(1, 1, 1, 1, dtype=torch.float64)), "d >= 2"),
        (lambda x, D: gf.velocity(x, D + torch.triu(torch.ones_like(D), 1)), "symmetric"),
        (lambda x, D: gf.simulate(x, D, gf.Frozen(), T=1.0, dt=0.0), "dt"),
        (lambda x, D: gf.simulate(x, D, gf.Frozen(), T=1.0, dt=-0.1), "dt"),
        (lambda x, D: gf.simulate(x, D, gf.Frozen(), T=-1.0, dt=0.1), "T"),
        (lambda x, D: gf.velocity(2 * x, D), "unit vectors"),
        (lambda x, D: gf.velocity(x[0], D), "tokens"),
        (lambda x, D: gf.velocity(x, D[:, :, :2]), "weights"),
        (lambda x, D: gf.velocity(x, D, sign=0), "sign"),
        (lambda x, D: gf.simulate(x, D, gf.Frozen(), T=1.0, dt=0.1, record_every=0),
         "record_every"),
        (lambda x, D: gf.uniform_sphere(4, 1), "d"),
        (lambda x, D: gf.Oscillating("random"), "phases"),
        (lambda x, D: gf.fit_power_law([1, 1], [1.0, 2.0]), "H"),
        (lambda x, D: gf.w2_sphere(x[0], x[0, :3]), "x, y"),
        (lambda x, D: gf.loglog_order([1.0, 2.0], [1.0]), "x, y"),
        (lambda x, D: gf.loglog_order([1.0, 2.0], [1.0, -1.0]), "y"),
        (lambda x, D: gf.loglog_order([1.0, 1.0], [1.0, 2.0]), "x"),
        (lambda x, D: gf.bootstrap_over_paths("mean", np.ones(3)), "statistic"),
        (lambda x, D: gf.bootstrap_over_paths(np.mean), "samples"),
        (lambda x, D: gf.bootstrap_over_paths(np.mean, np.ones(1)), "at least 2 paths"),
        (lambda x, D: gf.bootstrap_over_paths(np.mean, np.ones(3), np.ones(4)), "samples"),
        (lambda x, D: gf.bootstrap_over_paths(np.mean, np.ones(3), level=1.0), "level"),
        (lambda x, D: gf.bootstrap_over_paths(lambda v: float("nan"), np.ones(3)),
         "statistic"),
    ],
)
def test_bad_input_raises_clear_errors(call, match):
    g = torch.Generator().manual_seed(0)
    x = gf.uniform_sphere(5, 3, g, paths=1)
    D = gf.initial_weights(2, 3, g, paths=1)
    with pytest.raises((ValueError, TypeError), match=match):
        call(x, D)


def test_simulate_rejects_unknown_process():
    x = gf.uniform_sphere(5, 3, paths=1)
    D = gf.initial_weights(2, 3, paths=1)
    with pytest.raises(TypeError, match="process"):
        gf.simulate(x, D, "ou", T=1.0, dt=0.1)


@pytest.mark.parametrize("backend", ["torch", "numpy"])
@pytest.mark.parametrize("blocks", [False, True])
def test_results_do_not_depend_on_the_thread_count(blocks, backend):
    """simulate spends the caller's threads on independent paths (one intra-op thread
    each, and with numpy's block products one BLAS thread): 1 and 2 threads give the same
    trajectory bit for bit, and the thread count is restored afterwards."""
    # blocks of 3 rows, or whole matrices in groups of 2 paths: 2 workers either way
    tuning = gf.KernelTuning(block_elements=3 * 23 * 6 if blocks else 2 * 23 * 23 * 6,
                             backend=backend)
    g = torch.Generator().manual_seed(9)
    x = gf.octahedral_tokens(23, paths=5, generator=g)
    D = gf.initial_weights(6, 3, g, paths=5)
    runs = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            runs.append(gf.simulate(x, D, gf.OrnsteinUhlenbeck(), T=0.03, dt=0.01,
                                    generator=torch.Generator().manual_seed(1),
                                    tuning=tuning))
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    for key in ("positions", "energy", "energy_rate", "slope_sq", "dissipation",
                "martingale", "final_weights"):
        assert torch.equal(getattr(runs[0], key), getattr(runs[1], key)), key


# The pool tests below: starting a worker is an interpreter and `import torch` (about 2 s of
# CPU each; these tests start about 20). A test that needs a pool of 2 without caring who
# started it takes the one the test before it left running (simulate_many and start_workers
# keep a healthy pool of that size, and replace a missing or broken one): each test passes
# alone or in any order, and a test that needs fresh workers (started now, stopped, killed)
# makes them itself. The last one stops its workers.


def test_simulate_many_on_two_processes_equals_one_simulate_per_run():
    """Runs cut into pieces of paths on 2 worker processes: the trajectories of one
    simulate call per run bit for bit (noise drawn for all paths, each piece keeping its
    rows; the run's layout, whole matrices or row blocks, kept by every piece), and every
    generator left in the serial run's state."""
    g = torch.Generator().manual_seed(21)
    runs = []
    for n, H, P, process, tuning in [
            (23, 6, 5, gf.OrnsteinUhlenbeck(), gf.KernelTuning(block_elements=3 * 23 * 6)),
            # row blocks for the 5 paths of the run, whole matrices for a piece alone
            (13, 4, 5, gf.OrnsteinUhlenbeck(), gf.KernelTuning(block_elements=13 * 13 * 4)),
            (9, 1, 3, gf.Oscillating(), None)]:
        runs.append(dict(tokens=gf.octahedral_tokens(n, paths=P, generator=g),
                         weights=gf.initial_weights(H, 3, g, paths=P), process=process,
                         T=0.04, dt=0.01, record_every=3, tuning=tuning,
                         record_weights=True))
    serial_gens = [torch.Generator().manual_seed(i) for i in range(len(runs))]
    parallel_gens = [torch.Generator().manual_seed(i) for i in range(len(runs))]
    serial = [gf.simulate(**run, generator=gen) for run, gen in zip(runs, serial_gens)]
    parallel = gf.simulate_many([{**run, "generator": gen}
                                 for run, gen in zip(runs, parallel_gens)], workers=2)
    for a, b, ga, gb in zip(serial, parallel, serial_gens, parallel_gens):
        for key in TRAJECTORY_FIELDS:
            assert torch.equal(getattr(a, key), getattr(b, key)), key
        assert torch.equal(ga.get_state(), gb.get_state())


def _identity(pid):
    """``(pid, start time)``: a process, told apart from a later one given the same pid
    (the start time in clock ticks since boot, field 22 of ``/proc/<pid>/stat``; None
    where there is no ``/proc``, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return pid, f.read().rsplit(")", 1)[1].split()[19]
    except OSError:  # the process is gone, or no /proc on this system
        return pid, None


def _identities(pids):
    return [_identity(pid) for pid in pids]


def _alive(identity):
    """Whether the process ``identity`` (from :func:`_identity`) still exists; a reused
    pid belongs to another process and does not count."""
    import os

    pid, started = identity
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return started is None or _identity(pid)[1] == started


def _small_run(seed=3):
    g = torch.Generator().manual_seed(seed)
    return dict(tokens=gf.octahedral_tokens(7, paths=2, generator=g),
                weights=gf.initial_weights(2, 3, g, paths=2), process=gf.Frozen(),
                T=0.02, dt=0.01)


def _assert_same_trajectory(a, b):
    for key in TRAJECTORY_FIELDS:
        x, y = getattr(a, key), getattr(b, key)
        assert (x is None and y is None) or torch.equal(x, y), key


def test_simulate_many_keeps_its_workers_and_replaces_a_stopped_pool():
    """The worker processes outlive a call (a chapter calls simulate_many several times;
    starting them costs seconds), ignore an interrupt sent to their process group, and a
    pool that was stopped (as after an error or an interrupt) is replaced by a fresh one
    with the same results; one pool at a time (another number of workers stops it)."""
    import os
    import signal

    run = _small_run()
    first = gf.simulate_many([run], workers=2)[0]
    pids = gf.worker_pids()
    assert len(pids) == 2
    for pid in pids:
        os.kill(pid, signal.SIGINT)  # ignored by the workers
    second = gf.simulate_many([run, run], workers=2)
    assert gf.worker_pids() == pids
    first_pool = _identities(pids)
    gf.stop_workers()
    assert gf.worker_pids() == [] and not any(_alive(w) for w in first_pool)
    gf.stop_workers()  # nothing running: nothing to do
    assert gf.start_workers(2) == 2  # a fresh pool, started ahead of the call
    started = gf.worker_pids()
    second_pool = _identities(started)
    assert len(started) == 2 and not set(second_pool) & set(first_pool)
    third = gf.simulate_many([run], workers=2)[0]
    assert gf.worker_pids() == started
    gf.start_workers(3)  # the pool of 2 is stopped
    assert len(gf.worker_pids()) == 3 and not any(_alive(w) for w in second_pool)
    fourth = gf.simulate_many([run], workers=3)[0]  # more workers than paths
    gf.stop_workers()
    for other in (second[0], second[1], third, fourth):
        _assert_same_trajectory(first, other)


def test_workers_survive_an_interrupt_while_they_start():
    """SIGINT sent to workers still importing torch (the set-up cell interrupted) is held
    until their initialiser ignores it: the same processes then simulate."""
    import os
    import signal

    run = _small_run()
    gf.stop_workers()
    gf.start_workers(2)
    pids = gf.worker_pids()
    for pid in pids:
        os.kill(pid, signal.SIGINT)
    result = gf.simulate_many([run], workers=2)[0]
    assert gf.worker_pids() == pids
    _assert_same_trajectory(gf.simulate(**run), result)
    # its pool is left running for the next test (see the note above these tests)


def _kill_and_wait(pid):
    """SIGKILL one kept worker and wait until it has exited (its sentinel is ready), an
    event: a killed process still runs for a moment, more so on a busy machine."""
    import os
    import signal
    from multiprocessing.connection import wait

    process = gf.simulation._KEPT_POOLS[0].executor._processes[pid]
    os.kill(pid, signal.SIGKILL)
    assert wait([process.sentinel], timeout=300), f"worker {pid} still alive after SIGKILL"


def test_simulate_many_replaces_a_broken_pool(monkeypatch):
    """A worker killed: simulate_many replaces the pool before handing it pieces; and a
    pool that breaks after that (its workers dead once the pieces are submitted, noticed
    when submitting or while waiting for a result) has its pieces run again on a fresh
    pool. The same results each time."""
    run = _small_run()
    gf.simulate_many([run], workers=2)
    pids = gf.worker_pids()
    old_pool = _identities(pids)  # before the kill: a pid may be reused after it
    _kill_and_wait(pids[0])
    result = gf.simulate_many([run], workers=2)[0]
    new_pool = _identities(gf.worker_pids())
    assert len(new_pool) == 2 and not set(new_pool) & set(old_pool)
    _assert_same_trajectory(gf.simulate(**run), result)

    real_healthy_pool = gf.simulation._healthy_pool
    handed = []

    def healthy_then_dead(workers):  # the first pool's workers die once it is handed out
        pool = real_healthy_pool(workers)
        if not handed:
            for pid in gf.worker_pids():
                _kill_and_wait(pid)
        handed.append(pool)
        return pool

    monkeypatch.setattr(gf.simulation, "_healthy_pool", healthy_then_dead)
    again = gf.simulate_many([run], workers=2)[0]
    monkeypatch.undo()
    assert len(handed) == 2 and handed[0] is not handed[1]  # the retry, on a fresh pool
    _assert_same_trajectory(result, again)
    _kill_and_wait(gf.worker_pids()[0])
    gf.start_workers(2)  # a broken pool is replaced here too (or by the call after)
    _assert_same_trajectory(result, gf.simulate_many([run], workers=2)[0])
    # its pool is left running for the next test (see the note above these tests)


def _until_both_workers_answer(pool):
    """Hand out trivial tasks until each of the pool's two workers has run one (a condition
    polled, with a safety deadline): both have then finished starting."""
    import os
    import time

    answered, deadline = set(), time.monotonic() + 300
    while len(answered) < 2:
        assert time.monotonic() < deadline, "a worker never started"
        tasks = [pool.executor.submit(os.getpid) for _ in range(4)]
        answered |= {task.result() for task in tasks}


def test_stop_workers_returns_after_a_worker_was_killed():
    """An idle worker killed and the workers stopped at once, before the pool has noticed
    (the killed one may have held the call queue's lock, which the other then waits for
    for ever): stop_workers returns with every worker gone, each of the two killed in
    turn. (With shutdown(wait=True) alone this hung in about half of the tries.)"""
    import os
    import signal
    import threading

    for victim in (0, 1):
        gf.start_workers(2)
        pool = gf.simulation._KEPT_POOLS[0]
        _until_both_workers_answer(pool)  # both started and idle, neither still starting
        pids = gf.worker_pids()
        processes = [pool.executor._processes[pid] for pid in pids]
        os.kill(pids[victim], signal.SIGKILL)
        stopper = threading.Thread(target=gf.stop_workers, daemon=True)
        stopper.start()
        stopper.join(300)  # a safety limit: it returns in seconds, or never
        assert not stopper.is_alive(), "stop_workers hung after a worker was killed"
        assert gf.worker_pids() == [] and all(p.exitcode is not None for p in processes)


def test_simulate_many_interrupted_returns_with_its_workers_stopped(monkeypatch):
    """An interrupt while waiting for the pieces (a long run on both workers): the call
    raises it promptly (the running pieces end at their next step; no worker is killed
    while it sends), the workers are gone, and the next call works."""
    import threading
    from concurrent.futures import Future

    run = _small_run()
    gf.simulate_many([run], workers=2)  # the workers ready
    pool = _identities(gf.worker_pids())
    slow = {**run, "T": 1e4, "dt": 1e-3, "record_every": 10**7, "record_positions": False}
    real_result = Future.result
    waits = []

    def interrupted_result(self, timeout=None):
        waits.append(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(Future, "result", interrupted_result)
    outcome = []

    def call():
        try:
            gf.simulate_many([slow], workers=2)
        except KeyboardInterrupt:
            outcome.append("interrupted")

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(120)  # a safety limit: the 10^7-step pieces would take far longer
    monkeypatch.setattr(Future, "result", real_result)
    assert not caller.is_alive(), "simulate_many did not return after the interrupt"
    assert outcome == ["interrupted"] and waits
    assert gf.worker_pids() == [] and not any(_alive(w) for w in pool)
    _assert_same_trajectory(gf.simulate(**run), gf.simulate_many([run], workers=2)[0])
    gf.stop_workers()


TRAJECTORY_FIELDS = ("times", "positions", "weights", "energy", "energy_rate", "slope_sq",
                     "dissipation", "int_slope_sq", "int_dissipation", "int_energy_rate",
                     "martingale", "residual_slope", "residual_dissipation", "final_tokens",
                     "final_weights")


def test_simulate_many_rejects_bad_runs():
    x = gf.uniform_sphere(5, 3, paths=1)
    D = gf.initial_weights(2, 3, paths=1)
    with pytest.raises(TypeError, match=r"runs\[0\]"):
        gf.simulate_many([(x, D)], workers=2)
    with pytest.raises(ValueError, match=r"runs\[0\]: unknown"):
        gf.simulate_many([dict(tokens=x, weights=D, process=gf.Frozen(), T=1, dt=0.1,
                               steps=3)], workers=2)
    with pytest.raises(ValueError, match=r"runs\[0\]: missing"):
        gf.simulate_many([dict(tokens=x, weights=D, process=gf.Frozen(), T=1)], workers=2)
    with pytest.raises(ValueError, match="workers"):
        gf.simulate_many([], workers=0)
