"""``python -m companion``: see :mod:`companion.book.cli`.

The interrupt handlers are installed before anything else is imported: a Ctrl-C that
arrives while torch is being imported would otherwise be lost (torch's C extension clears
a KeyboardInterrupt raised inside its NumPy import; see :mod:`companion.book.interrupts`).
The signal is recorded either way, and a run that was interrupted exits 128 + signal.
"""
from companion.book.interrupts import install_interrupt_handlers, interrupted_signal

install_interrupt_handlers()
try:
    from companion.book.cli import main
except KeyboardInterrupt:
    main = None
if main is None or interrupted_signal() is not None:
    # interrupted while importing (even if the exception was swallowed): nothing has
    # been started or written yet
    raise SystemExit(128 + (interrupted_signal() or 2))
raise SystemExit(main())
