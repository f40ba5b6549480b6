"""Reachability, limits, depth and Hasse diagrams against brute force and networkx."""
import math
from collections import deque

import networkx as nx
import numpy as np
import pytest
import torch

from companion.hasse import masks as M
from companion.hasse import draw as D
from companion.hasse import reachability as RR

METHODS = ["bitset", "matmul"]


def _bfs_distances(mask):
    """dist[q][k]: fewest layers for information at k to reach q (None if never)."""
    n = mask.shape[0]
    out = [[] for _ in range(n)]  # k -> q edges
    m = mask.tolist()
    for q in range(n):
        for k in range(n):
            if m[q][k] and q != k:
                out[k].append(q)
    dist = [[None] * n for _ in range(n)]
    for k in range(n):
        dist[k][k] = 0
        queue = deque([k])
        while queue:
            v = queue.popleft()
            for w in out[v]:
                if dist[w][k] is None:
                    dist[w][k] = dist[v][k] + 1
                    queue.append(w)
    return dist


def _brute(mask):
    dist = _bfs_distances(mask)
    n = mask.shape[0]
    R = torch.tensor([[dist[q][k] is not None for k in range(n)] for q in range(n)])
    depth = max(d for row in dist for d in row if d is not None)
    return R, depth, dist


def _random_masks():
    g = torch.Generator().manual_seed(0)
    cases = []
    for n in (1, 2, 5, 13, 30):
        for p in (0.0, 0.05, 0.15, 0.4):
            cases.append(M.random_mask(n, p, generator=g))
            cases.append(M.random_mask(n, p, generator=g) & M.causal(n))  # DAG-like
    cases += [M.chain(17), M.sliding_window(23, 4), M.block_causal(12, 5), M.prefix_lm(9, 3)]
    return cases


def _members_graph(graph):
    return {
        (frozenset(graph.nodes[u]["members"]), frozenset(graph.nodes[v]["members"]))
        for u, v in graph.edges
    }, {frozenset(graph.nodes[v]["members"]) for v in graph}


def _networkx_hasse(mask):
    n = mask.shape[0]
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    qs, ks = torch.nonzero(mask, as_tuple=True)
    g.add_edges_from((int(k), int(q)) for q, k in zip(qs, ks) if int(q) != int(k))
    cond = nx.condensation(g)
    red = nx.transitive_reduction(cond)
    for v in red:
        red.nodes[v]["members"] = tuple(sorted(cond.nodes[v]["members"]))
    return red


@pytest.mark.parametrize("method", METHODS)
def test_limit_and_depth_match_bfs(method):
    for mask in _random_masks():
        R_bf, depth_bf, _ = _brute(mask)
        R, depth = RR.reachability_limit(mask, method=method)
        assert torch.equal(R, R_bf)
        assert depth == depth_bf


def test_reachability_powers_match_bfs():
    for mask in _random_masks()[::3]:
        _, depth, dist = _brute(mask)
        n = mask.shape[0]
        for L in range(0, depth + 3):
            want = torch.tensor(
                [[dist[q][k] is not None and dist[q][k] <= L for k in range(n)] for q in range(n)]
            )
            assert torch.equal(RR.reachability(mask, L), want), L


def test_sequence_ends_at_limit():
    for mask in (M.chain(9), M.sliding_window(20, 3), M.causal(6)):
        seq = RR.reachability_sequence(mask)
        R, depth = RR.reachability_limit(mask)
        assert torch.equal(seq[-1], R)
        assert len(seq) == max(depth, 1)
        for a, b in zip(seq, seq[1:]):
            assert not (a & ~b).any() and not torch.equal(a, b)  # strictly growing


@pytest.mark.parametrize("method", METHODS)
def test_hasse_matches_networkx(method):
    for mask in _random_masks():
        ours = RR.hasse_diagram(mask, method=method)
        ref = _networkx_hasse(mask)
        assert _members_graph(ours) == _members_graph(ref)
        # ids are a topological order and members partition the positions
        assert all(u < v for u, v in ours.edges)
        members = sorted(p for v in ours for p in ours.nodes[v]["members"])
        assert members == list(range(mask.shape[0]))


def test_methods_number_nodes_identically():
    for mask in _random_masks():
        a = RR.hasse_diagram(mask, method="bitset")
        b = RR.hasse_diagram(mask, method="matmul")
        assert dict(a.nodes(data="members")) == dict(b.nodes(data="members"))
        assert set(a.edges) == set(b.edges)


def test_known_depths():
    for n in (2, 5, 40):
        R, depth = RR.reachability_limit(M.chain(n))
        assert depth == n - 1 and torch.equal(R, M.causal(n))
    for n, w in [(10, 2), (50, 4), (64, 8), (100, 7)]:
        R, depth = RR.reachability_limit(M.sliding_window(n, w))
        assert depth == math.ceil((n - 1) / (w - 1))
        assert torch.equal(R, M.causal(n))
    for mask in (M.causal(30), M.block_causal(30, 4), M.prefix_lm(30, 7), M.bidirectional(9)):
        R, depth = RR.reachability_limit(mask)
        assert depth == 1 and torch.equal(R, RR.layer_adjacency(mask))  # dense: L* = 1
    R, depth = RR.reachability_limit(torch.zeros(6, 6, dtype=torch.bool))
    assert depth == 0 and torch.equal(R, torch.eye(6, dtype=torch.bool))


def test_hasse_of_standard_masks():
    h = RR.hasse_diagram(M.causal(6))
    assert list(h.edges) == [(i, i + 1) for i in range(5)]  # a chain, information flows up
    h = RR.hasse_diagram(M.block_causal(9, 3))
    assert [h.nodes[v]["members"] for v in h] == [(0, 1, 2), (3, 4, 5), (6, 7, 8)]
    assert list(h.edges) == [(0, 1), (1, 2)]
    h = RR.hasse_diagram(M.bidirectional(5))
    assert h.number_of_nodes() == 1 and h.nodes[0]["members"] == tuple(range(5))
    # XLNet: each query stream sits above the contents of earlier tokens, never its own
    n = 4
    order = [2, 0, 3, 1]
    R, _ = RR.reachability_limit(M.xlnet_two_stream(order).joint)
    rank = {tok: t for t, tok in enumerate(order)}
    for i in range(n):
        seen = {j for j in range(n) if R[n + i, j]}
        assert seen == {j for j in range(n) if rank[j] < rank[i]}


def test_bfs_paths_agree():
    """ELL and CSR neighbour lists, narrow and wide source blocks give the same depth."""
    g = torch.Generator().manual_seed(3)
    masks = [M.sliding_window(300, 9), M.random_mask(300, 4 / 300, generator=g)]
    hub = M.chain(300)
    hub[:, 0] = True  # a global key: skewed out-degree forces the CSR path
    hub[0, 0] = False
    masks.append(hub)
    for mask in masks:
        closure = RR._closure_bitset(mask)
        count = RR._reach_count(closure)
        depths = {RR._depth_bitset(closure.packed, count, kw) for kw in (1, 2, 16)}
        assert depths == {_brute(mask)[1]}


def test_packed_adjacency_restores_the_thread_count():
    """The mod runs on one intra-op thread; the caller's setting comes back, also when
    the mod raises."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []

        def mod(b, h, q_idx, kv_idx):
            seen.append(torch.get_num_threads())
            return q_idx >= kv_idx

        packed = RR.packed_adjacency(mod, 70, block_bytes=700)
        assert set(seen) == {1} and len(seen) == 7 and torch.get_num_threads() == 2
        assert torch.equal(RR.unpack_reach(packed, 70), M.causal(70))

        def broken(b, h, q_idx, kv_idx):
            raise RuntimeError("mod failed")

        with pytest.raises(RuntimeError, match="mod failed"):
            RR.packed_adjacency(broken, 5)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_row_intervals_and_closed_form_depth():
    """Interval rows are found across word boundaries; rows with a gap or with ends that
    go back take the search; the closed form agrees with the BFS distances."""
    for n, width in [(130, 64), (200, 65), (129, 1), (70, 70)]:
        packed = RR._closure_bitset(M.sliding_window(n, width)).packed
        lo, hi = RR._row_intervals(packed)
        q = np.arange(n)
        assert np.array_equal(lo, np.maximum(q - width + 1, 0)) and np.array_equal(hi, q)
        assert RR._depth_intervals(lo, hi) == _brute(M.sliding_window(n, width))[1]
    gap = M.chain(10)
    gap[7, 2] = True  # row 7 = {2, 6, 7}: not an interval
    assert RR._row_intervals(RR._closure_bitset(gap).packed) is None
    back = M.causal(6)
    back[3, :2] = False  # row 3 = 2..3, row 4 = 0..4: lower ends go back
    assert RR._row_intervals(RR._closure_bitset(back).packed) is None
    for mask in (gap, back):
        closure = RR._closure_bitset(mask)
        assert RR._depth(closure.packed, RR._reach_count(closure)) == _brute(mask)[1]


def test_scale_smoke():
    """n = 2048 runs through every stage (no timing assert: see the benchmark)."""
    g = torch.Generator().manual_seed(0)
    for mask, depth in [
        (M.causal(2048), 1),
        (M.sliding_window(2048, 64), math.ceil(2047 / 63)),
        (M.random_mask(2048, 4 / 2048, generator=g), None),
    ]:
        res = RR.order_structure(mask)
        assert res.R.shape == (2048, 2048) and res.R.diagonal().all()
        if depth is not None:
            assert res.depth == depth
        assert nx.is_directed_acyclic_graph(res.hasse)
        # R is transitive on a sample of rows: R[q] covers R[k] for every k it sees
        rows = np.random.default_rng(0).choice(2048, 20, replace=False)
        for q in rows:
            seen = torch.nonzero(res.R[q]).ravel()
            assert torch.equal(res.R[seen].any(dim=0) | res.R[q], res.R[q])


def test_tokens_reached_and_format():
    R = RR.layer_adjacency(M.causal(3))
    assert RR.tokens_reached(R, [(0,), (1, 2), ()]) == [{0}, {0, 1, 2}, {0, 1, 2}]
    assert D.format_members((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"


def test_bad_inputs():
    with pytest.raises(ValueError, match="mask: expected a square"):
        RR.reachability_limit(torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="dtype"):
        RR.hasse_diagram(torch.eye(3))
    with pytest.raises(ValueError, match="non-empty"):
        RR.layer_adjacency(torch.zeros(0, 0, dtype=torch.bool))
    with pytest.raises(ValueError, match="layers"):
        RR.reachability(M.causal(3), -1)
    with pytest.raises(ValueError, match="method"):
        RR.reachability_limit(M.causal(3), method="magic")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matmul_matches_cpu_bitset():
    mask = M.random_mask(200, 0.02, generator=torch.Generator().manual_seed(0))
    R_cpu, d_cpu = RR.reachability_limit(mask)
    R_gpu, d_gpu = RR.reachability_limit(mask.cuda())
    assert R_gpu.device.type == "cuda" and torch.equal(R_gpu.cpu(), R_cpu) and d_gpu == d_cpu
    with pytest.raises(ValueError, match="bitset"):
        RR.reachability_limit(mask.cuda(), method="bitset")


def test_condensation_graph_matches_networkx():
    for mask in _random_masks()[::2]:
        ours = RR.condensation_graph(mask)
        n = mask.shape[0]
        g = nx.DiGraph()
        g.add_nodes_from(range(n))
        qs, ks = torch.nonzero(mask, as_tuple=True)
        g.add_edges_from((int(k), int(q)) for q, k in zip(qs, ks) if int(q) != int(k))
        ref = nx.condensation(g)
        for v in ref:
            ref.nodes[v]["members"] = tuple(sorted(ref.nodes[v]["members"]))
        assert _members_graph(ours) == _members_graph(ref)


# ------------------------------------------------- dtypes, odd sizes, word boundaries
def _networkx_graph(mask):
    """The mask as a networkx DiGraph with an edge k -> q for mask[q, k] (q != k)."""
    g = nx.DiGraph()
    g.add_nodes_from(range(mask.shape[0]))
    qs, ks = torch.nonzero(mask, as_tuple=True)
    g.add_edges_from((int(k), int(q)) for q, k in zip(qs, ks) if int(q) != int(k))
    return g


def _networkx_reach(mask, layers=None):
    """R[q, k] from networkx: q within ``layers`` edges of k (any number when None)."""
    n = mask.shape[0]
    R = torch.zeros(n, n, dtype=torch.bool)
    if layers is None:
        closure = nx.transitive_closure(_networkx_graph(mask), reflexive=True)
        for k, q in closure.edges:
            R[q, k] = True
        return R
    for k, dist in nx.all_pairs_shortest_path_length(_networkx_graph(mask), cutoff=layers):
        for q in dist:
            R[q, k] = True
    return R


def _networkx_depth(mask):
    """Largest shortest-path distance between two positions that reach each other."""
    return max(max(d.values()) for _, d in nx.all_pairs_shortest_path_length(
        _networkx_graph(mask)))


def _odd_size_masks():
    """n = 1, odd sizes, and sizes on each side of the 64-bit words of the bitset rows."""
    g = torch.Generator().manual_seed(7)
    cases = {"n1-empty": torch.zeros(1, 1, dtype=torch.bool),
             "n1-self": torch.ones(1, 1, dtype=torch.bool)}
    for n in (3, 7, 63, 65, 129):
        for p in (0.0, min(1.0, 1.5 / n), min(1.0, 4.0 / n)):
            cases[f"random-{n}-{p:.3f}"] = M.random_mask(n, p, generator=g)
        cases[f"chain-{n}"] = M.chain(n)
    cases["window-65-5"] = M.sliding_window(65, 5)
    cases["chain-65-transposed-view"] = M.chain(65).T  # a non-contiguous view
    cases["block-causal-63-8"] = M.block_causal(63, 8)
    return cases


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", list(_odd_size_masks()))
def test_limit_depth_and_powers_match_networkx_at_odd_sizes(name, method):
    mask = _odd_size_masks()[name]
    res = RR.order_structure(mask, method=method)
    assert res.R.dtype == torch.bool
    assert torch.equal(res.R, _networkx_reach(mask))
    assert res.depth == _networkx_depth(mask)
    for layers in sorted({0, 1, 2, res.depth, res.depth + 1}):
        assert torch.equal(RR.reachability(mask, layers), _networkx_reach(mask, layers)), layers
    ref = _networkx_hasse(mask)
    assert _members_graph(res.hasse) == _members_graph(ref)


NON_BOOL_DTYPES = [torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16,
                   torch.float32, torch.float64]
PUBLIC_MASK_FUNCTIONS = {
    "layer_adjacency": RR.layer_adjacency,
    "reachability": lambda m: RR.reachability(m, 2),
    "reachability_sequence": RR.reachability_sequence,
    "reachability_limit/bitset": lambda m: RR.reachability_limit(m, method="bitset"),
    "reachability_limit/matmul": lambda m: RR.reachability_limit(m, method="matmul"),
    "order_structure": RR.order_structure,
    "hasse_diagram": RR.hasse_diagram,
    "condensation_graph": RR.condensation_graph,
    "tokens_reached": lambda m: RR.tokens_reached(m, [(i,) for i in range(m.shape[0])]),
}


@pytest.mark.parametrize("function", list(PUBLIC_MASK_FUNCTIONS))
@pytest.mark.parametrize("dtype", NON_BOOL_DTYPES, ids=str)
def test_non_bool_masks_raise_a_type_error_naming_the_parameter(dtype, function):
    """Masks are bool only: a 0/1 integer or float mask is refused, never read as truthy
    (a float mask could hold additive -inf/0 scores, the opposite convention)."""
    mask = M.chain(5).to(dtype)
    name = "R" if function == "tokens_reached" else "mask"
    with pytest.raises(TypeError, match=rf"^{name}: expected a square 2-D bool tensor, "
                                        rf"got dtype {dtype}"):
        PUBLIC_MASK_FUNCTIONS[function](mask)


@pytest.mark.parametrize("n", [1, 2, 9, 40])
def test_topological_class_order_fallback_is_topological(n):
    # scipy's component numbering is topological in practice, so the closure rarely calls
    # Kahn's algorithm; it is the fallback, checked here on its own: random DAG edges in
    # a shuffled numbering come out source before target, every class once.
    g = torch.Generator().manual_seed(n)
    perm = torch.randperm(n, generator=g).numpy()
    lo, hi = np.triu_indices(n, 1)
    keep = torch.rand(lo.size, generator=g).numpy() < 0.3
    src, dst = perm[lo[keep]], perm[hi[keep]]
    order = RR._topological_class_order(n, src, dst)
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    assert sorted(order.tolist()) == list(range(n))
    assert np.all(rank[src] < rank[dst])
