"""Drawing the objects of :mod:`companion.hasse.reachability`: masks as heat maps, how
reachability grows layer by layer, and Hasse diagrams (layouts, node sizes, panel sizes).

Matrix convention as in :mod:`companion.hasse.reachability`: rows are queries (receivers),
columns keys (sources); Hasse edges point the way information flows, drawn top to bottom.
"""
from __future__ import annotations

import networkx as nx
import numpy as np
import torch

from companion._validate import check_int, check_number, describe
from companion.hasse.masks import validate_mask
from companion.hasse.reachability import first_reach_layer

__all__ = [
    "draw_hasse",
    "draw_mask",
    "draw_reach_layers",
    "fit_hasse_axes",
    "format_members",
    "hasse_layout",
    "hasse_panel_inches",
    "label_node_size",
    "ranked_layout",
    "reach_layer_key",
]


def format_members(members) -> str:
    """Compact label for a class: ``(0, 1, 2, 5)`` -> ``"0-2,5"``.

    Examples
    --------
    >>> format_members((0, 1, 2, 5, 7, 8))
    '0-2,5,7-8'
    """
    members = sorted(members)
    parts, start, prev = [], None, None
    for m in members:
        if start is None:
            start = prev = m
        elif m == prev + 1:
            prev = m
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = m
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(parts)


def hasse_layout(graph: nx.DiGraph, *, key=None) -> dict:
    """Layered top-down layout: sources at the top, each node one row below its lowest
    cover, nodes in a row ordered by ``key(node)`` (default: smallest member).

    Examples
    --------
    >>> hasse_layout(nx.DiGraph([(0, 1), (0, 2)]))
    {0: (0.0, 0), 1: (-0.5, -1), 2: (0.5, -1)}
    """
    if not isinstance(graph, nx.DiGraph):
        raise TypeError(f"graph: expected a networkx.DiGraph, got {describe(graph)}")
    if key is None:

        def key(node):
            members = graph.nodes[node].get("members", (node,))
            return (min(members) if members else 0, node)

    pos = {}
    for depth, generation in enumerate(nx.topological_generations(graph)):
        row = sorted(generation, key=key)
        width = len(row)
        for i, node in enumerate(row):
            pos[node] = (i - (width - 1) / 2, -depth)
    return pos


def label_node_size(labels, font_size: float = 8.0, *, pad: float = 0.45) -> float:
    """Marker area (points squared, networkx's ``node_size``) of a circle that holds the
    widest of ``labels`` at ``font_size`` points, with ``pad`` font sizes of margin.

    Text is measured with matplotlib's own glyph metrics (multi-line labels: widest
    line, lines stacked at 1.2 font sizes).

    >>> label_node_size(["1"], 8) < label_node_size(["0-2,5"], 8)
    True
    >>> round(label_node_size([], 8))  # no labels: room for one digit
    261
    """
    from matplotlib.textpath import TextPath

    font_size = check_number("font_size", font_size, minimum=1)
    if isinstance(labels, dict):
        labels = list(labels.values())
    texts = [str(t) for t in labels] or ["0"]
    diameter = 0.0
    for text in texts:
        lines = text.split("\n")
        width = max(TextPath((0, 0), line or " ", size=font_size).get_extents().width
                    for line in lines)
        height = font_size * (1.2 * len(lines) - 0.2)
        diameter = max(diameter, float(np.hypot(width, height)))
    return (diameter + 2 * pad * font_size) ** 2


def ranked_layout(graph: nx.DiGraph, *, key=None) -> dict:
    """Layout by rank: :func:`hasse_layout`'s rows (sources on top, a node one row below
    its lowest cover), the top row centred, and each lower row, from the top, placed
    under its nodes' covers: ordered by the mean x of a node's covers (ties by ``key``,
    default smallest member), each node as close to that mean as a spacing of at least
    one unit allows. Rows are one unit apart.

    >>> g = nx.DiGraph([(0, 1), (0, 2), (2, 3)])
    >>> pos = ranked_layout(g)
    >>> pos[0], pos[1], pos[2], pos[3]
    ((0.0, 0), (-0.5, -1), (0.5, -1), (0.5, -2))
    """
    base = hasse_layout(graph, key=key)
    if key is None:

        def key(node):
            members = graph.nodes[node].get("members", (node,))
            return (min(members) if members else 0, node)

    rows: dict[float, list] = {}
    for node, (_, y) in base.items():
        rows.setdefault(y, []).append(node)
    pos: dict = {}
    for y in sorted(rows, reverse=True):
        if not pos:
            row = sorted(rows[y], key=key)
            pos.update({v: (i - (len(row) - 1) / 2, y) for i, v in enumerate(row)})
            continue
        want = {v: float(np.mean([pos[u][0] for u in graph.predecessors(v)])) for v in rows[y]}
        row = sorted(rows[y], key=lambda v: (want[v], key(v)))
        xs = [want[v] for v in row]
        for i in range(1, len(xs)):  # push right until one unit apart ...
            xs[i] = max(xs[i], xs[i - 1] + 1)
        shift = float(np.mean([want[v] for v in row]) - np.mean(xs))
        xs = [x + shift for x in xs]  # ... then centre the row on what its nodes want
        pos.update({v: (float(x), y) for v, x in zip(row, xs)})
    return pos


def hasse_panel_inches(pos: dict, node_size: float, *, gap: float = 0.6) -> tuple[float, float]:
    """Width and height (inches) of the axes :func:`draw_hasse` needs for nodes of area
    ``node_size`` (points squared) at the unit-spaced positions ``pos`` (as
    :func:`ranked_layout` gives), neighbours ``gap`` node diameters apart.

    :func:`draw_hasse` shows half a unit around the outermost nodes, at equal scale in x
    and y; an axes this large shows the circles at their size without overlap.

    >>> w, h = hasse_panel_inches({0: (0, 0), 1: (1, 0), 2: (0, -1)}, 30.0 ** 2)
    >>> round(w, 3), round(h, 3)
    (1.333, 1.333)
    """
    node_size = check_number("node_size", node_size, minimum=1)
    gap = check_number("gap", gap, minimum=0)
    step = float(np.sqrt(node_size)) * (1 + gap) / 72  # inches per unit of the layout
    if not pos:
        return (step, step)
    xs = [x for x, _ in pos.values()]
    ys = [y for _, y in pos.values()]
    return (float((max(xs) - min(xs) + 1) * step), float((max(ys) - min(ys) + 1) * step))


def fit_hasse_axes(ax, pos: dict, node_size: float, *, gap: float = 0.6) -> None:
    """Set the limits of ``ax`` so that one unit of ``pos`` is the spacing
    :func:`hasse_panel_inches` assumes (``gap`` node diameters between neighbours),
    whatever the axes' size: the drawing is centred left to right and hangs from the top,
    so diagrams in a row of panels share one scale and their first rows line up.
    Call it once the axes has its final place in the figure (after any ``tight_layout``).

    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> import matplotlib.pyplot as plt
    >>> fig = plt.figure(figsize=(2, 2)); ax = fig.add_axes((0, 0, 1, 1))
    >>> fit_hasse_axes(ax, {0: (0, 0), 1: (0, -1)}, 45.0 ** 2)  # a unit = 1 in
    >>> [float(v) for v in ax.get_xlim() + ax.get_ylim()]
    [-1.0, 1.0, -1.5, 0.5]
    >>> plt.close(fig)
    """
    node_size = check_number("node_size", node_size, minimum=1)
    gap = check_number("gap", gap, minimum=0)
    if not pos:
        return
    step = float(np.sqrt(node_size)) * (1 + gap) / 72
    ax.set_aspect("auto")  # before reading the box: an equal aspect would have shrunk it
    box = ax.get_position(original=True)
    fig_w, fig_h = ax.figure.get_size_inches()
    width, height = box.width * fig_w / step, box.height * fig_h / step
    xs = [x for x, _ in pos.values()]
    top = max(y for _, y in pos.values()) + 0.5
    centre = (min(xs) + max(xs)) / 2
    ax.set_xlim(float(centre - width / 2), float(centre + width / 2))
    ax.set_ylim(float(top - height), float(top))


def _check_axes(function: str, ax, drawn: str) -> None:
    """Drawing functions take the axes first, as matplotlib's helpers do."""
    if hasattr(ax, "figure") and hasattr(ax, "imshow"):
        return
    hint = ""
    if isinstance(ax, (nx.Graph, torch.Tensor)):
        hint = (f" (the axes come first: {function}(ax, {drawn}, ...); "
                f"{function}({drawn}, ax) was the older order)")
    raise TypeError(f"ax: expected a matplotlib Axes, got {describe(ax)}{hint}")


def draw_hasse(
    ax,
    graph: nx.DiGraph,
    *,
    pos=None,
    labels=None,
    node_color="#cfe2f3",
    node_size=None,
    font_size=8,
    connectionstyle="arc3",
):
    """Draw a Hasse diagram on ``ax`` (arrows = information flow, top to bottom); the axes
    come first, as in :func:`draw_mask` and matplotlib's own helpers.

    ``pos``: node -> (x, y), default :func:`ranked_layout`. ``labels``: node -> text
    (default: compact member ranges, :func:`format_members`). ``node_size``: marker area
    in points squared; default :func:`label_node_size`, the smallest circle that holds
    every label at ``font_size``. The axes limits leave room for the circles, so nothing
    is clipped when the axes is at least :func:`hasse_panel_inches` large.
    ``connectionstyle``: matplotlib's, e.g. ``"arc3,rad=0.5"`` to bend edges that would
    overlap a chain. Returns the positions used.

    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> import matplotlib.pyplot as plt
    >>> fig, ax = plt.subplots()
    >>> sorted(draw_hasse(ax, nx.DiGraph([(0, 1), (0, 2)])).items())
    [(0, (0.0, 0)), (1, (-0.5, -1)), (2, (0.5, -1))]
    >>> plt.close(fig)
    """
    _check_axes("draw_hasse", ax, "graph")
    if not isinstance(graph, nx.DiGraph):
        raise TypeError(f"graph: expected a networkx.DiGraph, got {describe(graph)}")
    pos = ranked_layout(graph) if pos is None else pos
    if labels is None:
        labels = {v: format_members(graph.nodes[v].get("members", (v,))) for v in graph}
    if node_size is None:
        node_size = label_node_size(labels, font_size)
    nx.draw_networkx_edges(
        graph, pos, ax=ax, arrows=True, arrowsize=10, node_size=node_size,
        edge_color="#555555", connectionstyle=connectionstyle,
    )
    nx.draw_networkx_nodes(
        graph, pos, ax=ax, node_color=node_color, node_size=node_size, edgecolors="#333333"
    )
    nx.draw_networkx_labels(graph, pos, labels=labels, ax=ax, font_size=font_size)
    ax.set_axis_off()
    if pos:
        # room for the circles (half a unit around the outermost centres), and the same
        # scale in x and y so that spacing and circles look alike in every panel
        xs = [x for x, _ in pos.values()]
        ys = [y for _, y in pos.values()]
        ax.set_xlim(min(xs) - 0.5, max(xs) + 0.5)
        ax.set_ylim(min(ys) - 0.5, max(ys) + 0.5)
        ax.set_aspect("equal")
    return pos


def draw_mask(ax, mask: torch.Tensor, title: str | None = None, *, cmap="Blues",
              font_size: float = 8):
    """Heat map of a bool mask: rows = query (receiver) q, columns = key (source) k.

    Dark = allowed (``True``). Positions are numbered from 0; for ``n <= 24`` every
    position gets a tick and every second one (every one for ``n <= 10``) a label, at
    ``font_size`` points. Returns ``ax``.

    Examples
    --------
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> import matplotlib.pyplot as plt
    >>> from companion.hasse.masks import causal
    >>> fig, ax = plt.subplots()
    >>> draw_mask(ax, causal(3), "causal") is ax
    True
    >>> plt.close(fig)
    """
    _check_axes("draw_mask", ax, "mask")
    validate_mask(mask)
    m = mask.detach().cpu().to(torch.float32).numpy()
    ax.imshow(m, cmap=cmap, vmin=0, vmax=1.25, interpolation="nearest")
    _position_axes(ax, m.shape[0], font_size)
    if title:
        ax.set_title(title, fontsize=font_size + 1)
    return ax


def _position_axes(ax, n: int, font_size: float) -> None:
    ax.set_xlabel("key position k", fontsize=font_size)
    ax.set_ylabel("query position q", fontsize=font_size)
    if n <= 24:
        step = 1 if n <= 10 else 2
        ax.set_xticks(range(n), minor=True)
        ax.set_yticks(range(n), minor=True)
        ax.set_xticks(range(0, n, step))
        ax.set_yticks(range(0, n, step))
    ax.tick_params(labelsize=font_size)


_MASK_COLOUR = "#08306b"      # Blues' darkest: the mask itself
_RESIDUAL_COLOUR = "#e66101"  # the diagonal A = M OR I adds
_NEVER_COLOUR = "#ffffff"


def _layer_colours(max_layer: int) -> list:
    """Colours of layers 2..max_layer: lighter for later (Blues from 0.75 to 0.3)."""
    import matplotlib.pyplot as plt

    count = max(max_layer - 1, 0)
    return [plt.cm.Blues(v) for v in np.linspace(0.75, 0.3, count)] if count else []


def draw_reach_layers(ax, mask: torch.Tensor, *, max_layer: int | None = None,
                      title: str | None = None, font_size: float = 8):
    """One heat map of how reachability grows with depth: each pair coloured by the first
    layer at which output ``q`` depends on input ``k`` (:func:`first_reach_layer`).

    Mask entries are darkest blue, the diagonal the residual connection adds to the mask
    (``A = M OR I``) orange, pairs first reached at layer 2, 3, ... lighter blues, pairs
    never reached white. ``max_layer`` fixes the colour scale (default: this mask's
    depth) so that several panels share one key (:func:`reach_layer_key`). Returns the
    counts drawn: ``{"mask": ..., "residual": ..., 2: ..., 3: ..., "never": ...}``.

    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> import matplotlib.pyplot as plt
    >>> fig, ax = plt.subplots()
    >>> draw_reach_layers(ax, torch.tensor([[0, 0], [1, 0]], dtype=torch.bool))
    {'mask': 1, 'residual': 2, 'never': 1}
    >>> plt.close(fig)
    """
    from matplotlib.colors import BoundaryNorm, ListedColormap

    _check_axes("draw_reach_layers", ax, "mask")
    validate_mask(mask)
    first = first_reach_layer(mask)
    deepest = int(first.max())
    if max_layer is None:
        max_layer = max(deepest, 1)
    max_layer = check_int("max_layer", max_layer, minimum=1)
    if deepest > max_layer:
        raise ValueError(f"max_layer: expected at least this mask's depth {deepest}, "
                         f"got {max_layer}")
    m = mask.detach().cpu()
    residual = (first == 1) & ~m
    # codes: 0 never, 1 mask, 2 residual diagonal, L + 1 first reached at layer L >= 2
    code = torch.where(first >= 2, first + 1, torch.zeros_like(first))
    code[m] = 1
    code[residual] = 2
    colours = [_NEVER_COLOUR, _MASK_COLOUR, _RESIDUAL_COLOUR] + _layer_colours(max_layer)
    cmap = ListedColormap(colours)
    norm = BoundaryNorm(np.arange(len(colours) + 1) - 0.5, len(colours))
    ax.imshow(code.numpy(), cmap=cmap, norm=norm, interpolation="nearest")
    _position_axes(ax, m.shape[0], font_size)
    if title:
        ax.set_title(title, fontsize=font_size + 1)
    counts = {"mask": int(m.sum()), "residual": int(residual.sum())}
    counts.update({layer: int((first == layer).sum()) for layer in range(2, deepest + 1)})
    counts["never"] = int((first == 0).sum())
    return counts


def reach_layer_key(max_layer: int) -> list:
    """Legend handles (matplotlib patches) for :func:`draw_reach_layers` with the same
    ``max_layer``: mask, residual diagonal, layers 2..max_layer, never reached.

    >>> [h.get_label() for h in reach_layer_key(3)]  # doctest: +NORMALIZE_WHITESPACE
    ['mask M (layer 1)', 'diagonal added by I (layer 1)', 'first reached at layer 2',
     'first reached at layer 3', 'never reached']
    """
    from matplotlib.patches import Patch

    max_layer = check_int("max_layer", max_layer, minimum=1)
    handles = [Patch(facecolor=_MASK_COLOUR, label="mask M (layer 1)"),
               Patch(facecolor=_RESIDUAL_COLOUR, label="diagonal added by I (layer 1)")]
    handles += [Patch(facecolor=c, label=f"first reached at layer {layer}")
                for layer, c in enumerate(_layer_colours(max_layer), start=2)]
    handles.append(Patch(facecolor=_NEVER_COLOUR, edgecolor="#999999", label="never reached"))
    return handles
