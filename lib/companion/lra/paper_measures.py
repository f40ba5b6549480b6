"""The quantities the SBM-Transformer chapter's paper claims are judged on.

Each function computes one measurement of a statement of Cho et al. (NeurIPS 2022,
arXiv 2210.15541) with its interval, from the chapter's trained models or from an SBM
head itself. The chapter and its falsifier tests (``tests/test_falsifiers_sbm_transformer.py``)
call the same functions, so a perturbation of the measured object (dense attention in
place of the sampled graph, embeddings frozen, the costly path of the public code) is
judged exactly as the chapter's measurement is.

Intervals resample what the statement ranges over: training seeds and test inputs (the
two-level bootstrap of :func:`companion.lra.experiments.bootstrap`), head initialisations
and sampled graphs, or timing rounds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from companion._validate import check_int, check_number
from companion.lra.experiments import bootstrap, loglog_slope, model_flops, spearman

__all__ = ["LRA_LENGTHS", "PAPER_MODEL", "SAMPLERS", "AccuracyComparison",
           "compare_accuracy", "mean_density", "density_change",
           "density_difficulty_correlation", "inference_flops", "inference_memory",
           "cost_ratio_at_length", "density_extremes",
           "cost_against_edges"]

# sequence lengths of the LRA tasks in the authors' lra_config (ListOps 2000 tokens,
# Pathfinder-32 1024 pixels)
LRA_LENGTHS = {"ListOps": 2000, "Pathfinder": 1024}
# the model of the authors' LRA config: 2 layers, 2 heads of 32, width 64, FFN 128, k = 128
PAPER_MODEL = dict(dim=64, heads=2, head_dim=32, ffn=128, num_layers=2, clusters=128)
# bytes an inference forward of companion.sbm holds per sampled edge: the sampled edge
# list (group, query, key: three int64), its CSR row and column (int32 each, see
# companion.sbm.graph_attention.EdgeGraph), and a float32 score and weight per edge
EDGE_BYTES = 3 * 8 + 2 * 4 + 2 * 4
# how an SBM head's graph is sampled: "fastrg" is the paper's algorithm (Rohe et al.'s
# fastRG: column sums of the memberships and S~ = diag(colsum Qhat) S diag(colsum Khat),
# then O(1) index work per edge); "query-major" is companion.sbm's sampler, which also
# forms Qhat S (n k^2 multiply-adds per head) to draw the edges in query order
SAMPLERS = ("fastrg", "query-major")


def _seeds_items(name: str, x) -> np.ndarray:
    a = np.asarray(x, dtype=float)
    if a.ndim != 2 or a.shape[0] < 1 or a.shape[1] < 1:
        raise ValueError(f"{name}: expected a [seeds, test items] array, got shape {a.shape}")
    return a


@dataclass(frozen=True)
class AccuracyComparison:
    """SBM minus dense test accuracy, and whether it can be judged at this size.

    ``comparable`` is False when the dense model's accuracy interval does not clear its
    ``floor`` by ``margin``: the majority class, or a model with nearly no attention
    where one was trained. Then attention has not been shown to matter for the task at
    this size, and the difference says nothing about it; ``reason`` says so with the
    numbers.

    >>> c = compare_accuracy(np.tile([0.0, 1.0], (2, 20)), np.ones((2, 40)), 0.5, reps=50)
    >>> isinstance(c, AccuracyComparison), c.dense, c.comparable
    (True, 1.0, True)
    """

    difference: float
    interval: tuple[float, float]
    sbm: float
    dense: float
    dense_interval: tuple[float, float]
    majority: float
    margin: float
    floor: float
    floor_name: str
    comparable: bool
    reason: str


def compare_accuracy(sbm_correct, dense_correct, majority: float, *, margin: float = 0.10,
                     no_attention: float | None = None, reps: int = 1000,
                     seed: int = 0) -> AccuracyComparison:
    """SBM minus dense accuracy over training seeds and test items, gated by learning.

    Parameters
    ----------
    sbm_correct, dense_correct : ``[seeds, test items]`` 0/1 arrays (the same items).
    majority : accuracy of always answering the test split's most frequent class.
    margin : how far above its floor (``majority``, or ``no_attention`` when higher) the
        dense model's whole interval must lie for the comparison to say anything about
        the attention (ours: the 10 points of the chapter's above-chance checks).
    no_attention : optional accuracy of a model with nearly no attention (an SBM model
        trained under a large density penalty): what the task gives without attention.
    reps, seed : bootstrap replicates and seed (seeds and items resampled, paired).

    >>> right = np.ones((2, 40)); half = np.tile([0.0, 1.0], (2, 20))
    >>> c = compare_accuracy(half, right, 0.5, reps=50)
    >>> round(c.difference, 3), c.comparable
    (-0.5, True)
    >>> compare_accuracy(half, half, 0.5, reps=50).comparable
    False
    """
    s = _seeds_items("sbm_correct", sbm_correct)
    d = _seeds_items("dense_correct", dense_correct)
    if s.shape[1] != d.shape[1]:
        raise ValueError(f"sbm_correct, dense_correct: expected the same test items, got "
                         f"{s.shape[1]} and {d.shape[1]}")
    majority = check_number("majority", majority, minimum=0.0, maximum=1.0)
    margin = check_number("margin", margin, minimum=0.0, maximum=1.0)
    floor, floor_name = majority, "the majority class"
    if no_attention is not None:
        no_attention = check_number("no_attention", no_attention, minimum=0.0, maximum=1.0)
        if no_attention > majority:
            floor, floor_name = no_attention, "a model with nearly no attention"
    if s.shape[0] != d.shape[0]:  # unpaired seeds: resample each side's items alone
        diff_ci = _difference_interval(s, d, reps, seed)
    else:
        diff_ci = bootstrap(lambda a: a["s"].mean() - a["d"].mean(), {"s": s, "d": d},
                            reps=reps, seed=seed)
    dense_ci = bootstrap(lambda a: a["d"].mean(), {"d": d}, reps=reps, seed=seed)
    comparable = dense_ci[0] >= floor + margin
    reason = "" if comparable else (
        f"the dense model's accuracy {d.mean():.3f} (95 % interval [{dense_ci[0]:.3f}, "
        f"{dense_ci[1]:.3f}]) does not clear {floor_name} ({floor:.3f}) by {margin:.2f}: "
        f"at this size attention has not been shown to matter for the task, so the two "
        f"models' difference says nothing about it")
    return AccuracyComparison(float(s.mean() - d.mean()), diff_ci, float(s.mean()),
                              float(d.mean()), dense_ci, majority, margin, floor,
                              floor_name, comparable, reason)


def _difference_interval(s, d, reps, seed):
    rng = np.random.default_rng(seed)
    vals = [s[:, rng.integers(0, s.shape[1], s.shape[1])].mean()
            - d[:, rng.integers(0, d.shape[1], d.shape[1])].mean() for _ in range(reps)]
    return float(np.quantile(vals, 0.025)), float(np.quantile(vals, 0.975))


def mean_density(density, *, reps: int = 1000, seed: int = 0):
    """Mean test density (``[seeds, test inputs]``) and its two-level bootstrap interval.

    >>> mean_density(np.full((2, 5), 0.25), reps=10)
    (0.25, (0.25, 0.25))
    """
    x = _seeds_items("density", density)
    return float(x.mean()), bootstrap(lambda a: a["x"].mean(), {"x": x}, reps=reps, seed=seed)


def density_change(low_lambda, high_lambda, *, reps: int = 1000, seed: int = 0):
    """Mean test density at the larger λ minus at the smaller one, with an interval
    over the test inputs (paired: the same inputs), ``[seeds, inputs]`` each.

    >>> density_change(np.full((1, 4), 0.3), np.full((1, 4), 0.1), reps=10)[0]
    -0.2
    """
    lo = _seeds_items("low_lambda", low_lambda)
    hi = _seeds_items("high_lambda", high_lambda)
    if lo.shape != hi.shape:
        raise ValueError(f"low_lambda, high_lambda: expected one shape, got {lo.shape} and "
                         f"{hi.shape}")
    stat = lambda a: a["hi"].mean() - a["lo"].mean()  # noqa: E731
    arrays = {"lo": lo, "hi": hi}
    return round(float(stat(arrays)), 12), bootstrap(stat, arrays, reps=reps, seed=seed)


def density_difficulty_correlation(density, difficulty, *, reps: int = 1000, seed: int = 0):
    """Spearman correlation of an input's mean SBM density with its difficulty (both
    averaged over seeds first), and a bootstrap interval over seeds and inputs.

    ``density`` ``[SBM seeds, inputs]``; ``difficulty`` ``[dense seeds, inputs]`` (e.g. the
    dense models' NLL of the true label), resampled with the same inputs.

    >>> density = np.array([[0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.5]])
    >>> difficulty = np.array([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]])
    >>> rho, (lo, hi) = density_difficulty_correlation(density, difficulty, reps=20)
    >>> rho
    1.0

    References
    ----------
    Cho et al., arXiv 2210.15541: attention with data-adaptive sparsity, each head
    choosing its edges per input (abstract).
    """
    x = _seeds_items("density", density)
    h = _seeds_items("difficulty", difficulty)
    if x.shape[1] != h.shape[1]:
        raise ValueError(f"density, difficulty: expected the same inputs, got {x.shape[1]} "
                         f"and {h.shape[1]}")
    rho = spearman(x.mean(0), h.mean(0))
    if x.shape == h.shape:
        ci = bootstrap(lambda a: spearman(a["x"].mean(0), a["h"].mean(0)),
                       {"x": x, "h": h}, reps=reps, seed=seed)
    else:
        xm, hm = x.mean(0)[None], h.mean(0)[None]
        ci = bootstrap(lambda a: spearman(a["x"][0], a["h"][0]), {"x": xm, "h": hm},
                       reps=reps, seed=seed)
    return rho, ci


def inference_flops(n, density, *, attention: str, sampler: str = "fastrg",
                    classes: int = 10, **model):
    """Inference FLOPs of one input of ``n`` tokens: :func:`companion.lra.experiments.
    model_flops` (which counts ``Qhat S``, ``2 n k^2`` per SBM head, as companion.sbm's
    sampler forms it), with ``sampler="fastrg"`` (default) counting the paper's fastRG
    instead: the memberships' column sums (``2 n k``) and ``S~`` (``2 k^2``) in place of
    ``Qhat S``. ``model`` overrides :data:`PAPER_MODEL`.

    >>> a = inference_flops(1024, 0.1, attention="sbm", sampler="query-major")
    >>> b = inference_flops(1024, 0.1, attention="sbm")
    >>> int(a - b) == 2 * 2 * (2 * 1024 * 128 ** 2 - 2 * 1024 * 128 - 2 * 128 ** 2)
    True
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler: expected one of {SAMPLERS}, got {sampler!r}")
    kw = {**PAPER_MODEL, **model}
    flops = model_flops(n, density, attention=attention, classes=classes, **kw)
    if attention == "sbm" and sampler == "fastrg":
        n_arr, k = np.asarray(n, dtype=float), kw["clusters"]
        flops = flops - kw["num_layers"] * kw["heads"] * (
            2 * n_arr * k ** 2 - 2 * n_arr * k - 2 * k ** 2)
    return float(flops) if np.ndim(flops) == 0 else flops


def inference_memory(n, density, *, attention: str, dim: int = 64, heads: int = 2,
                     head_dim: int = 32, ffn: int = 128, clusters: int = 128,
                     float_bytes: int = 4, edge_bytes: int = EDGE_BYTES,
                     sampler: str = "fastrg", num_layers: int = 2):
    """Peak bytes of live tensors in an inference forward of one input of ``n`` tokens.

    The layers are alike, so the peak is one layer's larger stage: attention or FFN.
    Both stages hold the block's input and its LayerNorm (``2 n dim`` floats). Attention
    adds queries, keys, values and the heads' outputs (``4 n H d``) and, per head,

    - dense (the plain softmax Transformer the paper compares with): the score and
      weight matrices, ``2 n^2`` floats;
    - SBM: the MLP's hidden and output for queries and keys (``4 n d``), the
      memberships (``2 n k``; ``Qhat S`` adds ``n k`` with ``sampler="query-major"``),
      ``S`` (``k^2``), and ``edge_bytes`` per sampled edge on ``density n^2`` edges (the
      edge list as companion.sbm holds it).

    The FFN stage holds its hidden layer before and after the GELU (``2 n ffn``).
    Numbers or numpy arrays (``n`` and ``density`` broadcast); ``density`` is ignored
    for dense attention; ``num_layers`` does not change a peak (the layers run in turn).

    >>> inference_memory(100, 1.0, attention="dense", dim=4, heads=1, head_dim=4, ffn=8)
    89600.0
    """
    if attention not in ("dense", "sbm"):
        raise ValueError(f"attention: expected 'dense' or 'sbm', got {attention!r}")
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler: expected one of {SAMPLERS}, got {sampler!r}")
    n = np.asarray(n, dtype=float)
    floats = 2 * n * dim + 4 * n * heads * head_dim
    extra = 0.0
    if attention == "dense":
        floats = floats + heads * 2 * n * n
    else:
        rho = np.asarray(density, dtype=float)
        per_node = 3 if sampler == "query-major" else 2
        floats = floats + heads * (4 * n * head_dim + per_node * n * clusters + clusters ** 2)
        extra = heads * rho * n * n * edge_bytes
    attention_stage = floats * float_bytes + extra
    ffn_stage = (2 * n * dim + 2 * n * ffn) * float_bytes
    peak = np.maximum(attention_stage, ffn_stage)
    return float(peak) if np.ndim(peak) == 0 else peak


def cost_ratio_at_length(density, *, length: int, measure: str, classes: int,
                         reps: int = 1000, seed: int = 0, sampler: str = "fastrg",
                         **model):
    """SBM over dense cost of inference at sequence length ``length``, at the densities
    the trained SBM heads reach (``[seeds, test inputs]``), with an interval over seeds
    and inputs.

    ``measure`` "flops" (:func:`inference_flops`) or "memory" (:func:`inference_memory`),
    for the SBM heads' ``sampler`` (default: the paper's fastRG); both models see
    ``length`` tokens per input; ``model`` overrides :data:`PAPER_MODEL`. The ratio is of
    sums over the inputs (a batch's cost).

    >>> r, ci = cost_ratio_at_length(np.full((1, 3), 1.0), length=1024, measure="flops",
    ...                              classes=2, reps=10)
    >>> r > 1  # at full density SBM only adds its sampling work
    True
    """
    x = _seeds_items("density", density)
    length = check_int("length", length, minimum=1)
    if measure not in ("flops", "memory"):
        raise ValueError(f"measure: expected 'flops' or 'memory', got {measure!r}")
    kw = {**PAPER_MODEL, **model, "sampler": sampler}
    if measure == "flops":
        cost = lambda rho, att: inference_flops(length, rho, attention=att,  # noqa: E731
                                                classes=classes, **kw)
    else:
        cost = lambda rho, att: inference_memory(length, rho, attention=att,  # noqa: E731
                                                 **kw)
    dense = cost(1.0, "dense")

    def stat(a):
        return float(np.sum(cost(a["x"], "sbm")) / (dense * a["x"].size))

    return stat({"x": x}), bootstrap(stat, {"x": x}, reps=reps, seed=seed)


def density_extremes(*, head_dim: int = 32, clusters: int = 16, n: int = 64,
                     inits: int = 4, draws: int = 8, steps: int = 150, lr: float = 0.1,
                     frozen: bool = False, seed: int = 0, reps: int = 1000):
    """How far an SBM head's density can go, from no attention to full attention.

    For each of ``inits`` freshly initialised heads (:class:`companion.sbm.SBMAttention`,
    one head), the node representations of ``n`` queries and keys and the head's cluster
    embeddings ``C`` are moved by gradient steps (Adam, ``steps`` of ``lr``) toward the
    densest and toward the sparsest expected graph (mean of ``P = Qhat S Khat^T``); then
    ``draws`` graphs are sampled from each with fastRG (duplicates kept, so the density
    ``E / (n m)`` has mean ``mean P``). With ``frozen`` the embeddings stay where the
    initialisation put them (no step is taken): the falsifier of the statement that the
    density follows the embeddings.

    Returns
    -------
    dict with "densest" and "sparsest" (``[inits, draws]`` sampled densities), "span"
    (mean densest minus mean sparsest) and "interval" (its bootstrap interval over
    initialisations and draws).

    >>> r = density_extremes(head_dim=4, clusters=2, n=8, inits=2, draws=2, steps=20, reps=20)
    >>> r["densest"].shape, r["span"] > 0.5
    ((2, 2), True)
    >>> density_extremes(head_dim=4, clusters=2, n=8, inits=2, draws=2, frozen=True,
    ...                  reps=20)["span"] < 0.5
    True

    References
    ----------
    Cho et al., arXiv 2210.15541: data-adaptive sparsity: a head's density follows its
    embeddings, from sparse to full attention (abstract).
    """
    from companion.sbm import SBMAttention, fastrg_sample, sbm_parameters

    for name, v in (("head_dim", head_dim), ("clusters", clusters), ("n", n),
                    ("inits", inits), ("draws", draws)):
        check_int(name, v, minimum=1)
    check_int("steps", steps, minimum=0)
    out = {"densest": np.empty((inits, draws)), "sparsest": np.empty((inits, draws))}
    for i in range(inits):
        torch.manual_seed(seed * 1000 + i)
        for target, sign in (("densest", -1.0), ("sparsest", 1.0)):
            head = SBMAttention(head_dim, num_heads=1, num_clusters=clusters)
            q = torch.randn(n, head_dim, requires_grad=True)
            k = torch.randn(n, head_dim, requires_grad=True)
            c = head.cluster_embeddings.detach()[0].clone().requires_grad_(True)
            opt = torch.optim.Adam([q, k, c], lr=lr)
            for _ in range(0 if frozen else steps):
                qm, s, km = sbm_parameters(q, k, c, head.mlp)
                mean_p = (qm.sum(0) @ s @ km.sum(0)) / (n * n)
                opt.zero_grad()
                (sign * mean_p).backward()
                opt.step()
            with torch.no_grad():
                qm, s, km = sbm_parameters(q, k, c, head.mlp)
                g = torch.Generator().manual_seed(seed * 1000 + i)
                for r in range(draws):
                    edges = fastrg_sample(qm, s, km, g)
                    out[target][i, r] = edges[0].numel() / (n * n)
    stat = lambda a: a["hi"].mean() - a["lo"].mean()  # noqa: E731
    arrays = {"hi": out["densest"], "lo": out["sparsest"]}
    out["span"] = float(stat(arrays))
    out["interval"] = bootstrap(stat, arrays, reps=reps, seed=seed)
    return out


def cost_against_edges(n: int, densities, *, repeats: int = 3, path: str = "edges",
                       seed: int = 0, reps: int = 1000, device="cpu", tuning=None,
                       heads: int = 2, head_dim: int = 32, timer=None):
    """Time of one SBM attention layer (sampling, forward, backward) against its edges.

    At fixed length ``n``, constant memberships ``sqrt(p)`` and ``S = 1/16`` give an
    expected density ``p`` for each ``p`` of ``densities``; the layer is timed
    ``repeats`` times per density, in rounds (one call at every density per round), and
    the log-log slope of time against edges is fitted
    (:func:`companion.lra.experiments.loglog_slope`, rounds resampled).

    ``path`` "edges": fastRG and attention over the edge list (``companion.sbm``), the
    paper's linear-cost path; "dense": every pair's count drawn from the ``n x m``
    matrix and attention computed densely under the mask (what the public code's
    default path does, ``O(n^2)`` whatever the edges).

    Returns
    -------
    dict: "edges" (mean edges per head at each density), "times" (``[densities,
    repeats]`` seconds), "slope", "interval".

    >>> r = cost_against_edges(32, [0.1, 0.4], repeats=2, reps=20, head_dim=4)
    >>> r["times"].shape, bool(r["edges"][1] > r["edges"][0])
    ((2, 2), True)

    References
    ----------
    Cho et al., arXiv 2210.15541: a cost linear in the number of edges (abstract).
    """
    from companion.sbm import edge_attention, fastrg_sample, poisson_pair_counts
    from companion.sbm.reference import dense_masked_attention
    from companion.timing import call_times

    n = check_int("n", n, minimum=2)
    densities = [check_number("densities", p, minimum=0.0, maximum=1.0) for p in densities]
    if len(densities) < 2:
        raise ValueError("densities: expected at least two densities to fit a slope")
    if path not in ("edges", "dense"):
        raise ValueError(f"path: expected 'edges' or 'dense', got {path!r}")
    device = torch.device(device)
    q, k, v = (torch.randn(1, heads, n, head_dim, device=device, requires_grad=True)
               for _ in range(3))
    s_blocks = torch.full((heads, 4, 4), 1 / 16, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    members = [torch.full((1, heads, n, 4), math.sqrt(p), device=device) for p in densities]
    kwargs = {} if tuning is None else {"tuning": tuning}
    counts = [[] for _ in densities]

    def step(i):
        if path == "edges":
            edges = fastrg_sample(members[i], s_blocks, members[i], gen, **kwargs)
            edge_attention(q, k, v, edges).sum().backward()
            return edges[0].numel() / heads
        a = poisson_pair_counts(members[i], s_blocks, members[i], gen)
        dense_masked_attention(q, k, v, a > 0).sum().backward()
        return float(a.sum()) / heads

    for i in range(len(densities)):  # warm-up, untimed
        step(i)
    times = [[] for _ in densities]
    for _ in range(check_int("repeats", repeats, minimum=2)):
        for i in range(len(densities)):
            times[i] += call_times(lambda i=i: counts[i].append(step(i)), repeats=1,
                                   warmup=0, cuda_sync=device.type == "cuda")
    edges = np.array([np.mean(c) for c in counts])
    slope, interval = loglog_slope(edges, times, reps=reps, seed=seed, paired=True)
    return {"edges": edges, "times": np.array(times), "slope": slope, "interval": interval}
