"""The key of every fastRG edge: ``j ~ Khat[:, b] / colsum_b(Khat)`` for its cell's
key cluster ``b``.

Two exact samplers of that law, chosen per block of groups by :class:`_KeyTable`:
rejection from the uniform proposal (:func:`_rejection_draw`: accept column ``c`` with
probability ``Khat_cb / max_c Khat_cb``, expected ``max / mean`` proposals per draw), and
an inverse-CDF search (:func:`_cdf_table`, :func:`_search_rows`) for rows too skewed for
rejection. :func:`_draw_keys` draws every edge's key, block of groups by block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from companion.sbm.poisson import _RandomSource
from companion.sbm.tensor_ops import repeat_each, transposed_copy

if TYPE_CHECKING:
    from companion.sbm.fastrg import FastRGTuning

def _draw_keys(km: torch.Tensor, counts: torch.Tensor, n: int, draws: _RandomSource,
               tuning: FastRGTuning, index_dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """The key (``index_dtype``) of every edge, ``j ~ Khat[:, b] / colsum_b(Khat)`` for its
    cell's ``b``.

    Groups are taken in blocks (``tuning.table_block_entries`` bounds the key tables of a
    block, :class:`_KeyTable`), and the edges of a block in steps of cells holding about
    ``tuning.draw_block`` edges (bounded scratch)."""
    num_groups, m, kc = km.shape
    key = torch.empty(int(counts.sum()), dtype=index_dtype, device=km.device)
    cells_per_group = n * kc
    groups_per_block = max(1, tuning.table_block_entries // (m * kc))
    cells_per_step = max(kc, tuning.draw_block * counts.numel() // max(key.numel(), 1))
    # the edges of the cells before c0, summed step by step (no [cells] cumulative sum: a
    # cell count's worth of memory less, in the sampler's largest allocations)
    e0 = 0
    for g0 in range(0, num_groups, groups_per_block):
        g1 = min(g0 + groups_per_block, num_groups)
        first, stop = g0 * cells_per_group, g1 * cells_per_group
        if not bool(counts[first:stop].any()):
            continue  # no edge in this block: no table to build
        table = _KeyTable(km[g0:g1], n, tuning)
        for c0 in range(first, stop, cells_per_step):
            c1 = min(c0 + cells_per_step, stop)
            e1 = e0 + int(counts[c0:c1].sum())
            if e1 > e0:
                base = repeat_each(table.cell_base[c0 - first:c1 - first], counts[c0:c1],
                                   e1 - e0)
                table.draw(base, draws, out=key[e0:e1])
            e0 = e1
    return key


class _KeyTable:
    """What the key draws of one block of groups read: for rejection, the acceptance
    probabilities ``Khat_jb / max_j Khat_jb`` (float64: the coin is compared exactly;
    clusters without mass get 0, they are never asked for); for search, the inverse-CDF
    table of :func:`_cdf_table`.  ``cell_base[c]`` is the offset of table row
    ``(group - g0) k + b`` of cell ``c = (group, query, b)`` of the block.

    ``tuning.key_draw == "auto"`` takes rejection unless some key cluster of the block
    accepts fewer than ``tuning.min_acceptance`` of the proposals (mean / max)."""

    def __init__(self, km_block: torch.Tensor, n: int, tuning: FastRGTuning):
        groups, m, kc = km_block.shape
        device = km_block.device
        # a view of k_membership whenever the block holds one group (the size-1 dim lets
        # reshape skip the copy): read only. Several groups: the contiguous copy reshape
        # would make, by transposed_copy (the same numbers, written in tiles of rows)
        if groups == 1:
            weights = km_block.transpose(1, 2).reshape(kc, m)
        else:
            weights = transposed_copy(km_block).reshape(groups * kc, m)
        row_max = weights.amax(1).to(torch.float64)
        used = row_max > 0
        # the float64 weights (a new copy unless they are float64 already: then possibly
        # the caller's k_membership itself, never written), which the table is made of
        weights64 = weights.to(torch.float64)
        if tuning.key_draw == "auto":
            # row sums of the float64 copy where it is contiguous: the numbers of
            # ``weights.sum(1, dtype=float64)`` (test), a contiguous reduction without
            # widening each entry again
            total = (weights64 if weights.is_contiguous() else weights).sum(1, dtype=torch.float64)
            acceptance = (total[used] / m) / row_max[used]
            search = bool(acceptance.numel()) and bool(acceptance.min() < tuning.min_acceptance)
        else:
            search = tuning.key_draw == "search"
        self.width = m
        self.accept = self.cdf = self.last = None
        if search:
            self.cdf, self.last = _cdf_table(weights64)
        else:
            scale = torch.where(used, row_max, 1.0)[:, None]
            if weights.dtype == torch.float64:  # out of place: see weights64
                self.accept = torch.div(weights64, scale).reshape(-1)
            else:  # in place on the new float64 copy: one [rows, m] buffer fewer
                self.accept = weights64.div_(scale).reshape(-1)
        rows = torch.arange(groups, device=device)[:, None, None] * kc
        rows = (rows + torch.arange(kc, device=device)) * m
        # int32 where every offset fits: half the memory (one entry per cell, and per edge
        # once repeated), the same numbers
        if groups * kc * m < 2**31:
            rows = rows.to(torch.int32)
        self.cell_base = rows.expand(groups, n, kc).reshape(-1)

    def draw(self, base: torch.Tensor, draws: _RandomSource, out: torch.Tensor) -> None:
        """One key per entry of ``base`` (a ``cell_base`` entry per edge), written into
        ``out`` (int32 or int64, as long as ``base``)."""
        if self.accept is not None:
            _rejection_draw(self.accept, self.width, base, draws, out)
        else:
            out.copy_(_search_rows(self.cdf, self.last, base, draws))


def _cdf_table(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF table of the rows of ``weights`` ``[rows, W]`` (float64): the CDF of
    row ``r`` offset by ``r`` and flattened into one sorted array, so that one
    ``searchsorted`` serves all rows, and the last column with positive mass per row.
    Rows with zero total are never requested (no edge uses them) and get a uniform CDF
    to keep the array sorted."""
    num_rows, width = weights.shape
    weights = weights.to(torch.float64)
    total = weights.sum(1, keepdim=True)
    empty = total <= 0
    probs = torch.where(empty, 1.0 / width, weights / torch.where(empty, 1.0, total))
    del total, empty
    # last column with positive mass: guards against r + u rounding up to r + 1
    last = width - 1 - (probs > 0).flip(1).to(torch.int8).argmax(1)
    cdf = probs.cumsum_(1).clamp_(max=1.0)
    cdf[:, -1] = 1.0
    cdf += torch.arange(num_rows, device=weights.device, dtype=torch.float64)[:, None]
    return cdf.reshape(-1), last


def _search_rows(
    table: torch.Tensor, last: torch.Tensor, base: torch.Tensor, draws: _RandomSource
) -> torch.Tensor:
    """Draw one column per entry of ``base`` (``row * width``) from the table of
    :func:`_cdf_table`.

    On CPU the draws are searched in sorted order (numpy narrows each search from the
    previous one, so the table is walked once, in cache order) and the answers put back
    in draw order, where a random-order search jumps across the table at every draw.
    """
    width = table.numel() // last.numel()
    row = torch.div(base, width, rounding_mode="floor")
    u = draws.uniform(row.numel())
    u += row
    if row.device.type == "cpu" and u.numel() > 1:
        values = u.numpy()
        order = np.argsort(values)
        col = torch.empty(u.numel(), dtype=torch.int64)
        col.numpy()[order] = np.searchsorted(table.numpy(), values[order], side="right")
    else:
        col = torch.searchsorted(table, u, right=True)
    del u
    col -= base
    return torch.minimum(col, last[row])


def _rejection_draw(
    accept: torch.Tensor, width: int, base: torch.Tensor, draws: _RandomSource,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw one column per entry of ``base`` by rejection from the uniform proposal.

    Row ``r`` of the flat table ``accept`` (``[rows * width]``, float64) holds
    ``weight[r, c] / max_c weight[r, c]``; ``base`` holds ``r * width`` for every draw.
    Propose ``c`` uniformly and accept with probability ``accept[r, c]``; rejected draws
    are proposed again, so ``Pr[c] = weight[r, c] / sum_c weight[r, c]`` exactly.  One
    look-up per proposal and no table to search, expected ``max / mean`` proposals per
    draw (about two for sigmoid memberships; with ``key_draw="auto"`` the caller bounds it
    by falling back to :func:`_search_rows` for skewed rows).  The columns go into
    ``out`` (int32 or int64, as long as ``base``; a new int64 tensor if None), which is
    returned."""
    if out is None:
        out = torch.empty(base.numel(), dtype=torch.int64, device=base.device)
    if draws.rng is not None and accept.device.type == "cpu":
        _rejection_draw_numpy(accept.numpy(), width, base.numpy(), draws.rng, out.numpy())
    else:
        _rejection_draw_torch(accept, width, base, draws, out)
    return out


def _rejection_draw_torch(
    accept: torch.Tensor, width: int, base: torch.Tensor, draws: _RandomSource,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`_rejection_draw` in torch's kernels (CUDA, or torch's CPU uniforms), into
    ``out`` (a new tensor if None), which is returned."""
    if out is None:
        out = torch.empty(base.numel(), dtype=torch.int64, device=base.device)
    pending = None  # indices into out still to draw (None: all of them)
    while base.numel():
        # one float64 uniform gives the column (integer part of x) and the coin
        # (fractional part: 53 - log2(width) random bits)
        x = draws.uniform(base.numel())
        x.mul_(width)
        col = x.to(torch.int64).clamp_(max=width - 1)
        coin = x.sub_(col)
        # index_select, not take: the same gather, the faster of the two on CPU
        # (benchmarks/bench_sbm.py)
        rejected = draws.nonzero(coin >= accept.index_select(0, col + base))
        del x, coin
        # write every proposal; the rejected ones are overwritten in a later round
        if pending is None:
            out.copy_(col)
            pending = rejected
        else:
            out.index_copy_(0, pending, col.to(out.dtype))
            pending = pending.index_select(0, rejected)
        base = base.index_select(0, rejected)
    return out


def _rejection_draw_numpy(accept: np.ndarray, width: int, base: np.ndarray,
                          rng: np.random.Generator, out: np.ndarray) -> np.ndarray:
    """:func:`_rejection_draw` on CPU with numpy's uniforms, in numpy's kernels: the same
    operations on the same uniforms as :func:`_rejection_draw_torch` (so the same keys,
    bit for bit), with fewer conversions between the two libraries' arrays, numpy's
    ``take`` for the look-ups and the compaction.  The first round's proposals are
    written straight into ``out`` (int32 or int64, as long as ``base``), and every
    round's indices, look-ups and coin comparisons into scratch arrays made once: a
    round's arrays are no longer than the first's."""
    index = np.empty(base.size, dtype=np.int64)
    looked_up = np.empty(base.size)
    is_rejected = np.empty(base.size, dtype=bool)
    pending = None  # indices into out still to draw (None: all of them)
    while base.size:
        size = base.size
        x = rng.random(size)
        x *= width
        # every proposal of the first round is written (the rejected ones are overwritten
        # in a later round); a later round's only where it is still pending
        col = out if pending is None else np.empty(size, dtype=out.dtype)
        np.copyto(col, x, casting="unsafe")  # truncation, as astype and torch's conversion
        np.minimum(col, width - 1, out=col)
        x -= col  # the coin
        np.add(col, base, out=index[:size], casting="unsafe")
        # every index is in the table (col < width): no bounds check ("clip")
        accept.take(index[:size], out=looked_up[:size], mode="clip")
        rejected = np.flatnonzero(np.greater_equal(x, looked_up[:size],
                                                   out=is_rejected[:size]))
        del x
        if pending is None:
            pending = rejected
        else:
            out[pending] = col
            pending = pending.take(rejected)
        base = base.take(rejected)
    return out
