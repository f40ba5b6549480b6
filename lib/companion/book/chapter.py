"""The running chapter: :func:`begin_chapter` validates its parameters, seeds the random
generators, sets the figure style and where outputs go, and remembers the chapter as the
active one (:func:`active_chapter`) that figures, tables and claims are saved for
(:mod:`companion.book.records`).

When the runner executes a chapter it tells the chapter (through the environment
variables below) where to write; run by hand, outputs go to
``book/_generated/assets/<chapter>/`` of the repository.
"""
from __future__ import annotations

import ast
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from companion._validate import check_choice, check_int, describe
from companion.book.files import now_iso
from companion.book.gitstate import repo_root

SCALES = ("smoke", "ci", "paper")

# Environment variables through which the runner talks to an executing chapter.
ENV_OUTPUT_DIR = "COMPANION_OUTPUT_DIR"
ENV_ASSET_URL = "COMPANION_ASSET_URL"
ENV_CHAPTER = "COMPANION_CHAPTER"
ENV_THREADS = "COMPANION_TORCH_THREADS"
# A file the chapter writes the device it resolved into ("cpu", "cuda"): the run record's
# device, without the runner importing torch (about 2 s) to learn what "auto" became.
ENV_DEVICE_FILE = "COMPANION_DEVICE_FILE"
# Every parameter of the run as papermill injected it (coerced), a Python literal: what
# begin_chapter records, so that a parameter not passed to it is recorded all the same.
ENV_PARAMETERS = "COMPANION_PARAMETERS"


def encode_parameters(params: dict[str, Any]) -> str:
    """``params`` as the runner hands them to the chapter (:data:`ENV_PARAMETERS`): a
    Python literal, so that a tuple stays a tuple.

    >>> run_parameters(encode_parameters({"seed": 0, "sizes": (1, 2), "model": None}))
    {'seed': 0, 'sizes': (1, 2), 'model': None}
    """
    text = repr(dict(params))
    try:
        same = ast.literal_eval(text) == params
    except (ValueError, SyntaxError):
        same = False
    if not same:
        raise ValueError(f"parameters: expected literal values, got {params!r}")
    return text


def run_parameters(text: str | None = None) -> dict[str, Any]:
    """The run's parameters the runner handed over (``text``, default
    ``$COMPANION_PARAMETERS``); empty outside the runner."""
    text = os.environ.get(ENV_PARAMETERS, "") if text is None else text
    if not text.strip():
        return {}
    params = ast.literal_eval(text)
    if not isinstance(params, dict):
        raise ValueError(f"{ENV_PARAMETERS}: expected a dict literal, got {text[:80]!r}")
    return params


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
    # the verdict and role of every claim recorded so far (the inventory reads them)
    verdicts: dict[str, str] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)

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


def seed_generators(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global random generators with ``seed``."""
    random.seed(seed)
    import numpy as np

    np.random.seed(seed % (2**32))
    import torch

    torch.manual_seed(seed)


def set_figure_style() -> None:
    """The book's matplotlib settings: fixed SVG hash salt (same figure, same bytes), dpi."""
    import matplotlib

    matplotlib.rcParams["svg.hashsalt"] = "attention-reproduced"
    matplotlib.rcParams["savefig.dpi"] = 150
    matplotlib.rcParams["figure.dpi"] = 110


def _output_location(name: str) -> tuple[Path, str]:
    """Where the chapter writes (the runner's staging folder, else the book's assets)."""
    if os.environ.get(ENV_OUTPUT_DIR):
        output_dir = Path(os.environ[ENV_OUTPUT_DIR])
        return output_dir, os.environ.get(ENV_ASSET_URL, str(output_dir))
    output_dir = repo_root() / "book" / "_generated" / "assets" / name
    return output_dir, str(output_dir)


def begin_chapter(name: str, **params: Any) -> Chapter:
    """Start a chapter: validate its parameters, seed generators, set the output folder.

    Parameters
    ----------
    name : the chapter's file stem (``"hasse"``, ``"gradient_flow"``, ...).
    **params : the chapter's parameters. ``scale`` (one of "smoke", "ci", "paper"),
        ``seed`` (int) and ``device`` ("auto", "cpu", "cuda") are required. Under the
        runner, every parameter of the run (``$COMPANION_PARAMETERS``: what papermill
        injected) is recorded besides, whether passed here or not; a value passed here
        wins.

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
    if told := os.environ.get(ENV_DEVICE_FILE):
        Path(told).write_text(device.type)

    env_chapter = os.environ.get(ENV_CHAPTER)
    if env_chapter and env_chapter != name:
        raise ValueError(
            f"name: the runner executes chapter {env_chapter!r} but the notebook calls "
            f"begin_chapter({name!r})"
        )
    recorded = {**(run_parameters() if env_chapter else {}), **params}
    output_dir, asset_url = _output_location(name)
    output_dir.mkdir(parents=True, exist_ok=True)

    seed_generators(params["seed"])
    if os.environ.get(ENV_THREADS):
        import torch

        torch.set_num_threads(max(1, int(os.environ[ENV_THREADS])))
    set_figure_style()

    _ACTIVE = Chapter(name=name, params=recorded, output_dir=output_dir,
                      asset_url=asset_url, device=device)
    return _ACTIVE


def active_chapter() -> Chapter:
    """The chapter :func:`begin_chapter` opened last; RuntimeError when there is none."""
    if _ACTIVE is None:
        raise RuntimeError(
            "no active chapter: call companion.book.begin_chapter(name, scale=..., "
            "seed=..., device=...) first"
        )
    return _ACTIVE
