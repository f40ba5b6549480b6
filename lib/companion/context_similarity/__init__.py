"""Context similarity (chapter 2): per-head output vectors and their pairwise dot products.

The public API of the chapter is importable from here (``from companion import
context_similarity as cs``); ``segmentation`` and ``segmentation_eval`` read sentence
boundaries from the similarities and score them.
"""
from companion.context_similarity.core import *  # noqa: F401,F403  (the public API)
from companion.context_similarity.core import __all__  # noqa: F401
