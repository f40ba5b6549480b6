"""run_many's schedule: the chapter expected to run longest starts first."""
from __future__ import annotations

import json

import pytest
from conftest import FIXTURE_CHAPTERS, make_project

from companion.book import runner


def _with_hint(text: str, hint: str | None) -> str:
    """The demo chapter with a ``companion:`` front-matter block (``hint`` its body)."""
    if hint is None:
        return text
    head, sep, rest = text.partition("\n---\n")
    return f"{head}\ncompanion:\n{hint}{sep}{rest}"


@pytest.fixture
def three_chapters(tmp_path):
    demo = (FIXTURE_CHAPTERS / "demo.md").read_text()
    hints = {"short": "  expected-minutes: {ci: 1, smoke: 0.1}\n",
             "long": "  expected-minutes: {ci: 12, smoke: 0.2}\n",
             "none": None}
    sources = {}
    for name, hint in hints.items():
        path = tmp_path / f"{name}.md"
        path.write_text(_with_hint(demo, hint))
        sources[name] = path
    return runner.Project(make_project(tmp_path / "book-project", sources))


def _write_record(project, name, scale, seconds, status="ok"):
    path = project.run_record(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"status": status, "seconds": seconds,
                                "parameters": {"scale": scale}}))


def test_expected_seconds_reads_the_front_matter_hint_at_the_requested_scale(three_chapters):
    assert runner.expected_seconds(three_chapters, "long", "ci") == 720.0
    assert runner.expected_seconds(three_chapters, "long", "smoke") == pytest.approx(12.0)
    # the demo's default scale is ci
    assert runner.expected_seconds(three_chapters, "short", None) == 60.0
    # no hint, no hint at that scale: nothing expected
    assert runner.expected_seconds(three_chapters, "none", "ci") == 0.0
    assert runner.expected_seconds(three_chapters, "long", "paper") == 0.0


def test_expected_seconds_prefers_the_last_run_at_the_same_scale(three_chapters):
    _write_record(three_chapters, "short", "ci", 3000.0)
    assert runner.expected_seconds(three_chapters, "short", "ci") == 3000.0
    # a run at another scale, or a failed run, says nothing about this one
    assert runner.expected_seconds(three_chapters, "short", "smoke") == pytest.approx(6.0)
    _write_record(three_chapters, "long", "ci", 5.0, status="failed")
    assert runner.expected_seconds(three_chapters, "long", "ci") == 720.0


def test_longest_first_orders_by_expected_time_and_keeps_ties_in_order(three_chapters):
    scales = {"short": "ci", "long": "ci", "none": "ci"}
    assert runner.longest_first(three_chapters, ["none", "short", "long"], scales) == [
        "long", "short", "none"]
    _write_record(three_chapters, "none", "ci", 10_000.0)
    assert runner.longest_first(three_chapters, ["short", "long", "none"], scales) == [
        "none", "long", "short"]
    # a mixed-scale build compares each chapter at its own scale
    mixed = {"short": "ci", "long": "smoke", "none": "smoke"}
    assert runner.longest_first(three_chapters, ["long", "none", "short"], mixed) == [
        "short", "long", "none"]


def test_a_bad_hint_counts_as_none(tmp_path):
    demo = (FIXTURE_CHAPTERS / "demo.md").read_text()
    bad = tmp_path / "bad.md"
    bad.write_text(_with_hint(demo, "  expected-minutes: {ci: soon}\n"))
    listed = tmp_path / "listed.md"
    listed.write_text(_with_hint(demo, "  expected-minutes: [1, 2]\n"))
    project = runner.Project(make_project(tmp_path / "p", {"bad": bad, "listed": listed}))
    assert runner.expected_seconds(project, "bad", "ci") == 0.0
    assert runner.expected_seconds(project, "listed", "ci") == 0.0
    assert runner.expected_seconds(project, "missing", "ci") == 0.0
