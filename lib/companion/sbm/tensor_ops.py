"""Tensor utilities of the SBM sampler and of edge attention: torch operations with a
faster CPU path through numpy, each giving torch's result bit for bit.

- :func:`stable_argsort`: ``torch.sort(keys, stable=True).indices`` for bounded integer keys
  (an LSD radix sort on CPU);
- :func:`repeat_each`: ``values.repeat_interleave(repeats)`` (numpy's ``repeat`` on CPU);
- :func:`transposed_copy`: ``x.transpose(1, 2).contiguous()``, always a new tensor
  (numpy's strided copy on CPU, in tiles of rows).

Tensors numpy cannot read (on another device, requiring grad, bfloat16, negative or
conjugate views) and traced or compiled calls take torch's own operation.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["repeat_each", "stable_argsort", "transposed_copy"]

# dtypes numpy reads and writes exactly (no bfloat16 in numpy)
_NUMPY_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                 torch.float16, torch.float32, torch.float64)
# the dtypes of edge indices the sampler writes and the attention reads
INDEX_DTYPES = (torch.int32, torch.int64)
# rows per tile of transposed_copy
_TRANSPOSE_TILE = 128


def stable_argsort(keys: torch.Tensor, bound: int) -> torch.Tensor:
    """Stable argsort of nonnegative integer ``keys < bound`` (int32 or int64).

    On CPU: LSD radix sort, 16 bits per pass, through numpy's radix ``argsort`` for
    16-bit keys (linear time, against ``torch.sort``'s comparison sort on CPU).
    Elsewhere: ``torch.sort(stable=True)`` (a radix sort on CUDA).

    Examples
    --------
    >>> stable_argsort(torch.tensor([2, 0, 2, 1]), 3)  # ties keep their order
    tensor([1, 3, 0, 2])
    """
    if keys.numel() == 0:
        return torch.zeros(0, dtype=torch.int64, device=keys.device)
    if keys.device.type != "cpu":
        return torch.sort(keys, stable=True).indices
    values = keys.numpy()
    bits = max(1, (max(int(bound), 2) - 1).bit_length())
    perm = None
    for shift in range(0, bits, 16):
        current = values if perm is None else values[perm]
        if shift == 0 and bits <= 16:
            digits = current.astype(np.uint16)
        else:
            digits = ((current >> shift) & 0xFFFF).astype(np.uint16)
        del current
        order = np.argsort(digits, kind="stable")
        del digits
        perm = order if perm is None else perm[order]
    return torch.from_numpy(np.ascontiguousarray(perm, dtype=np.int64))


def repeat_each(values: torch.Tensor, repeats: torch.Tensor,
                total: int | None = None) -> torch.Tensor:
    """Entry ``i`` of the 1-D ``values`` repeated ``repeats[i]`` times, in order:
    ``values.repeat_interleave(repeats, output_size=total)``.

    On CPU by numpy's ``repeat`` (a copy: the same numbers, bit for bit), faster than
    torch's ``repeat_interleave`` there (measurements: ``benchmarks/bench_sbm.py``).
    Tensors numpy cannot read (on another device, requiring grad, bfloat16, negative or
    conjugate views) and traced or compiled calls take torch's.  ``total``: the output
    length when the caller knows it (``sum(repeats)``; checked on the numpy path,
    trusted by torch's).

    >>> repeat_each(torch.tensor([5, 6, 7]), torch.tensor([2, 0, 1]))
    tensor([5, 5, 7])
    """
    if (values.device.type == "cpu" and repeats.device.type == "cpu"
            and values.dim() == 1 and repeats.dim() == 1 and values.dtype in _NUMPY_DTYPES
            and not (values.requires_grad or values.is_neg() or values.is_conj()
                     or torch.jit.is_tracing() or torch.compiler.is_compiling())):
        out = torch.from_numpy(np.repeat(values.numpy(), repeats.numpy()))
        if total is not None and out.numel() != total:
            raise ValueError(f"total: expected sum(repeats) = {out.numel()}, got {total}")
        return out
    return values.repeat_interleave(repeats, output_size=total)


def transposed_copy(x: torch.Tensor) -> torch.Tensor:
    """``x.transpose(1, 2).contiguous()`` of a 3-D tensor, as a new tensor without grad.

    On CPU (float32 / float64) by numpy's strided copy, the same numbers (a copy) with
    less overhead than torch's transposing copy; past 128 rows, in tiles of 128 rows, so
    that the columns written stay short (measurements: ``benchmarks/bench_sbm.py``). For
    the GEMMs' second operands, which are faster contiguous than transposed. Always a
    copy, never a view of ``x`` (``.contiguous()`` returns ``x`` itself when a size-1
    dimension makes the transpose contiguous). Tensors numpy cannot read (negative or
    conjugate views) and traced or compiled calls take torch's copy.

    >>> x = torch.arange(6.0).reshape(1, 2, 3)
    >>> torch.equal(transposed_copy(x), x.transpose(1, 2).contiguous())
    True
    >>> y = torch.zeros(3, 1, 5)
    >>> transposed_copy(y).data_ptr() != y.data_ptr()
    True
    """
    x = x.detach()
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and x.numel() \
            and not (x.is_neg() or x.is_conj() or torch.jit.is_tracing()
                     or torch.compiler.is_compiling()):
        a = x.numpy()
        rows = a.shape[1]
        # tiles of rows (one tile up to 128 rows): a long column written in one sweep
        # touches a new page per element; a tile's columns are short, its pages few
        out = np.empty((a.shape[0], a.shape[2], rows), dtype=a.dtype)
        for r0 in range(0, rows, _TRANSPOSE_TILE):
            out[:, :, r0:r0 + _TRANSPOSE_TILE] = a[:, r0:r0 + _TRANSPOSE_TILE].transpose(0, 2, 1)
        return torch.from_numpy(out)
    return x.transpose(1, 2).clone(memory_format=torch.contiguous_format)
