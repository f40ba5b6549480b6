"""Compare the claim records of two builds: which verdicts changed, which values moved.

Two uses: a refactor must leave every claim value identical (or equal within float
rounding), and a paper-scale build is read against a ci build (the thresholds are the
same; the intervals narrow, and some verdicts change). A *build* here is any folder that
holds claim records at ``<chapter>/claims/<id>.json`` below it, e.g.
``book/_generated/assets`` of a checkout, or a copy of it.

``python -m companion.book.claims_diff OLD NEW`` prints a Markdown table of the differences;
``--identical`` makes it exit 1 when any verdict differs or any value differs by more
than ``--rtol`` (relative, default 1e-9), for a check in a script.

>>> a = {"id": "x", "verdict": "reproduced", "measured": 1.0, "interval": [0.5, 1.5]}
>>> b = dict(a, verdict="differs", measured=1.2)
>>> [r["change"] for r in compare({"x": a}, {"x": b})]
['verdict']
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

__all__ = ["load_claims", "compare", "markdown", "main"]


def load_claims(folder: Path) -> dict[str, dict[str, Any]]:
    """Every claim record below ``folder`` (``**/claims/*.json``), by claim id.

    Raises ``FileNotFoundError`` when ``folder`` does not exist and ``ValueError`` naming
    the file when a record is not valid JSON or has no ``id``.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"folder: {folder} is not a folder of claim records")
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob("**/claims/*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path.name}: not a readable claim record ({exc})") from None
        if not isinstance(record, dict) or "id" not in record:
            raise ValueError(f"{path.name}: a claim record needs an 'id'")
        out[str(record["id"])] = record
    return out


def _close(a: Any, b: Any, rtol: float) -> bool:
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return math.isclose(a, b, rel_tol=rtol, abs_tol=rtol * 1e-3)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y, rtol) for x, y in zip(a, b))
    return a == b


def _width(interval: Any) -> float | None:
    if (isinstance(interval, (list, tuple)) and len(interval) == 2
            and all(isinstance(v, (int, float)) for v in interval)):
        return float(interval[1]) - float(interval[0])
    return None


def compare(old: dict[str, dict], new: dict[str, dict], *, rtol: float = 1e-9) -> list[dict]:
    """One row per claim that differs between ``old`` and ``new`` (by id).

    A row has ``id``, ``role``, ``change`` ("verdict", "value", "interval", "only old",
    "only new"), both verdicts, values, intervals and the ratio of interval widths
    (new / old; below 1 when the new build's interval is narrower).
    """
    rows = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        row = {"id": key, "role": (b or a).get("role", "paper")}
        if a is None or b is None:
            row["change"] = "only new" if a is None else "only old"
        elif a.get("verdict") != b.get("verdict"):
            row["change"] = "verdict"
        elif not _close(a.get("measured"), b.get("measured"), rtol):
            row["change"] = "value"
        elif not _close(a.get("interval"), b.get("interval"), rtol):
            row["change"] = "interval"
        else:
            continue
        for side, rec in (("old", a), ("new", b)):
            rec = rec or {}
            row[f"{side}_verdict"] = rec.get("verdict")
            row[f"{side}_value"] = rec.get("measured")
            row[f"{side}_interval"] = rec.get("interval")
            row[f"{side}_scale"] = rec.get("scale")
        wa, wb = _width(row["old_interval"]), _width(row["new_interval"])
        row["width_ratio"] = (wb / wa) if wa and wb is not None else None
        rows.append(row)
    return rows


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return "—" if value is None else str(value)


def markdown(rows: list[dict], n_old: int, n_new: int) -> str:
    """The rows as a Markdown table, after a one-line count."""
    verdicts = sum(r["change"] == "verdict" for r in rows)
    head = (f"{n_old} claims before, {n_new} after; {len(rows)} differ, "
            f"{verdicts} of them in verdict.")
    if not rows:
        return head
    lines = [head, "", "| claim | role | change | verdict | value | interval | width ratio |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| `{r['id']}` | {r['role']} | {r['change']} | "
            f"{_fmt(r.get('old_verdict'))} → {_fmt(r.get('new_verdict'))} | "
            f"{_fmt(r.get('old_value'))} → {_fmt(r.get('new_value'))} | "
            f"{_fmt(r.get('old_interval'))} → {_fmt(r.get('new_interval'))} | "
            f"{_fmt(r.get('width_ratio'))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m companion.book.claims_diff",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path, help="folder with <chapter>/claims/*.json below it")
    parser.add_argument("new", type=Path)
    parser.add_argument("--rtol", type=float, default=1e-9,
                        help="relative tolerance for values (default 1e-9)")
    parser.add_argument("--identical", action="store_true",
                        help="exit 1 when any claim differs")
    args = parser.parse_args(argv)
    if not (args.rtol >= 0):
        parser.error(f"--rtol: expected a number >= 0, got {args.rtol}")
    old, new = load_claims(args.old), load_claims(args.new)
    rows = compare(old, new, rtol=args.rtol)
    print(markdown(rows, len(old), len(new)))
    return 1 if (args.identical and rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
