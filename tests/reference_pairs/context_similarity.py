"""Pairs of the context_similarity package: every fast path against the definitions in
``companion.context_similarity.reference``.

- ``similarity``: the batched Gram matrices against a per-head loop (with and without a
  metric, one window of two tokens, an empty batch);
- ``top_pairs``: the pyramid search against sorting every pair of the upper triangle:
  odd sizes, segment lengths that do not divide ``T``, tied similarities (repeated
  tokens), windows with fewer pairs than ``k`` (one token, none);
- ``stats`` / ``window_sums``: the fused statistics against the pair-by-pair reference
  (padding, short and empty windows, a metric as for post-W_O);
- ``capture``: the one-pass capture of ``hook_z`` / ``hook_pattern`` against a plain
  forward whose per-head outputs are recomputed head by head (a small random BERT).
"""
from __future__ import annotations

import torch

from companion.context_similarity import (
    BatchResult,
    SimilarityStats,
    head_outputs,
    similarity_matrices,
    top_pairs,
)
from companion.context_similarity import reference as ref
from companion.context_similarity import stats as stats_module

from reference_pairs import Pair, assert_same

NEG_INF = float("-inf")


def _sizes(size: str) -> dict:
    """``"b3-t13-metric"`` -> {"b": 3, "t": 13, "metric": True}."""
    out = {}
    for part in size.split("-"):
        name = part.rstrip("0123456789")
        out[name] = int(part[len(name):]) if part[len(name):] else True
    return out


# ------------------------------------------------------------------ similarity


def _make_outputs(size, dtype, device, generator):
    s = _sizes(size)
    b, t, n_l, n_h, d = s.get("b", 2), s["t"], 2, 3, 5
    z = torch.randn(b, n_l, n_h, t, d, generator=generator, dtype=torch.float64)
    metric = None
    if s.get("metric"):
        m = torch.randn(n_l, n_h, d, d, generator=generator, dtype=torch.float64)
        metric = (m @ m.transpose(-1, -2)).to(dtype).to(device)
    return z.to(dtype).to(device), metric


def _similarity_fast(z, metric):
    return similarity_matrices(z, metric=metric)


def _similarity_reference(z, metric):
    return ref.similarity_reference(z, metric)


# ------------------------------------------------------------------ top pairs


def _make_top(size, dtype, device, generator):
    s = _sizes(size)
    b, t, n_l, n_h, d = 4, s["t"], 2, 2, 5
    z = torch.randn(b, n_l, n_h, t, d, generator=generator, dtype=torch.float64)
    if s.get("ties"):  # repeated tokens: equal similarities everywhere they meet
        z[..., 1::3, :] = z[..., 0:1, :]
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[:, 0] = valid[:, -1] = False
    if s.get("few"):  # fewer pairs than k: 3 pairs, one token, none
        valid[1] = False
        valid[1, [1, 3, t - 2]] = True
        valid[2] = False
        valid[2, t // 2] = True
        valid[3] = False
    n = t - 2
    k = s.get("k", max(1, n * (n - 1) // 2 // 10))
    metric = None
    if s.get("metric"):
        m = torch.randn(n_l, n_h, d, d, generator=generator, dtype=torch.float64)
        metric = (m @ m.transpose(-1, -2)).to(dtype).to(device)
    return z.to(dtype).to(device), valid.to(device), k, metric, s.get("seg", 32)


def _top_view(z, valid, k, metric, values, i, j) -> dict:
    """What a top-k result must satisfy, whichever of tied pairs it picked: the values
    (sorted), the reference similarity at each returned pair, that each is a pair of
    valid tokens ``i < j`` (fillers ``i = j = 0`` after them), and how many distinct
    pairs each matrix holds."""
    sims = ref.similarity_reference(z.double(), None if metric is None else metric.double())
    t = z.shape[3]
    n = valid.sum(1)
    per_window = torch.clamp(n * (n - 1) // 2, max=k)  # pairs each window returns
    slot = (torch.arange(k, device=z.device) < per_window[:, None])[:, None, None, :]
    at = sims.flatten(-2).gather(-1, i * t + j)
    both_valid = (valid.gather(1, i.flatten(1)) & valid.gather(1, j.flatten(1))).view(i.shape)
    is_pair = torch.where(slot, (i < j) & both_valid, (i == 0) & (j == 0))
    key = torch.where(slot, i * t + j, -1)
    distinct = torch.tensor([[[len(set(key[w, a, h].tolist()) - {-1}) for h in
                               range(key.shape[2])] for a in range(key.shape[1])]
                             for w in range(key.shape[0])])
    return {"values": values.double(), "similarity_at_pair": torch.where(slot, at, NEG_INF),
            "is_pair": is_pair, "distinct_pairs": distinct}


def _top_fast(z, valid, k, metric, segment):
    v, i, j = top_pairs(z, valid, k, metric=metric, segment=segment)
    return _top_view(z, valid, k, metric, v, i, j)


def _top_reference(z, valid, k, metric, segment):
    v, i, j = ref.top_pairs_reference(ref.similarity_reference(z, metric), valid, k)
    return _top_view(z, valid, k, metric, v, i, j)


def _compare_top(fast, reference, dtype):
    rtol, atol = (1e-4, 1e-4) if dtype == torch.float32 else (1e-10, 1e-10)
    for name in ("values", "similarity_at_pair"):
        assert_same(fast[name], reference[name], exact=False, rtol=rtol, atol=atol,
                    where=f"top_pairs {name}")
    for name in ("is_pair", "distinct_pairs"):
        assert_same(fast[name], reference[name], exact=True, rtol=0, atol=0,
                    where=f"top_pairs {name}")


# ------------------------------------------------------------------ statistics

SEPARATORS = {"sep": 2, "comma": 4}
VOCAB = 9


def _make_batch(size, dtype, device, generator):
    """A BatchResult: ``[CLS] content [SEP] padding`` windows, sentences of 1-4 tokens,
    normalised random attention; ``content`` lists each window's content tokens."""
    s = _sizes(size)
    t, n_l, n_h, d = s["t"], 2, 3, 4
    content = {"mixed": (t - 2, 3, 1, 0, 5), "full": (t - 2, t - 2, t - 4)}[
        "mixed" if s.get("mixed") else "full"] if t > 2 else (0,)
    b = len(content)
    z = torch.randn(b, n_l, n_h, t, d, generator=generator, dtype=torch.float64)
    mask = torch.zeros(b, t, dtype=torch.long)
    ids = torch.randint(3, VOCAB, (b, t), generator=generator)
    sent = torch.full((b, t), -1)
    for w, n in enumerate(content):
        mask[w, :n + 2] = 1
        ids[w, 0], ids[w, n + 1], ids[w, n + 2:] = 1, 2, 0  # [CLS], [SEP], padding
        ends = torch.randint(1, 5, (t,), generator=generator).cumsum(0)
        sent[w, 1:n + 1] = torch.bucketize(torch.arange(n), ends, right=True)
    attn = torch.rand(b, n_l, n_h, t, t, generator=generator, dtype=torch.float64) ** 4
    attn = attn * mask[:, None, None, None, :]
    attn = attn / attn.sum(-1, keepdim=True)
    metric = None
    if s.get("metric"):
        m = torch.randn(n_l, n_h, d, d, generator=generator, dtype=torch.float64)
        metric = (m @ m.transpose(-1, -2)).to(dtype).to(device)
    res = BatchResult(z.to(dtype).to(device), attn.to(dtype).to(device), ids.to(device),
                      sent.to(device), mask.to(device), metric)
    tracked = torch.randint(3, VOCAB, (n_l, n_h), generator=generator).to(device)
    return res, float(s.get("p", 10)), tracked


def _stats_fast(res, percentile, tracked):
    _, n_l, n_h, t, _ = res.outputs.shape
    stats = SimilarityStats(n_l, n_h, t, VOCAB, percentile=percentile,
                            attention_threshold=0.08, separators=SEPARATORS,
                            device=res.outputs.device).update(res)
    return {name: value.double().cpu() for name, value in stats.tensors().items()}


def _stats_reference(res, percentile, tracked):
    return ref.stats_reference(res, percentile, 0.08, SEPARATORS, VOCAB)


def _window_sums_fast(res, percentile, tracked):
    _, n_l, n_h, t, _ = res.outputs.shape
    stats = SimilarityStats(n_l, n_h, t, VOCAB, percentile=percentile,
                            attention_threshold=0.08, separators=SEPARATORS, per_window=True,
                            device=res.outputs.device).track_tokens(tracked)
    return {name: value.cpu() for name, value in stats.update(res).window_sums().items()}


def _window_sums_reference(res, percentile, tracked):
    return ref.window_sums_reference(res, percentile, 0.08, SEPARATORS, tracked,
                                     stats_module.SHORT_RANGE, stats_module.LONG_RANGE)


def _without_maps(res):
    """The batch as the corpus pass hands it over: no maps, only A >= 0.08 ([L, B, H,
    T, T] bool) and the attention keys receive from content queries."""
    content = (res.attention_mask.bool() & (res.sentence_ids >= 0)).to(res.attentions.dtype)
    received = torch.einsum("bq,blhqk->blhk", content, res.attentions)
    high = (0.08, (res.attentions >= 0.08).permute(1, 0, 2, 3, 4).contiguous())
    return res._replace(attentions=None, received_attention=received, high_attention=high)


def _stats_high_attention_fast(res, percentile, tracked):
    _, n_l, n_h, t, _ = res.outputs.shape
    stats = SimilarityStats(n_l, n_h, t, VOCAB, percentile=percentile,
                            attention_threshold=0.08, separators=SEPARATORS, per_window=True,
                            device=res.outputs.device).track_tokens(tracked)
    stats.update(_without_maps(res))
    return ({name: value.double().cpu() for name, value in stats.tensors().items()},
            {name: value.cpu() for name, value in stats.window_sums().items()})


def _stats_high_attention_reference(res, percentile, tracked):
    return (_stats_reference(res, percentile, tracked),
            _window_sums_reference(res, percentile, tracked))


# ------------------------------------------------------------------ capture


def _make_capture(size, dtype, device, generator):
    """A small random BERT (2 layers, 3 heads of size 4) and a batch with padding."""
    from transformers import BertConfig, BertModel

    s = _sizes(size)
    b, t = s.get("b", 2), s["t"]
    cfg = BertConfig(vocab_size=30, hidden_size=12, num_hidden_layers=2,
                     num_attention_heads=3, intermediate_size=24, max_position_embeddings=64,
                     attn_implementation="eager")
    model = BertModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=generator, dtype=torch.float64))
    model = model.to(device=device, dtype=dtype)
    ids = torch.randint(3, 30, (b, t), generator=generator)
    mask = torch.ones(b, t, dtype=torch.long)
    if b > 1 and t > 3:
        mask[-1, t - 2:] = 0  # padding in the last window
    return model, {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def _capture_fast(model, batch):
    out = head_outputs(model, batch)
    return out.outputs, out.attentions


def _capture_reference(model, batch):
    return ref.head_outputs_reference(model, batch)


LOOSE = {torch.float32: (1e-4, 1e-5), torch.float64: (1e-9, 1e-11)}

PAIRS = [
    Pair("context_similarity.similarity", _similarity_fast, _similarity_reference,
         _make_outputs, sizes=("t13", "t37-metric", "b1-t2", "b0-t5"),
         covers=(similarity_matrices,)),
    Pair("context_similarity.top_pairs", _top_fast, _top_reference, _make_top,
         sizes=("t37-seg16", "t24-seg4-metric", "t21-ties", "t13-few-k25", "t48-seg8-ties",
                "t10-seg16-k3"),
         compare=_compare_top, covers=(top_pairs,)),
    Pair("context_similarity.stats", _stats_fast, _stats_reference, _make_batch,
         sizes=("t20", "t13-mixed", "t17-mixed-metric-p5", "t2"), tolerances=LOOSE,
         covers=(SimilarityStats,)),
    Pair("context_similarity.window_sums", _window_sums_fast, _window_sums_reference,
         _make_batch, sizes=("t13-mixed-p50", "t40-p5"), tolerances=LOOSE,
         covers=(stats_module.log2_bin, stats_module.mode_count, stats_module.n_distance_bins)),
    Pair("context_similarity.stats_high_attention", _stats_high_attention_fast,
         _stats_high_attention_reference, _make_batch,
         sizes=("t13-mixed", "t17-mixed-metric-p5", "t20-p50"), tolerances=LOOSE),
    Pair("context_similarity.capture", _capture_fast, _capture_reference, _make_capture,
         sizes=("b2-t7", "b1-t2", "b3-t13"), covers=(head_outputs,)),
]
