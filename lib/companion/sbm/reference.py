"""The SBM-Transformer's equations written densely: the reference the fast paths equal.

Definition
----------
For one head (or a batch of heads, leading dims broadcast) with memberships ``Qhat``
``[n, k]``, ``Khat`` ``[m, k]`` and block matrix ``S`` ``[k, k]``:

* :func:`dense_edge_probabilities`: ``P_ij = sum_ab Qhat_ia S_ab Khat_jb``;
* :func:`poisson_edge_counts`: ``A_ij ~ Poisson(P_ij)``, independently (the law fastRG
  samples without forming ``P``);
* :func:`dense_edge_counts`: the ``[G, n, m]`` count matrix of an edge list;
* :func:`dense_masked_attention`: ``softmax(q k^T / sqrt(d))`` masked by ``A`` and
  renormalised per row, times ``v`` (zero rows where the mask is empty).

Everything here forms ``n x m`` tensors: ``O(n m k)`` time, for tests and small ``n``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["dense_edge_probabilities", "poisson_edge_counts", "dense_edge_counts",
           "dense_masked_attention"]


def dense_edge_probabilities(q_membership: torch.Tensor, s: torch.Tensor,
                             k_membership: torch.Tensor) -> torch.Tensor:
    """``P = Qhat S Khat^T``: ``[..., n, k]``, ``[..., k, k]``, ``[..., m, k]`` to
    ``[..., n, m]`` (leading dims broadcast).

    >>> dense_edge_probabilities(torch.ones(2, 1), torch.full((1, 1), 0.5), torch.ones(3, 1))
    tensor([[0.5000, 0.5000, 0.5000],
            [0.5000, 0.5000, 0.5000]])
    """
    return torch.einsum("...ia,...ab,...jb->...ij", q_membership, s, k_membership)


def poisson_edge_counts(p: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``A_ij ~ Poisson(P_ij)``, every entry independent (int64, the shape of ``p``).

    >>> poisson_edge_counts(torch.zeros(2, 3)).sum().item()
    0
    """
    return torch.poisson(p.to(torch.float64), generator=generator).to(torch.int64)


def dense_edge_counts(edges: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                      num_groups: int, n: int, m: int) -> torch.Tensor:
    """``A[g, i, j]`` = how many times the edge list ``(group, query, key)`` holds
    ``(g, i, j)`` (int64, ``[num_groups, n, m]``).

    >>> e = torch.tensor([0, 0]), torch.tensor([1, 1]), torch.tensor([2, 2])
    >>> dense_edge_counts(e, 1, 2, 3)
    tensor([[[0, 0, 0],
             [0, 0, 2]]])
    """
    group, query, key = edges
    counts = torch.zeros(num_groups, n, m, dtype=torch.int64, device=group.device)
    counts.index_put_((group, query, key), torch.ones_like(group), accumulate=True)
    return counts


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

    Examples
    --------
    >>> q = k = v = torch.eye(2)
    >>> dense_masked_attention(q, k, v, torch.tensor([[True, False], [False, False]]))
    tensor([[1., 0.],
            [0., 0.]])

    References
    ----------
    .. [1] S. Cho, S. Min, J. Kim, M. Lee, H. Lee, S. Hong, "Transformers meet
       Stochastic Block Models: Attention with Data-Adaptive Sparsity and Cost", NeurIPS
       2022, arXiv:2210.15541, masked softmax attention on the sampled graph, dense, as
       the public code computes it (section not known here: the abstract and the
       authors' code).
    """
    scale = _check_dense_inputs(q, k, v, mask, scale)
    attn = torch.softmax((q @ k.transpose(-1, -2)) * scale, dim=-1)
    attn = attn * mask.to(attn.dtype)
    total = attn.sum(-1, keepdim=True)
    attn = attn / torch.where(total > 0, total, torch.ones_like(total))
    return attn @ v


def _check_dense_inputs(q, k, v, mask, scale) -> float:
    """Validate :func:`dense_masked_attention`'s arguments; return the score scale."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point torch.Tensor")
        if t.dim() < 2:
            raise ValueError(f"{name}: expected [..., length, dim], got shape {tuple(t.shape)}")
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
    return scale
