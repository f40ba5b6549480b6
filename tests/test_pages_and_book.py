"""Generated pages, environment pins, and the built book checked in headless Chromium."""
from __future__ import annotations

import hashlib
import html
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from companion.book import pages
from companion.book import citations
from companion.book import runner
from companion.book import site
from companion.book.htmlcheck import check_book
from conftest import REPO, mathjax_available, require_browser


def _quiet(_line: str) -> None:
    pass


def test_environment_yml_pins_equal_pyproject():
    py = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = set(py["dependencies"])
    for name, extra in py["optional-dependencies"].items():
        if name != "all":
            pins |= set(extra)
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    env_pins = {p for p in pip if not p.startswith("-")}  # options: -e, --extra-index-url
    assert pins == env_pins
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][A-Za-z0-9_.+]*", p) for p in pins), (
        "every dependency is pinned exactly")
    assert "python=3.11" in env["dependencies"]


def test_generated_pages_list_figures_and_claims(ran_demo_project):
    p = ran_demo_project  # a copy of this pytest run's one good demo run at smoke scale
    index = pages.figure_index(p)
    # The chapter's heading gives the scale it ran at, and how to run it at the paper's.
    head, table = index.split("## 1. Demo chapter \u00b7 scale `smoke`")
    assert "1 figure(s) in 1 chapter(s)." in head
    assert "`python -m companion run demo --scale paper`" in table
    # A compact table: a 120 px thumbnail, the number (a link), the id, the Cite line.
    assert ":class: figure-index" in table and ":width: 120px" in table
    assert "{numref}`demo-random-walk` \u00b7 `demo-random-walk`" in table
    assert "320px" not in index and "```bibtex" not in index, "no unfolded BibTeX"
    for ext in ("png", "svg", "pdf", "json", "bib"):
        assert f'href="assets/demo/figures/demo-random-walk.{ext}"' in table, ext
    # The folded entry is the one written beside the figure (one function builds both).
    folder = p.assets("demo") / "figures"
    side = json.loads((folder / "demo-random-walk.json").read_text())
    written = (folder / "demo-random-walk.bib").read_text()
    assert written == citations.bibtex_entry(side) + "\n"
    assert html.escape(written.strip()).replace("\n", "\n    ") in table, (
        "the entry, indented in its table cell")
    assert side["files"]["bib"]["sha256"] == hashlib.sha256(written.encode()).hexdigest()
    report = pages.reproduction_report(p)
    # Counts: paper claims (differs, inconclusive, reproduced, not comparable), then checks
    # (fails, inconclusive, holds), never added together.
    assert ("| Demo chapter (smoke) | **2** {bdg-success}`1 reproduced` {bdg-muted}`1 not "
            "comparable` | **1** {bdg-success-line}`1 holds` |") in report
    assert "### Demo chapter \u00b7 scale `smoke`" in report
    assert "````{container} report-summary\n| Chapter (scale of its run) |" in report
    assert ("In all: 2 paper claims (1 reproduced, 1 not comparable); and 1 check "
            "(1 holds), not counted as reproductions.") in report
    paper_part, check_part = report.split("## Paper claims")[1].split("## Checks")
    # A paper claim: coloured verdict, link to its box, statement, the paper's place, the
    # threshold in one cell, the measured value with its interval, a link to its evidence.
    row = next(r for r in paper_part.splitlines() if "demo-mean-small <" in r)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:4] == ["{bdg-success}`reproduced`", "{ref}`demo-mean-small <demo-mean-small>`",
                         "The sample mean is within 1 of zero. (Sec. 1)", "0 \u00b1 1"]
    assert re.fullmatch(r"\u2212?[0-9.]+ \[\u2212?[0-9.]+, \u2212?[0-9.]+\]", cells[4]), cells[4]
    assert cells[5] == "{numref}`demo-summary`"
    assert ("{bdg-muted}`not comparable` | {ref}`demo-not-available <demo-not-available>`"
            in paper_part)
    assert paper_part.index("demo-mean-small <") < paper_part.index("demo-not-available <")
    assert "demo-drew-n-values" not in paper_part, "a check is not listed with the paper claims"
    assert ("| {bdg-success-line}`holds` | {ref}`demo-drew-n-values <demo-drew-n-values>` | "
            "The chapter drew n values. (this chapter) | holds | holds |") in check_part
    assert "| Tolerance |" not in report and "|  |" not in report, "no empty column"


def _write_claim(project, record: dict) -> None:
    folder = project.assets("demo") / "claims"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{record['id']}.json").write_text(json.dumps(record))


def test_report_leads_with_differs_and_inconclusive_and_tables_checks_apart(demo_project):
    base = {"reference": "Fig. 2", "statement": "S.", "tolerance": None, "interval": None,
            "evidence": [], "role": "paper"}
    records = [  # written oldest first in this order
        {**base, "id": "demo-a", "kind": "abs", "paper": -1.0, "tolerance": 0.5,
         "measured": -0.9, "interval": [-1.2, -0.7], "verdict": "reproduced"},
        {**base, "id": "demo-b", "kind": "range", "paper": [0.2, 0.4], "measured": 0.5,
         "verdict": "differs", "evidence": ["demo-fig", "demo-tab"]},
        {**base, "id": "demo-c", "kind": "at_least", "paper": 0.342, "measured": 0.36,
         "interval": [0.33, 0.39], "verdict": "inconclusive"},
        {**base, "id": "demo-d", "kind": "at_most", "paper": 1.0, "tolerance": 0.25,
         "measured": 2.0, "verdict": "fails", "role": "check", "reference": "this chapter"},
        {**base, "id": "demo-e", "kind": "holds", "paper": "qualitative", "measured": True,
         "verdict": "holds", "role": "check"},
        {**base, "id": "demo-f", "kind": "rel", "paper": 2.0, "tolerance": 0.1,
         "measured": 2.1, "verdict": "reproduced"},
    ]
    for i, r in enumerate(records):
        _write_claim(demo_project, {**r, "created": f"2026-01-01T00:00:0{i}"})
    report = pages.reproduction_report(demo_project)
    assert ("| Demo chapter (unknown, **STALE**) | **4** {bdg-danger}`1 differs` "
            "{bdg-warning}`1 inconclusive` {bdg-success}`2 reproduced` | **2** "
            "{bdg-danger-line}`1 fails` {bdg-success-line}`1 holds` |") in report
    paper_part, check_part = report.split("## Paper claims")[1].split("## Checks")
    order = [m for m in re.findall(r"\{ref\}`(demo-[a-f]) <", paper_part)]
    assert order == ["demo-b", "demo-c", "demo-a", "demo-f"], "differs, inconclusive first"
    assert re.findall(r"\{ref\}`(demo-[a-f]) <", check_part) == ["demo-d", "demo-e"]
    lines = {f"demo-{k}": next(r for r in report.splitlines() if f"`demo-{k} <" in r)
             for k in "abcdef"}
    assert "| \u22121 \u00b1 0.5 | \u22120.9 [\u22121.2, \u22120.7] |" in lines["demo-a"]
    assert "| in [0.2, 0.4] | 0.5 | {numref}`demo-fig` {numref}`demo-tab` |" in lines["demo-b"]
    assert lines["demo-b"].startswith("| {bdg-danger}`differs` |")
    assert "| \u2265 0.342 | 0.36 [0.33, 0.39] |" in lines["demo-c"]
    assert lines["demo-c"].startswith("| {bdg-warning}`inconclusive` |")
    assert "| \u2264 1 + 0.25 | 2 |" in lines["demo-d"]
    assert lines["demo-d"].startswith("| {bdg-danger-line}`fails` |"), "checks: outlined badges"
    assert "| 2 \u00b1 10 % | 2.1 |" in lines["demo-f"]
    assert "The last run of this chapter failed or never happened" in paper_part


@pytest.mark.parametrize("snippet, found", [
    # What MyST made of a $$ block glued to its paragraph (Definition 2.1 before the fix).
    ('<p>outputs, for every token <span class="math notranslate nohighlight">\\(i\\)</span>,'
     '\n$<span class="math notranslate nohighlight">\\(z^{lh}_i\\)</span>'
     '<span class="math notranslate nohighlight">\\(the slice\\)</span>W_O$.</p>', "$W_O$"),
    ("<p>with noise $dW = \\sqrt{dt}$ here</p>", "$dW = \\sqrt{dt}$"),
    ("<p>the gradient \\frac12 of x</p>", "\\frac"),
    ("<p>the entries x_{ij} of it</p>", "x_{"),
    ("<div><p>a</p>$$</div>", "$$"),
    # Not raw LaTeX: rendered or unrendered maths, code, prices, text outside the article.
    ('<p>maths <span class="math notranslate nohighlight">\\(\\sqrt{x}\\)</span> ok</p>', None),
    ("<p>rendered <mjx-container><mjx-math>x</mjx-math><mjx-assistive-mml><math><mi>x</mi>"
     "</math></mjx-assistive-mml></mjx-container>, then $5.</p>", None),
    ("<p>run <code>echo $HOME \\sqrt $x$</code></p><pre>a_{i} = $b$\n\\frac</pre>", None),
    ('<div class="highlight"><span>$x$</span></div><div class="cell_input">\\alpha</div>', None),
    ("<p>It costs $5 or $10, US$3, and 5$; prices.</p>", None),
    ("<p>costs $x</p><p>y$ in another paragraph</p>", None),
    ("<nav>$x$ in the sidebar</nav><article><p>clean</p></article>", None),
])
def test_raw_latex_detector_on_snippets(snippet, found):
    from companion.book.htmlcheck import raw_latex_in_html

    hits = raw_latex_in_html(f"<html><body>{snippet}</body></html>")
    if found is None:
        assert hits == [], hits
    else:
        assert hits and hits[0].startswith(found), hits


SIDECAR = {"id": "demo-x", "type": "figure", "chapter": "demo",
           "git_commit": "0123456789abcdef0123456789abcdef01234567", "git_dirty": False,
           "created": "2026-11-29T00:00:00+00:00", "scale": "ci", "device": "cpu", "seed": 0,
           "caption": "A caption.", "files": {"png": {}, "svg": {}, "pdf": {}}}


def _parse_bibtex(entry: str):
    """The entry as an independent BibTeX parser (pybtex) reads it."""
    from pybtex.database import parse_string

    (key, parsed), = parse_string(entry, "bibtex").entries.items()
    return key, parsed


def test_bibtex_entry_names_commit_and_figure():
    meta = {"title": "Attention, Reproduced", "version": "0.1.0",
            "authors": [{"name": "Attention, Reproduced contributors"},
                        {"family-names": "Doe", "given-names": "Jane"}]}
    entry = pages.bibtex_for_figure(meta, SIDECAR, "https://github.com/o/r")
    key, parsed = _parse_bibtex(entry)
    assert key == "attnrepro-demo-x" and parsed.type == "misc"
    # The corporate author is one name, not surname "Attention" (the bug it fixes).
    corporate, person = parsed.persons["author"]
    assert corporate.last_names == ["{Attention, Reproduced contributors}"]
    assert corporate.first_names == []
    assert (person.last_names, person.first_names) == (["Doe"], ["Jane"])
    assert parsed.fields["url"] == site.tree_url("https://github.com/o/r", SIDECAR["git_commit"])
    assert parsed.fields["year"] == "2026"
    assert "Commit 0123456789ab" in parsed.fields["note"]
    assert parsed.fields["title"] == "{Attention, Reproduced}: figure \\texttt{demo-x}"


def test_bibtex_entry_of_the_repository_and_of_a_table():
    """Default metadata: the repository's CITATION.cff and _config.yml address."""
    table = {**SIDECAR, "id": "demo-t", "type": "table", "git_commit": "unknown"}
    _, parsed = _parse_bibtex(citations.bibtex_entry(table))
    assert parsed.fields["title"].endswith("table \\texttt{demo-t}")
    # No commit to point at: the url is the repository itself, unless the address is
    # still the shipped placeholder, which names no repository: then there is no url.
    if site.is_placeholder(site.repository_url(REPO)):
        assert "url" not in parsed.fields
    else:
        assert parsed.fields["url"] == site.repository_url(REPO)
    _, real = _parse_bibtex(citations.bibtex_entry(table, None, "https://github.com/o/r"))
    assert real.fields["url"] == "https://github.com/o/r"
    assert [str(a) for a in parsed.persons["author"]] == [
        "{Attention, Reproduced contributors}"]


@pytest.mark.parametrize("caption, expected", [
    ("5 % of #1 & x_i.", "5 \\% of \\#1 \\& x\\_i."),
    ("Maths $a_b$ stays, see {numref}`demo-y`.", "Maths $a_b$ stays, see demo-y."),
    ("A lone $ sign and x_1", "A lone \\$ sign and x\\_1"),
    ("Unbalanced } and { braces", "Unbalanced and braces"),
])
def test_bibtex_fields_survive_latex_specials(caption, expected):
    entry = citations.bibtex_entry({**SIDECAR, "caption": caption}, {}, "")
    _, parsed = _parse_bibtex(entry)  # parses: braces balanced
    assert parsed.fields["note"].endswith(expected), parsed.fields["note"]
    assert "url" not in parsed.fields


def test_bibtex_entry_rejects_what_is_not_a_sidecar():
    with pytest.raises(ValueError, match="item: expected a figure or table sidecar"):
        citations.bibtex_entry({"caption": "no id"}, {}, "")


def test_cite_line_links_every_file_and_folds_the_entry():
    from companion.book.htmlcheck import cite_line_problems, cite_lines

    entry = citations.bibtex_entry(SIDECAR, {}, "")
    line = citations.cite_line(SIDECAR, "../assets/demo/figures", entry)
    assert "\n\n" not in line, "one HTML block: Markdown must not split it"
    assert line.startswith('<details class="cite-line" data-cite-for="demo-x">')
    links = cite_lines(line)["demo-x"]
    assert links == [f"../assets/demo/figures/demo-x.{e}" for e in
                     ("png", "svg", "pdf", "json", "bib")]
    assert html.escape(entry) in line
    figure = ('<figure id="demo-x"><figcaption><span class="caption-number">Fig. 1.1</span>'
              '</figcaption></figure>')
    assert cite_line_problems(figure + line) == []
    table = {**SIDECAR, "id": "demo-t", "type": "table", "files": {"csv": {}, "md": {}}}
    tline = citations.cite_line(table, "t", entry)
    assert cite_lines(tline)["demo-t"] == ["t/demo-t.csv", "t/demo-t.md", "t/demo-t.json",
                                           "t/demo-t.bib"]
    assert ">CSV<" in tline and ">Markdown<" in tline and ">provenance<" in tline


@pytest.mark.skipif(not mathjax_available(), reason="local MathJax missing: run make setup")
def test_built_book_passes_browser_check(ran_demo_project):
    require_browser()
    p = ran_demo_project  # a copy of this pytest run's one good demo run at smoke scale
    html = runner.build_html(p, echo=_quiet)
    assert html.exists()
    page = (p.build_dir / "html" / "book" / "_generated" / "chapters" / "demo.html").read_text()
    assert 'id="demo-random-walk"' in page, "figure label present"
    assert "Fig. 1.1" in page or "Figure 1.1" in page, "figures are numbered"
    assert "How this page was made" in page
    assert "_static/mathjax/tex-chtml.js" in page and "cdn.jsdelivr" not in page
    report = check_book(p, p.build_dir / "html")
    assert report.ok, report.summary()
    assert len(report.pages) == 6  # intro, findings, demo, index, report, references
    demo = next(r for r in report.pages if r.page.endswith("demo.html"))
    # Inline maths, and the definition's $$ display block (rendered, no raw LaTeX left).
    assert demo.images >= 1 and demo.math >= 4
    assert all(Path(r.screenshot).stat().st_size > 0 for r in report.pages)
    assert all(Path(r.screenshots[400]).stat().st_size > 0 for r in report.pages)
    # The Cite lines' files are in the build at the place the links name.
    figures = p.build_dir / "html" / "book" / "_generated" / "assets" / "demo" / "figures"
    assert {f.suffix for f in figures.glob("demo-random-walk.*")} == {
        ".png", ".svg", ".pdf", ".json", ".bib"}
    assert 'data-cite-for="demo-random-walk"' in page and 'data-cite-for="demo-summary"' in page


@pytest.mark.skipif(not mathjax_available(), reason="local MathJax missing: run make setup")
def test_browser_check_detects_broken_image_and_raw_latex(demo_project):
    require_browser()
    p = demo_project
    # A $$ block glued to its paragraph is not parsed as maths: the page shows raw LaTeX.
    source = p.source("demo")
    source.write_text(source.read_text() + "\nBroken on purpose: the formula\n$$\n"
                      "\\bar x = \\frac{1}{n} \\sum_{i=1}^{n} x_i\n$$\nglued to its paragraph.\n")
    assert runner.run_chapter(p, "demo", scale="smoke", echo=_quiet).status == "ok"
    runner.build_html(p, echo=_quiet)
    html_dir = p.build_dir / "html"
    for img in (html_dir / "_images").glob("*.png"):
        img.write_bytes(b"not a png")
    # A block 600 px wide (too wide for a phone only), a figure's Cite line removed, a
    # local path printed, a second parameters cell.
    page = html_dir / "book" / "_generated" / "chapters" / "demo.html"
    text = page.read_text()
    assert text.count('<details class="cite-line"') == 2, "the figure's and the table's"
    text = re.sub(r'<details class="cite-line" data-cite-for="demo-random-walk">.*?</details>',
                  "", text, count=1, flags=re.S)
    text = text.replace("</article>", '<div style="width: 600px">wide</div><pre>Error: '
                        '/home/someone/book/x.json</pre><div class="cell tag_parameters">'
                        '<pre>n = 1</pre></div><div class="report-summary"><div class="pst-'
                        'scrollable-table-container" style="overflow-x: auto"><table><tr><td '
                        'style="min-width: 500px">a table too wide for a phone</td></tr>'
                        "</table></div></div>" + "".join(
                            f'<div class="pst-scrollable-table-container"><table><caption '
                            f'id="{cid}"{style}>A caption as long as a sentence that says what '
                            f'the table shows</caption><tr><td style="min-width: 900px">wide'
                            "</td></tr></table></div>"
                            for cid, style in (("cut", ' style="position: static; display: '
                                                       'table-caption; max-width: none; '
                                                       'width: 600px"'),
                                               ("kept", ""))) + "</article>", 1)
    page.write_text(text)
    report = check_book(p, html_dir, pages=["book/_generated/chapters/demo.html"])
    summary = report.summary()
    # A caption as wide as its scrolling table is cut at the screen's edge; the book's
    # stylesheet keeps an ordinary one in view, wrapped.
    assert "cut off at 400 px: ['caption#cut" in summary, summary
    assert "caption#kept" not in summary, summary
    assert not report.ok and "images not loaded" in summary
    assert "raw LaTeX in the page text" in summary, summary
    assert "scrolls sideways at 400 px" in summary and "at 1400 px" not in summary, summary
    assert "figure demo-random-walk has no Cite line" in summary, summary
    assert "table demo-summary has no Cite line" not in summary, summary
    assert "local absolute paths in the page: ['/home/someone/book/x.json']" in summary
    assert "2 parameters cells shown" in summary
    assert "does not fit at 400 px: ['div.pst-scrollable-table-container" in summary, summary
    assert "does not fit at 1400 px" not in summary
    assert set(report.pages[0].screenshots) == {1400, 400}
    # without screenshots every check still runs, at both widths: the same problems
    quick = check_book(p, html_dir, pages=["book/_generated/chapters/demo.html"],
                       screenshots=False)
    assert quick.pages[0].problems == report.pages[0].problems
    assert not quick.pages[0].screenshots and "no screenshots saved" in quick.summary()
    proc = _cli(p, "check-html")  # what `make book` runs: a problem is a non-zero exit
    assert proc.returncode == 1 and "images not loaded" in proc.stdout, proc.stdout
    assert "raw LaTeX" in proc.stdout


def _cli(project, *args, env=None):
    return subprocess.run([sys.executable, "-m", "companion", *args, "--root", str(project.root)],
                          capture_output=True, text=True, env=env)


def test_check_html_without_a_browser_is_skipped_with_exit_0(demo_project, tmp_path):
    """The README: without chromium/chromedriver the check is skipped, saying why."""
    html = demo_project.build_dir / "html"
    html.mkdir(parents=True)
    (html / "index.html").write_text("<html></html>")
    empty_path = tmp_path / "no-browser-bin"  # a PATH on which no browser can be found
    empty_path.mkdir()
    proc = _cli(demo_project, "check-html", env={**os.environ, "PATH": str(empty_path)})
    assert proc.returncode == 0, proc.stderr
    assert "check-html skipped: chromium/chromedriver not installed" in proc.stdout


def test_check_html_report_exit_codes():
    from companion.book.htmlcheck import PageResult, Report

    assert Report([PageResult("a.html")]).exit_code == 0
    assert Report([], skipped="no browser").exit_code == 0
    broken = Report([PageResult("a.html"), PageResult("b.html", problems=["images not loaded"])])
    assert not broken.ok and broken.exit_code == 1 and "FAIL: images not loaded" in broken.summary()
    missing = Report([], error="no built book at x")
    assert not missing.ok and missing.exit_code == 2


def test_check_html_without_a_built_book_fails(demo_project):
    proc = _cli(demo_project, "check-html")
    assert proc.returncode == 2
    assert "no built book" in proc.stdout



def _prose_markdown(text: str) -> str:
    """A chapter's Markdown with the bodies of its directives (prf:definition,
    admonition, ...) unwrapped, so that markdown-it parses them as MyST does inside the
    directive; code cells stay fenced (code, not prose)."""
    out, fence = [], None
    for line in text.split("\n"):
        m = re.match(r"^(`{3,}|:{3,})\s*(\{[^}]+\})?", line)
        if fence is None and m:
            fence = (m.group(1), m.group(2) or "")
            if fence[1] in ("", "{code-cell}"):
                out.append(line)
            continue
        if fence is not None and line.strip() == fence[0]:
            if fence[1] in ("", "{code-cell}"):
                out.append(line)
            fence = None
            continue
        if fence is not None and fence[1] not in ("", "{code-cell}") and re.match(
                r"^:\w[\w-]*:", line):
            continue  # a directive option (:label:, :class:)
        out.append(line)
    return "\n".join(out)


def _render_myst(text: str) -> str:
    from markdown_it.renderer import RendererHTML
    from myst_parser.config.main import MdParserConfig
    from myst_parser.parsers.mdit import create_md_parser

    config = yaml.safe_load((REPO / "_config.yml").read_text())
    extensions = set(config["parse"]["myst_enable_extensions"]) - {"linkify"}
    md = create_md_parser(MdParserConfig(enable_extensions=extensions), RendererHTML)
    return md.render(_prose_markdown(text))


GLUED = ("```{prf:definition} D\n:label: d\n\nThe formula\n$$\nz = \\sqrt{x}\n$$\nthe slice "
         "of $W_O$.\n```\n")


def test_glued_display_maths_is_found_in_a_source():
    """The static twin of the browser check: the pattern that broke Definitions 2.1, 3.1
    and 3.2 (a $$ line right after text does not start a display block) is caught."""
    from companion.book.htmlcheck import raw_latex_in_html

    assert raw_latex_in_html(_render_myst(GLUED))
    fixed = GLUED.replace("The formula\n$$", "The formula\n\n$$").replace("$$\nthe", "$$\n\nthe")
    assert raw_latex_in_html(_render_myst(fixed)) == []


@pytest.mark.parametrize("source", sorted((REPO / "chapters").glob("*.md"))
                         + [REPO / "tests" / "fixtures" / "chapters" / "demo.md"],
                         ids=lambda p: p.stem)
def test_chapter_maths_parses(source):
    """No chapter's prose (definitions included) leaves LaTeX unparsed; runs without a
    browser or a build."""
    from companion.book.htmlcheck import raw_latex_in_html

    assert raw_latex_in_html(_render_myst(source.read_text())) == []


def test_generated_pages_unchanged_are_not_rewritten(demo_project):
    """A page whose text is the same keeps its file (and time): Sphinx reads it again
    only when it changed."""
    p = demo_project
    pages.write_generated_pages(p)
    index = p.generated / "figure_index.md"
    stamp = index.stat().st_mtime_ns
    os.utime(index, ns=(stamp - 10**9, stamp - 10**9))
    pages.write_generated_pages(p)
    assert index.stat().st_mtime_ns == stamp - 10**9, "unchanged: not rewritten"
    index.write_text("stale")
    pages.write_generated_pages(p)
    assert index.read_text() == pages.figure_index(p)


def test_chapter_title_is_the_first_heading_outside_code(tmp_path):
    assert pages.markdown_title("---\ntitle: x\n---\n# The title\n# Second\n") == "The title"
    assert pages.markdown_title("````{code-cell}\n```\n# not a title\n````\n# T\n") == "T"
    assert pages.markdown_title("no heading\n## Sub\n") is None
