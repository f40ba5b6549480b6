"""Tests of companion.context_similarity.segmentation and .segmentation_eval against independent
references (model forward passes only in the last tests, on a tiny random BERT).

- the fast dynamic programme against a brute force over all 2^(n-1) segmentations and
  against the plain-loop reference, batched over matrices and penalties;
- standardising, detrending and combining heads against direct computations;
- TextTiling depth scores against a plain climbing loop, and a hand-made two-topic case;
- boundary matching against a brute-force maximum matching; the batched F1 used for
  tuning against the per-window one; Pk / WindowDiff on hand-computed cases (nltk);
- the protocol pieces: gold boundaries, punctuation stripping, the document split,
  bootstrap scores, stacked predictions == one by one, and tuning that finds a planted
  layer.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from companion.context_similarity import segmentation as sg
from companion.context_similarity import segmentation_eval as se
from companion.corpora import Corpus, Document


def sym(n, seed, batch=()):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(*batch, n, n, generator=g, dtype=torch.float64)
    m = a + a.transpose(-1, -2)
    m.diagonal(dim1=-2, dim2=-1).zero_()
    return m


def brute_force(m, penalty):
    """Best segmentation by enumerating every set of segment starts."""
    n = m.shape[0]
    best = None
    for k in range(n):
        for starts in itertools.combinations(range(1, n), k):
            cuts = [0, *starts, n]
            value = sum(float(m[i, j]) for a, b in zip(cuts, cuts[1:])
                        for i in range(a, b) for j in range(i + 1, b)) - penalty * k
            if best is None or value > best[0] + 1e-12:
                best = (value, list(starts))
    return best[1]


# --------------------------------------------------------------------------- the DP


@pytest.mark.parametrize("n", [1, 2, 3, 6, 8])
def test_dp_equals_brute_force_and_reference(n):
    for seed in range(4):
        m = sym(n, seed)
        for penalty in (0.0, 0.7, 3.0, 50.0):
            fast = sg.optimal_segmentation(m, penalty).nonzero().flatten().tolist()
            assert fast == brute_force(m, penalty)
            assert fast == sg.optimal_segmentation_reference(m, penalty)


def test_dp_batched_over_matrices_and_penalties_equals_reference():
    m = sym(24, 7, batch=(2, 3))
    pens = [0.5, 4.0, 16.0]
    out = sg.optimal_segmentation(m, pens)
    assert out.shape == (2, 3, 3, 24) and out.dtype == torch.bool
    assert not out[..., 0].any()
    for i, j, p in itertools.product(range(2), range(3), range(3)):
        got = out[i, j, p].nonzero().flatten().tolist()
        assert got == sg.optimal_segmentation_reference(m[i, j], pens[p])
    # a 1-D tensor of penalties gives the same; a scalar drops the penalty dimension
    assert torch.equal(sg.optimal_segmentation(m, torch.tensor(pens)), out)
    assert torch.equal(sg.optimal_segmentation(m, 4.0), out[:, :, 1])


def test_dp_hand_case_two_blocks():
    # tokens 0-3 and 4-9 similar within (+1), dissimilar across (-1)
    lab = torch.tensor([0] * 4 + [1] * 6)
    m = torch.where(lab[:, None] == lab[None, :], 1.0, -1.0).double()
    m.fill_diagonal_(0)
    assert sg.optimal_segmentation(m, 1.0).nonzero().flatten().tolist() == [4]
    # splitting at 4 removes the 4 * 6 = 24 cross pairs of -1 (each pair i < j counted
    # once): worth it while the penalty is below 24
    assert sg.optimal_segmentation(m, 23.0).nonzero().flatten().tolist() == [4]
    assert sg.optimal_segmentation(m, 25.0).nonzero().flatten().tolist() == []


def test_segment_gains_are_within_segment_sums():
    m = sym(7, 3)
    w = sg.segment_gains(m)
    for a in range(8):
        for b in range(a, 8):
            direct = sum(float(m[i, j]) for i in range(a, b) for j in range(i + 1, b))
            assert abs(float(w[a, b]) - direct) < 1e-9


def vectorised_dp(m, pens):
    """The programme written the plain vectorised way (the former fast path): the gains
    table of segment_gains, then F(b) = max_a F(a) + W(a, b) - penalty with max(0)'s
    first maximum, then the back pointers followed from n. [..., P, n] bool."""
    n, batch = m.shape[-1], m.shape[:-2]
    pen = torch.as_tensor(pens, dtype=torch.float64)
    w = sg.segment_gains(m)  # [..., a, b]
    wt = w.movedim(-1, 0).movedim(-1, 1)[..., None]  # [b, a, ..., 1]
    pen = pen.to(wt.dtype)
    g = torch.zeros(n + 1, *batch, len(pen), dtype=wt.dtype)
    back = torch.zeros(n + 1, *batch, len(pen), dtype=torch.long)
    for b in range(1, n + 1):
        best, back[b] = (g[:b] + wt[b, :b]).max(0)
        g[b] = best - pen
    out = torch.zeros(n + 1, *batch, len(pen), dtype=torch.bool)
    pos = torch.full((1, *batch, len(pen)), n, dtype=torch.long)
    for _ in range(n):
        pos = back.gather(0, pos)
        out.scatter_(0, pos, True)
    res = out[:n].permute(*range(1, len(batch) + 2), 0).clone()
    res[..., 0] = False
    return res


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 1), (2, 2), (7, 7), (3, 5, 5), (2, 3, 9, 9), (4, 33, 33),
                                   (17, 1, 1)])
def test_dp_equals_the_plain_vectorised_programme_bit_for_bit(shape, dtype):
    # the fast programme forms every gain and candidate with the same float operations
    # as the plain one (column by column, on step-major matrices, with the first maximum
    # found from the candidates' bits): the same boundaries, ties included
    g = torch.Generator().manual_seed(sum(shape))
    pens = [0.0, 0.5, 2.0, 8.0, 64.0]
    for m in (torch.randn(shape, generator=g, dtype=dtype),  # not symmetric: upper read
              torch.randint(-2, 3, shape, generator=g).to(dtype),  # many exact ties
              torch.zeros(shape, dtype=dtype).neg_()):  # -0.0 everywhere: all tied
        assert torch.equal(sg.optimal_segmentation(m, pens), vectorised_dp(m, pens))


def test_step_major_layout_is_a_transposing_copy():
    m = torch.randn(37, 5, 5, dtype=torch.float64)  # 37: a last block of 5 matrices
    assert torch.equal(sg._step_major(m, block=16), m.permute(2, 1, 0))
    assert sg._step_major(m.half()).dtype == torch.float32


def test_dp_bad_input():
    with pytest.raises(ValueError, match="m: expected square"):
        sg.optimal_segmentation(torch.zeros(3, 4), 1.0)
    with pytest.raises(ValueError, match="m: "):
        sg.optimal_segmentation(torch.full((3, 3), float("nan")), 1.0)
    with pytest.raises(TypeError, match="penalty"):
        sg.optimal_segmentation(sym(3, 0), "big")
    with pytest.raises(ValueError, match="penalty"):
        sg.optimal_segmentation(sym(3, 0), [])
    with pytest.raises(TypeError, match="m: "):
        sg.optimal_segmentation(torch.zeros(3, 3, dtype=torch.long), 1.0)


# --------------------------------------------------------------------------- matrices


def test_standardise_and_detrend():
    m = torch.randn(2, 6, 6, dtype=torch.float64) * 3 + 5
    z = sg.standardise(m)
    off = ~torch.eye(6, dtype=torch.bool)
    for b in range(2):
        vals = z[b][off]
        assert abs(float(vals.mean())) < 1e-12
        assert abs(float(vals.std(unbiased=False)) - 1) < 1e-12
        ref = (m[b][off] - m[b][off].mean()) / m[b][off].std(unbiased=False)
        assert torch.allclose(vals, ref)
        assert float(z[b].diagonal().abs().max()) == 0
    assert torch.equal(sg.standardise(torch.ones(4, 4)), torch.zeros(4, 4))
    # a matrix that depends on |i - j| only detrends to zero; detrending removes exactly that
    i = torch.arange(8.0, dtype=torch.float64)
    toeplitz = torch.exp(-(i[:, None] - i[None, :]).abs())
    assert float(sg.detrend(toeplitz).abs().max()) < 1e-12
    x = torch.randn(8, 8, dtype=torch.float64)
    d = sg.detrend(toeplitz + x)
    assert torch.allclose(d, sg.detrend(x))
    for k in range(1, 8):
        assert abs(float(torch.diagonal(d, k).sum() + torch.diagonal(d, -k).sum())) < 1e-9


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_standardise_into_gives_the_same_numbers(dtype):
    g = torch.Generator().manual_seed(3)
    big = torch.randn(3, 2, 5, 11, 11, generator=g, dtype=dtype)
    view = big[..., 1:-1, 1:-1]  # strided, as the feature pass reads its content tokens
    out = torch.empty(view.shape, dtype=dtype)
    assert torch.equal(sg._standardise_into(view, out), sg._standardise(view))
    for m in (big.clone(), torch.randn(2, 2, generator=g, dtype=dtype),
              torch.full((4, 3, 3), 2.5, dtype=dtype), torch.randn(300, 3, 3, dtype=dtype)):
        want = sg._standardise(m)
        assert torch.equal(sg._standardise_into(m, m), want)  # in place
    bad = torch.zeros(2, 4, 4, dtype=dtype)
    bad[1, 0, 1] = float("nan")
    with pytest.raises(ValueError, match="m: expected finite"):
        sg._standardise_into(bad, torch.empty_like(bad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_detrend_and_mean_of_sums_into_buffers_give_the_same_numbers(dtype):
    g = torch.Generator().manual_seed(5)
    sums = [torch.randn(3, 9, 9, generator=g, dtype=dtype) for _ in range(3)]
    for k in (1, 2, 3):  # one layer (a division), two, three (added in order)
        out = torch.empty_like(sums[0])
        assert torch.equal(sg._mean_of_sums(sums[:k], 4 * k, out=out),
                           sg._mean_of_sums(sums[:k], 4 * k))
    m = sums[0]
    assert torch.equal(sg._detrend(m, out=torch.empty_like(m)), sg._detrend(m))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_head_sums_from_a_run_of_heads_equal_the_gathered_sums(dtype):
    x = torch.randn(3, 2, 12, 7, 7, generator=torch.Generator().manual_seed(4), dtype=dtype)
    for heads in ([0], [2, 3, 4], list(range(12)), [1, 5, 6]):
        assert torch.equal(sg._head_sum(x, 1, heads), x[:, 1, heads].sum(1))


def test_combine_equals_direct_average():
    g = torch.Generator().manual_seed(0)
    sims = torch.randn(2, 3, 4, 5, 5, generator=g)
    layers, heads = [0, 2], {0: [1, 3], 2: [0]}
    z = [sg.standardise(sims[:, ly, h].double()) for ly in layers for h in heads[ly]]
    ref = sg.standardise(sum(z) / len(z))
    got = sg.combine(sims, layers, heads)
    assert got.dtype == torch.float32  # the input's precision
    assert torch.allclose(got.double(), ref, atol=1e-5)
    assert torch.allclose(sg.combine(sims.double(), layers, heads), ref, atol=1e-12)
    # pre-standardised input gives the same; symmetrising = combining (S + S^T) / 2
    pre = sg.standardise(sims)
    assert torch.allclose(sg.combine(pre, layers, heads, standardised=True), got, atol=1e-5)
    assert torch.allclose(sg.combine(sims, symmetrise=True),
                          sg.combine(0.5 * (sims + sims.transpose(-1, -2))))
    assert torch.allclose(sg.combine(sims, [1], detrend=True),
                          sg.standardise(sg.detrend(sg.combine(sims, [1]))))
    assert torch.allclose(sg.segment(sims, 2.0, layers, heads).double(),
                          sg.optimal_segmentation(got, 2.0).double())


def test_combine_bad_input():
    sims = torch.randn(1, 2, 3, 4, 4)
    with pytest.raises(ValueError, match="layers"):
        sg.combine(sims, [2])
    with pytest.raises(TypeError, match="layers"):
        sg.combine(sims, 1)
    with pytest.raises(ValueError, match="heads"):
        sg.combine(sims, [0], [])
    with pytest.raises(ValueError, match="heads: no head list"):
        sg.combine(sims, [0, 1], {0: [0]})
    with pytest.raises(ValueError, match="sims"):
        sg.combine(sims[0])
    with pytest.raises(TypeError, match="detrend"):
        sg.combine(sims, detrend=1)


# --------------------------------------------------------------------------- TextTiling


def depth_reference(s):
    """Hearst's depth scores by walking left and right from each gap."""
    out = []
    for i, v in enumerate(s):
        lp = v
        j = i - 1
        cur = v
        while j >= 0 and s[j] >= cur:
            cur = s[j]
            lp = max(lp, cur)
            j -= 1
        rp = v
        j, cur = i + 1, v
        while j < len(s) and s[j] >= cur:
            cur = s[j]
            rp = max(rp, cur)
            j += 1
        out.append((lp - v) + (rp - v))
    return out


def test_texttiling_scores_against_plain_loops():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 30, 5, generator=g, dtype=torch.float64)
    width = 4
    depth = sg.texttiling_scores(x, width)
    assert depth.shape == (3, 30) and float(depth[:, 0].abs().max()) == 0
    for b in range(3):
        s = []
        for t in range(1, 30):
            left = x[b, max(0, t - width):t].mean(0)
            right = x[b, t:min(30, t + width)].mean(0)
            s.append(float(torch.dot(left, right) / (left.norm() * right.norm())))
        assert np.allclose(depth[b, 1:].numpy(), depth_reference(s), atol=1e-9)


def test_texttiling_two_topics():
    # tokens 0-9 point one way, 10-19 another: the only boundary is at 10
    x = torch.zeros(20, 3, dtype=torch.float64)
    x[:10, 0] = 1
    x[10:, 1] = 1
    x += 0.01 * torch.randn(20, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = sg.texttiling(x, 3, 0.0)
    assert out.nonzero().flatten().tolist() == [10]


def test_random_and_even_baselines():
    g = torch.Generator().manual_seed(0)
    r = sg.random_boundaries((400, 50), 0.1, g)
    assert not r[:, 0].any()
    assert abs(float(r[:, 1:].float().mean()) - 0.1) < 0.01
    e = sg.even_boundaries((2, 10), 3.0)
    assert e[0].nonzero().flatten().tolist() == [3, 6, 9] and torch.equal(e[0], e[1])
    assert sg.even_boundaries((7,), 2.5).nonzero().flatten().tolist() == [2, 5]
    with pytest.raises(ValueError, match="rate"):
        sg.random_boundaries((2, 5), 1.5)
    with pytest.raises(ValueError, match="spacing"):
        sg.even_boundaries((5,), 0.5)


# --------------------------------------------------------------------------- metrics


def max_matching(g, p, tol):
    """Brute-force maximum one-to-one matching within tol."""
    best = 0
    for k in range(min(len(g), len(p)), 0, -1):
        for gs in itertools.combinations(g, k):
            for ps in itertools.permutations(p, k):
                if all(abs(a - b) <= tol for a, b in zip(gs, ps)):
                    return k
    return best


def test_boundary_matches_hand_cases_and_brute_force():
    assert se.boundary_matches([3, 10], [4, 9, 20], 1) == (2, 1, 0)
    assert se.boundary_matches([3, 10], [4, 9, 20], 0) == (0, 3, 2)
    assert se.boundary_matches([5], [4, 6], 1) == (1, 1, 0)  # one-to-one
    assert se.boundary_matches([4, 6], [5], 1) == (1, 0, 1)
    assert se.boundary_matches([], [], 1) == (0, 0, 0)
    b = torch.zeros(8, dtype=torch.bool)
    b[[2, 5]] = True
    assert se.boundary_matches(b, b, 0) == (2, 0, 0)
    rng = np.random.default_rng(0)
    for _ in range(200):
        g = sorted(rng.choice(15, size=rng.integers(0, 5), replace=False).tolist())
        p = sorted(rng.choice(15, size=rng.integers(0, 5), replace=False).tolist())
        for tol in (0, 1, 2):
            tp, fp, fn = se.boundary_matches(g, p, tol)
            assert tp == max_matching(g, p, tol)
            assert tp + fp == len(p) and tp + fn == len(g)


def test_f1_score_hand_values():
    assert se.f1_score(2, 1, 1) == pytest.approx(4 / 6)
    assert se.f1_score(0, 0, 0) == 1.0
    assert se.f1_score(0, 3, 0) == 0.0


def test_batched_tuning_f1_equals_per_window_f1():
    g = torch.Generator().manual_seed(3)
    gold = torch.rand(6, 30, generator=g) < 0.15
    gold[:, 0] = False
    pred = torch.rand(4, 6, 30, generator=g) < 0.15
    pred[..., 0] = False
    batched = se._f1_pm1_batched(gold, pred)
    for c in range(4):  # the same counts, the same float operations: equal, not close
        assert float(batched[c]) == se._f1_pm1(gold, pred[c])


def test_pk_windowdiff_hand_case():
    # 9 tokens, 8 gaps; gold starts at 4, prediction at 6; k = 2: 7 probe windows over the
    # gap string, the gold boundary (gap index 3) is seen by windows 2, 3 and the predicted
    # one (gap index 5) by windows 4, 5: 4 of 7 disagree, for Pk and WindowDiff alike
    gold = [False] * 9
    pred = [False] * 9
    gold[4] = True
    pred[6] = True
    pk, wd = se.pk_windowdiff(gold, pred, 2)
    assert pk == pytest.approx(4 / 7) and wd == pytest.approx(4 / 7)
    assert se.pk_windowdiff(gold, gold, 2) == (0.0, 0.0)
    # two predicted boundaries where gold has one: Pk misses it, WindowDiff does not
    pred2 = [False] * 9
    pred2[4] = pred2[5] = True
    pk2, wd2 = se.pk_windowdiff(gold, pred2, 3)
    assert pk2 == pytest.approx(1 / 6) and wd2 == pytest.approx(3 / 6)
    with pytest.raises(ValueError, match="k"):
        se.pk_windowdiff(gold, gold, 9)


# --------------------------------------------------------------------------- protocol


def test_gold_boundaries_from_sentence_ids():
    sid = torch.tensor([[-1, 0, 0, 1, 1, 1, 2, -1]])
    assert se.gold_boundaries(sid).nonzero()[:, 1].tolist() == [2, 5]
    with pytest.raises(ValueError, match="sentence_ids"):
        se.gold_boundaries(torch.tensor([[0, 0, 1, -1]]))


def test_strip_sentence_punctuation():
    c = Corpus("x", [Document("d", ["Mr. Smith said so .", "Why ?", ". ;", "Yes , sir !"])])
    out = se.strip_sentence_punctuation(c)
    assert out.documents[0].sentences == ["Mr. Smith said so", "Why", "Yes , sir"]
    assert c.documents[0].sentences[0] == "Mr. Smith said so ."  # input untouched


def test_split_documents():
    dev, test = se.split_documents(range(11), seed=3)
    assert sorted(dev + test) == list(range(11)) and not set(dev) & set(test)
    assert abs(len(dev) - len(test)) <= 1
    assert (dev, test) == se.split_documents(range(11), seed=3)
    with pytest.raises(ValueError, match="documents"):
        se.split_documents([4])


def test_scores_point_bootstrap_and_paired_difference():
    gold = torch.zeros(4, 10, dtype=torch.bool)
    gold[:, 5] = True
    perfect = gold.clone()
    shifted = torch.roll(gold, 1, dims=1)
    none = torch.zeros_like(gold)
    s = se.Scores.compute(gold, {"perfect": perfect, "shifted": shifted, "none": none},
                          [0, 0, 1, 2], k=2)
    assert s.point("perfect").tolist() == [1.0, 1.0, 0.0, 0.0]
    f1, f1t, pk, wd = s.point("shifted")
    assert (f1, f1t) == (0.0, 1.0) and pk > 0
    assert s.point("none")[1] == 0.0
    table = s.summary(n_boot=200)
    row = table.set_index("method").loc["shifted"]
    assert row["Pk lo"] <= row["Pk"] <= row["Pk hi"]
    assert s.difference("perfect", "perfect", "F1") == (0.0, 0.0, 0.0)
    point, lo, hi = s.difference("perfect", "none", "F1 ±1")
    assert point == lo == hi == 1.0
    # a list stands for its best member, in the sample and in every resample
    assert s.difference(["none", "perfect"], "shifted", "F1") == (1.0, 1.0, 1.0)
    assert s.difference("shifted", ["none", "perfect"], "Pk")[0] == s.point("shifted")[2]
    with pytest.raises(ValueError, match="metric"):
        s.difference("perfect", "none", "accuracy")
    with pytest.raises(ValueError, match="a: unknown method"):
        s.difference("nobody", "none", "F1")
    with pytest.raises(ValueError, match="predictions"):
        se.Scores.compute(gold, {"bad": gold[:, :5]}, [0, 0, 1, 2], k=2)


def planted_features(n_windows=6, n=40, seed=0, layer=2):
    """Random per-head matrices, except layer ``layer`` whose heads see the sentences."""
    g = torch.Generator().manual_seed(seed)
    gold = torch.zeros(n_windows, n, dtype=torch.bool)
    for w in range(n_windows):
        starts = torch.randperm(n - 2, generator=g)[:3] + 2
        gold[w, starts] = True
    sent = gold.long().cumsum(-1)
    same = (sent[:, :, None] == sent[:, None, :]).float()
    heads = torch.randn(n_windows, 3, 4, n, n, generator=g)
    heads = heads + heads.transpose(-1, -2)
    heads[:, layer] += 6 * same[:, None]
    att = torch.randn(n_windows, 3, 4, n, n, generator=g)
    att = att + att.transpose(-1, -2)
    feats = se.Features(sg.standardise(heads), sg.standardise(att),
                        torch.randn(n_windows, n, 8, generator=g))
    return feats, gold


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_head_contrast_equals_pair_by_pair_means(dtype):
    g = torch.Generator().manual_seed(5)
    z = torch.randn(3, 2, 3, 9, 9, generator=g, dtype=dtype)
    gold = torch.zeros(3, 9, dtype=torch.bool)
    gold[0, 4] = gold[1, 2] = gold[1, 6] = True
    got = se.head_contrast(z, gold, max_distance=3)
    want = torch.zeros(2, 3, dtype=torch.float64)
    for ly, h in itertools.product(range(2), range(3)):
        same, diff = [], []
        for b in range(3):
            sent = gold[b].long().cumsum(0)
            for i, j in itertools.product(range(9), range(9)):
                if 1 <= abs(i - j) <= 3:
                    (same if sent[i] == sent[j] else diff).append(float(z[b, ly, h, i, j]))
        want[ly, h] = np.mean(same) - np.mean(diff)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got, want, atol=tol, rtol=0)


def test_tune_finds_the_planted_layer_and_stacked_predictions_match():
    feats, gold = planted_features()
    threads = torch.get_num_threads()
    methods = se.tune(feats, gold, final_layers=[1, 2], penalties=[1.0, 4.0, 16.0],
                      widths=(4,), cutoffs=(0.0,))
    assert torch.get_num_threads() == threads  # the loop-thread setting is restored
    by = {m.name: m for m in methods}
    assert 2 in by["head outputs, tuned"].params["layers"]
    assert by["head outputs, tuned"].params["dev_f1"] == 1.0
    assert by["head outputs, layer 3"].params["dev_f1"] == 1.0
    assert by["head outputs, layer 1"].params["dev_f1"] < 1.0
    names = [m.name for m in methods]
    assert len(set(names)) == len(names)
    baselines = {"random at the gold rate", "evenly spaced", "TextTiling, final hidden states"}
    assert baselines <= set(names)
    # stacked prediction == one by one (new windows: nothing was tuned on them)
    test_feats, _ = planted_features(seed=1)
    stacked = se.predict_all(methods, test_feats, torch.Generator().manual_seed(0))
    for m in methods:
        if m.family in se.DP_FAMILIES or m.family in ("TextTiling", "even"):
            assert torch.equal(stacked[m.name], m.predict(test_feats)), m.name



def test_tune_and_predict_side_by_side_equal_one_after_another():
    # with 3 caller threads the families, TextTiling and the prediction chunks run on 3
    # Python threads, every operation on one intra-op thread: the same numbers as 1
    feats, gold = planted_features()
    test_feats, _ = planted_features(seed=1)
    kw = dict(final_layers=[1, 2], penalties=[1.0, 4.0, 16.0], widths=(4,), cutoffs=(0.0,))
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            methods = se.tune(feats, gold, **kw)
            assert torch.get_num_threads() == threads
            runs.append((methods, se.predict_all(methods, test_feats,
                                                 torch.Generator().manual_seed(0))))
    finally:
        torch.set_num_threads(before)
    (m1, p1), (m3, p3) = runs
    assert [(m.name, m.params) for m in m1] == [(m.name, m.params) for m in m3]
    assert list(p1) == list(p3) and all(torch.equal(p1[k], p3[k]) for k in p1)
    assert se._run_tasks([lambda: 1, lambda: 2, lambda: 3], 2) == [1, 2, 3]
    assert se._run_tasks([], 2) == []

# --------------------------------------------------------------------------- the chapter's windows
# (these use the bundled tokenizer and a tiny random BERT: real forward passes, small sizes)


def _sentences(doc, n):
    return [f"doc {doc} sentence {i} has a few words in it ." if i % 2 else
            f"and here , in doc {doc} , another one ?" for i in range(n)]


@pytest.fixture(scope="module")
def toy_brown():
    # documents of different lengths; document 3 is shorter than one window of 24 tokens
    sizes = {0: 12, 1: 30, 2: 20, 3: 1, 4: 16}
    return Corpus("toy", [Document(f"d{d}", _sentences(d, n)) for d, n in sizes.items()])


@pytest.fixture(scope="module")
def tok():
    from companion import context_similarity as cs

    try:
        path = cs.default_model_path()
    except cs.ModelNotFoundError as exc:  # pragma: no cover - the venv ships it
        pytest.skip(str(exc))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tok):
    from transformers import BertConfig, BertModel

    from companion import context_similarity as cs

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=16, num_hidden_layers=3,
                     num_attention_heads=2, intermediate_size=32, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("tiny-seg-bert")
    BertModel(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return cs.load_encoder(path, device="cpu")[0]


def test_document_windows_counts_order_and_limit(toy_brown, tok):
    from companion.corpora import windows as cut

    w = se.document_windows(toy_brown, tok, [2, 0, 3, 1], [1, 2, 5, 1], length=24)
    assert w.document_ids[:, 1].tolist() == [2, 0, 0, 1]  # document 3 gives none
    assert (w.document_ids[:, 1:-1] == w.document_ids[:, 1:2]).all()
    own = cut(Corpus("d0", [toy_brown.documents[0]]), tok, 24, max_windows=2)
    assert torch.equal(w.input_ids[1:3], own.input_ids)  # the first windows of the document
    assert torch.equal(w.sentence_ids[1:3], own.sentence_ids)
    limited = se.document_windows(toy_brown, tok, [2, 0, 1], 3, length=24, max_windows=4)
    assert limited.document_ids[:, 1].tolist() == [2, 2, 2, 0]
    with pytest.raises(ValueError, match="per_document: expected one count per document"):
        se.document_windows(toy_brown, tok, [0, 1], [1], length=24)
    with pytest.raises(ValueError, match="per_document"):
        se.document_windows(toy_brown, tok, [0], 0, length=24)
    with pytest.raises(ValueError, match="none of the 1 documents"):
        se.document_windows(toy_brown, tok, [3], 1, length=24)


def test_first_windows_per_document(toy_brown, tok):
    from companion.corpora import windows as cut

    w = cut(toy_brown, tok, 24)  # consecutive windows, document after document
    docs = w.document_ids[:, 1].tolist()
    first = se.first_windows_per_document(w, 1)
    assert first.document_ids[:, 1].tolist() == sorted(set(docs), key=docs.index)
    two = se.first_windows_per_document(w, 2)
    rows = [i for i, d in enumerate(docs) if docs[:i].count(d) < 2]
    assert torch.equal(two.input_ids, w.input_ids[rows])
    assert torch.equal(se.first_windows_per_document(w, 10 ** 6).input_ids, w.input_ids)
    across = cut(toy_brown, tok, 24, cross_documents=True)
    with pytest.raises(ValueError, match="inside one document"):
        se.first_windows_per_document(across, 1)
    with pytest.raises(TypeError, match="windows"):
        se.first_windows_per_document(w.input_ids, 1)


def test_window_features_take_one_forward_pass(toy_brown, tok, tiny_model):
    from companion import context_similarity as cs
    from companion.corpora import windows as cut

    w = cut(toy_brown, tok, 24)[:5]
    calls = []
    hook = tiny_model.embeddings.register_forward_hook(lambda *a: calls.append(1))
    try:
        f = se.window_features(tiny_model, w, batch_size=2)
    finally:
        hook.remove()
    assert len(calls) == 3  # batches of 2, 2, 1: one pass each
    with torch.no_grad():
        own = tiny_model(input_ids=w.input_ids, attention_mask=w.attention_mask)
        ho = cs.head_outputs(tiny_model, {"input_ids": w.input_ids,
                                          "attention_mask": w.attention_mask})
    torch.testing.assert_close(f.hidden, own.last_hidden_state[:, 1:-1].float(),
                               atol=1e-5, rtol=0)
    sims = cs.similarity_matrices(ho.outputs)[..., 1:-1, 1:-1]
    torch.testing.assert_close(f.heads, sg.standardise(sims).float(), atol=1e-5, rtol=0)
    assert f.heads.shape == (5, 3, 2, 22, 22) and f.attention.shape == f.heads.shape
    # standardised in place, batch by batch: the same values as the plain batches
    # (fresh tensors, sg.standardise) concatenated, bit for bit
    parts = list(se._batches(tiny_model, w, 2))
    for i, got in enumerate((f.heads, f.attention, f.hidden)):
        assert torch.equal(got, torch.cat([p[i] for p in parts]))
    # and as before the kept similarity buffer and the maps as a view: fresh matrices
    # and contiguous stacked maps, batch by batch (2, 2, 1: the last in the buffer's
    # first rows)
    for start in range(0, 5, 2):
        part = w[start:start + 2]
        with torch.no_grad():
            ho = cs.head_outputs(tiny_model, {"input_ids": part.input_ids,
                                              "attention_mask": part.attention_mask},
                                 return_hidden=True)
        att = torch.stack(ho.attentions.unbind(1), dim=1)[..., 1:-1, 1:-1]
        att = 0.5 * (att + att.transpose(-1, -2))
        sims = cs.similarity_matrices(ho.outputs)[..., 1:-1, 1:-1]
        rows = slice(start, start + 2)
        assert torch.equal(f.heads[rows], sg.standardise(sims).float())
        assert torch.equal(f.attention[rows], sg.standardise(att).float())
    with pytest.raises(ValueError, match="windows: expected at least one window"):
        se.window_features(tiny_model, w[:0], batch_size=2)


@pytest.mark.parametrize("strip", [False, True])
def test_evaluate_in_chunks_equals_all_at_once(toy_brown, tok, tiny_model, strip):
    # chunks of 1 and 2 windows (development maps spilled to disk, test maps streamed)
    # give the methods, predictions and scores of one pass over all windows, bit for bit
    from companion.corpora import windows as cut

    w = cut(toy_brown, tok, 24)
    kw = dict(corpus=toy_brown, per_document=2, final_layers=[2], penalties=[1.0, 4.0],
              seed=1, batch_size=2, widths=(4,), cutoffs=(0.0,), strip_punctuation=strip,
              head_fractions=(0.5, 1.0))
    whole = se.evaluate(tiny_model, tok, w, max_feature_bytes=None, **kw)
    per_window = se.feature_bytes_per_window(tiny_model, w.length)
    assert per_window == 4 * (2 * 3 * 2 * 22 * 22 + 22 * 16)
    assert len(whole.dev) > 2 and len(whole.test) > 2  # so that both splits are chunked
    for windows_per_chunk in (1, 2):
        part = se.evaluate(tiny_model, tok, w, max_feature_bytes=windows_per_chunk * per_window,
                           **kw)
        assert [(m.name, m.params) for m in part.methods] == \
               [(m.name, m.params) for m in whole.methods]
        assert list(part.predictions) == list(whole.predictions)
        for name, pred in whole.predictions.items():
            assert torch.equal(part.predictions[name], pred), name
        assert part.scores.summary(n_boot=50).equals(whole.scores.summary(n_boot=50))
    with pytest.raises(ValueError, match="max_feature_bytes"):
        se.evaluate(tiny_model, tok, w, max_feature_bytes=0, **kw)


def test_tune_and_predict_read_chunks_as_one(tmp_path):
    # the planted features cut into uneven chunks: tune on SpilledFeatures and
    # predict_all on a generator of chunks equal the one-piece calls
    feats, gold = planted_features()
    test_feats, _ = planted_features(seed=1)
    kw = dict(final_layers=[1, 2], penalties=[1.0, 4.0, 16.0], widths=(4,), cutoffs=(0.0,))

    def cut(f, sizes):
        out, start = [], 0
        for k in sizes:
            out.append(se.Features(f.heads[start:start + k], f.attention[start:start + k],
                                   f.hidden[start:start + k]))
            start += k
        assert start == f.heads.shape[0]
        return out

    n_dev, n_test = feats.heads.shape[0], test_feats.heads.shape[0]
    whole = se.tune(feats, gold, **kw)
    spilled = se.SpilledFeatures(cut(feats, [1, n_dev - 3, 2]), tmp_path)
    assert len(spilled) == n_dev and len(list(tmp_path.iterdir())) == 6  # maps of 3 chunks
    chunked = se.tune(spilled, gold, **kw)
    assert [(m.name, m.params) for m in chunked] == [(m.name, m.params) for m in whole]
    one = se.predict_all(whole, test_feats, torch.Generator().manual_seed(0))
    parts = se.predict_all(whole, iter(cut(test_feats, [3, n_test - 3])),
                           torch.Generator().manual_seed(0))
    assert list(one) == list(parts) and all(torch.equal(one[k], parts[k]) for k in one)
    with pytest.raises(ValueError, match="gold: expected one row per window"):
        se.tune(spilled, gold[:-1], **kw)
    with pytest.raises(TypeError, match="feats: expected Features or SpilledFeatures"):
        se.tune(cut(feats, [n_dev]), gold, **kw)
    with pytest.raises(ValueError, match="feats: no windows"):
        se.predict_all(whole, iter([]))
    with pytest.raises(ValueError, match="directory"):
        se.SpilledFeatures([], tmp_path / "missing")
    with pytest.raises(ValueError, match="chunks: no windows"):
        se.SpilledFeatures([], tmp_path)


def test_feature_chunks_reused_give_each_chunk_its_own_numbers(toy_brown, tok, tiny_model):
    # chunks of 2, 2 and 1 windows written into one pair of buffers: each chunk, read
    # before the next is asked for, equals its fresh counterpart bit for bit; the maps of
    # every chunk share one buffer (the last, shorter chunk its first rows), the hidden
    # states stay each chunk's own
    from companion.corpora import windows as cut

    w = cut(toy_brown, tok, 24)[:5]
    fresh = list(se.feature_chunks(tiny_model, w, batch_size=2, chunk_windows=2))
    assert [f.heads.shape[0] for f in fresh] == [2, 2, 1]
    assert len({f.heads.data_ptr() for f in fresh}) == 3  # fresh: one buffer each
    starts, hidden = set(), []
    for i, chunk in enumerate(se.feature_chunks(tiny_model, w, batch_size=2, chunk_windows=2,
                                                reuse=True)):
        for field in ("heads", "attention", "hidden"):
            assert torch.equal(getattr(chunk, field), getattr(fresh[i], field)), (i, field)
        assert chunk.heads.is_contiguous() and chunk.attention.is_contiguous()
        starts.add((chunk.heads.data_ptr(), chunk.attention.data_ptr()))
        hidden.append(chunk.hidden)
    assert len(starts) == 1
    assert all(torch.equal(h, f.hidden) for h, f in zip(hidden, fresh))
    with pytest.raises(ValueError, match="batch_size"):
        next(se.feature_chunks(tiny_model, w, batch_size=0, reuse=True))


def test_spilled_features_read_back_as_written_and_writable(tmp_path):
    # the chunks come back mapped from their files, copy-on-write: equal to what was
    # written, writable, and a write reaches neither the file nor the next reading
    feats, _ = planted_features()
    parts = [se.Features(feats.heads[:3], feats.attention[:3], feats.hidden[:3]),
             se.Features(feats.heads[3:], feats.attention[3:], feats.hidden[3:])]
    spilled = se.SpilledFeatures(parts, tmp_path)
    for chunk, part in zip(spilled, parts):
        assert torch.equal(chunk.heads, part.heads) and torch.equal(chunk.attention,
                                                                    part.attention)
        assert chunk.heads.dtype == part.heads.dtype
        chunk.heads.fill_(7.0)
        chunk.attention.zero_()
    for chunk, part in zip(spilled, parts):
        assert torch.equal(chunk.heads, part.heads) and torch.equal(chunk.attention,
                                                                    part.attention)


def test_evaluate_reads_the_given_windows_split_by_document(toy_brown, tok, tiny_model):
    from companion.corpora import windows as cut

    w = cut(toy_brown, tok, 24)
    kw = dict(corpus=toy_brown, per_document=2, final_layers=[2], penalties=[1.0, 4.0],
              seed=1, batch_size=4, widths=(4,), cutoffs=(0.0,))
    a = se.evaluate(tiny_model, tok, w, **kw)
    chosen = se.first_windows_per_document(w, 2)
    dev_docs = set(a.dev.document_ids[:, 1].tolist())
    test_docs = set(a.test.document_ids[:, 1].tolist())
    assert not dev_docs & test_docs
    assert dev_docs | test_docs == set(chosen.document_ids[:, 1].tolist())
    rows = {tuple(r) for r in chosen.input_ids.tolist()}
    assert all(tuple(r) in rows for r in torch.cat([a.dev.input_ids, a.test.input_ids]).tolist())
    assert len(a.dev) + len(a.test) == len(chosen)
    names = {m.name for m in a.methods}
    assert set(a.scores.stats) == names and "TextTiling, final hidden states" in names
    assert all(p.shape == (len(a.test), 22) for p in a.predictions.values())
    b = se.evaluate(tiny_model, tok, w, strip_punctuation=True, **kw)
    assert set(b.dev.document_ids[:, 1].tolist()) == dev_docs  # the same documents
    assert set(b.test.document_ids[:, 1].tolist()) == test_docs
    stripped = {tok.convert_tokens_to_ids(t) for t in (".", "?", "!", ";", ":")}
    ids = set(torch.cat([b.dev.input_ids, b.test.input_ids]).flatten().tolist())
    assert not ids & stripped and (ids & {tok.convert_tokens_to_ids(",")})
    with pytest.raises(ValueError, match="document ids outside"):
        se.evaluate(tiny_model, tok, w, **{**kw, "corpus": Corpus("x", toy_brown.documents[:2])})
