"""Every real chapter executes at smoke scale.

This is the end-to-end test of the chapters: the chapters of ``chapters/`` are run by the
runner into the smoke book, a throw-away copy of the project shared by the test processes
(``conftest.smoke_book``: each chapter runs once per pytest run;
tests/test_smoke_book_pages.py builds and checks the HTML book from the same runs, and
tests/test_smoke_book.py runs one chapter a second time, into a second project with the
same seed: the same bytes).

The chapters run in name order except the one run twice (``conftest.REPEATED_CHAPTER``),
which comes last: with two workers, the other worker starts test_smoke_book.py at the same
time and runs that chapter twice meanwhile, so that this file finds it done instead of
waiting for it (about 14 s here when it came second).
"""
from __future__ import annotations

import pytest

from companion.book import runner
from conftest import CHAPTERS, REPEATED_CHAPTER, REPO, run_smoke


def test_every_toc_chapter_has_a_source():
    toc = runner.Project(REPO).toc_chapters()
    assert toc, "the table of contents lists chapters"
    missing = [n for n in toc if n not in CHAPTERS]
    assert not missing, f"chapters listed in _toc.yml without chapters/<name>.md: {missing}"


# figures the prose of a chapter refers to by number, checked at smoke scale too
EXPECTED_FIGURES = {
    "gradient_flow": {"gradient-flow-snapshots", "gradient-flow-slope-vs-heads",
                      "gradient-flow-energy-balance", "gradient-flow-residual-dt",
                      "gradient-flow-sign", "gradient-flow-stability"},
}


# the chapter run twice last (module docstring)
SMOKE_ORDER = sorted(CHAPTERS, key=lambda name: name == REPEATED_CHAPTER)


@pytest.mark.parametrize("name", SMOKE_ORDER)
def test_chapter_executes_at_smoke_scale(smoke_book, name):
    run_smoke(smoke_book, name)
    assets = smoke_book.assets(name)
    figures = {p.stem for p in (assets / "figures").glob("*.png")}
    assert figures, f"{name} saved no figure"
    missing = EXPECTED_FIGURES.get(name, set()) - figures
    assert not missing, f"{name} did not save {sorted(missing)}"
    assert list((assets / "claims").glob("*.json")), f"{name} recorded no claim"
