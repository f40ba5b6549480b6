"""The science packages never import the book's machinery (``companion.book``).

A reader who takes the code of a chapter (``companion.hasse``,
``companion.context_similarity``, ``companion.gradient_flow``, ``companion.sbm``,
``companion.lra``) takes it without papermill, Sphinx or the runner: those packages may
import each other, torch, numpy and the shared modules at the top of ``companion``
(argument checks, devices, timing, scale-out, corpora, model checkpoints, the heap's
settings, the build's thread budget), but never
``companion.book``.
Checked on the source (every ``import``, at module level or inside a function), so a lazy
import counts too.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

LIB = Path(__file__).resolve().parents[1] / "lib" / "companion"

#: The science packages: one per chapter, plus the offline long-range tasks.
SCIENCE_PACKAGES = ("hasse", "context_similarity", "gradient_flow", "sbm", "lra")

#: The shared modules every package may use (they import no book module either).
SHARED = ("_validate", "devices", "timing", "parallel", "corpora", "models", "heap",
          "thread_budget")

SCIENCE = sorted(
    [str(p.relative_to(LIB).with_suffix("")).replace("/", ".")
     for pkg in SCIENCE_PACKAGES for p in (LIB / pkg).rglob("*.py")]
    + list(SHARED))


def companion_imports(path: Path) -> set[str]:
    """The ``companion`` modules a file imports, as dotted names below ``companion``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "companion" and len(parts) > 1:
                found.add(".".join(parts[1:]))
    return found


def imports_the_book(path: Path) -> set[str]:
    return {name for name in companion_imports(path)
            if name == "book" or name.startswith("book.")}


def test_the_lists_cover_the_library():
    top = {p.stem for p in LIB.glob("*.py")} - {"__init__", "__main__"}
    assert top == set(SHARED), top ^ set(SHARED)
    packages = {p.name for p in LIB.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(SCIENCE_PACKAGES) | {"book"}, packages


@pytest.mark.parametrize("module", SCIENCE)
def test_science_module_imports_no_book_machinery(module):
    path = LIB / (module.replace(".", "/") + ".py")
    bad = imports_the_book(path)
    assert not bad, f"companion.{module} imports book machinery: {sorted(bad)}"


def test_the_checker_sees_lazy_imports(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("def f():\n    from companion.book.runner import Project\n"
                   "    import companion.book.pages\n    from companion.book import prose\n"
                   "    from companion.hasse import masks\n")
    assert imports_the_book(src) == {"book.runner", "book.runner.Project", "book.pages",
                                     "book", "book.prose"}
