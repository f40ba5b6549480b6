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
(:func:`companion.sbm.graph_attention.edge_attention`), and the sampling step is
back-propagated with the straight-through estimator ``grad_P = hardtanh(A * grad_A)``.

Sampling uses fastRG (Rohe et al., 2018): ``P`` is never formed; the number of edges is
Poisson with mean ``sum(P)``, and each edge draws a cluster pair and then its two
endpoints (drawn here in query-major order, see :func:`fastrg_sample`).  Time
``O(edges + (n + m) k + n k^2)`` (expected, keys by rejection; the last term is one
GEMM, ``Qhat S``) and memory ``O(edges + (n + m) k + k^2)`` per head.

Public API: :func:`sbm_parameters`, :func:`edge_probabilities`, :func:`fastrg_sample`,
:func:`companion.sbm.graph_attention.edge_attention` (re-exported here), :class:`SBMAttention`,
:func:`density_regularizer`, :func:`companion.sbm.graph_attention.dense_masked_attention`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from companion.sbm.graph_attention import (
    EdgeGraph,
    attention_on_graph,
    stable_argsort,
    dense_masked_attention,
    edge_attention,
)

__all__ = [
    "sbm_parameters",
    "edge_probabilities",
    "fastrg_sample",
    "edge_attention",
    "SBMAttention",
    "density_regularizer",
    "dense_masked_attention",
    "DUPLICATE_POLICIES",
    "FastRGTuning",
]

DUPLICATE_POLICIES = ("merge", "keep")
KEY_DRAWS = ("auto", "rejection", "search")
CPU_UNIFORM_SOURCES = ("numpy", "torch")


@dataclass(frozen=True)
class FastRGTuning:
    """Speed and memory knobs of :func:`fastrg_sample`; none changes the distribution.

    For a fixed seed the graph depends on the tuning (the uniforms are consumed in a
    different order), but every tuning samples the same law ``A ~ Poisson(P)``.

    Parameters
    ----------
    table_block_entries : int >= 1
        Groups are processed in blocks whose key tables (``groups x clusters x m``
        entries) stay below this size (at least one group per block).
    draw_block : int >= 1
        About this many edges get their keys drawn per step (bounded scratch memory).
    key_draw : ``"auto"`` (default), ``"rejection"`` or ``"search"``
        How keys are drawn.  ``"rejection"``: propose uniformly, accept with probability
        ``Khat_jb / max_j Khat_jb`` (exact, expected ``max / mean`` proposals per edge);
        ``"search"``: inverse-CDF search; ``"auto"``: rejection for a block of groups
        when every key cluster in it accepts at least ``min_acceptance`` of the
        proposals, else search.
    min_acceptance : float in ``[0, 1]``
        The ``"auto"`` threshold (default 1/8).
    cpu_uniforms : ``"numpy"`` (default) or ``"torch"``
        On CPU, uniforms and index compaction from numpy's PCG64 (seeded by the torch
        generator; several times faster) or from torch's generator and kernels (the path
        CUDA always takes).
    """

    table_block_entries: int = 1 << 22
    draw_block: int = 1 << 18
    key_draw: str = "auto"
    min_acceptance: float = 1 / 8
    cpu_uniforms: str = "numpy"

    def __post_init__(self):
        for name in ("table_block_entries", "draw_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.key_draw not in KEY_DRAWS:
            raise ValueError(f"key_draw: expected one of {KEY_DRAWS}, got {self.key_draw!r}")
        accept = self.min_acceptance
        if not isinstance(accept, (int, float)) or isinstance(accept, bool) or not 0 <= accept <= 1:
            raise ValueError(f"min_acceptance: expected a float in [0, 1], got {accept!r}")
        if self.cpu_uniforms not in CPU_UNIFORM_SOURCES:
            raise ValueError(
                f"cpu_uniforms: expected one of {CPU_UNIFORM_SOURCES}, got {self.cpu_uniforms!r}"
            )


DEFAULT_TUNING = FastRGTuning()


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
    duplicates: str = "keep",
    self_loops: bool = False,
    tuning: FastRGTuning = DEFAULT_TUNING,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample the bipartite graph ``A ~ Qhat S Khat^T`` with fastRG, as an edge list.

    fastRG (Rohe et al., 2018) draws ``E ~ Poisson(sum P)`` edges, each with a cluster
    pair ``(a, b) ~ S~ / sum S~`` (``S~ = diag(colsum Qhat) S diag(colsum Khat)``) and
    endpoints ``i ~ Qhat[:, a] / colsum``, ``j ~ Khat[:, b] / colsum``: a Poisson process
    on ``(i, a, b, j)`` with intensity ``Qhat_ia S_ab Khat_jb``, whose edge counts
    ``N_ij`` are independent Poisson(``P_ij``).  We draw the same process in
    query-major order, so that edges come out sorted by ``(group, query)`` (the CSR
    order :func:`edge_attention` works in) without a sort:

    1. Poisson splitting over ``(i, b)`` with ``a`` summed out: the edges whose query is
       ``i`` and whose key cluster is ``b`` number ``N_ib ~ Poisson((Qhat S)_ib
       colsum_b(Khat))``, independently (``sum N_ib ~ Poisson(sum P)``, and given the
       total the edges are i.i.d. with ``(i, b)`` distributed as in fastRG);
    2. each such edge draws its key ``j ~ Khat[:, b] / colsum_b(Khat)``.

    Then ``Pr[edge = (i, j)] = sum_ab Qhat_ia S_ab Khat_jb / sum P = P_ij / sum P``, as in
    fastRG.  Step 2 is batched over all edges of all groups; no ``n x m`` tensor is ever
    formed.  Each key is drawn by rejection from the uniform proposal (propose ``j``
    uniformly, accept with probability ``Khat_jb / max_j Khat_jb``: exact, nothing to
    search, about two look-ups per edge for sigmoid memberships) when every key cluster
    of a block of groups accepts at least 1/8 of the proposals; otherwise (skewed
    clusters) by an inverse-CDF search over the cumulative sums of ``Khat[:, b]``
    (``tuning`` can force either).  On CPU the uniforms come from numpy's PCG64 seeded
    by the torch generator (see :class:`_RandomSource`): the same seed (and tuning)
    gives the same graph.  The inputs are only read, never written.

    Parameters
    ----------
    q_membership : ``[n, k]`` or ``[B, H, n, k]``, nonnegative and finite.
    s : ``[k, k]`` (one group), or ``[H, k, k]`` / ``[B, H, k, k]`` (batch), nonnegative.
    k_membership : ``[m, k]`` or ``[B, H, m, k]``, nonnegative and finite.
    generator : optional ``torch.Generator`` on the memberships' device.
    duplicates : ``"keep"`` (default) or ``"merge"``.
        ``"keep"`` returns the Poisson multigraph as drawn: a pair drawn ``c`` times
        appears ``c`` times, ``E[count_ij] = P_ij`` exactly, and attention weighs that
        key ``c`` times (duplicates are rare where ``P`` is small: ``Pr[c >= 2] <=
        P_ij^2 / 2``).  ``"merge"`` keeps one copy of each drawn pair, so ``A`` is a 0/1
        mask with ``Pr[A_ij = 1] = 1 - exp(-P_ij)`` (the simple-graph fastRG), at the
        price of a linear-time radix sort; edges come sorted by ``(group, query, key)``.
    self_loops : if True (requires ``n == m``), every query ``i`` also gets the edge
        ``(i, i)`` (once, appended in order), so no query is left without an edge.  If
        False (default) a query may get no edge; :func:`edge_attention` then returns a
        zero output row for it.
    tuning : :class:`FastRGTuning`, optional
        Block sizes, the key-draw method and the CPU uniform source (speed and memory
        only: every tuning samples the same distribution).

    Returns
    -------
    group, query, key : int64 tensors of equal length ``E``, one entry per edge, on the
        memberships' device, sorted by ``(group, query)``.  ``group`` is the flat index
        ``b * H + h`` (0 for one group).

    Raises
    ------
    ValueError
        On shape mismatches, empty sequences, negative/NaN/infinite entries, an unknown
        ``duplicates`` policy, or ``self_loops`` with ``n != m``.
    TypeError
        Non-floating memberships, a ``tuning`` that is not a :class:`FastRGTuning`, a
        ``generator`` that is not a ``torch.Generator``, a non-bool ``self_loops``.

    Complexity
    ----------
    Time ``O(E + G (n + m) k + G n k^2)`` in expectation with rejection (``O(E log(m k))``
    with the search fallback; the last term is one GEMM, ``Qhat S``),
    memory ``O(E + G (n + m) k + G k^2)`` for ``G`` groups and ``E`` edges.
    """
    if duplicates not in DUPLICATE_POLICIES:
        raise ValueError(f"duplicates: expected one of {DUPLICATE_POLICIES}, got {duplicates!r}")
    if not isinstance(tuning, FastRGTuning):
        raise TypeError(f"tuning: expected a FastRGTuning, got {type(tuning).__name__}")
    if not isinstance(self_loops, bool):
        raise TypeError(
            f"self_loops: expected a bool, got {self_loops!r} ({type(self_loops).__name__})"
        )
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator: expected a torch.Generator or None, got {generator!r} "
            f"({type(generator).__name__})"
        )
    qm, sg, km, _ = _groups(q_membership, s, k_membership)
    for name, t in (("q_membership", qm), ("s", sg), ("k_membership", km)):
        # one pass: min and max are NaN if any entry is, and the comparisons then fail
        lo, hi = (float(x) for x in torch.aminmax(t.detach()))
        if not (lo >= 0 and hi < math.inf):
            raise ValueError(
                f"{name}: expected nonnegative finite entries (found negative, NaN or inf)"
            )
    num_groups, n, kc = qm.shape
    m = km.shape[1]
    if self_loops and n != m:
        raise ValueError(f"self_loops: requires as many queries as keys, got n={n}, m={m}")
    device = qm.device

    with torch.no_grad():
        # views of the caller's tensors (and, for float64 input, every ``.to(float64)``
        # below is one too): nothing derived from them may be written in place
        qm, km, sg = qm.detach(), km.detach(), sg.detach()
        work = torch.promote_types(qm.dtype, torch.float32)
        k_mass = km.sum(1, dtype=torch.float64)  # colsum Khat, [G, k]
        # expected number of edges with query i whose key comes from cluster b:
        # sum_a Qhat_ia S_ab colsum_b(Khat), one GEMM in the inputs' precision, then
        # float64 for the Poisson rates (no float64 copy of the memberships is kept)
        q_weight = torch.bmm(qm.to(work), sg.to(work)).to(torch.float64)
        q_weight.mul_(k_mass[:, None, :])  # [G, n, k]
        if not bool(torch.isfinite(q_weight.sum()).all()):
            raise ValueError("q_membership, s, k_membership: the expected edge count overflows")
        # Poisson splitting: the edges of each (query, key cluster) cell are independent
        # Poisson counts; enumerating the cells in order sorts edges by (group, query, b).
        draws = _RandomSource(device, generator, tuning.cpu_uniforms)
        counts = draws.poisson(q_weight.reshape(-1))
        del q_weight
        ends = torch.cumsum(counts, 0)  # edges of cell c are ends[c] - counts[c] .. ends[c]
        num_edges = int(ends[-1])
        # cells are ordered (group, query, b), so are the edges: group and query of every
        # edge follow from the per-query edge counts
        row_counts = counts.view(num_groups * n, kc).sum(1)
        group = torch.repeat_interleave(
            torch.arange(num_groups, device=device),
            row_counts.view(num_groups, n).sum(1),
            output_size=num_edges,
        )
        query = torch.arange(n, device=device).repeat(num_groups)
        query = query.repeat_interleave(row_counts, output_size=num_edges)
        del row_counts
        key = torch.empty_like(group)
        # step 2 in blocks of cells (bounded scratch) within blocks of groups (bounded
        # tables): keys by rejection from the uniform proposal where it accepts often
        # enough (a table of acceptance probabilities, one look-up per proposal), else by
        # inverse-CDF search
        cells_per_group = n * kc
        per_block = max(1, tuning.table_block_entries // (m * kc))
        cells_per_step = max(kc, tuning.draw_block * counts.numel() // max(num_edges, 1))
        for g0 in range(0, num_groups, per_block):
            g1 = min(g0 + per_block, num_groups)
            accept = cdf = last = cell_base = None
            for c0 in range(g0 * cells_per_group, g1 * cells_per_group, cells_per_step):
                c1 = min(c0 + cells_per_step, g1 * cells_per_group)
                e0, e1 = int(ends[c0] - counts[c0]), int(ends[c1 - 1])
                if e1 == e0:
                    continue
                if cell_base is None:
                    # a view of k_membership whenever the block holds one group (the
                    # size-1 dim lets reshape skip the copy): read only
                    weights = km[g0:g1].transpose(1, 2).reshape((g1 - g0) * kc, m)
                    row_max = weights.amax(1).to(torch.float64)
                    used = row_max > 0  # rows without mass are never asked for
                    if tuning.key_draw == "auto":
                        row_mean = weights.sum(1, dtype=torch.float64) / m
                        acceptance = row_mean[used] / row_max[used]
                        search = bool(acceptance.numel()) and bool(
                            acceptance.min() < tuning.min_acceptance
                        )
                        del row_mean, acceptance
                    else:
                        search = tuning.key_draw == "search"
                    if search:
                        cdf, last = _cdf_table(weights)
                    else:
                        # acceptance probability of key j in row r: weight / row max
                        # (float64: the coin is compared exactly); unused rows get 0.
                        # Out of place: for float64 input ``weights.to(float64)`` is the
                        # caller's k_membership itself, which an in-place division
                        # would scale up (too many edges in this and later calls)
                        accept = torch.div(
                            weights.to(torch.float64), torch.where(used, row_max, 1.0)[:, None]
                        ).reshape(-1)
                    del weights, row_max, used
                    # offset of table row (group - g0) * kc + b in the flat table, for
                    # every cell (group, query, b) of the block: one pass per block
                    rows = torch.arange(g1 - g0, device=device)[:, None, None] * kc
                    rows = rows + torch.arange(kc, device=device)
                    cell_base = rows.mul_(m).expand(g1 - g0, n, kc).reshape(-1)
                    del rows
                local = slice(c0 - g0 * cells_per_group, c1 - g0 * cells_per_group)
                base = cell_base[local].repeat_interleave(counts[c0:c1], output_size=e1 - e0)
                if cdf is None:
                    key[e0:e1] = _rejection_draw(accept, m, base, draws)
                else:
                    key[e0:e1] = _search_rows(cdf, last, base, draws)
                del base
            del accept, cdf, last, cell_base
        del counts, ends

        if self_loops:
            group, query, key = _append_self_loops(group, query, key, num_groups, n)
        if duplicates == "merge" and group.numel() > 1:
            code = (group * n + query) * m + key
            code = code[stable_argsort(code, num_groups * n * m)]
            code = torch.unique_consecutive(code)
            key = code % m
            code = torch.div(code, m, rounding_mode="floor")
            query = code % n
            group = torch.div(code, n, rounding_mode="floor")
    return group, query, key


class _RandomSource:
    """Uniforms, Poisson counts and index compaction for the sampler, on one device.

    On CPU with ``cpu_uniforms="numpy"`` (the default of :class:`FastRGTuning`) the
    uniforms come from numpy's PCG64, seeded by one 63-bit draw from the caller's
    ``torch.Generator`` (or torch's global one), so a graph stays reproducible from the
    torch seed; here numpy's generator is about three times faster than torch's CPU
    Mersenne Twister, and ``np.flatnonzero`` about nine times faster than
    ``torch.nonzero``, the two costs that dominated the key draws.  Otherwise (CUDA, or
    ``cpu_uniforms="torch"``) torch's own generator and kernels are used.
    """

    def __init__(self, device: torch.device, generator: torch.Generator | None, cpu_uniforms: str):
        self.device, self.generator = device, generator
        self.rng = None
        if device.type == "cpu" and cpu_uniforms == "numpy":
            seed = int(torch.randint(0, 2**63 - 1, (1,), generator=generator))
            self.rng = np.random.Generator(np.random.PCG64(seed))

    def uniform(self, size: int) -> torch.Tensor:
        """``size`` float64 uniforms in ``[0, 1)``."""
        if self.rng is not None:
            return torch.from_numpy(self.rng.random(size))
        return torch.rand(size, generator=self.generator, device=self.device, dtype=torch.float64)

    def nonzero(self, mask: torch.Tensor) -> torch.Tensor:
        """Indices of the true entries of a 1-D bool tensor, as int64."""
        if self.rng is not None:
            return torch.from_numpy(np.flatnonzero(mask.numpy()))
        return torch.nonzero(mask).squeeze(1)

    def poisson(self, rates: torch.Tensor) -> torch.Tensor:
        """Independent ``Poisson(rates)`` counts (int64) for a 1-D float64 tensor.

        torch's sampler on every device: a vectorised inversion with numpy's uniforms was
        no faster here for the small rates fastRG's cells have."""
        return torch.poisson(rates, generator=self.generator).to(torch.int64)


def _append_self_loops(group, query, key, num_groups, n):
    """Insert the edge ``(g, i, i)`` after the sampled edges of every query, keeping the
    ``(group, query)`` order."""
    device = group.device
    loops = torch.arange(num_groups * n, device=device)
    row = torch.cat([group * n + query, loops])
    order = stable_argsort(row, num_groups * n)
    group = torch.cat([group, torch.div(loops, n, rounding_mode="floor")])[order]
    query = torch.cat([query, loops % n])[order]
    key = torch.cat([key, loops % n])[order]
    return group, query, key


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
    previous one, so the table is walked once) and the answers put back in draw order:
    several times faster here than torch's random-order search.
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
    accept: torch.Tensor, width: int, base: torch.Tensor, draws: _RandomSource
) -> torch.Tensor:
    """Draw one column per entry of ``base`` by rejection from the uniform proposal.

    Row ``r`` of the flat table ``accept`` (``[rows * width]``, float64) holds
    ``weight[r, c] / max_c weight[r, c]``; ``base`` holds ``r * width`` for every draw.
    Propose ``c`` uniformly and accept with probability ``accept[r, c]``; rejected draws
    are proposed again, so ``Pr[c] = weight[r, c] / sum_c weight[r, c]`` exactly.  One
    look-up per proposal and no table to search, expected ``max / mean`` proposals per
    draw (about two for sigmoid memberships; with ``key_draw="auto"`` the caller bounds it
    by falling back to :func:`_search_rows` for skewed rows)."""
    out = torch.empty(base.numel(), dtype=torch.int64, device=base.device)
    pending = None  # indices into out still to draw (None: all of them)
    while base.numel():
        # one float64 uniform gives the column (integer part of x) and the coin
        # (fractional part: 53 - log2(width) random bits)
        x = draws.uniform(base.numel())
        x.mul_(width)
        col = x.to(torch.int64).clamp_(max=width - 1)
        coin = x.sub_(col)
        rejected = draws.nonzero(coin >= accept.take(col + base))
        del x, coin
        # write every proposal; the rejected ones are overwritten in a later round
        if pending is None:
            out.copy_(col)
            pending = rejected
        else:
            out.index_copy_(0, pending, col)
            pending = pending.index_select(0, rejected)
        base = base.index_select(0, rejected)
    return out


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
            grad_km = graph.matrix_t(grad_p) @ qs2
        return grad_qs, grad_km, None


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
    device, dtype : for the parameters.

    Complexity
    ----------
    ``O(E (d + k) + (n + m) k (d + k))`` time and ``O(E + (n + m)(d + k))`` memory per
    head for ``E`` sampled edges; no ``n x m`` tensor is formed.
    """

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        num_clusters: int,
        *,
        duplicates: str = "keep",
        self_loops: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        sizes = (("head_dim", head_dim), ("num_heads", num_heads), ("num_clusters", num_clusters))
        for name, val in sizes:
            if not isinstance(val, int) or isinstance(val, bool):
                raise TypeError(f"{name}: expected a positive int, got {val!r}")
            if val < 1:
                raise ValueError(f"{name}: expected a positive int, got {val!r}")
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
        edges : ``(group, query, key)``, only if ``return_edges``.
        """
        if q.dim() != 4 or q.shape[1] != self.num_heads or q.shape[-1] != self.head_dim:
            raise ValueError(
                f"q: expected [B, {self.num_heads}, n, {self.head_dim}], got {tuple(q.shape)}"
            )
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
        edges = fastrg_sample(
            q_membership.detach(),
            s.detach(),
            k_membership.detach(),
            generator,
            duplicates=self.duplicates,
            self_loops=self.self_loops,
        )
        batch, heads, n = q.shape[:3]
        m = k.shape[2]
        num_groups = batch * heads
        if self.self_loops and (query_valid is not None or key_valid is not None):
            group, query, key = edges
            element = torch.div(group, heads, rounding_mode="floor")  # batch index
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
        qs = q_membership @ s  # [B, H, n, k]
        mask = _StraightThroughMask.apply(
            qs.reshape(num_groups * n, -1), k_membership.reshape(num_groups * m, -1), graph
        )
        if v.shape[:3] != (batch, heads, m):
            raise ValueError(f"v: expected [{batch}, {heads}, {m}, d_v], got {tuple(v.shape)}")
        out = attention_on_graph(
            q.reshape(num_groups * n, -1),
            k.reshape(num_groups * m, -1),
            v.reshape(num_groups * m, -1),
            graph,
            mask,
            1.0 / math.sqrt(self.head_dim),
        ).reshape(batch, heads, n, -1)
        per_group = torch.zeros(num_groups, dtype=mask.dtype, device=mask.device)
        per_group = per_group.index_add(0, edges[0], mask)
        pairs = (valid_counts[0] * valid_counts[1]).clamp(min=1).to(mask.dtype)  # [B]
        density = per_group.reshape(batch, heads) / pairs[:, None]
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
    if t.device.type == "meta":  # no values to validate or sample from
        raise ValueError(f"{name}: expected a tensor with values, got one on the meta device")


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
