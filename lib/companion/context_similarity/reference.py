"""The definitions of the chapter as plain code: what every fast path here must equal.

Short and untuned on purpose (loops over layers, heads, windows and pairs; dense
tensors): each function reads like the equation it implements, and
``tests/reference_pairs/context_similarity.py`` holds the fast path to it.

- :func:`head_outputs_reference`: per-head outputs ``z^{lh}_i = sum_j A^{lh}_ij v^{lh}_j``
  and attention maps ``A^{lh} = softmax(q k^T / sqrt(d) + mask)``, recomputed head by
  head from each layer's input (fast path: :func:`~companion.context_similarity.head_outputs`);
- :func:`similarity_reference`: the Gram matrix ``S^{lh}_ij = z_i^T M z_j`` of every
  head, diagonal zeroed (fast: :func:`~companion.context_similarity.similarity_matrices`);
- :func:`top_pairs_reference`: the ``k`` largest ``S_ij``, ``i < j`` both valid, by
  sorting every pair of the upper triangle (fast: :func:`~companion.context_similarity.top_pairs`);
- :func:`stats_reference` and :func:`window_sums_reference`: every statistic of
  :class:`~companion.context_similarity.SimilarityStats`, pair by pair.
"""
from __future__ import annotations

import math

import torch

__all__ = [
    "head_outputs_reference",
    "similarity_reference",
    "stats_reference",
    "top_pairs_reference",
    "window_sums_reference",
]


@torch.no_grad()
def head_outputs_reference(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head outputs [B, L, H, T, d] and attention maps [B, L, H, T, T], float64,
    recomputed head by head from the input of every layer's self-attention.

    ``z^{lh}_i = sum_j A^{lh}_ij (W_V^h x_j + b_V^h)`` with
    ``A^{lh} = softmax_j((W_Q^h x_i + b_Q^h) . (W_K^h x_j + b_K^h) / sqrt(d) + m_j)``,
    ``m_j = -inf`` (the dtype's minimum) at padding keys.

    >>> from transformers import BertConfig, BertModel
    >>> model = BertModel(BertConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
    ...     intermediate_size=16, vocab_size=20, attn_implementation="eager")).eval()
    >>> batch = {"input_ids": torch.tensor([[1, 5, 7, 2]]),
    ...          "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    >>> z, a = head_outputs_reference(model, batch)
    >>> tuple(z.shape), tuple(a.shape)
    ((1, 2, 2, 4, 4), (1, 2, 2, 4, 4))
    """
    from companion.context_similarity.encoder import encoder_layers

    layers = encoder_layers(model)
    inputs = {}  # the hidden states x entering each layer's self-attention
    handles = [layer.attention.self.register_forward_hook(
        lambda mod, args, kwargs, out, i=i: inputs.__setitem__(
            i, args[0] if args else kwargs["hidden_states"]),
        with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        model(**{key: batch[key] for key in ("input_ids", "attention_mask", "token_type_ids")
                 if key in batch})
    finally:
        for h in handles:
            h.remove()
    n_heads = model.config.num_attention_heads
    d = model.config.hidden_size // n_heads
    mask = batch.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(batch["input_ids"])
    key_bias = (1.0 - mask.double()) * torch.finfo(torch.float64).min  # [B, T]
    zs, maps = [], []
    for i, layer in enumerate(layers):
        x = inputs[i].double()
        att = layer.attention.self
        per_z, per_a = [], []
        for h in range(n_heads):
            rows = slice(h * d, (h + 1) * d)
            q = x @ att.query.weight[rows].double().T + att.query.bias[rows].double()
            k = x @ att.key.weight[rows].double().T + att.key.bias[rows].double()
            v = x @ att.value.weight[rows].double().T + att.value.bias[rows].double()
            a = (q @ k.transpose(-1, -2) / math.sqrt(d) + key_bias[:, None, :]).softmax(-1)
            per_a.append(a)
            per_z.append(a @ v)
        zs.append(torch.stack(per_z, 1))
        maps.append(torch.stack(per_a, 1))
    return torch.stack(zs, 1), torch.stack(maps, 1)


def similarity_reference(outputs: torch.Tensor, metric: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """``S^{lh}_ij = z_i^T M^{lh} z_j`` (``M = I`` without a metric), ``S_ii = 0``: one
    Gram matrix per window, layer and head, [B, L, H, T, T].

    >>> z = torch.tensor([[[[[1.0, 0.0], [2.0, 1.0], [0.0, 3.0]]]]])  # [1, 1, 1, 3, 2]
    >>> similarity_reference(z)[0, 0, 0]
    tensor([[0., 2., 0.],
            [2., 0., 3.],
            [0., 3., 0.]])
    """
    b, n_layers, n_heads, t, _ = outputs.shape
    sims = torch.zeros(b, n_layers, n_heads, t, t, dtype=outputs.dtype, device=outputs.device)
    for w in range(b):
        for layer in range(n_layers):
            for h in range(n_heads):
                z = outputs[w, layer, h]  # [T, d]
                m = (torch.eye(z.shape[1], dtype=z.dtype, device=z.device) if metric is None
                     else metric[layer, h].to(z.dtype))
                s = z @ m @ z.T
                s.fill_diagonal_(0)
                sims[w, layer, h] = s
    return sims


def top_pairs_reference(similarity: torch.Tensor, valid: torch.Tensor, k: int):
    """The ``k`` most similar pairs ``i < j`` of valid tokens of every matrix, by sorting
    all of them: (values, i, j), each [B, L, H, k], by decreasing value (ties by the
    order of the pairs ``(0, 1), (0, 2), ..., (1, 2), ...``). A window with fewer than
    ``k`` pairs fills the rest with value ``-inf`` and ``i = j = 0``.

    >>> s = torch.tensor([[[[[0., 5., 1.], [5., 0., 7.], [1., 7., 0.]]]]])
    >>> v, i, j = top_pairs_reference(s, torch.ones(1, 3, dtype=torch.bool), 2)
    >>> v.flatten().tolist(), i.flatten().tolist(), j.flatten().tolist()
    ([7.0, 5.0], [1, 0], [2, 1])
    """
    b, n_layers, n_heads, t, _ = similarity.shape
    values = torch.full((b, n_layers, n_heads, k), float("-inf"), dtype=similarity.dtype)
    first = torch.zeros(b, n_layers, n_heads, k, dtype=torch.long)
    second = torch.zeros(b, n_layers, n_heads, k, dtype=torch.long)
    sims = similarity.detach().cpu().tolist()  # nested lists: sims[w][l][h][i][j]
    for w in range(b):
        tokens = [p for p in range(t) if bool(valid[w, p])]
        pairs = [(i, j) for a, i in enumerate(tokens) for j in tokens[a + 1:]]
        for layer in range(n_layers):
            for h in range(n_heads):
                s = sims[w][layer][h]
                ranked = sorted(pairs, key=lambda p: -s[p[0]][p[1]])
                for slot, (i, j) in enumerate(ranked[:k]):
                    values[w, layer, h, slot] = s[i][j]
                    first[w, layer, h, slot], second[w, layer, h, slot] = i, j
    dev = similarity.device
    return values.to(dev), first.to(dev), second.to(dev)


def _sum_shapes(n_layers, n_heads, t, vocab, n_separators):
    from companion.context_similarity.stats import STATISTICS  # the names and shapes only

    dims = {"L": n_layers, "H": n_heads, "T": t, "V": vocab, "S": n_separators}
    return {s.name: tuple(dims[c] for c in s.shape) for s in STATISTICS.values()
            if s.total is not None}


def stats_reference(result, percentile: float, threshold: float, separators: dict,
                    vocab_size: int) -> dict[str, torch.Tensor]:
    """Every sum of :class:`~companion.context_similarity.SimilarityStats` over one
    :class:`~companion.context_similarity.BatchResult`, pair by pair (float64).

    Per window: the content tokens (mask 1, sentence id >= 0) and their pairs ``i < j``;
    ``k = min(max(1, round(P percentile / 100)), P)`` of its ``P`` pairs are "high" per
    layer and head (the largest similarities). Each high pair counts once in ``n_high``,
    in ``distance_hist[j - i]``, in ``same_sentence`` when both tokens lie in one
    sentence, in ``identical`` (and ``identical_distance_hist``) when they are the same
    token, twice in ``token_counts`` (both endpoints), in ``in_attention_region`` when
    ``max(A_ij, A_ji) >= threshold``, else in the ``masked_*`` sums. Chance levels: ``k``
    times the share of the window's content pairs in one sentence / of identical tokens
    (``chance_same_sentence``, ``chance_identical``), and, pair by pair, the share of
    same-sentence pairs among the window's content pairs at the same distance
    (``chance_same_sentence_distance``). Separator attention: the attention mass content
    queries put on each separator kind; its chance: content queries times the share of
    separator keys among the non-padding keys.

    >>> from companion.context_similarity import BatchResult, SimilarityStats
    >>> g = torch.Generator().manual_seed(0)
    >>> z = torch.randn(1, 2, 2, 6, 4, generator=g, dtype=torch.float64)  # [B, L, H, T, d]
    >>> attn = torch.softmax(torch.randn(1, 2, 2, 6, 6, generator=g, dtype=torch.float64), -1)
    >>> ids, sent = torch.tensor([[1, 7, 8, 5, 7, 2]]), torch.tensor([[-1, 0, 0, 0, 1, -1]])
    >>> result = BatchResult(z, attn, ids, sent, torch.ones(1, 6, dtype=torch.long))
    >>> stats = SimilarityStats(n_layers=2, n_heads=2, length=6, vocab_size=10,
    ...                         separators={".": 5}).update(result)
    >>> ref = stats_reference(result, stats.percentile, stats.attention_threshold, {".": 5}, 10)
    >>> ref["n_high"].tolist(), torch.equal(ref["n_high"].long(), stats.n_high)
    ([[1.0, 1.0], [1.0, 1.0]], True)
    """
    z, attn, ids, sent, mask = (result.outputs.double(), result.attentions,
                                result.input_ids, result.sentence_ids,
                                result.attention_mask.bool())
    attn = (torch.stack(attn, 1) if isinstance(attn, (tuple, list)) else attn).double()
    b, n_l, n_h, t, _ = z.shape
    out = {name: torch.zeros(shape, dtype=torch.float64) for name, shape in _sum_shapes(
        n_l, n_h, t, vocab_size, len(separators)).items()}
    metric = None if result.metric is None else result.metric.double()
    sims = similarity_reference(z, metric).cpu()
    out["similarity_sum"] = sims.sum(0)
    sims_list = sims.tolist()
    z, attn, ids, sent, mask = z.cpu(), attn.cpu(), ids.cpu(), sent.cpu(), mask.cpu()
    for w in range(b):
        valid = [p for p in range(t) if mask[w, p] and sent[w, p] >= 0]
        pairs = [(i, j) for a, i in enumerate(valid) for j in valid[a + 1:]]
        k = min(max(1, round(len(pairs) * percentile / 100)), len(pairs))  # 0 if no pair
        same = {(i, j): bool(sent[w, i] == sent[w, j]) for i, j in pairs}
        ident = {(i, j): bool(ids[w, i] == ids[w, j]) for i, j in pairs}
        q = {}  # P(same sentence | distance)
        for dd in range(1, t):
            at = [p for p in pairs if p[1] - p[0] == dd]
            q[dd] = sum(same[p] for p in at) / len(at) if at else 0.0
        p_same = sum(same.values()) / max(1, len(pairs))
        p_ident = sum(ident.values()) / max(1, len(pairs))
        for tok in valid:
            out["corpus_token_counts"][ids[w, tok]] += 1
        out["n_windows"] += 1
        out["n_queries"] += len(valid)
        n_keys = int(mask[w].sum())
        for si, sid in enumerate(separators.values()):
            keys = [p for p in range(t) if mask[w, p] and ids[w, p] == sid]
            out["chance_separator"][si] += len(valid) * len(keys) / n_keys
            for layer in range(n_l):
                for h in range(n_h):
                    out["separator_attention"][layer, h, si] += sum(
                        float(attn[w, layer, h, qq, kk]) for qq in valid for kk in keys)
        for layer in range(n_l):
            for h in range(n_h):
                ranked = sorted(pairs, key=lambda p: -sims_list[w][layer][h][p[0]][p[1]])
                out["chance_same_sentence"][layer, h] += k * p_same
                out["chance_identical"][layer, h] += k * p_ident
                for i, j in ranked[:k]:
                    dd = j - i
                    region = max(attn[w, layer, h, i, j], attn[w, layer, h, j, i]) >= threshold
                    out["n_high"][layer, h] += 1
                    out["distance_hist"][layer, h, dd] += 1
                    out["same_sentence"][layer, h] += same[(i, j)]
                    out["chance_same_sentence_distance"][layer, h] += q[dd]
                    out["identical"][layer, h] += ident[(i, j)]
                    out["identical_distance_hist"][layer, h, dd] += ident[(i, j)]
                    out["token_counts"][layer, h, ids[w, i]] += 1
                    out["token_counts"][layer, h, ids[w, j]] += 1
                    out["in_attention_region"][layer, h] += bool(region)
                    if not region:
                        out["masked_distance_hist"][layer, h, dd] += 1
                        out["masked_same_sentence"][layer, h] += same[(i, j)]
                        out["masked_chance_same_sentence_distance"][layer, h] += q[dd]
    return out


def window_sums_reference(result, percentile: float, threshold: float, separators: dict,
                          tracked: torch.Tensor, short: int, long_: int
                          ) -> dict[str, torch.Tensor]:
    """Every window's own part of the sums (``SimilarityStats(per_window=True)``), pair
    by pair (float64): those of :func:`stats_reference` per window, and ``n_masked``,
    ``distance_sum``, ``short_range`` (``j - i <= short``), ``long_range`` (``> long_``),
    ``identical_long_range``, their chance counts (``k`` times the mean over the window's
    content pairs), ``tracked_endpoints`` / ``tracked_content`` of the token
    ``tracked[l, h]``, and the per-input sums (``distance_bins``, the hub token's counts
    ``hub_*``, ``mid_same_sentence``, their chance counts), by counting.

    >>> from companion.context_similarity import BatchResult, SimilarityStats
    >>> from companion.context_similarity.stats import LONG_RANGE, SHORT_RANGE
    >>> g = torch.Generator().manual_seed(0)
    >>> z = torch.randn(1, 2, 2, 6, 4, generator=g, dtype=torch.float64)  # [B, L, H, T, d]
    >>> attn = torch.softmax(torch.randn(1, 2, 2, 6, 6, generator=g, dtype=torch.float64), -1)
    >>> ids, sent = torch.tensor([[1, 7, 8, 5, 7, 2]]), torch.tensor([[-1, 0, 0, 0, 1, -1]])
    >>> result = BatchResult(z, attn, ids, sent, torch.ones(1, 6, dtype=torch.long))
    >>> stats = SimilarityStats(n_layers=2, n_heads=2, length=6, vocab_size=10,
    ...                         separators={".": 5}, per_window=True).update(result)
    >>> ref = window_sums_reference(result, stats.percentile, stats.attention_threshold,
    ...                             {".": 5}, torch.zeros(2, 2, dtype=torch.long), SHORT_RANGE,
    ...                             LONG_RANGE)
    >>> ours = stats.window_sums()
    >>> all(torch.allclose(ref[k].double(), ours[k].double()) for k in ref if k in ours)
    True
    """
    z, attn, ids, sent, mask = (result.outputs.double(), result.attentions,
                                result.input_ids, result.sentence_ids,
                                result.attention_mask.bool())
    attn = (torch.stack(attn, 1) if isinstance(attn, (tuple, list)) else attn).double()
    b, n_l, n_h, t, _ = z.shape
    metric = None if result.metric is None else result.metric.double()
    sims_list = similarity_reference(z, metric).cpu().tolist()
    attn, ids, sent, mask, tracked = attn.cpu(), ids.cpu(), sent.cpu(), mask.cpu(), tracked.cpu()
    names = ["n_high", "same_sentence", "chance_same_sentence",
             "chance_same_sentence_distance", "identical", "chance_identical",
             "in_attention_region", "n_masked", "masked_same_sentence",
             "masked_chance_same_sentence_distance", "distance_sum", "chance_distance_sum",
             "short_range", "chance_short_range", "long_range", "chance_long_range",
             "identical_long_range", "chance_identical_long_range", "mid_same_sentence",
             "chance_mid_same_sentence", "hub_endpoints", "hub_pairs", "hub_near",
             "unrelated"]
    out = {n: torch.zeros(b, n_l, n_h, dtype=torch.float64)
           for n in names + ["tracked_endpoints", "tracked_content"]}
    out["n_queries"] = torch.zeros(b, dtype=torch.float64)
    out["separator_attention"] = torch.zeros(b, n_l, n_h, len(separators), dtype=torch.float64)
    out["chance_separator"] = torch.zeros(b, len(separators), dtype=torch.float64)
    n_bins = max(1, (t - 1).bit_length())
    out["distance_bins"] = torch.zeros(b, n_l, n_h, n_bins, dtype=torch.float64)
    out["chance_distance_bins"] = torch.zeros(b, n_bins, dtype=torch.float64)
    out["chance_hub_endpoints"] = torch.zeros(b, dtype=torch.float64)
    out["hub_distinct"] = torch.zeros(b, n_l, dtype=torch.float64)

    def log2_bin(dd):  # bin b: 2^b <= dd < 2^(b + 1)
        return min(n_bins - 1, max(0, dd.bit_length() - 1))

    for w in range(b):
        valid = [p for p in range(t) if mask[w, p] and sent[w, p] >= 0]
        pairs = [(i, j) for a, i in enumerate(valid) for j in valid[a + 1:]]
        k = min(max(1, round(len(pairs) * percentile / 100)), len(pairs))
        out["n_queries"][w] = len(valid)
        n_keys = int(mask[w].sum())
        for si, sid in enumerate(separators.values()):
            keys = [p for p in range(t) if mask[w, p] and ids[w, p] == sid]
            out["chance_separator"][w, si] = len(valid) * len(keys) / n_keys
            for layer in range(n_l):
                for h in range(n_h):
                    out["separator_attention"][w, layer, h, si] = sum(
                        float(attn[w, layer, h, qq, kk]) for qq in valid for kk in keys)
        for layer in range(n_l):
            for h in range(n_h):
                out["tracked_content"][w, layer, h] = sum(
                    int(ids[w, p] == tracked[layer, h]) for p in valid)
        if not pairs:
            continue
        from companion.context_similarity.stats import uniform_pairs_mode_count

        out["chance_hub_endpoints"][w] = uniform_pairs_mode_count(
            torch.tensor([int(ids[w, p]) for p in valid]), k)
        for i, j in pairs:
            out["chance_distance_bins"][w, log2_bin(j - i)] += k / len(pairs)
        same = {p: bool(sent[w, p[0]] == sent[w, p[1]]) for p in pairs}
        q = {dd: (sum(same[p] for p in pairs if p[1] - p[0] == dd)
                  / max(1, sum(1 for p in pairs if p[1] - p[0] == dd))) for dd in range(1, t)}

        def chance(f):  # k times the window's mean of f over its content pairs
            return k * sum(f(p) for p in pairs) / len(pairs)

        for layer in range(n_l):
            hubs = []
            for h in range(n_h):
                o = {n: 0.0 for n in names + ["tracked_endpoints"]}
                ranked = sorted(pairs, key=lambda p: -sims_list[w][layer][h][p[0]][p[1]])

                def region_of(i, j, w=w, layer=layer, h=h):
                    return bool(max(attn[w, layer, h, i, j], attn[w, layer, h, j, i]) >= threshold)

                ends = [int(ids[w, q]) for pair in ranked[:k] for q in pair]
                top = max(ends.count(x) for x in ends)
                hub = min(x for x in ends if ends.count(x) == top)  # ties: smallest id
                hubs.append(hub)
                o["hub_endpoints"] = top
                for i, j in ranked[:k]:
                    out["distance_bins"][w, layer, h, log2_bin(j - i)] += 1
                    touches = int(ids[w, i]) == hub or int(ids[w, j]) == hub
                    o["hub_pairs"] += touches
                    o["hub_near"] += touches and j - i <= short
                    o["mid_same_sentence"] += same[(i, j)] and short < j - i <= long_
                    o["unrelated"] += (not same[(i, j)] and not bool(ids[w, i] == ids[w, j])
                                       and j - i > short and not region_of(i, j))
                    dd = j - i
                    region = max(attn[w, layer, h, i, j], attn[w, layer, h, j, i]) >= threshold
                    identical = bool(ids[w, i] == ids[w, j])
                    o["n_high"] += 1
                    o["same_sentence"] += same[(i, j)]
                    o["chance_same_sentence_distance"] += q[dd]
                    o["identical"] += identical
                    o["in_attention_region"] += bool(region)
                    o["n_masked"] += not region
                    o["masked_same_sentence"] += same[(i, j)] and not region
                    o["masked_chance_same_sentence_distance"] += q[dd] * (not region)
                    o["distance_sum"] += dd
                    o["short_range"] += dd <= short
                    o["long_range"] += dd > long_
                    o["identical_long_range"] += dd > long_ and identical
                    o["tracked_endpoints"] += (int(ids[w, i] == tracked[layer, h])
                                               + int(ids[w, j] == tracked[layer, h]))
                o["chance_same_sentence"] = chance(lambda p: same[p])
                o["chance_identical"] = chance(lambda p: bool(ids[w, p[0]] == ids[w, p[1]]))
                o["chance_distance_sum"] = chance(lambda p: p[1] - p[0])
                o["chance_short_range"] = chance(lambda p: p[1] - p[0] <= short)
                o["chance_long_range"] = chance(lambda p: p[1] - p[0] > long_)
                o["chance_identical_long_range"] = chance(
                    lambda p: p[1] - p[0] > long_ and bool(ids[w, p[0]] == ids[w, p[1]]))
                o["chance_mid_same_sentence"] = chance(
                    lambda p: same[p] and short < p[1] - p[0] <= long_)
                for n, value in o.items():
                    out[n][w, layer, h] = float(value)
            out["hub_distinct"][w, layer] = len(set(hubs))
    return out
