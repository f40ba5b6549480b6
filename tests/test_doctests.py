"""The ``>>>`` examples in the library's docstrings run and give what they show."""
from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import companion

MODULES = sorted(m.name for m in pkgutil.walk_packages(companion.__path__, "companion.")
                 if not m.name.endswith("__main__"))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
