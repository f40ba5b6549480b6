"""Tests of companion.sbm.graph_attention in float32 and float64 against independent
references: a dense float64 masked softmax with edge counts as multiplicities (written
here, not the library's dense_masked_attention), torch SDPA with a boolean mask, and
torch.autograd.gradcheck.

Every test takes a ``device``; CUDA variants are skipped without a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from companion.sbm.graph_attention import edge_attention

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]
DTYPES = [torch.float32, torch.float64]
INDEX_DTYPES = [torch.int64, torch.int32]
F64 = torch.float64
# forward / gradient tolerances against the float64 reference, per input dtype
TOL = {torch.float32: {"rtol": 2e-5, "atol": 2e-6}, F64: {"rtol": 1e-11, "atol": 1e-13}}


def _reference(q, k, v, counts, weight=None, scale=None):
    """Dense float64 edge attention: out_i = sum_j c_ij w_ij e^{s_ij} v_j / sum_j c_ij
    w_ij e^{s_ij} with multiplicities ``counts`` [G, n, m] and optional per-pair weights
    ``weight`` (same shape); rows without an edge are zero.  Differentiable (the row
    maximum only stabilises and is a constant for the gradient)."""
    q, k, v = (t.to(F64) for t in (q, k, v))
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    mult = counts.to(F64) if weight is None else counts.to(F64) * weight
    present = counts > 0
    row_max = scores.detach().masked_fill(~present, -math.inf).amax(-1, keepdim=True)
    row_max = torch.where(present.any(-1, keepdim=True), row_max, 0.0)
    unnorm = mult * torch.exp(scores - row_max)
    total = unnorm.sum(-1, keepdim=True)
    return (unnorm / torch.where(total > 0, total, 1.0)) @ v


def _counts(edges, groups, n, m):
    g, i, j = edges
    flat = (g * n + i) * m + j
    return torch.bincount(flat, minlength=groups * n * m).reshape(groups, n, m)


def _inputs(groups, n, m, d, dv, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(groups, length, width, generator=gen, dtype=F64)
        for length, width in ((n, d), (m, d), (m, dv))
    )
    return [t.to(dtype=dtype, device=device).requires_grad_() for t in (q, k, v)]


def _multigraph(groups, n, m, num_edges, empty_rows, device, seed):
    """A random edge list in random order with many repeated pairs, and no edge for the
    queries ``empty_rows`` of every group."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([i for i in range(n) if i not in empty_rows])
    group = torch.randint(0, groups, (num_edges,), generator=gen)
    query = allowed[torch.randint(0, allowed.numel(), (num_edges,), generator=gen)]
    key = torch.randint(0, m, (num_edges,), generator=gen)
    return tuple(t.to(device) for t in (group, query, key))


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_edge_attention_matches_dense_float64_reference(device, dtype, weighted, index_dtype):
    """Odd sizes (3 groups, n = 7, m = 5, d = 3, d_v = 5), edges unsorted, repeated
    pairs (counted with multiplicity), two queries with no edge (zero rows, zero
    gradient), optional edge weights, int64 and int32 edge indices: output and the
    gradients of q, k, v (and of the weights) equal the dense float64 reference, in the
    input's dtype; no input and no incoming gradient is written."""
    groups, n, m, d, dv = 3, 7, 5, 3, 5
    q, k, v = _inputs(groups, n, m, d, dv, dtype, device, seed=0)
    edges = _multigraph(groups, n, m, 60, empty_rows=(2, 6), device=device, seed=1)
    counts = _counts(edges, groups, n, m)
    edges = tuple(t.to(index_dtype) for t in edges)
    assert int(counts.max()) > 1  # duplicates present
    weight = weight_dense = None
    if weighted:
        gen = torch.Generator().manual_seed(2)
        weight = (0.1 + torch.rand(edges[0].numel(), generator=gen, dtype=F64)).to(
            dtype=dtype, device=device
        )
        weight.requires_grad_()
    # the reference runs on float64 leaves holding the same values
    leaves = [q, k, v] + ([weight] if weighted else [])
    leaves64 = [t.detach().to(F64).requires_grad_() for t in leaves]
    if weighted:
        # each copy of a pair has its own weight and the pair weighs their sum: the
        # reference's per-pair weight is that sum over the count
        flat = (edges[0].long() * n + edges[1]) * m + edges[2]
        weight_dense = torch.zeros(groups * n * m, dtype=F64, device=device).index_add(
            0, flat, leaves64[3]
        ).reshape(groups, n, m) / counts.clamp(min=1)
    before = [t.detach().clone() for t in (q, k, v)]

    out = edge_attention(q, k, v, edges, edge_weight=weight)
    ref = _reference(*leaves64[:3], counts, weight_dense)
    assert out.dtype == dtype and out.shape == (groups, n, dv)
    torch.testing.assert_close(out.to(F64), ref, **TOL[dtype])
    assert bool((out[:, [2, 6]] == 0).all())

    grad_out = torch.randn(groups, n, dv, generator=torch.Generator().manual_seed(3), dtype=F64)
    grad_out_given = grad_out.to(dtype=dtype, device=device)
    kept = grad_out_given.clone()
    got = torch.autograd.grad(out, leaves, grad_out_given)
    expect = torch.autograd.grad(ref, leaves64, grad_out.to(device))
    for name, a, b in zip("qkvw", got, expect):
        assert a.dtype == dtype, name
        torch.testing.assert_close(a.to(F64), b, **TOL[dtype], msg=lambda s: f"{name}: {s}")
    assert bool((got[0][:, [2, 6]] == 0).all())  # queries without edges get no gradient
    for before_t, after_t in zip(before + [kept], [q, k, v, grad_out_given]):
        assert torch.equal(before_t, after_t.detach())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_edge_attention_matches_sdpa_with_a_boolean_mask(device, dtype):
    """Without duplicates the edge list is a boolean mask: rows with at least one edge
    equal torch SDPA (a peer implementation) in output and gradients, in the input's
    dtype; rows without an edge are zero here (SDPA's value there is not compared)."""
    B, H, n, m, d = 2, 3, 9, 11, 5
    gen = torch.Generator().manual_seed(4)
    q, k, v = (
        torch.randn(B, H, length, d, generator=gen, dtype=F64)
        .to(dtype=dtype, device=device)
        .requires_grad_()
        for length in (n, m, m)
    )
    mask = torch.rand(B, H, n, m, generator=gen) < 0.35
    mask[0, 1, 4] = False  # one query without a key
    mask = mask.to(device)
    g, i, j = mask.reshape(B * H, n, m).nonzero(as_tuple=True)
    out = edge_attention(q, k, v, (g, i, j))
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    has_edge = mask.any(-1)
    tol = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, F64: {"rtol": 1e-12, "atol": 1e-13}}
    torch.testing.assert_close(out[has_edge], sdpa[has_edge], **tol[dtype])
    assert bool((out[~has_edge] == 0).all())
    grad_out = torch.randn(B, H, n, d, generator=gen, dtype=F64).to(dtype=dtype, device=device)
    grad_out = grad_out * has_edge[..., None]  # the empty row's SDPA value plays no part
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    expect = torch.autograd.grad(sdpa, (q, k, v), grad_out)
    for name, a, b in zip("qkv", got, expect):
        torch.testing.assert_close(a, b, **tol[dtype], msg=lambda s: f"{name}: {s}")


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_edge_attention_empty_edge_list(device, dtype, index_dtype):
    """No edge at all: a zero output of the input's dtype and zero (not missing)
    gradients for q, k, v and the (empty) weights."""
    q, k, v = _inputs(2, 4, 3, 5, 2, dtype, device, seed=5)
    none = torch.zeros(0, dtype=index_dtype, device=device)
    weight = torch.zeros(0, dtype=dtype, device=device, requires_grad=True)
    out = edge_attention(q, k, v, (none, none, none), edge_weight=weight)
    assert out.dtype == dtype and out.shape == (2, 4, 2) and bool((out == 0).all())
    grads = torch.autograd.grad(out.sum(), (q, k, v, weight))
    for t, g in zip((q, k, v, weight), grads):
        assert g.shape == t.shape and g.dtype == dtype and bool((g == 0).all())


def test_edge_attention_gradcheck_unsorted_multigraph():
    """torch.autograd.gradcheck (finite differences, float64) on a tiny unsorted
    multigraph with an empty row, odd sizes and weights, with and without ``scale``."""
    groups, n, m, d, dv = 2, 5, 3, 3, 1
    q, k, v = _inputs(groups, n, m, d, dv, F64, "cpu", seed=6)
    edges = _multigraph(groups, n, m, 14, empty_rows=(1,), device="cpu", seed=7)
    w = 0.2 + torch.rand(14, generator=torch.Generator().manual_seed(8), dtype=F64)
    w.requires_grad_()
    for scale in (None, 0.3):
        assert torch.autograd.gradcheck(
            lambda q, k, v, w: edge_attention(q, k, v, edges, edge_weight=w, scale=scale),
            (q, k, v, w),
        )


def test_edge_attention_float32_agrees_with_float64():
    """The same problem in both dtypes (inputs representable in float32): the float32
    result is the float64 one to float32 accuracy, scores up to about 30 included
    (float32 accumulates in float32; the shift by the row maximum keeps exp finite)."""
    groups, n, m, d, dv = 4, 33, 17, 8, 6
    q64, k64, v64 = _inputs(groups, n, m, d, dv, F64, "cpu", seed=9)
    q64 = (q64.detach() * 4).float().double().requires_grad_()  # scores ~ 30
    k64 = k64.detach().float().double().requires_grad_()
    v64 = v64.detach().float().double().requires_grad_()
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q64, k64, v64))
    edges = _multigraph(groups, n, m, 700, empty_rows=(0, 32), device="cpu", seed=10)
    out64 = edge_attention(q64, k64, v64, edges)
    out32 = edge_attention(q32, k32, v32, edges)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), out64, rtol=1e-5, atol=1e-5)
    for a, b in zip(
        torch.autograd.grad(out32.sum(), (q32, k32, v32)),
        torch.autograd.grad(out64.sum(), (q64, k64, v64)),
    ):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_attention_int32_edges_give_the_int64_numbers(dtype):
    """The same edges as int32 and as int64 (sorted as the sampler gives them, and
    unsorted): the same output and gradients, bit for bit."""
    groups, n, m, d, dv = 3, 9, 11, 4, 3
    for seed, ordered in ((11, True), (12, False)):
        edges = _multigraph(groups, n, m, 200, empty_rows=(4,), device="cpu", seed=seed)
        if ordered:
            order = torch.argsort(edges[0] * n + edges[1], stable=True)
            edges = tuple(t[order] for t in edges)
        results = []
        for index_dtype in INDEX_DTYPES:
            q, k, v = _inputs(groups, n, m, d, dv, dtype, "cpu", seed=13)
            out = edge_attention(q, k, v, tuple(t.to(index_dtype) for t in edges))
            results.append([out, *torch.autograd.grad(out.square().sum(), (q, k, v))])
        for wide, narrow in zip(*results):
            assert torch.equal(wide, narrow)


def test_edge_attention_names_the_edge_of_another_index_dtype():
    """Three int32 indices or three int64 ones: a mix, or another integer dtype, is
    refused with the edge named."""
    q, kv = torch.randn(1, 4, 3), torch.randn(1, 5, 3)
    e = (torch.zeros(2, dtype=torch.int64), torch.tensor([0, 3]), torch.tensor([1, 4]))
    with pytest.raises(TypeError, match=r"^edges\[key\]: expected a 1-D torch.int64"):
        edge_attention(q, kv, kv, (e[0], e[1], e[2].int()))
    with pytest.raises(TypeError, match=r"^edges\[query\]: expected a 1-D torch.int32"):
        edge_attention(q, kv, kv, (e[0].int(), e[1], e[2].int()))
    with pytest.raises(TypeError, match=r"^edges\[group\]: expected a 1-D torch.int64"):
        edge_attention(q, kv, kv, tuple(t.to(torch.int16) for t in e))


def test_edge_attention_rejects_mixed_dtypes():
    q = torch.randn(1, 4, 3)
    kv = torch.randn(1, 5, 3, dtype=F64)
    e = (torch.zeros(1, dtype=torch.int64), torch.tensor([0]), torch.tensor([1]))
    with pytest.raises(TypeError, match="q, k, v: expected one dtype"):
        edge_attention(q, kv, kv, e)


def test_edge_attention_bad_scale_weights_and_meta_tensors():
    """Each bad input raises with a message naming the parameter."""
    q, k, v = (torch.randn(1, length, 3) for length in (4, 5, 5))
    e = (torch.zeros(2, dtype=torch.int64), torch.tensor([0, 3]), torch.tensor([1, 4]))
    cases = [
        ({"scale": "x"}, TypeError, r"^scale: expected a positive finite number or None"),
        ({"scale": True}, TypeError, r"^scale: expected a positive finite number or None"),
        ({"scale": float("nan")}, ValueError, r"^scale: expected a positive finite number"),
        ({"scale": 0.0}, ValueError, r"^scale: expected a positive finite number"),
        ({"edge_weight": [1.0, 1.0]}, TypeError, r"^edge_weight: expected a floating-point"),
        ({"edge_weight": torch.ones(2, dtype=torch.int64)}, TypeError, r"^edge_weight: .*dtype"),
        ({"edge_weight": torch.tensor([-1.0, 1.0])}, ValueError, r"^edge_weight: .*nonnegative"),
        ({"edge_weight": torch.tensor([1.0, math.nan])}, ValueError, r"^edge_weight: .*finite"),
        ({"edge_weight": torch.tensor([1.0, math.inf])}, ValueError, r"^edge_weight: .*finite"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            edge_attention(q, k, v, e, **kwargs)
    with pytest.raises(ValueError, match=r"^q: expected a tensor with values, got one on the meta"):
        edge_attention(q.to("meta"), k.to("meta"), v.to("meta"), tuple(t.to("meta") for t in e))
    from companion.sbm.reference import dense_masked_attention

    with pytest.raises(ValueError, match=r"^q: expected \[\.\.\., length, dim\], got shape \(2,\)"):
        dense_masked_attention(torch.ones(2), k, v, torch.ones(4, 5, dtype=torch.bool))
