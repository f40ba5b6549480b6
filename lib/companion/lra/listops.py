"""ListOps: nested list operations over digits, generated offline and seeded.

Definition
----------
A ListOps expression is a digit ``0``-``9`` or an operator applied to a list of two or
more expressions, written ``[OP a_1 ... a_m ]``. The operators are those of the Long
Range Arena release {cite}`nangia2018listops, tay2021lra`:

- ``[MIN``: the minimum of the arguments;
- ``[MAX``: the maximum;
- ``[MED``: the median, truncated to an int (the mean of the two middle values, rounded
  down, when the count is even);
- ``[SM``: the sum modulo 10.

The target is the value of the whole expression, a digit, so the task is a 10-class
classification of a long sequence.

String format
-------------
The LRA generator builds each operator node as a left fold of pairs,
``(((op, a_1), a_2), ..., ])``, and writes every pair in parentheses, so
``[MAX 2 9 ]`` is written ``( ( ( [MAX 2 ) 9 ) ] )``. :func:`generate` writes exactly
that format; its *length* is the number of operator, digit and ``]`` tokens (the
parentheses are not counted), and an expression is kept when
``min_length < length < max_length`` (strict, as in the original).

The original draws each node with Python's global ``random`` and no seed: a node at
depth ``< max_depth`` is an operator with probability 1/4 (else a digit), an operator
takes ``randint(2, max_args)`` arguments, and the root has depth 1. Samples are kept
unique. :func:`generate` draws from the same distribution with a private seeded
``random.Random``, so a seed fixes the data set.

Tokenisation
------------
The released LRA pipeline tokenises ``Source`` with ``tfds``' default ``Tokenizer``,
which splits on ``\\W+`` and *drops* every non-alphanumeric character: the parentheses,
and also ``[`` and ``]``. The operators become ``MIN``, ``MAX``, ``MED``, ``SM`` and
the closing brackets vanish, which makes the nesting ambiguous (LRA issues #14 and #20;
the maintainers answered that the brackets are required). :func:`tokenize` offers both:

- ``brackets=True`` (default): operator tokens ``[MIN`` ... and ``]`` are kept, the
  parentheses are dropped (they are implied by the brackets). A length-``L`` expression
  becomes exactly ``L`` tokens.
- ``brackets=False``: the released LRA tokenisation, brackets dropped.

Ids follow ``tfds``' ``TokenTextEncoder``: 0 is padding, then the vocabulary (here in a
fixed order, the original's order depended on Python's set iteration), then one
out-of-vocabulary id. Sequences are truncated to ``max_length`` and right-padded.
"""
from __future__ import annotations

import random
import re
from collections.abc import Sequence

import torch

from companion._validate import check_int, check_str_sequence

MIN, MAX, MED, SUM_MOD, END = "[MIN", "[MAX", "[MED", "[SM", "]"
OPERATORS = (MIN, MAX, MED, SUM_MOD)
DIGITS = tuple(str(v) for v in range(10))
OPERATOR_PROBABILITY = 0.25  # the original's VALUE_P: P(node is an operator) below max depth

PAD_ID = 0
VOCAB_BRACKETS = OPERATORS + (END,) + DIGITS
VOCAB_LRA = tuple(op[1:] for op in OPERATORS) + DIGITS


def vocabulary(*, brackets: bool = True) -> dict[str, int]:
    """Token -> id map: 0 is padding, then the tokens, then the out-of-vocabulary id.

    ``len(vocabulary(brackets=b)) + 2`` is the embedding size a model needs
    (17 with brackets kept; 16 for the released LRA tokenisation, tfds' ``vocab_size``).

    Examples
    --------
    >>> len(vocabulary()), vocab_size()  # padding and OOV ids besides the 15 tokens
    (15, 17)
    """
    tokens = VOCAB_BRACKETS if brackets else VOCAB_LRA
    return {tok: i + 1 for i, tok in enumerate(tokens)}


def vocab_size(*, brackets: bool = True) -> int:
    """Number of ids used by :func:`encode`: padding + vocabulary + one OOV id.

    Examples
    --------
    >>> vocab_size(), vocab_size(brackets=False)
    (17, 16)
    """
    return len(VOCAB_BRACKETS if brackets else VOCAB_LRA) + 2


# --------------------------------------------------------------------------- generator
def _generate_tree(rng: random.Random, depth: int, max_depth: int, max_args: int):
    """One random expression tree in the original's nested-pair form, and its length.

    The tree is a digit (int), or ``(node, END)`` where ``node`` is a left fold of
    ``(op, first_arg)`` with the remaining arguments. The value is computed alongside
    (third return), from the argument values, never from the string.
    """
    r = rng.random() if depth < max_depth else 1.0
    if r > OPERATOR_PROBABILITY:
        value = rng.randrange(10)
        return value, 1, value
    length = 2  # the operator and its closing bracket
    num_args = rng.randint(2, max_args)
    args, values = [], []
    for _ in range(num_args):
        sub, sub_len, sub_val = _generate_tree(rng, depth + 1, max_depth, max_args)
        args.append(sub)
        values.append(sub_val)
        length += sub_len
    op = OPERATORS[rng.randrange(len(OPERATORS))]
    node = (op, args[0])
    for a in args[1:]:
        node = (node, a)
    return (node, END), length, _apply(op, values)


def _apply(op: str, values: list[int]) -> int:
    if op == MIN:
        return min(values)
    if op == MAX:
        return max(values)
    if op == MED:
        s = sorted(values)
        m = len(s) // 2
        return s[m] if len(s) % 2 else (s[m - 1] + s[m]) // 2
    return sum(values) % 10


def _to_string(tree) -> str:
    if isinstance(tree, str):
        return tree
    if isinstance(tree, int):
        return str(tree)
    return "( " + _to_string(tree[0]) + " " + _to_string(tree[1]) + " )"


def generate(
    n: int,
    *,
    seed: int,
    min_length: int = 500,
    max_length: int = 2000,
    max_depth: int = 10,
    max_args: int = 10,
    max_tries: int | None = None,
) -> list[tuple[str, int]]:
    """Draw ``n`` distinct ListOps expressions with their values.

    Parameters
    ----------
    n : int
        Number of examples (>= 1).
    seed : int
        Seed of the private random generator; the same seed gives the same list.
    min_length, max_length : int
        Keep an expression when ``min_length < length < max_length`` (length counts
        operators, digits and ``]``; LRA: 500 and 2000).
    max_depth : int
        Nodes at this depth are digits (LRA: 10; the root has depth 1).
    max_args : int
        Maximum arguments of an operator (LRA: 10; the minimum is 2).
    max_tries : int or None
        Give up (ValueError) after this many rejected draws; default ``1000 * n + 10**5``.

    Returns
    -------
    list of (source, target)
        ``source`` in the LRA string format, ``target`` the expression's value (0-9).

    Complexity
    ----------
    Expected O(n * T * R) where T is the mean tree size and R the mean number of draws
    per accepted expression (a few for the LRA settings).

    References
    ----------
    .. [1] N. Nangia, S. R. Bowman, "ListOps: A Diagnostic Dataset for Latent Tree
       Learning", NAACL SRW 2018, arXiv:1804.06028: the task.
    .. [2] Y. Tay, M. Dehghani, S. Abnar, Y. Shen, D. Bahri, P. Pham, J. Rao, L. Yang,
       S. Ruder, D. Metzler, "Long Range Arena: A Benchmark for Efficient Transformers",
       ICLR 2021, arXiv:2011.04006: its ListOps settings.

    Examples
    --------
    >>> pairs = generate(2, seed=0, min_length=5, max_length=40)
    >>> [evaluate(source) == value for source, value in pairs]
    [True, True]
    """
    for name, val in (("n", n), ("seed", seed), ("min_length", min_length),
                      ("max_length", max_length), ("max_depth", max_depth),
                      ("max_args", max_args)):
        check_int(name, val)
    check_int("n", n, minimum=1)
    if min_length < 0 or max_length <= min_length + 1:
        raise ValueError(
            f"min_length, max_length: expected 0 <= min_length < max_length - 1, "
            f"got {min_length}, {max_length}")
    if max_depth < 2:
        raise ValueError(f"max_depth: expected >= 2 (depth 1 is the root), got {max_depth}")
    if max_args < 2:
        raise ValueError(f"max_args: expected >= 2, got {max_args}")
    if max_tries is None:
        max_tries = 1000 * n + 10**5
    max_tries = check_int("max_tries", max_tries, minimum=1)
    rng = random.Random(seed)
    found: dict[str, int] = {}
    tries = 0
    while len(found) < n:
        tries += 1
        if tries > max_tries:
            raise ValueError(
                f"generate: only {len(found)} of {n} expressions with "
                f"{min_length} < length < {max_length} after {max_tries} draws; "
                f"widen the length range or raise max_depth/max_args")
        tree, length, value = _generate_tree(rng, 1, max_depth, max_args)
        if min_length < length < max_length:
            source = _to_string(tree)
            if source not in found:
                found[source] = value
    return list(found.items())


# --------------------------------------------------------------------------- evaluator
_TOKEN_RE = re.compile(r"\[MIN|\[MAX|\[MED|\[SM|\]|\d")


def evaluate(source: str) -> int:
    """Value of a ListOps expression, parsed from its string.

    Written independently of :func:`generate`: the string is scanned left to right with
    an explicit stack (parentheses ignored, they only group pairs), so it accepts both
    the parenthesised LRA format and plain ``[MAX 2 9 ]``.

    Raises
    ------
    ValueError
        If ``source`` is not a well-formed expression.

    Complexity
    ----------
    O(L log L) for a string with L tokens (sorting for medians).

    Examples
    --------
    >>> evaluate("[MAX 2 9 [MIN 4 7 ] 0 ]")
    9
    """
    if not isinstance(source, str):
        raise TypeError(f"source: expected a str, got {type(source).__name__}")
    stripped = source.replace("(", " ").replace(")", " ")
    tokens = stripped.split()
    if not tokens:
        raise ValueError("source: expected a ListOps expression, got an empty string")
    stack: list[list] = []  # frames: [operator, list of argument values]
    result: int | None = None
    for tok in tokens:
        if not _TOKEN_RE.fullmatch(tok):
            raise ValueError(f"source: unexpected token {tok!r}")
        if result is not None:
            raise ValueError(f"source: trailing token {tok!r} after a complete expression")
        if tok in OPERATORS:
            stack.append([tok, []])
        elif tok == END:
            if not stack:
                raise ValueError("source: ']' without an open operator")
            op, args = stack.pop()
            if len(args) < 1:
                raise ValueError(f"source: operator {op} closed without arguments")
            value = _reduce(op, args)
            if stack:
                stack[-1][1].append(value)
            else:
                result = value
        else:
            if stack:
                stack[-1][1].append(int(tok))
            else:
                result = int(tok)
    if stack:
        raise ValueError(f"source: {len(stack)} operator(s) never closed")
    assert result is not None
    return result


def _reduce(op: str, args: list[int]) -> int:
    # Deliberately a different formulation from the generator's _apply.
    if op == "[SM":
        total = 0
        for a in args:
            total = (total + a) % 10
        return total
    ordered = sorted(args)
    if op == "[MIN":
        return ordered[0]
    if op == "[MAX":
        return ordered[-1]
    lo, hi = ordered[(len(ordered) - 1) // 2], ordered[len(ordered) // 2]
    return int((lo + hi) / 2)


# ------------------------------------------------------------------------- tokenisation
def tokenize(source: str, *, brackets: bool = True) -> list[str]:
    """Tokens of ``source``; see the module docstring for the two conventions.

    ``brackets=False`` reproduces the released LRA pipeline (tfds ``Tokenizer``:
    split on ``\\W+``, keep alphanumeric pieces only).

    Examples
    --------
    >>> tokenize("[MAX 2 [MIN 4 7 ] ]")
    ['[MAX', '2', '[MIN', '4', '7', ']', ']']
    >>> tokenize("[MAX 2 [MIN 4 7 ] ]", brackets=False)
    ['MAX', '2', 'MIN', '4', '7']
    """
    if not isinstance(source, str):
        raise TypeError(f"source: expected a str, got {type(source).__name__}")
    if brackets:
        return [t for t in source.split() if t not in ("(", ")")]
    return [t for t in re.split(r"\W+", source) if t]


def encode(
    sources: Sequence[str],
    *,
    max_length: int,
    brackets: bool = True,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """Token ids, truncated to ``max_length`` and right-padded with 0.

    Returns
    -------
    torch.Tensor
        int64 tensor of shape ``[len(sources), max_length]`` on ``device`` (CPU if None).

    Examples
    --------
    >>> encode(["[MAX 2 9 ]"], max_length=6)
    tensor([[ 2,  8, 15,  5,  0,  0]])
    """
    max_length = check_int("max_length", max_length, minimum=1)
    sources = check_str_sequence("sources", sources)
    vocab = vocabulary(brackets=brackets)
    oov = len(vocab) + 1
    out = torch.zeros(len(sources), max_length, dtype=torch.long)
    for row, src in enumerate(sources):
        ids = [vocab.get(t, oov) for t in tokenize(src, brackets=brackets)][:max_length]
        if ids:
            out[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out if device is None else out.to(device)


def dataset(
    pairs: Sequence[tuple[str, int]],
    *,
    max_length: int,
    brackets: bool = True,
    device: str | torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [n, max_length] int64, targets [n] int64)`` from :func:`generate`'s list.

    Examples
    --------
    >>> tokens, targets = dataset([("[MAX 2 9 ]", 9), ("[MIN 4 7 ]", 4)], max_length=8)
    >>> tokens.shape, targets.tolist()
    (torch.Size([2, 8]), [9, 4])
    """
    tokens = encode([s for s, _ in pairs], max_length=max_length, brackets=brackets,
                    device=device)
    targets = torch.tensor([t for _, t in pairs], dtype=torch.long, device=tokens.device)
    return tokens, targets


def depth(source: str) -> int:
    """Nesting depth of an expression (a digit has depth 0), from its brackets.

    Examples
    --------
    >>> depth("[MAX 2 9 [MIN 4 7 ] 0 ]"), depth("3")
    (2, 0)
    """
    deepest = level = 0
    for tok in tokenize(source, brackets=True):
        if tok in OPERATORS:
            level += 1
            deepest = max(deepest, level)
        elif tok == END:
            level -= 1
    return deepest
