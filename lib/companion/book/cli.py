"""``python -m companion``: run chapters, build the book, check the built HTML.

    python -m companion run CHAPTER [--scale S] [--device D] [-p NAME VALUE]... [--force]
                                    [--timeout SECONDS] [--nproc N] [--out DIR | --publish]
    python -m companion build [--scale SPEC] [--device D] [--jobs N] [--chapters a,b]
                              [--force] [--timeout SECONDS] [--nproc N]
    python -m companion pages                 # regenerate figure index + report only
    python -m companion check-html [--build-dir DIR] [--force]
    python -m companion list                  # chapters and their parameters

run --out DIR: the documented way to explore parameters. The run (executed notebook,
figures, tables, claims, log, run.json and an HTML page DIR/html/CHAPTER.html) goes into
DIR and the book (book/_generated/) is left as it is, byte for byte. Without --out a run
replaces the book's page, so parameters other than the chapter's defaults (-p) are
refused there unless --publish says that this is meant.

build --scale SPEC: one scale for every chapter (smoke, ci, paper); "publish": each
chapter at the largest scale it reaches on a CPU (runner.PUBLISH_SCALES: paper for hasse,
gradient_flow, context_similarity; ci for sbm_transformer; what `make publish` builds);
or CHAPTER=SCALE items, with at most one plain scale for the chapters not named, e.g.
hasse=paper,gradient_flow=paper,context_similarity=paper,sbm_transformer=ci.

--nproc N: processes for a chapter's scale-out (the context-similarity corpus pass and
LRA training run under torchrun with N processes); the kernel sees COMPANION_NPROC=N,
and N is part of the cache key. Default 1.

Progress: each run prints its log path when it starts (the kernel's output, live), then
every 30 s (COMPANION_PROGRESS_SECONDS) the cell it is executing, "cell k of N".

Exit codes: 0 success (check-html: also when skipped because Chromium or chromedriver
is missing, with the reason printed); 1 a chapter failed (or check-html found a
problem); 2 bad input (unknown chapter, scale or parameter, bad --timeout or --nproc, a
CUDA device this machine lacks, a refused non-default run or --out folder, no built book
for check-html); 130 interrupted by Ctrl-C (SIGINT), 143 by SIGTERM, with the published
outputs whole.

check-html: a page whose HTML, loaded files (css, js, MathJax, images), linked files and
checker (its code, the Chromium version) are unchanged since it passed is not re-opened
(the passes are recorded in <build dir>/../.htmlcheck-cache.json); --force opens every
page.

--timeout: the longest one cell may run, in seconds; by default smoke 600, ci 1800,
paper 86400. A cell that runs longer fails the chapter, naming the cell.
A second run of a chapter that is being run waits for the first (it says so).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from companion.book.chapter import SCALES
from companion.book.gitstate import repo_root
from companion.book.runner import (CELL_TIMEOUT_SECONDS, DEVICE_CHOICES, ChapterError, Project,
                              RunInterrupted, interrupt_guard)


def _seconds(text: str) -> float:
    """argparse type of --timeout: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(
            f"expected a positive number of seconds, got {text!r}")
    return value


def _processes(text: str) -> int:
    """argparse type of --nproc: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer number of processes, got {text!r}")
    return value


def _say(line: str) -> None:
    """Progress lines, flushed at once (a build reads its runs' output as it comes)."""
    print(line, flush=True)


_NPROC_HELP = ("processes for the chapters' scale-out under torchrun (the kernel's "
               "COMPANION_NPROC; part of the cache key; default 1)")

_TIMEOUT_HELP = ("longest time one cell may run, in seconds (default per scale: "
                 + ", ".join(f"{k} {v:g}" for k, v in CELL_TIMEOUT_SECONDS.items()) + ")")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m companion", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=None,
                   help="project root (folder with _toc.yml); default: this repository")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="execute one chapter into book/_generated/")
    run.add_argument("chapter")
    run.add_argument("--scale", choices=SCALES)
    run.add_argument("--device", help=f"one of {DEVICE_CHOICES} or cuda:N")
    run.add_argument("-p", "--param", nargs=2, action="append", default=[],
                     metavar=("NAME", "VALUE"), help="set a chapter parameter")
    run.add_argument("--force", action="store_true", help="re-execute even if cached")
    run.add_argument("--threads", type=int, default=None, help="torch threads for the kernel")
    run.add_argument("--timeout", type=_seconds, default=None, metavar="SECONDS",
                     help=_TIMEOUT_HELP)
    run.add_argument("--nproc", type=_processes, default=None, metavar="N", help=_NPROC_HELP)
    where = run.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, default=None, metavar="DIR",
                       help="write the run (notebook, figures, tables, claims, HTML page) "
                            "into DIR and leave the book untouched: to explore parameters")
    where.add_argument("--publish", action="store_true",
                       help="allow non-default parameters (-p) to replace the book's page")
    run.add_argument("--root", type=Path, default=None, dest="root_sub")
    # for `build`: where the run leaves its status as JSON (runner.write_result_file)
    run.add_argument("--result-file", type=Path, default=None, help=argparse.SUPPRESS)

    build = sub.add_parser("build", help="execute the chapters, then build the HTML book")
    build.add_argument("--scale", default=None, metavar="SPEC",
                       help=f"one of {', '.join(SCALES)}; 'publish' (each chapter at the "
                            "largest scale a CPU reaches); or CHAPTER=SCALE,... items")
    build.add_argument("--device", help=f"one of {DEVICE_CHOICES} or cuda:N")
    build.add_argument("--jobs", type=int, default=1, help="chapters executed in parallel")
    build.add_argument("--chapters", default=None, help="comma-separated chapter names")
    build.add_argument("--force", action="store_true")
    build.add_argument("--timeout", type=_seconds, default=None, metavar="SECONDS",
                       help=_TIMEOUT_HELP)
    build.add_argument("--nproc", type=_processes, default=None, metavar="N",
                       help=_NPROC_HELP)
    build.add_argument("--root", type=Path, default=None, dest="root_sub")

    pages = sub.add_parser("pages", help="regenerate the figure index and reproduction report")
    pages.add_argument("--root", type=Path, default=None, dest="root_sub")

    check = sub.add_parser("check-html", help="open every page in headless Chromium")
    check.add_argument("--build-dir", type=Path, default=None)
    check.add_argument("--force", action="store_true",
                       help="open every page, also those unchanged since they passed")
    check.add_argument("--root", type=Path, default=None, dest="root_sub")

    lst = sub.add_parser("list", help="chapters and their parameters")
    lst.add_argument("--root", type=Path, default=None, dest="root_sub")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        # First thing: SIGINT/SIGTERM become a recorded interrupt, checked again at the
        # end, so one swallowed on the way is still an interrupt (runner.interrupt_guard).
        with interrupt_guard():
            return _main(argv)
    except KeyboardInterrupt as exc:
        print("interrupted: the published outputs are whole (the previous ones, or the "
              "new ones where publishing had finished)", file=sys.stderr)
        return exc.exit_code if isinstance(exc, RunInterrupted) else 130


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    root = getattr(args, "root_sub", None) or args.root or repo_root()
    project = Project(root)
    try:
        if args.command == "run":
            from companion.book.runner import run_chapter, write_result_file

            overrides = {}
            for name, value in args.param:
                if name in overrides:
                    raise ChapterError(f"parameter {name!r} given twice")
                overrides[name] = value
            result = run_chapter(project, args.chapter, scale=args.scale, device=args.device,
                                 overrides=overrides, force=args.force, threads=args.threads,
                                 timeout=args.timeout, nproc=args.nproc, out=args.out,
                                 publish_non_default=args.publish, echo=_say)
            if args.result_file is not None:
                write_result_file(args.result_file, result)
            return 0 if result.status in ("ok", "cached") else 1
        if args.command == "build":
            from companion.book.runner import build

            chapters = [c.strip() for c in args.chapters.split(",")] if args.chapters else None
            if args.jobs < 1:
                raise ChapterError(f"--jobs: expected a positive integer, got {args.jobs}")
            return build(project, scale=args.scale, device=args.device, jobs=args.jobs,
                         chapters=chapters, force=args.force, timeout=args.timeout,
                         nproc=args.nproc, echo=_say)
        if args.command == "pages":
            from companion.book.pages import write_generated_pages

            write_generated_pages(project)
            return 0
        if args.command == "check-html":
            from companion.book.htmlcheck import check_book
            from companion.book.htmlcheck_cache import cache_file

            build_dir = args.build_dir or project.build_dir / "html"
            report = check_book(project, build_dir, cache=cache_file(build_dir),
                                force=args.force, echo=_say)
            print(report.summary())
            return report.exit_code
        if args.command == "list":
            from companion.book.runner import (PUBLISH_SCALES, parameters_cell_index,
                                          parse_parameters, read_notebook)

            for name in project.chapter_names():
                nb = read_notebook(project.source(name))
                params = parse_parameters(nb.cells[parameters_cell_index(nb)].source)
                published = (f" [published at {PUBLISH_SCALES[name]}]"
                             if name in PUBLISH_SCALES else "")
                print(f"{name}{published}: "
                      + ", ".join(f"{k}={v!r}" for k, v in params.items()))
            return 0
    except ChapterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
