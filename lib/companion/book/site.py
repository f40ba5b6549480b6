"""Where the book lives: its repository, its published site and its distribution name.

One place holds the addresses: ``_config.yml`` at the project root, keys
``repository.url`` (the git repository, also what Jupyter Book's repository, issue and
launch buttons use), ``repository.branch`` and ``html.baseurl`` (the published site).
Everything else that needs an address (the install cell of an executed notebook, the
BibTeX ``url`` of a figure, the commit link in a page's run box, ``CITATION.cff``,
``pyproject.toml``'s ``[project.urls]``) reads it from here or is checked against it
by ``tests/test_publishing.py``.

The addresses shipped are placeholders (``PLACEHOLDER_REPOSITORY``). To publish a fork
from GitHub, run ``python -m companion.book.site set-url https://github.com/OWNER/REPO``: it
rewrites every copy of the address (:func:`set_url`); ``python -m companion.book.site show``
prints them (:func:`address_copies`).

Launch buttons (Binder, Colab) open a chapter's executed notebook on the branch
:func:`launch_branch` (``notebooks``), which the publishing workflow
(``.github/workflows/book.yml``) pushes after each build: the executed notebooks are
build outputs, not tracked on ``main``.

>>> from pathlib import Path
>>> commit_url("https://github.com/o/r", "0123456789abcdef")
'https://github.com/o/r/commit/0123456789abcdef'
>>> install_spec("https://github.com/o/r", "abc")
'attention-reproduced @ git+https://github.com/o/r@abc'
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

#: The name of the distribution on PyPI (``import companion`` stays the import name:
#: ``companion`` on PyPI is an unrelated package).
DISTRIBUTION = "attention-reproduced"

#: The repository address shipped until the book is published from a real repository.
PLACEHOLDER_REPOSITORY = "https://github.com/attention-reproduced/attention-reproduced"


def is_placeholder(url: str | None) -> bool:
    """Whether ``url`` is the shipped placeholder address (or empty): a page built with it
    shows no link to the repository, which does not exist.

    >>> is_placeholder(PLACEHOLDER_REPOSITORY + "/"), is_placeholder("https://github.com/o/r")
    (True, False)
    """
    return not url or str(url).rstrip("/").removesuffix(".git") == PLACEHOLDER_REPOSITORY


#: The branch, pushed by the publishing workflow, that holds the source tree of the last
#: published build plus its executed notebooks (what Binder and Colab open).
LAUNCH_BRANCH = "notebooks"

_GITHUB = re.compile(r"https://github\.com/([A-Za-z0-9][A-Za-z0-9-]*)/([A-Za-z0-9._-]+?)(?:\.git)?/?")


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


def launch_branch(root: Path) -> str:
    """The branch that launch buttons open (``html_theme_options.repository_branch`` in
    ``_config.yml``'s ``sphinx.config``; default :data:`LAUNCH_BRANCH`)."""
    sphinx_config = (_config(root).get("sphinx") or {}).get("config") or {}
    options = sphinx_config.get("html_theme_options") or {}
    return str(options.get("repository_branch") or LAUNCH_BRANCH)


def github_parts(url: str) -> tuple[str, str]:
    """``(owner, repo)`` of a GitHub repository address ``https://github.com/OWNER/REPO``.

    Raises ``ValueError`` naming ``url`` for anything else (another host, a path below
    the repository, ``http://``, a missing part).

    >>> github_parts("https://github.com/octo/attention-book.git")
    ('octo', 'attention-book')
    """
    if not isinstance(url, str):
        raise TypeError(f"url: expected a str 'https://github.com/OWNER/REPO', got "
                        f"{type(url).__name__}")
    match = _GITHUB.fullmatch(url.strip())
    if match is None:
        raise ValueError(f"url: expected a GitHub repository address "
                         f"'https://github.com/OWNER/REPO', got {url!r}")
    return match.group(1), match.group(2)


def pages_url_for(repository: str) -> str:
    """The GitHub Pages address of ``repository``: ``https://OWNER.github.io/REPO/``.

    GitHub serves Pages on a lower-case host name; the repository part keeps its case.

    >>> pages_url_for("https://github.com/Octo/attention-book")
    'https://octo.github.io/attention-book/'
    """
    owner, repo = github_parts(repository)
    return f"https://{owner.lower()}.github.io/{repo}/"


def issues_url(repository: str) -> str:
    """The issue tracker of ``repository`` (GitHub's layout).

    >>> issues_url("https://github.com/o/r")
    'https://github.com/o/r/issues'
    """
    return f"{repository.rstrip('/')}/issues"


# Every copy of the addresses outside _config.yml: file, its key, and which address it
# holds ("repository", "pages" or "issues"). set_url rewrites them; the test compares them.
_COPIES = (
    ("CITATION.cff", "repository-code", "repository"),
    ("CITATION.cff", "url", "pages"),
    ("pyproject.toml", "[project.urls] Repository", "repository"),
    ("pyproject.toml", "[project.urls] Homepage", "pages"),
    ("pyproject.toml", "[project.urls] Issues", "issues"),
)


def _cff_value(text: str, key: str) -> str | None:
    match = re.search(rf"^{re.escape(key)}:[ \t]*[\"']?([^\"'\n]*?)[\"']?[ \t]*$", text, re.M)
    return match.group(1) if match else None


def _toml_section_span(text: str, section: str) -> tuple[int, int] | None:
    start = re.search(rf"^\[{re.escape(section)}\][ \t]*$", text, re.M)
    if start is None:
        return None
    following = re.search(r"^\[", text[start.end():], re.M)
    end = start.end() + following.start() if following else len(text)
    return start.end(), end


def _toml_url(text: str, name: str) -> str | None:
    span = _toml_section_span(text, "project.urls")
    if span is None:
        return None
    match = re.search(rf'^{re.escape(name)}[ \t]*=[ \t]*"([^"]*)"', text[span[0]:span[1]], re.M)
    return match.group(1) if match else None


def address_copies(root: Path) -> dict[str, str | None]:
    """Every copy of the book's addresses, keyed ``"FILE KEY"`` (None where missing).

    ``_config.yml repository.url`` and ``_config.yml html.baseurl`` are the sources; the
    others must equal them (``repository``), the Pages address (``pages``, compared
    without the trailing slash) or the issue tracker (``issues``).
    """
    root = Path(root)
    config = _config(root)
    copies: dict[str, str | None] = {
        "_config.yml repository.url": (config.get("repository") or {}).get("url"),
        "_config.yml html.baseurl": (config.get("html") or {}).get("baseurl"),
    }
    for file, key, _kind in _COPIES:
        path = root / file
        text = path.read_text() if path.exists() else ""
        if file == "CITATION.cff":
            copies[f"{file} {key}"] = _cff_value(text, key)
        else:
            copies[f"{file} {key}"] = _toml_url(text, key.split()[-1])
    return copies


def expected_copies(repository: str) -> dict[str, str]:
    """What :func:`address_copies` must read for the repository address ``repository``."""
    repository = repository.rstrip("/")
    by_kind = {"repository": repository, "pages": pages_url_for(repository),
               "issues": issues_url(repository)}
    expected = {"_config.yml repository.url": repository,
                "_config.yml html.baseurl": by_kind["pages"]}
    for file, key, kind in _COPIES:
        expected[f"{file} {key}"] = by_kind[kind]
    return expected


def _replace_one(text: str, pattern: str, value: str, where: str) -> str:
    new, count = re.subn(pattern, lambda m: m.group(1) + value + m.group(2), text,
                         count=1, flags=re.M)
    if count != 1:
        raise ValueError(f"set-url: found no {where} to rewrite")
    return new


def _yaml_block_key(text: str, block: str, key: str, value: str, where: str) -> str:
    """Replace ``key:`` inside the top-level mapping ``block:`` of a YAML file's text."""
    start = re.search(rf"^{re.escape(block)}:[ \t]*(#.*)?$", text, re.M)
    if start is None:
        raise ValueError(f"set-url: found no {where} to rewrite")
    following = re.search(r"^\S", text[start.end() + 1:], re.M)
    end = start.end() + 1 + following.start() if following else len(text)
    pattern = rf"^([ \t]+{re.escape(key)}:[ \t]*)\S.*?([ \t]*(?:#.*)?)$"
    body = _replace_one(text[start.end():end], pattern, value, where)
    return text[:start.end()] + body + text[end:]


def set_url(root: Path, url: str) -> dict[str, str]:
    """Point every copy of the book's addresses at the GitHub repository ``url``.

    Rewrites, keeping everything else of each file (comments, order):
    ``_config.yml`` ``repository.url`` and ``html.baseurl`` (``https://OWNER.github.io/REPO/``),
    ``CITATION.cff`` ``repository-code`` and ``url``, and ``pyproject.toml``'s
    ``[project.urls]``. Returns :func:`expected_copies` of the new address.

    Parameters
    ----------
    root : the project root (the folder of ``_config.yml``).
    url : ``https://github.com/OWNER/REPO`` (a trailing ``.git`` or ``/`` is dropped).

    >>> import tempfile
    >>> tmp = Path(tempfile.mkdtemp())
    >>> _ = (tmp / "_config.yml").write_text("repository:\\n  url: x\\nhtml:\\n  baseurl: y\\n")
    >>> _ = (tmp / "CITATION.cff").write_text("repository-code: x\\nurl: y\\n")
    >>> _ = (tmp / "pyproject.toml").write_text(
    ...     '[project.urls]\\nHomepage = "y"\\nRepository = "x"\\nIssues = "z"\\n')
    >>> set_url(tmp, "https://github.com/octo/book")["_config.yml html.baseurl"]
    'https://octo.github.io/book/'
    >>> address_copies(tmp) == expected_copies("https://github.com/octo/book")
    True
    """
    owner, repo = github_parts(url)
    repository = f"https://github.com/{owner}/{repo}"
    expected = expected_copies(repository)
    root = Path(root)
    paths = {name: root / name for name in ("_config.yml", "CITATION.cff", "pyproject.toml")}
    missing = [str(p) for p in paths.values() if not p.exists()]
    if missing:
        raise FileNotFoundError(f"root: expected the project root, missing {', '.join(missing)}")
    texts = {name: path.read_text() for name, path in paths.items()}
    config = texts["_config.yml"]
    config = _yaml_block_key(config, "repository", "url", repository, "_config.yml repository.url")
    config = _yaml_block_key(config, "html", "baseurl", expected["_config.yml html.baseurl"],
                             "_config.yml html.baseurl")
    cff = texts["CITATION.cff"]
    for key in ("repository-code", "url"):
        cff = _replace_one(cff, rf"^({re.escape(key)}:[ \t]*)\S.*?()$",
                           f'"{expected[f"CITATION.cff {key}"]}"', f"CITATION.cff {key}")
    toml = texts["pyproject.toml"]
    span = _toml_section_span(toml, "project.urls")
    if span is None:
        raise ValueError("set-url: found no pyproject.toml [project.urls] to rewrite")
    section = toml[span[0]:span[1]]
    for name in ("Homepage", "Repository", "Issues"):
        section = _replace_one(section, rf'^({re.escape(name)}[ \t]*=[ \t]*")[^"]*(")',
                               expected[f"pyproject.toml [project.urls] {name}"],
                               f"pyproject.toml [project.urls] {name}")
    toml = toml[:span[0]] + section + toml[span[1]:]
    # Write only once every rewrite succeeded: a failure leaves all three files as they were.
    for name, text in (("_config.yml", config), ("CITATION.cff", cff), ("pyproject.toml", toml)):
        paths[name].write_text(text)
    return expected


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m companion.book.site",
        description="The book's addresses: show them, or point every copy at a repository.")
    parser.add_argument("--root", default=".", help="project root (default: .)")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("show", help="print every copy of the addresses")
    set_parser = commands.add_parser(
        "set-url", help="rewrite every copy for the GitHub repository URL")
    set_parser.add_argument("url", help="https://github.com/OWNER/REPO")
    args = parser.parse_args(argv)
    root = Path(args.root)
    try:
        if args.command == "set-url":
            set_url(root, args.url)
        for key, value in address_copies(root).items():
            print(f"{key}: {value}")
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main())
