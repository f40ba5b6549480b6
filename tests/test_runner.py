"""Runner: parameters, success, cache, failure with stale marking, pages, --out runs."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from companion.book import myst, runner
from companion.book.runner import ChapterError, run_chapter


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


# ran_demo_project (conftest): a copy of the one good demo run of this pytest run


def test_run_success_cache_force_and_the_pages_parameters_cell(demo_project):
    p = demo_project
    res = run_chapter(p, "demo", scale="smoke", echo=quiet)
    assert res.status == "ok", res.error
    nb = json.loads(p.notebook("demo").read_text())
    box = [c for c in nb["cells"] if runner.BOX_TAG in c["metadata"].get("tags", [])]
    assert len(box) == 1
    assert "python -m companion run demo --scale smoke" in "".join(box[0]["source"])
    shown = [c for c in nb["cells"] if "remove-cell" not in c["metadata"].get("tags", [])]
    assert "".join(shown[0]["source"]).startswith("# Demo chapter"), "title first on the page"
    assert runner.INSTALL_TAG in nb["cells"][0]["metadata"]["tags"], "install cell first"
    assert (p.assets("demo") / "figures" / "demo-random-walk.png").exists()
    assert (p.assets("demo") / "claims" / "demo-mean-small.json").exists()
    outputs = json.dumps([c.get("outputs", []) for c in nb["cells"]])
    assert "sha256" not in outputs, "a save_figure ending a cell must not print its sidecar"
    record = json.loads(p.run_record("demo").read_text())
    assert record["status"] == "ok" and record["parameters"]["scale"] == "smoke"
    # the kernel's peak resident memory: a Python kernel with torch is tens of MiB at least
    assert 0.02 < record["peak_memory_gib"] < 64
    assert "peak memory" in "".join(box[0]["source"])
    assert not (p.generated / ".staging").exists()

    png = (p.assets("demo") / "figures" / "demo-random-walk.png").read_bytes()
    assert run_chapter(p, "demo", scale="smoke", echo=quiet).status == "cached"
    # Same seed, same parameters: identical figure bytes after re-execution.
    forced = run_chapter(p, "demo", scale="smoke", force=True, echo=quiet)
    assert forced.status == "ok"
    assert (p.assets("demo") / "figures" / "demo-random-walk.png").read_bytes() == png
    # run again (forced): still one install cell, one scale banner, one run box
    nb = json.loads(p.notebook("demo").read_text())
    for tag in (runner.INSTALL_TAG, runner.SCALE_TAG, runner.BOX_TAG):
        assert sum(tag in c["metadata"].get("tags", []) for c in nb["cells"]) == 1, tag
    assert run_chapter(p, "demo", scale="smoke", overrides={"n": "21"},
                       echo=quiet).status == "ok", "a new parameter value is a cache miss"
    _assert_page_shows_one_parameters_cell_with_n_21(p)


def test_source_change_is_a_cache_miss(ran_demo_project):
    p = ran_demo_project
    src = p.source("demo")
    src.write_text(src.read_text() + "\nMore prose.\n")
    assert run_chapter(p, "demo", scale="smoke", echo=quiet).status == "ok"


def test_failure_keeps_previous_outputs_marked_stale(ran_demo_project):
    from companion.book.pages import figure_index

    p = ran_demo_project
    png_path = p.assets("demo") / "figures" / "demo-random-walk.png"
    before = png_path.read_bytes()
    lines: list[str] = []
    res = run_chapter(p, "demo", scale="smoke", overrides={"fail_at": "compute"},
                      echo=lines.append)
    assert res.status == "failed"
    # The demo's compute cell is the chapter's 3rd code cell: name cell and exception.
    assert "raised RuntimeError: deliberate failure for the tests" in res.error
    assert res.error.startswith("cell ")
    # The reported cell number is the cell of the chapter as written (1-based).
    number = int(res.error.split()[1])
    assert "deliberate failure" in runner.read_notebook(p.source("demo")).cells[number - 1].source
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


# The longest a command of a test may take (it would otherwise hang the suite).
SAFETY_DEADLINE = 300.0


def _cli(project, *args, **kw):
    return subprocess.run([sys.executable, "-m", "companion", *args, "--root", str(project.root)],
                          capture_output=True, text=True, **kw)


_TORCH_MARKER = "torch imported by the CLI process:"


def _cli_reporting_torch(project, *args, **kw):
    """:func:`_cli`, its stdout ending with whether the CLI's own process imported torch."""
    argv = ["companion", *args, "--root", str(project.root)]
    code = ("import runpy, sys\n"
            f"sys.argv = {argv!r}\n"
            "try:\n    runpy.run_module('companion', run_name='__main__', alter_sys=True)\n"
            "except SystemExit as stop:\n    status = stop.code\n"
            "else:\n    status = 0\n"
            f"print({_TORCH_MARKER!r}, 'torch' in sys.modules)\n"
            "sys.exit(status)\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, **kw)


def test_cli_reports_bad_parameters(demo_project):
    proc = _cli(demo_project, "run", "demo", "-p", "bogus", "1")
    assert proc.returncode == 2
    assert "unknown parameter 'bogus'" in proc.stderr and "valid parameters" in proc.stderr
    proc = _cli(demo_project, "run", "nochapter")
    assert proc.returncode == 2 and "available chapters: demo" in proc.stderr


def test_cli_failure_exits_nonzero(demo_project):
    proc = _cli(demo_project, "run", "demo", "--scale", "smoke", "-p", "fail_at", "compute",
                "--publish")
    assert proc.returncode == 1
    assert "[FAILED" in proc.stdout and "RuntimeError" in proc.stdout


# --------------------------------------------------------------------------- scales, nproc
CHAPTERS = ["hasse", "context_similarity", "gradient_flow", "sbm_transformer"]


def test_parse_scale_spec_plain_publish_and_mixed():
    assert runner.parse_scale_spec(None, CHAPTERS) == dict.fromkeys(CHAPTERS)
    assert runner.parse_scale_spec("ci", CHAPTERS) == dict.fromkeys(CHAPTERS, "ci")
    assert runner.parse_scale_spec("publish", CHAPTERS) == runner.PUBLISH_SCALES
    mixed = "hasse=paper,gradient_flow=paper,context_similarity=paper,sbm_transformer=ci"
    assert runner.parse_scale_spec(mixed, CHAPTERS) == runner.PUBLISH_SCALES
    assert runner.parse_scale_spec(" smoke , hasse = paper", CHAPTERS) == {
        "hasse": "paper", "context_similarity": "smoke", "gradient_flow": "smoke",
        "sbm_transformer": "smoke"}
    # A chapter not in PUBLISH_SCALES keeps its default; named chapters win over 'publish'.
    assert runner.parse_scale_spec("publish,sbm_transformer=smoke", ["demo", "sbm_transformer"]
                                   ) == {"demo": None, "sbm_transformer": "smoke"}
    assert set(runner.PUBLISH_SCALES.values()) <= set(runner.SCALES)


@pytest.mark.parametrize("spec, match", [
    ("huge", r"unknown scale 'huge'; expected one of smoke, ci, paper, 'publish'"),
    ("hasse=huge", r"unknown scale 'huge' for chapter 'hasse'"),
    ("nosuch=ci", r"unknown chapter 'nosuch' in 'nosuch=ci'; chapters: hasse"),
    ("ci,paper", "more than one default scale"),
    ("hasse=ci,hasse=paper", "chapter 'hasse' is given twice"),
    ("", "expected a scale"),
])
def test_parse_scale_spec_errors(spec, match):
    with pytest.raises(ChapterError, match=match):
        runner.parse_scale_spec(spec, CHAPTERS)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_check_nproc_rejects(bad):
    with pytest.raises(ChapterError, match="nproc: expected a positive integer"):
        runner.check_nproc(bad)


@pytest.mark.parametrize("args, match", [
    (["build", "--scale", "demo=huge"], "unknown scale 'huge' for chapter 'demo'"),
    (["build", "--scale", "nosuch=ci"], "unknown chapter 'nosuch'"),
    (["build", "--nproc", "0"], "--nproc: expected a positive integer number of processes"),
    (["run", "demo", "--nproc", "two"], "--nproc: expected a positive integer"),
    (["run", "demo", "--out", "x", "--publish"], "not allowed with argument"),
])
def test_cli_rejects_bad_scale_spec_and_nproc(demo_project, args, match):
    proc = _cli(demo_project, *args)
    assert proc.returncode == 2, proc.stderr
    assert match in proc.stderr, proc.stderr
    assert not demo_project.generated.exists() or not list(demo_project.generated.rglob(
        "*.ipynb")), "nothing ran"


def test_nproc_reaches_the_kernel_and_the_cache_key(ran_demo_project):
    p = ran_demo_project  # ran at the default nproc; the demo prints its COMPANION_NPROC
    params = {"scale": "smoke", "seed": 0, "device": "auto"}
    assert runner.cache_key(p, "demo", params, 2) != runner.cache_key(p, "demo", params, 1)
    assert json.loads(p.run_record("demo").read_text())["nproc"] == 1
    assert "NPROC=1" in p.notebook("demo").read_text()
    res = run_chapter(p, "demo", scale="smoke", nproc=2, echo=quiet)
    assert res.status == "ok", "another nproc is a cache miss"
    assert "NPROC=2" in p.notebook("demo").read_text()
    assert res.record["nproc"] == 2 and "--nproc 2" in res.record["command"]
    assert run_chapter(p, "demo", scale="smoke", nproc=2, echo=quiet).status == "cached"


# --------------------------------------------------------------------------- the page
def test_effective_parameters_source_keeps_comments_and_layout():
    src = ('scale = "ci"  # the scale\nseed = 0\nname = "é"\nsizes = (1,\n         2)\n'
           "rate = 0.5\n")
    got = runner.effective_parameters_source(
        src, {"scale": "smoke", "seed": 0, "name": "ü", "sizes": (3, 4), "rate": 0.5})
    assert got == 'scale = "smoke"  # the scale\nseed = 0\nname = "ü"\nsizes = (3, 4)\nrate = 0.5\n'
    # 1 == 1.0 but a float default overridden by an int-typed value is written anew
    assert runner.effective_parameters_source("x = 1\n", {"x": 1.0}) == "x = 1.0\n"
    assert runner.effective_parameters_source("", {}) == ""


def _assert_page_shows_one_parameters_cell_with_n_21(p):
    """The page of a run with ``-p n 21`` (the last run of
    test_run_success_cache_force_and_the_pages_parameters_cell) shows one parameters
    cell, papermill's, with the effective values."""
    nb = json.loads(p.notebook("demo").read_text())

    def tags(c):
        return c["metadata"].get("tags", [])

    params = [c for c in nb["cells"] if {"parameters", "injected-parameters"} & set(tags(c))]
    shown = [c for c in params if "remove-cell" not in tags(c)]
    assert len(params) == 2 and len(shown) == 1
    assert "injected-parameters" in tags(shown[0])
    source = "".join(shown[0]["source"])
    assert "n = 21\n" in source and 'scale = "smoke"' in source
    assert "# > 0 keeps the kernel busy" in source, "the chapter's comments stay"
    hidden = next(c for c in params if "parameters" in tags(c))
    assert "n = 20\n" in "".join(hidden["source"]), "the chapter's defaults kept, off the page"


def _record(**kw):
    record = {"chapter": "demo", "parameters": {"scale": "ci", "seed": 0, "device": "auto"},
              "defaults": {"scale": "ci", "seed": 0, "device": "auto"}, "device": "cpu",
              "git_commit": "0123456789abcdef0123456789abcdef01234567", "git_dirty": False,
              "repository": "https://github.com/o/r", "finished": "2026-01-01T00:00:00+00:00",
              "seconds": 1.5, "command": "python -m companion run demo", "nproc": 1}
    record.update(kw)
    return record


def test_scale_banner_says_the_scale_and_how_to_reach_paper_scale():
    below = runner.scale_banner(_record())
    assert "Run at ci scale, below the papers' settings" in below
    assert "`python -m companion run demo --scale paper --device auto -p seed 0`" in below
    paper = runner.scale_banner(_record(parameters={"scale": "paper", "seed": 0,
                                                    "device": "auto"}))
    assert "Run at paper scale" in paper and "below" not in paper
    sbm = runner.scale_banner(_record(chapter="sbm_transformer"))
    assert "--scale paper --device cuda" in sbm and "a GPU" in sbm
    out = runner.scale_banner(_record(out="/somewhere"))
    assert "--out DIR" in out and "--publish" not in out


def test_run_box_links_the_commit_and_has_a_real_header():
    box = myst.run_box(_record())
    assert "| | |" not in box and "| Setting | Value |" in box
    commit = "0123456789abcdef0123456789abcdef01234567"
    assert f"[`0123456789ab`](https://github.com/o/r/commit/{commit})" in box
    assert "--out DIR -p NAME VALUE" in box
    assert "[`" not in myst.run_box(_record(git_commit="unknown")), "no link to nowhere"
    assert "(with uncommitted changes)" in myst.run_box(_record(git_dirty=True))


def test_page_has_install_cell_banner_and_box_in_order(ran_demo_project):
    p = ran_demo_project
    nb = json.loads(p.notebook("demo").read_text())
    first = nb["cells"][0]
    assert first["cell_type"] == "code"
    assert first["metadata"]["tags"] == [runner.INSTALL_TAG, "remove-cell"]
    assert 'find_spec("companion") is None' in "".join(first["source"])
    assert "attention-reproduced @ git+" in "".join(first["source"])
    order = [t for c in nb["cells"] for t in c["metadata"].get("tags", [])
             if t in (runner.SCALE_TAG, runner.BOX_TAG)]
    assert order == [runner.SCALE_TAG, runner.BOX_TAG]
    assert "".join(nb["cells"][1]["source"]) == "# Demo chapter"
    assert runner.SCALE_TAG in nb["cells"][2]["metadata"]["tags"]
    # (a forced re-run still has one of each: test_run_success_cache_and_force)


def test_install_cell_installs_the_commit_and_corpora_extras():
    src = runner.install_cell_source("context_similarity", "https://github.com/o/r", "abc1234")
    assert "'attention-reproduced[nlp] @ git+https://github.com/o/r@abc1234'" in src
    assert '"-m", "companion.corpora", "install"' in src
    assert runner.ENV_INSTALL_SOURCE in src and runner.ENV_PIP_ARGS in src
    compile(src, "install-cell", "exec")  # plain Python: no IPython magics needed
    plain = runner.install_cell_source("hasse", "https://github.com/o/r", "unknown")
    assert "'attention-reproduced @ git+https://github.com/o/r@main'" in plain


# --------------------------------------------------------------------------- --out
def _all_files(folder):
    return {str(f.relative_to(folder)): f.read_bytes() for f in folder.rglob("*") if f.is_file()}


def test_out_run_writes_its_folder_and_leaves_the_book_byte_identical(ran_demo_project,
                                                                      tmp_path):
    p = ran_demo_project
    before = _all_files(p.generated)
    dirs_before = sorted(str(d) for d in p.generated.rglob("*"))
    out = tmp_path / "explore"
    proc = _cli_reporting_torch(p, "run", "demo", "--scale", "smoke", "-p", "seed", "1",
                                "--out", str(out), timeout=SAFETY_DEADLINE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the record's device is what the chapter's begin_chapter resolved "auto" to (it tells
    # the runner through COMPANION_DEVICE_FILE): the CLI never imports torch to ask
    assert f"{_TORCH_MARKER} False" in proc.stdout, proc.stdout
    assert _all_files(p.generated) == before, "the book is untouched, byte for byte"
    assert sorted(str(d) for d in p.generated.rglob("*")) == dirs_before, "nothing added"
    for rel in ("demo.ipynb", "demo.log", "run.json", "figures/demo-random-walk.png",
                "figures/demo-random-walk.json", "tables/demo-summary.csv",
                "claims/demo-mean-small.json", "html/demo.html"):
        assert (out / rel).is_file(), rel
    assert not list(out.glob(".staging-*"))
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "ok" and record["parameters"]["seed"] == 1
    assert record["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert not (out / ".device").exists() and ".device" not in record["files"]
    assert "--out" in record["command"]
    nb = (out / "demo.ipynb").read_text()
    assert runner.INSTALL_TAG in nb and runner.SCALE_TAG in nb
    assert "./figures/demo-random-walk.png" in nb, "figures referenced beside the notebook"
    html = (out / "html" / "demo.html").read_text()
    assert "Demo chapter" in html and "How this page was made" in html and "<img" in html
    # The same folder again: replaced. A folder holding something else: refused.
    proc = _cli(p, "run", "demo", "--scale", "smoke", "-p", "seed", "2", "--out", str(out),
                timeout=SAFETY_DEADLINE)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "run.json").read_text())["parameters"]["seed"] == 2
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    proc = _cli(p, "run", "demo", "--out", str(other))
    assert proc.returncode == 2 and "is not empty and holds no earlier --out run" in proc.stderr
    proc = _cli(p, "run", "demo", "--out", str(p.generated / "mine"))
    assert proc.returncode == 2 and "inside the book's own files" in proc.stderr
    assert _all_files(p.generated) == before


def test_record_device_is_what_the_chapter_resolved(ran_demo_project, tmp_path):
    """"auto" is recorded as the device the chapter's begin_chapter resolved, which it
    writes to the file the runner names (COMPANION_DEVICE_FILE); a device asked for is
    recorded as asked; where the chapter said nothing usable, torch is asked."""
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    record = json.loads(ran_demo_project.run_record("demo").read_text())
    assert record["device"] == expected and record["parameters"]["device"] == "auto"
    told = tmp_path / "device"
    told.write_text("cuda")
    assert runner.detected_device("auto", told) == "cuda"
    assert runner.detected_device("cpu", told) == "cpu"
    assert runner.detected_device("cuda:1", told) == "cuda:1"
    told.write_text("a chapter's garbage")
    assert runner.detected_device("auto", told) == expected
    assert runner.detected_device("auto", tmp_path / "never-written") == expected


def test_cli_refuses_non_default_parameters_into_the_book(demo_project):
    p = demo_project
    proc = _cli(p, "run", "demo", "--scale", "smoke", "-p", "seed", "1")
    assert proc.returncode == 2
    assert "-p seed 1 is not the chapter's default" in proc.stderr
    assert "python -m companion run demo --out DIR -p seed 1" in proc.stderr
    assert "--publish" in proc.stderr
    assert "[start]" not in proc.stdout and not p.notebook("demo").exists()
    with pytest.raises(ChapterError, match="not the chapter's default"):
        run_chapter(p, "demo", overrides={"n": 3}, publish_non_default=False, echo=quiet)


def test_the_pages_re_execute_command_is_accepted(ran_demo_project):
    """The command in the run box (defaults, with -p seed 0) needs no --publish."""
    import shlex

    p = ran_demo_project
    command = json.loads(p.run_record("demo").read_text())["command"]
    assert "-p seed 0" in command and "--publish" not in command
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "companion"]
    proc = _cli(p, *argv[3:], timeout=SAFETY_DEADLINE)
    assert proc.returncode == 0, proc.stderr


def test_chapter_inputs_enter_the_cache_key(demo_project):
    """A file named under companion.inputs in the front matter changes the cache key when
    it appears or changes; a chapter without the key has no inputs."""
    from companion.book.runner import ChapterError, cache_key, chapter_inputs

    project = demo_project
    source = project.source("demo")
    assert chapter_inputs(project, "demo") == []
    text = source.read_text()
    assert text.startswith("---\n")
    source.write_text("---\ncompanion:\n  inputs:\n    - results/*.json\n" + text[4:])
    params = {"scale": "smoke"}
    before = cache_key(project, "demo", params)
    (project.root / "results").mkdir()
    (project.root / "results" / "bench.json").write_text('{"x": 1}')
    assert chapter_inputs(project, "demo") == [project.root / "results" / "bench.json"]
    added = cache_key(project, "demo", params)
    (project.root / "results" / "bench.json").write_text('{"x": 2}')
    changed = cache_key(project, "demo", params)
    assert len({before, added, changed}) == 3
    source.write_text("---\ncompanion:\n  inputs: results/x.json\n" + text[4:])
    with pytest.raises(ChapterError, match="companion.inputs"):
        chapter_inputs(project, "demo")


# --------------------------------------------------------------------------- build's runs
def test_build_reports_a_current_chapter_cached_without_a_process(ran_demo_project,
                                                                   monkeypatch):
    def no_process(*args, **kwargs):
        raise AssertionError("a cached chapter must not start a process")

    p = ran_demo_project
    record = json.loads(p.run_record("demo").read_text())
    params = runner.prepare_chapter(p, "demo", "smoke").params
    # current even if lib/ changed since the run (other work in the same tree)
    record["cache_key"] = runner.cache_key(p, "demo", params)
    p.run_record("demo").write_text(json.dumps(record))
    monkeypatch.setattr(subprocess, "Popen", no_process)
    lines: list[str] = []
    results = runner.run_many(ran_demo_project, ["demo"], scale="smoke", device=None, jobs=2,
                              force=False, echo=lines.append)
    assert [(r.name, r.status) for r in results] == [("demo", "cached")]
    assert results[0].record["status"] == "ok"
    assert any(line.startswith("[cached] demo") for line in lines)


def test_a_child_runs_status_is_its_result_file_not_its_words(tmp_path, demo_project):
    """run_many reads the status a child wrote (``run --result-file``); a line that
    happens to say "[cached]" changes nothing, and a child without a result failed."""
    def finished_child(words: str, result: runner.RunResult | None):
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.json"
        if result is not None:
            runner.write_result_file(path, result)
        proc = subprocess.Popen([sys.executable, "-c", f"print({words!r})"],
                                stdout=subprocess.PIPE, text=True)
        out = proc.communicate()[0]
        return runner.Child(proc, time.time(), threading_done(), [out], path)

    def threading_done():
        import threading

        thread = threading.Thread(target=lambda: None)
        thread.start()
        return thread

    ok = finished_child("[cached] demo: unchanged", runner.RunResult("demo", "ok", 1.0))
    assert runner.child_result(demo_project, "demo", ok, quiet).status == "ok"
    cached = finished_child("done", runner.RunResult("demo", "cached"))
    assert runner.child_result(demo_project, "demo", cached, quiet).status == "cached"
    silent = finished_child("[cached] demo", None)
    assert runner.child_result(demo_project, "demo", silent, quiet).status == "failed"
    assert runner.read_result_file(tmp_path / "missing.json") is None


def test_the_book_sources_state_follows_every_file_but_logs_and_locks(demo_project):
    p = demo_project
    (p.generated / "logs").mkdir(parents=True)
    before = runner.book_sources_state(p)
    assert runner.book_sources_state(p) == before
    (p.generated / "logs" / "jupyter-book.log").write_text("a log")
    (p.build_dir / "html").mkdir(parents=True)
    (p.build_dir / "html" / "index.html").write_text("built")
    assert runner.book_sources_state(p) == before, "logs and the build are not sources"
    page = p.root / "book" / "intro.md"
    page.write_text(page.read_text() + "\nMore.\n")
    assert runner.book_sources_state(p) != before
