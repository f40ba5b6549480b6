"""Files written whole: atomic writes (temporary file + rename) and the JSON the book saves.

A reader, or an interrupted run, never sees a half-written file.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder + rename.

    A reader (or an interrupted run) never sees a half-written file.

    >>> import tempfile, pathlib
    >>> target = pathlib.Path(tempfile.mkdtemp()) / "a" / "b.txt"
    >>> atomic_write_bytes(target, b"whole"); target.read_bytes()
    b'whole'
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """:func:`atomic_write_bytes` of ``text`` encoded as UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


def write_text_if_changed(path: Path, text: str) -> bool:
    """Write ``text`` atomically unless ``path`` already holds exactly it; True if written.

    An unchanged file keeps its modification time, so that Sphinx does not read the page
    again on a rebuild.

    >>> import tempfile, pathlib
    >>> target = pathlib.Path(tempfile.mkdtemp()) / "page.md"
    >>> write_text_if_changed(target, "# A\\n"), write_text_if_changed(target, "# A\\n")
    (True, False)
    """
    path = Path(path)
    data = text.encode("utf-8")
    with contextlib.suppress(OSError):
        if path.read_bytes() == data:
            return False
    atomic_write_bytes(path, data)
    return True


def _json_default(obj: Any) -> Any:
    # numpy / torch scalars and tuples appear in parameters and measurements.
    if hasattr(obj, "item") and callable(obj.item):
        try:
            return obj.item()
        except (ValueError, RuntimeError):
            pass
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)


def dumps(obj: Any) -> str:
    """``obj`` as the book's JSON: indented, keys sorted, numpy/torch scalars as numbers.

    >>> print(dumps({"b": 1, "a": (2, 3)}), end="")
    {
      "a": [
        2,
        3
      ],
      "b": 1
    }
    """
    return json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n"


def now_iso() -> str:
    """The current UTC time, ISO 8601, to the second."""
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
