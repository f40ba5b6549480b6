"""Figures, tables and claims saved with their provenance.

Every figure a chapter shows goes through :func:`save_figure`, every table through
:func:`save_table`, every checked statement through :func:`claim`. Each writes its files
atomically (temporary file + rename) next to a JSON sidecar that says exactly what
produced it: chapter, parameters, scale, seed, device, git commit (and whether the tree
was dirty), package versions, time, and the sha256 of every file written.

A chapter starts with :func:`begin_chapter`, which validates the parameters, seeds the
random generators and sets where outputs go. When the runner executes a chapter it tells
the chapter (through environment variables) where to write; run by hand, outputs go to
``book/_generated/assets/<chapter>/`` of the repository.

Ids are stable kebab-case strings prefixed by the chapter's prefix (the chapter's file
stem with ``_`` replaced by ``-``), e.g. ``hasse-butterfly-mask``.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import io
import json
import math
import os
import random
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from companion._validate import check_choice, check_int, check_number, describe

SCALES = ("smoke", "ci", "paper")
VERDICTS = ("reproduced", "differs", "inconclusive", "not comparable")
# A check (our own target, an implementation check, another paper's statement) is judged
# like a claim but reads holds / fails, and is never counted as a reproduction.
CHECK_VERDICTS = {"reproduced": "holds", "differs": "fails", "inconclusive": "inconclusive"}
ROLES = ("paper", "check")
CLAIM_KINDS = ("holds", "abs", "rel", "range", "at_most", "at_least")
_ID_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")

# Environment variables through which the runner talks to an executing chapter.
ENV_OUTPUT_DIR = "COMPANION_OUTPUT_DIR"
ENV_ASSET_URL = "COMPANION_ASSET_URL"
ENV_CHAPTER = "COMPANION_CHAPTER"
ENV_THREADS = "COMPANION_TORCH_THREADS"
ENV_COMMIT = "COMPANION_GIT_COMMIT"
ENV_DIRTY = "COMPANION_GIT_DIRTY"

# Fixed metadata so that the same figure gives the same bytes (no dates, fixed hash salt).
_SAVE_METADATA = {
    "png": {"Software": None},
    "svg": {"Date": None, "Creator": None},
    "pdf": {"CreationDate": None, "ModDate": None, "Producer": None, "Creator": None},
}


def repo_root(start: Path | None = None) -> Path:
    """The repository root: the nearest folder above ``start`` holding ``_config.yml``
    and ``lib/companion``; else the checkout of an editable install; else (the library
    installed from a wheel, a notebook run outside any clone) the current folder."""
    here = Path(start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if _is_checkout(folder):
            return folder
    package_checkout = Path(__file__).resolve().parents[3]  # lib/companion/book/provenance.py
    return package_checkout if _is_checkout(package_checkout) else here


def _is_checkout(folder: Path) -> bool:
    return (folder / "_config.yml").exists() and (folder / "lib" / "companion").exists()


def git_state(root: Path | None = None) -> tuple[str, bool]:
    """Return (commit, dirty) of the repository at ``root``; ("unknown", False) outside git.

    The runner computes this once and passes it through the environment, so chapters
    report the commit of the run that executed them.
    """
    if os.environ.get(ENV_COMMIT):
        return os.environ[ENV_COMMIT], os.environ.get(ENV_DIRTY, "0") == "1"
    root = root or repo_root()
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root, capture_output=True, text=True, check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown", False
    return commit, bool(status.strip())


def package_versions() -> dict[str, str]:
    """Versions of the packages whose behaviour a figure depends on."""
    from importlib import metadata

    versions = {}
    from companion.book.site import DISTRIBUTION

    # the library is recorded as "companion" (its import name); its distribution on
    # PyPI is attention-reproduced
    for key, dist in (("torch", "torch"), ("numpy", "numpy"), ("matplotlib", "matplotlib"),
                      ("companion", DISTRIBUTION)):
        try:
            versions[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[key] = "not installed"
    return versions


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder + rename.

    A reader (or an interrupted run) never sees a half-written file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def _json_default(obj: Any) -> Any:
    # numpy / torch scalars and tuples appear in parameters and measurements.
    if hasattr(obj, "item") and callable(obj.item):
        try:
            return obj.item()
        except (ValueError, RuntimeError):
            pass
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n"


class Record(dict):
    """A saved item's sidecar: a plain dict that shows nothing when it ends a cell.

    save_figure/save_table/claim already display the item; returning a bare dict would
    print the whole sidecar under it on the chapter page.
    """

    def _ipython_display_(self) -> None:
        pass


@dataclass
class Chapter:
    """The running chapter: its name, validated parameters and where outputs go."""

    name: str
    params: dict[str, Any]
    output_dir: Path
    asset_url: str
    device: Any = None
    started: str = field(default_factory=lambda: now_iso())
    used_ids: dict[str, str] = field(default_factory=dict)

    @property
    def scale(self) -> str:
        return self.params["scale"]

    @property
    def seed(self) -> int:
        return self.params["seed"]

    @property
    def prefix(self) -> str:
        return self.name.replace("_", "-")

    def generator(self, offset: int = 0, device: Any = None):
        """A torch.Generator seeded with ``seed + offset`` (on ``device``, default CPU)."""
        import torch

        g = torch.Generator(device=device or "cpu")
        g.manual_seed(int(self.seed) + int(offset))
        return g


_ACTIVE: Chapter | None = None


def now_iso() -> str:
    """The current UTC time, ISO 8601, to the second."""
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def begin_chapter(name: str, **params: Any) -> Chapter:
    """Start a chapter: validate its parameters, seed generators, set the output folder.

    Parameters
    ----------
    name : the chapter's file stem (``"hasse"``, ``"gradient_flow"``, ...).
    **params : every parameter of the chapter's ``parameters`` cell. ``scale`` (one of
        "smoke", "ci", "paper"), ``seed`` (int) and ``device`` ("auto", "cpu", "cuda")
        are required.

    Returns
    -------
    Chapter, also remembered as the active chapter used by save_figure/save_table/claim.

    Raises
    ------
    TypeError
        ``name`` is not a str, or ``seed`` is not an int (a float, a str, a bool).
    ValueError
        ``name`` is not a file stem, a required parameter is missing, the scale is
        unknown, the device is unknown or absent, or the runner executes another chapter.
    """
    global _ACTIVE
    if not isinstance(name, str):
        raise TypeError(f"name: expected a chapter file stem like 'hasse', got {describe(name)}")
    if not re.fullmatch(r"[a-z0-9_]+", name):
        raise ValueError(f"name: expected a chapter file stem like 'hasse', got {name!r}")
    for required in ("scale", "seed", "device"):
        if required not in params:
            raise ValueError(f"begin_chapter: parameter {required!r} is required")
    check_choice("scale", params["scale"], SCALES)
    params["seed"] = check_int("seed", params["seed"])
    from companion.devices import resolve_device

    device = resolve_device(params["device"])

    env_chapter = os.environ.get(ENV_CHAPTER)
    if env_chapter and env_chapter != name:
        raise ValueError(
            f"name: the runner executes chapter {env_chapter!r} but the notebook calls "
            f"begin_chapter({name!r})"
        )
    if os.environ.get(ENV_OUTPUT_DIR):
        output_dir = Path(os.environ[ENV_OUTPUT_DIR])
        asset_url = os.environ.get(ENV_ASSET_URL, str(output_dir))
    else:
        output_dir = repo_root() / "book" / "_generated" / "assets" / name
        asset_url = str(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    random.seed(params["seed"])
    try:
        import numpy as np

        np.random.seed(params["seed"] % (2**32))
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    import torch

    torch.manual_seed(params["seed"])
    if os.environ.get(ENV_THREADS):
        torch.set_num_threads(max(1, int(os.environ[ENV_THREADS])))
    import matplotlib

    matplotlib.rcParams["svg.hashsalt"] = "attention-reproduced"
    matplotlib.rcParams["savefig.dpi"] = 150
    matplotlib.rcParams["figure.dpi"] = 110

    _ACTIVE = Chapter(name=name, params=dict(params), output_dir=output_dir,
                      asset_url=asset_url, device=device)
    return _ACTIVE


def active_chapter() -> Chapter:
    if _ACTIVE is None:
        raise RuntimeError(
            "no active chapter: call companion.book.provenance.begin_chapter(name, scale=..., "
            "seed=..., device=...) first"
        )
    return _ACTIVE


def _check_id(kind: str, item_id: str, chapter: Chapter) -> None:
    """Ids are kebab-case, chapter-prefixed and unique within a chapter.

    Figures, tables and claims share one namespace (each id is a label on the page).
    Under the runner an id may be used once; run by hand, re-running a cell may save the
    same item again. This only checks: :func:`_register_id` records the id once every
    other argument has been checked and the files are written, so that a call refused
    for a bad argument can be retried, corrected, with the same id.
    """
    if not isinstance(item_id, str) or not _ID_RE.match(item_id):
        raise ValueError(
            f"{kind}: expected a kebab-case id like 'hasse-causal-mask', got {item_id!r}")
    if not item_id.startswith(chapter.prefix + "-"):
        raise ValueError(
            f"{kind}: id {item_id!r} must start with the chapter prefix {chapter.prefix + '-'!r}"
        )
    previous = chapter.used_ids.get(item_id)
    if previous is not None and (previous != kind or os.environ.get(ENV_CHAPTER)):
        raise ValueError(
            f"{kind}: id {item_id!r} is already used by a {previous.split('_')[0]} of this "
            "chapter; every figure, table and claim needs its own id"
        )


def _register_id(kind: str, item_id: str, chapter: Chapter) -> None:
    chapter.used_ids[item_id] = kind


def _provenance(chapter: Chapter) -> dict[str, Any]:
    commit, dirty = git_state()
    return {
        "chapter": chapter.name,
        "parameters": chapter.params,
        "scale": chapter.scale,
        "seed": chapter.seed,
        "device": str(chapter.device),
        "git_commit": commit,
        "git_dirty": dirty,
        "versions": package_versions(),
        "created": now_iso(),
    }


def _display_markdown(markdown: str, extra: dict[str, Any] | None = None) -> None:
    """Show MyST markdown on the chapter page (MyST-NB parses it as MyST)."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # pragma: no cover - IPython comes with ipykernel
        return
    if get_ipython() is None:
        return
    bundle = {"text/markdown": markdown, "text/plain": markdown}
    bundle.update(extra or {})
    display(bundle, raw=True)


#: BibTeX author of the book when CITATION.cff names nobody: a braced corporate name,
#: so that BibTeX does not read "Attention" as a surname.
CORPORATE_AUTHOR = "Attention, Reproduced contributors"


def citation_metadata(root: Path | None = None) -> dict[str, Any]:
    """The book's ``CITATION.cff`` as a dict (title, authors, version, ...); a minimal
    default when the file is missing."""
    import yaml

    path = Path(root or repo_root()) / "CITATION.cff"
    if not path.exists():
        return {"title": "Attention, Reproduced", "authors": [{"name": CORPORATE_AUTHOR}]}
    return yaml.safe_load(path.read_text(encoding="utf-8")) or {}


_MYST_ROLE = re.compile(r"\{[\w:-]+\}`([^`<]*?)(?:\s*<[^`]*>)?`")


def _bibtex_text(text: str) -> str:
    """``text`` safe inside a braced BibTeX field: MyST roles reduced to their text,
    LaTeX specials outside ``$...$`` escaped, unbalanced braces dropped."""
    text = _MYST_ROLE.sub(lambda m: m.group(1), " ".join(str(text).split()))
    maths = text.count("$") % 2 == 0  # a lone $ opens no maths: every $ is escaped
    out, in_math = [], False
    for ch in text:
        if ch == "$":
            in_math = maths and not in_math
            ch = ch if maths else "\\$"
        elif ch in "%&#" or (ch == "_" and not in_math):
            ch = "\\" + ch
        out.append(ch)
    text = "".join(out)
    depth, kept = 0, []
    for ch in text:
        if ch == "}" and depth == 0:
            continue
        depth += (ch == "{") - (ch == "}")
        kept.append(ch)
    text = "".join(kept)
    while depth > 0:  # drop the last unclosed "{"
        i = text.rindex("{")
        text, depth = text[:i] + text[i + 1:], depth - 1
    return " ".join(text.split())


def _bibtex_author(author: dict[str, Any]) -> str:
    """One CITATION.cff author: a person as "Family, Given", an entity braced."""
    if author.get("family-names"):
        name = " ".join(filter(None, [author.get("name-particle"), author["family-names"]]))
        given = author.get("given-names")
        return f"{name}, {given}" if given else name
    return "{" + str(author.get("name") or CORPORATE_AUTHOR) + "}"


def bibtex_entry(item: dict[str, Any], metadata: dict[str, Any] | None = None,
                 repository: str | None = None) -> str:
    r"""The BibTeX entry citing one figure or table of the book at the commit that made it.

    The one function behind the figure index, the ``<id>.bib`` files that
    :func:`save_figure` and :func:`save_table` write, and the Cite line under every
    figure and table.

    Parameters
    ----------
    item : the item's sidecar (``id``, ``type`` "figure" or "table", ``caption``,
        ``chapter``, ``git_commit``, ``created``, ``scale``, ``device``, ``seed``).
    metadata : ``CITATION.cff`` as a dict (authors, title, version); default: the
        repository's (:func:`citation_metadata`).
    repository : the repository's web address; the entry's ``url`` is the repository's
        tree at the item's commit (``companion.book.site.tree_url``). Default: from
        ``_config.yml`` (``companion.book.site.repository_url``).

    >>> side = {"id": "demo-x", "type": "figure", "chapter": "demo", "caption": "A & B.",
    ...         "git_commit": "0123456789abcdef", "created": "2026-11-29T00:00:00+00:00",
    ...         "scale": "ci", "device": "cpu", "seed": 0}
    >>> print(bibtex_entry(side, {"authors": [{"name": "Attention, Reproduced contributors"}],
    ...                           "title": "Attention, Reproduced"}, "https://github.com/o/r"))
    @misc{attnrepro-demo-x,
      author = {{Attention, Reproduced contributors}},
      title = {{Attention, Reproduced}: figure \texttt{demo-x}},
      year = {2026},
      howpublished = {Jupyter Book, chapter demo},
      url = {https://github.com/o/r/tree/0123456789abcdef},
      note = {Commit 0123456789ab, scale ci, device cpu, seed 0. A \& B.}
    }
    """
    from companion.book import site

    if not isinstance(item, dict) or not isinstance(item.get("id"), str):
        raise ValueError(f"item: expected a figure or table sidecar with an 'id', got {item!r}")
    metadata = citation_metadata() if metadata is None else metadata
    if repository is None:
        repository = site.repository_url(repo_root())
    authors = " and ".join(_bibtex_author(a) for a in metadata.get("authors") or []
                           if isinstance(a, dict)) or "{" + CORPORATE_AUTHOR + "}"
    kind = "table" if item.get("type") == "table" else "figure"
    commit = str(item.get("git_commit") or "unknown")
    known = bool(re.fullmatch(r"[0-9a-f]{7,40}", commit))
    dirty = " (with uncommitted changes)" if item.get("git_dirty") else ""
    title = _bibtex_text(metadata.get("title") or "Attention, Reproduced")
    fields = [
        ("author", authors),
        ("title", f"{{{title}}}: {kind} \\texttt{{{item['id']}}}"),
        ("year", str(item.get("created") or "")[:4]),
        ("howpublished", f"Jupyter Book, chapter {_bibtex_text(item.get('chapter', ''))}"),
    ]
    if repository:
        fields.append(("url", site.tree_url(repository, commit) if known else repository))
    if metadata.get("version"):
        fields.append(("version", _bibtex_text(metadata["version"])))
    fields.append(("note", f"Commit {commit[:12]}{dirty}, scale {item.get('scale')}, device "
                           f"{item.get('device')}, seed {item.get('seed')}. "
                           f"{_bibtex_text(item.get('caption', ''))}".strip()))
    body = ",\n".join(f"  {k} = {{{v}}}" for k, v in fields if v)
    return f"@misc{{attnrepro-{item['id']},\n{body}\n}}"


#: What the Cite line offers per item type: (label, file extension), then provenance.
CITE_FORMATS = {"figure": (("PNG", "png"), ("SVG", "svg"), ("PDF", "pdf")),
                "table": (("CSV", "csv"), ("Markdown", "md"))}


def cite_line(item: dict[str, Any], base_url: str, bibtex: str) -> str:
    """The one-line HTML under a figure or table: *Cite · PNG · SVG · PDF · provenance*
    (tables: *Cite · CSV · Markdown · provenance*).

    "Cite" unfolds the item's BibTeX entry in place (a ``<details>`` element, no
    script) with a link to its ``.bib`` file; the other words link to the item's files
    under ``base_url`` (the folder of the item's files, as the page reaches it) and to
    its JSON sidecar. One HTML block without blank lines, so that Markdown keeps it whole.

    >>> line = cite_line({"id": "demo-t", "type": "table", "files": {"csv": {}}}, "t", "@misc{x}")
    >>> line.count("<a "), 'href="t/demo-t.csv"' in line, 'data-cite-for="demo-t"' in line
    (3, True, True)
    """
    import html

    item_id = item["id"]
    kind = "table" if item.get("type") == "table" else "figure"
    files = item.get("files") or {}
    base = base_url.rstrip("/") + "/" if base_url else ""
    links = [f'<a href="{html.escape(base + item_id)}.{ext}">{label}</a>'
             for label, ext in CITE_FORMATS[kind] if ext in files]
    links.append(f'<a href="{html.escape(base + item_id)}.json" title="The provenance '
                 f'sidecar: parameters, seed, device, commit, versions, checksums">provenance</a>')
    summary = " · ".join(['<span class="cite-toggle" title="Show the BibTeX entry">Cite</span>',
                          *links])
    return (f'<details class="cite-line" data-cite-for="{html.escape(item_id)}">'
            f"<summary>{summary}</summary>\n"
            f'<pre class="cite-bibtex">{html.escape(bibtex)}</pre>\n'
            f'<p class="cite-file"><a href="{html.escape(base + item_id)}.bib" download>'
            f"{html.escape(item_id)}.bib</a></p></details>\n")


def _write_citation(folder: Path, sidecar: dict[str, Any]) -> str:
    """Write ``<id>.bib`` beside the item's files, record it in ``sidecar["files"]``, and
    return the entry."""
    entry = bibtex_entry(sidecar)
    data = (entry + "\n").encode("utf-8")
    atomic_write_bytes(folder / f"{sidecar['id']}.bib", data)
    sidecar["files"]["bib"] = {"file": f"{sidecar['id']}.bib",
                               "sha256": hashlib.sha256(data).hexdigest()}
    return entry


def render_figure_bytes(fig, fmt: str) -> bytes:
    """The bytes of ``fig`` saved as ``fmt`` with fixed metadata (deterministic output)."""
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, metadata=_SAVE_METADATA[fmt], bbox_inches="tight")
    return buf.getvalue()


def save_figure(fig, figure_id: str, caption: str) -> dict[str, Any]:
    """Save ``fig`` as PNG, SVG and PDF with a JSON provenance sidecar, show it, close it.

    The figure appears on the chapter page as a numbered figure labelled ``figure_id``
    (reference it with ``{numref}`` in the prose). Files are written to
    ``<output>/figures/<figure_id>.{png,svg,pdf,json}``; the same inputs give the same
    bytes (no dates in the metadata, fixed SVG hash salt).

    Returns the sidecar as a dict.

    Raises
    ------
    TypeError
        ``fig`` is not a matplotlib Figure.
    ValueError
        A bad or already used ``figure_id``, an empty ``caption``. Nothing is written
        and the id stays free.
    """
    chapter = active_chapter()
    _check_id("figure_id", figure_id, chapter)
    if not isinstance(caption, str) or not caption.strip():
        raise ValueError("caption: expected a non-empty string saying what to see")
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    if not isinstance(fig, Figure):
        raise TypeError(f"fig: expected a matplotlib Figure, got {describe(fig)}")

    folder = chapter.output_dir / "figures"
    files = {}
    try:
        for fmt in ("png", "svg", "pdf"):
            data = render_figure_bytes(fig, fmt)
            path = folder / f"{figure_id}.{fmt}"
            atomic_write_bytes(path, data)
            files[fmt] = {"file": path.name, "sha256": hashlib.sha256(data).hexdigest()}
    finally:
        plt.close(fig)
    sidecar = {"id": figure_id, "type": "figure", "caption": caption.strip(),
               "files": files, **_provenance(chapter)}
    sidecar = Record(sidecar)
    bibtex = _write_citation(folder, sidecar)
    atomic_write_text(folder / f"{figure_id}.json", dumps(sidecar))
    _register_id("figure_id", figure_id, chapter)

    png = (folder / f"{figure_id}.png").read_bytes()
    import base64

    url = f"{chapter.asset_url}/figures/{figure_id}.png"
    markdown = (
        f"```{{figure}} {url}\n:name: {figure_id}\n:alt: {_one_line(caption)}\n\n"
        f"{caption.strip()}\n```\n\n"
        + cite_line(sidecar, f"{chapter.asset_url}/figures", bibtex)
    )
    data = base64.b64encode(png).decode("ascii")
    # The book renders the MyST text/markdown (nb_mime_priority_overrides); Jupyter,
    # Binder and Colab would show the {figure} directive as text, and pick this instead.
    import html

    figure_html = (f'<figure><img src="data:image/png;base64,{data}" '
                   f'alt="{html.escape(_one_line(caption))}" style="max-width:100%">'
                   f"<figcaption>{html.escape(caption.strip())}</figcaption></figure>")
    _display_markdown(markdown, {"image/png": data, "text/html": figure_html})
    return sidecar


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _format_cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        return f"{value:.4g}"
    text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(df) -> str:
    """A pipe table of a DataFrame (index dropped), floats to 4 significant digits."""
    header = "| " + " | ".join(_format_cell(c) for c in df.columns) + " |"
    rule = "| " + " | ".join("---" for _ in df.columns) + " |"
    rows = [
        "| " + " | ".join(_format_cell(v) for v in row) + " |"
        for row in df.itertuples(index=False, name=None)
    ]
    return "\n".join([header, rule, *rows]) + "\n"


def save_table(table, table_id: str, caption: str) -> dict[str, Any]:
    """Save a pandas DataFrame as CSV + Markdown with a JSON sidecar, and show it.

    Returns the sidecar as a dict.

    Raises
    ------
    TypeError
        ``table`` is not a pandas DataFrame.
    ValueError
        A bad or already used ``table_id``, an empty ``caption``. Nothing is written and
        the id stays free.
    """
    chapter = active_chapter()
    _check_id("table_id", table_id, chapter)
    if not isinstance(caption, str) or not caption.strip():
        raise ValueError("caption: expected a non-empty string saying what the table shows")
    import pandas as pd

    if not isinstance(table, pd.DataFrame):
        raise TypeError(f"table: expected a pandas DataFrame, got {type(table).__name__}")
    folder = chapter.output_dir / "tables"
    csv_bytes = table.to_csv(index=False).encode("utf-8")
    md_text = markdown_table(table)
    atomic_write_bytes(folder / f"{table_id}.csv", csv_bytes)
    atomic_write_text(folder / f"{table_id}.md", md_text)
    files = {
        "csv": {"file": f"{table_id}.csv", "sha256": hashlib.sha256(csv_bytes).hexdigest()},
        "md": {"file": f"{table_id}.md",
               "sha256": hashlib.sha256(md_text.encode("utf-8")).hexdigest()},
    }
    sidecar = {"id": table_id, "type": "table", "caption": caption.strip(), "files": files,
               "columns": [str(c) for c in table.columns], "rows": int(len(table)),
               **_provenance(chapter)}
    sidecar = Record(sidecar)
    bibtex = _write_citation(folder, sidecar)
    atomic_write_text(folder / f"{table_id}.json", dumps(sidecar))
    _register_id("table_id", table_id, chapter)
    markdown = (f"```{{table}} {_one_line(caption)}\n:name: {table_id}\n\n{md_text}```\n\n"
                + cite_line(sidecar, f"{chapter.asset_url}/tables", bibtex))
    _display_markdown(markdown, {"text/html": table.to_html(index=False)})
    return sidecar


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(float(x))


def _check_tolerance(tolerance: Any) -> float:
    """A tolerance: a real number >= 0 (infinity allowed: no constraint), else raise."""
    return check_number("tolerance", tolerance, minimum=0, finite=False)


_MEASURED = "a number or a bool (or a 1-element tensor)"


def _scalar_measured(measured: Any) -> Any:
    """``measured`` with a one-element tensor or array turned into its Python scalar."""
    if isinstance(measured, (list, tuple)) or not hasattr(measured, "item"):
        return measured
    shape = getattr(measured, "shape", None)
    if shape is not None and math.prod(shape) != 1:
        raise TypeError(f"measured: expected {_MEASURED}, got a tensor of shape {tuple(shape)}")
    if getattr(getattr(measured, "device", None), "type", None) == "meta":
        raise ValueError("measured: expected a tensor with values, got one on the meta device")
    try:
        return measured.item()
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"measured: expected {_MEASURED}, got {describe(measured)}") from exc


def acceptance_region(paper: Any, tolerance: Any, kind: str) -> tuple[float, float]:
    """The measured values ``[lo, hi]`` that agree with ``paper`` for a numeric ``kind``.

    - "abs": ``[p - tol, p + tol]``; "rel": ``[p - tol |p|, p + tol |p|]``;
    - "range": ``paper = (lo, hi)`` itself;
    - "at_most": ``(-inf, p + tol]``; "at_least": ``[p - tol, inf)`` (tolerance optional).

    >>> acceptance_region(-1.0, 0.5, "abs")
    (-1.5, -0.5)
    >>> acceptance_region(0.3, None, "at_least")
    (0.3, inf)
    """
    if kind not in CLAIM_KINDS or kind == "holds":
        raise ValueError(f"kind: expected one of {CLAIM_KINDS[1:]} (numeric), got {kind!r}")
    if kind == "range":
        if not (isinstance(paper, (tuple, list)) and len(paper) == 2
                and all(_is_number(v) for v in paper)):
            raise ValueError(f"paper: kind 'range' expects (lo, hi), got {paper!r}")
        lo, hi = float(paper[0]), float(paper[1])
        if lo > hi:
            raise ValueError(f"paper: kind 'range' expects lo <= hi, got {paper!r}")
        return lo, hi
    if not _is_number(paper):
        raise ValueError(f"paper: kind {kind!r} expects a number, got {paper!r}")
    if kind in ("abs", "rel") and tolerance is None:
        raise ValueError(f"tolerance: kind {kind!r} needs a tolerance")
    tol = 0.0 if tolerance is None else _check_tolerance(tolerance)
    p = float(paper)
    if kind == "abs":
        return p - tol, p + tol
    if kind == "rel":
        return p - tol * abs(p), p + tol * abs(p)
    if kind == "at_most":
        return -math.inf, p + tol
    return p - tol, math.inf


def _check_interval(interval: Any) -> tuple[float, float]:
    if not (isinstance(interval, (tuple, list)) and len(interval) == 2):
        raise ValueError(f"interval: expected (lo, hi), got {interval!r}")
    if hasattr(interval[0], "item"):
        interval = tuple(v.item() for v in interval)
    if not all(_is_number(v) for v in interval) or float(interval[0]) > float(interval[1]):
        raise ValueError(f"interval: expected finite numbers lo <= hi, got {interval!r}")
    return float(interval[0]), float(interval[1])


def judge_claim(measured: Any, paper: Any, tolerance: Any, kind: str,
                interval: Any = None) -> str:
    """The verdict of a claim: "reproduced", "differs", "inconclusive" or "not comparable".

    - paper == "not available" (or None): not comparable, we have no value to compare;
    - kind "holds": ``measured`` is a bool saying whether the statement holds;
    - numeric kinds: ``measured`` agrees when it lies in :func:`acceptance_region`
      ("abs": |measured - paper| <= tolerance; "rel": <= tolerance * |paper|; "range":
      lo <= measured <= hi; "at_most": measured <= paper + tolerance; "at_least":
      measured >= paper - tolerance).
    - with ``interval = (lo, hi)`` (the uncertainty interval of ``measured``, e.g. a
      bootstrap interval) the interval decides instead of the point: reproduced when it
      lies inside the acceptance region, differs when it lies wholly outside, and
      inconclusive when it straddles the region's boundary.
    A measurement that is NaN or infinite differs.

    >>> judge_claim(-0.95, -1.0, 0.5, "abs", interval=(-1.1, -0.8))
    'reproduced'
    >>> judge_claim(0.36, 0.342, None, "at_least", interval=(0.33, 0.39))
    'inconclusive'
    """
    if kind not in CLAIM_KINDS:
        raise ValueError(f"kind: expected one of {CLAIM_KINDS}, got {kind!r}")
    if paper is None or (isinstance(paper, str) and paper == "not available"):
        return "not comparable"
    if kind == "holds":
        if interval is not None:
            raise ValueError("interval: kind 'holds' takes no interval")
        if not isinstance(measured, bool):
            raise TypeError(f"measured: kind 'holds' expects a bool, got {type(measured).__name__}")
        return "reproduced" if measured else "differs"
    if isinstance(paper, str):
        raise ValueError(f"paper: kind {kind!r} needs a number or (lo, hi), got {paper!r}")
    accept_lo, accept_hi = acceptance_region(paper, tolerance, kind)
    if not _is_number(measured):
        if isinstance(measured, float) or hasattr(measured, "item"):
            return "differs"
        raise TypeError(f"measured: kind {kind!r} expects a number, got {measured!r}")
    if interval is not None:
        lo, hi = _check_interval(interval)
        if accept_lo <= lo and hi <= accept_hi:
            return "reproduced"
        if hi < accept_lo or lo > accept_hi:
            return "differs"
        return "inconclusive"
    m = float(measured)
    return "reproduced" if accept_lo <= m <= accept_hi else "differs"


_ADMONITION_CLASS = {"reproduced": "tip", "differs": "warning", "inconclusive": "caution",
                     "not comparable": "note", "holds": "tip", "fails": "warning"}


def describe_value(value: Any) -> str:
    if isinstance(value, bool):
        return "holds" if value else "does not hold"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return f"[{describe_value(value[0])}, {describe_value(value[1])}]"
    return str(value)


def _check_evidence(evidence: Any, chapter: "Chapter") -> list[str]:
    """``evidence`` as a list of figure/table ids of ``chapter`` (prefix checked)."""
    if evidence is None:
        return []
    ids = [evidence] if isinstance(evidence, str) else evidence
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, str) for i in ids):
        raise TypeError(f"evidence: expected a figure/table id or a list of ids, got {evidence!r}")
    for i in ids:
        if not (_ID_RE.match(i) and i.startswith(chapter.prefix + "-")):
            raise ValueError(f"evidence: expected ids of this chapter's figures or tables "
                             f"(prefix {chapter.prefix!r}), got {i!r}")
    return list(ids)


def claim(claim_id: str, measured: Any, *, paper: Any = None, tolerance: Any = None,
          reference: str, kind: str, statement: str, interval: Any = None,
          role: str = "paper", evidence: Any = None) -> dict[str, Any]:
    """Record a checked statement and show it on the chapter page.

    Parameters
    ----------
    claim_id : kebab-case id prefixed by the chapter prefix.
    measured : what we measured: a number, or a bool for kind "holds".
    paper : what the paper says: a number, a (lo, hi) tuple, "qualitative" (with kind
        "holds"), or "not available" / None (verdict "not comparable"). For a check, the
        threshold we set ourselves.
    tolerance : for kinds "abs", "rel" (required), "at_most", "at_least" (optional slack).
    reference : where the paper says it (section / figure / theorem), or "this chapter".
    kind : "holds", "abs", "rel", "range", "at_most" or "at_least" (see judge_claim).
    statement : one sentence saying what is checked.
    interval : optional ``(lo, hi)``, the uncertainty interval of ``measured`` (e.g. a
        bootstrap over windows, paths or seeds). The verdict is then "inconclusive" when
        the interval straddles the threshold (see :func:`judge_claim`).
    role : "paper" (default), a statement of the paper: verdict reproduced / differs /
        inconclusive / not comparable; or "check", our own statement (a target, an
        implementation check, another paper's or a fact sheet's statement): verdict holds /
        fails / inconclusive, never counted as a reproduction.
    evidence : optional id (or list of ids) of the figures and tables of this chapter
        that support the claim; the reproduction report links to them.

    Returns
    -------
    The claim record (dict) with its "verdict".

    Raises
    ------
    TypeError
        ``measured`` of the wrong type for ``kind`` (a tensor of several elements, a
        number for "holds"), a ``tolerance`` that is not a number.
    ValueError
        A bad or already used ``claim_id``, an empty ``reference`` or ``statement``, an
        unknown ``kind`` or ``role``, a ``paper``, ``tolerance`` or ``interval`` that does
        not fit ``kind``. Nothing is written and the id stays free.
    """
    chapter = active_chapter()
    _check_id("claim_id", claim_id, chapter)
    if not isinstance(reference, str) or not reference.strip():
        raise ValueError("reference: expected the section/figure of the paper, or 'this chapter'")
    if not isinstance(statement, str) or not statement.strip():
        raise ValueError("statement: expected one sentence saying what is checked")
    if role not in ROLES:
        raise ValueError(f"role: expected one of {ROLES}, got {role!r}")
    measured = _scalar_measured(measured)
    if tolerance is not None:
        _check_tolerance(tolerance)
    if isinstance(paper, list):
        paper = tuple(paper)
    if interval is not None:
        interval = _check_interval(interval)
    evidence = _check_evidence(evidence, chapter)
    verdict = judge_claim(measured, paper, tolerance, kind, interval=interval)
    if role == "check":
        if verdict == "not comparable":
            raise ValueError("paper: a check needs the threshold it is judged against")
        verdict = CHECK_VERDICTS[verdict]
    record = Record({
        "id": claim_id, "type": "claim", "role": role, "statement": _one_line(statement),
        "reference": reference, "kind": kind, "paper": paper, "measured": measured,
        "interval": interval, "tolerance": tolerance, "verdict": verdict,
        "evidence": evidence, **_provenance(chapter),
    })
    atomic_write_text(chapter.output_dir / "claims" / f"{claim_id}.json", dumps(record))
    _register_id("claim_id", claim_id, chapter)
    paper_text = describe_value(paper if paper is not None else "not available")
    tol_text = "" if tolerance is None else f" · tolerance {describe_value(tolerance)}"
    ci_text = "" if interval is None else f" (interval {describe_value(interval)})"
    what = "Claim" if role == "paper" else "Check"
    source = f"Paper ({reference})" if role == "paper" else f"Threshold ({reference})"
    markdown = (
        f"```{{admonition}} {what} {claim_id}: {verdict}\n"
        f":class: {_ADMONITION_CLASS[verdict]}\n"
        f":name: {claim_id}\n\n{_one_line(statement)}\n\n"
        f"{source}: **{paper_text}** · measured: **{describe_value(measured)}**{ci_text}"
        f"{tol_text} · check: `{kind}`\n```\n"
    )
    _display_markdown(markdown)
    return record
