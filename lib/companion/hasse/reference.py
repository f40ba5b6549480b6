"""The definitions of the Hasse chapter as plain code :cite:`li2026hasse`: the readable
twin of :mod:`companion.hasse.reachability` and :mod:`companion.hasse.masks`.

Dense Boolean matrices and loops, no tuning, ``O(n^3)`` per product; for checking the
fast paths at small ``n`` and for reading next to the equations:

- one layer: ``A = M OR I`` (:func:`layer_adjacency`);
- ``L`` layers: the Boolean power ``A^L`` (:func:`boolean_power`);
- the limit ``R = A^(L*)``, reached at the first ``L*`` with ``A^(L*) = A^(L*+1)``
  (:func:`reachability_limit`);
- the preorder's classes: ``p ~ q`` when ``R[p, q]`` and ``R[q, p]`` (:func:`classes`);
- the quotient order on classes and its transitive reduction, the Hasse diagram: ``a``
  is covered by ``b`` when ``a < b`` and no class ``c`` has ``a < c < b``
  (:func:`hasse_diagram`);
- each mask as an element-wise predicate on one pair ``(q, k)`` (:data:`PREDICATES`,
  :func:`dense_mask`).
"""
from __future__ import annotations

import networkx as nx
import torch

__all__ = [
    "PREDICATES",
    "boolean_power",
    "boolean_product",
    "classes",
    "dense_mask",
    "hasse_diagram",
    "layer_adjacency",
    "reachability_limit",
]


def layer_adjacency(mask: torch.Tensor) -> torch.Tensor:
    """``A = M OR I``: a query attends what its mask allows, and the residual adds itself.

    >>> layer_adjacency(torch.tensor([[False, False], [True, False]])).int().tolist()
    [[1, 0], [1, 1]]
    """
    return mask.cpu() | torch.eye(mask.shape[0], dtype=torch.bool)


def boolean_product(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``(X Y)[q, k] = OR over j of (X[q, j] AND Y[j, k])``, by the definition.

    >>> step = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    >>> boolean_product(step, step).int().tolist()
    [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """
    n = x.shape[0]
    out = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        for j in range(n):
            if x[q, j]:
                out[q] |= y[j]
    return out


def boolean_power(mask: torch.Tensor, layers: int) -> torch.Tensor:
    """``A^layers``: output ``q`` depends on input ``k`` after that many layers.
    ``A^0 = I``.

    >>> chain = torch.tensor([[0, 0, 0], [1, 0, 0], [0, 1, 0]], dtype=torch.bool)
    >>> boolean_power(chain, 2)[2].int().tolist()
    [1, 1, 1]
    """
    adj = layer_adjacency(mask)
    power = torch.eye(adj.shape[0], dtype=torch.bool)
    for _ in range(layers):
        power = boolean_product(power, adj)
    return power


def reachability_limit(mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The limit ``R`` and the depth ``L*``: the smallest ``L`` with ``A^L = A^(L+1)``.

    >>> chain = torch.tensor([[0, 0, 0], [1, 0, 0], [0, 1, 0]], dtype=torch.bool)
    >>> R, depth = reachability_limit(chain)
    >>> R.int().tolist(), depth
    ([[1, 0, 0], [1, 1, 0], [1, 1, 1]], 2)

    References
    ----------
    .. [1] C. Li and H. Guo, "Hasse Diagrams for Attention: A Partial Order Framework
       for Designing Transformer Masks", arXiv:2606.09951: the limit ``R = lim A^L``
       (the section is not known here: the abstract and a secondary summary).
    """
    adj = layer_adjacency(mask)
    power, layers = torch.eye(adj.shape[0], dtype=torch.bool), 0
    while True:
        following = boolean_product(power, adj)
        if torch.equal(following, power):
            return power, layers
        power, layers = following, layers + 1


def classes(R: torch.Tensor) -> list[tuple[int, ...]]:
    """The classes of the preorder ``R``: positions that reach each other, each class a
    sorted tuple, classes ordered by their smallest member.

    >>> classes(torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool))
    [(0, 1), (2,)]
    """
    n = R.shape[0]
    found: list[tuple[int, ...]] = []
    for p in range(n):
        if any(p in c for c in found):
            continue
        found.append(tuple(q for q in range(n) if R[p, q] and R[q, p]))
    return found


def hasse_diagram(mask: torch.Tensor) -> nx.DiGraph:
    """The Hasse diagram of the order that ``mask`` induces on its classes, by the
    definition: class ``a`` is below class ``b`` (``a < b``) when information flows from
    ``a`` to ``b`` (``R[q, k]`` for ``q`` in ``b``, ``k`` in ``a``) and ``a != b``; an
    edge ``a -> b`` when ``a < b`` with no class strictly between.

    Nodes are numbered as :func:`companion.hasse.reachability.hasse_diagram` numbers them:
    by the number of classes at or below, then by the smallest member; node attribute
    ``members``, ``graph.graph["n_positions"] = n``.

    >>> sorted(hasse_diagram(torch.tensor([[0, 0], [1, 0]], dtype=torch.bool)).edges)
    [(0, 1)]

    References
    ----------
    .. [1] C. Li and H. Guo, "Hasse Diagrams for Attention: A Partial Order Framework
       for Designing Transformer Masks", arXiv:2606.09951: the Hasse diagram of the
       partial order on the classes of ``R`` (the section is not known here: the
       abstract and a secondary summary).
    """
    R, _ = reachability_limit(mask)
    found = classes(R)

    def below(a, b):  # a < b in the quotient order
        return a != b and bool(R[found[b][0], found[a][0]])

    count = len(found)
    at_or_below = [sum(below(c, b) for c in range(count)) + 1 for b in range(count)]
    order = sorted(range(count), key=lambda c: (at_or_below[c], found[c][0]))
    graph = nx.DiGraph()
    graph.add_nodes_from((node, {"members": found[c]}) for node, c in enumerate(order))
    for a_node, a in enumerate(order):
        for b_node, b in enumerate(order):
            if below(a, b) and not any(below(a, c) and below(c, b) for c in range(count)):
                graph.add_edge(a_node, b_node)
    graph.graph["n_positions"] = int(mask.shape[0])
    return graph


# ------------------------------------------------------- masks, one pair at a time
def _butterfly(n: int):
    """Butterfly layout: forward positions ``0..n-2`` carry tokens ``0..n-2``, backward
    positions ``n-1..2n-3`` carry tokens ``1..n-1``, prediction positions ``2n-2..3n-3``
    predict tokens ``0..n-1``."""

    def part_and_token(p):
        if p < n - 1:
            return "forward", p
        if p < 2 * n - 2:
            return "backward", p - (n - 1) + 1
        return "predict", p - (2 * n - 2)

    def allowed(q, k):
        (qpart, tq), (kpart, tk) = part_and_token(q), part_and_token(k)
        if qpart == "forward":
            return kpart == "forward" and tk <= tq
        if qpart == "backward":
            return kpart == "backward" and tk >= tq
        return (q == k or (kpart == "forward" and tk < tq)
                or (kpart == "backward" and tk > tq))

    return allowed


def _block_two_stream(n: int, block: int):
    """Block two-stream layout: content positions ``0..c-1`` (tokens of all blocks but the
    last), then mask-token position ``c + t`` for each token ``t``."""
    c = ((n - 1) // block) * block

    def allowed(q, k):
        if q < c:  # content: block-causal over content
            return k < c and k // block <= q // block
        q_block = (q - c) // block
        if k < c:  # a mask token reads the content of earlier blocks ...
            return k // block < q_block
        return (k - c) // block == q_block  # ... and the mask tokens of its own block

    return allowed


def _mix32(x: int) -> int:
    """lowbias32 (C. Wellons): a 32-bit integer hash."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _random(p: float, seed: int):
    """Pair ``(q, k)``, ``q != k``, allowed when its hash falls below ``p * 2^32``."""
    threshold = int(round(p * 2**32))
    return lambda q, k: q != k and _mix32(k + _mix32(q + _mix32(seed))) < threshold


#: Each mask of :mod:`companion.hasse.masks` as a predicate ``allowed(q, k)`` on one
#: pair, by its parameters: ``PREDICATES[name](*parameters)(q, k)``.
PREDICATES = {
    "causal": lambda: lambda q, k: k <= q,
    "chain": lambda: lambda q, k: k == q - 1,
    "bidirectional": lambda: lambda q, k: True,
    "sliding_window": lambda width: lambda q, k: 0 <= q - k < width,
    "block_causal": lambda block: lambda q, k: k // block <= q // block,
    "prefix_lm": lambda prefix: lambda q, k: k < prefix or k <= q,
    "butterfly": _butterfly,
    "block_two_stream": _block_two_stream,
    "random": _random,
}


def dense_mask(allowed, size: int) -> torch.Tensor:
    """The ``(size, size)`` mask of a predicate, one pair at a time.

    >>> dense_mask(PREDICATES["causal"](), 2).int().tolist()
    [[1, 0], [1, 1]]
    """
    out = torch.zeros(size, size, dtype=torch.bool)
    for q in range(size):
        for k in range(size):
            out[q, k] = bool(allowed(q, k))
    return out
