"""``python -m companion``: run chapters, build the book, check the built HTML.

    python -m companion run CHAPTER [--scale S] [--device D] [-p NAME VALUE]... [--force]
    python -m companion build [--scale S] [--device D] [--jobs N] [--chapters a,b] [--force]
    python -m companion pages                 # regenerate figure index + report only
    python -m companion check-html [--build-dir DIR]
    python -m companion list                  # chapters and their parameters
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from companion.provenance import SCALES, repo_root
from companion.runner import DEVICE_CHOICES, ChapterError, Project


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
    run.add_argument("--root", type=Path, default=None, dest="root_sub")

    build = sub.add_parser("build", help="execute the chapters, then build the HTML book")
    build.add_argument("--scale", choices=SCALES)
    build.add_argument("--device", help=f"one of {DEVICE_CHOICES} or cuda:N")
    build.add_argument("--jobs", type=int, default=1, help="chapters executed in parallel")
    build.add_argument("--chapters", default=None, help="comma-separated chapter names")
    build.add_argument("--force", action="store_true")
    build.add_argument("--root", type=Path, default=None, dest="root_sub")

    pages = sub.add_parser("pages", help="regenerate the figure index and reproduction report")
    pages.add_argument("--root", type=Path, default=None, dest="root_sub")

    check = sub.add_parser("check-html", help="open every page in headless Chromium")
    check.add_argument("--build-dir", type=Path, default=None)
    check.add_argument("--root", type=Path, default=None, dest="root_sub")

    lst = sub.add_parser("list", help="chapters and their parameters")
    lst.add_argument("--root", type=Path, default=None, dest="root_sub")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    root = getattr(args, "root_sub", None) or args.root or repo_root()
    project = Project(root)
    try:
        if args.command == "run":
            from companion.runner import run_chapter

            overrides = {}
            for name, value in args.param:
                if name in overrides:
                    raise ChapterError(f"parameter {name!r} given twice")
                overrides[name] = value
            result = run_chapter(project, args.chapter, scale=args.scale, device=args.device,
                                 overrides=overrides, force=args.force, threads=args.threads)
            return 0 if result.status in ("ok", "cached") else 1
        if args.command == "build":
            from companion.runner import build

            chapters = [c.strip() for c in args.chapters.split(",")] if args.chapters else None
            if args.jobs < 1:
                raise ChapterError(f"--jobs: expected a positive integer, got {args.jobs}")
            return build(project, scale=args.scale, device=args.device, jobs=args.jobs,
                         chapters=chapters, force=args.force)
        if args.command == "pages":
            from companion.pages import write_generated_pages

            write_generated_pages(project)
            return 0
        if args.command == "check-html":
            from companion.htmlcheck import check_book

            build_dir = args.build_dir or project.build_dir / "html"
            report = check_book(project, build_dir)
            print(report.summary())
            return 0 if report.ok else 1
        if args.command == "list":
            from companion.runner import parameters_cell_index, parse_parameters, read_notebook

            for name in project.chapter_names():
                nb = read_notebook(project.source(name))
                params = parse_parameters(nb.cells[parameters_cell_index(nb)].source)
                print(f"{name}: " + ", ".join(f"{k}={v!r}" for k, v in params.items()))
            return 0
    except ChapterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: no partial outputs were published", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
