"""SBM-Transformer (chapter 4): attention on a graph sampled per head from a stochastic
block model (fastRG), with straight-through gradients.

The public API is importable from here (``from companion import sbm``). Submodules:

- ``reference``: the paper's equations, dense (``P = Qhat S Khat^T``, Poisson counts,
  masked softmax attention): what the fast paths are tested against;
- ``fastrg``: :func:`fastrg_sample` and its :class:`FastRGTuning`; the dense-count form
  :func:`poisson_pair_counts` for small dense graphs (:func:`use_pair_grid`);
- ``graph_attention``: attention over an edge list (the cost linear in the edges);
- ``layer``: :class:`SBMAttention` (straight-through estimator), :func:`density_regularizer`.
"""
from companion.sbm.fastrg import (DUPLICATE_POLICIES, FastRGTuning, edge_probabilities,
                                  fastrg_sample, poisson_pair_counts, use_pair_grid)
from companion.sbm.graph_attention import edge_attention
from companion.sbm.layer import SBMAttention, density_regularizer, sbm_parameters
from companion.sbm.reference import dense_masked_attention

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
]
