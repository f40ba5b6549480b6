"""fastRG sampling of the SBM attention graph (Rohe et al., 2018), as an edge list.

Definition
----------
Given memberships ``Qhat`` (``[n, k]``), ``Khat`` (``[m, k]``) and a block matrix ``S``
(``[k, k]``), all nonnegative, sample ``A ~ Poisson(P)`` with ``P = Qhat S Khat^T``
without forming ``P``: :func:`fastrg_sample` draws the edges in query-major order (see
its docstring), in time ``O(E + (n + m) k + n k^2)`` and memory ``O(E + (n + m) k + k^2)``
per group.  :func:`edge_probabilities` forms ``P`` densely (tests, small ``n``).

Every speed and memory knob is a field of :class:`FastRGTuning`, passed as an argument;
the module keeps no tuning state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from companion._validate import check_int, check_tensor
# the key draws and the Poisson counts live in modules of their own; their private names
# stay importable from here (the tests read them from companion.sbm.fastrg)
from companion.sbm.key_draws import (  # noqa: F401
    _cdf_table, _draw_keys, _KeyTable, _rejection_draw, _rejection_draw_numpy,
    _rejection_draw_torch, _search_rows)
from companion.sbm.poisson import (  # noqa: F401
    _INVERSION_BLOCK, _INVERSION_MAX_RATE, _invert_block, _poisson_by_inversion, _RandomSource)
from companion.sbm.tensor_ops import INDEX_DTYPES, repeat_each, stable_argsort, transposed_copy

__all__ = ["fastrg_sample", "poisson_pair_counts", "edge_probabilities", "FastRGTuning",
           "DUPLICATE_POLICIES", "use_pair_grid"]

DUPLICATE_POLICIES = ("merge", "keep")
KEY_DRAWS = ("auto", "rejection", "search")
CPU_UNIFORM_SOURCES = ("numpy", "torch")
CELL_GRIDS = ("auto", "clusters", "keys")
CPU_POISSON_SOURCES = ("inversion", "torch")


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
        generator; faster than torch's CPU generator, ``benchmarks/bench_sbm.py``) or
        from torch's generator and kernels (the path
        CUDA always takes).
    cpu_poisson : ``"inversion"`` (default) or ``"torch"``
        With ``cpu_uniforms="numpy"``: the Poisson counts by inversion of PCG64 uniforms
        (vectorised; rates above 16 from numpy's own Poisson sampler), or from
        ``torch.poisson`` on the torch generator (a serial loop on CPU; the source of the
        graphs before this option existed).  Ignored on the torch/CUDA path, which
        always uses ``torch.poisson``.
    cell_grid : ``"auto"`` (default), ``"clusters"`` or ``"keys"``
        The cells that get Poisson counts.  ``"clusters"``: fastRG's (query, key
        cluster) cells, then one key draw per edge; ``"keys"``: every (query, key) pair,
        ``N_ij ~ Poisson(P_ij)`` with ``P = (Qhat S) Khat^T`` formed per block of groups
        (no key draw, edges come sorted by ``(group, query, key)``; memory ``O(n m)``
        per block); ``"auto"``: keys when the batch has at most
        ``key_grid_max_entries`` pairs and at most ``key_grid_pairs_per_edge`` pairs per
        expected edge (so its memory stays linear in the edges), else clusters.
    key_grid_max_entries : int >= 0
        The ``"auto"`` bound on the pairs of the batch (default ``2**20``).
    key_grid_pairs_per_edge : float >= 0
        The ``"auto"`` bound on pairs per expected edge (default 8: density >= 1/8).

    Examples
    --------
    >>> FastRGTuning(cell_grid="keys").key_draw  # one field changed, the rest default
    'auto'
    """

    table_block_entries: int = 1 << 22
    draw_block: int = 1 << 18
    key_draw: str = "auto"
    min_acceptance: float = 1 / 8
    cpu_uniforms: str = "numpy"
    cpu_poisson: str = "inversion"
    cell_grid: str = "auto"
    key_grid_max_entries: int = 1 << 20
    key_grid_pairs_per_edge: float = 8.0

    def __post_init__(self):
        for name in ("table_block_entries", "draw_block"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("key_grid_max_entries", self.key_grid_max_entries, minimum=0)
        ratio = self.key_grid_pairs_per_edge
        if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not ratio >= 0:
            raise ValueError(f"key_grid_pairs_per_edge: expected a float >= 0, got {ratio!r}")
        for name, choices in (("cpu_poisson", CPU_POISSON_SOURCES), ("cell_grid", CELL_GRIDS)):
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"{name}: expected one of {choices}, got {getattr(self, name)!r}"
                )
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

    Examples
    --------
    >>> p = edge_probabilities(torch.ones(3, 2), torch.full((2, 2), 0.25), torch.ones(4, 2))
    >>> p.shape, float(p[0, 0])
    (torch.Size([3, 4]), 1.0)

    References
    ----------
    .. [1] S. Cho, S. Min, J. Kim, M. Lee, H. Lee, S. Hong, "Transformers meet
       Stochastic Block Models: Attention with Data-Adaptive Sparsity and Cost", NeurIPS
       2022, arXiv:2210.15541, the edge probabilities ``P = Qhat S Khat^T`` of the
       stochastic block model (section not known here: the abstract and the authors'
       code).
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
    q_times_s: torch.Tensor | None = None,
    index_dtype: torch.dtype = torch.int64,
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
    of a block of groups accepts at least ``tuning.min_acceptance`` of the proposals;
    otherwise (skewed clusters) by an inverse-CDF search over the cumulative sums of
    ``Khat[:, b]`` (``tuning`` can force either).  On CPU the uniforms come from numpy's
    PCG64 seeded by the torch generator (see :class:`_RandomSource`), and so do the
    Poisson counts (by inversion): the same seed (and tuning) gives the same graph.  For
    small dense graphs (``tuning.cell_grid``, :func:`use_pair_grid`) the counts are drawn
    per (query, key) pair instead, ``N_ij ~ Poisson(P_ij)`` from one GEMM forming ``P``
    (:func:`poisson_pair_counts`): the same law, no key draws, memory ``O(n m)`` (within
    a small factor of ``E`` there).  The inputs are only read, never written.

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
    q_times_s : optional ``Qhat S`` (the shape of ``q_membership``), when the caller has
        it already (the attention layer needs it for its gradient): the sampler then
        skips that GEMM.  Used only in the precision the sampler works in (float32 or
        wider, as ``q_membership``); it must equal ``q_membership @ s``, which is not
        checked.
    index_dtype : ``torch.int64`` (default) or ``torch.int32``
        The dtype of the returned indices.  int32 halves the memory of the edge list
        (three indices per edge) and is what :class:`companion.sbm.SBMAttention` uses;
        :func:`edge_attention` takes either.  The same seed gives the same edges in
        both.  Arithmetic on int32 indices stays in int32: ``group * n + query``
        overflows once ``G n`` reaches ``2**31``.

    Returns
    -------
    group, query, key : ``index_dtype`` tensors of equal length ``E``, one entry per edge,
        on the memberships' device, sorted by ``(group, query)``.  ``group`` is the flat
        index ``b * H + h`` (0 for one group).

    Raises
    ------
    ValueError
        On shape mismatches, empty sequences, negative/NaN/infinite entries, an unknown
        ``duplicates`` policy, ``self_loops`` with ``n != m``, or an ``index_dtype`` of
        int32 with a group, query or key count of ``2**31`` or more.
    TypeError
        Non-floating memberships, a ``tuning`` that is not a :class:`FastRGTuning`, a
        ``generator`` that is not a ``torch.Generator``, a non-bool ``self_loops``, an
        ``index_dtype`` other than ``torch.int32`` or ``torch.int64``.

    Complexity
    ----------
    Time ``O(E + G (n + m) k + G n k^2)`` in expectation with rejection (``O(E log(m k))``
    with the search fallback; the last term is one GEMM, ``Qhat S``),
    memory ``O(E + G (n + m) k + G k^2)`` for ``G`` groups and ``E`` edges.

    Examples
    --------
    >>> qm, km = torch.full((5, 2), 0.5), torch.full((7, 2), 0.5)
    >>> s = torch.full((2, 2), 0.25)
    >>> group, query, key = fastrg_sample(qm, s, km, torch.Generator().manual_seed(0))
    >>> bool((query[1:] >= query[:-1]).all()), int(key.max()) < 7
    (True, True)

    References
    ----------
    .. [1] S. Cho, S. Min, J. Kim, M. Lee, H. Lee, S. Hong, "Transformers meet
       Stochastic Block Models: Attention with Data-Adaptive Sparsity and Cost", NeurIPS
       2022, arXiv:2210.15541, each head's graph sampled from its stochastic block model
       by fastRG (section not known here: the abstract and the authors' code).
    .. [2] K. Rohe, J. Tao, X. Han, N. Binkiewicz, "A note on quickly sampling a sparse
       matrix with low rank expectation", JMLR 19 (2018): fastRG.
    """
    _check_options(duplicates, self_loops, generator, tuning)
    qm, sg, km, _, q_times_s = _checked_groups(q_membership, s, k_membership, q_times_s)
    num_groups, n, _ = qm.shape
    m = km.shape[1]
    if self_loops and n != m:
        raise ValueError(f"self_loops: requires as many queries as keys, got n={n}, m={m}")
    _check_index_dtype(index_dtype, max(num_groups, n, m))
    with torch.no_grad():
        # views of the caller's tensors: nothing derived from them is written in place
        qm, sg, km = qm.detach(), sg.detach(), km.detach()
        draws = _RandomSource(qm.device, generator, tuning.cpu_uniforms, tuning.cpu_poisson)
        q_times_s = _q_times_s(qm, sg, q_times_s)
        k_mass = km.sum(1, dtype=torch.float64)  # colsum Khat, [G, k]
        if _use_key_grid(q_times_s, k_mass, num_groups * n * m, tuning):
            group, query, key = _key_grid_edges(q_times_s, km, draws, duplicates, tuning,
                                                index_dtype)
            merged = duplicates == "merge"  # one edge per pair with a positive count
        else:
            # step 1: one Poisson count per cell (group, query, key cluster b); the cells
            # in this order sort the edges by (group, query, b)
            counts = draws.poisson(_cell_rates(q_times_s, k_mass).reshape(-1))
            group, query = _cell_owners(counts, num_groups, n, index_dtype)
            # step 2: the key of every edge, from its cell's key cluster
            key = _draw_keys(km, counts, n, draws, tuning, index_dtype)
            merged = False
        if self_loops:
            group, query, key = _append_self_loops(group, query, key, num_groups, n)
            merged = False
        if duplicates == "merge" and not merged:
            group, query, key = _merge_duplicates(group, query, key, num_groups, n, m)
    return group, query, key


def _check_index_dtype(index_dtype, largest: int) -> None:
    """``index_dtype`` is int32 or int64 and holds every index below ``largest``."""
    if index_dtype not in INDEX_DTYPES:
        raise TypeError(f"index_dtype: expected torch.int32 or torch.int64, got {index_dtype!r}")
    if largest > torch.iinfo(index_dtype).max:
        raise ValueError(f"index_dtype: {index_dtype} cannot hold indices up to {largest - 1}; "
                         f"use torch.int64")


def _checked_groups(q_membership, s, k_membership, q_times_s):
    """The inputs as ``[G, n, k]``, ``[G, k, k]``, ``[G, m, k]`` groups (and ``Qhat S``
    as ``[G, n, k]`` when given), checked: shapes, nonnegative finite entries."""
    qm, sg, km, batch_shape = _groups(q_membership, s, k_membership)
    if q_times_s is not None:
        if not isinstance(q_times_s, torch.Tensor) or q_times_s.shape != q_membership.shape:
            raise ValueError(
                f"q_times_s: expected a tensor of q_membership's shape "
                f"{tuple(q_membership.shape)}, got "
                f"{tuple(q_times_s.shape) if isinstance(q_times_s, torch.Tensor) else q_times_s}"
            )
        q_times_s = q_times_s.detach().reshape(qm.shape)
    for name, t in (("q_membership", qm), ("s", sg), ("k_membership", km)):
        # one pass: min and max are NaN if any entry is, and the comparisons then fail
        lo, hi = (float(x) for x in torch.aminmax(t.detach()))
        if not (lo >= 0 and hi < math.inf):
            raise ValueError(
                f"{name}: expected nonnegative finite entries (found negative, NaN or inf)"
            )
    return qm, sg, km, batch_shape, q_times_s


def poisson_pair_counts(
    q_membership: torch.Tensor,
    s: torch.Tensor,
    k_membership: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    tuning: FastRGTuning = DEFAULT_TUNING,
    q_times_s: torch.Tensor | None = None,
    dtype: torch.dtype = torch.int64,
) -> torch.Tensor:
    """``A ~ Poisson(P)`` as a dense count matrix: one count per (query, key) pair.

    The key grid of :func:`fastrg_sample` (``FastRGTuning.cell_grid="keys"``) without
    the edge list: for the same generator state and tuning, ``fastrg_sample(...,
    tuning=replace(tuning, cell_grid="keys"))`` returns exactly the pairs with a positive
    count here, each repeated by its count (``duplicates="keep"``).  For small or dense
    graphs, where ``n m`` is within a small factor of the expected edges; the other
    arguments are those of :func:`fastrg_sample`.

    Parameters
    ----------
    dtype : ``torch.int64`` (default) or a floating dtype: the same counts as numbers of
        that dtype (the weights :class:`companion.sbm.SBMAttention` attends with, without
        a conversion pass; rounded as converting the int64 counts would round them).

    Returns
    -------
    counts : ``[n, m]`` or ``[B, H, n, m]``, of ``dtype``.

    Complexity
    ----------
    Time and memory ``O(G n m + G n k^2)`` (one GEMM forms ``P`` per block of groups).

    Examples
    --------
    >>> qm, km = torch.full((5, 2), 0.5), torch.full((7, 2), 0.5)
    >>> counts = poisson_pair_counts(qm, torch.full((2, 2), 0.25), km,
    ...                              torch.Generator().manual_seed(0))
    >>> counts.shape, counts.dtype
    (torch.Size([5, 7]), torch.int64)
    """
    _check_options("keep", False, generator, tuning)
    if not isinstance(dtype, torch.dtype) or not (dtype == torch.int64
                                                  or dtype.is_floating_point):
        raise TypeError(f"dtype: expected torch.int64 or a floating dtype, got {dtype!r}")
    qm, sg, km, batch_shape, q_times_s = _checked_groups(
        q_membership, s, k_membership, q_times_s)
    num_groups, n, _ = qm.shape
    m = km.shape[1]
    with torch.no_grad():
        qm, sg, km = qm.detach(), sg.detach(), km.detach()
        draws = _RandomSource(qm.device, generator, tuning.cpu_uniforms, tuning.cpu_poisson)
        q_times_s = _q_times_s(qm, sg, q_times_s)
        blocks = list(_key_grid_blocks(q_times_s, km, draws, tuning, dtype))
        counts = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    return counts.reshape(*batch_shape, n, m)


def _check_options(duplicates, self_loops, generator, tuning) -> None:
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


def _q_times_s(qm: torch.Tensor, sg: torch.Tensor,
               q_times_s: torch.Tensor | None = None) -> torch.Tensor:
    """``Qhat S`` ``[G, n, k]`` in the sampler's precision (float32 or wider, as the
    memberships): the caller's when it is in that precision, else one GEMM."""
    work = torch.promote_types(qm.dtype, torch.float32)
    if q_times_s is None or q_times_s.dtype != work:
        q_times_s = torch.bmm(qm.to(work), sg.to(work))
    return q_times_s


def _cell_rates(q_times_s: torch.Tensor, k_mass: torch.Tensor) -> torch.Tensor:
    """``[G, n, k]`` float64: the expected number of edges with query ``i`` whose key
    comes from cluster ``b``, ``(Qhat S)_ib colsum_b(Khat)`` (float64 for the Poisson
    rates; no float64 copy of the memberships)."""
    # out of place: for float64 input ``.to(float64)`` is the caller's tensor itself
    rates = torch.mul(q_times_s.to(torch.float64), k_mass[:, None, :])
    if not bool(torch.isfinite(rates.sum()).all()):
        raise ValueError("q_membership, s, k_membership: the expected edge count overflows")
    return rates


def use_pair_grid(q_times_s: torch.Tensor, k_membership: torch.Tensor,
                  tuning: FastRGTuning = DEFAULT_TUNING) -> bool:
    """Whether :func:`fastrg_sample` with ``tuning`` counts edges per (query, key) pair
    (the key grid, :func:`poisson_pair_counts`) for memberships whose ``Qhat S`` is
    ``q_times_s`` (``[n, k]`` or ``[B, H, n, k]``) and keys ``k_membership``.

    >>> use_pair_grid(torch.full((5, 2), 0.25), torch.full((7, 2), 0.5))
    True
    """
    if q_times_s.dim() == 2:
        q_times_s, k_membership = q_times_s[None], k_membership[None]
    qs = q_times_s.reshape(-1, *q_times_s.shape[-2:])
    km = k_membership.reshape(-1, *k_membership.shape[-2:])
    pairs = qs.shape[0] * qs.shape[1] * km.shape[1]
    with torch.no_grad():
        return _use_key_grid(qs, km.sum(1, dtype=torch.float64), pairs, tuning)


def _use_key_grid(q_times_s: torch.Tensor, k_mass: torch.Tensor, pairs: int,
                  tuning: FastRGTuning) -> bool:
    """Whether to count edges per (query, key) pair (see ``FastRGTuning.cell_grid``)."""
    if tuning.cell_grid != "auto":
        return tuning.cell_grid == "keys"
    if pairs > tuning.key_grid_max_entries:
        return False
    # sum P = sum_b colsum_b(Qhat S) colsum_b(Khat), without forming P
    expected = float((q_times_s.sum(1, dtype=torch.float64) * k_mass).sum())
    return pairs <= tuning.key_grid_pairs_per_edge * expected


def _key_grid_blocks(q_times_s: torch.Tensor, km: torch.Tensor, draws: _RandomSource,
                     tuning: FastRGTuning, dtype: torch.dtype = torch.int64):
    """Per block of groups (``tuning.table_block_entries`` pairs, at least one group):
    the flat counts ``N_ij ~ Poisson(P_ij)`` (``dtype``) of its pairs in (group, query,
    key) order, with ``P = (Qhat S) Khat^T`` formed for that block only."""
    num_groups, n, _ = q_times_s.shape
    m = km.shape[1]
    groups_per_block = max(1, tuning.table_block_entries // (n * m))
    work = q_times_s.dtype
    for g0 in range(0, num_groups, groups_per_block):
        g1 = min(g0 + groups_per_block, num_groups)
        # a contiguous Khat^T: bmm with a transposed second operand was about twice as slow
        keys_t = transposed_copy(km[g0:g1].to(work))
        p = torch.bmm(q_times_s[g0:g1], keys_t).reshape(-1)
        # the rates stay in the GEMM's precision: the inversion reads them as float64
        # numbers (exactly) without a float64 copy of P
        if not _finite_sum(p):
            raise ValueError("q_membership, s, k_membership: the expected edge count overflows")
        yield draws.poisson(p, dtype)


def _finite_sum(p: torch.Tensor) -> bool:
    """Whether the float64 sum of the 1-D ``p`` is finite.  For float32 (or narrower)
    entries that is whether every entry is (fewer than ``2**800`` of them cannot overflow
    a float64 sum), decided by one min/max pass (both NaN if any entry is), which reads
    the entries as they are, where the float64 sum widens each.  Wider entries are summed.

    >>> _finite_sum(torch.tensor([1.0, 2.0])), _finite_sum(torch.tensor([1.0, -math.inf]))
    (True, False)
    """
    if p.dtype.itemsize <= 4 and p.numel():
        lo, hi = torch.aminmax(p)
        return bool(torch.isfinite(lo) & torch.isfinite(hi))
    return bool(torch.isfinite(p.sum(dtype=torch.float64)))


def _key_grid_edges(q_times_s: torch.Tensor, km: torch.Tensor, draws: _RandomSource,
                    duplicates: str, tuning: FastRGTuning,
                    index_dtype: torch.dtype = torch.int64):
    """Edges from one Poisson count per (group, query, key) pair
    (:func:`_key_grid_blocks`): sorted by (group, query, key); with ``"merge"`` each
    pair with a positive count gives one edge. The pair codes are int64 (``G n m`` may
    pass ``2**31``); the indices are ``index_dtype``."""
    num_groups, n, _ = q_times_s.shape
    m = km.shape[1]
    pieces, offset = [], 0
    for counts in _key_grid_blocks(q_times_s, km, draws, tuning):
        pair = draws.nonzero(counts > 0)
        if duplicates == "keep":
            pair = repeat_each(pair, counts[pair])
        pieces.append(pair + offset)
        offset += counts.numel()
    pair = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    key = pair % m
    row = torch.div(pair, m, rounding_mode="floor")
    group, query = torch.div(row, n, rounding_mode="floor"), row % n
    return group.to(index_dtype), query.to(index_dtype), key.to(index_dtype)


def _cell_owners(counts: torch.Tensor, num_groups: int, n: int,
                 index_dtype: torch.dtype = torch.int64):
    """Group and query (``index_dtype``) of every edge, from the per-cell counts in
    (group, query, b) order: each query's edges are the sum of its ``k`` cells' counts."""
    device = counts.device
    row_counts = counts.view(num_groups * n, -1).sum(1)
    num_edges = int(row_counts.sum())
    group = repeat_each(torch.arange(num_groups, device=device, dtype=index_dtype),
                        row_counts.view(num_groups, n).sum(1), num_edges)
    query = torch.arange(n, device=device, dtype=index_dtype).repeat(num_groups)
    query = repeat_each(query, row_counts, num_edges)
    return group, query


def _merge_duplicates(group, query, key, num_groups, n, m):
    """One copy of every drawn pair, sorted by ``(group, query, key)`` (radix sort); the
    pair codes in int64 (``G n m`` may pass ``2**31``), the indices in the given dtype."""
    if group.numel() <= 1:
        return group, query, key
    index_dtype = group.dtype
    code = (group.long() * n + query) * m + key
    code = torch.unique_consecutive(code[stable_argsort(code, num_groups * n * m)])
    key = code % m
    code = torch.div(code, m, rounding_mode="floor")
    group, query = torch.div(code, n, rounding_mode="floor"), code % n
    return group.to(index_dtype), query.to(index_dtype), key.to(index_dtype)


def _append_self_loops(group, query, key, num_groups, n):
    """Insert the edge ``(g, i, i)`` after the sampled edges of every query, keeping the
    ``(group, query)`` order, in the indices' dtype (the rows ``g n + i`` in int64)."""
    device, index_dtype = group.device, group.dtype
    loops = torch.arange(num_groups * n, device=device)
    row = torch.cat([group.long() * n + query, loops])
    order = stable_argsort(row, num_groups * n)
    loop_group = torch.div(loops, n, rounding_mode="floor").to(index_dtype)
    loop_query = (loops % n).to(index_dtype)
    group = torch.cat([group, loop_group])[order]
    query = torch.cat([query, loop_query])[order]
    key = torch.cat([key, loop_query])[order]
    return group, query, key


def _groups(q_membership, s, k_membership):
    """Flatten one group or a batch of groups to ``[G, n, k]``, ``[G, k, k]``, ``[G, m, k]``."""
    for name, t in (("q_membership", q_membership), ("s", s), ("k_membership", k_membership)):
        check_tensor(name, t, floating=True)
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
