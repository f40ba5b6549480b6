"""The browser check's cache of passing checks (companion.book.htmlcheck_cache).

The cache logic runs without a browser: ``check_book``'s browser part (``_open_pages``)
is replaced by a stand-in that reports what a real check would have read. One test opens
a small hand-written page in the real browser, once, to see that the check records
every file the page loads (style sheet, the image the style sheet names, an image) and
the file it links to.
"""
from __future__ import annotations

import json
import os
import struct
import time
import zlib
from pathlib import Path

import pytest

from companion.book import htmlcheck
from companion.book import htmlcheck_cache as hc
from companion.book.htmlcheck import PageResult, check_book
from conftest import require_browser

PAGES = ["index.html", "book/a.html", "book/b.html"]
# what each page "loads" (its HTML included) and links to, in the stand-in browser
LOADS = {"index.html": ["_static/s.css"],
         "book/a.html": ["_static/s.css", "_images/a.png"],
         "book/b.html": ["_static/s.css"]}
LINKS = {"index.html": [], "book/a.html": ["book/a.pdf"], "book/b.html": []}


def _build(tmp_path: Path) -> Path:
    html = tmp_path / "_build" / "html"
    for page in PAGES:
        (html / page).parent.mkdir(parents=True, exist_ok=True)
        (html / page).write_text(f"<html><body><p>{page}</p></body></html>")
    for rel, data in (("_static/s.css", "p {}"), ("_images/a.png", "png"),
                      ("book/a.pdf", "pdf")):
        (html / rel).parent.mkdir(parents=True, exist_ok=True)
        (html / rel).write_text(data)
    return _built_a_while_ago(html)


def _built_a_while_ago(html: Path) -> Path:
    """Files stamped a minute back: a check that starts now tells them from files written
    during it (it counts anything stamped less than CLOCK_MARGIN_S before its start)."""
    for path in html.rglob("*"):
        st = path.stat()
        os.utime(path, (st.st_atime - 60, st.st_mtime - 60))
    return html


class FakeBrowser:
    """Stands in for the browser: reports the reads of LOADS/LINKS, the problems of
    ``failing``, counts the pages it opened; ``interrupt`` raises a KeyboardInterrupt
    after the first page (Ctrl-C during the check)."""

    def __init__(self, monkeypatch, chromium="Chromium 1.0"):
        self.opened: list[list[str]] = []
        self.failing: dict[str, str] = {}
        self.interrupt = False
        self.rewrite: dict[str, str] = {}  # files of the build rewritten during the check
        self.stamped_behind = 0.0  # ... stamped this much before now (a coarse file clock)
        self.remove: list[str] = []  # files of the build removed during the check
        self.chromium = chromium
        monkeypatch.setattr(htmlcheck, "find_browser", lambda: ("chromium", "chromedriver"))
        monkeypatch.setattr(hc, "tool_versions", lambda b, d: {"chromium": self.chromium})
        monkeypatch.setattr(htmlcheck, "_open_pages", self.open_pages)

    def open_pages(self, browser, driver, build_dir, pages, reads, *, screenshots,
                   poll_seconds):
        self.opened.append(list(pages))
        for rel, text in self.rewrite.items():
            (build_dir / rel).write_text(text)
            if self.stamped_behind:
                stamp = time.time() - self.stamped_behind
                os.utime(build_dir / rel, (stamp, stamp))
        for rel in self.remove:
            (build_dir / rel).unlink()
        results = []
        for i, page in enumerate(pages):
            if self.interrupt and i == 1:
                raise KeyboardInterrupt
            reads[page] = hc.PageReads(loaded=set(LOADS.get(page, [])) | {page},
                                       linked=set(LINKS.get(page, [])))
            problems = [self.failing[page]] if page in self.failing else []
            res = PageResult(page, problems=problems, images=1, math=2)
            if screenshots:
                shot = build_dir.parent / "screenshots" / (page.replace("/", "__") + ".png")
                shot.parent.mkdir(parents=True, exist_ok=True)
                shot.write_bytes(b"png")
                res.screenshots = {1400: str(shot)}
            results.append(res)
        return results


def _check(html: Path, **kwargs):
    return check_book(None, html, pages=PAGES, screenshots=False,
                      cache=hc.cache_file(html), **kwargs)


def test_unchanged_pages_are_not_reopened(tmp_path, monkeypatch):
    html, fake = _build(tmp_path), FakeBrowser(monkeypatch)
    lines = []
    first = _check(html, echo=lines.append)
    assert first.ok and fake.opened == [PAGES]
    assert lines == ["check-html: opening 3 of 3 page(s) in the browser, 0 unchanged since "
                     "they passed"]
    assert "3 page(s) opened in the browser: no passing check recorded: index.html, " \
        "book/a.html, book/b.html" in first.summary()
    assert all(not p.unchanged_since for p in first.pages)
    stored = json.loads(hc.cache_file(html).read_text())
    assert set(stored["pages"]) == {f"html/{p}" for p in PAGES}

    lines.clear()
    second = _check(html, echo=lines.append)
    assert fake.opened == [PAGES], "nothing changed: no browser"
    assert second.ok and second.exit_code == 0
    assert [p.page for p in second.pages] == PAGES
    assert all(p.unchanged_since and (p.images, p.math) == (1, 2) for p in second.pages)
    assert lines == []
    summary = second.summary()
    assert "check-html: 3 page(s) unchanged since the passing check of " in summary
    assert "not re-opened" in summary and "3/3 pages ok" in summary


@pytest.mark.parametrize("change, reason", [
    (lambda h: (h / "book/a.html").write_text("<p>new</p>"), "its HTML changed"),
    (lambda h: (h / "_images/a.png").write_bytes(b"other png"), "_images/a.png"),
    (lambda h: (h / "book/a.pdf").unlink(), "appeared or vanished: ['book/a.pdf']"),
])
def test_a_changed_page_or_file_is_checked_again(tmp_path, monkeypatch, change, reason):
    html, fake = _build(tmp_path), FakeBrowser(monkeypatch)
    _check(html)
    change(html)
    report = _check(html)
    assert fake.opened == [PAGES, ["book/a.html"]], "only the page that read it"
    a = report.pages[1]
    assert a.page == "book/a.html" and not a.unchanged_since and reason in a.why_opened
    assert report.pages[0].unchanged_since and report.pages[2].unchanged_since


def test_the_css_every_page_loads_changed_checks_every_page(tmp_path, monkeypatch):
    html, fake = _build(tmp_path), FakeBrowser(monkeypatch)
    _check(html)
    (html / "_static/s.css").write_text("p { color: red }")
    _check(html)
    assert fake.opened == [PAGES, PAGES]


def test_another_checker_checks_every_page(tmp_path, monkeypatch):
    html, fake = _build(tmp_path), FakeBrowser(monkeypatch)
    _check(html)
    fake.chromium = "Chromium 2.0"  # another browser version
    report = _check(html)
    assert fake.opened == [PAGES, PAGES]
    assert "the checker changed" in report.pages[0].why_opened
    _check(html)
    assert len(fake.opened) == 2, "the new checker's passes were recorded"


def test_checker_fingerprint_reads_the_checks_code(tmp_path):
    code = tmp_path / "htmlcheck.py"
    code.write_text("WIDTHS = (1400, 400)\n")
    before = hc.checker_fingerprint({"chromium": "1"}, [code])
    code.write_text("WIDTHS = (1400, 360)\n")
    assert hc.checker_fingerprint({"chromium": "1"}, [code]) != before
    assert hc.checker_fingerprint({"chromium": "2"}, [code]) != hc.checker_fingerprint(
        {"chromium": "1"}, [code])


def test_the_font_stamp_sees_a_font_added_or_changed(tmp_path):
    fonts = tmp_path / "fonts"
    (fonts / "truetype").mkdir(parents=True)
    empty = hc.font_files_stamp([str(fonts), str(tmp_path / "none")])
    (fonts / "truetype" / "a.ttf").write_bytes(b"font")
    one = hc.font_files_stamp([str(fonts)])
    assert one != empty and one == hc.font_files_stamp([str(fonts)])
    (fonts / "truetype" / "a.ttf").write_bytes(b"another font")
    assert hc.font_files_stamp([str(fonts)]) != one


def test_a_failure_is_never_recorded(tmp_path, monkeypatch):
    html, fake = _build(tmp_path), FakeBrowser(monkeypatch)
    fake.failing = {"book/b.html": "images not loaded: ['x.png']"}
    report = _check(html)
    assert not report.ok and report.exit_code == 1
    stored = json.loads(hc.cache_file(html).read_text())["pages"]
    assert set(stored) == {"html/index.html", "html/book/a.html"}, "the passes only"
    # fails again although nothing changed: checked again, still not recorded
    report = _check(html)
    assert fake.opened[-1] == ["book/b.html"] and not report.ok
    # a page that passed, then failed under --force, is removed
    fake.failing = {"book/a.html": "console errors: ['boom']"}
    assert not _check(html, force=True).ok
    assert set(json.loads(hc.cache_file(html).read_text())["pages"]) == {
        "html/index.html", "html/book/b.html"}, "b passed this time, a failed"
    fake.failing = {}
    _check(html)
    assert fake.opened[-1] == ["book/a.html"]


@pytest.mark.parametrize("rel", ["book/a.html", "_images/a.png"])
def test_a_file_rewritten_during_the_check_is_not_recorded(tmp_path, monkeypatch, rel):
    html, fake = _build(tmp_path), FakeBrowser(monkeypatch)
    fake.rewrite = {rel: "rewritten while the browser had it open"}
    report = _check(html)
    assert report.ok and "book/a.html changed while it was checked" in report.summary()
    stored = json.loads(hc.cache_file(html).read_text())["pages"]
    assert set(stored) == {"html/index.html", "html/book/b.html"}


def test_a_rewrite_stamped_by_a_coarse_file_clock_is_not_recorded(tmp_path, monkeypatch):
    """Linux before 6.13 stamps a file up to a timer tick behind time.time(): a rewrite
    just after the check started may carry an mtime a few ms before that start."""
    html, fake = _build(tmp_path), FakeBrowser(monkeypatch)
    fake.rewrite, fake.stamped_behind = {"_images/a.png": "rewritten"}, 0.02
    report = _check(html)
    assert report.ok and "book/a.html changed while it was checked" in report.summary()
    assert "html/book/a.html" not in json.loads(hc.cache_file(html).read_text())["pages"]


def test_a_linked_file_removed_during_the_check_is_not_recorded(tmp_path, monkeypatch):
    """The check saw the link's target; a key with it "missing" would later pass the page
    unopened with a broken link."""
    html, fake = _build(tmp_path), FakeBrowser(monkeypatch)
    fake.remove = ["book/a.pdf"]
    report = _check(html)
    assert report.ok and "book/a.html: ['book/a.pdf'] not there now" in report.summary()
    stored = json.loads(hc.cache_file(html).read_text())["pages"]
    assert set(stored) == {"html/index.html", "html/book/b.html"}
    fake.remove = []
    _check(html)
    assert fake.opened[-1] == ["book/a.html"], "opened again, where its broken link shows"


def test_an_interrupted_check_records_nothing(tmp_path, monkeypatch):
    html, fake = _build(tmp_path), FakeBrowser(monkeypatch)
    fake.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        _check(html)
    assert not hc.cache_file(html).exists()
    assert list(hc.cache_file(html).parent.glob("*.tmp")) == []


def test_force_opens_every_page_and_records_them(tmp_path, monkeypatch):
    html, fake = _build(tmp_path), FakeBrowser(monkeypatch)
    _check(html)
    before = json.loads(hc.cache_file(html).read_text())["pages"]["html/index.html"]
    report = _check(html, force=True)
    assert fake.opened == [PAGES, PAGES]
    assert all(p.why_opened == "--force" for p in report.pages)
    assert json.loads(hc.cache_file(html).read_text())["pages"]["html/index.html"][
        "key"] == before["key"]


@pytest.mark.parametrize("content", ["{not json", '{"format": 1, "pages": []}',
                                     '{"format": 999, "pages": {}}',
                                     '{"format": 1, "pages": {"html/index.html": {"k": 1}}}'])
def test_a_corrupt_cache_file_is_ignored_with_a_message(tmp_path, monkeypatch, content):
    html, fake = _build(tmp_path), FakeBrowser(monkeypatch)
    hc.cache_file(html).write_text(content)
    report = _check(html)
    assert fake.opened == [PAGES] and report.ok
    assert "check-html: ignoring the cache of passing checks" in report.summary()
    assert "every page is checked in the browser" in report.summary()
    _check(html)  # the file was replaced by a good one
    assert fake.opened == [PAGES]


def test_screenshots_missing_since_the_pass_reopen_the_page(tmp_path, monkeypatch):
    html, fake = _build(tmp_path), FakeBrowser(monkeypatch)
    _check(html)  # recorded without screenshots
    report = check_book(None, html, pages=PAGES, cache=hc.cache_file(html))
    assert fake.opened == [PAGES, PAGES]
    assert "screenshots are missing" in report.pages[0].why_opened


def test_cli_check_html_uses_the_cache_and_force(demo_project, monkeypatch, capsys):
    from companion.book.cli import main

    fake = FakeBrowser(monkeypatch)
    html = demo_project.build_dir / "html"
    pages = htmlcheck.toc_pages(demo_project)
    for page in pages + ["index.html"]:
        (html / page).parent.mkdir(parents=True, exist_ok=True)
        (html / page).write_text(f"<p>{page}</p>")
    _built_a_while_ago(html)
    root = ["--root", str(demo_project.root)]
    assert main(["check-html", *root]) == 0
    assert main(["check-html", *root]) == 0
    assert fake.opened == [pages], "the second check opened nothing"
    out = capsys.readouterr().out
    assert f"check-html: {len(pages)} page(s) unchanged since the passing check" in out
    assert (demo_project.build_dir / hc.CACHE_NAME).exists()
    shot = Path(json.loads((demo_project.build_dir / hc.CACHE_NAME).read_text())["pages"][
        f"html/{pages[0]}"]["screenshots"]["1400"][0])
    shot.unlink()  # a screenshot gone: that page is opened again
    assert main(["check-html", *root]) == 0
    assert fake.opened[-1] == [pages[0]]
    assert main(["check-html", *root, "--force"]) == 0
    assert fake.opened[-1] == pages and "--force: " in capsys.readouterr().out


def _png(width: int, height: int) -> bytes:
    """A valid RGB PNG of one grey."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    rows = b"".join(b"\0" + b"\x80" * 3 * width for _ in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8,
                                                              2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def test_the_browser_check_records_every_file_a_page_loads_and_links(tmp_path):
    require_browser()
    html = tmp_path / "_build" / "html"
    (html / "s").mkdir(parents=True)
    (html / "index.html").write_text("<html><body><p>root</p></body></html>")
    (html / "s" / "style.css").write_text("body { background: url(bg.png) }")
    (html / "s" / "bg.png").write_bytes(_png(2, 2))
    (html / "a.png").write_bytes(_png(3, 2))
    (html / "doc.pdf").write_text("%PDF")
    (html / "page.html").write_text(
        '<html><head><link rel="stylesheet" href="s/style.css"><link rel="icon" '
        'href="data:,"></head><body><p>One page.</p><img src="a.png" alt="a"><a '
        'href="doc.pdf">doc</a></body></html>')
    _built_a_while_ago(html)
    report = check_book(None, html, pages=["page.html"], screenshots=False,
                        cache=hc.cache_file(html))
    assert report.ok, report.summary()
    entry = json.loads(hc.cache_file(html).read_text())["pages"]["html/page.html"]
    assert set(entry["reads"]["loaded"]) >= {"page.html", "s/style.css", "s/bg.png", "a.png"}
    assert entry["reads"]["linked"] == {"doc.pdf": "file"}
    # the image the style sheet names changed: the page is no longer unchanged
    store, note = hc.CheckCache.load(hc.cache_file(html), html, entry["checker"])
    assert note == "" and store.lookup("page.html", hc.FileStates(html))[0] is not None
    (html / "s" / "bg.png").write_bytes(_png(2, 3))
    found, why = store.lookup("page.html", hc.FileStates(html))
    assert found is None and "s/bg.png" in why
