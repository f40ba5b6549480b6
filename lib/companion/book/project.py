"""A book project's places and what the runner and the generated pages both read: the
chapter sources, executed notebooks and run records under ``book/_generated/``.

:mod:`companion.book.runner` and :mod:`companion.book.pages` both import this module;
neither imports the other's internals (the runner calls the pages to write them).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


class ChapterError(Exception):
    """A chapter could not be run: bad parameters, missing chapter, failed cell."""



@dataclass
class Project:
    """Paths of a book project: ``_toc.yml``, ``chapters/``, ``book/_generated/``."""

    root: Path

    def __post_init__(self) -> None:
        self.root = Path(self.root).resolve()

    @property
    def chapters_dir(self) -> Path:
        return self.root / "chapters"

    @property
    def generated(self) -> Path:
        return self.root / "book" / "_generated"

    @property
    def lib_dir(self) -> Path:
        return self.root / "lib"

    @property
    def build_dir(self) -> Path:
        return self.root / "book" / "_build"

    def source(self, name: str) -> Path:
        return self.chapters_dir / f"{name}.md"

    def notebook(self, name: str) -> Path:
        return self.generated / "chapters" / f"{name}.ipynb"

    def assets(self, name: str) -> Path:
        return self.generated / "assets" / name

    def run_record(self, name: str) -> Path:
        return self.generated / "runs" / f"{name}.json"

    def log(self, name: str) -> Path:
        return self.generated / "logs" / f"{name}.log"

    def toc_files(self) -> list[str]:
        """Every page of ``_toc.yml`` (root first), as paths without suffix."""
        import yaml

        toc = yaml.safe_load((self.root / "_toc.yml").read_text())
        files: list[str] = [toc["root"]]

        def walk(node: Any) -> None:
            if isinstance(node, dict):
                f = node.get("file")
                if isinstance(f, str) and f not in files:
                    files.append(f)
                for value in node.values():
                    walk(value)
            elif isinstance(node, list):
                for item in node:
                    walk(item)

        walk(toc)
        return files

    def toc_chapters(self) -> list[str]:
        """Chapter names in table-of-contents order (entries under _generated/chapters/)."""
        prefix = "book/_generated/chapters/"
        return [Path(f).name for f in self.toc_files() if f.startswith(prefix)]

    def chapter_names(self) -> list[str]:
        on_disk = sorted(p.stem for p in self.chapters_dir.glob("*.md"))
        ordered = [n for n in self.toc_chapters() if n in on_disk]
        return ordered + [n for n in on_disk if n not in ordered]


def read_notebook(path: Path):
    import jupytext

    return jupytext.read(path)


def read_notebook_ipynb(path: Path):
    import nbformat

    return nbformat.read(str(path), as_version=4)



def load_record(project: Project, name: str,
                echo: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """The last run record of chapter ``name``, or None when there is none.

    An unreadable record (cut short by a full disk, edited by hand) counts as none: the
    chapter is then run again rather than trusted. ``echo``, when given, is told so,
    naming the file.
    """
    path = project.run_record(name)
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        if isinstance(record, dict):
            return record
        problem = f"a JSON {type(record).__name__}, not an object"
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        problem = f"{type(exc).__name__}: {exc}"
    if echo is not None:
        echo(f"[warning] {name}: the run record {path} is unreadable ({problem}); "
             "treating it as no record, so the chapter runs again")
    return None
