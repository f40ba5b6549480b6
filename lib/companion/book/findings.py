"""The answer first: the Findings page, the report's coverage table, and the verdicts that
moved since the previous build.

Everything here is computed from what the chapters recorded: their statement inventories
(``<assets>/<chapter>/inventory.json``, :func:`companion.book.records.record_inventory`),
their claim records and their run records. Nothing is typed by hand.

- :func:`findings_page`: per paper, a few generated sentences and the statements grouped
  by outcome (differs, inconclusive, reproduced, not testable here), each linked to the
  claim that tests it; the scale, model and device of the run; and what would change it.
  Lists, not tables, so that it reads on a phone without sideways scrolling.
- :func:`coverage_section`: the report's opening table of statements by status.
- :func:`verdict_history`: the claim verdicts of the previous build that differed from
  this one's (kept in ``book/_generated/claims_history.json``), for the report's "Changes
  since the previous build".
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Any

from companion.book import myst
from companion.book.claims_diff import compare
from companion.book.files import atomic_write_text, now_iso

# A statement tested by several claims takes the outcome a reader must see first.
OUTCOME_ORDER = ("differs", "inconclusive", "not comparable", "reproduced")
_COVERAGE_VERDICTS = ("reproduced", "differs", "inconclusive")


def load_inventory(project, name: str) -> dict | None:
    """The inventory a chapter's last run recorded (``inventory.json``), or None."""
    from companion.book.pages import SidecarError

    path = project.assets(name) / "inventory.json"
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise SidecarError(f"{path}: not an inventory record ({exc}); re-run the chapter "
                           f"with `python -m companion run {name} --force`") from exc
    if not isinstance(record, dict) or not isinstance(record.get("statements"), list):
        raise SidecarError(f"{path}: not an inventory record (no 'statements' list); re-run "
                           f"the chapter with `python -m companion run {name} --force`")
    return record


def statement_outcome(row: dict[str, Any]) -> str:
    """One statement's outcome: its status unless tested; tested, the first of
    :data:`OUTCOME_ORDER` among its claims' verdicts.

    >>> statement_outcome({"status": "tested", "verdicts": {"a": "reproduced", "b": "differs"}})
    'differs'
    >>> statement_outcome({"status": "not comparable", "verdicts": {}})
    'not comparable'
    """
    if row["status"] != "tested":
        return row["status"]
    verdicts = set(row.get("verdicts", {}).values())
    return next((v for v in OUTCOME_ORDER if v in verdicts), "not comparable")


def coverage_counts(inventory: dict) -> Counter:
    """Per inventory: statements, tested, not comparable, not run at this scale, and the
    tested statements by outcome (:func:`statement_outcome`).

    >>> c = coverage_counts({"statements": [
    ...     {"status": "tested", "verdicts": {"a": "differs", "b": "reproduced"}},
    ...     {"status": "not comparable", "verdicts": {}}]})
    >>> c["statements"], c["tested"], c["differs"], c["reproduced"], c["not comparable"]
    (2, 1, 1, 0, 1)
    """
    counts: Counter = Counter()
    for row in inventory.get("statements", []):
        counts["statements"] += 1
        outcome = statement_outcome(row)
        if row["status"] == "tested" and outcome != "not comparable":
            counts["tested"] += 1
            counts[outcome] += 1
        elif outcome == "not comparable":  # by nature, or its claims could not be judged
            counts["not comparable"] += 1
        else:
            counts[row["status"]] += 1
    return counts


def coverage_section(project) -> list[str]:
    """The report's opening table: each paper's checkable statements and how many are
    tested (by outcome), not comparable here, or not run at the build's scale."""
    from companion.book.pages import chapter_title

    out = ["## What each paper states, and what is tested", "",
           "Each chapter lists every checkable statement of its paper (its inventory, at the "
           "end of the chapter): tested by one or more paper claims, or *not comparable* "
           "here, with the reason. A statement tested by several claims takes the outcome a "
           "reader must see first (differs, then inconclusive).", "",
           "````{container} report-summary",
           "| Chapter | Statements | Tested, by outcome | Not tested here |",
           "|---|---|---|---|"]
    badges = {"reproduced": "bdg-success", "differs": "bdg-danger",
              "inconclusive": "bdg-warning"}
    for name in project.toc_chapters():
        inv = load_inventory(project, name)
        title = chapter_title(project, name)
        if inv is None:
            out.append(f"| {title} | no inventory recorded | | |")
            continue
        c = coverage_counts(inv)
        tested = " ".join([f"**{c['tested']}**"] + [
            f"{{{badges[v]}}}`{c[v]} {v}`" for v in _COVERAGE_VERDICTS if c[v]])
        untested = ", ".join(f"{c[k]} {k}" for k in ("not comparable", "not run at this scale")
                             if c[k]) or "none"
        out.append(f"| {title} | {c['statements']} | {tested} | {untested} |")
    return out + ["````", ""]


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else (plural or word + 's')}"


def findings_sentences(counts: Counter) -> str:
    """The generated summary of one paper's inventory.

    >>> text = findings_sentences(Counter({"statements": 5, "tested": 3, "reproduced": 2,
    ...                                    "differs": 1, "not comparable": 2}))
    >>> for part in text.split(": "): print(part)
    Of its 5 checkable statements, 3 are tested here
    2 reproduced, 1 differs. 2 cannot be compared here.
    """
    tested = counts["tested"]
    parts = [f"{counts[v]} {v}" for v in ("reproduced", "differs", "inconclusive")
             if counts[v]]
    text = (f"Of its {_plural(counts['statements'], 'checkable statement')}, "
            f"{tested} {'is' if tested == 1 else 'are'} tested here"
            + (f": {', '.join(parts)}." if parts else "."))
    if counts["not comparable"]:
        text += f" {counts['not comparable']} cannot be compared here."
    if counts["not run at this scale"]:
        text += (f" {counts['not run at this scale']} "
                 f"{'is' if counts['not run at this scale'] == 1 else 'are'} tested only at "
                 "another scale.")
    return text


_GROUP_TITLES = {"differs": "Differs from the paper", "inconclusive": "Inconclusive",
                 "reproduced": "Reproduced",
                 "not comparable": "Cannot be tested here",
                 "not run at this scale": "Tested only at another scale"}


def _short(text: str, limit: int = 160) -> str:
    text = myst.one_line(text)
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " …"


def _statement_item(row: dict[str, Any], outcome: str) -> str:
    quote = _short(row["quote"])
    links = ", ".join(myst.role("ref", f"{verdict} <{cid}>")
                      for cid, verdict in row.get("verdicts", {}).items())
    if outcome == "not comparable" and not links:
        return f"- “{quote}” ({row['place']}): {myst.one_line(row['not_comparable'])}"
    if outcome == "not comparable":  # its claims could not be judged in this run: why
        return f"- “{quote}” ({row['place']}): not judged in this run, see {links}"
    if outcome == "not run at this scale":
        return f"- “{quote}” ({row['place']}): tested by {', '.join(row['claims'])}"
    return f"- “{quote}” ({row['place']}): {links}"


def findings_page(project) -> str:
    """The Findings page: per paper, what holds, what does not, what could not be tested,
    and where each verdict came from."""
    from companion.book.pages import HEADER, _run_state, chapter_title

    lines = [HEADER, "# Findings", "",
             "What the book finds, paper by paper, generated from the records of this "
             "build. Each paper's checkable statements are tested by a paper claim, whose "
             "verdict links to its box in the chapter, or cannot be compared here, with the "
             "reason. *Reproduced*: our measurement, with its interval, lies within the "
             "threshold; *differs*: it lies outside; *inconclusive*: its interval straddles "
             "the threshold. The [reproduction report](reproduction_report.md) has every "
             "claim and check in full.", ""]
    for name in project.toc_chapters():
        title = chapter_title(project, name)
        lines += [f"## {title}", ""]
        inv = load_inventory(project, name)
        stale, record = _run_state(project, name)
        if inv is None:
            lines += [f"This chapter recorded no inventory in this build: "
                      f"`python -m companion run {name}` records it.", ""]
            continue
        counts = coverage_counts(inv)
        params = (record or {}).get("parameters") or {}
        scale = params.get("scale") or inv.get("scale", "unknown")
        device = (record or {}).get("device") or inv.get("device", "unknown")
        setting = inv.get("setting")
        where = (f"Run at **{scale}** scale on `{device}`"
                 + (f", {myst.one_line(setting)}" if setting else "") + ".")
        lines += [findings_sentences(counts) + " " + where, ""]
        if stale:
            lines += ["**The last run of this chapter failed: these are the records of its "
                      "last good run.**", ""]
        groups: dict[str, list[str]] = {}
        for row in inv["statements"]:
            outcome = statement_outcome(row)
            groups.setdefault(outcome, []).append(_statement_item(row, outcome))
        for outcome in ("differs", "inconclusive", "reproduced", "not comparable",
                        "not run at this scale"):
            if groups.get(outcome):
                lines += [f"**{_GROUP_TITLES[outcome]}**", "", *groups[outcome], ""]
        change = []
        if scale != "paper":
            change.append(f"a run at the paper's sizes (`python -m companion run {name} "
                          "--scale paper`)")
        if counts["not comparable"]:
            change.append("what the statements under *Cannot be tested here* name")
        if change:
            lines += ["What would change these verdicts: " + "; ".join(change) + ".", ""]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- history
HISTORY_FILE = "claims_history.json"


def _snapshot(project) -> dict[str, dict[str, Any]]:
    from companion.book.pages import _load_sidecars

    out = {}
    for name in project.toc_chapters():
        folder = project.assets(name) / "claims"
        if folder.exists():
            for c in _load_sidecars(folder, name, "claim"):
                out[c["id"]] = {k: c.get(k) for k in ("id", "role", "verdict", "measured",
                                                       "interval", "git_commit", "scale")}
    return out


def verdict_history(project) -> tuple[list[dict], str | None]:
    """The claims whose verdict moved between the previous build and this one, and when the
    previous build was made.

    The claims of each build are kept in ``<generated>/claims_history.json`` (this build's
    and the previous one's); a build whose claims are those of the last one recorded leaves
    the file as it is, so a rebuild without changes does not erase the previous build.
    """
    path = project.generated / HISTORY_FILE
    history: dict[str, Any] = {}
    if path.exists():
        try:
            history = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            history = {}
    now = _snapshot(project)
    current = history.get("current") or {}
    if current.get("claims") != now:
        history = {"previous": current or None,
                   "current": {"claims": now, "recorded": now_iso()}}
        project.generated.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(history, indent=1, sort_keys=True) + "\n")
    previous = history.get("previous")
    if not previous:
        return [], None
    rows = [r for r in compare(previous["claims"], now)
            if r["change"] in ("verdict", "only old", "only new")]
    return rows, previous.get("recorded")


def changes_section(project) -> list[str]:
    """The report's "Changes since the previous build": verdicts that moved."""
    rows, when = verdict_history(project)
    out = ["## Changes since the previous build", ""]
    if when is None:
        return out + ["This is the first build recorded here: nothing to compare with.", ""]
    if not rows:
        return out + [f"No verdict moved since the build of {when[:16].replace('T', ' ')}.", ""]
    out += [f"Verdicts that moved since the build of {when[:16].replace('T', ' ')}:", ""]
    for r in rows:
        if r["change"] == "only new":
            out.append(f"- `{r['id']}`: new, {r['new_verdict']}")
        elif r["change"] == "only old":
            out.append(f"- `{r['id']}`: no longer recorded (was {r['old_verdict']})")
        else:
            out.append(f"- `{r['id']}`: {r['old_verdict']} → {r['new_verdict']}")
    return out + [""]
