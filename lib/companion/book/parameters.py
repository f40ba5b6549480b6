"""A chapter's parameters: its ``parameters`` cell read, requested values checked and
coerced, the scale each chapter of a build runs at, and the other settings of a run
(processes, cell timeout, device) checked before anything starts.

A parameters cell holds only ``name = literal`` assignments, so that the defaults are
known without running anything and every parameter has a type to check a requested
value against. A default of ``None`` says nothing of that type, so such a parameter
declares it with an annotation, ``name: str | None = None`` (:func:`parameter_types`).
"""
from __future__ import annotations

import ast
import contextlib
import math
import os
import shlex
from dataclasses import dataclass
from typing import Any

from companion._validate import check_int, check_number
from companion.book.chapter import SCALES
from companion.book.project import ChapterError, Project, read_notebook

REQUIRED_PARAMETERS = ("scale", "seed", "device")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
#: The scale each chapter of the published book is run at (``make publish``, ``build
#: --scale publish``): the largest it reaches on a CPU. ``sbm_transformer`` needs a GPU
#: for the papers' settings, so its page says how to run them there.
PUBLISH_SCALES = {"hasse": "paper", "gradient_flow": "paper",
                  "context_similarity": "paper", "sbm_transformer": "ci"}
#: The ``--scale`` value of ``build`` that means :data:`PUBLISH_SCALES`.
PUBLISH = "publish"
# Longest time one cell may run, per scale, unless --timeout says otherwise. Generous:
# they exist to stop a hung run, not to police a slow machine.
CELL_TIMEOUT_SECONDS = {"smoke": 600.0, "ci": 1800.0, "paper": 86400.0}
#: The types a parameter's annotation may name (with ``None``).
ANNOTATION_TYPES = {"str": str, "int": int, "float": float, "bool": bool}


def parameters_cell_index(nb) -> int:
    """Index of the ``parameters`` cell, which must be the first code cell."""
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    if not code:
        raise ChapterError("the notebook has no code cell; the first must be tagged 'parameters'")
    first = nb.cells[code[0]]
    if "parameters" not in first.get("metadata", {}).get("tags", []):
        raise ChapterError("the first code cell must be tagged 'parameters'")
    return code[0]


def parameter_assignments(source: str) -> list[ast.Assign | ast.AnnAssign]:
    """The assignments of a parameters cell, in order: ``name = literal`` or
    ``name: type = literal``; ChapterError on anything else."""
    tree = ast.parse(source)
    nodes: list[ast.Assign | ast.AnnAssign] = []
    for node in tree.body:
        if is_parameter_assignment(node):
            nodes.append(node)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # a docstring-like comment
        else:
            raise ChapterError(
                f"parameters cell, line {node.lineno}: only 'name = literal' assignments "
                "are allowed"
            )
    return nodes


def is_parameter_assignment(node: ast.stmt) -> bool:
    """Whether ``node`` assigns one name: ``name = value`` or ``name: type = value``."""
    if isinstance(node, ast.Assign):
        return len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
    return (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            and node.value is not None)


def assigned_name(node: ast.Assign | ast.AnnAssign) -> str:
    """The parameter an assignment of :func:`parameter_assignments` sets."""
    return node.target.id if isinstance(node, ast.AnnAssign) else node.targets[0].id


def parse_parameters(source: str) -> dict[str, Any]:
    """The ``name = literal`` assignments of a parameters cell, in order.

    Only plain assignments of literals are allowed (``name: type = literal`` too), so
    defaults are known without running anything, and every parameter has a type to check
    overrides against.
    """
    params: dict[str, Any] = {}
    for node in parameter_assignments(source):
        name = assigned_name(node)
        try:
            params[name] = ast.literal_eval(node.value)
        except ValueError as exc:
            raise ChapterError(f"parameter {name!r}: the default must be a literal") from exc
    missing = [p for p in REQUIRED_PARAMETERS if p not in params]
    if missing:
        raise ChapterError(f"parameters cell lacks required parameter(s) {missing}")
    return params


def _annotation_types(name: str, node: ast.expr) -> tuple[type, ...]:
    """The types an annotation names: ``T``, ``T | None``, ``Optional[T]`` with T one of
    :data:`ANNOTATION_TYPES`."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _annotation_types(name, node.left) + _annotation_types(name, node.right)
    if isinstance(node, ast.Constant) and node.value is None:
        return (type(None),)
    if isinstance(node, ast.Name) and node.id in ANNOTATION_TYPES:
        return (ANNOTATION_TYPES[node.id],)
    if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
            and node.value.id == "Optional"):
        return _annotation_types(name, node.slice) + (type(None),)
    raise ChapterError(f"parameter {name!r}: the annotation {ast.unparse(node)!r} is not "
                       f"one of {', '.join(ANNOTATION_TYPES)}, optionally '| None'")


def parameter_types(source: str) -> dict[str, tuple[type, ...]]:
    """The types each parameter of a parameters cell accepts, in order.

    A parameter's annotation (``limit: int | None = None``) gives them; without one, the
    type of its default. A default of ``None`` must be annotated: it would otherwise
    accept any value, and a mistyped one would reach the chapter unchecked.

    Raises
    ------
    ChapterError
        A ``None`` default without an annotation, an annotation this reads not, or a
        default that is not of its declared type.

    >>> parameter_types('seed = 0\\nmodel: str | None = None\\n')
    {'seed': (<class 'int'>,), 'model': (<class 'str'>, <class 'NoneType'>)}
    """
    types: dict[str, tuple[type, ...]] = {}
    for node in parameter_assignments(source):
        name = assigned_name(node)
        try:
            default = ast.literal_eval(node.value)
        except ValueError as exc:
            raise ChapterError(f"parameter {name!r}: the default must be a literal") from exc
        if isinstance(node, ast.AnnAssign):
            declared = tuple(dict.fromkeys(_annotation_types(name, node.annotation)))
            try:
                coerce_parameter(name, default, None, declared)
            except ChapterError:
                raise ChapterError(
                    f"parameter {name!r}: the default {default!r} is not a "
                    f"{_describe_types(declared)}") from None
            types[name] = declared
        elif default is None:
            raise ChapterError(
                f"parameter {name!r}: a default of None says nothing of the values it "
                f"takes; declare its type, e.g. '{name}: str | None = None'")
        else:
            types[name] = (type(default),)
    return types


def _describe_types(types: tuple[type, ...]) -> str:
    return " or ".join("None" if t is type(None) else t.__name__ for t in types)


def _describe_params(defaults: dict[str, Any]) -> str:
    return ", ".join(f"{k} ({type(v).__name__}, default {v!r})" for k, v in defaults.items())


def coerce_parameter(name: str, value: Any, default: Any,
                     types: tuple[type, ...] | None = None) -> Any:
    """Convert ``value`` (a CLI string or a Python value) to the type of ``default``, or
    to one of ``types`` when given (:func:`parameter_types`: ``None`` among them lets
    ``None`` and the string ``"None"`` through)."""
    if types is not None:
        return _coerce_declared(name, value, types)
    kind = type(default)
    if isinstance(value, str) and kind is not str:
        text = value.strip()
        if kind is bool:
            low = text.lower()
            if low in ("true", "1", "yes"):
                return True
            if low in ("false", "0", "no"):
                return False
            raise ChapterError(f"parameter {name!r}: expected a bool (true/false), got {value!r}")
        if default is None:
            try:
                return ast.literal_eval(text)
            except (ValueError, SyntaxError):
                return text
        try:
            parsed = ast.literal_eval(text)
        except (ValueError, SyntaxError) as exc:
            raise ChapterError(
                f"parameter {name!r}: expected a {kind.__name__}, got {value!r}"
            ) from exc
        value = parsed
    if default is None or value is None:
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is float and isinstance(value, float) and not math.isfinite(value):
        # no literal writes it: papermill could inject it, but the run's parameters
        # could not be handed to the chapter as literals (chapter.encode_parameters)
        raise ChapterError(f"parameter {name!r}: expected a finite float, got {value!r}")
    if kind is bool and not isinstance(value, bool):
        raise ChapterError(f"parameter {name!r}: expected a bool, got {value!r}")
    if kind is int and isinstance(value, bool):
        raise ChapterError(f"parameter {name!r}: expected an int, got {value!r}")
    if not isinstance(value, kind):
        raise ChapterError(
            f"parameter {name!r}: expected a {kind.__name__}, got {type(value).__name__} {value!r}"
        )
    return value


def _coerce_declared(name: str, value: Any, types: tuple[type, ...]) -> Any:
    """:func:`coerce_parameter` against declared types: the first that takes ``value``."""
    if type(None) in types and (value is None or (isinstance(value, str)
                                                  and value.strip() == "None")):
        return None
    kinds = [kind for kind in types if kind is not type(None)]
    if len(kinds) == 1 and type(None) not in types:
        return coerce_parameter(name, value, kinds[0]())  # its own error, as for a default
    for kind in kinds:
        with contextlib.suppress(ChapterError):
            return coerce_parameter(name, value, kind())
    raise ChapterError(f"parameter {name!r}: expected a {_describe_types(types)}, "
                       f"got {type(value).__name__} {value!r}")


def resolve_parameters(defaults: dict[str, Any], overrides: dict[str, Any],
                       types: dict[str, tuple[type, ...]] | None = None) -> dict[str, Any]:
    """Defaults updated with overrides, each checked by name and type (``types``: the
    declared ones, :func:`parameter_types`; else the type of each default)."""
    resolved = dict(defaults)
    for name, value in overrides.items():
        if name not in defaults:
            raise ChapterError(
                f"unknown parameter {name!r}; valid parameters: {_describe_params(defaults)}"
            )
        resolved[name] = coerce_parameter(name, value, defaults[name],
                                          None if types is None else types.get(name))
    if resolved["scale"] not in SCALES:
        raise ChapterError(f"scale: expected one of {SCALES}, got {resolved['scale']!r}")
    dev = str(resolved["device"])
    if dev not in DEVICE_CHOICES and not dev.startswith("cuda:"):
        raise ChapterError(f"device: expected one of {DEVICE_CHOICES}, got {dev!r}")
    return resolved


def non_default_parameters(params: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The parameters (other than scale and device) whose value is not the chapter's default.

    >>> non_default_parameters({"scale": "ci", "seed": 1, "device": "cpu", "n": 4},
    ...                        {"scale": "ci", "seed": 0, "device": "auto", "n": 4})
    {'seed': 1}
    """
    return {k: v for k, v in params.items()
            if k not in ("scale", "device") and v != defaults.get(k)}


@dataclass
class PreparedChapter:
    """A chapter read and its parameters resolved (:func:`prepare_chapter`)."""

    name: str
    nb: Any  # the notebook, as jupytext read it
    parameters_cell: int  # index of its parameters cell
    defaults: dict[str, Any]
    params: dict[str, Any]  # the defaults with the requested values, coerced


def prepare_chapter(project: Project, name: str, scale: str | None = None,
                    device: str | None = None,
                    overrides: dict[str, Any] | None = None) -> PreparedChapter:
    """Read ``chapters/<name>.md`` and resolve its parameters with the requested ones.

    Raises
    ------
    ChapterError
        No such chapter, a bad parameters cell, an unknown parameter or a wrongly typed
        value (the message names the chapter).
    """
    src = project.source(name)
    if not src.exists():
        available = ", ".join(project.chapter_names()) or "none"
        raise ChapterError(f"chapter {name!r}: no file {src}; available chapters: {available}")
    nb = read_notebook(src)
    try:
        pidx = parameters_cell_index(nb)
        source = nb.cells[pidx].source
        defaults = parse_parameters(source)
        types = parameter_types(source)
        requested = dict(overrides or {})
        if scale is not None:
            requested["scale"] = scale
        if device is not None:
            requested["device"] = device
        params = resolve_parameters(defaults, requested, types)
    except ChapterError as exc:
        raise ChapterError(f"chapter {name!r}: {exc}") from None
    return PreparedChapter(name, nb, pidx, defaults, params)


def parse_scale_spec(spec: str | None, chapters: list[str]) -> dict[str, str | None]:
    """Each chapter's scale from the ``--scale`` value of ``build``.

    Parameters
    ----------
    spec
        None (every chapter at its default scale); a scale (``"ci"``); ``"publish"``
        (:data:`PUBLISH_SCALES`); or comma-separated items, each a scale or ``publish``
        (for the chapters not named) or ``CHAPTER=SCALE``, e.g.
        ``"hasse=paper,gradient_flow=paper,context_similarity=paper,sbm_transformer=ci"``.
    chapters
        The chapters to run.

    Returns
    -------
    dict
        Chapter name -> scale, or None for the chapter's default.

    Raises
    ------
    ChapterError
        An unknown scale or chapter, a chapter named twice, two defaults.

    >>> parse_scale_spec("ci,hasse=paper", ["hasse", "sbm_transformer"])
    {'hasse': 'paper', 'sbm_transformer': 'ci'}
    """
    scales: dict[str, str | None] = {name: None for name in chapters}
    if spec is None:
        return scales
    if not isinstance(spec, str) or not spec.strip():
        raise ChapterError(f"--scale: expected a scale ({', '.join(SCALES)}), "
                           f"{PUBLISH!r} or CHAPTER=SCALE items, got {spec!r}")
    items = [item.strip() for item in spec.split(",")]
    defaults = [item for item in items if "=" not in item]
    named = [item for item in items if "=" in item]
    if len(defaults) > 1:
        raise ChapterError(f"--scale: more than one default scale in {spec!r} ({defaults}); "
                           "give one, and CHAPTER=SCALE for the others")
    for item in defaults:
        if item == PUBLISH:
            scales.update({n: s for n, s in PUBLISH_SCALES.items() if n in scales})
        elif item in SCALES:
            scales = {name: item for name in scales}
        else:
            raise ChapterError(f"--scale: unknown scale {item!r}; expected one of "
                               f"{', '.join(SCALES)}, {PUBLISH!r} or CHAPTER=SCALE")
    seen: set[str] = set()
    for item in named:
        name, _, scale = (part.strip() for part in item.partition("="))
        if name not in chapters:
            raise ChapterError(f"--scale: unknown chapter {name!r} in {item!r}; chapters: "
                               f"{', '.join(chapters) or 'none'}")
        if scale not in SCALES:
            raise ChapterError(f"--scale: unknown scale {scale!r} for chapter {name!r}; "
                               f"expected one of {', '.join(SCALES)}")
        if name in seen:
            raise ChapterError(f"--scale: chapter {name!r} is given twice in {spec!r}")
        seen.add(name)
        scales[name] = scale
    return scales


def check_nproc(nproc: Any) -> int:
    """``nproc`` (processes for a chapter's scale-out) as a positive int; 1 for None.

    >>> check_nproc(None), check_nproc(4)
    (1, 4)
    """
    if nproc is None:
        return 1
    try:
        return check_int("nproc", nproc, minimum=1)
    except (TypeError, ValueError):
        raise ChapterError(f"nproc: expected a positive integer number of processes, "
                           f"got {nproc!r}") from None


def default_timeout(scale: str) -> float:
    """The longest one cell may run at ``scale`` (:data:`CELL_TIMEOUT_SECONDS`)."""
    return CELL_TIMEOUT_SECONDS[scale]


def check_timeout(timeout: Any) -> float | None:
    """``timeout`` as seconds (a positive finite number) or None; ChapterError otherwise."""
    if timeout is None:
        return None
    try:
        return check_number("timeout", timeout, minimum=0, min_open=True)
    except (TypeError, ValueError):
        raise ChapterError(f"timeout: expected a positive number of seconds, "
                           f"got {timeout!r}") from None


def check_device_available(device: str) -> None:
    """Refuse ``cuda``/``cuda:N`` when this machine has no such CUDA device.

    torch is imported only when a CUDA device is requested ("auto" and "cpu" always work).
    """
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ChapterError(
            f"device {device!r}: CUDA is not available on this machine (torch "
            f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}); "
            "use --device cpu or --device auto")
    index = device.partition(":")[2]
    if index:
        if not index.isdigit():
            raise ChapterError(f"device: expected 'cuda' or 'cuda:N' with N an integer, "
                               f"got {device!r}")
        if int(index) >= torch.cuda.device_count():
            raise ChapterError(f"device {device!r}: this machine has "
                               f"{torch.cuda.device_count()} CUDA device(s)")


def rerun_command(name: str, params: dict[str, Any], defaults: dict[str, Any],
                  nproc: int = 1, out: str | os.PathLike | None = None) -> str:
    """The ``python -m companion run`` command that re-executes a run with ``params``.

    Non-default parameters are given with ``-p``; without ``out`` they replace the book's
    page, so the command then says ``--publish`` (see :func:`companion.book.runner.run_chapter`).

    >>> rerun_command("hasse", {"scale": "ci", "seed": 0, "device": "auto", "n": 8},
    ...               {"scale": "ci", "seed": 0, "device": "auto", "n": 4})
    'python -m companion run hasse --scale ci --device auto -p seed 0 -p n 8 --publish'
    """
    parts = ["python", "-m", "companion", "run", name,
             "--scale", str(params["scale"]), "--device", str(params["device"])]
    if nproc != 1:
        parts += ["--nproc", str(nproc)]
    for key, value in params.items():
        if key in ("scale", "device"):
            continue
        if key == "seed" or value != defaults.get(key):
            parts += ["-p", key, str(value)]
    if out is not None:
        parts += ["--out", str(out)]
    elif non_default_parameters(params, defaults):
        parts.append("--publish")
    return " ".join(shlex.quote(p) for p in parts)


def paper_scale_command(record: dict[str, Any]) -> str:
    """The command that runs the chapter of ``record`` at paper scale (on a GPU where a CPU
    does not reach it: :data:`PUBLISH_SCALES`)."""
    name = record["chapter"]
    params = dict(record["parameters"], scale="paper")
    if PUBLISH_SCALES.get(name, "paper") != "paper":
        params["device"] = "cuda"
    return rerun_command(name, params, record.get("defaults", params),
                         record.get("nproc", 1), "DIR" if record.get("out") else None)
