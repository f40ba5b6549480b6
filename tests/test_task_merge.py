"""Task families, node equivalence and minimal merges: the paper's three case studies."""
import itertools

import networkx as nx
import pytest
import torch

from companion.hasse import masks as M
from companion.hasse import reachability as RR
from companion.hasse import task_merge as T


@pytest.mark.parametrize("n", [1, 2, 3, 6, 12])
def test_autoregressive_merge_is_causal(n):
    merged = T.minimal_merge(T.autoregressive_family(n))
    assert torch.equal(merged.mask, M.causal(n))
    assert merged.inputs == tuple((p,) for p in range(n))
    assert merged.targets == tuple(range(1, n + 1))
    assert T.self_leakage(merged) == ()
    assert T.supervision_density(merged) == pytest.approx(n / (n + 1))
    # sparse variant: the chain, same Hasse diagram, n - 1 layers
    sparse = T.minimal_merge(T.autoregressive_family(n), sparse=True)
    assert torch.equal(sparse.mask, M.chain(n) | torch.eye(n, dtype=torch.bool))
    assert RR.reachability_limit(sparse.mask)[1] == n - 1
    assert set(RR.hasse_diagram(sparse.mask).edges) == set(RR.hasse_diagram(merged.mask).edges)


def test_task_hasse_diagram_carries_inputs_and_targets():
    task = T.block_generation_family(6, 2)[2]
    g = T.hasse_diagram(task)
    assert [g.nodes[v]["members"] for v in g] == [(0, 1), (2, 3), (4, 5)]
    assert g.nodes[2]["inputs"] == ((), ()) and g.nodes[2]["targets"] == (4, 5)
    assert g.nodes[0]["inputs"] == ((0,), (1,)) and g.nodes[0]["targets"] == (None, None)
    assert list(g.edges) == [(0, 1), (1, 2)]


def test_node_equivalence_autoregressive():
    n = 6
    eq = T.node_equivalence(T.autoregressive_family(n))
    # position j of every task that contains it is one class: n classes in total
    assert len(set(eq.values())) == n
    for k in range(1, n + 1):
        for j in range(k):
            assert eq[(k - 1, j)] == eq[(n - 1, j)]


def _upstream(graph, v):
    sub = graph.subgraph(nx.ancestors(graph, v) | {v}).copy()
    for u in sub:
        sub.nodes[u]["label"] = (tuple(sorted(graph.nodes[u]["inputs"])), u == v)
    return sub


@pytest.mark.parametrize(
    "family",
    [
        T.autoregressive_family(4),
        T.block_generation_family(6, 2),
        T.block_generation_family(5, 3),
        T.bidirectional_family(4),
    ],
)
def test_signature_equivalence_is_upstream_isomorphism(family):
    """Equal signatures <=> isomorphic labelled upstream sub-DAGs (Definition 3.5)."""
    graphs, sigs = T.node_signatures(family)
    nodes = [(t, v) for t, g in enumerate(graphs) for v in g]
    match = nx.algorithms.isomorphism.categorical_node_match("label", None)
    for (t1, v1), (t2, v2) in itertools.combinations(nodes, 2):
        iso = nx.is_isomorphic(
            _upstream(graphs[t1], v1), _upstream(graphs[t2], v2), node_match=match
        )
        assert iso == (sigs[t1][v1] == sigs[t2][v2]), (t1, v1, t2, v2)


@pytest.mark.parametrize("n,block", [(1, 1), (4, 1), (6, 2), (7, 3), (9, 3), (8, 8), (10, 4)])
def test_block_two_stream(n, block):
    task = T.block_two_stream(n, block)
    assert torch.equal(task.mask, M.block_two_stream_mask(n, block))  # derived == closed form
    seen = T.tokens_visible(task)
    for p, target in enumerate(task.targets):
        if target is None:
            continue
        k = target // block
        assert task.inputs[p] == ()
        # a mask token for block k reads exactly the tokens of blocks < k
        assert seen[p] == set(range(k * block)), (p, target)
    c = ((n - 1) // block) * block
    for p in range(c):  # content rows: block-causal
        assert seen[p] == set(range(min(n, (p // block + 1) * block)))
    assert T.supervision_density(task) == 1.0
    assert T.self_leakage(task) == ()
    # the merged task's Hasse diagram: content chain, one mask class per block
    g = T.hasse_diagram(task)
    k_blocks = -(-n // block)
    assert g.number_of_nodes() == (k_blocks - 1) + k_blocks


@pytest.mark.parametrize("n", [2, 3, 5, 8, 11])
def test_butterfly(n):
    task = T.butterfly(n)
    assert torch.equal(task.mask, M.butterfly_mask(n))
    assert task.n_positions == 3 * n - 2
    assert T.supervision_density(task) == 1.0
    assert T.self_leakage(task) == ()
    seen = T.tokens_visible(task)
    for p, target in enumerate(task.targets):
        if target is not None:
            assert seen[p] == set(range(n)) - {target}  # full bidirectional context
            assert target not in task.inputs[p]
            assert task.inputs[p] == tuple(t for t in (target - 1, target + 1) if 0 <= t < n)
    # butterfly shape: two chains of n-1 nodes and n prediction nodes with <= 2 covers
    g = T.hasse_diagram(task)
    assert g.number_of_nodes() == 3 * n - 2
    preds = [v for v in g if g.nodes[v]["targets"][0] is not None]
    assert len(preds) == n and all(g.in_degree(v) <= 2 and g.out_degree(v) == 0 for v in preds)
    assert nx.dag_longest_path_length(g) == n - 1


def test_density_and_leakage_of_reference_tasks():
    g = torch.Generator().manual_seed(0)
    mlm = T.masked_language_model(200, 0.15, generator=g)
    assert T.supervision_density(mlm) == pytest.approx(0.15)
    assert T.self_leakage(mlm) == ()
    leaky = T.leaky_bidirectional(5)
    assert T.self_leakage(leaky) == tuple(range(5))  # zero diagonal does not stop leakage
    # the residual carries each position's own token to its output at every depth
    assert T.self_leakage(leaky, layers=1) == tuple(range(5))


def test_merge_is_idempotent_and_minimal():
    for family in (T.autoregressive_family(5), T.block_generation_family(6, 3)):
        merged = T.minimal_merge(family)
        again = T.minimal_merge([merged])
        assert torch.equal(again.mask, merged.mask) and again.targets == merged.targets
        # no two nodes of the merged diagram are equivalent
        _, sigs = T.node_signatures([merged])
        assert len(set(sigs[0].values())) == len(sigs[0])
        # every task's diagram embeds: as many merged nodes as distinct signatures
        _, fam_sigs = T.node_signatures(family)
        assert len({s for d in fam_sigs for s in d.values()}) == len(sigs[0])


def test_context_as_one_class_shares_nothing():
    """With each task's context in one bidirectional class (and a mask token predicting
    the next token), no node is shared: the merge keeps every task whole."""
    n = 5
    family = []
    for k in range(1, n + 1):
        mask = torch.ones(k + 1, k + 1, dtype=torch.bool)
        mask[:k, k] = False  # the context does not see the mask token
        inputs = tuple((p,) for p in range(k)) + ((),)
        family.append(T.Task(inputs, (None,) * k + (k,), mask))
    merged = T.minimal_merge(family)
    assert merged.n_positions == sum(k + 1 for k in range(1, n + 1))
    assert T.self_leakage(merged) == ()


def test_conflicting_targets_raise():
    a = T.Task(((0,), ()), (None, 1), M.causal(2))
    b = T.Task(((0,), ()), (None, 2), M.causal(2))
    with pytest.raises(ValueError, match="predict different tokens"):
        T.minimal_merge([a, b])


def test_bad_inputs():
    with pytest.raises(ValueError, match="inputs: expected a sequence of 2"):
        T.Task(((0,),), (None, None), M.causal(2))
    with pytest.raises(ValueError, match="targets: expected a sequence of 2"):
        T.Task(((0,), (1,)), (None,), M.causal(2))
    with pytest.raises(TypeError, match="dtype"):
        T.Task(((0,), (1,)), (None, None), torch.ones(2, 2))
    with pytest.raises(ValueError, match="non-empty"):
        T.Task((), (), torch.zeros(0, 0, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"inputs\[1\]"):
        T.Task(((0,), (-1,)), (None, None), M.causal(2))
    with pytest.raises(TypeError, match=r"targets\[0\]"):
        T.Task(((0,), (1,)), ("a", None), M.causal(2))
    with pytest.raises(ValueError, match="tasks: expected at least one"):
        T.minimal_merge([])
    with pytest.raises(TypeError, match=r"tasks\[0\]: expected a Task"):
        T.minimal_merge([M.causal(2)])
    with pytest.raises(ValueError, match="n: expected an int >= 2"):
        T.butterfly(1)
    with pytest.raises(ValueError, match="block"):
        T.block_two_stream(4, 0)
    with pytest.raises(ValueError, match="order"):
        T.block_two_stream(4, 2).permute([0, 0, 1, 2, 3, 4])


# ------------------------------------------- merge checks against networkx references
def _partition(eq):
    """A class map as a set of frozensets (numbering-free)."""
    classes = {}
    for node, c in eq.items():
        classes.setdefault(c, set()).add(node)
    return {frozenset(s) for s in classes.values()}


def _random_tasks(seed, count=4, size=5, unique_inputs=True):
    g = torch.Generator().manual_seed(seed)
    tasks = []
    for _ in range(count):
        mask = (torch.rand(size, size, generator=g) < 0.4).tril(-1)
        if unique_inputs:  # distinct tokens inside a task, shared across tasks
            tokens = torch.randperm(size + 2, generator=g)[:size].tolist()
            inputs = tuple((t,) for t in tokens)
        else:
            inputs = tuple(() if r < 2 else (0,) for r in
                           torch.randint(0, 3, (size,), generator=g).tolist())
        tasks.append(T.Task(inputs, (None,) * size, mask))
    return tasks


@pytest.mark.parametrize(
    "family",
    [T.autoregressive_family(5), T.block_generation_family(7, 2), T.bidirectional_family(5)]
    + [_random_tasks(s) for s in range(6)],
)
def test_upstream_classes_equal_signatures(family):
    """The isomorphism reference and the signatures give the same classes when no task
    repeats an input (then no upstream structure has two nodes with equal signatures)."""
    assert _partition(T.upstream_classes(family)) == _partition(T.node_equivalence(family))


@pytest.mark.parametrize("seed", range(6))
def test_upstream_classes_refine_signatures(seed):
    """With repeated inputs, isomorphic upstream structures still have equal signatures
    (signatures may only merge more, the documented choice), and the classes agree with
    pairwise networkx isomorphism."""
    family = _random_tasks(seed, unique_inputs=False)
    iso, sig = T.upstream_classes(family), T.node_equivalence(family)
    for a, b in itertools.combinations(sorted(iso), 2):
        if iso[a] == iso[b]:
            assert sig[a] == sig[b]
    graphs = [T.hasse_diagram(t) for t in family]
    match = nx.algorithms.isomorphism.categorical_node_match("label", None)
    for (t1, v1), (t2, v2) in itertools.combinations(sorted(iso), 2):
        same = nx.is_isomorphic(_upstream(graphs[t1], v1), _upstream(graphs[t2], v2),
                                node_match=match)
        assert same == (iso[(t1, v1)] == iso[(t2, v2)])


def _label_match(a, b):
    return tuple(sorted(a["inputs"])) == tuple(sorted(b["inputs"]))


@pytest.mark.parametrize(
    "family",
    [T.autoregressive_family(6), T.block_generation_family(8, 3), T.bidirectional_family(5),
     T.random_autoregressive_family(7, 0.3, generator=torch.Generator().manual_seed(1))],
)
def test_diagram_embedding_against_networkx(family):
    merged = T.minimal_merge(family)
    big = T.hasse_diagram(merged)
    for task in family:
        small = T.hasse_diagram(task)
        f = T.diagram_embedding(task, merged)
        assert f is not None
        assert sorted(f) == sorted(small) and len(set(f.values())) == len(f)
        assert all(big.has_edge(f[u], f[v]) for u, v in small.edges)  # a monomorphism
        matcher = nx.algorithms.isomorphism.DiGraphMatcher(big, small, node_match=_label_match)
        assert matcher.subgraph_is_monomorphic()
        match = nx.algorithms.isomorphism.categorical_node_match("label", None)
        for v in small:  # upstream structure kept (networkx isomorphism)
            assert nx.is_isomorphic(_upstream(small, v), _upstream(big, f[v]), node_match=match)


def test_diagram_embedding_negative_cases():
    merged = T.minimal_merge(T.autoregressive_family(4))
    big = T.hasse_diagram(merged)
    # token 1 alone: networkx finds a node with its label, but upstream is not kept
    alone = T.Task(((1,),), (None,), M.causal(1))
    assert T.diagram_embedding(alone, merged) is None
    assert nx.algorithms.isomorphism.DiGraphMatcher(
        big, T.hasse_diagram(alone), node_match=_label_match).subgraph_is_monomorphic()
    # tokens 0 -> 2 directly: no covering edge 0 -> 2 in the chain; networkx agrees
    skip = T.Task(((0,), (2,)), (None, None), M.causal(2))
    assert T.diagram_embedding(skip, merged) is None
    assert not nx.algorithms.isomorphism.DiGraphMatcher(
        big, T.hasse_diagram(skip), node_match=_label_match).subgraph_is_monomorphic()
    # a target the merged task does not have
    wrong = T.Task(((0,), (1,)), (None, 3), M.causal(2))
    assert T.diagram_embedding(wrong, merged) is None
    # random pairs: ours implies a networkx monomorphism
    for seed in range(5):
        a, b = _random_tasks(seed, count=2, size=4)
        ours = T.diagram_embedding(a, b) is not None
        theirs = nx.algorithms.isomorphism.DiGraphMatcher(
            T.hasse_diagram(b), T.hasse_diagram(a), node_match=_label_match
        ).subgraph_is_monomorphic()
        assert theirs or not ours


@pytest.mark.parametrize(
    "family",
    [T.autoregressive_family(8), T.block_generation_family(9, 2), T.bidirectional_family(6),
     T.random_autoregressive_family(8, 0.2, generator=torch.Generator().manual_seed(2))],
)
def test_merge_check_minimal_and_sparse_same_limit(family):
    merged = T.minimal_merge(family)
    check = T.merge_check(family, merged)
    assert check.minimal and all(check.embeds) and check.equivalent_pairs == 0
    assert check.merged_nodes == check.family_classes == len(
        set(T.upstream_classes(family).values()))
    sparse = T.minimal_merge(family, sparse=True)
    assert torch.equal(RR.reachability_limit(sparse.mask)[0], merged.mask)  # Definition 3.8
    assert sparse.inputs == merged.inputs and sparse.targets == merged.targets
    assert not T.merge_check(family, sparse).dense


def test_merge_check_detects_non_minimal_and_partial_merges():
    family = T.autoregressive_family(4)
    merged = T.minimal_merge(family)
    # two copies of the merged task side by side: every task embeds, but nodes repeat
    n = merged.n_positions
    double = torch.zeros(2 * n, 2 * n, dtype=torch.bool)
    double[:n, :n] = merged.mask
    double[n:, n:] = merged.mask
    twice = T.Task(merged.inputs * 2, merged.targets * 2, double)
    check = T.merge_check(family, twice)
    assert all(check.embeds) and check.equivalent_pairs == n and not check.minimal
    assert check.merged_nodes == 2 * check.family_classes
    partial = T.merge_check(family, T.minimal_merge(family[:2]))
    assert partial.embeds == (True, True, False, False) and not partial.minimal


@pytest.mark.parametrize("seed", range(2))
def test_random_autoregressive_family_merges_to_causal(seed):
    n = 64
    family = T.random_autoregressive_family(n, 0.1, generator=torch.Generator().manual_seed(seed))
    assert any(not torch.equal(t.mask, M.causal(t.n_positions)) for t in family)
    merged = T.minimal_merge(family)
    order = sorted(range(merged.n_positions), key=lambda q: merged.inputs[q])
    laid_out = merged.permute(order)
    assert torch.equal(laid_out.mask, M.causal(n))
    assert laid_out.inputs == tuple((p,) for p in range(n))
    assert laid_out.targets == tuple(range(1, n + 1))
    for task in family:  # each random mask has the chain's limit (the prefix)
        R = RR.reachability_limit(task.mask)[0]
        seen = T.tokens_visible(task)
        assert all(seen[q] == set(range(task.inputs[q][0] + 1)) for q in range(task.n_positions))
        assert R.sum() == task.n_positions * (task.n_positions + 1) // 2


def test_merge_check_bad_inputs():
    with pytest.raises(TypeError, match="merged: expected a Task"):
        T.merge_check(T.autoregressive_family(2), M.causal(2))
    with pytest.raises(TypeError, match="task: expected a Task"):
        T.diagram_embedding(None, T.minimal_merge(T.autoregressive_family(2)))
    with pytest.raises(ValueError, match="p"):
        T.random_autoregressive_family(3, 1.5)
    with pytest.raises(TypeError, match="generator"):
        T.random_autoregressive_family(3, 0.1, generator=0)
