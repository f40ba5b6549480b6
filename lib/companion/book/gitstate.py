"""Where the repository is, and which commit (clean or dirty) a run comes from."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

# The runner computes the commit once and hands it to the chapters it executes.
ENV_COMMIT = "COMPANION_GIT_COMMIT"
ENV_DIRTY = "COMPANION_GIT_DIRTY"


def repo_root(start: Path | None = None) -> Path:
    """The repository root: the nearest folder above ``start`` holding ``_config.yml``
    and ``lib/companion``; else the checkout of an editable install; else (the library
    installed from a wheel, a notebook run outside any clone) the current folder."""
    here = Path(start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if _is_checkout(folder):
            return folder
    package_checkout = Path(__file__).resolve().parents[3]  # lib/companion/book/gitstate.py
    return package_checkout if _is_checkout(package_checkout) else here


def _is_checkout(folder: Path) -> bool:
    return (folder / "_config.yml").exists() and (folder / "lib" / "companion").exists()


def git_state(root: Path | None = None) -> tuple[str, bool]:
    """Return (commit, dirty) of the repository at ``root``; ("unknown", False) outside git.

    The runner computes this once and passes it through the environment
    (:data:`ENV_COMMIT`, :data:`ENV_DIRTY`), so chapters report the commit of the run
    that executed them.
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
