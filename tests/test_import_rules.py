"""The science modules never import the book's machinery.

A reader who takes the code of a chapter (masks, reachability, context similarity, the
gradient flow, SBM attention, the LRA tasks) takes it without papermill, Sphinx or the
runner: those modules may import each other, torch, numpy and the shared argument checks,
but never the modules that execute chapters and write pages. Checked on the source
(every ``import``, at module level or inside a function), so a lazy import counts too.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

LIB = Path(__file__).resolve().parents[1] / "lib" / "companion"

#: The book's machinery: executing chapters, recording figures and claims, writing pages.
BOOK = {"runner", "pages", "htmlcheck", "cli", "provenance", "prose", "site", "interrupts",
        "claims_diff", "__main__"}

#: The science (and its data and scale-out helpers), importable without the book.
SCIENCE = sorted(
    str(p.relative_to(LIB).with_suffix("")).replace("/", ".")
    for p in LIB.rglob("*.py")
    if p.stem not in BOOK and p.stem != "__init__" or p.parent.name == "lra")


def companion_imports(path: Path) -> set[str]:
    """The ``companion`` submodules a file imports (first component after ``companion.``)."""
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
                found.add(parts[1])
    return found


def test_the_lists_cover_the_library():
    modules = {p.stem for p in LIB.glob("*.py")} - {"__init__"}
    assert BOOK <= modules, BOOK - modules
    assert {"masks", "reachability", "context_similarity", "gradient_flow", "sbm",
            "edge_attention", "corpora"} <= set(SCIENCE)


@pytest.mark.parametrize("module", SCIENCE)
def test_science_module_imports_no_book_machinery(module):
    path = LIB / (module.replace(".", "/") + ".py")
    bad = companion_imports(path) & BOOK
    assert not bad, f"companion.{module} imports book machinery: {sorted(bad)}"


def test_the_checker_sees_lazy_imports(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("def f():\n    from companion.runner import Project\n"
                   "    import companion.pages\n    from companion import prose\n")
    assert companion_imports(src) == {"runner", "pages", "prose"}
