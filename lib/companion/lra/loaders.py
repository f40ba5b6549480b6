"""Loaders for the LRA tasks that need downloaded data, and an offline image stand-in.

Nothing here downloads anything. Each loader reads the files a user already has and
raises :class:`DataNotFoundError` (a ``FileNotFoundError`` and ``ValueError``) naming
the path it expected otherwise:

- Image: CIFAR-10, the "python version" archive unpacked to
  ``<root>/cifar-10-batches-py/{data_batch_1..5, test_batch}``; turned grey as LRA does
  (``tf.image.rgb_to_grayscale``: weights 0.2989, 0.5870, 0.1140 on intensities in
  [0, 1], back to 8 bits by ``floor(x * 255.5)``), flattened to 1024 tokens 0..255.
- Text: IMDB reviews, ``<root>/aclImdb/{train,test}/{pos,neg}/*.txt``; byte-level ids
  (UTF-8 byte + 1, 0 = padding, as tfds' ``ByteTextEncoder``), truncated and padded.
- Retrieval: ACL Anthology Network pairs from the LRA release,
  ``<root>/new_aan_pairs.{train,eval,test}.tsv`` (tab separated: label, id1, id2,
  text1, text2); two byte-level sequences per example.

Offline stand-in: :func:`digits_standin` upsamples scikit-learn's bundled 8 x 8
handwritten digits (1,797 images, 10 classes) to ``size x size`` grey tokens. It is an
image-classification task of the same sequence shape as LRA Image, *not* CIFAR-10, and
is named ``"stand-in: ..."`` wherever it is shown.
"""
from __future__ import annotations

import csv
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from companion._validate import check_int, check_str_sequence

GREY_WEIGHTS = (0.2989, 0.5870, 0.1140)  # tf.image.rgb_to_grayscale


@dataclass
class TokenDataset:
    """A classification data set of token sequences.

    Attributes
    ----------
    name : str
        What it is; stand-ins start with ``"stand-in:"``.
    tokens : torch.Tensor
        int64 ``[n, L]`` (0 = padding where the task pads).
    labels : torch.Tensor
        int64 ``[n]``.
    num_classes, vocab_size : int

    >>> d = TokenDataset("toy", torch.zeros(2, 3, dtype=torch.long), torch.tensor([0, 1]), 2, 5)
    >>> d.tokens.shape, d.num_classes
    (torch.Size([2, 3]), 2)
    """

    name: str
    tokens: torch.Tensor
    labels: torch.Tensor
    num_classes: int
    vocab_size: int


class DataNotFoundError(FileNotFoundError, ValueError):
    """The files of a data set are not where the loader looks (nothing is downloaded).

    >>> import tempfile
    >>> try:
    ...     load_imdb_bytes(tempfile.mkdtemp())
    ... except DataNotFoundError as err:
    ...     print(str(err)[:5], isinstance(err, FileNotFoundError))
    IMDB: True
    """


def _missing(path: Path, what: str, how: str) -> DataNotFoundError:
    return DataNotFoundError(
        f"{what}: expected {path} (not found). {how} Nothing is downloaded at run time.")


def _check_split(split: str, allowed: tuple[str, ...]) -> None:
    if split not in allowed:
        raise ValueError(f"split: expected one of {allowed}, got {split!r}")


def cifar_to_grey(rgb: np.ndarray) -> np.ndarray:
    """``[n, 3072]`` CIFAR rows (R plane, G plane, B plane) -> ``[n, 1024]`` grey 0..255.

    Matches ``tf.image.rgb_to_grayscale`` on uint8 input as LRA uses it.

    Examples
    --------
    >>> cifar_to_grey(np.full((1, 3072), 255, dtype=np.uint8)).shape
    (1, 1024)
    """
    rgb = np.asarray(rgb)
    if rgb.ndim != 2 or rgb.shape[1] != 3072:
        raise ValueError(f"rgb: expected shape [n, 3072], got {rgb.shape}")
    planes = rgb.reshape(-1, 3, 1024).astype(np.float32) / 255.0
    w = np.asarray(GREY_WEIGHTS, dtype=np.float32)
    grey = np.tensordot(planes, w, axes=([1], [0]))
    return np.clip(np.floor(grey * 255.5), 0, 255).astype(np.int64)


def load_cifar10_grey(root: str | Path, *, split: str = "train"):
    """CIFAR-10 as LRA Image: ``(tokens [n, 1024] int64 in 0..255, labels [n] int64)``.

    ``split``: "train" (data_batch_1..5, 50,000 images) or "test" (10,000).

    >>> import pathlib, tempfile
    >>> root = pathlib.Path(tempfile.mkdtemp()); (root / "cifar-10-batches-py").mkdir()
    >>> batch = {b"data": np.full((2, 3072), 255, dtype=np.uint8), b"labels": [3, 7]}
    >>> with open(root / "cifar-10-batches-py" / "test_batch", "wb") as fh:
    ...     pickle.dump(batch, fh)
    >>> tokens, labels = load_cifar10_grey(root, split="test")
    >>> tokens.shape, int(tokens.max()), labels.tolist()
    (torch.Size([2, 1024]), 255, [3, 7])
    """
    _check_split(split, ("train", "test"))
    folder = Path(root) / "cifar-10-batches-py"
    names = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
    rows, labels = [], []
    for name in names:
        path = folder / name
        if not path.is_file():
            raise _missing(path, "CIFAR-10",
                           "Unpack cifar-10-python.tar.gz (the 'python version') there.")
        with open(path, "rb") as fh:
            batch = pickle.load(fh, encoding="bytes")
        rows.append(np.asarray(batch[b"data"]))
        labels.extend(int(v) for v in batch[b"labels"])
    tokens = torch.from_numpy(cifar_to_grey(np.concatenate(rows)))
    return tokens, torch.tensor(labels, dtype=torch.long)


def bytes_to_ids(texts, *, max_length: int) -> torch.Tensor:
    """UTF-8 byte ids (byte + 1; 0 = padding), truncated to ``max_length``.

    Examples
    --------
    >>> bytes_to_ids(["hi", "é"], max_length=3)  # é is two UTF-8 bytes
    tensor([[105, 106,   0],
            [196, 170,   0]])
    """
    max_length = check_int("max_length", max_length, minimum=1)
    texts = check_str_sequence("texts", texts)
    out = torch.zeros(len(texts), max_length, dtype=torch.long)
    for i, text in enumerate(texts):
        raw = np.frombuffer(text.encode("utf-8")[:max_length], dtype=np.uint8)
        out[i, : raw.size] = torch.from_numpy(raw.astype(np.int64) + 1)
    return out


def load_imdb_bytes(root: str | Path, *, split: str = "train", max_length: int = 3072):
    """IMDB reviews as LRA Text: ``(tokens [n, max_length] int64, labels [n])``, 1 = pos.

    Vocabulary 257 (256 bytes + padding). Files are read in sorted order.

    >>> import pathlib, tempfile
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> for sub, text in (("neg", "bad"), ("pos", "good")):
    ...     (root / "aclImdb" / "test" / sub).mkdir(parents=True)
    ...     _ = (root / "aclImdb" / "test" / sub / "0_1.txt").write_text(text)
    >>> tokens, labels = load_imdb_bytes(root, split="test", max_length=4)
    >>> tokens.tolist(), labels.tolist()
    ([[99, 98, 101, 0], [104, 112, 112, 101]], [0, 1])
    """
    _check_split(split, ("train", "test"))
    texts, labels = [], []
    for label, sub in ((0, "neg"), (1, "pos")):
        folder = Path(root) / "aclImdb" / split / sub
        if not folder.is_dir():
            raise _missing(folder, "IMDB", "Unpack aclImdb_v1.tar.gz there.")
        for path in sorted(folder.glob("*.txt")):
            texts.append(path.read_text(encoding="utf-8", errors="replace"))
            labels.append(label)
    return bytes_to_ids(texts, max_length=max_length), torch.tensor(labels, dtype=torch.long)


def load_aan_pairs(root: str | Path, *, split: str = "train", max_length: int = 4000):
    """AAN citation pairs as LRA Retrieval.

    Returns ``(tokens_1, tokens_2, labels)``: two ``[n, max_length]`` byte-id tensors
    and ``[n]`` int64 labels (1 = the papers cite each other).
    ``split``: "train", "eval" or "test" (the LRA release's names).

    >>> import pathlib, tempfile
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (root / "new_aan_pairs.test.tsv").write_text(chr(9).join("1 a b ab cd".split()))
    >>> first, second, labels = load_aan_pairs(root, split="test", max_length=3)
    >>> first.tolist(), second.tolist(), labels.tolist()
    ([[98, 99, 0]], [[100, 101, 0]], [1])
    """
    _check_split(split, ("train", "eval", "test"))
    path = Path(root) / f"new_aan_pairs.{split}.tsv"
    if not path.is_file():
        raise _missing(path, "AAN", "Copy lra_release/tsv_data/new_aan_pairs.*.tsv there.")
    first, second, labels = [], [], []
    with open(path, encoding="utf-8", errors="replace", newline="") as fh:
        for row in csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE):
            if len(row) < 5:
                continue
            try:
                label = int(float(row[0]))
            except ValueError:  # a header line
                continue
            labels.append(label)
            first.append(row[3])
            second.append(row[4])
    return (bytes_to_ids(first, max_length=max_length),
            bytes_to_ids(second, max_length=max_length),
            torch.tensor(labels, dtype=torch.long))


def digits_standin(*, size: int = 32) -> TokenDataset:
    """Offline image stand-in: scikit-learn's bundled 8 x 8 digits at ``size x size``.

    The 17 grey levels (0..16) are upsampled bilinearly and mapped to 0..255, then
    flattened row by row: ``size**2`` tokens, vocabulary 256, 10 classes, 1,797 images.
    Requires scikit-learn (an ImportError says so).
    """
    size = check_int("size", size, minimum=8)
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("digits_standin needs scikit-learn (pip install scikit-learn)") \
            from exc
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16.0
    up = torch.nn.functional.interpolate(images, size=(size, size), mode="bilinear",
                                         align_corners=False)[:, 0]
    tokens = torch.round(up.clamp(0, 1) * 255).long().reshape(len(images), -1)
    shape = "8x8" if size == 8 else f"8x8 upsampled to {size}x{size}"
    return TokenDataset(
        name=f"stand-in: scikit-learn digits, {shape} (not CIFAR-10)",
        tokens=tokens, labels=torch.tensor(digits.target, dtype=torch.long),
        num_classes=10, vocab_size=256)
