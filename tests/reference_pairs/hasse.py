"""Pairs of the hasse package: every fast reachability path and every mask_mod against
the definitions in ``companion.hasse.reference``.

Boolean results, compared exactly; the dtype axis is one placeholder (``torch.bool``),
ignored by ``make``. Sizes name a mask and its ``n`` (``"random-13"``): lower-triangular
masks take the bitset closure's triangular path, the others scipy's strongly connected
components; odd sizes and ``n = 1`` (a mask has at least one position).
"""
from __future__ import annotations

import torch

from companion.hasse import masks as M
from companion.hasse import reachability as RR
from companion.hasse import reference as ref
from companion.hasse.reachability import _closure_bitset, _depth, _depth_bitset, _reach_count

from reference_pairs import Pair

BOOL = (torch.bool,)


def _mask(size: str, device, generator) -> torch.Tensor:
    kind, n = size.rsplit("-", 1)
    n = int(n)
    if kind == "random":  # cycles: several non-trivial classes
        mask = torch.rand(n, n, generator=generator) < 0.15
        mask.fill_diagonal_(False)
    elif kind == "randomdag":  # lower triangular, irregular
        mask = (torch.rand(n, n, generator=generator) < 0.3).tril(-1)
    elif kind == "hubchain":  # every position attends 0: CSR neighbour lists
        mask = M.chain(n)
        mask[:, 0] = True
    elif kind == "empty":
        mask = torch.zeros(n, n, dtype=torch.bool)
    elif kind == "causal":
        mask = M.causal(n)
    elif kind == "chain":
        mask = M.chain(n)
    elif kind == "window3":
        mask = M.sliding_window(n, 3)
    elif kind == "twosided2":  # rows are intervals, with cycles: |q - k| <= 2
        q = torch.arange(n)
        mask = (q[:, None] - q[None, :]).abs() <= 2
    elif kind == "intervals":  # irregular monotone intervals (ends drawn, then sorted)
        q = torch.arange(n)
        lo = torch.sort(torch.randint(0, n, (n,), generator=generator)).values.minimum(q)
        hi = torch.sort(torch.randint(0, n, (n,), generator=generator)).values.maximum(q)
        mask = (q[None, :] >= lo[:, None]) & (q[None, :] <= hi[:, None])
    elif kind == "blockcausal4":
        mask = M.block_causal(n, 4)
    elif kind == "bidirectional":
        mask = M.bidirectional(n)
    elif kind == "butterfly":
        mask = M.butterfly_mask(n)
    else:  # pragma: no cover
        raise ValueError(size)
    return mask.to(device)


GRAPH_SIZES = ("empty-1", "causal-1", "chain-2", "random-7", "random-19", "randomdag-13",
               "chain-17", "window3-21", "blockcausal4-15", "bidirectional-5", "butterfly-5",
               "empty-9", "hubchain-23", "twosided2-11", "intervals-15")
# masks whose rows are monotone intervals (the closed-form depth), and two that are not
INTERVAL_SIZES = ("causal-1", "chain-2", "chain-17", "window3-21", "blockcausal4-15",
                  "bidirectional-5", "empty-9", "twosided2-11", "intervals-15", "intervals-8",
                  "random-19", "hubchain-23")


def _make_mask(size, dtype, device, generator):
    return (_mask(size, device, generator),)


def _make_mask_layers(size, dtype, device, generator):
    mask = _mask(size, device, generator)
    return mask, 3


def _graphs_equal(fast, reference, dtype):
    assert sorted(fast.nodes(data="members")) == sorted(reference.nodes(data="members")), (
        "hasse: nodes or their members differ")
    assert sorted(fast.edges) == sorted(reference.edges), (
        f"hasse: edges {sorted(fast.edges)} != {sorted(reference.edges)}")
    assert fast.graph["n_positions"] == reference.graph["n_positions"]


def _depth_by_blocks(words_per_node, gather_words=1 << 22, cache_words=1 << 16):
    def depth(mask):
        closure = _closure_bitset(mask)
        return _depth_bitset(closure.packed, _reach_count(closure), words_per_node,
                             gather_words, cache_words)

    return depth


def _depth_auto(mask):  # closed form for interval rows, else the search
    closure = _closure_bitset(mask)
    return _depth(closure.packed, _reach_count(closure))


def _packed_from_mod(size, dtype, device, generator):
    mask = _mask(size, "cpu", generator)
    return (M.mask_mod(mask), mask.shape[0])


def _packed_fast_mod(mod, n):  # blocks of 3 rows: several blocks at every size
    result = RR.packed_order_structure(RR.packed_adjacency(mod, n, block_bytes=3 * n))
    return RR.unpack_reach(result.reach, n), result.depth, result.hasse


def _packed_fast_edges(q, k, n):
    result = RR.packed_order_structure(RR.packed_adjacency_from_edges(q, k, n))
    return RR.unpack_reach(result.reach, n), result.depth, result.hasse


def _packed_reference_mod(mod, n):
    mask = M.materialise(mod, n)
    return (*ref.reachability_limit(mask), ref.hasse_diagram(mask))


def _packed_from_edges(size, dtype, device, generator):
    mask = _mask(size, "cpu", generator)
    q, k = torch.nonzero(mask, as_tuple=True)
    return q, k, mask.shape[0]


def _packed_reference_edges(q, k, n):
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[q, k] = True
    return (*ref.reachability_limit(mask), ref.hasse_diagram(mask))


def _packed_same(fast, reference, dtype):
    (r_fast, depth_fast, hasse_fast), (r_ref, depth_ref, hasse_ref) = fast, reference
    assert torch.equal(r_fast, r_ref), "packed_order_structure: R differs"
    assert depth_fast == depth_ref, f"packed_order_structure: depth {depth_fast} != {depth_ref}"
    _graphs_equal(hasse_fast, hasse_ref, dtype)


def _first_reach_layer_reference(mask):
    n = mask.shape[0]
    first = torch.zeros(n, n, dtype=torch.int64)
    R, depth = ref.reachability_limit(mask)
    for layers in range(max(depth, 1), 0, -1):  # layer 1 is A, even when R = I
        first[ref.boolean_power(mask, layers)] = layers
    return first


def _reachability_sequence_reference(mask):  # [A^1, ..., A^L*], at least A^1
    _, depth = ref.reachability_limit(mask)
    return [ref.boolean_power(mask, layers) for layers in range(1, max(depth, 1) + 1)]


# (mask name, the mod from masks.py, reference parameters, sizes)
_MODS = [
    ("causal", lambda n: M.causal_mask_mod, (), (1, 2, 7)),
    ("random", lambda n: M.random_mask_mod(0.3, seed=5), (0.3, 5), (1, 9)),
    ("chain", lambda n: M.chain_mask_mod, (), (1, 6)),
    ("bidirectional", lambda n: M.bidirectional_mask_mod, (), (1, 5)),
    ("sliding_window", lambda n: M.sliding_window_mask_mod(3), (3,), (1, 9)),
    ("block_causal", lambda n: M.block_causal_mask_mod(4), (4,), (3, 11)),
    ("prefix_lm", lambda n: M.prefix_lm_mask_mod(3), (3,), (3, 8)),
    ("butterfly", lambda n: M.butterfly_mask_mod(n), None, (2, 5)),
    ("block_two_stream", lambda n: M.block_two_stream_mask_mod(n, 3), None, (1, 7, 10)),
]


def _mask_pair(name, mod_of, params, sizes):
    def size_of(n):  # positions of the mask for parameter n
        if name == "butterfly":
            return 3 * n - 2
        if name == "block_two_stream":
            return ((n - 1) // 3) * 3 + n
        return n

    def predicate(n):
        if name == "butterfly":
            return ref.PREDICATES[name](n)
        if name == "block_two_stream":
            return ref.PREDICATES[name](n, 3)
        return ref.PREDICATES[name](*params)

    return Pair(
        name=f"hasse.materialise.{name}",
        fast=lambda n, device: M.materialise(mod_of(n), size_of(n), device=device),
        reference=lambda n, device: ref.dense_mask(predicate(n), size_of(n)),
        make=lambda size, dtype, device, generator: (size, device),
        sizes=sizes, dtypes=BOOL, exact=True, covers=(M.materialise,),
    )


PAIRS = [
    Pair(name="hasse.reachability", fast=RR.reachability, reference=ref.boolean_power,
         make=_make_mask_layers, sizes=GRAPH_SIZES, dtypes=BOOL, exact=True),
    Pair(name="hasse.layer_adjacency", fast=RR.layer_adjacency, reference=ref.layer_adjacency,
         make=_make_mask, sizes=GRAPH_SIZES, dtypes=BOOL, exact=True, cuda=False),
    Pair(name="hasse.reachability_sequence", fast=RR.reachability_sequence,
         reference=_reachability_sequence_reference, make=_make_mask, sizes=GRAPH_SIZES,
         dtypes=BOOL, exact=True, cuda=False),
    Pair(name="hasse.reachability_limit.bitset",
         fast=lambda m: RR.reachability_limit(m, method="bitset"),
         reference=ref.reachability_limit, make=_make_mask, sizes=GRAPH_SIZES, dtypes=BOOL,
         exact=True, cuda=False, covers=(RR.reachability_limit, RR.order_structure)),
    Pair(name="hasse.reachability_limit.matmul",
         fast=lambda m: RR.reachability_limit(m, method="matmul"),
         reference=ref.reachability_limit, make=_make_mask, sizes=GRAPH_SIZES, dtypes=BOOL,
         exact=True, covers=(RR.reachability_limit, RR.order_structure)),
    Pair(name="hasse.reachability_limit.auto", fast=RR.reachability_limit,
         reference=ref.reachability_limit, make=_make_mask, sizes=GRAPH_SIZES, dtypes=BOOL,
         exact=True),
    *[Pair(name=f"hasse.depth_bitset.words{w}", fast=_depth_by_blocks(w),
           reference=lambda m: ref.reachability_limit(m)[1], make=_make_mask,
           sizes=("random-19", "chain-17", "window3-21", "butterfly-5"), dtypes=BOOL,
           exact=True, cuda=False) for w in (1, 2)],
    Pair(name="hasse.depth_bitset.cache_chunked",  # ELL pull, a few candidates a chunk
         fast=_depth_by_blocks(None, cache_words=3),
         reference=lambda m: ref.reachability_limit(m)[1], make=_make_mask,
         sizes=("random-7", "random-19", "randomdag-13"), dtypes=BOOL, exact=True,
         cuda=False),
    Pair(name="hasse.depth.intervals", fast=_depth_auto,
         reference=lambda m: ref.reachability_limit(m)[1], make=_make_mask,
         sizes=INTERVAL_SIZES, dtypes=BOOL, exact=True, cuda=False),
    Pair(name="hasse.depth_bitset.chunked", fast=_depth_by_blocks(None, gather_words=8),
         reference=lambda m: ref.reachability_limit(m)[1], make=_make_mask,
         sizes=("random-19", "hubchain-23", "chain-17"), dtypes=BOOL, exact=True, cuda=False),
    Pair(name="hasse.packed_order_structure.mask_mod", fast=_packed_fast_mod,
         reference=_packed_reference_mod, make=_packed_from_mod, sizes=GRAPH_SIZES,
         dtypes=BOOL, compare=_packed_same, cuda=False,
         covers=(RR.packed_adjacency, RR.packed_order_structure, RR.unpack_reach)),
    Pair(name="hasse.packed_order_structure.edges", fast=_packed_fast_edges,
         reference=_packed_reference_edges, make=_packed_from_edges, sizes=GRAPH_SIZES,
         dtypes=BOOL, compare=_packed_same, cuda=False,
         covers=(RR.packed_adjacency_from_edges, RR.packed_order_structure)),
    Pair(name="hasse.hasse_diagram.bitset",
         fast=lambda m: RR.hasse_diagram(m, method="bitset"), reference=ref.hasse_diagram,
         make=_make_mask, sizes=GRAPH_SIZES, dtypes=BOOL, compare=_graphs_equal, cuda=False,
         covers=(RR.hasse_diagram,)),
    Pair(name="hasse.hasse_diagram.matmul",
         fast=lambda m: RR.hasse_diagram(m, method="matmul"), reference=ref.hasse_diagram,
         make=_make_mask, sizes=GRAPH_SIZES, dtypes=BOOL, compare=_graphs_equal,
         covers=(RR.hasse_diagram, RR.order_structure)),
    Pair(name="hasse.first_reach_layer", fast=RR.first_reach_layer,
         reference=_first_reach_layer_reference, make=_make_mask,
         sizes=("empty-1", "random-7", "chain-9", "window3-11", "butterfly-4"), dtypes=BOOL,
         exact=True),
    *[_mask_pair(*entry) for entry in _MODS],
]
