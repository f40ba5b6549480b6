"""Hasse diagrams for attention (chapter 1).

- ``masks``: one ``mask_mod`` per mask (the single source), ``materialise`` to a dense
  mask, ``and_masks`` / ``or_masks``
- ``reachability``: the layer graph, Boolean powers, the reachability limit, its
  quotient and Hasse diagram
- ``task_merge``: a family of tasks' minimal common supergraph, and the mask it gives
- ``masked_transformer``: a small transformer that attends through any of these masks
"""
