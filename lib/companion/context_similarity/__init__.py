"""Context similarity (chapter 2): per-head output vectors and their pairwise dot products.

Halevi et al., arXiv 2512.21956. In layer ``l``, head ``h`` mixes the value vectors with
its attention map into one output vector per token, ``z^{lh}_i = sum_j A^{lh}_ij v^{lh}_j``
(before the output projection ``W_O``, value bias included; ``where="post_wo"`` is the
ablation after ``W_O``); the context similarity matrix of the head is the Gram matrix
``S^{lh}_ij = <z^{lh}_i, z^{lh}_j>`` with its diagonal zeroed. "High similarity" is the
top ``percentile`` per cent of the off-diagonal pairs ``i < j`` of content tokens per
window, layer and head; the high-attention region of a head is where
``max(A_ij, A_ji) >= attention_threshold``.

The public API is importable from here (``from companion import context_similarity as
cs``). The modules:

- ``reference``: the definitions as plain code (per-head outputs, the Gram matrix,
  top-k over the upper triangle, the per-pair statistics), what every fast path equals;
- ``encoder``: loading a BERT-family model offline, its layers, separator tokens;
- ``capture``: one forward pass capturing every head's ``hook_z`` and ``hook_pattern``;
- ``topk``: similarity matrices and the fast pyramid search for the top pairs;
- ``stats``: one small function per statistic, one registry, :class:`SimilarityStats`;
- ``measures``: the measurement behind each of the chapter's paper claims, a function of
  the per-window sums, with its bootstrap over windows;
- ``corpus``: the driver over a corpus of windows (:func:`analyse_corpus`, ``nproc``);
- ``workspace``: the work buffers kept between batches;
- ``segmentation`` and ``segmentation_eval``: sentence boundaries read from the
  similarities, and their scores.

Run at scale with ``torchrun --nproc-per-node N -m companion.context_similarity ...``.
"""
from companion.context_similarity.capture import (
    BatchResult,
    CaptureSettings,
    HeadOutputs,
    analyse_batch,
    head_outputs,
    wo_gram,
)
from companion.context_similarity.corpus import analyse_corpus, clear_workspaces
from companion.context_similarity.encoder import (
    DEFAULT_SEPARATORS,
    WHERE,
    ModelNotFoundError,
    default_model_path,
    encoder_layers,
    load_encoder,
    separator_ids,
)
from companion.context_similarity.stats import LONG_RANGE, SHORT_RANGE, SimilarityStats
from companion.context_similarity.topk import TopPairsTuning, similarity_matrices, top_pairs
from companion.context_similarity.workspace import Workspace

__all__ = [
    "DEFAULT_SEPARATORS",
    "LONG_RANGE",
    "SHORT_RANGE",
    "WHERE",
    "BatchResult",
    "CaptureSettings",
    "HeadOutputs",
    "ModelNotFoundError",
    "SimilarityStats",
    "TopPairsTuning",
    "Workspace",
    "analyse_batch",
    "analyse_corpus",
    "clear_workspaces",
    "default_model_path",
    "encoder_layers",
    "head_outputs",
    "load_encoder",
    "separator_ids",
    "similarity_matrices",
    "top_pairs",
    "wo_gram",
]
