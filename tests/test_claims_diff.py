"""claims_diff: verdict and value changes between two folders of claim records."""
import json

import pytest

from companion.book.claims_diff import compare, load_claims, main, markdown


def _write(root, chapter, record):
    folder = root / chapter / "claims"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{record['id']}.json").write_text(json.dumps(record))


def _claim(cid, verdict="reproduced", value=1.0, interval=(0.5, 1.5), role="paper"):
    return {"id": cid, "verdict": verdict, "measured": value,
            "interval": list(interval) if interval else None, "role": role, "scale": "ci"}


def test_identical_builds_have_no_rows(tmp_path):
    for side in ("a", "b"):
        _write(tmp_path / side, "hasse", _claim("h1"))
        _write(tmp_path / side, "gradient_flow", _claim("g1", value=0.3 + 1e-15))
    assert compare(load_claims(tmp_path / "a"), load_claims(tmp_path / "b")) == []
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--identical"]) == 0


def test_each_kind_of_change_is_reported(tmp_path):
    old = {c["id"]: c for c in [_claim("v"), _claim("x"), _claim("i"), _claim("gone"),
                                _claim("nan", value=float("nan"))]}
    new = {c["id"]: c for c in [_claim("v", verdict="differs"), _claim("x", value=1.1),
                                _claim("i", interval=(0.9, 1.1)), _claim("added"),
                                _claim("nan", value=float("nan"))]}
    rows = {r["id"]: r for r in compare(old, new)}
    assert {k: r["change"] for k, r in rows.items()} == {
        "v": "verdict", "x": "value", "i": "interval", "gone": "only old",
        "added": "only new"}
    assert rows["i"]["width_ratio"] == pytest.approx(0.2)
    text = markdown(list(rows.values()), len(old), len(new))
    assert "5 claims before, 5 after; 5 differ, 1 of them in verdict." in text
    assert "reproduced → differs" in text


def test_rtol_and_exit_code(tmp_path):
    _write(tmp_path / "a", "c", _claim("x", value=1.0))
    _write(tmp_path / "b", "c", _claim("x", value=1.0 + 1e-6))
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--identical"]) == 1
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--identical", "--rtol", "1e-5"]) == 0


def test_bad_folders_and_records(tmp_path):
    with pytest.raises(FileNotFoundError, match="folder"):
        load_claims(tmp_path / "missing")
    folder = tmp_path / "x" / "claims"
    folder.mkdir(parents=True)
    (folder / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="broken.json"):
        load_claims(tmp_path)
