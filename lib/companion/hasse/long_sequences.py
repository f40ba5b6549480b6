"""Order structure of long sequences :cite:`li2026hasse`, never an ``n x n`` bool array.

:func:`packed_order_structure` runs the bitset method of
:mod:`companion.hasse.reachability` from a packed ``A`` (:func:`packed_adjacency` of a
``mask_mod``, a block of rows at a time, or :func:`packed_adjacency_from_edges`) and
returns ``R`` packed (``n = 32768``: ``R`` is 128 MiB packed, 1 GiB as bools);
:func:`unpack_reach` gives the bool matrix back where it fits.
"""
from __future__ import annotations

from typing import NamedTuple

import networkx as nx
import numpy as np
import torch

from companion._validate import check_bool, check_int, describe
from companion.hasse.closure import (_build_hasse, _Closure, _closure_packed, _ints_from_packed,
                                     _pack_rows, _packed_from_ints, _set_diagonal, _unpack_rows)
from companion.hasse.depth import _depth

__all__ = ["PackedOrderStructure", "packed_adjacency", "packed_adjacency_from_edges",
           "packed_order_structure", "unpack_reach"]


class PackedOrderStructure(NamedTuple):
    """What :func:`packed_order_structure` computes: the
    :class:`~companion.hasse.reachability.OrderStructure` with ``R``
    bit-packed (``n^2 / 8`` bytes instead of ``n^2``).

    >>> from companion.hasse.masks import chain_mask_mod
    >>> result = packed_order_structure(packed_adjacency(chain_mask_mod, 4))
    >>> isinstance(result, PackedOrderStructure), result.reach.shape, result.depth
    (True, (4, 1), 3)
    """

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
    element-wise operations, each too small to repay synchronising threads
    (``benchmarks/bench_reachability.py`` records the measurement).

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
