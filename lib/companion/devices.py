"""Device resolution shared by every module: ``"auto"`` means CUDA when available.

Library functions never move data behind the caller's back; they only resolve the
``device=`` argument they were given.
"""
from __future__ import annotations

import torch

VALID_DEVICES = ("auto", "cpu", "cuda")


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
    """
    if device is None or (isinstance(device, str) and device == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(
            f"device: expected one of {VALID_DEVICES}, 'cuda:N' or a torch.device, got "
            f"{type(device).__name__}"
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device: expected one of {VALID_DEVICES} or 'cuda:N', got {device!r}"
        ) from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} was requested but CUDA is not available here")
    return dev
