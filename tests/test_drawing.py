"""Drawing helpers of companion.hasse.reachability: what they draw against independent references
(breadth-first search, networkx longest paths, matplotlib's own text extents), and that
circles fit their labels and nothing overlaps or is clipped."""
from collections import deque

import matplotlib
import networkx as nx
import numpy as np
import pytest
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from companion.hasse import masks as M  # noqa: E402
from companion.hasse import draw as D  # noqa: E402
from companion.hasse import reachability as RR  # noqa: E402


def _first_layer_bfs(mask):
    """Smallest L >= 1 after which k reaches q (the residual gives L = 1 on the diagonal);
    0 when never: breadth-first search on the mask graph, no matrix products."""
    n = mask.shape[0]
    m = mask.tolist()
    out = [[q for q in range(n) if m[q][k] and q != k] for k in range(n)]
    first = [[0] * n for _ in range(n)]
    for k in range(n):
        dist = {k: 0}
        queue = deque([k])
        while queue:
            v = queue.popleft()
            for w in out[v]:
                if w not in dist:
                    dist[w] = dist[v] + 1
                    queue.append(w)
        for q, d in dist.items():
            first[q][k] = max(d, 1)
    return first


def _random_masks():
    gen = torch.Generator().manual_seed(5)
    for n in (1, 2, 5, 9, 13):
        for p in (0.0, 0.15, 0.4):
            yield M.random_mask(n, p, generator=gen)
    yield M.chain(7)
    yield M.sliding_window(11, 3)
    yield M.xlnet_two_stream([2, 0, 1]).joint


@pytest.mark.parametrize("mask", list(_random_masks()))
def test_first_reach_layer_equals_breadth_first_search(mask):
    first = RR.first_reach_layer(mask)
    assert first.dtype == torch.int64
    assert first.tolist() == _first_layer_bfs(mask)
    # and against the library's own powers: reached by L layers <=> 1 <= first <= L
    for L in range(1, mask.shape[0] + 1):
        assert torch.equal((first >= 1) & (first <= L), RR.reachability(mask, L))


def test_draw_reach_layers_counts_every_pair_once_and_the_residual_diagonal():
    mask = M.xlnet_two_stream([3, 0, 4, 1, 2]).joint
    fig, ax = plt.subplots()
    counts = D.draw_reach_layers(ax, mask)
    n = mask.shape[0]
    assert sum(counts.values()) == n * n
    assert counts["mask"] == int(mask.sum())
    assert counts["residual"] == int((~mask.diagonal()).sum()) > 0
    image = ax.get_images()[0].get_array()
    assert image.shape == (n, n)
    # codes: 1 on the mask, 2 on the diagonal the mask lacks, 0 elsewhere (L* = 1 here)
    expected = mask.long().numpy() + 2 * np.diag((~mask.diagonal()).numpy())
    assert np.array_equal(np.asarray(image), expected)
    plt.close(fig)


def test_draw_reach_layers_layers_and_shared_scale():
    mask = M.sliding_window(9, 3)  # depth ceil(8 / 2) = 4
    fig, ax = plt.subplots()
    counts = D.draw_reach_layers(ax, mask, max_layer=6)
    first = _first_layer_bfs(mask)
    for layer in (2, 3, 4):
        assert counts[layer] == sum(row.count(layer) for row in first)
    assert 5 not in counts
    assert len(ax.get_images()[0].get_cmap().colors) == 3 + 5  # never, mask, residual, 2..6
    assert len(D.reach_layer_key(6)) == 2 + 5 + 1
    with pytest.raises(ValueError, match="max_layer"):
        D.draw_reach_layers(ax, mask, max_layer=3)
    with pytest.raises(TypeError, match="mask"):
        D.draw_reach_layers(ax, mask.float())
    plt.close(fig)


def _text_width_points(text, size):
    """Width of rendered text in points, measured by matplotlib's renderer (72 dpi)."""
    fig = plt.figure(dpi=72)
    t = fig.text(0, 0, text, fontsize=size)
    width = t.get_window_extent(renderer=fig.canvas.get_renderer()).width
    plt.close(fig)
    return width


@pytest.mark.parametrize("label", ["1", "0-2,5", "[m]×2\n→0,1", "1+3\n→2", "123456789"])
@pytest.mark.parametrize("size", [8, 11])
def test_label_node_size_holds_the_label(label, size):
    diameter = np.sqrt(D.label_node_size([label], size))
    widest = max(_text_width_points(line, size) for line in label.split("\n"))
    height = size * 1.2 * len(label.split("\n"))
    # the label's bounding box fits inside the circle: its half-diagonal within the radius
    assert np.hypot(widest, height * 0.9) <= diameter
    assert D.label_node_size([label], size) < D.label_node_size([label + "00"], size)


def test_label_node_size_bad_font_size():
    with pytest.raises(ValueError, match="font_size"):
        D.label_node_size(["1"], 0)


def _random_dag(n, seed):
    rng = np.random.default_rng(seed)
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    g.add_edges_from((a, b) for a in range(n) for b in range(a + 1, n) if rng.random() < 0.3)
    return nx.transitive_reduction(g)


@pytest.mark.parametrize("seed", range(6))
def test_ranked_layout_rows_are_ranks_and_nodes_keep_apart(seed):
    g = _random_dag(9, seed)
    pos = D.ranked_layout(g)
    assert set(pos) == set(g)
    for v in g:  # row = the longest path that ends at v (networkx, on v's ancestors)
        longest = nx.dag_longest_path_length(g.subgraph(nx.ancestors(g, v) | {v}))
        assert pos[v][1] == -longest
    rows = {}
    for v, (x, y) in pos.items():
        rows.setdefault(y, []).append(x)
    for xs in rows.values():
        xs = sorted(xs)
        assert all(b - a >= 1 - 1e-9 for a, b in zip(xs, xs[1:]))


def test_ranked_layout_chain_is_vertical_and_empty_graph():
    pos = D.ranked_layout(nx.path_graph(5, create_using=nx.DiGraph))
    assert {x for x, _ in pos.values()} == {0.0}
    assert D.ranked_layout(nx.DiGraph()) == {}
    with pytest.raises(TypeError, match="graph"):
        D.ranked_layout(M.causal(3))


def _circles_in_inches(ax, pos, node_size):
    """Centres (inches, figure coordinates) and radius (inches) of the drawn nodes."""
    fig = ax.figure
    to_inches = fig.dpi_scale_trans.inverted()
    centres = {v: to_inches.transform(ax.transData.transform(p)) for v, p in pos.items()}
    return centres, np.sqrt(node_size) / 72 / 2


@pytest.mark.parametrize("seed", range(4))
def test_draw_hasse_in_a_panel_of_hasse_panel_inches_keeps_circles_apart_and_inside(seed):
    g = _random_dag(8, seed)
    labels = {v: f"{v},{v + 1}" for v in g}
    size = D.label_node_size(labels, 8)
    pos = D.ranked_layout(g)
    w, h = D.hasse_panel_inches(pos, size)
    fig = plt.figure(figsize=(w + 1, h + 1))
    ax = fig.add_axes((0.5 / (w + 1), 0.5 / (h + 1), w / (w + 1), h / (h + 1)))
    D.draw_hasse(ax, g, pos=pos, labels=labels, node_size=size)
    D.fit_hasse_axes(ax, pos, size)
    centres, radius = _circles_in_inches(ax, pos, size)
    points = np.array(list(centres.values()))
    if len(points) > 1:
        gaps = [np.linalg.norm(a - b) for i, a in enumerate(points) for b in points[i + 1:]]
        assert min(gaps) >= 2 * radius * 1.5  # at least half a diameter between circles
    box = ax.get_position()
    left, bottom = box.x0 * (w + 1), box.y0 * (h + 1)
    assert (points[:, 0] - radius >= left - 1e-6).all()
    assert (points[:, 0] + radius <= left + w + 1e-6).all()
    assert (points[:, 1] - radius >= bottom - 1e-6).all()
    assert (points[:, 1] + radius <= bottom + h + 1e-6).all()
    # the default labels are the members' ranges, as format_members writes them
    texts = sorted(t.get_text() for t in ax.texts)
    assert texts == sorted(labels.values())
    plt.close(fig)


def test_draw_hasse_defaults_fit_the_labels_and_bad_graph():
    g = RR.hasse_diagram(M.block_causal(6, 3))
    fig, ax = plt.subplots()
    pos = D.draw_hasse(ax, g)
    assert sorted(t.get_text() for t in ax.texts) == ["0-2", "3-5"]
    sizes = ax.collections[0].get_sizes()
    assert np.allclose(sizes, D.label_node_size(["0-2", "3-5"], 8))
    assert pos == D.ranked_layout(g)
    with pytest.raises(TypeError, match="graph"):
        D.draw_hasse(ax, M.causal(3))
    plt.close(fig)


def test_drawing_functions_take_the_axes_first_and_name_the_older_order():
    fig, ax = plt.subplots()
    g, mask = RR.hasse_diagram(M.causal(3)), M.causal(3)
    with pytest.raises(TypeError, match=r"ax: expected a matplotlib Axes, got .*DiGraph.*"
                                        r"draw_hasse\(ax, graph, ...\)"):
        D.draw_hasse(g, ax)
    for draw in (D.draw_mask, D.draw_reach_layers):
        with pytest.raises(TypeError, match=rf"the axes come first: {draw.__name__}\(ax, mask"):
            draw(mask, ax)
        with pytest.raises(TypeError, match="ax: expected a matplotlib Axes, got None"):
            draw(None, mask)
    plt.close(fig)


@pytest.mark.parametrize("n, step", [(1, 1), (7, 1), (10, 1), (13, 2), (24, 2)])
def test_draw_mask_ticks_are_readable(n, step):
    fig, ax = plt.subplots()
    D.draw_mask(ax, M.causal(n), "causal")
    assert list(ax.get_xticks()) == list(range(0, n, step))
    assert all(t.get_fontsize() >= 8 for t in ax.get_xticklabels() + ax.get_yticklabels())
    assert ax.xaxis.label.get_fontsize() >= 8
    assert np.array_equal(np.asarray(ax.get_images()[0].get_array()), M.causal(n).numpy())
    plt.close(fig)


def test_draw_mask_rejects_a_float_mask():
    fig, ax = plt.subplots()
    with pytest.raises(TypeError, match="mask"):
        D.draw_mask(ax, torch.ones(3, 3))
    plt.close(fig)


def test_hasse_panel_inches_and_fit_axes_share_one_scale():
    size = 40.0 ** 2
    step = 40 * 1.6 / 72
    w, h = D.hasse_panel_inches({0: (0, 0), 1: (2, -3)}, size)
    assert (w, h) == pytest.approx((3 * step, 4 * step))
    assert D.hasse_panel_inches({}, size) == pytest.approx((step, step))
    fig = plt.figure(figsize=(4, 6))
    a = fig.add_axes((0, 0, 0.5, 0.5))
    b = fig.add_axes((0.5, 0.5, 0.5, 0.5))
    D.fit_hasse_axes(a, {0: (0, 0)}, size)
    D.fit_hasse_axes(b, {0: (0, 0), 1: (0, -2)}, size)
    for ax in (a, b):  # a unit is `step` inches in both directions, tops at half a unit
        x0, x1 = ax.get_xlim()
        y0, y1 = ax.get_ylim()
        assert (x1 - x0) * step == pytest.approx(2.0)
        assert (y1 - y0) * step == pytest.approx(3.0)
        assert y1 == pytest.approx(0.5)
    with pytest.raises(ValueError, match="node_size"):
        D.hasse_panel_inches({0: (0, 0)}, 0)
    plt.close(fig)
