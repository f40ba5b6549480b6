"""What a falsifier test uses: the marker that names the paper claim it falsifies, and the
claim's own judgement (the threshold declared in companion.book.statements).

A falsifier test perturbs the object a paper claim measures (G² set to zero, sentence
labels shuffled, tokens frozen, ...), recomputes the claim's measurement with the same
library function the chapter calls, and asserts that the verdict turns to "differs"
while the unperturbed measurement does not read "differs". Every paper claim of every
inventory has at least one such test (tests/test_statements.py reads the markers).
"""
from __future__ import annotations

from typing import Any

import pytest

from companion.book.statements import inventory


def falsifies(claim_id: str):
    """Mark a test as the falsifier of paper claim ``claim_id`` (``@falsifies("hasse-...")``)."""
    return pytest.mark.falsifies(claim_id)


def verdict(claim_id: str, measured: Any, interval: Any = None) -> str:
    """The verdict paper claim ``claim_id`` gives ``measured`` (and its ``interval``)."""
    chapter = next(name for name in ("context_similarity", "gradient_flow", "hasse",
                                     "sbm_transformer")
                   if claim_id.startswith(name.replace("_", "-") + "-"))
    return inventory(chapter).claim(claim_id).judge(measured, interval)


def assert_flips(claim_id: str, original: tuple[Any, Any], perturbed: tuple[Any, Any]) -> None:
    """The claim does not read "differs" on ``original`` = (measured, interval) and reads
    "differs" on ``perturbed``."""
    before = verdict(claim_id, *original)
    after = verdict(claim_id, *perturbed)
    assert before != "differs", f"{claim_id}: the unperturbed measurement {original} differs"
    assert after == "differs", (f"{claim_id}: the falsifier left the verdict at {after!r} "
                                f"(measured {perturbed})")
