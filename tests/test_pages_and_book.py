"""Generated pages, environment pins, and the built book checked in headless Chromium."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from companion import pages, runner
from companion.htmlcheck import check_book
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
    env_pins = {p for p in pip if not p.startswith("-e")}
    assert pins == env_pins
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][A-Za-z0-9_.+]*", p) for p in pins), (
        "every dependency is pinned exactly")
    assert "python=3.11" in env["dependencies"]


def test_generated_pages_list_figures_and_claims(demo_project):
    p = demo_project
    assert runner.run_chapter(p, "demo", scale="smoke", echo=_quiet).status == "ok"
    index = pages.figure_index(p)
    assert "### `demo-random-walk`" in index
    for fmt in ("PNG", "SVG", "PDF"):
        assert f"{{download}}`{fmt} <assets/demo/figures/demo-random-walk." in index
    assert "@misc{attnrepro-demo-random-walk," in index
    assert "{numref}`demo-random-walk`" in index
    assert "1 figure(s) in 1 chapter(s)." in index.split("## Demo chapter")[0]
    assert "scale `smoke`" in index
    report = pages.reproduction_report(p)
    assert "| Demo chapter | 1 | 0 | 0 | 1 | 0 | 0 | 0 | fresh |" in report
    assert "{ref}`demo-mean-small <demo-mean-small>`" in report
    assert "**not comparable**" in report


def test_bibtex_entry_names_commit_and_figure():
    meta = {"title": "Attention, Reproduced", "authors": [{"name": "A. Person"}],
            "version": "0.1.0"}
    side = {"id": "demo-x", "chapter": "demo", "git_commit": "0123456789abcdef",
            "created": "2026-11-29T00:00:00+00:00", "scale": "ci", "device": "cpu",
            "seed": 0, "caption": "A caption."}
    entry = pages.bibtex_for_figure(meta, side)
    assert entry.startswith("@misc{attnrepro-demo-x,")
    assert "Commit 0123456789ab" in entry and "year = {2026}" in entry
    assert "author = {A. Person}" in entry


@pytest.mark.skipif(not mathjax_available(), reason="local MathJax missing: run make setup")
def test_built_book_passes_browser_check(demo_project):
    require_browser()
    p = demo_project
    assert runner.run_chapter(p, "demo", scale="smoke", echo=_quiet).status == "ok"
    html = runner.build_html(p, echo=_quiet)
    assert html.exists()
    page = (p.build_dir / "html" / "book" / "_generated" / "chapters" / "demo.html").read_text()
    assert 'id="demo-random-walk"' in page, "figure label present"
    assert "Fig. 1.1" in page or "Figure 1.1" in page, "figures are numbered"
    assert "How this page was made" in page
    assert "_static/mathjax/tex-chtml.js" in page and "cdn.jsdelivr" not in page
    report = check_book(p, p.build_dir / "html")
    assert report.ok, report.summary()
    assert len(report.pages) == 5
    demo = next(r for r in report.pages if r.page.endswith("demo.html"))
    assert demo.images >= 1 and demo.math >= 2
    assert all(Path(r.screenshot).stat().st_size > 0 for r in report.pages)


@pytest.mark.skipif(not mathjax_available(), reason="local MathJax missing: run make setup")
def test_browser_check_detects_broken_image(demo_project):
    require_browser()
    p = demo_project
    assert runner.run_chapter(p, "demo", scale="smoke", echo=_quiet).status == "ok"
    runner.build_html(p, echo=_quiet)
    html_dir = p.build_dir / "html"
    for img in (html_dir / "_images").glob("*.png"):
        img.write_bytes(b"not a png")
    report = check_book(p, html_dir, pages=["book/_generated/chapters/demo.html"])
    assert not report.ok and "images not loaded" in report.summary()
    proc = _cli(p, "check-html")  # what `make book` runs: a problem is a non-zero exit
    assert proc.returncode == 1 and "images not loaded" in proc.stdout, proc.stdout


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
    from companion.htmlcheck import PageResult, Report

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

