"""companion.book.source: the code a chapter shows is the function's source without its
docstring, checked against the source text itself."""
from __future__ import annotations

import inspect

import pytest

from companion.book.source import source_without_docstring
from companion.hasse import reference


def _with_docstring(x):
    """One line."""
    return x + 1


def _with_long_docstring(x):
    """First line.

    More lines, with ``code``.
    """
    # a comment stays
    return x * 2


def _without_docstring(x):
    return x - 1


def _string_statement_later(x):
    y = x
    "not a docstring"
    return y


@pytest.mark.parametrize("fn", [_with_docstring, _with_long_docstring])
def test_the_docstring_goes_and_nothing_else(fn):
    shown = source_without_docstring(fn)
    assert fn.__doc__.strip().splitlines()[0] not in shown
    original = inspect.getsource(fn).splitlines()
    doc_lines = len(fn.__doc__.splitlines())
    assert len(shown.splitlines()) == len(original) - doc_lines
    assert all(line in original for line in shown.splitlines())


def test_without_a_docstring_the_source_is_unchanged():
    assert source_without_docstring(_without_docstring) == inspect.getsource(
        _without_docstring).rstrip("\n")
    assert '"not a docstring"' in source_without_docstring(_string_statement_later)


def test_a_library_reference_compiles_after_the_cut():
    shown = source_without_docstring(reference.reachability_limit)
    compile(shown, "<shown>", "exec")
    assert '"""' not in shown.splitlines()[1]


def test_methods_are_dedented():
    class Box:
        def value(self):
            """The value."""
            return 1

    shown = source_without_docstring(Box.value)
    assert shown.startswith("def value(self):") and "The value" not in shown


def test_not_a_function_is_a_clear_error():
    with pytest.raises(TypeError, match="^fn: expected a function or class, got int$"):
        source_without_docstring(3)
