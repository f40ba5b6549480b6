"""Judging a claim: the acceptance region of what the paper says, and the verdict.

A *claim* states what a paper says; a *check* is our own target. Both are judged the same
way (:func:`judge_claim`); a check's verdict reads holds / fails and is never counted as a
reproduction (:data:`CHECK_VERDICTS`).
"""
from __future__ import annotations

import math
from typing import Any

from companion._validate import check_number, describe

VERDICTS = ("reproduced", "differs", "inconclusive", "not comparable")
# A check (our own target, an implementation check, another paper's statement) is judged
# like a claim but reads holds / fails, and is never counted as a reproduction.
CHECK_VERDICTS = {"reproduced": "holds", "differs": "fails", "inconclusive": "inconclusive"}
ROLES = ("paper", "check")
CLAIM_KINDS = ("holds", "abs", "rel", "range", "at_most", "at_least")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(float(x))


def check_tolerance(tolerance: Any) -> float:
    """A tolerance: a real number >= 0 (infinity allowed: no constraint), else raise."""
    return check_number("tolerance", tolerance, minimum=0, finite=False)


_MEASURED = "a number or a bool (or a 1-element tensor)"


def scalar_measured(measured: Any) -> Any:
    """``measured`` with a one-element tensor or array turned into its Python scalar."""
    if isinstance(measured, (list, tuple)) or not hasattr(measured, "item"):
        return measured
    shape = getattr(measured, "shape", None)
    if shape is not None and math.prod(shape) != 1:
        raise TypeError(f"measured: expected {_MEASURED}, got a tensor of shape {tuple(shape)}")
    if getattr(getattr(measured, "device", None), "type", None) == "meta":
        raise ValueError("measured: expected a tensor with values, got one on the meta device")
    try:
        return measured.item()
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"measured: expected {_MEASURED}, got {describe(measured)}") from exc


def acceptance_region(paper: Any, tolerance: Any, kind: str) -> tuple[float, float]:
    """The measured values ``[lo, hi]`` that agree with ``paper`` for a numeric ``kind``.

    - "abs": ``[p - tol, p + tol]``; "rel": ``[p - tol |p|, p + tol |p|]``;
    - "range": ``paper = (lo, hi)`` itself;
    - "at_most": ``(-inf, p + tol]``; "at_least": ``[p - tol, inf)`` (tolerance optional).

    >>> acceptance_region(-1.0, 0.5, "abs")
    (-1.5, -0.5)
    >>> acceptance_region(0.3, None, "at_least")
    (0.3, inf)
    """
    if kind not in CLAIM_KINDS or kind == "holds":
        raise ValueError(f"kind: expected one of {CLAIM_KINDS[1:]} (numeric), got {kind!r}")
    if kind == "range":
        if not (isinstance(paper, (tuple, list)) and len(paper) == 2
                and all(_is_number(v) for v in paper)):
            raise ValueError(f"paper: kind 'range' expects (lo, hi), got {paper!r}")
        lo, hi = float(paper[0]), float(paper[1])
        if lo > hi:
            raise ValueError(f"paper: kind 'range' expects lo <= hi, got {paper!r}")
        return lo, hi
    if not _is_number(paper):
        raise ValueError(f"paper: kind {kind!r} expects a number, got {paper!r}")
    if kind in ("abs", "rel") and tolerance is None:
        raise ValueError(f"tolerance: kind {kind!r} needs a tolerance")
    tol = 0.0 if tolerance is None else check_tolerance(tolerance)
    p = float(paper)
    if kind == "abs":
        return p - tol, p + tol
    if kind == "rel":
        return p - tol * abs(p), p + tol * abs(p)
    if kind == "at_most":
        return -math.inf, p + tol
    return p - tol, math.inf


def check_interval(interval: Any) -> tuple[float, float]:
    if not (isinstance(interval, (tuple, list)) and len(interval) == 2):
        raise ValueError(f"interval: expected (lo, hi), got {interval!r}")
    if hasattr(interval[0], "item"):
        interval = tuple(v.item() for v in interval)
    if not all(_is_number(v) for v in interval) or float(interval[0]) > float(interval[1]):
        raise ValueError(f"interval: expected finite numbers lo <= hi, got {interval!r}")
    return float(interval[0]), float(interval[1])


def judge_claim(measured: Any, paper: Any, tolerance: Any, kind: str,
                interval: Any = None) -> str:
    """The verdict of a claim: "reproduced", "differs", "inconclusive" or "not comparable".

    - paper == "not available" (or None): not comparable, we have no value to compare;
    - kind "holds": ``measured`` is a bool saying whether the statement holds;
    - numeric kinds: ``measured`` agrees when it lies in :func:`acceptance_region`
      ("abs": |measured - paper| <= tolerance; "rel": <= tolerance * |paper|; "range":
      lo <= measured <= hi; "at_most": measured <= paper + tolerance; "at_least":
      measured >= paper - tolerance).
    - with ``interval = (lo, hi)`` (the uncertainty interval of ``measured``, e.g. a
      bootstrap interval) the interval decides instead of the point: reproduced when it
      lies inside the acceptance region, differs when it lies wholly outside, and
      inconclusive when it straddles the region's boundary.
    A measurement that is NaN or infinite differs.

    >>> judge_claim(-0.95, -1.0, 0.5, "abs", interval=(-1.1, -0.8))
    'reproduced'
    >>> judge_claim(0.36, 0.342, None, "at_least", interval=(0.33, 0.39))
    'inconclusive'
    """
    if kind not in CLAIM_KINDS:
        raise ValueError(f"kind: expected one of {CLAIM_KINDS}, got {kind!r}")
    if paper is None or (isinstance(paper, str) and paper == "not available"):
        return "not comparable"
    if kind == "holds":
        if interval is not None:
            raise ValueError("interval: kind 'holds' takes no interval")
        if not isinstance(measured, bool):
            raise TypeError(f"measured: kind 'holds' expects a bool, got {type(measured).__name__}")
        return "reproduced" if measured else "differs"
    if isinstance(paper, str):
        raise ValueError(f"paper: kind {kind!r} needs a number or (lo, hi), got {paper!r}")
    accept_lo, accept_hi = acceptance_region(paper, tolerance, kind)
    if not _is_number(measured):
        if isinstance(measured, float) or hasattr(measured, "item"):
            return "differs"
        raise TypeError(f"measured: kind {kind!r} expects a number, got {measured!r}")
    if interval is not None:
        lo, hi = check_interval(interval)
        if accept_lo <= lo and hi <= accept_hi:
            return "reproduced"
        if hi < accept_lo or lo > accept_hi:
            return "differs"
        return "inconclusive"
    m = float(measured)
    return "reproduced" if accept_lo <= m <= accept_hi else "differs"


def rule_words(kind: str, value: Any, tolerance: Any = None) -> str:
    """What a measured value must satisfy, in words: "at least 0.3", "between 0.2 and 0.4",
    "within 0.05 of 1". One function for paper claims' thresholds and checks' rules.

    >>> rule_words("at_most", 0.1), rule_words("abs", 1.0, 0.05), rule_words("rel", 2.0, 0.1)
    ('at most 0.1', 'within 0.05 of 1', 'within 10 % of 2')
    >>> rule_words("range", (0.2, 0.4)), rule_words("at_least", 0.3, 0.01)
    ('between 0.2 and 0.4', 'at least 0.3 (with a slack of 0.01)')
    """
    d = describe_value
    if kind == "holds":
        return "the statement holds"
    if kind == "range":
        return f"between {d(float(value[0]))} and {d(float(value[1]))}"
    slack = "" if not tolerance else f" (with a slack of {d(float(tolerance))})"
    if kind == "at_most":
        return f"at most {d(float(value))}{slack}"
    if kind == "at_least":
        return f"at least {d(float(value))}{slack}"
    if kind == "abs":
        return f"within {d(float(tolerance))} of {d(float(value))}"
    return f"within {d(100 * float(tolerance))} % of {d(float(value))}"


def describe_value(value: Any) -> str:
    """A claim's value as its box and the report print it: 4 significant digits, a bool
    as holds / does not hold, a pair as an interval.

    >>> describe_value(0.123456), describe_value(True), describe_value((0.25, 1.0))
    ('0.1235', 'holds', '[0.25, 1]')
    """
    if isinstance(value, bool):
        return "holds" if value else "does not hold"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return f"[{describe_value(value[0])}, {describe_value(value[1])}]"
    return str(value)
