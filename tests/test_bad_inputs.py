"""Bad input, a table: every public module and the CLI reject bad arguments clearly.

Each row of ``ROWS`` is a call with one bad argument, the exception it must raise
(ValueError or TypeError, or a subclass) and a regex the message must match; the regex
names the parameter and what was expected. The raise must come from the library itself
(the innermost traceback frame lies in ``lib/companion``), never from deep inside torch,
numpy or the standard library: a bare ``IndexError``/``RuntimeError`` from an op, or even a
``TypeError`` from ``'<' not supported``, fails its row.

Groups (the ``group`` field): dtype, shape, device, nan, negative, empty, unknown name,
type, missing path, corrupt record. ``CLI_ROWS`` feed ``python -m companion`` (in-process
through ``companion.book.cli.main``) and expect exit code 2 and a message on stderr.
Calls that write files (records.save_figure / save_table / claim) are checked to
leave nothing behind. Damaged records (a truncated corpus file, claim/figure sidecars, a
run record) name the file and how to regenerate it, or, for the run record, count as no
record with a warning.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

import companion
from companion import corpora, devices, gradient_flow as gf
from companion.sbm import graph_attention as EA
from companion.hasse import draw as D
from companion.hasse import masked_transformer as MT
from companion.hasse import masks as M
from companion.hasse import reachability as RR
from companion.book import chapter as book_chapter, claims as book_claims
from companion import sbm
from companion.hasse import task_merge as T
from companion._validate import check_choice, check_int, check_number, check_tensor
from companion.lra import listops, loaders, pathfinder

LIB = Path(companion.__file__).resolve().parent
NAN = float("nan")
CUDA = torch.cuda.is_available()


@dataclass(frozen=True)
class Row:
    id: str
    group: str
    call: Callable[[], Any]
    exc: type
    match: str


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, device="meta", dtype=dtype)


def _tokens(paths=1, n=4, d=3):
    return gf.uniform_sphere(n, d, torch.Generator().manual_seed(0), paths=paths)


def _weights(paths=1, heads=2, d=3):
    return gf.initial_weights(heads, d, torch.Generator().manual_seed(1), paths=paths)


def _with(t, index, value):
    t = t.clone()
    t[index] = value
    return t


def _memberships(n=3, m=4, k=2):
    g = torch.Generator().manual_seed(0)
    return (torch.rand(n, k, generator=g), torch.rand(k, k, generator=g),
            torch.rand(m, k, generator=g))


def _qkv(n=3, m=4, d=2):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(n, d, generator=g), torch.randn(m, d, generator=g),
            torch.randn(m, d, generator=g))


def _edges():
    return (torch.zeros(2, dtype=torch.long), torch.tensor([0, 1]), torch.tensor([1, 2]))


def _tiny_classifier(**kw):
    from companion.lra.model import LRAClassifier

    return LRAClassifier(10, 8, 2, dim=8, heads=2, head_dim=4, ffn=8, num_layers=1,
                         attention="dense", **kw)


def _model():
    return MT.init_masked_transformer(4, 1, n_heads=2, generator=torch.Generator().manual_seed(0))


_EMPTY_DIR: list[Path] = []


def _cs():
    from companion import context_similarity

    return context_similarity


def _lra_model():
    from companion.lra import model

    return model


def _lra_train():
    from companion.lra import train

    return train


def _tiny_classifier_dim(dim):
    from companion.lra.model import LRAClassifier

    return LRAClassifier(10, 8, 2, dim=dim, attention="dense")


def _mha():
    from companion.lra.model import MultiHeadAttention

    return MultiHeadAttention(8, 2, 4, attention="dense")


ROWS = [
    # ------------------------------------------------------------------ masks
    Row("masks.causal n<1", "negative", lambda: M.causal(-3), ValueError,
        r"^n: expected an int >= 1, got -3$"),
    Row("masks.causal float n", "type", lambda: M.causal(3.0), TypeError,
        r"^n: expected an int >= 1, got 3\.0 \(float\)$"),
    Row("masks.causal bool n", "type", lambda: M.causal(True), TypeError,
        r"^n: expected an int >= 1, got True \(bool\)$"),
    Row("masks.sliding_window str width", "type", lambda: M.sliding_window(4, "2"), TypeError,
        r"^width: expected an int >= 1, got '2' \(str\)$"),
    Row("masks.causal cuda without CUDA", "device", lambda: M.causal(3, device="cuda"),
        ValueError, r"^device: 'cuda' was requested but CUDA is not available"),
    Row("masks.bidirectional unknown device", "device",
        lambda: M.bidirectional(3, device="gpu0"), ValueError,
        r"^device: expected a device name"),
    Row("masks.random_mask NaN p", "nan", lambda: M.random_mask(4, NAN), ValueError,
        r"^p: expected a probability in \[0, 1\], got nan$"),
    Row("masks.random_mask str p", "type", lambda: M.random_mask(4, "0.5"), TypeError,
        r"^p: expected a probability in \[0, 1\], got '0\.5' \(str\)$"),
    Row("masks.random_mask generator", "type",
        lambda: M.random_mask(4, 0.5, generator=0), TypeError,
        r"^generator: expected a torch\.Generator or None"),
    Row("masks.xlnet float order", "dtype", lambda: M.xlnet_two_stream([0.5, 1.2, 2.0]),
        TypeError, r"^order: expected integer positions, got dtype torch\.float"),
    Row("masks.xlnet str order", "type", lambda: M.xlnet_two_stream("012"), TypeError,
        r"^order: expected a permutation"),
    Row("masks.xlnet empty order", "empty", lambda: M.xlnet_two_stream([]), ValueError,
        r"^order: expected a non-empty 1-D permutation"),
    Row("masks.validate_mask float dtype", "dtype", lambda: M.validate_mask(torch.zeros(3, 3)),
        TypeError, r"^mask: expected a square 2-D bool tensor, got dtype torch\.float32$"),
    Row("masks.validate_mask 3-D", "shape",
        lambda: M.validate_mask(torch.zeros(2, 2, 2, dtype=torch.bool)), ValueError,
        r"^mask: expected a square 2-D bool tensor, got shape \(2, 2, 2\)$"),
    Row("masks.validate_mask meta", "device",
        lambda: M.validate_mask(_meta(3, 3, dtype=torch.bool)), ValueError,
        r"^mask: .* got one on the meta device$"),
    Row("masks.validate_mask list", "type", lambda: M.validate_mask([[True]]), TypeError,
        r"^mask: expected a square 2-D bool tensor, got list$"),
    Row("masks.mask_mod empty", "empty",
        lambda: M.mask_mod(torch.zeros(0, 0, dtype=torch.bool)), ValueError,
        r"^mask: expected a non-empty mask"),
    Row("masks.materialise not callable", "type",
        lambda: M.materialise(M.causal(3), 3), TypeError,
        r"^mod: expected a mask_mod\(b, h, q_idx, kv_idx\), got a torch\.bool tensor of shape "
        r"\(3, 3\) on cpu$"),
    Row("masks.prefix_lm prefix > n", "negative", lambda: M.prefix_lm(3, 4), ValueError,
        r"^prefix: expected 0 <= prefix <= n = 3, got 4$"),
    # ------------------------------------------------------------------ reachability
    Row("reachability layers float", "type", lambda: RR.reachability(M.causal(3), 1.5),
        TypeError, r"^layers: expected an int >= 0, got 1\.5 \(float\)$"),
    Row("reachability layers < 0", "negative", lambda: RR.reachability(M.causal(3), -1),
        ValueError, r"^layers: expected an int >= 0, got -1$"),
    Row("reachability_sequence max_layers bool", "type",
        lambda: RR.reachability_sequence(M.causal(3), True), TypeError,
        r"^max_layers: expected an int >= 1, got True \(bool\)$"),
    Row("reachability_limit unknown method", "unknown name",
        lambda: RR.reachability_limit(M.causal(3), method="magic"), ValueError,
        r"^method: expected one of \('auto', 'bitset', 'matmul'\), got 'magic'$"),
    Row("hasse_diagram meta mask", "device",
        lambda: RR.hasse_diagram(_meta(3, 3, dtype=torch.bool), method="matmul"), ValueError,
        r"^mask: .*meta device"),
    Row("order_structure int mask", "dtype",
        lambda: RR.order_structure(torch.eye(3, dtype=torch.long)), TypeError,
        r"^mask: expected a square 2-D bool tensor, got dtype torch\.int64$"),
    Row("order_structure compute_depth str", "type",
        lambda: RR.order_structure(M.causal(3), compute_depth="no"), TypeError,
        r"^compute_depth: expected a bool, got 'no' \(str\)$"),
    Row("tokens_reached inputs length", "shape",
        lambda: RR.tokens_reached(M.causal(3), [(0,), (1,)]), ValueError,
        r"^inputs: expected 3 entries, got 2$"),
    Row("tokens_reached inputs None", "type", lambda: RR.tokens_reached(M.causal(3), None),
        TypeError, r"^inputs: expected a sequence of 3 token collections, got None$"),
    Row("hasse_layout not a graph", "type", lambda: D.hasse_layout(M.causal(3)), TypeError,
        r"^graph: expected a networkx\.DiGraph, got a torch\.bool tensor"),
    # ------------------------------------------------------------------ task_merge
    Row("task_merge.autoregressive_family n=0", "negative",
        lambda: T.autoregressive_family(0), ValueError, r"^n: expected an int >= 1, got 0$"),
    Row("task_merge.block_generation_family float block", "type",
        lambda: T.block_generation_family(4, 2.0), TypeError,
        r"^block: expected an int >= 1, got 2\.0 \(float\)$"),
    Row("task_merge.masked_language_model NaN rate", "nan",
        lambda: T.masked_language_model(4, NAN), ValueError,
        r"^rate: expected a fraction in \(0, 1\], got nan$"),
    Row("task_merge.masked_language_model str rate", "type",
        lambda: T.masked_language_model(4, "0.15"), TypeError,
        r"^rate: expected a fraction in \(0, 1\], got '0\.15' \(str\)$"),
    Row("task_merge.minimal_merge empty", "empty", lambda: T.minimal_merge([]), ValueError,
        r"^tasks: expected at least one Task$"),
    Row("task_merge.minimal_merge a single Task", "type",
        lambda: T.minimal_merge(T.leaky_bidirectional(2)), TypeError,
        r"^tasks: expected a sequence of Task, got Task$"),
    Row("task_merge.minimal_merge sparse str", "type",
        lambda: T.minimal_merge(T.autoregressive_family(2), sparse="yes"), TypeError,
        r"^sparse: expected a bool, got 'yes' \(str\)$"),
    Row("task_merge.Task float mask", "dtype",
        lambda: T.Task(((0,),), (None,), torch.ones(1, 1)), TypeError,
        r"^mask: expected a square 2-D bool tensor, got dtype"),
    Row("task_merge.Task.permute str order", "type",
        lambda: T.leaky_bidirectional(2).permute(["0", "1"]), TypeError,
        r"^order\[0\]: expected an int >= 0, got '0' \(str\)$"),
    Row("task_merge.tokens_visible layers float", "type",
        lambda: T.tokens_visible(T.leaky_bidirectional(2), 1.0), TypeError,
        r"^layers: expected an int >= 0, got 1\.0 \(float\)$"),
    Row("task_merge.hasse_diagram not a Task", "type", lambda: T.hasse_diagram(M.causal(2)),
        TypeError, r"^task: expected a Task, got Tensor$"),
    # ------------------------------------------------------------------ gradient_flow
    Row("gradient_flow.uniform_sphere d=1", "negative", lambda: gf.uniform_sphere(4, 1),
        ValueError, r"^d: expected an int >= 2, got 1$"),
    Row("gradient_flow.uniform_sphere int dtype", "dtype",
        lambda: gf.uniform_sphere(4, 3, dtype=torch.int64), TypeError,
        r"^dtype: expected a floating torch\.dtype or None"),
    Row("gradient_flow.uniform_sphere cuda", "device",
        lambda: gf.uniform_sphere(4, 3, device="cuda"), ValueError,
        r"^device: 'cuda' was requested but CUDA is not available"),
    Row("gradient_flow.octahedral_tokens NaN noise", "nan",
        lambda: gf.octahedral_tokens(6, NAN), ValueError,
        r"^noise: expected a finite number >= 0\.0, got nan$"),
    Row("gradient_flow.initial_weights paths str", "type",
        lambda: gf.initial_weights(2, 3, paths="1"), TypeError,
        r"^paths: expected an int >= 1, got '1' \(str\)$"),
    Row("gradient_flow.velocity NaN tokens", "nan",
        lambda: gf.velocity(_with(_tokens(), (0, 0, 0), NAN), _weights()), ValueError,
        r"^tokens: expected finite values, got NaN or infinity$"),
    Row("gradient_flow.velocity inf weights", "nan",
        lambda: gf.velocity(_tokens(), _with(_weights(), (0, 0, 0, 0), float("inf"))),
        ValueError, r"^weights: expected finite values, got NaN or infinity$"),
    Row("gradient_flow.velocity int tokens", "dtype",
        lambda: gf.velocity(torch.ones(1, 4, 3, dtype=torch.long), _weights()), TypeError,
        r"^tokens: expected a floating-point tensor, got dtype torch\.int64$"),
    Row("gradient_flow.velocity 2-D tokens", "shape", lambda: gf.velocity(_tokens()[0], _weights()),
        ValueError, r"^tokens: expected a 3-D tensor \[paths, n, d\], got shape \(4, 3\)$"),
    Row("gradient_flow.velocity meta tokens", "device",
        lambda: gf.velocity(_meta(1, 4, 3), _weights()), ValueError,
        r"^tokens: expected a tensor with values, got one on the meta device$"),
    Row("gradient_flow.velocity bool sign", "type",
        lambda: gf.velocity(_tokens(), _weights(), sign=True), TypeError,
        r"^sign: expected an int in \[-1, 1\], got True \(bool\)$"),
    Row("gradient_flow.step_quantities negative sigma", "negative",
        lambda: gf.step_quantities(_tokens(), _weights(), sigma=-1.0), ValueError,
        r"^sigma: expected a finite number >= 0\.0, got -1\.0$"),
    Row("gradient_flow.step_quantities drift shape", "shape",
        lambda: gf.step_quantities(_tokens(), _weights(), drift=torch.zeros(2, 2, 2,
                                                                             dtype=torch.float64)),
        ValueError, r"^drift: expected shape \(1, 2, 3, 3\) or \(2, 3, 3\) like weights"),
    Row("gradient_flow.simulate NaN dt", "nan",
        lambda: gf.simulate(_tokens(), _weights(), gf.Frozen(), T=1.0, dt=NAN), ValueError,
        r"^dt: expected a positive finite number, got nan$"),
    Row("gradient_flow.simulate unknown process", "unknown name",
        lambda: gf.simulate(_tokens(), _weights(), "ou", T=1.0, dt=0.1), TypeError,
        r"^process: expected OrnsteinUhlenbeck, Oscillating or Frozen, got str$"),
    Row("gradient_flow.Oscillating unknown phases", "unknown name",
        lambda: gf.Oscillating("random"), ValueError,
        r"^phases: expected 'identical' or 'spread', got 'random'$"),
    Row("gradient_flow.oscillating_target d=4", "negative",
        lambda: gf.oscillating_target(torch.zeros(2), 4), ValueError,
        r"^d: expected an int in \[2, 3\], got 4$"),
    Row("gradient_flow.oscillating_target float t", "type",
        lambda: gf.oscillating_target(0.5, 3), TypeError,
        r"^t: expected a tensor, got 0\.5 \(float\)$"),
    Row("gradient_flow.fit_power_law str level", "type",
        lambda: gf.fit_power_law([1, 2], [1.0, 2.0], level="high"), TypeError,
        r"^level: expected a finite number in \(0\.0, 1\.0\), got 'high' \(str\)$"),
    Row("gradient_flow.fit_power_law str H", "type",
        lambda: gf.fit_power_law(["a", "b"], [1.0, 2.0]), TypeError,
        r"^H: expected numbers, got list$"),
    Row("gradient_flow.fit_power_law NaN values", "nan",
        lambda: gf.fit_power_law([1, 2], [1.0, NAN]), ValueError,
        r"^values: expected finite positive numbers$"),
    Row("gradient_flow.w2_sphere unknown cost", "unknown name",
        lambda: gf.w2_sphere(_tokens(), _tokens(), cost="manhattan"), ValueError,
        r"^cost: expected one of \('geodesic', 'chordal'\), got 'manhattan'$"),
    Row("gradient_flow.lipschitz_constant int weights", "dtype",
        lambda: gf.lipschitz_constant(torch.ones(2, 3, 3, dtype=torch.long)), TypeError,
        r"^weights: expected a floating-point tensor, got dtype torch\.int64$"),
    Row("gradient_flow.weight_sensitivity not square", "shape",
        lambda: gf.weight_sensitivity(torch.ones(2, 3, 2)), ValueError,
        r"^weights: expected square matrices \[\.\.\., H, d, d\]"),
    Row("gradient_flow.gronwall_bound record counts", "shape",
        lambda: gf.gronwall_bound(torch.linspace(0, 1, 5), torch.ones(4), 1.0), ValueError,
        r"^lipschitz: expected \[R, \.\.\.\] with R = 5 records like times, got shape \(4,\)$"),
    Row("gradient_flow.pairwise_inner_stats one token", "empty",
        lambda: gf.pairwise_inner_stats(torch.ones(1, 3)), ValueError,
        r"^tokens: expected n >= 2 tokens for pairs"),
    # ------------------------------------------------------------------ devices
    Row("devices.resolve_device unknown", "unknown name",
        lambda: devices.resolve_device("tpu"), ValueError,
        r"^device: expected one of \('auto', 'cpu', 'cuda'\) or 'cuda:N', got 'tpu'$"),
    Row("devices.resolve_device float", "type", lambda: devices.resolve_device(1.5), TypeError,
        r"^device: expected one of \('auto', 'cpu', 'cuda'\), 'cuda:N', a torch\.device or "
        r"None, got 1\.5 \(float\)$"),
    Row("devices.resolve_device cuda", "device", lambda: devices.resolve_device("cuda"),
        ValueError, r"^device: 'cuda' was requested but CUDA is not available here$"),
    # ------------------------------------------------------------------ corpora
    Row("corpora.load_corpus missing path", "missing path",
        lambda: corpora.load_corpus("/nonexistent/corpus/dir"), corpora.CorpusNotFoundError,
        r"^name_or_path: '/nonexistent/corpus/dir' is neither an installed corpus name"),
    Row("corpora.load_corpus int", "type", lambda: corpora.load_corpus(3), TypeError,
        r"^name_or_path: expected a corpus name or a path, got int$"),
    Row("corpora.install str names", "type", lambda: corpora.install("wiki"), TypeError,
        r"^names: expected an iterable of corpus names like \['wiki'\]"),
    Row("corpora.install unknown corpus", "unknown name",
        lambda: corpora.install(["wikipedia"]), ValueError,
        r"^names: unknown corpora \['wikipedia'\]; expected some of \['wiki', 'brown', 'bbc'\]$"),
    Row("corpora.split_sentences bytes", "type", lambda: corpora.split_sentences(b"Hi."),
        TypeError, r"^text: expected str, got bytes$"),
    Row("corpora.data_dir int", "type", lambda: corpora.data_dir(3), TypeError,
        r"^dest: expected a path or None, got 3 \(int\)$"),
    Row("corpora.windows float length", "type",
        lambda: corpora.windows(corpora.Corpus("c", [corpora.Document("d", ["A b."])]), None,
                                64.0), TypeError,
        r"^length: expected an int >= 3, got 64\.0 \(float\)$"),
    Row("corpora.windows empty corpus", "empty",
        lambda: corpora.windows(corpora.Corpus("c", []), None), ValueError,
        r"^corpus: 'c' is empty"),
    Row("corpora.Windows.concat empty", "empty", lambda: corpora.Windows.concat([]),
        ValueError, r"^parts: expected at least one Windows$"),
    # ------------------------------------------------------------------ sbm
    Row("sbm.fastrg_sample NaN membership", "nan",
        lambda: sbm.fastrg_sample(_with(_memberships()[0], (0, 0), NAN), *_memberships()[1:]),
        ValueError, r"^q_membership: "),
    Row("sbm.fastrg_sample negative s", "negative",
        lambda: sbm.fastrg_sample(_memberships()[0], -_memberships()[1], _memberships()[2]),
        ValueError, r"^s: "),
    Row("sbm.fastrg_sample int membership", "dtype",
        lambda: sbm.fastrg_sample(torch.ones(3, 2, dtype=torch.long), *_memberships()[1:]),
        TypeError, r"^q_membership: expected a floating-point tensor"),
    Row("sbm.fastrg_sample unknown duplicates", "unknown name",
        lambda: sbm.fastrg_sample(*_memberships(), duplicates="drop"), ValueError,
        r"^duplicates: expected one of \('(keep|merge)', '(keep|merge)'\), got 'drop'$"),
    Row("sbm.fastrg_sample int16 indices", "dtype",
        lambda: sbm.fastrg_sample(*_memberships(), index_dtype=torch.int16), TypeError,
        r"^index_dtype: expected torch\.int32 or torch\.int64, got torch\.int16$"),
    Row("sbm.fastrg_sample empty queries", "empty",
        lambda: sbm.fastrg_sample(torch.ones(0, 2), *_memberships()[1:]), ValueError,
        r"empty sequence"),
    Row("sbm.SBMAttention num_clusters 0", "negative",
        lambda: sbm.SBMAttention(4, 2, 0), ValueError,
        r"^num_clusters: expected an int >= 1, got 0$"),
    Row("sbm.SBMAttention key size", "shape",
        lambda: sbm.SBMAttention(4, 2, 2)(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 5),
                                          torch.ones(1, 2, 3, 4)), ValueError,
        r"^q, k: batch dims and head size must agree"),
    Row("sbm.SBMAttention value length", "shape",
        lambda: sbm.SBMAttention(4, 2, 2)(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4),
                                          torch.ones(1, 2, 2, 4)), ValueError,
        r"^v: expected \[1, 2, 3, d_v\], got \(1, 2, 2, 4\)$"),
    Row("sbm.density_regularizer NaN lam", "nan",
        lambda: sbm.density_regularizer(torch.ones(2), lam=NAN), ValueError,
        r"^lam: expected a nonnegative float, got nan$"),
    Row("sbm.density_regularizer negative lam", "negative",
        lambda: sbm.density_regularizer(torch.ones(2), lam=-1.0), ValueError,
        r"^lam: expected a nonnegative float, got -1\.0$"),
    Row("sbm.density_regularizer empty", "empty", lambda: sbm.density_regularizer([]),
        TypeError, r"^densities: expected a tensor or a non-empty iterable of tensors$"),
    Row("sbm.SBMAttention float num_clusters", "type", lambda: sbm.SBMAttention(4, 2, 2.5),
        TypeError, r"^num_clusters: expected an int >= 1, got 2\.5 \(float\)$"),
    Row("sbm.fastrg_sample int generator", "type",
        lambda: sbm.fastrg_sample(*_memberships(), generator=5), TypeError,
        r"^generator: expected a torch\.Generator or None, got 5 \(int\)$"),
    Row("sbm.fastrg_sample str self_loops", "type",
        lambda: sbm.fastrg_sample(*_memberships(), self_loops="yes"), TypeError,
        r"^self_loops: expected a bool, got 'yes' \(str\)$"),
    Row("sbm.fastrg_sample meta memberships", "device",
        lambda: sbm.fastrg_sample(_meta(3, 2), _meta(2, 2), _meta(4, 2)), ValueError,
        r"^q_membership: expected a tensor with values, got one on the meta device$"),
    Row("sbm.sbm_parameters mlp None", "type",
        lambda: sbm.sbm_parameters(torch.randn(3, 4), torch.randn(4, 4), torch.randn(2, 4),
                                   mlp=None), TypeError,
        r"^mlp: expected a callable \[\.\.\., d\] -> \[\.\.\., d\], got None$"),
    # ------------------------------------------------------------------ edge_attention
    Row("edge_attention int q", "dtype",
        lambda: EA.edge_attention(torch.ones(3, 2, dtype=torch.long), *_qkv()[1:], _edges()),
        TypeError, r"^q: expected a floating-point tensor, got dtype torch\.int64$"),
    Row("edge_attention key out of range", "shape",
        lambda: EA.edge_attention(*_qkv(), (torch.zeros(1, dtype=torch.long),
                                            torch.zeros(1, dtype=torch.long),
                                            torch.tensor([9]))), ValueError,
        r"^edges\[key\]: expected indices in \[0, 4\), got range \[9, 9\]$"),
    Row("edge_attention int16 edges", "dtype",
        lambda: EA.edge_attention(*_qkv(), tuple(e.short() for e in _edges())), TypeError,
        r"^edges\[group\]: expected a 1-D torch\.int64 tensor \(int64, or int32 for all "
        r"three\), got torch\.int16 of shape \(\d+,\)$"),
    Row("edge_attention int32 and int64 edges mixed", "dtype",
        lambda: EA.edge_attention(*_qkv(), (_edges()[0].int(), *_edges()[1:])), TypeError,
        r"^edges\[query\]: expected a 1-D torch\.int32 tensor \(int64, or int32 for all "
        r"three\), got torch\.int64 of shape \(\d+,\)$"),
    Row("edge_attention empty keys", "empty",
        lambda: EA.edge_attention(_qkv()[0], torch.ones(0, 2), torch.ones(0, 2), _edges()),
        ValueError, r"^q, k: empty sequence, got n=3, m=0$"),
    Row("dense_masked_attention mask shape", "shape",
        lambda: sbm.dense_masked_attention(*_qkv(), torch.ones(3, 3, dtype=torch.bool)),
        ValueError, r"^mask: expected shape \[\.\.\., 3, 4\], got \(3, 3\)$"),
    Row("edge_attention str scale", "type",
        lambda: EA.edge_attention(*_qkv(), _edges(), scale="x"), TypeError,
        r"^scale: expected a positive finite number or None, got 'x' \(str\)$"),
    Row("edge_attention NaN scale", "nan",
        lambda: EA.edge_attention(*_qkv(), _edges(), scale=NAN), ValueError,
        r"^scale: expected a positive finite number, got nan$"),
    Row("edge_attention negative edge_weight", "negative",
        lambda: EA.edge_attention(*_qkv(), _edges(), edge_weight=torch.tensor([-1.0, 1.0])),
        ValueError, r"^edge_weight: expected nonnegative finite weights, got values in "
                    r"\[-1\.0, 1\.0\]$"),
    Row("edge_attention NaN edge_weight", "nan",
        lambda: EA.edge_attention(*_qkv(), _edges(), edge_weight=torch.tensor([NAN, 1.0])),
        ValueError, r"^edge_weight: expected nonnegative finite weights"),
    Row("edge_attention meta q, k, v", "device",
        lambda: EA.edge_attention(_meta(3, 2), _meta(4, 2), _meta(4, 2), _edges()), ValueError,
        r"^q: expected a tensor with values, got one on the meta device$"),
    Row("dense_masked_attention 1-D q", "shape",
        lambda: sbm.dense_masked_attention(torch.ones(2), *_qkv()[1:],
                                          torch.ones(3, 4, dtype=torch.bool)), ValueError,
        r"^q: expected \[\.\.\., length, dim\], got shape \(2,\)$"),
    # ------------------------------------------------------------------ masked_transformer
    Row("masked_transformer.init d_model 0", "negative",
        lambda: MT.init_masked_transformer(0), ValueError,
        r"^d_model: expected an int >= 1, got 0$"),
    Row("masked_transformer.init n_heads not a divisor", "shape",
        lambda: MT.init_masked_transformer(6, 1, n_heads=4), ValueError,
        r"^n_heads: expected a divisor of d_model = 6, got 4$"),
    Row("masked_transformer x width", "shape",
        lambda: MT.masked_transformer(_model(), torch.ones(3, 5, dtype=torch.float64),
                                      M.causal(3)), ValueError,
        r"^x: expected a \(positions, 4\) tensor, got \(3, 5\)$"),
    Row("masked_transformer float mask", "dtype",
        lambda: MT.masked_transformer(_model(), torch.ones(3, 4, dtype=torch.float64),
                                      torch.ones(3, 3)), TypeError,
        r"^mask: expected a square 2-D bool tensor, got dtype"),
    Row("masked_transformer.incremental_forward not a partition", "shape",
        lambda: MT.incremental_forward(_model(), torch.ones(3, 4, dtype=torch.float64),
                                       M.causal(3), [[0], [1]]), ValueError,
        r"^groups: expected a partition of the positions 0\.\.P-1$"),
    Row("masked_transformer.init float d_model", "type",
        lambda: MT.init_masked_transformer(4.0), TypeError,
        r"^d_model: expected an int >= 1, got 4\.0 \(float\)$"),
    Row("masked_transformer n_layers < 0", "negative",
        lambda: MT.masked_transformer(_model(), torch.ones(3, 4, dtype=torch.float64),
                                      M.causal(3), n_layers=-1), ValueError,
        r"^n_layers: expected an int in \[0, 1\], got -1$"),
    Row("masked_transformer n_layers > L", "negative",
        lambda: MT.masked_transformer(_model(), torch.ones(3, 4, dtype=torch.float64),
                                      M.causal(3), n_layers=2), ValueError,
        r"^n_layers: expected an int in \[0, 1\], got 2$"),
    Row("masked_transformer float n_layers", "type",
        lambda: MT.masked_transformer(_model(), torch.ones(3, 4, dtype=torch.float64),
                                      M.causal(3), n_layers=1.5), TypeError,
        r"^n_layers: expected an int in \[0, 1\] or None, got 1\.5 \(float\)$"),
    Row("masked_transformer float32 x, float64 model", "dtype",
        lambda: MT.masked_transformer(_model(), torch.ones(3, 4), M.causal(3)), TypeError,
        r"^x: expected dtype torch\.float64 like the model, got torch\.float32$"),
    Row("masked_transformer NaN x", "nan",
        lambda: MT.masked_transformer(_model(), torch.full((3, 4), NAN, dtype=torch.float64),
                                      M.causal(3)), ValueError,
        r"^x: expected finite values, got NaN or infinity$"),
    Row("masked_transformer.dependency_pattern meta x", "device",
        lambda: MT.dependency_pattern(_model(), _meta(3, 4, dtype=torch.float64), M.causal(3)),
        ValueError, r"^x: expected a tensor with values, got one on the meta device$"),
    Row("masked_transformer.block_two_stream_schedule block 0", "negative",
        lambda: MT.block_two_stream_schedule(4, 0), ValueError,
        r"^block: expected an int >= 1, got 0$"),
    Row("masked_transformer.embed_task_inputs too few token rows", "shape",
        lambda: MT.embed_task_inputs(_model(), T.leaky_bidirectional(3),
                                     torch.ones(2, 4, dtype=torch.float64)), ValueError,
        r"^token_embeddings: expected at least 3 rows \(one per token of the task\), got 2$"),
    Row("masked_transformer.embed_task_inputs float32 embeddings", "dtype",
        lambda: MT.embed_task_inputs(_model(), T.leaky_bidirectional(3), torch.ones(2, 4)),
        TypeError,
        r"^token_embeddings: expected dtype torch\.float64 like the model, got torch\.float32$"),
    Row("masked_transformer.incremental_forward str groups", "type",
        lambda: MT.incremental_forward(_model(), torch.ones(3, 4, dtype=torch.float64),
                                       M.causal(3), "012"), TypeError,
        r"^groups: expected a sequence of position lists, got '012' \(str\)$"),
    Row("masked_transformer.flex_vs_sdpa n_heads 0", "negative",
        lambda: MT.flex_vs_sdpa(M.causal_mask_mod, M.causal(4), n_heads=0), ValueError,
        r"^n_heads: expected an int >= 1, got 0$"),
    # ------------------------------------------------------------------ book
    Row("chapter.begin_chapter float seed", "type",
        lambda: book_chapter.begin_chapter("x", scale="smoke", seed=1.5, device="cpu"), TypeError,
        r"^seed: expected an int, got 1\.5 \(float\)$"),
    Row("chapter.begin_chapter unknown scale", "unknown name",
        lambda: book_chapter.begin_chapter("x", scale="huge", seed=0, device="cpu"), ValueError,
        r"^scale: expected one of \('smoke', 'ci', 'paper'\), got 'huge'$"),
    Row("claims.judge_claim str tolerance", "type",
        lambda: book_claims.judge_claim(1.0, 1.0, "abc", "abs"), TypeError,
        r"^tolerance: expected a number >= 0, got 'abc' \(str\)$"),
    # ------------------------------------------------------------------ context_similarity
    Row("context_similarity.similarity_matrices 4-D", "shape",
        lambda: _cs().similarity_matrices(torch.ones(1, 1, 2, 2)), ValueError,
        r"^outputs: expected a 5-D tensor \[B, L, H, T, d\], got \(1, 1, 2, 2\)$"),
    Row("context_similarity.similarity_matrices int", "dtype",
        lambda: _cs().similarity_matrices(torch.ones(1, 1, 1, 2, 2, dtype=torch.long)),
        TypeError, r"^outputs: expected a floating tensor, got torch\.int64$"),
    Row("context_similarity.similarity_matrices metric shape", "shape",
        lambda: _cs().similarity_matrices(torch.ones(1, 1, 1, 2, 2), metric=torch.ones(2, 2)),
        ValueError, r"^metric: expected shape \(1, 1, 2, 2\) \[L, H, d, d\], got \(2, 2\)$"),
    Row("context_similarity.load_encoder folder without config", "missing path",
        lambda: _cs().load_encoder(_EMPTY_DIR[0], device="cpu"), ValueError,
        r"^name_or_path: '.*' exists but has no config\.json; expected a Hugging Face model "
        r"directory"),
    Row("context_similarity.load_encoder int", "type", lambda: _cs().load_encoder(3),
        TypeError, r"^name_or_path: expected None, a model name or a path, got int$"),
    Row("context_similarity.analyse_batch unknown where", "unknown name",
        lambda: _cs().analyse_batch(None, {}, where="mid"), ValueError,
        r"^where: expected one of \('pre_wo', 'post_wo'\), got 'mid'$"),
    Row("context_similarity.load_encoder missing folder", "missing path",
        lambda: _cs().load_encoder("/nonexistent/model/dir", device="cpu"),
        _cs().ModelNotFoundError, r"^name_or_path: no local model '/nonexistent/model/dir'"),
    Row("context_similarity.load_encoder cuda", "device",
        lambda: _cs().load_encoder(None, device="cuda"), ValueError,
        r"^device: 'cuda' was requested but CUDA is not available here$"),
    Row("context_similarity.top_pairs k=0", "negative",
        lambda: _cs().top_pairs(torch.randn(1, 1, 1, 4, 2), torch.ones(1, 4, dtype=torch.bool),
                                0), ValueError, r"^k: expected an int >= 1, got 0$"),
    Row("context_similarity.top_pairs float valid", "dtype",
        lambda: _cs().top_pairs(torch.randn(1, 1, 1, 4, 2), torch.ones(1, 4), 1), ValueError,
        r"^valid: expected a bool tensor of shape \(1, 4\)"),
    Row("context_similarity.top_pairs segment=0", "negative",
        lambda: _cs().top_pairs(torch.randn(1, 1, 1, 4, 2), torch.ones(1, 4, dtype=torch.bool),
                                1, segment=0), ValueError,
        r"^segment: expected an int >= 1, got 0$"),
    Row("context_similarity.head_outputs not a model", "type",
        lambda: _cs().head_outputs(None, {"input_ids": torch.ones(1, 4, dtype=torch.long)}),
        TypeError, r"^model: expected a BERT-family encoder"),
    Row("context_similarity.analyse_corpus not windows", "type",
        lambda: _cs().analyse_corpus(None, None), TypeError,
        r"^windows: expected companion\.corpora\.Windows, got NoneType$"),
    Row("context_similarity.top_pairs float k", "type",
        lambda: _cs().top_pairs(torch.randn(1, 1, 1, 4, 2), torch.ones(1, 4, dtype=torch.bool),
                                1.5), TypeError, r"^k: expected an int >= 1, got 1\.5 \(float\)$"),
    Row("context_similarity.top_pairs NaN outputs", "nan",
        lambda: _cs().top_pairs(torch.full((1, 1, 1, 4, 2), NAN),
                                torch.ones(1, 4, dtype=torch.bool), 1), ValueError,
        r"^outputs: expected finite values, got similarities of valid tokens that are NaN "
        r"or inf$"),
    Row("context_similarity.similarity_matrices str zero_diagonal", "type",
        lambda: _cs().similarity_matrices(torch.ones(1, 1, 1, 2, 2), zero_diagonal="no"),
        TypeError, r"^zero_diagonal: expected a bool, got 'no' \(str\)$"),
    Row("context_similarity.separator_ids None", "type", lambda: _cs().separator_ids(None),
        TypeError, r"^tokenizer: expected a Hugging Face tokenizer \(with "
                   r"convert_tokens_to_ids\), got NoneType$"),
    # ------------------------------------------------------------------ lra
    Row("lra.listops.generate float n", "type", lambda: listops.generate(2.0, seed=0),
        TypeError, r"^n: expected an int, got 2\.0 \(float\)$"),
    Row("lra.listops.generate max_tries str", "type",
        lambda: listops.generate(1, seed=0, max_tries="9"), TypeError,
        r"^max_tries: expected an int >= 1, got '9' \(str\)$"),
    Row("lra.listops.evaluate empty", "empty", lambda: listops.evaluate(""), ValueError,
        r"^source: expected a ListOps expression, got an empty string$"),
    Row("lra.listops.encode non-str source", "type",
        lambda: listops.encode(["[MAX 1 ]", 3], max_length=4), TypeError,
        r"^sources\[1\]: expected a str, got 3 \(int\)$"),
    Row("lra.listops.encode max_length float", "type",
        lambda: listops.encode(["[MAX 1 ]"], max_length=4.0), TypeError,
        r"^max_length: expected an int >= 1, got 4\.0 \(float\)$"),
    Row("lra.pathfinder.generate str max_turn", "type",
        lambda: pathfinder.generate(1, seed=0, max_turn="wide"), TypeError,
        r"^max_turn: expected an angle in \(0, pi\], got 'wide' \(str\)$"),
    Row("lra.pathfinder.generate float num_distractors", "type",
        lambda: pathfinder.generate(1, seed=0, num_distractors=2.5), TypeError,
        r"^num_distractors: expected an int >= 0, got 2\.5 \(float\)$"),
    Row("lra.pathfinder.generate NaN padding", "nan",
        lambda: pathfinder.generate(1, seed=0, padding=NAN), ValueError,
        r"^padding: expected a finite number >= 0\.0, got nan$"),
    Row("lra.pathfinder.to_sequences NaN image", "nan",
        lambda: pathfinder.to_sequences(torch.full((1, 2, 2), NAN)), ValueError,
        r"^images: expected finite values, got NaN or infinity$"),
    Row("lra.pathfinder.to_sequences empty", "empty",
        lambda: pathfinder.to_sequences(torch.zeros(0, 2, 2)), ValueError,
        r"^images: expected a non-empty tensor, got shape \(0, 2, 2\)$"),
    Row("lra.pathfinder.best_threshold_accuracy list", "type",
        lambda: pathfinder.best_threshold_accuracy([1.0, 2.0], torch.tensor([0, 1])), TypeError,
        r"^feature: expected a tensor, got list$"),
    Row("lra.pathfinder.shortcut_accuracies not a set", "type",
        lambda: pathfinder.shortcut_accuracies({"images": None}), TypeError,
        r"^data: expected a PathfinderSet, got dict$"),
    Row("lra.loaders.load_cifar10_grey missing folder", "missing path",
        lambda: loaders.load_cifar10_grey("/nonexistent"), loaders.DataNotFoundError,
        r"^CIFAR-10: expected /nonexistent/cifar-10-batches-py/data_batch_1 \(not found\)"),
    Row("lra.loaders.load_aan_pairs unknown split", "unknown name",
        lambda: loaders.load_aan_pairs("/nonexistent", split="dev"), ValueError,
        r"^split: expected one of \('train', 'eval', 'test'\), got 'dev'$"),
    Row("lra.loaders.bytes_to_ids non-str", "type",
        lambda: loaders.bytes_to_ids(["ok", b"raw"], max_length=4), TypeError,
        r"^texts\[1\]: expected a str, got bytes$"),
    Row("lra.loaders.digits_standin float size", "type",
        lambda: loaders.digits_standin(size=16.0), TypeError,
        r"^size: expected an int >= 8, got 16\.0 \(float\)$"),
    Row("lra.model.LRAClassifier float dim", "type", lambda: _tiny_classifier_dim(8.0),
        TypeError, r"^dim: expected an int >= 1, got 8\.0 \(float\)$"),
    Row("lra.model.LRAClassifier unknown attention", "unknown name",
        lambda: _tiny_classifier(num_clusters=2).__class__(10, 8, 2, attention="linear"),
        ValueError, r"^attention: expected one of \('sbm', 'dense'\), got 'linear'$"),
    Row("lra.model.LRAClassifier dropout 1", "negative",
        lambda: _tiny_classifier(dropout=1.0), ValueError,
        r"^dropout: expected a probability in \[0, 1\), got 1\.0$"),
    Row("lra.model token id out of vocabulary", "shape",
        lambda: _tiny_classifier()(torch.tensor([[1, 2, 10]])), ValueError,
        r"^tokens: expected ids in \[0, 10\) \(vocab_size\), got range \[1, 10\]$"),
    Row("lra.model float tokens", "dtype",
        lambda: _tiny_classifier()(torch.ones(1, 3)), TypeError,
        r"^tokens: expected dtype torch\.int64, got dtype torch\.float32$"),
    Row("lra.model.MultiHeadAttention x width", "shape",
        lambda: _mha()(torch.ones(1, 3, 5)), ValueError,
        r"^x: expected \[B, n, 8\], got shape \(1, 3, 5\)$"),
    Row("lra.model.attention_flops str", "type",
        lambda: _lra_model().attention_flops("many", 32), TypeError,
        r"^num_edges: expected a finite number >= 0\.0, got 'many' \(str\)$"),
    Row("lra.train.TrainConfig str lr", "type", lambda: _lra_train().TrainConfig(lr="fast"),
        TypeError, r"^lr: expected a positive float, got 'fast' \(str\)$"),
    Row("lra.train.TrainConfig float steps", "type",
        lambda: _lra_train().TrainConfig(steps=10.0), TypeError,
        r"^steps: expected an int >= 1, got 10\.0 \(float\)$"),
    Row("lra.train.evaluate bad data", "type",
        lambda: _lra_train().evaluate(_tiny_classifier(), ([1, 2], [0, 1])), TypeError,
        r"^data: expected tensors with a batch axis, got list for tokens$"),
    # ------------------------------------------------------------------ _validate itself
    Row("_validate.check_int numpy float", "type",
        lambda: check_int("n", np.float64(2.0), minimum=1), TypeError,
        r"^n: expected an int >= 1, got (np\.float64\()?2\.0\)? \(float64\)$"),
    Row("_validate.check_number bool", "type", lambda: check_number("x", True), TypeError,
        r"^x: expected a finite number, got True \(bool\)$"),
    Row("_validate.check_choice bool among ints", "unknown name",
        lambda: check_choice("sign", True, (-1, 1)), ValueError,
        r"^sign: expected one of \(-1, 1\), got True$"),
    Row("_validate.check_tensor inf", "nan",
        lambda: check_tensor("x", torch.tensor([1.0, float("-inf")]), finite=True), ValueError,
        r"^x: expected finite values, got NaN or infinity$"),
]


@pytest.fixture(scope="module", autouse=True)
def _empty_model_dir(tmp_path_factory):
    _EMPTY_DIR[:] = [tmp_path_factory.mktemp("not-a-model")]
    yield


def _raised_in_library(excinfo) -> bool:
    """Whether the innermost frame of the traceback is library code, not torch/numpy."""
    return Path(str(excinfo.traceback[-1].path)).resolve().is_relative_to(LIB)


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input_is_rejected_clearly(row):
    if row.group == "device" and "cuda" in row.id and CUDA:
        pytest.skip("this machine has CUDA, so asking for it is not a bad input here")
    with pytest.raises((ValueError, TypeError)) as excinfo:
        row.call()
    assert isinstance(excinfo.value, row.exc), (
        f"expected {row.exc.__name__}, got {type(excinfo.value).__name__}: {excinfo.value}")
    assert re.search(row.match, str(excinfo.value)), (
        f"message {str(excinfo.value)!r} does not match {row.match!r}")
    assert _raised_in_library(excinfo), (
        f"raised from {excinfo.traceback[-1].path}, not by companion's own validation")


def test_table_covers_every_group_and_module():
    groups = {r.group for r in ROWS}
    assert groups >= {"dtype", "shape", "device", "nan", "negative", "empty", "unknown name",
                      "type", "missing path"}
    modules = {r.id.split(" ")[0].split(".")[0] for r in ROWS}
    assert modules >= {"masks", "reachability", "task_merge", "masked_transformer",
                       "gradient_flow", "sbm", "edge_attention", "context_similarity",
                       "corpora", "devices", "lra"}
    assert len(ROWS) >= 60 and len({r.id for r in ROWS}) == len(ROWS)


# ------------------------------------------------------------------ corrupt cached records
def test_damaged_installed_corpus_names_file_line_and_fix(tmp_path):
    """A truncated documents.jsonl (a killed copy, a full disk) is not read as a shorter
    corpus: the error names the file, the line and the command that reinstalls it."""
    root = tmp_path / "data"
    (root / "wiki").mkdir(parents=True)
    (root / "wiki" / "manifest.json").write_text("{}")
    good = json.dumps({"name": "a", "sentences": ["One sentence."]})
    (root / "wiki" / "documents.jsonl").write_text(good + "\n" + good[:17] + "\n")
    with pytest.raises(ValueError) as excinfo:
        corpora.load_corpus("wiki", dest=root)
    message = str(excinfo.value)
    assert re.search(r"^name_or_path: .*documents\.jsonl line 2 is not a document record",
                     message)
    assert "python -m companion.corpora install --only wiki --force" in message


def test_missing_installed_corpus_is_a_value_error_naming_the_install(tmp_path):
    with pytest.raises(corpora.CorpusNotFoundError) as excinfo:
        corpora.load_corpus("brown", dest=tmp_path)
    assert isinstance(excinfo.value, ValueError) and isinstance(excinfo.value, FileNotFoundError)
    assert "python -m companion.corpora install --only brown" in str(excinfo.value)


SIDECAR_DAMAGE = [
    ("claims", "truncated", '{"id": "demo-c", "verdict": "reprod', r"JSONDecodeError"),
    ("claims", "a list", "[]", r"a JSON list, not an object"),
    ("claims", "no id", '{"verdict": "reproduced"}', r"no string 'id' field"),
    ("figures", "truncated", '{"id": "demo-f", "files": {', r"JSONDecodeError"),
    ("figures", "a number", "3", r"a JSON int, not an object"),
    ("figures", "not UTF-8", b'{"id": "\xff"}', r"UnicodeDecodeError"),
]


@pytest.mark.parametrize("folder, what, content, reason", SIDECAR_DAMAGE,
                         ids=[f"{f} {w}" for f, w, _, _ in SIDECAR_DAMAGE])
def test_damaged_sidecar_names_file_and_fix(demo_project, capsys, folder, what, content,
                                            reason):
    """A claim or figure sidecar cut short (a killed run, a full disk) or not a record is
    neither skipped (the report would under-count with no sign) nor a crash: a
    ValueError names the file and the command that regenerates it, and
    ``python -m companion pages`` reports it (exit 2, no traceback, old pages kept)."""
    from companion.book import cli
    from companion.book import pages

    path = demo_project.assets("demo") / folder / "demo-bad.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    page = pages.reproduction_report if folder == "claims" else pages.figure_index
    kind = "claim" if folder == "claims" else "figure"
    with pytest.raises(ValueError) as excinfo:
        page(demo_project)
    message = str(excinfo.value)
    assert message.startswith(f"{path}: not a {kind} record (")
    assert re.search(reason, message), message
    assert message.endswith("re-run the chapter with `python -m companion run demo --force`")
    assert _raised_in_library(excinfo)

    demo_project.generated.mkdir(parents=True, exist_ok=True)
    old = demo_project.generated / "reproduction_report.md"
    old.write_text("previous report\n")
    assert cli.main(["pages", "--root", str(demo_project.root)]) == 2
    err = capsys.readouterr().err
    assert f"error: {path}: not a {kind} record" in err and "Traceback" not in err
    assert old.read_text() == "previous report\n"


def test_truncated_run_record_counts_as_no_record(demo_project):
    """runs/<name>.json cut short is a cache miss: the runner re-runs the chapter rather
    than trusting (or crashing on) the record."""
    from companion.book import runner

    path = demo_project.run_record("demo")
    path.parent.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    for damaged in ('{"status": "ok", "cache_key": "ab', '["ok"]'):
        path.write_text(damaged)
        assert runner.load_record(demo_project, "demo", lines.append) is None
        assert lines and str(path) in lines[-1] and "unreadable" in lines[-1]
        assert "runs again" in lines[-1]


# ------------------------------------------------------------------ writers leave nothing
@pytest.fixture
def chapter_dir(tmp_path, monkeypatch):
    from companion.book import chapter

    out = tmp_path / "assets"
    monkeypatch.setenv(chapter.ENV_OUTPUT_DIR, str(out))
    monkeypatch.delenv(chapter.ENV_CHAPTER, raising=False)
    before = chapter._ACTIVE
    chapter.begin_chapter("bad_inputs", scale="smoke", seed=0, device="cpu")
    yield out
    chapter._ACTIVE = before


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1, 1))
    ax.plot([0, 1])
    return fig


def _table():
    import pandas as pd

    return pd.DataFrame({"a": [1]})


WRITER_ROWS = [
    ("save_figure id without prefix",
     lambda p: p.save_figure(_figure(), "figure-one", "A line."), ValueError,
     r"^figure_id: id 'figure-one' must start with the chapter prefix 'bad-inputs-'$"),
    ("save_figure empty caption", lambda p: p.save_figure(_figure(), "bad-inputs-f", "  "),
     ValueError, r"^caption: expected a non-empty string"),
    ("save_table not a DataFrame",
     lambda p: p.save_table([[1, 2]], "bad-inputs-t", "Numbers."), TypeError,
     r"^table: expected a pandas DataFrame, got list$"),
    ("save_table id not kebab-case", lambda p: p.save_table(_table(), "Bad_Inputs", "N."),
     ValueError, r"^table_id: expected a kebab-case id"),
    ("claim unknown kind",
     lambda p: p.claim("bad-inputs-c", 1.0, paper=1.0, tolerance=0.1, reference="this chapter",
                       kind="approx", statement="One is one."), ValueError,
     r"^kind: expected one of \("),
    ("claim holds with a number",
     lambda p: p.claim("bad-inputs-c", 1.0, paper="qualitative", reference="this chapter",
                       kind="holds", statement="It holds."), TypeError,
     r"^measured: kind 'holds' expects a bool, got float$"),
    ("claim abs without tolerance",
     lambda p: p.claim("bad-inputs-c", 1.0, paper=1.0, reference="this chapter", kind="abs",
                       statement="One is one."), ValueError,
     r"^tolerance: kind 'abs' needs a tolerance$"),
    ("claim range with a str bound",
     lambda p: p.claim("bad-inputs-c", 1.0, paper=(0, "a"), reference="this chapter",
                       kind="range", statement="In range."), ValueError,
     r"^paper: kind 'range' expects \(lo, hi\), got \(0, 'a'\)$"),
    ("claim negative tolerance",
     lambda p: p.claim("bad-inputs-c", 1.0, paper=1.0, tolerance=-0.1,
                       reference="this chapter", kind="abs", statement="One is one."),
     ValueError, r"^tolerance: expected (a number )?>= 0, got -0\.1$"),
    ("save_figure not a figure",
     lambda p: p.save_figure("not a figure", "bad-inputs-f", "A caption."), TypeError,
     r"^fig: expected a matplotlib Figure, got 'not a figure' \(str\)$"),
    ("claim str tolerance",
     lambda p: p.claim("bad-inputs-c", 1.0, paper=1.0, tolerance="abc",
                       reference="this chapter", kind="abs", statement="One is one."),
     TypeError, r"^tolerance: expected a number >= 0, got 'abc' \(str\)$"),
    ("claim str tolerance, paper not available",
     lambda p: p.claim("bad-inputs-c", 1.0, paper="not available", tolerance="abc",
                       reference="this chapter", kind="abs", statement="One is one."),
     TypeError, r"^tolerance: expected a number >= 0, got 'abc' \(str\)$"),
    ("claim measured a 3-element tensor",
     lambda p: p.claim("bad-inputs-c", torch.ones(3), paper=1.0, tolerance=0.1,
                       reference="this chapter", kind="abs", statement="One is one."),
     TypeError, r"^measured: expected a number or a bool \(or a 1-element tensor\), got a "
                r"tensor of shape \(3,\)$"),
    ("claim measured a 2-element array",
     lambda p: p.claim("bad-inputs-c", np.ones(2), paper=1.0, tolerance=0.1,
                       reference="this chapter", kind="abs", statement="One is one."),
     TypeError, r"^measured: expected a number or a bool \(or a 1-element tensor\), got a "
                r"tensor of shape \(2,\)$"),
]


@pytest.mark.parametrize("name, call, exc, match", WRITER_ROWS,
                         ids=[r[0] for r in WRITER_ROWS])
def test_writers_reject_bad_input_and_write_nothing(chapter_dir, name, call, exc, match):
    from companion.book import chapter, records

    with pytest.raises(exc, match=match) as excinfo:
        call(records)
    assert _raised_in_library(excinfo)
    written = [p for p in chapter_dir.rglob("*") if p.is_file()] if chapter_dir.exists() else []
    assert written == [], f"a rejected call left files behind: {written}"
    # the id stays free: under the runner a corrected retry with the same id must not be
    # refused as "already used"
    assert chapter.active_chapter().used_ids == {}


# ------------------------------------------------------------------ CLI
CLI_ROWS = [
    ("unknown command", ["frobnicate"], r"invalid choice: 'frobnicate'"),
    ("unknown scale", ["run", "demo", "--scale", "huge"], r"--scale: invalid choice: 'huge'"),
    ("threads not an int", ["run", "demo", "--threads", "two"],
     r"--threads: invalid int value: 'two'"),
    ("jobs not an int", ["build", "--jobs", "1.5"], r"--jobs: invalid int value: '1\.5'"),
    ("param without value", ["run", "demo", "-p", "n"], r"-p/--param: expected 2 arguments"),
    ("unknown chapter", ["run", "nosuch"], r"chapter 'nosuch'.*available chapters: demo"),
    ("unknown parameter", ["run", "demo", "-p", "nn", "3"], r"unknown parameter 'nn'"),
    ("parameter of the wrong type", ["run", "demo", "-p", "n", "many"],
     r"parameter 'n': expected a"),
    ("parameter given twice", ["run", "demo", "-p", "n", "1", "-p", "n", "2"],
     r"parameter 'n' given twice"),
    ("unknown device", ["run", "demo", "--device", "tpu"], r"device: expected one of"),
    ("cuda without CUDA", ["run", "demo", "--device", "cuda"], r"CUDA is not available"),
    ("jobs < 1", ["build", "--jobs", "0"], r"--jobs: expected a positive integer, got 0"),
]


@pytest.mark.parametrize("name, argv, match", CLI_ROWS, ids=[r[0] for r in CLI_ROWS])
def test_cli_rejects_bad_arguments_with_exit_2(demo_project, capsys, name, argv, match):
    from companion.book import cli

    if "cuda" in argv and CUDA:
        pytest.skip("this machine has CUDA, so asking for it is not a bad input here")
    before = sorted(p for p in demo_project.root.rglob("*") if p.is_file())
    try:
        code = cli.main([*argv, "--root", str(demo_project.root)] if argv[0] != "frobnicate"
                        else ["--root", str(demo_project.root), *argv])
    except SystemExit as exc:  # argparse
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err
    assert "Traceback" not in err
    after = sorted(p for p in demo_project.root.rglob("*") if p.is_file())
    assert after == before, "a rejected command must not write anything"
