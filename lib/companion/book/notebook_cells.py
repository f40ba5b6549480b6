"""What the runner adds to a chapter's notebook: a hidden first cell that installs the
library when it is missing (a downloaded notebook runs outside a clone), one parameters
cell shown (papermill's, with the effective values), and under the title the scale
banner and the run box (:func:`finish_notebook`); on a failed run the stale banner on
the last good page (:func:`mark_stale`), and a page for a chapter never run.
"""
from __future__ import annotations

import ast
import contextlib
import copy
import json
import re
from pathlib import Path
from typing import Any

from companion.book import myst
from companion.book.chapter import ENV_OUTPUT_DIR
from companion.book.files import atomic_write_text
from companion.book.parameters import (PUBLISH_SCALES, assigned_name, is_parameter_assignment,
                                       paper_scale_command)
from companion.book.project import Project, read_notebook, read_notebook_ipynb

STALE_TAG = "companion-stale-banner"
BOX_TAG = "companion-run-box"
SCALE_TAG = "companion-scale-banner"
INSTALL_TAG = "companion-install"
REFERENCES_TAG = "companion-references"
#: Jupyter Book's tag for a cell kept in the notebook but left off the page.
REMOVE_TAG = "remove-cell"
#: What each scale is, in the words of the scale banner at the top of a page.
SCALE_MEANING = {"smoke": "the test suite's size: seconds of work, nothing to conclude from",
                 "ci": "reduced sizes that a CPU runs in minutes",
                 "paper": "the papers' own settings"}
#: Extras of the distribution a downloaded notebook installs, per chapter (base: none).
NOTEBOOK_EXTRAS = {"context_similarity": ("nlp",)}
#: The install cell of a downloaded notebook: a pip requirement (or local path) that
#: replaces the package at the notebook's commit, and extra pip arguments (shell words).
ENV_INSTALL_SOURCE = "COMPANION_INSTALL_SOURCE"
ENV_PIP_ARGS = "COMPANION_PIP_ARGS"


def insert_after_title(nb, cell) -> None:
    """Put ``cell`` right after the page title (first '# ' heading), keeping it the title."""
    import nbformat

    for i, c in enumerate(nb.cells):
        if c.cell_type != "markdown":
            continue
        lines = c.source.split("\n")
        for j, line in enumerate(lines):
            if line.startswith("# "):
                head = "\n".join(lines[: j + 1])
                tail = "\n".join(lines[j + 1:]).strip("\n")
                c.source = head
                new = [cell]
                if tail:
                    new.append(nbformat.v4.new_markdown_cell(tail))
                nb.cells[i + 1:i + 1] = new
                return
    nb.cells.insert(0, cell)


def markdown_cell(source: str, tag: str):
    """A markdown cell of ``source`` tagged ``tag``."""
    import nbformat

    cell = nbformat.v4.new_markdown_cell(source)
    cell.metadata["tags"] = [tag]
    return cell


def scale_banner(record: dict[str, Any]) -> str:
    """The banner at the top of a page: the scale it was run at; below paper scale, the
    command that runs it at paper scale (:func:`companion.book.myst.scale_banner`)."""
    scale = record["parameters"]["scale"]
    meaning = SCALE_MEANING.get(scale, scale)
    if scale == "paper":
        return myst.scale_banner(scale, meaning, SCALE_TAG)
    gpu = ("" if PUBLISH_SCALES.get(record["chapter"], "paper") == "paper" else
           f" (a GPU: on a CPU this chapter is published at scale "
           f"`{PUBLISH_SCALES[record['chapter']]}`)")
    return myst.scale_banner(scale, meaning, SCALE_TAG, paper_scale_command(record), gpu)


def cell_tags(cell) -> list[str]:
    """The tags of a notebook cell (none: an empty list)."""
    return cell.get("metadata", {}).get("tags", [])


def add_tag(cell, tag: str) -> None:
    """Tag ``cell`` with ``tag`` (once)."""
    tags = cell.setdefault("metadata", {}).setdefault("tags", [])
    if tag not in tags:
        tags.append(tag)


def strip_tagged(nb, tag: str) -> None:
    """Remove the cells tagged ``tag``."""
    nb.cells = [c for c in nb.cells if tag not in cell_tags(c)]


def write_notebook(nb, path: Path) -> None:
    """Write ``nb`` as ``.ipynb`` to ``path``, atomically."""
    import nbformat

    atomic_write_text(path, nbformat.writes(nb))


def effective_parameters_source(source: str, params: dict[str, Any]) -> str:
    """The parameters cell ``source`` with each assigned value replaced by ``params``'.

    Comments, annotations and layout stay; a value equal to the written default stays as
    written.

    >>> effective_parameters_source('seed = 0  # the seed\\nn = 4\\n', {"seed": 3, "n": 4})
    'seed = 3  # the seed\\nn = 4\\n'
    >>> effective_parameters_source('model: str | None = None\\n', {"model": "tiny"})
    "model: str | None = 'tiny'\\n"
    """
    lines = source.split("\n")
    edits = []
    for node in ast.parse(source).body:
        if not (is_parameter_assignment(node) and assigned_name(node) in params):
            continue
        value, written = params[assigned_name(node)], ast.literal_eval(node.value)
        if written == value and type(written) is type(value):
            continue
        text = repr(value)
        if isinstance(value, str) and isinstance(written, str) and (
                ast.get_source_segment(source, node.value) or "").startswith('"'):
            text = json.dumps(value, ensure_ascii=False)  # the chapter's quotes
            if ast.literal_eval(text) != value:
                text = repr(value)
        edits.append((node.value.lineno - 1, node.value.col_offset,
                      node.value.end_lineno - 1, node.value.end_col_offset, text))
    for first, col, last, end_col, text in sorted(edits, reverse=True):
        head = lines[first].encode()[:col].decode()  # ast offsets count UTF-8 bytes
        tail = lines[last].encode()[end_col:].decode()
        lines[first:last + 1] = [head + text + tail]
    return "\n".join(lines)


def show_one_parameters_cell(nb, params: dict[str, Any]) -> None:
    """Leave one parameters cell on the page: papermill's injected one, with the effective
    values written as the chapter writes them (its comments kept).

    The chapter's own ``parameters`` cell stays in the notebook (papermill needs it to run
    the notebook again) but is tagged ``remove-cell``, off the page.
    """
    original = next((c for c in nb.cells if "parameters" in cell_tags(c)), None)
    injected = next((c for c in nb.cells if "injected-parameters" in cell_tags(c)), None)
    if original is None or injected is None:
        return
    with contextlib.suppress(SyntaxError, ValueError):
        injected.source = ("# Parameters of this run\n"
                           + effective_parameters_source(original.source, params))
    for tag in cell_tags(original):
        if tag != "parameters":
            add_tag(injected, tag)
    add_tag(original, REMOVE_TAG)


def install_cell_source(name: str, repository: str, commit: str) -> str:
    """The first cell of an executed notebook: installs ``companion`` when it is missing.

    In a clone of the repository (or under the runner) ``companion`` imports and the cell
    does nothing. Elsewhere (a notebook downloaded from the book) it installs the package
    at ``commit`` with pip, then the corpora (``python -m companion.corpora install``), and
    sends the chapter's outputs to ``companion-outputs/<name>/`` beside the notebook.
    ``$COMPANION_INSTALL_SOURCE`` replaces the requirement (a local checkout, say) and
    ``$COMPANION_PIP_ARGS`` adds pip arguments.
    """
    from companion.book import site

    ref = commit if re.fullmatch(r"[0-9a-f]{7,40}", commit) else "main"
    requirement = site.install_spec(repository or site.PLACEHOLDER_REPOSITORY, ref)
    extras = NOTEBOOK_EXTRAS.get(name)
    if extras and requirement.startswith(f"{site.DISTRIBUTION} @"):
        requirement = requirement.replace(site.DISTRIBUTION,
                                          f"{site.DISTRIBUTION}[{','.join(extras)}]", 1)
    return f"""# Set-up for a notebook downloaded from the book (hidden on the page). In a clone of
# the repository `companion` imports and this cell does nothing; elsewhere it installs the
# library at the commit that made this notebook, and the corpora the chapters read.
import importlib, importlib.util, os, shlex, subprocess, sys
if importlib.util.find_spec("companion") is None:
    _requirement = os.environ.get({ENV_INSTALL_SOURCE!r}) or {requirement!r}
    _pip_args = shlex.split(os.environ.get({ENV_PIP_ARGS!r}, ""))
    print("installing", _requirement, "(pip install)")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *_pip_args, _requirement],
                   check=True)
    importlib.invalidate_caches()
    if subprocess.run([sys.executable, "-m", "companion.corpora", "install"]).returncode:
        print("warning: the corpora were not installed; only the context-similarity "
              "chapter needs them")
    os.environ.setdefault({ENV_OUTPUT_DIR!r},
                          os.path.abspath(os.path.join("companion-outputs", {name!r})))
    import companion  # noqa: F401  (if this fails, restart the kernel and run again)
"""


def add_install_cell(nb, name: str, repository: str, commit: str) -> None:
    """Put the install cell (:func:`install_cell_source`) first, tagged ``remove-cell``."""
    import nbformat

    strip_tagged(nb, INSTALL_TAG)
    cell = nbformat.v4.new_code_cell(install_cell_source(name, repository, commit))
    cell.metadata["tags"] = [INSTALL_TAG, REMOVE_TAG]
    nb.cells.insert(0, cell)


def finish_notebook(executed, record: dict[str, Any]) -> None:
    """What the runner adds to an executed notebook before it is shown: the install cell,
    one parameters cell, the scale banner and the run box under the title."""
    strip_tagged(executed, STALE_TAG)
    strip_tagged(executed, SCALE_TAG)
    strip_tagged(executed, BOX_TAG)
    show_one_parameters_cell(executed, record["parameters"])
    # inserted after the title in reverse order: the banner ends up first
    insert_after_title(executed, markdown_cell(myst.run_box(record), BOX_TAG))
    insert_after_title(executed, markdown_cell(scale_banner(record), SCALE_TAG))
    add_install_cell(executed, record["chapter"], record.get("repository") or "",
                     str(record.get("git_commit") or "unknown"))


def add_references_section(executed) -> None:
    """End a page that cites (``{cite...}``) with its own references section: a page of
    an ``--out`` run stands alone, while the book lists them on a page of its own."""
    if "{cite" in json.dumps([c.source for c in executed.cells]):
        executed.cells.append(markdown_cell(myst.references_section(), REFERENCES_TAG))


def mark_stale(project: Project, name: str, source_nb, record: dict, good: dict | None) -> None:
    """Keep the last good notebook but put a stale banner on it (or a placeholder page)."""
    path = project.notebook(name)
    if path.exists():
        nb = read_notebook_ipynb(path)
    else:
        import nbformat

        nb = nbformat.v4.new_notebook()
        title = next((line for c in source_nb.cells if c.cell_type == "markdown"
                      for line in c.source.split("\n") if line.startswith("# ")), f"# {name}")
        nb.cells = [nbformat.v4.new_markdown_cell(title)]
        nb.metadata = copy.deepcopy(source_nb.metadata)
    strip_tagged(nb, STALE_TAG)
    insert_after_title(nb, markdown_cell(myst.stale_banner(record, good), STALE_TAG))
    write_notebook(nb, path)


def write_placeholder(project: Project, name: str) -> None:
    """A page for a chapter that has never been executed, saying so (never blank)."""
    if project.notebook(name).exists():
        return
    nb = read_notebook(project.source(name))
    record = {"finished": "never", "git_commit": "-" * 12,
              "error": "this chapter has not been executed in this build"}
    mark_stale(project, name, nb, record, None)
