"""Masks: closed forms against element-wise definitions, mask_mods against dense masks,
and the mask registry (every mask_mod has its predicate and its reference pair)."""
import importlib
import inspect
import itertools
import pkgutil

import pytest
import torch

import companion.hasse
from companion.hasse import masks as M
from companion.hasse import reference as ref
from reference_pairs import hasse as hasse_pairs


def _from_predicate(n, pred):
    return torch.tensor([[bool(pred(q, k)) for k in range(n)] for q in range(n)])


@pytest.mark.parametrize("n", [1, 2, 7, 16])
def test_dense_builders_match_definitions(n):
    assert torch.equal(M.causal(n), _from_predicate(n, lambda q, k: k <= q))
    assert torch.equal(M.chain(n), _from_predicate(n, lambda q, k: k == q - 1))
    assert torch.equal(M.bidirectional(n), _from_predicate(n, lambda q, k: True))
    for w in (1, 2, 3, 5):
        assert torch.equal(
            M.sliding_window(n, w), _from_predicate(n, lambda q, k: 0 <= q - k < w)
        )
    for b in (1, 2, 3, 4):
        assert torch.equal(
            M.block_causal(n, b), _from_predicate(n, lambda q, k: k // b <= q // b)
        )
    for p in range(0, n + 1, max(1, n // 3)):
        assert torch.equal(
            M.prefix_lm(n, p), _from_predicate(n, lambda q, k: k < p or k <= q)
        )


def test_random_mask_density_and_diagonal():
    g = torch.Generator().manual_seed(1)
    m = M.random_mask(400, 0.1, generator=g)
    assert m.dtype == torch.bool and not m.diagonal().any()
    frac = m.sum().item() / (400 * 399)
    assert abs(frac - 0.1) < 0.01
    assert not M.random_mask(50, 0.0).any()
    assert M.random_mask(50, 1.0).sum().item() == 50 * 49


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [2, 0, 3, 1], [4, 3, 2, 1, 0]])
def test_xlnet_two_stream(order):
    n = len(order)
    rank = {tok: t for t, tok in enumerate(order)}
    masks = M.xlnet_two_stream(order)
    for i, j in itertools.product(range(n), repeat=2):
        assert masks.content[i, j] == (rank[j] <= rank[i])
        assert masks.query[i, j] == (rank[j] < rank[i])
    assert not masks.query.diagonal().any()  # the query stream never sees its own token
    assert masks.content.diagonal().all()
    assert torch.equal(masks.joint[:n, :n], masks.content)
    assert torch.equal(masks.joint[n:, :n], masks.query)
    assert not masks.joint[:, n:].any()


def test_block_two_stream_closed_form():
    # element-wise restatement of the docstring
    for n, b in [(1, 1), (6, 2), (7, 3), (8, 4), (5, 5)]:
        c = ((n - 1) // b) * b
        m = M.block_two_stream_mask(n, b)
        assert m.shape == (c + n, c + n)
        for q, k in itertools.product(range(c + n), repeat=2):
            if q < c:
                want = k < c and k // b <= q // b
            else:
                t = q - c
                want = (k < c and k // b < t // b) or (k >= c and (k - c) // b == t // b)
            assert bool(m[q, k]) == want, (n, b, q, k)


def test_butterfly_closed_form():
    for n in (2, 3, 6):
        lay = M.butterfly_layout(n)
        m = M.butterfly_mask(n)
        assert m.shape == (3 * n - 2, 3 * n - 2)
        fwd = {p: p for p in lay["forward"]}
        bwd = {p: p - (n - 1) + 1 for p in lay["backward"]}
        pred = {p: p - (2 * n - 2) for p in lay["predict"]}
        for q, k in itertools.product(range(3 * n - 2), repeat=2):
            if q in fwd:
                want = k in fwd and fwd[k] <= fwd[q]
            elif q in bwd:
                want = k in bwd and bwd[k] >= bwd[q]
            else:
                want = (k in fwd and fwd[k] < pred[q]) or (k in bwd and bwd[k] > pred[q]) or q == k
            assert bool(m[q, k]) == want


@pytest.mark.parametrize("n", [1, 5, 12])
def test_named_mask_mods_match_dense(n):
    pairs = [
        (M.causal_mask_mod, M.causal(n)),
        (M.chain_mask_mod, M.chain(n)),
        (M.sliding_window_mask_mod(3), M.sliding_window(n, 3)),
        (M.block_causal_mask_mod(4), M.block_causal(n, 4)),
        (M.prefix_lm_mask_mod(2), M.prefix_lm(n, min(2, n))),
    ]
    for mod, dense in pairs:
        if dense.shape[0] == n and mod is not None:
            assert torch.equal(M.materialise(mod, n), dense)
    assert torch.equal(M.materialise(M.mask_mod(M.causal(n)), n), M.causal(n))
    b2 = M.block_two_stream_mask(n, 2)
    assert torch.equal(M.materialise(M.block_two_stream_mask_mod(n, 2), b2.shape[0]), b2)
    if n >= 2:
        bf = M.butterfly_mask(n)
        assert torch.equal(M.materialise(M.butterfly_mask_mod(n), bf.shape[0]), bf)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="n: expected an int >= 1"):
        M.causal(0)
    with pytest.raises(TypeError, match="n: expected an int"):
        M.causal(3.0)
    with pytest.raises(ValueError, match="width"):
        M.sliding_window(4, 0)
    with pytest.raises(ValueError, match="prefix"):
        M.prefix_lm(4, 5)
    with pytest.raises(ValueError, match="order: expected a permutation"):
        M.xlnet_two_stream([0, 0, 1])
    with pytest.raises(ValueError, match="p: expected a probability"):
        M.random_mask(4, 1.5)
    with pytest.raises(ValueError, match=r"expected a square 2-D bool tensor, got shape \(3, 4\)"):
        M.validate_mask(torch.zeros(3, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask: expected a square 2-D bool tensor, got dtype"):
        M.validate_mask(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="non-empty"):
        M.validate_mask(torch.zeros(0, 0, dtype=torch.bool))
    with pytest.raises(TypeError):
        M.validate_mask([[True]])
    with pytest.raises(ValueError, match="n: expected an int >= 2"):
        M.butterfly_mask(1)


@pytest.mark.parametrize("n", [1, 6, 13])
def test_and_or_combinators_match_elementwise_logic(n):
    """and_masks / or_masks against the element-wise and / or of the predicates."""
    preds = {"causal": lambda q, k: k <= q, "window3": lambda q, k: 0 <= q - k < 3,
             "prefix2": lambda q, k: k < 2 or k <= q, "chain": lambda q, k: k == q - 1}
    mods = {"causal": M.causal_mask_mod, "window3": M.sliding_window_mask_mod(3),
            "prefix2": M.prefix_lm_mask_mod(2), "chain": M.chain_mask_mod}
    for a, b in itertools.combinations(preds, 2):
        both = M.materialise(M.and_masks(mods[a], mods[b]), n)
        either = M.materialise(M.or_masks(mods[a], mods[b]), n)
        pa, pb = preds[a], preds[b]
        assert torch.equal(both, _from_predicate(n, lambda q, k: pa(q, k) and pb(q, k)))
        assert torch.equal(either, _from_predicate(n, lambda q, k: pa(q, k) or pb(q, k)))
    assert M.materialise(M.and_masks(), n).all()
    assert not M.materialise(M.or_masks(), n).any()


def test_mask_mod_names_carry_their_parameters():
    assert M.sliding_window_mask_mod(64).__name__ == "sliding_window_64"
    assert M.block_causal_mask_mod(8).__name__ == "block_causal_8"
    assert M.prefix_lm_mask_mod(3).__name__ == "prefix_lm_3"
    assert M.block_two_stream_mask_mod(9, 4).__name__ == "block_two_stream_9_4"
    assert M.butterfly_mask_mod(5).__name__ == "butterfly_5"
    assert M.and_masks(M.causal_mask_mod, M.sliding_window_mask_mod(4)).__name__ == \
        "and(causal,sliding_window_4)"
    with pytest.raises(TypeError, match="mods"):
        M.and_masks(M.causal_mask_mod, 3)


def test_materialise_broadcasts_a_mod_of_one_index():
    """A mod that reads only q_idx gives a full (n, n) mask, not a column."""
    def even_queries(b, h, q_idx, kv_idx):
        return q_idx % 2 == 0

    m = M.materialise(even_queries, 5)
    assert m.shape == (5, 5) and m.is_contiguous()
    assert torch.equal(m, _from_predicate(5, lambda q, k: q % 2 == 0))


# ----------------------------------------------------------------- the mask registry
ADDING_A_MASK = (
    "a mask lives in three places: its mask_mod `NAME_mask_mod` in "
    "lib/companion/hasse/masks.py, its predicate `PREDICATES['NAME']` in "
    "lib/companion/hasse/reference.py, and its entry in `_MODS` of "
    "tests/reference_pairs/hasse.py (the pair `hasse.materialise.NAME`)")


def _public_mask_mods() -> dict[str, str]:
    """Every public ``*_mask_mod`` function defined in a module of companion.hasse, by mask
    name (``causal_mask_mod`` -> ``causal``), with where it is defined."""
    found = {}
    for info in pkgutil.iter_modules(companion.hasse.__path__):
        module = importlib.import_module(f"companion.hasse.{info.name}")
        for name, obj in inspect.getmembers(module, inspect.isfunction):
            if (name.endswith("_mask_mod") and not name.startswith("_")
                    and obj.__module__ == module.__name__):
                found[name.removesuffix("_mask_mod")] = f"{module.__name__}.{name}"
    return found


def _pair_masks() -> set[str]:
    prefix = "hasse.materialise."
    return {p.name.removeprefix(prefix) for p in hasse_pairs.PAIRS if p.name.startswith(prefix)}


def check_mask_registry(mods: dict[str, str], predicates, pairs: set[str]) -> None:
    """Raise AssertionError, naming the missing places, unless every mask_mod has a
    predicate and a reference pair and every predicate or pair has its mask_mod."""
    problems = []
    for name, where in sorted(mods.items()):
        if name not in predicates:
            problems.append(f"{where} has no predicate PREDICATES[{name!r}] in "
                            "lib/companion/hasse/reference.py")
        if name not in pairs:
            problems.append(f"{where} has no reference pair: add ({name!r}, ...) to _MODS in "
                            "tests/reference_pairs/hasse.py")
    for name in sorted(set(predicates) - set(mods)):
        problems.append(f"PREDICATES[{name!r}] in lib/companion/hasse/reference.py has no "
                        f"{name}_mask_mod in companion.hasse")
    for name in sorted(pairs - set(mods)):
        problems.append(f"the pair hasse.materialise.{name} in tests/reference_pairs/hasse.py "
                        f"has no {name}_mask_mod in companion.hasse")
    assert not problems, "; ".join(problems) + f" ({ADDING_A_MASK})"


def test_every_mask_mod_has_a_predicate_and_a_reference_pair():
    mods = _public_mask_mods()
    assert {"causal", "random", "butterfly", "block_two_stream"} <= set(mods)
    check_mask_registry(mods, ref.PREDICATES, _pair_masks())


def test_a_forgotten_step_of_a_new_mask_fails_and_names_the_other_places(monkeypatch):
    def diagonal_mask_mod(b, h, q_idx, kv_idx):
        return q_idx == kv_idx

    diagonal_mask_mod.__module__ = M.__name__
    monkeypatch.setattr(M, "diagonal_mask_mod", diagonal_mask_mod, raising=False)
    mods = _public_mask_mods()
    assert mods["diagonal"] == "companion.hasse.masks.diagonal_mask_mod"
    with pytest.raises(AssertionError) as both:  # the mask_mod alone
        check_mask_registry(mods, ref.PREDICATES, _pair_masks())
    assert "reference.py" in str(both.value) and "reference_pairs/hasse.py" in str(both.value)
    predicates = {**ref.PREDICATES, "diagonal": lambda: lambda q, k: q == k}
    with pytest.raises(AssertionError, match="no reference pair") as pair_only:
        check_mask_registry(mods, predicates, _pair_masks())
    assert "no predicate" not in str(pair_only.value)
    without_mod = {k: v for k, v in mods.items() if k != "diagonal"}
    with pytest.raises(AssertionError, match=r"PREDICATES\['diagonal'\].*no diagonal_mask_mod"):
        check_mask_registry(without_mod, predicates, _pair_masks())
    check_mask_registry(mods, predicates, _pair_masks() | {"diagonal"})
