"""Multi-head Wasserstein gradient flow on the sphere (chapter 3).

The public API is importable from here (``from companion import gradient_flow as gf``).
"""
from companion.gradient_flow.core import *  # noqa: F401,F403  (the public API)
from companion.gradient_flow.core import __all__  # noqa: F401
