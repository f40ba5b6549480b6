"""A notebook downloaded from the book runs outside a clone, in a fresh virtualenv.

The runner puts a hidden install cell first in every executed notebook (see
``runner.install_cell_source``): when ``companion`` does not import, it pip-installs the
library at the notebook's commit and the corpora. The repository address is a
placeholder here, so the test installs from a copy of the local checkout instead
(``COMPANION_INSTALL_SOURCE``, with ``--no-deps --no-build-isolation``).

To stay fast, the fresh virtualenv sees the dependencies already installed in ``.venv``
through one path line in a ``.pth`` file. Python adds that folder to ``sys.path`` but
does not process the ``.pth`` files inside it, so ``.venv``'s editable install of
``companion`` (itself a ``.pth`` line pointing at ``lib/``) stays invisible: the test
checks that ``companion`` is not importable before the install cell runs.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from companion.book import runner

REPO = Path(__file__).resolve().parents[1]
# The cheapest real chapter at smoke scale in a fresh kernel (gradient_flow 19 s, hasse and
# sbm_transformer 30 s each, one after the other at load 4.6); with two threads or more its
# simulations start worker processes, which import the freshly installed companion too.
CHAPTER = "gradient_flow"


def _fresh_venv(folder: Path) -> Path:
    """A virtualenv without pip or packages of its own that sees ``.venv``'s packages."""
    proc = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)],
                          capture_output=True, text=True)
    python = folder / "bin" / "python"
    if proc.returncode != 0 or not python.exists():
        pytest.skip(f"cannot create a virtualenv here (python -m venv: {proc.stderr.strip()})")
    purelib = subprocess.run([str(python), "-c",
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    clone_packages = sysconfig.get_paths()["purelib"]
    (Path(purelib) / "clone-dependencies.pth").write_text(clone_packages + "\n")
    return python


def _checkout_copy(folder: Path) -> Path:
    """What pip needs to build the package from the local checkout, outside the tree (a
    build writes its egg-info beside the sources)."""
    folder.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, folder / name)
    shutil.copytree(REPO / "lib", folder / "lib",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return folder


def _kernelspec(folder: Path, python: Path) -> Path:
    spec = folder / "kernels" / "fresh-venv"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "fresh virtualenv", "language": "python"}))
    return folder


def _probe(python: Path, cwd: Path, env: dict) -> dict:
    code = ("import importlib.util, json, sys; print(json.dumps({"
            "'companion': importlib.util.find_spec('companion') is not None, "
            "'torch': importlib.util.find_spec('torch') is not None, 'prefix': sys.prefix}))")
    out = subprocess.run([str(python), "-c", code], cwd=cwd, env=env, capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out)


def test_downloaded_notebook_runs_in_a_fresh_virtualenv(smoke_book, tmp_path, monkeypatch):
    import nbclient
    import nbformat
    from conftest import run_smoke

    # 1. The runner makes the notebook, as for the book: the smoke book's run of the
    # chapter (made once per pytest run, shared with tests/test_chapters_smoke.py).
    run_smoke(smoke_book, CHAPTER)
    downloaded = tmp_path / "downloads" / f"{CHAPTER}.ipynb"
    downloaded.parent.mkdir()
    shutil.copy(smoke_book.notebook(CHAPTER), downloaded)

    # 2. A reader's machine: a fresh virtualenv outside the clone, companion not importable.
    python = _fresh_venv(tmp_path / "fresh-venv")
    reader = tmp_path / "reader"
    reader.mkdir()
    for name in list(os.environ):
        if name.startswith("COMPANION_") or name in ("PYTHONPATH", "PYTHONHOME"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("JUPYTER_PATH", str(_kernelspec(tmp_path / "jupyter", python)))
    monkeypatch.setenv(runner.ENV_INSTALL_SOURCE, str(_checkout_copy(tmp_path / "checkout")))
    monkeypatch.setenv(runner.ENV_PIP_ARGS,
                       "--no-deps --no-build-isolation --ignore-installed --no-index")
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    corpora = REPO / ".cache" / "corpora"  # installed by make setup: nothing to fetch
    monkeypatch.setenv("COMPANION_DATA_DIR", str(corpora if corpora.is_dir()
                                                 else tmp_path / "corpora"))
    before = _probe(python, reader, dict(os.environ))
    assert before["torch"], "the fresh virtualenv sees .venv's dependencies"
    assert not before["companion"], ".venv's editable install must stay invisible"
    assert Path(before["prefix"]).resolve() == (tmp_path / "fresh-venv").resolve()
    assert REPO not in reader.resolve().parents

    # 3. Execute it there, to the end, and see where companion came from.
    nb = nbformat.read(str(downloaded), as_version=4)
    first = nb.cells[0]
    assert runner.INSTALL_TAG in first.metadata["tags"] and "remove-cell" in first.metadata["tags"]
    nb.cells.append(nbformat.v4.new_code_cell(
        "import companion; print('FROM', companion.__file__)"))
    # safety limits only (a loaded machine): a kernel start in a cold virtualenv, and the
    # wait for a cell's last output after its reply, raised on, never silently dropped
    client = nbclient.NotebookClient(nb, kernel_name="fresh-venv", timeout=600,
                                     startup_timeout=600, iopub_timeout=300,
                                     raise_on_iopub_timeout=True,
                                     resources={"metadata": {"path": str(reader)}})
    client.execute()  # raises CellExecutionError if any cell fails

    install_output = "".join(o.get("text", "") for o in nb.cells[0].outputs)
    assert "installing" in install_output, install_output
    origin = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    assert str((tmp_path / "fresh-venv").resolve()) in origin, origin
    figures = list((reader / "companion-outputs" / CHAPTER / "figures").glob("*.png"))
    assert figures, "the chapter wrote its figures beside the notebook"
    after = _probe(python, reader, dict(os.environ))
    assert after["companion"], "installed into the fresh virtualenv"
