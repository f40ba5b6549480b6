"""companion: the shared library of *Attention, Reproduced*.

Plain functions on torch tensors, CPU and GPU alike. One module per idea:

- ``masks`` (mask_mods, their combinators, dense masks), ``reachability``, ``task_merge``,
  ``masked_transformer``: Hasse diagrams for attention (chapter 1)
- ``context_similarity``, ``corpora``: per-head output similarities (chapter 2);
  ``segmentation``, ``segmentation_eval``: sentence boundaries read from them, scored
- ``gradient_flow``: multi-head Wasserstein gradient flow on the sphere (chapter 3)
- ``sbm``, ``edge_attention``, ``lra``: SBM-Transformer and offline long-range tasks
  (chapter 4)
- ``parallel``: a library function under ``torchrun`` with N processes, from a notebook
- ``provenance``: figures, tables and claims saved with their provenance
- ``prose``: the words of a chapter's summary sentences, computed from its numbers
- ``_validate``: the shared argument checks and their messages
- ``claims_diff``: the claims that differ between two builds; ``site``: the book's
  addresses (repository, published site, distribution name)
- ``runner``, ``cli``: execute chapters with papermill and build the book; ``pages``
  (figure index, reproduction report), ``htmlcheck`` (browser check), ``interrupts``
  (Ctrl-C as a recorded state)
"""
__version__ = "0.1.0"
