"""Whether a chapter's published run is current: what its outputs depend on (the chapter,
the files its front matter names, ``lib/``, its parameters and processes, the installed
packages) hashed into a cache key, and the chapter's lock that a run holds while it
checks and replaces the published run.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from companion.book.interrupts import signals_deferred
from companion.book.parameters import check_nproc, prepare_chapter
from companion.book.project import ChapterError, Project, load_record


@dataclass
class RunResult:
    """What one run of a chapter came to: status "ok", "cached" or "failed"."""

    name: str
    status: str  # "ok" | "cached" | "failed"
    seconds: float = 0.0
    error: str | None = None
    record: dict[str, Any] = field(default_factory=dict)


def installed_versions() -> list[str]:
    """``name==version`` of every installed distribution, sorted (part of the cache key).

    Read from the first lines of each distribution's metadata file rather than through
    ``Distribution.metadata``, whose e-mail parser reads the whole file (ten times
    slower); the strings are the same.
    """
    from importlib import metadata

    return sorted(_name_and_version(d) for d in metadata.distributions())


def _name_and_version(dist) -> str:
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    name = version = None
    for line in text.split("\n"):
        if not line.strip():  # the end of the headers
            break
        if name is None and line.startswith("Name:"):
            name = line[len("Name:"):].strip()
        elif version is None and line.startswith("Version:"):
            version = line[len("Version:"):].strip()
    return f"{(name or '').lower()}=={version}"


def chapter_front_matter(project: Project, name: str) -> dict[str, Any]:
    """The ``companion:`` mapping of the YAML front matter of ``chapters/<name>.md``
    (empty when the chapter has none); ChapterError when it is not a mapping."""
    import yaml

    text = project.source(name).read_text()
    if not text.startswith("---"):
        return {}
    end = text.find("\n---", 3)
    meta = yaml.safe_load(text[3:end]) if end > 0 else None
    section = (meta or {}).get("companion") if isinstance(meta, dict) else None
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ChapterError(f"{name}: front matter companion must be a mapping, "
                           f"got {type(section).__name__}")
    return section


def chapter_inputs(project: Project, name: str) -> list[Path]:
    """The files a chapter reads besides the library, from its front matter.

    A chapter lists them (paths or globs, relative to the project root) under
    ``companion: inputs:`` in the YAML front matter of ``chapters/<name>.md``; e.g. the
    SBM chapter reads the benchmark results it draws. They enter the cache key, so a new
    ``make bench`` re-executes the chapter. Files that do not exist are simply absent.
    """
    patterns = chapter_front_matter(project, name).get("inputs") or []
    if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
        raise ChapterError(f"{name}: front matter companion.inputs must be a list of paths")
    return sorted({path for pattern in patterns for path in project.root.glob(pattern)
                   if path.is_file()})


def cache_key(project: Project, name: str, params: dict[str, Any], nproc: int = 1,
              versions: list[str] | None = None) -> str:
    """Hash of everything a chapter's outputs depend on (``nproc``: its processes;
    ``versions``: :func:`installed_versions`, computed here when not given)."""
    h = hashlib.sha256()
    h.update(project.source(name).read_bytes())
    for path in chapter_inputs(project, name):
        h.update(str(path.relative_to(project.root)).encode())
        h.update(path.read_bytes())
    for path in sorted((project.lib_dir).rglob("*.py")):
        h.update(str(path.relative_to(project.lib_dir)).encode())
        h.update(path.read_bytes())
    h.update(json.dumps(params, sort_keys=True, default=str).encode())
    h.update(f"nproc={nproc}".encode())
    h.update("\n".join(installed_versions() if versions is None else versions).encode())
    return h.hexdigest()


def is_cached(project: Project, name: str, previous: dict[str, Any] | None, key: str) -> bool:
    """Whether the published run ``previous`` of ``name`` is good and has cache key ``key``."""
    return bool(previous and previous.get("status") == "ok"
                and previous.get("cache_key") == key and project.notebook(name).exists())


def cached_result(name: str, previous: dict[str, Any],
                  echo: Callable[[str], None]) -> RunResult:
    """The "cached" RunResult of the current published run ``previous``, echoed."""
    echo(f"[cached] {name}: unchanged since {previous['finished']} (use --force to re-run)")
    return RunResult(name, "cached", 0.0, record=previous)


def chapter_lock_file(project: Project, name: str):
    """The chapter's lock, ``locks/<name>.lock`` (its folder made), not yet acquired: a
    :class:`filelock.FileLock`."""
    import filelock

    path = project.generated / "locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    return filelock.FileLock(str(path))


@contextlib.contextmanager
def chapter_lock(project: Project, name: str, echo: Callable[[str], None]):
    """Hold ``locks/<name>.lock``; if another run holds it, say so and wait for it."""
    import filelock

    lock = chapter_lock_file(project, name)
    try:
        lock.acquire(blocking=False)
    except filelock.Timeout:
        echo(f"[waiting] {name}: another run of this chapter holds {lock.lock_file}; "
             "waiting for it to finish")
        lock.acquire()
    try:
        yield
    finally:
        with signals_deferred():
            lock.release()


def cached_run(project: Project, name: str, *, scale: str | None, device: str | None,
               nproc: int | None, echo: Callable[[str], None],
               versions: list[str] | None = None) -> RunResult | None:
    """The cached result of running ``name`` with these settings, without starting a
    process, or None when it must run (or cannot say: the run then reports why).

    What :func:`companion.book.runner.run_chapter` checks before it executes, done by
    :func:`companion.book.build.run_many` for each chapter first, so that an unchanged
    chapter costs no process. It holds the chapter's lock while it looks; when another
    run holds it, the answer is None (the run waits).
    """
    import filelock

    try:
        params = prepare_chapter(project, name, scale, device).params
        nproc = check_nproc(nproc)
    except ChapterError:
        return None
    lock = chapter_lock_file(project, name)
    try:
        lock.acquire(blocking=False)
    except filelock.Timeout:
        return None
    try:
        previous = load_record(project, name)
        key = cache_key(project, name, params, nproc, versions)
        if not is_cached(project, name, previous, key):
            return None
        return cached_result(name, previous, echo)
    finally:
        lock.release()
