"""Pathfinder: are two marked dots joined by one curvy path of paddles?

Definition
----------
A Pathfinder image {cite}`linsley2018pathfinder` is a small grey canvas with several
*snakes*, curvy chains of short line segments ("paddles") separated by small gaps, and
two round *markers*. The label is 1 when both markers sit on the two ends of the same
snake, 0 when they sit on ends of two different snakes. Distractor snakes, shorter and
unmarked, clutter the canvas. The image is flattened row by row into a sequence of
``size * size`` pixel intensities (LRA's Pathfinder-32: 1024 tokens, vocabulary 256),
so a model must trace a path across hundreds of positions.

This generator is a rewrite, not a port, of the original (``drewlinsley/pathfinder``,
used by LRA with contour length 14, paddle length 2, margin 1, marker radius 1.5,
distractor length 14 // 3, 20 // that many distractors). Every image holds two
*long* snakes of ``contour_length`` paddles, A and B, in both classes (positive: markers
on the start and the end of A; negative: on the start of A and the end of B), so the
number and length of snakes does not give the label away; then the distractors. Both
classes mark one snake start and one snake end: a start lies ``marker_radius`` inside
the canvas while an end may reach the border, where its marker is clipped, so marking
two starts in the negative class would let the amount of ink reveal the label (on a
12x12 canvas a threshold on the ink count then reached 72% accuracy; now 56%).

Geometry: a snake starts at a uniform point with a uniform heading; each paddle is a
segment of ``paddle_length`` pixels; the next paddle starts ``paddle_gap`` pixels further
on, its heading turned by a uniform angle in ``[-max_turn, max_turn]``. Candidate
headings that would leave the canvas (``padding`` pixels from the border) or come within
one pixel of another snake's ink are redrawn; a snake that cannot grow is restarted,
an image that cannot be completed is restarted.

Rendering: a pixel's intensity is ``clip((thickness/2 + antialias - d) / antialias, 0,
1)`` with ``d`` the distance from the pixel centre to the nearest paddle (or to the
marker centre minus ``marker_radius``), times ``path_intensity`` for paddles (1 by
default), quantised to 8 bits like an image file; an inked pixel keeps at least 1/255.

Guarantee (what the tests check by a flood fill): the ink of one snake is 8-connected
(the gap is bridged by the anti-aliased ends, which needs
``paddle_gap < paddle_thickness + 2 * antialias``), and the inks of different snakes
are never 8-adjacent. So the markers lie in one 8-connected component of the ink iff the
label is 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from companion._validate import check_device, check_int, check_number, check_tensor, describe


@dataclass
class PathfinderSet:
    """Images, labels and marker positions drawn by :func:`generate`.

    Attributes
    ----------
    images : torch.Tensor
        float32 ``[n, size, size]`` in [0, 1], multiples of 1/255.
    labels : torch.Tensor
        int64 ``[n]``, 1 = the markers are connected.
    markers : torch.Tensor
        int64 ``[n, 2, 2]``: (row, column) of the pixel under each marker centre.

    >>> d = generate(6, seed=0, size=10, contour_length=3, num_distractors=0,
    ...              paddle_length=1.5, marker_radius=1.0)
    >>> d.images.shape, d.labels.shape, d.markers.shape
    (torch.Size([6, 10, 10]), torch.Size([6]), torch.Size([6, 2, 2]))
    """

    images: torch.Tensor
    labels: torch.Tensor
    markers: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])


class _Canvas:
    """Pixel-centre coordinates and ink rendering on one ``size x size`` canvas."""

    def __init__(self, size: int, thickness: float, antialias: float):
        self.size = size
        self.half = thickness / 2.0
        self.aa = antialias
        self.reach = self.half + antialias  # ink footprint radius around a segment
        self.centres = np.arange(size, dtype=np.float64) + 0.5

    def _window(self, xs, ys, extra):
        lo_c = max(math.floor(min(xs) - extra), 0)
        hi_c = min(math.ceil(max(xs) + extra) + 1, self.size)
        lo_r = max(math.floor(min(ys) - extra), 0)
        hi_r = min(math.ceil(max(ys) + extra) + 1, self.size)
        return lo_r, hi_r, lo_c, hi_c

    def segment(self, p, q):
        """(row slice, col slice, intensity patch) of the segment p -> q (x, y) points."""
        r0, r1, c0, c1 = self._window((p[0], q[0]), (p[1], q[1]), self.reach + 1)
        ex = self.centres[c0:c1][None, :] - p[0]  # pixel centre minus p, broadcast
        ey = self.centres[r0:r1][:, None] - p[1]
        dx, dy = q[0] - p[0], q[1] - p[1]
        denom = dx * dx + dy * dy
        t = (ex * dx + ey * dy) / denom if denom > 0 else 0.0 * (ex + ey)
        t = np.minimum(np.maximum(t, 0.0), 1.0)
        dist = np.sqrt((ex - t * dx) ** 2 + (ey - t * dy) ** 2)
        val = np.minimum(np.maximum((self.reach - dist) / self.aa, 0.0), 1.0)
        return slice(r0, r1), slice(c0, c1), val

    def disc(self, c, radius):
        r0, r1, c0, c1 = self._window((c[0],), (c[1],), radius + self.aa + 1)
        dist = np.hypot(self.centres[c0:c1][None, :] - c[0],
                        self.centres[r0:r1][:, None] - c[1])
        val = np.clip((radius + self.aa - dist) / self.aa, 0.0, 1.0)
        return slice(r0, r1), slice(c0, c1), val


def _dilate(mask: np.ndarray) -> np.ndarray:
    """8-neighbourhood dilation (3 x 3) of a boolean image."""
    out = mask.copy()
    out[1:, :] |= mask[:-1, :]
    out[:-1, :] |= mask[1:, :]
    tmp = out.copy()
    out[:, 1:] |= tmp[:, :-1]
    out[:, :-1] |= tmp[:, 1:]
    return out


def _grow_snake(rng, canvas, blocked, n_paddles, paddle_length, gap, max_turn, padding,
                marker_radius, marked_ends, path_intensity=1.0, tries_per_paddle=12):
    """Try to draw one snake avoiding ``blocked``; return (ink, ends) or None.

    Points are plain ``(x, y)`` floats: the canvas is tiny, so per-call numpy overhead,
    not arithmetic, would dominate the heading search.
    """
    size = canvas.size
    lo, hi = padding + marker_radius, size - padding - marker_radius
    if hi <= lo:
        return None
    start = (rng.uniform(lo, hi), rng.uniform(lo, hi))
    heading = rng.uniform(0, 2 * math.pi)
    ink = np.zeros((size, size))
    pos = start
    end = start
    top = size - padding
    for k in range(n_paddles):
        placed = False
        for attempt in range(tries_per_paddle):
            h = heading + (rng.uniform(-max_turn, max_turn) if (k or attempt) else 0.0)
            if attempt >= tries_per_paddle // 2:  # stuck: allow a sharper turn
                h = heading + rng.uniform(-2 * max_turn, 2 * max_turn)
            ux, uy = math.cos(h), math.sin(h)
            p = pos if k == 0 else (pos[0] + gap * ux, pos[1] + gap * uy)
            q = (p[0] + paddle_length * ux, p[1] + paddle_length * uy)
            if not (padding <= min(p[0], p[1], q[0], q[1])
                    and max(p[0], p[1], q[0], q[1]) <= top):
                continue
            if blocked[int(q[1]), int(q[0])]:  # cheap early rejection
                continue
            rs, cs, val = canvas.segment(p, q)
            if (blocked[rs, cs] & (val > 0)).any():
                continue
            ink[rs, cs] = np.maximum(ink[rs, cs], path_intensity * val)
            heading, pos, end = h, q, q
            placed = True
            break
        if not placed:
            return None
    ends = (start, end)
    for which in marked_ends:
        c = ends[which]
        rs, cs, val = canvas.disc(c, marker_radius)
        if (blocked[rs, cs] & (val > 0)).any():
            return None
        ink[rs, cs] = np.maximum(ink[rs, cs], val)
    return ink, ends


def _draw_image(rng, label, *, size, contour_length, distractor_length, num_distractors,
                paddle_length, paddle_gap, max_turn, padding, marker_radius, canvas,
                path_intensity=1.0, snake_tries=60):
    """One image with the requested label, or None if the canvas got too crowded."""
    image = np.zeros((size, size))
    occupied = np.zeros((size, size), dtype=bool)
    # one start and one end marked in both classes (see the module docstring)
    plan = [("A", contour_length, (0, 1) if label == 1 else (0,)),
            ("B", contour_length, () if label == 1 else (1,))]
    plan += [("d", distractor_length, ())] * num_distractors
    markers = []
    for name, length, marked in plan:
        blocked = _dilate(occupied)
        for _ in range(snake_tries):
            drawn = _grow_snake(rng, canvas, blocked, length, paddle_length, paddle_gap,
                                max_turn, padding, marker_radius, marked, path_intensity)
            if drawn is not None:
                break
        else:
            return None
        ink, ends = drawn
        image = np.maximum(image, ink)
        occupied |= ink > 0
        markers += [ends[w] for w in marked]
    marker_px = [(min(int(c[1]), size - 1), min(int(c[0]), size - 1)) for c in markers]
    return image, marker_px


def generate(
    n: int,
    *,
    seed: int,
    size: int = 32,
    contour_length: int = 14,
    distractor_length: int | None = None,
    num_distractors: int | None = None,
    paddle_length: float = 2.0,
    paddle_gap: float = 1.0,
    paddle_thickness: float = 0.5,
    antialias: float = 1.0,
    marker_radius: float = 1.5,
    max_turn: float = math.pi / 4,
    padding: float = 1.0,
    path_intensity: float = 1.0,
    max_attempts: int = 200,
    device: str | torch.device | None = None,
) -> PathfinderSet:
    """Draw ``n`` Pathfinder images, half of them positive, in a seeded order.

    Parameters
    ----------
    n : int
        Number of images; ``n // 2`` positives (plus one when n is odd, by the seed).
    seed : int
        Seed of the private numpy generator; the same arguments give the same set.
    size : int
        Canvas side in pixels (LRA Pathfinder-32: 32; sequence length ``size**2``).
    contour_length : int
        Paddles in each of the two long snakes (LRA: 14; shorter is easier).
    distractor_length, num_distractors : int or None
        Paddles per distractor (default ``max(contour_length // 3, 1)``) and their number
        (default ``20 // distractor_length``), as in LRA's configuration.
    paddle_length, paddle_gap, paddle_thickness, antialias, marker_radius : float
        Geometry in pixels; see the module docstring.
    max_turn : float
        Largest heading change between consecutive paddles, radians.
    padding : float
        Paddles keep this far from the border.
    path_intensity : float
        Peak intensity of the paddles, in (0, 1]; markers are drawn at 1. Below 1/2
        the cores of the markers are the only pixels brighter than 1/2, so
        ``to_sequences(images, levels=3)`` gives them a token of their own (a reduced
        setting for small canvases, where a marker disc is hardly wider than a paddle).
        Both classes hold two markers, so this says where the markers are, not the label.
    max_attempts : int
        Restarts allowed per image before giving up (ValueError).
    device : torch device or None
        Where the returned tensors live (CPU if None).

    Returns
    -------
    PathfinderSet

    Raises
    ------
    ValueError
        On bad parameters, or when images cannot be completed (too many snakes for the
        canvas: lower the contour length or the number of distractors).

    Complexity
    ----------
    O(n * P * w^2) for P paddles per image and w the paddle window side, with a
    constant factor for rejected headings; a few ms per 32 x 32 image in numpy.

    References
    ----------
    .. [1] D. Linsley, J. Kim, V. Veerabadran, C. Windolf, T. Serre, "Learning long-
       range spatial dependencies with horizontal gated recurrent units", NeurIPS 2018,
       arXiv:1805.08315: the Pathfinder task.
    .. [2] Y. Tay, M. Dehghani, S. Abnar, Y. Shen, D. Bahri, P. Pham, J. Rao, L. Yang,
       S. Ruder, D. Metzler, "Long Range Arena: A Benchmark for Efficient Transformers",
       ICLR 2021, arXiv:2011.04006: Pathfinder as a sequence task.

    >>> d = generate(6, seed=0, size=10, contour_length=3, num_distractors=0,
    ...              paddle_length=1.5, marker_radius=1.0)
    >>> int(d.labels.sum()), bool(((d.images >= 0) & (d.images <= 1)).all())
    (3, True)
    """
    for name, val in (("n", n), ("seed", seed), ("size", size),
                      ("contour_length", contour_length)):
        check_int(name, val)
    check_int("n", n, minimum=1)
    if size < 8:
        raise ValueError(f"size: expected >= 8 pixels, got {size}")
    if contour_length < 1:
        raise ValueError(f"contour_length: expected >= 1 paddle, got {contour_length}")
    if distractor_length is None:
        distractor_length = max(contour_length // 3, 1)
    distractor_length = check_int("distractor_length", distractor_length, minimum=1)
    if num_distractors is None:
        num_distractors = 20 // distractor_length
    num_distractors = check_int("num_distractors", num_distractors, minimum=0)
    max_attempts = check_int("max_attempts", max_attempts, minimum=1)
    for name, val in (("paddle_length", paddle_length), ("paddle_thickness", paddle_thickness),
                      ("antialias", antialias), ("marker_radius", marker_radius)):
        check_number(name, val, minimum=0.0, min_open=True, expected="a positive finite number")
    paddle_gap = check_number("paddle_gap", paddle_gap, minimum=0.0)
    if not paddle_gap < paddle_thickness + 2 * antialias:
        raise ValueError(
            f"paddle_gap: expected 0 <= gap < paddle_thickness + 2 * antialias "
            f"(= {paddle_thickness + 2 * antialias}) so a snake stays connected, "
            f"got {paddle_gap}")
    check_number("max_turn", max_turn, minimum=0.0, maximum=math.pi, min_open=True,
                 expected="an angle in (0, pi]")
    check_number("padding", padding, minimum=0.0)
    check_number("path_intensity", path_intensity, minimum=0.0, maximum=1.0, min_open=True,
                 expected="a number in (0, 1]")
    device = check_device("device", device)

    rng = np.random.default_rng(seed)
    labels = np.zeros(n, dtype=np.int64)
    labels[: (n + 1) // 2 if rng.random() < 0.5 else n // 2] = 1
    rng.shuffle(labels)
    canvas = _Canvas(size, paddle_thickness, antialias)
    images = np.zeros((n, size, size), dtype=np.float32)
    markers = np.zeros((n, 2, 2), dtype=np.int64)
    for i in range(n):
        for _ in range(max_attempts):
            drawn = _draw_image(
                rng, int(labels[i]), size=size, contour_length=contour_length,
                distractor_length=distractor_length, num_distractors=num_distractors,
                paddle_length=paddle_length, paddle_gap=paddle_gap, max_turn=max_turn,
                padding=padding, marker_radius=marker_radius, canvas=canvas,
                path_intensity=path_intensity)
            if drawn is not None:
                break
        else:
            raise ValueError(
                f"generate: could not fit 2 snakes of {contour_length} paddles and "
                f"{num_distractors} distractors on a {size}x{size} canvas; lower "
                f"contour_length or num_distractors")
        image, marker_px = drawn
        # every inked pixel keeps at least 1/255, so the image's ink is exactly the
        # footprint the separation guarantee is about (dim paths would otherwise lose
        # their faintest anti-aliased pixels to rounding)
        images[i] = np.where(image > 0, np.maximum(np.round(image * 255.0), 1.0), 0.0) / 255.0
        markers[i] = np.asarray(marker_px)
    out = PathfinderSet(torch.from_numpy(images), torch.from_numpy(labels),
                        torch.from_numpy(markers))
    if device is not None:
        out = PathfinderSet(out.images.to(device), out.labels.to(device),
                            out.markers.to(device))
    return out


def to_sequences(images: torch.Tensor, levels: int = 256) -> torch.Tensor:
    """Flatten ``[n, H, W]`` images in [0, 1] row by row into int64 tokens.

    With ``levels = 256`` (default) this is LRA's image input: each pixel's 8-bit
    intensity ``v`` is a token (vocabulary 256). With fewer levels ``L`` the 8-bit
    intensity is quantised to ``ceil(v (L - 1) / 255)``: 0 stays 0 (background) and
    ``(0, 1]`` is cut into ``L - 1`` equal bins (vocabulary ``L``); e.g. ``L = 3``
    separates ink up to half intensity from brighter ink.

    Examples
    --------
    >>> to_sequences(torch.tensor([[[0.0, 1.0], [0.5, 1.0]]]))
    tensor([[  0, 255, 128, 255]])
    """
    levels = check_int("levels", levels, minimum=2, maximum=256)
    check_tensor("images", images, ndim=3, finite=True, nonempty=True, shape_text="[n, H, W]")
    if images.is_floating_point():
        if images.min() < 0 or images.max() > 1:
            raise ValueError("images: expected float intensities in [0, 1]")
        tokens = torch.round(images * 255.0).long()
    else:
        tokens = images.long()
        if tokens.min() < 0 or tokens.max() > 255:
            raise ValueError("images: expected integer intensities in 0..255")
    if levels < 256:
        tokens = (tokens * (levels - 1) + 254) // 255  # integer ceil(v (L - 1) / 255)
    return tokens.reshape(images.shape[0], -1)


def best_threshold_accuracy(feature: torch.Tensor, labels: torch.Tensor) -> float:
    """Best accuracy of a one-feature rule ``label = [feature <= t]`` or ``[feature > t]``.

    The accuracy a classifier reaches from that feature alone, at the best threshold and
    orientation (ties in the feature kept on one side). Used to check that a cheap
    image statistic does not give the Pathfinder label away.

    Complexity: ``O(n log n)`` (one sort).

    Examples
    --------
    >>> best_threshold_accuracy(torch.tensor([0.1, 0.2, 0.8, 0.9]), torch.tensor([0, 0, 1, 1]))
    1.0
    """
    check_tensor("feature", feature, finite=True)
    check_tensor("labels", labels)
    if feature.dim() != 1 or labels.shape != feature.shape:
        raise ValueError(
            f"feature, labels: expected two 1-D tensors of one length, got "
            f"{tuple(feature.shape)} and {tuple(labels.shape)}")
    n = feature.numel()
    if n == 0:
        raise ValueError("feature: expected at least one value")
    order = torch.argsort(feature.to(torch.float64), stable=True)
    f, y = feature[order], labels[order].to(torch.int64)
    pos_below = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(y, 0)])
    cut = torch.cat([torch.tensor([True]), f[1:] != f[:-1], torch.tensor([True])])
    below = torch.arange(n + 1)[cut]  # number of items with feature <= a threshold
    pos = pos_below[cut]
    total_pos = int(y.sum())
    # rule "positive iff feature <= t": correct = positives below + negatives above
    correct = pos + (n - below) - (total_pos - pos)
    return float(torch.maximum(correct, n - correct).max()) / n


def distance_matched_subset(markers: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Indices of a subset in which both classes have the same marker-distance histogram.

    The distance between the two marker pixels is rounded to whole pixels; for each
    rounded distance the first ``min(#positives, #negatives)`` items of each class (in
    index order) are kept. On the subset the marker distance alone scores exactly 1/2
    at every threshold, so accuracy above 1/2 there needs more than the distance.

    Parameters
    ----------
    markers : int tensor ``[n, 2, 2]`` (as :attr:`PathfinderSet.markers`).
    labels : int tensor ``[n]`` of 0/1.

    Returns
    -------
    int64 tensor of sorted indices into ``labels``.

    Complexity: ``O(n log n)``.

    >>> markers = torch.tensor([[[0, 0], [0, 3]], [[0, 0], [3, 0]], [[0, 0], [0, 5]]])
    >>> distance_matched_subset(markers, torch.tensor([1, 0, 1]))  # item 2 has no match
    tensor([0, 1])
    """
    check_tensor("markers", markers)
    check_tensor("labels", labels)
    if markers.dim() != 3 or markers.shape[1:] != (2, 2) or labels.shape != markers.shape[:1]:
        raise ValueError(
            f"markers, labels: expected shapes [n, 2, 2] and [n], got "
            f"{tuple(markers.shape)} and {tuple(labels.shape)}")
    dist = torch.round((markers[:, 0] - markers[:, 1]).to(torch.float64).norm(dim=1)).cpu()
    labels = labels.cpu()
    keep = []
    for value in torch.unique(dist):
        pos = torch.nonzero((dist == value) & (labels == 1)).flatten()
        neg = torch.nonzero((dist == value) & (labels == 0)).flatten()
        k = min(len(pos), len(neg))
        keep += [pos[:k], neg[:k]]
    return torch.sort(torch.cat(keep)).values if keep else torch.zeros(0, dtype=torch.int64)


def shortcut_accuracies(data: PathfinderSet) -> dict:
    """Best one-threshold accuracies of cheap statistics that ignore connectivity.

    ``marker distance``: Euclidean distance between the two marker pixels;
    ``marker to border``: pixels between the border and the marker closest to it;
    ``ink pixels``: number of non-black pixels; ``total ink``: sum of intensities.
    A model that traces paths should beat all of them.

    >>> d = generate(6, seed=0, size=10, contour_length=3, num_distractors=0,
    ...              paddle_length=1.5, marker_radius=1.0)
    >>> acc = shortcut_accuracies(d)
    >>> sorted(acc), all(0.5 <= a <= 1 for a in acc.values())
    (['ink pixels', 'marker distance', 'marker to border', 'total ink'], True)
    """
    if not isinstance(data, PathfinderSet):
        raise TypeError(f"data: expected a PathfinderSet, got {describe(data)}")
    markers = data.markers.to(torch.float64)
    dist = (markers[:, 0] - markers[:, 1]).norm(dim=1)
    size = data.images.shape[-1]
    border = torch.minimum(markers, size - 1 - markers).amin((1, 2))
    images = data.images.to(torch.float64)
    feats = {"marker distance": dist, "marker to border": border,
             "ink pixels": (images > 0).sum((1, 2)).to(torch.float64),
             "total ink": images.sum((1, 2))}
    return {name: best_threshold_accuracy(f.cpu(), data.labels.cpu())
            for name, f in feats.items()}
