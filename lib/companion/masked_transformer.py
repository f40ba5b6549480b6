"""A small random multi-layer masked transformer, for checking the Hasse-diagram theory on
a real network :cite:`li2026hasse`.

The network is a pre-LayerNorm transformer: per layer
``h <- h + Attn(LN(h); mask)`` then ``h <- h + MLP(LN(h))`` with multi-head softmax
attention restricted by the mask, and a final LayerNorm. Masked scores are ``-inf`` so
masked weights are exactly 0 and so are the gradients through them: a Jacobian entry is
structurally zero exactly when no path exists.

Rows with no allowed key (the chain's first query, say) output zero, with zero
gradients. A plain softmax over a row of ``-inf`` is ``0/0 = NaN``, so the attention
here sets the scores of such rows to 0 before the softmax (finite forward and backward)
and multiplies the weights by the mask after it. Zero is also what FlexAttention returns,
and what PyTorch SDPA returns on the CPU with torch 2.13 for a bool or an additive
``-inf`` mask, in float32 and float64, with the default choice, the MATH backend (its
softmax zeroes fully masked rows) and the FLASH_ATTENTION backend; EFFICIENT_ATTENTION and
CUDNN_ATTENTION do not run on the CPU. Older torch releases and some CUDA kernels returned
NaN there; ``tests/test_hasse_empirical.py`` pins the CPU behaviour per backend, and
:func:`flex_vs_sdpa` reports what SDPA gave on empty rows on any device.

Functions
---------
- :func:`init_masked_transformer`: random parameters (float64 by default).
- :func:`masked_transformer`: the forward pass for a mask.
- :func:`dependency_pattern`: which outputs depend on which inputs (Jacobian nonzeros);
  the theory predicts ``reachability(mask, L)`` for ``L`` layers.
- :func:`embed_task_inputs`, :func:`token_dependencies`: the whole input construction of
  a task (token embeddings summed per ``inputs[p]``, mask embedding for ``()``, position
  embeddings) and the dependency of each output on each raw token embedding.
- :func:`incremental_forward`: group-by-group inference with a per-layer key/value
  cache; for block two-stream it is block-by-block generation.
- :func:`flex_vs_sdpa`: FlexAttention with a ``mask_mod`` against SDPA with the dense mask.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from companion.masks import validate_mask

__all__ = [
    "MaskedTransformer",
    "block_two_stream_schedule",
    "dependency_pattern",
    "embed_task_inputs",
    "flex_vs_sdpa",
    "incremental_forward",
    "init_masked_transformer",
    "masked_transformer",
    "token_dependencies",
]


@dataclass
class MaskedTransformer:
    """Parameters: ``layers`` (list of dicts of tensors), ``final_ln`` (weight, bias),
    ``n_heads``; plus the input construction: ``position`` (max_positions, d) and
    ``mask_token`` (d,) embeddings."""

    layers: list
    final_ln: tuple
    n_heads: int
    position: torch.Tensor
    mask_token: torch.Tensor

    @property
    def d_model(self) -> int:
        return self.position.shape[1]


def init_masked_transformer(
    d_model: int = 16,
    n_layers: int = 2,
    *,
    n_heads: int = 2,
    d_ff: int | None = None,
    max_positions: int = 256,
    generator: torch.Generator | None = None,
    device=None,
    dtype: torch.dtype = torch.float64,
) -> MaskedTransformer:
    """Random parameters with unit-variance-preserving scales (weights ~ N(0, 1/fan_in),
    LayerNorm gains ~ 1 + N(0, 0.1^2) so that no weight is a special value)."""
    for name, value, low in (("d_model", d_model, 1), ("n_layers", n_layers, 1),
                             ("n_heads", n_heads, 1), ("max_positions", max_positions, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
    if d_model % n_heads:
        raise ValueError(f"n_heads: expected a divisor of d_model = {d_model}, got {n_heads}")
    d_ff = 2 * d_model if d_ff is None else d_ff

    def normal(*shape, scale=1.0):
        return torch.randn(*shape, generator=generator, dtype=dtype, device=device) * scale

    layers = []
    for _ in range(n_layers):
        layers.append(
            {
                "ln1": (1 + normal(d_model, scale=0.1), normal(d_model, scale=0.1)),
                "wq": normal(d_model, d_model, scale=d_model**-0.5),
                "wk": normal(d_model, d_model, scale=d_model**-0.5),
                "wv": normal(d_model, d_model, scale=d_model**-0.5),
                "wo": normal(d_model, d_model, scale=d_model**-0.5),
                "ln2": (1 + normal(d_model, scale=0.1), normal(d_model, scale=0.1)),
                "w1": normal(d_model, d_ff, scale=d_model**-0.5),
                "b1": normal(d_ff, scale=0.1),
                "w2": normal(d_ff, d_model, scale=d_ff**-0.5),
                "b2": normal(d_model, scale=0.1),
            }
        )
    return MaskedTransformer(
        layers,
        (1 + normal(d_model, scale=0.1), normal(d_model, scale=0.1)),
        n_heads,
        normal(max_positions, d_model),
        normal(d_model),
    )


def _layer_norm(x, params):
    weight, bias = params
    return F.layer_norm(x, (x.shape[-1],), weight, bias)


def _attention(h_q, h_kv, allowed, layer, n_heads):
    """Masked multi-head attention of queries ``h_q`` (Q, d) over keys ``h_kv`` (K, d)."""
    d = h_q.shape[-1]
    hd = d // n_heads
    q = (h_q @ layer["wq"]).view(-1, n_heads, hd).transpose(0, 1)
    k = (h_kv @ layer["wk"]).view(-1, n_heads, hd).transpose(0, 1)
    v = (h_kv @ layer["wv"]).view(-1, n_heads, hd).transpose(0, 1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    scores = scores.masked_fill(~allowed, float("-inf"))
    # A row with no allowed key would be softmax(-inf, ..., -inf) = 0/0: give it finite
    # scores (so forward and backward stay finite) and zero its weights with the mask.
    empty = ~allowed.any(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1) * allowed
    out = (weights @ v).transpose(0, 1).reshape(-1, d)
    return out @ layer["wo"]


def _layer(h_q, h_kv_normed, allowed, layer, n_heads):
    """One pre-LN layer for queries ``h_q`` given already-normalised keys/values."""
    h = h_q + _attention(_layer_norm(h_q, layer["ln1"]), h_kv_normed, allowed, layer, n_heads)
    z = _layer_norm(h, layer["ln2"])
    return h + torch.relu(z @ layer["w1"] + layer["b1"]) @ layer["w2"] + layer["b2"]


def _check_x_mask(model, x, mask):
    validate_mask(mask)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != model.d_model:
        raise ValueError(
            f"x: expected a (positions, {model.d_model}) tensor, got "
            f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
        )
    if x.shape[0] != mask.shape[0]:
        raise ValueError(
            f"x: expected {mask.shape[0]} positions to match the mask, got {x.shape[0]}"
        )


def masked_transformer(model: MaskedTransformer, x: torch.Tensor, mask: torch.Tensor,
                       n_layers: int | None = None) -> torch.Tensor:
    """Forward pass: ``x`` (P, d) input vectors, ``mask`` (P, P) -> outputs (P, d).

    ``n_layers`` uses only the first layers (default: all).
    """
    _check_x_mask(model, x, mask)
    layers = model.layers if n_layers is None else model.layers[:n_layers]
    h = x
    for layer in layers:
        h = _layer(h, _layer_norm(h, layer["ln1"]), mask, layer, model.n_heads)
    return _layer_norm(h, model.final_ln)


def _row_dependencies(outputs: torch.Tensor, inputs: torch.Tensor,
                      generator: torch.Generator | None) -> torch.Tensor:
    """Bool (rows of outputs, rows of inputs): one backward pass per output row with a
    random Gaussian cotangent. A structurally zero block gives exactly 0; a nonzero
    Jacobian block gives 0 only on a measure-zero set of cotangents."""
    pattern = torch.zeros(outputs.shape[0], inputs.shape[0], dtype=torch.bool)
    for q in range(outputs.shape[0]):
        cot = torch.randn(outputs.shape[1], generator=generator, dtype=outputs.dtype)
        (grad,) = torch.autograd.grad(outputs[q], inputs, cot.to(outputs.device),
                                      retain_graph=True)
        pattern[q] = (grad != 0).any(dim=1).cpu()
    return pattern


def dependency_pattern(model: MaskedTransformer, x: torch.Tensor, mask: torch.Tensor,
                       n_layers: int | None = None, *,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """Bool (P, P): ``[q, k]`` = output ``q`` has a nonzero derivative in input ``k``.

    One reverse-mode pass per output row with a random cotangent (see
    ``_row_dependencies``); exact zeros are structural (masked weights are exactly 0).
    """
    _check_x_mask(model, x, mask)
    x = x.detach().requires_grad_(True)
    return _row_dependencies(masked_transformer(model, x, mask, n_layers), x, generator)


def embed_task_inputs(model: MaskedTransformer, task, token_embeddings: torch.Tensor,
                      positions: Sequence[int] | None = None) -> torch.Tensor:
    """Input vectors of a task: for position p, the sum of ``token_embeddings[t]`` over
    ``t`` in ``task.inputs[p]`` (the mask embedding when empty) plus the position
    embedding of ``positions[p]`` (default ``p``)."""
    size = task.n_positions
    positions = list(range(size)) if positions is None else list(positions)
    if len(positions) != size or max(positions) >= model.position.shape[0]:
        raise ValueError(
            f"positions: expected {size} indices below {model.position.shape[0]}"
        )
    rows = []
    for p, inp in enumerate(task.inputs):
        base = token_embeddings[list(inp)].sum(dim=0) if inp else model.mask_token
        rows.append(base + model.position[positions[p]])
    return torch.stack(rows)


def token_dependencies(model: MaskedTransformer, task, token_embeddings: torch.Tensor,
                       n_layers: int | None = None, *,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """Bool (P, n_tokens): ``[p, t]`` = output ``p`` has a nonzero derivative in the raw
    embedding of token ``t``, through the whole input construction."""
    emb = token_embeddings.detach().requires_grad_(True)
    out = masked_transformer(model, embed_task_inputs(model, task, emb), task.mask, n_layers)
    return _row_dependencies(out, emb, generator)


def incremental_forward(model: MaskedTransformer, x: torch.Tensor, mask: torch.Tensor,
                        groups: Sequence[Sequence[int]]) -> torch.Tensor:
    """Inference group by group with a per-layer key/value cache.

    ``groups`` partitions the positions; group ``g`` is computed from its own inputs and
    the cached per-layer states of groups ``< g`` only (what a deployed model has when
    it generates group ``g``). Raises ValueError if the mask lets a group attend a later
    group (that would need the future). Returns outputs (P, d) in position order.
    """
    _check_x_mask(model, x, mask)
    flat = [int(p) for g in groups for p in g]
    if sorted(flat) != list(range(mask.shape[0])):
        raise ValueError("groups: expected a partition of the positions 0..P-1")
    rank = torch.empty(mask.shape[0], dtype=torch.long)
    for g_idx, g in enumerate(groups):
        rank[list(g)] = g_idx
    later = rank[None, :] > rank[:, None]
    if (mask.cpu() & later).any():
        raise ValueError("groups: the mask lets a group attend a later group")
    cache = [[] for _ in model.layers]  # per layer: list of (positions, normalised states)
    cached_pos: list[int] = []
    out = torch.empty_like(x)
    for g in groups:
        g = list(g)
        h = x[g]
        keys_pos = cached_pos + g
        for li, layer in enumerate(model.layers):
            normed = _layer_norm(h, layer["ln1"])
            kv = torch.cat([c for c in cache[li]] + [normed]) if cache[li] else normed
            allowed = mask[g][:, keys_pos]
            cache[li].append(normed)
            h = _layer(h, kv, allowed, layer, model.n_heads)
        cached_pos += g
        out[g] = _layer_norm(h, model.final_ln)
    return out


def block_two_stream_schedule(n: int, block: int) -> list[list[int]]:
    """Generation order for the block two-stream layout: mask tokens of block 0, then
    for k = 1..K-1 the content of block k-1 (now generated) and the mask tokens of
    block k."""
    c = ((n - 1) // block) * block
    n_blocks = -(-n // block)
    groups = []
    for k in range(n_blocks):
        if k:
            groups.append(list(range((k - 1) * block, k * block)))
        groups.append(list(range(c + k * block, c + min(n, (k + 1) * block))))
    return groups


def flex_vs_sdpa(mask_mod, dense_mask: torch.Tensor, *, n_heads: int = 2,
                 head_dim: int = 16, batch: int = 1, compile: bool = False,
                 generator: torch.Generator | None = None, device=None,
                 dtype: torch.dtype = torch.float32) -> dict:
    """Run ``flex_attention`` with ``create_block_mask(mask_mod)`` and SDPA with the dense
    mask on the same random q, k, v; compare on rows that have at least one key.

    Rows without a key are reported, not compared: their output is a convention of each
    kernel (0 for FlexAttention, and for SDPA on the CPU with torch 2.13; NaN for older
    SDPA releases and some CUDA kernels). Every row is computed independently, so a NaN
    there would not reach the compared rows.

    Returns dict with ``max_abs_diff`` (largest difference on non-empty rows),
    ``empty_rows`` (count), ``empty_rows_zero`` (FlexAttention's output on them is all 0)
    and ``sdpa_empty_rows_zero`` (SDPA's is all 0; False when it is NaN or anything else).
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    validate_mask(dense_mask, "dense_mask")
    size = dense_mask.shape[0]
    dense_mask = dense_mask.to(device)
    shape = (batch, n_heads, size, head_dim)
    q, k, v = (torch.randn(*shape, generator=generator, dtype=dtype).to(device)
               for _ in range(3))
    block_mask = create_block_mask(mask_mod, None, None, size, size, device=device or "cpu")
    fn = torch.compile(flex_attention) if compile else flex_attention
    out_flex = fn(q, k, v, block_mask=block_mask)
    nonempty = dense_mask.any(dim=1)
    out_sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask)
    diff = (out_flex - out_sdpa)[:, :, nonempty].abs().max().item() if nonempty.any() else 0.0
    return {
        "max_abs_diff": diff,
        "empty_rows": int((~nonempty).sum()),
        "empty_rows_zero": bool((out_flex[:, :, ~nonempty] == 0).all()),
        "sdpa_empty_rows_zero": bool((out_sdpa[:, :, ~nonempty] == 0).all()),
    }
