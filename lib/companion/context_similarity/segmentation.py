"""Unsupervised sentence segmentation read from token-similarity matrices.

Halevi et al. observe that in the final layers the context similarity of head outputs
spreads within a sentence and drops across sentence boundaries, which "suggests a
semantic text segmentation mechanism". This module turns a window's similarity matrices
into predicted boundaries, so that the suggestion can be scored against gold sentences
(:mod:`companion.context_similarity.segmentation_eval`).

Boundaries
----------
A segmentation of ``n`` tokens is a boolean vector ``b`` of length ``n``: ``b[t]`` is True
when a segment starts at token ``t`` (so ``b[0]`` is always False). Every function here
works on a batch ``[..., n]`` (or ``[..., n, n]`` for matrices).

The segmenter
-------------
Given a symmetric similarity matrix ``M`` (zero diagonal) the optimal segmentation with
per-boundary penalty ``beta`` maximises

.. math:: \\sum_{\\text{segments } [a, b)} \\; \\sum_{a \\le i < j < b} M_{ij}
          \\; - \\; \\beta \\cdot \\#\\text{boundaries},

the total similarity of the pairs kept inside one segment, less the penalty (a line
version of correlation clustering; ``M`` is standardised so that an average pair scores
zero and pairs more similar than average pull their tokens into one segment). The exact
optimum is a dynamic programme over segment ends, ``F(b) = max_a F(a) + W(a, b) - beta``
with ``W`` from a prefix-sum table: :func:`optimal_segmentation` (vectorised over windows
and penalties, O(n^2) per window and penalty) and :func:`optimal_segmentation_reference`
(plain loops that sum ``W`` pair by pair, the definition as code, O(n^4)).

:func:`combine` turns per-head matrices ``[B, L, H, n, n]`` of chosen layers and heads
into one standardised ``M`` per window (each head z-scored over its off-diagonal entries,
averaged, z-scored again; optionally the mean at each token distance removed, so that
locality alone scores zero), and :func:`segment` runs the two steps.

Baselines
---------
:func:`texttiling` (Hearst 1997, on vectors: cosine of the mean vectors of the blocks
left and right of each gap, depth scores, cut where the depth exceeds mean + ``cutoff``
standard deviations), :func:`random_boundaries` (independent boundaries at a rate) and
:func:`even_boundaries` (evenly spaced).
"""
from __future__ import annotations

import math

import torch

from companion._validate import check_bool, check_int, check_number, check_tensor

__all__ = [
    "combine",
    "detrend",
    "head_selection",
    "even_boundaries",
    "optimal_segmentation",
    "optimal_segmentation_reference",
    "random_boundaries",
    "segment",
    "segment_gains",
    "standardise",
    "texttiling",
    "texttiling_cut",
    "texttiling_scores",
]


def _check_square(name: str, m) -> torch.Tensor:
    check_tensor(name, m, min_ndim=2, floating=True, nonempty=True)
    if m.shape[-1] != m.shape[-2]:
        raise ValueError(f"{name}: expected square matrices [..., n, n], got {tuple(m.shape)}")
    # any NaN or infinity makes the float64 sum non-finite: one reduction, no mask tensor
    if not bool(torch.isfinite(m.sum(dtype=torch.float64))):
        raise ValueError(f"{name}: expected finite values (found NaN or infinity)")
    return m


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; float32 and the half types compute in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _penalties(penalty) -> tuple[torch.Tensor, bool]:
    """(1-D float64 tensor of penalties, whether a scalar was given)."""
    if isinstance(penalty, torch.Tensor):
        if penalty.dim() > 1 or penalty.numel() == 0 or not penalty.is_floating_point():
            raise ValueError(
                f"penalty: expected a number or a 1-D float tensor of penalties, got "
                f"{penalty.dtype} {tuple(penalty.shape)}")
        if not torch.isfinite(penalty).all():
            raise ValueError("penalty: expected finite values")
        return penalty.detach().reshape(-1).to(torch.float64), penalty.dim() == 0
    if isinstance(penalty, (list, tuple)):
        if not penalty:
            raise ValueError("penalty: expected at least one penalty, got an empty sequence")
        vals = [check_number("penalty", p) for p in penalty]
        return torch.tensor(vals, dtype=torch.float64), False
    return torch.tensor([check_number("penalty", penalty)], dtype=torch.float64), True


# --------------------------------------------------------------------------- matrices


def standardise(m: torch.Tensor) -> torch.Tensor:
    """Z-score each matrix over its off-diagonal entries; the diagonal becomes 0.

    Parameters
    ----------
    m : Tensor [..., n, n], n >= 2.

    Returns
    -------
    Tensor [..., n, n] of the same dtype: ``(m - mean) / std`` off the diagonal (mean and
    population std of the ``n(n-1)`` off-diagonal entries of each matrix; a constant
    matrix gives zeros), 0 on it.

    Examples
    --------
    >>> m = torch.tensor([[0.0, 2.0, 1.0], [2.0, 0.0, 3.0], [1.0, 3.0, 0.0]])
    >>> standardise(m)
    tensor([[ 0.0000,  0.0000, -1.2247],
            [ 0.0000,  0.0000,  1.2247],
            [-1.2247,  1.2247,  0.0000]])
    """
    _check_square("m", m)
    if m.shape[-1] < 2:
        raise ValueError(f"m: expected n >= 2 tokens, got {m.shape[-1]}")
    return _standardise(m)


def _standardise(m: torch.Tensor) -> torch.Tensor:
    n = m.shape[-1]
    cnt = n * (n - 1)
    diag = m.diagonal(dim1=-2, dim2=-1)
    mean = (m.sum((-1, -2)) - diag.sum(-1)) / cnt
    # population variance of the off-diagonal entries, from their centred squares
    centred = m - mean[..., None, None]
    cdiag = centred.diagonal(dim1=-2, dim2=-1)
    var = (centred.square().sum((-1, -2)) - cdiag.square().sum(-1)) / cnt
    std = var.clamp(min=0).sqrt()
    out = centred.div_(torch.where(std > 0, std, torch.ones_like(std))[..., None, None])
    out.diagonal(dim1=-2, dim2=-1).zero_()
    return out


def _standardise_into(m: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """:func:`_standardise` of ``m`` written into ``out`` (same shape and dtype; ``out``
    may be ``m`` itself, or any contiguous tensor not overlapping it), with the same
    numbers.

    The same operations in the same order, but no whole-size temporaries: the centred
    matrices are formed in ``out`` and their squares summed matrix block by matrix block
    (each matrix's sum is reduced as in the whole-tensor call; checked in the tests).
    """
    n = m.shape[-1]
    cnt = n * (n - 1)
    diag = m.diagonal(dim1=-2, dim2=-1)
    mean = (m.sum((-1, -2)) - diag.sum(-1)) / cnt
    if not bool(torch.isfinite(mean).all()):  # a NaN or infinity anywhere reaches a mean
        raise ValueError("m: expected finite values (found NaN or infinity)")
    if out is m:
        out.sub_(mean[..., None, None])
    else:
        torch.sub(m, mean[..., None, None], out=out)
    lead = out.reshape(-1, n, n) if out.dim() > 2 else out[None]
    squares = torch.empty(lead.shape[0], dtype=out.dtype, device=out.device)
    step = max(1, (1 << 20) // (n * n))  # blocks of about 4 MB of float32 squares
    for i in range(0, lead.shape[0], step):
        squares[i:i + step] = lead[i:i + step].square().sum((-1, -2))
    cdiag = out.diagonal(dim1=-2, dim2=-1)
    var = (squares.view(out.shape[:-2]) - cdiag.square().sum(-1)) / cnt
    std = var.clamp(min=0).sqrt()
    out.div_(torch.where(std > 0, std, torch.ones_like(std))[..., None, None])
    out.diagonal(dim1=-2, dim2=-1).zero_()
    return out


def detrend(m: torch.Tensor) -> torch.Tensor:
    """Subtract from every entry the mean of its diagonal ``|i - j|`` (per matrix), so that
    a similarity that depends on distance alone becomes 0; the diagonal is set to 0.

    Parameters
    ----------
    m : Tensor [..., n, n].

    Returns
    -------
    Tensor [..., n, n].

    Examples
    --------
    >>> detrend(torch.tensor([[0.0, 1.0, 3.0], [1.0, 0.0, 2.0], [3.0, 2.0, 0.0]]))
    tensor([[ 0.0000, -0.5000,  0.0000],
            [-0.5000,  0.0000,  0.5000],
            [ 0.0000,  0.5000,  0.0000]])
    """
    _check_square("m", m)
    return _detrend(m)


def _detrend(m: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`detrend` without checks; into ``out`` (contiguous, the shape and dtype of
    ``m``, not overlapping it) when given, with the same numbers."""
    n = m.shape[-1]
    idx = torch.arange(n, device=m.device)
    dist = (idx[:, None] - idx[None, :]).abs()  # [n, n]
    flat = m.reshape(*m.shape[:-2], n * n)
    sums = torch.zeros(*m.shape[:-2], n, dtype=m.dtype, device=m.device)
    sums.index_add_(-1, dist.reshape(-1), flat)
    counts = torch.bincount(dist.reshape(-1), minlength=n).to(m.dtype)
    means = sums / counts
    if out is None:
        out = m - means[..., dist]
    else:  # the gathered means, then m less them, in out (no whole-size temporary)
        torch.index_select(means, -1, dist.reshape(-1), out=out.view(*m.shape[:-2], n * n))
        torch.sub(m, out, out=out)
    out.diagonal(dim1=-2, dim2=-1).zero_()
    return out


def combine(sims: torch.Tensor, layers=None, heads=None, *, symmetrise: bool = False,
            detrend: bool = False, standardised: bool = False) -> torch.Tensor:
    """One standardised similarity matrix per window from per-head matrices.

    Parameters
    ----------
    sims : Tensor [B, L, H, n, n]
        Per-layer, per-head matrices of the tokens to segment (e.g. the content tokens of
        :func:`companion.context_similarity.similarity_matrices`, or attention maps).
    layers : sequence of int, optional
        Layer indices (0-based) to use; default all.
    heads : sequence of int, or a dict {layer: sequence of int}, optional
        Head indices used in every chosen layer, or per layer; default all.
    symmetrise : bool
        Use ``(S + S^T) / 2`` (for attention maps, which are not symmetric).
    detrend : bool
        After averaging, subtract the mean at each token distance (:func:`detrend`), so
        that pure locality (similarity that only depends on distance) scores zero.
    standardised : bool
        ``sims`` is already standardised head by head (:func:`standardise`, after any
        symmetrising): skip that step.

    Returns
    -------
    Tensor [B, n, n] in the input's precision, at least float32: each head's matrix
    standardised (:func:`standardise`),
    averaged over the chosen heads and layers, (detrended,) standardised again.

    >>> g = torch.Generator().manual_seed(0)
    >>> blocks = torch.block_diag(torch.ones(3, 3), torch.ones(4, 4)) * 2 - 1  # two sentences
    >>> sims = blocks + 0.1 * torch.randn(2, 2, 3, 7, 7, generator=g)  # [B, L, H, n, n]
    >>> m = combine(sims, layers=[1], heads=[0, 2])
    >>> m.shape, bool(m[0, 0, 1] > 0 > m[0, 0, 5])  # same sentence above, across below
    (torch.Size([2, 7, 7]), True)
    """
    check_tensor("sims", sims, ndim=5, floating=True, nonempty=True,
                 shape_text="[B, L, H, n, n]")
    if sims.shape[-1] != sims.shape[-2] or sims.shape[-1] < 2:
        raise ValueError(f"sims: expected square matrices [B, L, H, n, n] with n >= 2, got "
                         f"{tuple(sims.shape)}")
    selection = head_selection(sims.shape[1], sims.shape[2], layers, heads)
    symmetrise = check_bool("symmetrise", symmetrise)
    detrend = check_bool("detrend", detrend)
    standardised = check_bool("standardised", standardised)
    if symmetrise and standardised:
        raise ValueError("symmetrise: standardised input is already symmetrised (or not): "
                         "pass symmetrise=False with standardised=True")

    def prepare(s):
        if symmetrise:
            s = 0.5 * (s + s.transpose(-1, -2))
        return s if standardised else _standardise(s)

    if standardised:  # nothing to prepare
        prepare = None
    sums = [_head_sum(sims, ly, hs, prepare) for ly, hs in selection.items()]
    return _combine_sums(sums, sum(len(hs) for hs in selection.values()), detrend)


def head_selection(n_layers: int, n_heads: int, layers=None, heads=None) -> dict:
    """Validate a choice of layers and heads; return ``{layer: [heads]}`` (ordered).

    Examples
    --------
    >>> head_selection(2, 3, layers=[1], heads=[0, 2])
    {1: [0, 2]}
    """
    if layers is None:
        layers = list(range(n_layers))
    if isinstance(layers, (int, str)) or not hasattr(layers, "__iter__"):
        raise TypeError(
            f"layers: expected a sequence of layer indices, got {type(layers).__name__}")
    layers = [check_int("layers", ly, minimum=0, maximum=n_layers - 1) for ly in layers]
    if not layers:
        raise ValueError("layers: expected at least one layer")
    if len(set(layers)) != len(layers):
        raise ValueError(f"layers: expected distinct layers, got {layers}")
    if isinstance(heads, dict):
        missing = [ly for ly in layers if ly not in heads]
        if missing:
            raise ValueError(f"heads: no head list for layers {missing}")
        chosen = {ly: heads[ly] for ly in layers}
    else:
        chosen = {ly: heads for ly in layers}
    out = {}
    for ly, hs in chosen.items():
        if hs is None:
            hs = list(range(n_heads))
        if isinstance(hs, (int, str)) or not hasattr(hs, "__iter__"):
            raise TypeError(f"heads: expected a sequence of head indices, got {type(hs).__name__}")
        hs = [check_int("heads", h, minimum=0, maximum=n_heads - 1) for h in hs]
        if not hs or len(set(hs)) != len(hs):
            raise ValueError(f"heads: expected distinct heads, at least one, for layer {ly}, "
                             f"got {hs}")
        out[ly] = hs
    return out


def _head_sum(sims, layer, heads, prepare=None) -> torch.Tensor:
    """Sum over ``heads`` of layer ``layer``'s (prepared) matrices [B, n, n], in the input's
    precision (at least float32)."""
    first = heads[0]
    if prepare is None and list(heads) == list(range(first, first + len(heads))):
        # a run of heads: summed from a view, not a gathered copy (the same sums)
        s = sims[:, layer, first:first + len(heads)].to(_work_dtype(sims.dtype))
    else:
        s = sims[:, layer, heads].to(_work_dtype(sims.dtype))
    if prepare is not None:
        s = prepare(s)
    return s.sum(1)


def _mean_of_sums(sums, count: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``(sums[0] + sums[1] + ...) / count``; into ``out`` (not overlapping the sums)
    when given, with the same numbers."""
    if out is None:
        total = sums[0]
        for s in sums[1:]:
            total = total + s
        return total / count
    if len(sums) == 1:
        return torch.div(sums[0], count, out=out)
    torch.add(sums[0], sums[1], out=out)
    for s in sums[2:]:
        out.add_(s)
    return out.div_(count)


def _finish(mean: torch.Tensor, detrend: bool) -> torch.Tensor:
    return _standardise(_detrend(mean) if detrend else mean)


def _combine_sums(sums, count: int, detrend: bool) -> torch.Tensor:
    return _finish(_mean_of_sums(sums, count), detrend)


# --------------------------------------------------------------------------- segmenter


def segment_gains(m: torch.Tensor) -> torch.Tensor:
    """``W[..., a, b] = sum_{a <= i < j < b} M_ij`` for all ``0 <= a <= b <= n``.

    From the prefix sums ``P[r, c] = sum_{i < r, j < c, i < j} M_ij`` of the strict upper
    triangle: ``W(a, b) = P[b, b] - P[a, b]`` (entries with ``a > b`` are meaningless).
    Returns [..., n + 1, n + 1] in the input's precision (at least float32).

    Examples
    --------
    >>> segment_gains(torch.ones(3, 3) - torch.eye(3))  # W[0, 3]: the 3 pairs of 0..2
    tensor([[0., 0., 1., 3.],
            [0., 0., 0., 1.],
            [0., 0., 0., 0.],
            [0., 0., 0., 0.]])
    """
    _check_square("m", m)
    u = torch.triu(m.to(_work_dtype(m.dtype)), diagonal=1)
    p = torch.nn.functional.pad(u.cumsum(-2).cumsum(-1), (1, 0, 1, 0))  # [..., n+1, n+1]
    diag = p.diagonal(dim1=-2, dim2=-1)  # P[b, b], [..., n+1]
    return diag.unsqueeze(-2) - p


def optimal_segmentation(m: torch.Tensor, penalty) -> torch.Tensor:
    """The exact optimal segmentation of every matrix, for every penalty (fast).

    Maximises the within-segment similarity less ``penalty`` per boundary (see the module
    docstring) by dynamic programming over segment ends, vectorised over the batch and
    the penalties.

    Parameters
    ----------
    m : Tensor [..., n, n], symmetric similarity (only the strict upper triangle is read).
    penalty : float, or a 1-D tensor / sequence of P penalties.

    Returns
    -------
    BoolTensor [..., n] for a scalar penalty, [..., P, n] for several: True where a
    segment starts (index 0 is always False). Ties go to the earliest segment start.

    The sums are formed in the input's precision (float64 input: float64; otherwise
    float32), so near-ties may resolve differently at the two precisions.

    Complexity
    ----------
    O(n^2) time per matrix and penalty (n Python-level steps, each one vectorised
    reduction), O(n^2) memory per matrix plus O(n) per penalty.

    Examples
    --------
    Two blocks of mutually similar tokens: the optimum starts a segment at token 2.

    >>> m = torch.block_diag(torch.ones(2, 2), torch.ones(3, 3)) * 2 - 1
    >>> optimal_segmentation(m.fill_diagonal_(0), 0.0)
    tensor([False, False,  True, False, False])
    """
    _check_square("m", m)
    pen, scalar = _penalties(penalty)
    return _optimal_segmentation(m, pen, scalar)


def _step_major(m: torch.Tensor, out: torch.Tensor | None = None,
                block: int = 16) -> torch.Tensor:
    """The matrices ``m`` [..., n, n] transposed to step-major layout, ``xt[j, i, e] =
    m_e[i, j]`` [n, n, E] (``E`` the batch flattened), in the work precision (no input
    check); into ``out`` when given.

    A blocked copy, ``block`` matrices at a time: each output row of a block is one
    cache line, read from lines the block keeps in cache (a whole-tensor permuted copy
    reads every element from a different line). A copy: the values do not change.
    """
    n = m.shape[-1]
    flat = m.reshape(-1, n, n)
    if out is None:
        out = torch.empty(n, n, flat.shape[0], dtype=_work_dtype(m.dtype), device=m.device)
    for e in range(0, flat.shape[0], block):
        out[:, :, e:e + block].copy_(flat[e:e + block].permute(2, 1, 0))
    return out


def _segmentation_pointers(xt: torch.Tensor, pen: torch.Tensor) -> torch.Tensor:
    """The dynamic programme of :func:`optimal_segmentation` on step-major matrices.

    ``xt`` [n, n, E] with ``xt[j, i, e] = M_e[i, j]`` (only ``i < j`` is read), ``pen``
    [P] penalties in ``xt``'s dtype. Returns the back pointers [n + 1, P, E] (an integer
    type): ``back[b, p, e]`` is the start of the last segment of the best segmentation
    of tokens ``[0, b)``, the earliest one on ties.

    The gains ``W(a, b) = P[b, b] - P[a, b]`` are those of :func:`segment_gains`, with
    the same numbers: ``P`` is the prefix sum over ``i`` and then over ``j`` of the
    strict upper triangle, each formed as a CPU cumulative sum forms it (every line in
    sequence, accumulated in float64 from 0 and rounded to ``xt``'s dtype at every
    entry). Step ``b`` needs column ``b`` of ``P`` only, so the two sums are formed a
    column at a time inside the loop: column ``j = b - 1`` summed over ``i < j`` (one
    cumulative sum), then added to the running sums over ``j`` of the rows ``r < j``.
    The rows ``r >= j`` hold the same running sum (their lines only ever add the full
    column sums, and the zeros below the diagonal leave a float64 sum unchanged), kept
    once and copied into row ``j`` when it is first read. No [n + 1, n + 1, E] table is
    formed.

    The best start is the first maximum of ``F(a) + W(a, b)`` over ``a < b``, what
    ``max(0)`` returns, found faster: the maximum (exact), then the candidates less
    the maximum, which are ``+0`` exactly where the maximum is reached and negative
    elsewhere (no candidate is ``-0``: every prefix sum starts from ``+0``, so neither a
    gain nor a candidate can be ``-0``). Read as integers of the same width, those are
    ``0`` and negative; OR-ing in the weights ``b - a`` leaves the negative ones
    negative, so the largest result is ``b`` less the first start that reaches the
    maximum.
    """
    n, e_count = xt.shape[0], xt.shape[2]
    n_pen = pen.shape[0]
    dt, dev = xt.dtype, xt.device
    # every table [step, penalty, matrix]: each operation runs on contiguous rows of the
    # matrices, and the gains of a step are broadcast over the penalties, not along rows
    g = torch.empty(n + 1, n_pen, e_count, dtype=dt, device=dev)  # g[a] = F(a) - penalty (a > 0)
    g[0] = 0.0
    bits = torch.int32 if dt == torch.float32 else torch.int64  # same width as dt
    weights = torch.arange(n, 0, -1, dtype=bits, device=dev)  # weights[n - b + a] = b - a
    back = torch.zeros(n + 1, n_pen, e_count, dtype=bits, device=dev)
    rows = torch.zeros(n, e_count, dtype=torch.float64, device=dev)  # sums over j, row r
    full = torch.zeros(e_count, dtype=torch.float64, device=dev)  # ... of the rows r >= j
    col = torch.empty(n, e_count, dtype=dt, device=dev)
    gain = torch.empty(n, e_count, dtype=dt, device=dev)
    cand = torch.empty(n, n_pen, e_count, dtype=dt, device=dev)
    pen = pen.view(n_pen, 1)
    for b in range(1, n + 1):
        j = b - 1
        if j > 0:
            column = torch.cumsum(xt[j, :j], 0)  # [j, E]: sum over i <= r of M[i, j]
            rows[:j] += column
            full += column[j - 1]  # the full column sum
        rows[j] = full
        col[:b].copy_(rows[:b])  # P[r + 1, b] for r < b, rounded as the cumsum rounds
        gain[0] = col[j]  # W(0, b) = P[b, b]
        torch.sub(col[j], col[:j], out=gain[1:b])  # W(a, b) = P[b, b] - P[a, b]
        c = cand[:b]
        torch.add(g[:b], gain[:b, None], out=c)  # F(a) (- penalty) + W(a, b)
        best = torch.amax(c, 0)
        torch.sub(best, pen, out=g[b])
        key = c.sub_(best).view(bits).bitwise_or_(weights[n - b:].view(b, 1, 1))
        back[b] = b - torch.amax(key, 0)  # the first start reaching the maximum
    return back


def _segment_starts(back: torch.Tensor) -> torch.Tensor:
    """Segment starts [E, P, n] (bool, index 0 False) from the back pointers
    [n + 1, P, E] of :func:`_segmentation_pointers`."""
    n = back.shape[0] - 1
    out = torch.zeros(n + 1, *back.shape[1:], dtype=torch.bool, device=back.device)
    pos = torch.full((1, *back.shape[1:]), n, dtype=torch.long, device=back.device)
    for _ in range(n):
        start = back.gather(0, pos).long()
        out.scatter_(0, start, True)
        pos = start
        if not bool(pos.any()):
            break
    res = out[:n].permute(2, 1, 0).clone()  # [E, P, n]
    res[..., 0] = False
    return res


def _optimal_segmentation(m: torch.Tensor, pen: torch.Tensor, scalar: bool) -> torch.Tensor:
    """:func:`optimal_segmentation` after its checks (``pen``: 1-D float64 penalties)."""
    return _segmentation_of_step_major(_step_major(m), pen, m.shape[:-2], scalar)


def _segmentation_of_step_major(xt: torch.Tensor, pen: torch.Tensor, batch,
                                scalar: bool = False) -> torch.Tensor:
    """:func:`optimal_segmentation` of step-major matrices ``xt`` [n, n, E] (see
    :func:`_step_major`), ``E`` the product of ``batch``: [*batch, P, n] bool (or
    [*batch, n] with ``scalar``)."""
    n = xt.shape[0]
    back = _segmentation_pointers(xt, pen.to(device=xt.device, dtype=xt.dtype))
    res = _segment_starts(back).view(*batch, pen.shape[0], n)
    return res[..., 0, :] if scalar else res


def optimal_segmentation_reference(m: torch.Tensor, penalty: float) -> list[int]:
    """The same optimum, written as the definition: plain loops, one matrix, one penalty.

    ``W(a, b)`` is summed pair by pair; ``F(b) = max(W(0, b), max_{0 < a < b} F(a) +
    W(a, b) - penalty)``; ties go to the earliest start. Returns the sorted segment starts
    (excluding 0). O(n^4): for checking :func:`optimal_segmentation` on small cases.

    Examples
    --------
    >>> m = torch.block_diag(torch.ones(2, 2), torch.ones(3, 3)) * 2 - 1
    >>> optimal_segmentation_reference(m.fill_diagonal_(0), 0.0)
    [2]
    """
    _check_square("m", m)
    if m.dim() != 2:
        raise ValueError(f"m: expected one matrix [n, n], got {tuple(m.shape)}")
    penalty = check_number("penalty", penalty)
    a_ = m.detach().to(torch.float64).cpu().tolist()
    n = len(a_)

    def gain(a, b):
        return sum(a_[i][j] for i in range(a, b) for j in range(i + 1, b))

    best = [0.0] * (n + 1)
    start = [0] * (n + 1)
    for b in range(1, n + 1):
        best[b], start[b] = gain(0, b), 0
        for a in range(1, b):
            value = best[a] + gain(a, b) - penalty
            if value > best[b]:
                best[b], start[b] = value, a
    starts, pos = [], n
    while pos > 0:
        pos = start[pos]
        if pos > 0:
            starts.append(pos)
    return sorted(starts)


def segment(sims: torch.Tensor, penalty, layers=None, heads=None, *,
            symmetrise: bool = False, detrend: bool = False) -> torch.Tensor:
    """Predict sentence boundaries of windows from their per-head similarity matrices.

    :func:`combine` (chosen layers and heads, standardised) then
    :func:`optimal_segmentation` with per-boundary ``penalty``; the free parameters
    (``penalty``, ``layers``, ``heads``, ``detrend``) are to be fixed on development
    data, never on the windows scored.

    Parameters
    ----------
    sims : Tensor [B, L, H, n, n] of the tokens to segment (content tokens only).
    penalty : float or 1-D tensor / sequence of penalties.
    layers, heads, symmetrise, detrend : see :func:`combine`.

    Returns
    -------
    BoolTensor [B, n] (or [B, P, n] for several penalties), True where a sentence starts.

    >>> g = torch.Generator().manual_seed(0)
    >>> blocks = torch.block_diag(torch.ones(3, 3), torch.ones(4, 4)) * 2 - 1  # two sentences
    >>> sims = blocks + 0.1 * torch.randn(2, 2, 3, 7, 7, generator=g)  # [B, L, H, n, n]
    >>> segment(sims, 0.0).int().tolist()  # a sentence starts at token 3
    [[0, 0, 0, 1, 0, 0, 0], [0, 0, 0, 1, 0, 0, 0]]
    >>> segment(sims, [0.0, 100.0]).shape  # one row per penalty
    torch.Size([2, 2, 7])

    References
    ----------
    Halevi et al., arXiv 2512.21956, abstract: final-layer attention on separators, suggesting
    segmentation.
    """
    return optimal_segmentation(combine(sims, layers, heads, symmetrise=symmetrise,
                                        detrend=detrend), penalty)


# --------------------------------------------------------------------------- baselines


def texttiling_scores(x: torch.Tensor, width: int) -> torch.Tensor:
    """TextTiling depth scores of every gap from token vectors.

    For the gap before token ``t`` (``1 <= t < n``), the *gap similarity* is the cosine of
    the mean vectors of the blocks ``[t - width, t)`` and ``[t, t + width)`` (clipped at the
    window's ends). Its *depth* is ``(left peak - s_t) + (right peak - s_t)``, the peaks
    being the highest similarity reached by climbing from ``t`` while the similarity
    does not decrease (Hearst 1997).

    Parameters
    ----------
    x : Tensor [..., n, D] of token vectors.
    width : block size in tokens (>= 1).

    Returns
    -------
    Tensor [..., n] float64: depth score per gap (index 0 is 0, no gap there).

    References
    ----------
    .. [1] M. A. Hearst, "TextTiling: Segmenting text into multi-paragraph subtopic
       passages", Computational Linguistics 23(1), 1997: the depth scores of the gaps.

    Examples
    --------
    >>> x = torch.tensor([[1.0, 0], [1, 0], [1, 0], [0, 1], [0, 1], [0, 1]])
    >>> texttiling_scores(x, 2)
    tensor([0.0000, 0.0000, 0.2929, 2.0000, 0.2929, 0.0000], dtype=torch.float64)
    """
    check_tensor("x", x, min_ndim=2, floating=True, finite=True, nonempty=True)
    width = check_int("width", width, minimum=1)
    n = x.shape[-2]
    if n < 2:
        raise ValueError(f"x: expected n >= 2 tokens, got {n}")
    return _texttiling_depth(_texttiling_prefix(x), width)


def _texttiling_prefix(x: torch.Tensor) -> torch.Tensor:
    """The float64 prefix sums over tokens [..., n + 1, D] (row 0 zero) that
    :func:`texttiling_scores` reads, shared by every block width."""
    return torch.nn.functional.pad(x.to(torch.float64).cumsum(-2), (0, 0, 1, 0))


def _texttiling_depth(c: torch.Tensor, width: int) -> torch.Tensor:
    """:func:`texttiling_scores` from the prefix sums ``c`` of :func:`_texttiling_prefix`.

    The block sums are differences of slices of ``c`` (the gaps whose block is clipped
    at an end of the window apart from the others), divided by the block lengths: the
    numbers of an index-gathered difference, without the gathered copies.
    """
    n = c.shape[-2] - 1
    t = torch.arange(1, n, device=c.device)
    k0 = min(width, n - 1)  # left blocks clipped at the start: gaps t = 1..k0
    left = c.new_empty((*c.shape[:-2], n - 1, c.shape[-1]))
    torch.sub(c[..., 1:k0 + 1, :], c[..., :1, :], out=left[..., :k0, :])
    torch.sub(c[..., k0 + 1:n, :], c[..., 1:n - k0, :], out=left[..., k0:, :])
    left.div_(torch.clamp(t, max=width).to(c.dtype).unsqueeze(-1))  # t - max(t - width, 0)
    m = min(n - 1, max(0, n - width))  # right blocks inside the window: gaps t = 1..m
    right = c.new_empty(left.shape)
    torch.sub(c[..., 1 + width:1 + width + m, :], c[..., 1:1 + m, :], out=right[..., :m, :])
    torch.sub(c[..., n:, :], c[..., 1 + m:n, :], out=right[..., m:, :])
    right.div_(torch.clamp(n - t, max=width).to(c.dtype).unsqueeze(-1))  # min(t + width, n) - t
    s = torch.nn.functional.cosine_similarity(left, right, dim=-1)  # [..., n-1]
    # climb to the peaks: running maxima while non-decreasing, left and right
    g = n - 1
    lpeak = s.clone()
    rpeak = s.clone()
    lrun = torch.ones_like(s, dtype=torch.bool)
    rrun = torch.ones_like(s, dtype=torch.bool)
    lcur = s.clone()
    rcur = s.clone()
    for k in range(1, g):
        # left neighbour at distance k of gap i is gap i - k
        nxt = torch.nn.functional.pad(s[..., :-k], (k, 0), value=-math.inf)
        lrun = lrun & (nxt >= lcur)
        lcur = torch.where(lrun, nxt, lcur)
        lpeak = torch.where(lrun, torch.maximum(lpeak, nxt), lpeak)
        nxt = torch.nn.functional.pad(s[..., k:], (0, k), value=-math.inf)
        rrun = rrun & (nxt >= rcur)
        rcur = torch.where(rrun, nxt, rcur)
        rpeak = torch.where(rrun, torch.maximum(rpeak, nxt), rpeak)
        if not (lrun.any() or rrun.any()):
            break
    depth = (lpeak - s) + (rpeak - s)
    return torch.nn.functional.pad(depth, (1, 0))


def texttiling(x: torch.Tensor, width: int, cutoff: float) -> torch.Tensor:
    """TextTiling boundaries: gaps whose depth score (:func:`texttiling_scores`) is a
    local maximum and exceeds ``mean + cutoff * std`` of the window's depth scores
    (Hearst's liberal rule is ``cutoff = -0.5``); see :func:`texttiling_cut`.

    Returns BoolTensor [..., n], True where a segment starts.

    Examples
    --------
    >>> x = torch.tensor([[1.0, 0], [1, 0], [1, 0], [0, 1], [0, 1], [0, 1]])
    >>> texttiling(x, 2, 0.5)
    tensor([False, False, False,  True, False, False])
    """
    return texttiling_cut(texttiling_scores(x, width), cutoff)


def texttiling_cut(depth: torch.Tensor, cutoff: float) -> torch.Tensor:
    """Boundaries from depth scores [..., n] (index 0 unused): the gaps that are a local
    maximum (strictly above the left neighbour, at least the right one), positive, and
    above ``mean + cutoff * std`` of the window's depth scores. BoolTensor [..., n].

    Examples
    --------
    >>> texttiling_cut(torch.tensor([0.0, 0.1, 0.9, 0.2, 0.1]), 0.5)
    tensor([False, False,  True, False, False])
    """
    cutoff = check_number("cutoff", cutoff)
    check_tensor("depth", depth, min_ndim=1, floating=True, nonempty=True)
    depth = depth[..., 1:]  # [..., n-1]
    mean = depth.mean(-1, keepdim=True)
    std = depth.std(-1, unbiased=False, keepdim=True)
    left = torch.nn.functional.pad(depth[..., :-1], (1, 0), value=-math.inf)
    right = torch.nn.functional.pad(depth[..., 1:], (0, 1), value=-math.inf)
    peak = (depth > left) & (depth >= right) & (depth > 0)
    cut = peak & (depth > mean + cutoff * std)
    return torch.nn.functional.pad(cut, (1, 0), value=False)


def random_boundaries(shape, rate: float, generator: torch.Generator | None = None
                      ) -> torch.Tensor:
    """Independent boundaries: every gap (index >= 1) is one with probability ``rate``.

    ``shape`` is ``(..., n)``; returns BoolTensor of that shape (index 0 False).

    Examples
    --------
    >>> random_boundaries((1, 6), 0.5, torch.Generator().manual_seed(0)).shape
    torch.Size([1, 6])
    """
    rate = check_number("rate", rate, minimum=0.0, maximum=1.0)
    shape = tuple(int(s) for s in shape)
    if not shape or shape[-1] < 1:
        raise ValueError(f"shape: expected (..., n) with n >= 1, got {shape}")
    out = torch.rand(shape, generator=generator, dtype=torch.float64) < rate
    out[..., 0] = False
    return out


def even_boundaries(shape, spacing: float) -> torch.Tensor:
    """Evenly spaced boundaries at ``round(k * spacing)`` for k = 1, 2, ... below n.

    ``shape`` is ``(..., n)``; returns BoolTensor of that shape, the same row everywhere.

    Examples
    --------
    >>> even_boundaries((1, 7), 2.5)  # round(2.5) = 2, round(5.0) = 5
    tensor([[False, False,  True, False, False,  True, False]])
    """
    spacing = check_number("spacing", spacing, minimum=1.0)
    shape = tuple(int(s) for s in shape)
    if not shape or shape[-1] < 1:
        raise ValueError(f"shape: expected (..., n) with n >= 1, got {shape}")
    n = shape[-1]
    row = torch.zeros(n, dtype=torch.bool)
    k = 1
    while round(k * spacing) < n:
        row[round(k * spacing)] = True
        k += 1
    return row.expand(shape).clone()
