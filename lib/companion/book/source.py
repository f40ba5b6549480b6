"""The code a chapter shows: a library function's source, printed beside the equation
it implements (the docstring stays in the library, where the reader can follow it)."""
from __future__ import annotations

import ast
import inspect
import textwrap

__all__ = ["source_without_docstring"]


def source_without_docstring(fn) -> str:
    """The source of the function (or class) ``fn``, without its docstring.

    Parameters
    ----------
    fn : a function or class defined in a file (``inspect.getsource`` must find it).

    Returns
    -------
    str : the source as written (decorators and comments kept), the docstring's lines
        removed; unchanged when there is no docstring.

    >>> shown = source_without_docstring(source_without_docstring)
    >>> shown.splitlines()[0]
    'def source_without_docstring(fn) -> str:'
    >>> "Parameters" in shown  # a word of the docstring
    False
    """
    if not (inspect.isfunction(fn) or inspect.isclass(fn) or inspect.ismethod(fn)):
        raise TypeError(f"fn: expected a function or class, got {type(fn).__name__}")
    source = textwrap.dedent(inspect.getsource(fn))
    body = ast.parse(source).body[0].body
    first = body[0] if body else None
    if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        lines = source.splitlines()
        del lines[first.lineno - 1:first.end_lineno]
        source = "\n".join(lines)
    return source.rstrip("\n")
