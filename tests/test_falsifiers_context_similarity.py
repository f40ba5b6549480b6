"""Falsifiers of the context-similarity chapter's paper claims.

Each test measures a paper claim with the function of
``companion.context_similarity.measures`` that the chapter calls, on the bundled
all-MiniLM-L6-v2 reading 16 Brown windows (the unperturbed object), and again after the
claim's declared falsifier (``companion.book.statements.context_similarity``) has perturbed
the head outputs, token ids or attention maps of the same forward passes; the claim must
not read "differs" before and must read "differs" after.

Where MiniLM's own layer group does not meet a claim at this size (its final layers do not
attend to '.' and ','; see the chapter), the test takes the layers of MiniLM that do and
shows that the falsifier turns those to "differs": what is tested is that the measurement
can fail under the perturbation, with the chapter's function and threshold.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from companion import context_similarity as cs
from companion import corpora as cp
from companion.context_similarity import measures as ms
from companion.context_similarity import segmentation_eval as se
from falsify import assert_flips, falsifies, verdict

N_WINDOWS, BATCH, REPS = 16, 8, 300


@pytest.fixture(scope="module")
def run():
    """MiniLM's batch results on 16 Brown windows (the chapter's window cutting)."""
    try:
        enc, tok = cs.load_encoder(None, device="cpu")
    except cs.ModelNotFoundError as exc:  # pragma: no cover - the venv ships it
        pytest.skip(str(exc))
    brown = cp.load_corpus("brown")
    order = np.random.default_rng(0).permutation(len(brown.documents)).tolist()
    wins = se.document_windows(brown, tok, order, 1, length=128, max_windows=N_WINDOWS)
    with torch.no_grad():
        results = [cs.analyse_batch(enc, wins[s:s + BATCH]) for s in range(0, len(wins), BATCH)]
    n_layers = len(cs.encoder_layers(enc))
    groups = {g: [ly for ly in range(n_layers) if (3 * ly) // n_layers == i]
              for i, g in enumerate(("early", "middle", "final"))}
    seps = cs.separator_ids(tok)
    return dict(results=results, n_layers=n_layers, n_heads=enc.config.num_attention_heads,
                vocab=tok.vocab_size, seps=seps, groups=groups,
                punct=[list(seps).index(s) for s in (".", ",") if s in seps])


def sums_of(run, perturb=None, results=None) -> ms.WindowSums:
    st = cs.SimilarityStats(run["n_layers"], run["n_heads"], 128, run["vocab"],
                            separators=run["seps"], per_window=True)
    for r in results or run["results"]:
        st.update(r if perturb is None else perturb(r))
    return ms.WindowSums(st.window_sums(), reps=REPS, seed=0)


@pytest.fixture(scope="module")
def real(run):
    return sums_of(run)


def measured(sums, fn, *args):
    m = ms.evaluate(sums, fn, *args)
    return m.value, m.interval


def _content(r, b):
    return ((r.sentence_ids[b] >= 0) & r.attention_mask[b].bool()).nonzero()[:, 0]


def permute_positions(layers=None, seed=1):
    """Head outputs of ``layers`` (all if None) permuted over each window's content
    positions: the pairs a head joins no longer follow the text."""
    def perturb(r):
        z, g = r.outputs.clone(), torch.Generator().manual_seed(seed)
        for b in range(z.shape[0]):
            c = _content(r, b)
            p = c[torch.randperm(len(c), generator=g)]
            for ly in (range(z.shape[1]) if layers is None else layers):
                z[b, ly, :, c] = r.outputs[b, ly, :, p]
        return r._replace(outputs=z)
    return perturb


def shuffle_token_ids(seed=2):
    """Token ids permuted over each window's content positions (outputs unchanged)."""
    def perturb(r):
        ids, g = r.input_ids.clone(), torch.Generator().manual_seed(seed)
        for b in range(ids.shape[0]):
            c = _content(r, b)
            ids[b, c] = r.input_ids[b, c[torch.randperm(len(c), generator=g)]]
        return r._replace(input_ids=ids)
    return perturb


def replace_layers(dst, src):
    """The head outputs of layers ``dst`` replaced by those of layers ``src``."""
    def perturb(r):
        z = r.outputs.clone()
        z[:, list(dst)] = r.outputs[:, list(src)]
        return r._replace(outputs=z)
    return perturb


def copy_first_head(r):
    """Every head of a layer given the outputs of the layer's first head."""
    return r._replace(outputs=r.outputs[:, :, :1].expand_as(r.outputs).contiguous())


def uniform_attention(r):
    """Attention maps replaced by uniform attention over each window's tokens."""
    b, n_l, n_h, t, _ = r.outputs.shape
    keys = r.attention_mask.double()
    row = (keys / keys.sum(1, keepdim=True))[:, None, None, :].expand(b, n_h, t, t)
    return r._replace(attentions=tuple(row.to(r.outputs.dtype).contiguous()
                                       for _ in range(n_l)), received_attention=None)


def holding(claim_id, sums, fn, candidates):
    """The first argument tuple of ``candidates`` for which the claim does not read
    "differs" on ``sums`` (MiniLM's layers that meet the claim at this size)."""
    for args in candidates:
        if verdict(claim_id, *measured(sums, fn, *args)) != "differs":
            return args
    pytest.fail(f"{claim_id}: no candidate layers meet the claim on the unperturbed model")


def one_head(run, sums, layer, head):
    """``sums`` restricted to head (``layer``, ``head``), as a model of one layer of one
    head (the window sums of shape [W, L, H, ...] sliced; the per-window chance levels
    kept)."""
    n_l, n_h = run["n_layers"], run["n_heads"]
    out = {}
    for name, t in sums.items():
        if name == "windows_with_pairs":
            continue
        if t.dim() >= 3 and tuple(t.shape[1:3]) == (n_l, n_h):
            t = t[:, layer:layer + 1, head:head + 1]
        elif t.dim() == 2 and t.shape[1] == n_l and name == "hub_distinct":
            t = t[:, layer:layer + 1].clamp(max=1)
        out[name] = t
    return ms.WindowSums(out, reps=REPS, seed=0)


def holding_head(run, claim_id, sums, fn, *args):
    """The first head (layer, head) of MiniLM that meets the claim on its own."""
    for layer in range(run["n_layers"]):
        for head in range(run["n_heads"]):
            if verdict(claim_id, *measured(one_head(run, sums, layer, head), fn, *args)) \
                    != "differs":
                return layer, head
    pytest.fail(f"{claim_id}: no head meets the claim on the unperturbed model")


def singles(run):
    return [([ly],) for ly in range(run["n_layers"])]


# --------------------------------------------------------------------------- distances


@falsifies("context-similarity-early-uniform")
def test_early_uniform_falsified_by_middle_layers(run, real):
    cid = "context-similarity-early-uniform"
    mid = run["groups"]["middle"]
    # MiniLM's early layers already differ at this size (see the chapter): the flip is
    # shown on the layers whose pairs do spread like uniform ones (positions permuted:
    # uniform by construction), then those layers given the middle layers' outputs
    uniform = sums_of(run, permute_positions())
    (layer,) = holding(cid, uniform, ms.early_uniform_distance, singles(run))
    assert_flips(cid, measured(uniform, ms.early_uniform_distance, layer),
                 measured(sums_of(run, replace_layers(layer, mid[:1])),
                          ms.early_uniform_distance, layer))


@falsifies("context-similarity-early-long-range")
def test_early_long_range_falsified_by_swapping_early_and_middle(run, real):
    cid, g = "context-similarity-early-long-range", run["groups"]
    args = (g["early"], g["middle"])
    swapped = sums_of(run, replace_layers(g["early"] + g["middle"], g["middle"] + g["early"]))
    assert_flips(cid, measured(real, ms.long_share_difference, *args),
                 measured(swapped, ms.long_share_difference, *args))


@falsifies("context-similarity-middle-short-range")
def test_middle_short_range_falsified_by_swapping_early_and_middle(run, real):
    cid, g = "context-similarity-middle-short-range", run["groups"]
    args = (g["early"], g["middle"])
    swapped = sums_of(run, replace_layers(g["early"] + g["middle"], g["middle"] + g["early"]))
    assert_flips(cid, measured(real, ms.mean_distance_difference, *args),
                 measured(swapped, ms.mean_distance_difference, *args))


@falsifies("context-similarity-middle-short-range-dominance")
@falsifies("context-similarity-final-short-range-dominance")
@pytest.mark.parametrize("group", ["middle", "final"])
def test_short_range_dominance_falsified_by_permuted_positions(run, real, group):
    cid = f"context-similarity-{group}-short-range-dominance"
    # no MiniLM layer has half of its pairs within 8 tokens at this size (see the
    # chapter): the heads that do stand in for a layer
    layer, head = holding_head(run, cid, real, ms.short_share, [0])
    permuted = sums_of(run, permute_positions())
    assert_flips(cid, measured(one_head(run, real, layer, head), ms.short_share, [0]),
                 measured(one_head(run, permuted, layer, head), ms.short_share, [0]))


@falsifies("context-similarity-intra-sentence-over-long-range")
def test_intra_sentence_over_long_range_falsified_by_permuted_positions(run, real):
    cid = "context-similarity-intra-sentence-over-long-range"
    args = holding(cid, real, ms.intra_sentence_over_long_range, [(None,)] + singles(run))
    assert_flips(cid, measured(real, ms.intra_sentence_over_long_range, *args),
                 measured(sums_of(run, permute_positions()),
                          ms.intra_sentence_over_long_range, *args))


# --------------------------------------------------------------------------- sentences


@falsifies("context-similarity-same-sentence-fraction")
def test_same_sentence_fraction_falsified_by_permuted_positions(run, real):
    cid = "context-similarity-same-sentence-fraction"
    assert_flips(cid, measured(real, ms.same_sentence_fraction),
                 measured(sums_of(run, permute_positions()), ms.same_sentence_fraction))


@falsifies("context-similarity-same-sentence-above-chance")
def test_same_sentence_above_chance_falsified_by_permuted_positions(run, real):
    cid = "context-similarity-same-sentence-above-chance"
    assert_flips(cid, measured(real, ms.same_sentence_excess),
                 measured(sums_of(run, permute_positions()), ms.same_sentence_excess))


@falsifies("context-similarity-final-sentence-beyond-locality")
def test_final_sentence_beyond_locality_falsified_by_permuted_final_layers(run, real):
    cid = "context-similarity-final-sentence-beyond-locality"
    (layers,) = holding(cid, real, ms.sentence_beyond_locality,
                        [(run["groups"]["final"],)] + singles(run))
    assert_flips(cid, measured(real, ms.sentence_beyond_locality, layers),
                 measured(sums_of(run, permute_positions(layers)),
                          ms.sentence_beyond_locality, layers))


@falsifies("context-similarity-final-strongest-sentence")
def test_final_strongest_sentence_falsified_by_permuted_final_layers(run, real):
    cid = "context-similarity-final-strongest-sentence"
    n = run["n_layers"]
    # the layer with the strongest same-sentence preference plays "final" (MiniLM's last
    # layers do not have it; see the chapter)
    final, others = holding(cid, real, ms.final_strongest_sentence,
                            [([ly], [[m] for m in range(n) if m != ly])
                             for ly in reversed(range(n))])
    assert_flips(cid, measured(real, ms.final_strongest_sentence, final, others),
                 measured(sums_of(run, permute_positions(final)),
                          ms.final_strongest_sentence, final, others))


@falsifies("context-similarity-final-attend-separators")
def test_final_attend_separators_falsified_by_uniform_attention(run, real):
    cid = "context-similarity-final-attend-separators"
    # no MiniLM layer puts twice uniform attention on '.' and ',' at this size (see the
    # chapter): the heads that do stand in for a layer
    layer, head = holding_head(run, cid, real, ms.separator_ratio, [0], run["punct"])
    uniform = sums_of(run, uniform_attention)
    assert_flips(cid, measured(one_head(run, real, layer, head), ms.separator_ratio, [0],
                               run["punct"]),
                 measured(one_head(run, uniform, layer, head), ms.separator_ratio, [0],
                          run["punct"]))


# --------------------------------------------------------------------------- heads


@falsifies("context-similarity-repeated-token-heads")
def test_repeated_token_heads_falsified_by_shuffled_token_ids(run, real):
    cid = "context-similarity-repeated-token-heads"
    assert_flips(cid, measured(real, ms.repetition_top_fraction),
                 measured(sums_of(run, shuffle_token_ids()), ms.repetition_top_fraction))


@falsifies("context-similarity-heads-specialise")
def test_heads_specialise_falsified_by_permuted_positions(run, real):
    cid = "context-similarity-heads-specialise"
    assert_flips(cid, measured(real, ms.specialised_head_share),
                 measured(sums_of(run, permute_positions()), ms.specialised_head_share))


@falsifies("context-similarity-heads-distinct-tokens")
def test_heads_distinct_tokens_falsified_by_copied_heads(run, real):
    cid = "context-similarity-heads-distinct-tokens"
    assert_flips(cid, measured(real, ms.distinct_hub_share),
                 measured(sums_of(run, copy_first_head), ms.distinct_hub_share))


@falsifies("context-similarity-heads-distinct-features")
def test_heads_distinct_features_falsified_by_copied_heads(run, real):
    cid = "context-similarity-heads-distinct-features"
    assert_flips(cid, measured(real, ms.distinct_features_share),
                 measured(sums_of(run, copy_first_head), ms.distinct_features_share))


@falsifies("context-similarity-token-with-context")
def test_token_with_context_falsified_by_permuted_positions(run, real):
    cid = "context-similarity-token-with-context"
    assert_flips(cid, measured(real, ms.token_context_ratio),
                 measured(sums_of(run, permute_positions()), ms.token_context_ratio))


@falsifies("context-similarity-identical-across-window")
def test_identical_across_window_falsified_by_shuffled_token_ids(run):
    cid = "context-similarity-identical-across-window"
    # identical tokens more than 32 apart are rare (about one expected high pair per
    # window): 48 windows, so that chance is told from twice chance
    enc, tok = cs.load_encoder(None, device="cpu")
    brown = cp.load_corpus("brown")
    order = np.random.default_rng(0).permutation(len(brown.documents)).tolist()
    wins = se.document_windows(brown, tok, order, 1, length=128, max_windows=3 * N_WINDOWS)
    with torch.no_grad():
        more = run["results"] + [cs.analyse_batch(enc, wins[s:s + BATCH])
                                 for s in range(N_WINDOWS, len(wins), BATCH)]
    real = sums_of(run, results=more)
    # MiniLM has no layer 11: its strongest far identical-token head stands in for the
    # paper's layer 11, head 8 (the chapter tests that head on the 12-layer model)
    ratio = ms.head_ratio(real.point, "identical_long_range", "chance_identical_long_range")
    layer, head = divmod(int(ratio.flatten().argmax()), run["n_heads"])
    shuffled = sums_of(run, shuffle_token_ids(), results=more)
    assert_flips(cid, measured(real, ms.identical_far_ratio, layer, head),
                 measured(shuffled, ms.identical_far_ratio, layer, head))


# --------------------------------------------------------------------------- calibration


def test_intervals_cover_other_windows_about_as_often_as_their_level(run):
    """An interval from 8 windows holds the value measured on 8 other windows about as
    often as a 95 % interval should (loosely: the other half's value has its own spread,
    so the rate sits below 0.95; fewer than half would mean intervals far too narrow)."""
    a = sums_of(run, results=run["results"][:1])
    b = sums_of(run, results=run["results"][1:])
    g = run["groups"]
    cases = [(ms.early_uniform_distance, g["early"]), (ms.long_share_difference, g["early"],
             g["middle"]), (ms.short_share, g["middle"]), (ms.short_share, g["final"]),
             (ms.same_sentence_fraction,), (ms.same_sentence_excess,),
             (ms.sentence_beyond_locality, g["final"]), (ms.repetition_top_fraction,),
             (ms.specialised_head_share,), (ms.distinct_hub_share,),
             (ms.token_context_ratio,), (ms.intra_sentence_over_long_range,),
             (ms.separator_ratio, g["final"], run["punct"])]
    inside = []
    for fn, *args in cases:
        lo, hi = ms.evaluate(a, fn, *args).interval
        inside.append(lo <= ms.evaluate(b, fn, *args).value <= hi)
    assert sum(inside) >= len(cases) / 2, inside


def test_window_sums_refuse_what_is_not_per_window_sums():
    with pytest.raises(ValueError, match="window_sums"):
        ms.WindowSums({"same_sentence": torch.zeros(3, 1, 1)})
    with pytest.raises(ValueError, match="level"):
        ms.evaluate(ms.WindowSums({"n_high": torch.ones(3, 1, 1),
                                   "same_sentence": torch.ones(3, 1, 1)}),
                    ms.same_sentence_fraction, level=1.0)


def test_paper_measurements_cover_every_declared_claim(run, real):
    """The chapter's one call measures every declared paper claim (the layer 11, head 8
    claim only on a model of 12 layers of 12 heads), with the functions tested above."""
    from companion.book.statements import inventory

    got = ms.paper_measurements(real, run["groups"], run["punct"])
    declared = set(inventory("context_similarity").claims)
    assert set(got) == declared - {"context-similarity-identical-across-window"}
    direct = ms.evaluate(real, ms.short_share, run["groups"]["final"])
    assert got["context-similarity-final-short-range-dominance"].interval == direct.interval
    with pytest.raises(ValueError, match="groups"):
        ms.paper_measurements(real, {"early": [0], "middle": [], "final": [1]}, run["punct"])


def test_cluster_bootstrap_keeps_a_cluster_together():
    """clusters=: windows of one label are drawn together (each replicate weighs them
    alike), and with every window its own cluster the bootstrap is the window bootstrap."""
    w = {"n_high": torch.ones(6, 1, 1), "same_sentence": torch.tensor(
        [1., 1, 0, 0, 1, 0])[:, None, None]}
    by_doc = ms.WindowSums(w, reps=50, seed=3, clusters=[7, 7, 7, 2, 2, 9])
    assert by_doc.n_clusters == 3
    assert torch.equal(by_doc.weights[:, 0], by_doc.weights[:, 2])
    assert torch.equal(by_doc.weights[:, 3], by_doc.weights[:, 4])
    # every replicate draws 3 clusters: their counts, one window of each, sum to 3
    assert torch.equal(by_doc.weights[:, [0, 3, 5]].sum(1), torch.full((50,), 3.0,
                                                                       dtype=torch.float64))
    own = ms.WindowSums(w, reps=50, seed=3, clusters=list(range(6)))
    plain = ms.WindowSums(w, reps=50, seed=3)
    assert torch.equal(own.weights, plain.weights)
    with pytest.raises(ValueError, match="clusters"):
        ms.WindowSums(w, clusters=[1, 2])
