"""(fast, reference) pairs of companion.gradient_flow.

Every path of the step kernel (:func:`gf.step_quantities`) against the paper's equations
with dense tensors (:func:`gf.reference_step_quantities`): the symmetric kernel on whole
matrices and in row blocks (ragged last block for odd ``n``), the max-shifted softmax
moments unchunked and in row chunks, with and without weight drift and noise (the Itô
term), at odd sizes, one token and one head; the same step against the float64 loops of
:func:`gf.reference_step_loops`; and one step of :func:`gf.simulate` against the loops'
projected Euler step. Sizes are ``(paths, n, heads)``.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from companion import gradient_flow as gf
from reference_pairs import Pair

SIZES = [(1, 1, 1), (2, 7, 3), (3, 11, 4), (1, 17, 1), (2, 24, 9)]
LOOP_SIZES = [(1, 1, 1), (2, 5, 3), (1, 9, 2)]  # the loops are slow: small sizes only
DT = 0.05
SIGMA = 1.3
# Relative to each quantity's scale (energies reach e^|D| ~ 1e3 at these weights).
TOLERANCES = {torch.float32: (5e-5, 1e-5), torch.float64: (1e-11, 1e-12)}


def make_state(size, dtype, device, generator, *, with_noise=True):
    """Tokens, weights, OU drift, noise amplitude and a symmetric noise increment."""
    P, n, H = size
    x = gf.uniform_sphere(n, 3, generator, paths=P).to(dtype)
    x = (x / x.norm(dim=-1, keepdim=True)).to(device)
    D = gf.initial_weights(H, 3, generator, paths=P).to(dtype).to(device)
    f = gf.OrnsteinUhlenbeck().drift(D, 0.0)
    z = torch.randn(P, H, 3, 3, generator=generator, dtype=torch.float64)
    dW = (math.sqrt(DT) * (z + z.transpose(-1, -2)) / 2).to(dtype).to(device)
    if not with_noise:
        return x, D, None, 0.0, None
    return x, D, f, SIGMA, dW


def make_plain(size, dtype, device, generator):
    """No drift, no noise: the kernel without the Itô sum and without the rate GEMM."""
    return make_state(size, dtype, device, generator, with_noise=False)


def step_with(tuning_for):
    """``step_quantities`` with the KernelTuning ``tuning_for(n, H)``."""
    def fast(x, D, f, sigma, dW):
        return gf.step_quantities(x, D, drift=f, sigma=sigma, noise=dW,
                                  tuning=tuning_for(x.shape[1], D.shape[1]))
    return fast


def reference(x, D, f, sigma, dW):
    return gf.reference_step_quantities(x, D, drift=f, sigma=sigma, noise=dW)


def _numpy(a, like):
    return np.zeros(like.shape) if a is None else a.detach().cpu().double().numpy()


def loops(x, D, f, sigma, dW):
    """The float64 loops on the same inputs, as tensors of the inputs' dtype and device
    (``Z`` from the dense reference: the loops do not return it)."""
    out, _ = gf.reference_step_loops(_numpy(x, x), _numpy(D, D), _numpy(f, D), sigma,
                                     _numpy(dW, D), DT, -1)
    res = {k: torch.as_tensor(v).to(x.dtype).to(x.device) for k, v in out.items()}
    return res


def fast_without_z(x, D, f, sigma, dW):
    q = gf.step_quantities(x, D, drift=f, sigma=sigma, noise=dW)
    del q["Z"]
    return q


def euler_step(x, D, f, sigma, dW):
    """simulate's first projected Euler step (frozen weights)."""
    return gf.simulate(x, D, gf.Frozen(), T=DT, dt=DT).positions[-1]


def euler_step_loops(x, D, f, sigma, dW):
    zeros = np.zeros(D.shape)
    _, x_next = gf.reference_step_loops(_numpy(x, x), _numpy(D, D), zeros, 0.0, zeros, DT,
                                        -1)
    return torch.as_tensor(x_next).to(x.dtype).to(x.device)


def compare_scaled(fast, ref, dtype):
    """Every quantity within ``rtol * max |reference| + atol`` (the reference's scale)."""
    rtol, atol = TOLERANCES[dtype]
    items = ref.items() if isinstance(ref, dict) else [("result", ref)]
    for key, r in items:
        f = fast[key] if isinstance(fast, dict) else fast
        assert f.shape == r.shape, f"{key}: shape {tuple(f.shape)} != {tuple(r.shape)}"
        assert f.dtype == dtype, f"{key}: dtype {f.dtype} != {dtype}"
        f, r = f.detach().cpu().double(), r.detach().cpu().double()
        err = (f - r).abs().max().item() if r.numel() else 0.0
        scale = r.abs().max().item() if r.numel() else 0.0
        assert err <= rtol * scale + atol, (
            f"{key}: max error {err:.3g} > {rtol:.1g} * {scale:.3g} + {atol:.1g}")


PAIRS = [
    Pair("gradient_flow.step.whole", step_with(lambda n, H: gf.KernelTuning()), reference,
         make_state, SIZES, compare=compare_scaled, covers=(gf.step_quantities,)),
    Pair("gradient_flow.step.blocks",  # blocks of 2 query rows, ragged last block
         step_with(lambda n, H: gf.KernelTuning(block_elements=2 * n * H)), reference,
         make_state, SIZES, compare=compare_scaled),
    Pair("gradient_flow.step.blocks_plain",
         step_with(lambda n, H: gf.KernelTuning(block_elements=3 * n * H)), reference,
         make_plain, SIZES, compare=compare_scaled),
    Pair("gradient_flow.step.shifted",  # one chunk: every row at once
         step_with(lambda n, H: gf.KernelTuning(exp_shift="always")), reference,
         make_state, SIZES, compare=compare_scaled),
    Pair("gradient_flow.step.shifted_chunked",  # row chunks of 13 logits
         step_with(lambda n, H: gf.KernelTuning(exp_shift="always",
                                                shifted_chunk_elements=13)),
         reference, make_state, SIZES, compare=compare_scaled),
    Pair("gradient_flow.step.shifted_plain",
         step_with(lambda n, H: gf.KernelTuning(exp_shift="always",
                                                shifted_chunk_elements=13)),
         reference, make_plain, SIZES, compare=compare_scaled),
    Pair("gradient_flow.step.loops", fast_without_z, loops, make_state, LOOP_SIZES,
         compare=compare_scaled),
    Pair("gradient_flow.simulate.euler_step", euler_step, euler_step_loops, make_plain,
         LOOP_SIZES, compare=compare_scaled, covers=(gf.simulate,)),
]
