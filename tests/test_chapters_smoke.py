"""Every real chapter executes at smoke scale, and the book they make passes the browser check.

This is the end-to-end test of the book: the chapters of ``chapters/`` are run by the
runner into a throw-away copy of the project, then the HTML book is built with warnings
as errors and every page is opened in headless Chromium.
"""
from __future__ import annotations

import pytest

from companion import runner
from companion.htmlcheck import check_book
from conftest import REPO, make_project, mathjax_available, require_browser

CHAPTERS = sorted(p.stem for p in (REPO / "chapters").glob("*.md"))
RESULTS: dict[str, runner.RunResult] = {}


def test_every_toc_chapter_has_a_source():
    toc = runner.Project(REPO).toc_chapters()
    assert toc, "the table of contents lists chapters"
    missing = [n for n in toc if n not in CHAPTERS]
    assert not missing, f"chapters listed in _toc.yml without chapters/<name>.md: {missing}"


@pytest.fixture(scope="module")
def smoke_project(tmp_path_factory):
    root = make_project(tmp_path_factory.mktemp("smoke") / "book",
                        {name: REPO / "chapters" / f"{name}.md" for name in CHAPTERS})
    return runner.Project(root)


# figures the prose of a chapter refers to by number, checked at smoke scale too
EXPECTED_FIGURES = {
    "gradient_flow": {"gradient-flow-snapshots", "gradient-flow-slope-vs-heads",
                      "gradient-flow-energy-balance", "gradient-flow-residual-dt",
                      "gradient-flow-sign", "gradient-flow-stability"},
}


@pytest.mark.parametrize("name", CHAPTERS)
def test_chapter_executes_at_smoke_scale(smoke_project, name):
    lines: list[str] = []
    result = runner.run_chapter(smoke_project, name, scale="smoke", device="cpu",
                                echo=lines.append)
    RESULTS[name] = result
    assert result.status == "ok", f"{name}: {result.error}\n" + "\n".join(lines)
    assets = smoke_project.assets(name)
    figures = {p.stem for p in (assets / "figures").glob("*.png")}
    assert figures, f"{name} saved no figure"
    missing = EXPECTED_FIGURES.get(name, set()) - figures
    assert not missing, f"{name} did not save {sorted(missing)}"
    assert list((assets / "claims").glob("*.json")), f"{name} recorded no claim"


@pytest.mark.skipif(not mathjax_available(), reason="local MathJax missing: run make setup")
def test_smoke_book_builds_and_every_page_passes_browser_check(smoke_project):
    require_browser()
    for name in CHAPTERS:
        if name not in RESULTS:  # run alone (-k): execute what is missing
            RESULTS[name] = runner.run_chapter(smoke_project, name, scale="smoke",
                                               device="cpu", echo=lambda _l: None)
    runner.build_html(smoke_project, echo=lambda _l: None)
    report = check_book(smoke_project, smoke_project.build_dir / "html")
    assert report.ok, report.summary()
    assert len(report.pages) == len(CHAPTERS) + 4
