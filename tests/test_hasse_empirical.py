"""The theory on a real network: Jacobian dependency patterns, leakage, train = inference,
and FlexAttention mask_mods against SDPA."""
import contextlib
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from companion.hasse import masks as M
from companion.hasse import masked_transformer as MT
from companion.hasse import reachability as RR
from companion.hasse import task_merge as T


@pytest.fixture(scope="module")
def model():
    return MT.init_masked_transformer(
        d_model=8, n_layers=4, n_heads=2, generator=torch.Generator().manual_seed(0)
    )


def _masks():
    g = torch.Generator().manual_seed(1)
    return {
        "chain": M.chain(10),
        "window3": M.sliding_window(12, 3),
        "block_causal": M.block_causal(12, 4),
        "random": M.random_mask(12, 0.12, generator=g),
        "xlnet": M.xlnet_two_stream([3, 0, 4, 1, 2]).joint,
        "block_two_stream": M.block_two_stream_mask(6, 2),
        "butterfly": M.butterfly_mask(4),
    }


@pytest.mark.parametrize("name", list(_masks()))
def test_jacobian_pattern_equals_reachability(model, name):
    mask = _masks()[name]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(mask.shape[0], 8, dtype=torch.float64, generator=gen)
    for layers in range(1, 5):
        pattern = MT.dependency_pattern(model, x, mask, n_layers=layers)
        assert torch.equal(pattern, RR.reachability(mask, layers)), (name, layers)


@pytest.mark.parametrize("n", [3, 5, 7])
def test_butterfly_prediction_ignores_own_token(model, n):
    task = T.butterfly(n)
    emb = torch.randn(n, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    for layers in (1, 2, 4):
        dep = MT.token_dependencies(model, task, emb, n_layers=layers)
        for p, target in enumerate(task.targets):
            if target is None:
                continue
            assert not dep[p, target]  # gradient exactly zero through the input construction
            assert dep[p].sum() == n - 1  # ... and every other token matters


def test_zero_diagonal_mask_still_leaks(model):
    task = T.leaky_bidirectional(5)
    emb = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    dep = MT.token_dependencies(model, task, emb, n_layers=2)
    assert dep.diagonal().all()


@pytest.mark.parametrize("n,block", [(6, 1), (8, 2), (9, 3), (10, 4)])
def test_block_two_stream_train_equals_inference(model, n, block):
    task = T.block_two_stream(n, block)
    emb = torch.randn(n, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    x = MT.embed_task_inputs(model, task, emb)
    one_pass = MT.masked_transformer(model, x, task.mask)
    incremental = MT.incremental_forward(
        model, x, task.mask, MT.block_two_stream_schedule(n, block)
    )
    assert (one_pass - incremental).abs().max().item() < 1e-12


def test_causal_kv_cache_decoding_and_bad_schedules(model):
    mask = M.causal(9)
    x = torch.randn(9, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    full = MT.masked_transformer(model, x, mask)
    step = MT.incremental_forward(model, x, mask, [[p] for p in range(9)])
    assert (full - step).abs().max().item() < 1e-12
    with pytest.raises(ValueError, match="later group"):
        MT.incremental_forward(model, x, M.bidirectional(9), [[p] for p in range(9)])
    with pytest.raises(ValueError, match="partition"):
        MT.incremental_forward(model, x, mask, [[0, 1]])
    # block two-stream: generating block k's masks before block k-1's content would
    # need the future, and is refused
    task = T.block_two_stream(6, 2)
    x6 = MT.embed_task_inputs(model, task, torch.zeros(6, 8, dtype=torch.float64))
    schedule = MT.block_two_stream_schedule(6, 2)
    swapped = [schedule[0], schedule[2], schedule[1]] + schedule[3:]
    with pytest.raises(ValueError, match="later group"):
        MT.incremental_forward(model, x6, task.mask, swapped)


def test_bad_inputs(model):
    with pytest.raises(ValueError, match="x: expected"):
        MT.masked_transformer(model, torch.zeros(3, 5, dtype=torch.float64), M.causal(3))
    with pytest.raises(ValueError, match="x: expected 4 positions"):
        MT.masked_transformer(model, torch.zeros(3, 8, dtype=torch.float64), M.causal(4))
    with pytest.raises(ValueError, match="n_heads"):
        MT.init_masked_transformer(d_model=8, n_heads=3)


def _flex_cases():
    n = 6
    dense = M.random_mask(33, 0.3, generator=torch.Generator().manual_seed(0))
    return {
        "causal": (M.causal_mask_mod, M.causal(40)),
        "sliding_window": (M.sliding_window_mask_mod(7), M.sliding_window(40, 7)),
        "block_causal": (M.block_causal_mask_mod(8), M.block_causal(40, 8)),
        "prefix_lm": (M.prefix_lm_mask_mod(9), M.prefix_lm(40, 9)),
        "chain": (M.chain_mask_mod, M.chain(40)),
        "block_two_stream": (M.block_two_stream_mask_mod(16, 4), M.block_two_stream_mask(16, 4)),
        "butterfly": (M.butterfly_mask_mod(n), M.butterfly_mask(n)),
        "dense_lookup": (M.mask_mod(dense), dense),
    }


@pytest.mark.parametrize("name", list(_flex_cases()))
def test_flex_attention_matches_sdpa_cpu(name):
    mod, dense = _flex_cases()[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention warns that it is unfused
        res = MT.flex_vs_sdpa(mod, dense, generator=torch.Generator().manual_seed(0))
    assert res["max_abs_diff"] < 1e-5
    assert res["empty_rows_zero"]
    assert res["sdpa_empty_rows_zero"]  # SDPA on the CPU gives 0 too (see below)
    assert res["empty_rows"] == int((~dense.any(dim=1)).sum())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flex_attention_matches_sdpa_cuda_compiled():
    for name, (mod, dense) in _flex_cases().items():
        if name == "dense_lookup":
            mod = M.mask_mod(dense.cuda())
        res = MT.flex_vs_sdpa(mod, dense, device="cuda", compile=True,
                              generator=torch.Generator().manual_seed(0))
        assert res["max_abs_diff"] < 2e-3, name


# ------------------------------------------------------- SDPA on rows with no key
def _reference_attention(q, k, v, mask):
    """float64 softmax attention row by row over the allowed keys only (None: no key)."""
    q, k, v = q.double(), k.double(), v.double()
    out = [[None] * q.shape[-2] for _ in range(q.shape[1])]
    for h in range(q.shape[1]):
        for row in range(q.shape[-2]):
            keys = torch.nonzero(mask[row]).ravel()
            if keys.numel():
                scores = k[0, h, keys] @ q[0, h, row] / math.sqrt(q.shape[-1])
                out[h][row] = torch.softmax(scores, 0) @ v[0, h, keys]
    return out


def _mask_with_empty_rows():
    mask = M.random_mask(9, 0.4, generator=torch.Generator().manual_seed(5))
    mask[[0, 4]] = False  # two queries with no key, one of them mid-sequence
    return mask


# What SDPA gives on a row with no allowed key, per backend, with torch 2.13 on the CPU.
# A new torch that changes a line of this table fails the test below: then update the
# module docstring of companion.hasse.masked_transformer and the Hasse chapter's FlexAttention
# section, which state this behaviour.
SDPA_CPU_EMPTY_ROWS = {
    "default": "zero",
    "MATH": "zero",  # the math backend's softmax zeroes fully masked rows
    "FLASH_ATTENTION": "zero",
    "EFFICIENT_ATTENTION": "unavailable on the CPU",
    "CUDNN_ATTENTION": "unavailable on the CPU",
}


@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("backend", list(SDPA_CPU_EMPTY_ROWS))
def test_sdpa_output_on_rows_without_keys_per_cpu_backend(backend, dtype, mask_kind):
    mask = _mask_with_empty_rows()
    empty = ~mask.any(dim=1)
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=g, dtype=dtype).requires_grad_()
               for _ in range(3))
    attn_mask = mask if mask_kind == "bool" else torch.zeros(9, 9, dtype=dtype).masked_fill(
        ~mask, float("-inf"))
    expected = SDPA_CPU_EMPTY_ROWS[backend]
    choice = (contextlib.nullcontext() if backend == "default"  # torch picks the backend
              else sdpa_kernel(getattr(SDPBackend, backend)))
    with choice:
        if expected == "unavailable on the CPU":
            with pytest.raises(RuntimeError, match="No viable backend"):
                F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
            return
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    assert expected == "zero"
    assert torch.all(out[:, :, empty] == 0), "SDPA no longer returns 0 on rows without a key"
    ref = _reference_attention(q.detach(), k.detach(), v.detach(), mask)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for h in range(2):
        for row in torch.nonzero(~empty).ravel().tolist():
            torch.testing.assert_close(out[0, h, row].double(), ref[h][row], rtol=tol, atol=tol)
    out.sum().backward()
    for grad in (q.grad, k.grad, v.grad):
        assert torch.isfinite(grad).all()
    assert torch.all(q.grad[:, :, empty] == 0)  # the empty rows depend on nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_our_attention_agrees_with_sdpa_on_every_row(dtype):
    """companion's masked attention gives SDPA's output, empty rows (zeros) included."""
    mask = _mask_with_empty_rows()
    d, heads = 8, 2
    eye = torch.eye(d, dtype=dtype)
    layer = {"wq": eye, "wk": eye, "wv": eye, "wo": eye}  # plain multi-head attention
    g = torch.Generator().manual_seed(7)
    h_q, h_kv = (torch.randn(9, d, generator=g, dtype=dtype) for _ in range(2))
    ours = MT._attention(h_q, h_kv, mask, layer, heads)

    def split(h):  # (P, d) -> (1, heads, P, d / heads)
        return h.view(9, heads, d // heads).transpose(0, 1).unsqueeze(0)

    sdpa = F.scaled_dot_product_attention(split(h_q), split(h_kv), split(h_kv),
                                          attn_mask=mask)
    sdpa = sdpa[0].transpose(0, 1).reshape(9, d)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(ours, sdpa, rtol=tol, atol=tol)
    assert torch.all(ours[~mask.any(dim=1)] == 0)
