"""The depth ``L*`` of a mask (the smallest ``L`` with ``A^L = R``) from its bitset
closure (:mod:`companion.hasse.closure`) :cite:`li2026hasse`.

Algorithm
---------
``0`` if ``R = I``, ``1`` if ``A = R`` (dense masks: one popcount comparison, no
product), otherwise (:func:`_depth`):

- masks whose rows are intervals with non-decreasing ends (causal, sliding window,
  block-causal, chain) skip the search: row ``q`` of ``A^L`` is the interval between the
  ``L``-fold compositions of the row ends, and the depth is the number of compositions
  until both settle, found by binary lifting in ``O(n log n)``
  (:func:`_row_intervals`, :func:`_depth_intervals`), where a search would take one
  Python iteration per level, hundreds for a narrow window at long ``n``
  (``benchmarks/bench_reachability.py`` records both);
- every other mask: a bit-parallel breadth-first search from all sources at once
  (:func:`_depth_bitset`): sources are grouped in blocks of ``64 w`` (``w`` words per
  node, chosen from the mask's bandwidth), every (block, node) pair carries the bit set
  of the block's sources that reached it, and all blocks advance in lockstep, one Python
  iteration per BFS level. Cost ``O(sum over levels of frontier edges * w)`` word
  operations, ``O(E n / 64)`` in the worst case.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from companion.hasse.closure import _edges_from_packed


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
