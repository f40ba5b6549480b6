"""SBM-Transformer attention (Cho et al., NeurIPS 2022) at a cost linear in sampled edges.

Definition
----------
Each attention head owns ``k`` cluster embeddings ``C`` (``[k, d]``) and shares one MLP
``Linear(d, d) -> ReLU -> Linear(d, d)`` between queries and keys. From them

* memberships ``Qhat = sigmoid(MLP(Q) C^T)`` (``[n, k]``) and ``Khat = sigmoid(MLP(K) C^T)``
  (``[m, k]``), nonnegative and not normalised;
* block connectivity ``S = softmax(vec(C C^T))`` reshaped to ``[k, k]`` (sums to one);
* edge probabilities ``P = Qhat S Khat^T`` (``[n, m]``, every entry in ``[0, 1]``).

A bipartite graph ``A ~ P`` is sampled, attention is computed on the sampled edges only
(:func:`companion.edge_attention.edge_attention`), and the sampling step is
back-propagated with the straight-through estimator ``grad_P = hardtanh(A * grad_A)``.

Sampling uses fastRG (Rohe et al., 2018): ``P`` is never formed; the number of edges is
Poisson with mean ``sum(P)``, and each edge draws a cluster pair and then its two
endpoints.  Time and memory are ``O(edges + (n + m) k + k^2)`` per head.

Public API: :func:`sbm_parameters`, :func:`edge_probabilities`, :func:`fastrg_sample`,
:func:`companion.edge_attention.edge_attention` (re-exported here), :class:`SBMAttention`,
:func:`density_regularizer`, :func:`companion.edge_attention.dense_masked_attention`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from companion.edge_attention import (
    _check_edges,
    dense_masked_attention,
    edge_attention,
    _edge_pair_grads,
)

__all__ = [
    "sbm_parameters",
    "edge_probabilities",
    "fastrg_sample",
    "edge_attention",
    "straight_through_mask",
    "SBMAttention",
    "density_regularizer",
    "dense_masked_attention",
    "DUPLICATE_POLICIES",
]

DUPLICATE_POLICIES = ("merge", "keep")

# fastRG looks up one inverse-CDF table of (rows x nodes) float64 entries at a time; groups
# are processed in blocks so that this table stays below this many entries.
_CDF_BLOCK_ENTRIES = 1 << 24


# ---------------------------------------------------------------------------------------
# parameters and dense probabilities
# ---------------------------------------------------------------------------------------
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
    """
    _check_float("q", q)
    _check_float("k", k)
    _check_float("cluster_embeddings", cluster_embeddings)
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


def edge_probabilities(
    q_membership: torch.Tensor, s: torch.Tensor, k_membership: torch.Tensor
) -> torch.Tensor:
    """Dense edge-probability matrix ``P = Qhat S Khat^T`` (tests and small ``n`` only).

    Parameters
    ----------
    q_membership, s, k_membership : as for :func:`fastrg_sample`.

    Returns
    -------
    P : ``[n, m]`` or ``[B, H, n, m]``.

    Complexity
    ----------
    ``O(n m k)`` time and ``O(n m)`` memory per head: this is the cost fastRG avoids.
    """
    qm, sg, km, batch_shape = _groups(q_membership, s, k_membership)
    p = (qm @ sg) @ km.transpose(-1, -2)
    return p.reshape(*batch_shape, qm.shape[1], km.shape[1])


# ---------------------------------------------------------------------------------------
# fastRG sampler
# ---------------------------------------------------------------------------------------
def fastrg_sample(
    q_membership: torch.Tensor,
    s: torch.Tensor,
    k_membership: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    duplicates: str = "merge",
    self_loops: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample the bipartite graph ``A ~ Qhat S Khat^T`` with fastRG, as an edge list.

    Algorithm (Rohe et al., 2018), for each group (one batch element and head):

    1. ``S~ = diag(colsum Qhat) S diag(colsum Khat)``; ``X~``/``Y~`` are the columns of
       ``Qhat``/``Khat`` normalised into distributions over queries/keys.
    2. Draw the number of edges ``E ~ Poisson(sum S~)`` (``sum S~ = sum P``).
    3. For every edge independently draw a cluster pair ``(a, b) ~ S~ / sum S~``, a query
       ``i ~ X~[:, a]`` and a key ``j ~ Y~[:, b]``.

    Every step is vectorised over all edges of all groups (inverse-CDF look-ups with
    ``searchsorted``); no ``n x m`` tensor is ever formed.  The result is a Poisson
    multigraph whose count matrix ``N`` satisfies ``E[N_ij] = P_ij`` exactly.

    Parameters
    ----------
    q_membership : ``[n, k]`` or ``[B, H, n, k]``, nonnegative and finite.
    s : ``[k, k]`` (one group), or ``[H, k, k]`` / ``[B, H, k, k]`` (batch), nonnegative.
    k_membership : ``[m, k]`` or ``[B, H, m, k]``, nonnegative and finite.
    generator : optional ``torch.Generator`` on the memberships' device.
    duplicates : ``"merge"`` (default) or ``"keep"``.
        ``"keep"`` returns the multigraph as drawn: a pair ``(i, j)`` drawn ``c`` times
        appears ``c`` times (``E[count] = P_ij``; attention then weighs that key ``c``
        times).  ``"merge"`` keeps one copy of every drawn pair, so ``A`` is a 0/1 mask
        with ``Pr[A_ij = 1] = 1 - exp(-P_ij)`` (``= P_ij - P_ij^2 / 2 + ...``, the
        simple-graph version of fastRG); edges come back sorted by
        ``(group, query, key)``.
    self_loops : if True (requires ``n == m``), every query ``i`` is also given the edge
        ``(i, i)``, so no query is left without an edge.  If False (default) a query may
        receive no edge; :func:`edge_attention` then returns a zero output row for it.

    Returns
    -------
    group, query, key : int64 tensors of equal length ``E``, one entry per edge, on the
        memberships' device.  ``group`` is the flat index ``b * H + h`` (0 for one group).

    Raises
    ------
    ValueError
        On shape mismatches, empty sequences, negative/NaN/infinite entries, an unknown
        ``duplicates`` policy, or ``self_loops`` with ``n != m``.

    Complexity
    ----------
    Time ``O(E log(k n) + G (n + m) k + G k^2)`` and memory ``O(E + G (n + m) k)`` for
    ``G`` groups and ``E`` edges (plus ``O(E log E)`` for the sort of ``"merge"``).
    """
    if duplicates not in DUPLICATE_POLICIES:
        raise ValueError(f"duplicates: expected one of {DUPLICATE_POLICIES}, got {duplicates!r}")
    qm, sg, km, _ = _groups(q_membership, s, k_membership)
    for name, t in (("q_membership", qm), ("s", sg), ("k_membership", km)):
        if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
            raise ValueError(
                f"{name}: expected nonnegative finite entries (found negative, NaN or inf)"
            )
    num_groups, n, kc = qm.shape
    m = km.shape[1]
    if self_loops and n != m:
        raise ValueError(f"self_loops: requires as many queries as keys, got n={n}, m={m}")
    device = qm.device

    with torch.no_grad():
        qm = qm.detach().to(torch.float64)
        km = km.detach().to(torch.float64)
        sg = sg.detach().to(torch.float64)
        q_mass = qm.sum(1)  # [G, k]
        k_mass = km.sum(1)
        block = q_mass[:, :, None] * sg * k_mass[:, None, :]  # S~, [G, k, k]
        rates = block.sum((1, 2))
        if not bool(torch.isfinite(rates).all()):
            raise ValueError("q_membership, s, k_membership: the expected edge count overflows")
        counts = torch.poisson(rates, generator=generator).to(torch.int64)
        group = torch.repeat_interleave(torch.arange(num_groups, device=device), counts)
        num_edges = group.numel()

        # cluster pair per edge: one inverse-CDF table of k^2 entries per group
        pair = _sample_rows(block.reshape(num_groups, kc * kc), group, generator)
        a = torch.div(pair, kc, rounding_mode="floor")
        b = pair - a * kc
        del pair
        # endpoints: row (g, a) of the k distributions over queries of group g, etc.
        query = _sample_blocked(qm, group, a, generator)
        del a
        key = _sample_blocked(km, group, b, generator)
        del b

        if self_loops:
            loops = torch.arange(n, device=device)
            group = torch.cat([group, torch.arange(num_groups, device=device).repeat_interleave(n)])
            query = torch.cat([query, loops.repeat(num_groups)])
            key = torch.cat([key, loops.repeat(num_groups)])
        if duplicates == "merge" and group.numel() > 0:
            code = (group * n + query) * m + key
            code = torch.unique(code, sorted=True)
            key = code % m
            code = torch.div(code, m, rounding_mode="floor")
            query = code % n
            group = torch.div(code, n, rounding_mode="floor")
        del num_edges
    return group, query, key


def _sample_rows(
    weights: torch.Tensor, row: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    """For every entry ``r`` of ``row`` draw a column index ``c`` with
    ``Pr[c] = weights[r, c] / sum(weights[r])`` (inverse CDF, float64).

    The CDF rows are offset by their row index and flattened into one sorted array, so a
    single ``searchsorted`` serves all rows.  Rows with zero total are never requested
    (they have no edges) and get a uniform table to keep the array sorted.
    """
    num_rows, width = weights.shape
    total = weights.sum(1, keepdim=True)
    empty = total <= 0
    probs = torch.where(empty, 1.0 / width, weights / torch.where(empty, 1.0, total))
    cdf = probs.cumsum(1).clamp_(max=1.0)
    cdf[:, -1] = 1.0
    # last column with positive mass: guards against g + u rounding up to g + 1
    positive = probs > 0
    last = width - 1 - positive.flip(1).to(torch.int8).argmax(1)
    offsets = torch.arange(num_rows, device=weights.device, dtype=torch.float64)
    cdf += offsets[:, None]
    u = torch.rand(row.numel(), generator=generator, device=weights.device, dtype=torch.float64)
    u += row
    flat = torch.searchsorted(cdf.reshape(-1), u, right=True)
    del u
    col = flat - row * width
    return torch.minimum(col, last[row])


def _sample_blocked(
    membership: torch.Tensor,
    group: torch.Tensor,
    cluster: torch.Tensor,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Draw node ``i ~ membership[g, :, a] / colsum`` for every edge ``(g, a)``.

    ``group`` is sorted (edges come grouped), so blocks of groups map to contiguous
    slices of edges; each block builds one ``[groups * k, nodes]`` CDF table.
    """
    num_groups, nodes, kc = membership.shape
    out = torch.empty_like(group)
    per_block = max(1, _CDF_BLOCK_ENTRIES // max(1, nodes * kc))
    firsts = list(range(0, num_groups, per_block)) + [num_groups]
    starts = torch.searchsorted(group, torch.tensor(firsts, device=group.device)).tolist()
    bounds = [(firsts[i], firsts[i + 1], starts[i], starts[i + 1]) for i in range(len(firsts) - 1)]
    for g0, g1, e0, e1 in bounds:
        if e1 == e0:
            continue
        table = membership[g0:g1].transpose(1, 2).reshape((g1 - g0) * kc, nodes)
        row = (group[e0:e1] - g0) * kc + cluster[e0:e1]
        out[e0:e1] = _sample_rows(table, row, generator)
    return out


# ---------------------------------------------------------------------------------------
# straight-through estimator and the attention head
# ---------------------------------------------------------------------------------------
class _StraightThroughMask(torch.autograd.Function):
    """Forward: ones on the sampled edges.  Backward: ``hardtanh`` of the incoming edge
    gradient, routed to ``P_e = <(Qhat S)_i, Khat_j>`` without ever evaluating ``P``."""

    @staticmethod
    def forward(ctx, qs, km, group, query, key, chunk_size):
        ctx.save_for_backward(qs, km, group, query, key)
        ctx.chunk_size = chunk_size
        return torch.ones(group.numel(), dtype=qs.dtype, device=qs.device)

    @staticmethod
    def backward(ctx, grad_mask):
        qs, km, group, query, key = ctx.saved_tensors
        grad_p = torch.nn.functional.hardtanh(grad_mask)
        grad_qs, grad_km = _edge_pair_grads(
            qs,
            km,
            group,
            query,
            key,
            grad_p,
            ctx.chunk_size,
            need_x=ctx.needs_input_grad[0],
            need_y=ctx.needs_input_grad[1],
        )
        return grad_qs, grad_km, None, None, None, None


def straight_through_mask(
    q_membership: torch.Tensor,
    s: torch.Tensor,
    k_membership: torch.Tensor,
    edges: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The sampled mask ``A`` on its edges (all ones) with the straight-through backward.

    Forward returns ``ones(E)``.  Backward maps the gradient ``grad_A`` on the sampled
    edges to ``grad_P = hardtanh(A * grad_A)`` and back-propagates it through
    ``P_ij = (Qhat S)_i . Khat_j`` to the memberships and ``s``, as the paper's STE does;
    entries of ``P`` that were not sampled receive no gradient.

    Complexity: ``O(E k)`` time in backward, ``O(E + (n + m) k)`` memory.
    """
    qm, sg, km, _ = _groups(q_membership, s, k_membership)
    group, query, key = _check_edges(edges, qm.shape[0], qm.shape[1], km.shape[1], qm.device)
    qs = qm @ sg.to(qm.dtype)
    return _StraightThroughMask.apply(qs, km, group, query, key, chunk_size)


class SBMAttention(nn.Module):
    """One SBM-Transformer attention layer over ``num_heads`` heads (the full head).

    Holds the cluster embeddings ``[H, k, d]`` and the shared MLP; :meth:`forward`
    computes memberships (:func:`sbm_parameters`), samples ``A`` with
    :func:`fastrg_sample`, attends on the sampled edges (:func:`edge_attention`) and
    back-propagates through the sampling with the straight-through estimator
    (:func:`straight_through_mask`).

    Parameters
    ----------
    head_dim : head size ``d``.
    num_heads : ``H``.
    num_clusters : ``k`` (128 in the paper's LRA runs).
    duplicates, self_loops : forwarded to :func:`fastrg_sample`.  With ``self_loops``
        the forced loops are part of ``A`` and the STE passes gradient through them too.
    chunk_size : edges per chunk in :func:`edge_attention` (None: automatic).
    device, dtype : for the parameters.

    Complexity
    ----------
    ``O(E (d + k) + (n + m) k d)`` time and ``O(E + (n + m)(d + k))`` memory per head, for
    ``E`` sampled edges; no ``n x m`` tensor is formed.
    """

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        num_clusters: int,
        *,
        duplicates: str = "merge",
        self_loops: bool = False,
        chunk_size: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        for name, val in (
            ("head_dim", head_dim),
            ("num_heads", num_heads),
            ("num_clusters", num_clusters),
        ):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name}: expected a positive int, got {val!r}")
        if duplicates not in DUPLICATE_POLICIES:
            raise ValueError(
                f"duplicates: expected one of {DUPLICATE_POLICIES}, got {duplicates!r}"
            )
        factory = {"device": device, "dtype": dtype}
        self.head_dim, self.num_heads, self.num_clusters = head_dim, num_heads, num_clusters
        self.duplicates, self.self_loops, self.chunk_size = duplicates, self_loops, chunk_size
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
        generator: torch.Generator | None = None,
        return_edges: bool = False,
    ):
        """Attend ``q`` ``[B, H, n, d]`` to ``k``/``v`` ``[B, H, m, d]`` on a sampled graph.

        Returns
        -------
        out : ``[B, H, n, d_v]``; a query with no sampled edge gets a zero row.
        density : ``[B, H]``, realised density ``edges / (n m)`` per head, differentiable
            through the straight-through estimator (feed it to :func:`density_regularizer`).
        edges : ``(group, query, key)``, only if ``return_edges``.
        """
        if q.dim() != 4 or q.shape[1] != self.num_heads or q.shape[-1] != self.head_dim:
            raise ValueError(
                f"q: expected [B, {self.num_heads}, n, {self.head_dim}], got {tuple(q.shape)}"
            )
        q_membership, s, k_membership = sbm_parameters(q, k, self.cluster_embeddings, self.mlp)
        edges = fastrg_sample(
            q_membership.detach(),
            s.detach(),
            k_membership.detach(),
            generator,
            duplicates=self.duplicates,
            self_loops=self.self_loops,
        )
        mask = straight_through_mask(
            q_membership, s, k_membership, edges, chunk_size=self.chunk_size
        )
        out = edge_attention(q, k, v, edges, edge_weight=mask, chunk_size=self.chunk_size)
        batch, heads, n = q.shape[:3]
        m = k.shape[2]
        per_group = torch.zeros(batch * heads, dtype=mask.dtype, device=mask.device)
        per_group = per_group.index_add(0, edges[0], mask)
        density = (per_group / (n * m)).reshape(batch, heads)
        if return_edges:
            return out, density, edges
        return out, density


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


# ---------------------------------------------------------------------------------------
# validation helpers
# ---------------------------------------------------------------------------------------
def _check_float(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {t.dtype}")


def _groups(q_membership, s, k_membership):
    """Flatten one group or a batch of groups to ``[G, n, k]``, ``[G, k, k]``, ``[G, m, k]``."""
    for name, t in (("q_membership", q_membership), ("s", s), ("k_membership", k_membership)):
        _check_float(name, t)
    qm, km = q_membership, k_membership
    if qm.dim() == 2:
        if km.dim() != 2 or s.dim() != 2:
            raise ValueError(
                f"q_membership, s, k_membership: one group needs [n, k], [k, k], [m, k], got "
                f"{tuple(qm.shape)}, {tuple(s.shape)}, {tuple(km.shape)}"
            )
        batch_shape: tuple[int, ...] = ()
        qm, sg, km = qm[None], s[None], km[None]
    elif qm.dim() == 4:
        if km.dim() != 4 or km.shape[:2] != qm.shape[:2]:
            raise ValueError(
                f"k_membership: expected [B, H, m, k] = [{qm.shape[0]}, {qm.shape[1]}, m, k], "
                f"got {tuple(km.shape)}"
            )
        batch_shape = tuple(qm.shape[:2])
        if s.dim() == 3 and s.shape[0] == qm.shape[1]:
            sg = s.expand(qm.shape[0], *s.shape)
        elif s.dim() == 4 and s.shape[:2] == qm.shape[:2]:
            sg = s
        else:
            raise ValueError(
                f"s: expected [H, k, k] or [B, H, k, k] with B={qm.shape[0]}, H={qm.shape[1]}, "
                f"got {tuple(s.shape)}"
            )
        qm = qm.reshape(-1, *qm.shape[2:])
        km = km.reshape(-1, *km.shape[2:])
        sg = sg.reshape(-1, *sg.shape[2:])
    else:
        raise ValueError(
            f"q_membership: expected [n, k] or [B, H, n, k], got shape {tuple(qm.shape)}"
        )
    kc = qm.shape[-1]
    if kc == 0 or km.shape[-1] != kc or sg.shape[-2:] != (kc, kc):
        raise ValueError(
            f"q_membership, s, k_membership: cluster counts disagree or are zero: "
            f"{tuple(q_membership.shape)}, {tuple(s.shape)}, {tuple(k_membership.shape)}"
        )
    if qm.shape[1] == 0 or km.shape[1] == 0:
        raise ValueError(
            f"q_membership, k_membership: empty sequence, got {tuple(q_membership.shape)} "
            f"and {tuple(k_membership.shape)}"
        )
    if not (qm.device == sg.device == km.device):
        raise ValueError("q_membership, s, k_membership: expected tensors on one device")
    return qm, sg, km, batch_shape
