"""Provenance API: sidecars, determinism, atomic writes, claim verdicts, id checks."""
from __future__ import annotations

import hashlib
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from companion.book import chapter as book_chapter  # noqa: E402
from companion.book import citations, claims, files, records  # noqa: E402


@pytest.fixture
def chapter(tmp_path, monkeypatch):
    monkeypatch.setenv(book_chapter.ENV_OUTPUT_DIR, str(tmp_path / "out"))
    monkeypatch.setenv(book_chapter.ENV_ASSET_URL, "../assets/demo")
    monkeypatch.delenv(book_chapter.ENV_CHAPTER, raising=False)
    return book_chapter.begin_chapter("demo", scale="smoke", seed=3, device="cpu", n=4)


def _figure(seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot(rng.normal(size=10))
    ax.set_xlabel("x")
    ax.set_ylabel("y")
    return fig


def test_save_figure_writes_three_formats_and_sidecar(chapter):
    side = records.save_figure(_figure(), "demo-line", "A line.")
    folder = chapter.output_dir / "figures"
    for fmt in ("png", "svg", "pdf"):
        path = folder / f"demo-line.{fmt}"
        assert path.stat().st_size > 0
        assert hashlib.sha256(path.read_bytes()).hexdigest() == side["files"][fmt]["sha256"]
    on_disk = json.loads((folder / "demo-line.json").read_text())
    assert on_disk == json.loads(files.dumps(side))
    for key in ("id", "caption", "chapter", "parameters", "scale", "seed", "device",
                "git_commit", "git_dirty", "versions", "created"):
        assert key in on_disk, key
    assert on_disk["parameters"] == {"scale": "smoke", "seed": 3, "device": "cpu", "n": 4}
    assert set(on_disk["versions"]) == {"torch", "numpy", "matplotlib", "companion"}
    assert not list(folder.glob(".*.tmp")), "temporary files left behind"


def test_same_inputs_give_identical_figure_bytes(chapter, tmp_path, monkeypatch):
    first = records.save_figure(_figure(1), "demo-a", "First.")
    monkeypatch.setenv(book_chapter.ENV_OUTPUT_DIR, str(tmp_path / "again"))
    book_chapter.begin_chapter("demo", scale="smoke", seed=3, device="cpu", n=4)
    second = records.save_figure(_figure(1), "demo-a", "First.")
    for fmt in ("png", "svg", "pdf"):
        assert first["files"][fmt]["sha256"] == second["files"][fmt]["sha256"], fmt
    third = records.save_figure(_figure(2), "demo-b", "Other data.")
    assert third["files"]["png"]["sha256"] != first["files"]["png"]["sha256"]


def test_save_table_csv_markdown_sidecar(chapter):
    df = pd.DataFrame({"n": [1, 2], "value": [0.5, 0.25]})
    side = records.save_table(df, "demo-table", "Two rows.")
    folder = chapter.output_dir / "tables"
    assert pd.read_csv(folder / "demo-table.csv").equals(df)
    md = (folder / "demo-table.md").read_text()
    assert md.splitlines()[0] == "| n | value |" and "| 2 | 0.25 |" in md
    assert side["rows"] == 2 and side["columns"] == ["n", "value"]
    with pytest.raises(TypeError, match="table"):
        records.save_table([[1]], "demo-bad", "Not a frame.")


def test_figure_and_table_are_shown_with_their_cite_line_and_bib_file(chapter, monkeypatch):
    """Under the item on the page: Cite (the BibTeX entry, also written to <id>.bib) and
    the item's files, linked where the runner publishes them (the asset url)."""
    from companion.book.htmlcheck import cite_line_problems, cite_lines

    shown = []
    monkeypatch.setattr(records, "display_markdown", lambda md, extra=None: shown.append(md))
    fig = records.save_figure(_figure(), "demo-cited", "Cited.")
    tab = records.save_table(pd.DataFrame({"a": [1]}), "demo-cited-table", "Cited too.")
    for side, folder, exts in ((fig, "figures", ("png", "svg", "pdf")),
                               (tab, "tables", ("csv", "md"))):
        bib = chapter.output_dir / folder / f"{side['id']}.bib"
        assert bib.read_text() == citations.bibtex_entry(side) + "\n"
        assert side["files"]["bib"]["sha256"] == hashlib.sha256(bib.read_bytes()).hexdigest()
        saved = json.loads((chapter.output_dir / folder / f"{side['id']}.json").read_text())
        assert saved["files"]["bib"] == side["files"]["bib"], "the sidecar lists the .bib"
        base = f"../assets/demo/{folder}/{side['id']}"
        markdown = shown.pop(0)
        directive, line = markdown.split("```\n\n", 1)
        assert f":name: {side['id']}" in directive
        assert cite_lines(line)[side["id"]] == [f"{base}.{e}" for e in (*exts, "json", "bib")]
    assert not list(chapter.output_dir.rglob(".*.tmp"))
    page = ('<figure id="demo-cited"><figcaption><span class="caption-number">Fig. 1'
            '</span></figcaption></figure>')
    assert cite_line_problems(page) == ["figure demo-cited has no Cite line"]


@pytest.mark.parametrize("bad", ["Demo-x", "demo_x", "other-x", "demo-", ""])
def test_ids_must_be_kebab_case_with_chapter_prefix(chapter, bad):
    with pytest.raises(ValueError, match="figure_id"):
        records.save_figure(_figure(), bad, "caption")


def test_empty_caption_is_rejected(chapter):
    with pytest.raises(ValueError, match="caption"):
        records.save_figure(_figure(), "demo-x", "  ")


@pytest.mark.parametrize(
    "measured, paper, tol, kind, verdict",
    [
        (True, "qualitative", None, "holds", "reproduced"),
        (False, "qualitative", None, "holds", "differs"),
        (0.33, 0.30, 0.05, "abs", "reproduced"),
        (0.40, 0.30, 0.05, "abs", "differs"),
        (105.0, 100.0, 0.1, "rel", "reproduced"),
        (125.0, 100.0, 0.1, "rel", "differs"),
        (-0.9, (-1.2, -0.8), None, "range", "reproduced"),
        (-0.5, (-1.2, -0.8), None, "range", "differs"),
        (4.0, 5.0, None, "at_most", "reproduced"),
        (6.0, 5.0, None, "at_most", "differs"),
        (60.0, 50.0, None, "at_least", "reproduced"),
        (49.0, 50.0, 0.5, "at_least", "differs"),
        (0.1, "not available", None, "abs", "not comparable"),
        (float("nan"), 1.0, 0.1, "abs", "differs"),
    ],
)
def test_judge_claim(measured, paper, tol, kind, verdict):
    assert claims.judge_claim(measured, paper, tol, kind) == verdict


def test_judge_claim_rejects_inconsistent_input():
    with pytest.raises(ValueError, match="kind"):
        claims.judge_claim(1.0, 1.0, 0.1, "roughly")
    with pytest.raises(ValueError, match="tolerance"):
        claims.judge_claim(1.0, 1.0, None, "abs")
    with pytest.raises(TypeError, match="measured"):
        claims.judge_claim(1.0, "qualitative", None, "holds")
    with pytest.raises(ValueError, match="paper"):
        claims.judge_claim(1.0, 5.0, None, "range")


@pytest.mark.parametrize(
    "paper, tol, kind, interval, verdict",
    [
        # "b ~ -1": the interval must lie within [-1.5, -0.5]
        (-1.0, 0.5, "abs", (-1.2, -0.7), "reproduced"),
        (-1.0, 0.5, "abs", (-0.6, -0.3), "inconclusive"),
        (-1.0, 0.5, "abs", (-0.4, -0.1), "differs"),
        ((0.2, 0.4), None, "range", (0.25, 0.35), "reproduced"),
        ((0.2, 0.4), None, "range", (0.1, 0.5), "inconclusive"),
        ((0.2, 0.4), None, "range", (0.41, 0.5), "differs"),
        (0.342, None, "at_least", (0.35, 0.39), "reproduced"),
        (0.342, None, "at_least", (0.33, 0.39), "inconclusive"),
        (0.342, None, "at_least", (0.30, 0.34), "differs"),
        (5.0, 1.0, "at_most", (5.5, 6.0), "reproduced"),
        (5.0, 1.0, "at_most", (5.5, 6.5), "inconclusive"),
        (100.0, 0.1, "rel", (95.0, 111.0), "inconclusive"),
    ],
)
def test_judge_claim_with_interval(paper, tol, kind, interval, verdict):
    lo, hi = interval
    assert claims.judge_claim((lo + hi) / 2, paper, tol, kind, interval=interval) == verdict
    # the interval decides, not the point: an inconclusive interval stays inconclusive
    # whichever side of the threshold the point estimate lies on
    assert claims.judge_claim(lo, paper, tol, kind, interval=interval) == verdict


def test_judge_claim_interval_errors():
    with pytest.raises(ValueError, match="interval"):
        claims.judge_claim(0.5, 0.4, None, "at_least", interval=(0.6, 0.5))
    with pytest.raises(ValueError, match="interval"):
        claims.judge_claim(0.5, 0.4, None, "at_least", interval=(0.4, float("nan")))
    with pytest.raises(ValueError, match="interval"):
        claims.judge_claim(0.5, 0.4, None, "at_least", interval=0.1)
    with pytest.raises(ValueError, match="interval"):
        claims.judge_claim(True, "qualitative", None, "holds", interval=(0, 1))


def test_check_reads_holds_or_fails_and_records_role(chapter):
    rec = records.claim("demo-beats-random", 0.42, paper=0.2, kind="at_least",
                     interval=(0.38, 0.47), role="check", reference="this chapter",
                     statement="Our segmenter beats random boundaries.")
    saved = json.loads((chapter.output_dir / "claims" / "demo-beats-random.json").read_text())
    assert saved["verdict"] == rec["verdict"] == "holds"
    assert saved["role"] == "check" and saved["interval"] == [0.38, 0.47]
    rec = records.claim("demo-fails", 0.1, paper=0.2, kind="at_least", role="check",
                     reference="this chapter", statement="A check that fails.")
    assert rec["verdict"] == "fails"
    with pytest.raises(ValueError, match="role"):
        records.claim("demo-x", 0.1, paper=0.2, kind="at_least", role="target",
                   reference="this chapter", statement="s")
    with pytest.raises(ValueError, match="threshold"):
        records.claim("demo-x", 0.1, kind="at_least", role="check",
                   reference="this chapter", statement="s")
    assert not (chapter.output_dir / "claims" / "demo-x.json").exists()


def test_claim_is_recorded(chapter):
    rec = records.claim("demo-mean", 0.31, paper=0.33, tolerance=0.05, kind="abs",
                     reference="Sec. 2", statement="Mean near one third.")
    saved = json.loads((chapter.output_dir / "claims" / "demo-mean.json").read_text())
    assert saved["verdict"] == rec["verdict"] == "reproduced"
    assert saved["reference"] == "Sec. 2" and saved["paper"] == 0.33
    with pytest.raises(ValueError, match="reference"):
        records.claim("demo-x", True, paper="qualitative", kind="holds", reference="",
                   statement="s")


def test_begin_chapter_validates(tmp_path, monkeypatch):
    monkeypatch.setenv(book_chapter.ENV_OUTPUT_DIR, str(tmp_path))
    with pytest.raises(ValueError, match="scale"):
        book_chapter.begin_chapter("demo", scale="huge", seed=0, device="cpu")
    with pytest.raises(TypeError, match=r"^seed: expected an int, got '0' \(str\)$"):
        book_chapter.begin_chapter("demo", scale="smoke", seed="0", device="cpu")
    with pytest.raises(TypeError, match=r"^seed: expected an int, got 1\.5 \(float\)$"):
        book_chapter.begin_chapter("demo", scale="smoke", seed=1.5, device="cpu")
    with pytest.raises(TypeError, match="name"):
        book_chapter.begin_chapter(3, scale="smoke", seed=0, device="cpu")
    with pytest.raises(ValueError, match="device"):
        book_chapter.begin_chapter("demo", scale="smoke", seed=0, device="tpu")
    with pytest.raises(ValueError, match="required"):
        book_chapter.begin_chapter("demo", scale="smoke", seed=0)
    monkeypatch.setenv(book_chapter.ENV_CHAPTER, "other")
    with pytest.raises(ValueError, match="runner executes chapter 'other'"):
        book_chapter.begin_chapter("demo", scale="smoke", seed=0, device="cpu")


def test_atomic_write_leaves_old_file_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "f.txt"
    files.atomic_write_text(target, "old")

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(files.os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        files.atomic_write_text(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_ids_are_unique_within_a_chapter(chapter, monkeypatch):
    records.save_figure(_figure(), "demo-same", "A figure.")
    with pytest.raises(ValueError, match="already used by a figure"):
        records.claim("demo-same", True, paper="qualitative", kind="holds",
                   reference="this chapter", statement="Same id as the figure.")
    records.save_figure(_figure(), "demo-same", "Saved again by hand: allowed.")
    monkeypatch.setenv(book_chapter.ENV_CHAPTER, "demo")  # under the runner: a duplicate label
    with pytest.raises(ValueError, match="already used"):
        records.save_figure(_figure(), "demo-same", "Twice in one run.")


def test_rejected_call_leaves_its_id_free_for_a_corrected_retry(chapter, monkeypatch):
    """Under the runner an id may be used once; a call refused for a bad argument (other
    than the id) has not used it, so the corrected call in the same kernel succeeds."""
    import numpy as np

    monkeypatch.setenv(book_chapter.ENV_CHAPTER, "demo")
    fig = _figure()
    with pytest.raises(ValueError, match="caption"):
        records.save_figure(fig, "demo-retry-fig", " ")
    with pytest.raises(TypeError, match="fig"):
        records.save_figure("not a figure", "demo-retry-fig", "A line.")
    records.save_figure(fig, "demo-retry-fig", "A line.")
    with pytest.raises(TypeError, match="table"):
        records.save_table([[1]], "demo-retry-table", "Numbers.")
    records.save_table(pd.DataFrame({"a": [1]}), "demo-retry-table", "Numbers.")
    with pytest.raises(ValueError, match="kind"):
        records.claim("demo-retry-claim", 1.0, paper=1.0, tolerance=0.1, kind="approx",
                   reference="this chapter", statement="One is one.")
    with pytest.raises(TypeError, match="tolerance"):
        records.claim("demo-retry-claim", 1.0, paper=1.0, tolerance="0.1", kind="abs",
                   reference="this chapter", statement="One is one.")
    rec = records.claim("demo-retry-claim", np.float64(1.0), paper=1.0, tolerance=0.1,
                     kind="abs", reference="this chapter", statement="One is one.")
    assert rec["verdict"] == "reproduced"
    assert chapter.used_ids == {"demo-retry-fig": "figure_id",
                                "demo-retry-table": "table_id",
                                "demo-retry-claim": "claim_id"}
    # ... and a real second use is still refused
    with pytest.raises(ValueError, match="already used"):
        records.claim("demo-retry-claim", 1.0, paper=1.0, tolerance=0.1, kind="abs",
                   reference="this chapter", statement="One is one.")


def test_claim_measured_one_element_tensor_and_bad_tensors(chapter):
    import torch

    rec = records.claim("demo-t", torch.tensor([0.5]), paper=0.5, tolerance=0.1, kind="abs",
                     reference="this chapter", statement="A one-element tensor.")
    assert rec["measured"] == 0.5 and rec["verdict"] == "reproduced"
    rec = records.claim("demo-b", torch.tensor(True), paper="qualitative", kind="holds",
                     reference="this chapter", statement="A 0-d bool tensor.")
    assert rec["measured"] is True and rec["verdict"] == "reproduced"
    with pytest.raises(TypeError, match=r"shape \(2, 2\)"):
        records.claim("demo-m", torch.ones(2, 2), paper=0.5, tolerance=0.1, kind="abs",
                   reference="this chapter", statement="Four numbers.")
    with pytest.raises(ValueError, match="meta device"):
        records.claim("demo-m", torch.empty(1, device="meta"), paper=0.5, tolerance=0.1,
                   kind="abs", reference="this chapter", statement="No value.")
    assert not (chapter.output_dir / "claims" / "demo-m.json").exists()


def test_claim_evidence_names_this_chapters_items(chapter):
    rec = records.claim("demo-with-evidence", 0.3, paper=0.2, kind="at_least",
                     reference="Fig. 2", statement="s", evidence="demo-random-walk")
    assert rec["evidence"] == ["demo-random-walk"]
    with pytest.raises(ValueError, match="evidence: expected ids of this chapter"):
        records.claim("demo-bad-evidence", 0.3, paper=0.2, kind="at_least", reference="Fig. 2",
                   statement="s", evidence=["hasse-figure"])
    with pytest.raises(TypeError, match="evidence"):
        records.claim("demo-bad-evidence", 0.3, paper=0.2, kind="at_least", reference="Fig. 2",
                   statement="s", evidence=3)
    assert not (chapter.output_dir / "claims" / "demo-bad-evidence.json").exists()
