"""One chapter run a second time with the same seed gives the same bytes.

The chapters run into the smoke book (``conftest.smoke_book``), the project that
tests/test_chapters_smoke.py runs them into (each chapter runs once per pytest run) and
tests/test_smoke_book_pages.py builds its HTML book from. With two workers, the other
worker runs tests/test_chapters_smoke.py while this one runs this file; the repeated
chapter (``conftest.REPEATED_CHAPTER``) comes last there, so that this test's two runs of
it (its own project first, then the smoke book's) are done by the time that file asks.
"""
from __future__ import annotations

import json
from pathlib import Path

from companion.book import runner
from conftest import REPEATED_CHAPTER, REPO, make_project, run_smoke


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
    the one another worker made meanwhile): see the module docstring."""
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
