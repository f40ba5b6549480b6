"""Scoring unsupervised sentence segmentation against gold boundaries.

The protocol the context-similarity chapter runs (:func:`evaluate`):

1. **The chapter's windows, split by document.** The Brown windows (gold sentences) the
   chapter already analyses, at most ``per_document`` of each document
   (:func:`first_windows_per_document`); the documents are split into a development and
   a test half (:func:`split_documents`).
2. **Two conditions.** (a) those windows as they are; (b) the same documents with sentence
   punctuation removed before tokenising (:func:`strip_sentence_punctuation`: every
   stand-alone token made only of ``. ! ? ; :``, the marks that end Brown's sentences),
   cut again from the start of each document into as many windows
   (:func:`document_windows`), so that a boundary cannot be read off a '.'.
3. **Features** (:func:`window_features`): per window, from one forward pass, the
   standardised per-head similarity matrices of the head outputs and the symmetrised
   attention maps of the content tokens, and the model's final hidden states. Beyond
   ``max_feature_bytes`` they come in chunks (:func:`feature_chunks`): the development
   chunks are kept on disk between the two passes of :func:`tune`
   (:class:`SpilledFeatures`), the test chunks are predicted one at a time; the results
   are those of one piece, bit for bit.
4. **Free parameters fixed on the development split** (:func:`tune`): for every method
   the parameters that maximise the development F1 (±1 token); head subsets are ranked
   by a development statistic (:func:`head_contrast`). The test windows are featurised
   only after every parameter is fixed.
5. **Scores on the test split** (:class:`Scores`): boundary F1 exact and with ±1 token
   tolerance (:func:`boundary_matches`, one-to-one matching), Pk (Beeferman, Berger and
   Lafferty 1999) and WindowDiff (Pevzner and Hearst 2002) from
   ``nltk.metrics.segmentation`` (:func:`pk_windowdiff`), with percentile intervals from
   a bootstrap over test documents, paired across methods (:meth:`Scores.summary`,
   :meth:`Scores.difference`).
"""
from __future__ import annotations

import contextlib
import functools
import math
import queue
import re
import tempfile
from dataclasses import dataclass, field

import numpy as np
import torch

from companion.context_similarity import segmentation as sg
from companion.context_similarity.workspace import Workspace, work_buffer
from companion._validate import check_int
from companion.corpora import Corpus, Document, Windows, windows as cut_windows

__all__ = [
    "Condition",
    "Scores",
    "SpilledFeatures",
    "boundary_matches",
    "document_windows",
    "evaluate",
    "f1_score",
    "feature_bytes_per_window",
    "feature_chunks",
    "first_windows_per_document",
    "gold_boundaries",
    "head_contrast",
    "pk_windowdiff",
    "predict_all",
    "split_documents",
    "strip_sentence_punctuation",
    "tune",
    "window_features",
]

SENTENCE_PUNCTUATION = re.compile(r"^[.!?;:]+$")

# Tuning and prediction are loops of many small reductions (n steps of the dynamic
# programme per call): on CPU every operation runs on this many intra-op threads, since
# thread synchronisation costs them more than it gains (recorded in
# benchmarks/bench_context_similarity.py). Their independent parts (the two families,
# TextTiling, the chunks of stacked predictions) run side by side instead, on as many
# Python threads as the caller's intra-op setting allows: each operation still runs on
# one thread, so the numbers do not depend on the setting. The forward passes keep the
# caller's setting.
LOOP_THREADS = 1


@contextlib.contextmanager
def _loop_threads():
    """Intra-op threads down to LOOP_THREADS; yields the caller's setting (the workers)."""
    before = torch.get_num_threads()
    torch.set_num_threads(min(before, LOOP_THREADS))
    try:
        yield before
    finally:
        torch.set_num_threads(before)


def _run_tasks(tasks: list, workers: int) -> list:
    """The results of the callables ``tasks``, in order; on up to ``workers`` Python
    threads (torch releases the interpreter lock inside its operations)."""
    workers = min(int(workers), len(tasks))
    if workers <= 1:
        return [task() for task in tasks]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda task: task(), tasks))


# --------------------------------------------------------------------------- data


def strip_sentence_punctuation(corpus: Corpus) -> Corpus:
    """The corpus with every stand-alone token made only of ``. ! ? ; :`` removed.

    Brown text is tokenised with spaces around punctuation, so this removes the marks
    that end its sentences (and the same marks inside sentences); abbreviation dots inside
    words ("Mr.", "U.S.") and commas stay. Sentences left empty are dropped.

    >>> corpus = Corpus("toy", [Document("d", ["Mr. Smith left .", "Why ?"])])
    >>> strip_sentence_punctuation(corpus).documents[0].sentences
    ['Mr. Smith left', 'Why']
    """
    if not isinstance(corpus, Corpus):
        raise TypeError(f"corpus: expected a companion.corpora.Corpus, got {type(corpus).__name__}")
    docs = []
    for d in corpus.documents:
        sents = [" ".join(w for w in s.split() if not SENTENCE_PUNCTUATION.match(w))
                 for s in d.sentences]
        docs.append(Document(d.name, [s for s in sents if s]))
    return Corpus(f"{corpus.name} (no sentence punctuation)", docs, corpus.licence)


def document_windows(corpus: Corpus, tokenizer, documents, per_document, length: int = 128,
                     max_windows: int | None = None) -> Windows:
    """At most ``per_document`` consecutive windows from the start of each listed document.

    ``documents`` are indices into ``corpus.documents``, read in the order given; the
    windows' ``document_ids`` are those indices. ``per_document`` is one int for every
    document or a sequence of ints, one per document. Documents shorter than one window
    give none. With ``max_windows``, reading stops once that many windows are cut (so only
    the documents needed are tokenised).

    >>> docs = [Document(f"d{i}", ["one two three four five six seven ."] * 9)
    ...         for i in range(3)]  # doctest: +SKIP
    >>> w = document_windows(Corpus("toy", docs), tok, [2, 0], 2, length=16)  # doctest: +SKIP
    >>> w.document_ids[:, 1].tolist()  # doctest: +SKIP
    [2, 2, 0, 0]
    """
    if not isinstance(corpus, Corpus):
        raise TypeError(f"corpus: expected a companion.corpora.Corpus, got {type(corpus).__name__}")
    documents = [check_int("documents", d, minimum=0, maximum=len(corpus.documents) - 1)
                 for d in documents]
    if not documents:
        raise ValueError("documents: expected at least one document index")
    if isinstance(per_document, (list, tuple)):
        if len(per_document) != len(documents):
            raise ValueError(f"per_document: expected one count per document "
                             f"({len(documents)}), got {len(per_document)}")
        counts = [check_int("per_document", c, minimum=1) for c in per_document]
    else:
        counts = [check_int("per_document", per_document, minimum=1)] * len(documents)
    if max_windows is not None:
        max_windows = check_int("max_windows", max_windows, minimum=1)
    parts, total = [], 0
    for d, count in zip(documents, counts):
        if max_windows is not None:
            count = min(count, max_windows - total)
            if count <= 0:
                break
        # one document at a time: tokenise no more than needed
        single = Corpus(corpus.name, [corpus.documents[d]], corpus.licence)
        try:
            w = cut_windows(single, tokenizer, length, max_windows=count)
        except ValueError:
            continue  # shorter than one window
        w.document_ids[w.document_ids >= 0] = d
        parts.append(w)
        total += len(w)
    if not parts:
        raise ValueError(f"documents: none of the {len(documents)} documents fills a window "
                         f"of {length} tokens")
    out = Windows.concat(parts)
    out.corpus = corpus.name
    return out


def first_windows_per_document(windows: Windows, per_document: int) -> Windows:
    """The first ``per_document`` windows of each document, in the order of ``windows``.

    A window's document is its first content token's (``document_ids[:, 1]``); windows
    must stay inside one document (as :func:`companion.corpora.windows` cuts them with
    ``cross_documents=False``).

    >>> first_windows_per_document(w, 1).document_ids[:, 1].tolist()  # doctest: +SKIP
    [4, 9, 2]
    """
    if not isinstance(windows, Windows):
        raise TypeError(
            f"windows: expected companion.corpora.Windows, got {type(windows).__name__}")
    per_document = check_int("per_document", per_document, minimum=1)
    if len(windows) == 0:
        raise ValueError("windows: expected at least one window")
    docs = windows.document_ids[:, 1:-1]
    if ((docs != docs[:, :1]).any(dim=1)).any() or (docs < 0).any():
        raise ValueError("windows: expected every window inside one document "
                         "(cut with cross_documents=False)")
    seen: dict[int, int] = {}
    keep = []
    for i, d in enumerate(docs[:, 0].tolist()):
        if seen.get(d, 0) < per_document:
            seen[d] = seen.get(d, 0) + 1
            keep.append(i)
    return windows[torch.tensor(keep, dtype=torch.long)]


def split_documents(documents, seed: int = 0) -> tuple[list[int], list[int]]:
    """Development and test documents: a seeded shuffle, then alternate assignment.

    >>> split_documents([3, 5, 7, 9], seed=0)
    ([5, 7], [3, 9])
    """
    documents = list(documents)
    if len(documents) < 2:
        raise ValueError(f"documents: expected at least 2 documents to split, got {len(documents)}")
    order = np.random.default_rng(check_int("seed", seed)).permutation(len(documents))
    shuffled = [documents[i] for i in order]
    return sorted(shuffled[0::2]), sorted(shuffled[1::2])


def gold_boundaries(sentence_ids: torch.Tensor) -> torch.Tensor:
    """Gold segment starts of the content tokens: BoolTensor [B, n].

    ``sentence_ids`` [B, T] as in :class:`companion.corpora.Windows` (-1 at ``[CLS]`` and
    ``[SEP]``, which must be the first and last token). ``t`` is a start when token ``t``'s
    sentence differs from token ``t - 1``'s (the first content token never is).

    Examples
    --------
    >>> gold_boundaries(torch.tensor([[-1, 0, 0, 1, 1, -1]]))  # 4 content tokens
    tensor([[False, False,  True, False]])
    """
    if not isinstance(sentence_ids, torch.Tensor) or sentence_ids.dim() != 2:
        raise ValueError("sentence_ids: expected a 2-D tensor [B, T]")
    content = sentence_ids[:, 1:-1]
    if (content < 0).any() or (sentence_ids[:, [0, -1]] >= 0).any():
        raise ValueError("sentence_ids: expected -1 exactly at the first and last token "
                         "([CLS] ... [SEP] windows without padding)")
    out = torch.zeros_like(content, dtype=torch.bool)
    out[:, 1:] = content[:, 1:] != content[:, :-1]
    return out


# --------------------------------------------------------------------------- metrics


def boundary_matches(gold, pred, tolerance: int = 0) -> tuple[int, int, int]:
    """(true positives, false positives, false negatives) of one window's boundaries.

    ``gold`` and ``pred`` are boolean vectors (or index lists); a predicted boundary is a
    true positive when it is matched one-to-one to a gold boundary at most ``tolerance``
    tokens away. On a line, the greedy left-to-right matching is a maximum matching.

    Examples
    --------
    >>> boundary_matches([2, 5], [2, 4]), boundary_matches([2, 5], [2, 4], tolerance=1)
    ((1, 1, 1), (2, 0, 0))
    """
    tolerance = check_int("tolerance", tolerance, minimum=0)

    def positions(x, name):
        if isinstance(x, torch.Tensor):
            if x.dtype == torch.bool:
                return x.nonzero().flatten().tolist()
            return sorted(int(v) for v in x.flatten().tolist())
        if isinstance(x, np.ndarray) and x.dtype == bool:
            return np.flatnonzero(x).tolist()
        try:
            return sorted(int(v) for v in x)
        except TypeError as exc:
            raise TypeError(f"{name}: expected a boolean vector or a list of positions") from exc

    g, p = positions(gold, "gold"), positions(pred, "pred")
    i = j = tp = 0
    while i < len(g) and j < len(p):
        if abs(g[i] - p[j]) <= tolerance:
            tp += 1
            i += 1
            j += 1
        elif p[j] < g[i]:
            j += 1
        else:
            i += 1
    return tp, len(p) - tp, len(g) - tp


def f1_score(tp, fp, fn):
    """``2 tp / (2 tp + fp + fn)`` elementwise (1.0 where nothing is predicted or gold).

    Examples
    --------
    >>> f1_score([1, 0], [1, 0], [1, 0])  # the second: nothing predicted or gold
    array([0.5, 1. ])
    """
    tp, fp, fn = (np.asarray(v, dtype=np.float64) for v in (tp, fp, fn))
    den = 2 * tp + fp + fn
    return np.where(den > 0, 2 * tp / np.where(den > 0, den, 1.0), 1.0)


def _as_string(row) -> str:
    """Segment starts 1..n-1 of one window as nltk's '0'/'1' boundary string (one per gap)."""
    return "".join("1" if v else "0" for v in row[1:])


def pk_windowdiff(gold, pred, k: int) -> tuple[float, float]:
    """Pk and WindowDiff of one window from ``nltk.metrics.segmentation`` (not
    re-implemented): the gaps between the ``n`` tokens as a '0'/'1' string, window ``k``.

    References
    ----------
    .. [1] D. Beeferman, A. Berger, J. Lafferty, "Statistical models for text
       segmentation", Machine Learning 34, 1999: Pk.
    .. [2] L. Pevzner, M. A. Hearst, "A critique and improvement of an evaluation metric
       for text segmentation", Computational Linguistics 28(1), 2002: WindowDiff.

    >>> pk_windowdiff([1, 0, 0, 1, 0, 0], [1, 0, 0, 1, 0, 0], 2)
    (0.0, 0.0)
    >>> pk_windowdiff([1, 0, 0, 1, 0, 0], [1, 0, 0, 0, 1, 0], 2)
    (0.5, 0.5)
    """
    from nltk.metrics.segmentation import pk, windowdiff

    k = check_int("k", k, minimum=1)
    g, p = _as_string(list(gold)), _as_string(list(pred))
    if len(g) != len(p):
        raise ValueError(f"pred: expected {len(g) + 1} tokens like gold, got {len(p) + 1}")
    if k > len(g):
        raise ValueError(f"k: expected at most the number of gaps {len(g)}, got {k}")
    return float(pk(g, p, k)), float(windowdiff(g, p, k))


def pk_window(gold: torch.Tensor) -> int:
    """nltk's default Pk window over a set of windows: half the mean gold segment length,
    ``round(gaps / (2 * boundaries))`` (at least 1).

    Examples
    --------
    >>> pk_window(torch.tensor([[True, False, True, False, False, False]]))
    1
    """
    gaps = gold.shape[0] * (gold.shape[1] - 1)
    return max(1, int(round(gaps / (2.0 * max(int(gold.sum()), 1)))))


# --------------------------------------------------------------------------- features


@dataclass
class Features:
    """Per-window inputs of the segmenters (content tokens only)."""

    heads: torch.Tensor  # [N, L, H, n, n] float32, standardised head-output similarity
    attention: torch.Tensor  # [N, L, H, n, n] float32, standardised symmetrised attention
    hidden: torch.Tensor  # [N, n, D] float32, final hidden states


def _forward(model, part: Windows, workspace: Workspace | None = None):
    """(content-token similarity view, content-token attention view, hidden) of a batch;
    with a ``workspace`` (kept between batches), the head outputs, the maps and the
    similarity matrices live in its buffers (the views are then valid until the next
    call with it)."""
    from companion import context_similarity as cs

    dev = next(model.parameters()).device
    batch = {"input_ids": part.input_ids.to(dev), "attention_mask": part.attention_mask.to(dev)}
    with torch.no_grad():
        ho = cs.head_outputs(model, batch, return_hidden=True, workspace=workspace)
        shape = (*ho.outputs.shape[:-1], ho.outputs.shape[-2])
        out = (None if workspace is None else work_buffer(
            workspace, "segmentation_similarity", math.prod(shape), ho.outputs.dtype,
            ho.outputs.device).view(shape))
        sims = cs.similarity_matrices(ho.outputs, out=out)[..., 1:-1, 1:-1]
    return sims, ho.attentions[..., 1:-1, 1:-1], ho.hidden[:, 1:-1]


def _batches(model, windows: Windows, batch_size: int):
    """The features of each batch, formed the plain way (fresh tensors; :func:`window_features`
    forms the same numbers in place)."""
    for start in range(0, len(windows), batch_size):
        sims, att, hidden = _forward(model, windows[start:start + batch_size])
        att = 0.5 * (att + att.transpose(-1, -2))
        yield sg.standardise(sims).float(), sg.standardise(att).float(), hidden.float()


def window_features(model, windows: Windows, batch_size: int = 16) -> Features:
    """Head-output similarity, attention and final hidden states of every window.

    One forward pass per batch (:func:`companion.context_similarity.head_outputs` with
    ``return_hidden=True``: outputs, attention maps and final hidden states together),
    on the model's device; the features stay there.

    >>> from transformers import AutoTokenizer, BertConfig, BertModel
    >>> from companion.context_similarity.encoder import default_model_path
    >>> from companion.corpora import windows
    >>> tok = AutoTokenizer.from_pretrained(default_model_path())
    >>> model = BertModel(BertConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
    ...     intermediate_size=16, vocab_size=tok.vocab_size, attn_implementation="eager")).eval()
    >>> s = ["the cat sat on the mat .", "a dog ran far away .", "birds sing at dawn .",
    ...      "we went home late ."]
    >>> corpus = Corpus("toy", [Document(f"d{i}", s[i:] + s[:i]) for i in range(4)])
    >>> w = windows(corpus, tok, length=16)  # one window of 14 content tokens per document
    >>> feats = window_features(model, w)
    >>> tuple(feats.heads.shape), tuple(feats.hidden.shape)  # [N, L, H, n, n], [N, n, D]
    ((4, 2, 2, 14, 14), (4, 14, 8))
    """
    if not isinstance(windows, Windows):
        raise TypeError(
            f"windows: expected companion.corpora.Windows, got {type(windows).__name__}")
    batch_size = check_int("batch_size", batch_size, minimum=1)
    if len(windows) == 0:
        raise ValueError("windows: expected at least one window, got none")
    return _window_features(model, windows, batch_size)


def _window_features(model, windows: Windows, batch_size: int,
                     kept: Workspace | None = None) -> Features:
    """:func:`window_features` on checked arguments. With ``kept`` (a workspace kept
    between calls) the two maps are views of its buffers, reused by the next call (so
    valid until then): a fresh gigabyte would cost a page fault per 4 KiB and the
    kernel's zeroing of every page. The hidden states are always fresh tensors."""
    # Filled batch by batch into tensors allocated once: collecting the batches and
    # concatenating them would hold every feature twice (at paper scale, 2,000 windows of
    # [6, 12, 126, 126] float32 similarity and attention maps: about 9 GB each time).
    # A float32 model's matrices are standardised straight into their rows (the same
    # numbers as sg.standardise, without whole-batch temporaries); other dtypes are
    # standardised in their own precision first, then stored as float32.
    def maps(name, x):
        shape = (len(windows), *x.shape[1:])
        return work_buffer(kept, name, math.prod(shape), torch.float32, x.device).view(shape)

    out: Features | None = None
    # the forward's and similarity buffers, kept between batches (and with ``kept``
    # between calls too: its names are the maps', these are the capture's own)
    batch_buffers = Workspace() if kept is None else kept
    for start in range(0, len(windows), batch_size):
        sims, att, hidden = _forward(model, windows[start:start + batch_size], batch_buffers)
        if out is None:
            out = Features(maps("heads", sims), maps("attention", att),
                           torch.empty((len(windows), *hidden.shape[1:]),
                                       dtype=torch.float32, device=hidden.device))
        rows = slice(start, start + sims.shape[0])
        heads, attention = out.heads[rows], out.attention[rows]
        if sims.dtype == torch.float32:
            sg._standardise_into(sims, heads)
            torch.add(att, att.transpose(-1, -2), out=attention)
            sg._standardise_into(attention.mul_(0.5), attention)
        else:
            heads.copy_(sg.standardise(sims))
            attention.copy_(sg.standardise(0.5 * (att + att.transpose(-1, -2))))
        out.hidden[rows] = hidden
        del sims, att, hidden
    return out


# The largest maps evaluate() holds at once (two [L, H, n, n] float32 maps a window): more
# windows are featurised in chunks of this size (development windows kept on disk between
# the two passes of tune, test windows streamed). 1 GiB is about 55 windows of a 12-layer,
# 12-head model at 128 tokens; a chunk of that size keeps the forward passes' batches full.
MAX_FEATURE_BYTES = 1 << 30


def feature_bytes_per_window(model, length: int) -> int:
    """Bytes of one window's :class:`Features` for ``model`` and windows of ``length``
    tokens (content tokens: ``length - 2``): two float32 maps [L, H, n, n] and the
    final hidden states [n, D].

    >>> from transformers import BertConfig, BertModel
    >>> model = BertModel(BertConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
    ...     intermediate_size=16, attn_implementation="eager")).eval()
    >>> feature_bytes_per_window(model, 16) == 4 * (2 * 2 * 2 * 14 * 14 + 14 * 8)
    True
    """
    from companion import context_similarity as cs

    n = length - 2
    n_layers = len(cs.encoder_layers(model))
    n_heads = int(model.config.num_attention_heads)
    return 4 * (2 * n_layers * n_heads * n * n + n * int(model.config.hidden_size))


def feature_chunks(model, windows: Windows, batch_size: int = 16, chunk_windows: int = 64,
                   *, reuse: bool = False):
    """:func:`window_features` of ``windows`` in consecutive chunks of at most
    ``chunk_windows``, one at a time (a generator): each chunk's numbers are those of
    the same windows in one :func:`window_features` call.

    ``reuse=True``: every chunk's two maps are written into the same buffers, so a
    chunk's ``heads`` and ``attention`` are valid only until the next chunk is asked for
    (its ``hidden`` stays valid). For a consumer that is done with a chunk before it
    takes the next, as :class:`SpilledFeatures` and :func:`predict_all` are: a fresh
    gigabyte per chunk would cost a page fault per 4 KiB and the zeroing of every page.

    >>> from transformers import AutoTokenizer, BertConfig, BertModel
    >>> from companion.context_similarity.encoder import default_model_path
    >>> from companion.corpora import windows
    >>> tok = AutoTokenizer.from_pretrained(default_model_path())
    >>> model = BertModel(BertConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
    ...     intermediate_size=16, vocab_size=tok.vocab_size, attn_implementation="eager")).eval()
    >>> s = ["the cat sat on the mat .", "a dog ran far away .", "birds sing at dawn ."]
    >>> corpus = Corpus("toy", [Document(f"d{i}", s[i:] + s[:i]) for i in range(3)])
    >>> [f.heads.shape[0] for f in feature_chunks(model, windows(corpus, tok, length=16),
    ...                                           chunk_windows=2)]
    [2, 1]
    """
    chunk_windows = check_int("chunk_windows", chunk_windows, minimum=1)
    if not isinstance(windows, Windows):
        raise TypeError(
            f"windows: expected companion.corpora.Windows, got {type(windows).__name__}")
    batch_size = check_int("batch_size", batch_size, minimum=1)
    kept = Workspace() if reuse else None
    for start in range(0, len(windows), chunk_windows):
        yield _window_features(model, windows[start:start + chunk_windows], batch_size, kept)


class SpilledFeatures:
    """The :class:`Features` of many windows, kept in a folder on disk chunk by chunk
    (the final hidden states, small, stay in memory); iterating reads the chunks back in
    window order, one at a time, with the same numbers. For :func:`tune`, which reads the
    development windows' maps twice.

    ``chunks``: an iterable of :class:`Features` (e.g. :func:`feature_chunks`), read once
    here; ``directory``: an existing folder, e.g. a :class:`tempfile.TemporaryDirectory`'s,
    which the caller removes.

    >>> import tempfile
    >>> g = torch.Generator().manual_seed(0)
    >>> parts = [Features(*(torch.randn(k, 2, 2, 5, 5, generator=g) for _ in "ha"),
    ...                   torch.randn(k, 5, 3, generator=g)) for k in (2, 1)]
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     spilled = SpilledFeatures(parts, folder)
    ...     back = list(spilled)
    >>> len(spilled), all(torch.equal(a.heads, b.heads) for a, b in zip(parts, back))
    (3, True)
    """

    def __init__(self, chunks, directory):
        from pathlib import Path

        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ValueError(f"directory: expected an existing folder, got {directory!r}")
        self._files, self._hidden, self.device = [], [], None
        for i, part in enumerate(chunks):
            if not isinstance(part, Features):
                raise TypeError(f"chunks: expected Features, got {type(part).__name__}")
            # plain .npy files: written and read at disk speed, no archive to build
            paths = tuple(self.directory / f"features-{i:05d}-{name}.npy"
                          for name in ("heads", "attention"))
            for path, maps in zip(paths, (part.heads, part.attention)):
                np.save(path, maps.cpu().numpy())
            self._files.append(paths)
            self._hidden.append(part.hidden)
            self.device = part.heads.device
        if not self._files:
            raise ValueError("chunks: no windows")

    def __len__(self) -> int:
        return sum(h.shape[0] for h in self._hidden)

    def __iter__(self):
        for paths, hidden in zip(self._files, self._hidden):
            # mapped copy-on-write, not read: the pages come straight from the page cache
            # (the file was just written), with no fresh memory to zero and no copy
            heads, attention = (torch.from_numpy(np.load(path, mmap_mode="c")).to(self.device)
                                for path in paths)
            yield Features(heads, attention, hidden)
            del heads, attention


def head_contrast(z: torch.Tensor, gold: torch.Tensor, max_distance: int = 16) -> torch.Tensor:
    """Per layer and head: mean standardised similarity of same-sentence pairs minus that
    of different-sentence pairs, both at distance ``1..max_distance`` (so that locality
    does not count). ``z`` [N, L, H, n, n], ``gold`` [N, n]. Returns [L, H] float64.

    >>> from companion.context_similarity import segmentation as sg
    >>> g = torch.Generator().manual_seed(0)
    >>> blocks = torch.block_diag(torch.ones(4, 4), torch.ones(4, 4)) * 2 - 1
    >>> z = sg.standardise(blocks + 0.1 * torch.randn(4, 2, 2, 8, 8, generator=g))
    >>> gold = torch.zeros(4, 8, dtype=torch.bool); gold[:, 4] = True  # sentence 2 at token 4
    >>> feats = Features(z, z, torch.randn(4, 8, 4, generator=g))
    >>> bool((head_contrast(z, gold) > 1).all())  # every head separates the two sentences
    True
    """
    max_distance = check_int("max_distance", max_distance, minimum=1)
    return _contrast_of(*_contrast_sums(z, gold, max_distance), tuple(z.shape[1:3]))


def _contrast_sums(z: torch.Tensor, gold: torch.Tensor, max_distance: int):
    """:func:`head_contrast`'s parts for a set of windows, which add over windows:
    (per-window weighted sums [N, L*H, 2] in z's dtype, number of same-sentence and of
    different-sentence pairs)."""
    n = gold.shape[-1]
    sent = gold.long().cumsum(-1)  # [N, n] sentence number within the window
    same = sent[:, :, None] == sent[:, None, :]
    idx = torch.arange(n, device=gold.device)
    dist = (idx[:, None] - idx[None, :]).abs()
    near = (dist >= 1) & (dist <= max_distance)
    w_same = (same & near).to(torch.float32)
    w_diff = (~same & near).to(torch.float32)
    # both weighted sums in one pass over z, window by window (one batched product,
    # [N, L*H, n*n] @ [N, n*n, 2]: no permuted copy of z)
    w = torch.stack([w_same, w_diff], -1).to(z.dtype).reshape(z.shape[0], n * n, 2)
    per_window = torch.bmm(z.reshape(z.shape[0], -1, n * n), w)  # [N, L*H, 2]
    # the pair counts as integers: exact for any number of windows, and they add over chunks
    return per_window, int((same & near).sum()), int((~same & near).sum())


def _contrast_of(per_window: torch.Tensor, n_same: int, n_diff: int, shape) -> torch.Tensor:
    """[L, H] float64 contrast from :func:`_contrast_sums` (of all windows, concatenated)."""
    sums = per_window.double().sum(0).reshape(*shape, 2)
    return sums[..., 0] / float(max(n_same, 1)) - sums[..., 1] / float(max(n_diff, 1))


# --------------------------------------------------------------------------- tuning


@dataclass
class Method:
    """A segmenter with its parameters fixed: :meth:`predict` gives [N, n] bool."""

    name: str
    family: str  # "head outputs" | "attention" | "TextTiling" | "random" | "even"
    params: dict
    layer: int | None = None  # for per-layer rows

    def matrix(self, feats: Features) -> torch.Tensor:
        """The combined similarity matrices [N, n, n] of a head-output / attention method."""
        p = self.params
        src = feats.heads if self.family == "head outputs" else feats.attention
        return sg.combine(src, p["layers"], p["heads"], detrend=p["detrend"], standardised=True)

    def predict(self, feats: Features, generator: torch.Generator | None = None) -> torch.Tensor:
        p = self.params
        if self.family in ("head outputs", "attention"):
            return sg.optimal_segmentation(self.matrix(feats), p["penalty"]).cpu()
        if self.family == "TextTiling":
            return sg.texttiling(feats.hidden, p["width"], p["cutoff"]).cpu()
        shape = tuple(feats.hidden.shape[:2])
        if self.family == "random":
            return sg.random_boundaries(shape, p["rate"], generator)
        if self.family == "even":
            return sg.even_boundaries(shape, p["spacing"])
        raise ValueError(f"family: unknown {self.family!r}")


DP_FAMILIES = ("head outputs", "attention")


def _dp_chunks(items: list, n_windows: int, budget: int = 1024):
    """Consecutive chunks of ``items`` with at most ``budget`` matrices (items x windows)."""
    size = max(1, budget // max(n_windows, 1))
    for i in range(0, len(items), size):
        yield items[i:i + size]


def predict_all(methods: list, feats, generator: torch.Generator | None = None) -> dict:
    """``{name: [N, n] bool}`` for every method; the dynamic-programming methods run
    stacked (one batched call per chunk, with every distinct penalty), which gives the
    same boundaries as :meth:`Method.predict` one by one (checked in the tests).

    ``feats``: the :class:`Features` of the windows, or their chunks in window order (any
    iterable of :class:`Features`, e.g. :func:`feature_chunks`, read once): each window's
    boundaries depend on its own maps only, so chunks give the same predictions while
    holding one chunk's maps at a time. The random baselines draw for all windows at once
    after the last chunk, as for one :class:`Features`.

    >>> from companion.context_similarity import segmentation as sg
    >>> g = torch.Generator().manual_seed(0)
    >>> blocks = torch.block_diag(torch.ones(4, 4), torch.ones(4, 4)) * 2 - 1
    >>> z = sg.standardise(blocks + 0.1 * torch.randn(4, 2, 2, 8, 8, generator=g))
    >>> gold = torch.zeros(4, 8, dtype=torch.bool); gold[:, 4] = True  # sentence 2 at token 4
    >>> feats = Features(z, z, torch.randn(4, 8, 4, generator=g))
    >>> methods = tune(feats, gold, final_layers=[1], penalties=[0.0], widths=(2,),
    ...                cutoffs=(0.0,))
    >>> predictions = predict_all(methods, feats, generator=g)
    >>> torch.equal(predictions["head outputs, tuned"], gold)
    True
    """
    return _predict_all(methods, feats, generator)


def _predict_all(methods, feats, generator):
    dp = [m for m in methods if m.family in DP_FAMILIES]
    pens = sorted({m.params["penalty"] for m in dp})
    pen = torch.tensor(pens, dtype=torch.float64)

    def run(chunk_feats, chunk):
        # combine() checked every matrix: they go to the programme unchecked, each
        # copied into the chunk's step-major matrices as it is formed
        n_windows, n = chunk_feats.hidden.shape[:2]
        xt = None  # [n, n, C N]
        for c, m in enumerate(chunk):
            matrix = m.matrix(chunk_feats)
            if xt is None:
                xt = matrix.new_empty((n, n, len(chunk) * n_windows))
            sg._step_major(matrix, out=xt[:, :, c * n_windows:(c + 1) * n_windows])
            del matrix
        pred = sg._segmentation_of_step_major(xt, pen, (len(chunk), n_windows)).cpu()
        return {m.name: pred[c, :, pens.index(m.params["penalty"])]
                for c, m in enumerate(chunk)}

    found: dict = {m.name: [] for m in dp}
    hidden = []
    for part in [feats] if isinstance(feats, Features) else feats:
        if not isinstance(part, Features):
            raise TypeError(f"feats: expected Features or an iterable of Features, got an "
                            f"iterable of {type(part).__name__}")
        if dp:  # the loop threads only here: the next chunk's forward pass gets them all
            with _loop_threads() as workers:
                tasks = [functools.partial(run, part, chunk)
                         for chunk in _dp_chunks(dp, part.heads.shape[0])]
                for done in _run_tasks(tasks, workers if part.heads.device.type == "cpu"
                                       else 1):
                    for name, pred in done.items():
                        found[name].append(pred)
        hidden.append(part.hidden)
        del part  # released before the next chunk is formed
    if not hidden:
        raise ValueError("feats: no windows")
    # the baselines that read only the final hidden states (and the windows' shape) run
    # on all windows at once
    whole = Features(None, None, hidden[0] if len(hidden) == 1 else torch.cat(hidden))
    out = {name: preds[0] if len(preds) == 1 else torch.cat(preds)
           for name, preds in found.items()}
    tasks = [functools.partial(lambda m: {m.name: m.predict(whole)}, m)
             for m in methods if m.family == "TextTiling"]
    with _loop_threads() as workers:
        for part in _run_tasks(tasks, workers if whole.hidden.device.type == "cpu" else 1):
            out.update(part)
    for m in methods:  # the random baselines draw from the generator in method order
        if m.family not in DP_FAMILIES and m.family != "TextTiling":
            out[m.name] = m.predict(whole, generator)
    return {m.name: out[m.name] for m in methods}


def _f1_pm1(gold: torch.Tensor, pred: torch.Tensor) -> float:
    """Micro F1 with ±1 tolerance over a set of windows ([N, n] bool each)."""
    tp = fp = fn = 0
    for g, p in zip(gold, pred):
        a, b, c = boundary_matches(g, p, 1)
        tp, fp, fn = tp + a, fp + b, fn + c
    return float(f1_score(tp, fp, fn))


def _f1_pm1_batched(gold: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
    """The micro F1 (±1) of :func:`_f1_pm1` for a stack of predictions [..., N, n] at once.

    The one-to-one matching within ±1 is the greedy of :func:`boundary_matches`: gold
    boundaries left to right, each taking the leftmost still unmatched prediction among
    t - 1, t, t + 1; vectorised over the stack.
    """
    free = pred.clone()
    n = gold.shape[-1]
    tp = torch.zeros(pred.shape[:-1], dtype=torch.float64)  # [..., N]
    for t in torch.nonzero(gold.any(0)).flatten().tolist():
        g = gold[:, t]  # [N]
        taken = torch.zeros_like(free[..., t])
        for u in (t - 1, t, t + 1):
            if 0 <= u < n:
                hit = g & free[..., u] & ~taken
                free[..., u] &= ~hit
                taken |= hit
        tp += taken.to(torch.float64)
    tp = tp.sum(-1)
    fp = pred.sum((-1, -2)).to(torch.float64) - tp
    fn = float(gold.sum()) - tp
    den = 2 * tp + fp + fn
    return torch.where(den > 0, 2 * tp / den.clamp(min=1), torch.ones_like(den))


def _layer_sets(n_layers: int, final: list[int]) -> list[tuple[int, ...]]:
    sets = [(ly,) for ly in range(n_layers)]
    for extra in (tuple(final), tuple(range(n_layers))):
        if extra not in sets:
            sets.append(extra)
    return sets


def tune(feats, gold: torch.Tensor, *, final_layers, penalties,
         head_fractions=(0.25, 1.0), widths=(4, 8, 16), cutoffs=(-1.0, -0.5, 0.0, 0.5, 1.0)
         ) -> list[Method]:
    """Fix every method's free parameters on development windows (max F1 ±1).

    ``feats``: the windows' :class:`Features`, or :class:`SpilledFeatures` (the same maps
    kept on disk and read back chunk by chunk, twice: the same methods, holding one
    chunk's maps and the per-layer head sums at a time). ``gold`` [N, n]: their gold
    boundaries.

    - head outputs / attention: for each layer alone (all heads; rows "layer l"), and over
      the best of all layer sets (each layer, ``final_layers``, all layers), head subsets
      (the top ``fraction`` of each layer's heads by :func:`head_contrast` on these
      windows), detrending on/off and ``penalties`` (row "tuned");
    - TextTiling on final hidden states: ``widths`` x ``cutoffs``;
    - random boundaries at the development rate of gold boundaries per gap, and evenly
      spaced boundaries at its inverse (nothing to tune).
    Ties go to the first candidate in this order (smaller penalty, fewer heads, no
    detrending).

    Returns the list of :class:`Method` with fixed parameters.

    >>> from companion.context_similarity import segmentation as sg
    >>> g = torch.Generator().manual_seed(0)
    >>> blocks = torch.block_diag(torch.ones(4, 4), torch.ones(4, 4)) * 2 - 1
    >>> z = sg.standardise(blocks + 0.1 * torch.randn(4, 2, 2, 8, 8, generator=g))
    >>> gold = torch.zeros(4, 8, dtype=torch.bool); gold[:, 4] = True  # sentence 2 at token 4
    >>> feats = Features(z, z, torch.randn(4, 8, 4, generator=g))
    >>> methods = tune(feats, gold, final_layers=[1], penalties=[0.0, 1.0], widths=(2,),
    ...                cutoffs=(0.0,))
    >>> methods[0].name, methods[0].params["dev_f1"]  # F1 ±1 on these windows
    ('head outputs, tuned', 1.0)
    """
    _, device = _chunks_of(feats)
    with _loop_threads() as workers:
        return _tune(feats, gold, final_layers, penalties, head_fractions, widths, cutoffs,
                     workers if device.type == "cpu" else 1)


FAMILIES = (("head outputs", "heads"), ("attention", "attention"))  # family, Features field


def _chunks_of(feats) -> tuple[list, torch.device]:
    """``feats`` as a re-iterable of :class:`Features` chunks in window order (one
    :class:`Features` is a single chunk; :class:`SpilledFeatures` reads its chunks back from
    disk), and the device of their maps."""
    if isinstance(feats, Features):
        return [feats], feats.heads.device
    if isinstance(feats, SpilledFeatures):
        return feats, feats.device
    raise TypeError(f"feats: expected Features or SpilledFeatures, got {type(feats).__name__}")


def _with_rows(chunks):
    """``(rows, chunk)`` for each chunk: the slice of the windows it holds."""
    start = 0
    for chunk in chunks:
        rows = slice(start, start + chunk.hidden.shape[0])
        start = rows.stop
        yield rows, chunk


def _tune(feats, gold, final_layers, penalties, head_fractions, widths, cutoffs, workers=1):
    pen = torch.as_tensor(list(penalties), dtype=torch.float64)
    if pen.dim() != 1 or pen.numel() == 0:
        raise ValueError(f"penalties: expected a non-empty sequence, got {penalties!r}")
    if not bool(torch.isfinite(pen).all()):
        raise ValueError(f"penalties: expected finite values, got {penalties!r}")
    chunks, _ = _chunks_of(feats)
    gold = gold.cpu()
    widths = [w for w in widths if w < gold.shape[-1]]
    # Two passes over the windows' maps, so that they can come chunk by chunk (read back
    # from disk, SpilledFeatures): each family's head ranking (head_contrast, whose parts
    # add over windows), then the per-layer sums of the heads it keeps. Within a chunk the
    # two families run side by side.
    parts = {family: [] for family, _ in FAMILIES}
    counts = {family: [0, 0] for family, _ in FAMILIES}
    hidden, shape, n_windows = [], None, 0
    for rows, chunk in _with_rows(chunks):
        n_windows = rows.stop
        if rows.stop > gold.shape[0]:
            raise ValueError(f"gold: expected one row per window (at least {rows.stop}), "
                             f"got {gold.shape[0]}")
        g = gold[rows].to(chunk.heads.device)
        shape = tuple(chunk.heads.shape[1:3])
        done = _run_tasks([functools.partial(_contrast_sums, getattr(chunk, field), g, 16)
                           for _, field in FAMILIES], workers)
        for (family, _), (per_window, n_same, n_diff) in zip(FAMILIES, done):
            parts[family].append(per_window)
            counts[family][0] += n_same
            counts[family][1] += n_diff
        hidden.append(chunk.hidden)
        del chunk  # released before the next chunk is read
    if n_windows != gold.shape[0]:
        raise ValueError(f"gold: expected one row per window ({n_windows}), "
                         f"got {gold.shape[0]}")
    n_layers, n_heads = shape
    tops = {family: _top_heads(_contrast_of(torch.cat(parts[family]), *counts[family], shape),
                               head_fractions)
            for family, _ in FAMILIES}
    sums = {family: {} for family, _ in FAMILIES}  # family -> fraction -> layer -> [N, n, n]
    for rows, chunk in _with_rows(chunks):
        whole = rows.start == 0 and rows.stop == n_windows  # one chunk: its sums as they are
        done = _run_tasks([functools.partial(_layer_head_sums, getattr(chunk, field),
                                             tops[family]) for family, field in FAMILIES],
                          workers)
        del chunk  # released before the next chunk is read
        for (family, _), chunk_sums in zip(FAMILIES, done):
            for frac, by_layer in chunk_sums.items():
                into = sums[family].setdefault(frac, {})
                for ly, s in by_layer.items():
                    if whole:
                        into[ly] = s
                        continue
                    if ly not in into:
                        into[ly] = s.new_empty((n_windows, *s.shape[1:]))
                    into[ly][rows] = s
    candidates = [_family_candidates(sums[family], tops[family], n_layers, n_heads,
                                     list(final_layers), head_fractions)
                  for family, _ in FAMILIES]
    prefix = sg._texttiling_prefix(hidden[0] if len(hidden) == 1 else torch.cat(hidden))
    chunks = [list(_dp_chunks(c, 2 * gold.shape[0])) for c in candidates]  # pairs
    buffers = queue.SimpleQueue()  # one set of work tensors per worker, reused
    for _ in range(max(1, min(int(workers), sum(map(len, chunks))))):
        buffers.put({})
    tasks = [functools.partial(_score_chunk, chunk, gold, pen, buffers)
             for family_chunks in chunks for chunk in family_chunks]
    tasks += [functools.partial(_score_texttiling, prefix, gold, w, cutoffs) for w in widths]
    results = iter(_run_tasks(tasks, workers))
    methods: list[Method] = []
    for (family, _), family_chunks in zip(FAMILIES, chunks):
        scored = [s for _ in family_chunks for s in next(results)]
        methods += _family_methods(family, scored, n_layers)
    best_tt = None
    for w in widths:
        for c, f1 in zip(cutoffs, next(results)):
            if best_tt is None or f1 > best_tt[0]:
                best_tt = (f1, dict(width=w, cutoff=c, dev_f1=f1))
    methods.append(Method("TextTiling, final hidden states", "TextTiling", best_tt[1]))
    rate = float(gold[:, 1:].float().mean())
    methods.append(Method("random at the gold rate", "random", dict(rate=rate)))
    methods.append(Method("evenly spaced", "even", dict(spacing=max(1.0, 1.0 / max(rate, 1e-9)))))
    return methods


def _top_heads(contrast: torch.Tensor, head_fractions) -> dict:
    """``{fraction: {layer: sorted heads}}``: each layer's top ``fraction`` of heads by
    ``contrast`` [L, H] (ties: the lower head first, as argsort keeps them)."""
    n_layers, n_heads = contrast.shape
    order = contrast.argsort(dim=-1, descending=True).cpu()
    tops = {}
    for frac in head_fractions:
        k = max(1, int(round(frac * n_heads)))
        tops[frac] = {ly: sorted(order[ly, :k].tolist()) for ly in range(n_layers)}
    return tops


def _layer_head_sums(src: torch.Tensor, tops: dict) -> dict:
    """``{fraction: {layer: [N, n, n]}}``: the sums over each layer's kept heads of a
    chunk's maps (the sums :func:`companion.context_similarity.segmentation.combine`
    forms), checked once here since every candidate is made from them."""
    out = {}
    for frac, top in tops.items():
        out[frac] = {ly: sg._head_sum(src, ly, heads) for ly, heads in top.items()}
        for s in out[frac].values():
            sg._check_square("feats", s)
    return out


def _family_candidates(sums, tops, n_layers, n_heads, final_layers, head_fractions) -> list:
    """Every candidate of one family (see :func:`tune`), in the order ties are broken:
    pairs ``[(params, recipe) without, with detrending]`` of one head fraction and
    layer set, the recipe saying how :func:`_score_chunk` forms its matrices from the
    per-layer head sums (:func:`_layer_head_sums`)."""
    pairs = []
    for frac in head_fractions:
        top = tops[frac]
        k = len(top[0])
        for layers in _layer_sets(n_layers, final_layers):
            pairs.append([(dict(layers=list(layers), heads={ly: top[ly] for ly in layers},
                                detrend=detrend, head_fraction=frac,
                                all_heads=(k == n_heads)),
                           (sums[frac], layers, k * len(layers), detrend))
                          for detrend in (False, True)])
    return pairs


def _score_chunk(chunk, gold, pen, buffers=None) -> list:
    """``[(dev F1, params with the best penalty)]`` of every candidate of a chunk of
    pairs (:func:`_family_candidates`): their matrices formed in step-major layout, one
    programme over all of them, with every penalty.

    ``buffers``: a queue of dicts of work tensors, one taken for the call and put back:
    the matrices are formed in tensors kept between chunks (at paper size each is
    tens of MB, which a fresh allocation maps page by page again every time), with the
    same numbers (:func:`companion.context_similarity.segmentation._mean_of_sums`,
    ``_detrend`` and ``_standardise_into`` with ``out``).
    """
    items = [item for pair in chunk for item in pair]
    n_windows, n = gold.shape
    work = buffers.get() if buffers is not None else {}
    try:
        return _score_chunk_in(chunk, items, gold, pen, work, n_windows, n)
    finally:
        if buffers is not None:
            buffers.put(work)


def _buffer(work: dict, name: str, shape, like: torch.Tensor) -> torch.Tensor:
    """``work[name]`` with this shape and ``like``'s dtype and device (made when missing
    or different)."""
    t = work.get(name)
    shape = tuple(shape)
    if t is None or tuple(t.shape) != shape or t.dtype != like.dtype or t.device != like.device:
        work.pop(name, None)
        t = work[name] = like.new_empty(shape)
    return t


def _score_chunk_in(chunk, items, gold, pen, work, n_windows, n) -> list:
    first = chunk[0][0][1]
    like = first[0][first[1][0]]  # a head sum: the matrices' dtype and device
    xt = _buffer(work, "step_major", (n, n, len(items) * n_windows), like)
    mean = _buffer(work, "mean", like.shape, like)
    matrix = _buffer(work, "matrix", like.shape, like)
    for p, pair in enumerate(chunk):
        sums, layers, count, _ = pair[0][1]
        sg._mean_of_sums([sums[ly] for ly in layers], count, out=mean)  # shared by the pair
        for d, (_, recipe) in enumerate(pair):
            if recipe[3]:  # detrended
                sg._standardise_into(sg._detrend(mean, out=matrix), matrix)
            else:
                sg._standardise_into(mean, matrix)
            c = 2 * p + d
            sg._step_major(matrix, out=xt[:, :, c * n_windows:(c + 1) * n_windows])
    pred = sg._segmentation_of_step_major(xt, pen, (len(items), n_windows)).cpu()
    f1 = _f1_pm1_batched(gold, pred.transpose(1, 2))  # [C, P]
    scored = []
    for c, (params, _) in enumerate(items):
        i = int(f1[c].argmax())  # first maximum: the smaller penalty
        scored.append((float(f1[c, i]), {**params, "penalty": float(pen[i]),
                                         "dev_f1": float(f1[c, i])}))
    return scored


def _family_methods(family, scored, n_layers) -> list:
    """The "tuned" row and the per-layer rows of one family from its scored candidates."""
    best = max(scored, key=lambda x: x[0])  # first maximum
    methods = [Method(f"{family}, tuned", family, best[1])]
    for ly in range(n_layers):
        mine = [c for c in scored if c[1]["layers"] == [ly] and c[1]["all_heads"]]
        methods.append(Method(f"{family}, layer {ly + 1}", family,
                              max(mine, key=lambda x: x[0])[1], layer=ly))
    return methods


def _score_texttiling(prefix, gold, width, cutoffs) -> list[float]:
    """The development F1 (±1) of TextTiling at one block width, for every cutoff."""
    depth = sg._texttiling_depth(prefix, width)
    cuts = torch.stack([sg.texttiling_cut(depth, c) for c in cutoffs]).cpu()
    return [float(f1) for f1 in _f1_pm1_batched(gold, cuts)]


# --------------------------------------------------------------------------- scores


@dataclass
class Scores:
    """Per-window scores of several methods on one set of test windows.

    ``stats[name]`` is a float64 array [N, 8]: tp, fp, fn (exact), tp, fp, fn (±1), Pk,
    WindowDiff; ``documents`` [N] the document of each window.

    >>> from companion.context_similarity import segmentation as sg
    >>> g = torch.Generator().manual_seed(0)
    >>> blocks = torch.block_diag(torch.ones(4, 4), torch.ones(4, 4)) * 2 - 1
    >>> z = sg.standardise(blocks + 0.1 * torch.randn(4, 2, 2, 8, 8, generator=g))
    >>> gold = torch.zeros(4, 8, dtype=torch.bool); gold[:, 4] = True  # sentence 2 at token 4
    >>> feats = Features(z, z, torch.randn(4, 8, 4, generator=g))
    >>> scores = Scores.compute(gold, {"gold": gold, "none": torch.zeros_like(gold)},
    ...                         documents=[0, 0, 1, 1], k=2)
    >>> scores.stats["gold"][0].tolist()  # tp fp fn, tp fp fn (±1), Pk, WindowDiff
    [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    """

    stats: dict
    documents: np.ndarray
    k: int
    METRICS = ("F1", "F1 ±1", "Pk", "WindowDiff")

    @classmethod
    def compute(cls, gold: torch.Tensor, predictions: dict, documents, k: int) -> Scores:
        gold = gold.cpu()
        stats = {}
        for name, pred in predictions.items():
            pred = pred.cpu()
            if tuple(pred.shape) != tuple(gold.shape):
                raise ValueError(f"predictions[{name!r}]: expected shape {tuple(gold.shape)}, "
                                 f"got {tuple(pred.shape)}")
            rows = []
            for g, p in zip(gold, pred):
                rows.append([*boundary_matches(g, p, 0), *boundary_matches(g, p, 1),
                             *pk_windowdiff(g.tolist(), p.tolist(), k)])
            stats[name] = np.asarray(rows, dtype=np.float64)
        return cls(stats, np.asarray(documents), k)

    def _doc_sums(self, name: str) -> np.ndarray:
        docs, inv = np.unique(self.documents, return_inverse=True)
        out = np.zeros((len(docs), 9))
        np.add.at(out[:, :8], inv, self.stats[name])
        np.add.at(out[:, 8], inv, 1.0)
        return out

    @staticmethod
    def _metrics(sums: np.ndarray) -> np.ndarray:
        """[..., 9] sums -> [..., 4] (F1, F1 ±1, Pk, WindowDiff)."""
        f1 = f1_score(sums[..., 0], sums[..., 1], sums[..., 2])
        f1t = f1_score(sums[..., 3], sums[..., 4], sums[..., 5])
        return np.stack([f1, f1t, sums[..., 6] / sums[..., 8], sums[..., 7] / sums[..., 8]], -1)

    def _resamples(self, n_boot: int, seed: int) -> np.ndarray:
        n_docs = len(np.unique(self.documents))
        rng = np.random.default_rng(seed)
        idx = rng.integers(0, n_docs, size=(n_boot, n_docs))
        return np.stack([np.bincount(r, minlength=n_docs) for r in idx]).astype(np.float64)

    def point(self, name: str) -> np.ndarray:
        return self._metrics(self._doc_sums(name).sum(0))

    def boot(self, name: str, n_boot: int = 1000, seed: int = 0) -> np.ndarray:
        """[n_boot, 4] metrics over bootstrap resamples of the documents (the same
        resamples for every method with the same ``seed``: paired)."""
        w = self._resamples(n_boot, seed)  # [B, docs] multiplicities
        return self._metrics(w @ self._doc_sums(name))

    def summary(self, n_boot: int = 1000, seed: int = 0, level: float = 0.95):
        """pandas DataFrame: one row per method, each metric with its percentile interval."""
        import pandas as pd

        q = ((1 - level) / 2, (1 + level) / 2)
        rows = []
        for name in self.stats:
            pt, bs = self.point(name), self.boot(name, n_boot, seed)
            lo, hi = np.quantile(bs, q, axis=0)
            row = {"method": name}
            for j, m in enumerate(self.METRICS):
                row[m] = pt[j]
                row[f"{m} lo"] = lo[j]
                row[f"{m} hi"] = hi[j]
            s = self.stats[name]
            row["predicted / gold"] = (s[:, 0] + s[:, 1]).sum() / max((s[:, 0] + s[:, 2]).sum(), 1)
            rows.append(row)
        return pd.DataFrame(rows)

    def difference(self, a, b, metric: str, n_boot: int = 1000, seed: int = 0,
                   level: float = 0.95) -> tuple[float, float, float]:
        """(point, lo, hi) of ``metric(a) - metric(b)``, paired bootstrap over documents.

        ``a`` and ``b`` are method names, or lists of names: a list stands for its best
        member (the highest F1, the lowest Pk / WindowDiff) in the full sample and in
        each resample.
        """
        if metric not in self.METRICS:
            raise ValueError(f"metric: expected one of {self.METRICS}, got {metric!r}")
        j = self.METRICS.index(metric)
        best = np.max if j < 2 else np.min

        def values(names, arg, fn):
            names = [names] if isinstance(names, str) else list(names)
            if not names:
                raise ValueError(f"{arg}: expected a method name or a non-empty list")
            for name in names:
                if name not in self.stats:
                    raise ValueError(
                        f"{arg}: unknown method {name!r}; expected one of {list(self.stats)}")
            return best(np.stack([fn(name) for name in names]), axis=0)

        point = (values(a, "a", lambda x: self.point(x)[j])
                 - values(b, "b", lambda x: self.point(x)[j]))
        d = (values(a, "a", lambda x: self.boot(x, n_boot, seed)[:, j])
             - values(b, "b", lambda x: self.boot(x, n_boot, seed)[:, j]))
        lo, hi = np.quantile(d, ((1 - level) / 2, (1 + level) / 2))
        return float(point), float(lo), float(hi)


# --------------------------------------------------------------------------- protocol


@dataclass
class Condition:
    """One condition's run: its windows, fixed methods, test predictions and scores, as
    :func:`evaluate` returns it (whose example runs the protocol on a toy corpus).

    >>> from dataclasses import fields
    >>> [f.name for f in fields(Condition)]
    ['name', 'dev', 'test', 'methods', 'predictions', 'scores', 'test_features']
    """

    name: str
    dev: Windows
    test: Windows
    methods: list
    predictions: dict
    scores: Scores
    test_features: Features | None = field(default=None, repr=False)


def evaluate(model, tokenizer, windows: Windows, *, corpus: Corpus, final_layers, penalties,
             per_document: int | None = None, seed: int = 0, batch_size: int = 16,
             strip_punctuation: bool = False, name: str = "", keep_test_features: bool = False,
             max_feature_bytes: int | None = MAX_FEATURE_BYTES, **tune_kwargs) -> Condition:
    """The whole protocol for one condition (see the module docstring).

    Parameters
    ----------
    windows : Windows
        Windows already cut from ``corpus`` (each inside one document, ``document_ids``
        indexing ``corpus.documents``): the chapter's own windows. With ``per_document``,
        only the first that many of each document are used.
    corpus : Corpus
        The corpus with gold sentences the windows come from.
    strip_punctuation : bool
        Condition (b): the same documents with sentence punctuation removed, cut again
        from their start into as many windows as ``windows`` holds of each.
    max_feature_bytes : int or None
        The largest features held in memory at once (:func:`feature_bytes_per_window`).
        A split whose features are larger is featurised in chunks of that size: the
        development chunks are kept in a temporary folder on disk between the two passes
        of :func:`tune` (:class:`SpilledFeatures`), the test chunks are predicted one by
        one (:func:`predict_all`), with the same results. None: all at once.

    Development windows are featurised and every method's parameters fixed
    (:func:`tune`) before the test windows are featurised and scored.

    >>> from transformers import AutoTokenizer, BertConfig, BertModel
    >>> from companion.context_similarity.encoder import default_model_path
    >>> from companion.corpora import windows
    >>> tok = AutoTokenizer.from_pretrained(default_model_path())
    >>> model = BertModel(BertConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
    ...     intermediate_size=16, vocab_size=tok.vocab_size, attn_implementation="eager")).eval()
    >>> s = ["the cat sat on the mat .", "a dog ran far away .", "birds sing at dawn .",
    ...      "we went home late ."]
    >>> corpus = Corpus("toy", [Document(f"d{i}", s[i:] + s[:i]) for i in range(4)])
    >>> w = windows(corpus, tok, length=16)  # one window of 14 content tokens per document
    >>> c = evaluate(model, tok, w, corpus=corpus, final_layers=[1], penalties=[0.0, 1.0],
    ...              widths=(2,), cutoffs=(0.0,))
    >>> isinstance(c, Condition), len(c.dev) + len(c.test), len(c.methods)
    (True, 4, 9)
    >>> sorted(c.predictions) == sorted(m.name for m in c.methods)
    True
    >>> set(c.dev.document_ids[:, 1].tolist()) & set(c.test.document_ids[:, 1].tolist())
    set()

    References
    ----------
    Halevi et al., arXiv 2512.21956, abstract: final-layer attention on separators,
    suggesting segmentation.
    """
    if not isinstance(corpus, Corpus):
        raise TypeError(f"corpus: expected a companion.corpora.Corpus, got {type(corpus).__name__}")
    if per_document is not None:
        windows = first_windows_per_document(windows, per_document)
    elif not isinstance(windows, Windows):
        raise TypeError(
            f"windows: expected companion.corpora.Windows, got {type(windows).__name__}")
    doc_of = windows.document_ids[:, 1].tolist()
    if max(doc_of) >= len(corpus.documents) or min(doc_of) < 0:
        raise ValueError(f"windows: document ids outside corpus {corpus.name!r} "
                         f"({len(corpus.documents)} documents)")
    counts: dict[int, int] = {}
    for d in doc_of:
        counts[d] = counts.get(d, 0) + 1
    dev_docs, test_docs = split_documents(list(counts), seed)

    def split(docs):
        if strip_punctuation:
            return document_windows(text, tokenizer, docs, [counts[d] for d in docs],
                                    length=windows.length)
        chosen = set(docs)
        keep = torch.tensor([d in chosen for d in doc_of])
        return windows[keep.nonzero().flatten()]

    text = strip_sentence_punctuation(corpus) if strip_punctuation else corpus
    dev, test = split(dev_docs), split(test_docs)
    gold_dev = gold_boundaries(dev.sentence_ids)
    chunk = len(dev) + len(test)  # all at once
    if max_feature_bytes is not None:
        max_feature_bytes = check_int("max_feature_bytes", max_feature_bytes, minimum=1)
        chunk = max(1, max_feature_bytes // feature_bytes_per_window(model, windows.length))
    if len(dev) <= chunk:
        methods = tune(window_features(model, dev, batch_size), gold_dev,
                       final_layers=final_layers, penalties=penalties, **tune_kwargs)
    else:
        with tempfile.TemporaryDirectory(prefix="companion-segmentation-") as folder:
            feats = SpilledFeatures(feature_chunks(model, dev, batch_size, chunk, reuse=True),
                                    folder)
            methods = tune(feats, gold_dev, final_layers=final_layers, penalties=penalties,
                           **tune_kwargs)
            del feats
    k = pk_window(gold_dev)
    gen = torch.Generator().manual_seed(seed)
    if keep_test_features or len(test) <= chunk:
        feats = window_features(model, test, batch_size)
        preds = predict_all(methods, feats, gen)
    else:
        feats = None
        preds = predict_all(methods, feature_chunks(model, test, batch_size, chunk,
                                                    reuse=True), gen)
    gold = gold_boundaries(test.sentence_ids)
    scores = Scores.compute(gold, preds, test.document_ids[:, 1].tolist(), k)
    return Condition(name, dev, test, methods, preds, scores,
                     feats if keep_test_features else None)
