"""The LRA encoder classifier with SBM or dense softmax attention, same everything else.

Definition
----------
The SBM-Transformer's LRA configuration {cite}`cho2022sbm`: token embedding plus
learned position embedding, ``num_layers`` pre-LN encoder blocks
(``x + Dropout(Attention(LN(x)))`` then ``x + Dropout(FFN(LN(x)))`` with
``FFN = Linear(dim, ffn) -> GELU -> Dropout -> Linear(ffn, dim)``), a final LayerNorm,
mean pooling over the non-padding positions and a classifier
``Linear(dim, ffn) -> ReLU -> Linear(ffn, classes)``. Defaults: 2 layers, 2 heads, head
size 32, dim 64, FFN 128, dropout 0.1, k = 128 clusters. Dropout is
:class:`companion.lra.dropout.Dropout`: torch's numbers, with its CPU masks drawn from
PCG64 (faster than torch's: benchmarks/bench_dropout.py measures it; same law).

The attention of every block is either

- ``"sbm"``: :class:`companion.sbm.SBMAttention` (memberships, fastRG edge list,
  edge attention, straight-through estimator). Padding positions get zero memberships
  (its ``query_valid`` / ``key_valid``), so ``P_ij = 0`` there and no edge touches them;
  the cost stays linear in the sampled edges;
- ``"dense"``: softmax attention over all non-padding keys (torch SDPA).

Density of a head on one input is ``edges / (n_valid * m_valid)`` (1 for dense). A
forward returns the logits and one ``[B, H]`` density tensor per layer, differentiable
for SBM (the input of :func:`companion.sbm.density_regularizer`).

With ``dual=True`` (LRA Retrieval) two sequences go through the same encoder and the
classifier reads ``[u, v, u * v, u - v]``.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from companion._validate import check_bool, check_choice, check_int, check_number, check_tensor
from companion.lra.dropout import Dropout
from companion.sbm import SBMAttention

ATTENTIONS = ("sbm", "dense")


class MultiHeadAttention(nn.Module):
    """Multi-head self-attention with SBM or dense softmax heads.

    Parameters
    ----------
    dim : model width; heads, head_dim : number and size of heads.
    attention : "sbm" or "dense".
    num_clusters : k for SBM heads. duplicates, self_loops : see ``fastrg_sample``.

    After a forward with ``self.record = True`` the attribute ``last_edges`` holds the
    sampled ``(group, query, key)`` edge list (SBM) for inspection.

    >>> attn = MultiHeadAttention(8, 2, 4, attention="sbm", num_clusters=3)
    >>> x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    >>> y, density = attn(x, generator=torch.Generator().manual_seed(1))
    >>> y.shape, density.shape, bool(((density >= 0) & (density <= 1)).all())
    (torch.Size([2, 5, 8]), torch.Size([2, 2]), True)
    >>> MultiHeadAttention(8, 2, 4, attention="dense")(x)[1]  # dense heads: density 1
    tensor([[1., 1.],
            [1., 1.]])

    References
    ----------
    Cho et al., arXiv 2210.15541: SBM-Transformer heads, each choosing its edges per input
    (abstract; the settings from the authors' code).
    """

    def __init__(self, dim: int, heads: int, head_dim: int, *, attention: str = "sbm",
                 num_clusters: int = 128, duplicates: str = "keep", self_loops: bool = False,
                 device=None, dtype=None):
        super().__init__()
        for name, val in (("dim", dim), ("heads", heads), ("head_dim", head_dim)):
            check_int(name, val, minimum=1)
        check_choice("attention", attention, ATTENTIONS)
        factory = {"device": device, "dtype": dtype}
        self.dim, self.heads, self.head_dim, self.attention = dim, heads, head_dim, attention
        self.qkv = nn.Linear(dim, 3 * heads * head_dim, **factory)
        self.out = nn.Linear(heads * head_dim, dim, **factory)
        self.sbm = (SBMAttention(head_dim, heads, num_clusters, duplicates=duplicates,
                                 self_loops=self_loops, **factory)
                    if attention == "sbm" else None)
        self.record = False
        self.last_edges = None

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None, *,
                generator: torch.Generator | None = None):
        """``x`` ``[B, n, dim]``, ``valid`` ``[B, n]`` bool (None: all valid).

        Returns ``(y [B, n, dim], density [B, H])``.
        """
        check_tensor("x", x, ndim=3, floating=True, shape_text=f"[B, n, {self.dim}]")
        if x.shape[-1] != self.dim:
            raise ValueError(f"x: expected [B, n, {self.dim}], got shape {tuple(x.shape)}")
        if valid is not None:
            check_tensor("valid", valid, ndim=2, dtype=torch.bool, shape_text="[B, n]")
            if tuple(valid.shape) != tuple(x.shape[:2]):
                raise ValueError(
                    f"valid: expected shape {tuple(x.shape[:2])} like x, got {tuple(valid.shape)}")
        b, n, _ = x.shape
        q, k, v = (self.qkv(x).reshape(b, n, 3, self.heads, self.head_dim)
                   .permute(2, 0, 3, 1, 4).unbind(0))  # each [B, H, n, d]
        if self.attention == "dense":
            mask = None if valid is None else valid[:, None, None, :]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            density = torch.ones(b, self.heads, dtype=x.dtype, device=x.device)
        else:
            # the edge list only when recorded: the pair-grid path would build it for this
            result = self.sbm(q, k, v, query_valid=valid, key_valid=valid,
                              generator=generator, return_edges=self.record)
            y, density = result[:2]
            self.last_edges = result[2] if self.record else None
        y = y.transpose(1, 2).reshape(b, n, self.heads * self.head_dim)
        return self.out(y), density


class EncoderBlock(nn.Module):
    """Pre-LN block: attention and GELU FFN, each with dropout and a residual.

    >>> block = EncoderBlock(8, 2, 4, 16, 0.0, attention="dense")
    >>> x = torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(0))
    >>> y, density = block(x)
    >>> y.shape, density.shape
    (torch.Size([1, 5, 8]), torch.Size([1, 2]))
    """

    def __init__(self, dim, heads, head_dim, ffn, dropout, **attn_kwargs):
        super().__init__()
        factory = {k: attn_kwargs[k] for k in ("device", "dtype") if k in attn_kwargs}
        self.norm1 = nn.LayerNorm(dim, **factory)
        self.attn = MultiHeadAttention(dim, heads, head_dim, **attn_kwargs)
        self.norm2 = nn.LayerNorm(dim, **factory)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn, **factory), nn.GELU(), Dropout(dropout),
                                 nn.Linear(ffn, dim, **factory))
        self.drop = Dropout(dropout)

    def forward(self, x, valid=None, *, generator=None):
        a, density = self.attn(self.norm1(x), valid, generator=generator)
        x = x + self.drop(a)
        x = x + self.drop(self.ffn(self.norm2(x)))
        return x, density


class LRAClassifier(nn.Module):
    """Encoder classifier of the SBM-Transformer's LRA experiments.

    Parameters
    ----------
    vocab_size : token ids are in ``[0, vocab_size)``; ``pad_id`` marks padding
        (None: no padding, e.g. pixel tokens where 0 is black, not padding).
    seq_len : maximum sequence length (size of the learned position table).
    num_classes : output classes.
    attention : "sbm" or "dense".
    dim, heads, head_dim, ffn, num_layers, dropout, num_clusters : the architecture
        (defaults: the paper's LRA configuration).
    dual : two-tower input for Retrieval.
    duplicates, self_loops : forwarded to the SBM heads.
    device, dtype : for the parameters.

    Forward
    -------
    ``model(tokens)`` or ``model(tokens, tokens_2)`` when dual, with optional
    ``generator=`` for the SBM sampling; returns ``(logits [B, C], densities)`` where
    ``densities`` is a list of ``[B, H]`` tensors, one per layer (for dual inputs the two
    towers' densities are concatenated along the batch).

    Complexity
    ----------
    Per layer ``O(n dim (dim + ffn))`` plus attention: ``O(n^2 d)`` dense, or
    ``O(E (d + k) + n k d)`` SBM for ``E`` sampled edges.

    >>> model = LRAClassifier(10, 6, 3, dim=8, heads=2, head_dim=4, ffn=16, num_layers=1,
    ...                       num_clusters=2)
    >>> tokens = torch.tensor([[1, 2, 3, 0, 0, 0], [4, 5, 6, 7, 8, 9]])
    >>> logits, densities = model(tokens, generator=torch.Generator().manual_seed(0))
    >>> logits.shape, len(densities), densities[0].shape
    (torch.Size([2, 3]), 1, torch.Size([2, 2]))

    References
    ----------
    Cho et al., arXiv 2210.15541: the SBM-Transformer's LRA encoder (abstract; the
    architecture from the authors' ``lra_config.py``).
    """

    def __init__(self, vocab_size: int, seq_len: int, num_classes: int, *,
                 attention: str = "sbm", dim: int = 64, heads: int = 2, head_dim: int = 32,
                 ffn: int = 128, num_layers: int = 2, dropout: float = 0.1,
                 num_clusters: int = 128, pad_id: int | None = 0, dual: bool = False,
                 duplicates: str = "keep", self_loops: bool = False,
                 device=None, dtype=None):
        super().__init__()
        for name, val in (("vocab_size", vocab_size), ("seq_len", seq_len),
                          ("num_classes", num_classes), ("dim", dim), ("heads", heads),
                          ("head_dim", head_dim), ("ffn", ffn), ("num_layers", num_layers),
                          ("num_clusters", num_clusters)):
            check_int(name, val, minimum=1)
        check_choice("attention", attention, ATTENTIONS)
        check_number("dropout", dropout, minimum=0.0, maximum=1.0, max_open=True,
                     expected="a probability in [0, 1)")
        if pad_id is not None:
            check_int("pad_id", pad_id, minimum=0, maximum=vocab_size - 1)
        dual = check_bool("dual", dual)
        factory = {"device": device, "dtype": dtype}
        self.attention, self.pad_id, self.dual, self.seq_len = attention, pad_id, dual, seq_len
        self.vocab_size = vocab_size
        self.num_layers, self.heads = num_layers, heads
        self.embed = nn.Embedding(vocab_size, dim, **factory)
        self.pos = nn.Parameter(torch.empty(seq_len, dim, **factory))
        nn.init.normal_(self.pos, std=0.02)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.drop = Dropout(dropout)
        self.blocks = nn.ModuleList(
            EncoderBlock(dim, heads, head_dim, ffn, dropout, attention=attention,
                         num_clusters=num_clusters, duplicates=duplicates,
                         self_loops=self_loops, **factory)
            for _ in range(num_layers))
        self.norm = nn.LayerNorm(dim, **factory)
        width = 4 * dim if dual else dim
        self.head = nn.Sequential(nn.Linear(width, ffn, **factory), nn.ReLU(),
                                  nn.Linear(ffn, num_classes, **factory))

    def encode(self, tokens: torch.Tensor, *, generator=None):
        """Pooled representation ``[B, dim]`` and per-layer densities of one tower."""
        check_tensor("tokens", tokens, ndim=2, dtype=torch.long, shape_text="[B, n]")
        b, n = tokens.shape
        if b == 0 or n == 0:
            raise ValueError(f"tokens: expected B >= 1 and n >= 1, got shape {tuple(tokens.shape)}")
        if n > self.seq_len:
            raise ValueError(f"tokens: length {n} exceeds seq_len={self.seq_len}")
        lo, hi = (int(v) for v in torch.aminmax(tokens))
        if lo < 0 or hi >= self.vocab_size:
            # nn.Embedding would fail deep inside torch with "index out of range in self"
            raise ValueError(
                f"tokens: expected ids in [0, {self.vocab_size}) (vocab_size), got range "
                f"[{lo}, {hi}]")
        valid = None if self.pad_id is None else tokens != self.pad_id
        if valid is not None:
            valid[:, 0] = True  # an all-padding row would have nothing to attend to
        x = self.drop(self.embed(tokens) + self.pos[:n])
        densities = []
        for block in self.blocks:
            x, density = block(x, valid, generator=generator)
            densities.append(density)
        x = self.norm(x)
        if valid is None:
            pooled = x.mean(1)
        else:
            w = valid.to(x.dtype)[..., None]
            pooled = (x * w).sum(1) / w.sum(1)
        return pooled, densities

    def forward(self, tokens: torch.Tensor, tokens_2: torch.Tensor | None = None, *,
                generator: torch.Generator | None = None):
        if self.dual != (tokens_2 is not None):
            raise ValueError("tokens_2: required exactly when the model is dual (Retrieval)")
        u, densities = self.encode(tokens, generator=generator)
        if tokens_2 is None:
            return self.head(u), densities
        v, densities_2 = self.encode(tokens_2, generator=generator)
        feats = torch.cat([u, v, u * v, u - v], dim=-1)
        return self.head(feats), [torch.cat([a, b]) for a, b in zip(densities, densities_2)]

    def set_record(self, flag: bool) -> None:
        """Keep (True) or drop the sampled edge lists of the last forward (for plots)."""
        for block in self.blocks:
            block.attn.record = flag
            block.attn.last_edges = None

    def last_edges(self) -> list:
        """Per layer: the ``(group, query, key)`` edges of the last recorded forward."""
        return [block.attn.last_edges for block in self.blocks]


def attention_flops(num_edges: float, head_dim: int) -> float:
    """Multiply-adds of attention on ``num_edges`` edges, counted as FLOPs (2 per MAC).

    Per edge: the score ``<q_i, k_j>`` (``d`` MACs) and the weighted value sum
    (``d`` MACs), i.e. ``4 d`` FLOPs; the softmax's exp/sum/divide are ``O(1)`` per edge
    and not counted. Dense attention is the complete graph, ``n * m`` edges.

    Examples
    --------
    >>> attention_flops(1000, 32)  # scores and weighted sum: 2 * 32 MACs per edge, 2 FLOPs each
    128000.0
    """
    num_edges = check_number("num_edges", num_edges, minimum=0.0)
    head_dim = check_int("head_dim", head_dim, minimum=1)
    return 4.0 * head_dim * float(num_edges)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters.

    Examples
    --------
    >>> count_parameters(torch.nn.Linear(3, 2))
    8
    """
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


__all__ = [
    "ATTENTIONS",
    "EncoderBlock",
    "LRAClassifier",
    "MultiHeadAttention",
    "attention_flops",
    "count_parameters",
]
