"""Softmax attention restricted to an edge list, in ``O(edges + n d)`` memory.

Definition
----------
Given queries ``q_i``, keys ``k_j``, values ``v_j`` and a list of edges ``e = (g, i, j)``
(``g`` the flat batch*head index), edge attention computes for every query ``i`` of
every group ``g``

    s_e = w_e' <q_i, k_j> / sqrt(d)      (score of edge e),
    a_e = w_e exp(s_e) / sum_{f in row(i)} w_f exp(s_f),
    out_i = sum_{e in row(i)} a_e v_j,

a softmax over the keys sampled for ``i`` only.  ``w_e`` are optional nonnegative edge
weights (all ones by default; a key listed twice counts twice).  A query with no edge
(or only zero-weight edges) gets ``out_i = 0``.  On the complete graph this is ordinary
softmax attention.

Algorithm
---------
Segment softmax: scores per edge, the row maximum by ``scatter_reduce('amax')``,
``exp``, row sums and weighted values by ``index_add``.  Edges are processed in chunks,
so only ``chunk x d`` gathered rows exist at a time, and a custom autograd function
recomputes the gathers in backward, keeping one number per edge (the normalised
attention weight) between forward and backward.  The backward uses the identity
``sum_e a_e <dout_i, v_j> = <dout_i, out_i>`` for the softmax correction, as
FlashAttention does.

Complexity
----------
Time ``O(E d)``; memory ``O(E + G (n + m) d + chunk d)`` for ``E`` edges, ``G`` groups:
two or three numbers per edge on top of the caller's index tensors.
"""

from __future__ import annotations

import math

import torch

__all__ = ["edge_attention", "dense_masked_attention"]

# scratch per chunk is a few (chunk x d) tensors; this many gathered numbers per chunk
_CHUNK_NUMBERS = 1 << 19


def _default_chunk(width: int) -> int:
    return max(1024, _CHUNK_NUMBERS // max(1, width))


def _chunks(num_edges: int, chunk: int):
    for start in range(0, num_edges, chunk):
        yield slice(start, min(start + chunk, num_edges))


def _rows(group, query, key, n, m, sl):
    """Flat row (query) and column (key) indices of the edges in slice ``sl``."""
    g = group[sl]
    return g * n + query[sl], g * m + key[sl]


class _EdgeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, weight, group, query, key, scale, chunk):
        num_groups, n, _ = q.shape
        m = k.shape[1]
        acc = torch.promote_types(q.dtype, torch.float32)
        q2 = q.reshape(num_groups * n, -1)
        k2 = k.reshape(num_groups * m, -1)
        v2 = v.reshape(num_groups * m, -1)
        num_rows, num_edges = q2.shape[0], group.numel()
        device = q.device

        # pass 1: scores and row maxima
        scores = torch.empty(num_edges, dtype=acc, device=device)
        row_max = torch.full((num_rows,), -math.inf, dtype=acc, device=device)
        for sl in _chunks(num_edges, chunk):
            r, c = _rows(group, query, key, n, m, sl)
            s = (q2[r].to(acc) * k2[c].to(acc)).sum(-1).mul_(scale)
            scores[sl] = s
            row_max.scatter_reduce_(0, r, s, "amax", include_self=True)

        # pass 2: exp, row sums, unnormalised outputs (scores become exp(s - max))
        row_sum = torch.zeros(num_rows, dtype=acc, device=device)
        out = torch.zeros(num_rows, v2.shape[1], dtype=acc, device=device)
        for sl in _chunks(num_edges, chunk):
            r, c = _rows(group, query, key, n, m, sl)
            e = scores[sl].sub_(row_max[r]).exp_()
            if weight is not None:
                e = e * weight[sl].to(acc)
            row_sum.index_add_(0, r, e)
            out.index_add_(0, r, e[:, None] * v2[c].to(acc))
        del row_max
        inv = torch.where(row_sum > 0, 1.0 / row_sum, torch.zeros_like(row_sum))
        out.mul_(inv[:, None])
        # normalised unweighted weights u_e = exp(s_e - max) / Z, a_e = w_e u_e
        for sl in _chunks(num_edges, chunk):
            r, _ = _rows(group, query, key, n, m, sl)
            scores[sl] *= inv[r]
        out_cast = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, weight, group, query, key, scores, out)
        ctx.scale, ctx.chunk = scale, chunk
        return out_cast.reshape(num_groups, n, -1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, weight, group, query, key, u, out = ctx.saved_tensors
        scale, chunk = ctx.scale, ctx.chunk
        num_groups, n, _ = q.shape
        m = k.shape[1]
        acc = u.dtype
        q2 = q.reshape(num_groups * n, -1)
        k2 = k.reshape(num_groups * m, -1)
        v2 = v.reshape(num_groups * m, -1)
        go = grad_out.reshape(num_groups * n, -1).to(acc)
        need_q, need_k, need_v, need_w = ctx.needs_input_grad[:4]
        # softmax correction per row: sum_e a_e <dout_i, v_j> = <dout_i, out_i>
        row_dot = (go * out).sum(-1)
        grad_q = torch.zeros(q2.shape, dtype=acc, device=q.device) if need_q else None
        grad_k = torch.zeros(k2.shape, dtype=acc, device=q.device) if need_k else None
        grad_v = torch.zeros(v2.shape, dtype=acc, device=q.device) if need_v else None
        grad_w = torch.zeros(u.shape, dtype=acc, device=q.device) if need_w else None
        for sl in _chunks(u.numel(), chunk):
            r, c = _rows(group, query, key, n, m, sl)
            go_r = go[r]
            a = u[sl] if weight is None else u[sl] * weight[sl].to(acc)
            if need_v:
                grad_v.index_add_(0, c, a[:, None] * go_r)
            if not (need_q or need_k or need_w):
                continue
            grad_a = (go_r * v2[c].to(acc)).sum(-1)
            del go_r
            # d a_f / d w_e = u_e (delta_ef - a_f)  =>  dL/dw_e = u_e (grad_a_e - row_dot_i)
            gw = u[sl] * (grad_a - row_dot[r])
            if need_w:
                grad_w[sl] = gw
            if need_q or need_k:
                gs = gw if weight is None else gw * weight[sl].to(acc)
                gs = gs * scale
                if need_q:
                    grad_q.index_add_(0, r, gs[:, None] * k2[c].to(acc))
                if need_k:
                    grad_k.index_add_(0, c, gs[:, None] * q2[r].to(acc))
        grad_q = None if grad_q is None else grad_q.to(q.dtype).reshape(q.shape)
        grad_k = None if grad_k is None else grad_k.to(k.dtype).reshape(k.shape)
        grad_v = None if grad_v is None else grad_v.to(v.dtype).reshape(v.shape)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        return grad_q, grad_k, grad_v, grad_w, None, None, None, None, None


def _edge_pair_grads(x, y, group, query, key, coef, chunk, *, need_x=True, need_y=True):
    """Gradients of ``sum_e coef_e <x[g, i], y[g, j]>``: ``grad_x[g, i] += coef_e y[g, j]``
    and ``grad_y[g, j] += coef_e x[g, i]``, in chunks (an SpMM with the edge list).

    ``x``: ``[G, n, w]``, ``y``: ``[G, m, w]``, ``coef``: ``[E]``.
    """
    num_groups, n, width = x.shape
    m = y.shape[1]
    chunk = chunk or _default_chunk(width)
    x2 = x.reshape(num_groups * n, width)
    y2 = y.reshape(num_groups * m, width)
    grad_x = torch.zeros_like(x2) if need_x else None
    grad_y = torch.zeros_like(y2) if need_y else None
    coef = coef.to(x.dtype)
    for sl in _chunks(coef.numel(), chunk):
        r, c = _rows(group, query, key, n, m, sl)
        if need_x:
            grad_x.index_add_(0, r, coef[sl, None] * y2[c])
        if need_y:
            grad_y.index_add_(0, c, coef[sl, None] * x2[r])
    return (
        None if grad_x is None else grad_x.reshape(x.shape),
        None if grad_y is None else grad_y.reshape(y.shape),
    )


def _check_edges(edges, num_groups, n, m, device):
    """Validate an edge list ``(group, query, key)`` against ``num_groups`` x ``n`` x ``m``."""
    if not isinstance(edges, (tuple, list)) or len(edges) != 3:
        raise TypeError("edges: expected a tuple (group, query, key) of three int64 tensors")
    names = ("group", "query", "key")
    for name, t in zip(names, edges):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"edges[{name}]: expected a 1-D int64 tensor, got {got}")
        if t.device != device:
            raise ValueError(f"edges[{name}]: expected device {device}, got {t.device}")
    group, query, key = edges
    if not group.numel() == query.numel() == key.numel():
        raise ValueError(
            f"edges: group, query, key must have equal lengths, got "
            f"{group.numel()}, {query.numel()}, {key.numel()}"
        )
    if group.numel():
        for name, t, hi in zip(names, edges, (num_groups, n, m)):
            lo_val, hi_val = int(t.min()), int(t.max())
            if lo_val < 0 or hi_val >= hi:
                raise ValueError(
                    f"edges[{name}]: expected indices in [0, {hi}), got range [{lo_val}, {hi_val}]"
                )
    return group, query, key


def edge_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    edges: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    edge_weight: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Softmax attention of each query over its own list of keys (segment softmax).

    Parameters
    ----------
    q : ``[..., n, d]`` queries, e.g. ``[B, H, n, d]`` or ``[n, d]``.
    k : ``[..., m, d]`` keys, same leading dims.
    v : ``[..., m, d_v]`` values, same leading dims.
    edges : ``(group, query, key)`` int64 tensors of length ``E`` (as returned by
        :func:`companion.sbm.fastrg_sample`); ``group`` indexes the flattened leading dims
        (``b * H + h``).  Any order; repeated edges count with their multiplicity.
    edge_weight : optional ``[E]`` nonnegative weights ``w_e`` (differentiable): attention
        weights are ``w_e exp(s_e)`` normalised per query; the straight-through mask of
        :class:`companion.sbm.SBMAttention` enters here.
    scale : score scale, default ``1 / sqrt(d)``.
    chunk_size : edges per chunk (default: about ``2^19 / d``); smaller saves memory.

    Returns
    -------
    out : ``[..., n, d_v]``; rows of queries without edges are zero (finite, zero
        gradient).

    Complexity
    ----------
    Time ``O(E d)``, memory ``O(E + (n + m) d)`` per group, in forward and backward.
    Differentiable once (no double backward).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor, got dtype {t.dtype}")
        if t.dim() < 2:
            raise ValueError(f"{name}: expected [..., length, dim], got shape {tuple(t.shape)}")
    if q.shape[:-2] != k.shape[:-2] or k.shape[:-1] != v.shape[:-1] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q, k, v: expected [..., n, d], [..., m, d], [..., m, d_v] with equal leading dims, "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError("q, k, v: expected tensors on one device")
    n, m, d = q.shape[-2], k.shape[-2], q.shape[-1]
    if n == 0 or m == 0:
        raise ValueError(f"q, k: empty sequence, got n={n}, m={m}")
    batch_shape = q.shape[:-2]
    num_groups = math.prod(batch_shape)
    group, query, key = _check_edges(edges, num_groups, n, m, q.device)
    if edge_weight is not None:
        if not isinstance(edge_weight, torch.Tensor) or edge_weight.shape != (group.numel(),):
            shape = (
                tuple(edge_weight.shape) if isinstance(edge_weight, torch.Tensor) else edge_weight
            )
            raise ValueError(f"edge_weight: expected shape ({group.numel()},), got {shape}")
        if not edge_weight.is_floating_point() or edge_weight.device != q.device:
            raise TypeError("edge_weight: expected a floating-point tensor on q's device")
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d > 0 else 1.0
    if chunk_size is None:
        chunk_size = _default_chunk(max(d, v.shape[-1]))
    elif not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
    out = _EdgeAttention.apply(
        q.reshape(num_groups, n, d),
        k.reshape(num_groups, m, d),
        v.reshape(num_groups, m, v.shape[-1]),
        edge_weight,
        group,
        query,
        key,
        float(scale),
        chunk_size,
    )
    return out.reshape(*batch_shape, n, v.shape[-1])


def dense_masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Dense reference: softmax over all keys, then mask, then renormalise.

    ``out = (softmax(q k^T * scale) * mask) / rowsum(...) @ v`` -- the formulation of the
    public SBM-Transformer code.  Rows whose masked weights sum to zero give zero output.
    ``mask`` may be bool or float (weights / multiplicities); with nonnegative weights it
    equals :func:`edge_attention` on the same graph, up to the underflow of tiny softmax
    entries that this formulation suffers and the edge list does not.

    Parameters
    ----------
    q : ``[..., n, d]``; k : ``[..., m, d]``; v : ``[..., m, d_v]``.
    mask : broadcastable to ``[..., n, m]``.

    Complexity
    ----------
    ``O(n m d)`` time and several ``n x m`` tensors of memory per group.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point torch.Tensor")
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask: expected a torch.Tensor, got {type(mask).__name__}")
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"q, k, v: expected [..., n, d], [..., m, d], [..., m, d_v], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    n, m = q.shape[-2], k.shape[-2]
    if n == 0 or m == 0:
        raise ValueError(f"q, k: empty sequence, got n={n}, m={m}")
    if mask.dim() < 2 or mask.shape[-2:] != (n, m):
        raise ValueError(f"mask: expected shape [..., {n}, {m}], got {tuple(mask.shape)}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    attn = torch.softmax((q @ k.transpose(-1, -2)) * scale, dim=-1)
    attn = attn * mask.to(attn.dtype)
    total = attn.sum(-1, keepdim=True)
    attn = attn / torch.where(total > 0, total, torch.ones_like(total))
    return attn @ v
