"""Work buffers kept between batches and calls: one explicit object, :class:`Workspace`.

Buffers of tens of megabytes are handed back to the operating system when freed, and
page-faulting them in again costs about as much per batch as the product written into
them. The capture (attention maps or their ``A >= threshold``, head outputs) and the
top-pair search (similarity products and their batch sum, segment maxima, the limit that
masks the never-pairs) therefore ask a :class:`Workspace` for their buffers by name; a
buffer is reused while it is large enough and of the same dtype and device, and
overwritten by the next user of the name.
"""
from __future__ import annotations

import torch

__all__ = ["Workspace", "work_buffer"]


class Workspace:
    """Named flat buffers reused between calls (not for concurrent use from threads).

    >>> ws = Workspace()
    >>> a = ws.buffer("x", 6, torch.float32, "cpu")
    >>> b = ws.buffer("x", 4, torch.float32, "cpu")  # fits: the same memory
    >>> a.data_ptr() == b.data_ptr(), len(ws)
    (True, 1)
    >>> ws.clear(); len(ws)
    0
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def buffer(self, name: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        """A flat tensor of ``numel`` entries (uninitialised), kept under ``name``."""
        buf = self._buffers.get(name)
        if (buf is None or buf.numel() < numel or buf.dtype != dtype
                or buf.device != torch.device(device)):
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:numel]

    def clear(self) -> None:
        """Free every buffer."""
        self._buffers.clear()

    def __len__(self) -> int:
        return len(self._buffers)

    def __repr__(self) -> str:
        mb = sum(b.numel() * b.element_size() for b in self._buffers.values()) / 2**20
        return f"Workspace({len(self)} buffers, {mb:.1f} MiB)"


def work_buffer(workspace: Workspace | None, name: str, numel: int, dtype,
                device) -> torch.Tensor:
    """``workspace.buffer(...)``, or a fresh tensor without a workspace.

    >>> work_buffer(None, "x", 3, torch.float32, "cpu").shape  # no workspace: a fresh tensor
    torch.Size([3])
    >>> ws = Workspace()
    >>> work_buffer(ws, "x", 3, torch.float32, "cpu").data_ptr() == ws.buffer(
    ...     "x", 3, torch.float32, "cpu").data_ptr()
    True
    """
    if workspace is None:
        return torch.empty(numel, dtype=dtype, device=device)
    if not isinstance(workspace, Workspace):
        raise TypeError(f"workspace: expected a companion.context_similarity.Workspace or "
                        f"None, got {type(workspace).__name__}")
    return workspace.buffer(name, numel, dtype, device)
