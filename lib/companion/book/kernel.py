"""Executing a notebook: papermill in a worker thread while the main thread waits, echoes
progress lines and samples the kernel's memory; the environment through which the runner
talks to the chapter; the limits on a kernel's start and a cell's output; the kernel
killed on an interrupt (:func:`execute_notebook`).

For the tests only, ``COMPANION_TEST_PAUSE_AT=<point>:<marker path>`` makes a run stop
at ``<point>`` (``kernel-start``: just before the kernel is launched; ``publish``: after
the assets are swapped in, before the notebook is written), create the marker file and
wait there until it is interrupted or ``<marker path>.release`` exists (see
:func:`test_pause`). Tests use it to send signals at moments they cannot otherwise
hit deterministically.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from companion.book.chapter import (ENV_ASSET_URL, ENV_CHAPTER, ENV_DEVICE_FILE,
                                    ENV_OUTPUT_DIR, ENV_PARAMETERS, ENV_THREADS,
                                    encode_parameters)
from companion.book.gitstate import ENV_COMMIT, ENV_DIRTY
from companion.book.interrupts import (interrupted_signal, raise_if_interrupted,
                                       signals_deferred)
from companion.book.project import ChapterError

ENV_TEST_PAUSE_AT = "COMPANION_TEST_PAUSE_AT"
#: Processes for the chapters' scale-out (torchrun), read by :mod:`companion.parallel`.
ENV_NPROC = "COMPANION_NPROC"
#: Seconds between two progress lines of a running chapter (default 30).
ENV_PROGRESS_SECONDS = "COMPANION_PROGRESS_SECONDS"
PROGRESS_SECONDS = 30.0
# Safety limits, not expected times (a loaded machine starts a kernel in seconds): the
# kernel's start, and the wait for a cell's last output after its reply; nbclient's
# defaults (60 s, 4 s) would fail a start, or silently drop the end of a cell's output
# from the page, on a busy machine. Past them the chapter fails; nothing is dropped.
KERNEL_START_LIMIT_S = 600
OUTPUT_WAIT_LIMIT_S = 300
# ... and papermill's end after the kernel was killed on an interrupt (it notices the dead
# kernel within a second or two and writes the output notebook).
WORKER_END_LIMIT_S = 300
#: The file, in a run's staging folder, where its chapter writes the device it resolved
#: (``COMPANION_DEVICE_FILE``), read by :func:`detected_device`.
DEVICE_FILE = ".device"


def process_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and of its children that have ended:
    the difference over a run is the run's CPU time, its kernel's included (jupyter_client
    waits for the kernel it shuts down, and the kernel for its ``torchrun`` ranks)."""
    import resource

    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


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


def test_pause(point: str, stop: threading.Event | None = None) -> None:
    """The test hook of the module docstring (``COMPANION_TEST_PAUSE_AT``); else nothing."""
    spec = os.environ.get(ENV_TEST_PAUSE_AT, "")
    at, _, marker = spec.partition(":")
    if at != point or not marker:
        return
    Path(marker).write_text(str(os.getpid()))
    release = Path(marker + ".release")
    while not release.exists():
        if interrupted_signal() is not None or (stop is not None and stop.is_set()):
            break
        time.sleep(0.05)


test_pause.__test__ = False  # a hook, not a test: pytest collects nothing here


def kernel_variables(*, name: str, output_dir: Path, asset_url: str, commit: str,
                     dirty: bool, threads: int | None, nproc: int, device_file: Path,
                     params: dict[str, Any]) -> dict[str, str]:
    """The environment through which the runner talks to the executing chapter: where it
    writes, its parameters as papermill injects them (which ``begin_chapter`` records in
    every figure, table and claim), the commit, threads and processes; and
    ``device_file``, outside the outputs, through which the chapter answers: the device
    its ``begin_chapter`` resolved, read by :func:`detected_device`."""
    env = {
        ENV_OUTPUT_DIR: str(output_dir),
        ENV_DEVICE_FILE: str(device_file),
        ENV_ASSET_URL: asset_url,
        ENV_CHAPTER: name,
        ENV_PARAMETERS: encode_parameters(params),
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


@contextlib.contextmanager
def kernel_environment(variables: dict[str, str]):
    """os.environ with ``variables`` (:func:`kernel_variables`) for the kernel to inherit,
    restored afterwards."""
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def detected_device(requested: str, told: Path | None = None) -> str:
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


class KernelTracker:
    """The kernel a run launches, so that the main thread can kill it on an interrupt.

    The kernel runs in its own session (jupyter_client starts it with
    ``start_new_session``), so a Ctrl-C at the terminal never reaches it: it cannot turn
    an interrupt into a failed cell. The kernel is killed with its whole process group.
    What :func:`execute_notebook` uses of it: :meth:`manager_class`,
    :meth:`sample_memory`, :attr:`peak_bytes` and :meth:`stop`.
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
                test_pause("kernel-start", tracker.stopped)
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
        """Kill the kernels started so far, with their children."""
        with self._lock:
            pids = list(self._pids)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # its session's group: the kernel and children


@dataclass
class Execution:
    """What the worker thread of :func:`execute_notebook` left: an error, or none."""

    error: BaseException | None = None
    cell_index: int | None = None  # the cell being executed when it stopped
    peak_bytes: int = 0  # the kernel's (and its children's) largest resident memory


@dataclass
class Progress:
    """Where a running chapter is, for its progress lines (see :func:`progress_line`)."""

    name: str
    code_cells: int  # in the executed notebook: the chapter's and papermill's injected one
    started: float = field(default_factory=time.monotonic)
    code_cell: int = 0  # the code cell being executed (1-based; 0: none yet)
    cell_started: float = 0.0
    chapter_cell: int | None = None  # its number in the chapter as written


def progress_line(progress: Progress, now: float | None = None) -> str:
    """``[progress] NAME: cell k of N (chapter cell c) for s, t in all``."""
    now = time.monotonic() if now is None else now
    total = f"{now - progress.started:.0f} s in all"
    if not progress.code_cell:
        return f"[progress] {progress.name}: starting the kernel, {total}"
    where = (f" (chapter cell {progress.chapter_cell})"
             if progress.chapter_cell is not None else "")
    return (f"[progress] {progress.name}: cell {progress.code_cell} of {progress.code_cells}"
            f"{where} running for {now - progress.cell_started:.0f} s, {total}")


def code_cells(nb) -> int:
    """Code cells papermill executes: the notebook's and the injected parameters cell."""
    return sum(c.cell_type == "code" for c in nb.cells) + 1


def chapter_cell_number(executed_index: int, parameters_cell: int) -> int:
    """The 1-based number, in the chapter as written, of a cell of the executed notebook.

    papermill inserts one 'injected-parameters' cell after the parameters cell.
    """
    return executed_index + 1 - (1 if executed_index > parameters_cell else 0)


def execute_notebook(input_nb: Path, output_nb: Path, log_path: Path, params: dict[str, Any],
                     cwd: Path, timeout: float, progress: Progress | None = None,
                     echo: Callable[[str], None] | None = None, parameters_cell: int = 0,
                     tracker: KernelTracker | None = None) -> Execution:
    """Run papermill in a worker thread, waiting in the main thread (see interrupt_guard).

    Every :func:`progress_seconds` the main thread echoes a :func:`progress_line`. On an
    interrupt the kernel is killed (``tracker``: a new :class:`KernelTracker` when None),
    the worker is waited for (it ends once nbclient sees the dead kernel) and the
    interrupt is re-raised.
    """
    import papermill as pm

    tracker = KernelTracker() if tracker is None else tracker
    outcome = Execution()
    period = progress_seconds()

    def on_cell_start(cell, cell_index, **_):
        outcome.cell_index = cell_index
        if progress is not None and cell.cell_type == "code":
            progress.code_cell += 1
            progress.cell_started = time.monotonic()
            progress.chapter_cell = (
                None if "injected-parameters" in cell.get("metadata", {}).get("tags", [])
                else chapter_cell_number(cell_index, parameters_cell))

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


def papermill_error(exc: BaseException, parameters_cell: int) -> str:
    """'cell N raised ExcName: message' from a papermill execution error."""
    ename = getattr(exc, "ename", type(exc).__name__)
    evalue = str(getattr(exc, "evalue", exc)).strip().splitlines()
    msg = evalue[-1] if evalue else ""
    idx = getattr(exc, "cell_index", None)
    if idx is not None:
        return f"cell {chapter_cell_number(idx, parameters_cell)} raised {ename}: {msg}"
    return f"{ename}: {msg}"


def execution_error(outcome: Execution, parameters_cell: int, timeout: float) -> str | None:
    """The chapter's error message for a finished execution, or None when it succeeded."""
    import papermill as pm
    from nbclient.exceptions import CellTimeoutError

    exc = outcome.error
    if exc is None:
        return None
    if isinstance(exc, pm.PapermillExecutionError):
        return papermill_error(exc, parameters_cell)
    if isinstance(exc, CellTimeoutError):
        where = (f"cell {chapter_cell_number(outcome.cell_index, parameters_cell)}"
                 if outcome.cell_index is not None else "a cell")
        return f"{where} timed out after {timeout:g} s (raise the limit with --timeout SECONDS)"
    return f"{type(exc).__name__}: {exc}"
