"""Declared paper claims, the statement inventory, the Findings page, the report's coverage
and its "changes since the previous build", and links hidden while the addresses are the
shipped placeholder."""
from __future__ import annotations

import json
import sys
import types

import pytest

from companion.book import findings, myst, pages, site
from companion.book.statements import PaperClaim, Statement, Threshold


@pytest.fixture
def demo_statements(monkeypatch):
    """A statements module for the chapter "demo": one paper claim of ours, one with the
    paper's number, one statement not comparable."""
    mod = types.ModuleType("companion.book.statements.demo")
    mod.CLAIMS = [
        PaperClaim(id="demo-ours", quote="It is small.", source="abstract",
                   place="arXiv 0000.00000, abstract",
                   threshold=Threshold(kind="at_most", value=0.1, by="ours",
                                       reason="the paper gives no number"),
                   falsifier="the data doubled", resamples="windows"),
        PaperClaim(id="demo-theirs", quote="About one third.", source="secondary summary",
                   place="(secondary summary), results",
                   threshold=Threshold(kind="range", value=(0.3, 0.37), by="paper",
                                       reason="the paper's 33 %",
                                       set_after_result="abc1234: widened from 0.32"),
                   falsifier="labels shuffled", resamples="windows"),
    ]
    mod.STATEMENTS = [
        Statement(id="demo-s1", quote="It is small.", source="abstract", place="abstract",
                  claims=("demo-ours",)),
        Statement(id="demo-s2", quote="About one third.", source="secondary summary",
                  place="(secondary summary)", claims=("demo-theirs",)),
        Statement(id="demo-s3", quote="It works on GLUE.", source="abstract",
                  place="abstract", not_comparable="needs GLUE data, which cannot be "
                                                   "installed here"),
    ]
    monkeypatch.setitem(sys.modules, "companion.book.statements.demo", mod)
    return mod


@pytest.fixture
def demo_chapter(tmp_path, monkeypatch, demo_statements):
    from companion.book import begin_chapter
    from companion.book.chapter import ENV_OUTPUT_DIR

    monkeypatch.setenv(ENV_OUTPUT_DIR, str(tmp_path / "out"))
    return begin_chapter("demo", scale="smoke", seed=0, device="cpu")


def test_a_declared_claim_takes_its_threshold_from_the_inventory(demo_chapter):
    from companion.book import claim

    ours = claim("demo-ours", 0.05, interval=(0.02, 0.08), statement="Measured on 3 windows.")
    assert ours["verdict"] == "reproduced" and ours["threshold_by"] == "ours"
    box = myst.claim_box(ours)
    assert "We require at most 0.1: a tolerance of ours, because the paper gives no number" in box
    assert "95 % interval [0.02, 0.08] over windows" in box
    assert "*differs* under: the data doubled" in box
    theirs = claim("demo-theirs", 0.2, interval=(0.18, 0.22), statement="Measured.")
    assert theirs["verdict"] == "differs"
    box = myst.claim_box(theirs)
    assert "The paper's threshold: between 0.3 and 0.37 (the paper's 33 %)" in box
    assert "set after a result was seen (abc1234: widened from 0.32)" in box
    assert "check:" not in box and "at_most" not in box


@pytest.mark.parametrize("extra", [{"paper": 0.2}, {"kind": "abs"}, {"tolerance": 0.1},
                                   {"reference": "Fig. 1"}])
def test_a_declared_claim_refuses_a_second_threshold(demo_chapter, extra):
    from companion.book import claim

    name = next(iter(extra))
    with pytest.raises(ValueError, match=f"^{name}: paper claim 'demo-ours' is declared"):
        claim("demo-ours", 0.05, statement="S.", **extra)


def test_record_inventory_gives_each_statement_its_status(demo_chapter):
    from companion.book import claim, record_inventory

    claim("demo-ours", 0.5, interval=(0.4, 0.6), statement="S.")
    claim("demo-check", True, paper="qualitative", kind="holds", role="check",
          reference="this chapter", statement="Ours.")
    record = record_inventory(setting="a  tiny\nmodel")
    status = {r["id"]: (r["status"], r["verdicts"]) for r in record["statements"]}
    assert status == {"demo-s1": ("tested", {"demo-ours": "differs"}),
                      "demo-s2": ("not run at this scale", {}),
                      "demo-s3": ("not comparable", {})}
    saved = json.loads((demo_chapter.output_dir / "inventory.json").read_text())
    assert saved["setting"] == "a tiny model" and saved["scale"] == "smoke"


def test_record_inventory_refuses_an_undeclared_paper_claim(demo_chapter):
    from companion.book import claim, record_inventory

    claim("demo-stray", 1.0, paper=1.0, tolerance=0.1, kind="abs", reference="Fig. 1",
          statement="Not in the inventory.")
    with pytest.raises(ValueError, match=r"\['demo-stray'\] are not declared"):
        record_inventory()


def _inventory(project, statements):
    folder = project.assets("demo")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "inventory.json").write_text(json.dumps(
        {"id": "demo-inventory", "type": "inventory", "setting": "MiniLM, 8 windows",
         "scale": "ci", "device": "cpu", "statements": statements}))


ROWS = [
    {"id": "demo-s1", "quote": "It is small.", "place": "abstract", "status": "tested",
     "claims": ["demo-a", "demo-b"], "verdicts": {"demo-a": "reproduced",
                                                 "demo-b": "inconclusive"},
     "not_comparable": ""},
    {"id": "demo-s2", "quote": "About one third.", "place": "(secondary summary)",
     "status": "tested", "claims": ["demo-c"], "verdicts": {"demo-c": "reproduced"},
     "not_comparable": ""},
    {"id": "demo-s3", "quote": "It works on GLUE.", "place": "abstract",
     "status": "not comparable", "claims": [], "verdicts": {},
     "not_comparable": "needs GLUE data"},
]


def test_findings_page_answers_per_paper_from_the_inventory(demo_project):
    _inventory(demo_project, ROWS)
    page = findings.findings_page(demo_project)
    assert ("Of its 3 checkable statements, 2 are tested here: 1 reproduced, 1 inconclusive. "
            "1 cannot be compared here.") in page
    assert "MiniLM, 8 windows" in page
    inconclusive = page.index("**Inconclusive**")
    reproduced = page.index("**Reproduced**")
    assert inconclusive < reproduced < page.index("**Cannot be tested here**")
    assert "{ref}`inconclusive <demo-b>`" in page[inconclusive:reproduced]
    assert "“It works on GLUE.” (abstract): needs GLUE data" in page
    assert "--scale paper" in page  # not run at paper scale: what would change it
    assert "|" not in page.split("# Findings")[1], "lists, not tables: no sideways scrolling"


def test_report_opens_with_the_coverage_per_chapter(demo_project):
    _inventory(demo_project, ROWS)
    report = pages.reproduction_report(demo_project)
    assert report.index("## What each paper states") < report.index("## Paper claims")
    assert ("| Demo chapter | 3 | **2** {bdg-success}`1 reproduced` {bdg-warning}`1 "
            "inconclusive` | 1 not comparable |") in report


def test_changes_since_the_previous_build(demo_project):
    folder = demo_project.assets("demo") / "claims"
    folder.mkdir(parents=True)

    def write(verdict):
        (folder / "demo-a.json").write_text(json.dumps(
            {"id": "demo-a", "role": "paper", "verdict": verdict, "measured": 1.0,
             "interval": None}))

    write("reproduced")
    assert "first build recorded here" in "\n".join(findings.changes_section(demo_project))
    assert "first build recorded here" in "\n".join(findings.changes_section(demo_project))
    write("differs")
    moved = "\n".join(findings.changes_section(demo_project))
    assert "`demo-a`: reproduced → differs" in moved
    # the same build again keeps its previous build to compare with
    assert "`demo-a`: reproduced → differs" in "\n".join(findings.changes_section(demo_project))
    (folder / "demo-a.json").write_text(json.dumps(
        {"id": "demo-a", "role": "paper", "verdict": "differs", "measured": 2.0,
         "interval": None}))
    assert "No verdict moved" in "\n".join(findings.changes_section(demo_project))


def test_placeholder_addresses_show_no_repository_link():
    record = {"git_commit": "0123456789abcdef", "repository": site.PLACEHOLDER_REPOSITORY}
    assert myst.commit_text(record) == "`0123456789ab`"
    assert myst.commit_text({**record, "repository": "https://github.com/o/r"}).startswith(
        "[`0123456789ab`](https://github.com/o/r/commit/")
    sys.path.insert(0, str(site.Path(__file__).resolve().parents[1] / "book" / "_ext"))
    try:
        import book_assets
    finally:
        sys.path.pop(0)
    assert book_assets.PLACEHOLDER_REPOSITORY == site.PLACEHOLDER_REPOSITORY
    config = types.SimpleNamespace(html_theme_options={
        "repository_url": site.PLACEHOLDER_REPOSITORY, "use_repository_button": True,
        "launch_buttons": {"binderhub_url": "https://mybinder.org"}})
    book_assets._hide_placeholder_links(None, config)
    assert config.html_theme_options["use_repository_button"] is False
    assert config.html_theme_options["launch_buttons"] == {}
    real = types.SimpleNamespace(html_theme_options={
        "repository_url": "https://github.com/o/r", "use_repository_button": True})
    book_assets._hide_placeholder_links(None, real)
    assert real.html_theme_options["use_repository_button"] is True


def test_inventory_table_links_each_claim_with_a_title():
    """A {ref} to a claim box needs explicit link text: the box has no title Sphinx reads."""
    table = myst.inventory_table([{"id": "demo-s1", "quote": "It is small.",
                                   "place": "abstract", "status": "tested",
                                   "claims": ["demo-a"], "verdicts": {"demo-a": "differs"},
                                   "not_comparable": ""}])
    assert "{ref}`demo-a <demo-a>`: differs" in table


def test_a_declared_claim_not_comparable_in_this_run_says_why(demo_chapter):
    from companion.book import claim, record_inventory

    rec = claim("demo-ours", None, not_comparable="the baseline does not clear chance",
                statement="Not judged.")
    assert rec["verdict"] == "not comparable" and rec["measured"] is None
    assert "Not compared in this run: the baseline does not clear chance" in myst.claim_box(rec)
    row = next(r for r in record_inventory()["statements"] if r["id"] == "demo-s1")
    assert row["verdicts"] == {"demo-ours": "not comparable"}
    counts = findings.coverage_counts({"statements": [row]})
    assert counts["tested"] == 0 and counts["not comparable"] == 1
    with pytest.raises(ValueError, match="not_comparable"):
        claim("demo-theirs", None, not_comparable=" ", statement="S.")
