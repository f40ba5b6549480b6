"""The book of every real chapter at smoke scale builds, and every page passes the browser
check; one chapter run a second time with the same seed gives the same bytes.

The chapters run into the smoke book (``conftest.smoke_book``), the project that
tests/test_chapters_smoke.py runs them into, one test per chapter in name order: each
chapter runs once per pytest run. With two workers, the other worker runs that file while
this one runs this file, and the two share the chapters' runs between them:

- the same-seed test runs its second run first (a project of its own, no other run
  waits for it), then takes the smoke book's run of the chapter;
- the book test takes the chapters in the reverse order, one that another run holds
  last (:func:`conftest.run_smoke_free_first`), then builds.

So that neither worker waits on a chapter the other one runs while a chapter is left
to run (a chapter another worker runs is waited for, then taken from the cache: the
results are the same whichever worker ran it).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from companion.book import runner
from companion.book.htmlcheck import check_book
from conftest import (CHAPTERS, REPO, make_project, mathjax_available, require_browser,
                      run_smoke, run_smoke_free_first)


# The chapter run twice: gradient_flow is the fastest chapter at smoke scale (12 s alone,
# 24 s on a loaded machine; the others took 27-37 s there), and none of its tables,
# figures or claims holds a timing (hasse and sbm_transformer report seconds).
REPEATED_CHAPTER = "gradient_flow"
# Sidecar fields that legitimately differ between two runs: when the record was written.
VOLATILE_FIELDS = {"created"}


def _output_files(assets: Path) -> dict[str, Path]:
    return {str(p.relative_to(assets)): p for p in sorted(assets.rglob("*")) if p.is_file()}


def _record(path: Path) -> dict:
    return {k: v for k, v in json.loads(path.read_text()).items() if k not in VOLATILE_FIELDS}


def _png_chunk_types(data: bytes) -> list[bytes]:
    """Chunk types of a PNG file (8-byte signature, then length, type, data, CRC)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    types, at = [], 8
    while at < len(data):
        length = int.from_bytes(data[at:at + 4], "big")
        types.append(data[at + 4:at + 8])
        at += 12 + length
    return types


def _assert_no_embedded_date(path: Path) -> None:
    """PNG without a tIME chunk, SVG without <dc:date>, PDF without CreationDate/ModDate."""
    data = path.read_bytes()
    if path.suffix == ".png":
        assert b"tIME" not in _png_chunk_types(data), f"{path.name} embeds a date (tIME)"
    else:
        markers = {".svg": (b"<dc:date>",), ".pdf": (b"/CreationDate", b"/ModDate")}
        for marker in markers[path.suffix]:
            assert marker not in data, f"{path.name} embeds a date ({marker.decode()})"


def test_same_seed_gives_same_bytes(smoke_book, tmp_path_factory):
    """Two smoke runs with one seed: identical tables, claims and figure files.

    The second project's run comes first, and then the smoke book's (this run's own, or
    the one the other worker made meanwhile): see the module docstring."""
    name = REPEATED_CHAPTER
    second_project = runner.Project(make_project(
        tmp_path_factory.mktemp("repeat") / "book", {name: REPO / "chapters" / f"{name}.md"}))
    second = runner.run_chapter(second_project, name, scale="smoke", device="cpu",
                                echo=lambda _l: None)
    assert second.status == "ok", second.error
    first = run_smoke(smoke_book, name)
    assert "seed" in first.record["parameters"], "the chapter has a seed parameter"
    # the same parameters (both the chapter's defaults at smoke scale): the same seed
    assert second.record["parameters"] == first.record["parameters"]

    a = _output_files(smoke_book.assets(name))
    b = _output_files(second_project.assets(name))
    assert sorted(a) == sorted(b), "the two runs saved different files"
    kinds = {"table": (".csv", ".md"), "figure": (".png", ".svg", ".pdf")}
    for kind, suffixes in kinds.items():
        files = [rel for rel in a if Path(rel).suffix in suffixes]
        assert files, f"{name} saved no {kind} file"
        differ = [rel for rel in files if a[rel].read_bytes() != b[rel].read_bytes()]
        assert not differ, f"same seed, different {kind} bytes: {differ}"
    for rel in a:
        if Path(rel).suffix in kinds["figure"]:
            _assert_no_embedded_date(a[rel])

    claims = [rel for rel in a if rel.startswith("claims/")]
    assert claims, f"{name} recorded no claim"
    for rel in claims:
        one, two = _record(a[rel]), _record(b[rel])
        assert (one["measured"], one["verdict"]) == (two["measured"], two["verdict"]), rel
    # Every sidecar (figures, tables, claims) agrees apart from its timestamp; the figure
    # and table sidecars hold the files' SHA-256 too.
    sidecars = [rel for rel in a if rel.endswith(".json")]
    differ = [rel for rel in sidecars if _record(a[rel]) != _record(b[rel])]
    assert not differ, f"same seed, different records: {differ}"


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
    assert len(report.pages) == len(CHAPTERS) + 4
