"""``python -m companion``: see :mod:`companion.cli`.

A Ctrl-C that arrives while the CLI is still being imported, before its interrupt
handlers are installed, nothing has been started or written yet: exit 130 quietly, like
an interrupt later on.
"""
try:
    from companion.cli import main
except KeyboardInterrupt:
    raise SystemExit(130) from None

raise SystemExit(main())
