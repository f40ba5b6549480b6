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

import numpy as np
import torch

from companion._validate import check_int, check_tensor
from companion.sbm.graph_attention import repeat_each, stable_argsort

__all__ = ["fastrg_sample", "poisson_pair_counts", "edge_probabilities", "FastRGTuning",
           "DUPLICATE_POLICIES", "use_pair_grid"]

DUPLICATE_POLICIES = ("merge", "keep")
KEY_DRAWS = ("auto", "rejection", "search")
CPU_UNIFORM_SOURCES = ("numpy", "torch")
CELL_GRIDS = ("auto", "clusters", "keys")
CPU_POISSON_SOURCES = ("inversion", "torch")
# rates above this get numpy's own Poisson sampler (transformed rejection) instead of
# inversion, whose number of passes grows with the rate
_INVERSION_MAX_RATE = 16.0
# rows per tile of transposed_copy
_TRANSPOSE_TILE = 128
# rates per block of the inversion (:func:`_poisson_by_inversion`): its uniforms (512 KiB
# of float64) and its passes' arrays within a core's L2 cache
_INVERSION_BLOCK = 1 << 16
# count dtypes the inversion writes directly (others are converted from int64)
_NUMPY_COUNT_DTYPES = {torch.int64: np.int64, torch.float32: np.float32,
                       torch.float64: np.float64}


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

    Examples
    --------
    >>> qm, km = torch.full((5, 2), 0.5), torch.full((7, 2), 0.5)
    >>> s = torch.full((2, 2), 0.25)
    >>> group, query, key = fastrg_sample(qm, s, km, torch.Generator().manual_seed(0))
    >>> bool((query[1:] >= query[:-1]).all()), int(key.max()) < 7
    (True, True)
    """
    _check_options(duplicates, self_loops, generator, tuning)
    qm, sg, km, _, q_times_s = _checked_groups(q_membership, s, k_membership, q_times_s)
    num_groups, n, _ = qm.shape
    m = km.shape[1]
    if self_loops and n != m:
        raise ValueError(f"self_loops: requires as many queries as keys, got n={n}, m={m}")
    with torch.no_grad():
        # views of the caller's tensors: nothing derived from them is written in place
        qm, sg, km = qm.detach(), sg.detach(), km.detach()
        draws = _RandomSource(qm.device, generator, tuning.cpu_uniforms, tuning.cpu_poisson)
        q_times_s = _q_times_s(qm, sg, q_times_s)
        k_mass = km.sum(1, dtype=torch.float64)  # colsum Khat, [G, k]
        if _use_key_grid(q_times_s, k_mass, num_groups * n * m, tuning):
            group, query, key = _key_grid_edges(q_times_s, km, draws, duplicates, tuning)
            merged = duplicates == "merge"  # one edge per pair with a positive count
        else:
            # step 1: one Poisson count per cell (group, query, key cluster b); the cells
            # in this order sort the edges by (group, query, b)
            counts = draws.poisson(_cell_rates(q_times_s, k_mass).reshape(-1))
            group, query = _cell_owners(counts, num_groups, n)
            # step 2: the key of every edge, from its cell's key cluster
            key = _draw_keys(km, counts, n, draws, tuning)
            merged = False
        if self_loops:
            group, query, key = _append_self_loops(group, query, key, num_groups, n)
            merged = False
        if duplicates == "merge" and not merged:
            group, query, key = _merge_duplicates(group, query, key, num_groups, n, m)
    return group, query, key


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


def transposed_copy(x: torch.Tensor) -> torch.Tensor:
    """``x.transpose(1, 2).contiguous()`` of a 3-D tensor, as a new tensor without grad.

    On CPU (float32 / float64) by numpy's strided copy: at [64, 100, 32] on one thread
    74 against 110 us for torch's transposing copy (this 2-core machine, load 2.7); the
    same numbers (a copy). Past 128 rows, in tiles of 128 rows (a tenth of the time of
    one sweep at [2, 8192, 128]). For the GEMMs' second operands, which ran about twice as fast
    contiguous as transposed. Always a copy, never a view of ``x`` (``.contiguous()``
    returns ``x`` itself when a size-1 dimension makes the transpose contiguous). Tensors
    numpy cannot read (negative or conjugate views) and traced or compiled calls take
    torch's copy.

    >>> x = torch.arange(6.0).reshape(1, 2, 3)
    >>> torch.equal(transposed_copy(x), x.transpose(1, 2).contiguous())
    True
    >>> y = torch.zeros(3, 1, 5)
    >>> transposed_copy(y).data_ptr() != y.data_ptr()
    True
    """
    x = x.detach()
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and x.numel() \
            and not (x.is_neg() or x.is_conj() or torch.jit.is_tracing()
                     or torch.compiler.is_compiling()):
        a = x.numpy()
        rows = a.shape[1]
        # tiles of rows (one tile up to 128 rows): a long column written in one sweep
        # touches a new page per element; a tile's columns are short ([2, 8192, 128]
        # float32 in 1.5 against 15 ms here)
        out = np.empty((a.shape[0], a.shape[2], rows), dtype=a.dtype)
        for r0 in range(0, rows, _TRANSPOSE_TILE):
            out[:, :, r0:r0 + _TRANSPOSE_TILE] = a[:, r0:r0 + _TRANSPOSE_TILE].transpose(0, 2, 1)
        return torch.from_numpy(out)
    return x.transpose(1, 2).clone(memory_format=torch.contiguous_format)


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
    a float64 sum), decided by one min/max pass (both NaN if any entry is): about a
    third of the time of the float64 sum here.  Wider entries are summed.

    >>> _finite_sum(torch.tensor([1.0, 2.0])), _finite_sum(torch.tensor([1.0, -math.inf]))
    (True, False)
    """
    if p.dtype.itemsize <= 4 and p.numel():
        lo, hi = torch.aminmax(p)
        return bool(torch.isfinite(lo) & torch.isfinite(hi))
    return bool(torch.isfinite(p.sum(dtype=torch.float64)))


def _key_grid_edges(q_times_s: torch.Tensor, km: torch.Tensor, draws: _RandomSource,
                    duplicates: str, tuning: FastRGTuning):
    """Edges from one Poisson count per (group, query, key) pair
    (:func:`_key_grid_blocks`): sorted by (group, query, key); with ``"merge"`` each
    pair with a positive count gives one edge."""
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
    return torch.div(row, n, rounding_mode="floor"), row % n, key


def _cell_owners(counts: torch.Tensor, num_groups: int, n: int):
    """Group and query of every edge, from the per-cell counts in (group, query, b)
    order: each query's edges are the sum of its ``k`` cells' counts."""
    device = counts.device
    row_counts = counts.view(num_groups * n, -1).sum(1)
    num_edges = int(row_counts.sum())
    group = repeat_each(torch.arange(num_groups, device=device),
                        row_counts.view(num_groups, n).sum(1), num_edges)
    query = torch.arange(n, device=device).repeat(num_groups)
    query = repeat_each(query, row_counts, num_edges)
    return group, query


def _draw_keys(km: torch.Tensor, counts: torch.Tensor, n: int, draws: _RandomSource,
               tuning: FastRGTuning) -> torch.Tensor:
    """The key of every edge, ``j ~ Khat[:, b] / colsum_b(Khat)`` for its cell's ``b``.

    Groups are taken in blocks (``tuning.table_block_entries`` bounds the key tables of a
    block, :class:`_KeyTable`), and the edges of a block in steps of cells holding about
    ``tuning.draw_block`` edges (bounded scratch)."""
    num_groups, m, kc = km.shape
    ends = torch.cumsum(counts, 0)  # edges of cell c are ends[c] - counts[c] .. ends[c]
    key = torch.empty(int(ends[-1]), dtype=torch.int64, device=km.device)
    cells_per_group = n * kc
    groups_per_block = max(1, tuning.table_block_entries // (m * kc))
    cells_per_step = max(kc, tuning.draw_block * counts.numel() // max(key.numel(), 1))
    for g0 in range(0, num_groups, groups_per_block):
        g1 = min(g0 + groups_per_block, num_groups)
        first, stop = g0 * cells_per_group, g1 * cells_per_group
        if int(ends[stop - 1]) == int(ends[first] - counts[first]):
            continue  # no edge in this block: no table to build
        table = _KeyTable(km[g0:g1], n, tuning)
        for c0 in range(first, stop, cells_per_step):
            c1 = min(c0 + cells_per_step, stop)
            e0, e1 = int(ends[c0] - counts[c0]), int(ends[c1 - 1])
            if e1 > e0:
                base = repeat_each(table.cell_base[c0 - first:c1 - first], counts[c0:c1],
                                   e1 - e0)
                key[e0:e1] = table.draw(base, draws)
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
        # would make, by transposed_copy (the same numbers, in a tenth of the time at
        # [2, 8192, 128])
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
            # ``weights.sum(1, dtype=float64)`` (test), in a third of the time here
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

    def draw(self, base: torch.Tensor, draws: _RandomSource) -> torch.Tensor:
        """One key per entry of ``base`` (a ``cell_base`` entry per edge)."""
        if self.accept is not None:
            return _rejection_draw(self.accept, self.width, base, draws)
        return _search_rows(self.cdf, self.last, base, draws)


def _merge_duplicates(group, query, key, num_groups, n, m):
    """One copy of every drawn pair, sorted by ``(group, query, key)`` (radix sort)."""
    if group.numel() <= 1:
        return group, query, key
    code = (group * n + query) * m + key
    code = torch.unique_consecutive(code[stable_argsort(code, num_groups * n * m)])
    key = code % m
    code = torch.div(code, m, rounding_mode="floor")
    return torch.div(code, n, rounding_mode="floor"), code % n, key



class _RandomSource:
    """Uniforms, Poisson counts and index compaction for the sampler, on one device.

    On CPU with ``cpu_uniforms="numpy"`` (the default of :class:`FastRGTuning`) the
    uniforms come from numpy's PCG64, seeded by one 63-bit draw from the caller's
    ``torch.Generator`` (or torch's global one), so a graph stays reproducible from the
    torch seed; here numpy's generator is about three times faster than torch's CPU
    Mersenne Twister, and ``np.flatnonzero`` about nine times faster than
    ``torch.nonzero``, the two costs that dominated the key draws.  The Poisson counts
    then come by inversion of the same stream (:func:`_poisson_by_inversion`) unless
    ``cpu_poisson="torch"``.  Otherwise (CUDA, or ``cpu_uniforms="torch"``) torch's own
    generator and kernels are used.
    """

    def __init__(self, device: torch.device, generator: torch.Generator | None,
                 cpu_uniforms: str, cpu_poisson: str = "inversion"):
        self.device, self.generator = device, generator
        self.rng = None
        if device.type == "cpu" and cpu_uniforms == "numpy":
            seed = int(torch.randint(0, 2**63 - 1, (1,), generator=generator))
            self.rng = np.random.Generator(np.random.PCG64(seed))
        self.inversion = self.rng is not None and cpu_poisson == "inversion"

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

    def poisson(self, rates: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """Independent ``Poisson(rates)`` counts for a 1-D float32 or float64 tensor (the
        rates taken as float64 numbers: float32 ones give the counts of their exact float64
        copy), as int64 or as numbers of the floating ``dtype`` (the same counts, rounded as
        a conversion from int64 would round them)."""
        if self.inversion:
            # float32 / float64 written directly; other dtypes converted from int64
            np_dtype = _NUMPY_COUNT_DTYPES.get(dtype, np.int64)
            counts = torch.from_numpy(_poisson_by_inversion(rates.numpy(), self.rng, np_dtype))
            return counts.to(dtype)
        return torch.poisson(rates.to(torch.float64), generator=self.generator).to(dtype)


def _poisson_by_inversion(rates: np.ndarray, rng: np.random.Generator,
                          dtype=np.int64, block: int = _INVERSION_BLOCK) -> np.ndarray:
    """Independent ``Poisson(rates)`` counts from one PCG64 uniform per rate.

    Inversion: the count is the least ``c`` with ``u < F(c) = sum_{i <= c} e^{-r}
    r^i / i!``, found by subtracting the terms from ``u`` one pass at a time.  ``e^{-r}
    >= 1 - r`` decides most zero counts of small rates without an exponential (``u < 1 -
    r``).  The first pass runs over every remaining rate (most of them have a count of at
    least one), the later ones over the rates still undecided.  Rates above 16 (many
    passes) take numpy's own sampler instead, after all the uniforms, so the stream stays
    in a fixed order.  Exact up to float64 rounding of ``F`` (about ``1e-16`` in
    probability).

    The rates are taken ``block`` at a time (:func:`_invert_block`): the same uniforms
    in the same order and the same arithmetic per rate, so the counts do not depend on
    ``block``, but the dozen passes of a block over its rates, uniforms and partial sums
    stay in a core's cache.  At 2**16 (512 KiB of uniforms), on a 2 MiB-L2 Xeon: 640,000
    float32 rates near 0.25 (the ci model's pair grid) in 3.4 against 4.0 ms, 2**20
    exponential rates of mean 1.6 (fastRG's cells at n = 4096, 5 %, have mean 1.6) in
    19 against 32 ms.

    Parameters
    ----------
    rates : 1-D float64, or float32 (read as their exact float64 values: the counts of
        ``rates.astype(np.float64)`` bit for bit, without that copy).
    rng : the PCG64 generator the uniforms come from.
    dtype : of the counts (int64, or a float dtype that holds them as numbers).
    block : rates per block, at least 1.

    >>> rng = np.random.Generator(np.random.PCG64(0))
    >>> _poisson_by_inversion(np.array([0.0, 0.5, 40.0]), rng).dtype
    dtype('int64')
    """
    block = check_int("block", block, minimum=1)
    counts = np.empty(rates.size, dtype)
    u = np.empty(min(block, rates.size))
    large = []
    for start in range(0, rates.size, block):
        stop = min(start + block, rates.size)
        uniforms = u[:stop - start]
        rng.random(out=uniforms)
        found = _invert_block(rates[start:stop], uniforms, counts[start:stop])
        if found is not None:
            large.append(found + start)
    if large:
        where = np.concatenate(large)  # in index order, as one pass over all rates gave
        counts[where] = rng.poisson(rates[where])
    return counts


def _invert_block(rates: np.ndarray, u: np.ndarray, counts: np.ndarray):
    """:func:`_poisson_by_inversion` on one block: writes ``counts`` (a view of the
    block's counts) from the block's uniforms ``u`` (consumed), except at rates above
    16, whose positions in the block it returns (None if there is none)."""
    # u < 1 - r <= e^{-r}: count 0; 1 - r in float64 for float32 rates too (of their
    # exact float64 copies: a plain cast and an in-place subtract, about three times
    # faster here than numpy's mixed-dtype subtract)
    if rates.dtype == np.float64:
        one_minus = np.subtract(1.0, rates)
    else:
        one_minus = rates.astype(np.float64)
        np.subtract(1.0, one_minus, out=one_minus)
    candidate = np.greater_equal(u, one_minus)
    del one_minus
    live = np.flatnonzero(candidate)
    # pass 1 below writes the count 1 of every candidate whose u >= F(0); most are (at
    # r = 0.25, 88 %), so every candidate starts at 1 and the others are set back to 0
    counts[...] = candidate
    del candidate
    r = rates.take(live).astype(np.float64, copy=False)
    # every rate above the limit is a candidate (1 - r < 0 <= u), so the candidates'
    # maximum decides whether there is one (a quarter of the rates at r = 0.25, not all)
    large = None
    if r.size and not r.max() <= _INVERSION_MAX_RATE:
        is_large = r > _INVERSION_MAX_RATE
        large = live[is_large]
        small = np.flatnonzero(~is_large)
        live, r = live.take(small), r.take(small)
    term = np.exp(-r)
    rest = u.take(live)
    rest -= term  # u - F(0)
    # pass 1 over every candidate: counts >= 1 where u >= F(0), else 0 (the large rates'
    # 1 is overwritten by their own sampler)
    counts[live.take(np.flatnonzero(rest < 0))] = 0
    passes = 1
    term *= r
    rest -= term  # u - F(1)
    while live.size:
        keep = np.flatnonzero(rest >= 0)  # u >= F(c): the count is above c
        # take with indices: several times faster than four boolean-mask selections
        live, r, term, rest = live.take(keep), r.take(keep), term.take(keep), rest.take(keep)
        passes += 1
        counts[live] = passes
        # guards a u in the last rounding gap below the float64 F(inf)
        if passes > 16 * _INVERSION_MAX_RATE:
            break
        term *= r
        term /= passes
        rest -= term
    return large


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
    if draws.rng is not None and accept.device.type == "cpu":
        return torch.from_numpy(
            _rejection_draw_numpy(accept.numpy(), width, base.numpy(), draws.rng))
    return _rejection_draw_torch(accept, width, base, draws)


def _rejection_draw_torch(
    accept: torch.Tensor, width: int, base: torch.Tensor, draws: _RandomSource
) -> torch.Tensor:
    """:func:`_rejection_draw` in torch's kernels (CUDA, or torch's CPU uniforms)."""
    out = torch.empty(base.numel(), dtype=torch.int64, device=base.device)
    pending = None  # indices into out still to draw (None: all of them)
    while base.numel():
        # one float64 uniform gives the column (integer part of x) and the coin
        # (fractional part: 53 - log2(width) random bits)
        x = draws.uniform(base.numel())
        x.mul_(width)
        col = x.to(torch.int64).clamp_(max=width - 1)
        coin = x.sub_(col)
        # index_select, not take: the same gather, about five times faster on CPU here
        rejected = draws.nonzero(coin >= accept.index_select(0, col + base))
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


def _rejection_draw_numpy(accept: np.ndarray, width: int, base: np.ndarray,
                          rng: np.random.Generator) -> np.ndarray:
    """:func:`_rejection_draw` on CPU with numpy's uniforms, in numpy's kernels: the same
    operations on the same uniforms as :func:`_rejection_draw_torch` (so the same keys,
    bit for bit), about a quarter faster per round here (fewer conversions between the
    two libraries' arrays, numpy's ``take`` for the look-ups and the compaction)."""
    out = np.empty(base.size, dtype=np.int64)
    pending = None  # indices into out still to draw (None: all of them)
    while base.size:
        x = rng.random(base.size)
        x *= width
        col = x.astype(np.int64)  # truncation, as torch's conversion
        np.minimum(col, width - 1, out=col)
        x -= col  # the coin
        rejected = np.flatnonzero(x >= accept.take(col + base))
        del x
        if pending is None:
            out[...] = col
            pending = rejected
        else:
            out[pending] = col
            pending = pending.take(rejected)
        base = base.take(rejected)
    return out


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
