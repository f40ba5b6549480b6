"""Sphinx extension for the PDF: tables break across pages.

Sphinx typesets a table of at most 30 rows as ``tabulary``, which cannot break, so a
table taller than the page (a claims table with long statements, the figure index with
its thumbnails) runs over the footer. In the LaTeX build only, every table that stands
in the text (not inside another table, an admonition, a list, a footnote, a sidebar or
a topic, where LaTeX's ``longtable`` cannot go) gets the class ``longtable``, which
Sphinx typesets as a ``longtable``, captions and numbers kept.

A ``longtable`` of plain ``l`` columns does not wrap its cells, so each column also gets a
width (:func:`column_widths`: its longest cell, in characters, between 4 and 60; an image
counts 24), which Sphinx turns into wrapping columns of those proportions.

``longtable`` steps LaTeX's table counter even when the table has no caption; after an
uncaptioned one the counter is stepped back, so the PDF numbers tables as the web pages do.
"""
from __future__ import annotations

from docutils import nodes

#: Containers a ``longtable`` cannot be typeset in.
_BOXES = (nodes.table, nodes.Admonition, nodes.list_item, nodes.footnote, nodes.sidebar,
          nodes.topic, nodes.entry)


def _parents(node):
    node = node.parent
    while node is not None:
        yield node
        node = node.parent


def column_widths(table: nodes.table) -> list[int] | None:
    """Relative widths of ``table``'s columns from their longest cells, or None when the
    table has spanning cells or several groups (Sphinx's own layout is kept then)."""
    groups = [c for c in table.children if isinstance(c, nodes.tgroup)]
    if len(groups) != 1:
        return None
    colspecs = [c for c in groups[0].children if isinstance(c, nodes.colspec)]
    longest = [0] * len(colspecs)
    for row in groups[0].findall(nodes.row):
        entries = [e for e in row.children if isinstance(e, nodes.entry)]
        if len(entries) != len(colspecs) or any(
                e.get("morecols") or e.get("morerows") for e in entries):
            return None
        for col, entry in enumerate(entries):
            size = len(" ".join(entry.astext().split()))
            if any(True for _ in entry.findall(nodes.image)):
                size = max(size, 24)
            longest[col] = max(longest[col], size)
    return [min(60, max(4, size)) for size in longest]


def mark_tables_long(app, doctree, docname) -> None:
    """Make every free-standing table of a LaTeX build a ``longtable`` (see module doc)."""
    if app.builder.format != "latex":
        return
    for table in list(doctree.findall(nodes.table)):
        if any(isinstance(parent, _BOXES) for parent in _parents(table)):
            continue
        if "longtable" not in table["classes"]:
            table["classes"].append("longtable")
        widths = None if "colwidths-given" in table["classes"] else column_widths(table)
        if widths:
            group = next(c for c in table.children if isinstance(c, nodes.tgroup))
            colspecs = [c for c in group.children if isinstance(c, nodes.colspec)]
            for colspec, width in zip(colspecs, widths):
                colspec["colwidth"] = width
            table["classes"].append("colwidths-given")
        if not any(isinstance(child, nodes.title) for child in table.children):
            fix = nodes.raw("", "\\addtocounter{table}{-1}\n", format="latex")
            table.parent.insert(table.parent.index(table) + 1, fix)


def setup(app):
    app.connect("doctree-resolved", mark_tables_long)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
