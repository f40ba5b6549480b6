"""Every fast path of the library equals its readable reference.

One harness over all (fast, reference) pairs, which live in ``tests/reference_pairs/``
(one module per science package): several sizes (odd ones and empty ones among them),
float32 and float64, the CPU, and CUDA when a device is present.

The registry of fast kernels is checked too: every public function or class of a fast
module (:data:`KERNEL_MODULES`) is held to its reference by some pair (``Pair.fast`` or
``Pair.covers``), or :data:`NOT_KERNELS` says why it needs none. A new kernel without a
pair fails :func:`test_every_fast_kernel_has_a_pair`, naming the file of pairs.
"""
from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from reference_pairs import Pair, assert_same

PACKAGES = ("hasse", "context_similarity", "gradient_flow", "sbm")

PAIRS: list[Pair] = []
for _package in PACKAGES:
    try:
        _module = importlib.import_module(f"reference_pairs.{_package}")
    except ModuleNotFoundError as exc:  # reported by test_every_package_has_pairs
        if exc.name != f"reference_pairs.{_package}":
            raise
        continue
    PAIRS.extend(_module.PAIRS)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _cases():
    for pair in PAIRS:
        for size in pair.sizes:
            for dtype in pair.dtypes:
                for device in DEVICES:
                    if device == "cuda" and not pair.cuda:
                        continue
                    yield pytest.param(pair, size, dtype, device,
                                       id=f"{pair.name}-{size}-{str(dtype).removeprefix('torch.')}-{device}")


def test_every_package_has_pairs():
    names = {pair.name.split(".")[0] for pair in PAIRS}
    assert names == set(PACKAGES), f"packages without pairs: {sorted(set(PACKAGES) - names)}"
    assert len({pair.name for pair in PAIRS}) == len(PAIRS), "pair names must be unique"


#: The modules whose public functions are fast paths of a readable reference, by package.
KERNEL_MODULES = {
    "hasse": ("companion.hasse.reachability",),
    "context_similarity": ("companion.context_similarity.topk",
                           "companion.context_similarity.stats",
                           "companion.context_similarity.capture"),
    "gradient_flow": ("companion.gradient_flow.kernels",),
    "sbm": ("companion.sbm.fastrg", "companion.sbm.graph_attention",
            "companion.sbm.tensor_ops"),
}

#: Public names of the fast modules that are no kernel of their own, and why.
NOT_KERNELS = {
    "companion.hasse.reachability.OrderStructure": "result type",
    "companion.hasse.reachability.PackedOrderStructure": "result type",
    "companion.hasse.reachability.mask_graph": "a networkx view of a mask, for drawing",
    "companion.hasse.reachability.condensation_graph":
        "a networkx view built on order_structure (covered), for drawing",
    "companion.hasse.reachability.tokens_reached": "a set union over R, for tables",
    "companion.context_similarity.topk.TopPairsTuning": "tuning parameters",
    "companion.context_similarity.stats.BatchParts": "result type",
    "companion.context_similarity.stats.ScatterAdd": "result type",
    "companion.context_similarity.stats.Statistic": "registry entry",
    "companion.context_similarity.stats.PairBatch":
        "inside SimilarityStats.update (covered by context_similarity.stats)",
    "companion.context_similarity.stats.uniform_pairs_mode_count":
        "a seeded draw that the reference calls too (chance_hub_endpoints)",
    "companion.context_similarity.stats.batch_sum": "registers a statistic",
    "companion.context_similarity.stats.window_sum": "registers a statistic",
    "companion.context_similarity.capture.BatchResult": "result type",
    "companion.context_similarity.capture.HeadOutputs": "result type",
    "companion.context_similarity.capture.CaptureSettings": "settings",
    "companion.context_similarity.capture.analyse_batch":
        "head_outputs (covered) and the maps, into a BatchResult for SimilarityStats",
    "companion.context_similarity.capture.hook_names": "names of a model's modules",
    "companion.context_similarity.capture.wo_gram":
        "a product of a model's weights; its property is tested in test_context_similarity",
    "companion.gradient_flow.kernels.KernelTuning": "tuning parameters",
    "companion.gradient_flow.kernels.velocity": "one output of step_quantities (covered)",
    "companion.sbm.fastrg.FastRGTuning": "tuning parameters",
    "companion.sbm.fastrg.fastrg_sample":
        "a random draw: its law is tested against the dense Poisson counts in test_sbm.py",
    "companion.sbm.fastrg.poisson_pair_counts":
        "a random draw: its law is tested against the dense Poisson counts in test_sbm.py",
    "companion.sbm.fastrg.use_pair_grid": "a choice between two paths, not a result",
    "companion.sbm.graph_attention.EdgeGraph": "the edge list's index, inside edge_attention",
    "companion.sbm.graph_attention.attention_on_graph":
        "edge_attention's work on a built graph (covered through edge_attention)",
}


def _public(module_name: str):
    module = importlib.import_module(module_name)
    for name in getattr(module, "__all__", ()):
        obj = getattr(module, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            yield f"{module_name}.{name}", obj


def _kernels_without_pairs() -> tuple[list[str], list[str]]:
    """(kernels without a pair, each with where to add it; NOT_KERNELS entries that name
    nothing a fast module exports)."""
    covered = {id(obj) for pair in PAIRS for obj in pair.covered()}
    missing, stale = [], [name for name in NOT_KERNELS
                          if not any(name == n for modules in KERNEL_MODULES.values()
                                     for m in modules for n, _ in _public(m))]
    for package, modules in KERNEL_MODULES.items():
        for module_name in modules:
            for name, obj in _public(module_name):
                if id(obj) not in covered and name not in NOT_KERNELS:
                    missing.append(f"{name}: add a Pair (fast=, or covers=) to "
                                   f"tests/reference_pairs/{package}.py against its reference "
                                   f"in companion.{package}.reference, or say why it needs "
                                   "none in NOT_KERNELS (tests/test_fast_equals_reference.py)")
    return missing, stale


def test_every_fast_kernel_has_a_pair():
    missing, stale = _kernels_without_pairs()
    assert not missing, "fast kernels without a reference pair: " + "; ".join(missing)
    assert not stale, f"NOT_KERNELS names what no fast module exports: {stale}"


def test_a_new_kernel_without_a_pair_is_named_with_where_its_pair_goes(monkeypatch):
    from companion.sbm import tensor_ops

    def cumulative_sum(x):
        return x.cumsum(0)

    monkeypatch.setattr(tensor_ops, "cumulative_sum", cumulative_sum, raising=False)
    monkeypatch.setattr(tensor_ops, "__all__", [*tensor_ops.__all__, "cumulative_sum"])
    missing, _ = _kernels_without_pairs()
    assert len(missing) == 1 and missing[0].startswith(
        "companion.sbm.tensor_ops.cumulative_sum: add a Pair")
    assert "tests/reference_pairs/sbm.py" in missing[0] and "NOT_KERNELS" in missing[0]


@pytest.mark.parametrize(("pair", "size", "dtype", "device"), list(_cases()))
def test_fast_equals_reference(pair: Pair, size, dtype, device):
    generator = torch.Generator().manual_seed(20261201)
    args = pair.make(size, dtype, torch.device(device), generator)
    fast = pair.fast(*args)
    reference = pair.reference(*args)
    if pair.compare is not None:
        pair.compare(fast, reference, dtype)
        return
    rtol, atol = pair.tolerances.get(dtype, (0.0, 0.0))
    assert_same(fast, reference, exact=pair.exact, rtol=rtol, atol=atol, where=pair.name)
