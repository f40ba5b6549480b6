"""What the chapter measures for each statement of the paper :cite:`li2026hasse`, and the
perturbed objects (falsifiers) that must turn a measurement against the statement.

Every paper claim of the Hasse chapter is computed by one function of this module, so
that the chapter and the falsifier tests (``tests/test_falsifiers_hasse.py``) measure the
same thing. Each measurement takes the object it measures (a mask, a family of tasks, a
merged task, a network) as an argument; the falsifiers are the same measurement applied
to a perturbed object:

- layers without the residual connection (:func:`layer_limit` with ``residual=False``):
  Boolean powers of a mask without the diagonal need not settle, and their limit, where
  there is one, is not reflexive;
- families whose task diagrams are not chains (:func:`autoregressive_family_one_class`,
  :func:`block_generation_family_one_class`, :func:`bidirectional_family_one_class`:
  every task's context is one class of mutually attending positions);
- a merge that drops a covering edge (:func:`drop_cover`), and a union that identifies
  nothing (:func:`disjoint_union`);
- a block two-stream mask whose mask tokens read the content of their own block
  (:func:`block_two_stream_reading_own_block`).

References
----------
Li, C. and Guo, H., "Hasse Diagrams for Attention: A Partial Order Framework for
Designing Transformer Masks", arXiv:2606.09951 (2026).
"""
from __future__ import annotations

from collections.abc import Sequence

import networkx as nx
import numpy as np
import torch
from scipy import sparse
from scipy.sparse import csgraph

from companion._validate import check_bool, check_int, describe
from companion.hasse import masked_transformer as MT
from companion.hasse import masks as M
from companion.hasse import reachability as RR
from companion.hasse import task_merge as T

__all__ = [
    "autoregressive_family_one_class",
    "bidirectional_family_one_class",
    "block_generation_family_one_class",
    "block_two_stream_reading_own_block",
    "butterfly_merge_matches",
    "causal_merge_matches",
    "closure_by_search",
    "block_merge_matches",
    "disjoint_union",
    "drop_cover",
    "embedded_tasks",
    "jacobian_mismatches",
    "layer_limit",
    "leaking_positions",
    "limit_converges",
    "merge_is_minimal",
    "order_matches_networkx",
    "own_token_gradient_holds",
    "position_supervision_density",
    "same_mask_up_to_layout",
    "sparse_network_mismatches",
    "supervised_bidirectional_family",
    "token_supervision_density",
    "train_inference_gap",
]


# ------------------------------------------------------------- limit and preorder
def _bool_matmul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # float32 sums of 0/1 entries are exact up to n = 2**24, far beyond any n used here
    return (x.float() @ y.float()) > 0


def layer_limit(mask: torch.Tensor, *, residual: bool = True
                ) -> tuple[torch.Tensor | None, int]:
    """The limit of the Boolean powers of the layer graph, and the layer that reaches it.

    The layer graph is ``A = M OR I`` (``residual=True``, the paper's model: the residual
    connection adds every position to itself) or ``A = M`` (``residual=False``, the
    falsifier). The powers ``A^1, A^2, ...`` of a Boolean matrix are eventually periodic;
    they have a limit exactly when the period is 1, i.e. when ``A^(L+1) = A^L`` for some
    ``L`` (then every later power is the same).

    Returns
    -------
    (limit, L) : the limit and the smallest ``L >= 1`` with ``A^L = A^(L+1)``; or
    ``(None, L)`` when the powers cycle with a period > 1 (``L``: where the cycle was
    found).

    >>> ring = torch.tensor([[0, 0, 1], [1, 0, 0], [0, 1, 0]], dtype=torch.bool)
    >>> layer_limit(ring)[1], layer_limit(ring, residual=False)[0] is None
    (2, True)
    """
    M.validate_mask(mask, "mask")
    residual = check_bool("residual", residual)
    n = mask.shape[0]
    adj = mask.cpu() | torch.eye(n, dtype=torch.bool) if residual else mask.cpu().clone()
    power, layers = adj, 1
    seen = {power.numpy().tobytes(): 1}
    adj_f = adj.float()
    while True:
        following = (power.float() @ adj_f) > 0  # exact: see _bool_matmul
        if torch.equal(following, power):
            return power, layers
        power, layers = following, layers + 1
        key = power.numpy().tobytes()
        if key in seen:  # a power seen before, not the previous one: a cycle of period > 1
            return None, layers
        seen[key] = layers


def closure_by_search(mask: torch.Tensor) -> torch.Tensor:
    """Reflexive transitive closure of the mask graph by all-pairs breadth-first search
    (scipy.sparse.csgraph), independent of the Boolean powers: ``R[q, k]`` = query ``q``
    reaches key ``k`` through a path of allowed pairs (or ``q == k``).

    >>> closure_by_search(M.chain(3)).int().tolist()
    [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """
    M.validate_mask(mask, "mask")
    n = mask.shape[0]
    q, k = torch.nonzero(mask.cpu(), as_tuple=True)
    graph = sparse.csr_matrix((np.ones(len(q)), (q.numpy(), k.numpy())), shape=(n, n))
    hops = csgraph.shortest_path(graph, directed=True, unweighted=True)
    return torch.from_numpy(np.isfinite(hops))


def limit_converges(mask: torch.Tensor, *, residual: bool = True) -> bool:
    """The paper's convergence statement on one mask: the powers of the layer graph reach
    a unique limit, within ``n - 1`` layers, and the limit is the reflexive transitive
    closure of the mask graph (by breadth-first search).

    >>> limit_converges(M.chain(5)), limit_converges(M.chain(5), residual=False)
    (True, False)
    """
    limit, layers = layer_limit(mask, residual=residual)
    n = mask.shape[0]
    return bool(limit is not None and layers <= max(1, n - 1)
                and torch.equal(limit, closure_by_search(mask)))


def order_matches_networkx(mask: torch.Tensor, *, residual: bool = True) -> bool:
    """The paper's order statement on one mask: the limit ``R`` of the layer graph is
    reflexive and transitive (a preorder), and the library's classes and Hasse diagram
    (:func:`companion.hasse.reachability.order_structure`) are networkx's strongly
    connected components and the transitive reduction of the condensation.

    With ``residual=False`` the limit is that of ``A = M``; a mask without a full diagonal
    then has no reflexive limit (or none at all), and the statement fails.

    >>> order_matches_networkx(M.sliding_window(6, 3))
    True
    >>> order_matches_networkx(M.sliding_window(6, 3) & ~torch.eye(6, dtype=torch.bool),
    ...                        residual=False)
    False
    """
    limit, _ = layer_limit(mask, residual=residual)
    if limit is None:
        return False
    Rf = limit.double()
    preorder = bool(limit.diagonal().all()) and not bool(((Rf @ Rf > 0) & ~limit).any())
    res = RR.order_structure(mask.cpu())
    cond = nx.condensation(RR.mask_graph(mask.cpu()))
    nx_members = {c: frozenset(cond.nodes[c]["members"]) for c in cond}
    nx_covers = {(nx_members[a], nx_members[b]) for a, b in nx.transitive_reduction(cond).edges}
    members = {v: frozenset(res.hasse.nodes[v]["members"]) for v in res.hasse}
    covers = {(members[a], members[b]) for a, b in res.hasse.edges}
    return bool(preorder and torch.equal(res.R, limit) and nx.is_directed_acyclic_graph(res.hasse)
                and set(members.values()) == set(nx_members.values()) and covers == nx_covers)


# ---------------------------------------------------------------- a real network
def jacobian_mismatches(model: MT.MaskedTransformer, mask: torch.Tensor, x: torch.Tensor,
                        layers: int, *, residual: bool = True,
                        generator: torch.Generator | None = None) -> int:
    """Entries where the network's dependency pattern after ``layers`` layers differs from
    the paper's ``R^(L) = A^L``.

    The network (:func:`companion.hasse.masked_transformer.dependency_pattern`) always has
    its residual connections; ``residual=False`` predicts with ``A = M`` instead of
    ``M OR I`` (the falsifier: a layer graph without the residual connection's edges).

    >>> import torch
    >>> from companion.hasse import masked_transformer as MT
    >>> g = torch.Generator().manual_seed(0)
    >>> model = MT.init_masked_transformer(d_model=8, n_layers=2, max_positions=8, generator=g)
    >>> x = torch.randn(4, 8, dtype=torch.float64, generator=g)
    >>> jacobian_mismatches(model, M.chain(4), x, 2, generator=g)
    0
    >>> jacobian_mismatches(model, M.chain(4), x, 2, residual=False, generator=g) > 0
    True

    References
    ----------
    C. Li and H. Guo, arXiv 2606.09951: ``L`` layers as the Boolean power ``A^L`` of ``A = M OR I``
    (section not known here; abstract and a secondary summary).
    """
    layers = check_int("layers", layers, minimum=1)
    residual = check_bool("residual", residual)
    pattern = MT.dependency_pattern(model, x, mask, n_layers=layers, generator=generator)
    adj = mask.cpu() | torch.eye(mask.shape[0], dtype=torch.bool) if residual else mask.cpu()
    predicted = adj
    for _ in range(layers - 1):
        predicted = _bool_matmul(predicted, adj)
    return int((pattern != predicted).sum())


def sparse_network_mismatches(sparse_task: T.Task, dense_task: T.Task, *,
                              generator: torch.Generator, d_model: int = 8) -> tuple[int, int]:
    """Run a random transformer with the sparse task's mask for as many layers as its
    depth ``L*`` and compare its dependency pattern with the dense task's mask (which is
    its own limit, one layer).

    Returns ``(mismatches, layers)``: the entries where the network with the sparse mask
    and ``L*`` layers depends on an input the dense task does not read, or misses one it
    reads; and ``L*``. Definition 3.8 says the two are the same information flow: 0.

    >>> fam = T.autoregressive_family(4)
    >>> sparse, dense = T.minimal_merge(fam, sparse=True), T.minimal_merge(fam)
    >>> sparse_network_mismatches(sparse, dense, generator=torch.Generator().manual_seed(0))
    (0, 3)

    References
    ----------
    C. Li and H. Guo, arXiv 2606.09951: Definition 3.8, the sparse merge (numbered by a secondary
    summary).
    """
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator, got {describe(generator)}")
    if sparse_task.n_positions != dense_task.n_positions:
        raise ValueError("dense_task: expected as many positions as sparse_task, got "
                         f"{dense_task.n_positions} and {sparse_task.n_positions}")
    _, depth = RR.reachability_limit(sparse_task.mask.cpu())
    depth = max(1, depth)
    size = sparse_task.n_positions
    model = MT.init_masked_transformer(d_model=d_model, n_layers=depth, n_heads=2,
                                       max_positions=max(size, 1), generator=generator)
    x = torch.randn(size, d_model, dtype=torch.float64, generator=generator)
    pattern = MT.dependency_pattern(model, x, sparse_task.mask.cpu(), generator=generator)
    dense = dense_task.mask.cpu() | torch.eye(size, dtype=torch.bool)
    return int((pattern != dense).sum()), depth


def own_token_gradient_holds(model: MT.MaskedTransformer, task: T.Task,
                             token_embeddings: torch.Tensor, *,
                             generator: torch.Generator | None = None) -> bool:
    """Butterfly's statement on one network: every prediction has an exactly zero
    derivative in the raw embedding of the token it predicts, through the whole input
    construction, and a nonzero one in every other token of the sequence.

    >>> import torch
    >>> from companion.hasse import masked_transformer as MT
    >>> g = torch.Generator().manual_seed(0)
    >>> model = MT.init_masked_transformer(d_model=8, n_layers=2, max_positions=8, generator=g)
    >>> emb = torch.randn(3, 8, dtype=torch.float64, generator=g)
    >>> own_token_gradient_holds(model, T.butterfly(3), emb, generator=g)
    True
    >>> own_token_gradient_holds(model, T.leaky_bidirectional(3), emb, generator=g)
    False

    References
    ----------
    C. Li and H. Guo, arXiv 2606.09951: butterfly attention's prediction of a token does not depend
    on that token (abstract and a secondary summary).
    """
    dep = MT.token_dependencies(model, task, token_embeddings, generator=generator)
    tokens = {t for inp in task.inputs for t in inp} | {y for y in task.targets if y is not None}
    rows = [(p, y) for p, y in enumerate(task.targets) if y is not None]
    return bool(rows) and all(
        not bool(dep[p, y]) and all(bool(dep[p, t]) for t in tokens - {y}) for p, y in rows)


def train_inference_gap(model: MT.MaskedTransformer, task: T.Task,
                        token_embeddings: torch.Tensor,
                        groups: Sequence[Sequence[int]]) -> float:
    """Largest difference between one-pass training outputs and generation group by group.

    Training runs every position at once under ``task.mask``. Inference computes group
    ``g`` from the cached states of groups ``< g`` and its own inputs only: a key that
    belongs to a later group is not there yet, so it is dropped from the mask
    (:func:`companion.hasse.masked_transformer.incremental_forward` with the mask
    restricted to the past). A mask that never reads a later group gives equal outputs
    up to rounding; one that does gives a difference of the order of the outputs.

    >>> import torch
    >>> from companion.hasse import masked_transformer as MT
    >>> g = torch.Generator().manual_seed(0)
    >>> model = MT.init_masked_transformer(d_model=8, n_layers=2, max_positions=8, generator=g)
    >>> emb = torch.randn(4, 8, dtype=torch.float64, generator=g)
    >>> schedule = MT.block_two_stream_schedule(4, 2)
    >>> train_inference_gap(model, T.block_two_stream(4, 2), emb, schedule) < 1e-12
    True
    >>> train_inference_gap(model, block_two_stream_reading_own_block(4, 2), emb, schedule) > 1e-3
    True

    References
    ----------
    C. Li and H. Guo, arXiv 2606.09951: block two-stream attention, training equal to block-wise
    generation (abstract and a secondary summary).
    """
    groups = [list(g) for g in groups]
    rank = torch.empty(task.n_positions, dtype=torch.long)
    for i, g in enumerate(groups):
        rank[g] = i
    available = task.mask.cpu() & (rank[None, :] <= rank[:, None])
    x = MT.embed_task_inputs(model, task, token_embeddings)
    one_pass = MT.masked_transformer(model, x, task.mask.cpu())
    incremental = MT.incremental_forward(model, x, available, groups)
    return float((one_pass - incremental).abs().max())


# ------------------------------------------------------------------ the merges
def _one_class(task: T.Task, context: Sequence[int]) -> T.Task:
    mask = task.mask.clone()
    idx = torch.as_tensor(list(context), dtype=torch.long)
    if len(idx):
        mask[idx[:, None], idx[None, :]] = True
    return T.Task(task.inputs, task.targets, mask, task.name + " (one context class)")


def autoregressive_family_one_class(n: int) -> list[T.Task]:
    """The autoregressive family with every task's context in one class: the positions
    of tokens ``0..k-1`` of task ``T_k`` all attend each other (a diagram that is not a
    chain). The falsifier of the causal merge.

    >>> len(T.minimal_merge(autoregressive_family_one_class(4)).inputs)
    10
    """
    return [_one_class(t, range(t.n_positions)) for t in T.autoregressive_family(n)]


def block_generation_family_one_class(n: int, block: int) -> list[T.Task]:
    """The block generation family with every task's content (blocks ``< k``) in one
    class instead of block-causal. The falsifier of the block two-stream merge.

    >>> block_merge_matches(block_generation_family_one_class(6, 2), 6, 2)
    False
    """
    return [_one_class(t, [p for p, inp in enumerate(t.inputs) if inp])
            for t in T.block_generation_family(n, block)]


def bidirectional_family_one_class(n: int) -> list[T.Task]:
    """The bidirectional family with every task's context (the two chains) in one class.
    The falsifier of the butterfly merge.

    >>> butterfly_merge_matches(bidirectional_family_one_class(4), 4)
    False
    """
    return [_one_class(t, [p for p, y in enumerate(t.targets) if y is None])
            for t in T.bidirectional_family(n)]


def supervised_bidirectional_family(n: int) -> list[T.Task]:
    """The bidirectional family plus next-token tasks on the forward chain (predict token
    ``t+1`` from ``0..t``) and previous-token tasks on the backward chain (predict ``t-1``
    from ``t..n-1``). Context nodes are the same as the butterfly's, so the merge keeps
    the butterfly's mask and supervises its chain positions too (our construction, not the
    paper's).

    >>> merged = T.minimal_merge(supervised_bidirectional_family(4))
    >>> same_mask_up_to_layout(merged, T.butterfly(4)), position_supervision_density(merged)
    (True, 1.0)
    """
    n = check_int("n", n, 2)
    tasks = list(T.bidirectional_family(n))
    for t in range(n - 1):  # forward: tokens 0..t, the last predicts t + 1
        tasks.append(T.Task(tuple((i,) for i in range(t + 1)), tuple([None] * t + [t + 1]),
                            M.causal(t + 1), f"next token {t + 1}"))
    for t in range(1, n):  # backward: tokens t..n-1, the first (token t) predicts t - 1
        size = n - t
        tasks.append(T.Task(tuple((i,) for i in range(t, n)),
                            tuple([t - 1] + [None] * (size - 1)), M.causal(size).T,
                            f"previous token {t - 1}"))
    return tasks


def causal_merge_matches(family: Sequence[T.Task], n: int) -> bool:
    """The minimal merge of ``family``, positions sorted by their tokens, is the causal
    mask on ``n`` positions carrying tokens ``0..n-1`` and predicting tokens ``1..n``.

    >>> causal_merge_matches(T.autoregressive_family(5), 5)
    True
    >>> causal_merge_matches(autoregressive_family_one_class(5), 5)
    False
    """
    n = check_int("n", n, 1)
    merged = T.minimal_merge(family)
    if merged.n_positions != n:
        return False
    laid = merged.permute(sorted(range(n), key=lambda q: merged.inputs[q]))
    return bool(torch.equal(laid.mask, M.causal(n))
                and laid.inputs == tuple((p,) for p in range(n))
                and laid.targets == tuple(range(1, n + 1)))


def block_merge_matches(family: Sequence[T.Task], n: int, block: int) -> bool:
    """The minimal merge of ``family`` is block two-stream attention as the paper
    describes it: content (block-causal) first, then one mask token per token at the
    end, the mask tokens of block ``k`` reading the content of blocks ``< k`` and each
    other, never their own block's content
    (:func:`companion.hasse.masks.block_two_stream_mask`).

    >>> block_merge_matches(T.block_generation_family(6, 2), 6, 2)
    True
    >>> block_merge_matches(block_generation_family_one_class(6, 2), 6, 2)
    False
    """
    n, block = check_int("n", n, 1), check_int("block", block, 1)
    merged = T.minimal_merge(family)
    expected = M.block_two_stream_mask(n, block)
    if merged.n_positions != expected.shape[0]:
        return False
    content = sorted((p for p in range(merged.n_positions) if merged.inputs[p]),
                     key=lambda p: merged.inputs[p])
    masked = sorted((p for p in range(merged.n_positions) if not merged.inputs[p]),
                    key=lambda p: (merged.targets[p] is None, merged.targets[p] or 0))
    laid = merged.permute(content + masked)
    c = len(content)
    return bool(torch.equal(laid.mask, expected)
                and laid.inputs == tuple([(t,) for t in range(c)] + [()] * n)
                and laid.targets == tuple([None] * c + list(range(n))))


def butterfly_merge_matches(family: Sequence[T.Task], n: int) -> bool:
    """The minimal merge of ``family`` is butterfly attention: a forward chain (tokens
    ``0..n-2``), a backward chain (tokens ``1..n-1``) and ``n`` prediction positions,
    the ``k``-th predicting token ``k`` from the aggregate of its neighbours and reading
    every token but ``k`` (:func:`companion.hasse.masks.butterfly_mask`).

    >>> butterfly_merge_matches(T.bidirectional_family(5), 5)
    True
    >>> butterfly_merge_matches(bidirectional_family_one_class(5), 5)
    False
    """
    n = check_int("n", n, 2)
    merged = T.minimal_merge(family)
    if merged.n_positions != 3 * n - 2:
        return False
    seen = T.tokens_visible(merged)
    forward, backward, predict = [], [], []
    for p in range(merged.n_positions):
        if merged.targets[p] is not None:
            predict.append(p)
        elif len(merged.inputs[p]) == 1 and seen[p] == set(range(merged.inputs[p][0] + 1)):
            forward.append(p)
        else:
            backward.append(p)
    forward.sort(key=lambda p: merged.inputs[p])
    backward.sort(key=lambda p: merged.inputs[p])
    predict.sort(key=lambda p: merged.targets[p])
    laid = merged.permute(forward + backward + predict)
    full_context = all(seen[p] == set(range(n)) - {merged.targets[p]} for p in predict)
    return bool(full_context and torch.equal(laid.mask, M.butterfly_mask(n))
                and laid.targets[2 * n - 2:] == tuple(range(n)))


def same_mask_up_to_layout(a: T.Task, b: T.Task) -> bool:
    """Whether ``a`` and ``b`` are the same mask on the same inputs, up to the order of
    their positions (targets aside): each position is named by its input tokens, the
    tokens it reaches and how many positions reach it; the names must be distinct and
    shared, and the masks must agree.

    >>> same_mask_up_to_layout(T.butterfly(4), T.minimal_merge(T.bidirectional_family(4)))
    True
    """
    def names(task):
        R = RR.reachability_limit(task.mask.cpu())[0]
        seen = RR.tokens_reached(R, task.inputs)
        readers = R.sum(dim=0).tolist()
        return [(task.inputs[p], frozenset(seen[p]), readers[p])
                for p in range(task.n_positions)]

    na, nb = names(a), names(b)
    if len(set(na)) != len(na) or set(na) != set(nb):
        return False
    where = {name: p for p, name in enumerate(nb)}
    order = torch.as_tensor([where[name] for name in na])
    return bool(torch.equal(a.mask.cpu(), b.mask.cpu()[order][:, order]))


def embedded_tasks(family: Sequence[T.Task], merged: T.Task) -> int:
    """How many tasks of ``family`` have a Hasse diagram that embeds in ``merged``'s
    (:func:`companion.hasse.task_merge.diagram_embedding`: same inputs, covers onto
    covers, targets kept).

    >>> fam = T.autoregressive_family(3)
    >>> embedded_tasks(fam, T.minimal_merge(fam))
    3

    References
    ----------
    C. Li and H. Guo, arXiv 2606.09951: the minimal merged task is a common supergraph of the
    family's Hasse diagrams (Theorem 3.7, numbered by a secondary summary).
    """
    return sum(T.diagram_embedding(t, merged) is not None for t in family)


def merge_is_minimal(family: Sequence[T.Task], merged: T.Task,
                     check: T.MergeCheck | None = None) -> bool:
    """``merged`` has exactly one node per equivalence class of the family's nodes (by
    isomorphism of upstream structures, :func:`companion.hasse.task_merge.upstream_classes`),
    no two equivalent nodes, and a dense mask (``A = R``).

    ``check``: the :func:`companion.hasse.task_merge.merge_check` of ``family`` and
    ``merged`` when it is already computed (it is the slow part), else None.

    >>> fam = T.autoregressive_family(3)
    >>> merge_is_minimal(fam, T.minimal_merge(fam)), merge_is_minimal(fam, disjoint_union(fam))
    (True, False)

    References
    ----------
    C. Li and H. Guo, arXiv 2606.09951: Definition 3.5 (node equivalence) and Theorem 3.7 (the
    minimal merged task), numbered by a secondary summary.
    """
    if check is None:
        check = T.merge_check(family, merged)
    elif not isinstance(check, T.MergeCheck):
        raise TypeError(f"check: expected a MergeCheck or None, got {describe(check)}")
    return bool(check.merged_nodes == check.family_classes and check.equivalent_pairs == 0
                and check.dense)


def disjoint_union(family: Sequence[T.Task]) -> T.Task:
    """All tasks side by side, nothing identified: a common supergraph of the family's
    diagrams that is not minimal (the falsifier of minimality).

    >>> disjoint_union(T.autoregressive_family(3)).n_positions
    6
    """
    family = list(family)
    if not family:
        raise ValueError("family: expected at least one Task")
    size = sum(t.n_positions for t in family)
    mask = torch.zeros(size, size, dtype=torch.bool)
    start = 0
    for t in family:
        end = start + t.n_positions
        mask[start:end, start:end] = t.mask.cpu()
        start = end
    return T.Task(sum((t.inputs for t in family), ()), sum((t.targets for t in family), ()),
                  mask, "disjoint union")


def drop_cover(task: T.Task, which: int = 0, *, close: bool = True) -> T.Task:
    """``task`` with one covering edge of its Hasse diagram removed (the ``which``-th in
    sorted order): the lower class no longer reads the upper one directly.

    ``close=True`` (for a dense mask, as a minimal merge's is): the result's mask is the
    limit of what remains, so the lower class loses everything only that edge brought.
    ``close=False`` (for a sparse merge, covering edges only): the mask minus that edge.

    >>> fam = T.autoregressive_family(3)
    >>> embedded_tasks(fam, drop_cover(T.minimal_merge(fam)))
    1
    """
    which = check_int("which", which, minimum=0)
    close = check_bool("close", close)
    graph = T.hasse_diagram(task)
    edges = sorted(graph.edges)
    if which >= len(edges):
        raise ValueError(f"which: expected an index below {len(edges)} (covering edges), "
                         f"got {which}")
    u, v = edges[which]
    mask = task.mask.cpu().clone()
    up = torch.as_tensor(sorted(graph.nodes[u]["members"]))
    down = torch.as_tensor(sorted(graph.nodes[v]["members"]))
    mask[down[:, None], up[None, :]] = False
    if close:
        mask = RR.reachability_limit(mask)[0]
    return T.Task(task.inputs, task.targets, mask, task.name + " (a cover dropped)")


# ------------------------------------------------------- supervision and leakage
def position_supervision_density(task: T.Task) -> float:
    """Fraction of the task's positions that are trained to predict a token.

    >>> position_supervision_density(T.butterfly(4))
    0.4
    """
    if not isinstance(task, T.Task):
        raise TypeError(f"task: expected a Task, got {describe(task)}")
    return sum(y is not None for y in task.targets) / task.n_positions


def token_supervision_density(task: T.Task) -> float:
    """Fraction of the sequence's tokens that some position predicts
    (:func:`companion.hasse.task_merge.supervision_density`).

    >>> token_supervision_density(T.butterfly(4))
    1.0
    """
    return T.supervision_density(task)


def leaking_positions(tasks: Sequence[T.Task]) -> int:
    """Positions, over ``tasks``, that reach the token they predict through the limit
    ``R`` (:func:`companion.hasse.task_merge.self_leakage`).

    >>> leaking_positions([T.butterfly(4), T.leaky_bidirectional(4)]) > 0
    True
    >>> leaking_positions([T.butterfly(4)])
    0
    """
    return sum(len(T.self_leakage(t)) for t in tasks)


def block_two_stream_reading_own_block(n: int, block: int) -> T.Task:
    """Block two-stream attention with each mask token also reading the content of its
    own block (where the layout has it): the falsifier of no leakage and of training
    equal to inference (at inference that content is not generated yet).

    >>> leaking_positions([block_two_stream_reading_own_block(6, 2)])
    4
    """
    task = T.block_two_stream(n, block)
    mask = task.mask.clone()
    content_of = {inp[0]: p for p, inp in enumerate(task.inputs) if inp}
    for p, y in enumerate(task.targets):
        if y is None:
            continue
        start = (y // block) * block
        for t in range(start, min(n, start + block)):
            if t in content_of:
                mask[p, content_of[t]] = True
    return T.Task(task.inputs, task.targets, mask, "block two-stream, own block read")
