"""Attention masks as dense Boolean matrices and as FlexAttention ``mask_mod`` functions.

Convention (used everywhere in the book): a mask is a square 2-D ``torch.bool`` tensor
``M`` with ``M[q, k] = True`` when query position ``q`` may attend key position ``k``.
Residual connections are *not* part of a mask; :func:`companion.reachability.layer_adjacency`
adds them.

Every dense builder has a FlexAttention twin ``*_mask_mod`` with the signature
``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` that
:func:`torch.nn.attention.flex_attention.create_block_mask` accepts, in the style of
attention-gym (one small closed-form predicate per mask). :func:`mask_mod` turns any
dense mask into a ``mask_mod`` by table look-up.

The two masks derived in the Hasse chapter have closed forms here as well:
:func:`block_two_stream_mask` and :func:`butterfly_mask`. Their layouts are the ones
produced by :func:`companion.task_merge.block_two_stream` and
:func:`companion.task_merge.butterfly`, which derive them from task families; the tests
check that derivation and closed form agree.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from companion._validate import check_device, check_int, check_number, check_tensor, describe

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

__all__ = [
    "TwoStreamMasks",
    "bidirectional",
    "block_causal",
    "block_causal_mask_mod",
    "block_two_stream_mask",
    "block_two_stream_mask_mod",
    "butterfly_layout",
    "butterfly_mask",
    "butterfly_mask_mod",
    "causal",
    "causal_mask_mod",
    "chain",
    "chain_mask_mod",
    "dense_from_mask_mod",
    "mask_mod",
    "prefix_lm",
    "prefix_lm_mask_mod",
    "random_mask",
    "sliding_window",
    "sliding_window_mask_mod",
    "validate_mask",
    "xlnet_two_stream",
]


# ----------------------------------------------------------------------------- checks
def validate_mask(mask, name: str = "mask") -> torch.Tensor:
    """Check that ``mask`` is a non-empty square 2-D ``torch.bool`` tensor and return it.

    Raises
    ------
    TypeError
        If ``mask`` is not a tensor or not of dtype ``torch.bool``.
    ValueError
        If ``mask`` is not square 2-D, has no rows or is on the meta device (no values).
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name}: expected a square 2-D bool tensor, got {describe(mask)}")
    if mask.device.type == "meta":
        raise ValueError(f"{name}: expected a square 2-D bool tensor with values, got one on "
                         "the meta device")
    if mask.dim() != 2 or mask.shape[0] != mask.shape[1]:
        raise ValueError(
            f"{name}: expected a square 2-D bool tensor, got shape {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        raise TypeError(f"{name}: expected a square 2-D bool tensor, got dtype {mask.dtype}")
    if mask.shape[0] == 0:
        raise ValueError(f"{name}: expected a non-empty mask, got shape {tuple(mask.shape)}")
    return mask


def _grid(n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.arange(n, device=check_device("device", device))
    return idx[:, None], idx[None, :]


# ------------------------------------------------------------------- dense builders
def causal(n: int, *, device=None) -> torch.Tensor:
    """Causal mask: query ``q`` attends keys ``k <= q`` (itself included).

    Returns an ``(n, n)`` bool tensor. Complexity: O(n^2) memory and time.
    """
    check_int("n", n, 1)
    q, k = _grid(n, device)
    return k <= q


def sliding_window(n: int, width: int, *, device=None) -> torch.Tensor:
    """Causal sliding window: query ``q`` attends itself and its ``width - 1`` predecessors.

    ``M[q, k] = 0 <= q - k < width``. With residual connections the stack of ``L`` layers
    sees ``L (width - 1)`` positions back, so the limit is the causal mask, reached after
    ``ceil((n - 1) / (width - 1))`` layers (for ``width >= 2``).
    """
    check_int("n", n, 1)
    check_int("width", width, 1)
    q, k = _grid(n, device)
    return (q - k >= 0) & (q - k < width)


def block_causal(n: int, block: int, *, device=None) -> torch.Tensor:
    """Block-causal mask: query ``q`` attends every key of its own and earlier blocks.

    Blocks are ``[0, block), [block, 2 block), ...``; the last may be shorter.
    ``M[q, k] = k // block <= q // block``.
    """
    check_int("n", n, 1)
    check_int("block", block, 1)
    q, k = _grid(n, device)
    return (k // block) <= (q // block)


def chain(n: int, *, device=None) -> torch.Tensor:
    """Chain (path) mask: query ``q`` attends only its predecessor ``q - 1``.

    The diagonal is empty (row 0 is empty too): the residual supplies ``q -> q``. This is
    the worst case for depth: information from position 0 needs ``n - 1`` layers to reach
    position ``n - 1``.
    """
    check_int("n", n, 1)
    q, k = _grid(n, device)
    return k == q - 1


def prefix_lm(n: int, prefix: int, *, device=None) -> torch.Tensor:
    """Prefix-LM mask: keys ``k < prefix`` are visible to every query; after that, causal.

    ``M[q, k] = (k < prefix) or (k <= q)``.
    """
    check_int("n", n, 1)
    check_int("prefix", prefix, 0)
    if prefix > n:
        raise ValueError(f"prefix: expected 0 <= prefix <= n = {n}, got {prefix}")
    q, k = _grid(n, device)
    return (k < prefix) | (k <= q)


def bidirectional(n: int, *, device=None) -> torch.Tensor:
    """Full (encoder) mask: every query attends every key."""
    check_int("n", n, 1)
    return torch.ones(n, n, dtype=torch.bool, device=check_device("device", device))


def random_mask(
    n: int, p: float, *, generator: torch.Generator | None = None, device=None
) -> torch.Tensor:
    """Random mask: each off-diagonal ``(q, k)`` is True independently with probability ``p``.

    The diagonal is False (the residual supplies self edges). Rows are drawn in chunks so
    that ``n = 8192`` needs no ``n x n`` float buffer. A ``generator`` must live on
    ``device`` (CPU by default).
    """
    check_int("n", n, 1)
    p = check_number("p", p, minimum=0.0, maximum=1.0, expected="a probability in [0, 1]")
    device = check_device("device", device)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator or None, got {describe(generator)}")
    out = torch.empty(n, n, dtype=torch.bool, device=device)
    chunk = max(1, (1 << 22) // n)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        out[start:stop] = (
            torch.rand(stop - start, n, generator=generator, device=device) < p
        )
    out.fill_diagonal_(False)
    return out


class TwoStreamMasks(NamedTuple):
    """XLNet two-stream masks for one factorisation order (all ``(n, n)`` or ``(2n, 2n)``).

    - ``content[i, j]``: content stream of token ``i`` attends content of token ``j``.
    - ``query[i, j]``: query stream of token ``i`` attends content of token ``j``.
    - ``joint``: both streams as one ``(2n, 2n)`` mask over positions
      ``[content_0..content_{n-1}, query_0..query_{n-1}]``; queries never attend queries
      (each query keeps its own state through the residual), contents never attend queries.
    """

    content: torch.Tensor
    query: torch.Tensor
    joint: torch.Tensor


def xlnet_two_stream(order: Sequence[int] | torch.Tensor, *, device=None) -> TwoStreamMasks:
    """Masks of XLNet's two-stream attention for the factorisation order ``order``.

    ``order`` is a permutation ``z`` of ``0..n-1``: token ``z[t]`` is predicted at step
    ``t``. With ``rank[z[t]] = t``, the content stream of token ``i`` sees tokens with
    ``rank[j] <= rank[i]`` (itself included) and the query stream of token ``i`` sees
    contents with ``rank[j] < rank[i]`` (never its own token) :cite:`yang2019xlnet`.
    """
    device = check_device("device", device)
    try:
        order_t = torch.as_tensor(order)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"order: expected a permutation of 0..n-1, got {describe(order)}") from exc
    check_tensor("order", order_t)
    if order_t.dim() != 1 or order_t.numel() == 0:
        raise ValueError(
            f"order: expected a non-empty 1-D permutation, got shape {tuple(order_t.shape)}"
        )
    if order_t.is_floating_point() or order_t.is_complex() or order_t.dtype == torch.bool:
        # a float would be truncated to a position silently
        raise TypeError(f"order: expected integer positions, got dtype {order_t.dtype}")
    order_t = order_t.to(device=device, dtype=torch.long)
    n = order_t.numel()
    if not torch.equal(torch.sort(order_t).values, torch.arange(n, device=order_t.device)):
        raise ValueError(f"order: expected a permutation of 0..{n - 1}, got {order_t.tolist()}")
    rank = torch.empty_like(order_t)
    rank[order_t] = torch.arange(n, device=order_t.device)
    content = rank[None, :] <= rank[:, None]
    query = rank[None, :] < rank[:, None]
    joint = torch.zeros(2 * n, 2 * n, dtype=torch.bool, device=order_t.device)
    joint[:n, :n] = content
    joint[n:, :n] = query
    return TwoStreamMasks(content, query, joint)


def block_two_stream_mask(n: int, block: int, *, device=None) -> torch.Tensor:
    """Block two-stream mask (closed form) in the layout of ``task_merge.block_two_stream``.

    ``n`` tokens in blocks of ``block`` (the last may be shorter); ``K`` blocks. Positions:

    - content positions ``0 .. c-1`` carry tokens ``0 .. c-1`` of blocks ``0 .. K-2``
      (``c = n - len(last block)``: the last block's content is never read by any
      prediction, so the minimal merged task drops it);
    - mask-token positions ``c .. c+n-1``: position ``c + t`` predicts token ``t``.

    Content rows are block-causal. The mask token for token ``t`` (block ``t // block``)
    attends the content of earlier blocks and every mask token of its own block, never
    its own block's content.
    """
    check_int("n", n, 1)
    check_int("block", block, 1)
    c = ((n - 1) // block) * block
    size = c + n
    q, k = _grid(size, device)
    q_content, k_content = q < c, k < c
    q_block = torch.where(q_content, q // block, (q - c) // block)
    k_block = torch.where(k_content, k // block, (k - c) // block)
    content_rows = q_content & k_content & (k_block <= q_block)
    mask_rows = (~q_content) & (
        (k_content & (k_block < q_block)) | ((~k_content) & (k_block == q_block))
    )
    return content_rows | mask_rows


def butterfly_layout(n: int) -> dict[str, range]:
    """Position ranges of the butterfly task for ``n >= 2`` tokens.

    - ``forward``: ``n - 1`` positions carrying tokens ``0 .. n-2`` (causal chain);
    - ``backward``: ``n - 1`` positions carrying tokens ``1 .. n-1`` (anti-causal chain);
    - ``predict``: ``n`` positions, the ``k``-th predicts token ``k`` from an aggregate of
      its neighbours' tokens.
    """
    check_int("n", n, 2)
    return {
        "forward": range(n - 1),
        "backward": range(n - 1, 2 * n - 2),
        "predict": range(2 * n - 2, 3 * n - 2),
    }


def butterfly_mask(n: int, *, device=None) -> torch.Tensor:
    """Butterfly attention mask (closed form), layout of :func:`butterfly_layout`.

    Forward position of token ``i`` attends forward positions of tokens ``<= i``; backward
    position of token ``j`` attends backward positions of tokens ``>= j``; the prediction
    position of token ``k`` attends itself, the forward positions of tokens ``< k`` and
    the backward positions of tokens ``> k``. Its Hasse diagram is two chains running in
    opposite directions joined at the prediction nodes: a butterfly.
    """
    check_int("n", n, 2)
    size = 3 * n - 2
    q, k = _grid(size, device)
    f_end, b_end = n - 1, 2 * n - 2
    # token carried (forward/backward) or predicted (predict) by each position
    def token(i):
        return torch.where(i < f_end, i, torch.where(i < b_end, i - f_end + 1, i - b_end))

    tq, tk = token(q), token(k)
    qf, qb, qp = q < f_end, (q >= f_end) & (q < b_end), q >= b_end
    kf, kb = k < f_end, (k >= f_end) & (k < b_end)
    fwd = qf & kf & (tk <= tq)
    bwd = qb & kb & (tk >= tq)
    pred = qp & ((kf & (tk < tq)) | (kb & (tk > tq)) | (q == k))
    return fwd | bwd | pred


# ------------------------------------------------------------------------ mask_mods
def mask_mod(mask: torch.Tensor) -> MaskMod:
    """Wrap a dense mask as a FlexAttention ``mask_mod`` (table look-up).

    The returned ``mask_mod(b, h, q_idx, kv_idx)`` reads ``mask[q_idx, kv_idx]``; it
    ignores batch and head. The mask must be on the device where the block mask is built.
    """
    validate_mask(mask)

    def dense_mask_mod(b, h, q_idx, kv_idx):
        return mask[q_idx, kv_idx]

    return dense_mask_mod


def causal_mask_mod(b, h, q_idx, kv_idx):
    """FlexAttention mask_mod of :func:`causal`."""
    return kv_idx <= q_idx


def chain_mask_mod(b, h, q_idx, kv_idx):
    """FlexAttention mask_mod of :func:`chain` (row 0 is empty)."""
    return kv_idx == q_idx - 1


def sliding_window_mask_mod(width: int) -> MaskMod:
    """FlexAttention mask_mod of :func:`sliding_window` with window ``width``."""
    check_int("width", width, 1)

    def sliding_window_mod(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx >= 0) & (q_idx - kv_idx < width)

    return sliding_window_mod


def block_causal_mask_mod(block: int) -> MaskMod:
    """FlexAttention mask_mod of :func:`block_causal` with block size ``block``."""
    check_int("block", block, 1)

    def block_causal_mod(b, h, q_idx, kv_idx):
        return (kv_idx // block) <= (q_idx // block)

    return block_causal_mod


def prefix_lm_mask_mod(prefix: int) -> MaskMod:
    """FlexAttention mask_mod of :func:`prefix_lm` with ``prefix`` visible keys."""
    check_int("prefix", prefix, 0)

    def prefix_lm_mod(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (kv_idx <= q_idx)

    return prefix_lm_mod


def block_two_stream_mask_mod(n: int, block: int) -> MaskMod:
    """FlexAttention mask_mod of :func:`block_two_stream_mask` (sequence length ``c + n``)."""
    check_int("n", n, 1)
    check_int("block", block, 1)
    c = ((n - 1) // block) * block

    def block_two_stream_mod(b, h, q_idx, kv_idx):
        q_content, k_content = q_idx < c, kv_idx < c
        q_block = torch.where(q_content, q_idx // block, (q_idx - c) // block)
        k_block = torch.where(k_content, kv_idx // block, (kv_idx - c) // block)
        content_rows = q_content & k_content & (k_block <= q_block)
        mask_rows = (~q_content) & (
            (k_content & (k_block < q_block)) | ((~k_content) & (k_block == q_block))
        )
        return content_rows | mask_rows

    return block_two_stream_mod


def butterfly_mask_mod(n: int) -> MaskMod:
    """FlexAttention mask_mod of :func:`butterfly_mask` (sequence length ``3n - 2``)."""
    check_int("n", n, 2)
    f_end, b_end = n - 1, 2 * n - 2

    def butterfly_mod(b, h, q_idx, kv_idx):
        def token(i):
            return torch.where(i < f_end, i, torch.where(i < b_end, i - f_end + 1, i - b_end))

        tq, tk = token(q_idx), token(kv_idx)
        qf, qp = q_idx < f_end, q_idx >= b_end
        qb = (~qf) & (~qp)
        kf = kv_idx < f_end
        kb = (~kf) & (kv_idx < b_end)
        fwd = qf & kf & (tk <= tq)
        bwd = qb & kb & (tk >= tq)
        pred = qp & ((kf & (tk < tq)) | (kb & (tk > tq)) | (q_idx == kv_idx))
        return fwd | bwd | pred

    return butterfly_mod


def dense_from_mask_mod(mod: MaskMod, size: int, *, device=None) -> torch.Tensor:
    """Evaluate a ``mask_mod`` on the full ``(size, size)`` grid (batch 0, head 0)."""
    check_int("size", size, 1)
    if not callable(mod):
        raise TypeError(f"mod: expected a mask_mod(b, h, q_idx, kv_idx), got {describe(mod)}")
    q, k = _grid(size, device)
    zero = torch.zeros((), dtype=torch.long, device=device)
    out = mod(zero, zero, q.expand(size, size), k.expand(size, size))
    return out.to(torch.bool)
