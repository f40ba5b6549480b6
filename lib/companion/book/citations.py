"""Citing the book's figures and tables: BibTeX entries at the commit that made each
item, the ``.bib`` file beside it, and the *Cite* line under it on the page."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from companion.book.files import atomic_write_bytes
from companion.book.gitstate import repo_root


#: BibTeX author of the book when CITATION.cff names nobody: a braced corporate name,
#: so that BibTeX does not read "Attention" as a surname.
CORPORATE_AUTHOR = "Attention, Reproduced contributors"


def citation_metadata(root: Path | None = None) -> dict[str, Any]:
    """The book's ``CITATION.cff`` as a dict (title, authors, version, ...); a minimal
    default when the file is missing."""
    import yaml

    path = Path(root or repo_root()) / "CITATION.cff"
    if not path.exists():
        return {"title": "Attention, Reproduced", "authors": [{"name": CORPORATE_AUTHOR}]}
    return yaml.safe_load(path.read_text(encoding="utf-8")) or {}


_MYST_ROLE = re.compile(r"\{[\w:-]+\}`([^`<]*?)(?:\s*<[^`]*>)?`")


def _bibtex_text(text: str) -> str:
    """``text`` safe inside a braced BibTeX field: MyST roles reduced to their text,
    LaTeX specials outside ``$...$`` escaped, unbalanced braces dropped."""
    text = _MYST_ROLE.sub(lambda m: m.group(1), " ".join(str(text).split()))
    maths = text.count("$") % 2 == 0  # a lone $ opens no maths: every $ is escaped
    out, in_math = [], False
    for ch in text:
        if ch == "$":
            in_math = maths and not in_math
            ch = ch if maths else "\\$"
        elif ch in "%&#" or (ch == "_" and not in_math):
            ch = "\\" + ch
        out.append(ch)
    text = "".join(out)
    depth, kept = 0, []
    for ch in text:
        if ch == "}" and depth == 0:
            continue
        depth += (ch == "{") - (ch == "}")
        kept.append(ch)
    text = "".join(kept)
    while depth > 0:  # drop the last unclosed "{"
        i = text.rindex("{")
        text, depth = text[:i] + text[i + 1:], depth - 1
    return " ".join(text.split())


def _bibtex_author(author: dict[str, Any]) -> str:
    """One CITATION.cff author: a person as "Family, Given", an entity braced."""
    if author.get("family-names"):
        name = " ".join(filter(None, [author.get("name-particle"), author["family-names"]]))
        given = author.get("given-names")
        return f"{name}, {given}" if given else name
    return "{" + str(author.get("name") or CORPORATE_AUTHOR) + "}"


def bibtex_entry(item: dict[str, Any], metadata: dict[str, Any] | None = None,
                 repository: str | None = None) -> str:
    r"""The BibTeX entry citing one figure or table of the book at the commit that made it.

    The one function behind the figure index, the ``<id>.bib`` files that
    :func:`save_figure` and :func:`save_table` write, and the Cite line under every
    figure and table.

    Parameters
    ----------
    item : the item's sidecar (``id``, ``type`` "figure" or "table", ``caption``,
        ``chapter``, ``git_commit``, ``created``, ``scale``, ``device``, ``seed``).
    metadata : ``CITATION.cff`` as a dict (authors, title, version); default: the
        repository's (:func:`citation_metadata`).
    repository : the repository's web address; the entry's ``url`` is the repository's
        tree at the item's commit (``companion.book.site.tree_url``). Default: from
        ``_config.yml`` (``companion.book.site.repository_url``).

    >>> side = {"id": "demo-x", "type": "figure", "chapter": "demo", "caption": "A & B.",
    ...         "git_commit": "0123456789abcdef", "created": "2026-11-29T00:00:00+00:00",
    ...         "scale": "ci", "device": "cpu", "seed": 0}
    >>> print(bibtex_entry(side, {"authors": [{"name": "Attention, Reproduced contributors"}],
    ...                           "title": "Attention, Reproduced"}, "https://github.com/o/r"))
    @misc{attnrepro-demo-x,
      author = {{Attention, Reproduced contributors}},
      title = {{Attention, Reproduced}: figure \texttt{demo-x}},
      year = {2026},
      howpublished = {Jupyter Book, chapter demo},
      url = {https://github.com/o/r/tree/0123456789abcdef},
      note = {Commit 0123456789ab, scale ci, device cpu, seed 0. A \& B.}
    }
    """
    from companion.book import site

    if not isinstance(item, dict) or not isinstance(item.get("id"), str):
        raise ValueError(f"item: expected a figure or table sidecar with an 'id', got {item!r}")
    metadata = citation_metadata() if metadata is None else metadata
    if repository is None:
        repository = site.repository_url(repo_root())
    authors = " and ".join(_bibtex_author(a) for a in metadata.get("authors") or []
                           if isinstance(a, dict)) or "{" + CORPORATE_AUTHOR + "}"
    kind = "table" if item.get("type") == "table" else "figure"
    commit = str(item.get("git_commit") or "unknown")
    known = bool(re.fullmatch(r"[0-9a-f]{7,40}", commit))
    dirty = " (with uncommitted changes)" if item.get("git_dirty") else ""
    title = _bibtex_text(metadata.get("title") or "Attention, Reproduced")
    fields = [
        ("author", authors),
        ("title", f"{{{title}}}: {kind} \\texttt{{{item['id']}}}"),
        ("year", str(item.get("created") or "")[:4]),
        ("howpublished", f"Jupyter Book, chapter {_bibtex_text(item.get('chapter', ''))}"),
    ]
    if repository and not site.is_placeholder(repository):
        fields.append(("url", site.tree_url(repository, commit) if known else repository))
    if metadata.get("version"):
        fields.append(("version", _bibtex_text(metadata["version"])))
    fields.append(("note", f"Commit {commit[:12]}{dirty}, scale {item.get('scale')}, device "
                           f"{item.get('device')}, seed {item.get('seed')}. "
                           f"{_bibtex_text(item.get('caption', ''))}".strip()))
    body = ",\n".join(f"  {k} = {{{v}}}" for k, v in fields if v)
    return f"@misc{{attnrepro-{item['id']},\n{body}\n}}"


#: What the Cite line offers per item type: (label, file extension), then provenance.
CITE_FORMATS = {"figure": (("PNG", "png"), ("SVG", "svg"), ("PDF", "pdf")),
                "table": (("CSV", "csv"), ("Markdown", "md"))}


def cite_line(item: dict[str, Any], base_url: str, bibtex: str) -> str:
    """The one-line HTML under a figure or table: *Cite · PNG · SVG · PDF · provenance*
    (tables: *Cite · CSV · Markdown · provenance*).

    "Cite" unfolds the item's BibTeX entry in place (a ``<details>`` element, no
    script) with a link to its ``.bib`` file; the other words link to the item's files
    under ``base_url`` (the folder of the item's files, as the page reaches it) and to
    its JSON sidecar. One HTML block without blank lines, so that Markdown keeps it whole.

    >>> line = cite_line({"id": "demo-t", "type": "table", "files": {"csv": {}}}, "t", "@misc{x}")
    >>> line.count("<a "), 'href="t/demo-t.csv"' in line, 'data-cite-for="demo-t"' in line
    (3, True, True)
    """
    import html

    item_id = item["id"]
    kind = "table" if item.get("type") == "table" else "figure"
    files = item.get("files") or {}
    base = base_url.rstrip("/") + "/" if base_url else ""
    links = [f'<a href="{html.escape(base + item_id)}.{ext}">{label}</a>'
             for label, ext in CITE_FORMATS[kind] if ext in files]
    links.append(f'<a href="{html.escape(base + item_id)}.json" title="The provenance '
                 f'sidecar: parameters, seed, device, commit, versions, checksums">provenance</a>')
    summary = " · ".join(['<span class="cite-toggle" title="Show the BibTeX entry">Cite</span>',
                          *links])
    return (f'<details class="cite-line" data-cite-for="{html.escape(item_id)}">'
            f"<summary>{summary}</summary>\n"
            f'<pre class="cite-bibtex">{html.escape(bibtex)}</pre>\n'
            f'<p class="cite-file"><a href="{html.escape(base + item_id)}.bib" download>'
            f"{html.escape(item_id)}.bib</a></p></details>\n")


def write_citation(folder: Path, sidecar: dict[str, Any]) -> str:
    """Write ``<id>.bib`` beside the item's files, record it in ``sidecar["files"]``, and
    return the entry."""
    entry = bibtex_entry(sidecar)
    data = (entry + "\n").encode("utf-8")
    atomic_write_bytes(folder / f"{sidecar['id']}.bib", data)
    sidecar["files"]["bib"] = {"file": f"{sidecar['id']}.bib",
                               "sha256": hashlib.sha256(data).hexdigest()}
    return entry
