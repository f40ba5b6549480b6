"""The bitset closure of a mask :cite:`li2026hasse`: the limit ``R`` of
:mod:`companion.hasse.reachability`, its classes and its Hasse diagram, on bit-packed rows.

Algorithm
---------
1. strongly connected components (none to compute when the mask is lower triangular,
   otherwise ``scipy.sparse.csgraph.connected_components``) and a topological order of
   the classes (:func:`_topological_class_order`);
2. closure and transitive reduction in one sweep over the classes in topological order
   (:func:`_closure_packed`): for class ``c`` take its highest-ranked in-neighbour ``u``
   not yet known to reach ``c``; the edge ``u -> c`` is a covering edge, so
   ``reach[c] |= reach[u]``; repeat until every in-neighbour is known. Cost
   ``O((C + H) * C / 64)`` word operations for ``C`` classes and ``H`` Hasse edges, plus
   one pass over the mask.

The result (:class:`_Closure`) holds each class's reach as packed bits, the position ->
class labels and the covering edges, from which :func:`_build_hasse` numbers the Hasse
nodes as every method of the package does.
"""
from __future__ import annotations

from typing import NamedTuple

import networkx as nx
import numpy as np
import torch



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
