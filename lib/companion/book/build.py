"""The book's build: chapters run in parallel child processes, the longest first, each
relaying its lines as they come (:func:`run_many`); then the HTML book, which
jupyter-book rebuilds only when something it reads or wrote has changed
(:func:`build_html`); and the one-page HTML of a run into a folder (:func:`page_html`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from companion.book.cache import (RunResult, cached_run, chapter_front_matter,
                                  installed_versions)
from companion.book.files import atomic_write_text, dumps
from companion.book.interrupts import signals_deferred
from companion.book.kernel import process_cpu_seconds, progress_seconds
from companion.book.notebook_cells import write_placeholder
from companion.book.parameters import (check_device_available, check_nproc, check_timeout,
                                       parse_scale_spec, prepare_chapter)
from companion.book.project import ChapterError, Project, load_record
from companion.thread_budget import ENV_THREAD_BUDGET, write_thread_budget


def expected_seconds(project: Project, name: str, scale: str | None) -> float:
    """How long chapter ``name`` is expected to run at ``scale`` (None: its default), for
    :func:`run_many`'s schedule only (the longest starts first): the last run's seconds
    when that run was at this scale; else the hint in its front matter,
    ``companion: expected-minutes: {scale: minutes}`` (minutes on a 2-core machine, so a
    clean clone schedules well too); else 0. Never an error: a bad hint counts as none.
    """
    try:
        params = prepare_chapter(project, name, scale).params
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


def page_html(project: Project, folder: Path, name: str,
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


def schedule_seconds(expected: list[float], jobs: int) -> float:
    """When the last of runs taking ``expected`` seconds ends, started longest first,
    each as soon as one of ``jobs`` slots is free (the schedule of :func:`run_many`).

    >>> schedule_seconds([400.0, 300.0, 200.0, 100.0], 2)
    500.0
    """
    slots = [0.0] * max(1, jobs)
    for seconds in sorted(expected, reverse=True):
        slots[slots.index(min(slots))] += seconds
    return max(slots)


def relay_output(proc: subprocess.Popen, name: str, lines: list[str],
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
    Chapters start longest first (:func:`longest_first`: the last run's time), each as
    soon as one of ``jobs`` slots is free, with the cores shared between the slots as
    torch threads; a ``[schedule]`` line says so, with the expected end
    (:func:`schedule_seconds`). Each child also gets a thread budget file
    (:mod:`companion.thread_budget`), rewritten whenever a chapter starts or ends
    (:func:`thread_shares`): once the others have ended, the longest chapter's long loops
    (the context-similarity corpus pass) take every core. A chapter whose published run
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
    expected = {name: expected_seconds(project, name, scales.get(name)) for name in pending}
    pending = sorted(pending, key=lambda name: -expected[name])  # longest_first's order
    jobs = max(1, min(jobs, len(pending)))
    threads = max(1, (os.cpu_count() or 1) // jobs)
    echo(f"[schedule] {jobs} at a time, {threads} torch thread(s) each, longest first: "
         + ", ".join(f"{name} (" + (f"~{expected[name] / 60:.0f} min" if expected[name]
                                    else "time unknown") + ")" for name in pending)
         + (f"; expected about {schedule_seconds(list(expected.values()), jobs) / 60:.0f} "
            "min" if all(expected.values()) else ""))
    running: dict[str, Child] = {}
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
                cmd = child_command(project, name, scales.get(name), device, threads,
                                     nproc, force, timeout, result_file)
                budget = results_dir / f"{name}.threads"
                write_thread_budget(budget, threads)
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, env={**child_env,
                                                        ENV_THREAD_BUDGET: str(budget)})
                lines: list[str] = []
                reader = threading.Thread(target=relay_output, args=(proc, name, lines, live),
                                          name=f"relay-{name}", daemon=True)
                reader.start()
                running[name] = Child(proc, time.time(), reader, lines, result_file)
            time.sleep(0.2)
            echo_live()
            for name, child in list(running.items()):
                if child.proc.poll() is None:
                    continue
                child.reader.join()
                echo_live()
                del running[name]
                results.append(child_result(project, name, child, echo))
                if running and not pending:  # the cores of the ended run go to the others
                    shares = thread_shares(os.cpu_count() or 1, list(running))
                    for other, share in shares.items():
                        write_thread_budget(results_dir / f"{other}.threads", share)
                    echo("[schedule] " + ", ".join(f"{other} now {share} torch thread(s)"
                                                   for other, share in shares.items()))
    except KeyboardInterrupt:
        with signals_deferred():
            stop_children([child.proc for child in running.values()])
        raise
    finally:
        shutil.rmtree(results_dir, ignore_errors=True)
    return sorted(results, key=lambda r: names.index(r.name))


def thread_shares(cores: int, running: list[str]) -> dict[str, int]:
    """The torch threads of each of the ``running`` chapters (in the order they started,
    longest expected first) on ``cores`` cores: an equal share, at least 1, the remainder
    going to the first started.

    >>> thread_shares(2, ["context_similarity"])
    {'context_similarity': 2}
    >>> thread_shares(5, ["a", "b"])
    {'a': 3, 'b': 2}
    """
    if not running:
        return {}
    share, extra = divmod(max(1, cores), len(running))
    return {name: max(1, share + (1 if i < extra else 0)) for i, name in enumerate(running)}


@dataclass
class Child:
    """A ``python -m companion run`` process started by :func:`run_many`."""

    proc: subprocess.Popen
    started: float
    reader: threading.Thread
    lines: list[str]
    result_file: Path


def child_command(project: Project, name: str, scale: str | None, device: str | None,
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


def child_result(project: Project, name: str, child: Child,
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


def stop_children(procs: list[subprocess.Popen], grace_seconds: float = 120.0) -> None:
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


def book_sources_state(project: Project) -> str:
    """A hash of what the HTML build reads: every file of the project but the build's
    own, logs and locks (name, size, modification time: how Sphinx judges a page
    changed), the PDF the web book links, and the installed packages."""
    pdf = project.build_dir / "latex" / "book.pdf"
    state = {"sources": _tree_state(project.root, _NOT_BOOK_SOURCES),
             "pdf": [pdf.stat().st_size, pdf.stat().st_mtime_ns] if pdf.is_file() else None,
             "versions": installed_versions()}
    return hashlib.sha256(json.dumps(state).encode()).hexdigest()


def book_output_state(project: Project) -> str:
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
    build (``book/_build/.companion-build-state.json``: :func:`book_sources_state`
    before that build, :func:`book_output_state` after it), jupyter-book is not
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
    sources = book_sources_state(project)  # before the build: what it is going to read
    if html.exists() and _read_stamp(stamp) == {"sources": sources,
                                                "html": book_output_state(project)}:
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
    atomic_write_text(stamp, dumps({"sources": sources, "html": book_output_state(project)}))
    echo(f"[book] built: open {html}")
    return html


def run_summary(results: list[RunResult], wall_seconds: float, cpu_seconds: float,
                cores: int) -> list[str]:
    """The lines :func:`build` prints once its chapters have run: one per chapter (its
    wall time, the CPU time of its run with its kernel, the kernel's peak memory; or
    "cached"), then the chapters' wall time against its floor on this machine, their CPU
    seconds spread over the ``cores`` (``cpu_seconds``: every child run's, measured by
    the build).

    >>> ok = RunResult("hasse", "ok", 400.0, record={"cpu_seconds": 390.0,
    ...                                                "peak_memory_gib": 1.5})
    >>> for line in run_summary([ok, RunResult("sbm", "cached")], 410.0, 396.0, 2):
    ...     print(line)
    [summary] hasse: ok, wall 400.0 s, CPU 390.0 s, peak 1.50 GiB
    [summary] sbm: cached
    [summary] chapters: wall 410 s, CPU 396 s on 2 cores: 2.07x the floor of 198 s (CPU / cores)
    """
    lines = []
    for result in results:
        if result.status == "cached":
            lines.append(f"[summary] {result.name}: cached")
            continue
        record = result.record or {}
        cpu, peak = record.get("cpu_seconds"), record.get("peak_memory_gib")
        lines.append(f"[summary] {result.name}: {result.status}, wall {result.seconds:.1f} s, "
                     + (f"CPU {cpu:.1f} s" if isinstance(cpu, (int, float)) else "CPU unknown")
                     + (f", peak {peak:.2f} GiB" if isinstance(peak, (int, float)) else ""))
    if all(result.status == "cached" for result in results):
        return lines + ["[summary] chapters: none ran, every one was current"]
    floor = cpu_seconds / max(1, cores)
    ratio = f"{wall_seconds / floor:.2f}x the floor" if floor > 0 else "no floor"
    lines.append(f"[summary] chapters: wall {wall_seconds:.0f} s, CPU {cpu_seconds:.0f} s on "
                 f"{cores} cores: {ratio} of {floor:.0f} s (CPU / cores)")
    return lines


def build(project: Project, *, scale: str | dict[str, str | None] | None = None,
          device: str | None = None, jobs: int = 1, chapters: list[str] | None = None,
          force: bool = False, timeout: float | None = None, nproc: int | None = None,
          echo: Callable[[str], None] = print) -> int:
    """Execute chapters, then build the book. Returns the exit code (non-zero on failure).

    ``scale`` is a ``--scale`` value (:func:`parse_scale_spec`: a scale, ``publish``, or
    ``CHAPTER=SCALE`` items) or a mapping chapter -> scale. ``timeout`` (seconds per
    cell) and ``nproc`` are passed to every run; an unavailable CUDA device is refused
    before any chapter starts. Once the chapters have run, :func:`run_summary`'s lines
    give each one's wall time, CPU time and peak memory, and the total against its floor.
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
    cpu_before = process_cpu_seconds()
    results = run_many(project, names, scale=scales, device=device, jobs=jobs, force=force,
                       timeout=timeout, nproc=nproc, echo=echo)
    for line in run_summary(results, time.time() - t0, process_cpu_seconds() - cpu_before,
                            os.cpu_count() or 1):
        echo(line)
    failed = [r for r in results if r.status == "failed"]
    build_html(project, echo=echo)
    echo(f"[done {time.time() - t0:.1f}s] {len(results) - len(failed)} chapter(s) fresh, "
         f"{len(failed)} failed" + (f": {', '.join(r.name for r in failed)}" if failed else ""))
    return 1 if failed else 0
