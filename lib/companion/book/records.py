"""Figures, tables and claims saved with their provenance.

Every figure a chapter shows goes through :func:`save_figure`, every table through
:func:`save_table`, every checked statement through :func:`claim`. Each writes its files
atomically (temporary file + rename) next to a JSON sidecar that says exactly what
produced it: chapter, parameters, scale, seed, device, git commit (and whether the tree
was dirty), package versions, time, and the sha256 of every file written. Each is saved
for the active chapter (:func:`companion.book.chapter.begin_chapter`), and shown on its
page as MyST (:mod:`companion.book.myst`).

Ids are stable kebab-case strings prefixed by the chapter's prefix (the chapter's file
stem with ``_`` replaced by ``-``), e.g. ``hasse-butterfly-mask``.
"""
from __future__ import annotations

import hashlib
import io
import os
import re
from typing import Any

from companion._validate import describe
from companion.book import myst
from companion.book.chapter import ENV_CHAPTER, Chapter, active_chapter
from companion.book.citations import cite_line, write_citation
from companion.book.claims import (CHECK_VERDICTS, ROLES, check_interval, check_tolerance,
                                   judge_claim, scalar_measured)
from companion.book.files import atomic_write_bytes, atomic_write_text, dumps, now_iso
from companion.book.gitstate import git_state

_ID_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")

# Fixed metadata so that the same figure gives the same bytes (no dates, fixed hash salt).
_SAVE_METADATA = {
    "png": {"Software": None},
    "svg": {"Date": None, "Creator": None},
    "pdf": {"CreationDate": None, "ModDate": None, "Producer": None, "Creator": None},
}


def package_versions() -> dict[str, str]:
    """Versions of the packages whose behaviour a figure depends on."""
    from importlib import metadata

    versions = {}
    from companion.book.site import DISTRIBUTION

    # the library is recorded as "companion" (its import name); its distribution on
    # PyPI is attention-reproduced
    for key, dist in (("torch", "torch"), ("numpy", "numpy"), ("matplotlib", "matplotlib"),
                      ("companion", DISTRIBUTION)):
        try:
            versions[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[key] = "not installed"
    return versions


class Record(dict):
    """A saved item's sidecar: a plain dict that shows nothing when it ends a cell.

    save_figure/save_table/claim already display the item; returning a bare dict would
    print the whole sidecar under it on the chapter page.
    """

    def _ipython_display_(self) -> None:
        pass


def _check_id(kind: str, item_id: str, chapter: Chapter) -> None:
    """Ids are kebab-case, chapter-prefixed and unique within a chapter.

    Figures, tables and claims share one namespace (each id is a label on the page).
    Under the runner an id may be used once; run by hand, re-running a cell may save the
    same item again. This only checks: :func:`_register_id` records the id once every
    other argument has been checked and the files are written, so that a call refused
    for a bad argument can be retried, corrected, with the same id.
    """
    if not isinstance(item_id, str) or not _ID_RE.match(item_id):
        raise ValueError(
            f"{kind}: expected a kebab-case id like 'hasse-causal-mask', got {item_id!r}")
    if not item_id.startswith(chapter.prefix + "-"):
        raise ValueError(
            f"{kind}: id {item_id!r} must start with the chapter prefix {chapter.prefix + '-'!r}"
        )
    previous = chapter.used_ids.get(item_id)
    if previous is not None and (previous != kind or os.environ.get(ENV_CHAPTER)):
        raise ValueError(
            f"{kind}: id {item_id!r} is already used by a {previous.split('_')[0]} of this "
            "chapter; every figure, table and claim needs its own id"
        )


def _register_id(kind: str, item_id: str, chapter: Chapter) -> None:
    chapter.used_ids[item_id] = kind


def _provenance(chapter: Chapter) -> dict[str, Any]:
    commit, dirty = git_state()
    return {
        "chapter": chapter.name,
        "parameters": chapter.params,
        "scale": chapter.scale,
        "seed": chapter.seed,
        "device": str(chapter.device),
        "git_commit": commit,
        "git_dirty": dirty,
        "versions": package_versions(),
        "created": now_iso(),
    }


def display_markdown(markdown: str, extra: dict[str, Any] | None = None) -> None:
    """Show MyST markdown on the chapter page (MyST-NB parses it as MyST)."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # pragma: no cover - IPython comes with ipykernel
        return
    if get_ipython() is None:
        return
    bundle = {"text/markdown": markdown, "text/plain": markdown}
    bundle.update(extra or {})
    display(bundle, raw=True)


def render_figure_bytes(fig, fmt: str) -> bytes:
    """The bytes of ``fig`` saved as ``fmt`` with fixed metadata (deterministic output)."""
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, metadata=_SAVE_METADATA[fmt], bbox_inches="tight")
    return buf.getvalue()


def save_figure(fig, figure_id: str, caption: str) -> dict[str, Any]:
    """Save ``fig`` as PNG, SVG and PDF with a JSON provenance sidecar, show it, close it.

    The figure appears on the chapter page as a numbered figure labelled ``figure_id``
    (reference it with ``{numref}`` in the prose). Files are written to
    ``<output>/figures/<figure_id>.{png,svg,pdf,json}``; the same inputs give the same
    bytes (no dates in the metadata, fixed SVG hash salt).

    Returns the sidecar as a dict.

    Raises
    ------
    TypeError
        ``fig`` is not a matplotlib Figure.
    ValueError
        A bad or already used ``figure_id``, an empty ``caption``. Nothing is written
        and the id stays free.
    """
    chapter = active_chapter()
    _check_id("figure_id", figure_id, chapter)
    if not isinstance(caption, str) or not caption.strip():
        raise ValueError("caption: expected a non-empty string saying what to see")
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    if not isinstance(fig, Figure):
        raise TypeError(f"fig: expected a matplotlib Figure, got {describe(fig)}")

    folder = chapter.output_dir / "figures"
    files = {}
    try:
        for fmt in ("png", "svg", "pdf"):
            data = render_figure_bytes(fig, fmt)
            path = folder / f"{figure_id}.{fmt}"
            atomic_write_bytes(path, data)
            files[fmt] = {"file": path.name, "sha256": hashlib.sha256(data).hexdigest()}
    finally:
        plt.close(fig)
    sidecar = {"id": figure_id, "type": "figure", "caption": caption.strip(),
               "files": files, **_provenance(chapter)}
    sidecar = Record(sidecar)
    bibtex = write_citation(folder, sidecar)
    atomic_write_text(folder / f"{figure_id}.json", dumps(sidecar))
    _register_id("figure_id", figure_id, chapter)

    png = (folder / f"{figure_id}.png").read_bytes()
    import base64

    url = f"{chapter.asset_url}/figures/{figure_id}.png"
    markdown = (myst.figure_directive(url, figure_id, caption) + "\n\n"
                + cite_line(sidecar, f"{chapter.asset_url}/figures", bibtex))
    data = base64.b64encode(png).decode("ascii")
    # The book renders the MyST text/markdown (nb_mime_priority_overrides); Jupyter,
    # Binder and Colab would show the {figure} directive as text, and pick this instead.
    import html

    figure_html = (f'<figure><img src="data:image/png;base64,{data}" '
                   f'alt="{html.escape(myst.one_line(caption))}" style="max-width:100%">'
                   f"<figcaption>{html.escape(caption.strip())}</figcaption></figure>")
    display_markdown(markdown, {"image/png": data, "text/html": figure_html})
    return sidecar


def save_table(table, table_id: str, caption: str) -> dict[str, Any]:
    """Save a pandas DataFrame as CSV + Markdown with a JSON sidecar, and show it.

    Returns the sidecar as a dict.

    Raises
    ------
    TypeError
        ``table`` is not a pandas DataFrame.
    ValueError
        A bad or already used ``table_id``, an empty ``caption``. Nothing is written and
        the id stays free.
    """
    chapter = active_chapter()
    _check_id("table_id", table_id, chapter)
    if not isinstance(caption, str) or not caption.strip():
        raise ValueError("caption: expected a non-empty string saying what the table shows")
    import pandas as pd

    if not isinstance(table, pd.DataFrame):
        raise TypeError(f"table: expected a pandas DataFrame, got {type(table).__name__}")
    folder = chapter.output_dir / "tables"
    csv_bytes = table.to_csv(index=False).encode("utf-8")
    md_text = myst.markdown_table(table)
    atomic_write_bytes(folder / f"{table_id}.csv", csv_bytes)
    atomic_write_text(folder / f"{table_id}.md", md_text)
    files = {
        "csv": {"file": f"{table_id}.csv", "sha256": hashlib.sha256(csv_bytes).hexdigest()},
        "md": {"file": f"{table_id}.md",
               "sha256": hashlib.sha256(md_text.encode("utf-8")).hexdigest()},
    }
    sidecar = {"id": table_id, "type": "table", "caption": caption.strip(), "files": files,
               "columns": [str(c) for c in table.columns], "rows": int(len(table)),
               **_provenance(chapter)}
    sidecar = Record(sidecar)
    bibtex = write_citation(folder, sidecar)
    atomic_write_text(folder / f"{table_id}.json", dumps(sidecar))
    _register_id("table_id", table_id, chapter)
    markdown = (myst.table_directive(table_id, caption, md_text) + "\n\n"
                + cite_line(sidecar, f"{chapter.asset_url}/tables", bibtex))
    display_markdown(markdown, {"text/html": table.to_html(index=False)})
    return sidecar


def _check_evidence(evidence: Any, chapter: "Chapter") -> list[str]:
    """``evidence`` as a list of figure/table ids of ``chapter`` (prefix checked)."""
    if evidence is None:
        return []
    ids = [evidence] if isinstance(evidence, str) else evidence
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, str) for i in ids):
        raise TypeError(f"evidence: expected a figure/table id or a list of ids, got {evidence!r}")
    for i in ids:
        if not (_ID_RE.match(i) and i.startswith(chapter.prefix + "-")):
            raise ValueError(f"evidence: expected ids of this chapter's figures or tables "
                             f"(prefix {chapter.prefix!r}), got {i!r}")
    return list(ids)


_UNSET = object()


def claim(claim_id: str, measured: Any, *, paper: Any = _UNSET, tolerance: Any = None,
          reference: str | None = None, kind: str | None = None, statement: str,
          interval: Any = None, role: str = "paper", evidence: Any = None,
          not_comparable: str | None = None) -> dict[str, Any]:
    """Record a checked statement and show it on the chapter page.

    A paper claim (``role="paper"``) is declared in the chapter's inventory
    (:mod:`companion.book.statements`): its quote, place, threshold (the paper's number or
    a tolerance of ours, with its reason), what its interval resamples and its falsifier.
    The chapter passes only what it measured: ``claim(id, measured, interval=...,
    statement=..., evidence=...)``. A check (``role="check"``) passes its own threshold
    (``paper``, ``tolerance``, ``kind``, ``reference``).

    Parameters
    ----------
    claim_id : kebab-case id prefixed by the chapter prefix.
    measured : what we measured: a number, or a bool for kind "holds".
    paper : a check's threshold: a number, a (lo, hi) tuple, or "qualitative" (with kind
        "holds"). For a paper claim it comes from the inventory and is not passed.
    tolerance : a check's slack, for kinds "abs", "rel" (required), "at_most", "at_least".
    reference : a check's source ("this chapter", another paper); a paper claim's place
        comes from the inventory.
    kind : a check's "holds", "abs", "rel", "range", "at_most" or "at_least" (see
        judge_claim).
    statement : one sentence saying what is measured, at this run's sizes.
    interval : optional ``(lo, hi)``, the uncertainty interval of ``measured`` (e.g. a
        bootstrap over windows, paths or seeds). The verdict is then "inconclusive" when
        the interval straddles the threshold (see :func:`judge_claim`).
    role : "paper" (default), a statement of the paper: verdict reproduced / differs /
        inconclusive / not comparable; or "check", our own statement (a target, an
        implementation check, another paper's or a fact sheet's statement): verdict holds /
        fails / inconclusive, never counted as a reproduction.
    evidence : optional id (or list of ids) of the figures and tables of this chapter
        that support the claim; the reproduction report links to them.
    not_comparable : for a declared paper claim that this run cannot judge, why (e.g. "the
        dense model does not clear the majority class by 10 points at this size"): the
        verdict is "not comparable", ``measured`` may be None, and the box and the
        inventory say why instead of leaving the statement untested.

    Returns
    -------
    The claim record (dict) with its "verdict".

    Raises
    ------
    TypeError
        ``measured`` of the wrong type for ``kind`` (a tensor of several elements, a
        number for "holds"), a ``tolerance`` that is not a number.
    ValueError
        A bad or already used ``claim_id``, an empty ``reference`` or ``statement``, an
        unknown ``kind`` or ``role``, a ``paper``, ``tolerance`` or ``interval`` that does
        not fit ``kind``. Nothing is written and the id stays free.
    """
    chapter = active_chapter()
    _check_id("claim_id", claim_id, chapter)
    if role not in ROLES:
        raise ValueError(f"role: expected one of {ROLES}, got {role!r}")
    declared = None
    if role == "paper":
        declared = _declared_claim(chapter.name, claim_id)
    if declared is not None:
        passed = [name for name, value in (("paper", paper is not _UNSET),
                                           ("tolerance", tolerance is not None),
                                           ("kind", kind is not None),
                                           ("reference", reference is not None)) if value]
        if passed:
            raise ValueError(
                f"{passed[0]}: paper claim {claim_id!r} is declared in "
                f"companion.book.statements.{chapter.name}; its threshold and place come "
                "from there, pass only measured, interval, statement and evidence")
        t = declared.threshold
        paper, tolerance, kind, reference = t.value, t.tolerance, t.kind, declared.place
    elif paper is _UNSET:
        paper = None
    if not isinstance(reference, str) or not reference.strip():
        raise ValueError("reference: expected the section/figure of the paper, or 'this chapter'")
    if kind is None:
        raise ValueError("kind: expected one of holds, abs, rel, range, at_most, at_least")
    if not isinstance(statement, str) or not statement.strip():
        raise ValueError("statement: expected one sentence saying what is checked")
    measured = scalar_measured(measured)
    if tolerance is not None:
        check_tolerance(tolerance)
    if isinstance(paper, list):
        paper = tuple(paper)
    if interval is not None:
        interval = check_interval(interval)
    evidence = _check_evidence(evidence, chapter)
    if not_comparable is not None:
        if declared is None or not str(not_comparable).strip():
            raise ValueError("not_comparable: expected the reason why a declared paper claim "
                             "cannot be judged in this run")
        verdict = "not comparable"
    else:
        verdict = judge_claim(measured, paper, tolerance, kind, interval=interval)
    if role == "check":
        if verdict == "not comparable":
            raise ValueError("paper: a check needs the threshold it is judged against")
        verdict = CHECK_VERDICTS[verdict]
    record = Record({
        "id": claim_id, "type": "claim", "role": role, "statement": myst.one_line(statement),
        "reference": reference, "kind": kind, "paper": paper, "measured": measured,
        "interval": interval, "tolerance": tolerance, "verdict": verdict,
        "not_comparable": myst.one_line(not_comparable) if not_comparable else None,
        "evidence": evidence, **_declaration(declared, role), **_provenance(chapter),
    })
    atomic_write_text(chapter.output_dir / "claims" / f"{claim_id}.json", dumps(record))
    _register_id("claim_id", claim_id, chapter)
    chapter.verdicts[claim_id] = verdict
    chapter.roles[claim_id] = role
    display_markdown(myst.claim_box(record))
    return record


def _declared_claim(chapter_name: str, claim_id: str):
    """The inventory's declaration of paper claim ``claim_id``, or None (not declared)."""
    from companion.book.statements import inventory

    try:
        inv = inventory(chapter_name)
    except ModuleNotFoundError:
        return None
    return inv.claims.get(claim_id)


def _declaration(declared, role: str) -> dict[str, Any]:
    """The record's fields that say whose threshold it is, and how the claim can fail."""
    if role == "check":
        return {"threshold_by": "ours", "declared": True}
    if declared is None:  # a paper claim missing from the inventory: the report flags it
        return {"threshold_by": None, "declared": False}
    t = declared.threshold
    return {"declared": True, "quote": declared.quote, "source": declared.source,
            "threshold_by": t.by, "threshold_words": t.words(), "threshold_reason": t.reason,
            "set_after_result": t.set_after_result, "falsifier": declared.falsifier,
            "resamples": declared.resamples, "level": declared.level}


def record_inventory(setting: str = "") -> dict[str, Any]:
    """Save and show the active chapter's statement inventory with this run's verdicts.

    ``setting`` says in a few words what the verdicts were measured with (the model, the
    sizes), for the Findings page: "MPNet (12 layers) on 600 windows".

    Every statement of ``companion.book.statements.<chapter>`` is written to
    ``<output>/inventory.json`` with its status: "tested" (the verdicts of its paper
    claims in this run), "not comparable" (and why), or "not run at this scale" (its
    claims were not recorded by this run). Call it once, after the chapter's last claim.

    Raises
    ------
    ValueError
        A paper claim of this run is missing from the inventory.
    """
    from companion.book.statements import inventory

    chapter = active_chapter()
    inv = inventory(chapter.name)
    stray = [c for c in chapter.verdicts if c not in inv.claims
             and chapter.roles.get(c) == "paper"]
    if stray:
        raise ValueError(f"record_inventory: paper claims {stray} are not declared in "
                         f"companion.book.statements.{chapter.name}")
    rows = []
    for s in inv.statements:
        verdicts = {c: chapter.verdicts[c] for c in s.claims if c in chapter.verdicts}
        if s.not_comparable:
            status = "not comparable"
        elif verdicts:
            status = "tested"
        else:
            status = "not run at this scale"
        rows.append({"id": s.id, "quote": s.quote, "source": s.source, "place": s.place,
                     "claims": list(s.claims), "verdicts": verdicts, "status": status,
                     "not_comparable": s.not_comparable})
    record = Record({"id": f"{chapter.prefix}-inventory", "type": "inventory",
                     "setting": " ".join(str(setting).split()), "statements": rows,
                     **_provenance(chapter)})
    atomic_write_text(chapter.output_dir / "inventory.json", dumps(record))
    display_markdown(myst.inventory_table(rows))
    return record
