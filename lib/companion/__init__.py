"""companion: the shared library of *Attention, Reproduced*.

Plain functions on torch tensors, CPU and GPU alike. One module per idea:

- ``masks``, ``reachability``, ``task_merge``: Hasse diagrams for attention (chapter 1)
- ``context_similarity``, ``corpora``: per-head output similarities (chapter 2);
  ``segmentation``, ``segmentation_eval``: sentence boundaries read from them, scored
- ``gradient_flow``: multi-head Wasserstein gradient flow on the sphere (chapter 3)
- ``sbm``, ``lra``: SBM-Transformer and offline long-range tasks (chapter 4)
- ``provenance``: figures, tables and claims saved with their provenance
- ``prose``: the words of a chapter's summary sentences, computed from its numbers
- ``_validate``: the shared argument checks and their messages
- ``runner``, ``cli``: execute chapters with papermill and build the book; ``pages``
  (figure index, reproduction report), ``htmlcheck`` (browser check), ``interrupts``
  (Ctrl-C as a recorded state)
"""
__version__ = "0.1.0"
