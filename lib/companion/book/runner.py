"""Execute chapters with papermill and build the book.

A chapter is a MyST-markdown notebook ``chapters/<name>.md`` (jupytext). Running it:

1. reads it with jupytext and parses its ``parameters`` cell (the first code cell) into
   names and literal defaults; validates the requested parameters against them (an
   unknown name, unknown scale or wrongly typed value is an error listing the valid ones;
   a ``None`` default declares its type, ``name: str | None = None``). Parameters other
   than the defaults replace the book's page, so the CLI refuses them without ``--out``
   (below) or ``--publish``;
2. skips the run when a cached good run has the same key (chapter source, ``lib/``
   sources, parameters, processes and installed package versions), unless forced;
3. executes it with papermill into a private staging folder, the chapter writing its
   figures, tables, claims and kernel log there (see :mod:`companion.book.records`),
   each with every parameter of the run (``$COMPANION_PARAMETERS``, which
   ``begin_chapter`` reads: a parameter the chapter does not pass it is recorded too). It
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
takes seconds; it ends with a summary line per chapter (wall time, CPU time, peak
memory) and the total against its floor, the CPU seconds over the cores. ``--nproc N``
reaches the kernel as ``$COMPANION_NPROC`` (:mod:`companion.parallel` reads it).

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

For the tests only, ``COMPANION_TEST_PAUSE_AT`` stops a run at a given point (see
:mod:`companion.book.kernel`).

The parts live in modules of their own, which this one re-exports (the runner's API):
:mod:`~companion.book.parameters` (the parameters cell, coercion, scales, checks),
:mod:`~companion.book.cache` (inputs, versions, the cache key, the chapter's lock),
:mod:`~companion.book.notebook_cells` (what the runner adds to a notebook),
:mod:`~companion.book.kernel` (execution, progress, limits, the kernel's environment)
and :mod:`~companion.book.build` (the parallel build and the HTML). This module keeps a
chapter's run: one path (:func:`execute_run`) for the book and for ``--out``, a
:class:`RunSpec` saying what to run and a target saying where it goes.
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from companion.book.build import (  # noqa: F401 - re-exported: the runner's build API
    Child, book_output_state, book_sources_state, build, build_html, child_result,
    expected_seconds, jupyter_book_executable, longest_first, page_html, read_result_file,
    run_many, write_result_file
)
from companion.book.cache import (  # noqa: F401 - re-exported: the runner's cache API
    RunResult, cache_key, cached_result, cached_run, chapter_front_matter, chapter_inputs,
    chapter_lock, chapter_lock_file, installed_versions, is_cached
)
from companion.book.chapter import SCALES  # noqa: F401 - re-exported
from companion.book.files import atomic_write_text, dumps, now_iso
from companion.book.gitstate import git_state
from companion.book.interrupts import (  # noqa: F401 - re-exported: the runner's interrupt API
    INTERRUPT_SIGNALS, RunInterrupted, install_interrupt_handlers, interrupt_guard,
    raise_if_interrupted, signals_deferred
)
from companion.book.kernel import (  # noqa: F401 - re-exported: the runner's kernel API
    DEVICE_FILE, ENV_NPROC, ENV_PROGRESS_SECONDS, ENV_TEST_PAUSE_AT, PROGRESS_SECONDS,
    Execution, KernelTracker, Progress, code_cells, detected_device, execute_notebook,
    execution_error, kernel_environment, kernel_variables, process_cpu_seconds, progress_line,
    progress_seconds, test_pause
)
from companion.book.notebook_cells import (  # noqa: F401 - re-exported: what a page gets
    BOX_TAG, ENV_INSTALL_SOURCE, ENV_PIP_ARGS, INSTALL_TAG, NOTEBOOK_EXTRAS, REMOVE_TAG,
    SCALE_MEANING, SCALE_TAG, STALE_TAG, add_install_cell, add_references_section,
    effective_parameters_source, finish_notebook, install_cell_source, mark_stale, scale_banner,
    show_one_parameters_cell, write_notebook, write_placeholder
)
from companion.book.parameters import (  # noqa: F401 - re-exported: the runner's parameters API
    CELL_TIMEOUT_SECONDS, DEVICE_CHOICES, PUBLISH, PUBLISH_SCALES, REQUIRED_PARAMETERS,
    PreparedChapter, check_device_available, check_nproc, check_timeout, coerce_parameter,
    default_timeout, non_default_parameters, paper_scale_command, parameter_types,
    parameters_cell_index, parse_parameters, parse_scale_spec, prepare_chapter, rerun_command,
    resolve_parameters
)
from companion.book.project import (  # noqa: F401 - re-exported: the runner's project API
    ChapterError, Project, load_record, read_notebook, read_notebook_ipynb
)


@dataclass(frozen=True)
class RunSpec:
    """One run of a chapter, checked (:func:`run_chapter` makes it): what to execute and
    how; :func:`execute_run` takes it with the target the run goes to."""

    project: Project
    chapter: PreparedChapter
    timeout: float  # the longest one cell may run, in seconds
    nproc: int = 1  # processes for the chapter's scale-out ($COMPANION_NPROC)
    threads: int | None = None  # torch threads of the kernel (None: torch's default)
    echo: Callable[[str], None] = field(default=print, compare=False)

    @property
    def name(self) -> str:
        return self.chapter.name

    @property
    def params(self) -> dict[str, Any]:
        return self.chapter.params

    @property
    def defaults(self) -> dict[str, Any]:
        return self.chapter.defaults


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
        chapter = prepare_chapter(project, name, scale, device, overrides)
        params = chapter.params
        spec = RunSpec(project, chapter,
                       timeout=check_timeout(timeout) or default_timeout(params["scale"]),
                       nproc=check_nproc(nproc), threads=threads, echo=echo)
        progress_seconds()  # a bad $COMPANION_PROGRESS_SECONDS is refused before the run
        check_device_available(str(params["device"]))
        # a signal swallowed on the way here (inside an import: see interrupts) stops the
        # run before anything starts
        raise_if_interrupted()
        if out is not None:
            return execute_run(spec, OutFolder(check_out_folder(project, out)))
        if not publish_non_default:
            refuse_non_default(name, params, chapter.defaults)
        with chapter_lock(project, name, echo):
            key = cache_key(project, name, params, spec.nproc)
            previous = load_record(project, name, echo)
            if not force and is_cached(project, name, previous, key):
                return cached_result(name, previous, echo)
            return execute_run(spec, BookPage(key, previous))


def refuse_non_default(name: str, params: dict[str, Any], defaults: dict[str, Any]) -> None:
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


# --------------------------------------------------------------------------- the one run path
@dataclass(frozen=True)
class Staging:
    """The private folder one run of chapter ``name`` executes in, and its files.

    ``outputs`` is where the chapter writes its figures, tables and claims. The notebook
    papermill reads is removed once it has run, before the target takes the folder.
    """

    folder: Path
    name: str
    outputs: Path

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
        return self.folder / DEVICE_FILE


def new_record(spec: RunSpec, commit: str, dirty: bool,
               out: str | None = None) -> dict[str, Any]:
    """The run record of ``spec`` as it starts (``runs/<name>.json``, or ``run.json``)."""
    from companion.book import site

    return {
        "chapter": spec.name, "parameters": spec.params, "defaults": spec.defaults,
        "nproc": spec.nproc, "git_commit": commit, "git_dirty": dirty,
        "repository": site.repository_url(spec.project.root), "started": now_iso(),
        "command": rerun_command(spec.name, spec.params, spec.defaults, spec.nproc, out),
        "device": spec.params["device"],
    }


def execute_run(spec: RunSpec, target: BookPage | OutFolder) -> RunResult:
    """The one run path: execute ``spec``'s chapter in a staging folder of ``target``,
    then hand the outcome to it (:class:`BookPage` publishes or marks stale,
    :class:`OutFolder` moves the run into its folder); the staging folder is removed.

    An interrupt up to the moment the target starts changing its files leaves them as
    they were; from then on it is taken once they are complete.
    """
    project, name, params, echo = spec.project, spec.name, spec.params, spec.echo
    commit, dirty = git_state(project.root)
    staging = target.new_staging(spec)
    record = new_record(spec, commit, dirty, target.out)
    record.update(target.record_fields())
    variables = kernel_variables(
        name=name, output_dir=staging.outputs, asset_url=target.asset_url(name),
        commit=commit, dirty=dirty, threads=spec.threads, nproc=spec.nproc,
        device_file=staging.device_file, params=params)
    started, cpu_before = time.time(), process_cpu_seconds()
    try:
        staging.outputs.mkdir(parents=True)
        write_notebook(spec.chapter.nb, staging.input_nb)
        echo(f"[start] {name} (scale={params['scale']}, device={params['device']}"
             + (f", {spec.nproc} processes" if spec.nproc != 1 else "")
             + f"){target.where}: log {staging.log} (then {target.final_log(spec)})")
        with kernel_environment(variables):
            outcome = execute_notebook(staging.input_nb, staging.output_nb, staging.log,
                                       params, project.root, spec.timeout,
                                       Progress(name, code_cells(spec.chapter.nb)), echo,
                                       spec.chapter.parameters_cell)
        error = execution_error(outcome, spec.chapter.parameters_cell, spec.timeout)
        staging.input_nb.unlink(missing_ok=True)
        executed = None
        if error is None:
            executed = read_notebook_ipynb(staging.output_nb)
            record["device"] = detected_device(params["device"], staging.device_file)
        record.update(seconds=time.time() - started, finished=now_iso(),
                      cpu_seconds=round(process_cpu_seconds() - cpu_before, 1),
                      peak_memory_gib=round(outcome.peak_bytes / 2**30, 3))
        raise_if_interrupted()
        if error is None:
            record["status"] = "ok"
            finish_notebook(executed, record)
        else:
            record.update(status="failed", error=error)
        target.stage(spec, staging, executed, record)
        raise_if_interrupted()  # the last moment an interrupt leaves everything as it was
        with signals_deferred():
            target.publish(spec, staging, executed, record)
    except Exception as exc:  # noqa: BLE001 - our own steps failed: the target says how
        if not target.records_own_errors:
            raise
        error = str(exc) if isinstance(exc, ChapterError) else f"{type(exc).__name__}: {exc}"
        record.update(seconds=time.time() - started, finished=now_iso(),
                      status="failed", error=error)
        raise_if_interrupted()
        with signals_deferred():
            target.publish(spec, staging, None, record)
    finally:
        with signals_deferred():
            target.remove_staging(staging)
    return target.report(spec, record)


class BookPage:
    """Where a run of the book goes: ``book/_generated/``. A good run replaces the
    chapter's page, assets, log and record; a failed one keeps the last good outputs,
    marked stale. Errors of the runner's own steps fail the run the same way."""

    out = None
    where = ""
    records_own_errors = True

    def __init__(self, key: str, previous: dict[str, Any] | None):
        self.key = key
        self.previous = previous

    def new_staging(self, spec: RunSpec) -> Staging:
        """A fresh staging folder name (dead runs' folders removed first)."""
        project, name = spec.project, spec.name
        remove_dead_staging(project, name)
        folder = (project.generated / ".staging"
                  / f"{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        return Staging(folder, name, folder / "assets")

    def asset_url(self, name: str) -> str:
        return f"../assets/{name}"

    def final_log(self, spec: RunSpec) -> Path:
        return spec.project.log(spec.name)

    def record_fields(self) -> dict[str, Any]:
        return {"cache_key": self.key}

    def stage(self, spec: RunSpec, staging: Staging, executed, record: dict) -> None:
        """Nothing to prepare: the staging folder is already laid out as published."""

    def publish(self, spec: RunSpec, staging: Staging, executed, record: dict) -> None:
        """Swap a good run in (record last), or record the failure and mark stale."""
        project, name = spec.project, spec.name
        if record["status"] == "ok":
            publish(project, name, executed, staging.outputs, staging.log)
            atomic_write_text(project.run_record(name), dumps(record))
        else:
            publish_failure(project, name, spec.chapter.nb, record, self.previous,
                            record["error"], staging.log, staging.output_nb)

    def remove_staging(self, staging: Staging) -> None:
        shutil.rmtree(staging.folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            staging.folder.parent.rmdir()  # .staging, when no other run uses it

    def report(self, spec: RunSpec, record: dict) -> RunResult:
        """The RunResult of the finished run (its record published), echoed."""
        name, echo = spec.name, spec.echo
        if record["status"] == "ok":
            peak = record.get("peak_memory_gib")
            echo(f"[ok {record['seconds']:.1f}s" + (f", peak {peak:.2f} GiB" if peak else "")
                 + f"] {name}")
            return RunResult(name, "ok", record["seconds"], record=record)
        echo(f"[FAILED {record['seconds']:.1f}s] {name}: {record['error']} "
             f"(log: {spec.project.log(name)})")
        return RunResult(name, "failed", record["seconds"], error=record["error"],
                         record=record)


# --------------------------------------------------------------------------- --out
#: What a run into a folder (``run --out DIR``) writes there, besides ``<name>.ipynb``,
#: ``<name>.failed.ipynb`` and ``<name>.log``.
OUT_ENTRIES = ("figures", "tables", "claims", "html", "run.json")


class OutFolder:
    """Where a run with ``--out DIR`` goes: the folder, which receives the notebook,
    outputs, log, ``run.json`` and an HTML page; the book is not touched. Errors of the
    runner's own steps are raised (the folder keeps the earlier run)."""

    records_own_errors = False

    def __init__(self, folder: Path):
        self.folder = folder
        self.out = str(folder)
        self.where = f" into {folder}"
        self.html: Path | None = None

    def new_staging(self, spec: RunSpec) -> Staging:
        """A staging folder inside the out folder, which becomes its contents."""
        self.folder.mkdir(parents=True, exist_ok=True)
        staging = self.folder / f".staging-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        return Staging(staging, spec.name, staging)

    def asset_url(self, name: str) -> str:
        return "."

    def final_log(self, spec: RunSpec) -> Path:
        return self.folder / f"{spec.name}.log"

    def record_fields(self) -> dict[str, Any]:
        return {"out": self.out}

    def stage(self, spec: RunSpec, staging: Staging, executed, record: dict) -> None:
        """Lay the staging folder out as the out folder will be: the page with its own
        references and its HTML (or the failed notebook), and ``run.json`` listing it."""
        if executed is not None:
            if (spec.project.root / "book" / "references.bib").exists():
                add_references_section(executed)
            write_notebook(executed, staging.output_nb)
            self.html = page_html(spec.project, staging.folder, spec.name, spec.echo)
        elif staging.output_nb.exists():
            os.replace(staging.output_nb, staging.folder / f"{spec.name}.failed.ipynb")
        staging.device_file.unlink(missing_ok=True)  # the chapter's answer, not an output
        record["files"] = sorted(p.name for p in staging.folder.iterdir()) + ["run.json"]
        atomic_write_text(staging.folder / "run.json", dumps(record))

    def publish(self, spec: RunSpec, staging: Staging, executed, record: dict) -> None:
        move_into(self.folder, staging.folder)

    def remove_staging(self, staging: Staging) -> None:
        shutil.rmtree(staging.folder, ignore_errors=True)

    def report(self, spec: RunSpec, record: dict) -> RunResult:
        """The RunResult of the finished run (moved into the folder), echoed."""
        name, folder, echo = spec.name, self.folder, spec.echo
        if record["status"] == "ok":
            page = f"open {folder / 'html' / (name + '.html')}" if self.html else "no HTML page"
            echo(f"[ok {record['seconds']:.1f}s] {name} into {folder} ({page}; notebook "
                 f"{folder / (name + '.ipynb')})")
            return RunResult(name, "ok", record["seconds"], record=record)
        echo(f"[FAILED {record['seconds']:.1f}s] {name}: {record['error']} "
             f"(log: {self.final_log(spec)})")
        return RunResult(name, "failed", record["seconds"], error=record["error"],
                         record=record)


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


def move_into(folder: Path, staging: Path) -> None:
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


# --------------------------------------------------------------------------- the book's files
def publish(project: Project, name: str, executed, staging_assets: Path,
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
    test_pause("publish")
    project.log(name).parent.mkdir(parents=True, exist_ok=True)
    os.replace(staged_log, project.log(name))
    write_notebook(executed, project.notebook(name))
    shutil.rmtree(trash, ignore_errors=True)


def publish_failure(project: Project, name: str, nb, record: dict, previous: dict | None,
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
    mark_stale(project, name, nb, record, good)
    atomic_write_text(project.run_record(name), dumps(record))


def remove_dead_staging(project: Project, name: str) -> None:
    """Remove staging folders of this chapter left by a run that was killed (SIGKILL)."""
    import psutil

    for folder in (project.generated / ".staging").glob(f"{name}-*"):
        parts = folder.name[len(name) + 1:].split("-")
        pid = int(parts[0]) if parts and parts[0].isdigit() else None
        if pid is None or not psutil.pid_exists(pid):
            shutil.rmtree(folder, ignore_errors=True)
