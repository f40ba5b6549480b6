"""Matrix-product FLOPs of a call, for the benchmarks' floors (work a ratio cannot go below).

:func:`matrix_product_flops` counts what ``torch.utils.flop_counter`` counts (``mm``,
``addmm``, ``bmm``, ``baddbmm``, SDPA, ...) and also the CPU flash-attention kernels, which
its table does not list (they would count as zero): by its own SDPA formulas, 2 products
forward and 5 backward (the scores recomputed). Elementwise work, softmax, reductions and
anything outside torch (numpy) are not counted.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils import flop_counter


def _flash_forward(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query, key, value)


def _flash_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)


def matrix_product_flops(call: Callable[[], object]) -> int:
    """FLOPs of the matrix products ``call()`` dispatches on this thread (``2 M N K`` per
    ``[M, K] @ [K, N]``).

    >>> matrix_product_flops(lambda: torch.ones(2, 3) @ torch.ones(3, 5))
    60
    """
    aten = torch.ops.aten  # the counter wraps these to receive shapes
    cpu_flash = {aten._scaled_dot_product_flash_attention_for_cpu: _flash_forward,
                 aten._scaled_dot_product_flash_attention_for_cpu_backward: _flash_backward}
    with flop_counter.FlopCounterMode(display=False, custom_mapping=cpu_flash) as counter:
        call()
    return counter.get_total_flops()
