"""Kept only for ``benchmarks/gpu_paper_sbm.py`` (``from companion.book.provenance import
git_state``): the module was split into :mod:`companion.book.chapter`,
:mod:`companion.book.records`, :mod:`companion.book.claims`,
:mod:`companion.book.citations`, :mod:`companion.book.files` and
:mod:`companion.book.gitstate`. Delete it once that script imports
``companion.book.gitstate``.
"""
from companion.book.gitstate import git_state

__all__ = ["git_state"]
