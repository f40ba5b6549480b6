"""Collect every benchmark's Markdown result into benchmarks/results/SUMMARY.md and print it."""
from __future__ import annotations

import platform

import torch
from results_io import RESULTS



def main() -> None:
    parts = [
        "# Benchmark summary",
        "",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}, Python {platform.python_version()}.",
        "",
    ]
    for md in sorted(RESULTS.glob("*.md")):
        if md.name == "SUMMARY.md":
            continue
        parts += [md.read_text().strip(), ""]
    text = "\n".join(parts) + "\n"
    (RESULTS / "SUMMARY.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
