"""Tests of companion.sbm (fastrg, graph_attention, layer) against independent references:
closed forms (E[A] = Qhat S Khat^T, the STE gradient), dense float64 softmax attention,
torch SDPA, the dense masked formulation, and torch.autograd.gradcheck.

Every test takes a ``device``; CUDA variants are skipped without a GPU
(benchmarks/gpu_check_sbm.py runs them on a lent GPU).
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from companion.sbm import (
    FastRGTuning,
    SBMAttention,
    dense_masked_attention,
    density_regularizer,
    edge_attention,
    edge_probabilities,
    fastrg_sample,
    poisson_pair_counts,
    sbm_parameters,
    use_pair_grid,
)

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]
F64 = torch.float64


def _random_sbm(n, m, k, *, heads=None, seed=0, device="cpu", scale=1.0):
    g = torch.Generator().manual_seed(seed)
    lead = () if heads is None else (1, heads)
    qm = torch.rand(*lead, n, k, generator=g, dtype=F64) * scale
    km = torch.rand(*lead, m, k, generator=g, dtype=F64)
    s_shape = (k, k) if heads is None else (heads, k, k)
    s = torch.softmax(torch.randn(*s_shape[:-2], k * k, generator=g, dtype=F64), -1).reshape(
        s_shape
    )
    return qm.to(device), s.to(device), km.to(device)


def _complete_graph(groups, n, m, device):
    g, i, j = torch.meshgrid(
        torch.arange(groups, device=device),
        torch.arange(n, device=device),
        torch.arange(m, device=device),
        indexing="ij",
    )
    return g.reshape(-1), i.reshape(-1), j.reshape(-1)


def _dense_count(edges, groups, n, m):
    g, i, j = edges
    flat = (g * n + i) * m + j
    return torch.bincount(flat, minlength=groups * n * m).reshape(groups, n, m)


# ---------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------
def test_sbm_parameters_closed_form():
    torch.manual_seed(0)
    B, H, n, m, d, k = 2, 3, 7, 5, 4, 6
    q, kk = torch.randn(B, H, n, d, dtype=F64), torch.randn(B, H, m, d, dtype=F64)
    c = torch.randn(H, k, d, dtype=F64)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(d, d), torch.nn.ReLU(), torch.nn.Linear(d, d)
    ).double()
    qm, s, km = sbm_parameters(q, kk, c, mlp)
    assert qm.shape == (B, H, n, k) and km.shape == (B, H, m, k) and s.shape == (H, k, k)
    for h in range(H):
        gram = c[h] @ c[h].T
        expect = torch.exp(gram) / torch.exp(gram).sum()
        torch.testing.assert_close(s[h], expect)
        torch.testing.assert_close(qm[1, h], 1 / (1 + torch.exp(-(mlp(q[1, h]) @ c[h].T))))
    p = edge_probabilities(qm, s, km)
    assert p.shape == (B, H, n, m)
    torch.testing.assert_close(p, torch.einsum("zhia,hac,zhjc->zhij", qm, s, km))
    assert float(p.detach().min()) >= 0 and float(p.detach().max()) <= 1


# ---------------------------------------------------------------------------------------
# fastRG sampler
# ---------------------------------------------------------------------------------------
# the sampler's ways to the same law: fastRG's (query, key cluster) cells with either key
# draw, or one count per (query, key) pair
KEY_DRAWS = ["rejection", "search", "pairs"]
# numpy uniforms with Poisson counts by inversion, numpy uniforms with torch.poisson (the
# graphs of the first implementation), torch's generator throughout
CPU_UNIFORMS = ["numpy", "numpy+torch.poisson", "torch"]
SIGMA = 5.5  # Monte Carlo bound in standard errors: a false alarm is below 1e-6 per test


def _issue_sbm(n, m, k, *, groups, seed, p_max=None, dtype=F64, device="cpu"):
    """The setting of issue 11: memberships uniform in [0.05, 0.95], S the softmax of
    C C^T over all k^2 entries (scaled so that max P = ``p_max`` if given).
    Returns ``[1, groups, ., .]`` memberships, ``[groups, k, k]`` S, all rounded to
    ``dtype``, and the dense ``P`` ``[groups, n, m]`` in float64 from those rounded
    values (an einsum, not the sampler's GEMM)."""
    g = torch.Generator().manual_seed(seed)
    qm = 0.05 + 0.9 * torch.rand(1, groups, n, k, generator=g, dtype=F64)
    km = 0.05 + 0.9 * torch.rand(1, groups, m, k, generator=g, dtype=F64)
    c = torch.randn(groups, k, 4, generator=g, dtype=F64)
    s = torch.softmax((c @ c.transpose(1, 2)).flatten(1), -1).reshape(groups, k, k)
    if p_max is not None:
        s *= p_max / float(torch.einsum("gia,gab,gjb->gij", qm[0], s, km[0]).max())
    qm, s, km = (t.to(dtype) for t in (qm, s, km))
    p = torch.einsum("gia,gab,gjb->gij", qm[0].to(F64), s.to(F64), km[0].to(F64))
    return qm.to(device), s.to(device), km.to(device), p


def _draw_counts(qm, s, km, reps, seed, **kwargs):
    """Counts ``[reps, groups, n, m]`` (float64) of ``reps`` independent graphs drawn in
    one call (the draws are the batch dimension), and the edges."""
    _, groups, n, kc = qm.shape
    m = km.shape[2]
    inputs = [t.clone() for t in (qm, s, km)]
    gen = torch.Generator(device=qm.device).manual_seed(seed)
    edges = fastrg_sample(
        qm.expand(reps, groups, n, kc), s, km.expand(reps, groups, m, kc), gen, **kwargs
    )
    for before, after in zip(inputs, (qm, s, km)):  # the sampler only reads its inputs
        assert torch.equal(before, after)
    counts = _dense_count(edges, reps * groups, n, m).reshape(reps, groups, n, m)
    return counts.to(F64), edges


def _tuning(key_draw, cpu_uniforms, device, **sizes):
    if torch.device(device).type == "cuda" and cpu_uniforms != "torch":
        pytest.skip("numpy uniforms are a CPU path")
    grid = {"cell_grid": "keys"} if key_draw == "pairs" else {"cell_grid": "clusters",
                                                               "key_draw": key_draw}
    source = {"cpu_uniforms": cpu_uniforms.split("+")[0],
              "cpu_poisson": "torch" if cpu_uniforms.endswith("torch.poisson") else "inversion"}
    return FastRGTuning(**grid, **source, **sizes)


@pytest.mark.parametrize(
    "case",
    [
        # n, m, k, groups, max P (None: S sums to one), reps
        pytest.param((6, 5, 3, 2, None, 8000), id="tiny"),
        pytest.param((1, 1, 1, 1, 1.7, 8000), id="1x1-P>1"),
        pytest.param((6, 5, 3, 1, 3.0, 3000), id="tiny-P>1"),
    ],
)
@pytest.mark.parametrize("cpu_uniforms", CPU_UNIFORMS)
@pytest.mark.parametrize("key_draw", KEY_DRAWS)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("device", DEVICES)
def test_fastrg_keep_counts_have_mean_P_per_pair(device, dtype, key_draw, cpu_uniforms, case):
    """Monte Carlo: with duplicates="keep" every pair's count is Poisson(P_ij), so its
    mean over ``reps`` draws is P_ij within SIGMA standard errors sqrt(P_ij / reps), per
    pair and in total, for both dtypes, both key-draw paths, both CPU uniform sources,
    one to two groups with different parameters, and P_ij above 1."""
    n, m, k, groups, p_max, reps = case
    tuning = _tuning(key_draw, cpu_uniforms, device)
    qm, s, km, p = _issue_sbm(n, m, k, groups=groups, seed=1, p_max=p_max, dtype=dtype,
                              device=device)
    if p_max is not None:
        assert float(p.max()) > 1.5  # the docstring's "any nonnegative S"
    counts, edges = _draw_counts(qm, s, km, reps, seed=2, tuning=tuning)
    p = p.to(device)
    z = (counts.mean(0) - p) / (p / reps).sqrt()
    assert float(z.abs().max()) < SIGMA, float(z.abs().max())
    total = p.sum((1, 2))
    z_total = (counts.sum((2, 3)).mean(0) - total) / (total / reps).sqrt()
    assert float(z_total.abs().max()) < SIGMA, z_total
    row = edges[0] * n + edges[1]  # sorted by (group, query): the CSR order, no sort
    assert bool((row[1:] >= row[:-1]).all())


@pytest.mark.parametrize("cpu_uniforms", CPU_UNIFORMS)
@pytest.mark.parametrize("key_draw", KEY_DRAWS)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_fastrg_large_n_counts_fit_poisson_P(dtype, key_draw, cpu_uniforms):
    """Large n (256 x 193 pairs, 16 clusters): the per-pair totals over ``reps`` draws
    are Poisson(reps P_ij), so the chi-square statistic sum (X - reps P)^2 / (reps P)
    has mean N (pairs) and variance sum (2 + 1 / (reps P)); it and the total edge count
    stay within SIGMA standard deviations.  A per-pair bias of 1% (the defect of issue
    11 was 5%) moves the statistic by about 0.01^2 reps P N / sqrt(2 N) = 14 sigma."""
    n, m, k, reps = 256, 193, 16, 48
    tuning = _tuning(key_draw, cpu_uniforms, "cpu")
    qm, s, km, p = _issue_sbm(n, m, k, groups=1, seed=3, dtype=dtype)
    counts, _ = _draw_counts(qm, s, km, reps, seed=4, tuning=tuning)
    lam = reps * p[0]
    # the moments are exact for any rates (some lam here are below 1); the sum of 49k
    # independent terms is close to normal
    chi2 = ((counts.sum(0)[0] - lam) ** 2 / lam).sum()
    z_chi2 = (chi2 - lam.numel()) / (2 + 1 / lam).sum().sqrt()
    assert abs(float(z_chi2)) < SIGMA, float(z_chi2)
    total = float(p.sum())
    z_total = (float(counts.sum()) / reps - total) / math.sqrt(total / reps)
    assert abs(z_total) < SIGMA, z_total


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_fastrg_single_group_calls_are_unbiased_and_read_only(dtype):
    """Issue 11: one call per graph (a table block of one group, where the key weights
    are a view of k_membership) drew about 1.4 x sum P edges in float64, because the
    rejection table was divided into k_membership in place.  Many such calls, and one
    batched call with one group per table block, give sum P within SIGMA standard
    errors, and leave the memberships untouched."""
    n, m, k, calls = 6, 5, 3, 400
    qm, s, km, p = _issue_sbm(n, m, k, groups=1, seed=5, dtype=dtype)
    qm, s, km = qm[0, 0], s[0], km[0, 0]
    inputs = [t.clone() for t in (qm, s, km)]
    gen = torch.Generator().manual_seed(6)
    sizes = [fastrg_sample(qm, s, km, gen)[0].numel() for _ in range(calls)]
    for before, after in zip(inputs, (qm, s, km)):
        assert torch.equal(before, after)
    total = float(p.sum())
    z = (sum(sizes) / calls - total) / math.sqrt(total / calls)
    assert abs(z) < SIGMA, (sum(sizes) / calls / total, z)
    # batched, with one group per table block: the same view, through another door
    reps = 300
    one_group_blocks = FastRGTuning(table_block_entries=1, key_draw="rejection",
                                    cell_grid="clusters")
    counts, _ = _draw_counts(qm[None, None], s[None], km[None, None], reps, seed=7,
                             tuning=one_group_blocks)
    z = (counts.mean(0)[0] - p[0]) / (p[0] / reps).sqrt()
    assert float(z.abs().max()) < SIGMA, float(z.abs().max())


@pytest.mark.parametrize("key_draw", KEY_DRAWS)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("device", DEVICES)
def test_fastrg_merge_policy(device, dtype, key_draw):
    """ "merge": no repeated pair, sorted by (group, query, key), Pr[A_ij = 1] =
    1 - exp(-P_ij) within SIGMA binomial standard errors per pair, with P_ij up to
    about 2.5 (duplicates frequent), for both dtypes and key-draw paths."""
    n, m, k, reps = 5, 6, 4, 8000
    qm, s, km, p = _issue_sbm(n, m, k, groups=1, seed=8, p_max=2.5, dtype=dtype,
                              device=device)
    assert float(p.max()) > 1.5 and float(p.min()) < 0.5
    tuning = _tuning(key_draw, "torch" if device == "cuda" else "numpy", device)
    counts, edges = _draw_counts(qm, s, km, reps, seed=9, duplicates="merge", tuning=tuning)
    code = (edges[0] * n + edges[1]) * m + edges[2]
    assert bool((code[1:] > code[:-1]).all())  # strictly increasing: sorted and unique
    freq = counts.mean(0)
    expect = (1 - torch.exp(-p)).to(device)
    z = (freq - expect) / (expect * (1 - expect) / reps).sqrt()
    assert float(z.abs().max()) < SIGMA, float(z.abs().max())


def test_fastrg_tuning_selects_the_key_draw_and_blocks_keep_the_law():
    """``key_draw="auto"`` takes rejection for flat key clusters and the inverse-CDF
    search for skewed ones (same seed, same graph as the forced path; the two paths give
    different graphs), and small table and draw blocks (several blocks of 500 groups,
    steps of a few hundred edges) keep E[count_ij] = P_ij."""
    qm, s, km, p = _issue_sbm(40, 30, 4, groups=3, seed=10)
    skewed = km.clone()
    skewed[..., 0, :] = 100.0  # acceptance about 1/30 < 1/8
    gen = lambda: torch.Generator().manual_seed(11)  # noqa: E731
    clusters = FastRGTuning(cell_grid="clusters")
    for keys, auto_takes, other in ((km, "rejection", "search"), (skewed, "search", "rejection")):
        auto = fastrg_sample(qm, s, keys, gen(), tuning=clusters)
        forced = fastrg_sample(qm, s, keys, gen(),
                               tuning=replace(clusters, key_draw=auto_takes))
        different = fastrg_sample(qm, s, keys, gen(), tuning=replace(clusters, key_draw=other))
        assert all(torch.equal(a, b) for a, b in zip(auto, forced))
        assert not torch.equal(auto[2], different[2])
    qm, s, km, p = _issue_sbm(6, 5, 3, groups=1, seed=12)
    reps = 3000
    for grid in ("clusters", "keys"):  # several blocks of groups on both grids
        small = FastRGTuning(table_block_entries=500 * 5 * 3, draw_block=256, cell_grid=grid)
        counts, _ = _draw_counts(qm, s, km, reps, seed=13, tuning=small)
        z = (counts.mean(0) - p) / (p / reps).sqrt()
        assert float(z.abs().max()) < SIGMA, (grid, float(z.abs().max()))


def test_fastrg_tuning_bad_input():
    for kwargs, name, error in (
        ({"table_block_entries": 0}, "table_block_entries", ValueError),
        ({"draw_block": 2.5}, "draw_block", TypeError),
        ({"key_draw": "inverse"}, "key_draw", ValueError),
        ({"min_acceptance": 1.5}, "min_acceptance", ValueError),
        ({"min_acceptance": float("nan")}, "min_acceptance", ValueError),
        ({"cpu_uniforms": "cuda"}, "cpu_uniforms", ValueError),
        ({"cpu_poisson": "numpy"}, "cpu_poisson", ValueError),
        ({"cell_grid": "pairs"}, "cell_grid", ValueError),
        ({"key_grid_max_entries": -1}, "key_grid_max_entries", ValueError),
        ({"key_grid_pairs_per_edge": -1.0}, "key_grid_pairs_per_edge", ValueError),
    ):
        with pytest.raises(error, match=f"^{name}: expected"):
            FastRGTuning(**kwargs)
    qm, s, km = _random_sbm(4, 5, 3)
    with pytest.raises(TypeError, match="tuning"):
        fastrg_sample(qm, s, km, tuning={"key_draw": "search"})


@pytest.mark.parametrize("device", DEVICES)
def test_fastrg_batched_s_per_batch_and_zero_mass(device):
    """s given per batch element; queries/keys/clusters with zero mass are never drawn."""
    B, H, n, m, k = 3, 2, 8, 7, 4
    g = torch.Generator().manual_seed(5)
    qm = torch.rand(B, H, n, k, generator=g, dtype=F64)
    km = torch.rand(B, H, m, k, generator=g, dtype=F64)
    s = torch.rand(B, H, k, k, generator=g, dtype=F64)
    qm[:, :, 2] = 0  # query 2 has no membership
    km[..., 6, :] = 0  # key 6 neither
    s[1, 0] = 0  # group 2 has no edge probability at all
    qm, km, s = qm.to(device), km.to(device), s.to(device)
    gen = torch.Generator(device=device).manual_seed(6)
    group, query, key = fastrg_sample(qm * 3, s, km * 3, gen, duplicates="keep")
    assert group.dtype == query.dtype == key.dtype == torch.int64
    assert group.numel() > 100
    assert not bool((query == 2).any()) and not bool((key == 6).any())
    assert not bool((group == 2).any())
    assert int(group.max()) < B * H and int(query.max()) < n and int(key.max()) < m


def test_fastrg_reproducible_and_no_dense_intermediate():
    """Same generator seed, same graph.  n = m = 200k (a dense P would need 320 GB) runs
    in well under a second with about 2000 edges: nothing n x m is formed."""
    n, k = 200_000, 4
    qm, s, km = _random_sbm(n, n, k, seed=7)
    total = qm.sum(0) @ s @ km.sum(0)  # sum P without forming P
    qm = qm * (2000 / total)  # E[#edges] = 2000
    a = fastrg_sample(qm, s, km, torch.Generator().manual_seed(8))
    b = fastrg_sample(qm, s, km, torch.Generator().manual_seed(8))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert 2000 - 5 * math.sqrt(2000) < a[0].numel() < 2000 + 5 * math.sqrt(2000)


@pytest.mark.parametrize("device", DEVICES)
def test_fastrg_self_loops_give_every_query_an_edge(device):
    n, k = 40, 3
    qm, s, km = _random_sbm(n, n, k, seed=9, device=device, scale=0.01)  # very sparse
    gen = torch.Generator(device=device).manual_seed(10)
    group, query, key = fastrg_sample(qm, s, km, gen, self_loops=True)
    assert torch.equal(torch.unique(query[query == key]), torch.arange(n, device=device))
    assert bool((query[1:] >= query[:-1]).all())  # still sorted by query
    group, query, key = fastrg_sample(qm, s, km, gen, self_loops=True, duplicates="merge")
    loops = query[query == key]
    assert torch.equal(loops, torch.arange(n, device=device))  # merged: each loop once
    with pytest.raises(ValueError, match="self_loops"):
        fastrg_sample(qm, s, km[:-1], gen, self_loops=True)


def test_fastrg_bad_input():
    qm, s, km = _random_sbm(4, 5, 3)
    with pytest.raises(ValueError, match="q_membership"):
        fastrg_sample(-qm, s, km)
    bad = km.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="k_membership"):
        fastrg_sample(qm, s, bad)
    with pytest.raises(ValueError, match="cluster counts"):
        fastrg_sample(qm, s, km[:, :2])
    with pytest.raises(ValueError, match="empty sequence"):
        fastrg_sample(qm[:0], s, km)
    with pytest.raises(ValueError, match="duplicates"):
        fastrg_sample(qm, s, km, duplicates="drop")
    with pytest.raises(ValueError, match="s: expected"):
        fastrg_sample(qm[None, None], s[None, None, None], km[None, None])
    with pytest.raises(TypeError, match="floating-point"):
        fastrg_sample(qm.long(), s, km)
    with pytest.raises(ValueError, match="q, k"):
        sbm_parameters(torch.randn(3, 4), torch.randn(3, 5), torch.randn(2, 4), lambda x: x)
    with pytest.raises(ValueError, match="empty"):
        sbm_parameters(torch.randn(0, 4), torch.randn(3, 4), torch.randn(2, 4), lambda x: x)
    with pytest.raises(TypeError, match=r"^mlp: expected a callable"):
        sbm_parameters(torch.randn(3, 4), torch.randn(3, 4), torch.randn(2, 4), None)
    with pytest.raises(TypeError, match=r"^generator: expected a torch.Generator or None"):
        fastrg_sample(qm, s, km, 5)
    with pytest.raises(TypeError, match=r"^self_loops: expected a bool, got 'yes'"):
        fastrg_sample(qm, s, qm, self_loops="yes")
    with pytest.raises(ValueError, match=r"^q_membership: expected a tensor with values"):
        fastrg_sample(qm.to("meta"), s.to("meta"), km.to("meta"))


# ---------------------------------------------------------------------------------------
# edge attention
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_edge_attention_complete_graph_equals_softmax_attention(device):
    torch.manual_seed(11)
    B, H, n, m, d = 2, 3, 9, 7, 5
    q, k = torch.randn(B, H, n, d, dtype=F64), torch.randn(B, H, m, d, dtype=F64)
    v = torch.randn(B, H, m, 4, dtype=F64)
    q, k, v = (t.to(device).requires_grad_() for t in (q, k, v))
    edges = _complete_graph(B * H, n, m, device)
    perm = torch.randperm(edges[0].numel(), device=device)  # order must not matter
    edges = tuple(e[perm] for e in edges)
    out = edge_attention(q, k, v, edges)
    ref = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), -1) @ v
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    weight = torch.randn_like(out)
    got = torch.autograd.grad((out * weight).sum(), (q, k, v))
    expect = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    for a, b in zip(got, expect):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # peer library: torch SDPA in float32
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    out32 = edge_attention(q.float(), k.float(), v.float(), edges)
    torch.testing.assert_close(out32, sdpa, rtol=1e-5, atol=1e-5)


def test_edge_attention_gradcheck_weights_duplicates_empty_rows():
    torch.manual_seed(12)
    G, n, m, d = 2, 4, 3, 3
    q = torch.randn(G, n, d, dtype=F64, requires_grad=True)
    k = torch.randn(G, m, d, dtype=F64, requires_grad=True)
    v = torch.randn(G, m, 2, dtype=F64, requires_grad=True)
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 0, 1])
    query = torch.tensor([0, 0, 1, 3, 0, 2, 2, 0, 3])  # query 2 of group 0 has no edge
    key = torch.tensor([1, 1, 2, 0, 0, 1, 2, 0, 2])  # (0, 0, 1) appears twice
    w = torch.rand(group.numel(), dtype=F64).add_(0.2).requires_grad_()
    edges = (group, query, key)
    assert torch.autograd.gradcheck(
        lambda q, k, v, w: edge_attention(q, k, v, edges, edge_weight=w), (q, k, v, w)
    )


@pytest.mark.parametrize("device", DEVICES)
def test_edge_attention_equals_dense_masked_on_random_masks(device):
    torch.manual_seed(13)
    B, H, n, m, d = 2, 2, 12, 10, 6
    q, k, v = (
        torch.randn(B, H, L, d, dtype=F64, device=device).requires_grad_() for L in (n, m, m)
    )
    for density in (0.05, 0.3, 0.9):
        mask = torch.rand(B, H, n, m, device=device) < density
        g, i, j = mask.reshape(B * H, n, m).nonzero(as_tuple=True)
        out = edge_attention(q, k, v, (g, i, j))
        ref = dense_masked_attention(q, k, v, mask)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
        weight = torch.randn_like(out)
        for a, b in zip(
            torch.autograd.grad((out * weight).sum(), (q, k, v)),
            torch.autograd.grad((ref * weight).sum(), (q, k, v)),
        ):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    # a multigraph counts each copy: equal to the dense formulation with a count mask
    qm, s, km = _random_sbm(n, m, 3, heads=H, seed=14, device=device, scale=3.0)
    edges = fastrg_sample(
        qm.expand(B, H, n, 3),
        s,
        km.expand(B, H, m, 3),
        torch.Generator(device=device).manual_seed(15),
        duplicates="keep",
    )
    counts = _dense_count(edges, B * H, n, m).reshape(B, H, n, m)
    assert int(counts.max()) > 1
    torch.testing.assert_close(
        edge_attention(q, k, v, edges), dense_masked_attention(q, k, v, counts.to(F64))
    )


@pytest.mark.parametrize("device", DEVICES)
def test_edge_attention_empty_rows_and_large_scores_are_finite(device):
    torch.manual_seed(16)
    n, m, d = 6, 5, 4
    q = (1e3 * torch.randn(1, 1, n, d, device=device)).requires_grad_()  # scores ~ 1e6
    k = torch.randn(1, 1, m, d, device=device).requires_grad_()
    v = torch.randn(1, 1, m, d, device=device).requires_grad_()
    group = torch.zeros(4, dtype=torch.int64, device=device)
    query = torch.tensor([0, 0, 3, 3], device=device)
    key = torch.tensor([1, 4, 0, 2], device=device)
    out = edge_attention(q, k, v, (group, query, key))
    assert bool(torch.isfinite(out).all())
    empty = torch.tensor([1, 2, 4, 5], device=device)
    assert bool((out[0, 0, empty] == 0).all())
    ref = torch.softmax(
        (q @ k.transpose(-1, -2) / 2)
        .double()
        .masked_fill(
            ~_dense_count((group, query, key), 1, n, m).bool().reshape(1, 1, n, m), -math.inf
        ),
        -1,
    )
    ref = torch.nan_to_num(ref) @ v.double()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))
    assert bool((q.grad[0, 0, empty] == 0).all())
    # no edge at all
    none = torch.zeros(0, dtype=torch.int64, device=device)
    out0 = edge_attention(q, k, v, (none, none, none))
    assert bool((out0 == 0).all())


def test_edge_attention_keeps_a_few_numbers_per_edge_for_backward():
    """Memory O(E + n d): what autograd keeps between forward and backward, besides the
    inputs and the edge list, is one number per edge plus the output."""
    torch.manual_seed(17)
    G, n, m, d = 2, 300, 300, 32
    q, k, v = (torch.randn(G, L, d, requires_grad=True) for L in (n, m, m))
    qm, s, km = _random_sbm(n, m, 4, heads=G, seed=18, scale=0.3)
    edges = fastrg_sample(qm, s, km, torch.Generator().manual_seed(19))
    group = edges[0]
    num_edges = group.numel()
    assert num_edges > 10 * n
    inputs = {t.data_ptr() for t in (q, k, v, *edges)}
    saved = []

    def pack(t):
        if t.data_ptr() not in inputs:
            saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = edge_attention(q, k, v, edges)
    assert sum(saved) <= num_edges + out.numel()
    out.sum().backward()


def test_stable_argsort_matches_torch_sort():
    from companion.sbm.graph_attention import stable_argsort

    g = torch.Generator().manual_seed(25)
    for bound in (7, 1 << 16, 1 << 40):
        keys = torch.randint(0, bound, (5000,), generator=g)
        keys[::3] = keys[0]  # ties: stability matters
        torch.testing.assert_close(stable_argsort(keys, bound), torch.sort(keys, stable=True)[1])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, F64, torch.bool,
                                   torch.bfloat16])
def test_repeat_each_equals_repeat_interleave(dtype):
    """repeat_each gives torch.repeat_interleave's tensor, bit for bit (dtype, values,
    signs of zero): int64 and int32 repeats, zero repeats, an empty input, a strided
    view, a tensor that requires grad (torch's path, still differentiable), bfloat16
    (numpy has none: torch's path); a wrong ``total`` is refused on numpy's path."""
    from companion.sbm.graph_attention import repeat_each

    g = torch.Generator().manual_seed(26)
    values = torch.randn(2 * 333, generator=g).mul(100)
    values[::5] = -0.0
    values = values.to(dtype)
    for rep_dtype in (torch.int64, torch.int32):
        reps = torch.randint(0, 4, (2 * 333,), generator=g).to(rep_dtype)
        for v, r in ((values, reps), (values[::2], reps[1::2]), (values[:0], reps[:0])):
            want = v.repeat_interleave(r)
            got = repeat_each(v, r, int(r.sum()))
            assert got.dtype == want.dtype and torch.equal(got, want)
            if dtype.is_floating_point:
                assert torch.equal(torch.signbit(got), torch.signbit(want))
            assert torch.equal(repeat_each(v, r), want)
    if dtype.is_floating_point:
        leaf = values[:5].clone().requires_grad_(True)
        out = repeat_each(leaf, torch.tensor([1, 0, 2, 1, 3]))
        out.sum().backward()
        assert torch.equal(leaf.grad, torch.tensor([1.0, 0, 2, 1, 3], dtype=dtype))
    if dtype != torch.bfloat16:
        with pytest.raises(ValueError, match="total"):
            repeat_each(values[:3], torch.tensor([1, 1, 1]), 4)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_transposed_csr_is_the_stable_column_order(index_dtype):
    """EdgeGraph's transposed CSR (scipy's counting sort on CPU) against torch's stable
    sort of the columns: the permutation, the column pointers and each edge's row, for
    graphs with empty rows and columns, repeated pairs, edges given unsorted, one edge
    and none; int32 indices and int64 ones."""
    from companion.sbm.graph_attention import EdgeGraph

    g = torch.Generator().manual_seed(27)
    for groups, n, m, num_edges in ((3, 7, 5, 60), (2, 40, 33, 9), (1, 1, 1, 1), (2, 3, 4, 0)):
        group = torch.randint(0, groups, (num_edges,), generator=g)
        query = torch.randint(0, n, (num_edges,), generator=g)
        key = torch.randint(0, m, (num_edges,), generator=g)
        key[: num_edges // 3] = 0  # one crowded column per group
        graph = EdgeGraph(group, query, key, groups, n, m)
        graph.index_dtype = index_dtype
        graph.col, graph.crow = graph.col.to(index_dtype), graph.crow.to(index_dtype)
        order = graph.order if graph.order is not None else torch.arange(num_edges)
        row = (group * n + query)[order]
        col = (group * m + key)[order]
        assert torch.equal(graph.col, col.to(index_dtype))
        perm, crow_t, row_t = graph._transposed_csr()
        want = torch.sort(col, stable=True).indices
        counts = torch.bincount(col, minlength=groups * m)
        assert perm.dtype == crow_t.dtype == row_t.dtype == index_dtype
        assert torch.equal(perm, want.to(index_dtype))
        assert torch.equal(crow_t, torch.cat([torch.zeros(1, dtype=torch.int64),
                                              counts.cumsum(0)]).to(index_dtype))
        assert torch.equal(row_t, row[want].to(index_dtype))


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_transpose_matmul_equals_the_transposed_csr_product_and_the_dense_one(index_dtype,
                                                                             dtype):
    """EdgeGraph.transpose_matmul (on CPU scipy's product with the CSR read as the CSC of
    the transpose, no transposed CSR built) against the product with the transposed CSR
    (:meth:`matrix_t`) and against the dense ``A^T x`` in float64: graphs with empty rows
    and columns, repeated pairs, edges given unsorted, one edge and none, odd sizes, a
    non-contiguous ``x``, int32 and int64 indices; the dtype is kept."""
    from companion.sbm.graph_attention import EdgeGraph

    g = torch.Generator().manual_seed(29)
    tol = {torch.float32: 1e-5, F64: 1e-12}[dtype]
    for groups, n, m, k, num_edges in ((3, 7, 5, 3, 61), (2, 40, 33, 17, 9), (1, 1, 1, 1, 1),
                                       (2, 3, 4, 5, 0)):
        group = torch.randint(0, groups, (num_edges,), generator=g)
        query = torch.randint(0, n, (num_edges,), generator=g)
        key = torch.randint(0, m, (num_edges,), generator=g)
        key[: num_edges // 3] = 0  # repeated pairs, one crowded column per group
        graph = EdgeGraph(group, query, key, groups, n, m)
        graph.index_dtype = index_dtype
        graph.col, graph.crow = graph.col.to(index_dtype), graph.crow.to(index_dtype)
        order = graph.order if graph.order is not None else torch.arange(num_edges)
        row, col = (group * n + query)[order], (group * m + key)[order]
        values = torch.randn(num_edges, generator=g, dtype=dtype)
        for x in (torch.randn(groups * n, k, generator=g, dtype=dtype),
                  torch.randn(k, groups * n, generator=g, dtype=dtype).t()):
            got = graph.transpose_matmul(values, x)
            assert got.dtype == dtype and got.shape == (groups * m, k)
            want = graph.matrix_t(values) @ x
            scale = max(1.0, want.abs().max().item())
            assert (got - want).abs().max().item() <= tol * scale
            dense = torch.zeros(groups * n, groups * m, dtype=F64)
            dense.index_put_((row, col), values.double(), accumulate=True)
            exact = dense.t() @ x.double()
            assert (got.double() - exact).abs().max().item() <= tol * scale


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_sddmm_in_place_equals_the_copying_product_and_the_gathered_dots(index_dtype, dtype):
    """EdgeGraph.sddmm (the product written into its pattern's values, ``out=``) gives
    the numbers of the copying ``sampled_addmm`` it replaced, bit for bit, and the dots of
    the gathered rows in float64 to rounding: graphs with empty rows, repeated pairs, one
    edge and none, odd sizes, int32 and int64 indices; a fresh tensor each call."""
    import warnings

    from companion.sbm.graph_attention import EdgeGraph

    g = torch.Generator().manual_seed(31)
    for groups, n, m, d, num_edges in ((3, 7, 5, 3, 61), (2, 40, 33, 17, 9), (1, 1, 1, 1, 1),
                                       (2, 3, 4, 5, 0)):
        group = torch.randint(0, groups, (num_edges,), generator=g)
        query = torch.randint(0, n, (num_edges,), generator=g)
        key = torch.randint(0, m, (num_edges,), generator=g)
        key[: num_edges // 3] = 0  # repeated pairs
        graph = EdgeGraph(group, query, key, groups, n, m)
        graph.index_dtype = index_dtype
        graph.col, graph.crow = graph.col.to(index_dtype), graph.crow.to(index_dtype)
        x = torch.randn(groups * n, d, generator=g, dtype=dtype)
        y = torch.randn(groups * m, d, generator=g, dtype=dtype)
        got = graph.sddmm(x, y, alpha=0.37)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            pattern = torch.sparse_csr_tensor(graph.crow, graph.col,
                                              torch.zeros(num_edges, dtype=dtype),
                                              size=(groups * n, groups * m))
        copying = torch.sparse.sampled_addmm(pattern, x, y.t(), beta=0.0, alpha=0.37)
        assert got.dtype == dtype and got.shape == (num_edges,)
        assert torch.equal(got, copying.values())
        order = graph.order if graph.order is not None else torch.arange(num_edges)
        row, col = (group * n + query)[order], (group * m + key)[order]
        dots = 0.37 * (x.double()[row] * y.double()[col]).sum(1)
        tol = 1e-12 if dtype == F64 else 1e-5
        torch.testing.assert_close(got.double(), dots, rtol=tol, atol=tol)
        assert graph.sddmm(x, y, alpha=0.37).data_ptr() != got.data_ptr() or num_edges == 0


@pytest.mark.parametrize("base_dtype", [torch.int64, torch.int32])
def test_rejection_draw_numpy_equals_torch_kernels(base_dtype):
    """The key draw by rejection in numpy's kernels (the CPU default) gives the keys of
    the same algorithm in torch's kernels on the same numpy uniforms, bit for bit, and
    leaves the stream in the same place: widths 1, 7 and 300, tables with zero and
    one entries, no draw, one draw, many; also written into a slice of a larger int64 or
    int32 tensor."""
    from companion.sbm.fastrg import _RandomSource, _rejection_draw, _rejection_draw_torch

    g = torch.Generator().manual_seed(28)
    for rows, width, draws_n in ((3, 1, 50), (4, 7, 0), (4, 7, 1), (5, 300, 20000)):
        accept = torch.rand(rows, width, generator=g, dtype=F64)
        accept[:, 0] = 1.0  # every row can accept
        if width > 1:
            accept[:, 1] = 0.0  # a column never accepted
        accept = accept.reshape(-1)
        base = (torch.randint(0, rows, (draws_n,), generator=g) * width).to(base_dtype)
        keys = []
        for draw in (_rejection_draw, _rejection_draw_torch):
            source = _RandomSource(torch.device("cpu"), torch.Generator().manual_seed(3),
                                   "numpy")
            keys.append((draw(accept, width, base, source), source.rng.bit_generator.state))
        (got, state_got), (want, state_want) = keys
        assert got.dtype == want.dtype == torch.int64 and torch.equal(got, want)
        assert state_got == state_want
        # written into a slice of a larger tensor, int64 or int32 (as _draw_keys does):
        # the same keys there, nothing around them touched
        for draw in (_rejection_draw, _rejection_draw_torch):
            for into_dtype in (torch.int64, torch.int32):
                source = _RandomSource(torch.device("cpu"), torch.Generator().manual_seed(3),
                                       "numpy")
                into = torch.full((draws_n + 5,), -7, dtype=into_dtype)
                assert draw(accept, width, base, source, into[2:2 + draws_n]) is not None
                assert torch.equal(into[2:2 + draws_n].long(), want)
                assert bool((into[:2] == -7).all()) and bool((into[2 + draws_n:] == -7).all())
        if width > 1 and draws_n:
            assert not bool((got == 1).any()) and int(got.max()) < width


def test_key_table_row_sums_of_the_float64_copy_equal_the_float64_sums():
    """The key table's acceptance (the ``auto`` choice between rejection and search)
    sums the rows of its contiguous float64 copy of the weights: the numbers of
    ``weights.sum(1, dtype=float64)``, which it summed before, bit for bit (widths 1 to
    8195, both thread settings the book uses)."""
    g = torch.Generator().manual_seed(29)
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            for rows, width in ((3, 1), (7, 13), (64, 100), (256, 4096), (5, 8195)):
                w = torch.sigmoid(torch.randn(rows, width, generator=g) * 3)
                assert torch.equal(w.to(F64).sum(1), w.sum(1, dtype=F64))
    finally:
        torch.set_num_threads(threads)


def test_edge_attention_bad_input():
    q = torch.randn(1, 1, 4, 3)
    kv = torch.randn(1, 1, 5, 3)
    e = (torch.zeros(2, dtype=torch.int64), torch.tensor([0, 3]), torch.tensor([1, 4]))
    edge_attention(q, kv, kv, e)
    with pytest.raises(ValueError, match="edges\\[key\\]"):
        edge_attention(q, kv, kv, (e[0], e[1], torch.tensor([1, 5])))
    with pytest.raises(ValueError, match="edges\\[group\\]"):
        edge_attention(q, kv, kv, (torch.tensor([0, 1]), e[1], e[2]))
    with pytest.raises(TypeError, match="int64"):
        edge_attention(q, kv, kv, (e[0], e[1].int(), e[2]))
    with pytest.raises(ValueError, match="equal lengths"):
        edge_attention(q, kv, kv, (e[0], e[1][:1], e[2]))
    with pytest.raises(ValueError, match="q, k, v"):
        edge_attention(q, torch.randn(1, 1, 5, 2), kv, e)
    with pytest.raises(ValueError, match="empty"):
        edge_attention(q[:, :, :0], kv, kv, e)
    with pytest.raises(ValueError, match="edge_weight"):
        edge_attention(q, kv, kv, e, edge_weight=torch.ones(3))
    with pytest.raises(ValueError, match="mask"):
        dense_masked_attention(q, kv, kv, torch.ones(4, 4, dtype=torch.bool))


# ---------------------------------------------------------------------------------------
# SBMAttention: straight-through estimator, density, regulariser
# ---------------------------------------------------------------------------------------
# the layer's two paths: dense pair counts (the default at these sizes) and edge lists
LAYER_PATHS = {"pairs": FastRGTuning(), "edges": FastRGTuning(key_grid_max_entries=0)}


@pytest.mark.parametrize("path", sorted(LAYER_PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("duplicates", ["merge", "keep"])
@pytest.mark.parametrize("device", DEVICES)
def test_sbm_attention_ste_gradient_closed_form(device, duplicates, padded, dtype, path):
    """All parameter and input gradients of SBMAttention equal the closed form: dense
    attention with the sampled mask A (counts for "keep") as a leaf, grad_P =
    A * hardtanh(grad_A) (= hardtanh(A * grad_A) for a 0/1 mask), then back-propagation
    of grad_P through P = Qhat S Khat^T (dense, float64).  With padding, the closed form
    uses memberships zeroed at padded positions, no edge touches them, and the density
    counts valid pairs only.  In float32 the layer's gradients are compared with the
    closed form in float64 on a float64 copy of the layer and inputs (same sampled
    graph), to float32 accuracy."""
    torch.manual_seed(20)
    B, H, n, m, d, kc = 2, 2, 7, 6, 4, 3
    layer = SBMAttention(d, H, kc, duplicates=duplicates, tuning=LAYER_PATHS[path],
                         device=device, dtype=dtype)
    q, k, v = (
        torch.randn(B, H, L, d, dtype=F64, device=device).to(dtype).requires_grad_()
        for L in (n, m, m)
    )
    weight = 3 * torch.randn(B, H, n, d, dtype=F64, device=device)
    lam = 0.7
    gen = torch.Generator(device=device).manual_seed(21)
    qv = kv = None
    pairs = torch.full((B, 1), float(n * m), dtype=F64, device=device)
    if padded:
        qv = torch.ones(B, n, dtype=torch.bool, device=device)
        kv = torch.ones(B, m, dtype=torch.bool, device=device)
        qv[0, 5:], kv[0, 4:], kv[1, :2] = False, False, False
        pairs = (qv.sum(1) * kv.sum(1)).to(F64)[:, None]
    out, density, edges = layer(q, k, v, query_valid=qv, key_valid=kv, generator=gen,
                                return_edges=True)
    assert out.dtype == density.dtype == dtype
    loss = (out * weight.to(dtype)).sum() + lam * density.sum()
    params = [q, k, v, *layer.parameters()]
    got = torch.autograd.grad(loss, params)
    # the closed form, in float64 on a copy holding the same values
    ref_layer = copy.deepcopy(layer).to(F64)
    q, k, v = (t.detach().to(F64).requires_grad_() for t in (q, k, v))
    ref_params = [q, k, v, *ref_layer.parameters()]
    tol = {"rtol": 1e-9, "atol": 1e-11} if dtype == F64 else {"rtol": 2e-4, "atol": 2e-5}

    mask = _dense_count(edges, B * H, n, m).reshape(B, H, n, m).to(F64).requires_grad_()
    assert 0 < int(mask.sum()) < B * H * n * m
    if duplicates == "merge":
        assert int(mask.max()) == 1
    if padded:  # no edge touches padding: padded queries get zero rows
        assert not bool(mask[~qv[:, None, :, None].expand_as(mask)].any())
        assert not bool(mask[~kv[:, None, None, :].expand_as(mask)].any())
        assert float(out.detach()[0, :, 5:].abs().max()) == 0
    torch.testing.assert_close(density.detach().to(F64), mask.detach().sum((2, 3)) / pairs, **tol)
    ref_out = dense_masked_attention(q, k, v, mask)
    torch.testing.assert_close(out.to(F64), ref_out, **tol)
    ref_loss = (ref_out * weight).sum() + lam * (mask.sum((2, 3)) / pairs).sum()
    (grad_a,) = torch.autograd.grad(ref_loss, mask, retain_graph=True)
    grad_p = mask.detach() * torch.nn.functional.hardtanh(grad_a)
    if duplicates == "merge":
        torch.testing.assert_close(grad_p, torch.nn.functional.hardtanh(mask.detach() * grad_a))
    sampled = mask.detach().bool()
    clipped = grad_a.abs() > 1
    assert bool(clipped[sampled].any()) and bool((~clipped)[sampled].any())  # both regimes
    qm, s, km = sbm_parameters(q, k, ref_layer.cluster_embeddings, ref_layer.mlp)
    if padded:
        qm, km = qm * qv[:, None, :, None], km * kv[:, None, :, None]
    assert use_pair_grid(qm @ s, km, LAYER_PATHS[path]) == (path == "pairs")
    p = edge_probabilities(qm, s, km)
    surrogate = ref_loss + (grad_p * p).sum()
    expect = torch.autograd.grad(surrogate, ref_params)
    for name, a, b in zip(["q", "k", "v"] + [n for n, _ in layer.named_parameters()], got, expect):
        assert a.dtype == dtype, name
        torch.testing.assert_close(a.to(F64), b, **tol, msg=lambda s: f"{name}: {s}")


@pytest.mark.parametrize("duplicates, self_loops, padded",
                         [("keep", False, False), ("merge", True, True), ("keep", True, True)])
def test_sbm_attention_int32_edges_change_no_number(monkeypatch, duplicates, self_loops,
                                                    padded):
    """The layer samples its edge lists with int32 indices: outputs, densities and every
    gradient equal those of the same layer on int64 indices, bit for bit (padding and
    self-loops included, whose masks index with the edges), and the edges it returns are
    int64 either way."""
    import companion.sbm.layer as layer_module

    torch.manual_seed(23)
    batch, heads, n, d = 2, 2, 13, 4
    layer = SBMAttention(d, heads, 3, duplicates=duplicates, self_loops=self_loops,
                         tuning=LAYER_PATHS["edges"])
    q, k, v = (torch.randn(batch, heads, n, d, requires_grad=True) for _ in range(3))
    valid = torch.ones(batch, n, dtype=torch.bool)
    if padded:
        valid[1, -4:] = False
    masks = dict(query_valid=valid, key_valid=valid) if padded else {}
    sampled_dtypes = []
    original = layer_module.fastrg_sample

    def sampler(forced):
        def sample(*args, **kwargs):
            if forced is not None:
                kwargs["index_dtype"] = forced
            edges = original(*args, **kwargs)
            sampled_dtypes.append(edges[0].dtype)
            return edges
        return sample

    results = []
    for forced in (None, torch.int64):
        monkeypatch.setattr(layer_module, "fastrg_sample", sampler(forced))
        out, density, edges = layer(q, k, v, generator=torch.Generator().manual_seed(24),
                                    return_edges=True, **masks)
        params = [q, k, v, *layer.parameters()]
        grads = torch.autograd.grad((out.square().sum() + density.sum()), params)
        assert all(t.dtype == torch.int64 for t in edges)
        results.append([out, density, *edges, *grads])
    assert sampled_dtypes == [torch.int32, torch.int64]
    for narrow, wide in zip(*results):
        assert torch.equal(narrow, wide)


def test_sbm_attention_density_regularizer_and_shapes():
    torch.manual_seed(22)
    B, H, n, d, kc = 2, 2, 30, 8, 4
    layer = SBMAttention(d, H, kc, self_loops=True)
    q, k, v = (torch.randn(B, H, n, d) for _ in range(3))
    out, density = layer(q, k, v, generator=torch.Generator().manual_seed(23))
    assert out.shape == (B, H, n, d) and density.shape == (B, H)
    assert bool(torch.isfinite(out).all())
    assert bool((density >= 1 / n).all())  # self loops: at least n edges per head
    out2, density2 = layer(q, k, v, generator=torch.Generator().manual_seed(24))
    reg = density_regularizer([density, density2], lam=1e-4)
    torch.testing.assert_close(reg, 1e-4 * torch.cat([density, density2]).mean())
    reg.backward()
    grads = [p.grad for p in layer.parameters()]
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
    # the regulariser alone reaches the parameters, through the straight-through estimator
    assert any(float(g.abs().sum()) > 0 for g in grads)
    with pytest.raises(ValueError, match="lam"):
        density_regularizer(density, lam=-1.0)
    with pytest.raises(TypeError, match="densities"):
        density_regularizer([])


def test_sbm_attention_bad_input():
    with pytest.raises(ValueError, match="num_clusters"):
        SBMAttention(8, 2, 0)
    with pytest.raises(TypeError, match=r"^num_clusters: expected an int >= 1, got 2.5"):
        SBMAttention(8, 2, 2.5)
    with pytest.raises(ValueError, match="duplicates"):
        SBMAttention(8, 2, 4, duplicates="sum")
    layer = SBMAttention(8, 2, 4)
    with pytest.raises(ValueError, match="q: expected"):
        layer(torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8))
    with pytest.raises(ValueError, match="q, k"):
        layer(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 7), torch.randn(1, 2, 5, 8))
    with pytest.raises(ValueError, match="empty"):
        layer(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 0, 8), torch.randn(1, 2, 0, 8))
    nan_q = torch.randn(1, 2, 5, 8)
    nan_q[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="q_membership"):
        layer(nan_q, torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8))
    x = torch.randn(2, 2, 5, 8)
    with pytest.raises(ValueError, match="query_valid"):
        layer(x, x, x, query_valid=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_valid"):
        layer(x, x, x, key_valid=torch.ones(2, 5))  # not bool


def test_sbm_attention_self_loops_skip_padding():
    """Forced self-loops give every valid query an edge and none to padded positions."""
    torch.manual_seed(25)
    B, H, n, d = 2, 2, 12, 8
    layer = SBMAttention(d, H, 4, self_loops=True)
    q, k, v = (torch.randn(B, H, n, d) for _ in range(3))
    valid = torch.ones(B, n, dtype=torch.bool)
    valid[0, 9:] = False
    out, density, (group, query, key) = layer(
        q, k, v, query_valid=valid, key_valid=valid,
        generator=torch.Generator().manual_seed(26), return_edges=True,
    )
    element = group // H
    assert bool(valid[element, query].all()) and bool(valid[element, key].all())
    loops = torch.unique((group * n + query)[query == key])
    assert loops.numel() == H * int(valid.sum())  # one loop per valid query and head
    assert float(out.detach()[0, :, 9:].abs().max()) == 0
    assert bool((density >= 1 / valid.sum(1, keepdim=True)).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("n, m", [(7, 5), (1, 3)])
def test_fastrg_given_q_times_s_draws_the_same_graph(device, dtype, n, m):
    # the layer hands the sampler its own Qhat S: the same rates, so the same graph
    qm, s, km = (t.to(device, dtype) for t in _random_sbm(n, m, 3, heads=2, seed=4))
    drawn = []
    for q_times_s in (None, qm @ s):
        gen = torch.Generator(device=device).manual_seed(11)
        drawn.append(fastrg_sample(qm, s, km, gen, q_times_s=q_times_s))
    for plain, given in zip(*drawn):
        assert torch.equal(plain, given)
    if dtype == F64:  # the float64 rates are computed out of place: the input is kept
        qs = qm @ s
        kept = qs.clone()
        fastrg_sample(qm, s, km, torch.Generator(device=device).manual_seed(0), q_times_s=qs)
        assert torch.equal(qs, kept)


def test_fastrg_q_times_s_of_the_wrong_shape_names_the_parameter():
    qm, s, km = _random_sbm(4, 4, 2, heads=2)
    with pytest.raises(ValueError, match="q_times_s"):
        fastrg_sample(qm, s, km, q_times_s=torch.zeros(3))


@pytest.mark.parametrize("duplicates, self_loops", [("keep", False), ("merge", False),
                                                    ("keep", True), ("merge", True)])
@pytest.mark.parametrize("path", ["default"] + [f"{draw}/{source}" for draw in KEY_DRAWS
                                                for source in CPU_UNIFORMS])
@pytest.mark.parametrize("device", DEVICES)
def test_fastrg_int32_indices_are_the_int64_edges(device, path, duplicates, self_loops):
    """``index_dtype=torch.int32`` gives the edges of the default int64 call of the same
    seed, value for value, on every path (the default tuning, both cell grids, rejection
    and search, every uniform source, merged, with self-loops), two heads of odd sizes
    with a query and a key without mass; an empty graph too."""
    tuning = FastRGTuning()
    if path != "default":
        tuning = _tuning(*path.split("/"), device)
    qm, s, km = (t.to(device) for t in _random_sbm(13, 13, 3, heads=2, seed=21, scale=3.0))
    qm[:, :, 4] = 0
    km[:, :, 7] = 0
    for scale in (1.0, 0.0):  # 0: no edge at all (the self-loops only)
        drawn = []
        for index_dtype in (torch.int64, torch.int32):
            gen = torch.Generator(device=device).manual_seed(22)
            drawn.append(fastrg_sample(qm * scale, s, km, gen, duplicates=duplicates,
                                       self_loops=self_loops, tuning=tuning,
                                       index_dtype=index_dtype))
        for wide, narrow in zip(*drawn):
            assert wide.dtype == torch.int64 and narrow.dtype == torch.int32
            assert torch.equal(wide, narrow.long())
        assert drawn[0][0].numel() > (50 if scale else -1)
        assert drawn[0][0].numel() >= (26 if self_loops else 0)


def test_fastrg_index_dtype_bad_input_names_the_parameter():
    from companion.sbm.fastrg import _check_index_dtype

    qm, s, km = _random_sbm(4, 5, 3)
    for bad in (torch.int16, torch.float32, "int32", None):
        with pytest.raises(TypeError, match="^index_dtype: expected torch.int32 or torch.int64"):
            fastrg_sample(qm, s, km, index_dtype=bad)
    # no test can allocate 2**31 queries: the check the sampler makes, on the count
    _check_index_dtype(torch.int32, 2**31 - 1)
    _check_index_dtype(torch.int64, 2**31)
    with pytest.raises(ValueError, match="^index_dtype: torch.int32 cannot hold"):
        _check_index_dtype(torch.int32, 2**31)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_flat_index_of_int32_indices_is_exact_past_two_to_the_31(index_dtype):
    """``group * size + index`` into int64 is computed in int64 even for int32 inputs
    (``G n`` may pass ``2**31`` where ``G`` and ``n`` do not); into int32 it equals the
    int64 numbers where they fit."""
    from companion.sbm.graph_attention import _flat_index

    group = torch.tensor([0, 1, 3, 2], dtype=index_dtype)
    index = torch.tensor([5, 0, 2**30 - 1, 7], dtype=index_dtype)
    want = group.long() * 2**30 + index.long()
    assert int(want.max()) >= 2**31
    got = _flat_index(index, group, 2**30, torch.int64)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    small = _flat_index(index[:2], group[:2], 2**30, torch.int32)
    assert small.dtype == torch.int32 and torch.equal(small.long(), want[:2])


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_attention_unit_weight_is_bit_identical_to_multiplying_by_ones(dtype):
    from companion.sbm.graph_attention import EdgeGraph, attention_on_graph

    qm, s, km = _random_sbm(9, 9, 3, heads=2, seed=2)
    edges = fastrg_sample(qm, s, km, torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(18, 4, generator=g, dtype=dtype) for _ in range(3))
    results = []
    for unit in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        weight = torch.ones(edges[0].numel(), dtype=dtype, requires_grad=True)
        graph = EdgeGraph(*edges, 2, 9, 9)
        out = attention_on_graph(*leaves, graph, weight, 0.5, unit_weight=unit)
        (out * torch.arange(out.numel(), dtype=dtype).reshape(out.shape)).sum().backward()
        results.append([out, *(t.grad for t in leaves), weight.grad])
    for plain, unit in zip(*results):
        assert torch.equal(plain, unit)


@pytest.mark.parametrize("case", [(6, 5, 3, 1, 1.5, 6000), (23, 17, 4, 2, None, 3000)],
                         ids=["tiny-P>1", "odd"])
@pytest.mark.parametrize("cpu_uniforms", CPU_UNIFORMS)
@pytest.mark.parametrize("key_draw", KEY_DRAWS)
def test_fastrg_keep_counts_have_poisson_variance(key_draw, cpu_uniforms, case):
    """Poisson law beyond the mean: with duplicates="keep" the per-pair sample variance
    of the counts over ``reps`` graphs is P_ij (Poisson: variance = mean) within SIGMA
    of its standard error sqrt((P + 2 P^2) / reps), and so is the variance of the total
    edge count; on both grids, both key draws and every CPU random source."""
    n, m, k, groups, p_max, reps = case
    tuning = _tuning(key_draw, cpu_uniforms, "cpu")
    qm, s, km, p = _issue_sbm(n, m, k, groups=groups, seed=31, p_max=p_max)
    counts, _ = _draw_counts(qm, s, km, reps, seed=32, tuning=tuning)
    var = counts.var(0)
    z = (var - p) / ((p + 2 * p**2) / reps).sqrt()
    assert float(z.abs().max()) < SIGMA, float(z.abs().max())
    total, lam = counts.sum((2, 3)), p.sum((1, 2))
    z_total = (total.var(0) - lam) / ((lam + 2 * lam**2) / reps).sqrt()
    assert float(z_total.abs().max()) < SIGMA, z_total


def test_poisson_by_inversion_mean_variance_and_stream():
    """The inversion sampler alone: mean and variance equal the rate for rates from 0 to
    500 (through the switch to numpy's sampler above 16), within SIGMA standard errors;
    a zero rate never counts; the same seed gives the same counts."""
    from companion.sbm.fastrg import _poisson_by_inversion

    rates = np.array([0.0, 1e-3, 0.2, 0.9, 3.0, 15.9, 16.1, 40.0, 500.0])
    reps = 20000
    draw = lambda seed: _poisson_by_inversion(  # noqa: E731
        np.repeat(rates, reps), np.random.Generator(np.random.PCG64(seed))
    ).reshape(len(rates), reps)
    counts = draw(3)
    assert counts.dtype == np.int64 and not counts[0].any()
    mean, var = counts.mean(1)[1:], counts.var(1, ddof=1)[1:]
    lam = rates[1:]
    assert np.abs((mean - lam) / np.sqrt(lam / reps)).max() < SIGMA
    assert np.abs((var - lam) / np.sqrt((lam + 2 * lam**2) / reps)).max() < SIGMA
    assert np.array_equal(draw(3), counts) and not np.array_equal(draw(4), counts)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("n, m", [(7, 5), (1, 3), (12, 12)])
def test_pair_counts_are_the_pair_grid_graph_and_reproducible(dtype, n, m):
    """poisson_pair_counts and fastrg_sample on the pair grid read the same stream: the
    counts are the multiplicities of the edge list drawn from the same seed (and merge
    keeps each pair with a positive count once); the same seed gives the same graph."""
    qm, s, km = (t.to(dtype) for t in _random_sbm(n, m, 3, heads=2, seed=4))
    keys = FastRGTuning(cell_grid="keys")
    gen = lambda: torch.Generator().manual_seed(11)  # noqa: E731
    counts = poisson_pair_counts(qm, s, km, gen())
    assert counts.shape == (1, 2, n, m) and counts.dtype == torch.int64
    assert torch.equal(counts, poisson_pair_counts(qm, s, km, gen()))
    edges = fastrg_sample(qm, s, km, gen(), tuning=keys)
    assert torch.equal(_dense_count(edges, 2, n, m).reshape(counts.shape), counts)
    merged = fastrg_sample(qm, s, km, gen(), tuning=keys, duplicates="merge")
    assert torch.equal(_dense_count(merged, 2, n, m).reshape(counts.shape), counts.clamp(max=1))
    assert use_pair_grid(qm @ s, km)  # dense enough: the default takes this grid
    assert not use_pair_grid(qm @ s, km, FastRGTuning(key_grid_max_entries=2 * n * m - 1))
    assert not use_pair_grid(qm @ s * 1e-3, km)  # too sparse: fastRG's cells


def _poisson_by_inversion_one_pass_at_a_time(rates, rng):
    """The inversion as it was before its first pass ran over every candidate (commit
    1894721): every pass over the undecided rates only, int64 counts."""
    limit = 16.0
    counts = np.zeros(rates.size, dtype=np.int64)
    u = rng.random(rates.size)
    large = rates > limit
    has_large = bool(large.any())
    candidate = u >= 1.0 - rates
    if has_large:
        candidate &= ~large
    live = np.flatnonzero(candidate)
    r = rates.take(live)
    term = np.exp(-r)
    rest = u.take(live) - term
    passes = 0
    while live.size:
        keep = np.flatnonzero(rest >= 0)
        live, r, term, rest = live.take(keep), r.take(keep), term.take(keep), rest.take(keep)
        passes += 1
        counts[live] = passes
        if passes > 16 * limit:
            break
        term *= r
        term /= passes
        rest -= term
    if has_large:
        counts[large] = rng.poisson(rates[large])
    return counts


def test_poisson_by_inversion_is_bit_identical_to_one_pass_at_a_time():
    """The inversion with its first pass over every candidate, in blocks of rates, gives
    the counts of the pass-at-a-time loop over all the rates at once bit for bit, as
    int64 and as float32 / float64 numbers, and leaves the stream where that loop left
    it: empty, zero, tiny, small, mixed and large rates (through the switch to numpy's
    sampler above 16, whose rates may fall in several blocks), in the default block, an
    odd one and (for the short cases) one rate per block."""
    from companion.sbm.fastrg import _INVERSION_BLOCK, _poisson_by_inversion

    gen = np.random.Generator(np.random.PCG64(5))
    cases = [np.zeros(0), np.zeros(7), np.full(1000, 1e-12), gen.uniform(0, 1e-8, 999),
             gen.uniform(0, 1, 20001), gen.uniform(0.2, 0.3, 20000),
             gen.exponential(0.01, 20000), np.full(5000, 15.999),
             np.concatenate([gen.uniform(0, 40, 3001), [16.0, np.nextafter(16.0, 17), 0.0]])]
    for rates in cases:
        for seed in range(3):
            old = np.random.Generator(np.random.PCG64(seed))
            want = _poisson_by_inversion_one_pass_at_a_time(rates, old)
            blocks = (_INVERSION_BLOCK, 997) + ((1,) if rates.size <= 1000 else ())
            for dtype in (np.int64, np.float32, np.float64):
                for block in blocks:
                    new = np.random.Generator(np.random.PCG64(seed))
                    got = _poisson_by_inversion(rates, new, dtype, block)
                    assert got.dtype == dtype
                    assert np.array_equal(got, want.astype(dtype)), (rates.size, block)
                    assert new.bit_generator.state == old.bit_generator.state
    with pytest.raises(ValueError, match="block"):
        _poisson_by_inversion(np.ones(3), np.random.Generator(np.random.PCG64(0)), block=0)


def test_poisson_by_inversion_reads_float32_rates_as_their_float64_copies():
    """float32 rates (the pair grid's P straight from its float32 GEMM) give the counts
    and the stream position of their exact float64 copies, bit for bit: zero, tiny, small
    (where the ``u < 1 - r`` shortcut decides), and large ones (numpy's sampler above 16)."""
    from companion.sbm.fastrg import _poisson_by_inversion

    gen = np.random.Generator(np.random.PCG64(7))
    cases = [np.zeros(0), np.full(999, 1e-9), gen.uniform(0, 1e-3, 5001),
             gen.uniform(0.2, 0.3, 20001),
             np.concatenate([gen.uniform(0, 40, 3001), [16.0, np.nextafter(16.0, 17), 0.0]])]
    for rates in cases:
        rates32 = rates.astype(np.float32)
        for seed in range(3):
            for dtype, block in ((np.int64, 1 << 16), (np.float32, 1 << 16), (np.int64, 997)):
                old = np.random.Generator(np.random.PCG64(seed))
                want = _poisson_by_inversion(rates32.astype(np.float64), old, dtype, block)
                new = np.random.Generator(np.random.PCG64(seed))
                got = _poisson_by_inversion(rates32, new, dtype, block)
                assert got.dtype == dtype and np.array_equal(got, want)
                assert new.bit_generator.state == old.bit_generator.state


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("cpu_poisson", ["inversion", "torch"])
def test_pair_counts_as_floats_equal_the_int64_counts(dtype, cpu_poisson):
    """poisson_pair_counts(dtype=float) gives the int64 counts of the same seed as
    numbers, on both Poisson sources; other dtypes are refused with the parameter named."""
    qm, s, km = (t.to(dtype) for t in _random_sbm(9, 7, 3, heads=2, seed=4))
    tuning = FastRGTuning(cpu_poisson=cpu_poisson)
    gen = lambda: torch.Generator().manual_seed(11)  # noqa: E731
    want = poisson_pair_counts(qm, s, km, gen(), tuning=tuning)
    for count_dtype in (torch.float32, torch.float64, torch.float16):
        got = poisson_pair_counts(qm, s, km, gen(), tuning=tuning, dtype=count_dtype)
        assert got.dtype == count_dtype and torch.equal(got, want.to(count_dtype))
    with pytest.raises(TypeError, match="dtype"):
        poisson_pair_counts(qm, s, km, gen(), dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("duplicates, self_loops, padded, loss_uses",
                         [("keep", False, False, "both"), ("merge", False, True, "both"),
                          ("keep", True, True, "both"), ("keep", False, True, "output"),
                          ("merge", True, False, "density")])
def test_sbm_attention_pair_grid_is_bit_identical_to_int64_counts(dtype, duplicates,
                                                                  self_loops, padded,
                                                                  loss_uses):
    """The pair-grid forward with the counts drawn as float weights gives the outputs,
    densities and every gradient of the former path (int64 counts converted; the
    straight-through counts, the count attention and the density's sum as three autograd
    nodes, not the layer's one) bit for bit, whether the loss reads the output, the
    density or both; its absent-pair bias ``(min(w, 1) - 1) 1e30`` equals the
    masked_fill bias of 042a95f..3483a16 (``-1e30`` where ``w = 0``, ``+0`` elsewhere)."""
    from companion.sbm.fastrg import use_pair_grid as pair_grid
    from companion.sbm.layer import _absent_bias, _CountAttention, _DenseStraightThrough

    torch.manual_seed(0)
    batch, heads, n, d = 3, 2, 11, 4
    layer = SBMAttention(d, heads, 3, duplicates=duplicates, self_loops=self_loops,
                         dtype=dtype)
    q, k, v = (torch.randn(batch, heads, n, d, dtype=dtype, requires_grad=True)
               for _ in range(3))
    valid = torch.ones(batch, n, dtype=torch.bool)
    if padded:
        valid[0, -3:] = False
    masks = dict(query_valid=valid, key_valid=valid) if padded else {}

    def former():
        qm, s, km = sbm_parameters(q, k, layer.cluster_embeddings, layer.mlp)
        if padded:
            qm = qm * valid[:, None, :, None].to(qm.dtype)
            km = km * valid[:, None, :, None].to(km.dtype)
        qs = qm @ s
        assert pair_grid(qs.detach(), km.detach(), layer.tuning)
        counts = poisson_pair_counts(qm.detach(), s.detach(), km.detach(),
                                     torch.Generator().manual_seed(3), q_times_s=qs.detach())
        if self_loops:
            loops = torch.eye(n, dtype=torch.bool).expand(batch, n, n)
            if padded:
                loops = loops & valid[:, :, None] & valid[:, None, :]
            counts = counts + loops[:, None].to(counts.dtype)
        if duplicates == "merge":
            counts = counts.clamp_(max=1)
        groups = batch * heads
        weights = counts.reshape(groups, n, n).to(dtype)
        present = weights.clamp(max=1.0)  # as the layer forms it
        absent_bias = _absent_bias(present)
        # the bias of 042a95f..3483a16: the same numbers, signs of zero included
        filled = torch.zeros_like(weights).masked_fill_(weights == 0, -1e30)
        assert torch.equal(absent_bias, filled)
        assert torch.equal(absent_bias.signbit(), filled.signbit())
        weights = _DenseStraightThrough.apply(qs.reshape(groups, n, -1),
                                              km.reshape(groups, n, -1), weights)
        out = _CountAttention.apply(q.reshape(groups, n, d), k.reshape(groups, n, d),
                                    v.reshape(groups, n, d), weights, present,
                                    1.0 / math.sqrt(d)).reshape(batch, heads, n, d)
        pairs = (valid.sum(1).to(dtype) ** 2).clamp(min=1)
        return out, weights.sum((1, 2)).reshape(batch, heads) / pairs[:, None]

    def now():
        return layer(q, k, v, generator=torch.Generator().manual_seed(3), **masks)

    results = []
    for run in (former, now):
        out, density = run()
        params = [q, k, v, *layer.parameters()]
        loss = {"output": (out * torch.linspace(-1, 1, d, dtype=dtype)).sum(),
                "density": 10 * density.sum()}
        loss["both"] = loss["output"] + loss["density"]
        grads = torch.autograd.grad(loss[loss_uses], params, allow_unused=True)
        results.append((out, density, grads))
    (out0, dens0, grads0), (out1, dens1, grads1) = results
    # the same parameters get no gradient (None: AdamW then leaves them alone)
    assert [g is None for g in grads0] == [g is None for g in grads1]
    grads0, grads1 = ([torch.zeros_like(p) if g is None else g for p, g in zip(params, gs)]
                      for gs in (grads0, grads1))
    assert torch.equal(out0, out1) and torch.equal(dens0, dens1)
    for g0, g1 in zip(grads0, grads1):
        assert torch.equal(g0, g1)


def _count_attention_clamped_only(q, k, v, weights, absent_bias, scale):
    """The count attention's forward as it was up to 905e8a0: exponents clamped at -80
    everywhere, so an absent pair kept ``u = exp(-80) / Z`` (the reference for the
    present pairs' numbers)."""
    acc = weights.dtype
    qa, ka, va = q.to(acc), k.to(acc), v.to(acc)
    u = torch.baddbmm(absent_bias, qa, ka.transpose(1, 2).contiguous(), alpha=scale)
    u.sub_(u.amax(-1, keepdim=True)).clamp_(min=-80.0).exp_()
    total = torch.mul(u, weights).sum(-1, keepdim=True)
    u.mul_(torch.where(total > 0, 1.0 / total, torch.zeros_like(total)))
    attn = u * weights
    out = torch.bmm(attn, va)
    return out.to(q.dtype), (qa, ka, va, weights, u, attn, out)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_count_attention_absent_pairs_are_exact_zeros(dtype):
    """The count attention sets ``u = 0`` on absent pairs (it was exp(-80) / Z, which the
    backward turned into subnormal numbers, slow on Intel processors): the output, the
    attention and every gradient the layer uses (q, k, v, and the weights' gradient on the
    present pairs, the only ones the straight-through rule passes on) are those of the
    former clamp-only formula bit for bit, signs of zero included, and the absent pairs'
    gradients are exact zeros (where the former made subnormal numbers). Odd sizes, a row
    without any pair, counts up to 3, scores far apart (some present pairs below the -80
    clamp)."""
    from companion.sbm.layer import _count_attention_backward, _count_attention_forward

    gen = torch.Generator().manual_seed(4)
    groups, n, m, d = 3, 7, 11, 5
    q = torch.randn(groups, n, d, generator=gen, dtype=dtype) * 6
    k = torch.randn(groups, m, d, generator=gen, dtype=dtype) * 6
    v = torch.randn(groups, m, d, generator=gen, dtype=dtype)
    weights = torch.randint(0, 4, (groups, n, m), generator=gen).to(dtype)
    weights *= torch.rand(groups, n, m, generator=gen, dtype=dtype) < 0.4
    weights[1, 2] = 0  # a query without pairs: a zero row
    absent_bias = weights.clamp(max=1.0).sub_(1.0).mul_(1e30)  # the former layer's bias
    present = weights.clamp(max=1.0)
    scale = d ** -0.5
    out, saved = _count_attention_forward(q, k, v, weights, present, scale)
    out0, saved0 = _count_attention_clamped_only(q, k, v, weights, absent_bias, scale)
    u, u0 = saved[4], saved0[4]
    # the test means something: pairs below the clamp, and absent pairs that were tiny
    s = torch.baddbmm(absent_bias, q, k.transpose(1, 2), alpha=scale)
    below = (s - s.amax(-1, keepdim=True) < -80) & (weights > 0)
    assert below.any() and (u0[weights == 0] > 0).any()
    assert torch.equal(out, out0) and torch.equal(saved[5], saved0[5])
    assert torch.equal(u[weights > 0], u0[weights > 0]) and not u[weights == 0].any()
    grad_out = torch.randn(groups, n, d, generator=gen, dtype=dtype) * 1e-3
    grads = _count_attention_backward(saved, grad_out, scale, (dtype,) * 3)
    grads0 = _count_attention_backward(saved0, grad_out, scale, (dtype,) * 3)
    for name, g, g0 in zip(("q", "k", "v"), grads, grads0):
        assert torch.equal(g, g0) and torch.equal(g.signbit(), g0.signbit()), name
    grad_w, grad_w0 = grads[3], grads0[3]
    assert torch.equal(grad_w[weights > 0], grad_w0[weights > 0])
    assert torch.equal(grads[4], grads0[4]) and torch.equal(grads[4].signbit(),
                                                              grads0[4].signbit())
    # on the absent pairs exact zeros now (a present pair far below its row's maximum
    # may still give a subnormal number: rare, and the same as before)
    assert not grad_w[weights == 0].any() and not grads[4][weights == 0].any()
    if dtype == torch.float32:  # where the former formula made subnormal numbers
        tiny = torch.finfo(dtype).tiny
        absent = grad_w0[weights == 0]
        assert ((absent != 0) & (absent.abs() < tiny)).any()


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_sbm_parameters_on_projection_views_equal_contiguous_copies(dtype):
    """SBMAttention copies q and k to contiguous before the MLP (3483a16 ran the MLP on
    the fused projection's strided views): memberships, block matrix and every gradient
    are bit for bit those of the views (odd sizes)."""
    torch.manual_seed(1)
    batch, heads, n, d, clusters = 3, 2, 13, 5, 7
    layer = SBMAttention(d, heads, clusters, dtype=dtype)
    x = torch.randn(batch, n, 3 * heads * d, dtype=dtype, requires_grad=True)
    results = []
    for contiguous in (False, True):
        q, k, _ = x.reshape(batch, n, 3, heads, d).permute(2, 0, 3, 1, 4).unbind(0)
        assert not q.is_contiguous()
        if contiguous:
            q, k = q.contiguous(), k.contiguous()
        qm, s, km = sbm_parameters(q, k, layer.cluster_embeddings, layer.mlp)
        loss = (qm * torch.linspace(-1, 1, clusters, dtype=dtype)).sum() + km.square().sum() \
            + (s * s).sum()
        grads = torch.autograd.grad(loss, [x, *layer.parameters()])
        results.append((qm, s, km, *grads))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, F64, torch.float16])
@pytest.mark.parametrize("shape", [(3, 5, 7), (1, 1, 1), (2, 0, 3), (4, 13, 2), (2, 128, 3),
                                   (3, 300, 5), (1, 257, 0)])
def test_transposed_copy_equals_torch_transpose_contiguous(dtype, shape):
    """transposed_copy (numpy's strided copy on CPU, in tiles of rows past 128) is
    ``x.transpose(1, 2).contiguous()`` bit for bit, from contiguous, strided and
    negated-view inputs (odd and empty sizes, one tile and a last partial one; float16
    takes torch's copy), contiguous itself, never sharing the input's memory, and without
    grad for an input that requires it."""
    from companion.sbm.fastrg import transposed_copy

    g = torch.Generator().manual_seed(2)
    x = torch.randn(*shape, generator=g, dtype=F64).to(dtype)
    strided = torch.randn(shape[2], shape[0], shape[1], generator=g,
                          dtype=F64).to(dtype).permute(1, 2, 0)
    # x._neg_view(): a lazily negated view, which numpy cannot read (torch's copy then)
    for t in (x, strided, x.clone().requires_grad_(dtype != torch.float16), x._neg_view()):
        got = transposed_copy(t)
        want = t.detach().transpose(1, 2).contiguous().resolve_neg()
        assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
        assert torch.equal(got, want) and not got.requires_grad
        if t.numel():  # a copy, never a view of the input (size-1 dimensions included)
            assert got.data_ptr() != t.data_ptr()


def test_finite_sum_decides_as_the_float64_sum():
    """The pair grid's overflow check (min/max for float32 rates) says what the float64
    sum of the rates said: finite, +-inf, NaN, empty, the largest float32 numbers (whose
    float64 sum is finite) and float64 numbers whose sum overflows."""
    from companion.sbm.fastrg import _finite_sum

    big32 = torch.finfo(torch.float32).max
    cases = [torch.zeros(0), torch.rand(1001), torch.full((999,), big32),
             torch.tensor([1.0, math.inf]), torch.tensor([-math.inf, 2.0]),
             torch.tensor([0.5, math.nan, 1.0]), torch.tensor([math.inf, -math.inf]),
             torch.tensor([1e308, 1e308], dtype=F64), torch.tensor([1e308, 1.0], dtype=F64),
             torch.tensor([1.0, math.nan], dtype=F64), torch.zeros(0, dtype=F64)]
    for p in cases:
        assert _finite_sum(p) == bool(torch.isfinite(p.sum(dtype=F64))), p


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_pair_counts_refuse_overflowing_rates(dtype):
    """Memberships whose ``P = Qhat S Khat^T`` overflows (finite inputs) are refused with
    the sampler's message, in float32 and float64."""
    big = torch.finfo(dtype).max ** 0.75
    qm = torch.full((1, 2, 5, 3), big, dtype=dtype)
    km = torch.full((1, 2, 4, 3), big, dtype=dtype)
    s = torch.full((2, 3, 3), 1 / 9, dtype=dtype)
    with pytest.raises(ValueError, match="expected edge count overflows"):
        poisson_pair_counts(qm, s, km, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("pad_id", [None, 0])
def test_lra_training_is_bit_identical_to_the_former_copies_and_checks(dtype, pad_id,
                                                                       monkeypatch):
    """Four AdamW steps of a small pair-grid LRA model give the losses, logits,
    densities, every gradient, the parameters and the sampled edges of the former code
    (torch's transposing copies, the float64 sum as the overflow check) bit for bit."""
    from companion.lra.model import LRAClassifier
    from companion.sbm import fastrg, layer

    def train():
        torch.manual_seed(0)
        model = LRAClassifier(4, 23, 2, attention="sbm", dim=12, heads=2, head_dim=6,
                              ffn=16, num_clusters=5, pad_id=pad_id, dropout=0.0,
                              dtype=dtype)
        optimiser = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, 4, (3, 23), generator=torch.Generator().manual_seed(2))
        labels = torch.tensor([0, 1, 1])
        record = []
        for step in range(4):
            model.set_record(step == 3)
            logits, densities = model(tokens, generator=gen)
            loss = torch.nn.functional.cross_entropy(logits, labels) \
                + density_regularizer(densities, 1e-2)
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            optimiser.step()
            record += [loss, logits, *densities,
                       *(p.grad for p in model.parameters()), *model.parameters()]
        for edges in model.last_edges():
            record += list(edges)
        return [t.detach().clone() for t in record]

    now = train()
    former_copy = lambda x: x.detach().transpose(1, 2).contiguous()  # noqa: E731
    monkeypatch.setattr(fastrg, "transposed_copy", former_copy)
    monkeypatch.setattr(layer, "transposed_copy", former_copy)
    monkeypatch.setattr(fastrg, "_finite_sum",
                        lambda p: bool(torch.isfinite(p.sum(dtype=torch.float64))))
    former = train()
    assert len(now) == len(former)
    for a, b in zip(now, former):
        assert a.dtype == b.dtype and torch.equal(a, b)
