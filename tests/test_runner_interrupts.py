"""Runner: interrupts (SIGINT, SIGTERM) leave whole outputs, cell timeouts, the chapter
lock, the CUDA check, and the progress lines of runs and builds (in their own processes)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from companion.book import runner
from companion.book.runner import ChapterError, run_chapter


def quiet(_line: str) -> None:
    pass


def _cli(project, *args, **kw):
    return subprocess.run([sys.executable, "-m", "companion", *args, "--root", str(project.root)],
                          capture_output=True, text=True, **kw)


# --------------------------------------------------------------------------- interrupts
# Every wait below is for an event (a marker file, a line of output, a process ending);
# the deadlines are safety nets for a broken run, never part of what is tested.
SAFETY_DEADLINE = 300.0


def _published(p) -> dict[str, bytes]:
    """Every published file (notebook, assets, run record, log) and its bytes."""
    skip = ("locks", ".staging")
    return {str(f.relative_to(p.generated)): f.read_bytes() for f in p.generated.rglob("*")
            if f.is_file() and not str(f.relative_to(p.generated)).startswith(skip)}


def _leftovers(p) -> list[str]:
    return [str(f) for f in p.generated.rglob("*")
            if ".staging" in f.parts or f.name.endswith(".tmp") or ".old-" in f.name]


def _wait_for(condition, what: str, proc=None) -> None:
    deadline = time.monotonic() + SAFETY_DEADLINE
    while not condition():
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended (rc {proc.returncode}) before {what}:\n{out}\n{err}")
        assert time.monotonic() < deadline, f"safety deadline: {what} never happened"
        time.sleep(0.05)


def _pid_gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _default_signal_dispositions() -> None:
    # A command started in the background of a non-interactive shell (`make test &`, a CI
    # script) inherits SIGINT *ignored*, and so do its children: a signal that reaches
    # such a process before it installs its own handler is discarded by the kernel, as
    # POSIX asks. A terminal's Ctrl-C always reaches a run whose SIGINT is in its default
    # state, which is what these tests stand for.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _start_run(p, *args, env_extra=None):
    """``python -m companion run demo`` in its own session (so killpg is a terminal Ctrl-C),
    with SIGINT and SIGTERM in their default state whatever this test process inherited."""
    env = {**os.environ, **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "companion", "run", "demo", "--root",
                             str(p.root), "--scale", "smoke", "--force", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True, preexec_fn=_default_signal_dispositions)


def _start_build(p, scale: str, env_extra=None):
    """``python -m companion build --scale SCALE`` of the project, in this test's session
    (the tests interrupt it with a SIGINT to its pid, as a terminal's Ctrl-C reaches it)."""
    return subprocess.Popen([sys.executable, "-m", "companion", "build", "--root",
                             str(p.root), "--scale", scale], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env_extra or {})})


@pytest.fixture(scope="module")
def interrupt_project(demo_ran_once, tmp_path_factory):
    """One project with one good run (a copy of this pytest run's one good demo run),
    shared by the interrupt tests (each compares to what is published when it starts)."""
    from conftest import copy_project

    return copy_project(demo_ran_once, tmp_path_factory.mktemp("interrupts") / "book-project")


@contextlib.contextmanager
def _hanging_defaults(p, marker):
    """The demo chapter's defaults changed to write ``marker`` and then sleep 600 s (for
    ``build``, which takes no chapter parameters); the source is restored afterwards."""
    src = p.source("demo")
    original = src.read_text()
    src.write_text(original.replace('marker = ""', f'marker = "{marker}"')
                   .replace("sleep_seconds = 0.0", "sleep_seconds = 600.0"))
    try:
        yield
    finally:
        src.write_text(original)


def _assert_unchanged(p, before: dict[str, bytes], proc) -> None:
    after = _published(p)
    assert sorted(after) == sorted(before), "no published file added or removed"
    changed = [f for f in before if after[f] != before[f]]
    assert not changed, f"published files changed by an interrupted run: {changed}"
    assert not _leftovers(p), _leftovers(p)


@pytest.mark.parametrize("point", ["python-start-up", "kernel-start", "cell-sigint-group",
                                   "cell-sigterm"])
def test_interrupt_leaves_published_outputs_byte_identical(interrupt_project, tmp_path, point):
    p = interrupt_project
    before = _published(p)
    marker = tmp_path / "marker"
    if point == "python-start-up":
        proc = _start_run(p)
        os.kill(proc.pid, signal.SIGINT)  # at once: during start-up or imports
        expected = None  # -2 before our handler is installed, 130 after: non-zero
    elif point == "kernel-start":
        proc = _start_run(p, env_extra={runner.ENV_TEST_PAUSE_AT: f"kernel-start:{marker}"})
        _wait_for(marker.exists, "the run reached kernel start-up", proc)
        os.kill(proc.pid, signal.SIGINT)
        expected = 130
    else:
        proc = _start_run(p, "-p", "marker", str(marker), "-p", "sleep_seconds", "600",
                          "--publish")
        _wait_for(marker.exists, "the kernel executes the wait cell", proc)
        if point == "cell-sigint-group":  # Ctrl-C at a terminal: the whole process group
            os.killpg(proc.pid, signal.SIGINT)
            expected = 130
        else:  # what build sends its child runs
            os.kill(proc.pid, signal.SIGTERM)
            expected = 143
    out, err = proc.communicate(timeout=SAFETY_DEADLINE)
    assert proc.returncode != 0, f"an interrupt was lost:\n{out}\n{err}"
    if expected is not None:
        assert proc.returncode == expected, err
        assert "interrupted" in err
    _assert_unchanged(p, before, proc)
    if marker.exists() and point.startswith("cell"):
        kernel = json.loads(marker.read_text())["kernel"]
        _wait_for(lambda: _pid_gone(kernel), "the kernel ended")


# What lost a Ctrl-C on a loaded machine: a SIGINT that arrives while torch initialises its
# C extension raises KeyboardInterrupt inside the NumPy import torch makes from C, and
# torch clears it (a failed NumPy import becomes a warning). The import runs long on a
# busy machine, so "at once" often landed there. This prelude reproduces that moment
# deterministically: the first `import torch` sends SIGINT and swallows the exception
# exactly as torch does, then `python -m companion run` goes on as usual.
_SWALLOWING_IMPORT = """
import builtins, os, runpy, signal, sys
SWALLOWED = os.environ["SWALLOWED_IMPORT"]
real_import = builtins.__import__
fired = []
def swallowing_import(name, *args, **kwargs):
    if name == SWALLOWED and not fired:
        fired.append(True)
        try:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10_000):  # the handler runs between bytecodes
                pass
        except KeyboardInterrupt:
            pass
    return real_import(name, *args, **kwargs)
builtins.__import__ = swallowing_import
sys.argv = ["companion", *sys.argv[1:]]
runpy.run_module("companion", run_name="__main__", alter_sys=True)
"""


def test_interrupt_swallowed_during_an_import_is_not_lost(interrupt_project):
    """torch's C extension swallows a KeyboardInterrupt raised while it imports. The
    runner no longer imports torch before a run starts (a cached run never does), so the
    interrupt is swallowed here in the first heavy import a run makes, jupytext's."""
    p = interrupt_project
    before = _published(p)
    proc = subprocess.run([sys.executable, "-c", _SWALLOWING_IMPORT, "run", "demo",
                           "--root", str(p.root), "--scale", "smoke", "--force"],
                          capture_output=True, text=True, timeout=SAFETY_DEADLINE,
                          env={**os.environ, "SWALLOWED_IMPORT": "jupytext"})
    assert proc.returncode == 130, f"an interrupt was lost:\n{proc.stdout}\n{proc.stderr}"
    assert "[start]" not in proc.stdout, "nothing may start after an interrupt"
    _assert_unchanged(p, before, proc)


def test_nested_guard_raises_a_signal_recorded_before_it():
    """Inside `python -m companion` the handlers are installed before any import; a signal
    recorded then (even if its exception was swallowed) stops the first guard at once."""
    from companion.book import interrupts

    previous = interrupts.install_interrupt_handlers()
    try:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10_000):
                pass
        except KeyboardInterrupt:
            pass  # swallowed, as torch's C extension does
        assert interrupts.interrupted_signal() == signal.SIGINT
        with pytest.raises(runner.RunInterrupted) as info:
            with runner.interrupt_guard():
                raise AssertionError("the body must not run")
        assert info.value.exit_code == 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        interrupts.forget_interrupt()


def test_an_interrupt_waits_for_papermills_thread_to_end(monkeypatch, tmp_path):
    """The interrupt lands while the main thread waits for papermill's thread, as a Ctrl-C
    does: the runner kills the kernel and returns only once that thread has ended, so its
    last write (the output notebook) cannot land in a staging folder being removed. On
    Python 3.11 an interrupted Thread.join marks a running thread as stopped, and waiting
    with join made such a run leave ``.staging/<run>/<chapter>.ipynb`` behind."""
    import threading

    import papermill

    from companion.book import interrupts

    kernel_killed = threading.Event()
    papermill_ended = threading.Event()

    class Tracker:  # stands for runner.KernelTracker: no kernel is started
        peak_bytes = 0

        def manager_class(self):
            return None

        def sample_memory(self):
            pass

        def stop(self):
            kernel_killed.set()

    def execute_notebook(*_args, **_kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # handled in the main thread, which waits
        assert kernel_killed.wait(SAFETY_DEADLINE), "the runner kills the kernel"
        sum(range(3_000_000))  # papermill's work after the kernel's death (its last write)
        papermill_ended.set()

    monkeypatch.setattr(papermill, "execute_notebook", execute_notebook)
    try:
        with pytest.raises(runner.RunInterrupted):
            with runner.interrupt_guard():
                runner.execute_notebook(tmp_path / "in.ipynb", tmp_path / "out.ipynb",
                                        tmp_path / "run.log", {}, tmp_path, timeout=60,
                                        tracker=Tracker())
        assert papermill_ended.is_set(), "returned while papermill's thread still ran"
    finally:
        interrupts.forget_interrupt()


def test_interrupt_during_publishing_publishes_everything(interrupt_project, tmp_path):
    """A signal while publishing is taken once publishing has finished: all new, exit 130."""
    p = interrupt_project
    before = _published(p)
    old_record = json.loads(p.run_record("demo").read_text())
    marker = tmp_path / "publishing"
    proc = _start_run(p, env_extra={runner.ENV_TEST_PAUSE_AT: f"publish:{marker}"})
    _wait_for(marker.exists, "the run started publishing", proc)
    os.kill(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=SAFETY_DEADLINE)
    assert proc.returncode == 130, err
    after = _published(p)
    assert sorted(after) == sorted(before), "the same set of files, all of them"
    record = json.loads(p.run_record("demo").read_text())
    assert record["status"] == "ok" and record["started"] != old_record["started"]
    nb = p.notebook("demo").read_text()
    assert record["finished"] in nb, "the notebook is the one of the new run record"
    png = "assets/demo/figures/demo-random-walk.png"
    assert after[png] == before[png], "same seed: the new figure has the same bytes"
    assert not _leftovers(p)


def test_interrupt_of_build_stops_its_runs(interrupt_project, tmp_path):
    p = interrupt_project
    before = _published(p)
    marker = tmp_path / "marker"
    with _hanging_defaults(p, marker):
        proc = _start_build(p, "smoke")
        _wait_for(marker.exists, "the build's run executes the wait cell", proc)
        pids = json.loads(marker.read_text())
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=SAFETY_DEADLINE)
    assert proc.returncode == 130, f"{out}\n{err}"
    assert _pid_gone(pids["runner"]), "build waited for its child run to end"
    _wait_for(lambda: _pid_gone(pids["kernel"]), "the child run's kernel ended")
    _assert_unchanged(p, before, proc)


# --------------------------------------------------------------------------- limits
def test_hung_cell_times_out_naming_the_cell_and_marks_stale(interrupt_project, tmp_path):
    p = interrupt_project
    good = json.loads(p.run_record("demo").read_text())
    assert good["status"] == "ok"
    published = tmp_path / "published"  # the good run, put back for the module's other tests
    shutil.copytree(p.generated, published, symlinks=True)
    proc = _cli(p, "run", "demo", "--scale", "smoke", "--force", "-p", "hang", "true",
                "--timeout", "5", "--publish", timeout=SAFETY_DEADLINE)
    assert proc.returncode == 1, proc.stderr
    record = json.loads(p.run_record("demo").read_text())
    assert record["status"] == "failed"
    nb = runner.read_notebook(p.source("demo"))
    number = int(record["error"].split()[1])
    assert record["error"] == f"cell {number} timed out after 5 s (raise the limit with " \
        "--timeout SECONDS)"
    assert "time.sleep(3600)" in nb.cells[number - 1].source, "the hanging cell is named"
    assert record["last_good"]["started"] == good["started"]
    page = p.notebook("demo").read_text()
    assert runner.STALE_TAG in page and "timed out" in page
    assert not _leftovers(p)
    # Leave the good run for the other tests of the module: its files, byte for byte.
    shutil.rmtree(p.generated)
    shutil.copytree(published, p.generated, symlinks=True)
    assert json.loads(p.run_record("demo").read_text()) == good


@pytest.mark.parametrize("bad", ["0", "-3", "nan", "inf", "soon"])
def test_cli_rejects_bad_timeout(demo_project, bad):
    for command in ("run", "build"):
        args = [command, "demo"] if command == "run" else [command]
        proc = _cli(demo_project, *args, f"--timeout={bad}")
        assert proc.returncode == 2
        assert "--timeout" in proc.stderr and "positive number of seconds" in proc.stderr


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True, "5"])
def test_run_chapter_rejects_bad_timeout(demo_project, bad):
    with pytest.raises(ChapterError, match="timeout: expected a positive number of seconds"):
        run_chapter(demo_project, "demo", scale="smoke", timeout=bad, echo=quiet)


def test_cuda_without_cuda_is_refused_before_anything_runs(interrupt_project):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    p = interrupt_project
    before = _published(p)
    proc = _cli(p, "run", "demo", "--scale", "smoke", "--force", "--device", "cuda")
    assert proc.returncode == 2, proc.stderr
    assert "device 'cuda': CUDA is not available on this machine" in proc.stderr
    assert "[start]" not in proc.stdout
    lines: list[str] = []
    with pytest.raises(ChapterError, match="device 'cuda:1': CUDA is not available on this"):
        run_chapter(p, "demo", scale="smoke", force=True, device="cuda:1", echo=lines.append)
    assert not [line for line in lines if line.startswith("[start]")]
    proc = _cli(p, "build", "--scale", "smoke", "--device", "cuda")
    assert proc.returncode == 2 and "CUDA is not available" in proc.stderr
    assert _published(p) == before, "not marked stale; run record unchanged"


def test_second_run_of_a_chapter_waits_for_the_first(interrupt_project):
    """While another run holds the chapter's lock a run says it waits, and does."""
    import filelock

    p = interrupt_project
    lock = filelock.FileLock(str(p.generated / "locks" / "demo.lock"))
    with lock:
        proc = _start_run(p)
        first = proc.stdout.readline()  # blocks until the run prints (an event)
        assert first.startswith("[waiting] demo: another run of this chapter holds"), first
        assert not (p.generated / ".staging").exists(), "nothing started while it waits"
        assert proc.poll() is None
    out, err = proc.communicate(timeout=SAFETY_DEADLINE)
    assert proc.returncode == 0, err
    assert "[ok" in out
    record = json.loads(p.run_record("demo").read_text())
    assert record["status"] == "ok"
    assert json.loads(p.notebook("demo").read_text())["cells"], "a whole notebook"
    assert not _leftovers(p)


def test_staging_of_a_killed_run_is_removed(demo_project):
    p = demo_project
    dead = p.generated / ".staging" / "demo-999999999-deadbeef"
    dead.mkdir(parents=True)
    (dead / "demo.ipynb").write_text("{}")
    assert run_chapter(p, "demo", scale="smoke", echo=quiet).status == "ok"
    assert not dead.exists()


# --------------------------------------------------------------------------- progress
def _lines_until(proc, patterns: list[str]) -> list[str]:
    """Lines of ``proc``'s stdout until each regex of ``patterns`` has matched one (an
    event; the deadline is a safety net)."""
    import queue
    import re
    import threading

    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout],
                     daemon=True).start()
    seen: list[str] = []
    missing = list(patterns)
    deadline = time.monotonic() + SAFETY_DEADLINE
    while missing:
        assert time.monotonic() < deadline, f"safety deadline: {missing} never printed: {seen}"
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            assert proc.poll() is None or not lines.empty(), f"run ended early: {seen}"
            continue
        seen.append(line)
        missing = [m for m in missing if not re.search(m, line)]
    return seen


def test_run_prints_its_log_path_and_the_current_cell(interrupt_project, tmp_path):
    p = interrupt_project
    before = _published(p)
    marker = tmp_path / "marker"
    proc = _start_run(p, "-p", "marker", str(marker), "-p", "sleep_seconds", "600",
                      "--publish", env_extra={runner.ENV_PROGRESS_SECONDS: "0.1"})
    seen = _lines_until(proc, [r"^\[start\] demo .*: log \S+demo\.log",
                               r"^\[progress\] demo: cell \d+ of \d+"])
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=SAFETY_DEADLINE)  # (its stdout is the reader thread's)
    assert proc.returncode == 143
    start = next(line for line in seen if line.startswith("[start]"))
    assert ".staging" in start, "the live log, where the kernel writes now"
    cells = [line for line in seen if "[progress]" in line and " of " in line]
    # "cell k of N (chapter cell c) running ...", without the parenthesis for a cell that
    # is not the chapter's (papermill's injected parameters)
    k, n = (int(x) for x in re.search(r"cell (\d+) of (\d+)", cells[-1]).groups())
    assert 1 <= k <= n
    _assert_unchanged(p, before, proc)


def test_build_relays_each_runs_log_path_and_progress(interrupt_project, tmp_path):
    p = interrupt_project
    before = _published(p)
    marker = tmp_path / "marker"
    with _hanging_defaults(p, marker):
        proc = _start_build(p, "demo=smoke", env_extra={runner.ENV_PROGRESS_SECONDS: "0.1"})
        seen = _lines_until(proc, [r"^\[scales\] demo=smoke", r"^\[start\] demo .*: log \S+",
                                   r"^\[progress\] demo: cell \d+ of \d+ \(chapter cell \d+\)"])
        _wait_for(marker.exists, "the build's run executes the wait cell", proc)
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(timeout=SAFETY_DEADLINE)
    assert proc.returncode == 130, seen
    _assert_unchanged(p, before, proc)


def test_bad_progress_period_is_refused(demo_project):
    proc = subprocess.run([sys.executable, "-m", "companion", "run", "demo", "--root",
                           str(demo_project.root)], capture_output=True, text=True,
                          env={**os.environ, runner.ENV_PROGRESS_SECONDS: "soon"})
    assert proc.returncode == 2
    assert "COMPANION_PROGRESS_SECONDS: expected a positive number of seconds" in proc.stderr
