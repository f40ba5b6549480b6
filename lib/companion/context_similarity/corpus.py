"""The corpus pass: :func:`analyse_corpus` over windows, batch by batch (on a CPU with
2 to ``lanes`` intra-op threads, one batch per thread: lanes, see
:class:`CaptureSettings`), in one process, sharded over ``torch.distributed`` ranks,
or started under ``torchrun`` from here
(``nproc``); optionally resumable (``checkpoint``: partial sums saved atomically every
few hundred windows, a re-run continues from the last save); and the
``torchrun -m companion.context_similarity`` command line.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import threading
from dataclasses import asdict
from pathlib import Path

import torch

from companion._validate import check_int
from companion.context_similarity.capture import (
    CaptureSettings,
    _check_model,
    analyse_batch,
    buffered_attention,
    wo_gram,
)
from companion.context_similarity.encoder import (
    WHERE,
    _heads,
    load_encoder,
    separator_ids,
)
from companion.context_similarity.stats import SimilarityStats
from companion.context_similarity.workspace import Workspace
from companion.devices import resolve_device
from companion.heap import reusing_freed_memory
from companion.thread_budget import adopt_thread_budget

__all__ = ["analyse_corpus", "checkpoint_dir", "checkpoint_key", "clear_workspaces"]

# Work buffers of analyse_corpus, one Workspace per device, buffer slot (see _in_lanes)
# and where entry, kept between calls: buffers of tens of megabytes are handed back to
# the operating system when freed, and page-faulting them in again costs about as much
# per call as a batch of analysis. A cache, not a setting: clear_workspaces() frees them.
_SHARED_WORKSPACES: dict[str, Workspace] = {}
# buffer slots per lane of analyse_corpus (see _in_lanes)
LANE_SLOTS = 2


def clear_workspaces() -> None:
    """Free the work buffers :func:`analyse_corpus` keeps between calls (the bool map of
    ``A >= attention_threshold``, ``L H B T^2`` bytes, the head outputs and the
    similarity buffers: about 60 MB per device and set of buffers for MiniLM in
    float32, batches of 16; the serial pass keeps one set, lanes two each).

    >>> clear_workspaces()
    """
    _SHARED_WORKSPACES.clear()


def _distributed(distributed, group):
    import torch.distributed as dist

    active = dist.is_available() and dist.is_initialized()
    if distributed is None:
        distributed = active
    if distributed and not active:
        raise ValueError("distributed: True needs an initialised torch.distributed process group")
    if not distributed:
        return False, 0, 1
    return True, dist.get_rank(group), dist.get_world_size(group)


# every forward pass allocates and frees the same large temporaries: the heap keeps their
# pages for the next batch instead of mapping fresh ones (a page fault per 4 KiB, 14 % of
# a window's time on the 12-layer encoder); the per-window parts the pass keeps are held
# outside the heap (SimilarityStats), so that they leave no holes and the heap stays flat
@reusing_freed_memory()
def analyse_corpus(
    model,
    windows,
    *,
    tokenizer=None,
    separators: dict[str, int] | None = None,
    where: str | tuple[str, ...] = "pre_wo",
    batch_size: int = 16,
    percentile: float = 1.0,
    attention_threshold: float = 0.1,
    device: str | torch.device | None = None,
    progress: bool = True,
    distributed: bool | None = None,
    group=None,
    per_window: bool | tuple[bool, ...] = False,
    track_tokens: torch.Tensor | None = None,
    nproc: int | None = None,
    settings: CaptureSettings = CaptureSettings(),
    into: SimilarityStats | tuple[SimilarityStats | None, ...] | None = None,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int = 256,
) -> SimilarityStats | tuple[SimilarityStats, ...]:
    """Context-similarity statistics of a model over a set of windows.

    The windows are split into consecutive batches of ``batch_size``; batch ``k`` is
    processed by rank ``k mod world_size`` when a ``torch.distributed`` process group is
    initialised (``torchrun``), and the statistics are all-reduced, so every rank returns
    the statistics of all windows, equal to a single-process run (identical batches give
    identical forward passes; only the float64 summation order differs).

    Parameters
    ----------
    model : from :func:`load_encoder` (eval mode, eager attention).
    windows : :class:`companion.corpora.Windows`.
    tokenizer, separators : the separator tokens whose attention mass is tracked:
        ``separators`` (name -> id), or ``separator_ids(tokenizer)`` ('.', ',', '[SEP]').
    where : "pre_wo" | "post_wo" (ablation; via :func:`wo_gram`), or a tuple of them:
        one forward pass feeds one SimilarityStats per entry (the post-W_O statistics use
        the same head outputs with the metric), each equal to a pass of its own.
    batch_size : windows per forward pass.
    percentile, attention_threshold : see :class:`SimilarityStats`.
    device : where the statistics accumulate (default: the model's device). Each batch
        of windows is copied to the model's device for the forward pass (the windows
        themselves stay where they are).
    progress : show a tqdm progress bar (rank 0 only).
    distributed : None = shard when a process group is initialised; False = never.
    group : the process group (default: the world).
    per_window : also keep every window's contribution (for a bootstrap over windows;
        see :class:`SimilarityStats`). Under torchrun the windows come back grouped by rank.
        With a tuple ``where``: one bool for all, or a tuple with one per entry.
    track_tokens : optional [L, H] token ids to count per window (needs ``per_window``;
        see :meth:`SimilarityStats.track_tokens`); with a tuple ``where``, counted by the
        statistics that keep ``per_window``.
    nproc : run the pass under ``torchrun`` with this many processes from here (a
        notebook, one process): :func:`companion.parallel.torchrun_call` starts them, each
        takes every ``nproc``-th batch, and the all-reduced statistics come back, per-window
        parts in window order. Default: the book's ``--nproc`` (``COMPANION_NPROC``, 1).
        Ignored inside an initialised process group (the ranks are already there).
    settings : :class:`CaptureSettings` of the pass (speed only: the default stops the
        forward after the last layer's attention and, on a CPU with 2 to ``lanes``
        intra-op threads (default 2), keeps one batch in flight per thread, one intra-op
        thread each, their parts added in batch order; the statistics are the same either way, bit
        for bit).
    into : statistics to add these windows to, in batch order (one per ``where`` entry,
        None: fresh ones), instead of new ones; their own ``per_window`` and tracked tokens
        apply. Two calls over consecutive windows then sum exactly as one call over all of
        them does when the first call's windows are a multiple of ``batch_size``.
    checkpoint : a directory, or None. Makes the pass resumable: the windows are taken
        in chunks of ``checkpoint_every`` windows (rounded up to whole batches), each
        added to the statistics with ``into`` (so the sums are those of one pass, bit for
        bit, with ``nproc=1``), and after each chunk the partial statistics are saved
        atomically (written to a temporary file, then renamed) as
        ``context-similarity-<key>.pt``. The key is a SHA-256 of the model (class,
        configuration, dtype and every weight's bytes), the windows (all four tensors and
        the corpus names), the parameters (``where``, ``batch_size``, ``percentile``,
        ``attention_threshold``, the separator ids, ``per_window``, ``track_tokens``,
        ``settings``, ``checkpoint_every``, ``nproc``, the statistics' device type), the
        source of ``companion.context_similarity`` and the torch and transformers
        versions. A call with the same key after an interrupt, a kill or a crash
        continues after the last saved chunk and returns what an uninterrupted call
        returns, bit for bit (tested with a killed process), given the model loaded the
        same way (e.g. :func:`load_encoder` on the same folder: where a loaded weight
        lies in memory can change a GEMM's last bits); a different key never reads
        another key's file. A finished pass leaves its file: the same call again returns
        the saved statistics without a forward pass. Not with ``into`` or inside an
        initialised process group (call it from one process, with ``nproc``).
    checkpoint_every : windows between saves (default 256: a few seconds of saving, the
        per-window parts included, against minutes of forward passes for 12 layers).

    Returns
    -------
    SimilarityStats on ``device`` (``into`` itself where given), or a tuple of them, one
    per entry, for a tuple ``where``.

    >>> import inspect
    >>> inspect.signature(analyse_corpus).parameters["where"].default
    'pre_wo'

    Complexity
    ----------
    One forward pass per window plus O(L H T^2) per window for the statistics. Memory:
    work buffers of about 60 MB per lane (MiniLM, float32, batches of 16: the attention
    maps are not kept, only ``A >= attention_threshold``, ``L H B T^2`` bytes), every
    lane's kept between calls on each device (:func:`clear_workspaces` frees them: a
    fresh lane's buffers would be page-faulted in again by every call); not for
    concurrent calls from threads (the buffers are shared by all calls). During the pass
    glibc's heap reuses the freed temporaries of the forward passes
    (:func:`companion.heap.reusing_freed_memory`; afterwards its free memory goes back to
    the system), and the per-window parts are kept outside it.
    """
    from companion.corpora import Windows

    if not isinstance(windows, Windows):
        raise TypeError(
            f"windows: expected companion.corpora.Windows, got {type(windows).__name__}")
    if len(windows) == 0:
        raise ValueError("windows: expected at least one window, got none")
    batch_size = check_int("batch_size", batch_size, minimum=1)
    wheres, windowed, targets = _where_plan(where, per_window, into)
    if separators is None:
        if tokenizer is None:
            raise ValueError("tokenizer: needed to find the separator tokens (or pass separators=)")
        separators = separator_ids(tokenizer)
    _check_model(model, windows.length)
    import torch.distributed as dist

    from companion.parallel import requested_nproc, torchrun_call

    nproc = requested_nproc() if nproc is None else check_int("nproc", nproc, minimum=1)
    if checkpoint is not None:
        if not isinstance(checkpoint, (str, os.PathLike)):
            raise TypeError(f"checkpoint: expected a directory path or None, got "
                            f"{type(checkpoint).__name__}")
        checkpoint_every = check_int("checkpoint_every", checkpoint_every, minimum=1)
        if into is not None:
            raise ValueError("into: not with checkpoint (a resumable pass makes its own "
                             "statistics; merge them afterwards)")
        if distributed is not False and dist.is_available() and dist.is_initialized():
            raise ValueError("checkpoint: not inside an initialised process group; call "
                             "analyse_corpus from one process with nproc= instead")
        out = _checkpointed(model, windows, Path(checkpoint), checkpoint_every, dict(
            separators=dict(separators), where=wheres, batch_size=batch_size,
            percentile=percentile, attention_threshold=attention_threshold, device=device,
            per_window=windowed, track_tokens=track_tokens, nproc=nproc, settings=settings,
            distributed=distributed, group=group), progress)
        return out if isinstance(where, tuple) else out[0]
    if nproc > 1 and distributed is not False and not (dist.is_available()
                                                         and dist.is_initialized()):
        kind = next(model.parameters()).device.type
        out = torchrun_call("companion.context_similarity.corpus:analyse_corpus", dict(
            model=model, windows=windows, separators=separators, where=wheres,
            batch_size=batch_size, percentile=percentile,
            attention_threshold=attention_threshold, device=device, progress=progress,
            per_window=windowed, track_tokens=track_tokens, nproc=1, settings=settings),
            nproc=nproc, device="cuda" if kind == "cuda" else "cpu")
        dev = resolve_device(device) if device is not None else next(model.parameters()).device
        out = tuple(s.to(dev) if t is None else t.merge(s)
                    for s, t in zip(out, targets))
        return out if isinstance(where, tuple) else out[0]
    model_device = next(model.parameters()).device
    dev = model_device if device is None else resolve_device(device)
    n_layers, n_heads, _ = _heads(model)
    is_dist, rank, world = _distributed(distributed, group)
    fresh = []  # what is summed here; under a process group, added to ``into`` after the all-reduce
    for keep, target in zip(windowed, targets):
        s = SimilarityStats(
            n_layers=n_layers, n_heads=n_heads, length=windows.length,
            vocab_size=int(model.config.vocab_size), percentile=percentile,
            attention_threshold=attention_threshold, separators=separators, device=dev,
            per_window=keep,
        )
        if target is not None:
            target._check_compatible(s)
            if is_dist:  # all-reduce the new windows only, then add them to ``into``
                s = SimilarityStats(**target.config(), device=dev)
                if target._tracked is not None:
                    s.track_tokens(target._tracked)
            else:
                s = target
        elif track_tokens is not None and keep:
            s.track_tokens(track_tokens)
        fresh.append(s)
    if track_tokens is not None and not any(windowed):
        raise ValueError("token_ids: tracking tokens needs per_window=True")
    n_batches = math.ceil(len(windows) / batch_size)
    mine = range(rank, n_batches, world)
    gram = wo_gram(model) if "post_wo" in wheres else None
    metrics = [gram if w == "post_wo" else None for w in wheres]
    bar = None
    if progress and rank == 0:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(windows), desc=f"context similarity ({'+'.join(wheres)})",
                   unit="window")
    threads = torch.get_num_threads()
    # lanes only where each gets one intra-op thread (threads <= lanes): the forward's
    # numbers at one thread equal those at 2, 3 and 4 (tested), not assumed beyond
    n_lanes = (min(threads, len(mine)) if model_device.type == "cpu" and threads <= settings.lanes
               else 1)

    def lane_workspaces(slot):
        """One workspace per where for the update's buffers (the capture's in the first),
        kept between calls: slot 0's (the serial path's) under the device's name, slot
        ``s``'s (of :func:`_in_lanes`) under ``<device>/lane<s>``."""
        lane_key = str(model_device) if slot == 0 else f"{model_device}/lane{slot}"
        return [_SHARED_WORKSPACES.setdefault(
            lane_key if n == 0 else f"{lane_key}/where{n}", Workspace())
            for n in range(len(fresh))]

    def forward(position, workspace):
        k = mine[position]
        part = windows[k * batch_size:(k + 1) * batch_size]
        batch = {name: t.to(model_device) for name, t in part.batch().items()}
        # only A >= attention_threshold of the maps (all the statistics read of them)
        result = analyse_batch(model, batch, where=wheres[0], gram=metrics[0],
                               workspace=workspace, settings=settings,
                               attention_threshold=attention_threshold)
        # one forward pass, one update per where
        return len(part), [result._replace(metric=metric) for metric in metrics]

    def advance(n_windows):
        if bar is not None:
            # rank 0 speaks for all ranks: they advance in lock-step over equal shards
            bar.update(min(n_windows * world, bar.total - bar.n))

    with buffered_attention(model):  # set once: lanes run forward passes side by side
        if n_lanes > 1:
            # two buffer slots per lane: a lane computes its next batch while its last
            # one waits to be added after the other lanes' earlier ones
            workspaces = [lane_workspaces(slot) for slot in range(LANE_SLOTS * n_lanes)]

            def compute(position, slot):
                n_windows, results = forward(position, workspaces[slot][0])
                return n_windows, [s.batch_parts(r, workspace=ws) for s, r, ws in
                                   zip(fresh, results, workspaces[slot])]

            def add(position, computed):
                n_windows, parts = computed
                for s, batch_parts in zip(fresh, parts):
                    s.add_parts(batch_parts)
                advance(n_windows)

            _in_lanes(n_lanes, n_lanes, len(mine), compute, add,  # one intra-op thread each
                      slots_per_lane=LANE_SLOTS)
        else:
            _one_batch_at_a_time(fresh, lane_workspaces(0), len(mine), forward, advance,
                                 side_by_side=(settings.side_by_side_updates
                                               and len(fresh) > 1 and threads > 1
                                               and model_device.type == "cpu"))
    if bar is not None:
        bar.close()
    if is_dist:
        for s in fresh:
            s.all_reduce(group)
        fresh = [s if t is None else t.merge(s) for s, t in zip(fresh, targets)]
    return tuple(fresh) if isinstance(where, tuple) else fresh[0]



# --------------------------------------------------------------------------- resumable pass


def checkpoint_dir() -> Path:
    """Where resumable passes keep their saves by default (pass it as ``checkpoint=``):
    ``$COMPANION_CHECKPOINT_DIR`` when set, else ``.cache/checkpoints/context_similarity``
    at the repository root (beside ``.cache/corpora`` and ``.cache/models``, git-ignored)
    in a source checkout, else ``~/.cache/companion/checkpoints/context_similarity``.
    Nothing is created here.

    >>> import os
    >>> checkpoint_dir().name, checkpoint_dir().is_absolute()
    ('context_similarity', True)
    """
    env = os.environ.get("COMPANION_CHECKPOINT_DIR")
    if env:
        return Path(env).expanduser().resolve()
    repo = Path(__file__).resolve().parents[3]
    if (repo / "pyproject.toml").is_file():
        return repo / ".cache" / "checkpoints" / "context_similarity"
    return Path.home() / ".cache" / "companion" / "checkpoints" / "context_similarity"


def _hash_tensor(h, t: torch.Tensor) -> None:
    t = t.detach().cpu().contiguous()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(t.view(-1).view(torch.uint8).numpy())


def _code_digest() -> str:
    """SHA-256 of the source of companion.context_similarity (every module: the
    statistics' definitions and the pass alike) and the versions that compute them."""
    import transformers

    h = hashlib.sha256(f"torch {torch.__version__} transformers {transformers.__version__}"
                       .encode())
    for path in sorted(Path(__file__).resolve().parent.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def checkpoint_key(model, windows, params: dict) -> str:
    """The key of a resumable pass (see :func:`analyse_corpus` ``checkpoint``): a SHA-256
    of the model (class, configuration but for the folder it was loaded from and the
    transformers version that wrote it, dtype, every weight), the windows, the parameters
    and the code.

    >>> from transformers import AutoTokenizer, BertConfig, BertModel
    >>> from companion.context_similarity.encoder import default_model_path
    >>> from companion.corpora import Corpus, Document, windows
    >>> tok = AutoTokenizer.from_pretrained(default_model_path())
    >>> model = BertModel(BertConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
    ...     intermediate_size=16, vocab_size=tok.vocab_size, attn_implementation="eager")).eval()
    >>> s = ["the cat sat on the mat .", "a dog ran far away .", "birds sing at dawn .",
    ...      "we went home late ."]
    >>> corpus = Corpus("toy", [Document(f"d{i}", s[i:] + s[:i]) for i in range(4)])
    >>> w = windows(corpus, tok, length=16)  # one window of 14 content tokens per document
    >>> from companion.context_similarity.capture import CaptureSettings
    >>> key = checkpoint_key(model, w, {"settings": CaptureSettings(), "percentile": 1.0})
    >>> len(key), key == checkpoint_key(model, w, {"settings": CaptureSettings(),
    ...                                            "percentile": 2.0})
    (64, False)
    """
    h = hashlib.sha256(b"companion.context_similarity checkpoint 1")
    h.update(type(model).__name__.encode())
    # the configuration without where it was loaded from (the weights are hashed below)
    config = {k: v for k, v in model.config.to_dict().items()
              if k not in ("_name_or_path", "transformers_version")}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, t in model.state_dict().items():
        h.update(name.encode())
        _hash_tensor(h, t)
    h.update(windows.corpus.encode())
    for t in (windows.input_ids, windows.attention_mask, windows.sentence_ids,
              windows.document_ids):
        _hash_tensor(h, t)
    plain = {k: v for k, v in params.items() if k not in ("track_tokens", "settings", "group")}
    plain["settings"] = asdict(params["settings"])
    h.update(json.dumps(plain, sort_keys=True, default=str).encode())
    if params.get("track_tokens") is not None:
        _hash_tensor(h, params["track_tokens"])
    h.update(_code_digest().encode())
    return h.hexdigest()


def _read(path: Path, key: str):
    """A saved file's content when it is readable and of this key, else None (an
    unreadable file is warned about)."""
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - an unreadable file is started over, said why
        import warnings

        warnings.warn(f"checkpoint: {path} is unreadable ({type(exc).__name__}: {exc}); "
                      "starting the pass over", stacklevel=4)
        return None
    return state if isinstance(state, dict) and state.get("key") == key else None


def _load_checkpoint(path: Path, key: str):
    """The saved statistics (state dicts, per-window parts gathered from the chunk files
    the main file lists) and the batches done; None when nothing usable is saved."""
    state = _read(path, key)
    if state is None:
        return None
    parts = []
    for name in state["chunks"]:
        chunk = _read(path.with_name(name), key)
        if chunk is None:
            import warnings

            warnings.warn(f"checkpoint: {path.with_name(name)}, listed by {path.name}, is "
                          "missing or unreadable; starting the pass over", stacklevel=3)
            return None
        parts.append(chunk["windows"])
    for n, stats_state in enumerate(state["stats"]):
        names = parts[0][n].keys() if parts else ()
        if names:
            stats_state["windows"] = {name: torch.cat([p[n][name] for p in parts])
                                      for name in names}
    return state


def _sums_state(stats: SimilarityStats) -> dict:
    """:meth:`SimilarityStats.state_dict` without the per-window parts (saved once per
    chunk instead, so that the saves of a pass write each window's parts once)."""
    state = {"config": stats.config(),
             "sums": {k: v.cpu() for k, v in stats.tensors().items()}}
    if stats._tracked is not None:
        state["tracked_tokens"] = stats._tracked.cpu()
    return state


def _save_checkpoint(path: Path, state: dict) -> None:
    """Atomically: a temporary file in the same directory, flushed to disk, then renamed
    over the previous save (a kill leaves either the old file or the new one)."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")  # removed by the next run if cut
    with open(tmp, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _checkpointed(model, windows, folder: Path, every: int, params: dict, progress: bool):
    """:func:`analyse_corpus` in chunks of ``every`` windows (whole batches), saved after
    each chunk under the pass's key; resumes after the last saved chunk.

    Per save: the chunk's per-window parts in a file of their own
    (``<main>.w<batches>.pt``), then the main file (the sums, the batches done and the
    chunk files so far), each atomically; so each window's parts are written once, not
    once per later save (at paper scale they reach hundreds of megabytes)."""
    from filelock import FileLock, Timeout

    folder.mkdir(parents=True, exist_ok=True)
    batch_size = params["batch_size"]
    chunk = max(1, math.ceil(every / batch_size))  # batches per save
    params = {**params, "checkpoint_every": chunk * batch_size}
    model_device = next(model.parameters()).device
    dev = model_device if params["device"] is None else resolve_device(params["device"])
    key = checkpoint_key(model, windows, {**params, "device": dev.type, "distributed": None})
    path = folder / f"context-similarity-{key[:32]}.pt"
    try:
        lock = FileLock(str(path) + ".lock", timeout=0)
        lock.acquire()
    except Timeout:
        raise RuntimeError(f"checkpoint: another pass is running with {path}") from None
    try:
        stem = path.name[:-len(".pt")]
        for stale in folder.glob(f"{stem}*.tmp-*"):  # a save cut short by a kill
            stale.unlink(missing_ok=True)
        state = _load_checkpoint(path, key)
        n_batches = math.ceil(len(windows) / batch_size)
        done, stats, chunks = 0, None, []
        if state is not None:
            done, chunks = int(state["batches"]), list(state["chunks"])
            stats = tuple(SimilarityStats.from_state_dict(s, device=dev)
                          for s in state["stats"])
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(windows), initial=min(len(windows), done * batch_size),
                       desc=f"context similarity ({'+'.join(params['where'])})",
                       unit="window")
        inner = {k: v for k, v in params.items() if k != "checkpoint_every"}
        for start in range(done, n_batches, chunk):
            # the book's build may give this chapter more cores once the others end; the
            # sums are the same at any thread count, bit for bit (the lanes' contract)
            adopt_thread_budget()
            end = min(start + chunk, n_batches)
            part = windows[start * batch_size:end * batch_size]
            before = ([{} for _ in params["where"]] if stats is None
                      else [{name: len(p) for name, p in s._windows.items()} for s in stats])
            if stats is None:
                stats = analyse_corpus(model, part, **inner, progress=False)
            else:
                stats = analyse_corpus(model, part, **{**inner, "track_tokens": None},
                                       into=stats, progress=False)
            # this chunk's per-window parts: those appended to each list since `before`
            new = [{name: torch.cat(p[b.get(name, 0):]).cpu()
                    for name, p in s._windows.items()} for s, b in zip(stats, before)]
            if any(new):
                chunk_name = f"{stem}.w{end}.pt"
                _save_checkpoint(path.with_name(chunk_name), {"key": key, "windows": new})
                chunks.append(chunk_name)
            _save_checkpoint(path, {"key": key, "batches": end, "n_batches": n_batches,
                                    "chunks": chunks,
                                    "stats": [_sums_state(s) for s in stats]})
            if bar is not None:
                bar.update(len(part))
        if bar is not None:
            bar.close()
        return stats
    finally:
        lock.release()


class _Cancelled(Exception):
    """A lane stops because another one failed (never leaves :func:`_in_lanes`)."""


class _InOrder:
    """Adds the lanes' jobs in job order, 0, 1, 2, ..., whichever lane computed them: a
    computed job waits here until every job before it was added, and the lane that adds
    a job goes on with the following ones already computed (one lane adds at a time)."""

    def __init__(self, add):
        self._add = add
        self._condition = threading.Condition()
        self._added = 0  # jobs 0 .. _added - 1 are added
        self._waiting: dict[int, object] = {}  # computed jobs not yet added
        self._adding = False  # a lane is adding (outside the lock)
        self._cancelled = False

    def wait_added(self, count: int) -> None:
        """Return once jobs ``0 .. count - 1`` are added; raise if the lanes stopped
        before they were."""
        with self._condition:
            self._condition.wait_for(lambda: self._added >= count or self._cancelled)
            if self._added < count:
                raise _Cancelled

    def hand_in(self, job: int, computed) -> None:
        """``job`` is computed: add it now if it is next (and the waiting ones after it),
        else leave it to the lane that adds the one before it."""
        with self._condition:
            if self._cancelled:
                raise _Cancelled
            self._waiting[job] = computed
            if self._adding:
                return  # that lane finds it when it gets there
            self._adding = True
        while True:
            with self._condition:
                following = self._added
                if self._cancelled or following not in self._waiting:
                    self._adding = False
                    if self._cancelled:
                        raise _Cancelled
                    return
                computed = self._waiting.pop(following)
            self._add(following, computed)
            with self._condition:
                self._added = following + 1
                self._condition.notify_all()

    def cancel(self) -> None:
        with self._condition:
            self._cancelled = True
            self._condition.notify_all()


def _in_lanes(n_lanes: int, threads: int, n_jobs: int, compute, add,
              slots_per_lane: int = 1) -> None:
    """Jobs ``0 .. n_jobs - 1`` on ``n_lanes`` threads (this one is lane 0): lane ``l``
    computes jobs ``l, l + n_lanes, ...`` (``compute(job, slot)``, with ``threads //
    n_lanes`` intra-op threads) and ``add(job, computed)`` runs for every job in job
    order, one at a time, on whichever lane computed the job or, if that lane is still
    waiting for the job before it, on the lane that adds that one.

    ``slot`` names the buffers a job's results may live in until it is added: a lane has
    ``slots_per_lane`` of them, used in turn (lane ``l``'s ``s``-th is slot ``l + s *
    n_lanes``, so with one per lane the slot is the lane), and starts a job only once
    the job that used its slot before was added. With one slot a lane waits for its job
    to be added before it computes the next; with two it computes the next meanwhile,
    and lanes that take a little longer or shorter per job do not hold each other up.

    The first error of a lane stops the others at their next wait and is raised here;
    the calling thread's intra-op thread count is restored.
    """
    from concurrent.futures import ThreadPoolExecutor

    per_lane = max(1, threads // n_lanes)
    caller = torch.get_num_threads()
    in_order = _InOrder(add)

    def lane(index):
        torch.set_num_threads(per_lane)  # this thread's intra-op threads
        try:
            for turn, job in enumerate(range(index, n_jobs, n_lanes)):
                # the job that used this slot before: added before its buffers are reused
                in_order.wait_added(job - slots_per_lane * n_lanes + 1)
                computed = compute(job, index + (turn % slots_per_lane) * n_lanes)
                in_order.hand_in(job, computed)
        except BaseException:
            in_order.cancel()
            raise

    errors = []
    try:
        with ThreadPoolExecutor(n_lanes - 1, thread_name_prefix="similarity-lane") as pool:
            others = [pool.submit(lane, index) for index in range(1, n_lanes)]
            try:
                lane(0)
            except _Cancelled:
                pass
            except BaseException as exc:  # an interrupt too (lane() has stopped the others)
                errors.append(exc)
            try:
                for future in others:
                    exc = future.exception()
                    if exc is not None and not isinstance(exc, _Cancelled):
                        errors.append(exc)
            except BaseException:  # interrupted while waiting: stop the other lanes
                in_order.cancel()
                raise
    finally:  # every lane has stopped (the pool's exit waits): none sets a count after this
        torch.set_num_threads(caller)  # the lanes' counts may be shared: restore
    if errors:
        raise errors[0]
    if in_order._added != n_jobs:  # pragma: no cover - every lane returned without error
        raise RuntimeError(f"lanes: {in_order._added} of {n_jobs} jobs added")


def _one_batch_at_a_time(fresh, workspaces, n_jobs, forward, advance, side_by_side):
    """Batch after batch: the forward pass on all intra-op threads, then each where's
    update, side by side (one thread each, one intra-op thread each) or one after the
    other."""
    threads = torch.get_num_threads()
    pool = None
    if side_by_side:
        from concurrent.futures import ThreadPoolExecutor

        # each update on a thread of its own with one intra-op thread (set per thread;
        # this thread's count, which the forward uses, stays)
        pool = ThreadPoolExecutor(len(fresh), thread_name_prefix="similarity-update",
                                  initializer=torch.set_num_threads, initargs=(1,))
    try:
        for job in range(n_jobs):
            n_windows, results = forward(job, workspaces[0])
            updates = list(zip(fresh, results, workspaces))
            if pool is None:
                for s, r, ws in updates:
                    s.update(r, workspace=ws)
            else:
                for done in [pool.submit(s.update, r, workspace=ws) for s, r, ws in updates]:
                    done.result()
            advance(n_windows)
    finally:
        if pool is not None:
            pool.shutdown()
            torch.set_num_threads(threads)  # the pool's threads set the shared default to 1


def _where_plan(where, per_window, into):
    """(wheres, per_window per where, into per where) of :func:`analyse_corpus`."""
    many = isinstance(where, tuple)
    wheres = where if many else (where,)
    if not wheres or any(w not in WHERE for w in wheres):
        raise ValueError(f"where: expected one of {WHERE} or a tuple of them, got {where!r}")
    if len(set(wheres)) != len(wheres):
        raise ValueError(f"where: expected distinct entries, got {where!r}")
    if isinstance(per_window, tuple):
        if not many or len(per_window) != len(wheres):
            raise ValueError(f"per_window: expected a bool or one per where entry "
                             f"({len(wheres)}), got {per_window!r}")
        windowed = tuple(bool(p) for p in per_window)
    else:
        windowed = (bool(per_window),) * len(wheres)
    if into is None:
        targets = (None,) * len(wheres)
    else:
        targets = into if isinstance(into, tuple) else (into,)
        if len(targets) != len(wheres) or not all(
                t is None or isinstance(t, SimilarityStats) for t in targets):
            raise ValueError(f"into: expected None or one SimilarityStats (or None) per "
                             f"where entry ({len(wheres)}), got {into!r}")
        windowed = tuple(w if t is None else t.per_window for w, t in zip(windowed, targets))
    return wheres, windowed, targets


# --------------------------------------------------------------------------- CLI (torchrun)


def _main(argv=None) -> int:
    """``torchrun --nproc-per-node N -m companion.context_similarity --corpus brown ...``."""
    import torch.distributed as dist

    from companion.corpora import Windows, load_corpus
    from companion.corpora import windows as cut_windows

    parser = argparse.ArgumentParser(prog="python -m companion.context_similarity")
    parser.add_argument("--model", default=None, help="name or path (default: bundled MiniLM)")
    parser.add_argument("--corpus", default="brown,bbc,wiki",
                        help="comma-separated corpus names or paths")
    parser.add_argument("--windows", type=int, default=20_000)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--percentile", type=float, default=1.0)
    parser.add_argument("--attention-threshold", type=float, default=0.1)
    parser.add_argument("--where", choices=WHERE, default="pre_wo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", required=True, help="where rank 0 saves the statistics (.pt)")
    parser.add_argument("--checkpoint", default=None,
                        help="directory: a resumable pass (one process, not under torchrun; "
                             "see analyse_corpus)")
    args = parser.parse_args(argv)
    if args.checkpoint is not None and "RANK" in os.environ:
        parser.error("--checkpoint: run without torchrun (one process); the pass is resumed "
                     "from the directory on a re-run")

    if "RANK" in os.environ and not dist.is_initialized():
        dev = resolve_device(args.device)
        if dev.type == "cuda":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            dev = torch.device("cuda", local)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    else:
        dev = resolve_device(args.device)
    model, tokenizer = load_encoder(args.model, device=dev)
    names = [c for c in args.corpus.split(",") if c]
    per = math.ceil(args.windows / len(names))
    parts = []
    for c in names:
        corpus = load_corpus(c)
        parts.append(cut_windows(corpus, tokenizer, args.length, max_windows=per, seed=args.seed,
                                 cross_documents=(c == "wiki")))
    wins = Windows.concat(parts)[: args.windows]
    stats = analyse_corpus(model, wins, tokenizer=tokenizer, where=args.where,
                           batch_size=args.batch_size, percentile=args.percentile,
                           attention_threshold=args.attention_threshold,
                           checkpoint=args.checkpoint)
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(stats.state_dict(), args.out)
        print(f"saved statistics of {int(stats.n_windows)} windows to {args.out}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
