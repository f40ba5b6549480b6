"""Offline LRA tasks: ListOps generator vs an independent evaluator, Pathfinder labels
checked by a flood fill (scipy.ndimage.label), loaders' errors and the image stand-in."""
from __future__ import annotations

import math
import re
import statistics

import numpy as np
import pytest
import torch
from scipy import ndimage

from companion.lra import listops, loaders, pathfinder


# ----------------------------------------------------------------------------- ListOps
def _brute_value(source: str) -> int:
    """Third, recursive-descent evaluator over the tokens (statistics.median)."""
    toks = [t for t in source.split() if t not in "()"]
    pos = 0

    def parse():
        nonlocal pos
        tok = toks[pos]
        pos += 1
        if tok.isdigit():
            return int(tok)
        args = []
        while toks[pos] != "]":
            args.append(parse())
        pos += 1
        return {"[MIN": min, "[MAX": max, "[SM": lambda a: sum(a) % 10,
                "[MED": lambda a: int(statistics.median(a))}[tok](args)

    value = parse()
    assert pos == len(toks)
    return value


def test_listops_generator_agrees_with_evaluators_at_lra_lengths():
    pairs = listops.generate(40, seed=0)
    assert len(pairs) == 40 and len({s for s, _ in pairs}) == 40
    for source, target in pairs:
        length = len(listops.tokenize(source))
        assert 500 < length < 2000
        assert listops.evaluate(source) == target == _brute_value(source)
        assert 0 <= target <= 9


def _write_left_fold(tokens: list[str]) -> str:
    """The original's string for a bracket-token expression, written from its rule:
    an m-argument node is ((...((op, a1), a2)...), am), ]) with each pair in parens."""
    pos = 0

    def node() -> str:
        nonlocal pos
        tok = tokens[pos]
        pos += 1
        if tok.isdigit():
            return tok
        args = []
        while tokens[pos] != "]":
            args.append(node())
        pos += 1
        out = "( " * (len(args) + 1) + tok + " " + args[0] + " )"
        for a in args[1:]:
            out += " " + a + " )"
        return out + " ] )"

    return node()


def test_listops_string_format_is_the_original_left_fold():
    pairs = listops.generate(200, seed=3, min_length=2, max_length=40, max_depth=4)
    for source, _ in pairs:
        assert re.fullmatch(r"[\[\]()0-9A-Z ]+", source)
        assert _write_left_fold(listops.tokenize(source)) == source
    assert listops.evaluate("( ( ( [MAX 2 ) 9 ) ] )") == 9
    assert listops.evaluate("( ( ( [MED 2 ) 9 ) ] )") == 5  # (2 + 9) / 2 truncated
    assert listops.evaluate("( ( ( ( [SM 7 ) 8 ) 9 ) ] )") == 4


def test_listops_is_deterministic_and_seed_dependent():
    a = listops.generate(30, seed=11, min_length=20, max_length=80, max_depth=4)
    b = listops.generate(30, seed=11, min_length=20, max_length=80, max_depth=4)
    c = listops.generate(30, seed=12, min_length=20, max_length=80, max_depth=4)
    assert a == b and a != c


def test_listops_depth_and_args_limits():
    pairs = listops.generate(100, seed=5, min_length=10, max_length=400, max_depth=4,
                             max_args=3)
    for source, _ in pairs:
        assert listops.depth(source) <= 3  # nodes at depth max_depth are digits
        stack = []  # argument count of each open operator
        for tok in listops.tokenize(source):
            if tok == "]":
                assert 2 <= stack.pop() <= 3
                continue
            if stack:
                stack[-1] += 1  # a digit or an operator is an argument of its parent
            if tok in listops.OPERATORS:
                stack.append(0)
        assert stack == []


def test_listops_tokenisation_both_conventions():
    src = "( ( ( [MAX 2 ) ( ( ( [SM 3 ) 4 ) ] ) ) ] )"
    assert listops.tokenize(src) == ["[MAX", "2", "[SM", "3", "4", "]", "]"]
    assert listops.tokenize(src, brackets=False) == ["MAX", "2", "SM", "3", "4"]
    ids = listops.encode([src], max_length=10)
    vocab = listops.vocabulary()
    assert ids.shape == (1, 10) and ids.dtype == torch.long
    assert ids[0, :7].tolist() == [vocab[t] for t in listops.tokenize(src)]
    assert ids[0, 7:].tolist() == [0, 0, 0]
    assert int(ids.max()) < listops.vocab_size()
    assert listops.vocab_size(brackets=False) == 16  # tfds: 14 tokens + OOV + padding
    trunc = listops.encode([src], max_length=3, brackets=False)
    assert trunc[0].tolist() == [listops.vocabulary(brackets=False)[t]
                                 for t in ["MAX", "2", "SM"]]


@pytest.mark.parametrize("bad", ["", "[MAX 2", "]", "[MAX 2 ] 3", "[FOO 1 ]", "[MAX ]"])
def test_listops_evaluator_rejects_malformed(bad):
    with pytest.raises(ValueError, match="source"):
        listops.evaluate(bad)


def test_listops_generate_validates():
    with pytest.raises(ValueError, match="n"):
        listops.generate(0, seed=0)
    with pytest.raises(TypeError, match="seed"):
        listops.generate(3, seed=1.5)
    with pytest.raises(ValueError, match="min_length"):
        listops.generate(3, seed=0, min_length=10, max_length=5)
    with pytest.raises(ValueError, match="max_depth"):
        listops.generate(3, seed=0, max_depth=1)
    with pytest.raises(ValueError, match="after"):
        listops.generate(3, seed=0, min_length=40, max_length=50, max_depth=2, max_args=3,
                         max_tries=50)


# --------------------------------------------------------------------------- Pathfinder
def _connected_by_flood_fill(image: np.ndarray, markers: np.ndarray) -> bool:
    labels, _ = ndimage.label(image > 0, structure=np.ones((3, 3), dtype=bool))
    a, b = labels[tuple(markers[0])], labels[tuple(markers[1])]
    assert a > 0 and b > 0, "a marker is not on ink"
    return bool(a == b)


@pytest.mark.parametrize("kwargs", [{"size": 32, "contour_length": 14},
                                    {"size": 20, "contour_length": 6, "num_distractors": 3},
                                    {"size": 24, "contour_length": 9, "num_distractors": 4,
                                     "max_turn": math.pi / 3},
                                    {"size": 10, "contour_length": 3, "num_distractors": 0,
                                     "paddle_length": 1.5, "marker_radius": 1.0,
                                     "path_intensity": 0.4}])
def test_pathfinder_labels_match_flood_fill(kwargs):
    data = pathfinder.generate(60, seed=7, **kwargs)
    size = kwargs["size"]
    assert data.images.shape == (60, size, size) and data.images.dtype == torch.float32
    assert 0.4 <= data.labels.float().mean().item() <= 0.6
    for img, label, markers in zip(data.images.numpy(), data.labels.numpy(),
                                   data.markers.numpy()):
        assert _connected_by_flood_fill(img, markers) == bool(label)


def test_pathfinder_each_snake_is_one_component_and_counts_match():
    # 2 long snakes + distractors, never touching: exactly that many components
    data = pathfinder.generate(20, seed=2, size=32, contour_length=14)
    for img in data.images.numpy():
        _, count = ndimage.label(img > 0, structure=np.ones((3, 3), dtype=bool))
        assert count == 2 + 20 // (14 // 3)


def test_pathfinder_deterministic_quantised_and_sequences():
    kw = {"size": 20, "contour_length": 5, "num_distractors": 2}
    a = pathfinder.generate(6, seed=4, **kw)
    b = pathfinder.generate(6, seed=4, **kw)
    c = pathfinder.generate(6, seed=5, **kw)
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.images, c.images)
    assert torch.allclose(a.images * 255, torch.round(a.images * 255), atol=1e-4)
    seq = pathfinder.to_sequences(a.images)
    assert seq.shape == (6, 400) and seq.dtype == torch.long
    assert int(seq.min()) >= 0 and int(seq.max()) <= 255
    assert torch.equal(seq.reshape(6, 20, 20), torch.round(a.images * 255).long())


def test_pathfinder_dim_paths_give_markers_their_own_token():
    # paths at 0.4 peak intensity, markers at 1: with 3 levels only marker cores are token 2
    kw = {"size": 10, "contour_length": 3, "num_distractors": 0, "paddle_length": 1.5,
          "marker_radius": 1.0}
    dim = pathfinder.generate(40, seed=3, path_intensity=0.4, **kw)
    full = pathfinder.generate(40, seed=3, **kw)
    assert torch.equal(dim.labels, full.labels) and torch.equal(dim.markers, full.markers)
    assert torch.equal(dim.images > 0, full.images > 0)  # same ink, dimmer paths
    tokens = pathfinder.to_sequences(dim.images, levels=3).reshape(dim.images.shape)
    v8 = torch.round(dim.images * 255).long()
    assert torch.equal(tokens, (v8 > 0).long() + (v8 > 127).long())  # ceil(2 v / 255)
    for img_tokens, markers in zip(tokens, dim.markers):
        bright = torch.nonzero(img_tokens == 2)
        assert len(bright) > 0
        # every token-2 pixel lies within 2 pixels of a marker centre pixel
        near = (bright[:, None, :] - markers[None, :, :]).abs().amax(-1).amin(-1)
        assert int(near.max()) <= 2
        assert all(int(img_tokens[tuple(m)]) == 2 for m in markers)
    assert int(pathfinder.to_sequences(full.images, levels=2).max()) == 1


def test_best_threshold_accuracy_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 15, (1,), generator=g))
        feature = torch.randint(0, 5, (n,), generator=g).float()
        labels = torch.randint(0, 2, (n,), generator=g)
        brute = 0
        for t in [-1.0, *feature.unique().tolist()]:
            correct = int(((feature <= t).long() == labels).sum())
            brute = max(brute, correct, n - correct)
        assert pathfinder.best_threshold_accuracy(feature, labels) == pytest.approx(brute / n)
    with pytest.raises(ValueError, match="feature, labels"):
        pathfinder.best_threshold_accuracy(torch.zeros(3), torch.zeros(4))


def test_pathfinder_small_canvas_ink_does_not_give_the_label_away():
    # both classes mark one snake start and one (possibly border-clipped) snake end
    data = pathfinder.generate(400, seed=1, size=12, contour_length=3, num_distractors=0)
    shortcuts = pathfinder.shortcut_accuracies(data)
    assert set(shortcuts) == {"marker distance", "marker to border", "ink pixels",
                              "total ink"}
    assert shortcuts["ink pixels"] < 0.62 and shortcuts["total ink"] < 0.62
    assert shortcuts["marker to border"] < 0.62


def test_distance_matched_subset_balances_every_distance():
    data = pathfinder.generate(200, seed=2, size=10, contour_length=3, num_distractors=0,
                               paddle_length=1.5, marker_radius=1.0)
    idx = pathfinder.distance_matched_subset(data.markers, data.labels)
    assert len(idx) > 40 and len(set(idx.tolist())) == len(idx)
    dist = torch.round((data.markers[idx, 0] - data.markers[idx, 1]).float().norm(dim=1))
    lab = data.labels[idx]
    for value in dist.unique():
        sel = dist == value
        assert int(lab[sel].sum()) * 2 == int(sel.sum())  # as many positives as negatives
    # on the subset the marker distance alone is at chance
    assert pathfinder.best_threshold_accuracy(dist, lab) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="markers, labels"):
        pathfinder.distance_matched_subset(data.markers[:, 0], data.labels)


def test_pathfinder_validates():
    with pytest.raises(ValueError, match="paddle_gap"):
        pathfinder.generate(2, seed=0, paddle_gap=3.0)
    with pytest.raises(ValueError, match="size"):
        pathfinder.generate(2, seed=0, size=4)
    with pytest.raises(ValueError, match="could not fit"):
        pathfinder.generate(1, seed=0, size=10, contour_length=30, max_attempts=2)
    with pytest.raises(ValueError, match="images"):
        pathfinder.to_sequences(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="levels"):
        pathfinder.to_sequences(torch.zeros(1, 3, 3), levels=1)
    with pytest.raises(ValueError, match="path_intensity"):
        pathfinder.generate(2, seed=0, path_intensity=0.0)


# ------------------------------------------------------------------------------ loaders
def test_loaders_name_the_expected_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="cifar-10-batches-py"):
        loaders.load_cifar10_grey(tmp_path)
    with pytest.raises(FileNotFoundError, match="aclImdb"):
        loaders.load_imdb_bytes(tmp_path)
    with pytest.raises(FileNotFoundError, match="new_aan_pairs"):
        loaders.load_aan_pairs(tmp_path)


def test_cifar_grey_and_imdb_bytes_from_tiny_fake_files(tmp_path):
    import pickle

    batches = tmp_path / "cifar-10-batches-py"
    batches.mkdir()
    rgb = np.zeros((2, 3072), dtype=np.uint8)
    rgb[0, :1024] = 255  # pure red image
    rgb[1, 2048:] = 255  # pure blue image
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(batches / name, "wb") as fh:
            pickle.dump({b"data": rgb, b"labels": [3, 7]}, fh)
    tokens, labels = loaders.load_cifar10_grey(tmp_path, split="test")
    assert tokens.shape == (2, 1024) and labels.tolist() == [3, 7]
    assert tokens[0, 0].item() == int(0.2989 * 255.5) and tokens[1, 0].item() == int(0.1140 * 255.5)
    train_tokens, _ = loaders.load_cifar10_grey(tmp_path, split="train")
    assert train_tokens.shape == (10, 1024)

    for label in ("pos", "neg"):
        d = tmp_path / "aclImdb" / "train" / label
        d.mkdir(parents=True)
        (d / "0_1.txt").write_text("héllo" if label == "pos" else "ab")
    tokens, labels = loaders.load_imdb_bytes(tmp_path, split="train", max_length=8)
    assert tokens.shape == (2, 8)
    rows = {int(lab): row.tolist() for row, lab in zip(tokens, labels)}
    assert rows[1][:6] == [b + 1 for b in "héllo".encode()]  # ids = byte + 1, 0 = pad
    assert rows[0] == [ord("a") + 1, ord("b") + 1] + [0] * 6


def test_digits_standin_is_named_and_shaped():
    pytest.importorskip("sklearn")
    data = loaders.digits_standin(size=32)
    assert data.name.startswith("stand-in")
    assert data.tokens.shape == (1797, 1024) and data.tokens.dtype == torch.long
    assert int(data.tokens.max()) <= 255 and int(data.tokens.min()) >= 0
    assert sorted(set(data.labels.tolist())) == list(range(10))
