"""SBM-Transformer (chapter 4): attention on a graph sampled per head from a stochastic
block model (fastRG), with straight-through gradients.

The public API is importable from here (``from companion import sbm``);
``graph_attention`` holds attention over an edge list (the cost linear in the edges).
"""
from companion.sbm.core import *  # noqa: F401,F403  (the public API)
from companion.sbm.core import __all__  # noqa: F401
