"""Shared fixtures: a throw-away book project built around the real configuration, and the
smoke book: one project with every real chapter, shared by all test processes of a run."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

# Threads of torch's OpenMP runtime that wait at the end of a parallel region sleep at once
# instead of spinning first (OpenMP's default). The two test workers each run torch on both
# cores, with the kernels, rank and worker processes they start (which inherit this): the
# cores are shared, and a spinning thread takes them from the threads with work. Two
# test_hasse_empirical.py runs side by side took 49 s, and 19 s with this (load 6-7). How
# threads wait, not how the work is split: the same results. Set before torch is imported
# (the OpenMP runtime reads it when it loads); a value set outside is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parents[1]
FIXTURE_CHAPTERS = Path(__file__).parent / "fixtures" / "chapters"
CHAPTERS = sorted(p.stem for p in (REPO / "chapters").glob("*.md"))
# The chapter tests/test_smoke_book.py runs twice with one seed: gradient_flow is the
# fastest chapter at smoke scale (12 s alone, 24 s on a loaded machine; the others took
# 27-37 s there), and none of its tables, figures or claims holds a timing (hasse and
# sbm_transformer report seconds).
REPEATED_CHAPTER = "gradient_flow"

# Test files that take longest, run first (with `make test`'s --no-loadscope-reorder the
# xdist workers take files in collection order): the chapters' smoke runs, then the files
# of many runs and processes, then the longest files of small tests, so that the last
# files a worker takes are short (a long file last left the other worker idle for its
# length). The other files keep their order. The smoke book's HTML test comes fifth, not
# second: it needs every chapter's run, and in the same file as the same-seed test it made
# both workers ask for the same chapters at once (in one timeline of `make test` a worker
# waited 13.5 s and 4 s for chapters the other ran); by the time it is taken, they are done.
SLOW_FILES_FIRST = ("test_chapters_smoke.py", "test_smoke_book.py", "test_runner.py",
                    "test_portable_notebook.py", "test_smoke_book_pages.py",
                    "test_runner_interrupts.py",
                    "test_lra_training.py", "test_pages_and_book.py",
                    "test_context_similarity.py", "test_gpu_scripts.py", "test_sbm.py",
                    "test_hasse_empirical.py", "test_lra_tasks.py",
                    "test_fast_equals_reference.py", "test_reachability.py",
                    "test_gradient_flow.py", "test_parallel.py", "test_segmentation.py",
                    "test_edge_attention.py", "test_publishing.py")


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        name = item.path.name
        return SLOW_FILES_FIRST.index(name) if name in SLOW_FILES_FIRST else len(SLOW_FILES_FIRST)

    items.sort(key=rank)  # stable: the order inside a file and among the rest is kept


def toc_yaml(chapters: list[str]) -> str:
    lines = ["format: jb-book", "root: book/intro", "parts:", "  - caption: Findings",
             "    chapters:", "      - file: book/_generated/findings", "  - caption: Chapters",
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


def demo_project_after_one_run(parent: Path):
    """A demo project under ``parent`` whose chapter has run once at smoke scale (the
    start of the runner tests that need a good published run)."""
    from companion.book.runner import Project, run_chapter

    project = Project(make_project(parent / "book-project",
                                   {"demo": FIXTURE_CHAPTERS / "demo.md"}))
    result = run_chapter(project, "demo", scale="smoke", echo=lambda _line: None)
    assert result.status == "ok", result.error
    return project


def copy_project(project, root: Path):
    """A copy of ``project`` at ``root`` (its links kept as links), with what it ran."""
    from companion.book.runner import Project

    shutil.copytree(project.root, root, symlinks=True)
    return Project(root)


@pytest.fixture(scope="session")
def demo_ran_once(tmp_path_factory):
    """The demo project after one good run at smoke scale, made once per pytest run and
    shared by the workers (as :func:`smoke_book`). Read-only: tests take a copy
    (:func:`ran_demo_project`), so each starts from the same good published run."""
    import filelock

    from companion.book.runner import Project

    shared = _run_shared_folder(tmp_path_factory)
    folder = shared / "demo-ran-once"
    with filelock.FileLock(str(shared / "demo-ran-once.lock")):
        if not (folder / "done").exists():  # written once the run succeeded
            shutil.rmtree(folder, ignore_errors=True)
            demo_project_after_one_run(folder)
            (folder / "done").write_text("")
    return Project(folder / "book-project")


@pytest.fixture
def ran_demo_project(demo_ran_once, tmp_path):
    """A demo project whose chapter has run once at smoke scale: a copy of the one run of
    this pytest run, so that a test that starts from a good run needs no run of its own."""
    return copy_project(demo_ran_once, tmp_path / "book-project")


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


def _run_shared_folder(tmp_path_factory) -> Path:
    """A folder all processes of this pytest run see: the parent of the xdist workers'
    base folders, or the base folder of a run without workers."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def smoke_book(tmp_path_factory):
    """The project of every real chapter, made once per pytest run and shared by the
    workers: each chapter runs in it once at smoke scale (:func:`run_smoke`), whichever
    test asks first; later asks wait for that run (the runner's chapter lock) and get it
    from the cache."""
    import filelock

    from companion.book.runner import Project

    shared = _run_shared_folder(tmp_path_factory)
    root = shared / "smoke-book"
    with filelock.FileLock(str(shared / "smoke-book.lock")):
        if not (root / "_toc.yml").exists():  # make_project writes the toc last
            make_project(root, {name: REPO / "chapters" / f"{name}.md" for name in CHAPTERS})
    return Project(root)


def run_smoke(project, name: str):
    """Run chapter ``name`` of the smoke book at smoke scale on the CPU, or wait for the
    run another test started, and return its result; fail with the log if it failed.

    The project is new in each pytest run, so a "cached" result is a good run of this
    pytest run, made by another test (maybe in another worker).
    """
    from companion.book import runner

    lines: list[str] = []
    result = runner.run_chapter(project, name, scale="smoke", device="cpu",
                                echo=lines.append)
    assert result.status in ("ok", "cached"), f"{name}: {result.error}\n" + "\n".join(lines)
    assert result.record["status"] == "ok" and result.record["parameters"]["scale"] == "smoke"
    return result


def held_by_another_run(project, name: str) -> bool:
    """Whether another run holds chapter ``name``'s lock now (the runner's
    ``locks/<name>.lock``): a hint for the order of :func:`run_smoke_free_first` only (the
    run itself waits for the lock, whatever this said)."""
    import filelock

    from companion.book import runner

    lock = runner.chapter_lock_file(project, name)
    try:
        lock.acquire(blocking=False)
    except filelock.Timeout:
        return True
    lock.release()
    return False


def run_smoke_free_first(project, names: list[str]) -> None:
    """:func:`run_smoke` for every chapter of ``names``, in that order, except that a
    chapter another run holds (another worker's test runs it) is left for later, as long
    as one that none holds is left: this worker runs those meanwhile instead of waiting.
    The same runs and results as asking in order; only who waits when differs."""
    left = list(names)
    while left:
        name = next((n for n in left if not held_by_another_run(project, n)), left[0])
        run_smoke(project, name)
        left.remove(name)
