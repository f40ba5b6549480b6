"""Multi-head attention dynamics on the sphere as a time-dependent Wasserstein gradient flow.

This package implements the particle model of Massucco, Del Grande, Carioni, Brune and
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

Layout. :mod:`~companion.gradient_flow.reference` holds the equations as plain code (the
tests' reference), :mod:`~companion.gradient_flow.kernels` the fast batched step
(:func:`step_quantities`, tuned by a :class:`KernelTuning` argument),
:mod:`~companion.gradient_flow.simulation` the initial conditions, weight processes,
:func:`simulate` and :func:`simulate_many` (independent runs on worker processes, the same
trajectories bit for bit; :func:`start_workers`, :func:`stop_workers` and
:func:`worker_pids` for its kept worker processes),
:mod:`~companion.gradient_flow.analysis` the fits, bootstrap intervals, distances and
stability constants the chapter reads trajectories with, and
:mod:`~companion.gradient_flow.paper_measures` the measurements the paper's statements are
tested with (the chapter's paper claims and their falsifier tests call the same functions).
"""
from companion.gradient_flow.analysis import (PowerLawFit, bootstrap_mean_band,
                                              bootstrap_over_paths, fit_power_law,
                                              gronwall_bound, lipschitz_constant,
                                              loglog_order, pairwise_inner_stats,
                                              spectral_norms, w2_sphere, weight_sensitivity)
from companion.gradient_flow.kernels import KernelTuning, step_quantities, velocity
from companion.gradient_flow.reference import reference_step_loops, reference_step_quantities
from companion.gradient_flow.simulation import (Frozen, OrnsteinUhlenbeck, Oscillating,
                                                Trajectory, initial_weights,
                                                octahedral_tokens, oscillating_target,
                                                simulate, simulate_many, start_workers,
                                                stop_workers, uniform_sphere, worker_pids)

__all__ = [
    "Frozen",
    "KernelTuning",
    "OrnsteinUhlenbeck",
    "Oscillating",
    "PowerLawFit",
    "Trajectory",
    "bootstrap_mean_band",
    "bootstrap_over_paths",
    "fit_power_law",
    "gronwall_bound",
    "initial_weights",
    "lipschitz_constant",
    "loglog_order",
    "octahedral_tokens",
    "oscillating_target",
    "pairwise_inner_stats",
    "reference_step_loops",
    "reference_step_quantities",
    "simulate",
    "simulate_many",
    "spectral_norms",
    "start_workers",
    "step_quantities",
    "stop_workers",
    "uniform_sphere",
    "velocity",
    "w2_sphere",
    "weight_sensitivity",
    "worker_pids",
]
