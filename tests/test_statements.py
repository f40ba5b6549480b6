"""The chapters' statement inventories: well formed, every paper claim tested by a
statement and falsified by a test, and no word of how the book was made on a page."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from companion.book.statements import PaperClaim, Statement, Threshold, inventory

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = ("hasse", "context_similarity", "gradient_flow", "sbm_transformer")
_MARK = re.compile(r"""falsifies\(\s*["']([a-z0-9-]+)["']\s*\)""")


def falsifier_marks() -> set[str]:
    """The claim ids named by ``@falsifies("...")`` anywhere in the tests."""
    ids: set[str] = set()
    for path in ROOT.joinpath("tests").rglob("test_*.py"):
        if path.name == Path(__file__).name:
            continue
        ids.update(_MARK.findall(path.read_text()))
    return ids


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_inventory_is_well_formed(chapter):
    inv = inventory(chapter)
    assert inv.statements, f"{chapter}: the inventory lists no statement of the paper"
    for c in inv.claims.values():
        if c.threshold.by == "ours":
            assert len(c.threshold.reason.split()) >= 3, f"{c.id}: say why this tolerance"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_paper_claim_has_a_falsifier_test(chapter):
    marked = falsifier_marks()
    missing = sorted(set(inventory(chapter).claims) - marked)
    assert not missing, (f"paper claims of {chapter} with no @falsifies test (add one to "
                         f"tests/test_falsifiers_{chapter}.py): {missing}")


_HOW_IT_WAS_MADE = re.compile(
    r"seed summar|\bseeds?/|fact sheet|\bsession\b|\blent to\b|local PyPI|\bmirror\b", re.I)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_no_word_of_how_the_book_was_made(chapter):
    """A reader knows the paper, its abstract, its code and "a secondary summary of the
    paper"; never our notes, our sessions or our machines."""
    texts = {f"chapters/{chapter}.md": ROOT.joinpath("chapters", f"{chapter}.md").read_text()}
    for s in inventory(chapter).statements:
        texts[f"statement {s.id}"] = " ".join([s.quote, s.place, s.not_comparable])
    for c in inventory(chapter).claims.values():
        texts[f"claim {c.id}"] = " ".join([c.quote, c.place, c.falsifier,
                                           c.threshold.reason, c.resamples])
    found = {where: m.group(0) for where, text in texts.items()
             if (m := _HOW_IT_WAS_MADE.search(text))}
    assert not found, f"words of how the book was made, on a reader's page: {found}"


def test_threshold_and_claim_refuse_malformed_declarations():
    with pytest.raises(ValueError, match="reason"):
        Threshold(kind="at_least", value=0.3, by="ours", reason=" ")
    with pytest.raises(ValueError, match="by"):
        Threshold(kind="at_least", value=0.3, by="us", reason="because")
    with pytest.raises(ValueError, match="range"):
        Threshold(kind="range", value=0.3, by="paper", reason="Table 1")
    t = Threshold(kind="at_most", value=0.1, by="ours", reason="a tolerance of ours")
    with pytest.raises(ValueError, match="resamples"):
        PaperClaim(id="hasse-x", quote="q", source="abstract", place="abstract",
                   threshold=t, falsifier="f")
    with pytest.raises(ValueError, match="either"):
        Statement(id="hasse-s", quote="q", source="abstract", place="abstract")
    with pytest.raises(ValueError, match="source"):
        Statement(id="hasse-s", quote="q", source="fact sheet", place="p", claims=("x",))


def test_threshold_words_and_judgement():
    t = Threshold(kind="at_most", value=0.1, by="ours", reason="our tolerance")
    c = PaperClaim(id="hasse-x", quote="q", source="abstract", place="abstract",
                   threshold=t, falsifier="f", resamples="masks")
    assert t.words() == "at most 0.1"
    assert c.judge(0.05, (0.02, 0.08)) == "reproduced"
    assert c.judge(0.2, (0.15, 0.25)) == "differs"
    assert c.judge(0.09, (0.05, 0.15)) == "inconclusive"
    assert Threshold(kind="range", value=(0.2, 0.4), by="paper", reason="Fig. 3").words() \
        == "between 0.2 and 0.4"
