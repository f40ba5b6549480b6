"""A run's parameters: declared types of None defaults, and provenance that records every
parameter papermill injected, whether the chapter passed it to begin_chapter or not."""
from __future__ import annotations

import json

import pytest

from companion.book import chapter as book_chapter
from companion.book import records
from companion.book.runner import (ChapterError, coerce_parameter, parameter_types,
                                   parse_parameters, prepare_chapter, resolve_parameters)

REQUIRED = 'scale = "ci"\nseed = 0\ndevice = "auto"\n'


def test_a_none_default_declares_its_type():
    src = REQUIRED + ("model: str | None = None  # a name or a path\n"
                      "limit: Optional[int] = None\nrate: float = 1\n")
    assert parse_parameters(src)["model"] is None
    types = parameter_types(src)
    assert types["model"] == (str, type(None)) and types["limit"] == (int, type(None))
    assert types["rate"] == (float,) and types["seed"] == (int,)


@pytest.mark.parametrize("line, match", [
    ("model = None  # a name or a path\n", r"parameter 'model'.*declare its type.*model: str"),
    ("model: list | None = None\n", r"parameter 'model': the annotation 'list'"),
    ("model: int = 'x'\n", r"parameter 'model': the default 'x' is not a int"),
    ("model: str | None = 3\n", r"parameter 'model': the default 3 is not a str or None"),
])
def test_an_undeclared_or_wrong_type_is_refused(line, match):
    with pytest.raises(ChapterError, match=match):
        parameter_types(REQUIRED + line)


def test_a_declared_type_checks_the_requested_value():
    src = REQUIRED + "model: str | None = None\nlimit: int | None = None\n"
    defaults, types = parse_parameters(src), parameter_types(src)
    got = resolve_parameters(defaults, {"model": "123", "limit": "7"}, types)
    assert got["model"] == "123", "a str parameter keeps a CLI string that looks like a number"
    assert got["limit"] == 7
    got = resolve_parameters(defaults, {"model": "None", "limit": None}, types)
    assert got["model"] is None and got["limit"] is None
    with pytest.raises(ChapterError, match=r"parameter 'limit': expected a int or None"):
        resolve_parameters(defaults, {"limit": "many"}, types)
    with pytest.raises(ChapterError, match=r"parameter 'model': expected a str or None"):
        resolve_parameters(defaults, {"model": 3}, types)
    with pytest.raises(ChapterError, match=r"parameter 'rate': expected a finite float"):
        resolve_parameters({**defaults, "rate": 0.5}, {"rate": "1e999"})
    # an undeclared None default took anything; a declared type is checked
    assert coerce_parameter("model", "3", None) == 3
    assert coerce_parameter("model", "3", None, (str, type(None))) == "3"


def test_a_chapter_with_an_undeclared_none_default_is_refused(demo_project):
    source = demo_project.source("demo")
    text = source.read_text()
    source.write_text(text.replace('seed = 0\n', 'seed = 0\nextra = None\n', 1))
    with pytest.raises(ChapterError, match=r"chapter 'demo': parameter 'extra'.*declare"):
        prepare_chapter(demo_project, "demo")
    source.write_text(text.replace('seed = 0\n', 'seed = 0\nextra: int | None = None\n', 1))
    assert prepare_chapter(demo_project, "demo", overrides={"extra": "4"}).params["extra"] == 4


def test_every_record_has_every_parameter_of_the_run(ran_demo_project):
    """The demo chapter passes some parameters to begin_chapter but not ``marker`` and
    ``hang``: every figure, table and claim records them all the same, as the run does."""
    p = ran_demo_project
    run = json.loads(p.run_record("demo").read_text())["parameters"]
    assert {"marker", "hang"} <= set(run)
    sidecars = [path for kind in ("figures", "tables", "claims")
                for path in sorted((p.assets("demo") / kind).glob("*.json"))]
    kinds = {path.parent.name for path in sidecars}
    assert kinds == {"figures", "tables", "claims"}, kinds
    for path in sidecars:
        assert json.loads(path.read_text())["parameters"] == run, path.name


def test_begin_chapter_records_the_runs_parameters(tmp_path, monkeypatch):
    monkeypatch.setenv(book_chapter.ENV_OUTPUT_DIR, str(tmp_path / "out"))
    monkeypatch.setenv(book_chapter.ENV_CHAPTER, "demo")
    run = {"scale": "smoke", "seed": 3, "device": "cpu", "sizes": (2, 3), "model": None}
    monkeypatch.setenv(book_chapter.ENV_PARAMETERS, book_chapter.encode_parameters(run))
    chapter = book_chapter.begin_chapter("demo", scale="smoke", seed=3, device="cpu")
    assert chapter.params == run, "a tuple stays a tuple, None stays None"
    import pandas as pd

    assert records.save_table(pd.DataFrame({"n": [1]}), "demo-t", "One.")["parameters"] == run
    on_disk = json.loads((chapter.output_dir / "tables" / "demo-t.json").read_text())
    assert on_disk["parameters"] == {**run, "sizes": [2, 3]}  # JSON has no tuples
    # a value the chapter passes wins; outside the runner nothing is added
    assert book_chapter.begin_chapter("demo", scale="smoke", seed=4,
                                      device="cpu").params["seed"] == 4
    monkeypatch.delenv(book_chapter.ENV_CHAPTER)
    alone = book_chapter.begin_chapter("demo", scale="smoke", seed=3, device="cpu")
    assert alone.params == {"scale": "smoke", "seed": 3, "device": "cpu"}
    with pytest.raises(ValueError, match="literal"):
        book_chapter.encode_parameters({"f": object()})


def test_build_prints_its_schedule_and_a_summary_per_chapter(demo_project, monkeypatch):
    """``build`` says how it schedules the chapters, then each chapter's wall time, CPU
    time and peak memory, and the total against the CPU seconds over the cores."""
    from companion.book import build

    monkeypatch.setattr(build, "build_html", lambda project, echo: None)  # pages: elsewhere
    lines: list[str] = []
    assert build.build(demo_project, scale="smoke", jobs=2, echo=lines.append) == 0
    schedule = [line for line in lines if line.startswith("[schedule]")]
    assert len(schedule) == 1 and "longest first: demo (time unknown)" in schedule[0]
    summary = [line for line in lines if line.startswith("[summary]")]
    assert len(summary) == 2 and summary[0].startswith("[summary] demo: ok, wall "), summary
    record = json.loads(demo_project.run_record("demo").read_text())
    # the kernel imports torch: seconds of CPU, all of it counted (the kernel is reaped)
    assert 0.5 < record["cpu_seconds"] and f"CPU {record['cpu_seconds']:.1f} s" in summary[0]
    assert "on " in summary[1] and "the floor of" in summary[1]
    # chapters all current (what a second build finds): no floor to compare against
    cached = build.run_summary([build.RunResult("demo", "cached")], 1.0, 0.0, 2)
    assert cached == ["[summary] demo: cached",
                      "[summary] chapters: none ran, every one was current"]
