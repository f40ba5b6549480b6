"""Runner: parameters, success, cache, failure with stale marking, interrupt, pages."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from companion import runner
from companion.runner import ChapterError, run_chapter


def quiet(_line: str) -> None:
    pass


def test_parse_parameters_reads_literals_in_order():
    src = 'scale = "ci"\nseed = 0\ndevice = "auto"\nn = 16  # size\nrate = 0.5\nname = None\n'
    assert runner.parse_parameters(src) == {
        "scale": "ci", "seed": 0, "device": "auto", "n": 16, "rate": 0.5, "name": None}


@pytest.mark.parametrize("src, match", [
    ('scale = "ci"\nseed = 0\n', "device"),
    ('scale = "ci"\nseed = 0\ndevice = "auto"\nn = 2 * 8\n', "literal"),
    ('scale = "ci"\nseed = 0\ndevice = "auto"\nimport os\n', "only 'name = literal'"),
])
def test_parse_parameters_rejects(src, match):
    with pytest.raises(ChapterError, match=match):
        runner.parse_parameters(src)


DEFAULTS = {"scale": "ci", "seed": 0, "device": "auto", "n": 16, "rate": 0.5, "flag": False}


def test_resolve_parameters_coerces_cli_strings():
    got = runner.resolve_parameters(DEFAULTS, {"n": "32", "rate": "1", "flag": "true",
                                               "scale": "smoke"})
    assert got == {**DEFAULTS, "n": 32, "rate": 1.0, "flag": True, "scale": "smoke"}


@pytest.mark.parametrize("overrides, match", [
    ({"nn": "3"}, r"unknown parameter 'nn'; valid parameters: scale \(str"),
    ({"n": "3.5"}, "parameter 'n': expected a int"),
    ({"n": "many"}, "parameter 'n': expected a int"),
    ({"flag": "maybe"}, "parameter 'flag': expected a bool"),
    ({"scale": "huge"}, "scale: expected one of"),
    ({"device": "tpu"}, "device: expected one of"),
    ({"n": True}, "expected an int"),
])
def test_resolve_parameters_errors(overrides, match):
    with pytest.raises(ChapterError, match=match):
        runner.resolve_parameters(DEFAULTS, overrides)


def test_run_success_cache_and_force(demo_project):
    p = demo_project
    res = run_chapter(p, "demo", scale="smoke", echo=quiet)
    assert res.status == "ok", res.error
    nb = json.loads(p.notebook("demo").read_text())
    box = [c for c in nb["cells"] if runner.BOX_TAG in c["metadata"].get("tags", [])]
    assert len(box) == 1
    assert "python -m companion run demo --scale smoke" in "".join(box[0]["source"])
    assert "".join(nb["cells"][0]["source"]).startswith("# Demo chapter"), "title stays first"
    assert (p.assets("demo") / "figures" / "demo-random-walk.png").exists()
    assert (p.assets("demo") / "claims" / "demo-mean-small.json").exists()
    outputs = json.dumps([c.get("outputs", []) for c in nb["cells"]])
    assert "sha256" not in outputs, "a save_figure ending a cell must not print its sidecar"
    record = json.loads(p.run_record("demo").read_text())
    assert record["status"] == "ok" and record["parameters"]["scale"] == "smoke"
    assert not (p.generated / ".staging").exists()

    png = (p.assets("demo") / "figures" / "demo-random-walk.png").read_bytes()
    assert run_chapter(p, "demo", scale="smoke", echo=quiet).status == "cached"
    assert run_chapter(p, "demo", scale="smoke", overrides={"n": "21"},
                       echo=quiet).status == "ok", "a new parameter value is a cache miss"
    assert run_chapter(p, "demo", scale="smoke", echo=quiet).status == "ok"
    # Same seed, same parameters: identical figure bytes after re-execution.
    forced = run_chapter(p, "demo", scale="smoke", force=True, echo=quiet)
    assert forced.status == "ok"
    assert (p.assets("demo") / "figures" / "demo-random-walk.png").read_bytes() == png


def test_source_change_is_a_cache_miss(demo_project):
    p = demo_project
    assert run_chapter(p, "demo", scale="smoke", echo=quiet).status == "ok"
    src = p.source("demo")
    src.write_text(src.read_text() + "\nMore prose.\n")
    assert run_chapter(p, "demo", scale="smoke", echo=quiet).status == "ok"


def test_failure_keeps_previous_outputs_marked_stale(demo_project):
    from companion.pages import figure_index

    p = demo_project
    assert run_chapter(p, "demo", scale="smoke", echo=quiet).status == "ok"
    png_path = p.assets("demo") / "figures" / "demo-random-walk.png"
    before = png_path.read_bytes()
    lines: list[str] = []
    res = run_chapter(p, "demo", scale="smoke", overrides={"fail_at": "compute"},
                      echo=lines.append)
    assert res.status == "failed"
    # The demo's compute cell is the chapter's 3rd code cell: name cell and exception.
    assert "raised RuntimeError: deliberate failure for the tests" in res.error
    assert res.error.startswith("cell ")
    assert any(line.startswith("[FAILED") and "demo" in line for line in lines)
    assert png_path.read_bytes() == before, "previous good figure kept"
    nb = json.loads(p.notebook("demo").read_text())
    banners = [c for c in nb["cells"] if runner.STALE_TAG in c["metadata"].get("tags", [])]
    assert len(banners) == 1 and "Stale outputs" in "".join(banners[0]["source"])
    assert "deliberate failure" in "".join(banners[0]["source"])
    record = json.loads(p.run_record("demo").read_text())
    assert record["status"] == "failed" and record["last_good"]["status"] == "ok"
    assert "STALE" in figure_index(p)
    assert not (p.generated / ".staging").exists()
    # A later good run removes the banner.
    assert run_chapter(p, "demo", scale="smoke", echo=quiet).status == "ok"
    nb = json.loads(p.notebook("demo").read_text())
    assert not [c for c in nb["cells"] if runner.STALE_TAG in c["metadata"].get("tags", [])]


def test_failed_cell_number_counts_chapter_cells(demo_project):
    """The reported cell number is the cell of the chapter as written (1-based)."""
    p = demo_project
    res = run_chapter(p, "demo", scale="smoke", overrides={"fail_at": "compute"}, echo=quiet)
    nb = runner.read_notebook(p.source("demo"))
    number = int(res.error.split()[1])
    assert "deliberate failure" in nb.cells[number - 1].source


def _cli(project, *args, **kw):
    return subprocess.run([sys.executable, "-m", "companion", *args, "--root", str(project.root)],
                          capture_output=True, text=True, **kw)


def test_cli_reports_bad_parameters(demo_project):
    proc = _cli(demo_project, "run", "demo", "-p", "bogus", "1")
    assert proc.returncode == 2
    assert "unknown parameter 'bogus'" in proc.stderr and "valid parameters" in proc.stderr
    proc = _cli(demo_project, "run", "nochapter")
    assert proc.returncode == 2 and "available chapters: demo" in proc.stderr


def test_cli_failure_exits_nonzero(demo_project):
    proc = _cli(demo_project, "run", "demo", "--scale", "smoke", "-p", "fail_at", "compute")
    assert proc.returncode == 1
    assert "[FAILED" in proc.stdout and "RuntimeError" in proc.stdout


def test_interrupt_leaves_no_partial_files(demo_project):
    p = demo_project
    assert run_chapter(p, "demo", scale="smoke", echo=quiet).status == "ok"
    published = {f: f.read_bytes() for f in p.generated.rglob("*") if f.is_file()}
    proc = subprocess.Popen([sys.executable, "-m", "companion", "run", "demo", "--root",
                             str(p.root), "--scale", "smoke", "--force", "-p",
                             "sleep_seconds", "30"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (p.generated / ".staging").exists() and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(3)  # let the kernel start executing
    os.kill(proc.pid, signal.SIGINT)
    proc.wait(timeout=60)
    assert proc.returncode != 0
    assert not (p.generated / ".staging").exists(), "staging folder removed on Ctrl-C"
    for f, data in published.items():
        if f.parent.name in ("runs", "logs") or f.name.endswith(".ipynb"):
            continue
        assert f.read_bytes() == data, f"{f} changed"
    leftovers = [f for f in p.generated.rglob("*.tmp")]
    assert not leftovers


def test_staging_of_a_killed_run_is_removed(demo_project):
    p = demo_project
    dead = p.generated / ".staging" / "demo-999999999-deadbeef"
    dead.mkdir(parents=True)
    (dead / "demo.ipynb").write_text("{}")
    assert run_chapter(p, "demo", scale="smoke", echo=quiet).status == "ok"
    assert not dead.exists()
