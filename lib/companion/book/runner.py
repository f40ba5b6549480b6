"""Execute chapters with papermill and build the book.

A chapter is a MyST-markdown notebook ``chapters/<name>.md`` (jupytext). Running it:

1. reads it with jupytext and parses its ``parameters`` cell (the first code cell) into
   names and literal defaults; validates the requested parameters against them (an
   unknown name, unknown scale or wrongly typed value is an error listing the valid ones);
   Parameters other than the defaults replace the book's page, so the CLI refuses them
   without ``--out`` (below) or ``--publish``;
2. skips the run when a cached good run has the same key (chapter source, ``lib/``
   sources, parameters, processes and installed package versions), unless forced;
3. executes it with papermill into a private staging folder, the chapter writing its
   figures, tables, claims and kernel log there (see :mod:`companion.book.records`). It
   prints the log's path when it starts and, every :data:`PROGRESS_SECONDS`
   (``$COMPANION_PROGRESS_SECONDS``), the cell it is executing ("cell k of N");
4. on success swaps the staging outputs into ``book/_generated/`` and finishes the
   notebook for the page (:func:`finish_notebook`): a hidden first cell that installs the
   library when it is missing (a downloaded notebook runs outside a clone), one
   parameters cell shown (papermill's, with the effective values), and under the title
   the scale banner (below paper scale: with the command that runs paper scale) and a
   box with the parameters, scale, device, commit (a link), run time and the command to
   re-execute;
5. on failure keeps the previous good outputs, marks them stale (banner on the page and
   in the figure index), names the chapter, cell and exception, and exits non-zero.

``run --out DIR`` (``run_chapter(out=DIR)``) executes into ``DIR`` instead: notebook,
figures, tables, claims, log, ``run.json`` and a one-page HTML book
(``DIR/html/<name>.html``), leaving ``book/_generated/`` untouched. ``build`` runs each
chapter at its scale (:func:`parse_scale_spec`; ``publish`` is :data:`PUBLISH_SCALES`)
and relays each run's lines as they come; a chapter whose run is current costs no
process (:func:`cached_run`), and jupyter-book is not started when nothing it reads or
wrote has changed since its last good build (:func:`build_html`): a no-change rebuild
takes seconds. ``--nproc N`` reaches the kernel as
``$COMPANION_NPROC`` (:mod:`companion.parallel` reads it).

Faults and limits:

- **Interrupts.** SIGINT (Ctrl-C) and SIGTERM (what ``build`` sends its child runs) at
  any moment stop the run: the kernel is killed, the staging folder removed, and the
  published notebook, assets, run record and log are the previous ones byte for byte.
  Publishing (and marking stale) is all-or-nothing: a signal that arrives while it is
  under way is taken when it has finished, so the outputs are then the complete new
  ones. The CLI exits 128 + the signal number (130 for SIGINT, 143 for SIGTERM). Why
  it is done this way: see :func:`interrupt_guard`.
- **Timeouts.** Each cell may run at most :data:`CELL_TIMEOUT_SECONDS` for the scale
  (smoke 600 s, ci 1800 s, paper 86400 s), or ``--timeout SECONDS``. A cell that takes
  longer fails the chapter ("cell N timed out after T s") and marks the page stale.
- **Devices.** ``--device cuda`` or ``cuda:N`` on a machine without that CUDA device is
  refused before anything is started or marked (a :class:`ChapterError`, exit 2).
- **Concurrent runs.** One run per chapter at a time: ``book/_generated/locks/<name>.lock``
  (a :class:`filelock.FileLock`). A second ``run`` or ``build`` of the same chapter
  prints that it waits for the other run, then waits for it (Ctrl-C stops the wait),
  and then proceeds, usually as a cache hit.

Layout under ``book/_generated/``::

    chapters/<name>.ipynb       executed notebook shown in the book
    assets/<name>/figures/...   PNG/SVG/PDF + JSON sidecars
    assets/<name>/tables/...    CSV/MD + JSON sidecars
    assets/<name>/claims/...    one JSON per claim
    runs/<name>.json            last run: status, cache key, parameters, commit, timings
    logs/<name>.log             the kernel's output of the last run (not of an interrupted one)
    locks/<name>.lock           held while a run of the chapter is under way (not published)

For the tests only, ``COMPANION_TEST_PAUSE_AT=<point>:<marker path>`` makes a run stop
at ``<point>`` (``kernel-start``: just before the kernel is launched; ``publish``: after
the assets are swapped in, before the notebook is written), create the marker file and
wait there until it is interrupted or ``<marker path>.release`` exists (see
:func:`_test_pause`). Tests use it to send signals at moments they cannot otherwise
hit deterministically.
"""
from __future__ import annotations

import ast
import contextlib
import copy
import hashlib
import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from companion._validate import check_int, check_number
from companion.book import myst
from companion.book.chapter import (ENV_ASSET_URL, ENV_CHAPTER, ENV_DEVICE_FILE,
                                    ENV_OUTPUT_DIR, ENV_THREADS, SCALES)
from companion.book.files import atomic_write_text, dumps, now_iso
from companion.book.gitstate import ENV_COMMIT, ENV_DIRTY, git_state
from companion.book.project import (  # noqa: F401 - re-exported: the runner's project API
    ChapterError,
    Project,
    load_record,
    read_notebook,
    read_notebook_ipynb,
)
from companion.book.interrupts import (  # noqa: F401 - re-exported: the runner's interrupt API
    INTERRUPT_SIGNALS,
    _INTERRUPT,
    RunInterrupted,
    _on_interrupt_signal,
    install_interrupt_handlers,
    interrupt_guard,
    raise_if_interrupted,
    signals_deferred,
)

REQUIRED_PARAMETERS = ("scale", "seed", "device")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
STALE_TAG = "companion-stale-banner"
BOX_TAG = "companion-run-box"
SCALE_TAG = "companion-scale-banner"
INSTALL_TAG = "companion-install"
#: Jupyter Book's tag for a cell kept in the notebook but left off the page.
REMOVE_TAG = "remove-cell"
#: The scale each chapter of the published book is run at (``make publish``, ``build
#: --scale publish``): the largest it reaches on a CPU. ``sbm_transformer`` needs a GPU
#: for the papers' settings, so its page says how to run them there.
PUBLISH_SCALES = {"hasse": "paper", "gradient_flow": "paper",
                  "context_similarity": "paper", "sbm_transformer": "ci"}
#: The ``--scale`` value of ``build`` that means :data:`PUBLISH_SCALES`.
PUBLISH = "publish"
#: What each scale is, in the words of the scale banner at the top of a page.
SCALE_MEANING = {"smoke": "the test suite's size: seconds of work, nothing to conclude from",
                 "ci": "reduced sizes that a CPU runs in minutes",
                 "paper": "the papers' own settings"}
#: Extras of the distribution a downloaded notebook installs, per chapter (base: none).
NOTEBOOK_EXTRAS = {"context_similarity": ("nlp",)}
# Longest time one cell may run, per scale, unless --timeout says otherwise. Generous:
# they exist to stop a hung run, not to police a slow machine.
CELL_TIMEOUT_SECONDS = {"smoke": 600.0, "ci": 1800.0, "paper": 86400.0}
ENV_TEST_PAUSE_AT = "COMPANION_TEST_PAUSE_AT"
#: Processes for the chapters' scale-out (torchrun), read by :mod:`companion.parallel`.
ENV_NPROC = "COMPANION_NPROC"
#: Seconds between two progress lines of a running chapter (default 30).
ENV_PROGRESS_SECONDS = "COMPANION_PROGRESS_SECONDS"
PROGRESS_SECONDS = 30.0
#: The install cell of a downloaded notebook: a pip requirement (or local path) that
#: replaces the package at the notebook's commit, and extra pip arguments (shell words).
ENV_INSTALL_SOURCE = "COMPANION_INSTALL_SOURCE"
ENV_PIP_ARGS = "COMPANION_PIP_ARGS"


# --------------------------------------------------------------------------- project
# --------------------------------------------------------------------------- parameters
def parameters_cell_index(nb) -> int:
    """Index of the ``parameters`` cell, which must be the first code cell."""
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    if not code:
        raise ChapterError("the notebook has no code cell; the first must be tagged 'parameters'")
    first = nb.cells[code[0]]
    if "parameters" not in first.get("metadata", {}).get("tags", []):
        raise ChapterError("the first code cell must be tagged 'parameters'")
    return code[0]


def parse_parameters(source: str) -> dict[str, Any]:
    """The ``name = literal`` assignments of a parameters cell, in order.

    Only plain assignments of literals are allowed, so defaults are known without running
    anything, and every parameter has a type to check overrides against.
    """
    tree = ast.parse(source)
    params: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
            node.targets[0], ast.Name
        ):
            try:
                params[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError as exc:
                raise ChapterError(
                    f"parameter {node.targets[0].id!r}: the default must be a literal"
                ) from exc
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # a docstring-like comment
        else:
            raise ChapterError(
                f"parameters cell, line {node.lineno}: only 'name = literal' assignments "
                "are allowed"
            )
    missing = [p for p in REQUIRED_PARAMETERS if p not in params]
    if missing:
        raise ChapterError(f"parameters cell lacks required parameter(s) {missing}")
    return params


def _describe_params(defaults: dict[str, Any]) -> str:
    return ", ".join(f"{k} ({type(v).__name__}, default {v!r})" for k, v in defaults.items())


def coerce_parameter(name: str, value: Any, default: Any) -> Any:
    """Convert ``value`` (a CLI string or a Python value) to the type of ``default``."""
    kind = type(default)
    if isinstance(value, str) and kind is not str:
        text = value.strip()
        if kind is bool:
            low = text.lower()
            if low in ("true", "1", "yes"):
                return True
            if low in ("false", "0", "no"):
                return False
            raise ChapterError(f"parameter {name!r}: expected a bool (true/false), got {value!r}")
        if default is None:
            try:
                return ast.literal_eval(text)
            except (ValueError, SyntaxError):
                return text
        try:
            parsed = ast.literal_eval(text)
        except (ValueError, SyntaxError) as exc:
            raise ChapterError(
                f"parameter {name!r}: expected a {kind.__name__}, got {value!r}"
            ) from exc
        value = parsed
    if default is None or value is None:
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is bool and not isinstance(value, bool):
        raise ChapterError(f"parameter {name!r}: expected a bool, got {value!r}")
    if kind is int and isinstance(value, bool):
        raise ChapterError(f"parameter {name!r}: expected an int, got {value!r}")
    if not isinstance(value, kind):
        raise ChapterError(
            f"parameter {name!r}: expected a {kind.__name__}, got {type(value).__name__} {value!r}"
        )
    return value


def resolve_parameters(defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Defaults updated with overrides, each checked by name and type."""
    resolved = dict(defaults)
    for name, value in overrides.items():
        if name not in defaults:
            raise ChapterError(
                f"unknown parameter {name!r}; valid parameters: {_describe_params(defaults)}"
            )
        resolved[name] = coerce_parameter(name, value, defaults[name])
    if resolved["scale"] not in SCALES:
        raise ChapterError(f"scale: expected one of {SCALES}, got {resolved['scale']!r}")
    dev = str(resolved["device"])
    if dev not in DEVICE_CHOICES and not dev.startswith("cuda:"):
        raise ChapterError(f"device: expected one of {DEVICE_CHOICES}, got {dev!r}")
    return resolved


def non_default_parameters(params: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The parameters (other than scale and device) whose value is not the chapter's default.

    >>> non_default_parameters({"scale": "ci", "seed": 1, "device": "cpu", "n": 4},
    ...                        {"scale": "ci", "seed": 0, "device": "auto", "n": 4})
    {'seed': 1}
    """
    return {k: v for k, v in params.items()
            if k not in ("scale", "device") and v != defaults.get(k)}


def parse_scale_spec(spec: str | None, chapters: list[str]) -> dict[str, str | None]:
    """Each chapter's scale from the ``--scale`` value of ``build``.

    Parameters
    ----------
    spec
        None (every chapter at its default scale); a scale (``"ci"``); ``"publish"``
        (:data:`PUBLISH_SCALES`); or comma-separated items, each a scale or ``publish``
        (for the chapters not named) or ``CHAPTER=SCALE``, e.g.
        ``"hasse=paper,gradient_flow=paper,context_similarity=paper,sbm_transformer=ci"``.
    chapters
        The chapters to run.

    Returns
    -------
    dict
        Chapter name -> scale, or None for the chapter's default.

    Raises
    ------
    ChapterError
        An unknown scale or chapter, a chapter named twice, two defaults.

    >>> parse_scale_spec("ci,hasse=paper", ["hasse", "sbm_transformer"])
    {'hasse': 'paper', 'sbm_transformer': 'ci'}
    """
    scales: dict[str, str | None] = {name: None for name in chapters}
    if spec is None:
        return scales
    if not isinstance(spec, str) or not spec.strip():
        raise ChapterError(f"--scale: expected a scale ({', '.join(SCALES)}), "
                           f"{PUBLISH!r} or CHAPTER=SCALE items, got {spec!r}")
    items = [item.strip() for item in spec.split(",")]
    defaults = [item for item in items if "=" not in item]
    named = [item for item in items if "=" in item]
    if len(defaults) > 1:
        raise ChapterError(f"--scale: more than one default scale in {spec!r} ({defaults}); "
                           "give one, and CHAPTER=SCALE for the others")
    for item in defaults:
        if item == PUBLISH:
            scales.update({n: s for n, s in PUBLISH_SCALES.items() if n in scales})
        elif item in SCALES:
            scales = {name: item for name in scales}
        else:
            raise ChapterError(f"--scale: unknown scale {item!r}; expected one of "
                               f"{', '.join(SCALES)}, {PUBLISH!r} or CHAPTER=SCALE")
    seen: set[str] = set()
    for item in named:
        name, _, scale = (part.strip() for part in item.partition("="))
        if name not in chapters:
            raise ChapterError(f"--scale: unknown chapter {name!r} in {item!r}; chapters: "
                               f"{', '.join(chapters) or 'none'}")
        if scale not in SCALES:
            raise ChapterError(f"--scale: unknown scale {scale!r} for chapter {name!r}; "
                               f"expected one of {', '.join(SCALES)}")
        if name in seen:
            raise ChapterError(f"--scale: chapter {name!r} is given twice in {spec!r}")
        seen.add(name)
        scales[name] = scale
    return scales


def check_nproc(nproc: Any) -> int:
    """``nproc`` (processes for a chapter's scale-out) as a positive int; 1 for None.

    >>> check_nproc(None), check_nproc(4)
    (1, 4)
    """
    if nproc is None:
        return 1
    try:
        return check_int("nproc", nproc, minimum=1)
    except (TypeError, ValueError):
        raise ChapterError(f"nproc: expected a positive integer number of processes, "
                           f"got {nproc!r}") from None


def progress_seconds() -> float:
    """Seconds between two progress lines: ``$COMPANION_PROGRESS_SECONDS`` or 30."""
    text = os.environ.get(ENV_PROGRESS_SECONDS, "").strip()
    if not text:
        return PROGRESS_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ChapterError(f"{ENV_PROGRESS_SECONDS}: expected a positive number of seconds, "
                           f"got {text!r}")
    return value


# --------------------------------------------------------------------------- cache key
def installed_versions() -> list[str]:
    """``name==version`` of every installed distribution, sorted (part of the cache key).

    Read from the first lines of each distribution's metadata file rather than through
    ``Distribution.metadata``, whose e-mail parser reads the whole file (ten times
    slower); the strings are the same.
    """
    from importlib import metadata

    return sorted(_name_and_version(d) for d in metadata.distributions())


def _name_and_version(dist) -> str:
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    name = version = None
    for line in text.split("\n"):
        if not line.strip():  # the end of the headers
            break
        if name is None and line.startswith("Name:"):
            name = line[len("Name:"):].strip()
        elif version is None and line.startswith("Version:"):
            version = line[len("Version:"):].strip()
    return f"{(name or '').lower()}=={version}"


def chapter_front_matter(project: Project, name: str) -> dict[str, Any]:
    """The ``companion:`` mapping of the YAML front matter of ``chapters/<name>.md``
    (empty when the chapter has none); ChapterError when it is not a mapping."""
    import yaml

    text = project.source(name).read_text()
    if not text.startswith("---"):
        return {}
    end = text.find("\n---", 3)
    meta = yaml.safe_load(text[3:end]) if end > 0 else None
    section = (meta or {}).get("companion") if isinstance(meta, dict) else None
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ChapterError(f"{name}: front matter companion must be a mapping, "
                           f"got {type(section).__name__}")
    return section


def expected_seconds(project: Project, name: str, scale: str | None) -> float:
    """How long chapter ``name`` is expected to run at ``scale`` (None: its default), for
    :func:`run_many`'s schedule only (the longest starts first): the last run's seconds
    when that run was at this scale; else the hint in its front matter,
    ``companion: expected-minutes: {scale: minutes}`` (minutes on a 2-core machine, so a
    clean clone schedules well too); else 0. Never an error: a bad hint counts as none.
    """
    try:
        params = _prepare(project, name, scale, None, None)[3]
    except ChapterError:
        return 0.0
    wanted = params.get("scale")
    record = load_record(project, name)
    if (record and record.get("status") == "ok"
            and (record.get("parameters") or {}).get("scale") == wanted):
        with contextlib.suppress(TypeError, ValueError):
            return float(record["seconds"])
    try:
        hint = (chapter_front_matter(project, name).get("expected-minutes") or {}).get(wanted)
        return 60.0 * float(hint) if hint is not None else 0.0
    except (ChapterError, AttributeError, TypeError, ValueError):
        return 0.0


def longest_first(project: Project, names: list[str],
                  scales: dict[str, str | None]) -> list[str]:
    """``names`` in the order :func:`run_many` starts them: longest expected run first
    (:func:`expected_seconds`), ties in the given order. With two slots, a long chapter
    started last would run alone at the end (at ci scale the SBM chapter is most of the
    book's time)."""
    expected = {name: expected_seconds(project, name, scales.get(name)) for name in names}
    return sorted(names, key=lambda name: -expected[name])


def chapter_inputs(project: Project, name: str) -> list[Path]:
    """The files a chapter reads besides the library, from its front matter.

    A chapter lists them (paths or globs, relative to the project root) under
    ``companion: inputs:`` in the YAML front matter of ``chapters/<name>.md``; e.g. the
    SBM chapter reads the benchmark results it draws. They enter the cache key, so a new
    ``make bench`` re-executes the chapter. Files that do not exist are simply absent.
    """
    patterns = chapter_front_matter(project, name).get("inputs") or []
    if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
        raise ChapterError(f"{name}: front matter companion.inputs must be a list of paths")
    return sorted({path for pattern in patterns for path in project.root.glob(pattern)
                   if path.is_file()})


def cache_key(project: Project, name: str, params: dict[str, Any], nproc: int = 1,
              versions: list[str] | None = None) -> str:
    """Hash of everything a chapter's outputs depend on (``nproc``: its processes;
    ``versions``: :func:`installed_versions`, computed here when not given)."""
    h = hashlib.sha256()
    h.update(project.source(name).read_bytes())
    for path in chapter_inputs(project, name):
        h.update(str(path.relative_to(project.root)).encode())
        h.update(path.read_bytes())
    for path in sorted((project.lib_dir).rglob("*.py")):
        h.update(str(path.relative_to(project.lib_dir)).encode())
        h.update(path.read_bytes())
    h.update(json.dumps(params, sort_keys=True, default=str).encode())
    h.update(f"nproc={nproc}".encode())
    h.update("\n".join(installed_versions() if versions is None else versions).encode())
    return h.hexdigest()


# --------------------------------------------------------------------------- notebook edits
def rerun_command(name: str, params: dict[str, Any], defaults: dict[str, Any],
                  nproc: int = 1, out: str | None = None) -> str:
    """The ``python -m companion run`` command that re-executes a run with ``params``.

    Non-default parameters are given with ``-p``; without ``out`` they replace the book's
    page, so the command then says ``--publish`` (see :func:`run_chapter`).

    >>> rerun_command("hasse", {"scale": "ci", "seed": 0, "device": "auto", "n": 8},
    ...               {"scale": "ci", "seed": 0, "device": "auto", "n": 4})
    'python -m companion run hasse --scale ci --device auto -p seed 0 -p n 8 --publish'
    """
    parts = ["python", "-m", "companion", "run", name,
             "--scale", str(params["scale"]), "--device", str(params["device"])]
    if nproc != 1:
        parts += ["--nproc", str(nproc)]
    for key, value in params.items():
        if key in ("scale", "device"):
            continue
        if key == "seed" or value != defaults.get(key):
            parts += ["-p", key, str(value)]
    if out is not None:
        parts += ["--out", out]
    elif non_default_parameters(params, defaults):
        parts.append("--publish")
    return " ".join(shlex.quote(p) for p in parts)


def paper_scale_command(record: dict[str, Any]) -> str:
    """The command that runs the chapter of ``record`` at paper scale (on a GPU where a CPU
    does not reach it: :data:`PUBLISH_SCALES`)."""
    name = record["chapter"]
    params = dict(record["parameters"], scale="paper")
    if PUBLISH_SCALES.get(name, "paper") != "paper":
        params["device"] = "cuda"
    return rerun_command(name, params, record.get("defaults", params),
                         record.get("nproc", 1), "DIR" if record.get("out") else None)


def _insert_after_title(nb, cell) -> None:
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


def _markdown_cell(source: str, tag: str):
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


def _tags(cell) -> list[str]:
    return cell.get("metadata", {}).get("tags", [])


def _add_tag(cell, tag: str) -> None:
    tags = cell.setdefault("metadata", {}).setdefault("tags", [])
    if tag not in tags:
        tags.append(tag)


def effective_parameters_source(source: str, params: dict[str, Any]) -> str:
    """The parameters cell ``source`` with each assigned value replaced by ``params``'.

    Comments and layout stay; a value equal to the written default stays as written.

    >>> effective_parameters_source('seed = 0  # the seed\\nn = 4\\n', {"seed": 3, "n": 4})
    'seed = 3  # the seed\\nn = 4\\n'
    """
    tree = ast.parse(source)
    lines = source.split("\n")
    edits = []
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id in params):
            continue
        value, written = params[node.targets[0].id], ast.literal_eval(node.value)
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
    original = next((c for c in nb.cells if "parameters" in _tags(c)), None)
    injected = next((c for c in nb.cells if "injected-parameters" in _tags(c)), None)
    if original is None or injected is None:
        return
    with contextlib.suppress(SyntaxError, ValueError):
        injected.source = ("# Parameters of this run\n"
                           + effective_parameters_source(original.source, params))
    for tag in _tags(original):
        if tag != "parameters":
            _add_tag(injected, tag)
    _add_tag(original, REMOVE_TAG)


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

    _strip_tagged(nb, INSTALL_TAG)
    cell = nbformat.v4.new_code_cell(install_cell_source(name, repository, commit))
    cell.metadata["tags"] = [INSTALL_TAG, REMOVE_TAG]
    nb.cells.insert(0, cell)


def finish_notebook(executed, record: dict[str, Any]) -> None:
    """What the runner adds to an executed notebook before it is shown: the install cell,
    one parameters cell, the scale banner and the run box under the title."""
    _strip_tagged(executed, STALE_TAG)
    _strip_tagged(executed, SCALE_TAG)
    _strip_tagged(executed, BOX_TAG)
    show_one_parameters_cell(executed, record["parameters"])
    # inserted after the title in reverse order: the banner ends up first
    _insert_after_title(executed, _markdown_cell(myst.run_box(record), BOX_TAG))
    _insert_after_title(executed, _markdown_cell(scale_banner(record), SCALE_TAG))
    add_install_cell(executed, record["chapter"], record.get("repository") or "",
                     str(record.get("git_commit") or "unknown"))


def _strip_tagged(nb, tag: str) -> None:
    nb.cells = [c for c in nb.cells if tag not in c.get("metadata", {}).get("tags", [])]


def _write_notebook(nb, path: Path) -> None:
    import nbformat

    atomic_write_text(path, nbformat.writes(nb))


# --------------------------------------------------------------------------- running
@dataclass
class RunResult:
    name: str
    status: str  # "ok" | "cached" | "failed"
    seconds: float = 0.0
    error: str | None = None
    record: dict[str, Any] = field(default_factory=dict)


def _papermill_error(exc: BaseException, nb_cells_before: int) -> str:
    """'cell N (ExcName): message' from a papermill execution error."""
    ename = getattr(exc, "ename", type(exc).__name__)
    evalue = str(getattr(exc, "evalue", exc)).strip().splitlines()
    msg = evalue[-1] if evalue else ""
    idx = getattr(exc, "cell_index", None)
    if idx is not None:
        return f"cell {_chapter_cell_number(idx, nb_cells_before)} raised {ename}: {msg}"
    return f"{ename}: {msg}"


def _chapter_cell_number(executed_index: int, parameters_cell: int) -> int:
    """The 1-based number, in the chapter as written, of a cell of the executed notebook.

    papermill inserts one 'injected-parameters' cell after the parameters cell.
    """
    return executed_index + 1 - (1 if executed_index > parameters_cell else 0)


def _test_pause(point: str, stop: threading.Event | None = None) -> None:
    """The test hook of the module docstring (``COMPANION_TEST_PAUSE_AT``); else nothing."""
    spec = os.environ.get(ENV_TEST_PAUSE_AT, "")
    at, _, marker = spec.partition(":")
    if at != point or not marker:
        return
    Path(marker).write_text(str(os.getpid()))
    release = Path(marker + ".release")
    while not release.exists():
        if _INTERRUPT.signum is not None or (stop is not None and stop.is_set()):
            break
        time.sleep(0.05)


# --------------------------------------------------------------------------- kernel
class _KernelTracker:
    """The kernel a run launches, so that the main thread can kill it on an interrupt.

    The kernel runs in its own session (jupyter_client starts it with
    ``start_new_session``), so a Ctrl-C at the terminal never reaches it: it cannot turn
    an interrupt into a failed cell. The kernel is killed with its whole process group.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pids: list[int] = []
        self.stopped = threading.Event()
        self.peak_bytes = 0  # largest resident memory seen: the kernel and its children

    def sample_memory(self) -> None:
        """Update :attr:`peak_bytes`: the kernel's own peak (``VmHWM``, exact) or the sum of
        the resident memory of the kernel and its children (``torchrun`` ranks, sampled)."""
        import psutil

        with self._lock:
            pids = list(self._pids)
        for pid in pids:
            with contextlib.suppress(psutil.Error, OSError, ValueError):
                kernel = psutil.Process(pid)
                total = kernel.memory_info().rss + sum(
                    c.memory_info().rss for c in kernel.children(recursive=True))
                hwm = 0
                with open(f"/proc/{pid}/status") as fh:
                    for line in fh:
                        if line.startswith("VmHWM:"):
                            hwm = int(line.split()[1]) * 1024
                self.peak_bytes = max(self.peak_bytes, total, hwm)

    def manager_class(self):
        """An AsyncKernelManager class that reports its kernel here (or refuses to start)."""
        from jupyter_client.manager import AsyncKernelManager

        tracker = self

        class TrackedKernelManager(AsyncKernelManager):
            async def start_kernel(self, **kw):
                _test_pause("kernel-start", tracker.stopped)
                if tracker.stopped.is_set():
                    raise RuntimeError("the run was interrupted before the kernel started")
                await super().start_kernel(**kw)
                tracker._started(self.provisioner.process.pid)

        return TrackedKernelManager

    def _started(self, pid: int) -> None:
        with self._lock:
            self._pids.append(pid)
            if not self.stopped.is_set():
                return
        self.kill()  # interrupted while the kernel was starting

    def stop(self) -> None:
        """No further kernel may start; kill the running one."""
        with self._lock:
            self.stopped.set()
        self.kill()

    def kill(self) -> None:
        with self._lock:
            pids = list(self._pids)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # its session's group: the kernel and children


@dataclass
class _Execution:
    """What the worker thread of :func:`_execute_notebook` left: an error, or none."""

    error: BaseException | None = None
    cell_index: int | None = None  # the cell being executed when it stopped
    peak_bytes: int = 0  # the kernel's (and its children's) largest resident memory


@dataclass
class _Progress:
    """Where a running chapter is, for its progress lines (see :func:`progress_line`)."""

    name: str
    code_cells: int  # in the executed notebook: the chapter's and papermill's injected one
    started: float = field(default_factory=time.monotonic)
    code_cell: int = 0  # the code cell being executed (1-based; 0: none yet)
    cell_started: float = 0.0
    chapter_cell: int | None = None  # its number in the chapter as written


def progress_line(progress: _Progress, now: float | None = None) -> str:
    """``[progress] NAME: cell k of N (chapter cell c) for s, t in all``."""
    now = time.monotonic() if now is None else now
    total = f"{now - progress.started:.0f} s in all"
    if not progress.code_cell:
        return f"[progress] {progress.name}: starting the kernel, {total}"
    where = (f" (chapter cell {progress.chapter_cell})"
             if progress.chapter_cell is not None else "")
    return (f"[progress] {progress.name}: cell {progress.code_cell} of {progress.code_cells}"
            f"{where} running for {now - progress.cell_started:.0f} s, {total}")


def _execute_notebook(input_nb: Path, output_nb: Path, log_path: Path, params: dict[str, Any],
                      cwd: Path, timeout: float, progress: _Progress | None = None,
                      echo: Callable[[str], None] | None = None,
                      parameters_cell: int = 0) -> _Execution:
    """Run papermill in a worker thread, waiting in the main thread (see interrupt_guard).

    Every :func:`progress_seconds` the main thread echoes a :func:`progress_line`. On an
    interrupt the kernel is killed, the worker is waited for (it ends once nbclient sees
    the dead kernel) and the interrupt is re-raised.
    """
    import papermill as pm

    tracker = _KernelTracker()
    outcome = _Execution()
    period = progress_seconds()

    def on_cell_start(cell, cell_index, **_):
        outcome.cell_index = cell_index
        if progress is not None and cell.cell_type == "code":
            progress.code_cell += 1
            progress.cell_started = time.monotonic()
            progress.chapter_cell = (None if "injected-parameters" in _tags(cell) else
                                     _chapter_cell_number(cell_index, parameters_cell))

    # The worker says it has ended through this event, never through Thread.join or
    # is_alive: on Python 3.11 a KeyboardInterrupt raised inside join() marks a thread
    # that is still running as stopped (threading's bpo-45274 handler releases the lock
    # the running thread holds), so a second join returned at once and the staging folder
    # was removed while papermill still wrote the output notebook into it.
    ended = threading.Event()

    def work() -> None:
        try:
            with open(log_path, "w") as log:
                pm.execute_notebook(
                    str(input_nb), str(output_nb), parameters=params, kernel_name="python3",
                    log_output=False, progress_bar=sys.stderr.isatty(),
                    stdout_file=log, stderr_file=log, cwd=str(cwd),
                    execution_timeout=timeout, kernel_manager_class=tracker.manager_class(),
                    on_cell_start=on_cell_start, start_timeout=KERNEL_START_LIMIT_S,
                    iopub_timeout=OUTPUT_WAIT_LIMIT_S, raise_on_iopub_timeout=True,
                )
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread as it is
            outcome.error = exc
        finally:
            ended.set()

    worker = threading.Thread(target=work, name="papermill", daemon=True)
    try:
        worker.start()
        next_report = time.monotonic() + period
        while True:
            finished = ended.wait(timeout=min(0.5, period))
            tracker.sample_memory()  # once more after the end, as the peak may be there
            outcome.peak_bytes = tracker.peak_bytes
            if finished:
                break
            if progress is not None and echo is not None and (
                    time.monotonic() >= next_report):
                echo(progress_line(progress))
                next_report = time.monotonic() + period
        raise_if_interrupted()
    except KeyboardInterrupt:
        with signals_deferred():
            tracker.stop()
            # Safety net only: the worker ends within seconds of the kernel's death.
            ended.wait(timeout=WORKER_END_LIMIT_S)
        raise
    return outcome


# Safety limits, not expected times (a loaded machine starts a kernel in seconds): the
# kernel's start, and the wait for a cell's last output after its reply; nbclient's
# defaults (60 s, 4 s) would fail a start, or silently drop the end of a cell's output
# from the page, on a busy machine. Past them the chapter fails; nothing is dropped.
KERNEL_START_LIMIT_S = 600
OUTPUT_WAIT_LIMIT_S = 300
# ... and papermill's end after the kernel was killed on an interrupt (it notices the dead
# kernel within a second or two and writes the output notebook).
WORKER_END_LIMIT_S = 300


def _execution_error(outcome: _Execution, parameters_cell: int, timeout: float) -> str | None:
    """The chapter's error message for a finished execution, or None when it succeeded."""
    import papermill as pm
    from nbclient.exceptions import CellTimeoutError

    exc = outcome.error
    if exc is None:
        return None
    if isinstance(exc, pm.PapermillExecutionError):
        return _papermill_error(exc, parameters_cell)
    if isinstance(exc, CellTimeoutError):
        where = (f"cell {_chapter_cell_number(outcome.cell_index, parameters_cell)}"
                 if outcome.cell_index is not None else "a cell")
        return f"{where} timed out after {timeout:g} s (raise the limit with --timeout SECONDS)"
    return f"{type(exc).__name__}: {exc}"


def default_timeout(scale: str) -> float:
    return CELL_TIMEOUT_SECONDS[scale]


def check_timeout(timeout: Any) -> float | None:
    """``timeout`` as seconds (a positive finite number) or None; ChapterError otherwise."""
    if timeout is None:
        return None
    try:
        return check_number("timeout", timeout, minimum=0, min_open=True)
    except (TypeError, ValueError):
        raise ChapterError(f"timeout: expected a positive number of seconds, "
                           f"got {timeout!r}") from None


def check_device_available(device: str) -> None:
    """Refuse ``cuda``/``cuda:N`` when this machine has no such CUDA device.

    torch is imported only when a CUDA device is requested ("auto" and "cpu" always work).
    """
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ChapterError(
            f"device {device!r}: CUDA is not available on this machine (torch "
            f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}); "
            "use --device cpu or --device auto")
    index = device.partition(":")[2]
    if index:
        if not index.isdigit():
            raise ChapterError(f"device: expected 'cuda' or 'cuda:N' with N an integer, "
                               f"got {device!r}")
        if int(index) >= torch.cuda.device_count():
            raise ChapterError(f"device {device!r}: this machine has "
                               f"{torch.cuda.device_count()} CUDA device(s)")


def _chapter_lock_file(project: Project, name: str):
    """The chapter's lock, ``locks/<name>.lock`` (its folder made), not yet acquired."""
    import filelock

    path = project.generated / "locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    return filelock.FileLock(str(path))


@contextlib.contextmanager
def chapter_lock(project: Project, name: str, echo: Callable[[str], None]):
    """Hold ``locks/<name>.lock``; if another run holds it, say so and wait for it."""
    import filelock

    lock = _chapter_lock_file(project, name)
    try:
        lock.acquire(blocking=False)
    except filelock.Timeout:
        echo(f"[waiting] {name}: another run of this chapter holds {lock.lock_file}; "
             "waiting for it to finish")
        lock.acquire()
    try:
        yield
    finally:
        with signals_deferred():
            lock.release()


# --------------------------------------------------------------------------- run_chapter
def run_chapter(
    project: Project,
    name: str,
    *,
    scale: str | None = None,
    device: str | None = None,
    overrides: dict[str, Any] | None = None,
    force: bool = False,
    threads: int | None = None,
    timeout: float | None = None,
    nproc: int | None = None,
    out: str | os.PathLike | None = None,
    publish_non_default: bool = True,
    echo: Callable[[str], None] = print,
) -> RunResult:
    """Execute one chapter into ``book/_generated/``, or into ``out`` (see the module docstring).

    Parameters
    ----------
    project, name
        The book project and the chapter (``chapters/<name>.md``).
    scale, device, overrides
        Chapter parameters (``overrides`` maps parameter names to values or CLI strings).
    force
        Re-execute even when a cached good run has the same key.
    threads
        Torch threads for the kernel (None: torch's default).
    timeout
        Longest time one cell may run, in seconds; None: :data:`CELL_TIMEOUT_SECONDS`
        of the scale.
    nproc
        Processes for the chapter's scale-out (``$COMPANION_NPROC`` of the kernel, read by
        :mod:`companion.parallel`); part of the cache key. None: 1.
    out
        A folder for the run instead of the book: the executed notebook, figures, tables,
        claims, log, ``run.json`` and an HTML page (``html/<name>.html``). The book
        (``book/_generated/``) is not touched; there is no cache. The folder must be new,
        empty or an earlier ``out`` run (which is replaced).
    publish_non_default
        False refuses (ChapterError) to publish into the book a run whose parameters are
        not the chapter's defaults (``python -m companion run`` without ``--publish``): a
        reader exploring parameters must not replace the book's page by accident.
    echo
        Where progress lines go.

    Returns
    -------
    RunResult
        Status "ok", "cached" or "failed" (with the error).

    Raises
    ------
    ChapterError
        Unknown chapter, bad parameters, timeout or nproc, unavailable CUDA device, a
        refused non-default run or ``out`` folder (nothing is run or marked stale).
    RunInterrupted
        SIGINT or SIGTERM (a KeyboardInterrupt); the published outputs are whole.
    """
    with interrupt_guard():
        nb, pidx, defaults, params = _prepare(project, name, scale, device, overrides)
        timeout = check_timeout(timeout) or default_timeout(params["scale"])
        nproc = check_nproc(nproc)
        progress_seconds()  # a bad $COMPANION_PROGRESS_SECONDS is refused before the run
        check_device_available(str(params["device"]))
        # a signal swallowed on the way here (inside an import: see interrupts) stops the
        # run before anything starts
        raise_if_interrupted()
        if out is not None:
            folder = check_out_folder(project, out)
            return _execute_into_folder(project, name, nb, pidx, defaults, params, folder,
                                        threads, timeout, nproc, echo)
        if not publish_non_default:
            _refuse_non_default(name, params, defaults)
        with chapter_lock(project, name, echo):
            key = cache_key(project, name, params, nproc)
            previous = load_record(project, name, echo)
            if not force and is_cached(project, name, previous, key):
                return _cached_result(name, previous, echo)
            return _execute_and_publish(project, name, nb, pidx, defaults, params, key,
                                        previous, threads, timeout, echo, nproc)


def _refuse_non_default(name: str, params: dict[str, Any], defaults: dict[str, Any]) -> None:
    """ChapterError when ``params`` are not the chapter's defaults (a run without ``--out``
    would replace the book's page with them)."""
    changed = non_default_parameters(params, defaults)
    if changed:
        given = " ".join(f"-p {k} {shlex.quote(str(v))}" for k, v in changed.items())
        raise ChapterError(
            f"chapter {name!r}: {given} is not the chapter's default, and a run without "
            "--out replaces the book's page (book/_generated/). To explore parameters, "
            f"write the run into a folder of its own: python -m companion run {name} "
            f"--out DIR {given}; to replace the book's page on purpose, add --publish.")


def is_cached(project: Project, name: str, previous: dict[str, Any] | None, key: str) -> bool:
    """Whether the published run ``previous`` of ``name`` is good and has cache key ``key``."""
    return bool(previous and previous.get("status") == "ok"
                and previous.get("cache_key") == key and project.notebook(name).exists())


def _cached_result(name: str, previous: dict[str, Any],
                   echo: Callable[[str], None]) -> RunResult:
    echo(f"[cached] {name}: unchanged since {previous['finished']} (use --force to re-run)")
    return RunResult(name, "cached", 0.0, record=previous)


def cached_run(project: Project, name: str, *, scale: str | None, device: str | None,
               nproc: int | None, echo: Callable[[str], None],
               versions: list[str] | None = None) -> RunResult | None:
    """The cached result of running ``name`` with these settings, without starting a
    process, or None when it must run (or cannot say: the run then reports why).

    What :func:`run_chapter` checks before it executes, done by :func:`run_many` for each
    chapter first, so that an unchanged chapter costs no process. It holds the chapter's
    lock while it looks; when another run holds it, the answer is None (the run waits).
    """
    import filelock

    try:
        _nb, _pidx, defaults, params = _prepare(project, name, scale, device, None)
        nproc = check_nproc(nproc)
    except ChapterError:
        return None
    lock = _chapter_lock_file(project, name)
    try:
        lock.acquire(blocking=False)
    except filelock.Timeout:
        return None
    try:
        previous = load_record(project, name)
        key = cache_key(project, name, params, nproc, versions)
        if not is_cached(project, name, previous, key):
            return None
        return _cached_result(name, previous, echo)
    finally:
        lock.release()


# --------------------------------------------------------------------------- --out
#: What a run into a folder (``run --out DIR``) writes there, besides ``<name>.ipynb``,
#: ``<name>.failed.ipynb`` and ``<name>.log``.
OUT_ENTRIES = ("figures", "tables", "claims", "html", "run.json")


def check_out_folder(project: Project, out: str | os.PathLike) -> Path:
    """``out`` resolved, when it may receive a run: not inside the book's generated or built
    files, and new, empty or an earlier ``--out`` run (with its ``run.json``)."""
    if not isinstance(out, (str, os.PathLike)) or not str(out).strip():
        raise ChapterError(f"--out: expected a folder path, got {out!r}")
    folder = Path(out).expanduser().resolve()
    for protected in (project.generated, project.build_dir):
        if folder == protected or protected in folder.parents:
            raise ChapterError(f"--out: {folder} is inside the book's own files ({protected}); "
                               "choose a folder outside book/_generated and book/_build")
    if folder.exists() and not folder.is_dir():
        raise ChapterError(f"--out: {folder} exists and is not a folder")
    if folder.is_dir():
        entries = [e for e in folder.iterdir() if not e.name.startswith(".staging-")]
        record = folder / "run.json"
        earlier = False
        if record.is_file():
            with contextlib.suppress(ValueError, OSError):
                earlier = "out" in json.loads(record.read_text())
        if entries and not earlier:
            raise ChapterError(f"--out: {folder} is not empty and holds no earlier --out run "
                               "(run.json); choose a new or empty folder")
    return folder


def _html_page(project: Project, folder: Path, name: str,
               echo: Callable[[str], None]) -> Path | None:
    """Build ``folder/html/<name>.html`` from ``folder/<name>.ipynb`` (a one-page Jupyter
    Book, the book's MyST settings; maths from the local MathJax when there is one)."""
    import yaml

    config = {
        "title": name, "only_build_toc_files": False,
        "execute": {"execute_notebooks": "off"},
        "parse": {"myst_enable_extensions": ["amsmath", "colon_fence", "dollarmath"]},
        "sphinx": {"extra_extensions": ["sphinx_proof"], "config": {
            "nb_execution_mode": "off", "nb_output_stderr": "remove",
            "nb_render_markdown_format": "myst",
            "nb_mime_priority_overrides": [["html", "text/markdown", 0]],
            "numfig": True, "suppress_warnings": ["mystnb.unknown_mime_type"]}},
    }
    bib = project.root / "book" / "references.bib"
    if bib.exists():
        shutil.copyfile(bib, folder / "references.bib")
        config["bibtex_bibfiles"] = ["references.bib"]
    mathjax = project.root / "book" / "_static" / "mathjax" / "tex-chtml.js"
    if mathjax.exists():
        config["sphinx"]["config"]["mathjax_path"] = mathjax.as_uri()
    (folder / "_config.yml").write_text(yaml.safe_dump(config))
    build_root = folder / "_build"
    cmd = [jupyter_book_executable(), "build", "--config", str(folder / "_config.yml"),
           "--path-output", str(folder), str(folder / f"{name}.ipynb")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=folder)
    built = build_root / "_page" / name / "html"
    try:
        if proc.returncode != 0 or not (built / f"{name}.html").exists():
            (folder / f"{name}.html.log").write_text(proc.stdout + "\n" + proc.stderr)
            echo(f"[warning] {name}: the HTML page was not built (log: "
                 f"{folder.parent / (name + '.html.log')})")
            return None
        os.replace(built, folder / "html")
        return folder / "html" / f"{name}.html"
    finally:
        shutil.rmtree(build_root, ignore_errors=True)
        for leftover in ("_config.yml", "references.bib"):
            with contextlib.suppress(FileNotFoundError):
                (folder / leftover).unlink()


def _move_into(folder: Path, staging: Path) -> None:
    """Replace the earlier run in ``folder`` (the files its run.json lists) by ``staging``'s."""
    earlier = folder / "run.json"
    old: list[str] = []
    if earlier.is_file():
        with contextlib.suppress(ValueError, OSError):
            old = list(json.loads(earlier.read_text()).get("files", []))
    for entry in old:
        path = folder / entry
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    for path in sorted(staging.iterdir(), key=lambda p: p.name == "run.json"):
        os.replace(path, folder / path.name)  # run.json last


def _execute_into_folder(project: Project, name: str, nb, pidx: int, defaults: dict,
                         params: dict, folder: Path, threads: int | None, timeout: float,
                         nproc: int, echo: Callable[[str], None]) -> RunResult:
    """``run --out DIR``: execute the chapter into ``folder``; the book is not touched."""
    commit, dirty = git_state(project.root)
    folder.mkdir(parents=True, exist_ok=True)
    staging = folder / f".staging-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    input_nb = staging / f".{name}.input.ipynb"
    output_nb = staging / f"{name}.ipynb"
    log = staging / f"{name}.log"
    # in the staging folder, which becomes the --out folder: removed before it moves
    device_file = staging / _DEVICE_FILE
    env_updates = _kernel_env(name, staging, ".", commit, dirty, threads, nproc, device_file)
    started = time.time()
    record = _new_record(project, name, params, defaults, nproc, commit, dirty, str(folder))
    record["out"] = str(folder)
    try:
        staging.mkdir()
        _write_notebook(nb, input_nb)
        echo(f"[start] {name} (scale={params['scale']}, device={params['device']}) into "
             f"{folder}: log {log} (then {folder / log.name})")
        progress = _Progress(name, _code_cells(nb))
        with _kernel_environment(env_updates):
            outcome = _execute_notebook(input_nb, output_nb, log, params, project.root,
                                        timeout, progress, echo, pidx)
        error = _execution_error(outcome, pidx, timeout)
        input_nb.unlink()
        record.update(seconds=time.time() - started, finished=now_iso(),
                      peak_memory_gib=round(outcome.peak_bytes / 2**30, 3))
        raise_if_interrupted()
        html = None
        if error is None:
            executed = read_notebook_ipynb(output_nb)
            record.update(status="ok", device=_detected_device(params["device"], device_file))
            finish_notebook(executed, record)
            if "{cite" in json.dumps([c.source for c in executed.cells]) and (
                    project.root / "book" / "references.bib").exists():
                # the book lists references on a page of its own; this page lists its own
                executed.cells.append(_markdown_cell(myst.references_section(),
                                                     "companion-references"))
            _write_notebook(executed, output_nb)
            html = _html_page(project, staging, name, echo)
        else:
            record.update(status="failed", error=error)
            if output_nb.exists():
                os.replace(output_nb, staging / f"{name}.failed.ipynb")
        device_file.unlink(missing_ok=True)  # the chapter's answer, not one of its outputs
        record["files"] = sorted(p.name for p in staging.iterdir()) + ["run.json"]
        atomic_write_text(staging / "run.json", dumps(record))
        raise_if_interrupted()
        with signals_deferred():
            _move_into(folder, staging)
    finally:
        with signals_deferred():
            shutil.rmtree(staging, ignore_errors=True)
    if record["status"] == "ok":
        page = f"open {folder / 'html' / (name + '.html')}" if html else "no HTML page"
        echo(f"[ok {record['seconds']:.1f}s] {name} into {folder} ({page}; notebook "
             f"{folder / (name + '.ipynb')})")
        return RunResult(name, "ok", record["seconds"], record=record)
    echo(f"[FAILED {record['seconds']:.1f}s] {name}: {record['error']} "
         f"(log: {folder / log.name})")
    return RunResult(name, "failed", record["seconds"], error=record["error"], record=record)


def _prepare(project: Project, name: str, scale, device, overrides):
    """The chapter's notebook, parameters-cell index, defaults and resolved parameters."""
    src = project.source(name)
    if not src.exists():
        available = ", ".join(project.chapter_names()) or "none"
        raise ChapterError(f"chapter {name!r}: no file {src}; available chapters: {available}")
    nb = read_notebook(src)
    try:
        pidx = parameters_cell_index(nb)
        defaults = parse_parameters(nb.cells[pidx].source)
        requested = dict(overrides or {})
        if scale is not None:
            requested["scale"] = scale
        if device is not None:
            requested["device"] = device
        params = resolve_parameters(defaults, requested)
    except ChapterError as exc:
        raise ChapterError(f"chapter {name!r}: {exc}") from None
    return nb, pidx, defaults, params


@contextlib.contextmanager
def _kernel_environment(updates: dict[str, str]):
    """os.environ with ``updates`` for the kernel to inherit, restored afterwards."""
    saved = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _kernel_env(name: str, output_dir: Path, asset_url: str, commit: str, dirty: bool,
                threads: int | None, nproc: int, device_file: Path) -> dict[str, str]:
    """The environment through which the runner talks to the executing chapter (and
    ``device_file``, outside the outputs, through which the chapter answers: the device
    its ``begin_chapter`` resolved, read by :func:`_detected_device`)."""
    env = {
        ENV_OUTPUT_DIR: str(output_dir),
        ENV_DEVICE_FILE: str(device_file),
        ENV_ASSET_URL: asset_url,
        ENV_CHAPTER: name,
        ENV_COMMIT: commit,
        ENV_DIRTY: "1" if dirty else "0",
        ENV_NPROC: str(nproc),
        "PYTHONHASHSEED": "0",
        "MPLBACKEND": "Agg",
    }
    if threads:
        env.update({ENV_THREADS: str(threads), "OMP_NUM_THREADS": str(threads),
                    "MKL_NUM_THREADS": str(threads)})
    return env


def _new_record(project: Project, name: str, params: dict, defaults: dict, nproc: int,
                commit: str, dirty: bool, out: str | None = None) -> dict[str, Any]:
    from companion.book import site

    return {
        "chapter": name, "parameters": params, "defaults": defaults, "nproc": nproc,
        "git_commit": commit, "git_dirty": dirty, "repository": site.repository_url(project.root),
        "started": now_iso(), "command": rerun_command(name, params, defaults, nproc, out),
        "device": params["device"],
    }


def _code_cells(nb) -> int:
    """Code cells papermill executes: the notebook's and the injected parameters cell."""
    return sum(c.cell_type == "code" for c in nb.cells) + 1


@dataclass
class _Staging:
    """The private folder one run of chapter ``name`` executes in, and its files."""

    folder: Path
    name: str

    @property
    def assets(self) -> Path:
        return self.folder / "assets"

    @property
    def input_nb(self) -> Path:
        return self.folder / f"{self.name}.input.ipynb"

    @property
    def output_nb(self) -> Path:
        return self.folder / f"{self.name}.ipynb"

    @property
    def log(self) -> Path:
        return self.folder / f"{self.name}.log"

    @property
    def device_file(self) -> Path:
        return self.folder / _DEVICE_FILE


def _new_staging(project: Project, name: str) -> _Staging:
    """A fresh staging folder name for ``name`` (dead runs' folders removed first)."""
    remove_dead_staging(project, name)
    folder = project.generated / ".staging" / f"{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return _Staging(folder, name)


def _start_and_execute(project: Project, name: str, nb, pidx: int, params: dict,
                       staging: _Staging, env_updates: dict[str, str], timeout: float,
                       nproc: int, echo: Callable[[str], None]) -> _Execution:
    """Write the input notebook into ``staging``, say so, and execute it with papermill."""
    staging.assets.mkdir(parents=True)
    _write_notebook(nb, staging.input_nb)
    echo(f"[start] {name} (scale={params['scale']}, device={params['device']}"
         + (f", {nproc} processes" if nproc != 1 else "")
         + f"): log {staging.log} (then {project.log(name)})")
    progress = _Progress(name, _code_cells(nb))
    with _kernel_environment(env_updates):
        return _execute_notebook(staging.input_nb, staging.output_nb, staging.log, params,
                                 project.root, timeout, progress, echo, pidx)


def _run_result(project: Project, name: str, record: dict,
                echo: Callable[[str], None]) -> RunResult:
    """The RunResult of a finished run (its record published), echoed."""
    if record["status"] == "ok":
        peak = record.get("peak_memory_gib")
        echo(f"[ok {record['seconds']:.1f}s" + (f", peak {peak:.2f} GiB" if peak else "")
             + f"] {name}")
        return RunResult(name, "ok", record["seconds"], record=record)
    echo(f"[FAILED {record['seconds']:.1f}s] {name}: {record['error']} "
         f"(log: {project.log(name)})")
    return RunResult(name, "failed", record["seconds"], error=record["error"], record=record)


def _execute_and_publish(project: Project, name: str, nb, pidx: int, defaults: dict,
                         params: dict, key: str, previous: dict | None, threads: int | None,
                         timeout: float, echo: Callable[[str], None],
                         nproc: int = 1) -> RunResult:
    """Execute the chapter in a staging folder; publish its outputs, or mark it stale."""
    commit, dirty = git_state(project.root)
    staging = _new_staging(project, name)
    env_updates = _kernel_env(name, staging.assets, f"../assets/{name}", commit, dirty,
                              threads, nproc, staging.device_file)
    started = time.time()
    record = _new_record(project, name, params, defaults, nproc, commit, dirty)
    record["cache_key"] = key
    try:
        outcome = _start_and_execute(project, name, nb, pidx, params, staging, env_updates,
                                     timeout, nproc, echo)
        error = _execution_error(outcome, pidx, timeout)
        if error is None:
            executed = read_notebook_ipynb(staging.output_nb)
            record["device"] = _detected_device(params["device"], staging.device_file)
        record.update(seconds=time.time() - started, finished=now_iso(),
                      peak_memory_gib=round(outcome.peak_bytes / 2**30, 3))
        raise_if_interrupted()  # the last moment an interrupt leaves everything as it was
        with signals_deferred():
            if error is None:
                record["status"] = "ok"
                finish_notebook(executed, record)
                _publish(project, name, executed, staging.assets, staging.log)
                atomic_write_text(project.run_record(name), dumps(record))
            else:
                _publish_failure(project, name, nb, record, previous, error, staging.log,
                                 staging.output_nb)
    except Exception as exc:  # noqa: BLE001 - our own steps failed: mark stale too
        error = str(exc) if isinstance(exc, ChapterError) else f"{type(exc).__name__}: {exc}"
        record.update(seconds=time.time() - started, finished=now_iso())
        raise_if_interrupted()
        with signals_deferred():
            _publish_failure(project, name, nb, record, previous, error, staging.log,
                             staging.output_nb)
    finally:
        with signals_deferred():
            shutil.rmtree(staging.folder, ignore_errors=True)
            with contextlib.suppress(OSError):
                (project.generated / ".staging").rmdir()
    return _run_result(project, name, record, echo)


def _publish_failure(project: Project, name: str, nb, record: dict, previous: dict | None,
                     error: str, staged_log: Path, output_nb: Path) -> None:
    """Record the failure, keep the last good outputs and mark them stale."""
    project.log(name).parent.mkdir(parents=True, exist_ok=True)
    if staged_log.exists():
        os.replace(staged_log, project.log(name))
    if output_nb.exists():
        shutil.copyfile(output_nb, project.log(name).with_suffix(".failed.ipynb"))
    record.update(status="failed", error=error)
    good = previous if previous and previous.get("status") == "ok" else (
        previous.get("last_good") if previous else None)
    record["last_good"] = good
    _mark_stale(project, name, nb, record, good)
    atomic_write_text(project.run_record(name), dumps(record))


def remove_dead_staging(project: Project, name: str) -> None:
    """Remove staging folders of this chapter left by a run that was killed (SIGKILL)."""
    import psutil

    for folder in (project.generated / ".staging").glob(f"{name}-*"):
        parts = folder.name[len(name) + 1:].split("-")
        pid = int(parts[0]) if parts and parts[0].isdigit() else None
        if pid is None or not psutil.pid_exists(pid):
            shutil.rmtree(folder, ignore_errors=True)


# Where a run's chapter writes the device it resolved (COMPANION_DEVICE_FILE), in the
# run's staging folder
_DEVICE_FILE = ".device"


def _detected_device(requested: str, told: Path | None = None) -> str:
    """The device the chapter really used, as begin_chapter resolved it ("auto" -> cpu).

    ``told``: the file the chapter's ``begin_chapter`` wrote it into
    (``COMPANION_DEVICE_FILE``). Only where a chapter did not write it (one that never
    called ``begin_chapter``) is torch imported here to ask, as the chapter would have:
    that import took about 2 s of every run's end in a process without torch (the CLI)."""
    if requested != "auto":
        return requested
    if told is not None:
        with contextlib.suppress(OSError):
            said = told.read_text().strip()
            if said in ("cpu", "cuda"):
                return said
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover
        return requested


def _publish(project: Project, name: str, executed, staging_assets: Path,
             staged_log: Path) -> None:
    """Swap fresh outputs in: assets folder by rename, the log, then the notebook atomically.

    The caller runs it inside :func:`signals_deferred` and writes the run record last.
    """
    final = project.assets(name)
    final.parent.mkdir(parents=True, exist_ok=True)
    trash = final.with_name(f".{name}.old-{uuid.uuid4().hex[:8]}")
    if final.exists():
        os.replace(final, trash)
    os.replace(staging_assets, final)
    _test_pause("publish")
    project.log(name).parent.mkdir(parents=True, exist_ok=True)
    os.replace(staged_log, project.log(name))
    _write_notebook(executed, project.notebook(name))
    shutil.rmtree(trash, ignore_errors=True)


def _mark_stale(project: Project, name: str, source_nb, record: dict, good: dict | None) -> None:
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
    _strip_tagged(nb, STALE_TAG)
    _insert_after_title(nb, _markdown_cell(myst.stale_banner(record, good), STALE_TAG))
    _write_notebook(nb, path)


def write_placeholder(project: Project, name: str) -> None:
    """A page for a chapter that has never been executed, saying so (never blank)."""
    if project.notebook(name).exists():
        return
    nb = read_notebook(project.source(name))
    record = {"finished": "never", "git_commit": "-" * 12,
              "error": "this chapter has not been executed in this build"}
    _mark_stale(project, name, nb, record, None)


# --------------------------------------------------------------------------- build
def _relay_output(proc: subprocess.Popen, name: str, lines: list[str],
                  live: queue.Queue) -> None:
    """Read a child run's output line by line as it comes (so the pipe never fills)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        live.put((name, line.rstrip("\n")))


def run_many(project: Project, names: list[str], *,
             scale: str | dict[str, str | None] | None, device: str | None,
             jobs: int, force: bool, timeout: float | None = None, nproc: int | None = None,
             echo: Callable[[str], None] = print) -> list[RunResult]:
    """Execute chapters in parallel processes, torch threads divided between them.

    ``scale`` is one scale for all, or a mapping chapter -> scale (None: its default).
    Chapters start longest first (:func:`longest_first`). A chapter whose published run
    is current (:func:`cached_run`) is reported cached without a process. Each child's
    lines (its start with its log path, its progress every :func:`progress_seconds`, its
    result) are echoed as they come; its status is the result file it writes
    (``run --result-file``), not its words.

    On SIGINT or SIGTERM (a KeyboardInterrupt here) every running child gets SIGTERM,
    which makes it kill its kernel and remove its staging folder; they are waited for
    (killed after a generous deadline) and the interrupt is re-raised.
    """
    scales = scale if isinstance(scale, dict) else {name: scale for name in names}
    results: list[RunResult] = []
    pending = list(names)
    if not force:
        versions = installed_versions()
        for name in names:
            cached = cached_run(project, name, scale=scales.get(name), device=device,
                                nproc=nproc, echo=echo, versions=versions)
            if cached is not None:
                results.append(cached)
                pending.remove(name)
    if not pending:
        return sorted(results, key=lambda r: names.index(r.name))
    pending = longest_first(project, pending, scales)
    jobs = max(1, min(jobs, len(pending)))
    threads = max(1, (os.cpu_count() or 1) // jobs)
    running: dict[str, _Child] = {}
    live: queue.Queue[tuple[str, str]] = queue.Queue()
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    results_dir = Path(tempfile.mkdtemp(prefix="companion-results-"))

    def echo_live() -> None:
        while True:
            try:
                _name, line = live.get_nowait()
            except queue.Empty:
                return
            if line.startswith("["):
                echo(line)

    try:
        while pending or running:
            while pending and len(running) < jobs:
                name = pending.pop(0)
                result_file = results_dir / f"{name}.json"
                cmd = _child_command(project, name, scales.get(name), device, threads,
                                     nproc, force, timeout, result_file)
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, env=child_env)
                lines: list[str] = []
                reader = threading.Thread(target=_relay_output, args=(proc, name, lines, live),
                                          name=f"relay-{name}", daemon=True)
                reader.start()
                running[name] = _Child(proc, time.time(), reader, lines, result_file)
            time.sleep(0.2)
            echo_live()
            for name, child in list(running.items()):
                if child.proc.poll() is None:
                    continue
                child.reader.join()
                echo_live()
                del running[name]
                results.append(_child_result(project, name, child, echo))
    except KeyboardInterrupt:
        with signals_deferred():
            _stop_children([child.proc for child in running.values()])
        raise
    finally:
        shutil.rmtree(results_dir, ignore_errors=True)
    return sorted(results, key=lambda r: names.index(r.name))


@dataclass
class _Child:
    """A ``python -m companion run`` process started by :func:`run_many`."""

    proc: subprocess.Popen
    started: float
    reader: threading.Thread
    lines: list[str]
    result_file: Path


def _child_command(project: Project, name: str, scale: str | None, device: str | None,
                   threads: int, nproc: int | None, force: bool, timeout: float | None,
                   result_file: Path) -> list[str]:
    cmd = [sys.executable, "-m", "companion", "run", name, "--root", str(project.root),
           "--threads", str(threads), "--result-file", str(result_file)]
    if scale:
        cmd += ["--scale", str(scale)]
    if device:
        cmd += ["--device", device]
    if nproc is not None:
        cmd += ["--nproc", str(nproc)]
    if force:
        cmd.append("--force")
    if timeout is not None:
        cmd += ["--timeout", repr(timeout)]
    return cmd


def read_result_file(path: Path) -> dict[str, Any] | None:
    """The result a child run wrote (:func:`write_result_file`), or None when it wrote
    none (it failed before, was killed) or the file is not a result."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) and result.get("status") in (
        "ok", "cached", "failed") else None


def write_result_file(path: Path, result: RunResult) -> None:
    """What ``run --result-file PATH`` leaves for :func:`run_many`: the run's status,
    seconds and error, as JSON."""
    atomic_write_text(Path(path), dumps({"name": result.name, "status": result.status,
                                         "seconds": result.seconds, "error": result.error}))


def _child_result(project: Project, name: str, child: _Child,
                  echo: Callable[[str], None]) -> RunResult:
    """The RunResult of a finished child: its result file's status (failed without one)."""
    out = "".join(child.lines)
    record = load_record(project, name) or {}
    seconds = time.time() - child.started
    result = read_result_file(child.result_file)
    if child.proc.returncode == 0 and result is not None and result["status"] != "failed":
        return RunResult(name, result["status"], seconds, record=record)
    if "[FAILED" not in out:
        echo(f"[FAILED] {name}:\n{out.strip()}")
    error = (result or {}).get("error") or record.get("error", out.strip()[-500:])
    return RunResult(name, "failed", seconds, error=error, record=record)


def _stop_children(procs: list[subprocess.Popen], grace_seconds: float = 120.0) -> None:
    """SIGTERM each child run, wait for its clean-up, SIGKILL it if it never ends."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
    deadline = time.time() + grace_seconds  # a safety net: clean-up takes seconds
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def jupyter_book_executable() -> str:
    candidate = Path(sys.executable).parent / "jupyter-book"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("jupyter-book")
    if not found:
        raise ChapterError("jupyter-book is not installed: run 'make setup'")
    return found


#: Folders whose files the HTML build never reads (relative to the project root), and
#: folder names skipped wherever they are.
_NOT_BOOK_SOURCES = ("book/_build", "book/_generated/logs", "book/_generated/locks",
                     "book/_generated/.staging")
_NOT_BOOK_SOURCE_NAMES = {".git", ".venv", ".cache", "__pycache__", "node_modules",
                          ".pytest_cache", ".ruff_cache", ".ipynb_checkpoints"}


def _tree_state(root: Path, skip: tuple[str, ...] = ()) -> list[tuple[str, int, int]]:
    """(path, size, mtime in ns) of every file under ``root``, but those under ``skip``."""
    entries: list[tuple[str, int, int]] = []
    skipped = {root / s for s in skip}
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        dirs[:] = sorted(d for d in dirs if d not in _NOT_BOOK_SOURCE_NAMES
                         and not d.endswith(".egg-info") and here / d not in skipped)
        for f in sorted(files):
            with contextlib.suppress(OSError):
                st = (here / f).stat()
                entries.append((str((here / f).relative_to(root)), st.st_size, st.st_mtime_ns))
    return entries


def _book_sources_state(project: Project) -> str:
    """A hash of what the HTML build reads: every file of the project but the build's
    own, logs and locks (name, size, modification time: how Sphinx judges a page
    changed), the PDF the web book links, and the installed packages."""
    pdf = project.build_dir / "latex" / "book.pdf"
    state = {"sources": _tree_state(project.root, _NOT_BOOK_SOURCES),
             "pdf": [pdf.stat().st_size, pdf.stat().st_mtime_ns] if pdf.is_file() else None,
             "versions": installed_versions()}
    return hashlib.sha256(json.dumps(state).encode()).hexdigest()


def _book_output_state(project: Project) -> str:
    """A hash of the built HTML (names, sizes, modification times)."""
    state = _tree_state(project.build_dir / "html")
    return hashlib.sha256(json.dumps(state).encode()).hexdigest()


def _read_stamp(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def build_html(project: Project, echo: Callable[[str], None] = print) -> Path:
    """Generate the index pages and build the HTML book with warnings as errors.

    When neither what the build reads nor what it wrote has changed since the last good
    build (``book/_build/.companion-build-state.json``: :func:`_book_sources_state`
    before that build, :func:`_book_output_state` after it), jupyter-book is not
    started: the book is as it would make it.
    """
    from companion.book import pages

    mathjax = project.root / "book" / "_static" / "mathjax" / "tex-chtml.js"
    if not mathjax.exists():
        raise ChapterError(f"local MathJax missing ({mathjax}): run 'make setup'")
    for name in project.toc_chapters():
        if project.source(name).exists():
            write_placeholder(project, name)
    pages.write_generated_pages(project)
    html = project.build_dir / "html" / "index.html"
    stamp = project.build_dir / ".companion-build-state.json"
    sources = _book_sources_state(project)  # before the build: what it is going to read
    if html.exists() and _read_stamp(stamp) == {"sources": sources,
                                                "html": _book_output_state(project)}:
        echo(f"[book] unchanged since the last build: open {html}")
        return html
    with contextlib.suppress(FileNotFoundError):
        stamp.unlink()
    cmd = [jupyter_book_executable(), "build", str(project.root),
           "--path-output", str(project.root / "book"), "--warningiserror", "--keep-going"]
    echo("[book] " + " ".join(shlex.quote(c) for c in cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log = project.generated / "logs" / "jupyter-book.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(proc.stdout + "\n" + proc.stderr)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
        raise ChapterError(f"jupyter-book build failed (log: {log}):\n{tail}")
    atomic_write_text(stamp, dumps({"sources": sources, "html": _book_output_state(project)}))
    echo(f"[book] built: open {html}")
    return html


def build(project: Project, *, scale: str | dict[str, str | None] | None = None,
          device: str | None = None, jobs: int = 1, chapters: list[str] | None = None,
          force: bool = False, timeout: float | None = None, nproc: int | None = None,
          echo: Callable[[str], None] = print) -> int:
    """Execute chapters, then build the book. Returns the exit code (non-zero on failure).

    ``scale`` is a ``--scale`` value (:func:`parse_scale_spec`: a scale, ``publish``, or
    ``CHAPTER=SCALE`` items) or a mapping chapter -> scale. ``timeout`` (seconds per
    cell) and ``nproc`` are passed to every run; an unavailable CUDA device is refused
    before any chapter starts.
    """
    names = chapters or project.chapter_names()
    unknown = [n for n in names if not project.source(n).exists()]
    if unknown:
        raise ChapterError(
            f"unknown chapter(s) {unknown}; available: {', '.join(project.chapter_names())}"
        )
    scales = scale if isinstance(scale, dict) else parse_scale_spec(scale, names)
    timeout = check_timeout(timeout)
    if nproc is not None:
        check_nproc(nproc)
    progress_seconds()
    if device is not None:
        check_device_available(device)
    t0 = time.time()
    if any(scales.values()):
        echo("[scales] " + ", ".join(f"{n}={scales.get(n) or 'default'}" for n in names))
    results = run_many(project, names, scale=scales, device=device, jobs=jobs, force=force,
                       timeout=timeout, nproc=nproc, echo=echo)
    failed = [r for r in results if r.status == "failed"]
    build_html(project, echo=echo)
    echo(f"[done {time.time() - t0:.1f}s] {len(results) - len(failed)} chapter(s) fresh, "
         f"{len(failed)} failed" + (f": {', '.join(r.name for r in failed)}" if failed else ""))
    return 1 if failed else 0
