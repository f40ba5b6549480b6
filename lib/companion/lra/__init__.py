"""Offline long-range tasks for the SBM-Transformer chapter (Long Range Arena style).

- ``listops``: ListOps generator (original grammar and string format), an independent
  evaluator, LRA's tokenisation;
- ``pathfinder``: Pathfinder images (paddle paths, distractors), flattened to pixels;
- ``loaders``: CIFAR-10 grey, IMDB bytes, AAN pairs for users who have the data, and a
  named offline image stand-in;
- ``model``: the LRA encoder classifier with SBM or dense softmax attention;
- ``dropout``: inverted dropout with torch's numbers and faster CPU masks (PCG64);
- ``train``: AdamW + OneCycle training, best-dev evaluation, density tracking, DDP.

``model``, ``dropout`` and ``train`` import torch-heavy code; import them explicitly.
"""
from companion.lra import listops, loaders, pathfinder

__all__ = ["listops", "loaders", "pathfinder"]
