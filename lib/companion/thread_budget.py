"""A running chapter's share of the cores, which the book's build may change while it runs.

``build`` runs two chapters side by side, each with half the cores as torch threads. When
one ends, the other would go on alone at half the machine: at publish scale the
context-similarity corpus pass (most of an hour) would then leave a core idle for most of
its run. So the build gives each chapter a small file holding its current share
(:data:`ENV_THREAD_BUDGET`) and rewrites it whenever a chapter starts or ends; a long loop
calls :func:`adopt_thread_budget` between its pieces of work and takes the new share.

Only a count of threads changes, never what is computed: the loops that adopt a budget
give the same numbers at any thread count (the corpus pass, bit for bit: tested).
"""

from __future__ import annotations

import os
from pathlib import Path

#: The environment variable naming the budget file of this process (set by ``build``).
ENV_THREAD_BUDGET = "COMPANION_THREAD_BUDGET_FILE"


def write_thread_budget(path: str | os.PathLike, threads: int) -> None:
    """Set the budget at ``path`` to ``threads`` (at least 1), atomically: a reader sees
    the old count or the new one, never a partial file.

    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> write_thread_budget(f"{folder}/budget", 2)
    >>> read_thread_budget(f"{folder}/budget")
    2
    """
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads: expected a positive int, got {threads!r}")
    path = Path(path)
    staging = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    staging.write_text(f"{threads}\n")
    os.replace(staging, path)


def read_thread_budget(path: str | os.PathLike | None = None) -> int | None:
    """The count of threads the budget file ``path`` (default: the one named by
    :data:`ENV_THREAD_BUDGET`) allows, or None when there is no such file or it does not
    hold a positive int (then the process keeps what it has).

    >>> read_thread_budget("/nonexistent/budget") is None
    True
    """
    if path is None:
        path = os.environ.get(ENV_THREAD_BUDGET)
        if not path:
            return None
    try:
        value = int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None
    return value if value >= 1 else None


def adopt_thread_budget() -> int:
    """Set torch's intra-op threads to this process's budget (:func:`read_thread_budget`)
    when there is one and it differs; return the count now in force. Cheap (one small
    file read): call it between pieces of work, never inside a parallel region.

    >>> import torch
    >>> adopt_thread_budget() == torch.get_num_threads()
    True
    """
    import torch

    wanted = read_thread_budget()
    if wanted is not None and wanted != torch.get_num_threads():
        torch.set_num_threads(wanted)
    return torch.get_num_threads()
