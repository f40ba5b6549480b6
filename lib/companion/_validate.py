"""Small uniform checks of public arguments, shared by the library's modules.

Every check raises with a message that starts with the parameter's name and says what
was expected and what was given, e.g. ``"n: expected an int >= 1, got -3"``:

- ``TypeError`` when the value has the wrong type (a float or a str where an int is
  expected, a bool where a number is, a list where a tensor is, a wrong tensor dtype);
- ``ValueError`` when the type is right but the value is not (out of range, NaN or
  infinite, a wrong shape, an unknown name, a device that is not there).

Each check returns the value (converted where that is lossless, e.g. a numpy integer to
``int``), so that a caller can write ``n = check_int("n", n, minimum=1)``.
"""
from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a check needs it: the book's runner, which
    import torch   # only validates parameters, starts without it

__all__ = [
    "check_bool",
    "check_choice",
    "check_device",
    "check_str_sequence",
    "check_int",
    "check_number",
    "check_tensor",
    "describe",
]


def describe(value) -> str:
    """A short account of ``value`` for an error message: small scalars and strings with
    their type (``"2.5 (float)"``, ``"'3' (str)"``), a tensor by dtype, shape and device,
    anything else by its type name.

    >>> describe(2.5), describe("3"), describe([1, 2])
    ('2.5 (float)', "'3' (str)", 'list')
    """
    torch = sys.modules.get("torch")  # not imported yet: value is no tensor
    if torch is not None and isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    if value is None:
        return "None"
    if isinstance(value, (bool, numbers.Number, str)):
        text = repr(value)
        if len(text) <= 60:
            return f"{text} ({type(value).__name__})"
    return type(value).__name__


def _range_text(kind: str, minimum, maximum, min_open: bool = False,
                max_open: bool = False) -> str:
    if minimum is not None and maximum is not None:
        left, right = "(" if min_open else "[", ")" if max_open else "]"
        return f"{kind} in {left}{minimum}, {maximum}{right}"
    if minimum is not None:
        return f"{kind} {'>' if min_open else '>='} {minimum}"
    if maximum is not None:
        return f"{kind} {'<' if max_open else '<='} {maximum}"
    return kind


def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """Check that ``value`` is an int (not a bool) in ``[minimum, maximum]``; return it.

    Parameters
    ----------
    name : the parameter's name, the first word of the message.
    value : the argument. Python and numpy integers are accepted; bools, floats (even
        integral ones such as ``2.0``), strings and everything else are not.
    minimum, maximum : inclusive bounds, None for none.

    Returns
    -------
    int

    Raises
    ------
    TypeError
        ``value`` is not an integer.
    ValueError
        ``value`` is out of range.

    >>> check_int("n", 3, minimum=1)
    3
    >>> check_int("n", -3, minimum=1)
    Traceback (most recent call last):
    ...
    ValueError: n: expected an int >= 1, got -3
    """
    expected = _range_text("an int", minimum, maximum)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected {expected}, got {describe(value)}")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name}: expected {expected}, got {value}")
    return value


def check_number(
    name: str,
    value,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    min_open: bool = False,
    max_open: bool = False,
    finite: bool = True,
    expected: str | None = None,
) -> float:
    """Check that ``value`` is a real number (not a bool) in the given range; return a float.

    Parameters
    ----------
    name : the parameter's name.
    value : the argument: a Python or numpy int or float (a 0-d tensor is not accepted:
        pass ``t.item()``).
    minimum, maximum : bounds, None for none; inclusive unless ``min_open`` /
        ``max_open``.
    finite : reject NaN and infinities (default). NaN is always rejected when a bound is
        given, since it compares false with every bound.
    expected : what the message says is expected, e.g. ``"a probability in [0, 1]"``
        (default: built from the bounds, ``"a finite number >= 0"``).

    Returns
    -------
    float

    Raises
    ------
    TypeError
        ``value`` is not a real number.
    ValueError
        ``value`` is NaN, infinite (when ``finite``) or out of range.

    >>> check_number("rate", 0.5, minimum=0, maximum=1, min_open=True)
    0.5
    >>> check_number("rate", float("nan"), minimum=0)
    Traceback (most recent call last):
    ...
    ValueError: rate: expected a finite number >= 0, got nan
    """
    if expected is None:
        kind = "a finite number" if finite else "a number"
        expected = _range_text(kind, minimum, maximum, min_open, max_open)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected {expected}, got {describe(value)}")
    value = float(value)
    bad = math.isnan(value) or (finite and math.isinf(value))
    if minimum is not None:
        bad = bad or (value <= minimum if min_open else value < minimum)
    if maximum is not None:
        bad = bad or (value >= maximum if max_open else value > maximum)
    if bad:
        raise ValueError(f"{name}: expected {expected}, got {value}")
    return value


def check_bool(name: str, value) -> bool:
    """Check that ``value`` is a bool (Python or numpy); return it as ``bool``.

    Raises
    ------
    TypeError
        For anything else, including the ints 0 and 1 and the strings "true"/"false".

    >>> check_bool("sparse", True)
    True
    >>> check_bool("sparse", "yes")
    Traceback (most recent call last):
    ...
    TypeError: sparse: expected a bool, got 'yes' (str)
    """
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise TypeError(f"{name}: expected a bool, got {describe(value)}")


def check_choice(name: str, value, choices: Iterable):
    """Check that ``value`` is one of ``choices``; return it.

    Raises
    ------
    ValueError
        ``value`` is not among ``choices`` (the message lists them).

    >>> check_choice("cost", "geodesic", ("geodesic", "chordal"))
    'geodesic'
    >>> check_choice("cost", "manhattan", ("geodesic", "chordal"))
    Traceback (most recent call last):
    ...
    ValueError: cost: expected one of ('geodesic', 'chordal'), got 'manhattan'
    """
    choices = tuple(choices)
    try:
        known = value in choices
    except TypeError:  # an unhashable value compared with a dict's keys, say
        known = False
    if not known or isinstance(value, bool) and not any(c is value for c in choices):
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")
    return value


def check_str_sequence(name: str, value) -> list[str]:
    """``value`` as a list of str: any iterable of str, but not one bare str.

    >>> check_str_sequence("texts", ("ab", "c"))
    ['ab', 'c']
    >>> check_str_sequence("texts", "abc")
    Traceback (most recent call last):
    ...
    TypeError: texts: expected a sequence of str, got a single str
    """
    if isinstance(value, str):
        raise TypeError(f"{name}: expected a sequence of str, got a single str")
    items = list(value)
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise TypeError(f"{name}[{i}]: expected a str, got {describe(item)}")
    return items


#: The device names ``check_device(..., allow_auto=True)`` accepts besides 'cuda:N'.
AUTO_DEVICES = ("auto", "cpu", "cuda")


def check_device(name: str, device, *, allow_auto: bool = False) -> torch.device | None:
    """Check a ``device=`` argument. Without ``allow_auto`` it chooses none: None stays
    None (the caller's default, usually the CPU); anything else must name a device that
    exists here. With ``allow_auto``, None and "auto" mean CUDA when available, else the
    CPU (:func:`companion.devices.resolve_device`).

    Raises
    ------
    TypeError
        ``device`` is neither None, a str, an int (a CUDA index) nor a torch.device.
    ValueError
        It is not a device name, or names CUDA on a machine without CUDA.

    >>> check_device("device", "cpu")
    device(type='cpu')
    >>> check_device("device", "tpu", allow_auto=True)
    Traceback (most recent call last):
    ...
    ValueError: device: expected one of ('auto', 'cpu', 'cuda') or 'cuda:N', got 'tpu'
    """
    import torch

    if allow_auto and (device is None or (isinstance(device, str) and device == "auto")):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device is None:
        return None
    listed = f"one of {AUTO_DEVICES}, 'cuda:N'" if allow_auto else (
        "a device name ('cpu', 'cuda', 'cuda:N')")
    names = f"one of {AUTO_DEVICES} or 'cuda:N'" if allow_auto else listed
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"{name}: expected {listed}, a torch.device or None, "
                        f"got {describe(device)}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"{name}: expected {names}, got {device!r}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name}: {device!r} was requested but CUDA is not available here")
    return dev


def check_tensor(
    name: str,
    t,
    *,
    ndim: int | tuple[int, ...] | None = None,
    min_ndim: int | None = None,
    dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
    floating: bool = False,
    finite: bool = False,
    nonempty: bool = False,
    shape_text: str | None = None,
) -> torch.Tensor:
    """Check a tensor argument; return it unchanged.

    A tensor on the meta device is always rejected: it has no values to compute with.

    Parameters
    ----------
    name : the parameter's name.
    t : the argument.
    ndim : required number of dimensions (an int or a tuple of allowed ones), or None.
    min_ndim : least number of dimensions, or None.
    dtype : required dtype (or tuple of allowed dtypes), or None.
    floating : require a floating-point dtype.
    finite : require every entry to be finite (no NaN, no infinity).
    nonempty : require at least one entry.
    shape_text : how the expected shape reads in messages, e.g. ``"[paths, n, d]"``.

    Raises
    ------
    TypeError
        ``t`` is not a tensor, or has the wrong dtype.
    ValueError
        Wrong number of dimensions, empty, on the meta device, or not finite.

    >>> import torch
    >>> check_tensor("x", torch.zeros(2, 3), ndim=2, floating=True).shape
    torch.Size([2, 3])
    >>> check_tensor("x", torch.zeros(2, 3, dtype=torch.long), floating=True)
    Traceback (most recent call last):
    ...
    TypeError: x: expected a floating-point tensor, got dtype torch.int64
    """
    import torch

    what = "a tensor" if shape_text is None else f"a tensor {shape_text}"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected {what}, got {describe(t)}")
    if t.device.type == "meta":
        raise ValueError(f"{name}: expected a tensor with values, got one on the meta device")
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if dims is not None and t.dim() not in dims:
        want = " or ".join(f"{d}-D" for d in dims)
        shape = "" if shape_text is None else f" {shape_text}"
        raise ValueError(f"{name}: expected a {want} tensor{shape}, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        shape = "" if shape_text is None else f" {shape_text}"
        raise ValueError(
            f"{name}: expected a tensor of at least {min_ndim} dimensions{shape}, "
            f"got shape {tuple(t.shape)}"
        )
    dtypes = (dtype,) if isinstance(dtype, torch.dtype) else dtype
    if dtypes is not None and t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {want}, got dtype {t.dtype}")
    if floating and not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {t.dtype}")
    if nonempty and t.numel() == 0:
        raise ValueError(f"{name}: expected a non-empty tensor, got shape {tuple(t.shape)}")
    if finite and (t.is_floating_point() or t.is_complex()) and not bool(
            torch.isfinite(t.detach()).all()):
        raise ValueError(f"{name}: expected finite values, got NaN or infinity")
    return t
