"""The ``>>>`` examples in the library's docstrings run and give what they show."""
from __future__ import annotations

import doctest
import importlib
import inspect
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


SCIENCE_PACKAGES = ("hasse", "context_similarity", "gradient_flow", "sbm", "lra")

# Public names (relative to ``companion``) whose docstring has no ``>>>`` example, each with its
# reason: an example would take seconds (a one-time import or model load). Keep it short: an
# entry that gains an example must leave it (the test says so).
WITHOUT_EXAMPLE = {
    "lra.loaders.digits_standin": "imports scikit-learn: seconds",
    "hasse.masked_transformer.flex_vs_sdpa": "FlexAttention's first call takes seconds",
    "context_similarity.encoder.load_encoder": "loads the bundled MiniLM: seconds",
}


def _public_objects():
    """Yield (dotted name, object) for every public function and class of the science packages.

    Public: defined in its module (not imported), name not starting with ``_``, in a public
    module, and listed in the module's ``__all__`` when it has one.
    """
    for package in SCIENCE_PACKAGES:
        root = importlib.import_module(f"companion.{package}")
        names = [root.__name__] + [
            m.name for m in pkgutil.walk_packages(root.__path__, root.__name__ + ".")
            if not any(part.startswith("_") for part in m.name.split("."))]
        for module_name in sorted(names):
            module = importlib.import_module(module_name)
            listed = getattr(module, "__all__", None)
            for name, obj in vars(module).items():
                if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                    continue
                if getattr(obj, "__module__", None) != module_name:
                    continue
                if listed is not None and name not in listed:
                    continue
                yield module_name.removeprefix("companion.") + "." + name, obj


def test_every_public_function_of_the_science_packages_has_an_example():
    objects = dict(_public_objects())
    assert len(objects) > 100, "the walk over the science packages found too few names"
    missing = sorted(name for name, obj in objects.items()
                     if ">>>" not in (inspect.getdoc(obj) or "") and name not in WITHOUT_EXAMPLE)
    assert not missing, f"public names without a >>> example: {missing}"
    stale = sorted(name for name in WITHOUT_EXAMPLE
                   if name not in objects or ">>>" in (inspect.getdoc(objects[name]) or ""))
    assert not stale, f"WITHOUT_EXAMPLE entries that have an example or no longer exist: {stale}"
