"""Where the benchmarks keep their results, and how each one writes its own.

Every ``bench_<topic>.py`` ends with :func:`write_results`: ``results/<topic>.json`` (the
numbers, read by the chapters and by ``summary.py``) and ``results/<topic>.md`` (the
table a reader sees), printed as well. The folder is git-ignored.
"""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(topic: str, result: dict, markdown: str) -> None:
    """Write ``results/<topic>.json`` and ``results/<topic>.md``; print the Markdown."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{topic}.json").write_text(json.dumps(result, indent=2))
    (RESULTS / f"{topic}.md").write_text(markdown)
    print()
    print(markdown)
