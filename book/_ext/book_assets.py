"""Small Sphinx fixes for the book's pages.

- Drop duplicated inline scripts: the Jupyter Book stack registers sphinx-thebe's and
  sphinx-togglebutton's inline configuration twice (once with filename None, once with
  ''), so ``const THEBE_JS_URL = ...`` appears twice on every page and the browser
  reports "Identifier 'THEBE_JS_URL' has already been declared" (the book's browser
  check catches it).
"""


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


def setup(app):
    # Early priority: html-page-context is emitted with emit_firstresult, so a handler
    # after one that returns a template name would never run.
    app.connect("html-page-context", _dedupe_scripts, priority=1)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
