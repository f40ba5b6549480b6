"""The book of every real chapter at smoke scale builds, and every page passes the browser
check.

The chapters' runs are those of the smoke book (``conftest.smoke_book``), which
tests/test_chapters_smoke.py and tests/test_smoke_book.py make: each chapter runs once
per pytest run. This file comes fifth in ``conftest.SLOW_FILES_FIRST``, so that with two
workers those runs are done when it starts; run alone, it runs them itself. It takes the
chapters in the reverse order, one that another run holds last
(:func:`conftest.run_smoke_free_first`), so that it does not wait on a chapter another
worker runs while a chapter is left to run.
"""
from __future__ import annotations

import pytest

from companion.book import runner
from companion.book.htmlcheck import check_book
from conftest import CHAPTERS, mathjax_available, require_browser, run_smoke_free_first


@pytest.mark.skipif(not mathjax_available(), reason="local MathJax missing: run make setup")
def test_smoke_book_builds_and_every_page_passes_browser_check(smoke_book):
    require_browser()
    run_smoke_free_first(smoke_book, list(reversed(CHAPTERS)))
    runner.build_html(smoke_book, echo=lambda _l: None)
    # every check at both widths; the screenshots are make check-html's (and
    # test_pages_and_book's), for a person to look at
    report = check_book(smoke_book, smoke_book.build_dir / "html", screenshots=False)
    assert report.ok, report.summary()
    assert all(not p.screenshots for p in report.pages)
    # the chapters, and intro, findings, figure index, report, references
    assert len(report.pages) == len(CHAPTERS) + 5
