"""Device resolution shared by every module: ``"auto"`` means CUDA when available.

Library functions never move data behind the caller's back; they only resolve the
``device=`` argument they were given. The check itself is
:func:`companion._validate.check_device` (``allow_auto=True``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from companion._validate import AUTO_DEVICES, check_device

if TYPE_CHECKING:
    import torch

VALID_DEVICES = AUTO_DEVICES


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """Return the torch.device for ``device``.

    Parameters
    ----------
    device : "auto", "cpu", "cuda", "cuda:N", a torch.device, or None (= "auto").
        "auto" picks CUDA when ``torch.cuda.is_available()``, else CPU.

    Raises
    ------
    TypeError
        If ``device`` is not a str, an int (a CUDA index), a torch.device or None.
    ValueError
        If ``device`` names CUDA but no CUDA device is available, or is not a device name.

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    return check_device("device", device, allow_auto=True)
