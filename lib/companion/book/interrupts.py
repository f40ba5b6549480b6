"""Interrupts as a recorded state: Ctrl-C (SIGINT) and SIGTERM can never be lost.

A plain Ctrl-C is a KeyboardInterrupt raised in whatever frame the main thread runs, and
libraries can lose it. One case, measured here: a SIGINT that arrives while ``import torch``
initialises its C extension raises KeyboardInterrupt inside the NumPy import that torch's
C code makes, and torch clears the error (it turns a failed NumPy import into a warning),
so the interrupt vanishes and a run that was stopped finishes "ok". So the handlers here
first *record* the signal, then raise; code that must not be fooled checks the record
(:func:`raise_if_interrupted`). ``python -m companion`` installs them before it imports
anything heavy (see ``companion/__main__.py``), and :mod:`companion.book.runner` checks the
record before it publishes anything.

One window no process can close: a program started with SIGINT *ignored* (what a
non-interactive shell does to a background command, what ``nohup`` and some CI runners
pass on) has every SIGINT discarded by the kernel until a handler is installed, i.e.
during the interpreter's first few hundred milliseconds. From then on our handler counts,
whatever was inherited.

This module imports nothing heavy, so that it can be installed first.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any

INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM)

__all__ = ["INTERRUPT_SIGNALS", "RunInterrupted", "forget_interrupt",
           "install_interrupt_handlers", "interrupt_guard", "interrupted_signal",
           "raise_if_interrupted", "signals_deferred"]


class RunInterrupted(KeyboardInterrupt):
    """A run was stopped by SIGINT or SIGTERM; ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = 128 + signum


class _InterruptState:
    """The first SIGINT/SIGTERM a run received, and whether it may raise right now."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.deferring = 0  # > 0 inside signals_deferred(): record, do not raise


_INTERRUPT = _InterruptState()


def _on_interrupt_signal(signum: int, _frame) -> None:
    if _INTERRUPT.signum is None:
        _INTERRUPT.signum = signum
    if not _INTERRUPT.deferring:
        raise RunInterrupted(signum)


def raise_if_interrupted() -> None:
    """Raise :class:`RunInterrupted` if a signal has been recorded (even if swallowed)."""
    if _INTERRUPT.signum is not None:
        raise RunInterrupted(_INTERRUPT.signum)


def install_interrupt_handlers() -> dict[int, Any]:
    """Route SIGINT and SIGTERM to the interrupt record; returns the previous handlers.

    Only the main thread can set handlers; elsewhere nothing is installed (and {} returned).
    """
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _on_interrupt_signal) for sig in INTERRUPT_SIGNALS}


@contextlib.contextmanager
def interrupt_guard():
    """Make an interrupt a recorded state that no library can swallow.

    A plain Ctrl-C is a KeyboardInterrupt raised inside whatever frame the main thread
    happens to run, often deep in nbclient, jupyter_client or asyncio, whose clean-up
    paths (re-running the event loop to shut the kernel down, retrying interrupted
    calls) can replace or lose it; and SIGTERM would kill the process without clean-up.
    Here both signals set a record first and then raise :class:`RunInterrupted`; the
    notebook runs in a worker thread (``kernel.execute_notebook``), so the main thread,
    where Python runs signal handlers, only waits in our own code when one arrives.
    The record is checked again before publishing and when the guard exits, so even a
    swallowed exception cannot turn an interrupted run into a success.
    """
    previous = install_interrupt_handlers()
    if previous.get(signal.SIGINT) is not _on_interrupt_signal:  # not nested: a fresh record
        _INTERRUPT.signum = None
    try:
        # Nested (inside `python -m companion`, whose handlers are installed before any
        # import): a signal recorded before this point, possibly swallowed, stops us now.
        raise_if_interrupted()
        yield
        raise_if_interrupted()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def signals_deferred():
    """Run the body whole: a signal arriving inside is recorded and raised at the end.

    Used for publishing, marking stale and clean-up, which must not stop half-way (a
    body that starts a change should call :func:`raise_if_interrupted` first). A
    deferred Python handler rather than ``pthread_sigmask``: masking the main thread
    would only move delivery to another thread, whose C handler still schedules the
    Python handler on the main thread.
    """
    _INTERRUPT.deferring += 1
    try:
        yield
    finally:
        _INTERRUPT.deferring -= 1
    raise_if_interrupted()


def interrupted_signal() -> int | None:
    """The signal number recorded so far in this process (None when none)."""
    return _INTERRUPT.signum


def forget_interrupt() -> None:
    """Forget the signal recorded in this process: for a test that sent one to itself and
    goes on in the same process (a run never does)."""
    _INTERRUPT.signum = None
