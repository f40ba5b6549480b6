"""Where the book lives: its repository, its published site and its distribution name.

One place holds the addresses: ``_config.yml`` at the project root, keys
``repository.url`` (the git repository, also what Jupyter Book's repository, issue and
launch buttons use), ``repository.branch`` and ``html.baseurl`` (the published site).
Everything else that needs an address (the install cell of an executed notebook, the
BibTeX ``url`` of a figure, the commit link in a page's run box, ``CITATION.cff``,
``pyproject.toml``'s ``[project.urls]``) reads it from here or is checked against it
by ``tests/test_publishing.py``.

The addresses shipped are placeholders (``PLACEHOLDER_REPOSITORY``). To publish a fork,
change the two keys in ``_config.yml`` and run ``python -m companion set-url URL``,
which rewrites the copies (see the README, "Publishing").

>>> from pathlib import Path
>>> commit_url("https://github.com/o/r", "0123456789abcdef")
'https://github.com/o/r/commit/0123456789abcdef'
>>> install_spec("https://github.com/o/r", "abc")
'attention-reproduced @ git+https://github.com/o/r@abc'
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

#: The name of the distribution on PyPI (``import companion`` stays the import name:
#: ``companion`` on PyPI is an unrelated package).
DISTRIBUTION = "attention-reproduced"

#: The repository address shipped until the book is published from a real repository.
PLACEHOLDER_REPOSITORY = "https://github.com/attention-reproduced/attention-reproduced"


def _config(root: Path) -> dict[str, Any]:
    import yaml

    path = Path(root) / "_config.yml"
    if not path.exists():
        return {}
    return yaml.safe_load(path.read_text()) or {}


def repository_url(root: Path) -> str:
    """The git repository's web address, from ``_config.yml`` (``repository.url``)."""
    url = (_config(root).get("repository") or {}).get("url") or PLACEHOLDER_REPOSITORY
    return str(url).rstrip("/")


def repository_branch(root: Path) -> str:
    """The branch the book is published from (``repository.branch``, default ``main``)."""
    return str((_config(root).get("repository") or {}).get("branch") or "main")


def pages_url(root: Path) -> str:
    """The published site's base address, from ``_config.yml`` (``html.baseurl``)."""
    url = (_config(root).get("html") or {}).get("baseurl") or ""
    return str(url).rstrip("/")


def commit_url(repository: str, commit: str) -> str:
    """The web page of ``commit`` in ``repository`` (GitHub's layout)."""
    return f"{repository.rstrip('/')}/commit/{commit}"


def tree_url(repository: str, commit: str, path: str = "") -> str:
    """The web page of ``path`` at ``commit`` in ``repository`` (GitHub's layout)."""
    tail = f"/{path.lstrip('/')}" if path else ""
    return f"{repository.rstrip('/')}/tree/{commit}{tail}"


def install_spec(repository: str, commit: str) -> str:
    """A pip requirement that installs the library at exactly ``commit``."""
    return f"{DISTRIBUTION} @ git+{repository.rstrip('/')}@{commit}"
