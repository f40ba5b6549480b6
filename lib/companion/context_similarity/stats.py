"""Streaming statistics of the high-similarity pairs: one small function per statistic.

Every statistic is a sum over windows, registered once in :data:`STATISTICS` by the
decorators :func:`batch_sum` (its part of the corpus sum, one batch at a time) and
:func:`window_sum` (each window's own part, kept with ``per_window=True`` for a bootstrap
over windows). A statistic is a small function of a :class:`PairBatch`, which computes
what several statistics share (the selected pairs, their distances, whether they lie in
one sentence, in the high-attention region, ...) once, on first use. Adding a statistic
is one function here; :class:`SimilarityStats` allocates, adds, merges, all-reduces and
saves every registered sum.

The plain definitions, loops over pairs, are in
:func:`companion.context_similarity.reference.stats_reference`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import NamedTuple

import torch

from companion._validate import check_int
from companion.context_similarity.capture import BatchResult
from companion.context_similarity.topk import similarity_matrices, top_pairs
from companion.context_similarity.workspace import Workspace
from companion.heap import MappedArena

__all__ = [
    "LONG_RANGE",
    "SHORT_RANGE",
    "STATISTICS",
    "BatchParts",
    "PairBatch",
    "ScatterAdd",
    "SimilarityStats",
    "Statistic",
    "batch_sum",
    "log2_bin",
    "mode_count",
    "n_distance_bins",
    "uniform_pairs_mode_count",
    "window_sum",
]

SHORT_RANGE = 8  # per-window "short" pairs: token distance j - i <= SHORT_RANGE
LONG_RANGE = 32  # per-window "long" pairs: token distance j - i > LONG_RANGE


def _k_of(n_pairs: torch.Tensor, percentile: float) -> torch.Tensor:
    """Number of pairs in the top ``percentile`` per cent (at least 1 when any pair)."""
    k = torch.round(n_pairs.double() * (percentile / 100.0)).long()
    return torch.minimum(torch.clamp(k, min=1), n_pairs)


def n_distance_bins(length: int) -> int:
    """Number of log2 distance bins for windows of ``length`` tokens: distances 1 to
    ``length - 1`` fall in bins 0 (distance 1), 1 (2-3), 2 (4-7), ...

    >>> n_distance_bins(128), n_distance_bins(13)
    (7, 4)
    """
    return max(1, int(length - 1).bit_length())


def log2_bin(distance: torch.Tensor, n_bins: int) -> torch.Tensor:
    """The log2 bin of integer distances (bin b: ``2^b <= d < 2^(b+1)``; d <= 1 in bin 0),
    by comparisons with powers of two (exact, no floating-point logarithm).

    >>> log2_bin(torch.tensor([1, 2, 3, 4, 7, 8, 127]), 7).tolist()
    [0, 1, 1, 2, 2, 3, 6]
    """
    powers = 2 ** torch.arange(1, n_bins, device=distance.device)
    return (distance[..., None] >= powers).sum(-1)


def uniform_pairs_mode_count(tokens: torch.Tensor, k: int) -> int:
    """How often the commonest token occurs among the endpoints of ``k`` pairs ``i < j``
    of the positions of ``tokens`` (a window's content tokens) drawn uniformly without
    replacement. The draw is seeded by the tokens themselves, so a window gives the same
    count in any batch and in any order.

    >>> uniform_pairs_mode_count(torch.tensor([7, 7, 7]), 3)  # every endpoint is 7
    6
    """
    n = int(tokens.numel())
    if n < 2 or k < 1:
        return 0
    tokens = tokens.long().cpu()
    seed = int((tokens * torch.arange(1, n + 1)).sum()) % (2 ** 31 - 1)
    gen = torch.Generator().manual_seed(seed + n)
    i, j = torch.triu_indices(n, n, 1)
    pick = torch.randperm(i.numel(), generator=gen)[:k]
    return int(mode_count(torch.cat([tokens[i[pick]], tokens[j[pick]]]))[0])


def mode_count(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The count and value of the most common entry along the last dimension (a tie goes
    to the smallest value), batched over the leading dimensions.

    >>> mode_count(torch.tensor([[3, 1, 3, 2, 1], [5, 5, 4, 4, 6]]))
    (tensor([2, 2]), tensor([1, 4]))
    """
    s = values.sort(-1).values
    n = s.shape[-1]
    idx = torch.arange(n, device=s.device).expand_as(s)
    start = torch.ones_like(s, dtype=torch.bool)
    start[..., 1:] = s[..., 1:] != s[..., :-1]
    run = idx - torch.where(start, idx, torch.zeros_like(idx)).cummax(-1).values + 1
    count, at = run.max(-1)  # the first maximum: the smallest value of the longest runs
    return count, s.gather(-1, at[..., None])[..., 0]


# --------------------------------------------------------------------------- registry


class ScatterAdd(NamedTuple):
    """A batch's part of a sum too large to build densely: add ``weights`` at the flat
    positions ``index`` of the sum.

    >>> part = ScatterAdd(torch.tensor([0, 2, 2]), torch.tensor([1.0, 1.0, 1.0]))
    >>> torch.zeros(3).index_add_(0, part.index, part.weights)  # how a sum adds it
    tensor([1., 0., 2.])
    """

    index: torch.Tensor
    weights: torch.Tensor


class BatchParts(NamedTuple):
    """One batch's part of every sum (:meth:`SimilarityStats.batch_parts`): ``totals``,
    (name, tensor or :class:`ScatterAdd`) pairs added to the corpus sums, and ``windows``,
    (name, [B, ...] float64) pairs appended to the per-window parts.

    >>> from companion.context_similarity.capture import BatchResult
    >>> g = torch.Generator().manual_seed(0)
    >>> z = torch.randn(1, 2, 2, 6, 4, generator=g, dtype=torch.float64)  # [B, L, H, T, d]
    >>> attn = torch.softmax(torch.randn(1, 2, 2, 6, 6, generator=g, dtype=torch.float64), -1)
    >>> ids, sent = torch.tensor([[1, 7, 8, 5, 7, 2]]), torch.tensor([[-1, 0, 0, 0, 1, -1]])
    >>> result = BatchResult(z, attn, ids, sent, torch.ones(1, 6, dtype=torch.long))
    >>> stats = SimilarityStats(n_layers=2, n_heads=2, length=6, vocab_size=10,
    ...                         separators={".": 5}, per_window=True)
    >>> parts = stats.batch_parts(result)
    >>> isinstance(parts, BatchParts), dict(parts.totals)["n_windows"]
    (True, tensor(1))
    """

    totals: list
    windows: list


@dataclass
class Statistic:
    """One registered sum.

    ``needs``: what must exist for it to be computed: ``"batch"`` (always), ``"pairs"``
    (windows with content pairs; zero otherwise), ``"separators"`` (separator tokens
    given), ``"tracked"`` (:meth:`SimilarityStats.track_tokens` set; per window only).
    ``shape``/``dtype``: of the corpus sum (letters L, H, T, V, S), with ``total`` the
    function giving a batch's part of it; ``window_shape``/``window``: each window's part
    (float64, shape ``[B, *window_shape]``). Either may be absent.

    >>> entry = STATISTICS["n_high"]
    >>> isinstance(entry, Statistic), entry.needs, entry.shape
    (True, 'pairs', ('L', 'H'))
    """

    name: str
    needs: str = "batch"
    shape: tuple | None = None
    dtype: torch.dtype | None = None
    total: Callable[[PairBatch], torch.Tensor | ScatterAdd] | None = None
    window_shape: tuple | None = None
    window: Callable[[PairBatch], torch.Tensor] | None = None


#: Every statistic, by name, in the order of the saved sums.
STATISTICS: dict[str, Statistic] = {}
_NEEDS = ("batch", "pairs", "separators", "tracked")


def _entry(name: str, needs: str) -> Statistic:
    if needs not in _NEEDS:
        raise ValueError(f"needs: expected one of {_NEEDS}, got {needs!r}")
    entry = STATISTICS.setdefault(name, Statistic(name, needs))
    if entry.needs != needs:
        raise ValueError(f"name: {name!r} is registered with needs={entry.needs!r}")
    return entry


def batch_sum(name: str, shape: tuple, dtype: torch.dtype, needs: str = "batch"):
    """Register ``fn(batch: PairBatch)`` as a batch's part of the sum ``name``.

    ``shape`` in the letters L (layers), H (heads), T (tokens), V (vocabulary), S
    (separators); the returned tensor (or :class:`ScatterAdd`) is added to the sum.

    >>> "n_high" in STATISTICS and STATISTICS["n_high"].total is not None  # registered so
    True
    """
    def register(fn):
        entry = _entry(name, needs)
        entry.shape, entry.dtype, entry.total = tuple(shape), dtype, fn
        return fn

    return register


def window_sum(name: str, shape: tuple = ("L", "H"), needs: str = "batch"):
    """Register ``fn(batch: PairBatch)`` as every window's part of the sum ``name``,
    ``[B, *shape]`` float64 (kept with ``per_window=True``).

    >>> STATISTICS["short_range"].window_shape  # registered with @window_sum("short_range")
    ('L', 'H')
    """
    def register(fn):
        entry = _entry(name, needs)
        entry.window_shape, entry.window = tuple(shape), fn
        return fn

    return register


def _tracked_names() -> tuple[str, ...]:
    """The per-window sums of tracked tokens (``needs="tracked"``), as registered now."""
    return tuple(s.name for s in STATISTICS.values() if s.needs == "tracked")


# --------------------------------------------------------------------------- one batch


class PairBatch:
    """One batch of windows and its high-similarity pairs, as the statistics read them.

    Everything several statistics share is computed once, on first use (a cached
    property), on the device of the head outputs. The selected pairs are ``i``, ``j``
    ``[B, L, H, k_max]`` (:func:`top_pairs`); window ``b`` keeps its first ``k[b]``
    (:attr:`kept`), the rest are fillers ``i = j = 0``, in range for every gather.

    >>> from companion.context_similarity.capture import BatchResult
    >>> g = torch.Generator().manual_seed(0)
    >>> z = torch.randn(1, 2, 2, 6, 4, generator=g, dtype=torch.float64)  # [B, L, H, T, d]
    >>> attn = torch.softmax(torch.randn(1, 2, 2, 6, 6, generator=g, dtype=torch.float64), -1)
    >>> ids, sent = torch.tensor([[1, 7, 8, 5, 7, 2]]), torch.tensor([[-1, 0, 0, 0, 1, -1]])
    >>> result = BatchResult(z, attn, ids, sent, torch.ones(1, 6, dtype=torch.long))
    >>> stats = SimilarityStats(n_layers=2, n_heads=2, length=6, vocab_size=10,
    ...                         separators={".": 5}, per_window=True)
    >>> batch = PairBatch(stats, result, [0, 1], None)
    >>> batch.k.tolist(), tuple(batch.i.shape)  # 4 content tokens: 6 pairs, 1 high per head
    ([1], (1, 2, 2, 1))
    """

    def __init__(self, stats: SimilarityStats, result: BatchResult, layers: list,
                 workspace: Workspace | None):
        self.stats, self.result, self.layers, self.workspace = stats, result, layers, workspace
        z = result.outputs
        self.device = dev = z.device
        self.ids = result.input_ids.to(dev)
        self.sentence = result.sentence_ids.to(dev)
        self.mask = result.attention_mask.to(dev).bool()
        self.b, self.n_layers, self.n_heads, self.length, _ = z.shape
        self.valid = self.mask & (self.sentence >= 0)  # content: not [CLS]/[SEP]/padding
        self.n_tokens = self.valid.sum(1)
        n_pairs = self.n_tokens * (self.n_tokens - 1) // 2  # content pairs per window
        self.k = _k_of(n_pairs, stats.percentile)  # [B]
        self.k_max = int(self.k.max())

    # ---------------------------------------------------------------- the pairs

    @cached_property
    def _top(self):
        k, k_max = self.k, self.k_max
        return top_pairs(self.result.outputs, self.valid, k_max, metric=self.result.metric,
                         return_sum=True, workspace=self.workspace,
                         sort=bool(k.min() < k_max))  # prefixes differ

    @property
    def i(self) -> torch.Tensor:
        return self._top[1]

    @property
    def j(self) -> torch.Tensor:
        return self._top[2]

    @cached_property
    def similarity_sum(self) -> torch.Tensor:
        """[L, H, T, T] sum over the batch of the zero-diagonal similarity matrices."""
        if self.k_max > 0:
            return self._top[3]
        return similarity_matrices(self.result.outputs, metric=self.result.metric).sum(0)

    @cached_property
    def selected(self) -> torch.Tensor | None:
        """[B, L, H, k_max] True for the first ``k[b]`` pairs of window b; None when every
        window keeps all ``k_max`` (the usual case)."""
        if bool((self.k == self.k_max).all()):
            return None
        sel = (torch.arange(self.k_max, device=self.device) < self.k[:, None])
        return sel[:, None, None, :].expand(self.b, self.n_layers, self.n_heads, self.k_max)

    def kept(self, m: torch.Tensor) -> torch.Tensor:
        """``m`` [B, L, H, k_max] (bool) on the kept pairs only."""
        return m if self.selected is None else m & self.selected

    def weighed(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [B, L, H, k_max] (numbers) times 1 on kept pairs, 0 on fillers."""
        return x if self.selected is None else x * self.selected

    @cached_property
    def all_kept(self) -> torch.Tensor:
        return self.kept(torch.ones_like(self.in_region))

    def _gather(self, per_token: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        return per_token.gather(1, at.reshape(self.b, -1)).view(at.shape)

    @cached_property
    def distance(self) -> torch.Tensor:
        """j - i of the selected pairs."""
        return self.j - self.i

    @cached_property
    def same_sentence(self) -> torch.Tensor:
        return self._gather(self.sentence, self.i) == self._gather(self.sentence, self.j)

    @cached_property
    def token_i(self) -> torch.Tensor:
        return self._gather(self.ids, self.i)

    @cached_property
    def token_j(self) -> torch.Tensor:
        return self._gather(self.ids, self.j)

    @cached_property
    def identical(self) -> torch.Tensor:
        return self.token_i == self.token_j

    @cached_property
    def in_region(self) -> torch.Tensor:
        """The pair lies in the head's high-attention region, max(A_ij, A_ji) >= threshold
        (through flat indices per layer)."""
        b, n_h, t, dev = self.b, self.n_heads, self.length, self.device
        window_head = (torch.arange(b, device=dev)[:, None, None] * n_h
                       + torch.arange(n_h, device=dev)[None, :, None]) * (t * t)  # [B, H, 1]
        i, j = self.i, self.j
        if self.layers is None:  # only A >= threshold kept: either entry reaching it
            high = self.result.high_attention[1].to(dev)  # [L, B, H, T, T]
            return torch.stack([
                a.reshape(-1).take(window_head + i[:, layer] * t + j[:, layer])
                | a.reshape(-1).take(window_head + j[:, layer] * t + i[:, layer])
                for layer, a in enumerate(high.unbind(0))], dim=1)  # [B, L, H, k_max]
        att = torch.stack([
            torch.maximum(a.reshape(-1).take(window_head + i[:, layer] * t + j[:, layer]),
                          a.reshape(-1).take(window_head + j[:, layer] * t + i[:, layer]))
            for layer, a in enumerate(self.layers)], dim=1)  # [B, L, H, k_max]
        return att >= self.stats.attention_threshold

    @cached_property
    def outside_region(self) -> torch.Tensor:
        """Kept pairs outside the high-attention region ("masked")."""
        return self.kept(~self.in_region)

    @cached_property
    def layer_head(self) -> torch.Tensor:
        """[1, L, H, 1] flat index l H + h."""
        return torch.arange(self.n_layers * self.n_heads, device=self.device).view(
            1, self.n_layers, self.n_heads, 1)

    def distance_histogram(self, m: torch.Tensor) -> torch.Tensor:
        """[L, H, T] counts of the pairs in ``m`` by distance (no boolean indexing: the
        others go to a last bin that is dropped)."""
        t = self.length
        n_bins = self.n_layers * self.n_heads * t
        bins = self.layer_head * t + self.distance
        dropped = torch.full((), n_bins, dtype=bins.dtype, device=self.device)
        return torch.bincount(torch.where(m, bins, dropped).view(-1),
                              minlength=n_bins + 1)[:-1].view(self.n_layers, self.n_heads, t)

    # ---------------------------------------------------------------- chance levels

    def _by_distance(self, pairs: torch.Tensor) -> torch.Tensor:
        """[B, T, T] bool -> [B, T] counts per distance j - i.

        Pair (i, j), i < j, of the [T, T] table sits at i (T + 1) + (j - i) of its
        flattened strict upper triangle: viewed as rows of T + 1 (after T zeros of
        padding), column d sums the pairs at distance d (entries that wrap into the next
        row are from the lower triangle, zero).
        """
        b, t = self.b, self.length
        padded = torch.nn.functional.pad(pairs.view(b, -1).float(), (0, t))  # exact
        return padded.view(b, t, t + 1).sum(1)[:, :t].double()

    @cached_property
    def _content_pairs(self) -> torch.Tensor:  # [B, T, T]: content pairs i < j
        t = self.length
        upper = torch.ones(t, t, dtype=torch.bool, device=self.device).triu(1)
        return self.valid[:, :, None] & self.valid[:, None, :] & upper

    @cached_property
    def pairs_by_distance(self) -> torch.Tensor:
        """[B, T] content pairs of each window at each distance."""
        return self._by_distance(self._content_pairs)

    @cached_property
    def same_sentence_by_distance(self) -> torch.Tensor:
        """[B, T] content pairs inside one sentence at each distance."""
        same = self._content_pairs & (self.sentence[:, :, None] == self.sentence[:, None, :])
        return self._by_distance(same)

    @cached_property
    def n_pairs(self) -> torch.Tensor:
        """[B] content pairs per window (at least 1), float64."""
        return self.pairs_by_distance.sum(1).clamp(min=1)

    @cached_property
    def same_sentence_given_distance(self) -> torch.Tensor:
        """[B, L, H, k_max] P(same sentence | the pair's distance) in its window."""
        q = self.same_sentence_by_distance / self.pairs_by_distance.clamp(min=1)  # [B, T]
        return self._gather(q, self.distance)

    @cached_property
    def chance_same(self) -> torch.Tensor:
        """[B] share of a window's content pairs inside one sentence."""
        return self.same_sentence_by_distance.sum(1) / self.n_pairs

    @cached_property
    def chance_identical(self) -> torch.Tensor:
        """[B] share of a window's content pairs of identical tokens."""
        ident = self._content_pairs & (self.ids[:, :, None] == self.ids[:, None, :])
        return torch.count_nonzero(ident.view(self.b, -1), dim=1).double() / self.n_pairs

    def chance_count(self, share: torch.Tensor) -> torch.Tensor:
        """[B, L, H]: k times a window's mean over its content pairs (``share`` [B] is the
        sum over them)."""
        return (self.k.double() * share / self.n_pairs)[:, None, None].expand(
            self.b, self.n_layers, self.n_heads)

    # ---------------------------------------------------------------- separators

    @cached_property
    def separator_keys(self) -> torch.Tensor:
        """[B, T, S] key t is a separator of kind s (not padding)."""
        sep_ids = torch.tensor(list(self.stats.separators.values()), device=self.device)
        return (self.ids[:, :, None] == sep_ids) & self.mask[:, :, None]

    @cached_property
    def separator_attention(self) -> torch.Tensor:
        """[B, L, H, S] attention mass from content queries onto each separator kind."""
        key_kind = self.separator_keys
        received = self.result.received_attention
        if received is not None:  # [B, L, H, T] from the forward pass
            # in float64 by a reduction over each window's keys, not a GEMM: a GEMM's
            # summation order may follow the thread count (float32 MKL at [L H, T] x
            # [T, S] did), and the statistics must not depend on how the batch was run
            kind = key_kind.permute(0, 2, 1)[:, None, None].to(torch.float64)  # [B,1,1,S,T]
            return (received.to(self.device, torch.float64).unsqueeze(3) * kind).sum(-1)
        # per layer, the sum over all query rows minus the rows of non-content queries
        inv_b, inv_q = (~self.valid).nonzero(as_tuple=True)
        per_layer = []
        for a in self.layers:
            from_content = a.sum(2)  # [B, H, T]
            from_content.index_add_(0, inv_b, a[inv_b, :, inv_q, :], alpha=-1)
            per_layer.append(torch.matmul(from_content, key_kind.to(a.dtype)))
        return torch.stack(per_layer, dim=1).double()

    # ---------------------------------------------------------------- per-input hubs

    @cached_property
    def distance_bin(self) -> torch.Tensor:
        """[B, L, H, k_max] the log2 distance bin of each pair: bin b holds distances
        2^b <= j - i < 2^(b + 1) (fillers, at distance 0, fall in bin 0 with weight 0)."""
        return log2_bin(self.distance, n_distance_bins(self.length))

    @cached_property
    def _hub(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's most common token among the endpoints of its kept pairs in each
        window, ``(token [B, L, H], endpoint count [B, L, H])``; a tie goes to the smaller
        token id; a window without kept pairs counts 0."""
        ends = torch.cat([self.token_i, self.token_j], dim=-1)  # [B, L, H, 2 k_max]
        n = ends.shape[-1]
        if self.selected is not None:  # fillers: distinct ids above the vocabulary
            sentinel = self.stats.vocab_size + torch.arange(n, device=self.device)
            ends = torch.where(torch.cat([self.selected, self.selected], dim=-1), ends,
                               sentinel.expand_as(ends))
        count, hub = mode_count(ends)
        count = torch.where((self.k > 0)[:, None, None], count, torch.zeros_like(count))
        return hub, count

    @cached_property
    def hub_pair(self) -> torch.Tensor:
        """[B, L, H, k_max] kept pairs with an endpoint that is the head's hub token."""
        hub = self._hub[0][..., None]
        return self.kept((self.token_i == hub) | (self.token_j == hub))

    @cached_property
    def tracked(self) -> torch.Tensor:
        """[L, H] the token tracked per head."""
        return self.stats._tracked.to(self.device)


    @cached_property
    def separator_attention_total(self) -> torch.Tensor:
        """[L, H, S] the sum over the batch of :attr:`separator_attention` (window by
        window, so that it is the same with and without ``per_window``; one einsum over
        windows and keys at once was a float32 GEMM whose rounding changed with the
        thread count)."""
        return self.separator_attention.sum(0)

    @cached_property
    def chance_separator(self) -> torch.Tensor:
        """[B, S] the separator attention of a window under uniform attention over its
        keys: content queries times the share of separator keys."""
        n_keys = self.mask.sum(1).double().clamp(min=1)
        return (self.n_tokens.double()[:, None] * self.separator_keys.sum(1).double()
                / n_keys[:, None])


# --------------------------------------------------------------------------- the statistics
# Corpus sums: a batch's part. Per-window sums: [B, L, H] float64 unless said.

@batch_sum("n_windows", (), torch.long)
def _n_windows(b: PairBatch):
    return torch.tensor(b.b, device=b.device)


@batch_sum("n_high", ("L", "H"), torch.long, needs="pairs")
def _n_high(b: PairBatch):
    return b.all_kept.sum((0, 3))


@window_sum("n_high", needs="pairs")
def _n_high_w(b: PairBatch):
    return b.all_kept.sum(3).double()


@batch_sum("distance_hist", ("L", "H", "T"), torch.long, needs="pairs")
def _distance_hist(b: PairBatch):
    return b.distance_histogram(b.all_kept)


@batch_sum("same_sentence", ("L", "H"), torch.long, needs="pairs")
def _same_sentence(b: PairBatch):
    return b.kept(b.same_sentence).sum((0, 3))


@window_sum("same_sentence", needs="pairs")
def _same_sentence_w(b: PairBatch):
    return b.kept(b.same_sentence).sum(3).double()


@batch_sum("chance_same_sentence", ("L", "H"), torch.float64, needs="pairs")
def _chance_same_sentence(b: PairBatch):
    return (b.k.double() * b.chance_same).sum().expand(b.n_layers, b.n_heads)


@window_sum("chance_same_sentence", needs="pairs")
def _chance_same_sentence_w(b: PairBatch):
    return (b.k.double() * b.chance_same)[:, None, None].expand(b.b, b.n_layers, b.n_heads)


@batch_sum("chance_same_sentence_distance", ("L", "H"), torch.float64, needs="pairs")
def _chance_same_sentence_distance(b: PairBatch):
    return b.weighed(b.same_sentence_given_distance).sum((0, 3))


@window_sum("chance_same_sentence_distance", needs="pairs")
def _chance_same_sentence_distance_w(b: PairBatch):
    return b.weighed(b.same_sentence_given_distance).sum(3)


@batch_sum("identical", ("L", "H"), torch.long, needs="pairs")
def _identical(b: PairBatch):
    return b.kept(b.identical).sum((0, 3))


@window_sum("identical", needs="pairs")
def _identical_w(b: PairBatch):
    return b.kept(b.identical).sum(3).double()


@batch_sum("chance_identical", ("L", "H"), torch.float64, needs="pairs")
def _chance_identical(b: PairBatch):
    return (b.k.double() * b.chance_identical).sum().expand(b.n_layers, b.n_heads)


@window_sum("chance_identical", needs="pairs")
def _chance_identical_w(b: PairBatch):
    return (b.k.double() * b.chance_identical)[:, None, None].expand(
        b.b, b.n_layers, b.n_heads)


@batch_sum("identical_distance_hist", ("L", "H", "T"), torch.long, needs="pairs")
def _identical_distance_hist(b: PairBatch):
    return b.distance_histogram(b.kept(b.identical))


@batch_sum("token_counts", ("L", "H", "V"), torch.long, needs="pairs")
def _token_counts(b: PairBatch):
    # [L, H, V] is large: scattered into the sum (pairs beyond a window's k add 0)
    vocab = b.stats.vocab_size
    index = torch.cat([(b.layer_head * vocab + tok).reshape(-1) for tok in (b.token_i,
                                                                            b.token_j)])
    weights = (torch.ones(index.numel(), dtype=torch.long, device=b.device)
               if b.selected is None else b.selected.to(torch.long).reshape(-1).repeat(2))
    return ScatterAdd(index, weights)


@batch_sum("corpus_token_counts", ("V",), torch.long)
def _corpus_token_counts(b: PairBatch):
    return torch.bincount(b.ids[b.valid], minlength=b.stats.vocab_size)


@batch_sum("in_attention_region", ("L", "H"), torch.long, needs="pairs")
def _in_attention_region(b: PairBatch):
    return b.kept(b.in_region).sum((0, 3))


@window_sum("in_attention_region", needs="pairs")
def _in_attention_region_w(b: PairBatch):
    return b.kept(b.in_region).sum(3).double()


@window_sum("n_masked", needs="pairs")
def _n_masked_w(b: PairBatch):
    return b.outside_region.sum(3).double()


@batch_sum("masked_distance_hist", ("L", "H", "T"), torch.long, needs="pairs")
def _masked_distance_hist(b: PairBatch):
    return b.distance_histogram(b.outside_region)


@batch_sum("masked_same_sentence", ("L", "H"), torch.long, needs="pairs")
def _masked_same_sentence(b: PairBatch):
    return (b.same_sentence & b.outside_region).sum((0, 3))


@window_sum("masked_same_sentence", needs="pairs")
def _masked_same_sentence_w(b: PairBatch):
    return (b.same_sentence & b.outside_region).sum(3).double()


@batch_sum("masked_chance_same_sentence_distance", ("L", "H"), torch.float64, needs="pairs")
def _masked_chance_same_sentence_distance(b: PairBatch):
    return (b.same_sentence_given_distance * b.outside_region).sum((0, 3))


@window_sum("masked_chance_same_sentence_distance", needs="pairs")
def _masked_chance_same_sentence_distance_w(b: PairBatch):
    return (b.same_sentence_given_distance * b.outside_region).sum(3)


@window_sum("distance_sum", needs="pairs")
def _distance_sum_w(b: PairBatch):
    return b.weighed(b.distance).sum(3).double()  # fillers sit at distance 0


@window_sum("chance_distance_sum", needs="pairs")
def _chance_distance_sum_w(b: PairBatch):
    d = torch.arange(b.length, device=b.device, dtype=torch.float64)
    return b.chance_count((b.pairs_by_distance * d).sum(1))


@window_sum("short_range", needs="pairs")
def _short_range_w(b: PairBatch):
    return b.kept((b.distance >= 1) & (b.distance <= SHORT_RANGE)).sum(3).double()


@window_sum("chance_short_range", needs="pairs")
def _chance_short_range_w(b: PairBatch):
    return b.chance_count(b.pairs_by_distance[:, 1:SHORT_RANGE + 1].sum(1))


@window_sum("long_range", needs="pairs")
def _long_range_w(b: PairBatch):
    return b.kept(b.distance > LONG_RANGE).sum(3).double()


@window_sum("chance_long_range", needs="pairs")
def _chance_long_range_w(b: PairBatch):
    return b.chance_count(b.pairs_by_distance[:, LONG_RANGE + 1:].sum(1))


@window_sum("identical_long_range", needs="pairs")
def _identical_long_range_w(b: PairBatch):
    return b.kept(b.identical & (b.distance > LONG_RANGE)).sum(3).double()


@window_sum("chance_identical_long_range", needs="pairs")
def _chance_identical_long_range_w(b: PairBatch):
    ident = b._content_pairs & (b.ids[:, :, None] == b.ids[:, None, :])
    return b.chance_count(b._by_distance(ident)[:, LONG_RANGE + 1:].sum(1))


@window_sum("mid_same_sentence", needs="pairs")
def _mid_same_sentence_w(b: PairBatch):
    mid = (b.distance > SHORT_RANGE) & (b.distance <= LONG_RANGE)
    return b.kept(mid & b.same_sentence).sum(3).double()


@window_sum("chance_mid_same_sentence", needs="pairs")
def _chance_mid_same_sentence_w(b: PairBatch):
    return b.chance_count(b.same_sentence_by_distance[:, SHORT_RANGE + 1:LONG_RANGE + 1].sum(1))


@window_sum("distance_bins", ("L", "H", "D"), needs="pairs")
def _distance_bins_w(b: PairBatch):
    n_bins = n_distance_bins(b.length)
    out = torch.zeros(b.b, b.n_layers, b.n_heads, n_bins, dtype=torch.float64, device=b.device)
    return out.scatter_add_(-1, b.distance_bin, b.weighed(torch.ones_like(b.distance,
                                                                          dtype=torch.float64)))


@window_sum("chance_distance_bins", ("D",), needs="pairs")
def _chance_distance_bins_w(b: PairBatch):
    n_bins = n_distance_bins(b.length)
    d = torch.arange(b.length, device=b.device)
    one_hot = ((log2_bin(d, n_bins)[:, None] == torch.arange(n_bins, device=b.device))
               & (d >= 1)[:, None])
    by_bin = b.pairs_by_distance @ one_hot.double()  # [B, D]
    return b.k.double()[:, None] * by_bin / b.n_pairs[:, None]


@window_sum("unrelated", needs="pairs")
def _unrelated_w(b: PairBatch):
    # none of the relations the chapter measures: another sentence, different tokens,
    # more than SHORT_RANGE apart, outside the high-attention region
    return b.kept(~b.same_sentence & ~b.identical & (b.distance > SHORT_RANGE)
                  & ~b.in_region).sum(3).double()


@window_sum("hub_endpoints", needs="pairs")
def _hub_endpoints_w(b: PairBatch):
    return b._hub[1].double()


@window_sum("chance_hub_endpoints", (), needs="pairs")
def _chance_hub_endpoints_w(b: PairBatch):
    # the same statistic (the commonest endpoint token's count) on k content pairs drawn
    # uniformly: its expectation is not 2 k n_max / N, since a maximum over noisy counts
    # exceeds the largest expected count; one draw per window, seeded by the window
    ids, valid, k = b.ids.cpu(), b.valid.cpu(), b.k.cpu()
    out = [float(uniform_pairs_mode_count(ids[w][valid[w]], int(k[w]))) for w in range(b.b)]
    return torch.tensor(out, dtype=torch.float64, device=b.device)


@window_sum("hub_pairs", needs="pairs")
def _hub_pairs_w(b: PairBatch):
    return b.hub_pair.sum(3).double()


@window_sum("hub_near", needs="pairs")
def _hub_near_w(b: PairBatch):
    return (b.hub_pair & (b.distance <= SHORT_RANGE)).sum(3).double()


@window_sum("hub_distinct", ("L",), needs="pairs")
def _hub_distinct_w(b: PairBatch):
    hub = b._hub[0].sort(-1).values  # [B, L, H]
    distinct = 1 + (hub[..., 1:] != hub[..., :-1]).sum(-1)
    return torch.where((b.k > 0)[:, None], distinct, torch.zeros_like(distinct)).double()


@batch_sum("separator_attention", ("L", "H", "S"), torch.float64, needs="separators")
def _separator_attention(b: PairBatch):
    return b.separator_attention_total


@window_sum("separator_attention", ("L", "H", "S"), needs="separators")
def _separator_attention_w(b: PairBatch):
    return b.separator_attention


@batch_sum("chance_separator", ("S",), torch.float64, needs="separators")
def _chance_separator(b: PairBatch):
    return b.chance_separator.sum(0)


@window_sum("chance_separator", ("S",), needs="separators")
def _chance_separator_w(b: PairBatch):
    return b.chance_separator


@batch_sum("n_queries", (), torch.long)
def _n_queries(b: PairBatch):
    return b.n_tokens.sum()


@window_sum("n_queries", ())
def _n_queries_w(b: PairBatch):
    return b.n_tokens.double()


@batch_sum("similarity_sum", ("L", "H", "T", "T"), torch.float64)
def _similarity_sum(b: PairBatch):
    # in the outputs' dtype (top_pairs's buffer): add_parts adds it to the float64 sum
    # as it is, which equals adding its float64 copy (the widening is exact) without
    # writing that copy
    return b.similarity_sum


@window_sum("tracked_endpoints", needs="tracked")
def _tracked_endpoints_w(b: PairBatch):
    if b.k_max == 0:
        return torch.zeros(b.b, b.n_layers, b.n_heads, dtype=torch.float64, device=b.device)
    tracked = b.tracked.view(1, b.n_layers, b.n_heads, 1)
    return (b.kept(b.token_i == tracked).sum(3) + b.kept(b.token_j == tracked).sum(3)).double()


@window_sum("tracked_content", needs="tracked")
def _tracked_content_w(b: PairBatch):
    tracked = b.tracked.view(1, 1, -1)
    return ((b.ids[:, :, None] == tracked) & b.valid[:, :, None]).sum(1).double().view(
        b.b, b.n_layers, b.n_heads)


@dataclass
class SimilarityStats:
    """Streaming statistics of context similarity over windows; every field is a sum.

    Configuration (must agree to merge): ``n_layers``, ``n_heads``, ``length`` (tokens per
    window), ``vocab_size``, ``percentile`` (top per cent of the off-diagonal content pairs
    ``i < j`` of a window and head, called "high similarity"), ``attention_threshold``
    (a pair is in the head's high-attention region when ``max(A_ij, A_ji)`` reaches it; the
    maps are normalised, rows sum to 1), ``separators`` (name -> token id).

    Sums, per layer ``l`` and head ``h`` ([L, H] unless said), over all windows:

    - ``n_windows``; ``n_high``: high-similarity pairs;
    - ``distance_hist`` [L, H, T]: their token distances ``j - i``;
    - ``same_sentence``: those inside one sentence; ``chance_same_sentence``: expected
      count if the high pairs were drawn uniformly from the window's content pairs
      (``k * sum_s n_s(n_s-1) / (N(N-1))`` per window, sentence lengths ``n_s``);
      ``chance_same_sentence_distance``: expected count for pairs drawn at the same
      distances (sum over high pairs of P(same sentence | distance) in that window);
    - ``identical``: high pairs of identical tokens, ``chance_identical`` its uniform
      expectation, ``identical_distance_hist`` [L, H, T];
    - ``token_counts`` [L, H, V]: how often each vocabulary token is an endpoint of a high
      pair; ``corpus_token_counts`` [V]: content-token frequencies;
    - ``in_attention_region``: high pairs inside the high-attention region; ``masked_*``:
      distance histogram, same-sentence count and distance-matched chance of the high
      pairs outside it ("masking the high-attention regions");
    - ``separator_attention`` [L, H, S]: attention mass from content queries onto each
      separator token kind; ``chance_separator`` [S]: the same under uniform attention;
      ``n_queries``;
    - ``similarity_sum`` [L, H, T, T]: sum of the zero-diagonal similarity matrices (all
      tokens, computed as one product over the batch: no T x T matrix per window).

    ``update`` never forms the ``[B, L, H, T, T]`` similarity tensor (see
    :func:`top_pairs`); its cost is a fraction of the forward pass. ``merge`` and
    :meth:`all_reduce` add sums, so the statistics of a sharded corpus equal those of one
    pass.

    Per-window contributions (``per_window=True``), for intervals: every window's own
    share of the ``[L, H]`` sums is kept as well (:meth:`window_sums`: the statistics
    registered with a :func:`window_sum`, leading dimension W in the order the windows
    were added), so that a bootstrap over windows (:meth:`window_bootstrap`) can resample
    any ratio of sums. Besides
    the ``[L, H]`` sums above they hold ``n_masked`` (high pairs outside the attention
    region), ``distance_sum`` (sum of ``j - i``), ``short_range`` / ``long_range`` (high
    pairs with ``j - i <= SHORT_RANGE`` / ``> LONG_RANGE``; ``identical_long_range``: the
    identical-token ones among the latter) and their uniform chance
    counts ``chance_distance_sum``, ``chance_short_range``, ``chance_long_range`` (``k``
    times the window's mean over its content pairs), ``separator_attention`` [W, L, H, S],
    ``chance_separator`` [W, S], ``n_queries`` [W] (content tokens). With
    :meth:`track_tokens` ``(ids [L, H])`` also ``tracked_endpoints`` (endpoints of head
    ``(l, h)``'s high pairs that are token ``ids[l, h]``) and ``tracked_content`` (content
    tokens of the window equal to ``ids[l, h]``), for a held-out token lift. For the
    paper's per-input statements: ``distance_bins`` [W, L, H, D] (high pairs per log2
    distance bin, :func:`log2_bin`) and ``chance_distance_bins`` [W, D] (uniform pairs'
    expected counts); ``hub_endpoints`` (endpoints taken by the head's most common token in
    the window, its *hub*), ``chance_hub_endpoints`` [W] (the same count for ``k`` pairs
    drawn uniformly, :func:`uniform_pairs_mode_count`), ``hub_pairs`` / ``hub_near`` (high pairs
    touching the hub; those at most ``SHORT_RANGE`` apart), ``hub_distinct`` [W, L]
    (distinct hub tokens among a layer's heads); ``mid_same_sentence`` (same-sentence
    pairs ``SHORT_RANGE < j - i <= LONG_RANGE``) and ``chance_mid_same_sentence``;
    ``chance_identical_long_range``; ``unrelated`` (high pairs in two sentences, of two
    different tokens, more than ``SHORT_RANGE`` apart and outside the high-attention
    region). The cost is a
    few reductions over the ``[B, L, H, k]`` selected pairs; nothing changes when it is off.

    >>> from companion.context_similarity.capture import BatchResult
    >>> g = torch.Generator().manual_seed(0)
    >>> z = torch.randn(1, 2, 2, 6, 4, generator=g, dtype=torch.float64)  # [B, L, H, T, d]
    >>> attn = torch.softmax(torch.randn(1, 2, 2, 6, 6, generator=g, dtype=torch.float64), -1)
    >>> ids, sent = torch.tensor([[1, 7, 8, 5, 7, 2]]), torch.tensor([[-1, 0, 0, 0, 1, -1]])
    >>> result = BatchResult(z, attn, ids, sent, torch.ones(1, 6, dtype=torch.long))
    >>> stats = SimilarityStats(n_layers=2, n_heads=2, length=6, vocab_size=10,
    ...                         separators={".": 5}, per_window=True)
    >>> stats.update(result).n_high.tolist()
    [[1, 1], [1, 1]]
    >>> from companion.context_similarity.reference import stats_reference
    >>> ref = stats_reference(result, stats.percentile, stats.attention_threshold, {".": 5}, 10)
    >>> all(torch.allclose(ref[k].double(), getattr(stats, k).double()) for k in ref)
    True

    References
    ----------
    Halevi et al., arXiv 2512.21956, abstract: pairs of tokens whose self-attention vector outputs
    are most similar, by layer and head.
    """

    n_layers: int
    n_heads: int
    length: int
    vocab_size: int
    percentile: float = 1.0
    attention_threshold: float = 0.1
    separators: dict = field(default_factory=dict)
    per_window: bool = False
    device: str | torch.device = "cpu"

    def __post_init__(self):
        for name in ("n_layers", "n_heads", "length", "vocab_size"):
            check_int(name, getattr(self, name), minimum=1)
        if self.length < 2:
            raise ValueError(f"length: expected >= 2 tokens, got {self.length}")
        # a bool is an int to isinstance: True would pass as 1 (analyse_batch refuses it)
        if (isinstance(self.percentile, bool) or not isinstance(self.percentile, (int, float))
                or not 0 < self.percentile <= 100):
            raise ValueError(f"percentile: expected a number in (0, 100], got {self.percentile!r}")
        if (isinstance(self.attention_threshold, bool)
                or not isinstance(self.attention_threshold, (int, float))
                or not 0 < self.attention_threshold <= 1):
            raise ValueError("attention_threshold: expected a probability in (0, 1], got "
                             f"{self.attention_threshold!r}")
        if not isinstance(self.per_window, bool):
            raise TypeError(f"per_window: expected a bool, got {self.per_window!r}")
        self.separators = {str(k): int(v) for k, v in dict(self.separators).items()}
        self.device = torch.device(self.device)
        self._workspace = Workspace()  # buffers reused between batches (not statistics)
        self._windows: dict[str, list[torch.Tensor]] = {}  # per-window parts, by batch
        # where the parts are kept on the CPU: outside malloc's heap, so that a pass's
        # temporaries reuse the heap's pages without leaving holes (companion.heap)
        self._kept = MappedArena()
        self._tracked: torch.Tensor | None = None
        self._sums: dict[str, tuple] = {}  # name: (shape letters, dtype), allocated
        self._registry: tuple = ()
        self._registered()

    def _registered(self) -> None:
        """Take up the statistics registered since this object last looked.

        :data:`STATISTICS` is read when it is used, not when the class is defined: a
        statistic registered later, in any module, is summed by every
        :class:`SimilarityStats` that has not added windows yet. One registered after
        windows were added would miss them, so that is refused, naming it.
        """
        registry = tuple((s.name, s.needs, s.total is not None, s.window is not None)
                         for s in STATISTICS.values())
        if registry == self._registry:
            return
        if self._registry and (self._windows or int(self.n_windows.sum()) > 0):
            new = sorted({entry[0] for entry in set(registry) - set(self._registry)})
            raise RuntimeError(
                f"statistics {new} were registered after this SimilarityStats added windows, "
                "so their sums would miss them: register every statistic before the first "
                "update (or start a new SimilarityStats)")
        dims = {"L": self.n_layers, "H": self.n_heads, "T": self.length,
                "V": self.vocab_size, "S": len(self.separators)}
        for stat in STATISTICS.values():
            if stat.total is not None and stat.name not in self._sums:
                setattr(self, stat.name, torch.zeros(tuple(dims[c] for c in stat.shape),
                                                     dtype=stat.dtype, device=self.device))
                self._sums[stat.name] = (stat.shape, stat.dtype)
        self._registry = registry

    # ------------------------------------------------------------------ bookkeeping

    def config(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "device"}

    def _check_compatible(self, other: SimilarityStats) -> None:
        if not isinstance(other, SimilarityStats):
            raise TypeError(f"other: expected SimilarityStats, got {type(other).__name__}")
        if other.config() != self.config():
            raise ValueError(
                f"other: configuration differs, expected {self.config()}, got {other.config()}"
            )

    def tensors(self) -> dict[str, torch.Tensor]:
        """The summed statistics, by name: one per statistic registered in :data:`STATISTICS`
        with a corpus sum (:func:`batch_sum`)."""
        self._registered()
        return {name: getattr(self, name) for name in self._sums}

    def copy(self) -> SimilarityStats:
        return self.to(self.device)

    def to(self, device) -> SimilarityStats:
        """A copy on ``device``."""
        new = SimilarityStats(**self.config(), device=device)
        for name, t in self.tensors().items():
            setattr(new, name, t.to(new.device, copy=True))
        if self._tracked is not None:
            new._tracked = self._tracked.to(new.device, copy=True)
        new._windows = {name: [t.to(new.device, copy=True) for t in parts]
                        for name, parts in self._windows.items()}
        return new

    def merge(self, other: SimilarityStats) -> SimilarityStats:
        """Add ``other``'s sums into ``self`` (in place) and return ``self``.

        Per-window contributions are concatenated (``self``'s windows first). The tracked
        counts (:meth:`track_tokens`) survive only when both track the same tokens;
        otherwise the merged statistics track none.
        """
        self._check_compatible(other)
        other._registered()
        for name, t in self.tensors().items():
            t += getattr(other, name).to(t.device)
        same_tracked = (self._tracked is not None and other._tracked is not None
                        and torch.equal(self._tracked, other._tracked.to(self._tracked.device)))
        if not same_tracked:
            self._tracked = None
        for name in list(self._windows):
            if name in _tracked_names() and not same_tracked:
                del self._windows[name]
                continue
            self._windows[name] = (self._windows[name]
                                   + [t.to(self.device) for t in other._windows.get(name, [])])
        return self

    def track_tokens(self, token_ids: torch.Tensor | None) -> SimilarityStats:
        """Count, per window, head ``(l, h)``'s high-pair endpoints that are token
        ``token_ids[l, h]``, and that token's content occurrences (needs ``per_window``).

        For a held-out lift: choose each head's token on some windows, track it on others;
        ``None`` stops tracking. Returns self.
        """
        if not self.per_window:
            raise ValueError("token_ids: tracking tokens needs per_window=True")
        if token_ids is None:
            self._tracked = None
            for name in _tracked_names():
                self._windows.pop(name, None)
            return self
        if (not isinstance(token_ids, torch.Tensor) or token_ids.is_floating_point()
                or tuple(token_ids.shape) != (self.n_layers, self.n_heads)):
            raise TypeError(f"token_ids: expected an integer tensor [{self.n_layers}, "
                            f"{self.n_heads}] of token ids, got {token_ids!r}")
        if int(token_ids.min()) < 0 or int(token_ids.max()) >= self.vocab_size:
            raise ValueError(f"token_ids: expected ids in [0, {self.vocab_size})")
        if int(self.n_windows) > 0:
            raise ValueError("token_ids: set the tracked tokens before the first update")
        self._tracked = token_ids.to(device=self.device, dtype=torch.long).clone()
        return self

    def window_sums(self) -> dict[str, torch.Tensor]:
        """The per-window contributions, name -> [W, ...] float64 (see the class notes)."""
        if not self.per_window:
            raise ValueError("stats: per-window contributions need per_window=True")
        self._need_data()
        self._registered()
        out = {}
        for name, parts in self._windows.items():
            if len(parts) > 1:
                self._windows[name] = parts = [torch.cat(parts)]
            out[name] = parts[0]
        self._kept = MappedArena()  # the concatenated parts: the old blocks can go
        return out

    def window_bootstrap(self, reps: int = 1000, seed: int = 0) -> dict[str, torch.Tensor]:
        """Resampled sums, name -> [reps, ...]: windows drawn with replacement.

        Replicate ``r`` weighs window ``w`` by how often it was drawn (the same draws for
        every name, so ratios of sums are paired), i.e. the nonparametric bootstrap over
        windows of every sum in :meth:`window_sums`.
        """
        reps = check_int("reps", reps, minimum=1)
        sums = self.window_sums()
        n = int(sums["n_queries"].shape[0])
        gen = torch.Generator().manual_seed(int(seed))
        draws = torch.randint(n, (reps, n), generator=gen)
        weights = torch.zeros(reps, n, dtype=torch.float64).scatter_add_(
            1, draws, torch.ones(reps, n, dtype=torch.float64))
        return {name: (weights @ t.cpu().reshape(n, -1)).view(reps, *t.shape[1:])
                for name, t in sums.items()}

    def all_reduce(self, group=None) -> SimilarityStats:
        """Sum the statistics over all ranks of ``group`` (torch.distributed), in place.

        With the NCCL backend the sums travel through the current CUDA device and are put
        back where they were.
        """
        import torch.distributed as dist

        backend = dist.get_backend(group)
        if self._windows:
            # Per-window parts, one per batch: rank r holds batches r, r + W, r + 2W, ...
            # (analyse_corpus), so interleaving the ranks' lists restores the windows'
            # order, and a bootstrap over windows is the single-process one.
            mine = {name: [t.cpu() for t in parts] for name, parts in self._windows.items()}
            gathered = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, mine, group=group)
            longest = max(len(parts) for g in gathered for parts in g.values())
            self._windows = {
                name: [torch.cat([g[name][j] for j in range(longest) for g in gathered
                                  if j < len(g[name])]).to(self.device)]
                for name in mine}
        for t in self.tensors().values():
            if backend == "nccl" and t.device.type != "cuda":
                buf = t.to(torch.device("cuda", torch.cuda.current_device()))
                dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
                t.copy_(buf)
            else:
                dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return self

    def state_dict(self) -> dict:
        state = {"config": self.config(),
                 "sums": {k: v.cpu() for k, v in self.tensors().items()}}
        if self._windows:
            state["windows"] = {name: torch.cat(parts).cpu()
                                for name, parts in self._windows.items()}
        if self._tracked is not None:
            state["tracked_tokens"] = self._tracked.cpu()
        return state

    @classmethod
    def from_state_dict(cls, state: dict, device="cpu") -> SimilarityStats:
        new = cls(**state["config"], device=device)
        missing = sorted(set(new.tensors()) - set(state["sums"]))
        if missing:
            raise ValueError(f"state: no sums for the registered statistics {missing} "
                             "(saved before they were registered)")
        for name, t in state["sums"].items():
            getattr(new, name).copy_(t)
        new._windows = {name: [t.to(new.device)] for name, t in state.get("windows", {}).items()}
        if state.get("tracked_tokens") is not None:
            new._tracked = state["tracked_tokens"].to(new.device)
        return new

    # ------------------------------------------------------------------ update

    def _validate(self, batch_result):
        if not isinstance(batch_result, BatchResult):
            raise TypeError(
                f"batch_result: expected a BatchResult (analyse_batch), got "
                f"{type(batch_result).__name__}"
            )
        z = batch_result.outputs
        n_l, n_h, t_len = self.n_layers, self.n_heads, self.length
        if not isinstance(z, torch.Tensor) or z.dim() != 5 or tuple(z.shape[1:4]) != (
                n_l, n_h, t_len):
            got = tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__
            raise ValueError(
                f"batch_result.outputs: expected [B, {n_l}, {n_h}, {t_len}, d], got {got}")
        b = z.shape[0]
        attn = batch_result.attentions
        if attn is None:
            layers = None
            self._validate_high_attention(batch_result, b)
        else:
            layers = list(attn.unbind(1)) if isinstance(attn, torch.Tensor) else list(attn)
        if layers is not None and (len(layers) != n_l or any(
                tuple(a.shape) != (b, n_h, t_len, t_len) for a in layers)):
            raise ValueError(
                "batch_result.attentions: expected [B, L, H, T, T] or L tensors [B, H, T, T] "
                f"with B={b}, L={n_l}, H={n_h}, T={t_len}")
        for name in ("input_ids", "sentence_ids", "attention_mask"):
            t = getattr(batch_result, name)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (b, t_len):
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"batch_result.{name}: expected shape {(b, t_len)}, got {got}")
        received = batch_result.received_attention
        if received is not None and (not isinstance(received, torch.Tensor) or tuple(
                received.shape) != (b, n_l, n_h, t_len)):
            got = tuple(received.shape) if isinstance(received, torch.Tensor) else type(
                received).__name__
            raise ValueError("batch_result.received_attention: expected shape "
                             f"{(b, n_l, n_h, t_len)} or None, got {got}")
        ids = batch_result.input_ids
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(
                f"batch_result.input_ids: token ids must lie in [0, {self.vocab_size})")
        return layers

    def _validate_high_attention(self, batch_result, b):
        """Without maps: ``high_attention`` at this ``attention_threshold`` and
        ``received_attention`` must be there (all that is read of the maps)."""
        high = batch_result.high_attention
        want = (self.n_layers, b, self.n_heads, self.length, self.length)
        if (not isinstance(high, tuple) or len(high) != 2
                or not isinstance(high[1], torch.Tensor) or high[1].dtype != torch.bool
                or tuple(high[1].shape) != want):
            raise ValueError("batch_result.attentions: None needs high_attention (threshold, "
                             f"bool tensor {want} [L, B, H, T, T]), got "
                             f"{type(high).__name__}")
        if high[0] != self.attention_threshold:
            raise ValueError(f"batch_result.high_attention: at threshold {high[0]}, the "
                             f"statistics' attention_threshold is {self.attention_threshold}"
                             " (analyse_batch(attention_threshold=) must match, or keep the "
                             "maps)")
        if batch_result.received_attention is None:
            raise ValueError("batch_result.attentions: None needs received_attention")


    @torch.no_grad()
    def update(self, batch_result: BatchResult,
               workspace: Workspace | None = None) -> SimilarityStats:
        """Add one batch of windows (see :func:`analyse_batch`) to the sums; returns self.

        The tensors of ``batch_result`` may live on any device; the work happens on the
        device of the outputs and the sums are added on ``self.device``. ``workspace``:
        where the work buffers are kept (default: the statistics' own).
        """
        return self.add_parts(self.batch_parts(batch_result, workspace))

    @torch.no_grad()
    def batch_parts(self, batch_result: BatchResult,
                    workspace: Workspace | None = None) -> BatchParts:
        """What :meth:`update` adds for one batch, computed without changing ``self``.

        ``update(r)`` is ``add_parts(batch_parts(r))``: the parts of several batches may
        be computed at once (on threads of their own, each with its own ``workspace``) and
        then added one batch after the other, in the windows' order, giving the sums of
        :meth:`update` bit for bit. The parts may live in ``workspace``'s buffers: add
        them before that workspace computes the next batch's.
        """
        self._registered()
        layers = self._validate(batch_result)
        batch = PairBatch(self, batch_result, layers,
                          self._workspace if workspace is None else workspace)
        totals = []
        for stat in STATISTICS.values():
            if stat.total is None or not self._computed(stat, batch):
                continue
            totals.append((stat.name, stat.total(batch)))
        windows = []
        if self.per_window:
            dims = {"L": self.n_layers, "H": self.n_heads, "S": len(self.separators),
                    "D": n_distance_bins(self.length)}
            for stat in STATISTICS.values():
                if stat.window is None or (stat.needs == "tracked" and self._tracked is None):
                    continue
                if self._computed(stat, batch):
                    value = stat.window(batch)
                else:  # no content pairs or no separators: zeros
                    value = torch.zeros((batch.b, *(dims[s] for s in stat.window_shape)),
                                        dtype=torch.float64, device=batch.device)
                windows.append((stat.name, value))
        return BatchParts(totals, windows)

    @torch.no_grad()
    def add_parts(self, parts: BatchParts) -> SimilarityStats:
        """Add one batch's :meth:`batch_parts` to the sums; returns self."""
        if not isinstance(parts, BatchParts):
            raise TypeError(f"parts: expected BatchParts (SimilarityStats.batch_parts), got "
                            f"{type(parts).__name__}")
        self._registered()
        for name, value in parts.totals:
            total = getattr(self, name)
            if isinstance(value, ScatterAdd):
                total.view(-1).index_add_(0, value.index.to(total.device),
                                          value.weights.to(total.device, total.dtype))
            else:
                value = value.to(total.device)
                if torch.promote_types(value.dtype, total.dtype) != total.dtype:
                    value = value.to(total.dtype)
                # a float32 part into a float64 sum: widened exactly on the fly, the
                # same numbers as adding its float64 copy, without that copy
                total += value
        for name, value in parts.windows:
            self._windows.setdefault(name, []).append(self._kept.keep(value.to(self.device)))
        return self

    def _computed(self, stat: Statistic, batch: PairBatch) -> bool:
        """Whether ``stat`` has anything to count in ``batch``."""
        if stat.needs == "pairs":
            return batch.k_max > 0
        if stat.needs == "separators":
            return bool(self.separators)
        if stat.needs == "tracked":
            return self._tracked is not None
        return True

    # ------------------------------------------------------------------ results

    def _need_data(self):
        if int(self.n_high.sum()) == 0:
            raise ValueError("stats: no windows analysed yet (call update first)")

    def distance_distribution(self, masked: bool = False) -> torch.Tensor:
        """[L, H, T] distribution of distances ``j - i`` (index 0 unused) of high pairs."""
        self._need_data()
        h = (self.masked_distance_hist if masked else self.distance_hist).double()
        return h / h.sum(-1, keepdim=True).clamp(min=1)

    def same_sentence_fraction(self, masked: bool = False) -> torch.Tensor:
        """[L, H] fraction of high-similarity pairs inside one sentence."""
        self._need_data()
        if masked:
            n = self.masked_distance_hist.sum(-1).double()
            return self.masked_same_sentence.double() / n.clamp(min=1)
        return self.same_sentence.double() / self.n_high.double().clamp(min=1)

    def same_sentence_chance(self, kind: str = "sentence_lengths",
                             masked: bool = False) -> torch.Tensor:
        """[L, H] chance level of :meth:`same_sentence_fraction`.

        ``kind="sentence_lengths"``: pairs drawn uniformly from the window's content pairs
        (depends only on the sentence lengths); ``kind="distance_matched"``: pairs drawn
        at the same distances as the observed high pairs.
        """
        self._need_data()
        if kind == "sentence_lengths":
            if masked:
                raise ValueError("masked: only the distance-matched chance exists for masked pairs")
            return self.chance_same_sentence / self.n_high.double().clamp(min=1)
        if kind == "distance_matched":
            if masked:
                n = self.masked_distance_hist.sum(-1).double()
                return self.masked_chance_same_sentence_distance / n.clamp(min=1)
            return self.chance_same_sentence_distance / self.n_high.double().clamp(min=1)
        raise ValueError(f"kind: expected 'sentence_lengths' or 'distance_matched', got {kind!r}")

    def identical_fraction(self) -> torch.Tensor:
        """[L, H] fraction of high pairs whose two tokens are identical."""
        self._need_data()
        return self.identical.double() / self.n_high.double().clamp(min=1)

    def identical_chance(self) -> torch.Tensor:
        """[L, H] fraction of identical-token pairs among all content pairs (chance)."""
        self._need_data()
        return self.chance_identical / self.n_high.double().clamp(min=1)

    def most_common_tokens(self, top: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's ``top`` most frequent tokens among high-pair endpoints.

        Returns (ids [L, H, top], share [L, H, top]) with share = count / (2 * n_high).
        """
        self._need_data()
        counts, idx = self.token_counts.topk(top, dim=-1)
        return idx, counts.double() / (2 * self.n_high.double()).clamp(min=1)[..., None]

    def token_lift(self) -> torch.Tensor:
        """[L, H, V] token share among high-pair endpoints over its corpus share."""
        self._need_data()
        share = self.token_counts.double() / (2 * self.n_high.double()).clamp(min=1)[..., None]
        base = self.corpus_token_counts.double() / self.corpus_token_counts.sum().clamp(min=1)
        return share / base.clamp(min=1e-12)

    def separator_attention_mean(self) -> torch.Tensor:
        """[L, H, S] mean attention mass of a content query on each separator kind."""
        self._need_data()
        return self.separator_attention / self.n_queries.double().clamp(min=1)

    def separator_attention_chance(self) -> torch.Tensor:
        """[S] the same under uniform attention over the window's keys."""
        self._need_data()
        return self.chance_separator / self.n_queries.double().clamp(min=1)

    def attention_region_fraction(self) -> torch.Tensor:
        """[L, H] fraction of high-similarity pairs inside the high-attention region."""
        self._need_data()
        return self.in_attention_region.double() / self.n_high.double().clamp(min=1)

    def mean_similarity(self) -> torch.Tensor:
        """[L, H, T, T] mean similarity matrix over windows (zero diagonal)."""
        self._need_data()
        return self.similarity_sum / self.n_windows.double()

