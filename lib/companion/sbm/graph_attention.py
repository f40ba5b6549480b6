"""Softmax attention restricted to an edge list, in ``O(edges + n d)`` memory.

Definition
----------
Given queries ``q_i``, keys ``k_j``, values ``v_j`` and a list of edges ``e = (g, i, j)``
(``g`` the flat batch*head index), edge attention computes for every query ``i`` of
every group ``g``

    s_e = <q_i, k_j> / sqrt(d)      (score of edge e),
    a_e = w_e exp(s_e) / sum_{f in row(i)} w_f exp(s_f),
    out_i = sum_{e in row(i)} a_e v_j,

a softmax over the keys sampled for ``i`` only.  ``w_e`` are optional nonnegative edge
weights (all ones by default; a key listed twice counts twice).  A query with no edge
(or only zero-weight edges) gets ``out_i = 0``.  On the complete graph this is ordinary
softmax attention.

Algorithm
---------
Segment softmax on the CSR form of the edge list (rows ``g n + i``, columns ``g m + j``):
scores by a sampled dense-dense product (``torch.sparse.sampled_addmm``, SDDMM), row
maxima and sums by ``segment_reduce``, ``exp``, and the output by a sparse-dense
product (SpMM).  No ``[E, d]`` tensor of gathered rows is ever formed.  A custom
autograd function keeps one number per edge (the normalised attention weight) for the
backward, which recomputes with SDDMM/SpMM passes; the softmax correction uses
``sum_e a_e <dout_i, v_j> = <dout_i, out_i>``, as FlashAttention does.  Gradients of
keys and values use the transposed CSR, built by a linear-time radix sort.

Complexity
----------
Time ``O(E d)`` (plus ``O(E)`` radix passes); memory ``O(E + G (n + m) d)`` for ``E``
edges over ``G`` groups: a few numbers per edge, in forward and backward.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

# its old home: still importable from here until tests/test_bad_inputs.py imports it from
# companion.sbm (the dense reference lives in companion.sbm.reference)
from companion.sbm.reference import dense_masked_attention  # noqa: F401
from companion.sbm.tensor_ops import INDEX_DTYPES, repeat_each, stable_argsort

__all__ = ["edge_attention", "EdgeGraph", "attention_on_graph"]


def _flat_index(index: torch.Tensor, group: torch.Tensor, size: int,
                dtype: torch.dtype) -> torch.Tensor:
    """``group * size + index`` as ``dtype`` (int32 or int64, holding every value). On
    CPU by numpy: int64 written straight into its output, where torch's integer add with
    ``alpha`` is followed by a conversion; int32 by narrowing both inputs and adding in
    int32."""
    if index.device.type != "cpu":
        # in the wider of the two dtypes: int32 indices may give rows past 2**31
        wide = torch.promote_types(index.dtype, dtype)
        return torch.add(index.to(wide), group.to(wide), alpha=size).to(dtype)
    if dtype == torch.int32:
        # narrowed first, then int32 arithmetic: every value and the sum fit int32 (the
        # caller's choice of dtype), and plain int32 passes took half the time of the
        # mixed-type loops that narrow as they go
        out = index.numpy().astype(np.int32)
        scaled = group.numpy().astype(np.int32)
        scaled *= size
        out += scaled
        return torch.from_numpy(out)
    out = np.empty(index.numel(), dtype=np.int64)
    # an int64 loop: int32 groups times size may pass 2**31
    np.multiply(group.numpy(), size, out=out, dtype=np.int64, casting="unsafe")
    np.add(out, index.numpy(), out=out, casting="unsafe")
    return torch.from_numpy(out)


def _is_sorted(x: torch.Tensor) -> bool:
    """Whether the 1-D ``x`` is non-decreasing (numpy on CPU: one pass, without the
    bool tensor of torch's compare and ``all``)."""
    if x.device.type == "cpu":
        values = x.numpy()
        return bool(np.all(values[1:] >= values[:-1]))
    return bool((x[1:] >= x[:-1]).all())


class EdgeGraph:
    """CSR view of an edge list over ``G`` groups: row ``g n + i``, column ``g m + j``.

    Built once per sampled graph and shared by the attention and the straight-through
    estimator.  Edges already sorted by ``(group, query)`` (as :func:`fastrg_sample`
    returns them) are used as they are; otherwise ``order`` holds the stable row-major
    permutation (``sorted[e] = given[order[e]]``).  The gradients of keys and values
    need products with the transpose (:meth:`transpose_matmul`): on CPU they read the CSR
    as the CSC of the transpose; elsewhere the transposed (column-major) CSR is built on
    first use.

    Memory: two indices per edge (one on CPU; two more once transposed, off the CPU or
    by :meth:`matrix_t`), int32 when they fit, and ``O(G (n + m))``.

    Examples
    --------
    >>> graph = EdgeGraph(torch.tensor([0, 0, 0]), torch.tensor([1, 0, 0]),
    ...                   torch.tensor([0, 0, 1]), 1, 2, 2)  # rows given out of order
    >>> graph.order, graph.counts  # the row-major permutation, edges per query
    (tensor([1, 2, 0]), tensor([2, 1], dtype=torch.int32))
    """

    def __init__(self, group, query, key, num_groups, n, m):
        self.num_groups, self.n, self.m = num_groups, n, m
        self.num_rows, self.num_cols = num_groups * n, num_groups * m
        self.num_edges = group.numel()
        device = group.device
        # int32 indices halve the index memory whenever they fit
        fits = max(self.num_rows, self.num_cols, self.num_edges) < 2**31 - 1
        self.index_dtype = torch.int32 if fits else torch.int64
        row = _flat_index(query, group, n, self.index_dtype)
        self.order = None
        if self.num_edges > 1 and not _is_sorted(row):
            self.order = stable_argsort(row, self.num_rows)
            row = row[self.order]
            self.col = _flat_index(key, group, m, self.index_dtype)[self.order]
        else:
            self.col = _flat_index(key, group, m, self.index_dtype)
        # rows are sorted: row r's edges start at the first edge whose row is >= r
        bounds = torch.arange(self.num_rows + 1, device=device, dtype=row.dtype)
        self.crow = torch.searchsorted(row, bounds).to(self.index_dtype)
        self.counts = self.crow.diff()
        # each edge's row, kept for the transposed CSR of the backward pass (on CPU that
        # is built from the CSR itself, see _transposed_csr)
        self.row = row if device.type != "cpu" else None
        del row, bounds
        self._transpose = None

    def spread(self, per_row: torch.Tensor) -> torch.Tensor:
        """``[rows]`` -> ``[E]``: the value of each edge's row."""
        return repeat_each(per_row, self.counts, self.num_edges)

    def row_reduce(self, values: torch.Tensor, reduce: str) -> torch.Tensor:
        """``[E]`` -> ``[rows]`` by ``reduce`` ("sum" or "max"); empty rows give 0 / -inf."""
        return torch.segment_reduce(values, reduce, lengths=self.counts, unsafe=True)

    def matrix(self, values: torch.Tensor) -> torch.Tensor:
        """The ``[G n, G m]`` sparse CSR matrix with ``values`` on the edges."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.sparse_csr_tensor(
                self.crow,
                self.col,
                values,
                size=(self.num_rows, self.num_cols),
                check_invariants=False,
            )

    def transpose_matmul(self, values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``A^T x`` ``[G m, k]`` for ``A`` the ``[G n, G m]`` matrix with ``values`` on the
        edges (row-major) and ``x`` ``[G n, k]`` of the same dtype.

        On CPU the CSR arrays are read as the CSC arrays of ``A^T`` and multiplied by
        scipy (``O(E k)``, one thread): no transposed CSR is built and no values are
        permuted. Each output row sums its edges in the order of their rows, as the
        product with :meth:`matrix_t` does. Elsewhere: ``matrix_t(values) @ x``.
        """
        if values.device.type != "cpu":
            return self.matrix_t(values) @ x
        import scipy.sparse

        transposed = scipy.sparse.csc_matrix(
            (values.detach().numpy(), self.col.numpy(), self.crow.numpy()),
            shape=(self.num_cols, self.num_rows))
        return torch.from_numpy(transposed @ x.detach().contiguous().numpy())

    def matrix_t(self, values: torch.Tensor) -> torch.Tensor:
        """The transposed ``[G m, G n]`` CSR matrix with ``values`` (given row-major)."""
        if self._transpose is None:
            self._transpose = self._transposed_csr()
            self.row = None  # only the transpose needed it: free it before the peak
        perm, crow_t, row_t = self._transpose
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.sparse_csr_tensor(
                crow_t,
                row_t,
                values.index_select(0, perm),
                size=(self.num_cols, self.num_rows),
                check_invariants=False,
            )

    def _transposed_csr(self):
        """``(perm, crow_t, row_t)``: the edges' stable column-major order (``perm[t]`` is
        the row-major position of transposed edge ``t``), the column pointers, and the
        row of every edge in that order."""
        idx = self.index_dtype
        if self.col.device.type == "cpu":
            import scipy.sparse

            # scipy's CSR -> CSC conversion is a counting sort over the columns that keeps
            # the row order within a column: with the edge numbers as values it gives the
            # stable column order, the column pointers and the rows in one O(E + G m)
            # pass (where radix argsort, bincount and gather make three), and needs no
            # per-edge row index
            numbers = np.arange(self.num_edges, dtype=np.int32 if idx == torch.int32 else np.int64)
            csc = scipy.sparse.csr_matrix(
                (numbers, self.col.numpy(), self.crow.numpy()),
                shape=(self.num_rows, self.num_cols),
            ).tocsc()
            del numbers
            return tuple(torch.from_numpy(np.ascontiguousarray(a)).to(idx)
                         for a in (csc.data, csc.indptr, csc.indices))
        perm = stable_argsort(self.col, self.num_cols).to(idx)
        counts_t = torch.bincount(self.col, minlength=self.num_cols)
        crow_t = torch.zeros(self.num_cols + 1, dtype=idx, device=self.col.device)
        torch.cumsum(counts_t, 0, out=crow_t[1:])
        # index_select, not advanced indexing: a plain gather, without advanced
        # indexing's general index machinery
        return perm, crow_t, self.row.index_select(0, perm)

    def sddmm(self, x: torch.Tensor, y: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        """``[E]``: ``alpha <x[row_e], y[col_e]>`` for every edge (sampled dense-dense
        matmul, no ``[E, d]`` gather)."""
        # written in place into the pattern's own values (``out=``): without it the product
        # copies the pattern into a new matrix (with its own copies of the indices), whose
        # values then had to be copied out. The values start at zero: with ``out`` the
        # input's values are read even at ``beta=0`` (a NaN left in them would stay)
        values = torch.zeros(self.num_edges, dtype=x.dtype, device=x.device)
        pattern = self.matrix(values)
        if x.device.type == "cpu":
            torch.sparse.sampled_addmm(pattern, x, y.t(), beta=0.0, alpha=alpha, out=pattern)
            return values
        # elsewhere as first written (the in-place form is measured and tested on CPU only)
        result = torch.sparse.sampled_addmm(pattern, x, y.t(), beta=0.0, alpha=alpha)
        return result.values().clone()


class _EdgeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q2, k2, v2, weight, graph, scale, unit_weight=False):
        acc = torch.promote_types(q2.dtype, torch.float32)
        # all-ones weights (the straight-through mask): u * 1 == u, so skip the products
        scale_by = None if unit_weight else weight
        qa, ka, va = q2.to(acc), k2.to(acc), v2.to(acc)
        if graph.num_edges == 0:
            out = torch.zeros(q2.shape[0], v2.shape[1], dtype=acc, device=q2.device)
            u = torch.zeros(0, dtype=acc, device=q2.device)
        else:
            scores = graph.sddmm(qa, ka, alpha=scale)
            row_max = graph.row_reduce(scores, "max")
            u = scores.sub_(graph.spread(row_max)).exp_()  # exp(s - max) <= 1
            del row_max
            weighted = u if scale_by is None else u * scale_by.to(acc)
            row_sum = graph.row_reduce(weighted, "sum")
            del weighted
            inv = torch.where(row_sum > 0, 1.0 / row_sum, torch.zeros_like(row_sum))
            u.mul_(graph.spread(inv))  # u_e = exp(s_e - max) / Z, a_e = w_e u_e
            a = u if scale_by is None else u * scale_by.to(acc)
            out = graph.matrix(a) @ va
            del a
        ctx.save_for_backward(q2, k2, v2, weight, u, out)
        ctx.graph, ctx.scale, ctx.unit_weight = graph, scale, unit_weight
        return out.to(q2.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q2, k2, v2, weight, u, out = ctx.saved_tensors
        graph, scale = ctx.graph, ctx.scale
        acc = u.dtype
        need_q, need_k, need_v, need_w = ctx.needs_input_grad[:4]
        if graph.num_edges == 0:
            return (
                torch.zeros_like(q2) if need_q else None,
                torch.zeros_like(k2) if need_k else None,
                torch.zeros_like(v2) if need_v else None,
                torch.zeros_like(weight) if need_w else None,
                None,
                None,
                None,
            )
        qa, ka, va = q2.to(acc), k2.to(acc), v2.to(acc)
        go = grad_out.to(acc).contiguous()
        w = None if weight is None or ctx.unit_weight else weight.to(acc)
        grad_q = grad_k = grad_v = grad_w = None
        if need_v:
            a = u if w is None else u * w
            grad_v = graph.transpose_matmul(a, go).to(v2.dtype)
            del a
        if need_q or need_k or need_w:
            # softmax correction per row: sum_e a_e <dout_i, v_j> = <dout_i, out_i>
            row_dot = (go * out).sum(-1)
            grad_a = graph.sddmm(go, va)
            # d a_f / d w_e = u_e (delta_ef - a_f)  =>  dL/dw_e = u_e (grad_a_e - row_dot_i)
            gw = grad_a.sub_(graph.spread(row_dot)).mul_(u)
            if need_w:
                grad_w = gw.to(weight.dtype, copy=True)
            # dL/ds_e = w_e dL/dw_e, in place: one number per edge less at the peak
            gs = gw if w is None else gw.mul_(w)
            gs.mul_(scale)
            if need_q:
                grad_q = (graph.matrix(gs) @ ka).to(q2.dtype)
            if need_k:
                grad_k = graph.transpose_matmul(gs, qa).to(k2.dtype)
        return grad_q, grad_k, grad_v, grad_w, None, None, None


def attention_on_graph(q2, k2, v2, graph, edge_weight, scale, *, unit_weight=False):
    """Edge attention on flat ``[G n, d]``, ``[G m, d]``, ``[G m, d_v]`` rows over an
    :class:`EdgeGraph` already built, with ``edge_weight`` in the graph's row-major order.
    ``unit_weight=True`` says every weight is one (the straight-through mask of
    :class:`companion.sbm.SBMAttention`): the products with it are skipped (they would
    not change a bit) and its gradient is still returned.

    The building block :func:`edge_attention` wraps and :class:`companion.sbm.SBMAttention`
    calls with the graph it sampled (no arguments are checked here: the callers do).

    Examples
    --------
    >>> graph = EdgeGraph(torch.tensor([0, 0, 0]), torch.tensor([0, 0, 1]),
    ...                   torch.tensor([0, 1, 0]), 1, 2, 2)
    >>> q2, k2, v2 = torch.zeros(2, 4), torch.zeros(2, 4), torch.tensor([[1.0], [3.0]])
    >>> attention_on_graph(q2, k2, v2, graph, None, 0.5)
    tensor([[2.],
            [1.]])
    """
    return _EdgeAttention.apply(q2, k2, v2, edge_weight, graph, scale, unit_weight)


def _check_edges(edges, num_groups, n, m, device):
    """Validate an edge list ``(group, query, key)`` against ``num_groups`` x ``n`` x ``m``."""
    if not isinstance(edges, (tuple, list)) or len(edges) != 3:
        raise TypeError("edges: expected a tuple (group, query, key) of three int64 (or "
                        "three int32) tensors")
    names = ("group", "query", "key")
    index_dtype = edges[0].dtype if isinstance(edges[0], torch.Tensor) else torch.int64
    if index_dtype not in INDEX_DTYPES:
        index_dtype = torch.int64  # named in the error below
    for name, t in zip(names, edges):
        if not isinstance(t, torch.Tensor) or t.dtype != index_dtype or t.dim() != 1:
            got = (f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                   else type(t).__name__)
            raise TypeError(f"edges[{name}]: expected a 1-D {index_dtype} tensor (int64, or "
                            f"int32 for all three), got {got}")
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
            lo_val, hi_val = (int(x) for x in torch.aminmax(t))
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
) -> torch.Tensor:
    """Softmax attention of each query over its own list of keys (segment softmax).

    Parameters
    ----------
    q : ``[..., n, d]`` queries, e.g. ``[B, H, n, d]`` or ``[n, d]``, floating point
        (half precision is computed in float32, float64 in float64).
    k : ``[..., m, d]`` keys, same leading dims and dtype.
    v : ``[..., m, d_v]`` values, same leading dims and dtype.
    edges : ``(group, query, key)`` tensors of length ``E``, all three int64 or all three
        int32 (as returned by :func:`companion.sbm.fastrg_sample`); ``group`` indexes the
        flattened leading dims (``b * H + h``).  Any order; repeated edges count with their
        multiplicity.
    edge_weight : optional ``[E]`` nonnegative weights ``w_e`` (differentiable): attention
        weights are ``w_e exp(s_e)`` normalised per query; the straight-through mask of
        :class:`companion.sbm.SBMAttention` enters here.
    scale : positive score scale, default ``1 / sqrt(d)``.

    Returns
    -------
    out : ``[..., n, d_v]``; rows of queries without edges are zero (finite, zero
        gradient).

    Raises
    ------
    TypeError
        Non-tensor or non-floating inputs or weights, ``q``, ``k``, ``v`` of different
        dtypes, edge indices that are not three 1-D int64 (or three int32) tensors, a
        ``scale`` that is not a number.
    ValueError
        Shape or device mismatches, meta tensors, empty sequences, out-of-range edge
        indices, negative or non-finite weights, a ``scale`` that is not positive and
        finite.

    Complexity
    ----------
    Time ``O(E d)``, memory ``O(E + (n + m) d)`` per group, in forward and backward.
    Differentiable once (no double backward).

    References
    ----------
    .. [1] S. Cho, S. Min, J. Kim, M. Lee, H. Lee, S. Hong, "Transformers meet
       Stochastic Block Models: Attention with Data-Adaptive Sparsity and Cost", NeurIPS
       2022, arXiv:2210.15541, attention restricted to the sampled edges, its cost
       linear in the edges (section not known here: the abstract and the authors' code).

    Examples
    --------
    With equal scores each query averages the values of its own keys: query 0 has keys 0 and
    1, query 1 has key 0.

    >>> q, k, v = torch.zeros(1, 2, 4), torch.zeros(1, 2, 4), torch.tensor([[[1.0], [3.0]]])
    >>> edges = (torch.tensor([0, 0, 0]), torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0]))
    >>> edge_attention(q, k, v, edges)
    tensor([[[2.],
             [1.]]])
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor, got dtype {t.dtype}")
        if t.dim() < 2:
            raise ValueError(f"{name}: expected [..., length, dim], got shape {tuple(t.shape)}")
        if t.device.type == "meta":  # the edge indices are checked against values
            raise ValueError(f"{name}: expected a tensor with values, got one on the meta device")
    if q.shape[:-2] != k.shape[:-2] or k.shape[:-1] != v.shape[:-1] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q, k, v: expected [..., n, d], [..., m, d], [..., m, d_v] with equal leading dims, "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError("q, k, v: expected tensors on one device")
    if not (q.dtype == k.dtype == v.dtype):
        # the computation runs in q's precision: a float64 k or v would be rounded silently
        raise TypeError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    n, m, d = q.shape[-2], k.shape[-2], q.shape[-1]
    if n == 0 or m == 0:
        raise ValueError(f"q, k: empty sequence, got n={n}, m={m}")
    batch_shape = q.shape[:-2]
    num_groups = math.prod(batch_shape)
    group, query, key = _check_edges(edges, num_groups, n, m, q.device)
    if edge_weight is not None:
        if not isinstance(edge_weight, torch.Tensor):
            raise TypeError(
                f"edge_weight: expected a floating-point tensor of shape ({group.numel()},), "
                f"got {type(edge_weight).__name__}"
            )
        if edge_weight.shape != (group.numel(),):
            raise ValueError(
                f"edge_weight: expected shape ({group.numel()},), got {tuple(edge_weight.shape)}"
            )
        if not edge_weight.is_floating_point():
            raise TypeError(
                f"edge_weight: expected a floating-point tensor, got dtype {edge_weight.dtype}"
            )
        if edge_weight.device != q.device:
            raise ValueError(f"edge_weight: expected device {q.device}, got {edge_weight.device}")
        # one pass: min is NaN if any entry is, and the comparison then fails
        if edge_weight.numel():
            lo, hi = (float(x) for x in torch.aminmax(edge_weight.detach()))
            if not (lo >= 0 and hi < math.inf):
                raise ValueError(
                    f"edge_weight: expected nonnegative finite weights, got values in [{lo}, {hi}]"
                )
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d > 0 else 1.0
    elif not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(
            f"scale: expected a positive finite number or None, got {scale!r} "
            f"({type(scale).__name__})"
        )
    elif not 0 < scale < math.inf:
        raise ValueError(f"scale: expected a positive finite number, got {scale!r}")
    graph = EdgeGraph(group, query, key, num_groups, n, m)
    if edge_weight is not None and graph.order is not None:
        edge_weight = edge_weight[graph.order]
    out = attention_on_graph(
        q.reshape(num_groups * n, d),
        k.reshape(num_groups * m, d),
        v.reshape(num_groups * m, v.shape[-1]),
        graph,
        edge_weight,
        float(scale),
    )
    return out.reshape(*batch_shape, n, v.shape[-1])
