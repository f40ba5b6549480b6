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
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from companion._validate import check_bool, check_device, check_int, check_tensor, describe
from companion.hasse.masks import validate_mask

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
    ``mask_token`` (d,) embeddings.

    >>> import torch
    >>> model = init_masked_transformer(d_model=8, n_layers=2, max_positions=4,
    ...                                 generator=torch.Generator().manual_seed(0))
    >>> isinstance(model, MaskedTransformer), model.d_model, len(model.layers)
    (True, 8, 2)
    """

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
    LayerNorm gains ~ 1 + N(0, 0.1^2) so that no weight is a special value).

    Raises
    ------
    TypeError
        A size that is not an int (``4.0``, ``True``), a ``generator`` that is not a
        torch.Generator, a ``dtype`` that is not a floating torch.dtype.
    ValueError
        A size < 1, ``n_heads`` not dividing ``d_model``, an unknown or absent device.

    >>> import torch
    >>> model = init_masked_transformer(d_model=8, n_layers=1, n_heads=4, max_positions=4,
    ...                                 generator=torch.Generator().manual_seed(0))
    >>> model.n_heads, model.position.shape, model.layers[0]["w1"].shape
    (4, torch.Size([4, 8]), torch.Size([8, 16]))
    """
    d_model = check_int("d_model", d_model, minimum=1)
    n_layers = check_int("n_layers", n_layers, minimum=1)
    n_heads = check_int("n_heads", n_heads, minimum=1)
    max_positions = check_int("max_positions", max_positions, minimum=1)
    d_ff = 2 * d_model if d_ff is None else check_int("d_ff", d_ff, minimum=1)
    if d_model % n_heads:
        raise ValueError(f"n_heads: expected a divisor of d_model = {d_model}, got {n_heads}")
    _check_generator(generator)
    check_device("device", device)
    _check_dtype(dtype)

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


def _check_generator(generator) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator: expected a torch.Generator or None, got {describe(generator)}")


def _check_dtype(dtype) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating torch.dtype, got {describe(dtype)}")


def _check_model(model) -> None:
    if not isinstance(model, MaskedTransformer):
        raise TypeError(
            f"model: expected a MaskedTransformer (see init_masked_transformer), got "
            f"{describe(model)}")


def _model_layers(model: MaskedTransformer, n_layers) -> list:
    """The first ``n_layers`` layers of ``model`` (all for None), checked."""
    total = len(model.layers)
    if n_layers is None:
        return model.layers
    if isinstance(n_layers, bool) or not isinstance(n_layers, numbers.Integral):
        raise TypeError(
            f"n_layers: expected an int in [0, {total}] or None, got {describe(n_layers)}")
    return model.layers[:check_int("n_layers", n_layers, minimum=0, maximum=total)]


def _check_vectors(name: str, model: MaskedTransformer, x, rows: str = "positions") -> None:
    """``x``: a finite (rows, d_model) tensor of the model's dtype, on its device."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"{name}: expected a ({rows}, {model.d_model}) tensor, got {describe(x)}")
    check_tensor(name, x)  # no meta tensors
    if x.dim() != 2 or x.shape[1] != model.d_model:
        raise ValueError(
            f"{name}: expected a ({rows}, {model.d_model}) tensor, got {tuple(x.shape)}")
    if x.dtype != model.position.dtype:
        raise TypeError(
            f"{name}: expected dtype {model.position.dtype} like the model, got {x.dtype}")
    if x.device != model.position.device:
        raise ValueError(
            f"{name}: expected a tensor on {model.position.device} like the model, got one "
            f"on {x.device}")
    check_tensor(name, x, finite=True)


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
    _check_model(model)
    validate_mask(mask)
    _check_vectors("x", model, x)
    if x.shape[0] != mask.shape[0]:
        raise ValueError(
            f"x: expected {mask.shape[0]} positions to match the mask, got {x.shape[0]}"
        )


def masked_transformer(model: MaskedTransformer, x: torch.Tensor, mask: torch.Tensor,
                       n_layers: int | None = None) -> torch.Tensor:
    """Forward pass: ``x`` (P, d) input vectors, ``mask`` (P, P) -> outputs (P, d).

    ``n_layers`` uses only the first layers (an int in ``[0, L]``; default None: all L).

    Raises
    ------
    TypeError
        ``model`` is not a MaskedTransformer, ``x`` is not a tensor of the model's dtype,
        ``mask`` is not a bool tensor, ``n_layers`` is not an int or None.
    ValueError
        Wrong shapes, ``x`` not finite or not on the model's device, ``n_layers`` out of
        ``[0, L]``.

    >>> import torch
    >>> from companion.hasse.masks import chain
    >>> g = torch.Generator().manual_seed(0)
    >>> model = init_masked_transformer(d_model=8, n_layers=2, max_positions=4, generator=g)
    >>> x = torch.randn(4, 8, dtype=torch.float64, generator=g)
    >>> out = masked_transformer(model, x, chain(4))
    >>> out.shape, out.dtype
    (torch.Size([4, 8]), torch.float64)
    >>> y = x.clone(); y[3] += 1  # a change at the last position does not reach the first
    >>> torch.equal(masked_transformer(model, y, chain(4))[0], out[0])
    True
    """
    _check_x_mask(model, x, mask)
    layers = _model_layers(model, n_layers)
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

    >>> import torch
    >>> from companion.hasse.masks import chain
    >>> g = torch.Generator().manual_seed(0)
    >>> model = init_masked_transformer(d_model=8, n_layers=2, max_positions=4, generator=g)
    >>> x = torch.randn(4, 8, dtype=torch.float64, generator=g)
    >>> dependency_pattern(model, x, chain(4), generator=g).int().tolist()  # (M OR I)^2
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1]]

    References
    ----------
    C. Li and H. Guo, arXiv 2606.09951: ``L`` layers as the Boolean power ``A^L`` (section
    not known here; abstract and a secondary summary).
    """
    _check_x_mask(model, x, mask)
    _model_layers(model, n_layers)
    _check_generator(generator)
    x = x.detach().requires_grad_(True)
    return _row_dependencies(masked_transformer(model, x, mask, n_layers), x, generator)


def embed_task_inputs(model: MaskedTransformer, task, token_embeddings: torch.Tensor,
                      positions: Sequence[int] | None = None) -> torch.Tensor:
    """Input vectors of a task: for position p, the sum of ``token_embeddings[t]`` over
    ``t`` in ``task.inputs[p]`` (the mask embedding when empty) plus the position
    embedding of ``positions[p]`` (default ``p``).

    ``token_embeddings`` is a (n_tokens, d_model) tensor of the model's dtype with a row
    for every token the task's inputs name (at least ``1 + max token index`` rows).

    Raises
    ------
    TypeError
        ``model`` or ``task`` of the wrong type, ``token_embeddings`` not a tensor of the
        model's dtype, a position that is not an int.
    ValueError
        ``token_embeddings`` of the wrong width, with too few rows, not finite or not on
        the model's device; ``positions`` of the wrong length or out of range.

    >>> import torch
    >>> from companion.hasse.task_merge import butterfly, autoregressive_family
    >>> g = torch.Generator().manual_seed(0)
    >>> model = init_masked_transformer(d_model=8, n_layers=2, max_positions=8, generator=g)
    >>> task = autoregressive_family(3)[1]  # tokens 0, 1 predict token 2
    >>> emb = torch.randn(3, 8, dtype=torch.float64, generator=g)
    >>> x = embed_task_inputs(model, task, emb)
    >>> x.shape, torch.equal(x[1], emb[1] + model.position[1])
    (torch.Size([2, 8]), True)
    """
    _check_model(model)
    _check_task(task)
    _check_vectors("token_embeddings", model, token_embeddings, rows="n_tokens")
    needed = 1 + max((t for inp in task.inputs for t in inp), default=-1)
    if token_embeddings.shape[0] < needed:
        raise ValueError(
            f"token_embeddings: expected at least {needed} rows (one per token of the "
            f"task), got {token_embeddings.shape[0]}")
    size = task.n_positions
    limit = model.position.shape[0]
    if positions is None:
        positions = list(range(size))
    else:
        if isinstance(positions, (str, bytes)) or not hasattr(positions, "__iter__"):
            raise TypeError(
                f"positions: expected a sequence of {size} position indices or None, got "
                f"{describe(positions)}")
        positions = [check_int(f"positions[{i}]", p, minimum=0, maximum=limit - 1)
                     for i, p in enumerate(positions)]
    if len(positions) != size or max(positions) >= limit:
        raise ValueError(
            f"positions: expected {size} indices below {limit}"
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
    embedding of token ``t``, through the whole input construction.

    Raises as :func:`embed_task_inputs` and :func:`masked_transformer` do.

    >>> import torch
    >>> from companion.hasse.task_merge import butterfly, autoregressive_family
    >>> g = torch.Generator().manual_seed(0)
    >>> model = init_masked_transformer(d_model=8, n_layers=2, max_positions=8, generator=g)
    >>> emb = torch.randn(3, 8, dtype=torch.float64, generator=g)
    >>> task = butterfly(3)
    >>> dep = token_dependencies(model, task, emb, generator=g)
    >>> [bool(dep[p, y]) for p, y in enumerate(task.targets) if y is not None]  # own token
    [False, False, False]
    """
    _check_model(model)
    _check_task(task)
    _check_vectors("token_embeddings", model, token_embeddings, rows="n_tokens")
    _model_layers(model, n_layers)
    _check_generator(generator)
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

    Raises
    ------
    TypeError
        ``groups`` is not a sequence of position lists (a str, say), or a position is not
        an int; and as :func:`masked_transformer` for ``model``, ``x`` and ``mask``.
    ValueError
        ``groups`` is not a partition of the positions, or needs the future.

    >>> import torch
    >>> from companion.hasse.masks import chain
    >>> g = torch.Generator().manual_seed(0)
    >>> model = init_masked_transformer(d_model=8, n_layers=2, max_positions=4, generator=g)
    >>> x = torch.randn(4, 8, dtype=torch.float64, generator=g)
    >>> groups = [[0, 1], [2], [3]]
    >>> one_pass = masked_transformer(model, x, chain(4))
    >>> torch.allclose(incremental_forward(model, x, chain(4), groups), one_pass)
    True
    """
    _check_x_mask(model, x, mask)
    groups = _check_groups(groups)
    flat = [p for g in groups for p in g]
    if sorted(flat) != list(range(mask.shape[0])):
        raise ValueError("groups: expected a partition of the positions 0..P-1")
    rank = torch.empty(mask.shape[0], dtype=torch.long)
    for g_idx, g in enumerate(groups):
        rank[g] = g_idx
    later = rank[None, :] > rank[:, None]
    if (mask.cpu() & later).any():
        raise ValueError("groups: the mask lets a group attend a later group")
    cache = [[] for _ in model.layers]  # per layer: list of (positions, normalised states)
    cached_pos: list[int] = []
    out = torch.empty_like(x)
    for g in groups:
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


def _check_task(task) -> None:
    from companion.hasse.task_merge import Task

    if not isinstance(task, Task):
        raise TypeError(f"task: expected a companion.hasse.task_merge.Task, got {describe(task)}")


def _position(name: str, p) -> int:
    """A position index: an int, or a one-element integer tensor (``rank[i]``, say)."""
    if isinstance(p, torch.Tensor) and p.numel() == 1 and not (
            p.is_floating_point() or p.is_complex() or p.dtype == torch.bool):
        p = p.item()
    return check_int(name, p, minimum=0)


def _check_groups(groups) -> list[list[int]]:
    """``groups`` as a list of lists of ints (any iterable of iterables of positions)."""
    def bad(what):
        return TypeError(f"groups: expected a sequence of position lists, got {describe(what)}")

    if isinstance(groups, (str, bytes)) or not hasattr(groups, "__iter__"):
        raise bad(groups)
    checked = []
    for i, g in enumerate(groups):
        if isinstance(g, (str, bytes)) or not hasattr(g, "__iter__"):
            raise TypeError(
                f"groups[{i}]: expected a list of positions, got {describe(g)}")
        checked.append([_position(f"groups[{i}][{j}]", p) for j, p in enumerate(g)])
    return checked


def block_two_stream_schedule(n: int, block: int) -> list[list[int]]:
    """Generation order for the block two-stream layout: mask tokens of block 0, then
    for k = 1..K-1 the content of block k-1 (now generated) and the mask tokens of
    block k.

    Raises
    ------
    TypeError
        ``n`` or ``block`` is not an int.
    ValueError
        ``n`` or ``block`` is < 1.

    >>> block_two_stream_schedule(4, 2)  # content at 0..1, mask tokens at 2..5
    [[2, 3], [0, 1], [4, 5]]
    """
    n = check_int("n", n, minimum=1)
    block = check_int("block", block, minimum=1)
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

    Raises
    ------
    TypeError
        ``mask_mod`` not callable, ``dense_mask`` not a bool tensor, a size that is not an
        int, ``compile`` not a bool, a bad ``generator`` or ``dtype``.
    ValueError
        A size < 1, ``dense_mask`` not square, an unknown or absent device.
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not callable(mask_mod):
        raise TypeError(
            f"mask_mod: expected a mask_mod(b, h, q_idx, kv_idx), got {describe(mask_mod)}")
    validate_mask(dense_mask, "dense_mask")
    check_int("n_heads", n_heads, minimum=1)
    check_int("head_dim", head_dim, minimum=1)
    check_int("batch", batch, minimum=1)
    check_bool("compile", compile)
    _check_generator(generator)
    check_device("device", device)
    _check_dtype(dtype)
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
