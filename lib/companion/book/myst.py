"""Every MyST string the book writes: directives and admonitions, the figure and table
directives, claim boxes, the banners and the run box of a chapter page, pipe tables.

The modules that save records (:mod:`companion.book.records`), finish notebooks
(:mod:`companion.book.runner`) and write the generated pages
(:mod:`companion.book.pages`) call these builders; none writes MyST syntax itself.
"""
from __future__ import annotations

import math
import re
from typing import Any

from companion.book import site
from companion.book.claims import describe_value, rule_words

#: The admonition class (its colour) of each verdict.
ADMONITION_CLASS = {"reproduced": "tip", "differs": "warning", "inconclusive": "caution",
                    "not comparable": "note", "holds": "tip", "fails": "warning"}


def one_line(text: Any) -> str:
    """``text`` with every run of whitespace (newlines too) as one space.

    >>> one_line("two\\n  lines ")
    'two lines'
    """
    return " ".join(str(text).split())


def directive(name: str, argument: str = "", body: str = "", *,
              options: dict[str, str] | None = None, fence: str = "```") -> str:
    """A MyST directive: ``{name} argument``, its ``:option: value`` lines, its body.

    A blank line separates the options from the body; without options the body follows
    the directive line. There is no newline after the closing fence.

    >>> print(directive("admonition", "Note", "Body.", options={"class": "tip"}))
    ```{admonition} Note
    :class: tip
    <BLANKLINE>
    Body.
    ```
    """
    head = f"{fence}{{{name}}}" + (f" {argument}" if argument else "") + "\n"
    opts = "".join(f":{key}: {value}\n" for key, value in (options or {}).items())
    return (head + opts + ("\n" if opts and body else "") + (body + "\n" if body else "")
            + fence)


def role(name: str, text: str) -> str:
    """A MyST role: ``{name}`text```.

    >>> role("numref", "hasse-causal-mask")
    '{numref}`hasse-causal-mask`'
    """
    return f"{{{name}}}`{text}`"


# --------------------------------------------------------------------------- tables
def table_cell(text: Any) -> str:
    """``text`` safe in one cell of a pipe table: ``|`` escaped, newlines as spaces.

    The one escaping function of every pipe table the book writes.

    >>> table_cell("a | b\\nc")
    'a \\\\| b c'
    """
    return str(text).replace("|", "\\|").replace("\n", " ")


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return "NaN" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def pipe_table(header: list[Any], rows: list[list[Any]]) -> str:
    """A pipe table; floats to 4 significant digits, every cell :func:`table_cell`-escaped.

    >>> print(pipe_table(["x", "y"], [[1, 0.123456], ["a|b", float("nan")]]), end="")
    | x | y |
    | --- | --- |
    | 1 | 0.1235 |
    | a\\|b | NaN |
    """
    def line(cells: list[Any]) -> str:
        return "| " + " | ".join(table_cell(_format_value(c)) for c in cells) + " |"

    rule = "| " + " | ".join("---" for _ in header) + " |"
    return "\n".join([line(list(header)), rule, *(line(list(r)) for r in rows)]) + "\n"


def markdown_table(df) -> str:
    """A pipe table of a DataFrame (index dropped), floats to 4 significant digits."""
    return pipe_table(list(df.columns), [list(r) for r in df.itertuples(index=False, name=None)])


def list_table(header: list[str], rows: list[list[str]], *,
               options: dict[str, str] | None = None) -> str:
    """A ``{list-table}`` (header row first); a cell may hold several lines, even
    directives, indented under its bullet.

    >>> print(list_table(["A", "B"], [["1", "two\\n\\nlines"]], options={"widths": "1 1"}))
    ````{list-table}
    :header-rows: 1
    :widths: 1 1
    <BLANKLINE>
    * - A
      - B
    * - 1
      - two
    <BLANKLINE>
        lines
    ````
    """
    out: list[str] = []
    for row in [header, *rows]:
        for i, cell in enumerate(row):
            first, *rest = str(cell).rstrip("\n").split("\n")
            out.append(("* - " if i == 0 else "  - ") + first)
            out += ["    " + line if line else line for line in rest]
    return directive("list-table", "", "\n".join(out), fence="````",
                     options={"header-rows": "1", **(options or {})})


def image(path: str, *, width: str, alt: str, target: str) -> str:
    """An ``{image}`` directive."""
    return directive("image", path, options={"width": width, "alt": alt, "target": target})


# --------------------------------------------------------------------------- records
def figure_directive(url: str, figure_id: str, caption: str) -> str:
    """The numbered figure of a chapter page, labelled ``figure_id``."""
    return directive("figure", url, caption.strip(),
                     options={"name": figure_id, "alt": one_line(caption)})


def table_directive(table_id: str, caption: str, table_markdown: str) -> str:
    """The numbered table of a chapter page, labelled ``table_id``."""
    return directive("table", one_line(caption), table_markdown.rstrip("\n"),
                     options={"name": table_id})


def check_rule_words(record: dict[str, Any]) -> str:
    """A check's acceptance rule in words (:func:`companion.book.claims.rule_words`).

    >>> check_rule_words({"kind": "at_most", "paper": 0.1, "tolerance": None})
    'at most 0.1'
    >>> check_rule_words({"kind": "abs", "paper": 1.0, "tolerance": 0.05})
    'within 0.05 of 1'
    """
    return rule_words(record["kind"], record["paper"], record.get("tolerance"))


def _measured_words(record: dict[str, Any]) -> str:
    interval = record["interval"]
    text = f"measured **{describe_value(record['measured'])}**"
    if interval is not None:
        level = record.get("level") or 0.95
        over = record.get("resamples")
        text += (f", {100 * level:.0f} % interval {describe_value(interval)}"
                 + (f" over {over}" if over else ""))
    return text


def claim_box(record: dict[str, Any]) -> str:
    """The admonition that shows a claim (or a check) on its chapter's page.

    A paper claim quotes the paper and its place, then says whose the threshold is: "The
    paper says ..." for the paper's own number, "We require ..." for a tolerance of ours,
    with its reason. A check says "We require ..." with its source. Nothing is abbreviated.
    """
    verdict, role_ = record["verdict"], record["role"]
    reference = record["reference"]
    lines = [record["statement"]]
    if role_ == "paper" and record.get("declared"):
        quote = one_line(record.get("quote", ""))
        lines.append(f"The paper ({reference}): *“{quote}”*")
        rule = record["threshold_words"]
        if record.get("threshold_by") == "paper":
            lines.append(f"The paper's threshold: {rule} ({record['threshold_reason']}); "
                         f"{_measured_words(record)}.")
        else:
            lines.append(f"We require {rule}: a tolerance of ours, because "
                         f"{record['threshold_reason']}; {_measured_words(record)}.")
        if record.get("not_comparable"):
            lines[-1] = (f"Not compared in this run: {record['not_comparable']}. "
                         f"The rule, where it is compared: {rule}.")
        if record.get("set_after_result"):
            lines.append(f"This tolerance was set after a result was seen "
                         f"({record['set_after_result']}).")
        lines.append(f"It would read *differs* under: {record['falsifier']}.")
    elif role_ == "paper":
        paper = record["paper"]
        said = describe_value(paper if paper is not None else "not available")
        lines.append(f"The paper ({reference}): {said}; {_measured_words(record)}.")
    else:
        lines.append(f"We require {check_rule_words(record)} ({reference}); "
                     f"{_measured_words(record)}.")
    what = "Claim" if role_ == "paper" else "Check"
    return directive("admonition", f"{what} {record['id']}: {verdict}", "\n\n".join(lines),
                     options={"class": ADMONITION_CLASS[verdict], "name": record["id"]}) + "\n"


def inventory_table(rows: list[dict[str, Any]]) -> str:
    """The chapter's statement inventory: each statement of the paper and how it is tested.

    >>> inventory_table([{"id": "x-a", "quote": "q", "place": "abstract",
    ...     "status": "not comparable", "claims": [], "verdicts": {},
    ...     "not_comparable": "needs a GPU"}]).splitlines()[-1]
    '| q | abstract | not comparable: needs a GPU |'
    """
    body = []
    for r in rows:
        if r["status"] == "tested":
            how = "; ".join(f"{role('ref', f'{c} <{c}>')}: {v}" for c, v in r["verdicts"].items())
        elif r["status"] == "not comparable":
            how = f"not comparable: {r['not_comparable']}"
        else:
            how = "not run at this scale: " + ", ".join(r["claims"])
        body.append([one_line(r["quote"]), r["place"], how])
    return pipe_table(["The paper states", "Where", "How this chapter tests it"], body)


# --------------------------------------------------------------------------- chapter pages
def commit_text(record: dict[str, Any]) -> str:
    """The run's commit as a link to it in the repository (plain when unknown)."""
    commit = str(record.get("git_commit") or "unknown")
    short = f"`{commit[:12]}`"
    repository = record.get("repository")
    if site.is_placeholder(repository) or not re.fullmatch(r"[0-9a-f]{7,40}", commit):
        return short
    return f"[{short}]({site.commit_url(repository, commit)})"


def run_box(record: dict[str, Any]) -> str:
    """The box under the title: how the page was made, and how to make it again."""
    params = ", ".join(f"`{k}={v!r}`" for k, v in record["parameters"].items())
    dirty = " (with uncommitted changes)" if record.get("git_dirty") else ""
    rows = [("Parameters", params), ("Scale", f"`{record['parameters']['scale']}`"),
            ("Device", f"`{record['device']}`")]
    if record.get("nproc", 1) != 1:
        rows.append(("Processes", f"{record['nproc']} (torchrun)"))
    peak = record.get("peak_memory_gib")
    rows += [("Commit", commit_text(record) + dirty),
             ("Executed", f"{record['finished']} in {record['seconds']:.1f} s"
              + (f", peak memory {peak:.2f} GiB" if peak else ""))]
    table = "| Setting | Value |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)
    explore = (f"python -m companion run {record['chapter']} --scale "
               f"{record['parameters']['scale']} --out DIR -p NAME VALUE")
    body = (f"{table}\n"
            f"Re-execute with: `{record['command']}`\n\n"
            f"Explore other parameters, leaving the book as it is: `{explore}` writes the run "
            "(notebook, figures, tables, claims and an HTML page) into `DIR`.")
    return directive("admonition", "How this page was made", body, options={"class": "note"})


def scale_banner(scale: str, meaning: str, css_class: str, paper_command: str = "",
                 gpu_note: str = "") -> str:
    """The banner at the top of a page: the scale it was run at; below paper scale, the
    command that runs it at paper scale (``gpu_note``: where that needs a GPU)."""
    if scale == "paper":
        return directive("admonition", "Run at paper scale",
                         f"Every number, figure and verdict on this page comes from a run at "
                         f"scale `paper`: {meaning}.", options={"class": f"tip {css_class}"})
    return directive(
        "admonition", f"Run at {scale} scale, below the papers' settings",
        f"This page was run at scale **`{scale}`** ({meaning}), not at the papers' "
        "settings: its numbers, figures and verdicts come from smaller experiments than "
        f"the papers'. To run it at paper scale{gpu_note}: `{paper_command}`",
        options={"class": f"warning {css_class}"})


def stale_banner(record: dict[str, Any], good: dict[str, Any] | None) -> str:
    """The banner of a chapter page whose last run failed: what failed, and what the page
    shows instead (the last good run, or nothing)."""
    when = f" from {good['finished']} (commit {commit_text(good)})" if good else ""
    return directive(
        "danger", "Stale outputs",
        f"The last run of this chapter ({record['finished']}, commit "
        f"{commit_text(record)}) **failed**: {record['error']}.\n"
        + (f"Everything below is the last good run{when}, not the current code."
           if good else "No good run of this chapter exists: nothing below was computed."))


def stale_chapter_notice(why: str, what: str) -> list[str]:
    """The lines the figure index and the report put under a stale chapter's heading
    (``what``: "The figures listed here", "These records")."""
    return directive("danger", "Stale chapter",
                     f"The last run of this chapter failed or never happened ({why}). "
                     f"{what} are from its last good run.").split("\n") + [""]


def references_section() -> str:
    """The bibliography of a one-page HTML run (``run --out``)."""
    return "## References\n\n" + directive("bibliography")
