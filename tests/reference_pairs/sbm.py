"""(fast, reference) pairs of ``companion.sbm``: attention over a sampled edge list against
dense masked attention (forward, and the gradients of queries, keys, values and edge
weights), the layer's dense count-matrix attention (the pair-grid path of
:class:`companion.sbm.SBMAttention`) against the same reference, and the batched edge
probabilities against the dense ``P = Qhat S Khat^T``.

The graphs are drawn by fastRG itself, with duplicate pairs kept (a pair drawn ``c``
times weighs ``c`` in both) or merged, at about two edges per query: some queries get no
edge (their rows are zero in both) and, with few keys, many pairs repeat.
"""
from __future__ import annotations

import torch

from companion.sbm import dense_masked_attention, edge_attention, edge_probabilities, fastrg_sample
from companion.sbm.reference import dense_edge_counts, dense_edge_probabilities
from companion.sbm.tensor_ops import repeat_each, stable_argsort, transposed_copy
from reference_pairs import Pair

# (batch, heads, n, m, head size, duplicates); odd sizes, a single query, few keys (many
# duplicates), and an edge list that is empty (no query gets an edge)
ATTENTION_SIZES = [
    (1, 1, 1, 4, 4, "keep"),
    (2, 3, 7, 5, 4, "keep"),
    (2, 3, 7, 5, 4, "merge"),
    (1, 2, 33, 17, 8, "keep"),
    (1, 2, 33, 17, 8, "merge"),
    (1, 1, 5, 4, 3, "empty"),
]


def _edges(batch, heads, n, m, duplicates, generator):
    """A fastRG graph with about two edges per query (on the CPU)."""
    clusters = 3
    qm = torch.rand(batch, heads, n, clusters, generator=generator, dtype=torch.float64)
    km = torch.rand(batch, heads, m, clusters, generator=generator, dtype=torch.float64)
    s = torch.softmax(torch.randn(heads, clusters * clusters, generator=generator,
                                  dtype=torch.float64), -1).reshape(heads, clusters, clusters)
    if duplicates == "empty":
        s = torch.zeros_like(s)  # P = 0: no edge at all
    # E[edges per query] = sum_j P_ij: scale S so that it is about two
    s = s * (2.0 / max(float(km.sum(2).mean()) * float(qm.mean()), 1e-12))
    return fastrg_sample(qm, s, km, generator,
                         duplicates="merge" if duplicates == "merge" else "keep")


def _make_attention(size, dtype, device, generator):
    batch, heads, n, m, d, duplicates = size
    edges = _edges(batch, heads, n, m, duplicates, generator)
    q = torch.randn(batch, heads, n, d, generator=generator, dtype=dtype)
    k = torch.randn(batch, heads, m, d, generator=generator, dtype=dtype)
    v = torch.randn(batch, heads, m, d + 1, generator=generator, dtype=dtype)
    weight = torch.rand(edges[0].numel(), generator=generator, dtype=dtype) + 0.5
    grad_out = torch.randn(batch, heads, n, d + 1, generator=generator, dtype=dtype)
    return tuple(x.to(device) for x in (q, k, v, *edges, weight, grad_out))


def _dense_mask(q, k, group, query, key, weight):
    """The ``[..., n, m]`` mask of the edge list: the sum of the weights of the copies of
    every pair (differentiable in the weights)."""
    lead, n, m = q.shape[:-2], q.shape[-2], k.shape[-2]
    groups = q[..., 0, 0].numel()
    mask = torch.zeros(groups, n, m, dtype=weight.dtype, device=weight.device)
    mask = mask.index_put((group, query, key), weight, accumulate=True)
    return mask.reshape(*lead, n, m)


def edge_forward(q, k, v, group, query, key, weight, grad_out):
    return edge_attention(q, k, v, (group, query, key))


def dense_forward(q, k, v, group, query, key, weight, grad_out):
    groups = q[..., 0, 0].numel()
    counts = dense_edge_counts((group, query, key), groups, q.shape[-2], k.shape[-2])
    mask = counts.reshape(*q.shape[:-2], q.shape[-2], k.shape[-2]).to(q.dtype)
    return dense_masked_attention(q, k, v, mask)


def _grads(attend, q, k, v, weight, grad_out):
    inputs = [t.detach().requires_grad_(True) for t in (q, k, v, weight)]
    out = attend(*inputs)
    return torch.autograd.grad(out, inputs, grad_out, allow_unused=True)


def edge_gradients(q, k, v, group, query, key, weight, grad_out):
    """Gradients of ``<grad_out, out>`` in q, k, v and the edge weights, edge path."""
    def attend(q, k, v, w):
        return edge_attention(q, k, v, (group, query, key), edge_weight=w)
    grads = _grads(attend, q, k, v, weight, grad_out)
    # an empty edge list leaves the weights out of the graph: their gradient is empty
    return tuple(torch.zeros_like(weight) if g is None else g for g in grads)


def dense_gradients(q, k, v, group, query, key, weight, grad_out):
    """The same gradients through dense masked attention; a weight's gradient is its
    pair's mask entry's (every copy of a pair moves that entry alike)."""
    def attend(q, k, v, w):
        return dense_masked_attention(q, k, v, _dense_mask(q, k, group, query, key, w))
    grads = _grads(attend, q, k, v, weight, grad_out)
    return tuple(torch.zeros_like(weight) if g is None else g for g in grads)


def _count_attention(q, k, v, mask):
    """The layer's pair-grid attention on a dense weight matrix ``mask`` ``[..., n, m]``."""
    from companion.sbm.layer import _CountAttention

    lead, n, m, d = q.shape[:-2], q.shape[-2], k.shape[-2], q.shape[-1]
    groups = q[..., 0, 0].numel()
    acc = torch.promote_types(q.dtype, torch.float32)
    weights = mask.reshape(groups, n, m).to(acc)
    present = (weights.detach() > 0).to(acc)
    out = _CountAttention.apply(q.reshape(groups, n, d), k.reshape(groups, m, d),
                                v.reshape(groups, m, -1), weights, present, d**-0.5)
    return out.reshape(*lead, n, -1)


def count_forward(q, k, v, group, query, key, weight, grad_out):
    return _count_attention(q, k, v, _dense_mask(q, k, group, query, key, weight))


def weighted_dense_forward(q, k, v, group, query, key, weight, grad_out):
    return dense_masked_attention(q, k, v, _dense_mask(q, k, group, query, key, weight))


def count_gradients(q, k, v, group, query, key, weight, grad_out):
    """Gradients of ``<grad_out, out>`` in q, k, v and the edge weights, through the
    count-matrix attention (a weight's gradient is its pair's entry's)."""
    def attend(q, k, v, w):
        return _count_attention(q, k, v, _dense_mask(q, k, group, query, key, w))
    grads = _grads(attend, q, k, v, weight, grad_out)
    return tuple(torch.zeros_like(weight) if g is None else g for g in grads)


# (batch shape, n, m, clusters): one group, then a batch of heads sharing S per head
PROBABILITY_SIZES = [((), 1, 1, 1), ((), 7, 5, 3), ((2, 3), 9, 4, 5), ((1, 2), 33, 17, 2)]


def _make_probabilities(size, dtype, device, generator):
    lead, n, m, clusters = size
    qm = torch.rand(*lead, n, clusters, generator=generator, dtype=dtype)
    km = torch.rand(*lead, m, clusters, generator=generator, dtype=dtype)
    heads = lead[1:] if lead else ()
    s = torch.softmax(torch.randn(*heads, clusters * clusters, generator=generator,
                                  dtype=dtype), -1).reshape(*heads, clusters, clusters)
    return qm.to(device), s.to(device), km.to(device)


def _make_keys(size, dtype, device, generator):  # ties: stability matters
    n, bound = size
    keys = torch.randint(0, bound, (n,), generator=generator)
    keys[::3] = keys[0] if n else keys[::3]
    return keys.to(device), bound


def _make_repeats(size, dtype, device, generator):
    values = torch.randn(size, generator=generator, dtype=dtype)
    repeats = torch.randint(0, 4, (size,), generator=generator)
    return values.to(device), repeats.to(device)


def _make_3d(size, dtype, device, generator):
    return (torch.randn(*size, generator=generator, dtype=dtype).to(device),)


PAIRS = [
    Pair("sbm.stable_argsort", stable_argsort,
         lambda keys, bound: torch.sort(keys, stable=True).indices, _make_keys,
         ((0, 7), (1, 7), (5000, 7), (4099, 1 << 16), (3001, 1 << 40)), dtypes=(torch.int64,),
         exact=True),
    Pair("sbm.repeat_each", repeat_each, lambda v, r: v.repeat_interleave(r), _make_repeats,
         (0, 1, 333, 1000), exact=True),
    Pair("sbm.transposed_copy", transposed_copy,
         lambda x: x.transpose(1, 2).contiguous(), _make_3d,
         ((3, 5, 7), (1, 1, 1), (2, 0, 3), (2, 300, 5)), exact=True),
    Pair("sbm.edge_attention", edge_forward, dense_forward, _make_attention, ATTENTION_SIZES,
         covers=(edge_attention,)),
    Pair("sbm.edge_attention_gradients", edge_gradients, dense_gradients, _make_attention,
         ATTENTION_SIZES),
    Pair("sbm.count_attention", count_forward, weighted_dense_forward, _make_attention,
         ATTENTION_SIZES),
    Pair("sbm.count_attention_gradients", count_gradients, dense_gradients, _make_attention,
         ATTENTION_SIZES),
    Pair("sbm.edge_probabilities", edge_probabilities, dense_edge_probabilities,
         _make_probabilities, PROBABILITY_SIZES),
]
