"""Small Sphinx fixes for the book's pages.

- Copy the saved figures' and tables' files (PNG, SVG, PDF, CSV, Markdown, the JSON
  provenance sidecar and the ``.bib`` entry) from ``book/_generated/assets/`` into the
  built site at the same relative place, so that the Cite line under every figure and
  table (``companion.book.citations.cite_line``, plain links such as
  ``../assets/hasse/figures/hasse-causal-mask.pdf``) and the figure index resolve in
  the built HTML, at stable addresses.
- Add the book's stylesheet ``book/_static/book.css`` (cell outputs wrap, tables scroll
  in their own box, the Cite line, the compact figure index).
- A book whose ``_config.yml`` still holds the placeholder repository address (a local
  build before ``python -m companion.book.site set-url``) shows no repository, issues or
  launch button: they would point at a repository that does not exist.
- Drop duplicated inline scripts: the Jupyter Book stack registers sphinx-thebe's and
  sphinx-togglebutton's inline configuration twice (once with filename None, once with
  ''), so ``const THEBE_JS_URL = ...`` appears twice on every page and the browser
  reports "Identifier 'THEBE_JS_URL' has already been declared" (the book's browser
  check catches it).
"""
import shutil
from pathlib import Path

#: Where the runner saves each chapter's items, relative to the book's source folder.
ASSETS = Path("book") / "_generated" / "assets"
#: The item folders and file types that pages link to.
ITEM_FOLDERS = ("figures", "tables")
ITEM_SUFFIXES = (".png", ".svg", ".pdf", ".json", ".bib", ".csv", ".md")


def copy_item_files(srcdir, outdir):
    """Copy every saved figure's and table's files from ``srcdir/book/_generated/assets``
    to the same relative folder under ``outdir``; return how many files were copied.

    Temporary files of an interrupted save (``.name.tmp``) are left out; a file already
    there with the same size and time is not copied again.
    """
    source, copied = Path(srcdir) / ASSETS, 0
    if not source.is_dir():
        return 0
    for chapter in sorted(p for p in source.iterdir() if p.is_dir()):
        for folder in ITEM_FOLDERS:
            for path in sorted((chapter / folder).glob("*")):
                if (not path.is_file() or path.name.startswith(".")
                        or path.suffix not in ITEM_SUFFIXES):
                    continue
                target = Path(outdir) / path.relative_to(srcdir)
                stat = path.stat()
                if target.exists() and (target.stat().st_size, int(target.stat().st_mtime)) == (
                        stat.st_size, int(stat.st_mtime)):
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
                copied += 1
    return copied


def _copy_assets(app, exception):
    if exception is None and app.builder.format == "html":
        copy_item_files(app.srcdir, app.outdir)


def _dedupe_scripts(app, pagename, templatename, context, doctree):
    seen = set()
    unique = []
    for js in context.get("script_files", []):
        key = (getattr(js, "filename", None) or "",
               repr(sorted(getattr(js, "attributes", {}).items())))
        if key not in seen:
            seen.add(key)
            unique.append(js)
    # In place: later handlers (sphinx.ext.mathjax) append to this same list.
    context["script_files"][:] = unique


#: The shipped placeholder address (companion.book.site.PLACEHOLDER_REPOSITORY; this
#: extension runs inside Sphinx without importing the library).
PLACEHOLDER_REPOSITORY = "https://github.com/attention-reproduced/attention-reproduced"


def _hide_placeholder_links(app, config):
    options = dict(config.html_theme_options or {})
    url = str(options.get("repository_url") or "").rstrip("/").removesuffix(".git")
    if url and url != PLACEHOLDER_REPOSITORY:
        return
    for key in ("use_repository_button", "use_issues_button", "use_edit_page_button",
                "use_source_button"):
        options[key] = False
    options["launch_buttons"] = {}
    options.pop("repository_url", None)
    config.html_theme_options = options


def setup(app):
    app.connect("config-inited", _hide_placeholder_links)
    # Early priority: html-page-context is emitted with emit_firstresult, so a handler
    # after one that returns a template name would never run.
    app.connect("html-page-context", _dedupe_scripts, priority=1)
    app.connect("build-finished", _copy_assets)
    app.add_css_file("book.css")
    return {"parallel_read_safe": True, "parallel_write_safe": True}
