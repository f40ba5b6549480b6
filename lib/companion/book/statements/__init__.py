"""What each paper states, and how the book tests it: the chapters' statement inventories.

Every checkable statement of a paper is a :class:`Statement` of its chapter's module
(``companion.book.statements.<chapter>``): the paper's words, where they stand, and either
the paper claims that test it or why it cannot be compared here ("needs a GPU", "needs GLUE
data, which cannot be installed here", "a theorem with no computable consequence at this
size").

A *paper claim* is declared once, as a :class:`PaperClaim` of the same module: the
statement it tests, its :class:`Threshold` (the paper's number, or a tolerance of ours with
its reason, and whether that tolerance was set after seeing a result), what its interval
resamples, and its *falsifier*: the perturbation of the measured object that must turn
the verdict to "differs". The chapter only supplies what it measured
(:func:`companion.book.records.claim`); the tests apply each falsifier to the same
measurement and judge it with the same threshold (:meth:`PaperClaim.judge`).

The chapter records its inventory at the end of its run
(:func:`companion.book.records.record_inventory`), with the verdict of each claim of that
run; the reproduction report opens with the coverage it gives.
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from typing import Any

from companion.book.claims import CLAIM_KINDS, acceptance_region, judge_claim, rule_words

# Where a statement is known from (papers/SOURCES.md): the paper's abstract, the authors'
# code and README, or only a secondary summary of the paper.
SOURCES = ("abstract", "authors' code", "secondary summary")
THRESHOLD_BY = ("paper", "ours")
_ID = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


@dataclass(frozen=True)
class Threshold:
    """What the measured value must satisfy for "reproduced", and whose rule that is.

    Parameters
    ----------
    kind : "holds", "abs", "rel", "range", "at_most" or "at_least" (see
        :func:`companion.book.claims.judge_claim`).
    value : the paper's number (or ``(lo, hi)`` for "range"; ``"qualitative"`` for
        "holds"), or, with ``by="ours"``, the number we set.
    by : "paper" when the number (and its direction) is the paper's own; "ours" when the
        paper gives none and the rule is a tolerance of ours.
    reason : why this rule (required for "ours"; for "paper", where the number stands).
    tolerance : slack around ``value`` (kinds "abs", "rel" need it). A tolerance is always
        ours: a threshold with one is labelled ours unless ``reason`` says the paper gave it.
    set_after_result : empty when the rule was fixed before any run; otherwise the commit
        and what changed ("3f2a1c0: widened from 0.05 after the first ci build").
    """

    kind: str
    value: Any
    by: str
    reason: str
    tolerance: float | None = None
    set_after_result: str = ""

    def __post_init__(self) -> None:
        if self.kind not in CLAIM_KINDS:
            raise ValueError(f"kind: expected one of {CLAIM_KINDS}, got {self.kind!r}")
        if self.by not in THRESHOLD_BY:
            raise ValueError(f"by: expected one of {THRESHOLD_BY}, got {self.by!r}")
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise ValueError("reason: expected why this threshold (and whose it is)")
        if self.kind == "holds":
            if self.value != "qualitative":
                raise ValueError("value: kind 'holds' takes value 'qualitative'")
        else:
            acceptance_region(self.value, self.tolerance, self.kind)  # raises when malformed

    def words(self) -> str:
        """The rule in words: "at least 0.3", "between 0.2 and 0.4", "within 0.1 of -1"."""
        return rule_words(self.kind, self.value, self.tolerance)


@dataclass(frozen=True)
class PaperClaim:
    """A statement of the paper, tested as the paper states it.

    Parameters
    ----------
    id : the claim's id (chapter prefix, kebab-case), as the chapter records it.
    quote : the paper's words (translated where the source is the secondary summary).
    source : one of :data:`SOURCES`.
    place : where it stands: "arXiv 2605.18870, Theorem 4.16 (per the authors' code
        README)", "arXiv 2512.21956, abstract", "(secondary summary), results".
    threshold : the :class:`Threshold` the measurement is judged against.
    falsifier : the perturbation of the measured object that must turn the verdict to
        "differs" (a test applies it at smoke scale).
    resamples : what the interval resamples ("initial tokens and weights: 10 draws"),
        empty for an exact statement of kind "holds".
    level : the interval's level.
    """

    id: str
    quote: str
    source: str
    place: str
    threshold: Threshold
    falsifier: str
    resamples: str = ""
    level: float = 0.95

    def __post_init__(self) -> None:
        if not _ID.match(self.id):
            raise ValueError(f"id: expected a kebab-case claim id, got {self.id!r}")
        if self.source not in SOURCES:
            raise ValueError(f"source: expected one of {SOURCES}, got {self.source!r}")
        for name in ("quote", "place", "falsifier"):
            if not str(getattr(self, name)).strip():
                raise ValueError(f"{name}: expected a non-empty string ({self.id})")
        if self.threshold.kind != "holds" and not self.resamples.strip():
            raise ValueError(f"resamples: a numeric claim says what its interval resamples "
                             f"({self.id})")

    def judge(self, measured: Any, interval: Any = None) -> str:
        """The verdict of ``measured`` (with its ``interval``) against this threshold."""
        t = self.threshold
        return judge_claim(measured, t.value, t.tolerance, t.kind, interval=interval)


@dataclass(frozen=True)
class Statement:
    """A checkable statement of the paper, and how the book tests it.

    Exactly one of ``claims`` (the ids of the paper claims that test it) and
    ``not_comparable`` (why it cannot be compared here) is given.
    """

    id: str
    quote: str
    source: str
    place: str
    claims: tuple[str, ...] = field(default_factory=tuple)
    not_comparable: str = ""

    def __post_init__(self) -> None:
        if not _ID.match(self.id):
            raise ValueError(f"id: expected a kebab-case statement id, got {self.id!r}")
        if self.source not in SOURCES:
            raise ValueError(f"source: expected one of {SOURCES}, got {self.source!r}")
        if bool(self.claims) == bool(self.not_comparable.strip()):
            raise ValueError(f"statement {self.id}: give either the claims that test it or "
                             "why it is not comparable, not both or neither")


@dataclass(frozen=True)
class Inventory:
    """A chapter's statements and paper claims (its module's STATEMENTS and CLAIMS)."""

    chapter: str
    statements: tuple[Statement, ...]
    claims: dict[str, PaperClaim]

    def claim(self, claim_id: str) -> PaperClaim:
        try:
            return self.claims[claim_id]
        except KeyError:
            raise ValueError(
                f"claim_id: {claim_id!r} is not a paper claim declared in "
                f"companion.book.statements.{self.chapter} (declare its quote, place, "
                "threshold and falsifier there, or record it with role='check')") from None


def inventory(chapter: str) -> Inventory:
    """The inventory of ``chapter`` (``companion.book.statements.<chapter>``), checked:
    unique ids, every paper claim tested by some statement, every statement's claims
    declared.

    >>> inv = inventory("hasse")
    >>> inv.chapter, all(c.id.startswith("hasse-") for c in inv.claims.values())
    ('hasse', True)
    """
    module = importlib.import_module(f"companion.book.statements.{chapter}")
    claims_list = list(getattr(module, "CLAIMS", ()))
    statements = tuple(getattr(module, "STATEMENTS", ()))
    claims = {c.id: c for c in claims_list}
    if len(claims) != len(claims_list):
        raise ValueError(f"{chapter}: a paper claim id is declared twice")
    prefix = chapter.replace("_", "-") + "-"
    ids = [s.id for s in statements]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{chapter}: a statement id is declared twice")
    tested = set()
    for s in statements:
        for c in s.claims:
            if c not in claims:
                raise ValueError(f"{chapter}: statement {s.id} names an undeclared claim {c!r}")
            tested.add(c)
    for c in claims.values():
        if not c.id.startswith(prefix):
            raise ValueError(f"{chapter}: claim id {c.id!r} must start with {prefix!r}")
        if c.id not in tested:
            raise ValueError(f"{chapter}: paper claim {c.id!r} tests no statement of the "
                             "inventory")
    return Inventory(chapter=chapter, statements=statements, claims=claims)
