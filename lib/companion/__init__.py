"""companion: the shared library of *Attention, Reproduced*.

Plain functions on torch tensors, CPU and GPU alike; one package per chapter, and in each
a ``reference`` module that reads like the paper's equations beside the fast code
(``tests/test_fast_equals_reference.py`` holds every pair together).

- ``hasse``: masks (one ``mask_mod`` per mask, ``materialise``, ``and_masks`` /
  ``or_masks``), reachability, task_merge, masked_transformer, draw (chapter 1)
- ``context_similarity``: encoder, capture (``hook_z`` / ``hook_pattern``), topk, stats,
  corpus (the corpus pass), segmentation and segmentation_eval (chapter 2)
- ``gradient_flow``: kernels, simulation, analysis (chapter 3)
- ``sbm``: fastrg, graph_attention, layer; ``lra``: the offline long-range tasks, the
  model, training and the chapter's experiments (chapter 4)
- shared: ``_validate`` (argument checks and their messages), ``devices``, ``timing``
  (timed calls), ``parallel`` (a library function under ``torchrun`` from a notebook),
  ``corpora`` (the bundled English corpora)
- ``book``: the book's machinery (chapter, records, claims, citations, myst, source, runner,
  project, pages, htmlcheck, cli, prose, site, claims_diff, ...). No science package
  imports it.
"""
__version__ = "0.1.0"
