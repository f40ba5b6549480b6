"""The checkable statements of the sbm_transformer chapter's paper, and its paper claims.

See :mod:`companion.book.statements` for what a :class:`Statement` and a
:class:`PaperClaim` hold. The chapter records each claim by id; the tests in
`tests/test_falsifiers_sbm_transformer.py` apply each claim's falsifier.
"""
from companion.book.statements import PaperClaim, Statement, Threshold  # noqa: F401

CLAIMS: list[PaperClaim] = []

STATEMENTS: list[Statement] = []
