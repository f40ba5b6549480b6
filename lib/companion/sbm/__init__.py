"""SBM-Transformer (chapter 4): attention on a graph sampled per head from a stochastic
block model (fastRG), with straight-through gradients.

The public API is importable from here (``from companion import sbm``). Submodules:

- ``reference``: the paper's equations, dense (``P = Qhat S Khat^T``, Poisson counts,
  masked softmax attention): what the fast paths are tested against;
- ``fastrg``: :func:`fastrg_sample` and its :class:`FastRGTuning`; the dense-count form
  :func:`poisson_pair_counts` for small dense graphs (:func:`use_pair_grid`);
- ``fastrg`` draws its Poisson counts in ``poisson`` and its keys in ``key_draws``;
- ``graph_attention``: attention over an edge list (the cost linear in the edges);
- ``tensor_ops``: :func:`stable_argsort`, :func:`repeat_each`, :func:`transposed_copy`,
  torch operations with a faster CPU path, bit for bit torch's result;
- ``layer``: :class:`SBMAttention` (straight-through estimator), :func:`density_regularizer`.
"""
from companion.sbm.fastrg import (DUPLICATE_POLICIES, FastRGTuning, edge_probabilities,
                                  fastrg_sample, poisson_pair_counts, use_pair_grid)
from companion.sbm.graph_attention import edge_attention
from companion.sbm.layer import SBMAttention, density_regularizer, sbm_parameters
from companion.sbm.reference import dense_masked_attention
from companion.sbm.tensor_ops import repeat_each, stable_argsort, transposed_copy

__all__ = [
    "sbm_parameters",
    "edge_probabilities",
    "fastrg_sample",
    "poisson_pair_counts",
    "use_pair_grid",
    "edge_attention",
    "SBMAttention",
    "density_regularizer",
    "dense_masked_attention",
    "DUPLICATE_POLICIES",
    "FastRGTuning",
    "repeat_each",
    "stable_argsort",
    "transposed_copy",
]
