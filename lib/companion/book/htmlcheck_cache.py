"""The browser check's memory: a page that passed is not re-opened while nothing it read
has changed.

A passing check of a page (:func:`companion.book.htmlcheck.check_book`) is recorded under
a key: the SHA-256 of

- the checker: the source of :mod:`companion.book.htmlcheck`, of
  :mod:`companion.book.htmlpage` (its HTML rules) and of this module (what is
  checked, the widths, the scripts run in the page), the Chromium and chromedriver
  versions (their ``--version``), the paths they were found at, the selenium and
  Python versions, and the system's font files (names, sizes and times: text widths,
  hence a page's layout, depend on them) (:func:`checker_fingerprint`);
- the page's path and the bytes of every file the browser loaded for it: the page
  itself and what it pulled in (style sheets, scripts, MathJax and its fonts, images),
  as the local server saw the requests and as the page's resource timing lists them
  (files served from the browser's cache included); a file asked for and missing counts
  as missing;
- whether each file that a relative link or image of the rendered page names exists
  (what :func:`~companion.book.htmlcheck.broken_links` and the Cite lines look up).

A later check finds the page *unchanged* when the same key comes out of the files as
they are now, and reports it passed without opening it. Anything else (a changed byte,
a file that appeared or vanished, another Chromium, an edit of the checker) opens it in
the browser as before. Only passes are recorded, and only when the check ran to its end:
a page that fails is removed from the cache; an interrupted check writes nothing. A
page that loaded something from another host is not recorded (its outcome depends on
more than these files).

The cache is one JSON file next to the build (``<build>/../.htmlcheck-cache.json``,
:func:`cache_file`), written atomically; an unreadable one is ignored with a message
(every page is then checked) and replaced after the check.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import posixpath
import subprocess
import sys
import urllib.parse
import uuid
from datetime import datetime, timezone
from pathlib import Path

#: The format of the cache file; a file of another format is ignored.
CACHE_FORMAT = 1
CACHE_NAME = ".htmlcheck-cache.json"


def cache_file(build_dir: str | os.PathLike) -> Path:
    """Where the passing checks of the book built at ``build_dir`` are recorded: next to
    it, not in it (the folder is what gets published).

    >>> cache_file("book/_build/html").as_posix()
    'book/_build/.htmlcheck-cache.json'
    """
    return Path(build_dir).parent / CACHE_NAME


#: Where fonts that Chromium lays text out with live (fontconfig's folders on Linux,
#: the system's on macOS); those that exist are stamped by :func:`font_files_stamp`.
FONT_DIRS = ("/usr/share/fonts", "/usr/local/share/fonts", "/etc/fonts", "~/.fonts",
             "~/.local/share/fonts", "/System/Library/Fonts", "/Library/Fonts")


def font_files_stamp(dirs=FONT_DIRS) -> str:
    """SHA-256 of the path, size and modification time of every file under ``dirs``
    (those that exist): another font installed, removed or updated changes it."""
    h = hashlib.sha256()
    for top in dirs:
        for folder, _subdirs, files in sorted(os.walk(os.path.expanduser(top))):
            for name in sorted(files):
                path = os.path.join(folder, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def tool_versions(browser: str, driver: str) -> dict[str, str]:
    """What the check runs on: Chromium's and chromedriver's ``--version`` (and where
    they are), selenium's and Python's version, the fonts (:func:`font_files_stamp`).
    Raises RuntimeError when a ``--version`` fails (the check cannot then be keyed)."""
    versions = {"chromium_path": str(Path(browser).resolve()),
                "chromedriver_path": str(Path(driver).resolve())}
    for name, program in (("chromium", browser), ("chromedriver", driver)):
        try:
            proc = subprocess.run([program, "--version"], capture_output=True, text=True,
                                  timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"{program} --version failed: {exc}") from None
        if proc.returncode != 0 or not proc.stdout.strip():
            raise RuntimeError(f"{program} --version exited {proc.returncode} "
                               f"printing {proc.stdout.strip()!r}")
        versions[name] = proc.stdout.strip()
    try:
        from importlib.metadata import version

        versions["selenium"] = version("selenium")
    except Exception:  # noqa: BLE001 - no selenium: the check itself says so
        versions["selenium"] = "none"
    versions["python"] = sys.version.split()[0]
    versions["fonts"] = font_files_stamp()
    return versions


def checker_fingerprint(versions: dict[str, str], code_files: list[Path]) -> str:
    """SHA-256 of the checker: ``versions`` (:func:`tool_versions`) and the bytes of
    ``code_files`` (the check's source).

    >>> a = checker_fingerprint({"chromium": "Chromium 1"}, [])
    >>> a == checker_fingerprint({"chromium": "Chromium 2"}, [])
    False
    """
    h = hashlib.sha256()
    h.update(json.dumps(sorted(versions.items())).encode())
    for path in code_files:
        h.update(b"\0" + Path(path).name.encode() + b"\0" + Path(path).read_bytes())
    return h.hexdigest()


def build_path(url: str, base: str) -> str | None:
    """The path in the build of ``url`` served from ``base`` (query and fragment
    dropped, ``%xx`` decoded; a folder stays a folder: ``""`` is the root), or None for
    a URL of another host or scheme.

    >>> build_path("http://127.0.0.1:80/_static/a%20b.css?digest=1#x", "http://127.0.0.1:80")
    '_static/a b.css'
    >>> build_path("http://127.0.0.1:80/", "http://127.0.0.1:80") is None
    False
    >>> build_path("https://cdn.example.org/x.js", "http://127.0.0.1:80") is None
    True
    """
    parts = urllib.parse.urlsplit(url)
    if f"{parts.scheme}://{parts.netloc}" != base.rstrip("/"):
        return None
    return _clean(parts.path)


def _clean(path: str) -> str:
    path = posixpath.normpath("/" + urllib.parse.unquote(path)).lstrip("/")
    return "" if path == "." else path


def is_local_url(url: str, base: str) -> bool:
    """Whether the browser fetched ``url`` from the book's server (or needed no host:
    ``data:``, ``blob:``, ``about:``)."""
    return build_path(url, base) is not None or urllib.parse.urlsplit(url).scheme in (
        "data", "blob", "about", "javascript")


@dataclasses.dataclass
class PageReads:
    """What the check of one page read: files the browser loaded (their bytes count),
    files the rendered page links to (their existence counts), and URLs of other hosts
    it loaded (a page with any is not recorded)."""

    loaded: set[str] = dataclasses.field(default_factory=set)
    linked: set[str] = dataclasses.field(default_factory=set)
    external: set[str] = dataclasses.field(default_factory=set)


class FileStates:
    """The state of files of a build as the check depends on them, each read once:
    ``content`` (a file's SHA-256, ``missing``; a folder as the server answers it: its
    ``index.html`` or its listing) and ``exists`` (``file`` or ``missing``)."""

    def __init__(self, build_dir: Path) -> None:
        self.build_dir = Path(build_dir)
        self._content: dict[str, str] = {}

    def content(self, rel: str) -> str:
        if rel not in self._content:
            self._content[rel] = self._read(self.build_dir / rel)
        return self._content[rel]

    def _read(self, path: Path) -> str:
        if path.is_dir():
            index = path / "index.html"
            if index.is_file():
                return "dir index " + self._read(index)
            names = "\n".join(sorted(p.name + ("/" if p.is_dir() else "")
                                     for p in path.iterdir()))
            return "dir listing " + hashlib.sha256(names.encode()).hexdigest()
        try:
            h = hashlib.sha256()
            with open(path, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
            return "sha256 " + h.hexdigest()
        except (FileNotFoundError, NotADirectoryError):
            return "missing"

    def exists(self, rel: str) -> str:
        return "file" if (self.build_dir / rel).is_file() else "missing"

    def modified_since(self, rels, since: float) -> bool:
        """Whether a file of ``rels`` was modified at or after the time ``since`` (during
        a check that started then: what it read may not be what is there now)."""
        for rel in rels:
            try:
                if (self.build_dir / rel).stat().st_mtime >= since:
                    return True
            except OSError:
                continue
        return False

    def missing(self, rels) -> list[str]:
        """The files of ``rels`` that are not there now (sorted)."""
        return sorted(rel for rel in set(rels) if not (self.build_dir / rel).exists())

    def of(self, loaded, linked) -> dict[str, dict[str, str]]:
        """The states of ``loaded`` (content) and ``linked`` (existence) files, sorted;
        a file both loaded and linked counts by its content."""
        loaded = sorted(set(loaded))
        return {"loaded": {rel: self.content(rel) for rel in loaded},
                "linked": {rel: self.exists(rel) for rel in sorted(set(linked) - set(loaded))}}


# How far before a check's start a file's mtime may lie and still count as written during
# it: Linux before 6.13 stamps files from a clock up to a timer tick (10 ms at HZ = 100)
# behind time.time(), so a file rewritten just after the start could look older.
CLOCK_MARGIN_S = 0.1


def page_key(fingerprint: str, page: str, reads: dict[str, dict[str, str]]) -> str:
    """The key of a check of ``page``: SHA-256 of the checker's ``fingerprint``, the
    page's path and the states of the files it read (:meth:`FileStates.of`)."""
    blob = json.dumps({"checker": fingerprint, "page": page, "reads": reads}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclasses.dataclass
class CachedPass:
    """A recorded passing check of a page."""

    key: str
    checker: str
    checked: str  # when (UTC, ISO 8601)
    images: int
    math: int
    reads: dict[str, dict[str, str]]
    screenshots: dict[str, list] = dataclasses.field(default_factory=dict)
    # width -> [file, size, mtime_ns]: the screenshots that check saved


def _screenshot_stamp(path: str) -> list:
    st = os.stat(path)
    return [path, st.st_size, st.st_mtime_ns]


def now_utc() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class CheckCache:
    """The passing checks recorded for one build folder (see the module doc).

    ``lookup`` says whether a page is unchanged since its passing check (or why not);
    ``record``/``forget`` stage a pass or a failure; ``save`` writes them, atomically,
    onto the file as it is then (so two checks at once lose nothing but their race).
    """

    def __init__(self, path: Path, build_dir: Path, fingerprint: str) -> None:
        self.path = Path(path)
        self.build_dir = Path(build_dir)
        self.fingerprint = fingerprint
        self.entries: dict[str, CachedPass] = {}
        self._changes: dict[str, CachedPass | None] = {}

    def _name(self, page: str) -> str:
        return f"{self.build_dir.name}/{page}"

    @classmethod
    def load(cls, path: Path, build_dir: Path, fingerprint: str) -> tuple[CheckCache, str]:
        """The cache at ``path`` and a note: empty, or why the file was ignored (then
        every page is checked, and the file is replaced after the check)."""
        cache = cls(path, build_dir, fingerprint)
        try:
            cache.entries = cls._read_entries(Path(path))
        except FileNotFoundError:
            return cache, ""
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            return cache, (f"check-html: ignoring the cache of passing checks {path} "
                           f"({type(exc).__name__}: {str(exc)[:200]}); every page is "
                           "checked in the browser")
        return cache, ""

    @staticmethod
    def _read_entries(path: Path) -> dict[str, CachedPass]:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
            raise ValueError(f"not a cache file of format {CACHE_FORMAT}")
        pages = data["pages"]
        if not isinstance(pages, dict):
            raise ValueError("'pages' is not a mapping")
        entries = {}
        for name, entry in pages.items():
            if not isinstance(entry, dict):
                raise ValueError(f"the entry of {name!r} is not a mapping")
            entries[name] = CachedPass(**entry)
            reads = entries[name].reads
            if set(reads) != {"loaded", "linked"} or not all(
                    isinstance(v, dict) for v in reads.values()):
                raise ValueError(f"the entry of {name!r} has no loaded/linked files")
        return entries

    def lookup(self, page: str, states: FileStates, screenshots: bool = False
               ) -> tuple[CachedPass | None, str]:
        """``(the recorded pass, "")`` when ``page`` is unchanged since it passed, else
        ``(None, why it must be checked)``. With ``screenshots``, the screenshots that
        check saved must still be there, unchanged."""
        entry = self.entries.get(self._name(page))
        if entry is None:
            return None, "no passing check recorded"
        if entry.checker != self.fingerprint:
            return None, ("the checker changed (its code, Chromium, chromedriver, selenium "
                          "or the fonts)")
        now = states.of(entry.reads["loaded"], entry.reads["linked"])
        if page_key(self.fingerprint, page, now) != entry.key:
            return None, _what_changed(page, entry.reads, now)
        if screenshots:
            try:
                same = all(_screenshot_stamp(shot[0]) == shot
                           for shot in entry.screenshots.values()) and entry.screenshots
            except OSError:
                same = False
            if not same:
                return None, "its screenshots are missing or were replaced"
        return entry, ""

    def record(self, page: str, reads: dict[str, dict[str, str]], images: int, math: int,
               screenshots: dict[int, str], checked: str) -> None:
        """Stage a passing check of ``page`` that read ``reads`` (:meth:`FileStates.of`)."""
        self._changes[self._name(page)] = CachedPass(
            key=page_key(self.fingerprint, page, reads), checker=self.fingerprint,
            checked=checked, images=images, math=math, reads=reads,
            screenshots={str(w): _screenshot_stamp(s) for w, s in screenshots.items()})

    def forget(self, page: str) -> None:
        """Stage the removal of ``page``'s entry (it failed)."""
        self._changes[self._name(page)] = None

    def save(self) -> None:
        """Apply the staged passes and removals to the file as it is now and write it
        atomically (a temporary file renamed over it). Entries of another checker, or
        of pages no longer in the build, are dropped."""
        try:
            entries = self._read_entries(self.path)
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            entries = {}
        for name, entry in self._changes.items():
            if entry is None:
                entries.pop(name, None)
            else:
                entries[name] = entry
        prefix = self.build_dir.name + "/"
        entries = {name: e for name, e in sorted(entries.items())
                   if e.checker == self.fingerprint and not (
                       name.startswith(prefix)
                       and not (self.build_dir / name[len(prefix):]).is_file())}
        data = {"format": CACHE_FORMAT,
                "about": "passing browser checks (companion.book.htmlcheck_cache); "
                         "safe to delete",
                "pages": {name: dataclasses.asdict(e) for name, e in entries.items()}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "x", encoding="utf-8") as fh:
                json.dump(data, fh, indent=1, sort_keys=True)
                fh.write("\n")
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.entries = entries
        self._changes = {}


def _what_changed(page: str, before: dict[str, dict[str, str]],
                  now: dict[str, dict[str, str]]) -> str:
    """Why a page's key changed, in a few words."""
    if before["loaded"].get(page) != now["loaded"].get(page):
        return "its HTML changed"
    loaded = [rel for rel, state in now["loaded"].items() if before["loaded"].get(rel) != state]
    linked = [rel for rel, state in now["linked"].items() if before["linked"].get(rel) != state]
    parts = []
    if loaded:
        parts.append(f"{len(loaded)} file(s) it loads changed: {loaded[:3]}")
    if linked:
        parts.append(f"{len(linked)} file(s) it links to appeared or vanished: {linked[:3]}")
    return "; ".join(parts) or "its key changed"


def since_text(times: list[str]) -> str:
    """``the passing check of T`` for one time, ``the passing checks of T1 to T2`` else.

    >>> since_text(["2026-12-02T02:00:00+00:00"] * 2)
    'the passing check of 2026-12-02T02:00:00+00:00'
    """
    first, last = min(times), max(times)
    if first == last:
        return f"the passing check of {first}"
    return f"the passing checks of {first} to {last}"
