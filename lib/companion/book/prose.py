"""Sentences built from a run's numbers, so that no result in a chapter is typed by hand.

A chapter's summary and captions state results: numbers and comparison words ("above",
"faster", "holds"). Typed by hand, they drift from the numbers when a parameter, a seed
or the code changes. These helpers make the words a function of the values, and
:func:`show` puts the sentence on the page::

    from companion.book import prose
    prose.show(f"Same-sentence pairs are {prose.compare(frac, chance)} chance "
               f"({prose.pct(frac)} vs {prose.pct(chance)}).")

and :func:`claim_phrase` states a recorded claim's verdict with its interval.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from companion._validate import check_number
from companion.book.records import display_markdown

__all__ = ["num", "pct", "interval", "compare", "claim_phrase", "verdict_word", "show"]


def _finite(name: str, x: Any) -> float:
    if hasattr(x, "item"):
        x = x.item()
    if isinstance(x, float) and math.isnan(x):  # a number: callers say what NaN means
        return x
    return check_number(name, x, finite=False)


def num(x: Any, digits: int = 3) -> str:
    """``x`` with ``digits`` significant digits ("nan" and "inf" spelled out).

    >>> num(0.123456), num(1234.5), num(-2e-5, 2)
    ('0.123', '1.23e+03', '-2e-05')
    """
    v = _finite("x", x)
    if math.isnan(v) or math.isinf(v):
        return str(v)
    return f"{v:.{digits}g}"


def pct(x: Any, digits: int = 1) -> str:
    """A fraction as a percentage.

    >>> pct(0.4137)
    '41.4 %'
    """
    return f"{100 * _finite('x', x):.{digits}f} %"


def interval(lo: Any, hi: Any, digits: int = 3, percent: bool = False) -> str:
    """``[lo, hi]`` formatted like :func:`num` (or :func:`pct`).

    >>> interval(0.31, 0.35), interval(0.31, 0.35, percent=True)
    ('[0.31, 0.35]', '[31.0 %, 35.0 %]')
    """
    f = pct if percent else (lambda v: num(v, digits))
    return f"[{f(lo)}, {f(hi)}]"


def compare(a: Any, b: Any, *, more: str = "above", less: str = "below",
            same: str = "equal to", rel_tol: float = 0.0) -> str:
    """The word that compares ``a`` with ``b``: ``more`` if a > b, ``less`` if a < b.

    ``same`` when ``|a - b| <= rel_tol * max(|a|, |b|)`` (exact equality by default).

    >>> compare(0.37, 0.342), compare(1.0, 2.0, more="slower", less="faster")
    ('above', 'faster')
    >>> compare(1.0, 1.001, rel_tol=0.01)
    'equal to'
    """
    x, y = _finite("a", a), _finite("b", b)
    if math.isnan(x) or math.isnan(y):
        raise ValueError(f"a, b: expected numbers to compare, got {a!r} and {b!r}")
    if abs(x - y) <= rel_tol * max(abs(x), abs(y)):
        return same
    return more if x > y else less


def verdict_word(record: Mapping) -> str:
    """The verdict of a claim or check record, as recorded ("reproduced", "holds", ...)."""
    if not isinstance(record, Mapping) or "verdict" not in record:
        raise TypeError(f"record: expected a claim record (what claim() returns), got {record!r}")
    return str(record["verdict"])


def claim_phrase(record: Mapping, digits: int = 3) -> str:
    """One clause stating a recorded claim: its measurement, interval and verdict.

    >>> claim_phrase({"id": "x-a", "measured": 0.37, "interval": [0.33, 0.41],
    ...               "verdict": "inconclusive", "role": "paper"})
    '0.37 (interval [0.33, 0.41]): inconclusive'
    """
    verdict = verdict_word(record)
    measured = record.get("measured")
    if isinstance(measured, bool):
        text = "holds" if measured else "does not hold"
    elif isinstance(measured, (int, float)):
        text = num(measured, digits)
    else:
        text = str(measured)
    if record.get("interval") is not None:
        lo, hi = record["interval"]
        text += f" (interval {interval(lo, hi, digits)})"
    return f"{text}: {verdict}"


def show(markdown: str) -> None:
    """Put MyST markdown on the chapter page (a generated sentence, a summary list)."""
    if not isinstance(markdown, str):
        raise TypeError(f"markdown: expected a str, got {type(markdown).__name__}")
    display_markdown(markdown)
