"""The SBM-Transformer attention layer (Cho et al., NeurIPS 2022) and its training pieces.

Definition
----------
Each attention head owns ``k`` cluster embeddings ``C`` (``[k, d]``) and shares one MLP
``Linear(d, d) -> ReLU -> Linear(d, d)`` between queries and keys. From them

* memberships ``Qhat = sigmoid(MLP(Q) C^T)`` (``[n, k]``) and ``Khat = sigmoid(MLP(K) C^T)``
  (``[m, k]``), nonnegative and not normalised (:func:`sbm_parameters`);
* block connectivity ``S = softmax(vec(C C^T))`` reshaped to ``[k, k]`` (sums to one);
* edge probabilities ``P = Qhat S Khat^T`` (``[n, m]``, every entry in ``[0, 1]``).

:class:`SBMAttention` samples a bipartite graph ``A ~ P``
(:func:`companion.sbm.fastrg.fastrg_sample`), attends on the sampled edges only
(:mod:`companion.sbm.graph_attention`) and back-propagates the sampling step with the
straight-through estimator ``grad_P = hardtanh(A * grad_A)``; :func:`density_regularizer`
is the density penalty of the loss.
Time ``O(E (d + k) + (n + m) k (d + k))`` and memory ``O(E + (n + m)(d + k))`` per head.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from companion._validate import check_int, check_tensor
from companion.sbm.fastrg import (DEFAULT_TUNING, DUPLICATE_POLICIES, FastRGTuning,
                                  fastrg_sample, poisson_pair_counts, use_pair_grid)
from companion.sbm.graph_attention import EdgeGraph, attention_on_graph
from companion.sbm.tensor_ops import transposed_copy

__all__ = ["sbm_parameters", "SBMAttention", "density_regularizer"]


def sbm_parameters(
    q: torch.Tensor,
    k: torch.Tensor,
    cluster_embeddings: torch.Tensor,
    mlp: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Memberships and block matrix of the SBM attention head.

    Parameters
    ----------
    q, k : tensor ``[n, d]`` and ``[m, d]`` (one head) or ``[B, H, n, d]`` and
        ``[B, H, m, d]`` (a batch of heads).
    cluster_embeddings : tensor ``[k, d]`` (shared by all heads) or ``[H, k, d]``.
    mlp : callable mapping ``[..., d]`` to ``[..., d]``, applied to both ``q`` and ``k``
        (the paper's shared ``Linear -> ReLU -> Linear``).

    Returns
    -------
    q_membership : ``sigmoid(mlp(q) C^T)``, ``[n, k]`` or ``[B, H, n, k]``.
    s : ``softmax`` over all ``k^2`` entries of ``C C^T``, ``[k, k]``, or ``[H, k, k]`` for
        batched input.
    k_membership : ``sigmoid(mlp(k) C^T)``, ``[m, k]`` or ``[B, H, m, k]``.

    Complexity
    ----------
    ``O((n + m) d (d + k) + k^2 d)`` per head.

    Examples
    --------
    >>> q, k, c = torch.randn(5, 4), torch.randn(7, 4), torch.randn(3, 4)
    >>> qm, s, km = sbm_parameters(q, k, c, torch.nn.Identity())
    >>> qm.shape, s.shape, km.shape, round(float(s.sum()), 6)
    (torch.Size([5, 3]), torch.Size([3, 3]), torch.Size([7, 3]), 1.0)

    References
    ----------
    .. [1] S. Cho, S. Min, J. Kim, M. Lee, H. Lee, S. Hong, "Transformers meet
       Stochastic Block Models: Attention with Data-Adaptive Sparsity and Cost", NeurIPS
       2022, arXiv:2210.15541, the memberships ``Qhat``, ``Khat`` and the block matrix
       ``S`` from the queries, keys and cluster embeddings (section not known here: the
       abstract and the authors' code).
    """
    for name, t in (("q", q), ("k", k), ("cluster_embeddings", cluster_embeddings)):
        check_tensor(name, t, floating=True)
    if not callable(mlp):
        raise TypeError(f"mlp: expected a callable [..., d] -> [..., d], got {mlp!r}")
    if q.dim() not in (2, 4) or k.dim() != q.dim():
        raise ValueError(
            f"q, k: expected [n, d] and [m, d] or [B, H, n, d] and [B, H, m, d], "
            f"got shapes {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q, k: batch dims and head size must agree, got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        raise ValueError(f"q, k: empty sequence, got shapes {tuple(q.shape)} and {tuple(k.shape)}")
    d = q.shape[-1]
    c = cluster_embeddings
    if c.dim() == 2:
        if c.shape[-1] != d or c.shape[0] == 0:
            raise ValueError(
                f"cluster_embeddings: expected [k, {d}] with k >= 1, got {tuple(c.shape)}"
            )
    elif c.dim() == 3:
        if q.dim() != 4 or c.shape[0] != q.shape[1] or c.shape[-1] != d or c.shape[1] == 0:
            heads = q.shape[1] if q.dim() == 4 else "H"
            raise ValueError(
                f"cluster_embeddings: expected [H, k, d] = [{heads}, k, {d}] for batched q, "
                f"got {tuple(c.shape)}"
            )
    else:
        raise ValueError(f"cluster_embeddings: expected [k, d] or [H, k, d], got {tuple(c.shape)}")

    ct = c.transpose(-1, -2)
    q_membership = torch.sigmoid(mlp(q) @ ct)
    k_membership = torch.sigmoid(mlp(k) @ ct)
    gram = c @ ct
    s = torch.softmax(gram.flatten(-2), dim=-1).reshape(gram.shape)
    if q.dim() == 4 and s.dim() == 2:
        s = s.expand(q.shape[1], *s.shape)
    return q_membership, s, k_membership



# ---------------------------------------------------------------------------------------
# straight-through estimator and the attention head
# ---------------------------------------------------------------------------------------
class _StraightThroughMask(torch.autograd.Function):
    """Forward: ones on the sampled edges.  Backward: ``grad_P = hardtanh(grad_A)`` on
    the sampled edges, routed to ``P_e = <(Qhat S)_i, Khat_j>`` by two sparse-dense
    products, without ever evaluating ``P``."""

    @staticmethod
    def forward(ctx, qs2, km2, graph):
        ctx.save_for_backward(qs2, km2)
        ctx.graph = graph
        return torch.ones(graph.num_edges, dtype=qs2.dtype, device=qs2.device)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_mask):
        qs2, km2 = ctx.saved_tensors
        graph = ctx.graph
        grad_p = torch.nn.functional.hardtanh(grad_mask).to(qs2.dtype)
        grad_qs = grad_km = None
        if ctx.needs_input_grad[0]:
            grad_qs = graph.matrix(grad_p) @ km2
        if ctx.needs_input_grad[1]:
            grad_km = graph.transpose_matmul(grad_p, qs2)
        return grad_qs, grad_km, None


class _DenseStraightThrough(torch.autograd.Function):
    """The straight-through estimator on a dense count matrix ``C`` ``[G, n, m]`` (the
    pair-grid path): forward returns ``C`` (the weights of the pairs; a pair drawn ``c``
    times is ``c`` copies of weight one), backward ``grad_P = C * hardtanh(grad_C)``
    (each copy passes ``hardtanh`` of its own gradient, which is the same for all copies
    of a pair), routed to ``P = (Qhat S) Khat^T`` by two GEMMs."""

    @staticmethod
    def forward(ctx, qs, km, counts):
        ctx.save_for_backward(qs, km, counts)
        return counts

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_counts):
        qs, km, counts = ctx.saved_tensors
        grad_p = torch.nn.functional.hardtanh(grad_counts).mul_(counts).to(qs.dtype)
        grad_qs = grad_km = None
        if ctx.needs_input_grad[0]:
            grad_qs = torch.bmm(grad_p, km)
        if ctx.needs_input_grad[1]:
            grad_km = torch.bmm(grad_p.transpose(1, 2), qs)
        return grad_qs, grad_km, None


class _CountAttention(torch.autograd.Function):
    """Softmax attention of ``[G, n, d]`` queries over ``[G, m, d]`` keys with pair
    weights ``w`` ``[G, n, m]``: ``a_ij = w_ij exp(s_ij) / sum_j w_ij exp(s_ij)``, the
    edge attention of the multigraph with ``w_ij`` copies of pair ``(i, j)``; a query
    without a pair gets a zero row.  The same quantities as :func:`edge_attention`'s
    forward and backward (``u``, ``a``, the per-row correction ``<dout_i, out_i>``),
    with dense GEMMs in float32 or wider.

    ``present`` is 1.0 where ``w_ij > 0`` and 0.0 elsewhere. From it the scores get the
    bias :func:`_absent_bias`, ``-1e30`` on the absent pairs, so that the row maximum is
    taken over the present pairs, as the edge path does (a fused add, where a boolean
    mask costs a compare and a select).  Exponents are clamped at -80: the exponential is
    slow in its subnormal range, and ``exp(-80) < 2e-35`` is far below the
    row's largest term ``exp(0) = 1``; ``u`` is then set to 0 on the absent pairs (no
    subnormal numbers in the backward)."""

    @staticmethod
    def forward(ctx, q, k, v, weights, present, scale):
        out, saved = _count_attention_forward(q, k, v, weights, present, scale)
        ctx.save_for_backward(*saved)
        ctx.scale, ctx.dtypes = scale, (q.dtype, k.dtype, v.dtype)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        grad_q, grad_k, grad_v, grad_w, _ = _count_attention_backward(
            ctx.saved_tensors, grad_out, ctx.scale, ctx.dtypes)
        return grad_q, grad_k, grad_v, grad_w, None, None


def _absent_bias(present: torch.Tensor) -> torch.Tensor:
    """``-1e30`` where ``present`` is 0.0 and ``+0`` where it is 1.0: ``(present - 1)
    1e30``, two float passes (zeros_like + masked_fill_(w == 0) adds a bool compare and
    a masked write); the same numbers, signs of zero included."""
    return present.sub(1.0).mul_(1e30)


def _count_attention_forward(q, k, v, weights, present, scale):
    """:class:`_CountAttention`'s forward: the output (in ``q``'s dtype) and the tensors
    its backward reads. ``present``: 1.0 where a pair is present, 0.0 where absent."""
    acc = weights.dtype
    qa, ka, va = q.to(acc), k.to(acc), v.to(acc)
    # a contiguous K^T: bmm reads a contiguous second operand in its own order
    # (float32 results bit-identical on the shapes tried)
    u = torch.baddbmm(_absent_bias(present), qa, transposed_copy(ka), alpha=scale)
    u.sub_(u.amax(-1, keepdim=True)).clamp_(min=-80.0).exp_()
    total = torch.mul(u, weights).sum(-1, keepdim=True)
    inv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    # u_ij = exp(s_ij - max) / Z_i, a_ij = w_ij u_ij; u_ij = 0 on absent pairs. Left at
    # exp(-80) / Z_i there, the backward's dL/dw = u (...) made subnormal numbers of them,
    # and on processors that take a microcode assist per subnormal operand (Intel's)
    # that made two [G, n, m] passes of the backward several times slower. (An exponent below
    # -104, whose exp is 0, is as slow: exp computes through the subnormal range.) The
    # same numbers bit for bit: an absent pair's u only ever meets a zero weight, and
    # multiplying a present pair's by 1.0 is exact.
    u.mul_(inv).mul_(present)
    attn = u * weights
    out = torch.bmm(attn, va)
    return out.to(q.dtype), (qa, ka, va, weights, u, attn, out)


def _count_attention_backward(saved, grad_out, scale, dtypes):
    """:class:`_CountAttention`'s backward: the gradients of ``q``, ``k``, ``v`` and the
    weights, and ``dL/ds / scale`` (``grad_w * weights``, already formed)."""
    qa, ka, va, weights, u, attn, out = saved
    go = grad_out.to(u.dtype)
    grad_v = torch.bmm(attn.transpose(1, 2), go)
    # dL/dw_ij = u_ij (<dout_i, v_j> - <dout_i, out_i>)
    grad_w = torch.bmm(go, transposed_copy(va))
    grad_w.sub_((go * out).sum(-1, keepdim=True)).mul_(u)
    grad_s = grad_w * weights  # dL/ds_ij / scale
    grad_q = torch.bmm(grad_s, ka).mul_(scale)
    grad_k = torch.bmm(grad_s.transpose(1, 2), qa).mul_(scale)
    dq, dk, dv = dtypes
    return grad_q.to(dq), grad_k.to(dk), grad_v.to(dv), grad_w, grad_s


class _PairGridAttention(torch.autograd.Function):
    """The pair-grid layer in one node: :class:`_DenseStraightThrough` on the counts,
    :class:`_CountAttention` with them as weights, and the counts' sums per group (the
    density's numerator).  Forward returns ``(out, sums)``; backward adds the sums'
    gradient to the weights' one, as autograd accumulated the two uses of the counts,
    and passes the total through the straight-through rule, in place: the same numbers
    as the three nodes, bit for bit, with two ``[G, n, m]`` passes and buffers fewer."""

    @staticmethod
    def forward(ctx, q, k, v, qs, km, counts, present, scale):
        ctx.set_materialize_grads(False)
        out, saved = _count_attention_forward(q, k, v, counts, present, scale)
        ctx.save_for_backward(qs, km, *saved)
        ctx.scale, ctx.dtypes = scale, (q.dtype, k.dtype, v.dtype)
        return out, counts.sum((1, 2))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_sums):
        qs, km, *saved = ctx.saved_tensors
        counts = saved[3]
        if grad_out is None:  # the loss reads only the density: q, k, v get no gradient
            grad_q = grad_k = grad_v = None  # (as from the former separate attention node)
            grad_w = torch.zeros(counts.shape, dtype=saved[4].dtype, device=qs.device)
        else:
            grad_q, grad_k, grad_v, grad_w, _ = _count_attention_backward(
                saved, grad_out, ctx.scale, ctx.dtypes)
        if grad_sums is not None:
            grad_w.add_(grad_sums[:, None, None])
        # straight-through: grad_P = counts * hardtanh(grad_counts)
        grad_p = torch.nn.functional.hardtanh(grad_w, inplace=True).mul_(counts).to(qs.dtype)
        grad_qs = grad_km = None
        if ctx.needs_input_grad[3]:
            grad_qs = torch.bmm(grad_p, km)
        if ctx.needs_input_grad[4]:
            grad_km = torch.bmm(grad_p.transpose(1, 2), qs)
        return grad_q, grad_k, grad_v, grad_qs, grad_km, None, None, None


class SBMAttention(nn.Module):
    """One SBM-Transformer attention layer over ``num_heads`` heads (the full head).

    Holds the cluster embeddings ``[H, k, d]`` and the shared MLP; :meth:`forward`
    computes memberships (:func:`sbm_parameters`), samples ``A`` with
    :func:`fastrg_sample`, attends on the sampled edges (:func:`edge_attention`) and
    back-propagates through the sampling with the straight-through estimator: the
    gradient ``grad_A`` on the sampled entries becomes ``grad_P = hardtanh(A * grad_A)``
    and flows to ``P = Qhat S Khat^T``; unsampled entries get none.  ``P`` is never
    formed: its gradient is pushed to ``Qhat S`` and ``Khat`` by sparse products.

    Parameters
    ----------
    head_dim : head size ``d``.
    num_heads : ``H``.
    num_clusters : ``k`` (128 in the paper's LRA runs).
    duplicates : forwarded to :func:`fastrg_sample`.  With ``"keep"`` (default) each copy
        of a pair drawn ``c`` times is one edge of weight one, so that pair passes
        ``c * hardtanh(grad_A)`` (with ``grad_A`` the gradient of its multiplicity);
        with ``"merge"`` ``A`` is 0/1 and the rule is exactly ``hardtanh(A * grad_A)``.
    self_loops : forwarded to :func:`fastrg_sample`; the forced loops are part of ``A``
        and the STE passes gradient through them too.
    tuning : :class:`companion.sbm.FastRGTuning` of the sampler.  When it counts edges
        per (query, key) pair (:func:`companion.sbm.fastrg.use_pair_grid`: small and
        dense graphs, ``n m`` within a small factor of the expected edges) the layer
        keeps the counts as a dense ``[n, m]`` weight matrix and attends with dense
        GEMMs (the same graph as the edge list of that tuning, the same law, the same
        straight-through rule; equal to the edge path up to float rounding), else on
        the sampled edge list.
    device, dtype : for the parameters.

    Complexity
    ----------
    ``O(E (d + k) + (n + m) k (d + k))`` time and ``O(E + (n + m)(d + k))`` memory per
    head for ``E`` sampled edges; no ``n x m`` tensor is formed.

    Examples
    --------
    >>> torch.manual_seed(0) and None
    >>> layer = SBMAttention(head_dim=4, num_heads=2, num_clusters=3)
    >>> q = k = v = torch.randn(1, 2, 6, 4)
    >>> out, density = layer(q, k, v, generator=torch.Generator().manual_seed(0))
    >>> out.shape, density.shape
    (torch.Size([1, 2, 6, 4]), torch.Size([1, 2]))

    References
    ----------
    .. [1] S. Cho, S. Min, J. Kim, M. Lee, H. Lee, S. Hong, "Transformers meet
       Stochastic Block Models: Attention with Data-Adaptive Sparsity and Cost", NeurIPS
       2022, arXiv:2210.15541, the SBM-Transformer's attention: sampled graph, attention
       on its edges, straight-through gradients (section not known here: the abstract
       and the authors' code).
    """

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        num_clusters: int,
        *,
        duplicates: str = "keep",
        self_loops: bool = False,
        tuning: FastRGTuning = DEFAULT_TUNING,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if not isinstance(tuning, FastRGTuning):
            raise TypeError(f"tuning: expected a FastRGTuning, got {type(tuning).__name__}")
        self.tuning = tuning
        sizes = (("head_dim", head_dim), ("num_heads", num_heads), ("num_clusters", num_clusters))
        for name, val in sizes:
            check_int(name, val, minimum=1)
        if duplicates not in DUPLICATE_POLICIES:
            raise ValueError(
                f"duplicates: expected one of {DUPLICATE_POLICIES}, got {duplicates!r}"
            )
        factory = {"device": device, "dtype": dtype}
        self.head_dim, self.num_heads, self.num_clusters = head_dim, num_heads, num_clusters
        self.duplicates, self.self_loops = duplicates, self_loops
        self.cluster_embeddings = nn.Parameter(
            torch.empty(num_heads, num_clusters, head_dim, **factory)
        )
        nn.init.normal_(self.cluster_embeddings, std=head_dim**-0.5)
        self.mlp = nn.Sequential(
            nn.Linear(head_dim, head_dim, **factory),
            nn.ReLU(),
            nn.Linear(head_dim, head_dim, **factory),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        query_valid: torch.Tensor | None = None,
        key_valid: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        return_edges: bool = False,
    ):
        """Attend ``q`` ``[B, H, n, d]`` to ``k``/``v`` ``[B, H, m, d]`` on a sampled graph.

        ``query_valid`` ``[B, n]`` and ``key_valid`` ``[B, m]`` (bool, None: all valid)
        mark padding: its memberships are zero, so ``P_ij = 0`` wherever ``i`` or ``j``
        is padding and no edge touches it (a forced self-loop of a padded position is
        dropped too); padded queries get zero output rows.  Nothing per edge is
        gathered for this: the cost stays ``O(E + (n + m) k)``.

        Returns
        -------
        out : ``[B, H, n, d_v]``; a query with no sampled edge gets a zero row.
        density : ``[B, H]``, realised density ``edges / (n' m')`` per head, with
            ``n'``, ``m'`` the numbers of valid queries and keys of that batch element,
            differentiable through the straight-through estimator (feed it to
            :func:`density_regularizer`).
        edges : ``(group, query, key)`` int64, only if ``return_edges``.
        """
        if q.dim() != 4 or q.shape[1] != self.num_heads or q.shape[-1] != self.head_dim:
            raise ValueError(
                f"q: expected [B, {self.num_heads}, n, {self.head_dim}], got {tuple(q.shape)}"
            )
        # one contiguous copy each (views of a fused projection otherwise copied twice:
        # by the MLP's GEMM and by the attention's [G, n, d] reshape)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        q_membership, s, k_membership = sbm_parameters(q, k, self.cluster_embeddings, self.mlp)
        valid_counts = []
        for name, mask, length in (
            ("query_valid", query_valid, q.shape[2]),
            ("key_valid", key_valid, k.shape[2]),
        ):
            if mask is None:
                valid_counts.append(torch.full((q.shape[0],), float(length), device=q.device))
                continue
            if (
                not isinstance(mask, torch.Tensor)
                or mask.dtype != torch.bool
                or tuple(mask.shape) != (q.shape[0], length)
            ):
                got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
                raise ValueError(
                    f"{name}: expected a bool tensor [{q.shape[0]}, {length}], got {got}"
                )
            valid_counts.append(mask.sum(1).to(torch.float32))
        if query_valid is not None:
            q_membership = q_membership * query_valid[:, None, :, None].to(q_membership.dtype)
        if key_valid is not None:
            k_membership = k_membership * key_valid[:, None, :, None].to(k_membership.dtype)
        qs = q_membership @ s  # [B, H, n, k]: the STE's factor, and the sampler's GEMM
        if v.shape[:3] != (q.shape[0], q.shape[1], k.shape[2]):
            raise ValueError(f"v: expected [{q.shape[0]}, {q.shape[1]}, {k.shape[2]}, d_v], "
                             f"got {tuple(v.shape)}")
        if use_pair_grid(qs.detach(), k_membership.detach(), self.tuning):
            return self._forward_pairs(q, k, v, q_membership, s, k_membership, qs,
                                       query_valid, key_valid, valid_counts, generator,
                                       return_edges)
        edges = fastrg_sample(
            q_membership.detach(),
            s.detach(),
            k_membership.detach(),
            generator,
            duplicates=self.duplicates,
            self_loops=self.self_loops,
            tuning=self.tuning,
            q_times_s=qs.detach(),
            # half the memory of int64 indices, the same edges; the group, query and key
            # counts are far below 2**31 at any size that fits in memory
            index_dtype=torch.int32,
        )
        batch, heads, n = q.shape[:3]
        m = k.shape[2]
        num_groups = batch * heads
        if self.self_loops and (query_valid is not None or key_valid is not None):
            group, query, key = edges
            # int64 flat positions: B n and B m may pass 2**31 where the indices do not
            element = torch.div(group.long(), heads, rounding_mode="floor")  # batch index
            keep = torch.ones_like(group, dtype=torch.bool)
            if query_valid is not None:
                keep &= query_valid.reshape(-1)[element * n + query]
            if key_valid is not None:
                keep &= key_valid.reshape(-1)[element * m + key]
            edges = (group[keep], query[keep], key[keep])
            del element, keep
        graph = EdgeGraph(*edges, num_groups, n, m)
        if graph.order is not None:  # the mask below is indexed in the sampler's order
            raise RuntimeError("fastrg_sample returned edges not sorted by (group, query)")
        mask = _StraightThroughMask.apply(
            qs.reshape(num_groups * n, -1), k_membership.reshape(num_groups * m, -1), graph
        )
        out = attention_on_graph(
            q.reshape(num_groups * n, -1),
            k.reshape(num_groups * m, -1),
            v.reshape(num_groups * m, -1),
            graph,
            mask,
            1.0 / math.sqrt(self.head_dim),
            unit_weight=True,  # the straight-through mask is all ones
        ).reshape(batch, heads, n, -1)
        per_group = torch.zeros(num_groups, dtype=mask.dtype, device=mask.device)
        per_group = per_group.index_add(0, edges[0], mask)
        pairs = (valid_counts[0] * valid_counts[1]).clamp(min=1).to(mask.dtype)  # [B]
        density = per_group.reshape(batch, heads) / pairs[:, None]
        if return_edges:  # int64, as the pair grid's and fastrg_sample's default
            return out, density, tuple(t.long() for t in edges)
        return out, density

    def _forward_pairs(self, q, k, v, q_membership, s, k_membership, qs, query_valid,
                       key_valid, valid_counts, generator, return_edges):
        """:meth:`forward` on the pair grid: the sampled counts as a dense weight matrix."""
        batch, heads, n = q.shape[:3]
        m = k.shape[2]
        num_groups = batch * heads
        acc = torch.promote_types(q.dtype, torch.float32)
        # the counts as the attention's weights directly (no int64 -> float pass)
        counts = poisson_pair_counts(q_membership.detach(), s.detach(), k_membership.detach(),
                                     generator, tuning=self.tuning, q_times_s=qs.detach(),
                                     dtype=acc)
        if self.self_loops:
            if n != m:
                raise ValueError(
                    f"self_loops: requires as many queries as keys, got n={n}, m={m}")
            loops = torch.eye(n, dtype=torch.bool, device=q.device).expand(batch, n, n)
            if query_valid is not None:  # no forced loop at a padded position
                loops = loops & query_valid[:, :, None]
            if key_valid is not None:
                loops = loops & key_valid[:, None, :]
            counts = counts + loops[:, None].to(counts.dtype)
        if self.duplicates == "merge":
            counts = counts.clamp_(max=1)
        weights = counts.reshape(num_groups, n, m)
        qs2 = qs.reshape(num_groups, n, -1)
        # 1.0 where a pair is present, 0.0 where absent: min(w, 1), one float pass, as
        # the counts are integers w >= 0
        present = weights.clamp(max=1.0)
        # straight-through counts, count attention and their sums in one node
        out, sums = _PairGridAttention.apply(
            q.reshape(num_groups, n, -1), k.reshape(num_groups, m, -1),
            v.reshape(num_groups, m, -1), qs2, k_membership.reshape(num_groups, m, -1),
            weights, present, 1.0 / math.sqrt(self.head_dim))
        out = out.reshape(batch, heads, n, -1)
        pairs = (valid_counts[0] * valid_counts[1]).clamp(min=1).to(qs2.dtype)  # [B]
        density = sums.to(qs2.dtype).reshape(batch, heads) / pairs[:, None]
        if not return_edges:
            return out, density
        flat = counts.reshape(-1)
        pair = torch.nonzero(flat).squeeze(1)
        pair = pair.repeat_interleave(flat[pair].to(torch.int64))
        row = torch.div(pair, m, rounding_mode="floor")
        edges = (torch.div(row, n, rounding_mode="floor"), row % n, pair % m)
        return out, density, edges


def density_regularizer(
    densities: torch.Tensor | Iterable[torch.Tensor], lam: float = 1e-4
) -> torch.Tensor:
    """``lam`` times the mean realised density over layers, heads and batch.

    Parameters
    ----------
    densities : one tensor (e.g. ``[B, H]`` from :class:`SBMAttention`) or an iterable of
        them, one per layer.
    lam : the weight ``lambda`` (1e-4 in the paper's LRA runs); must be >= 0.

    Returns
    -------
    A scalar tensor, to be added to the task loss; its gradient reaches the edge
    probabilities through the straight-through estimator.

    Examples
    --------
    >>> float(density_regularizer([torch.tensor([[0.2, 0.4]]), torch.tensor([[0.6, 0.8]])],
    ...                           lam=0.5))
    0.25

    References
    ----------
    .. [1] S. Cho, S. Min, J. Kim, M. Lee, H. Lee, S. Hong, "Transformers meet
       Stochastic Block Models: Attention with Data-Adaptive Sparsity and Cost", NeurIPS
       2022, arXiv:2210.15541, the penalty on the sampled graphs' density (section not
       known here: the abstract and the authors' code).
    """
    if not isinstance(lam, (int, float)) or isinstance(lam, bool) or not lam >= 0:
        raise ValueError(f"lam: expected a nonnegative float, got {lam!r}")
    if isinstance(densities, torch.Tensor):
        parts = [densities]
    else:
        parts = list(densities)
    if not parts or any(not isinstance(p, torch.Tensor) for p in parts):
        raise TypeError("densities: expected a tensor or a non-empty iterable of tensors")
    flat = torch.cat([p.reshape(-1) for p in parts])
    if flat.numel() == 0:
        raise ValueError("densities: no entries")
    return lam * flat.mean()

