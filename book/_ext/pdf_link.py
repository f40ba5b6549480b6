"""Sphinx extension: the web book links its PDF only when there is one, and carries it.

A page marks the sentence that links the PDF with a ``{container} pdf-link``. In an HTML
build this extension

- keeps that container when the PDF exists (``book/_build/latex/book.pdf``, what
  ``make pdf`` builds, beside the HTML output folder) and removes it otherwise, so a book
  built without ``make pdf`` has no dead link;
- copies the PDF into the HTML output as ``attention-reproduced.pdf`` (:data:`PDF_NAME`)
  when the build succeeds, so the link resolves in the built site.

Other builders (the PDF itself) always drop the container. The pages holding one are
read again on every build, so the link follows the PDF appearing or going away.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from docutils import nodes

#: The PDF's file name in the HTML output (the Makefile's PDF_NAME).
PDF_NAME = "attention-reproduced.pdf"
#: The class of the container that holds the link.
LINK_CLASS = "pdf-link"


def built_pdf(app) -> Path | None:
    """The PDF that ``make pdf`` built next to this build's output folder, if any."""
    pdf = Path(app.outdir).parent / "latex" / "book.pdf"
    return pdf if pdf.is_file() and pdf.stat().st_size > 0 else None


def _link_containers(doctree):
    return [n for n in doctree.findall(nodes.container) if LINK_CLASS in n["classes"]]


def note_link_pages(app, doctree) -> None:
    docs = getattr(app.env, "pdf_link_docs", set())
    if _link_containers(doctree):
        docs.add(app.env.docname)
    app.env.pdf_link_docs = docs


def forget_page(app, env, docname) -> None:
    getattr(env, "pdf_link_docs", set()).discard(docname)


def merge_pages(app, env, docnames, other) -> None:
    env.pdf_link_docs = getattr(env, "pdf_link_docs", set()) | (
        getattr(other, "pdf_link_docs", set()) & set(docnames))


def reread_link_pages(app, env, added, changed, removed):
    return sorted(getattr(env, "pdf_link_docs", set()) - set(removed))


def keep_or_drop_link(app, doctree, docname) -> None:
    """Remove the PDF link unless this is an HTML build and the PDF exists."""
    keep = app.builder.format == "html" and built_pdf(app) is not None
    for container in _link_containers(doctree):
        if not keep:
            container.parent.remove(container)


def copy_pdf(app, exception) -> None:
    pdf = built_pdf(app)
    if exception is None and app.builder.format == "html" and pdf is not None:
        shutil.copy2(pdf, Path(app.outdir) / PDF_NAME)


def setup(app):
    app.connect("doctree-read", note_link_pages)
    app.connect("env-purge-doc", forget_page)
    app.connect("env-merge-info", merge_pages)
    app.connect("env-get-outdated", reread_link_pages)
    app.connect("doctree-resolved", keep_or_drop_link)
    app.connect("build-finished", copy_pdf)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
