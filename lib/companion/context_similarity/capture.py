"""One capture of every head's output vector and attention map, in a single forward pass.

The names follow TransformerLens: per layer ``l``, ``blocks.{l}.attn.hook_z`` is the
per-head context ``z^{lh}_i = sum_j A^{lh}_ij v^{lh}_j`` (``[B, T, H, d]``, the input of
the output projection ``W_O`` split into heads) and ``blocks.{l}.attn.hook_pattern`` the
attention probabilities ``A^{lh}`` (``[B, H, T_q, T_k]``). :func:`head_outputs` returns
both for a batch; :func:`analyse_batch` also what the statistics need (content tokens,
the attention each key receives), as a :class:`BatchResult`.

How: a registered attention function (the eager computation, window by window) writes
``hook_pattern`` and ``hook_z`` (its output, what ``attention.output.dense`` reads) into
buffers of a :class:`~companion.context_similarity.workspace.Workspace`; no hooks, so
forward passes on several threads may overlap (:func:`buffered_attention`). An MPNet
(all-mpnet-base-v2) computes its attention inline, not through the transformers
attention interface: :func:`_mpnet_pass` runs its layers as ``MPNetModel.forward`` does
and calls the same function, which adds MPNet's relative position bias to the scores. With
:class:`CaptureSettings` ``stop_after_last_attention`` (the default for the analysis), the
pass stops once the last layer's ``hook_z`` is written.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch

from companion._validate import check_bool, check_int
from companion.context_similarity.encoder import (
    WHERE,
    _base,
    _heads,
    encoder_layers,
    is_mpnet,
    output_projection,
)
from companion.context_similarity.workspace import Workspace, work_buffer

__all__ = [
    "ATTENTION_INTO_BUFFER",
    "BatchResult",
    "CaptureSettings",
    "HeadOutputs",
    "analyse_batch",
    "head_outputs",
    "hook_names",
    "wo_gram",
]


def hook_names(layer: int) -> tuple[str, str]:
    """The TransformerLens names of what layer ``layer`` captures: (``hook_z``,
    ``hook_pattern``).

    >>> hook_names(0)
    ('blocks.0.attn.hook_z', 'blocks.0.attn.hook_pattern')
    """
    return f"blocks.{layer}.attn.hook_z", f"blocks.{layer}.attn.hook_pattern"


@dataclass(frozen=True)
class CaptureSettings:
    """How the forward pass of the analysis runs.

    ``stop_after_last_attention``: stop the pass once the last layer's ``hook_z`` is
    captured; that layer's ``W_O``, feed-forward block and the pooler feed no statistic
    (about a tenth of the forward of a 6-layer model). False runs the whole model (as
    benchmarks/bench_context_similarity.py does to measure the analysis's own overhead).

    ``side_by_side_updates``: with several ``where`` entries, a CPU model and two or more
    intra-op threads, :func:`analyse_corpus` updates the entries' statistics of a batch
    side by side, one thread each with one intra-op thread (the forward keeps all of
    them). The update's ops are short (a head's similarity product, its masking and
    segment maxima) and split poorly over threads; the same ops on one thread give the
    same numbers (tested), so only the speed changes. False: one entry after the other.

    ``lanes``: on a CPU whose intra-op thread count ``T`` is 2 to ``lanes``,
    :func:`analyse_corpus` runs ``T`` lanes (fewer if there are fewer batches), each a
    thread of its own with one intra-op thread: a lane runs its batch's forward pass and
    every update, and the batches' parts are added to the statistics one batch after the
    other, in the windows' order. Each lane keeps two sets of work buffers, so that it
    computes its next batch while its last one waits for the earlier batches of the
    other lanes to be added. The forward's numbers at one intra-op
    thread equal those at 2, 3 and 4 bit for bit (tested on the bundled MiniLM at the
    chapter's 16 x 128 batch shape), so the statistics are those of one batch after the
    other, bit for bit; the small ops of a batch (a window's attention, a head's
    similarity product) no longer wait for a second thread, and every core stays busy.
    ``lanes`` is at most 4 (what is tested). With more threads than ``lanes``, or
    ``lanes=1``: one batch at a time, its forward on all threads, then its updates
    (side by side per ``side_by_side_updates``).

    >>> CaptureSettings().stop_after_last_attention
    True
    >>> CaptureSettings(lanes=1).lanes
    1
    """

    stop_after_last_attention: bool = True
    side_by_side_updates: bool = True
    lanes: int = 2

    def __post_init__(self):
        check_bool("stop_after_last_attention", self.stop_after_last_attention)
        check_bool("side_by_side_updates", self.side_by_side_updates)
        check_int("lanes", self.lanes, minimum=1, maximum=4)  # tested to 4


class HeadOutputs(NamedTuple):
    """Per-head output vectors and attention maps of one batch (and, on request, the
    final hidden states of the same forward pass).

    >>> from transformers import BertConfig, BertModel
    >>> model = BertModel(BertConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
    ...     intermediate_size=16, vocab_size=20, attn_implementation="eager")).eval()
    >>> batch = {"input_ids": torch.tensor([[1, 5, 7, 2]]),
    ...          "attention_mask": torch.ones(1, 4, dtype=torch.long),
    ...          "sentence_ids": torch.tensor([[-1, 0, 0, -1]])}
    >>> ho = head_outputs(model, batch)
    >>> isinstance(ho, HeadOutputs), tuple(ho.outputs.shape), tuple(ho.attentions.shape)
    (True, (1, 2, 2, 4, 4), (1, 2, 2, 4, 4))
    """

    outputs: torch.Tensor  # [B, L, H, T, d] (pre_wo) or [B, L, H, T, D] (post_wo)
    attentions: torch.Tensor  # [B, L, H, T, T], rows are queries
    hidden: torch.Tensor | None = None  # [B, T, D] last_hidden_state (return_hidden=True)



_BATCH_HELP = ("a Mapping such as a dict or a tokenizer's BatchEncoding "
               "(tokenizer(..., return_tensors='pt')) with 'input_ids' [B, T] and optionally "
               "'attention_mask' and 'token_type_ids', or a companion.corpora.Windows")


def _batch_tensors(batch, model) -> dict[str, torch.Tensor]:
    """The batch as a plain dict, its model inputs checked against ``model``.

    Any ``collections.abc.Mapping`` is read (a Hugging Face ``BatchEncoding`` is one, not a
    dict); keys other than the model inputs and ``sentence_ids`` are passed through
    unchecked. Checked here rather than left to the forward pass, whose errors (an
    embedding index out of range, a device mismatch) come from deep inside torch.
    """
    encoder_layers(model)  # TypeError for anything but a BERT-family model
    if not isinstance(batch, Mapping) and callable(getattr(batch, "batch", None)):
        batch = batch.batch()  # companion.corpora.Windows
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch: expected {_BATCH_HELP}; got {type(batch).__name__}")
    if "input_ids" not in batch:
        raise TypeError(f"batch: expected {_BATCH_HELP}; got a {type(batch).__name__} with "
                        f"keys {sorted(map(str, batch.keys()))}")
    ids = batch["input_ids"]
    if not isinstance(ids, torch.Tensor):
        raise TypeError("batch['input_ids']: expected a torch.Tensor [B, T] of token ids "
                        f"(return_tensors='pt'), got {type(ids).__name__}")
    if ids.dtype != torch.long:
        raise TypeError(f"batch['input_ids']: expected dtype torch.long, got {ids.dtype}")
    if ids.dim() != 2:
        raise ValueError(f"batch['input_ids']: expected a 2-D tensor [B, T], got shape "
                         f"{tuple(ids.shape)}")
    if ids.shape[0] == 0 or ids.shape[1] < 2:
        raise ValueError(f"batch['input_ids']: expected B >= 1 and T >= 2, got {tuple(ids.shape)}")
    model_device = next(model.parameters()).device
    if ids.device != model_device:
        raise ValueError(f"batch['input_ids']: on {ids.device}, the model on {model_device}; "
                         "move the batch to the model's device (nothing is moved here)")
    vocab = int(model.config.vocab_size)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"batch['input_ids']: token ids must lie in [0, {vocab}) (the "
                         f"model's vocabulary), got [{int(ids.min())}, {int(ids.max())}]")
    out = dict(batch.items())
    n_types = getattr(model.config, "type_vocab_size", None)
    for name, top in (("attention_mask", 2), ("token_type_ids", n_types), ("sentence_ids", None)):
        x = out.get(name)
        if x is None:
            continue
        if not isinstance(x, torch.Tensor) or x.dtype.is_floating_point or x.is_complex():
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"batch[{name!r}]: expected an integer (or bool) torch.Tensor, "
                            f"got {got}")
        if tuple(x.shape) != tuple(ids.shape) or x.device != ids.device:
            raise ValueError(f"batch[{name!r}]: expected shape {tuple(ids.shape)} on "
                             f"{ids.device} like input_ids, got {tuple(x.shape)} on {x.device}")
        if x.dtype == torch.bool:
            x = out[name] = x.long()  # the model adds masks as numbers
        if top is not None and (int(x.min()) < 0 or int(x.max()) >= top):
            raise ValueError(f"batch[{name!r}]: expected values in [0, {top}), got "
                             f"[{int(x.min())}, {int(x.max())}]")
    if out.get("attention_mask") is None:
        out["attention_mask"] = torch.ones_like(ids)
    return out


def _check_model(model, length: int) -> None:
    if getattr(model.config, "_attn_implementation", "eager") not in (
            "eager", ATTENTION_INTO_BUFFER):  # the latter: inside buffered_attention
        raise ValueError(
            "model: attention maps need attn_implementation='eager' (got "
            f"{model.config._attn_implementation!r}); load it with load_encoder() or "
            "AutoModel.from_pretrained(..., attn_implementation='eager')"
        )
    if model.training:
        raise ValueError(
            "model: in training mode (dropout would perturb outputs); call model.eval()")
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos is not None and is_mpnet(model):
        max_pos -= 2  # positions start after MPNet's padding index 1 (fairseq's numbering)
    if max_pos is not None and length > max_pos:
        raise ValueError(
            f"batch: windows of {length} tokens exceed the model's maximum input length {max_pos}"
        )


def wo_gram(model) -> torch.Tensor:
    """Per-head Gram matrices of the output projection, ``G^{lh} = W_O^{h T} W_O^{h}``.

    ``<W_O^h z_i, W_O^h z_j> = z_i^T G^{lh} z_j``: the post-W_O similarity from pre-W_O
    vectors without materialising the ``[B, L, H, T, D]`` contributions.

    Returns
    -------
    Tensor [L, H, d, d] on the model's device and dtype.

    >>> from transformers import BertConfig, BertModel
    >>> model = BertModel(BertConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
    ...     intermediate_size=16, vocab_size=20, attn_implementation="eager")).eval()
    >>> G = wo_gram(model)
    >>> G.shape, torch.allclose(G, G.transpose(-1, -2))
    (torch.Size([2, 2, 4, 4]), True)
    """
    layers = encoder_layers(model)
    _, n_heads, d = _heads(model)
    grams = []
    for layer in layers:
        w = output_projection(layer).weight  # [D_out, H*d]
        wh = w.detach().view(w.shape[0], n_heads, d)  # [D, H, d]
        grams.append(torch.einsum("ohd,ohe->hde", wh, wh))
    return torch.stack(grams)


@torch.no_grad()
def head_outputs(model, batch, where: str = "pre_wo", return_hidden: bool = False,
                 workspace: Workspace | None = None) -> HeadOutputs:
    """Every head's output vector for every token, and the attention maps.

    A registered attention function (the eager computation, the model's configured
    implementation is restored afterwards) writes each layer's per-head context
    ``z^{lh}`` (value bias included) into one buffer: what the layer's
    ``attention.output.dense`` (the ``W_O`` projection) reads once transformers has merged
    the heads into ``[B, T, H*d]``, bit for bit (tested against a pre-hook on it). The
    attention maps are that function's probabilities, kept in a buffer too.

    Parameters
    ----------
    model : a BERT-family model or an MPNet in eval mode with eager attention (see
        :func:`load_encoder`).
    batch : Mapping or :class:`companion.corpora.Windows`
        Any ``collections.abc.Mapping`` (a dict, or the tokenizer's own output, a
        ``BatchEncoding`` from ``tokenizer(..., padding=True, return_tensors="pt")``) with
        ``input_ids`` [B, T] (long) and optionally ``attention_mask`` and
        ``token_type_ids`` (integer or bool, [B, T]); other keys are ignored. Tensors must
        be on the model's device (nothing is moved).
    where : "pre_wo" | "post_wo"
        ``"pre_wo"``: ``z^{lh}_i`` (size ``d``); ``"post_wo"``: the head's contribution
        after ``W_O``, ``W_O^h z^{lh}_i`` (size ``D``; the bias of ``W_O`` is not split
        among heads, so the heads' contributions plus that bias give the layer's
        attention output before dropout, residual and LayerNorm).
    return_hidden : bool
        Also return the model's final hidden states (``last_hidden_state``) from the same
        forward pass, which then runs to the end instead of stopping after the last
        layer's attention: one pass gives what a head-output analysis and a baseline on
        the final hidden states both need.
    workspace : :class:`Workspace`, optional
        Keeps the buffers of the pre-W_O outputs and the maps between calls (for a loop
        over batches: a fresh buffer of a hundred megabytes costs a page fault per 4 KiB
        at every batch). The returned views then live in its buffers and are overwritten
        by the next call with it; without it they are fresh.

    Returns
    -------
    HeadOutputs(outputs, attentions, hidden)
        ``outputs`` [B, L, H, T, d] (or [B, L, H, T, D]); ``attentions`` [B, L, H, T, T];
        ``hidden`` [B, T, D] with ``return_hidden=True``, else None; all in the model's
        dtype (float32 and float64 are tested).

    Examples
    --------
    >>> model, tok = load_encoder(device="cpu")  # doctest: +SKIP
    >>> ho = head_outputs(model, tok(["A cat sat."], return_tensors="pt"),
    ...                   return_hidden=True)  # doctest: +SKIP
    >>> ho.outputs.shape[1:3], ho.hidden.shape[-1]  # doctest: +SKIP
    (torch.Size([6, 12]), 384)

    Raises
    ------
    TypeError
        ``batch`` is not a Mapping (or Windows), has no ``input_ids``, or holds a
        non-tensor or wrongly typed entry (``input_ids`` not long, a floating mask).
    ValueError
        Wrong rank or shape, tensors on another device than the model, token ids outside
        the vocabulary, a mask not 0/1, windows longer than the model accepts, ``where``
        unknown, a model in training mode or without eager attention.

    Complexity
    ----------
    One forward pass (stopped after the last layer's attention unless
    ``return_hidden``); the outputs and maps are written in place, no copy: both are
    views (``outputs`` of a ``[L, H, B, T, d]`` buffer, ``attentions`` of a
    ``[L, B, H, T, T]`` one) of buffers fresh to this call, which no later call
    overwrites (they live as long as the views do), or of ``workspace``'s.
    """
    if where not in WHERE:
        raise ValueError(f"where: expected one of {WHERE}, got {where!r}")
    return_hidden = check_bool("return_hidden", return_hidden)
    z, attentions, _, hidden = _capture(model, _batch_tensors(batch, model),
                                        workspace=workspace, return_hidden=return_hidden)
    if where == "post_wo":
        layers = encoder_layers(model)
        n_layers, n_heads, d = _heads(model)
        w = torch.stack([output_projection(layer).weight for layer in layers])  # [L,D,H*d]
        w = w.view(n_layers, w.shape[1], n_heads, d)
        z = torch.einsum("blhtd,lohd->blhto", z, w)
    # the maps' buffer [L, B, H, T, T] seen as [B, L, H, T, T]: no copy (one window's
    # [H, T, T] of a layer stays contiguous)
    return HeadOutputs(z, attentions.permute(1, 0, 2, 3, 4), hidden)


# The attention maps come from our own registered attention function: the eager
# computation (scores, additive mask, softmax, probabilities times values), written into
# one buffer per call instead of fresh [B, H, T, T] tensors per layer. Keeping fresh maps
# alive for the whole batch (``output_attentions=True``) made every layer's allocation a
# new mapping of pages, and cost more than the rest of the eager attention together.
ATTENTION_INTO_BUFFER = "companion_eager_into_buffer"
_SINK_KWARG = "companion_attention_maps"


class _AttentionMaps:
    """The attention probabilities and head outputs of one forward pass, layer by layer
    (call order).

    ``buffer`` (every layer's ``hook_pattern``) is ``[L, B, H, T, T]``, ``outputs`` (every
    layer's ``hook_z``, the attention's output) ``[L, H, B, T, d]``; with a
    :class:`Workspace` both are reused between passes of equal shape, dtype and device
    (so the maps of a pass are overwritten by the next one). With ``content`` (``[B, T]``
    query weights, 1 for content tokens), the attention every key receives from those
    queries, ``sum_q content_q A_qk``, is summed while each window's maps are in cache:
    ``received`` ``[L, B, H, T]``. With ``stop_after_last`` the last layer's call ends the
    forward pass once its output is written (:class:`_StopAfterLastAttention`).

    With ``threshold`` the maps are not kept: each window's probabilities go to one
    ``[H, Tq, Tk]`` scratch buffer (they stay in the core's cache) and ``buffer`` holds
    only where they reach the threshold, ``A >= threshold`` (bool ``[L, B, H, T, T]``,
    a quarter of the maps' bytes), written while the window's maps are in cache.
    """

    def __init__(self, n_layers: int, workspace: Workspace | None = None,
                 content: torch.Tensor | None = None, stop_after_last: bool = False,
                 threshold: float | None = None):
        self.n_layers = n_layers
        self.workspace = workspace
        self.content = content
        self.stop_after_last = stop_after_last
        self.threshold = threshold
        self.scratch: torch.Tensor | None = None
        self.buffer: torch.Tensor | None = None
        self.outputs: torch.Tensor | None = None
        self.received: torch.Tensor | None = None
        self.calls = 0

    def _reused(self, name, shape, dtype, device) -> torch.Tensor:
        return work_buffer(self.workspace, name, math.prod(shape), dtype, device).view(shape)

    def next_layer(self, shape, d_value, dtype, device):
        """The next layer's slices: maps [B, H, Tq, Tk] (bool ``A >= threshold`` with a
        threshold), head outputs [B, H, Tq, d] (a view of the ``[H, B, Tq, d]`` block of
        ``outputs``) and ``received`` (or None)."""
        if self.calls >= self.n_layers:
            raise RuntimeError(
                f"model: more attention calls than the {self.n_layers} layers in one pass")
        full = (self.n_layers, *shape)
        bsz, n_heads, t_q, _ = shape
        if self.buffer is None:
            if self.threshold is None:
                self.buffer = self._reused("attention_maps", full, dtype, device)
            else:
                self.buffer = self._reused("high_attention", full, torch.bool, device)
                self.scratch = self._reused("attention_scratch", shape[1:], dtype, device)
            self.outputs = self._reused("head_outputs",
                                        (self.n_layers, n_heads, bsz, t_q, d_value),
                                        dtype, device)
            if self.content is not None:
                if tuple(self.content.shape) != (shape[0], shape[2]):
                    raise RuntimeError("content: expected [B, T] query weights")
                self.received = self._reused("received_attention",
                                             (self.n_layers, shape[0], shape[1], shape[3]),
                                             dtype, device)
        if tuple(self.buffer.shape) != full or self.outputs.shape[-1] != d_value:
            raise RuntimeError(f"model: attention layers of different shapes {shape} in one pass")
        layer = self.calls
        self.calls += 1
        return (self.buffer[layer], self.outputs[layer].transpose(0, 1),
                None if self.received is None else self.received[layer])

    def after_layer(self) -> None:
        """Called once a layer's output is written: ends the pass after the last one."""
        if self.stop_after_last and self.calls == self.n_layers:
            raise _StopAfterLastAttention


def _eager_attention_into_buffer(module, query, key, value, attention_mask, scaling=None,
                                 dropout=0.0, position_bias=None, **kwargs):
    """Eager attention (as ``transformers``' BERT computes it) writing its maps into a buffer.

    ``softmax(scale q k^T + mask) v`` with the probabilities left in the next layer slice of
    the :class:`_AttentionMaps` passed as ``companion_attention_maps=`` to the forward (or,
    with its ``threshold``, in a scratch buffer, and only ``A >= threshold`` kept), and
    the output (``hook_z``, what ``W_O`` reads once transformers has merged the heads)
    written straight into its ``[H, B, T, d]`` block of head outputs.
    Window by window: one window's maps (``H T^2`` numbers, under a megabyte for BERT
    sizes) stay in the processor's cache from the scores through the softmax to the
    product with the values, which makes this as fast as a fused attention kernel
    (the batched form makes three trips through main memory per layer).

    ``position_bias`` (MPNet, :func:`_mpnet_pass`): ``[H, Tq, Tk]`` added to every
    window's scaled scores before the mask, as ``MPNetSelfAttention`` adds it.
    """
    sink = kwargs.get(_SINK_KWARG)
    if not isinstance(sink, _AttentionMaps):
        raise RuntimeError(
            f"attention implementation {ATTENTION_INTO_BUFFER!r} runs only inside "
            "companion.context_similarity.head_outputs / analyse_batch")
    if dropout:
        raise ValueError("model: attention dropout is active (call model.eval())")
    bsz, n_heads, t_q, d = query.shape
    t_k = key.shape[2]
    if scaling is None:
        scaling = d ** -0.5
    maps, out, received = sink.next_layer((bsz, n_heads, t_q, t_k), value.shape[-1],
                                          query.dtype, query.device)
    if received is not None:
        content = sink.content.to(query.dtype)[:, None, :]  # [B, 1, Tq]
    high = sink.threshold
    for w in range(bsz):
        probs = maps[w] if high is None else sink.scratch  # [H, Tq, Tk]
        torch.baddbmm(probs, query[w], key[w].transpose(1, 2), beta=0, alpha=scaling,
                      out=probs)
        if position_bias is not None:
            probs.add_(position_bias)
        if attention_mask is not None:
            probs.add_(attention_mask[w if attention_mask.shape[0] > 1 else 0])
        torch.softmax(probs, dim=-1, out=probs)
        torch.matmul(probs, value[w], out=out[w])
        if received is not None:  # [1, Tq] @ [H, Tq, Tk] -> [H, 1, Tk]
            torch.matmul(content[w], probs, out=received[w].unsqueeze(1))
        if high is not None:
            # A >= threshold as 1.0 / 0.0 in place (the scratch's last use), then to bool:
            # two vectorised passes, the same bits as one ge into the bool map (which
            # does not vectorise, and cost twice as much)
            torch.ge(probs, high, out=probs)
            maps[w].copy_(probs)
    sink.after_layer()
    return out.transpose(1, 2), (maps if high is None else None)


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    if ATTENTION_INTO_BUFFER not in AttentionInterface():
        AttentionInterface.register(ATTENTION_INTO_BUFFER, _eager_attention_into_buffer)
        AttentionMaskInterface.register(ATTENTION_INTO_BUFFER, eager_mask)


class _StopAfterLastAttention(Exception):
    """Raised by the last layer's attention call to end the forward pass early.

    Why an exception: a ``transformers`` model has no way to run only its first ``L``
    attention blocks, and everything after the last layer's ``hook_z`` (that layer's
    ``W_O``, its feed-forward block, the pooler) feeds no statistic. Raising from the
    attention function is the one way out of ``model(...)`` there; it is caught right
    around the call in :func:`_capture` and never leaves this module.
    """


@contextmanager
def buffered_attention(model):
    """Run ``model`` with :func:`_eager_attention_into_buffer` inside the block (its
    configured implementation is restored afterwards); nothing changes when an enclosing
    block already set it. :func:`_capture` opens one per call; a corpus pass opens one
    around all its batches, so that forward passes may run on several threads at once
    (``set_attn_implementation`` changes the model, it is not for concurrent use).
    """
    if is_mpnet(model):  # _mpnet_pass calls our attention itself: the model is not touched
        yield
        return
    _register_attention()
    configured = model.config._attn_implementation
    if configured == ATTENTION_INTO_BUFFER:
        yield
        return
    model.set_attn_implementation(ATTENTION_INTO_BUFFER)
    try:
        yield
    finally:
        model.set_attn_implementation(configured)


@torch.no_grad()
def _capture(model, tensors, workspace: Workspace | None = None,
             content: torch.Tensor | None = None, return_hidden: bool = False,
             settings: CaptureSettings = CaptureSettings(),
             attention_threshold: float | None = None):
    """Pre-W_O head outputs [B, L, H, T, d] (every layer's ``hook_z``), the per-layer
    attention maps (``hook_pattern``: the ``[L, B, H, T, T]`` buffer itself) and, with
    ``content`` ([B, T] query weights), the attention each key receives from those
    queries, [B, L, H, T] (else None); with ``return_hidden``, also the final hidden
    states [B, T, D] (the pass then runs to the end), else None.

    The outputs are a view of a ``[L, H, B, T, d]`` tensor; with a ``workspace``, outputs
    and maps live in buffers kept there and overwritten by the next call. With
    ``attention_threshold`` the maps are not kept: the second value is instead the bool
    ``[L, B, H, T, T]`` buffer of ``A >= attention_threshold``.

    The model runs once with :func:`_eager_attention_into_buffer` (the eager computation,
    its maps and outputs written into buffers, see :class:`_AttentionMaps`), inside
    :func:`buffered_attention`. No hooks: the model is not changed during the pass, so
    calls on different threads (each with its own ``workspace``) may overlap inside one
    enclosing :func:`buffered_attention`.
    """
    _check_model(model, tensors["input_ids"].shape[1])
    n_layers, _, _ = _heads(model)
    stop_early = settings.stop_after_last_attention and not return_hidden
    maps = _AttentionMaps(n_layers, workspace, content, stop_after_last=stop_early,
                          threshold=attention_threshold)
    hidden = None
    inputs = {k: tensors[k] for k in ("input_ids", "attention_mask", "token_type_ids")
              if tensors.get(k) is not None}
    with buffered_attention(model):
        try:
            if is_mpnet(model):
                hidden = _mpnet_pass(model, inputs, maps)
            else:
                hidden = model(**inputs, **{_SINK_KWARG: maps}).last_hidden_state
        except _StopAfterLastAttention:
            pass
    if maps.calls != n_layers:
        raise RuntimeError(
            "model: the forward pass did not reach every attention layer through the "
            "transformers attention interface (a BERT-family model of transformers >= 5 "
            "is expected)")
    # stored (layer, head, window, token, dim): the statistics take the sum over windows
    # of every head's similarity matrix, which is then one contiguous block
    received = None if maps.received is None else maps.received.permute(1, 0, 2, 3)
    return maps.outputs.permute(2, 0, 1, 3, 4), maps.buffer, received, hidden


def _mpnet_pass(model, inputs, maps: _AttentionMaps) -> torch.Tensor:
    """``MPNetModel``'s forward up to ``last_hidden_state``, its attention computed by
    :func:`_eager_attention_into_buffer` (maps and ``hook_z`` into ``maps``' buffers).

    MPNet's attention modules compute their attention inline (not through the
    transformers attention interface), so the layers are run here, step for step as
    ``MPNetModel.forward`` runs them in eval mode: the embeddings (position ids from the
    input ids, padding index 1), the additive padding mask (0 at kept keys, the dtype's
    minimum at padded ones, what the eager mask of transformers holds), the relative
    position bias of ``encoder.compute_position_bias`` (the same ``[H, T, T]`` for every
    window: relative positions are those of the raw positions), then per layer
    ``q, k, v``, ``softmax(q k^T / sqrt(d) + bias + mask) v``, ``W_O``
    (``attention.attn.o``), the residual and LayerNorm, and the feed-forward block. The
    model is not changed, so passes on several threads may overlap. Tested against the
    model's own forward (hidden states and ``output_attentions``) and a brute force.
    """
    base = _base(model)
    ids = inputs["input_ids"]
    mask = inputs["attention_mask"]
    hidden = base.embeddings(input_ids=ids)
    dtype = hidden.dtype
    additive = torch.zeros(mask.shape[0], 1, 1, mask.shape[1], dtype=dtype,
                           device=hidden.device).masked_fill_(
        ~mask[:, None, None, :].bool(), torch.finfo(dtype).min)  # [B, 1, 1, Tk]
    bias = base.encoder.compute_position_bias(hidden[:1])[0]  # [H, T, T]
    for layer in base.encoder.layer:
        attention = layer.attention
        attn = attention.attn
        shape = (*hidden.shape[:-1], -1, attn.attention_head_size)
        q = attn.q(hidden).view(shape).transpose(1, 2)
        k = attn.k(hidden).view(shape).transpose(1, 2)
        v = attn.v(hidden).view(shape).transpose(1, 2)
        # the last layer's call raises _StopAfterLastAttention when the pass may stop
        c, _ = _eager_attention_into_buffer(
            attn, q, k, v, additive, scaling=attn.attention_head_size ** -0.5,
            position_bias=bias, **{_SINK_KWARG: maps})
        c = c.reshape(*hidden.shape[:-1], attn.all_head_size)
        attention_output = attention.LayerNorm(attn.o(c) + hidden)
        hidden = layer.output(layer.intermediate(attention_output), attention_output)
    return hidden


class BatchResult(NamedTuple):
    """What :meth:`SimilarityStats.update` consumes for one batch of windows.

    >>> from transformers import BertConfig, BertModel
    >>> model = BertModel(BertConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
    ...     intermediate_size=16, vocab_size=20, attn_implementation="eager")).eval()
    >>> batch = {"input_ids": torch.tensor([[1, 5, 7, 2]]),
    ...          "attention_mask": torch.ones(1, 4, dtype=torch.long),
    ...          "sentence_ids": torch.tensor([[-1, 0, 0, -1]])}
    >>> r = analyse_batch(model, batch)
    >>> isinstance(r, BatchResult), tuple(r.outputs.shape), r.metric is None
    (True, (1, 2, 2, 4, 4), True)
    """

    outputs: torch.Tensor  # [B, L, H, T, d] pre-W_O head outputs
    # [B, L, H, T, T] or L tensors [B, H, T, T]; None with high_attention (below)
    attentions: torch.Tensor | tuple | None
    input_ids: torch.Tensor  # [B, T]
    sentence_ids: torch.Tensor  # [B, T], -1 at special tokens / padding
    attention_mask: torch.Tensor  # [B, T]
    metric: torch.Tensor | None = None  # [L, H, d, d]: similarity z_i^T M z_j (post-W_O)
    # [B, L, H, T]: attention each key receives from the content queries (sentence id >= 0,
    # not padding), sum_q A_qk; None: computed from the maps
    received_attention: torch.Tensor | None = None
    # instead of the maps (attentions None): (threshold t, bool [L, B, H, T, T] A >= t),
    # what the statistics need of them at attention_threshold t (with received_attention)
    high_attention: tuple[float, torch.Tensor] | None = None


def analyse_batch(model, batch, where: str = "pre_wo", gram: torch.Tensor | None = None,
                  workspace: Workspace | None = None,
                  settings: CaptureSettings = CaptureSettings(),
                  attention_threshold: float | None = None) -> BatchResult:
    """Head outputs and attention maps of one batch, ready for :meth:`SimilarityStats.update`.

    ``batch`` is what :func:`head_outputs` takes (a Mapping such as a dict or a
    tokenizer's ``BatchEncoding``, or a :class:`companion.corpora.Windows`) and needs
    ``sentence_ids`` [B, T] (integer, -1 at special tokens and padding; a Windows has
    them, a tokenizer's output does not: add them to it).
    ``where="post_wo"`` attaches the metric :func:`wo_gram` (pass ``gram`` to reuse it),
    so the statistics use the post-W_O similarities. With a :class:`Workspace` the
    attention maps live in a buffer kept there and reused by the next call with the same
    workspace (which overwrites them): consume the result before the next call.

    ``attention_threshold``: keep, instead of the maps, only where they reach it (the
    result's ``attentions`` is then None and ``high_attention`` is ``(threshold, bool
    [L, B, H, T, T] A >= threshold)``): all that :class:`SimilarityStats` with that
    ``attention_threshold`` reads of them (``max(A_ij, A_ji) >= t`` is ``A_ij >= t or
    A_ji >= t``; the attention on separators comes from ``received_attention``), written
    while each window's maps are in cache, a quarter of their bytes. None: the maps.

    >>> from transformers import BertConfig, BertModel
    >>> model = BertModel(BertConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
    ...     intermediate_size=16, vocab_size=20, attn_implementation="eager")).eval()
    >>> batch = {"input_ids": torch.tensor([[1, 5, 7, 2]]),
    ...          "attention_mask": torch.ones(1, 4, dtype=torch.long),
    ...          "sentence_ids": torch.tensor([[-1, 0, 0, -1]])}
    >>> r = analyse_batch(model, batch, where="post_wo")
    >>> tuple(r.metric.shape), tuple(r.received_attention.shape)  # metric: wo_gram(model)
    ((2, 2, 4, 4), (1, 2, 2, 4))
    >>> analyse_batch(model, batch, attention_threshold=0.5).high_attention[1].dtype
    torch.bool

    References
    ----------
    Halevi et al., arXiv 2512.21956, abstract: the similarity of self-attention vector outputs
    (head outputs) of pairs of tokens.
    """
    if where not in WHERE:
        raise ValueError(f"where: expected one of {WHERE}, got {where!r}")
    if attention_threshold is not None and (
            isinstance(attention_threshold, bool)
            or not isinstance(attention_threshold, (int, float))
            or not 0 < attention_threshold <= 1):
        raise ValueError("attention_threshold: expected None or a probability in (0, 1], "
                         f"got {attention_threshold!r}")
    tensors = _batch_tensors(batch, model)
    if tensors.get("sentence_ids") is None:
        raise ValueError("batch: expected 'sentence_ids' [B, T] (-1 at special tokens and "
                         "padding), as companion.corpora.windows makes; add them to a "
                         "tokenizer's output")
    content = tensors["attention_mask"].bool() & (tensors["sentence_ids"] >= 0)
    z, maps, received, _ = _capture(model, tensors, workspace, content, settings=settings,
                                    attention_threshold=attention_threshold)
    attentions, high = tuple(maps.unbind(0)), None
    if attention_threshold is not None:
        attentions, high = None, (float(attention_threshold), maps)
    metric = None
    if where == "post_wo":
        metric = gram if gram is not None else wo_gram(model)
    return BatchResult(z, attentions, tensors["input_ids"], tensors["sentence_ids"],
                       tensors["attention_mask"], metric, received, high)

