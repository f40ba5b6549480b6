"""The measurements behind the chapter's paper claims, as functions of per-window sums.

Every statement of Halevi et al. (arXiv 2512.21956) that the chapter tests ranges over
text: over windows of 128 tokens. Each measurement here is a function ``fn(sums, ...)``
of the sums of :class:`~companion.context_similarity.stats.SimilarityStats` (name ->
tensor whose trailing dimensions are those of the sum, e.g. ``[..., L, H]``), so that the
same function gives the value on the summed windows and, with a leading replicate axis,
on every bootstrap replicate of the windows (:class:`WindowSums`, :func:`evaluate`).
The chapter and the falsifier tests call these functions, and nothing else, for a claim.

Layer groups are lists of 0-based layer indices; heads are 0-based too.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from companion._validate import check_int

__all__ = [
    "CONTEXT_MIN",
    "HUB_MIN",
    "PAPER_HEAD",
    "REP_MIN",
    "Measured",
    "WindowSums",
    "distinct_features_share",
    "distinct_hub_share",
    "early_uniform_distance",
    "evaluate",
    "final_strongest_sentence",
    "head_ratio",
    "identical_far_ratio",
    "intra_sentence_over_long_range",
    "long_share_difference",
    "mean_distance_difference",
    "paper_measurements",
    "pooled",
    "repetition_top_fraction",
    "same_sentence_excess",
    "same_sentence_fraction",
    "sentence_beyond_locality",
    "separator_ratio",
    "short_share",
    "specialised_head_share",
    "token_context_ratio",
    "unrelated_share",
]

#: A head pairs around its hub token when the hub takes at least this many times the
#: endpoints that the commonest token of uniformly drawn pairs takes (ours).
HUB_MIN = 2.0
#: A repetition head joins identical tokens at least this many times as often as chance
#: (ours), in :func:`distinct_features_share`.
REP_MIN = 5.0
#: A context head's hub pairs lie within SHORT_RANGE tokens at least this many times as
#: often as uniform pairs do (ours), in :func:`distinct_features_share`.
CONTEXT_MIN = 2.0


@dataclass(frozen=True)
class Measured:
    """A measurement: its value on all windows, its percentile interval over bootstrap
    replicates of the windows, and the replicates.

    >>> m = Measured(0.5, (0.4, 0.6), torch.tensor([0.4, 0.5, 0.6]))
    >>> m.interval[0] <= m.value <= m.interval[1]
    True
    """

    value: float
    interval: tuple[float, float]
    replicates: torch.Tensor


class WindowSums(Mapping):
    """Per-window sums and their bootstrap over windows, resampled lazily by name.

    ``point[name]`` is the sum over all windows; ``boot[name]`` is ``[reps, ...]``: replicate
    ``r`` weighs window ``w`` by how often it was drawn (the same draws for every name, so
    ratios of sums are paired). ``window_sums`` is :meth:`SimilarityStats.window_sums`.
    A derived per-window sum ``windows_with_pairs`` counts the windows that have pairs.

    ``clusters``: one label per window (e.g. its document); the bootstrap then draws
    clusters with replacement and keeps all windows of a drawn cluster together, since
    consecutive windows of one text are not independent draws. None: every window is its
    own cluster.

    >>> w = {"n_high": torch.ones(4, 1, 1), "same_sentence": torch.ones(4, 1, 1)}
    >>> s = WindowSums(w, reps=3, seed=0, clusters=[0, 0, 1, 1])
    >>> s.point["n_high"], s.boot["n_high"].shape, s.n_clusters
    (tensor([[4.]], dtype=torch.float64), torch.Size([3, 1, 1]), 2)
    """

    def __init__(self, window_sums: Mapping[str, torch.Tensor], reps: int = 1000,
                 seed: int = 0, clusters=None):
        reps = check_int("reps", reps, minimum=1)
        if "n_high" not in window_sums:
            raise ValueError("window_sums: expected SimilarityStats.window_sums() (no 'n_high')")
        self._w = dict(window_sums)
        n_high = self._w["n_high"]
        self._w["windows_with_pairs"] = (n_high.reshape(n_high.shape[0], -1).sum(1) > 0).double()
        self.n = int(n_high.shape[0])
        if self.n == 0:
            raise ValueError("window_sums: no windows")
        if clusters is None:
            inverse, n_clusters = torch.arange(self.n), self.n
        else:
            labels = torch.as_tensor(clusters)
            if labels.shape != (self.n,) or labels.is_floating_point():
                raise ValueError(f"clusters: expected {self.n} integer labels, one per window, "
                                 f"got {tuple(labels.shape)} {labels.dtype}")
            _, inverse = torch.unique(labels, return_inverse=True)
            n_clusters = int(inverse.max()) + 1
        self.n_clusters = n_clusters
        gen = torch.Generator().manual_seed(int(seed))
        draws = torch.randint(n_clusters, (reps, n_clusters), generator=gen)
        counts = torch.zeros(reps, n_clusters, dtype=torch.float64).scatter_add_(
            1, draws, torch.ones(reps, n_clusters, dtype=torch.float64))
        self.weights = counts[:, inverse]  # [reps, windows]
        self.point = _Lazy(lambda t: t.sum(0), self._w)
        self.boot = _Lazy(lambda t: (self.weights @ t.cpu().double().reshape(self.n, -1))
                          .view(-1, *t.shape[1:]), self._w)

    def __getitem__(self, name):
        return self._w[name]

    def __iter__(self):
        return iter(self._w)

    def __len__(self):
        return len(self._w)


class _Lazy(Mapping):
    def __init__(self, fn, source):
        self._fn, self._source, self._cache = fn, source, {}

    def __getitem__(self, name):
        if name not in self._cache:
            self._cache[name] = self._fn(self._source[name].cpu().double())
        return self._cache[name]

    def __iter__(self):
        return iter(self._source)

    def __len__(self):
        return len(self._source)


def evaluate(sums: WindowSums, fn: Callable, *args, level: float = 0.95, **kwargs) -> Measured:
    """``fn(sums, *args, **kwargs)`` on all windows, and its ``level`` percentile interval
    over the bootstrap replicates of the windows.

    >>> w = {"n_high": torch.ones(4, 1, 1),
    ...      "same_sentence": torch.tensor([1., 0, 1, 1])[:, None, None]}
    >>> m = evaluate(WindowSums(w, reps=200, seed=0), same_sentence_fraction)
    >>> m.value, 0 <= m.interval[0] <= 0.75 <= m.interval[1] <= 1
    (0.75, True)
    """
    if not 0 < level < 1:
        raise ValueError(f"level: expected a probability in (0, 1), got {level!r}")
    value = float(fn(sums.point, *args, **kwargs))
    reps = fn(sums.boot, *args, **kwargs).double()
    a = (1 - level) / 2
    lo, hi = torch.quantile(reps, torch.tensor([a, 1 - a], dtype=torch.float64)).tolist()
    return Measured(value, (float(lo), float(hi)), reps)


# --------------------------------------------------------------------------- helpers


def pooled(s: Mapping, name: str, layers=None) -> torch.Tensor:
    """The sum ``name`` [..., L, H] over the heads of ``layers`` (all if None): [...].

    >>> s = {"n_high": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}  # [L, H]
    >>> pooled(s, "n_high"), pooled(s, "n_high", [1])
    (tensor(10.), tensor(7.))
    """
    t = s[name]
    if layers is not None:
        t = t[..., list(layers), :]
    return t.sum((-1, -2))


def _ratio(num, den):
    return num / den.clamp(min=1e-12)


def head_ratio(s: Mapping, num: str, den: str) -> torch.Tensor:
    """[..., L, H] ``num / den`` per head.

    >>> s = {"identical": torch.tensor([[1.0, 0.0]]),
    ...      "n_high": torch.tensor([[2.0, 0.0]])}
    >>> head_ratio(s, "identical", "n_high")  # a head without pairs gives 0
    tensor([[0.5000, 0.0000]])
    """
    return _ratio(s[num], s[den])


# --------------------------------------------------------------------------- distances


def early_uniform_distance(s: Mapping, layers) -> torch.Tensor:
    """Total variation distance between the distance distribution of the high pairs of
    ``layers`` (pooled over their heads, log2 distance bins) and that of uniformly drawn
    content pairs of the same windows: 0 when the pairs are as far apart as uniform pairs,
    1 when the two share no bin.

    >>> s = {"distance_bins": torch.tensor([[[1.0, 0.0]]]),  # [L, H, bins]
    ...      "chance_distance_bins": torch.tensor([0.5, 0.5])}
    >>> early_uniform_distance(s, [0])
    tensor(0.5000)

    References
    ----------
    Halevi et al., arXiv 2512.21956, abstract:
    long-range attention in the early layers.
    """
    h = s["distance_bins"][..., list(layers), :, :].sum((-2, -3))  # [..., D]
    q = s["chance_distance_bins"]  # [..., D]
    p = h / h.sum(-1, keepdim=True).clamp(min=1e-12)
    q = q / q.sum(-1, keepdim=True).clamp(min=1e-12)
    return 0.5 * (p - q).abs().sum(-1)


def long_share_difference(s: Mapping, a, b) -> torch.Tensor:
    """Share of high pairs more than LONG_RANGE apart in layers ``a`` minus in ``b``.

    >>> s = {"long_range": torch.tensor([[3.0], [1.0]]),
    ...      "n_high": torch.tensor([[4.0], [4.0]])}
    >>> long_share_difference(s, [0], [1])
    tensor(0.5000)

    References
    ----------
    Halevi et al., arXiv 2512.21956, abstract:
    long-range attention early, short-range later.
    """
    return (_ratio(pooled(s, "long_range", a), pooled(s, "n_high", a))
            - _ratio(pooled(s, "long_range", b), pooled(s, "n_high", b)))


def mean_distance_difference(s: Mapping, a, b) -> torch.Tensor:
    """Mean token distance of the high pairs of layers ``a`` minus that of ``b``.

    >>> s = {"distance_sum": torch.tensor([[40.0], [8.0]]),
    ...      "n_high": torch.tensor([[4.0], [4.0]])}
    >>> mean_distance_difference(s, [0], [1])
    tensor(8.)

    References
    ----------
    Halevi et al., arXiv 2512.21956, abstract:
    long-range attention early, short-range later.
    """
    return (_ratio(pooled(s, "distance_sum", a), pooled(s, "n_high", a))
            - _ratio(pooled(s, "distance_sum", b), pooled(s, "n_high", b)))


def short_share(s: Mapping, layers) -> torch.Tensor:
    """Share of the high pairs of ``layers`` at most SHORT_RANGE tokens apart.

    >>> s = {"short_range": torch.tensor([[1.0], [3.0]]),
    ...      "n_high": torch.tensor([[4.0], [4.0]])}
    >>> short_share(s, [1])
    tensor(0.7500)

    References
    ----------
    Halevi et al., arXiv 2512.21956, abstract:
    short-range attention in the later layers.
    """
    return _ratio(pooled(s, "short_range", layers), pooled(s, "n_high", layers))


def intra_sentence_over_long_range(s: Mapping, layers=None) -> torch.Tensor:
    """How much more the high pairs favour mid-range pairs inside one sentence
    (SHORT_RANGE < distance <= LONG_RANGE) than pairs across the text (distance >
    LONG_RANGE), each against uniform pairs: (mid same-sentence / its chance) over (long
    range / its chance), pooled over the heads of ``layers`` (all if None).

    >>> s = {"mid_same_sentence": torch.tensor([[4.0]]),
    ...      "chance_mid_same_sentence": torch.tensor([[1.0]]),
    ...      "long_range": torch.tensor([[2.0]]), "chance_long_range": torch.tensor([[2.0]])}
    >>> intra_sentence_over_long_range(s)
    tensor(4.)

    References
    ----------
    Halevi et al., arXiv 2512.21956, abstract:
    a preference for pairs within one sentence at the end.
    """
    mid = _ratio(pooled(s, "mid_same_sentence", layers),
                 pooled(s, "chance_mid_same_sentence", layers))
    far = _ratio(pooled(s, "long_range", layers), pooled(s, "chance_long_range", layers))
    return _ratio(mid, far)


# --------------------------------------------------------------------------- sentences


def same_sentence_fraction(s: Mapping, layers=None) -> torch.Tensor:
    """Share of the high pairs of ``layers`` (all if None) inside one sentence.

    >>> s = {"same_sentence": torch.tensor([[1.0, 2.0]]), "n_high": torch.tensor([[2.0, 2.0]])}
    >>> same_sentence_fraction(s)
    tensor(0.7500)

    References
    ----------
    Halevi et al., arXiv 2512.21956, abstract:
    a preference for pairs within one sentence.
    """
    return _ratio(pooled(s, "same_sentence", layers), pooled(s, "n_high", layers))


def same_sentence_excess(s: Mapping, layers=None) -> torch.Tensor:
    """Same-sentence share minus that of pairs drawn uniformly from the same windows.

    >>> s = {"same_sentence": torch.tensor([[3.0]]), "chance_same_sentence": torch.tensor([[1.0]]),
    ...      "n_high": torch.tensor([[4.0]])}
    >>> same_sentence_excess(s)
    tensor(0.5000)

    References
    ----------
    Halevi et al., arXiv 2512.21956, abstract:
    a preference for pairs within one sentence.
    """
    return (same_sentence_fraction(s, layers)
            - _ratio(pooled(s, "chance_same_sentence", layers), pooled(s, "n_high", layers)))


def sentence_beyond_locality(s: Mapping, layers) -> torch.Tensor:
    """Same-sentence share minus that of pairs at the same distances (locality alone
    gives 0).

    >>> s = {"same_sentence": torch.tensor([[3.0]]),
    ...      "chance_same_sentence_distance": torch.tensor([[2.0]]),
    ...      "n_high": torch.tensor([[4.0]])}
    >>> sentence_beyond_locality(s, [0])
    tensor(0.2500)

    References
    ----------
    Halevi et al., arXiv 2512.21956, abstract:
    a preference for pairs within one sentence in the final layers.
    """
    return (same_sentence_fraction(s, layers)
            - _ratio(pooled(s, "chance_same_sentence_distance", layers),
                     pooled(s, "n_high", layers)))


def final_strongest_sentence(s: Mapping, final, others) -> torch.Tensor:
    """Same-sentence share of the ``final`` layers minus the largest of the other groups'
    (``others``: a list of layer lists).

    >>> s = {"same_sentence": torch.tensor([[1.0], [2.0], [3.0]]),
    ...      "n_high": torch.full((3, 1), 4.0)}
    >>> final_strongest_sentence(s, [2], [[0], [1]])
    tensor(0.2500)

    References
    ----------
    Halevi et al., arXiv 2512.21956, abstract:
    the within-sentence preference is strongest at the end.
    """
    rest = torch.stack([same_sentence_fraction(s, g) for g in others], -1).amax(-1)
    return same_sentence_fraction(s, final) - rest


# --------------------------------------------------------------------------- attention


def separator_ratio(s: Mapping, layers, kinds) -> torch.Tensor:
    """Attention mass that content queries of ``layers`` put on the separator kinds
    ``kinds`` (indices into the statistics' separators), over uniform attention's.

    >>> s = {"separator_attention": torch.tensor([[[0.6, 0.2]]]),  # [L, H, kinds]
    ...      "chance_separator": torch.tensor([0.1, 0.1])}
    >>> separator_ratio(s, [0], [0])
    tensor(6.)

    References
    ----------
    Halevi et al., arXiv 2512.21956, abstract:
    final-layer attention on separators, suggesting segmentation.
    """
    layers, kinds = list(layers), list(kinds)
    mass = s["separator_attention"][..., layers, :, :][..., kinds].sum((-1, -2, -3))
    n_heads = s["separator_attention"].shape[-2]
    chance = s["chance_separator"][..., kinds].sum(-1) * len(layers) * n_heads
    return _ratio(mass, chance)


# --------------------------------------------------------------------------- heads


def repetition_top_fraction(s: Mapping) -> torch.Tensor:
    """The largest share, over the heads, of a head's high pairs that join identical
    tokens.

    >>> s = {"identical": torch.tensor([[1.0, 3.0]]), "n_high": torch.tensor([[4.0, 4.0]])}
    >>> repetition_top_fraction(s)
    tensor(0.7500)

    References
    ----------
    Halevi et al., arXiv 2512.21956, abstract:
    heads specialise on repetitions.
    """
    return head_ratio(s, "identical", "n_high").flatten(-2).amax(-1)


def _hub_ratio(s: Mapping) -> torch.Tensor:
    """[..., L, H] endpoints taken by each head's per-window hub token over the same count
    for uniformly drawn pairs of the same windows."""
    return _ratio(s["hub_endpoints"], s["chance_hub_endpoints"][..., None, None])


def specialised_head_share(s: Mapping, hub_min: float = HUB_MIN) -> torch.Tensor:
    """Share of the heads whose per-input hub token (the commonest endpoint token of the
    head's high pairs in a window) takes at least ``hub_min`` times the endpoints that the
    commonest token of uniformly drawn pairs takes, pooled over the windows.

    >>> s = {"hub_endpoints": torch.tensor([[6.0, 2.0]]),
    ...      "chance_hub_endpoints": torch.tensor(2.0)}
    >>> specialised_head_share(s)  # hubs at 3 and 1 times chance's
    tensor(0.5000, dtype=torch.float64)

    References
    ----------
    Halevi et al., arXiv 2512.21956, abstract:
    heads specialise on a common token with its context.
    """
    return (_hub_ratio(s) >= hub_min).double().flatten(-2).mean(-1)


def distinct_hub_share(s: Mapping) -> torch.Tensor:
    """Distinct hub tokens among a layer's heads, per head: the mean over windows (with
    pairs) and layers of (distinct hubs of the layer) / (heads). 1 when every head of a
    layer has its own token, 1 / H when all share one.

    >>> s = {"n_high": torch.ones(1, 2), "hub_distinct": torch.tensor([1.0]),
    ...      "windows_with_pairs": torch.tensor(1.0)}
    >>> distinct_hub_share(s)  # both heads of the one layer share one hub token
    tensor(0.5000)

    References
    ----------
    Halevi et al., arXiv 2512.21956, abstract:
    heads specialise on different tokens.
    """
    n_layers, n_heads = s["n_high"].shape[-2:]
    return _ratio(s["hub_distinct"].sum(-1), s["windows_with_pairs"] * n_layers * n_heads)


def _context_ratio(s: Mapping) -> torch.Tensor:
    """[..., L, H] share of the hub pairs at most SHORT_RANGE apart over uniform pairs'."""
    return _ratio(head_ratio(s, "hub_near", "hub_pairs"),
                  head_ratio(s, "chance_short_range", "n_high"))


def token_context_ratio(s: Mapping) -> torch.Tensor:
    """Pooled over all heads: the share of the pairs touching a head's hub token that lie
    within SHORT_RANGE tokens of each other, over that share for uniform pairs.

    >>> s = {"hub_near": torch.tensor([[3.0]]), "hub_pairs": torch.tensor([[4.0]]),
    ...      "chance_short_range": torch.tensor([[1.0]]), "n_high": torch.tensor([[4.0]])}
    >>> token_context_ratio(s)
    tensor(3.)

    References
    ----------
    Halevi et al., arXiv 2512.21956, abstract:
    heads specialise on a common token with its context.
    """
    near = _ratio(s["hub_near"].sum((-1, -2)), s["hub_pairs"].sum((-1, -2)))
    chance = _ratio(s["chance_short_range"].sum((-1, -2)), s["n_high"].sum((-1, -2)))
    return _ratio(near, chance)


def distinct_features_share(s: Mapping, rep_min: float = REP_MIN,
                            context_min: float = CONTEXT_MIN) -> torch.Tensor:
    """Share of the layers that hold both a repetition head (identical-token pairs at
    least ``rep_min`` times chance) and a context head (not a repetition head; its hub's
    pairs within SHORT_RANGE at least ``context_min`` times as often as uniform pairs).

    >>> s = {"identical": torch.tensor([[10.0, 0.0], [0.0, 0.0]]),
    ...      "chance_identical": torch.ones(2, 2),
    ...      "hub_near": torch.tensor([[0.0, 3.0], [0.0, 3.0]]),
    ...      "hub_pairs": torch.full((2, 2), 4.0),
    ...      "chance_short_range": torch.ones(2, 2), "n_high": torch.full((2, 2), 4.0)}
    >>> distinct_features_share(s)  # only layer 0 has a repetition head and a context head
    tensor(0.5000, dtype=torch.float64)

    References
    ----------
    Halevi et al., arXiv 2512.21956, abstract:
    heads specialise on repetitions or a common token with its context.
    """
    rep = head_ratio(s, "identical", "chance_identical") >= rep_min
    ctx = ~rep & (_context_ratio(s) >= context_min)
    both = rep.any(-1) & ctx.any(-1)  # [..., L]
    return both.double().mean(-1)


def identical_far_ratio(s: Mapping, layer: int, head: int) -> torch.Tensor:
    """Head (``layer``, ``head``)'s high pairs of identical tokens more than LONG_RANGE
    apart, over what uniform pairs of the same windows give.

    >>> s = {"identical_long_range": torch.tensor([[0.0, 6.0]]),
    ...      "chance_identical_long_range": torch.tensor([[1.0, 2.0]])}
    >>> identical_far_ratio(s, 0, 1)
    tensor(3.)

    References
    ----------
    Halevi et al., arXiv 2512.21956, abstract:
    heads specialise on repetitions; layer 11, head 8 (secondary summary).
    """
    return _ratio(s["identical_long_range"][..., layer, head],
                  s["chance_identical_long_range"][..., layer, head])


def unrelated_share(s: Mapping, layers=None) -> torch.Tensor:
    """Share of the high pairs of ``layers`` (all if None) with none of the relations the
    chapter measures: in two sentences, two different tokens, more than SHORT_RANGE
    apart, outside the high-attention region.

    >>> s = {"unrelated": torch.tensor([[1.0, 0.0]]), "n_high": torch.tensor([[2.0, 2.0]])}
    >>> unrelated_share(s)
    tensor(0.2500)
    """
    return _ratio(pooled(s, "unrelated", layers), pooled(s, "n_high", layers))


#: The head the secondary summary names, "layer 11, head 8", read as numbered from 1.
PAPER_HEAD = (10, 7)


def paper_measurements(sums: WindowSums, groups: Mapping, separator_kinds,
                       level: float = 0.95) -> dict[str, Measured]:
    """Every paper claim's measurement on one model's window sums: claim id -> Measured.

    ``groups``: the layer groups, ``{"early": [...], "middle": [...], "final": [...]}``
    (0-based); ``separator_kinds``: the indices of '.' and ',' among the statistics'
    separators. The layer 11, head 8 claim is measured only for a model of 12 layers of
    12 heads. The chapter records these for its headline model and judges them for the
    model beside it, with the same functions and arguments.

    >>> from companion.context_similarity import BatchResult, SimilarityStats
    >>> g = torch.Generator().manual_seed(0)
    >>> z = torch.randn(2, 2, 2, 6, 4, generator=g, dtype=torch.float64)  # [B, L, H, T, d]
    >>> attn = torch.softmax(torch.randn(2, 2, 2, 6, 6, generator=g, dtype=torch.float64), -1)
    >>> ids = torch.tensor([[1, 7, 8, 5, 7, 2]] * 2)
    >>> sent = torch.tensor([[-1, 0, 0, 0, 1, -1]] * 2)
    >>> result = BatchResult(z, attn, ids, sent, torch.ones(2, 6, dtype=torch.long))
    >>> stats = SimilarityStats(n_layers=2, n_heads=2, length=6, vocab_size=10,
    ...                         separators={".": 5, ",": 6}, per_window=True).update(result)
    >>> groups = {"early": [0], "middle": [0], "final": [1]}
    >>> m = paper_measurements(WindowSums(stats.window_sums(), reps=50), groups, [0, 1])
    >>> len(m), m["context-similarity-same-sentence-fraction"].value  # no 12 x 12 head claim
    (16, 0.75)

    References
    ----------
    Halevi et al., arXiv 2512.21956, abstract (every number of the statements from the
    secondary summary).
    """
    for g in ("early", "middle", "final"):
        if not groups.get(g):
            raise ValueError(f"groups: expected a non-empty list of layers for {g!r}")
    g = groups

    def ev(fn, *args):
        return evaluate(sums, fn, *args, level=level)

    p = "context-similarity-"
    out = {
        p + "early-uniform": ev(early_uniform_distance, g["early"]),
        p + "early-long-range": ev(long_share_difference, g["early"], g["middle"]),
        p + "middle-short-range": ev(mean_distance_difference, g["early"], g["middle"]),
        p + "middle-short-range-dominance": ev(short_share, g["middle"]),
        p + "final-short-range-dominance": ev(short_share, g["final"]),
        p + "same-sentence-fraction": ev(same_sentence_fraction),
        p + "same-sentence-above-chance": ev(same_sentence_excess),
        p + "final-sentence-beyond-locality": ev(sentence_beyond_locality, g["final"]),
        p + "final-strongest-sentence": ev(final_strongest_sentence, g["final"],
                                           [g["early"], g["middle"]]),
        p + "intra-sentence-over-long-range": ev(intra_sentence_over_long_range),
        p + "final-attend-separators": ev(separator_ratio, g["final"], separator_kinds),
        p + "repeated-token-heads": ev(repetition_top_fraction),
        p + "heads-specialise": ev(specialised_head_share),
        p + "heads-distinct-tokens": ev(distinct_hub_share),
        p + "heads-distinct-features": ev(distinct_features_share),
        p + "token-with-context": ev(token_context_ratio),
    }
    if tuple(sums["n_high"].shape[-2:]) == (12, 12):
        out[p + "identical-across-window"] = ev(identical_far_ratio, *PAPER_HEAD)
    return out
