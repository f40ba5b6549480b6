"""Shared fixtures: a throw-away book project built around the real configuration."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURE_CHAPTERS = Path(__file__).parent / "fixtures" / "chapters"


def toc_yaml(chapters: list[str]) -> str:
    lines = ["format: jb-book", "root: book/intro", "parts:", "  - caption: Chapters",
             "    numbered: true", "    chapters:"]
    lines += [f"      - file: book/_generated/chapters/{c}" for c in chapters]
    lines += ["  - caption: Reproducibility", "    chapters:",
              "      - file: book/_generated/figure_index",
              "      - file: book/_generated/reproduction_report",
              "      - file: book/references"]
    return "\n".join(lines) + "\n"


def make_project(root: Path, chapters: dict[str, Path]) -> Path:
    """A project at ``root`` with the repository's book config and the given chapters.

    ``lib`` and the static assets are linked, not copied (the cache key reads lib/).
    """
    (root / "book").mkdir(parents=True)
    (root / "chapters").mkdir()
    for name in ("_config.yml", "CITATION.cff"):
        shutil.copy(REPO / name, root / name)
    for name in ("intro.md", "references.md", "references.bib"):
        shutil.copy(REPO / "book" / name, root / "book" / name)
    for name in ("_static", "_ext"):
        os.symlink(REPO / "book" / name, root / "book" / name)
    os.symlink(REPO / "lib", root / "lib")
    if (REPO / ".cache").exists():  # installed corpora and npm packages
        os.symlink(REPO / ".cache", root / ".cache")
    for name, src in chapters.items():
        shutil.copy(src, root / "chapters" / f"{name}.md")
    (root / "_toc.yml").write_text(toc_yaml(list(chapters)))
    return root


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a test module of small problems (restored afterwards)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def demo_project(tmp_path):
    from companion.book.runner import Project

    root = make_project(tmp_path / "book-project", {"demo": FIXTURE_CHAPTERS / "demo.md"})
    return Project(root)


def browser_available() -> bool:
    return bool(shutil.which("chromium") and shutil.which("chromedriver"))


def require_browser():
    """Skip without Chromium, except under CI where the browser check must run."""
    if browser_available():
        return
    if os.environ.get("CI"):
        pytest.fail("CI must run the browser check but chromium/chromedriver are missing")
    pytest.skip("chromium/chromedriver not installed: browser check skipped "
                "(make setup installs them when run as root)")


def mathjax_available() -> bool:
    return (REPO / "book" / "_static" / "mathjax" / "tex-chtml.js").exists()
