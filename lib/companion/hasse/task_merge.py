"""Training tasks, their Hasse diagrams, node equivalence and the minimal merged task
:cite:`li2026hasse`.

Definitions
-----------
A *task* on ``P`` positions is a triple ``(inputs, targets, mask)``:

- ``inputs[p]``: the sorted tuple (a multiset) of source-token indices whose embeddings
  are summed into position ``p``'s input. ``()`` is a pure mask token; ``(t,)`` a
  content position carrying token ``t``; ``(k-1, k+1)`` an aggregate of neighbours.
- ``targets[p]``: the token index that position ``p`` is trained to predict, or None.
- ``mask``: a ``(P, P)`` bool attention mask (``mask[q, k]``: ``q`` may attend ``k``).

A task's Hasse diagram (:func:`hasse_diagram`) is the Hasse diagram of its mask
(:func:`companion.hasse.reachability.hasse_diagram`) with each node carrying ``inputs`` and
``targets`` of its members.

*Node equivalence* (the paper's Definition 3.5): two nodes, possibly of different tasks'
diagrams, are equivalent when their input multisets are equal and their upstream
dependency structures are isomorphic. **Choice made here**: a node's *signature* is
``(label, multiset of the signatures of its covers)`` with ``label`` = the sorted tuple
of its members' inputs, computed recursively and interned to integers (hash-consing).
Equal signatures mean the upstream structures, unfolded into trees, are isomorphic and
carry equal inputs at every node -- i.e. the two nodes compute the same function of the
token sequence. This coincides with isomorphism of the upstream sub-DAGs whenever no
upstream structure contains two distinct nodes with equal signatures, which holds for
every family in this module (tested). Targets do not enter the signature: whether a
node is supervised does not change what it computes.

*Minimal merged task* (Theorem 3.7): the union of all diagrams with equivalent nodes
identified. Each merged node expands to as many positions as its representative (first
occurrence) has members; members are matched across occurrences by input, then by
position; the targets of matched members are merged, and two different targets on one
member raise ``ValueError`` (the family would ask one position to predict two tokens).
The merged mask is *dense*: ``mask = R`` of the merged diagram (every position attends
everything it must depend on, so one layer suffices). With ``sparse=True`` the mask keeps
only the covering edges and full attention inside each class: the same Hasse diagram,
reached after as many layers as the longest chain (the paper's Definition 3.8).
**Choice made here**: positions are laid out in order of first appearance (tasks in the
given order, positions in task order); :func:`block_two_stream` and :func:`butterfly`
then permute to their documented layouts.

The families (**choices made here**, written out in each builder) give every task's
context the prefix/suffix structures that let tasks share nodes; with context tokens
in one bidirectional class instead, no node would be shared and the merge would grow
quadratically (see the chapter).
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import networkx as nx
import numpy as np
import torch

from companion.hasse import masks as M
from companion.hasse import reachability as RR
from companion._validate import check_bool, check_int, check_number, describe

__all__ = [
    "Task",
    "autoregressive_family",
    "bidirectional_family",
    "block_generation_family",
    "MergeCheck",
    "block_two_stream",
    "butterfly",
    "diagram_embedding",
    "hasse_diagram",
    "leaky_bidirectional",
    "masked_language_model",
    "merge_check",
    "minimal_merge",
    "node_equivalence",
    "node_signatures",
    "random_autoregressive_family",
    "self_leakage",
    "supervision_density",
    "tokens_visible",
    "upstream_classes",
]


@dataclass(frozen=True, eq=False)
class Task:
    """A training task: ``inputs[p]`` (sorted token tuple), ``targets[p]`` (token or None)
    and the ``(P, P)`` bool ``mask``. ``name`` is for display only.

    Examples
    --------
    >>> from companion.hasse.masks import causal
    >>> Task(((0,), (1,)), (None, 2), causal(2), "toy").n_positions
    2
    """

    inputs: tuple
    targets: tuple
    mask: torch.Tensor
    name: str = field(default="")

    def __post_init__(self):
        M.validate_mask(self.mask, "mask")
        size = self.mask.shape[0]
        if not isinstance(self.inputs, Sequence) or len(self.inputs) != size:
            raise ValueError(
                f"inputs: expected a sequence of {size} token tuples (one per mask row), "
                f"got {len(self.inputs) if isinstance(self.inputs, Sequence) else self.inputs!r}"
            )
        if not isinstance(self.targets, Sequence) or len(self.targets) != size:
            raise ValueError(
                f"targets: expected a sequence of {size} entries (token or None), got "
                f"{len(self.targets) if isinstance(self.targets, Sequence) else self.targets!r}"
            )
        clean_inputs = []
        for p, item in enumerate(self.inputs):
            if not isinstance(item, (tuple, list)) or not all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0
                for t in item
            ):
                raise TypeError(
                    f"inputs[{p}]: expected a tuple of non-negative token indices, got {item!r}"
                )
            clean_inputs.append(tuple(sorted(int(t) for t in item)))
        for p, t in enumerate(self.targets):
            if t is not None and (
                not isinstance(t, (int, np.integer)) or isinstance(t, bool) or t < 0
            ):
                raise TypeError(f"targets[{p}]: expected a token index or None, got {t!r}")
        object.__setattr__(self, "inputs", tuple(clean_inputs))
        object.__setattr__(
            self, "targets", tuple(None if t is None else int(t) for t in self.targets)
        )

    @property
    def n_positions(self) -> int:
        return self.mask.shape[0]

    def permute(self, order: Sequence[int]) -> Task:
        """The same task with position ``i`` of the result = position ``order[i]`` here."""
        if isinstance(order, (str, bytes)) or not hasattr(order, "__iter__"):
            raise TypeError(f"order: expected a sequence of positions, got {describe(order)}")
        order = [check_int(f"order[{i}]", p, minimum=0) for i, p in enumerate(order)]
        if sorted(order) != list(range(self.n_positions)):
            raise ValueError(f"order: expected a permutation of 0..{self.n_positions - 1}")
        idx = torch.as_tensor(order, device=self.mask.device)
        return Task(
            tuple(self.inputs[i] for i in order),
            tuple(self.targets[i] for i in order),
            self.mask[idx][:, idx],
            self.name,
        )


def _check_task(task, name="task"):
    if not isinstance(task, Task):
        raise TypeError(f"{name}: expected a Task, got {type(task).__name__}")
    return task


def _task_list(tasks) -> list[Task]:
    """``tasks`` as a non-empty list of Task (a single Task or a non-iterable is an error)."""
    if isinstance(tasks, Task) or not hasattr(tasks, "__iter__"):
        raise TypeError(f"tasks: expected a sequence of Task, got {describe(tasks)}")
    tasks = list(tasks)
    if not tasks:
        raise ValueError("tasks: expected at least one Task")
    for i, t in enumerate(tasks):
        _check_task(t, f"tasks[{i}]")
    return tasks


# --------------------------------------------------------------------- diagrams
def hasse_diagram(task: Task) -> nx.DiGraph:
    """Hasse diagram of ``task.mask`` with ``inputs`` and ``targets`` on the nodes.

    Node attributes: ``members`` (positions), ``inputs`` and ``targets`` (tuples aligned
    with ``members``).

    Examples
    --------
    >>> task = autoregressive_family(3)[1]  # tokens 0, 1 predict token 2
    >>> sorted(hasse_diagram(task).nodes(data="inputs")), sorted(hasse_diagram(task).edges)
    ([(0, ((0,),)), (1, ((1,),))], [(0, 1)])
    """
    _check_task(task)
    graph = RR.hasse_diagram(task.mask.cpu())
    for v in graph:
        members = graph.nodes[v]["members"]
        graph.nodes[v]["inputs"] = tuple(task.inputs[p] for p in members)
        graph.nodes[v]["targets"] = tuple(task.targets[p] for p in members)
    return graph


def node_signatures(tasks: Sequence[Task]) -> tuple[list[nx.DiGraph], list[dict[int, int]]]:
    """Hasse diagram of each task and the interned signature of each of its nodes.

    Signatures are integers shared across ``tasks``: equal integers = equivalent nodes.
    Complexity: ``O(sum of diagram sizes)`` dictionary operations.

    References
    ----------
    .. [1] C. Li and H. Guo, "Hasse Diagrams for Attention: A Partial Order Framework
       for Designing Transformer Masks", arXiv:2606.09951, Definition 3.5: node
       equivalence (equal input multisets, isomorphic upstream structures) (numbered by
       a secondary summary of the paper).

    Examples
    --------
    >>> _, signatures = node_signatures(autoregressive_family(2))
    >>> signatures  # position 0 of both tasks: one signature
    [{0: 0}, {0: 0, 1: 1}]
    """
    tasks = _task_list(tasks)
    table: dict = {}
    graphs, sigs = [], []
    for task in tasks:
        graph = hasse_diagram(task)
        sig: dict[int, int] = {}
        for v in nx.topological_sort(graph):
            label = tuple(sorted(graph.nodes[v]["inputs"]))
            upstream = tuple(sorted(sig[u] for u in graph.predecessors(v)))
            sig[v] = table.setdefault((label, upstream), len(table))
        graphs.append(graph)
        sigs.append(sig)
    return graphs, sigs


def node_equivalence(tasks: Sequence[Task]) -> dict[tuple[int, int], int]:
    """Equivalence classes of the nodes of all tasks' Hasse diagrams.

    Returns a dict ``(task index, node) -> class id``; class ids count up in order of
    first appearance (tasks in order, nodes in each diagram's node order).

    References
    ----------
    .. [1] C. Li and H. Guo, "Hasse Diagrams for Attention: A Partial Order Framework
       for Designing Transformer Masks", arXiv:2606.09951, Definition 3.5: node
       equivalence (numbered by a secondary summary of the paper).

    Examples
    --------
    >>> node_equivalence(autoregressive_family(2))
    {(0, 0): 0, (1, 0): 0, (1, 1): 1}
    """
    _, sigs = node_signatures(tasks)
    renumber: dict[int, int] = {}
    out = {}
    for t, sig in enumerate(sigs):
        for v in sorted(sig):
            out[(t, v)] = renumber.setdefault(sig[v], len(renumber))
    return out


def _member_order(graph, v, task):
    members = graph.nodes[v]["members"]
    return sorted(members, key=lambda p: (task.inputs[p], p))


def minimal_merge(tasks: Sequence[Task], *, sparse: bool = False, name: str = "") -> Task:
    """The minimal merged task of a family (Theorem 3.7; see the module docstring).

    Parameters
    ----------
    tasks : the family, a non-empty sequence of Task.
    sparse : bool. False: dense mask (``mask = R``). True: covering edges plus full
        attention inside each class (same Hasse diagram, more layers).
    name : name of the result.

    Returns
    -------
    Task whose Hasse diagram is the union of the family's diagrams with equivalent nodes
    identified.

    Raises
    ------
    ValueError
        If two equivalent positions carry different targets.

    References
    ----------
    .. [1] C. Li and H. Guo, "Hasse Diagrams for Attention: A Partial Order Framework
       for Designing Transformer Masks", arXiv:2606.09951, Theorem 3.7: the minimal
       merged task; Definition 3.8: its sparse variant (numbered by a secondary summary
       of the paper).

    Examples
    --------
    Causal attention is the minimal merge of the autoregressive family:

    >>> from companion.hasse.masks import causal
    >>> merged = minimal_merge(autoregressive_family(3))
    >>> merged.targets, torch.equal(merged.mask, causal(3))
    ((1, 2, 3), True)
    """
    sparse = check_bool("sparse", sparse)
    tasks = _task_list(tasks)
    graphs, sigs = node_signatures(tasks)
    rep: dict[int, tuple[int, int]] = {}  # signature -> (task, node) first seen
    first_pos: dict[int, tuple[int, int]] = {}
    merged_edges: set[tuple[int, int]] = set()
    for t, (graph, sig) in enumerate(zip(graphs, sigs)):
        for v in graph:
            s = sig[v]
            key = (t, min(graph.nodes[v]["members"]))
            rep.setdefault(s, (t, v))
            first_pos[s] = min(first_pos.get(s, key), key)
        merged_edges.update((sig[u], sig[v]) for u, v in graph.edges)
    order = sorted(rep, key=lambda s: first_pos[s])
    # slots: for each merged class, its members' inputs (from the representative)
    slots: dict[int, list[tuple]] = {}
    slot_targets: dict[int, list] = {}
    for s in order:
        t, v = rep[s]
        members = _member_order(graphs[t], v, tasks[t])
        slots[s] = [tasks[t].inputs[p] for p in members]
        slot_targets[s] = [None] * len(members)
    for t, (graph, sig) in enumerate(zip(graphs, sigs)):
        for v in graph:
            s = sig[v]
            for i, p in enumerate(_member_order(graph, v, tasks[t])):
                target = tasks[t].targets[p]
                if target is None:
                    continue
                have = slot_targets[s][i]
                if have is not None and have != target:
                    raise ValueError(
                        f"tasks: equivalent positions must not predict different tokens; "
                        f"a position with inputs {slots[s][i]} predicts both {have} and "
                        f"{target} (task {t}, position {p})"
                    )
                slot_targets[s][i] = target
    # positions and the class DAG
    class_of_position, inputs, targets = [], [], []
    index = {s: i for i, s in enumerate(order)}
    for s in order:
        for inp, tgt in zip(slots[s], slot_targets[s]):
            class_of_position.append(index[s])
            inputs.append(inp)
            targets.append(tgt)
    # the class DAG as a mask (class b attends class a for every merged edge a -> b);
    # its covers (sparse) or its closure (dense) by the bitset closure of reachability
    n_classes = len(order)
    edges = torch.as_tensor([(index[a], index[b]) for a, b in merged_edges],
                            dtype=torch.long).reshape(-1, 2)
    class_dag = torch.zeros(n_classes, n_classes, dtype=torch.bool)
    class_dag[edges[:, 1], edges[:, 0]] = True
    cls = torch.as_tensor(class_of_position)
    if sparse:
        closure = RR._closure_bitset(class_dag)  # every class is its own (acyclic)
        node_of = np.empty(n_classes, dtype=np.int64)
        node_of[closure.labels] = np.arange(n_classes)
        covers = torch.as_tensor(node_of[closure.covers.reshape(-1, 2)])
        class_mask = torch.eye(n_classes, dtype=torch.bool)
        class_mask[covers[:, 1], covers[:, 0]] = True
    else:
        class_mask = RR.order_structure(class_dag, method="bitset", compute_depth=False).R
    mask = class_mask[cls][:, cls]
    return Task(tuple(inputs), tuple(targets), mask, name)


# ------------------------------------------------- checks of a merge (reference)
def _label(graph, v):
    return tuple(sorted(graph.nodes[v]["inputs"]))


def _labelled_upstream(graph, v):
    """``v`` and its ancestors, each labelled by its sorted inputs (``v`` marked)."""
    sub = graph.subgraph(nx.ancestors(graph, v) | {v}).copy()
    for u in sub:
        sub.nodes[u]["label"] = (_label(graph, u), u == v)
    return sub


def upstream_classes(tasks: Sequence[Task]) -> dict[tuple[int, int], int]:
    """Node equivalence straight from Definition 3.5, by graph isomorphism (a reference).

    Two nodes (of any tasks' Hasse diagrams) are equivalent when their input multisets
    are equal and their upstream dependency structures (the node and its ancestors, every
    node labelled by its input multiset) are isomorphic as labelled DAGs. Each node is
    compared, with ``networkx.is_isomorphic``, with one representative of every class
    met so far that has the same label, size and multiset of upstream labels (the
    relation is an equivalence, so one comparison per class decides). Independent of the
    signatures of :func:`node_signatures`, against which it is the reference; slow
    (one isomorphism test per node and candidate class), exact.

    Returns a dict ``(task index, node) -> class id``, numbered like
    :func:`node_equivalence` (order of first appearance).

    >>> eq = upstream_classes(autoregressive_family(3))
    >>> [eq[(t, v)] for t, v in sorted(eq)]  # position j is one class in every task
    [0, 0, 1, 0, 1, 2]
    """
    tasks = _task_list(tasks)
    match = nx.algorithms.isomorphism.categorical_node_match("label", None)
    reps: dict = {}  # quick key -> list of (class id, upstream graph)
    out: dict[tuple[int, int], int] = {}
    n_classes = 0
    for t, task in enumerate(tasks):
        graph = hasse_diagram(task)
        for v in sorted(graph):
            up = _labelled_upstream(graph, v)
            key = (_label(graph, v), up.number_of_nodes(), up.number_of_edges(),
                   tuple(sorted(up.nodes[u]["label"][0] for u in up)))
            for cid, other in reps.get(key, ()):
                if nx.is_isomorphic(up, other, node_match=match):
                    out[(t, v)] = cid
                    break
            else:
                reps.setdefault(key, []).append((n_classes, up))
                out[(t, v)] = n_classes
                n_classes += 1
    return out


def diagram_embedding(task: Task, merged: Task) -> dict[int, int] | None:
    """A map of ``task``'s Hasse diagram into ``merged``'s, or None when there is none.

    The map sends each node ``v`` to a node ``f(v)`` of the merged diagram such that
    (i) ``f`` is injective, (ii) ``f(v)`` has the same input multiset as ``v``, (iii) the
    covers of ``f(v)`` are exactly the images of the covers of ``v`` (so every covering
    edge maps to a covering edge and the upstream structure of ``v`` maps onto that of
    ``f(v)``: the merged task computes what ``task`` computes), and (iv) every target of
    ``v``'s members is a target of ``f(v)``'s members with the same input. The candidate
    is found through :func:`node_signatures` and each condition is then verified
    directly on the two diagrams, so a wrong signature cannot pass unnoticed.

    >>> family = autoregressive_family(3)
    >>> diagram_embedding(family[1], minimal_merge(family))
    {0: 0, 1: 1}
    >>> diagram_embedding(bidirectional_family(3)[0], minimal_merge(family)) is None
    True
    """
    _check_task(task)
    _check_task(merged, "merged")
    (g, big), (sig, big_sig) = node_signatures([task, merged])
    by_sig: dict[int, int] = {}
    for w in sorted(big):
        by_sig.setdefault(big_sig[w], w)
    if any(sig[v] not in by_sig for v in g):
        return None
    f = {v: by_sig[sig[v]] for v in sorted(g)}
    if len(set(f.values())) != len(f):
        return None
    for v, w in f.items():
        if _label(g, v) != _label(big, w):
            return None
        if {f[u] for u in g.predecessors(v)} != set(big.predecessors(w)):
            return None
        need = Counter((i, y) for i, y in zip(g.nodes[v]["inputs"], g.nodes[v]["targets"])
                       if y is not None)
        have = Counter(zip(big.nodes[w]["inputs"], big.nodes[w]["targets"]))
        if need - have:
            return None
    return f


class MergeCheck(NamedTuple):
    """What :func:`merge_check` finds; ``minimal`` says whether all of it holds.

    Examples
    --------
    >>> family = autoregressive_family(3)
    >>> check = merge_check(family, minimal_merge(family))
    >>> check.merged_nodes, check.family_classes, check.minimal
    (3, 3, True)
    """

    embeds: tuple  # per task: its diagram embeds in the merged one (diagram_embedding)
    merged_nodes: int  # nodes of the merged Hasse diagram
    family_classes: int  # equivalence classes of the family's nodes (upstream_classes)
    equivalent_pairs: int  # pairs of merged nodes that are equivalent (should be 0)
    dense: bool  # the merged mask equals its limit R (one layer suffices)

    @property
    def minimal(self) -> bool:
        return (all(self.embeds) and self.merged_nodes == self.family_classes
                and self.equivalent_pairs == 0 and self.dense)


def merge_check(tasks: Sequence[Task], merged: Task) -> MergeCheck:
    """Check that ``merged`` is a minimal common supergraph of the family (Theorem 3.7).

    Common supergraph: every task's diagram embeds (:func:`diagram_embedding`). Minimal:
    no two merged nodes are equivalent, and the merged diagram has exactly one node per
    equivalence class of the family's nodes -- a common supergraph whose embeddings keep
    upstream structure needs at least one node per class, since two nodes with the same
    image have isomorphic upstream structures. Classes are counted with the
    isomorphism reference :func:`upstream_classes`, not with the signatures the merge
    uses. ``dense``: the merged mask is its own limit (``A = R``).

    >>> fam = block_generation_family(4, 2)
    >>> merge_check(fam, minimal_merge(fam)).minimal
    True
    >>> merge_check(fam, minimal_merge(fam[:1])).embeds
    (True, False)
    """
    tasks = _task_list(tasks)
    _check_task(merged, "merged")
    embeds = tuple(diagram_embedding(t, merged) is not None for t in tasks)
    family = upstream_classes(tasks)
    own = Counter(upstream_classes([merged]).values())
    mask = merged.mask.cpu()
    return MergeCheck(
        embeds=embeds,
        merged_nodes=len(hasse_diagram(merged)),
        family_classes=len(set(family.values())),
        equivalent_pairs=sum(c * (c - 1) // 2 for c in own.values()),
        dense=bool(torch.equal(RR.reachability_limit(mask)[0], mask | torch.eye(
            mask.shape[0], dtype=torch.bool))),
    )


# --------------------------------------------------------------------- families
def autoregressive_family(n: int) -> list[Task]:
    """Tasks ``T_k`` (``k = 1..n``): predict token ``k`` from tokens ``0..k-1``.

    ``T_k`` has ``k`` content positions carrying tokens ``0..k-1``; the last predicts
    token ``k``. **Choice**: context positions are causal (each summarises its prefix),
    so ``T_k``'s diagram is a chain and position ``j`` has the same upstream structure in
    every task that contains it. Token indices run to ``n``: the merged task has ``n``
    positions predicting tokens ``1..n`` (the usual next-token layout).

    References
    ----------
    .. [1] C. Li and H. Guo, "Hasse Diagrams for Attention: A Partial Order Framework
       for Designing Transformer Masks", arXiv:2606.09951, the autoregressive family,
       whose minimal merge is causal attention (section not known here; a secondary
       summary of the paper).

    Examples
    --------
    >>> [(task.inputs, task.targets) for task in autoregressive_family(2)]
    [(((0,),), (1,)), (((0,), (1,)), (None, 2))]
    """
    n = check_int("n", n, 1)
    return [
        Task(
            tuple((p,) for p in range(k)),
            tuple([None] * (k - 1) + [k]),
            M.causal(k),
            f"AR: predict {k}",
        )
        for k in range(1, n + 1)
    ]


def random_autoregressive_family(
    n: int, p: float = 0.1, *, generator: torch.Generator | None = None
) -> list[Task]:
    """The autoregressive family with each task's mask and layout drawn at random.

    ``T_k`` (``k = 1..n``) predicts token ``k`` from tokens ``0..k-1`` as in
    :func:`autoregressive_family`, but its mask is a random sparse mask with the same
    limit: the chain edges ``j -> j+1`` plus each earlier key ``i < j - 1`` with
    probability ``p`` (so every position reaches exactly its prefix, through up to
    ``k - 1`` layers), and its positions are put in a random order. The Hasse diagram
    of every task is still the chain, so the minimal merge must recover the causal
    mask from diagrams alone, whatever mask and order each task came with.

    >>> fam = random_autoregressive_family(5, 0.3, generator=torch.Generator().manual_seed(0))
    >>> merged = minimal_merge(fam)
    >>> order = sorted(range(5), key=lambda q: merged.inputs[q])
    >>> torch.equal(merged.permute(order).mask, M.causal(5))
    True
    """
    n = check_int("n", n, 1)
    p = check_number("p", p, minimum=0.0, maximum=1.0, expected="a probability in [0, 1]")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator or None, got {describe(generator)}")
    tasks = []
    for k in range(1, n + 1):
        extra = torch.rand(k, k, generator=generator) < p
        mask = M.chain(k) | (extra & torch.ones(k, k, dtype=torch.bool).tril(-2))
        task = Task(tuple((q,) for q in range(k)), tuple([None] * (k - 1) + [k]), mask,
                    f"AR (random mask and order): predict {k}")
        tasks.append(task.permute(torch.randperm(k, generator=generator).tolist()))
    return tasks


def block_generation_family(n: int, block: int) -> list[Task]:
    """Tasks ``T_k`` (one per block): predict the tokens of block ``k`` in one pass.

    ``n`` tokens in blocks of ``block`` (the last may be shorter). ``T_k`` has content
    positions for the tokens of blocks ``< k`` (block-causal: each content block sees
    itself and earlier blocks) followed by one mask token (inputs ``()``) per token of
    block ``k``, predicting it; mask tokens attend all content and each other (full
    connectivity inside the block), so they form one class. ``T_0`` has no content.

    References
    ----------
    .. [1] C. Li and H. Guo, "Hasse Diagrams for Attention: A Partial Order Framework
       for Designing Transformer Masks", arXiv:2606.09951, block-wise generation, whose
       minimal merge is block two-stream attention (section not known here; a secondary
       summary of the paper).

    Examples
    --------
    >>> family = block_generation_family(4, 2)
    >>> len(family), family[0].inputs, family[0].targets  # block 0: two mask tokens
    (2, ((), ()), (0, 1))
    """
    n = check_int("n", n, 1)
    block = check_int("block", block, 1)
    tasks = []
    for k in range(math.ceil(n / block)):
        c = k * block
        b = min(n, c + block) - c
        size = c + b
        mask = torch.zeros(size, size, dtype=torch.bool)
        if c:
            mask[:c, :c] = M.block_causal(c, block)
        mask[c:, :] = True
        tasks.append(
            Task(
                tuple([(p,) for p in range(c)] + [()] * b),
                tuple([None] * c + list(range(c, c + b))),
                mask,
                f"block {k}",
            )
        )
    return tasks


def _neighbour_aggregate(k: int, n: int) -> tuple[int, ...]:
    return tuple(t for t in (k - 1, k + 1) if 0 <= t < n)


def bidirectional_family(n: int) -> list[Task]:
    """Tasks ``T_k`` (``k = 0..n-1``): predict token ``k`` from every other token.

    ``T_k`` has a forward chain of content positions for tokens ``0..k-1`` (causal), a
    backward chain for tokens ``k+1..n-1`` (each sees itself and later tokens), and one
    prediction position whose input is the aggregate of its neighbours' tokens
    ``(k-1, k+1)`` (never token ``k``), attending every context position. **Choice**:
    the context is two chains rather than one bidirectional class, so that prefixes and
    suffixes are shared across tasks.

    References
    ----------
    .. [1] C. Li and H. Guo, "Hasse Diagrams for Attention: A Partial Order Framework
       for Designing Transformer Masks", arXiv:2606.09951, the bidirectional family,
       whose minimal merge is butterfly attention (section not known here; a secondary
       summary of the paper).

    Examples
    --------
    >>> task = bidirectional_family(3)[0]  # token 0 from the aggregate of its neighbours
    >>> task.inputs, task.targets
    (((1,), (2,), (1,)), (None, None, 0))
    """
    n = check_int("n", n, 2)
    tasks = []
    for k in range(n):
        f, b = k, n - 1 - k
        size = f + b + 1
        mask = torch.zeros(size, size, dtype=torch.bool)
        if f:
            mask[:f, :f] = M.causal(f)
        if b:
            mask[f : f + b, f : f + b] = M.causal(b).T  # backward chain: tokens >= own
        mask[-1, :] = True
        inputs = [(t,) for t in range(k)] + [(t,) for t in range(k + 1, n)]
        inputs.append(_neighbour_aggregate(k, n))
        tasks.append(
            Task(tuple(inputs), tuple([None] * (f + b) + [k]), mask, f"predict {k}")
        )
    return tasks


# ---------------------------------------------------------------- derived tasks
def block_two_stream(n: int, block: int) -> Task:
    """Block two-stream attention: the minimal merge of :func:`block_generation_family`.

    Layout (as :func:`companion.hasse.masks.block_two_stream_mask`): content positions for the
    tokens of blocks ``0..K-2`` in token order, then ``n`` mask-token positions, the
    ``t``-th predicting token ``t``. The last block's content is absent: no prediction
    reads it, so the minimal merge drops it (the common ``2n`` layout appends it).

    Examples
    --------
    >>> from companion.hasse.masks import block_two_stream_mask
    >>> torch.equal(block_two_stream(4, 2).mask, block_two_stream_mask(4, 2))
    True
    """
    merged = minimal_merge(block_generation_family(n, block), name="block two-stream")
    content = sorted(
        (p for p in range(merged.n_positions) if merged.inputs[p]), key=lambda p: merged.inputs[p]
    )
    masked = sorted(
        (p for p in range(merged.n_positions) if not merged.inputs[p]),
        key=lambda p: merged.targets[p],
    )
    return merged.permute(content + masked)


def butterfly(n: int) -> Task:
    """Butterfly attention: the minimal merge of :func:`bidirectional_family`.

    Layout (as :func:`companion.hasse.masks.butterfly_mask`): forward chain (tokens
    ``0..n-2``), backward chain (tokens ``1..n-1``), then ``n`` prediction positions, the
    ``k``-th predicting token ``k`` from the aggregate ``(k-1, k+1)`` and seeing every
    other token. Supervision density 1.0 and no self-leakage.

    Examples
    --------
    >>> from companion.hasse.masks import butterfly_mask
    >>> task = butterfly(3)
    >>> torch.equal(task.mask, butterfly_mask(3)), supervision_density(task), self_leakage(task)
    (True, 1.0, ())
    """
    merged = minimal_merge(bidirectional_family(n), name="butterfly")
    seen = tokens_visible(merged)
    forward, backward, predict = [], [], []
    for p in range(merged.n_positions):
        if merged.targets[p] is not None:
            predict.append(p)
            continue
        (t,) = merged.inputs[p]
        (forward if seen[p] == set(range(t + 1)) else backward).append(p)
    forward.sort(key=lambda p: merged.inputs[p])
    backward.sort(key=lambda p: merged.inputs[p])
    predict.sort(key=lambda p: merged.targets[p])
    return merged.permute(forward + backward + predict)


def masked_language_model(
    n: int, rate: float = 0.15, *, generator: torch.Generator | None = None
) -> Task:
    """BERT-style masked LM on ``n`` tokens: ``round(rate * n)`` positions (at least one)
    chosen at random get a mask token (inputs ``()``) and predict their token; the mask is
    bidirectional. (The 80/10/10 replacement rule is left out: it does not change which
    tokens are supervised.)

    Examples
    --------
    >>> task = masked_language_model(6, 0.5, generator=torch.Generator().manual_seed(0))
    >>> sum(target is not None for target in task.targets), supervision_density(task)
    (3, 0.5)
    """
    n = check_int("n", n, 1)
    rate = check_number("rate", rate, minimum=0.0, maximum=1.0, min_open=True,
                        expected="a fraction in (0, 1]")
    count = max(1, round(rate * n))
    chosen = set(torch.randperm(n, generator=generator)[:count].tolist())
    return Task(
        tuple(() if p in chosen else (p,) for p in range(n)),
        tuple(p if p in chosen else None for p in range(n)),
        M.bidirectional(n),
        "masked LM",
    )


def leaky_bidirectional(n: int) -> Task:
    """Counter-example: every position carries and predicts its own token, and the mask
    is bidirectional with an empty diagonal. The residual connection carries each
    position's own input to its output, so an empty diagonal stops nothing: every
    position leaks, at every depth.

    Examples
    --------
    >>> self_leakage(leaky_bidirectional(3))
    (0, 1, 2)
    """
    n = check_int("n", n, 2)
    mask = M.bidirectional(n) & ~torch.eye(n, dtype=torch.bool)
    return Task(tuple((p,) for p in range(n)), tuple(range(n)), mask, "zero-diagonal BERT")


# ---------------------------------------------------------------------- metrics
def tokens_visible(task: Task, layers: int | None = None) -> list[set[int]]:
    """Tokens each position can read: through the limit ``R`` (``layers=None``) or
    through ``A^layers``.

    Examples
    --------
    >>> task = autoregressive_family(3)[2]
    >>> [sorted(tokens) for tokens in tokens_visible(task)]
    [[0], [0, 1], [0, 1, 2]]
    """
    _check_task(task)
    if layers is not None:
        layers = check_int("layers", layers, minimum=0)
    mask = task.mask.cpu()
    R = RR.reachability_limit(mask)[0] if layers is None else RR.reachability(mask, layers)
    return RR.tokens_reached(R, task.inputs)


def supervision_density(task: Task) -> float:
    """Fraction of the task's tokens (all indices in ``inputs`` or ``targets``) that are
    some position's target.

    Examples
    --------
    >>> supervision_density(autoregressive_family(3)[2])  # target 3 of tokens 0-3
    0.25
    """
    _check_task(task)
    tokens = {t for inp in task.inputs for t in inp} | {t for t in task.targets if t is not None}
    if not tokens:
        return 0.0
    return len({t for t in task.targets if t is not None}) / len(tokens)


def self_leakage(task: Task, layers: int | None = None) -> tuple[int, ...]:
    """Positions whose own target token can reach them (through ``R``, or ``A^layers``).

    Empty for a task that never lets a prediction see the token it predicts.

    >>> self_leakage(butterfly(3))
    ()
    >>> len(self_leakage(leaky_bidirectional(3))) > 0
    True
    """
    seen = tokens_visible(task, layers)
    return tuple(
        p for p, t in enumerate(task.targets) if t is not None and t in seen[p]
    )
