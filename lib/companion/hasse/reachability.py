"""Information flow of a multi-layer masked transformer: layer graphs, ``A^L``, limits,
condensation and Hasse diagrams :cite:`li2026hasse`.

Definitions
-----------
One transformer layer is a bipartite graph from input positions to output positions with
an edge ``k -> q`` when query ``q`` may attend key ``k`` (``mask[q, k]``) or ``k == q``
(the residual connection; feed-forward and LayerNorm act position-wise and add no edge).
Its adjacency is ``A = mask OR I`` (:func:`layer_adjacency`). After ``L`` layers output
``q`` depends on input ``k`` exactly when ``R^(L)[q, k] = (A^L)[q, k]`` in Boolean
arithmetic (:func:`reachability`). Because ``A`` is reflexive ``R^(L)`` grows with ``L``
and is constant from some ``L*`` on: the limit ``R`` is the reflexive transitive closure
of the mask graph and ``L*`` (the *depth*) is the largest shortest-path distance between
two positions that reach each other (:func:`reachability_limit`). ``R`` is a preorder;
its classes of mutually reachable positions (strongly connected components) are
partially ordered, and the Hasse diagram of that order (:func:`hasse_diagram`) is the
information-flow structure of any deep enough transformer with this mask.

Matrix convention: ``R[q, k] = True`` means information flows from position ``k`` to
position ``q`` (row = receiver, like the mask). Hasse edges point the way information
flows: from the class that is attended to the class that attends.

Algorithms
----------
``method="bitset"`` (CPU, the default for CPU tensors) works on bit-packed rows: the
closure, the classes and the Hasse diagram in one sweep over the classes in topological
order (:mod:`companion.hasse.closure`), then the depth, in closed form for masks whose
rows are monotone intervals, else by a bit-parallel breadth-first search
(:mod:`companion.hasse.depth`).

``method="matmul"`` (any device, the default for CUDA tensors) squares ``A`` repeatedly
with float matrix products on the mask's device (exact for ``n < 2**24``), finds the
depth by binary lifting over the stored powers, and reduces the class order with one more
product (``covers = S AND NOT S^2`` for the strict order ``S``). Cost
``O(n^3 log n)`` flops.

Long sequences: :func:`packed_order_structure` and the packed adjacencies
(:mod:`companion.hasse.long_sequences`, re-exported here) run the bitset method without
ever forming an ``n x n`` bool array.

Both methods number the Hasse nodes identically: by the number of classes at or below the
class, then by the smallest member (a topological order; the natural order for masks
whose positions are already topologically ordered).
"""
from __future__ import annotations

from typing import NamedTuple

import networkx as nx
import numpy as np
import torch

from companion._validate import check_bool, check_choice, check_int, describe
from companion.hasse.closure import (  # noqa: F401  (private names the tests read here)
    _build_hasse, _closure_bitset, _expand_reach, _reach_count, _topological_class_order)
from companion.hasse.depth import (  # noqa: F401
    _depth, _depth_bitset, _depth_intervals, _row_intervals)
from companion.hasse.long_sequences import (PackedOrderStructure, packed_adjacency,
                                            packed_adjacency_from_edges, packed_order_structure,
                                            unpack_reach)
from companion.hasse.masks import validate_mask

__all__ = [
    "OrderStructure",
    "PackedOrderStructure",
    "condensation_graph",
    "first_reach_layer",
    "hasse_diagram",
    "layer_adjacency",
    "mask_graph",
    "order_structure",
    "packed_adjacency",
    "packed_adjacency_from_edges",
    "packed_order_structure",
    "reachability",
    "reachability_limit",
    "reachability_sequence",
    "tokens_reached",
    "unpack_reach",
]

_METHODS = ("auto", "bitset", "matmul")


# ------------------------------------------------------------------ basic operators
def layer_adjacency(mask: torch.Tensor) -> torch.Tensor:
    """Adjacency of one layer: ``A = mask OR I`` (the identity is the residual connection).

    Parameters
    ----------
    mask : (n, n) bool tensor, ``mask[q, k]`` = query ``q`` may attend key ``k``.

    Returns
    -------
    (n, n) bool tensor on ``mask.device``.

    References
    ----------
    .. [1] C. Li and H. Guo, "Hasse Diagrams for Attention: A Partial Order Framework
       for Designing Transformer Masks", arXiv:2606.09951: one layer as the graph ``A =
       M OR I``, the residual connection adding ``k == q`` (the section is not known
       here: the abstract and a secondary summary).

    Examples
    --------
    >>> from companion.hasse.masks import chain
    >>> layer_adjacency(chain(3)).int().tolist()
    [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    """
    validate_mask(mask)
    eye = torch.eye(mask.shape[0], dtype=torch.bool, device=mask.device)
    return mask | eye


def mask_graph(mask: torch.Tensor) -> nx.DiGraph:
    """The information-flow graph of a mask: nodes ``0..n-1``, an edge ``k -> q`` whenever
    query ``q`` attends key ``k`` (self edges kept when the mask has them).

    The graph networkx's algorithms take (closure, condensation, reduction): the peer the
    tests and the chapter compare this module with. O(n + edges) time.

    >>> from companion.hasse.masks import causal
    >>> sorted(mask_graph(causal(3)).edges)
    [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (2, 2)]
    """
    validate_mask(mask)
    q, k = torch.nonzero(mask.cpu(), as_tuple=True)
    graph = nx.DiGraph()
    graph.add_nodes_from(range(mask.shape[0]))
    graph.add_edges_from(zip(k.tolist(), q.tolist()))
    return graph


def _bool_product(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Boolean matrix product on the tensors' device (float32 is exact for n < 2**24)."""
    return (x.to(torch.float32) @ y.to(torch.float32)) > 0


def reachability(mask: torch.Tensor, layers: int) -> torch.Tensor:
    """Dependency pattern of ``layers`` stacked layers: Boolean ``A^layers``.

    Parameters
    ----------
    mask : (n, n) bool tensor.
    layers : int >= 0. ``A^0 = I``.

    Returns
    -------
    (n, n) bool tensor ``R`` on ``mask.device``; ``R[q, k]`` = output ``q`` depends on
    input ``k`` after ``layers`` layers.

    Complexity: ``O(n^3 log(layers))`` flops by repeated squaring (stops early once the
    powers are stable).

    References
    ----------
    .. [1] C. Li and H. Guo, "Hasse Diagrams for Attention: A Partial Order Framework
       for Designing Transformer Masks", arXiv:2606.09951: ``L`` layers as the Boolean
       power ``A^L`` (the section is not known here: the abstract and a secondary
       summary).

    Examples
    --------
    >>> from companion.hasse.masks import chain
    >>> reachability(chain(3), 2)[2].int().tolist()  # position 2 reads 0 after two layers
    [1, 1, 1]
    """
    layers = check_int("layers", layers, minimum=0)
    adj = layer_adjacency(mask)
    result = torch.eye(adj.shape[0], dtype=torch.bool, device=adj.device)
    power = adj  # A^(2^j)
    remaining = layers
    while remaining:
        if remaining & 1:
            result = _bool_product(result, power)
        remaining >>= 1
        if remaining:
            squared = _bool_product(power, power)
            if torch.equal(squared, power):
                # A^(2^j) is already the limit and layers >= 2^(j+1): A^layers is the limit.
                return power
            power = squared
    return result


def reachability_sequence(mask: torch.Tensor, max_layers: int | None = None) -> list[torch.Tensor]:
    """``[A^1, A^2, ..., A^L*]``: the dependency patterns layer by layer until stable.

    The last entry is the limit ``R`` (it is repeated nowhere). With ``max_layers`` the
    list stops after that many layers even if not yet stable. Intended for drawing
    (small ``n``): one product per layer.

    Examples
    --------
    >>> from companion.hasse.masks import chain
    >>> [int(power.sum()) for power in reachability_sequence(chain(3))]  # A^1, A^2 = R
    [5, 6]
    """
    adj = layer_adjacency(mask)
    if max_layers is not None:
        max_layers = check_int("max_layers", max_layers, minimum=1)
    seq = [adj]
    while max_layers is None or len(seq) < max_layers:
        nxt = _bool_product(seq[-1], adj)
        if torch.equal(nxt, seq[-1]):
            break
        seq.append(nxt)
    return seq


# --------------------------------------------------------------- bit-packed helpers


# ------------------------------------------------------------------ matmul method
def _closure_matmul(mask: torch.Tensor):
    """Limit, powers A^(2^j) and depth by repeated squaring on the mask's device."""
    adj = layer_adjacency(mask)
    n = adj.shape[0]
    eye = torch.eye(n, dtype=torch.bool, device=adj.device)
    powers = [adj]
    while True:
        sq = _bool_product(powers[-1], powers[-1])
        if torch.equal(sq, powers[-1]):
            break
        powers.append(sq)
    limit = powers[-1]
    if torch.equal(limit, eye):
        return limit, 0
    # Binary lifting: largest L with A^L != R, then depth = L + 1.
    current, steps = eye, 0
    for j in range(len(powers) - 1, -1, -1):
        candidate = _bool_product(current, powers[j])
        if not torch.equal(candidate, limit):
            current, steps = candidate, steps + (1 << j)
    return limit, steps + 1


def _classes_from_limit(limit: torch.Tensor):
    """Class labels (canonical ids), class-level order and covers from a limit R."""
    n = limit.shape[0]
    mutual = limit & limit.T
    first = torch.argmax(mutual.to(torch.uint8), dim=1)  # smallest mutually reachable
    reps, raw = torch.unique(first, return_inverse=True)
    class_r = limit[reps][:, reps]
    below = class_r.sum(dim=1).cpu().numpy()
    smallest = reps.cpu().numpy()  # reps are the smallest members
    canon = torch.as_tensor(np.lexsort((smallest, below)), device=limit.device)
    new_id = torch.empty_like(canon)
    new_id[canon] = torch.arange(canon.numel(), device=limit.device)
    labels = new_id[raw]
    class_r = class_r[canon][:, canon]
    eye = torch.eye(class_r.shape[0], dtype=torch.bool, device=limit.device)
    strict = class_r & ~eye
    covers = strict & ~_bool_product(strict, strict)
    hi, lo = torch.nonzero(covers, as_tuple=True)  # covers[hi, lo]: lo -> hi
    del n
    return labels, torch.stack([lo, hi], dim=1)


# ------------------------------------------------------------------ public analysis
class OrderStructure(NamedTuple):
    """Everything :func:`order_structure` computes for one mask.

    Examples
    --------
    >>> from companion.hasse.masks import causal
    >>> order_structure(causal(2))._fields
    ('R', 'depth', 'hasse', 'labels')
    """

    R: torch.Tensor  # (n, n) bool limit reachability
    depth: int  # smallest L with A^L = R
    hasse: nx.DiGraph  # Hasse diagram of the classes
    labels: torch.Tensor  # (n,) long: Hasse node of each position


def _resolve_method(mask: torch.Tensor, method: str) -> str:
    check_choice("method", method, _METHODS)
    if method == "auto":
        return "bitset" if mask.device.type == "cpu" else "matmul"
    return method


def order_structure(
    mask: torch.Tensor, *, method: str = "auto", compute_depth: bool = True
) -> OrderStructure:
    """Limit reachability, depth and Hasse diagram of ``mask`` in one pass.

    Parameters
    ----------
    mask : (n, n) bool tensor.
    method : "auto" (bitset on CPU tensors, matmul elsewhere), "bitset" or "matmul";
        see the module docstring for algorithms and costs.
    compute_depth : bool. When False ``depth`` is returned as -1 (saves the BFS).

    Returns
    -------
    OrderStructure(R, depth, hasse, labels), ``R`` and ``labels`` on ``mask.device``.

    References
    ----------
    .. [1] C. Li and H. Guo, "Hasse Diagrams for Attention: A Partial Order Framework
       for Designing Transformer Masks", arXiv:2606.09951: the limit ``R = lim A^L``,
       its classes (a preorder's equivalence classes) and the Hasse diagram of their
       partial order (the section is not known here: the abstract and a secondary
       summary).

    Examples
    --------
    >>> from companion.hasse.masks import block_causal
    >>> result = order_structure(block_causal(4, 2))
    >>> result.depth, sorted(result.hasse.edges), result.labels.tolist()
    (1, [(0, 1)], [0, 0, 1, 1])
    """
    validate_mask(mask)
    method = _resolve_method(mask, method)
    compute_depth = check_bool("compute_depth", compute_depth)
    if method == "bitset":
        closure = _closure_bitset(mask)
        r_np = _expand_reach(closure)
        depth = _depth(closure.packed, _reach_count(closure)) if compute_depth else -1
        hasse = _build_hasse(closure.labels, closure.covers, len(closure.reach))
        return OrderStructure(
            torch.from_numpy(r_np), depth, hasse, torch.from_numpy(closure.labels)
        )
    limit, depth = _closure_matmul(mask)
    labels, covers = _classes_from_limit(limit)
    labels_np = labels.cpu().numpy()
    hasse = _build_hasse(labels_np, covers.cpu().numpy(), int(labels_np.max()) + 1)
    return OrderStructure(limit, depth if compute_depth else -1, hasse, labels)


def reachability_limit(mask: torch.Tensor, *, method: str = "auto") -> tuple[torch.Tensor, int]:
    """Limit reachability ``R = lim A^L`` and the depth ``L*`` (smallest L with A^L = R).

    ``L* = 0`` when no information flows between positions (``R = I``), ``1`` for dense
    masks (``A`` already transitive: causal, block-causal, prefix-LM, ...), ``n - 1`` for
    the chain. See the module docstring for the algorithms.

    Returns
    -------
    (R, depth): ``R`` an (n, n) bool tensor on ``mask.device``, ``depth`` an int.

    References
    ----------
    .. [1] C. Li and H. Guo, "Hasse Diagrams for Attention: A Partial Order Framework
       for Designing Transformer Masks", arXiv:2606.09951: the limit ``R = lim A^L``,
       reached after at most ``n - 1`` layers (the section is not known here: the
       abstract and a secondary summary).

    Examples
    --------
    A sliding window of width 3 over 7 positions reaches the causal mask after
    ``ceil((7 - 1) / (3 - 1)) = 3`` layers:

    >>> from companion.hasse.masks import causal, sliding_window
    >>> R, depth = reachability_limit(sliding_window(7, 3))
    >>> depth, torch.equal(R, causal(7))
    (3, True)
    """
    result = order_structure(mask, method=method)
    return result.R, result.depth


def hasse_diagram(mask: torch.Tensor, *, method: str = "auto") -> nx.DiGraph:
    """Hasse diagram of the partial order that ``mask`` induces on its position classes.

    Nodes are the classes of mutually reachable positions (node attribute ``members``: the
    sorted tuple of positions), numbered in a topological order (see module docstring);
    edges are the covering relations, from the attended class to the attending class.
    ``graph.graph["n_positions"]`` holds ``n``.

    References
    ----------
    .. [1] C. Li and H. Guo, "Hasse Diagrams for Attention: A Partial Order Framework
       for Designing Transformer Masks", arXiv:2606.09951: the Hasse diagram (transitive
       reduction of the condensation) as the information-flow structure of a deep enough
       transformer (the section is not known here: the abstract and a secondary
       summary).

    Examples
    --------
    >>> from companion.hasse.masks import block_causal
    >>> graph = hasse_diagram(block_causal(4, 2))
    >>> sorted(graph.nodes(data="members")), sorted(graph.edges)
    ([(0, (0, 1)), (1, (2, 3))], [(0, 1)])
    """
    validate_mask(mask)
    if _resolve_method(mask, method) == "bitset":  # the closure alone: R is not needed
        closure = _closure_bitset(mask)
        return _build_hasse(closure.labels, closure.covers, len(closure.reach))
    return order_structure(mask, method=method, compute_depth=False).hasse


def condensation_graph(mask: torch.Tensor) -> nx.DiGraph:
    """The quotient of the mask graph by its classes (before transitive reduction).

    Same nodes (ids, ``members``) as :func:`hasse_diagram`; an edge ``a -> b`` whenever
    some position of class ``b`` attends some position of class ``a`` (``a != b``).
    For drawing the pipeline mask -> R -> condensation -> Hasse diagram.

    Examples
    --------
    The causal mask's condensation keeps the edge ``0 -> 2`` that the Hasse diagram drops:

    >>> from companion.hasse.masks import causal
    >>> sorted(condensation_graph(causal(3)).edges), sorted(hasse_diagram(causal(3)).edges)
    ([(0, 1), (0, 2), (1, 2)], [(0, 1), (1, 2)])
    """
    result = order_structure(mask, compute_depth=False)
    graph = nx.DiGraph()
    graph.add_nodes_from(result.hasse.nodes(data=True))
    labels = result.labels.cpu()
    q, k = torch.nonzero(mask.cpu(), as_tuple=True)
    pairs = {(int(a), int(b)) for a, b in zip(labels[k], labels[q]) if int(a) != int(b)}
    graph.add_edges_from(sorted(pairs))
    return graph


def tokens_reached(R: torch.Tensor, inputs) -> list[set[int]]:
    """For each position ``q`` the set of source tokens it can read through ``R``:
    the union of ``inputs[k]`` over ``k`` with ``R[q, k]``.

    Examples
    --------
    >>> from companion.hasse.masks import causal
    >>> [sorted(tokens) for tokens in tokens_reached(causal(3), [[10], [11], [12]])]
    [[10], [10, 11], [10, 11, 12]]
    """
    validate_mask(R, "R")
    if isinstance(inputs, (str, bytes)) or not hasattr(inputs, "__len__"):
        raise TypeError(
            f"inputs: expected a sequence of {R.shape[0]} token collections, got {describe(inputs)}"
        )
    if len(inputs) != R.shape[0]:
        raise ValueError(f"inputs: expected {R.shape[0]} entries, got {len(inputs)}")
    r_np = R.cpu().numpy()
    return [{t for k in np.flatnonzero(r_np[q]) for t in inputs[k]} for q in range(len(inputs))]


# ------------------------------------------------------------- per-pair first layer
def first_reach_layer(mask: torch.Tensor) -> torch.Tensor:
    """For every pair the smallest number of layers ``L >= 1`` with ``R^(L)[q, k]``, or 0
    where ``k`` never reaches ``q`` (int64, on the CPU).

    ``1`` marks ``A = mask OR I``: the mask and the diagonal the residual adds.

    >>> first_reach_layer(torch.tensor([[False, False], [True, False]])).tolist()
    [[1, 0], [1, 1]]
    >>> chain = torch.tensor([[0, 0, 0], [1, 0, 0], [0, 1, 0]], dtype=torch.bool)
    >>> first_reach_layer(chain)[2].tolist()
    [2, 1, 1]
    """
    validate_mask(mask)
    first = torch.zeros(mask.shape, dtype=torch.int64)
    for layer, reach in enumerate(reachability_sequence(mask.detach().cpu()), start=1):
        first[reach & (first == 0)] = layer
    return first


# ------------------------------------------------- long sequences: never n^2 bools


