"""Attention masks as dense Boolean matrices and as FlexAttention ``mask_mod`` functions.

Convention (used everywhere in the book): a mask is a square 2-D ``torch.bool`` tensor
``M`` with ``M[q, k] = True`` when query position ``q`` may attend key position ``k``.
Residual connections are *not* part of a mask; :func:`companion.hasse.reachability.layer_adjacency`
adds them.

Each mask is defined once, as a FlexAttention ``mask_mod`` with the signature
``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` that
:func:`torch.nn.attention.flex_attention.create_block_mask` accepts, in the style of
attention-gym: one small closed-form predicate per mask, named for what it allows
(parametrised mods carry their parameters in ``__name__``, e.g. ``sliding_window_64``),
composed with :func:`and_masks` / :func:`or_masks`. The dense builders (:func:`causal`,
:func:`sliding_window`, ...) are :func:`materialise` of their mod; :func:`mask_mod` turns
any dense mask (a random one, say) back into a ``mask_mod`` by table look-up.

The two masks derived in the Hasse chapter have closed forms here as well:
:func:`block_two_stream_mask` and :func:`butterfly_mask`. Their layouts are the ones
produced by :func:`companion.hasse.task_merge.block_two_stream` and
:func:`companion.hasse.task_merge.butterfly`, which derive them from task families; the tests
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
    "and_masks",
    "bidirectional",
    "bidirectional_mask_mod",
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
    "mask_mod",
    "materialise",
    "or_masks",
    "prefix_lm",
    "prefix_lm_mask_mod",
    "random_mask",
    "random_mask_mod",
    "random_edges",
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

    Examples
    --------
    >>> validate_mask(causal(2)).dtype
    torch.bool
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


# -------------------------------------------------- mask_mods: the definitions
# Each mask is defined once, as a mask_mod predicate on index tensors; the dense builders
# below materialise it. A mask_mod only compares and does integer arithmetic, so it works
# on broadcast index grids (dense), on FlexAttention's vmapped scalars, and on any device.
def _named(mod: MaskMod, name: str) -> MaskMod:
    mod.__name__ = mod.__qualname__ = name
    return mod


def causal_mask_mod(b, h, q_idx, kv_idx):
    """Causal: query ``q`` attends keys ``k <= q`` (itself included).

    Examples
    --------
    >>> materialise(causal_mask_mod, 3).int().tolist()
    [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """
    return kv_idx <= q_idx


def chain_mask_mod(b, h, q_idx, kv_idx):
    """Chain: query ``q`` attends only its predecessor ``q - 1`` (row 0 is empty).

    Examples
    --------
    >>> materialise(chain_mask_mod, 3).int().tolist()
    [[0, 0, 0], [1, 0, 0], [0, 1, 0]]
    """
    return kv_idx == q_idx - 1


def bidirectional_mask_mod(b, h, q_idx, kv_idx):
    """Full (encoder) attention: every query attends every key.

    Examples
    --------
    >>> materialise(bidirectional_mask_mod, 2).int().tolist()
    [[1, 1], [1, 1]]
    """
    return (q_idx >= 0) & (kv_idx >= 0)


def sliding_window_mask_mod(width: int) -> MaskMod:
    """Causal sliding window: query ``q`` attends keys with ``0 <= q - k < width``.

    >>> sliding_window_mask_mod(4).__name__
    'sliding_window_4'
    """
    check_int("width", width, 1)

    def sliding_window_mod(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx >= 0) & (q_idx - kv_idx < width)

    return _named(sliding_window_mod, f"sliding_window_{width}")


def block_causal_mask_mod(block: int) -> MaskMod:
    """Block-causal: query ``q`` attends keys with ``k // block <= q // block``.

    Examples
    --------
    >>> materialise(block_causal_mask_mod(2), 4).int().tolist()
    [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    """
    check_int("block", block, 1)

    def block_causal_mod(b, h, q_idx, kv_idx):
        return (kv_idx // block) <= (q_idx // block)

    return _named(block_causal_mod, f"block_causal_{block}")


def prefix_lm_mask_mod(prefix: int) -> MaskMod:
    """Prefix-LM: keys ``k < prefix`` are visible to every query; after that, causal.

    Examples
    --------
    >>> materialise(prefix_lm_mask_mod(2), 4).int().tolist()
    [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    """
    check_int("prefix", prefix, 0)

    def prefix_lm_mod(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (kv_idx <= q_idx)

    return _named(prefix_lm_mod, f"prefix_lm_{prefix}")


def block_two_stream_mask_mod(n: int, block: int) -> MaskMod:
    """Block two-stream mask, sequence length ``c + n`` (:func:`block_two_stream_mask`).

    Content rows are block-causal; the mask token for token ``t`` attends the content of
    earlier blocks and every mask token of its own block, never its own block's content.

    Examples
    --------
    >>> mod = block_two_stream_mask_mod(4, 2)  # content 0-1, mask tokens 2-5
    >>> mod.__name__, materialise(mod, 6)[4].int().tolist()
    ('block_two_stream_4_2', [1, 1, 0, 0, 1, 1])
    """
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

    return _named(block_two_stream_mod, f"block_two_stream_{n}_{block}")


def butterfly_mask_mod(n: int) -> MaskMod:
    """Butterfly mask (sequence length ``3n - 2``; layout: :func:`butterfly_layout`).

    Forward position of token ``i`` attends forward positions of tokens ``<= i``; backward
    position of token ``j`` attends backward positions of tokens ``>= j``; the prediction
    position of token ``k`` attends itself, the forward positions of tokens ``< k`` and
    the backward positions of tokens ``> k``.

    Examples
    --------
    >>> mod = butterfly_mask_mod(3)
    >>> mod.__name__, torch.equal(materialise(mod, 7), butterfly_mask(3))
    ('butterfly_3', True)
    """
    check_int("n", n, 2)
    f_end, b_end = n - 1, 2 * n - 2

    def token(i):  # the token a position carries (forward/backward) or predicts
        return torch.where(i < f_end, i, torch.where(i < b_end, i - f_end + 1, i - b_end))

    def butterfly_mod(b, h, q_idx, kv_idx):
        tq, tk = token(q_idx), token(kv_idx)
        qf, qp = q_idx < f_end, q_idx >= b_end
        qb = (~qf) & (~qp)
        kf = kv_idx < f_end
        kb = (~kf) & (kv_idx < b_end)
        fwd = qf & kf & (tk <= tq)
        bwd = qb & kb & (tk >= tq)
        pred = qp & ((kf & (tk < tq)) | (kb & (tk > tq)) | (q_idx == kv_idx))
        return fwd | bwd | pred

    return _named(butterfly_mod, f"butterfly_{n}")


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32, by C. Wellons) on int64 tensors, exact: every
    product is reduced to its low 32 bits."""
    low = 0xFFFFFFFF
    x = x & low
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & low
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & low
    return x ^ (x >> 16)


def random_mask_mod(p: float, seed: int = 0) -> MaskMod:
    """Random mask as a closed-form mask_mod: each off-diagonal ``(q, k)`` is allowed with
    probability ``p``, decided by a hash of ``(seed, q, k)``; the diagonal is False.

    The long-sequence twin of :func:`random_mask` (same law, other draws): no table, so it
    costs nothing to store at any ``n`` and gives the same pair the same answer on every
    device, block and call.

    >>> mod = random_mask_mod(0.5, seed=1)
    >>> mod.__name__
    'random_0.5_seed1'
    >>> torch.equal(materialise(mod, 6), materialise(mod, 9)[:6, :6])
    True
    """
    p = check_number("p", p, minimum=0.0, maximum=1.0, expected="a probability in [0, 1]")
    seed = check_int("seed", seed, 0)
    threshold = int(round(p * 2**32))

    def random_mod(b, h, q_idx, kv_idx):
        q = torch.as_tensor(q_idx).to(torch.int64)
        k = torch.as_tensor(kv_idx).to(torch.int64)
        x = _mix32(k + _mix32(q + _mix32(torch.as_tensor(seed, dtype=torch.int64,
                                                         device=q.device))))
        return (x < threshold) & (q != k)

    return _named(random_mod, f"random_{p:g}_seed{seed}")


def mask_mod(mask: torch.Tensor) -> MaskMod:
    """Wrap a dense mask as a FlexAttention ``mask_mod`` (table look-up).

    The returned ``mask_mod(b, h, q_idx, kv_idx)`` reads ``mask[q_idx, kv_idx]``; it
    ignores batch and head. The mask must be on the device where the block mask is built.

    Examples
    --------
    >>> mod = mask_mod(causal(5))
    >>> mod.__name__, torch.equal(materialise(mod, 5), causal(5))
    ('dense_5', True)
    """
    validate_mask(mask)

    def dense_mask_mod(b, h, q_idx, kv_idx):
        return mask[q_idx, kv_idx]

    return _named(dense_mask_mod, f"dense_{mask.shape[0]}")


def _check_mods(name: str, mods) -> tuple:
    for i, mod in enumerate(mods):
        if not callable(mod):
            raise TypeError(f"{name}: expected mask_mod functions, got {describe(mod)} at "
                            f"position {i}")
    return tuple(mods)


def and_masks(*mods: MaskMod) -> MaskMod:
    """The mask_mod allowing ``(q, k)`` when every one of ``mods`` allows it (no mods:
    everything).

    >>> both = and_masks(causal_mask_mod, sliding_window_mask_mod(2))
    >>> both.__name__
    'and(causal,sliding_window_2)'
    >>> materialise(both, 3).int().tolist()
    [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    """
    mods = _check_mods("mods", mods)

    def and_mod(b, h, q_idx, kv_idx):
        out = bidirectional_mask_mod(b, h, q_idx, kv_idx)
        for mod in mods:
            out = out & mod(b, h, q_idx, kv_idx)
        return out

    return _named(and_mod, "and(" + ",".join(_short(m) for m in mods) + ")")


def or_masks(*mods: MaskMod) -> MaskMod:
    """The mask_mod allowing ``(q, k)`` when any of ``mods`` allows it (no mods: nothing).

    >>> self_or_previous = or_masks(chain_mask_mod, sliding_window_mask_mod(1))
    >>> self_or_previous.__name__
    'or(chain,sliding_window_1)'
    >>> materialise(self_or_previous, 3).int().tolist()
    [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    """
    mods = _check_mods("mods", mods)

    def or_mod(b, h, q_idx, kv_idx):
        out = ~bidirectional_mask_mod(b, h, q_idx, kv_idx)
        for mod in mods:
            out = out | mod(b, h, q_idx, kv_idx)
        return out

    return _named(or_mod, "or(" + ",".join(_short(m) for m in mods) + ")")


def _short(mod) -> str:
    name = getattr(mod, "__name__", type(mod).__name__)
    return name[: -len("_mask_mod")] if name.endswith("_mask_mod") else name


def materialise(mod: MaskMod, size: int, *, device=None) -> torch.Tensor:
    """The dense ``(size, size)`` bool mask of a ``mask_mod`` (batch 0, head 0).

    The mod is evaluated once on broadcast index grids (``q_idx`` a column, ``kv_idx`` a
    row), so it costs O(size^2) time and memory and no Python loop.

    >>> materialise(causal_mask_mod, 3).int().tolist()
    [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """
    check_int("size", size, 1)
    if not callable(mod):
        raise TypeError(f"mod: expected a mask_mod(b, h, q_idx, kv_idx), got {describe(mod)}")
    q, k = _grid(size, device)
    zero = torch.zeros((), dtype=torch.long, device=q.device)
    out = torch.as_tensor(mod(zero, zero, q, k), device=q.device)
    return torch.broadcast_to(out.to(torch.bool), (size, size)).contiguous()


# ------------------------------------------------------------------- dense builders
def causal(n: int, *, device=None) -> torch.Tensor:
    """Causal mask (:func:`causal_mask_mod`) as an ``(n, n)`` bool tensor.

    Complexity: O(n^2) memory and time.

    >>> causal(3).int().tolist()
    [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """
    check_int("n", n, 1)
    return materialise(causal_mask_mod, n, device=device)


def sliding_window(n: int, width: int, *, device=None) -> torch.Tensor:
    """Causal sliding window (:func:`sliding_window_mask_mod`) as an ``(n, n)`` bool tensor.

    ``M[q, k] = 0 <= q - k < width``. With residual connections the stack of ``L`` layers
    sees ``L (width - 1)`` positions back, so the limit is the causal mask, reached after
    ``ceil((n - 1) / (width - 1))`` layers (for ``width >= 2``).

    Examples
    --------
    >>> sliding_window(4, 2).int().tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    """
    check_int("n", n, 1)
    return materialise(sliding_window_mask_mod(width), n, device=device)


def block_causal(n: int, block: int, *, device=None) -> torch.Tensor:
    """Block-causal mask (:func:`block_causal_mask_mod`) as an ``(n, n)`` bool tensor.

    Blocks are ``[0, block), [block, 2 block), ...``; the last may be shorter.

    Examples
    --------
    >>> block_causal(4, 2).int().tolist()
    [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    """
    check_int("n", n, 1)
    return materialise(block_causal_mask_mod(block), n, device=device)


def chain(n: int, *, device=None) -> torch.Tensor:
    """Chain (path) mask (:func:`chain_mask_mod`) as an ``(n, n)`` bool tensor.

    The diagonal is empty (row 0 is empty too): the residual supplies ``q -> q``. This is
    the worst case for depth: information from position 0 needs ``n - 1`` layers to reach
    position ``n - 1``.

    Examples
    --------
    >>> chain(3).int().tolist()
    [[0, 0, 0], [1, 0, 0], [0, 1, 0]]
    """
    check_int("n", n, 1)
    return materialise(chain_mask_mod, n, device=device)


def prefix_lm(n: int, prefix: int, *, device=None) -> torch.Tensor:
    """Prefix-LM mask (:func:`prefix_lm_mask_mod`) as an ``(n, n)`` bool tensor.

    ``M[q, k] = (k < prefix) or (k <= q)``, for ``0 <= prefix <= n``.

    Examples
    --------
    >>> prefix_lm(4, 2).int().tolist()
    [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    """
    check_int("n", n, 1)
    check_int("prefix", prefix, 0)
    if prefix > n:
        raise ValueError(f"prefix: expected 0 <= prefix <= n = {n}, got {prefix}")
    return materialise(prefix_lm_mask_mod(prefix), n, device=device)


def bidirectional(n: int, *, device=None) -> torch.Tensor:
    """Full (encoder) mask (:func:`bidirectional_mask_mod`) as an ``(n, n)`` bool tensor.

    Examples
    --------
    >>> bidirectional(2).int().tolist()
    [[1, 1], [1, 1]]
    """
    check_int("n", n, 1)
    return materialise(bidirectional_mask_mod, n, device=device)


def random_mask(
    n: int, p: float, *, generator: torch.Generator | None = None, device=None
) -> torch.Tensor:
    """Random mask: each off-diagonal ``(q, k)`` is True independently with probability ``p``.

    The diagonal is False (the residual supplies self edges). Rows are drawn in chunks so
    that ``n = 8192`` needs no ``n x n`` float buffer. A ``generator`` must live on
    ``device`` (CPU by default).

    Examples
    --------
    >>> mask = random_mask(6, 0.5, generator=torch.Generator().manual_seed(0))
    >>> mask.shape, bool(mask.diagonal().any())
    (torch.Size([6, 6]), False)
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


def random_edges(
    n: int, p: float, *, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The edges of a :func:`random_mask` without its ``n x n`` matrix: each off-diagonal
    ``(q, k)`` independently with probability ``p``, as two int64 tensors ``(q, k)`` in
    row-major order.

    The gaps between successive edges (pairs numbered row by row, diagonal skipped) are
    geometric, drawn in batches: time and memory ``O(p n^2)`` instead of ``O(n^2)``.
    The same law as :func:`random_mask`, other draws.

    >>> q, k = random_edges(5, 1.0)
    >>> q.tolist()[:6], k.tolist()[:6]
    ([0, 0, 0, 0, 1, 1], [1, 2, 3, 4, 0, 2])
    >>> random_edges(3, 0.0)[0].numel()
    0
    """
    check_int("n", n, 1)
    p = check_number("p", p, minimum=0.0, maximum=1.0, expected="a probability in [0, 1]")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator or None, got {describe(generator)}")
    pairs = n * (n - 1)
    if p == 0.0 or pairs == 0:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty.clone()
    log_q = torch.log1p(torch.tensor(-p, dtype=torch.float64))
    batch = int(p * pairs * 1.05) + 64
    flat, last = [], -1
    while last < pairs:
        u = 1.0 - torch.rand(batch, generator=generator, dtype=torch.float64)  # (0, 1]
        gaps = (torch.log(u) / log_q).floor().clamp(max=pairs).to(torch.int64) + 1
        positions = last + torch.cumsum(gaps, 0)
        flat.append(positions[positions < pairs])
        last = int(positions[-1])
    index = torch.cat(flat)
    q, j = index // (n - 1), index % (n - 1)
    return q, j + (j >= q).to(torch.int64)


class TwoStreamMasks(NamedTuple):
    """XLNet two-stream masks for one factorisation order (all ``(n, n)`` or ``(2n, 2n)``).

    - ``content[i, j]``: content stream of token ``i`` attends content of token ``j``.
    - ``query[i, j]``: query stream of token ``i`` attends content of token ``j``.
    - ``joint``: both streams as one ``(2n, 2n)`` mask over positions
      ``[content_0..content_{n-1}, query_0..query_{n-1}]``; queries never attend queries
      (each query keeps its own state through the residual), contents never attend queries.

    Examples
    --------
    >>> xlnet_two_stream([1, 0])._fields
    ('content', 'query', 'joint')
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

    Examples
    --------
    >>> masks = xlnet_two_stream([2, 0, 1])  # factorisation order 2, 0, 1
    >>> masks.content.int().tolist(), masks.query.int().tolist()
    ([[1, 0, 1], [1, 1, 1], [0, 0, 1]], [[0, 0, 1], [1, 0, 1], [0, 0, 0]])
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
    """Block two-stream mask (:func:`block_two_stream_mask_mod`), dense, in the layout of
    ``task_merge.block_two_stream``.

    ``n`` tokens in blocks of ``block`` (the last may be shorter); ``K`` blocks. Positions:

    - content positions ``0 .. c-1`` carry tokens ``0 .. c-1`` of blocks ``0 .. K-2``
      (``c = n - len(last block)``: the last block's content is never read by any
      prediction, so the minimal merged task drops it);
    - mask-token positions ``c .. c+n-1``: position ``c + t`` predicts token ``t``.

    Examples
    --------
    >>> block_two_stream_mask(4, 2).shape  # 2 content positions, 4 mask tokens
    torch.Size([6, 6])
    """
    check_int("n", n, 1)
    check_int("block", block, 1)
    c = ((n - 1) // block) * block
    return materialise(block_two_stream_mask_mod(n, block), c + n, device=device)


def butterfly_layout(n: int) -> dict[str, range]:
    """Position ranges of the butterfly task for ``n >= 2`` tokens.

    - ``forward``: ``n - 1`` positions carrying tokens ``0 .. n-2`` (causal chain);
    - ``backward``: ``n - 1`` positions carrying tokens ``1 .. n-1`` (anti-causal chain);
    - ``predict``: ``n`` positions, the ``k``-th predicts token ``k`` from an aggregate of
      its neighbours' tokens.

    Examples
    --------
    >>> butterfly_layout(3)
    {'forward': range(0, 2), 'backward': range(2, 4), 'predict': range(4, 7)}
    """
    check_int("n", n, 2)
    return {
        "forward": range(n - 1),
        "backward": range(n - 1, 2 * n - 2),
        "predict": range(2 * n - 2, 3 * n - 2),
    }


def butterfly_mask(n: int, *, device=None) -> torch.Tensor:
    """Butterfly attention mask (:func:`butterfly_mask_mod`), dense, layout of
    :func:`butterfly_layout`.

    Its Hasse diagram is two chains running in opposite directions joined at the
    prediction nodes: a butterfly.

    Examples
    --------
    >>> butterfly_mask(3).shape  # 3 n - 2 positions
    torch.Size([7, 7])
    """
    check_int("n", n, 2)
    return materialise(butterfly_mask_mod(n), 3 * n - 2, device=device)
