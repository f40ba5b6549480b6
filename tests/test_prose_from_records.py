"""A chapter's summary sentence follows its results: run the demo fixture with two
measured values and see the sentence's number, comparison word and verdict change."""
from __future__ import annotations

import json
import re

from companion.book import prose
from companion.book import runner


def _quiet(_line: str) -> None:
    pass


def _summary_and_claim(project) -> tuple[str, dict]:
    """The generated summary sentence of the executed demo notebook and its claim record."""
    nb = json.loads(project.notebook("demo").read_text())
    sentences = [
        "".join(out["data"]["text/markdown"])
        for cell in nb["cells"] if "hide-input" in cell["metadata"].get("tags", [])
        for out in cell.get("outputs", []) if "text/markdown" in out.get("data", {})
    ]
    assert len(sentences) == 1, sentences
    record = json.loads((project.assets("demo") / "claims" / "demo-mean-small.json").read_text())
    return sentences[0], record


def test_summary_sentence_changes_with_the_measured_value(ran_demo_project):
    p = ran_demo_project  # a copy of this pytest run's one good demo run, at shift 0.0
    seen = {}
    for shift in (0.0, -3.0):  # -3 moves the mean of 20 N(0, 1) draws far below zero
        if shift:
            res = runner.run_chapter(p, "demo", scale="smoke", overrides={"shift": str(shift)},
                                     echo=_quiet)
            assert res.status == "ok", res.error
        assert json.loads(p.run_record("demo").read_text())["parameters"]["shift"] == shift
        sentence, record = _summary_and_claim(p)
        m = record["measured"]
        word = prose.compare(m, 0.0)
        # Every number and word of the sentence is the record's, not typed in the chapter.
        assert f"The sample mean is {prose.num(m)} " in sentence, sentence
        assert f"(interval {prose.interval(*record['interval'])})" in sentence, sentence
        assert f", {word} zero;" in sentence, sentence
        assert sentence.endswith(f"is {record['verdict']}."), sentence
        seen[shift] = (sentence, m, word, record["verdict"])
    (s0, m0, w0, v0), (s3, m3, w3, v3) = seen[0.0], seen[-3.0]
    assert abs(m3 - (m0 - 3.0)) < 1e-5, "the shift moved the measured value (float32 values)"
    assert s0 != s3
    assert (w0, v0) == ("above", "reproduced"), s0  # seed 0: mean 0.35, interval inside ±1
    assert (w3, v3) == ("below", "differs"), s3
    assert re.search(r"-2\.6\d", s3), s3
