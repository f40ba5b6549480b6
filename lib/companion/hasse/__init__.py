"""Hasse diagrams for attention (chapter 1).

- ``masks``: one ``mask_mod`` per mask (the single source), ``materialise`` to a dense
  mask, ``and_masks`` / ``or_masks``
- ``reachability``: the layer graph, Boolean powers, the reachability limit, its
  quotient and Hasse diagram; it re-exports ``long_sequences`` (bit-packed, for long
  sequences: ``packed_order_structure``) and rests on ``closure`` (the bitset closure,
  classes and covering edges) and ``depth`` (the depth ``L*``: closed form for interval
  rows, else a bit-parallel search)
- ``reference``: the same definitions as plain code (dense products, loops), against
  which the fast paths are tested
- ``draw``: heat maps of masks and of reachability by layer, Hasse diagram layouts
- ``task_merge``: a family of tasks' minimal common supergraph, and the mask it gives
- ``masked_transformer``: a small transformer that attends through any of these masks
- ``paper_measures``: what the chapter measures for each statement of the paper, and the
  perturbed objects (falsifiers) that must turn each measurement against it
"""
