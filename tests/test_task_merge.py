"""Task families, node equivalence and minimal merges: the paper's three case studies."""
import itertools

import networkx as nx
import pytest
import torch

from companion import masks as M
from companion import reachability as RR
from companion import task_merge as T


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
