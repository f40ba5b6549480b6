"""Every fast path of the library equals its readable reference.

One harness over all (fast, reference) pairs, which live in ``tests/reference_pairs/``
(one module per science package): several sizes (odd ones and empty ones among them),
float32 and float64, the CPU, and CUDA when a device is present.
"""
from __future__ import annotations

import importlib

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
