"""Information flow of a multi-layer masked transformer: layer graphs, ``A^L``, limits,
condensation and Hasse diagrams :cite:`li2026hasse`.

Definitions
-----------
One transformer layer is a bipartite graph from input positions to output positions with
an edge ``k -> q`` when query ``q`` may attend key ``k`` (``mask[q, k]``) or ``k == q``
(the residual connection; feed-forward and LayerNorm act position-wise and add no edge).
Its adjacency is ``A = mask OR I`` (:func:`layer_adjacency`). After ``L`` layers output
``q`` depends on input ``k`` exactly when ``R^(L)[q, k] = (A^L)[q, k]`` in Boolean
arithmetic (:func:`reachability`). Because ``A`` is reflexive ``R^(L)`` grows with ``L``
and is constant from some ``L*`` on: the limit ``R`` is the reflexive transitive closure
of the mask graph and ``L*`` (the *depth*) is the largest shortest-path distance between
two positions that reach each other (:func:`reachability_limit`). ``R`` is a preorder;
its classes of mutually reachable positions (strongly connected components) are
partially ordered, and the Hasse diagram of that order (:func:`hasse_diagram`) is the
information-flow structure of any deep enough transformer with this mask.

Matrix convention: ``R[q, k] = True`` means information flows from position ``k`` to
position ``q`` (row = receiver, like the mask). Hasse edges point the way information
flows: from the class that is attended to the class that attends.

Algorithms
----------
``method="bitset"`` (CPU, the default for CPU tensors) works on bit-packed rows:

1. strongly connected components (none to compute when the mask is lower triangular,
   otherwise ``scipy.sparse.csgraph.connected_components``) and a topological order of
   the classes;
2. closure and transitive reduction in one sweep over the classes in topological order:
   for class ``c`` take its highest-ranked in-neighbour ``u`` not yet known to reach
   ``c``; the edge ``u -> c`` is a covering edge, so ``reach[c] |= reach[u]``; repeat
   until every in-neighbour is known. Cost ``O((C + H) * C / 64)`` word operations for
   ``C`` classes and ``H`` Hasse edges, plus one pass over the mask;
3. depth: ``0`` if ``R = I``, ``1`` if ``A = R`` (dense masks: one popcount comparison,
   no product), otherwise a bit-parallel breadth-first search from all sources at once:
   sources are grouped in blocks of ``64 w`` (``w`` words per node, chosen from the
   mask's bandwidth), every (block, node) pair carries the bit set of the block's
   sources that reached it, and all blocks advance in lockstep, one Python iteration per
   BFS level. Cost ``O(sum over levels of frontier edges * w)`` word operations,
   ``O(E n / 64)`` in the worst case. Masks whose rows are intervals with
   non-decreasing ends (causal, sliding window, block-causal, chain) skip the search:
   row ``q`` of ``A^L`` is the interval between the ``L``-fold compositions of the row
   ends, and the depth is the number of compositions until both settle, found by binary
   lifting in ``O(n log n)`` (a sliding window of width 64 at ``n = 32768``: 521 levels,
   0.1 s instead of 25 s).

``method="matmul"`` (any device, the default for CUDA tensors) squares ``A`` repeatedly
with float matrix products on the mask's device (exact for ``n < 2**24``), finds the
depth by binary lifting over the stored powers, and reduces the class order with one more
product (``covers = S AND NOT S^2`` for the strict order ``S``). Cost
``O(n^3 log n)`` flops.

Long sequences: :func:`packed_order_structure` runs the bitset method from a packed ``A``
(:func:`packed_adjacency` of a ``mask_mod``, a block of rows at a time, or
:func:`packed_adjacency_from_edges`) and returns ``R`` packed, so no ``n x n`` bool array
is formed (``n = 32768``: ``R`` is 128 MiB packed, 1 GiB as bools).

Both methods number the Hasse nodes identically: by the number of classes at or below the
class, then by the smallest member (a topological order; the natural order for masks
whose positions are already topologically ordered).
"""
from __future__ import annotations

from typing import NamedTuple

import networkx as nx
import numpy as np
import torch

from companion._validate import check_bool, check_choice, check_int, describe
from companion.hasse.masks import validate_mask

__all__ = [
    "OrderStructure",
    "PackedOrderStructure",
    "condensation_graph",
    "first_reach_layer",
    "hasse_diagram",
    "layer_adjacency",
    "mask_graph",
    "order_structure",
    "packed_adjacency",
    "packed_adjacency_from_edges",
    "packed_order_structure",
    "reachability",
    "reachability_limit",
    "reachability_sequence",
    "tokens_reached",
    "unpack_reach",
]

_METHODS = ("auto", "bitset", "matmul")


# ------------------------------------------------------------------ basic operators
def layer_adjacency(mask: torch.Tensor) -> torch.Tensor:
    """Adjacency of one layer: ``A = mask OR I`` (the identity is the residual connection).

    Parameters
    ----------
    mask : (n, n) bool tensor, ``mask[q, k]`` = query ``q`` may attend key ``k``.

    Returns
    -------
    (n, n) bool tensor on ``mask.device``.
    """
    validate_mask(mask)
    eye = torch.eye(mask.shape[0], dtype=torch.bool, device=mask.device)
    return mask | eye


def mask_graph(mask: torch.Tensor) -> nx.DiGraph:
    """The information-flow graph of a mask: nodes ``0..n-1``, an edge ``k -> q`` whenever
    query ``q`` attends key ``k`` (self edges kept when the mask has them).

    The graph networkx's algorithms take (closure, condensation, reduction): the peer the
    tests and the chapter compare this module with. O(n + edges) time.

    >>> from companion.hasse.masks import causal
    >>> sorted(mask_graph(causal(3)).edges)
    [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (2, 2)]
    """
    validate_mask(mask)
    q, k = torch.nonzero(mask.cpu(), as_tuple=True)
    graph = nx.DiGraph()
    graph.add_nodes_from(range(mask.shape[0]))
    graph.add_edges_from(zip(k.tolist(), q.tolist()))
    return graph


def _bool_product(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Boolean matrix product on the tensors' device (float32 is exact for n < 2**24)."""
    return (x.to(torch.float32) @ y.to(torch.float32)) > 0


def reachability(mask: torch.Tensor, layers: int) -> torch.Tensor:
    """Dependency pattern of ``layers`` stacked layers: Boolean ``A^layers``.

    Parameters
    ----------
    mask : (n, n) bool tensor.
    layers : int >= 0. ``A^0 = I``.

    Returns
    -------
    (n, n) bool tensor ``R`` on ``mask.device``; ``R[q, k]`` = output ``q`` depends on
    input ``k`` after ``layers`` layers.

    Complexity: ``O(n^3 log(layers))`` flops by repeated squaring (stops early once the
    powers are stable).
    """
    layers = check_int("layers", layers, minimum=0)
    adj = layer_adjacency(mask)
    result = torch.eye(adj.shape[0], dtype=torch.bool, device=adj.device)
    power = adj  # A^(2^j)
    remaining = layers
    while remaining:
        if remaining & 1:
            result = _bool_product(result, power)
        remaining >>= 1
        if remaining:
            squared = _bool_product(power, power)
            if torch.equal(squared, power):
                # A^(2^j) is already the limit and layers >= 2^(j+1): A^layers is the limit.
                return power
            power = squared
    return result


def reachability_sequence(mask: torch.Tensor, max_layers: int | None = None) -> list[torch.Tensor]:
    """``[A^1, A^2, ..., A^L*]``: the dependency patterns layer by layer until stable.

    The last entry is the limit ``R`` (it is repeated nowhere). With ``max_layers`` the
    list stops after that many layers even if not yet stable. Intended for drawing
    (small ``n``): one product per layer.
    """
    adj = layer_adjacency(mask)
    if max_layers is not None:
        max_layers = check_int("max_layers", max_layers, minimum=1)
    seq = [adj]
    while max_layers is None or len(seq) < max_layers:
        nxt = _bool_product(seq[-1], adj)
        if torch.equal(nxt, seq[-1]):
            break
        seq.append(nxt)
    return seq


# --------------------------------------------------------------- bit-packed helpers
def _pack_rows(rows: np.ndarray) -> np.ndarray:
    """Pack a (m, n) bool array into (m, ceil(n/64)) uint64, bit j of row = column j."""
    m, n = rows.shape
    words = (n + 63) // 64
    packed = np.packbits(rows, axis=1, bitorder="little")
    pad = words * 8 - packed.shape[1]
    if pad:
        packed = np.pad(packed, ((0, 0), (0, pad)))
    return np.ascontiguousarray(packed).view("<u8").reshape(m, words)


def _unpack_rows(packed: np.ndarray, n: int) -> np.ndarray:
    bytes_ = np.ascontiguousarray(packed).view(np.uint8).reshape(packed.shape[0], -1)
    return np.unpackbits(bytes_, axis=1, count=n, bitorder="little").astype(bool)


def _popcount_rows(packed: np.ndarray) -> np.ndarray:
    return np.bitwise_count(packed).sum(axis=1, dtype=np.int64)


class _Closure(NamedTuple):
    labels: np.ndarray  # class id of each position (ids in the canonical order)
    reach: list  # reach[c]: Python int bitset of the classes at or below class c
    covers: np.ndarray  # (H, 2) int64: (lower class, upper class) covering pairs
    packed: np.ndarray  # (n, words) uint64: A = mask | I, bit k of row q = A[q, k]
    triangular: bool


def _edges_from_packed(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q, k) pairs with A[q, k] from packed rows; cost O(n * words + nnz)."""
    rows, wcol = np.nonzero(packed)
    values = packed[rows, wcol]
    bits = np.unpackbits(values.view(np.uint8).reshape(-1, 8), axis=1, bitorder="little")
    r_idx, b_idx = np.nonzero(bits)
    return rows[r_idx].astype(np.int64), wcol[r_idx].astype(np.int64) * 64 + b_idx


def _is_lower_triangular(packed: np.ndarray) -> bool:
    """True when no row q has a bit k > q (only forward edges k -> q with k <= q)."""
    n, words = packed.shape
    q = np.arange(n)
    qw = q >> 6
    beyond = (np.arange(words)[None, :] > qw[:, None]) & (packed != 0)
    if beyond.any():
        return False
    own = packed[q, qw]
    shift = (q & 63).astype(np.uint64)
    return not ((own >> shift) >> np.uint64(1)).any()


def _ints_from_packed(packed: np.ndarray) -> list[int]:
    raw = np.ascontiguousarray(packed).astype("<u8", copy=False).tobytes()
    step = packed.shape[1] * 8
    return [int.from_bytes(raw[i : i + step], "little") for i in range(0, len(raw), step)]


def _packed_from_ints(values: list[int], n_bits: int) -> np.ndarray:
    words = (n_bits + 63) // 64
    raw = b"".join(v.to_bytes(words * 8, "little") for v in values)
    return np.frombuffer(raw, dtype="<u8").reshape(len(values), words).astype(np.uint64)


def _topological_class_order(n_classes: int, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Kahn's algorithm by generations (vectorised per generation); returns class ids
    in a topological order."""
    order_edges = np.argsort(src, kind="stable")
    dst_s = dst[order_edges]
    indptr = np.concatenate(([0], np.cumsum(np.bincount(src, minlength=n_classes))))
    indeg = np.bincount(dst, minlength=n_classes)
    frontier = np.flatnonzero(indeg == 0)
    out = []
    while frontier.size:
        out.append(frontier)
        starts = indptr[frontier]
        counts = indptr[frontier + 1] - starts
        total = int(counts.sum())
        if total == 0:
            break
        idx = np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(total)
        targets = dst_s[idx]
        np.subtract.at(indeg, targets, 1)
        touched = np.unique(targets)
        frontier = touched[indeg[touched] == 0]
    order = np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
    if order.size != n_classes:  # pragma: no cover - a condensation is always acyclic
        raise RuntimeError("condensation is not acyclic")
    return order


def _closure_bitset(mask: torch.Tensor) -> _Closure:
    if mask.device.type != "cpu":
        raise ValueError(
            f"mask: method='bitset' runs on the CPU, got a tensor on {mask.device}; "
            "pass mask.cpu() or use method='matmul'"
        )
    packed = _pack_rows(mask.numpy())
    _set_diagonal(packed)
    return _closure_packed(packed)


def _set_diagonal(packed: np.ndarray, start: int = 0) -> None:
    """OR the identity into packed rows ``start .. start + len(packed) - 1`` (in place)."""
    q = np.arange(start, start + packed.shape[0])
    packed[q - start, q >> 6] |= np.left_shift(np.uint64(1), (q & 63).astype(np.uint64))


def _closure_packed(packed: np.ndarray) -> _Closure:
    """Classes, class-level closure and covers of ``A`` given packed (``A = M OR I``)."""
    n = packed.shape[0]
    triangular = _is_lower_triangular(packed)
    if triangular:
        # Every edge goes from a lower to a higher position: positions are the classes
        # and their natural order is topological.
        n_classes = n
        labels = np.arange(n)
        adj = _ints_from_packed(packed)
    else:
        from scipy.sparse import coo_matrix
        from scipy.sparse.csgraph import connected_components

        rows, cols = _edges_from_packed(packed)
        graph = coo_matrix(
            (np.ones(rows.size, dtype=np.int8), (rows, cols)), shape=(n, n)
        ).tocsr()
        n_classes, raw = connected_components(graph, directed=True, connection="strong")
        src, dst = raw[cols], raw[rows]  # information flows key class -> query class
        keep = src != dst
        src, dst = src[keep], dst[keep]  # repeated class pairs are harmless below
        # scipy numbers the components as its depth-first search completes them, which
        # is a topological order (or its reverse) of the condensation in practice; that
        # is checked on every edge, and Kahn's algorithm runs only when it fails.
        if np.all(src < dst):
            topo = np.arange(n_classes)
        elif np.all(src > dst):
            topo = np.arange(n_classes)[::-1]
        else:
            topo = _topological_class_order(n_classes, src, dst)
        rank = np.empty(n_classes, dtype=np.int64)
        rank[topo] = np.arange(n_classes)
        labels = rank[raw]
        src, dst = rank[src], rank[dst]
        if n_classes <= 1 << 14:  # one plain indexed write, then pack (<= 256 MiB of bools)
            class_bool = np.zeros((n_classes, n_classes), dtype=bool)
            class_bool[dst, src] = True
            class_adj = _pack_rows(class_bool)
            del class_bool
        else:
            class_adj = np.zeros((n_classes, (n_classes + 63) // 64), dtype=np.uint64)
            np.bitwise_or.at(class_adj, (dst, src >> 6),
                             np.left_shift(np.uint64(1), (src & 63).astype(np.uint64)))
        adj = _ints_from_packed(class_adj)  # adj[b]: bit a set for every edge a -> b
        del class_adj

    # Closure and transitive reduction in one topological sweep (Python ints are
    # bitsets: OR and highest set bit run in C over n/30 digits).
    reach: list[int] = [0] * n_classes
    covers_lo: list[int] = []
    covers_hi: list[int] = []
    for c in range(n_classes):
        row = 1 << c
        remaining = adj[c] & ~row
        while remaining:
            u = remaining.bit_length() - 1  # highest-ranked unexplained in-neighbour
            covers_lo.append(u)
            covers_hi.append(c)
            row |= reach[u]
            remaining &= ~row
        reach[c] = row

    # Canonical ids: (number of classes at or below, smallest member).
    below = np.fromiter((r.bit_count() for r in reach), dtype=np.int64, count=n_classes)
    smallest = np.full(n_classes, n, dtype=np.int64)
    np.minimum.at(smallest, labels, np.arange(n))
    canon = np.lexsort((smallest, below))
    covers_lo_a = np.asarray(covers_lo, dtype=np.int64)
    covers_hi_a = np.asarray(covers_hi, dtype=np.int64)
    if not np.array_equal(canon, np.arange(n_classes)):
        new_id = np.empty(n_classes, dtype=np.int64)
        new_id[canon] = np.arange(n_classes)
        dense = _unpack_rows(_packed_from_ints(reach, n_classes), n_classes)[canon][:, canon]
        reach = _ints_from_packed(_pack_rows(dense))
        labels = new_id[labels]
        covers_lo_a, covers_hi_a = new_id[covers_lo_a], new_id[covers_hi_a]
    covers = np.stack([covers_lo_a, covers_hi_a], axis=1).reshape(-1, 2)
    return _Closure(labels, reach, covers, packed, triangular)


def _reach_count(closure: _Closure) -> int:
    """Number of True entries of the position-level R."""
    if closure.triangular:
        return sum(r.bit_count() for r in closure.reach)
    n_classes = len(closure.reach)
    sizes = np.bincount(closure.labels, minlength=n_classes)
    class_r = _unpack_rows(_packed_from_ints(closure.reach, n_classes), n_classes)
    per_class = class_r.astype(np.int64) @ sizes
    return int(per_class[closure.labels].sum())


def _expand_reach(closure: _Closure) -> np.ndarray:
    n_classes = len(closure.reach)
    class_r = _unpack_rows(_packed_from_ints(closure.reach, n_classes), n_classes)
    if closure.triangular and np.array_equal(closure.labels, np.arange(n_classes)):
        return class_r
    return class_r[closure.labels][:, closure.labels]


class _Adjacency(NamedTuple):
    """Neighbour lists of ``n`` nodes: CSR (``ptr``, ``idx``) and, when no degree is far
    above the mean, a padded slot-major table (ELL, ``(width, n + 1)``) whose pad entries
    are ``n``."""

    ptr: np.ndarray
    idx: np.ndarray
    table: np.ndarray | None


def _adjacency(keys: np.ndarray, values: np.ndarray, n: int) -> _Adjacency:
    order = np.argsort(keys, kind="stable")
    keys, values = keys[order], values[order]
    counts = np.bincount(keys, minlength=n)
    ptr = np.concatenate(([0], np.cumsum(counts)))
    width = int(counts.max()) if counts.size else 0
    table = None
    if width and width <= 4 * counts.mean() + 4:
        # slot-major (width, n + 1): slot j of every node is one contiguous row; pad and
        # the dummy node n point at the dummy, whose words are always 0. int32 halves
        # the gather traffic.
        table = np.full((width, n + 1), n, dtype=np.int32)
        table[np.arange(keys.size) - ptr[keys], keys] = values
    return _Adjacency(ptr, values.astype(np.int32), table)


def _neighbours(adj: _Adjacency, nodes: np.ndarray):
    """Neighbours of ``nodes`` from the CSR lists: (flat array, counts)."""
    starts = adj.ptr[nodes]
    counts = adj.ptr[nodes + 1] - starts
    total = int(counts.sum())
    flat = np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(total)
    return adj.idx[flat], counts


def _pull(frontier_words: np.ndarray, in_adj: _Adjacency, cand: np.ndarray,
          stride: np.int32, gather_words: int = 1 << 22,
          cache_words: int = 1 << 16) -> np.ndarray:
    """OR of the frontier words of each candidate's in-neighbours (same block).

    ELL: one gather and OR per slot, over all candidates at once (no gathered block is
    kept); with more than two slots the candidates are sorted by in-degree, so that slot
    ``j`` gathers only those with a ``j``-th in-neighbour, a chunk of about
    ``cache_words`` words of candidates at a time so that its ORs stay in cache (a
    random mask at ``n = 32768``: 1.4x, then 1.3x, faster than gathering every slot of
    every candidate at once).
    CSR: gathered and reduced in chunks of about ``gather_words`` words, so
    that memory stays bounded."""
    node = cand % stride
    base = cand - node
    if in_adj.table is not None:
        slots = in_adj.table
        if slots.shape[0] <= 2:
            acc = frontier_words[slots[0][node] + base]
            for j in range(1, slots.shape[0]):
                acc |= frontier_words[slots[j][node] + base]
            return acc
        # candidates by falling in-degree: slot j gathers only the candidates that have a
        # j-th in-neighbour (the rest would gather the dummy's zero words)
        degree = in_adj.ptr[node + 1] - in_adj.ptr[node]
        order = np.argsort(-degree, kind="stable")
        node, base = node[order], base[order]
        having = np.searchsorted(-degree[order], -np.arange(slots.shape[0]), side="left")
        having = having.tolist()  # having[j]: the candidates with degree > j
        # candidates in cache-sized chunks: a chunk's ORs stay in cache over all its slots
        chunk = max(1, cache_words // (1 if frontier_words.ndim == 1 else
                                       frontier_words.shape[1]))
        out = np.empty((cand.size,) + frontier_words.shape[1:], dtype=np.uint64)
        for lo in range(0, cand.size, chunk):
            hi = min(cand.size, lo + chunk)
            acc = frontier_words[slots[0][node[lo:hi]] + base[lo:hi]]
            for j in range(1, slots.shape[0]):
                k = min(hi, having[j])
                if k <= lo:
                    break
                acc[:k - lo] |= frontier_words[slots[j][node[lo:k]] + base[lo:k]]
            out[order[lo:hi]] = acc
        return out
    kw = 1 if frontier_words.ndim == 1 else frontier_words.shape[1]
    per_cand = (in_adj.ptr[node + 1] - in_adj.ptr[node]).astype(np.int64)
    ends = np.cumsum(per_cand) * kw
    cuts = np.searchsorted(ends, np.arange(gather_words, int(ends[-1]) if ends.size else 0,
                                           gather_words), side="right")
    out = []
    for lo, hi in zip(np.concatenate(([0], cuts)), np.concatenate((cuts, [cand.size]))):
        if hi <= lo:
            continue
        senders, counts = _neighbours(in_adj, node[lo:hi])
        gathered = frontier_words[senders + np.repeat(base[lo:hi], counts)]
        out.append(np.bitwise_or.reduceat(gathered, np.cumsum(counts) - counts, axis=0))
    if len(out) == 1:
        return out[0]
    if not out:
        return np.zeros((0,) + frontier_words.shape[1:], dtype=np.uint64)
    return np.concatenate(out)


def _row_intervals(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``(lo, hi)`` when every row ``q`` of the packed ``A`` is one run of set bits
    ``lo[q] .. hi[q]`` and both ends are non-decreasing in ``q`` (causal, sliding-window,
    block-causal, chain masks), else None. Cost ``O(n * words)`` word operations."""
    n, words = packed.shape
    counts = np.bitwise_count(packed).sum(axis=1, dtype=np.int64)
    nonzero = packed != 0
    first = nonzero.argmax(axis=1)  # every row has its diagonal bit
    last = words - 1 - nonzero[:, ::-1].argmax(axis=1)
    del nonzero
    rows = np.arange(n)
    low = packed[rows, first]
    low_bit = np.bitwise_count((low & (~low + np.uint64(1))) - np.uint64(1))  # trailing 0s
    high = packed[rows, last]
    for shift in (1, 2, 4, 8, 16, 32):  # smear the highest set bit down
        high |= high >> np.uint64(shift)
    lo = first.astype(np.int64) * 64 + low_bit.astype(np.int64)
    hi = last.astype(np.int64) * 64 + np.bitwise_count(high).astype(np.int64) - 1
    if not np.array_equal(counts, hi - lo + 1):
        return None
    if (np.diff(lo) < 0).any() or (np.diff(hi) < 0).any():
        return None
    return lo, hi


def _steps_to_fixed_point(step: np.ndarray) -> int:
    """Smallest ``L`` with ``step^L = step^(L + 1)`` on every position, for a monotone
    ``step`` with ``step^L(q)`` monotone in ``L`` (binary lifting: ``O(n log n)``)."""
    n = step.size
    powers = [step]  # powers[j] = step^(2^j)
    while (1 << (len(powers) - 1)) < n:
        powers.append(powers[-1][powers[-1]])
    fixed = powers[-1]  # step^(2^J), 2^J >= n: every orbit has settled
    here = np.arange(n)
    steps = np.zeros(n, dtype=np.int64)
    for j in range(len(powers) - 1, -1, -1):  # largest jumps that stay short of the limit
        ahead = powers[j][here]
        short = ahead != fixed
        here = np.where(short, ahead, here)
        steps += short.astype(np.int64) << j
    steps += here != fixed  # one more step reaches the limit, unless q is already there
    return int(steps.max())


def _depth_intervals(lo: np.ndarray, hi: np.ndarray) -> int:
    """Depth of ``A`` whose rows are the intervals ``lo[q] .. hi[q]`` (monotone ends).

    Row ``q`` of ``A^L`` is then ``lo^L(q) .. hi^L(q)`` (``L``-fold compositions): a union
    of intervals that each contain their own position is an interval, and monotone ends
    make its ends those of the outermost rows. ``A^L = R`` once both compositions have
    settled on every row, so the depth is the larger of their numbers of steps to the
    fixed point. ``O(n log n)`` instead of one BFS level per layer."""
    return max(_steps_to_fixed_point(lo), _steps_to_fixed_point(hi))


def _depth(packed: np.ndarray, r_count: int) -> int:
    """Depth of the packed ``A``: in closed form when its rows are monotone intervals
    (:func:`_depth_intervals`), else by the bit-parallel search (:func:`_depth_bitset`)."""
    n = packed.shape[0]
    a_count = int(np.bitwise_count(packed).sum())
    if a_count == r_count:  # A is a subset of R: equal sizes mean A = R
        return 0 if a_count == n else 1
    intervals = _row_intervals(packed) if n > 1 else None
    if intervals is not None:
        return _depth_intervals(*intervals)
    return _depth_bitset(packed, r_count)


def _depth_bitset(packed: np.ndarray, r_count: int, words_per_node: int | None = None,
                  gather_words: int = 1 << 22, cache_words: int = 1 << 16) -> int:
    """Smallest L with A^L = R, given A packed and the number of True entries of R.

    Breadth-first search from all sources at once: sources are grouped in blocks of
    ``64 * words_per_node``; each (block, node) pair carries a bit set of the block's
    sources that reached the node, and all blocks advance in lockstep so that Python runs
    one iteration per BFS level. Each level *pulls*: candidate receivers are the
    out-neighbours of the frontier, and each candidate ORs the frontier words of its
    in-neighbours. For banded graphs (every edge spans at most ``b`` positions) the
    frontier of a block is a band of ``64 * words + b`` nodes, so narrow blocks do the
    least work; for graphs with long edges wide blocks amortise the index arithmetic.
    ``words_per_node=None`` picks ``clip(b / 64, 1, 64)`` (a power of two), at most the
    ``ceil(n / 64)`` words one block of all sources needs.
    """
    n = packed.shape[0]
    a_count = int(np.bitwise_count(packed).sum())
    if a_count == r_count:  # A is a subset of R: equal sizes mean A = R
        return 0 if a_count == n else 1
    q_idx, k_idx = _edges_from_packed(packed)
    off = q_idx != k_idx
    q_idx, k_idx = q_idx[off], k_idx[off]
    if words_per_node is None:
        bandwidth = int(np.abs(q_idx - k_idx).max())
        words_per_node = min(int(np.clip(2 ** round(np.log2(max(bandwidth, 1) / 64)), 1, 64)),
                             (n + 63) // 64)
    kw = words_per_node
    group = 64 * kw
    n_blocks = (n + group - 1) // group
    # One dummy node per block (index n): in-lists are padded with it (its frontier word
    # is always 0) and out-lists are padded with it (it is never kept as a candidate).
    out_adj = _adjacency(k_idx, q_idx, n)
    in_adj = _adjacency(q_idx, k_idx, n)
    stride = n + 1
    if n_blocks * stride >= 2**31:  # pragma: no cover - n > 2**20 is out of scope
        raise ValueError(f"mask: n = {n} is too large for the bitset depth search")
    shape = (n_blocks * stride,) if kw == 1 else (n_blocks * stride, kw)
    frontier_words = np.zeros(shape, dtype=np.uint64)
    visited = np.zeros(shape, dtype=np.uint64)
    marks = np.zeros(n_blocks * stride, dtype=bool)
    dummies = np.arange(n_blocks) * stride + n
    sources = np.arange(n)
    local = sources % group
    front = ((sources // group) * stride + sources).astype(np.int32)
    words = np.zeros((n, kw), dtype=np.uint64)
    words[sources, local >> 6] = np.left_shift(np.uint64(1), (local & 63).astype(np.uint64))
    if kw == 1:
        words = words[:, 0]
    visited[front] = words
    level = 0
    stride32 = np.int32(stride)
    while front.size:
        frontier_words[front] = words
        front_node = front % stride32
        block_base = front - front_node
        if out_adj.table is not None:
            receivers = (out_adj.table[:, front_node] + block_base).ravel()
        else:
            receivers, counts = _neighbours(out_adj, front_node)
            receivers += np.repeat(block_base, counts)
        marks[receivers] = True
        marks[dummies] = False
        cand = np.flatnonzero(marks).astype(np.int32)
        marks[cand] = False
        new = _pull(frontier_words, in_adj, cand, stride32, gather_words, cache_words)
        new &= ~visited[cand]
        frontier_words[front] = 0
        keep = new != 0 if kw == 1 else new.any(axis=1)
        front, words = cand[keep], new[keep]
        if front.size:
            visited[front] |= words
            level += 1
    return level


# ------------------------------------------------------------------ matmul method
def _closure_matmul(mask: torch.Tensor):
    """Limit, powers A^(2^j) and depth by repeated squaring on the mask's device."""
    adj = layer_adjacency(mask)
    n = adj.shape[0]
    eye = torch.eye(n, dtype=torch.bool, device=adj.device)
    powers = [adj]
    while True:
        sq = _bool_product(powers[-1], powers[-1])
        if torch.equal(sq, powers[-1]):
            break
        powers.append(sq)
    limit = powers[-1]
    if torch.equal(limit, eye):
        return limit, 0
    # Binary lifting: largest L with A^L != R, then depth = L + 1.
    current, steps = eye, 0
    for j in range(len(powers) - 1, -1, -1):
        candidate = _bool_product(current, powers[j])
        if not torch.equal(candidate, limit):
            current, steps = candidate, steps + (1 << j)
    return limit, steps + 1


def _classes_from_limit(limit: torch.Tensor):
    """Class labels (canonical ids), class-level order and covers from a limit R."""
    n = limit.shape[0]
    mutual = limit & limit.T
    first = torch.argmax(mutual.to(torch.uint8), dim=1)  # smallest mutually reachable
    reps, raw = torch.unique(first, return_inverse=True)
    class_r = limit[reps][:, reps]
    below = class_r.sum(dim=1).cpu().numpy()
    smallest = reps.cpu().numpy()  # reps are the smallest members
    canon = torch.as_tensor(np.lexsort((smallest, below)), device=limit.device)
    new_id = torch.empty_like(canon)
    new_id[canon] = torch.arange(canon.numel(), device=limit.device)
    labels = new_id[raw]
    class_r = class_r[canon][:, canon]
    eye = torch.eye(class_r.shape[0], dtype=torch.bool, device=limit.device)
    strict = class_r & ~eye
    covers = strict & ~_bool_product(strict, strict)
    hi, lo = torch.nonzero(covers, as_tuple=True)  # covers[hi, lo]: lo -> hi
    del n
    return labels, torch.stack([lo, hi], dim=1)


# ------------------------------------------------------------------ public analysis
class OrderStructure(NamedTuple):
    """Everything :func:`order_structure` computes for one mask."""

    R: torch.Tensor  # (n, n) bool limit reachability
    depth: int  # smallest L with A^L = R
    hasse: nx.DiGraph  # Hasse diagram of the classes
    labels: torch.Tensor  # (n,) long: Hasse node of each position


def _resolve_method(mask: torch.Tensor, method: str) -> str:
    check_choice("method", method, _METHODS)
    if method == "auto":
        return "bitset" if mask.device.type == "cpu" else "matmul"
    return method


def _build_hasse(labels: np.ndarray, covers: np.ndarray, n_classes: int) -> nx.DiGraph:
    graph = nx.DiGraph()
    order = np.argsort(labels, kind="stable")
    bounds = np.searchsorted(labels[order], np.arange(n_classes + 1))
    members = order.tolist()
    bounds = bounds.tolist()
    graph.add_nodes_from(
        (c, {"members": tuple(members[bounds[c] : bounds[c + 1]])}) for c in range(n_classes)
    )
    graph.add_edges_from(map(tuple, np.asarray(covers).reshape(-1, 2).tolist()))
    graph.graph["n_positions"] = int(labels.size)
    return graph


def order_structure(
    mask: torch.Tensor, *, method: str = "auto", compute_depth: bool = True
) -> OrderStructure:
    """Limit reachability, depth and Hasse diagram of ``mask`` in one pass.

    Parameters
    ----------
    mask : (n, n) bool tensor.
    method : "auto" (bitset on CPU tensors, matmul elsewhere), "bitset" or "matmul";
        see the module docstring for algorithms and costs.
    compute_depth : bool. When False ``depth`` is returned as -1 (saves the BFS).

    Returns
    -------
    OrderStructure(R, depth, hasse, labels), ``R`` and ``labels`` on ``mask.device``.
    """
    validate_mask(mask)
    method = _resolve_method(mask, method)
    compute_depth = check_bool("compute_depth", compute_depth)
    if method == "bitset":
        closure = _closure_bitset(mask)
        r_np = _expand_reach(closure)
        depth = _depth(closure.packed, _reach_count(closure)) if compute_depth else -1
        hasse = _build_hasse(closure.labels, closure.covers, len(closure.reach))
        return OrderStructure(
            torch.from_numpy(r_np), depth, hasse, torch.from_numpy(closure.labels)
        )
    limit, depth = _closure_matmul(mask)
    labels, covers = _classes_from_limit(limit)
    labels_np = labels.cpu().numpy()
    hasse = _build_hasse(labels_np, covers.cpu().numpy(), int(labels_np.max()) + 1)
    return OrderStructure(limit, depth if compute_depth else -1, hasse, labels)


def reachability_limit(mask: torch.Tensor, *, method: str = "auto") -> tuple[torch.Tensor, int]:
    """Limit reachability ``R = lim A^L`` and the depth ``L*`` (smallest L with A^L = R).

    ``L* = 0`` when no information flows between positions (``R = I``), ``1`` for dense
    masks (``A`` already transitive: causal, block-causal, prefix-LM, ...), ``n - 1`` for
    the chain. See the module docstring for the algorithms.

    Returns
    -------
    (R, depth): ``R`` an (n, n) bool tensor on ``mask.device``, ``depth`` an int.
    """
    result = order_structure(mask, method=method)
    return result.R, result.depth


def hasse_diagram(mask: torch.Tensor, *, method: str = "auto") -> nx.DiGraph:
    """Hasse diagram of the partial order that ``mask`` induces on its position classes.

    Nodes are the classes of mutually reachable positions (node attribute ``members``: the
    sorted tuple of positions), numbered in a topological order (see module docstring);
    edges are the covering relations, from the attended class to the attending class.
    ``graph.graph["n_positions"]`` holds ``n``.
    """
    validate_mask(mask)
    if _resolve_method(mask, method) == "bitset":  # the closure alone: R is not needed
        closure = _closure_bitset(mask)
        return _build_hasse(closure.labels, closure.covers, len(closure.reach))
    return order_structure(mask, method=method, compute_depth=False).hasse


def condensation_graph(mask: torch.Tensor) -> nx.DiGraph:
    """The quotient of the mask graph by its classes (before transitive reduction).

    Same nodes (ids, ``members``) as :func:`hasse_diagram`; an edge ``a -> b`` whenever
    some position of class ``b`` attends some position of class ``a`` (``a != b``).
    For drawing the pipeline mask -> R -> condensation -> Hasse diagram.
    """
    result = order_structure(mask, compute_depth=False)
    graph = nx.DiGraph()
    graph.add_nodes_from(result.hasse.nodes(data=True))
    labels = result.labels.cpu()
    q, k = torch.nonzero(mask.cpu(), as_tuple=True)
    pairs = {(int(a), int(b)) for a, b in zip(labels[k], labels[q]) if int(a) != int(b)}
    graph.add_edges_from(sorted(pairs))
    return graph


def tokens_reached(R: torch.Tensor, inputs) -> list[set[int]]:
    """For each position ``q`` the set of source tokens it can read through ``R``:
    the union of ``inputs[k]`` over ``k`` with ``R[q, k]``."""
    validate_mask(R, "R")
    if isinstance(inputs, (str, bytes)) or not hasattr(inputs, "__len__"):
        raise TypeError(
            f"inputs: expected a sequence of {R.shape[0]} token collections, got {describe(inputs)}"
        )
    if len(inputs) != R.shape[0]:
        raise ValueError(f"inputs: expected {R.shape[0]} entries, got {len(inputs)}")
    r_np = R.cpu().numpy()
    return [{t for k in np.flatnonzero(r_np[q]) for t in inputs[k]} for q in range(len(inputs))]


# ------------------------------------------------------------- per-pair first layer
def first_reach_layer(mask: torch.Tensor) -> torch.Tensor:
    """For every pair the smallest number of layers ``L >= 1`` with ``R^(L)[q, k]``, or 0
    where ``k`` never reaches ``q`` (int64, on the CPU).

    ``1`` marks ``A = mask OR I``: the mask and the diagonal the residual adds.

    >>> first_reach_layer(torch.tensor([[False, False], [True, False]])).tolist()
    [[1, 0], [1, 1]]
    >>> chain = torch.tensor([[0, 0, 0], [1, 0, 0], [0, 1, 0]], dtype=torch.bool)
    >>> first_reach_layer(chain)[2].tolist()
    [2, 1, 1]
    """
    validate_mask(mask)
    first = torch.zeros(mask.shape, dtype=torch.int64)
    for layer, reach in enumerate(reachability_sequence(mask.detach().cpu()), start=1):
        first[reach & (first == 0)] = layer
    return first


# ------------------------------------------------- long sequences: never n^2 bools
class PackedOrderStructure(NamedTuple):
    """What :func:`packed_order_structure` computes: :class:`OrderStructure` with ``R``
    bit-packed (``n^2 / 8`` bytes instead of ``n^2``)."""

    reach: np.ndarray  # (n, ceil(n / 64)) uint64: bit k of row q (word k // 64) = R[q, k]
    depth: int  # smallest L with A^L = R (-1 when not computed)
    hasse: nx.DiGraph  # Hasse diagram of the classes, numbered as hasse_diagram numbers them
    labels: np.ndarray  # (n,) int64: Hasse node of each position


def packed_adjacency(mod, n: int, *, block_bytes: int = 1 << 20) -> np.ndarray:
    """``A = M OR I`` of a ``mask_mod`` on ``n`` positions, bit-packed: bit ``k`` of row
    ``q`` (word ``k // 64``) is ``A[q, k]``.

    The mod is evaluated on blocks of rows (at most ``block_bytes`` bools at a time, a
    cache-sized block by default) and each block is packed at once, so no ``n x n`` bool
    tensor is formed: memory ``n^2 / 8`` bytes plus one block. The blocks are evaluated
    on one intra-op thread (the caller's setting is restored): a block is a few small
    element-wise operations, and synchronising threads for each one made building ``A``
    of a sliding window at ``n = 32768`` 2-3x slower on a loaded 2-core machine.

    >>> from companion.hasse.masks import chain_mask_mod
    >>> packed_adjacency(chain_mask_mod, 3)[:, 0].tolist()  # rows 1, 3 = 0b11, 6 = 0b110
    [1, 3, 6]
    """
    n = check_int("n", n, minimum=1)
    block_bytes = check_int("block_bytes", block_bytes, minimum=1)
    if not callable(mod):
        raise TypeError(f"mod: expected a mask_mod(b, h, q_idx, kv_idx), got {describe(mod)}")
    words = (n + 63) // 64
    packed = np.zeros((n, words), dtype=np.uint64)
    rows = max(1, block_bytes // n)
    index = torch.int32 if n < 2**31 else torch.int64  # as FlexAttention passes them
    zero = torch.zeros((), dtype=index)
    keys = torch.arange(n, dtype=index)[None, :]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            queries = torch.arange(start, stop, dtype=index)[:, None]
            block = torch.broadcast_to(torch.as_tensor(mod(zero, zero, queries, keys)),
                                       (stop - start, n)).to(torch.bool)
            packed[start:stop] = _pack_rows(block.numpy())
            _set_diagonal(packed[start:stop], start)
    finally:
        torch.set_num_threads(threads)
    return packed


def _position_reach(closure: _Closure, n: int) -> np.ndarray:
    """Packed position-level R from the class-level closure, without n^2 bools: the
    classes are swept in topological order, each OR-ing the member bit sets of its
    covers' rows (every class below ``c`` lies below a cover of ``c``)."""
    labels = closure.labels
    if closure.triangular and np.array_equal(labels, np.arange(n)):
        return _packed_from_ints(closure.reach, n)
    n_classes = len(closure.reach)
    words = (n + 63) // 64
    members = np.zeros((n_classes, words), dtype=np.uint64)
    q = np.arange(n)
    np.bitwise_or.at(members, (labels, q >> 6),
                     np.left_shift(np.uint64(1), (q & 63).astype(np.uint64)))
    rows = _ints_from_packed(members)
    del members
    covers = closure.covers[np.argsort(closure.covers[:, 1], kind="stable")]
    bounds = np.searchsorted(covers[:, 1], np.arange(n_classes + 1))
    lower = covers[:, 0].tolist()
    for c in range(n_classes):  # class ids are topological: covers come first
        row = rows[c]
        for u in lower[bounds[c]:bounds[c + 1]]:
            row |= rows[u]
        rows[c] = row
    return _packed_from_ints([rows[label] for label in labels.tolist()], n)


def packed_adjacency_from_edges(q_idx, kv_idx, n: int) -> np.ndarray:
    """``A = M OR I`` packed as :func:`packed_adjacency` packs it, from the mask's edge
    list: ``M[q_idx[i], kv_idx[i]] = True`` (integer sequences or tensors of one length;
    repeats allowed). Memory ``n^2 / 8`` bytes plus the edges.

    >>> packed_adjacency_from_edges([2], [0], 3)[:, 0].tolist()  # 0b101 = 5
    [1, 2, 5]
    """
    n = check_int("n", n, minimum=1)
    q = torch.as_tensor(q_idx).cpu().numpy()
    k = torch.as_tensor(kv_idx).cpu().numpy()
    if q.ndim != 1 or k.shape != q.shape or not (np.issubdtype(q.dtype, np.integer)
                                                 and np.issubdtype(k.dtype, np.integer)):
        raise ValueError(f"q_idx, kv_idx: expected two 1-D integer sequences of one length, "
                         f"got shapes {q.shape} and {k.shape}")
    if q.size and (min(q.min(), k.min()) < 0 or max(q.max(), k.max()) >= n):
        raise ValueError(f"q_idx, kv_idx: expected positions in [0, {n}), got "
                         f"[{min(q.min(), k.min())}, {max(q.max(), k.max())}]")
    packed = np.zeros((n, (n + 63) // 64), dtype=np.uint64)
    k = k.astype(np.int64)
    np.bitwise_or.at(packed, (q.astype(np.int64), k >> 6),
                     np.left_shift(np.uint64(1), (k & 63).astype(np.uint64)))
    _set_diagonal(packed)
    return packed


def packed_order_structure(packed: np.ndarray, *,
                           compute_depth: bool = True) -> PackedOrderStructure:
    """Limit reachability (bit-packed), depth and Hasse diagram from a packed ``A``
    (:func:`packed_adjacency` of a ``mask_mod``, :func:`packed_adjacency_from_edges` of
    an edge list), for long sequences: no ``n x n`` bool array is ever formed.

    The same results as :func:`order_structure` on the dense mask (``R`` packed like
    ``A``; :func:`unpack_reach` gives the dense one back), by the same bitset algorithms.
    Memory about ``5 n^2 / 8`` bytes (``A``, the closure's rows, ``R``, the depth
    search's two bit sets per node), under 1 GiB at ``n = 32768`` for causal,
    sliding-window and sparse random masks. Masks whose graph has cycles go through the
    edge list (scipy's strongly connected components), so a dense non-triangular mask
    (bidirectional, block-causal) at such ``n`` needs memory for its ``n^2`` edges.

    >>> from companion.hasse.masks import sliding_window_mask_mod
    >>> result = packed_order_structure(packed_adjacency(sliding_window_mask_mod(3), 7))
    >>> result.depth, result.hasse.number_of_edges()
    (3, 6)
    >>> bool(unpack_reach(result.reach, 7)[6, 0])
    True
    """
    compute_depth = check_bool("compute_depth", compute_depth)
    if not isinstance(packed, np.ndarray) or packed.dtype != np.uint64 or packed.ndim != 2 \
            or packed.shape[0] < 1 or packed.shape[1] != (packed.shape[0] + 63) // 64:
        raise ValueError(f"packed: expected an (n, ceil(n / 64)) uint64 array with n >= 1, "
                         f"got {describe(packed)}")
    n = packed.shape[0]
    closure = _closure_packed(packed)
    reach = _position_reach(closure, n)
    r_count = int(np.bitwise_count(reach).sum())
    hasse = _build_hasse(closure.labels, closure.covers, len(closure.reach))
    labels = closure.labels
    del closure
    depth = _depth(packed, r_count) if compute_depth else -1
    return PackedOrderStructure(reach, depth, hasse, labels)


def unpack_reach(reach: np.ndarray, n: int) -> torch.Tensor:
    """The dense ``(n, n)`` bool tensor of packed rows (:class:`PackedOrderStructure`).

    >>> unpack_reach(np.array([[1], [3]], dtype=np.uint64), 2).int().tolist()
    [[1, 0], [1, 1]]
    """
    n = check_int("n", n, minimum=1)
    if not isinstance(reach, np.ndarray) or reach.dtype != np.uint64 or reach.ndim != 2 \
            or reach.shape != (n, (n + 63) // 64):
        raise ValueError(f"reach: expected a ({n}, {(n + 63) // 64}) uint64 array, got "
                         f"{describe(reach)}")
    return torch.from_numpy(_unpack_rows(reach, n))
