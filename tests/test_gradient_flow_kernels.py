"""Whole trajectories of gf.simulate against an Euler–Maruyama loop over the dense reference.

The reference pairs (tests/reference_pairs/gradient_flow.py) hold one step of the fast
kernel to the paper's equations; this file holds a whole run to them: every recorded
quantity of every step of :func:`gf.simulate` (tokens, weights, energy balance,
integrals, residuals) against the same projected Euler / Euler–Maruyama scheme written
as a plain loop over :func:`gf.reference_step_quantities`, with the same noise draws.
A change of the step's rounding (a GEMM layout, a block size, ``exp`` or ``exp2``) must
keep float64 runs within 1e-10 of the reference's scale over the whole run, and the
symmetric kernel is reached both on whole matrices and in row blocks (ragged last block at
odd ``n``), with either exponential and either library for the block products (torch's
GEMMs and exponentials, or numpy's on the same memory).
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from companion import gradient_flow as gf

# small problems: one intra-op thread (with two, each step's paths go to two worker
# threads, which on a loaded 2-core machine cost 30x the arithmetic; the numbers are the same)
pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Relative to each quantity's largest value over the run (residuals: to the energy's).
TOLERANCES = {torch.float64: 1e-10, torch.float32: 2e-4}
FIELDS = ("positions", "weights", "energy", "energy_rate", "slope_sq", "dissipation",
          "int_slope_sq", "int_dissipation", "int_energy_rate", "martingale",
          "final_tokens", "final_weights")


def reference_trajectory(tokens, weights, process, *, steps, dt, sign, generator):
    """The scheme of gf.simulate as a plain loop over the dense reference step.

    Every step from the state at ``t_k``: ``x <- (x + dt v) / |x + dt v|`` and
    ``D <- D + f(D, t_k) dt + sigma dW`` with ``dW = sqrt(dt) (Z + Z^T) / 2`` (``Z`` drawn
    from ``generator``, none at the last state); left-point integrals of ``G^2``, the
    dissipation and ``dE/dt``, and the martingale's increments summed. Returns per-step
    lists of each quantity, as simulate records them with ``record_every=1``.
    """
    x, D = tokens.clone(), weights.clone()
    P, _, d = x.shape
    H = D.shape[1]
    sigma = float(process.sigma)
    out = {k: [] for k in FIELDS[:-2]}
    running = {k: torch.zeros(P, dtype=x.dtype) for k in
               ("int_slope_sq", "int_dissipation", "int_energy_rate", "martingale")}
    for k in range(steps + 1):
        drift = process.drift(D, k * dt)
        noise = None
        if k < steps and sigma > 0:
            z = torch.randn(P, H, d, d, generator=generator, dtype=x.dtype)
            noise = math.sqrt(dt) * (z + z.transpose(-1, -2)) / 2
        q = gf.reference_step_quantities(x, D, sign=sign, drift=drift, sigma=sigma,
                                         noise=noise)
        out["positions"].append(x.clone())
        out["weights"].append(D.clone())
        for key in ("energy", "energy_rate", "slope_sq", "dissipation"):
            out[key].append(q[key])
        for key, value in running.items():
            out[key].append(value.clone())
        if k == steps:
            break
        running["int_slope_sq"] += q["slope_sq"] * dt
        running["int_dissipation"] += q["dissipation"] * dt
        running["int_energy_rate"] += q["energy_rate"] * dt
        running["martingale"] += q["martingale_increment"]
        x = x + dt * q["velocity"]
        x = x / x.norm(dim=-1, keepdim=True)
        if drift is not None:
            D = D + dt * drift
        if noise is not None:
            D = D + sigma * noise
    result = {key: torch.stack(v) for key, v in out.items()}
    result["final_tokens"], result["final_weights"] = x, D
    return result


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("process", [gf.OrnsteinUhlenbeck(), gf.Oscillating(), gf.Frozen()],
                         ids=["ou", "oscillating", "frozen"])
@pytest.mark.parametrize("size,block_rows", [((2, 13, 3), None), ((3, 17, 5), 4),
                                             ((1, 1, 1), None), ((2, 9, 16), 2)],
                         ids=["whole", "blocks", "one_token", "blocks_many_heads"])
@pytest.mark.parametrize("exponential", ["exp", "exp2"])
@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_simulate_follows_the_reference_scheme(size, block_rows, process, dtype, exponential,
                                               backend):
    P, n, H = size
    steps, dt, sign = 25, 0.02, -1
    g = torch.Generator().manual_seed(n * 100 + H)
    tokens = gf.uniform_sphere(n, 3, g, paths=P).to(dtype)
    tokens = tokens / tokens.norm(dim=-1, keepdim=True)
    weights = gf.initial_weights(H, 3, g, paths=P).to(dtype)
    tuning = gf.KernelTuning(block_elements=None if block_rows is None else block_rows * n * H,
                             exponential=exponential, backend=backend)
    fast = gf.simulate(tokens, weights, process, T=steps * dt, dt=dt, sign=sign,
                       record_weights=True, generator=torch.Generator().manual_seed(5),
                       tuning=tuning)
    ref = reference_trajectory(tokens, weights, process, steps=steps, dt=dt, sign=sign,
                               generator=torch.Generator().manual_seed(5))
    tol = TOLERANCES[dtype]
    assert fast.energy.shape == (steps + 1, P)
    for key in FIELDS:
        f, r = getattr(fast, key).double(), ref[key].double()
        assert f.shape == r.shape, key
        scale = r.abs().max().item()
        err = (f - r).abs().max().item()
        assert err <= tol * scale + 1e-300, f"{key}: {err:.3g} > {tol:g} * {scale:.3g}"
    # the residuals of the energy balance: differences of O(E) terms, held to E's scale
    energy_scale = ref["energy"].abs().max().item()
    dE = ref["energy"] - ref["energy"][:1]
    base = dE - ref["int_energy_rate"] - ref["martingale"]
    for key, r in (("residual_slope", base - sign * ref["int_slope_sq"]),
                   ("residual_dissipation", base + ref["int_dissipation"])):
        err = (getattr(fast, key).double() - r.double()).abs().max().item()
        assert err <= 4 * tol * energy_scale, f"{key}: {err:.3g}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("block_rows", [None, 4], ids=["whole", "blocks"])
def test_exp2_kernel_gives_the_exp_kernels_trajectories_to_rounding(dtype, block_rows):
    """The two exponentials of the symmetric kernel (``exp``, the kernel before the
    machine's choice, and ``exp2`` with ``log2 e`` in the queries) give every recorded
    quantity of a whole OU run to rounding: a few units of the dtype's epsilon over 30
    steps (float64: measured at most 4.4e-16 relative at n = 200, H = 100, 10 paths; the
    bound here, 64 eps, is ours). An exponential of another base (a wrong factor on the
    queries) moves the energy by O(1) and fails it."""
    P, n, H, steps, dt = 3, 23, 7, 30, 0.02
    g = torch.Generator().manual_seed(23)
    tokens = gf.octahedral_tokens(n, paths=P, generator=g).to(dtype)
    weights = gf.initial_weights(H, 3, g, paths=P).to(dtype)

    def run(exponential):
        tuning = gf.KernelTuning(block_elements=None if block_rows is None
                                 else block_rows * n * H, exponential=exponential)
        return gf.simulate(tokens, weights, gf.OrnsteinUhlenbeck(), T=steps * dt, dt=dt,
                           record_weights=True, generator=torch.Generator().manual_seed(4),
                           tuning=tuning)

    with_exp, with_exp2 = run("exp"), run("exp2")
    eps = torch.finfo(dtype).eps
    # float32 trajectories drift apart over the steps like any two roundings do
    bound = 64 * eps if dtype == torch.float64 else 1e-4
    energy_scale = with_exp.energy.abs().max()
    for key in (*FIELDS, "residual_slope", "residual_dissipation"):
        a, b = getattr(with_exp, key), getattr(with_exp2, key)
        scale = energy_scale if key.startswith("residual") else a.abs().max()
        assert (a - b).abs().max() <= bound * scale, key
    # the check can fail: exp2 of the unscaled logits is another exponential
    wrong = gf.step_quantities(tokens, weights * math.log(2.0),
                               tuning=gf.KernelTuning(exponential="exp"))
    assert (wrong["energy"] - with_exp2.energy[0]).abs().max() > 1e3 * bound * energy_scale


def _auto_follows_the_machine(monkeypatch, field: str, intel_or_off_cpu: str,
                              other_cpu: str):
    """``KernelTuning``'s ``field="auto"`` gives ``intel_or_off_cpu`` off the CPU and on
    an Intel CPU whose torch uses MKL, ``other_cpu`` on any other CPU (the machine rule
    stubbed both ways), and either named choice is kept on the CPU."""
    from companion.gradient_flow import kernels

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    choice_for = f"{field}_for"
    auto = gf.KernelTuning()
    for intel, expected in ((True, intel_or_off_cpu), (False, other_cpu)):
        monkeypatch.setattr(kernels, "_mkl_exp_on_intel", lambda intel=intel: intel)
        assert getattr(auto, choice_for)(cpu) == expected
        assert getattr(auto, choice_for)(cuda) == intel_or_off_cpu
        for named in (intel_or_off_cpu, other_cpu):
            assert getattr(gf.KernelTuning(**{field: named}), choice_for)(cpu) == named


def test_exponential_choice_follows_the_machine_not_a_timing(monkeypatch):
    """``exponential="auto"`` is ``exp`` off the CPU and on an Intel CPU whose torch uses
    MKL, ``exp2`` on any other CPU; a named choice is kept; anything else is refused."""
    from companion.gradient_flow import kernels

    _auto_follows_the_machine(monkeypatch, "exponential", intel_or_off_cpu="exp",
                              other_cpu="exp2")
    monkeypatch.undo()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():  # this machine: its vendor line decides
        intel = "GenuineIntel" in cpuinfo.read_text()
        assert kernels._mkl_exp_on_intel() == (intel and torch.backends.mkl.is_available())
    with pytest.raises(ValueError, match="exponential"):
        gf.KernelTuning(exponential="exp10")


def test_backend_choice_follows_the_machine_not_a_timing(monkeypatch):
    """``backend="auto"`` is ``torch`` off the CPU and on an Intel CPU whose torch uses
    MKL, ``numpy`` on any other CPU; a named choice is kept; ``numpy`` off the CPU and an
    unknown name are refused, naming the parameter."""
    cuda = torch.device("cuda")
    _auto_follows_the_machine(monkeypatch, "backend", intel_or_off_cpu="torch",
                              other_cpu="numpy")
    assert gf.KernelTuning(backend="torch").backend_for(cuda) == "torch"
    with pytest.raises(ValueError, match="backend.*CPU"):
        gf.KernelTuning(backend="numpy").backend_for(cuda)
    with pytest.raises(ValueError, match="backend"):
        gf.KernelTuning(backend="jax")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("block_rows", [None, 3], ids=["whole", "blocks"])
@pytest.mark.parametrize("exponential", ["exp", "exp2"])
def test_numpy_blocks_give_the_torch_kernels_numbers_to_rounding(dtype, block_rows,
                                                                 exponential, monkeypatch):
    """numpy's GEMMs and exponential on the kernel's own buffers give torch's step to
    rounding (64 eps of each quantity's scale, ours; float32 1e-5), at odd ``n`` with a
    ragged last block; numpy's BLAS runs on one thread while the blocks run and gets its
    thread count back afterwards. The check can fail: a factor 2 on the weights (other
    logits) moves the energy far beyond the bound."""
    from threadpoolctl import threadpool_info

    from companion.gradient_flow import kernels

    P, n, H = 3, 19, 5
    g = torch.Generator().manual_seed(19)
    tokens = gf.uniform_sphere(n, 3, g, paths=P).to(dtype)
    weights = gf.initial_weights(H, 3, g, paths=P).to(dtype)
    drift, noise = -weights, 0.1 * weights
    bound = 64 * torch.finfo(dtype).eps if dtype == torch.float64 else 1e-5

    def blas_threads():  # numpy's BLAS (scipy's own, if loaded, is another library)
        return [i["num_threads"] for i in threadpool_info()
                if i["user_api"] == "blas" and "numpy" in i["filepath"]]

    def step(backend, w=weights):
        tuning = gf.KernelTuning(block_elements=None if block_rows is None
                                 else block_rows * n * H, exponential=exponential,
                                 backend=backend)
        return gf.step_quantities(tokens, w, drift=drift, sigma=0.3, noise=noise,
                                  tuning=tuning)

    seen = []
    real_run = kernels._SymmetricPlan.run

    def run_and_look(plan, t):  # numpy's arrays in the plan, the BLAS threads meanwhile
        seen.append((plan.arrays is not None, set(blas_threads())))
        return real_run(plan, t)

    before = blas_threads()
    assert before, "numpy's BLAS not found by threadpoolctl"
    with_torch = step("torch")
    monkeypatch.setattr(kernels._SymmetricPlan, "run", run_and_look)
    with_numpy = step("numpy")
    monkeypatch.undo()
    assert seen and all(look == (True, {1}) for look in seen)
    assert blas_threads() == before
    for key, a in with_torch.items():
        assert (a - with_numpy[key]).abs().max() <= bound * a.abs().max() + 1e-300, key
    wrong = step("numpy", 2 * weights)
    assert (wrong["energy"] - with_torch["energy"]).abs().max() \
        > 1e3 * bound * with_torch["energy"].abs().max()
