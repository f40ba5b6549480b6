"""The book of every real chapter at smoke scale builds, and every page passes the browser
check.

The chapters run into the smoke book (``conftest.smoke_book``), the project that
tests/test_chapters_smoke.py runs them into: each chapter runs once per pytest run. This
test asks for them in the reverse order, so that with two workers both run chapters until
they meet (a chapter another worker is running is waited for, then taken from the cache).
"""
from __future__ import annotations

import pytest

from companion.book import runner
from companion.book.htmlcheck import check_book
from conftest import CHAPTERS, mathjax_available, require_browser, run_smoke


@pytest.mark.skipif(not mathjax_available(), reason="local MathJax missing: run make setup")
def test_smoke_book_builds_and_every_page_passes_browser_check(smoke_book):
    require_browser()
    for name in reversed(CHAPTERS):
        run_smoke(smoke_book, name)
    runner.build_html(smoke_book, echo=lambda _l: None)
    # every check at both widths; the screenshots are make check-html's (and
    # test_pages_and_book's), for a person to look at
    report = check_book(smoke_book, smoke_book.build_dir / "html", screenshots=False)
    assert report.ok, report.summary()
    assert all(not p.screenshots for p in report.pages)
    assert len(report.pages) == len(CHAPTERS) + 4
