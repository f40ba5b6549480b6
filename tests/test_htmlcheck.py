"""The browser check's HTML rules on small hand-written pages (fast, no browser).

The browser applies the same functions to each rendered page (``page_source``); only the
sideways-scroll measurement needs a layout engine (tests/test_pages_and_book.py).
"""
from __future__ import annotations

import importlib.util

import pytest

from companion.book import citations
from companion.book.htmlcheck import (cite_line_problems, cite_lines, is_chapter_page, local_paths,
                                 numbered_items, page_problems, parameters_cell_problems,
                                 sideways_problem)
from conftest import REPO


def _figure(item_id: str, number: str = "Fig. 1.1") -> str:
    return (f'<figure class="align-default" id="{item_id}"><img src="x.png"><figcaption><p>'
            f'<span class="caption-number">{number} </span><span class="caption-text">C.'
            "</span></p></figcaption></figure>")


def _table(item_id: str) -> str:
    return (f'<div class="pst-scrollable-table-container"><table class="table" id="{item_id}">'
            '<caption><span class="caption-number">Table 1.1 </span></caption><tr><td>1</td>'
            "</tr></table></div>")


def _line(item_id: str, kind: str = "figure", base: str = "../assets/demo/figures") -> str:
    files = {"figure": ("png", "svg", "pdf"), "table": ("csv", "md")}[kind]
    item = {"id": item_id, "type": kind, "files": {f: {} for f in files}}
    return citations.cite_line(item, base, "@misc{x,\n  title = {T}\n}")


def _cell(tag: str) -> str:
    return (f'<div class="cell tag_{tag} docutils container"><div class="cell_input">'
            "<pre>seed = 0</pre></div></div>")


def test_numbered_items_are_figures_and_tables_with_a_caption_number():
    page = (_figure("demo-a") + _table("demo-t")
            + '<figure id="logo"><img src="l.png"></figure>'  # no number: not an item
            + '<table class="table"><tr><td>run box</td></tr></table>')
    assert numbered_items(page) == ["demo-a", "demo-t"]
    assert numbered_items("") == []


def test_every_item_needs_its_cite_line_with_all_links():
    fig, tab = _figure("demo-a"), _table("demo-t")
    assert cite_line_problems(fig + _line("demo-a") + tab + _line("demo-t", "table")) == []
    assert cite_line_problems(fig + tab) == ["figure demo-a has no Cite line",
                                             "table demo-t has no Cite line"]
    # A line for another id does not count.
    assert cite_line_problems(fig + _line("demo-b")) == ["figure demo-a has no Cite line"]
    # A line without its SVG link, and a table line without its CSV.
    no_svg = _line("demo-a").replace('<a href="../assets/demo/figures/demo-a.svg">SVG</a>', "")
    assert cite_line_problems(fig + no_svg) == [
        "the Cite line of figure demo-a has no SVG link (.svg)"]
    no_csv = _line("demo-t", "table").replace(".csv", ".txt")
    assert cite_line_problems(tab + no_csv) == [
        "the Cite line of table demo-t has no CSV link (.csv)"]
    assert cite_line_problems("<p>no items</p>") == []


def test_cite_links_must_resolve_in_the_build(tmp_path):
    page = "book/_generated/chapters/demo.html"
    html = _figure("demo-a") + _line("demo-a")
    folder = tmp_path / "book" / "_generated" / "assets" / "demo" / "figures"
    folder.mkdir(parents=True)
    for ext in ("png", "svg", "pdf", "json"):
        (folder / f"demo-a.{ext}").write_text("x")
    problems = cite_line_problems(html, page, tmp_path)
    assert problems == ["the Cite line of figure demo-a links to files missing from the "
                        "build: ['../assets/demo/figures/demo-a.bib']"]
    (folder / "demo-a.bib").write_text("@misc{x}")
    assert cite_line_problems(html, page, tmp_path) == []
    # A link that climbs out of the build is missing, whatever lies there.
    outside = _figure("demo-a") + _line("demo-a", base="../../../../outside")
    assert "missing from the build" in cite_line_problems(outside, page, tmp_path)[0]


def test_cite_lines_maps_ids_to_their_links():
    links = cite_lines(_line("demo-t", "table", base="t"))
    assert links == {"demo-t": ["t/demo-t.csv", "t/demo-t.md", "t/demo-t.json", "t/demo-t.bib"]}


@pytest.mark.parametrize("cells, problems", [
    (["parameters"], []),
    (["injected-parameters"], []),
    (["parameters", "injected-parameters"], ["2 parameters cells shown (expected exactly one)"]),
    ([], ["0 parameters cells shown (expected exactly one)"]),
    (["hide-input"], ["0 parameters cells shown (expected exactly one)"]),
])
def test_exactly_one_parameters_cell(cells, problems):
    assert parameters_cell_problems("".join(_cell(c) for c in cells)) == problems


@pytest.mark.parametrize("snippet, found", [
    ("<pre>FileNotFoundError: /work/main/benchmarks/results/sbm.json not found</pre>",
     ["/work/main/benchmarks/results/sbm.json"]),
    ("<p>(/tmp/pytest-of-root/x.png)</p>", ["/tmp/pytest-of-root/x.png"]),
    ("<code>/home/alice/book</code> and <code>/Users/bob/book</code>",
     ["/home/alice/book", "/Users/bob/book"]),
    ("<p>C:\\Users\\carol\\book</p>", ["C:\\Users\\carol\\book"]),
    ('<img src="/root/figs/a.png">', ["/root/figs/a.png"]),
    ('<a href="file:///srv/x.html">x</a>', ["file:///srv/x.html"]),
    # Not local paths: web addresses, relative links, a bare folder name in prose.
    ('<a href="https://github.com/home/work/tmp">web</a> https://example.org/tmp/x', []),
    ('<img src="../../_images/a.png"><a href="../assets/demo/x.pdf">x</a>', []),
    ("<p>temporary files go to /tmp, homes under /home</p>", []),
    ("<p>a ratio 3/home/x is not a path</p>", []),
    ("<script>const p = '/home/x/y';</script>", []),
])
def test_local_paths(snippet, found):
    assert local_paths(f"<html><body>{snippet}</body></html>") == found


def test_page_problems_apply_the_chapter_rules_to_chapter_pages_only():
    page = _figure("demo-a") + "<p>/work/main/x.json</p>"
    assert is_chapter_page("book/_generated/chapters/demo.html")
    assert not is_chapter_page("book/_generated/figure_index.html")
    chapter = page_problems(page, "book/_generated/chapters/demo.html", chapter_page=True)
    assert chapter == ["local absolute paths in the page: ['/work/main/x.json']",
                       "figure demo-a has no Cite line",
                       "0 parameters cells shown (expected exactly one)"]
    other = page_problems(page, "book/intro.html", chapter_page=False)
    assert other == ["local absolute paths in the page: ['/work/main/x.json']"]


def test_sideways_problem_reports_width_and_culprits():
    assert sideways_problem({"scrollWidth": 1400, "innerWidth": 1400, "offenders": []},
                            1400) == ""
    problem = sideways_problem({"scrollWidth": 731, "innerWidth": 400,
                                "offenders": ["table.figure-index (right edge 731 px)"]}, 400)
    assert problem.startswith("scrolls sideways at 400 px (content 731 px wide)")
    assert "table.figure-index" in problem


def _book_assets():
    spec = importlib.util.spec_from_file_location("book_assets",
                                                  REPO / "book" / "_ext" / "book_assets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_book_assets_copies_item_files_to_the_same_place_in_the_build(tmp_path):
    assets = _book_assets()
    src, out = tmp_path / "src", tmp_path / "out"
    figures = src / "book" / "_generated" / "assets" / "demo" / "figures"
    tables = src / "book" / "_generated" / "assets" / "demo" / "tables"
    figures.mkdir(parents=True)
    tables.mkdir(parents=True)
    for name in ("demo-a.png", "demo-a.svg", "demo-a.pdf", "demo-a.json", "demo-a.bib",
                 ".demo-a.png.x.tmp", "notes.txt"):
        (figures / name).write_text(name)
    (tables / "demo-t.csv").write_text("a\n1\n")
    (src / "book" / "_generated" / "assets" / "demo" / "claims").mkdir()
    assert assets.copy_item_files(src, out) == 6
    copied = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert copied == [f"book/_generated/assets/demo/figures/demo-a.{e}"
                      for e in ("bib", "json", "pdf", "png", "svg")] + [
                          "book/_generated/assets/demo/tables/demo-t.csv"]
    assert (out / "book/_generated/assets/demo/figures/demo-a.bib").read_text() == "demo-a.bib"
    assert assets.copy_item_files(src, out) == 0, "unchanged files are not copied again"
    assert assets.copy_item_files(tmp_path / "nothing", out) == 0


def test_broken_links_are_relative_links_without_a_file_in_the_build(tmp_path):
    from companion.book.htmlcheck import broken_links

    page = "book/_generated/figure_index.html"
    (tmp_path / "book" / "_generated" / "assets").mkdir(parents=True)
    (tmp_path / "book" / "_generated" / "assets" / "a.png").write_text("x")
    (tmp_path / "_images").mkdir()
    (tmp_path / "_images" / "b.png").write_text("x")
    html = ('<img src="../../_images/b.png"><a href="assets/a.png">ok</a>'
            '<a href="assets/a.png#frag">ok</a><a href="assets/missing.pdf">no</a>'
            '<img src="../../_images/gone.png"><a href="../../../outside.html">out</a>'
            '<a href="https://github.com/o/r">web</a><a href="#here">anchor</a>'
            '<img src="data:image/png;base64,AAAA">')
    assert broken_links(html, page, tmp_path) == [
        "assets/missing.pdf", "../../_images/gone.png", "../../../outside.html"]
    problems = page_problems(html, page, tmp_path)
    assert problems == ["links to files missing from the build: ['assets/missing.pdf', "
                        "'../../_images/gone.png', '../../../outside.html']"]


@pytest.mark.parametrize("poll", [0, -0.1, float("nan"), "0.1"])
def test_check_book_bad_poll_seconds_names_the_parameter(poll, tmp_path):
    from companion.book.htmlcheck import check_book

    with pytest.raises((ValueError, TypeError), match="poll_seconds"):
        check_book(None, tmp_path, poll_seconds=poll)


def test_a_page_is_parsed_once_for_all_its_checks(tmp_path, monkeypatch):
    """page_problems and linked_files share one parse of a page (the tree is read only):
    the same answers as parsing afresh for every check, with one parse instead of six."""
    from companion.book import htmlcheck, htmlpage

    page = ("<p>see /home/someone/x.json</p>" + _figure("fig-a") + _table("tab-b")
            + '<details class="cite-line" data-cite-for="fig-a"><summary><a href="a.png">'
            "PNG</a></summary></details>"
            + '<div class="cell tag_parameters"><pre>n = 1</pre></div><a href="gone.pdf">x</a>')
    htmlpage.page_tree.cache_clear()
    feeds = []
    real_feed = htmlpage.PageTree.feed
    monkeypatch.setattr(htmlpage.PageTree, "feed",
                        lambda self, data: (feeds.append(len(data)), real_feed(self, data))[1])
    shared = (page_problems(page, "book/p.html", tmp_path, chapter_page=True),
              htmlcheck.linked_files(page, "book/p.html"))
    assert len(feeds) == 1
    afresh = []
    for _ in range(2):  # a new parse for every call: the uncached function
        htmlpage.page_tree.cache_clear()
        afresh.append(page_problems(page, "book/p.html", tmp_path, chapter_page=True))
        htmlpage.page_tree.cache_clear()
        afresh.append(htmlcheck.linked_files(page, "book/p.html"))
    assert shared == tuple(afresh[:2]) and afresh[:2] == afresh[2:]
    assert any("local absolute paths" in p for p in shared[0])
    assert any("table tab-b has no Cite line" in p for p in shared[0])
    assert "book/gone.pdf" in shared[1]
