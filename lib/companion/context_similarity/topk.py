"""Similarity matrices and the most similar token pairs of every head.

:func:`similarity_matrices` is the batched Gram matrix ``S^{lh} = Z^{lh} Z^{lh T}`` (zero
diagonal). :func:`top_pairs` finds the ``k`` most similar pairs ``i < j`` of valid tokens
per window, layer and head without a top-k over all ``T(T-1)/2`` pairs of every matrix:
a pyramid of maxima (row parts, segments, shorter and shorter runs) is searched top-down,
``k`` members per level (:func:`_descend`). The plain definition it equals is
:func:`companion.context_similarity.reference.top_pairs_reference`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from companion._validate import check_int
from companion.context_similarity.workspace import Workspace, work_buffer

__all__ = ["TopPairsTuning", "similarity_matrices", "top_pairs"]


@dataclass(frozen=True)
class TopPairsTuning:
    """Cache sizes that set how many similarity matrices :func:`top_pairs` computes at once.

    On a CPU the products are made ``step`` heads at a time, where ``step`` holds about
    ``core_cache_bytes`` of products: the passes right after the product (batch sum,
    masking, segment maxima) then find it in the core's own cache (L2). ``heads_per_group``
    steps make a group whose selection (:func:`_descend`) runs while the group's products
    (about ``heads_per_group * core_cache_bytes``, 8 MiB by default) sit in the shared
    cache (L3); a buffer of all products would be written back to main memory and gathered
    from there. On other devices everything is done at once.

    ``mask_by_minimum``: the entries that are never pairs are set to ``-inf`` by one
    vectorised ``minimum`` with a ``[B, T, T]`` limit (``+inf`` at the candidates,
    ``-inf`` elsewhere) instead of an ``index_fill_`` of their flat offsets. For every
    number, ``-0.0`` and the infinities the two give the same bits; they differ only at
    a NaN among the never-pairs (``minimum`` keeps it). Such a NaN, unless its segment is
    excluded, wins every level of the search (``amax``, max pooling and ``topk`` all put
    NaN first, at any position of a run) and shows among the selected values, where
    a NaN or ``+inf`` sends :func:`top_pairs` back to the ``index_fill_`` (which then
    raises or not, as it decides alone). So none of these changes the result, only the
    speed.

    >>> tuning = TopPairsTuning(core_cache_bytes=1 << 16, heads_per_group=2)
    >>> z = torch.randn(1, 1, 3, 6, 4, generator=torch.Generator().manual_seed(0))
    >>> valid = torch.ones(1, 6, dtype=torch.bool)
    >>> fast, default = top_pairs(z, valid, 2, tuning=tuning), top_pairs(z, valid, 2)
    >>> all(torch.equal(a, b) for a, b in zip(fast, default))  # only the speed changes
    True
    """

    core_cache_bytes: int = 1 << 20
    heads_per_group: int = 8
    mask_by_minimum: bool = True


def similarity_matrices(
    outputs: torch.Tensor, zero_diagonal: bool = True, metric: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Context similarity matrices: pairwise dot products of every head's output vectors.

    Parameters
    ----------
    outputs : Tensor [B, L, H, T, d]
        From :func:`head_outputs`.
    zero_diagonal : bool
        Set ``S_ii = 0`` (the paper studies off-diagonal similarity).
    metric : Tensor [L, H, d, d], optional
        Symmetric positive semi-definite per-head metric ``M``: ``S_ij = z_i^T M z_j``
        (``metric=wo_gram(model)`` turns pre-W_O vectors into post-W_O similarities).
    out : Tensor [B, L, H, T, T], optional
        A contiguous tensor of the outputs' dtype and device to write the matrices into
        (a buffer kept between batches; the same numbers as without it).

    Returns
    -------
    Tensor [B, L, H, T, T] (``out`` where given)

    >>> z = torch.arange(12.0).reshape(1, 1, 1, 3, 4)
    >>> buf = torch.empty(1, 1, 1, 3, 3)
    >>> similarity_matrices(z, out=buf) is buf, buf[0, 0, 0, 0].tolist()
    (True, [0.0, 38.0, 62.0])

    Complexity
    ----------
    One batched matrix product, O(B L H T^2 d) time (plus O(B L H T d^2) with a metric).

    References
    ----------
    .. [1] Y. Halevi, Y. Tzach, R. Gross, I. Rosner, I. Kanter, "Self-attention vector
       output similarities reveal how machines pay attention", Physica A 686 (2026)
       131363, arXiv:2512.21956: context similarity as the dot products of a head's
       output vectors (section not known here; the abstract and a secondary summary of
       the paper)

    Examples
    --------
    >>> outputs = torch.tensor([[[[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]]]])  # [B, L, H, T, d]
    >>> similarity_matrices(outputs)[0, 0, 0]
    tensor([[0., 0., 1.],
            [0., 0., 1.],
            [1., 1., 0.]])
    """
    if not isinstance(outputs, torch.Tensor) or outputs.dim() != 5:
        got = tuple(outputs.shape) if isinstance(outputs, torch.Tensor) else type(outputs).__name__
        raise ValueError(f"outputs: expected a 5-D tensor [B, L, H, T, d], got {got}")
    if not outputs.is_floating_point():
        raise TypeError(f"outputs: expected a floating tensor, got {outputs.dtype}")
    if not isinstance(zero_diagonal, bool):
        raise TypeError(f"zero_diagonal: expected a bool, got {zero_diagonal!r} "
                        f"({type(zero_diagonal).__name__})")
    left = outputs
    if metric is not None:
        want = (*outputs.shape[1:3], outputs.shape[-1], outputs.shape[-1])
        if not isinstance(metric, torch.Tensor) or tuple(metric.shape) != want:
            got = tuple(metric.shape) if isinstance(metric, torch.Tensor) else type(metric).__name__
            raise ValueError(f"metric: expected shape {want} [L, H, d, d], got {got}")
        left = torch.matmul(outputs, metric.to(outputs.dtype))
    if out is None:
        sims = torch.matmul(left, outputs.transpose(-1, -2))
    else:
        want = (*outputs.shape[:-1], outputs.shape[-2])
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"out: expected shape {want} [B, L, H, T, T], got {got}")
        if out.dtype != outputs.dtype or out.device != outputs.device:
            raise TypeError(f"out: expected {outputs.dtype} on {outputs.device}, got "
                            f"{out.dtype} on {out.device}")
        if not out.is_contiguous():
            raise ValueError("out: expected a contiguous tensor")
        sims = torch.matmul(left, outputs.transpose(-1, -2), out=out)
    if zero_diagonal:
        sims.diagonal(dim1=-2, dim2=-1).zero_()
    return sims



def _run_max(x: torch.Tensor, width: int) -> torch.Tensor:
    """Maxima of consecutive runs of ``width`` along the last axis of a 2-D tensor.

    Same numbers whichever way; the fastest on a CPU: a reduction over the last axis for
    runs of 32 and more, max pooling for shorter runs (a reduction over short contiguous
    runs does not vectorise).
    """
    if width == 1:
        return x
    if width >= 32:
        return x.view(x.shape[0], -1, width).amax(2)
    return torch.nn.functional.max_pool1d(x.unsqueeze(1), width).squeeze(1)


def _segment_maxima(part: torch.Tensor, seg_len: int, excluded: torch.Tensor,
                    out: torch.Tensor) -> None:
    """Maxima of the segments of ``seg_len`` columns of ``part`` [c, B, T, T] into ``out``
    [c, B, T, T / seg_len], ``-inf`` where ``excluded`` [B, T, T / seg_len]."""
    c, b, t, _ = part.shape
    if seg_len >= 32:  # a reduction over the last axis, straight into out
        torch.amax(part.view(c, b, t, t // seg_len, seg_len), -1, out=out)
    else:  # max pooling: a reduction over short runs does not vectorise
        out.copy_(_run_max(part.view(-1, t), seg_len).view(out.shape))
    out.masked_fill_(excluded, float("-inf"))


def _divisor_at_most(t: int, target: int) -> int:
    """Largest divisor of ``t`` not above ``target`` (at least 1)."""
    return max(s for s in range(1, max(1, min(t, target)) + 1) if t % s == 0)


def top_pairs(
    outputs: torch.Tensor,
    valid: torch.Tensor,
    k: int,
    metric: torch.Tensor | None = None,
    segment: int = 32,
    return_sum: bool = False,
    workspace: Workspace | None = None,
    sort: bool = True,
    tuning: TopPairsTuning = TopPairsTuning(),
):
    """The ``k`` most similar pairs ``i < j`` of valid tokens, per window, layer and head.

    Equal to taking ``similarity_matrices(outputs, metric=metric)``, keeping the strict
    upper triangle of valid pairs and calling ``topk(k)`` (the reference in the tests),
    but without a top-k over all ``T(T-1)/2`` pairs of every matrix, which would cost more
    than the rest of the analysis together. A pyramid of maxima narrows the search:

    1. the similarity matrices are computed into one (reusable) buffer, layer and head
       after layer and head (all windows at once, about a megabyte: the passes below
       then find the product in the processor's cache instead of main memory); there the
       sum over the windows is taken, then the lower triangle inside the diagonal
       ``segment x segment`` blocks, the diagonal and the columns of invalid tokens are
       set to ``-inf``, and each row is cut into *segments* of ``segment`` consecutive
       columns whose maxima are one reduction (32 columns: a reduction over short runs
       does not vectorise);
    2. segments wholly below the diagonal and the rows of invalid tokens get the maximum
       ``-inf`` (their entries are never candidates); *row parts* of a few neighbouring
       segments take the maximum of theirs;
    3. top-down, each level keeps the ``k`` members with the largest maxima and looks only
       at their children, which are contiguous in memory: row parts, then segments, then
       runs of about a quarter of the parent's length, down to single entries (the
       maxima of the runs of the ``k`` kept members are computed on the spot). Every
       top-``k`` entry lies in a member whose maximum is at least the ``k``-th largest
       value, hence in one of the ``k`` members kept at every level, so the result is
       exact; only the ``k`` winners are sorted.

    Parameters
    ----------
    outputs : Tensor [B, L, H, T, d]
        Any strides; the layout of :func:`head_outputs` (windows innermost of the
        matrices, ``outputs.permute(1, 2, 0, 3, 4)`` contiguous) avoids a copy.
    valid : bool Tensor [B, T]
    k : int
        Pairs to return (callers keep only the first ``k_b`` of window ``b``).
    metric : Tensor [L, H, d, d], optional, symmetric (see :func:`similarity_matrices`).
    segment : int
        Target segment length (the largest divisor of ``T`` not above it).
    return_sum : bool
        Also return the sum over the batch of the similarity matrices, zero diagonal,
        [L, H, T, T] (before any masking).
    workspace : Workspace, optional
        Keeps the ``[L H B, T, T]`` buffer (and the smaller ones) between calls (pass the
        same dict each time); the returned sum then lives there too, overwritten by the
        next call.
    sort : bool
        Sort the ``k`` pairs by decreasing similarity (needed to keep a prefix); False
        returns them in no particular order.
    tuning : TopPairsTuning
        How many matrices are computed at once (speed only, never the result).

    Returns
    -------
    (values, i, j) : each [B, L, H, k]. Window ``b`` has ``P_b = n_b (n_b - 1) / 2`` pairs
    of its ``n_b`` valid tokens; its first ``min(k, P_b)`` entries are pairs (``i < j``,
    both valid), sorted by decreasing similarity if ``sort`` (else in no particular
    order). The remaining ``k - min(k, P_b)`` entries, only in windows with fewer than
    ``k`` pairs, are fillers that are never a pair: value ``-inf`` and ``i = j = 0``
    (so indices and distances ``j - i`` stay in range). With ``return_sum``,
    ``(values, i, j, sum)``.

    Complexity
    ----------
    O(B L H T^2 d) for the product, two passes over its entries (segment maxima, batch
    sum) while it is in cache; per matrix, top-k selections over ``T^2 / (seg_len r)`` row
    parts, ``k r`` segments and about ``4 k`` runs per level below (``seg_len`` the segment
    length, ``r`` segments per row part, about ``sqrt(T^2 / (seg_len k))``), and a sort of ``k``.
    Memory: the ``B L H T^2`` buffer.

    Raises
    ------
    TypeError
        ``outputs`` not floating; ``k`` or ``segment`` not an int.
    ValueError
        Wrong shapes, ``valid`` not bool or on another device, ``k`` or ``segment`` below
        1, ``k`` above the ``T(T-1)/2`` pairs, or NaN / inf similarities among valid tokens.

    References
    ----------
    .. [1] Y. Halevi, Y. Tzach, R. Gross, I. Rosner, I. Kanter, "Self-attention vector
       output similarities reveal how machines pay attention", Physica A 686 (2026)
       131363, arXiv:2512.21956: the high-similarity pairs, the top per cent of a head's
       pairs (secondary summary of the paper)

    Examples
    --------
    >>> outputs = torch.tensor([[[[[1.0, 0.0], [0.0, 1.0], [2.0, 0.0]]]]])
    >>> values, i, j = top_pairs(outputs, torch.ones(1, 3, dtype=torch.bool), 1)
    >>> float(values), int(i), int(j)  # tokens 0 and 2: <(1, 0), (2, 0)> = 2
    (2.0, 0, 2)
    """
    if not isinstance(outputs, torch.Tensor) or outputs.dim() != 5:
        got = tuple(outputs.shape) if isinstance(outputs, torch.Tensor) else type(outputs).__name__
        raise ValueError(f"outputs: expected a 5-D tensor [B, L, H, T, d], got {got}")
    if not outputs.is_floating_point():
        raise TypeError(f"outputs: expected a floating tensor, got {outputs.dtype}")
    b, n_l, n_h, t, d = outputs.shape
    if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool or tuple(
            valid.shape) != (b, t) or valid.device != outputs.device:
        got = ((valid.dtype, tuple(valid.shape), str(valid.device))
               if isinstance(valid, torch.Tensor) else type(valid).__name__)
        raise ValueError(f"valid: expected a bool tensor of shape {(b, t)} on "
                         f"{outputs.device}, got {got}")
    k = check_int("k", k, minimum=1)
    segment = check_int("segment", segment, minimum=1)
    if k > t * (t - 1) // 2:
        raise ValueError(f"k: {k} exceeds the {t * (t - 1) // 2} pairs of {t} tokens")
    if metric is not None and (not isinstance(metric, torch.Tensor)
                               or tuple(metric.shape) != (n_l, n_h, d, d)):
        got = tuple(metric.shape) if isinstance(metric, torch.Tensor) else type(metric).__name__
        raise ValueError(f"metric: expected shape {(n_l, n_h, d, d)} [L, H, d, d], got {got}")
    dev, n_matrices = outputs.device, n_l * n_h
    neg_inf = float("-inf")
    if b == 0 or n_matrices == 0:  # no windows, layers or heads: no pairs to search
        empty = torch.empty((b, n_l, n_h, k), dtype=torch.long, device=dev)
        result = outputs.new_empty((b, n_l, n_h, k)), empty, empty.clone()
        return (*result, outputs.new_zeros((n_l, n_h, t, t))) if return_sum else result
    # a view (no copy) for the layout of head_outputs
    right = outputs.permute(1, 2, 0, 3, 4).reshape(n_matrices, b, t, d)
    left = right
    if metric is not None:
        # one [B T, d] x [d, d] product per head (not B broadcast [T, d] x [d, d] ones)
        left = torch.matmul(right.reshape(n_matrices, b * t, d),
                            metric.to(outputs.dtype).reshape(n_matrices, d, d)).view(
                                n_matrices, b, t, d)
    seg_len = _divisor_at_most(t, segment)  # segment length
    n_segments = t // seg_len  # segments per row
    cpu = dev.type == "cpu"
    # heads per step and per group of steps (see TopPairsTuning): on a CPU each step's
    # products fit the core's cache and each group's the shared cache; all at once elsewhere
    matrix_bytes = b * t * t * outputs.element_size()  # one head, all windows
    step = max(1, tuning.core_cache_bytes // matrix_bytes) if cpu else n_matrices
    group = step * tuning.heads_per_group if cpu else n_matrices
    per_group = min(group, n_matrices)
    products = work_buffer(workspace, "similarity", per_group * b * t * t, outputs.dtype, dev)
    maxima = work_buffer(workspace, "segment_maxima", per_group * b * t * n_segments,
                         outputs.dtype, dev)
    total = None
    if return_sum:
        total = work_buffer(workspace, "similarity_sum", n_matrices * t * t, outputs.dtype,
                            dev).view(n_matrices, t, t)
    # Entries that are never pairs, in one [B, T, T] block of matrices: j <= i inside the
    # diagonal segment x segment blocks, and the columns of invalid tokens j (invalid rows
    # i are dropped through the segment maxima below). As flat offsets (index_fill_), or
    # as a limit, +inf at candidates and -inf there (a vectorised minimum; see
    # TopPairsTuning.mask_by_minimum).
    tok = torch.arange(t, device=dev)
    same_block = (tok[:, None] // seg_len) == (tok[None, :] // seg_len)
    in_block_lower = same_block & (tok[None, :] <= tok[:, None])
    never_pair = in_block_lower[None] | ~valid[:, None, :]  # [B, T, T]
    if tuning.mask_by_minimum:
        limit = work_buffer(workspace, "pair_limit", b * t * t, outputs.dtype, dev).view(
            b, t, t).fill_(float("inf")).masked_fill_(never_pair, neg_inf)
    else:
        never = never_pair.view(-1).nonzero().squeeze(1)
    # segments wholly below the diagonal and the rows of invalid tokens i: maximum -inf
    below_diagonal = tok[None, :n_segments] < (tok // seg_len)[:, None]  # [T, n_segments]
    excluded = below_diagonal[None] | ~valid[:, :, None]  # [B, T, n_segments]
    # row parts of segs_per_part neighbouring segments; about sqrt(T n_segments / k) of
    # them balances the first two selections (row parts, then their segments)
    segs_per_part = _divisor_at_most(n_segments, max(1, round(math.sqrt(t * n_segments / k))))
    v = torch.empty(n_matrices * b, k, dtype=outputs.dtype, device=dev)
    i_sel = torch.empty(n_matrices * b, k, dtype=torch.long, device=dev)
    j_sel = torch.empty(n_matrices * b, k, dtype=torch.long, device=dev)
    for group_start in range(0, n_matrices, group):
        group_end = min(n_matrices, group_start + group)
        n_group = group_end - group_start
        sims = products[:n_group * b * t * t].view(n_group, b, t, t)
        seg_max = maxima[:n_group * b * t * n_segments].view(n_group, b, t, n_segments)
        for first in range(group_start, group_end, step):
            last = min(group_end, first + step)  # heads first .. last - 1 of this step
            part = sims[first - group_start:last - group_start]  # [c, B, T, T]
            torch.matmul(left[first:last], right[first:last].transpose(-1, -2), out=part)
            if total is not None:
                torch.sum(part, 1, out=total[first:last])
            if tuning.mask_by_minimum:
                torch.minimum(part, limit, out=part)
            else:
                part.view(last - first, -1).index_fill_(1, never, neg_inf)
            # segment (i, c): row i, columns c seg_len .. (c + 1) seg_len - 1 (contiguous)
            _segment_maxima(part, seg_len, excluded,
                            seg_max[first - group_start:last - group_start])
        rows = slice(group_start * b, group_end * b)
        v[rows], i_sel[rows], j_sel[rows] = _descend(sims.view(-1), seg_max, k, seg_len,
                                                     segs_per_part)
    if total is not None:
        total.diagonal(dim1=1, dim2=2).zero_()
    # NaN ranks above every number and +inf above every finite one: a non-finite output of
    # a valid token shows among the selected values (checking k per matrix, not T^2)
    if bool((v.isnan() | v.isposinf()).any()):
        if tuning.mask_by_minimum:  # perhaps a NaN among the never-pairs (see the tuning)
            return top_pairs(outputs, valid, k, metric=metric, segment=segment,
                             return_sum=return_sum, workspace=workspace, sort=sort,
                             tuning=replace(tuning, mask_by_minimum=False))
        raise ValueError("outputs: expected finite values, got similarities of valid tokens "
                         "that are NaN or inf")
    if sort:
        v, order = v.sort(dim=-1, descending=True, stable=True)
        i_sel, j_sel = i_sel.gather(1, order), j_sel.gather(1, order)
    # A window with fewer than k pairs leaves the rest of its k slots to whatever -inf
    # entries the selection met last (lower triangle, invalid rows or columns: i > j or
    # an invalid token). Those become fillers that are never pairs, i = j = 0, value
    # -inf, placed after the pairs. Only then: the usual batch has no such window.
    n_tok = valid.sum(1)
    if int((n_tok * (n_tok - 1) // 2).min()) < k:
        # row r is window r % b
        valid_rows = valid.expand(n_matrices, b, t).reshape(n_matrices * b, t)
        filler = ~((i_sel < j_sel) & valid_rows.gather(1, i_sel)
                   & valid_rows.gather(1, j_sel))
        order = filler.to(torch.uint8).argsort(dim=-1, stable=True)  # pairs first
        v = v.masked_fill(filler, neg_inf).gather(1, order)
        i_sel = i_sel.masked_fill(filler, 0).gather(1, order)
        j_sel = j_sel.masked_fill(filler, 0).gather(1, order)

    def by_window(x):  # [L H B, k] -> [B, L, H, k]
        return x.view(n_l, n_h, b, k).permute(2, 0, 1, 3).contiguous()

    result = by_window(v), by_window(i_sel), by_window(j_sel)
    if total is None:
        return result
    return (*result, total.view(n_l, n_h, t, t))


def _descend(products: torch.Tensor, segment_max: torch.Tensor, k: int, seg_len: int,
             segs_per_part: int):
    """Step 3 of :func:`top_pairs` for the matrices of one group.

    ``products``: their masked similarity products, ``N T T`` numbers, flat;
    ``segment_max`` ``[.., T, n_segments]``: the maxima of their segments of ``seg_len``
    columns (``-inf`` when excluded); ``segs_per_part`` segments per row part. Returns
    (values, i, j), each [N, k], in no particular order.
    """
    t, n_segments = segment_max.shape[-2], segment_max.shape[-1]
    n_matrices = segment_max.numel() // (t * n_segments)
    dev = products.device
    neg_inf = float("-inf")
    part_max = segment_max.reshape(n_matrices, t * n_segments // segs_per_part,
                                   segs_per_part).amax(2)  # [N, T n_segments / segs_per_part]

    def keep_k(maxima, m):
        """The ``m`` largest of each matrix's ``maxima`` [N, members]: (values, index)."""
        return maxima.topk(min(m, maxima.shape[1]), dim=-1, sorted=False)

    def children(data, width, parent):
        """The runs of ``width`` in ``data`` whose per-matrix index is ``parent`` [N, m]:
        [N, m, width] (contiguous, one gather)."""
        runs_per_matrix = data.numel() // (n_matrices * width)
        runs = torch.arange(0, n_matrices * runs_per_matrix, runs_per_matrix,
                            device=dev)[:, None] + parent
        return data.reshape(-1, width).index_select(0, runs.view(-1)).view(
            n_matrices, -1, width)

    def divmod_(x, m):  # (x // m, x % m); shifts for powers of two (int64 division is slow)
        if m & (m - 1) == 0:
            return x >> (m.bit_length() - 1), x & (m - 1)
        return x // m, x % m

    # row parts -> segments -> runs of about a quarter of their parent's length -> ...
    # -> entries, k members kept per level
    _, kept_part = keep_k(part_max, k)  # [N, m]: row parts
    value, member = keep_k(children(segment_max, segs_per_part, kept_part).view(
        n_matrices, -1), k)
    parent, slot = divmod_(member, segs_per_part)
    # the kept segments: row i, segment index c (first column c * seg_len)
    row_i, segment_c = divmod_(kept_part.gather(1, parent) * segs_per_part + slot,
                               n_segments)
    first_j = segment_c * seg_len
    entries = children(products, seg_len, row_i * n_segments + segment_c)  # [N, m, seg_len]
    # entries of excluded segments (below the diagonal, invalid i) are not pairs (there are
    # such among the kept ones only when fewer than k segments hold pairs)
    excluded_segment = torch.isneginf(value)
    if bool(excluded_segment.any()):
        entries.masked_fill_(excluded_segment[:, :, None], neg_inf)
    run_len = seg_len
    while run_len > 1:
        sub_len = _divisor_at_most(run_len, max(1, run_len // 4))
        value, member = keep_k(_run_max(entries.view(n_matrices, -1), sub_len), k)
        parent, sub_run = divmod_(member, run_len // sub_len)
        row_i = row_i.gather(1, parent)
        first_j = first_j.gather(1, parent) + sub_run * sub_len
        if sub_len > 1:  # the entries themselves once single: nothing left to gather
            entries = children(entries, sub_len, member)  # [N, m, sub_len]
        run_len = sub_len
    return value, row_i, first_j
