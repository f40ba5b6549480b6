"""The capture on MPNet (relative position bias) against an independent brute force.

A small random ``MPNetConfig`` (2 layers, 5 heads of size 7, odd window lengths) with
its relative position bias and attention weights scaled up, so that maps are far from
uniform and the bias matters. The brute force recomputes the whole forward from the
weights, head by head in Python loops: embeddings (positions from the input ids, the
padding index 1), LayerNorm by its formula, q, k, v, the relative position buckets
(T5-style, bidirectional, 32 buckets up to distance 128, written out here), the scores
``q k^T / sqrt(d) + bias``, the padding mask, the softmax, the per-head outputs, ``W_O``,
the residual, LayerNorm and the feed-forward block (exact GELU). float32 and float64,
padded and unpadded windows.
"""
from __future__ import annotations

import math

import pytest
import torch

import companion.context_similarity as cs
from companion.context_similarity import (
    CaptureSettings,
    analyse_batch,
    analyse_corpus,
    encoder_layers,
    head_outputs,
    wo_gram,
)
from companion.context_similarity.encoder import is_mpnet, output_projection
from companion.corpora import Windows

L, H, D_HEAD, VOCAB = 2, 5, 7, 41
PAD = 1  # MPNet's padding index (position ids and the pad token)


def _tiny_mpnet(dtype=torch.float64, seed=0, head_size=D_HEAD, intermediate=23):
    from transformers import MPNetConfig, MPNetModel

    torch.manual_seed(seed)
    cfg = MPNetConfig(vocab_size=VOCAB, hidden_size=H * head_size, num_hidden_layers=L,
                      num_attention_heads=H, intermediate_size=intermediate,
                      max_position_embeddings=60, relative_attention_num_buckets=32,
                      hidden_act="gelu", attn_implementation="eager")
    model = MPNetModel(cfg).eval()
    with torch.no_grad():
        # larger than the initialisation's 0.02 std: peaked maps, a bias that matters
        model.encoder.relative_attention_bias.weight.normal_(0, 2.0)
        for layer in model.encoder.layer:
            for lin in (layer.attention.attn.q, layer.attention.attn.k):
                lin.weight.normal_(0, 0.4)
    return model.to(dtype)


def _batch(b=3, t=29, padded=True, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (b, t), generator=g)
    ids[:, 0], ids[:, -1] = 0, 2  # <s> ... </s>
    mask = torch.ones(b, t, dtype=torch.long)
    if padded:
        for w, n_pad in enumerate([0, 6, 11][:b]):
            if n_pad:
                ids[w, t - n_pad - 1] = 2
                ids[w, t - n_pad:] = PAD
                mask[w, t - n_pad:] = 0
    sentence = torch.zeros(b, t, dtype=torch.long)
    sentence[:, t // 2:] = 1
    sentence[:, 0] = -1
    sentence[ids == 2] = -1
    sentence[mask == 0] = -1
    return {"input_ids": ids, "attention_mask": mask, "sentence_ids": sentence}


# --------------------------------------------------------------------------- brute force


def _bucket(relative: int) -> int:
    """MPNet's relative position bucket of ``key - query`` (32 buckets, distance 128)."""
    n = -relative
    bucket = 16 if n < 0 else 0
    n = abs(n)
    if n < 8:
        return bucket + n
    return bucket + min(15, 8 + int(math.log(n / 8) / math.log(128 / 8) * 8))


def _layer_norm(x, ln):
    w, b = ln.weight.double(), ln.bias.double()
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        mu = x[i].mean()
        var = ((x[i] - mu) ** 2).mean()
        out[i] = (x[i] - mu) / math.sqrt(float(var) + ln.eps) * w + b
    return out


def _linear(x, lin):
    return x @ lin.weight.double().T + lin.bias.double()


@torch.no_grad()
def brute_force(model, batch):
    """Per-head outputs [B, L, H, T, d] (pre-W_O), maps [B, L, H, T, T] and final hidden
    states [B, T, D] of an MPNetModel, in float64, window by window and head by head."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    b, t = ids.shape
    emb = model.embeddings
    rel = model.encoder.relative_attention_bias.weight.double()  # [buckets, H]
    zs = torch.zeros(b, L, H, t, D_HEAD, dtype=torch.float64)
    maps = torch.zeros(b, L, H, t, t, dtype=torch.float64)
    hidden_out = torch.zeros(b, t, H * D_HEAD, dtype=torch.float64)
    for w in range(b):
        pos, count = [], 0
        for tok in ids[w].tolist():  # fairseq positions: pads at PAD, others count from PAD+1
            count += tok != PAD
            pos.append(count + PAD if tok != PAD else PAD)
        x = emb.word_embeddings.weight.double()[ids[w]] + \
            emb.position_embeddings.weight.double()[torch.tensor(pos)]
        x = _layer_norm(x, emb.LayerNorm)
        for li, layer in enumerate(model.encoder.layer):
            attn = layer.attention.attn
            q, k, v = (_linear(x, m) for m in (attn.q, attn.k, attn.v))
            heads = []
            for h in range(H):
                sl = slice(h * D_HEAD, (h + 1) * D_HEAD)
                scores = torch.zeros(t, t, dtype=torch.float64)
                for i in range(t):
                    for j in range(t):
                        s = float(q[i, sl] @ k[j, sl]) / math.sqrt(D_HEAD)
                        s += float(rel[_bucket(j - i), h])
                        scores[i, j] = s if mask[w, j] else -math.inf
                probs = torch.softmax(scores, dim=-1)
                maps[w, li, h] = probs
                zs[w, li, h] = probs @ v[:, sl]
                heads.append(zs[w, li, h])
            context = torch.cat(heads, dim=-1)
            a = _layer_norm(_linear(context, attn.o) + x, layer.attention.LayerNorm)
            inter = _linear(a, layer.intermediate.dense)
            inter = 0.5 * inter * (1 + torch.erf(inter / math.sqrt(2)))  # exact GELU
            x = _layer_norm(_linear(inter, layer.output.dense) + a, layer.output.LayerNorm)
        hidden_out[w] = x
    return zs, maps, hidden_out


def _tolerance(dtype):
    return dict(atol=1e-10, rtol=1e-9) if dtype == torch.float64 else dict(atol=5e-5,
                                                                            rtol=5e-4)


@pytest.fixture(scope="module")
def reference_run():
    """The brute force once per padding (float64 weights; the float32 model is the same
    weights rounded, compared at float32 tolerance)."""
    model = _tiny_mpnet()
    return {padded: (_batch(padded=padded), brute_force(model, _batch(padded=padded)))
            for padded in (False, True)}


# --------------------------------------------------------------------------- tests


def test_mpnet_is_recognised_and_its_w_o_found():
    model = _tiny_mpnet()
    assert is_mpnet(model) and len(encoder_layers(model)) == L
    assert output_projection(encoder_layers(model)[0]) is model.encoder.layer[0].attention.attn.o
    from transformers import MPNetConfig, MPNetForMaskedLM

    head = MPNetForMaskedLM(MPNetConfig(vocab_size=VOCAB, hidden_size=10, num_hidden_layers=1,
                                        num_attention_heads=2, intermediate_size=8))
    assert is_mpnet(head) and len(encoder_layers(head)) == 1
    # positions start after the padding index 1: 60 position embeddings, 58 tokens
    head_outputs(model, _batch(b=1, t=58, padded=False))
    with pytest.raises(ValueError, match="windows of 59 tokens exceed the model's maximum "
                       "input length 58"):
        head_outputs(model, _batch(b=1, t=59, padded=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("padded", [False, True])
def test_head_outputs_maps_and_hidden_equal_the_brute_force(reference_run, dtype, padded):
    model = _tiny_mpnet(dtype)
    batch, (z_ref, a_ref, hid_ref) = reference_run[padded]
    ho = head_outputs(model, batch, return_hidden=True)
    assert ho.outputs.shape == (3, L, H, 29, D_HEAD) and ho.outputs.dtype == dtype
    tol = _tolerance(dtype)
    torch.testing.assert_close(ho.outputs.double(), z_ref, **tol)
    torch.testing.assert_close(ho.attentions.double(), a_ref, **tol)
    torch.testing.assert_close(ho.hidden.double(), hid_ref, **tol)
    if padded:  # the padded keys get no attention
        assert float(ho.attentions[2, :, :, :, -11:].abs().max()) == 0.0
    # the bias matters here: without it the maps differ
    assert float((a_ref - _maps_without_bias(model, batch)).abs().max()) > 0.05
    # stopped after the last attention (the analysis's default): the same numbers
    again = head_outputs(model, batch)
    assert torch.equal(again.outputs, ho.outputs) and torch.equal(again.attentions,
                                                                  ho.attentions)
    # post-W_O: the head's contribution W_O^h z^h, summing with the bias to the projection
    post = head_outputs(model, batch, where="post_wo").outputs
    w_o = torch.stack([output_projection(layer).weight.double().view(-1, H, D_HEAD)
                       for layer in model.encoder.layer])
    want = torch.einsum("blhtd,lohd->blhto", z_ref, w_o)
    torch.testing.assert_close(post.double(), want, **tol)
    g = wo_gram(model).double()
    torch.testing.assert_close(g, torch.einsum("lohd,lohe->lhde", w_o, w_o), **tol)


def _maps_without_bias(model, batch):
    saved = model.encoder.relative_attention_bias.weight.detach().clone()
    with torch.no_grad():
        model.encoder.relative_attention_bias.weight.zero_()
        maps = head_outputs(model, batch).attentions.double().clone()
        model.encoder.relative_attention_bias.weight.copy_(saved)
    return maps


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_capture_equals_the_models_own_forward(dtype):
    """The layer-by-layer pass is MPNetModel.forward in eval mode: hidden states and
    ``output_attentions`` maps equal up to the order of float operations (window by
    window here, batched there; padded windows included), and the model's attention
    implementation is untouched. Head size 16 (all-mpnet-base-v2's is 64): its
    ``1 / sqrt(d)`` is exact, so multiplying the scores by it (here) and dividing them
    by ``sqrt(d)`` (MPNet's code) round alike."""
    model = _tiny_mpnet(dtype, head_size=16)
    batch = _batch(t=31)
    ho = head_outputs(model, batch, return_hidden=True)
    with torch.no_grad():
        own = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    output_attentions=True)
    tol = dict(atol=1e-12, rtol=0) if dtype == torch.float64 else dict(atol=2e-6, rtol=0)
    torch.testing.assert_close(ho.hidden, own.last_hidden_state, **tol)
    torch.testing.assert_close(ho.attentions, torch.stack(own.attentions, 1), **tol)
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_analyse_batch_on_mpnet_with_and_without_the_maps(dtype):
    model = _tiny_mpnet(dtype)
    batch = _batch()
    ho = head_outputs(model, batch)
    res = analyse_batch(model, batch, where="post_wo")
    assert torch.equal(res.outputs, ho.outputs)
    assert torch.equal(torch.stack(res.attentions, 1), ho.attentions)
    content = (batch["attention_mask"].bool() & (batch["sentence_ids"] >= 0)).to(dtype)
    received = torch.einsum("bq,blhqk->blhk", content, ho.attentions)
    torch.testing.assert_close(res.received_attention, received, **_tolerance(dtype))
    high = analyse_batch(model, batch, attention_threshold=0.1)
    assert high.attentions is None
    assert torch.equal(high.high_attention[1], ho.attentions.permute(1, 0, 2, 3, 4) >= 0.1)


def _windows(n=7, t=23, seed=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n, t), generator=g)
    ids[:, 0], ids[:, -1] = 0, 2
    ids[:, 5::6] = 4  # a "." every few tokens
    sentence = torch.cumsum((ids == 4).long(), 1) - (ids == 4).long()
    sentence[:, 0] = sentence[:, -1] = -1
    doc = torch.zeros(n, t, dtype=torch.long)
    doc[:, 0] = doc[:, -1] = -1
    return Windows(ids, torch.ones(n, t, dtype=torch.long), sentence, doc, "random")


SEPARATORS = {".": 4, ",": 5, "[SEP]": 2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_corpus_pass_on_mpnet_lanes_equal_one_batch_at_a_time(dtype):
    """Lanes (one intra-op thread each) give the statistics of one batch at a time on two
    threads, bit for bit. Even widths here (hidden 40, feed-forward 24), as real models have:
    a float64 GEMM with an odd output width (23, 35) gives other bits at 1 and 2 threads
    (measured with a bare nn.Linear), which is the linear algebra library's, not MPNet's."""
    model = _tiny_mpnet(dtype, head_size=8, intermediate=24)
    wins = _windows()
    opts = dict(separators=SEPARATORS, batch_size=2, percentile=10.0, progress=False,
                nproc=1, where=("pre_wo", "post_wo"), per_window=(True, False))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        lanes = analyse_corpus(model, wins, **opts)
        serial = analyse_corpus(model, wins, settings=CaptureSettings(
            lanes=1, side_by_side_updates=False), **opts)
    finally:
        torch.set_num_threads(before)
    assert int(lanes[0].n_windows) == len(wins)
    for got, want in zip(lanes, serial):
        for name, value in want.tensors().items():
            assert torch.equal(getattr(got, name), value), name
    assert model.config._attn_implementation == "eager"
    cs.clear_workspaces()


def test_corpus_pass_on_mpnet_under_torchrun_equals_one_process():
    model = _tiny_mpnet(torch.float64)
    wins = _windows()
    opts = dict(separators=SEPARATORS, batch_size=2, percentile=10.0, progress=False)
    one = analyse_corpus(model, wins, nproc=1, **opts)
    two = analyse_corpus(model, wins, nproc=2, **opts)
    assert int(two.n_windows) == len(wins)
    for name, value in one.tensors().items():
        other = getattr(two, name)
        if value.is_floating_point():
            torch.testing.assert_close(other, value, atol=1e-9, rtol=1e-9, msg=name)
        else:
            assert torch.equal(other, value), name


def test_the_assembled_all_mpnet_base_v2_end_to_end():
    """The real checkpoint from the models directory (skipped where it is not assembled):
    an MPNetModel of 12 layers of 12 heads, its separator token '</s>', and analyse_batch
    on two windows equal to the model's own maps."""
    from companion import models

    try:
        path = models.model_path(models.MPNET)
    except cs.ModelNotFoundError as exc:
        pytest.skip(str(exc))
    model, tok = cs.load_encoder(path, device="cpu")
    assert type(model).__name__ == "MPNetModel" and is_mpnet(model)
    assert len(encoder_layers(model)) == 12 and model.config.num_attention_heads == 12
    seps = cs.separator_ids(tok)
    assert seps["[SEP]"] == tok.sep_token_id == tok.convert_tokens_to_ids("</s>")
    enc = tok(["The cat sat on the mat. It was warm, and quiet.", "Short one."],
              padding=True, return_tensors="pt")
    batch = dict(enc)
    batch["sentence_ids"] = torch.where(
        (enc["attention_mask"] == 1) & (enc["input_ids"] > 2), 0, -1)
    res = analyse_batch(model, batch)
    with torch.no_grad():
        own = model(**enc, output_attentions=True)
    assert res.outputs.shape[1:4] == (12, 12, enc["input_ids"].shape[1])
    assert torch.equal(torch.stack(res.attentions, 1), torch.stack(own.attentions, 1))
