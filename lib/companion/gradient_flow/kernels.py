"""The fast step kernel: the softmax moments of every head and every path in a few GEMMs.

:func:`step_quantities` reads the drift, energy, rates and slopes off the softmax moments
(:math:`\\sum_j U^h_{ij}`, :math:`\\sum_j U^h_{ij} x_j` and, with noise,
:math:`\\sum_{ij} U^h_{ij}(1 + \\langle x_i, x_j\\rangle^2)`). Because every ``D_h`` is
symmetric, so is every ``U^h``: a block of query rows is exponentiated once against the keys
at and after it, and the same exponentials are handed, transposed, to the later rows; a
step costs about :math:`H n^2 / 2` exponentials per path instead of :math:`H n^2`. All heads
of a block are one GEMM (``D_h x_i`` computed once and reused for every key), one
vectorised exponential and two GEMMs for the moments; no ``n x n`` matrix per head is stored
and memory is :math:`O(P H n d)` plus one cache-sized block. Weights so large that unshifted
exponentials could overflow take a max-shifted, row-chunked path.

The tuning (block sizes, chunk sizes, forcing the shifted path, ``exp`` or ``exp2``, torch's
or numpy's GEMMs for the blocks) is a :class:`KernelTuning` argument with defaults; no
module state. The reference these kernels are tested against is
:mod:`companion.gradient_flow.reference`.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from companion._validate import check_choice, check_int
from companion.gradient_flow._checks import check_step_args

__all__ = ["KernelTuning", "step_quantities", "velocity"]

_LOG2E = 1.0 / math.log(2.0)


@dataclass(frozen=True)
class KernelTuning:
    """How the step kernel tiles its work (results agree to rounding for any setting).

    Parameters
    ----------
    block_elements : int or None
        Exponentials per block of the symmetric kernel. None: ``2**18`` on CPU (a block
        of float64 exponentials is 2 MiB and stays in a core's L2 with its moments; the
        block sizes measured against each other are in
        ``benchmarks/bench_gradient_flow.py``), ``2**25`` elsewhere (one block per group
        of paths: few, large kernel launches). The block size sets the order of the sums,
        so trajectories agree between sizes to rounding, not bit for bit.
    shifted_chunk_elements : int
        Logits per row chunk of the max-shifted path.
    exp_shift : {"auto", "always"}
        ``"auto"``: unshifted exponentials where they cannot overflow, else the
        max-shifted path; ``"always"``: the max-shifted path whatever the weights.
    plan_paths : int or None
        Choose between whole matrices and row blocks as for this many paths (None: the
        paths given). A piece of a run (:func:`~companion.gradient_flow.simulate_many`)
        passes its run's number, so that it takes the run's layout and rounding.
    exponential : {"auto", "exp", "exp2"}
        How the symmetric kernel exponentiates its logits: ``"exp"``, ``torch.exp``;
        ``"exp2"``, ``torch.exp2`` with ``log2 e`` folded into the weights (the same
        numbers to rounding). ``"auto"`` (see :meth:`exponential_for`): ``"exp"`` on an
        Intel CPU with torch built on MKL and off the CPU, ``"exp2"`` on any other CPU.
        The choice follows the machine, never a timing, so that every process on one
        machine (the workers of :func:`~companion.gradient_flow.simulate_many`
        included) takes the same one and rounds alike. Why: torch's ``exp`` of a
        contiguous tensor is MKL's vector exponential, which is fast on Intel and takes
        a slow generic path elsewhere; ``exp2`` is torch's own vectorised code
        everywhere. Measured, 1 thread, in place on cache-resident blocks: on an AVX-512
        Intel Xeon float64 ``exp`` 0.62 ns per element against 1.08 for ``exp2``
        (float32 0.19 against 0.35); on an AVX-512 AMD EPYC float64 1.64 against 0.84
        (float32 0.83 against 0.32).
    backend : {"auto", "torch", "numpy"}
        Which library runs the symmetric kernel's two GEMMs per block (logits and row
        sums) and its exponential: ``"torch"``, ``torch.mm`` and ``Tensor.exp_`` (or
        ``exp2_``); ``"numpy"``, ``numpy.matmul`` and ``numpy.exp`` (or ``exp2``) on the
        same memory, CPU tensors only, with numpy's BLAS on one thread per worker
        (:func:`_one_blas_thread`). The same numbers to rounding. ``"auto"`` (see
        :meth:`backend_for`): ``"torch"`` off the CPU and on an Intel CPU with torch built
        on MKL, ``"numpy"`` on any other CPU; like ``exponential``, the choice follows
        the machine, never a timing. Why: these GEMMs are thin (an inner dimension of
        ``d`` = 3 for the logits, ``d + 1`` = 4 rows for the sums); torch's CPU GEMM is
        MKL's, and on the AMD processor measured numpy's OpenBLAS ran them twice as fast.
        Measured on an AVX-512 AMD EPYC, 1 thread, float64, one block of 107 keys by 13
        rows x 100 heads: logits 25 against 50 us, row sums 22 against 51 us, ``exp2``
        0.71 against 0.85 ns per element; the whole step kernel at the paper's setting
        1.25x faster. Not measured on Intel, where ``"auto"`` keeps torch.

    >>> KernelTuning(block_elements=64).block_elements_for(torch.device("cpu"))
    64
    >>> KernelTuning().block_elements_for(torch.device("cpu"))
    262144
    >>> KernelTuning(exponential="exp2").exponential_for(torch.device("cpu"))
    'exp2'
    >>> KernelTuning(backend="torch").backend_for(torch.device("cpu"))
    'torch'
    """

    block_elements: int | None = None
    shifted_chunk_elements: int = 1 << 25
    exp_shift: str = "auto"
    plan_paths: int | None = None
    exponential: str = "auto"
    backend: str = "auto"

    def __post_init__(self):
        if self.block_elements is not None:
            check_int("block_elements", self.block_elements, 1)
        check_int("shifted_chunk_elements", self.shifted_chunk_elements, 1)
        check_choice("exp_shift", self.exp_shift, ("auto", "always"))
        if self.plan_paths is not None:
            check_int("plan_paths", self.plan_paths, 1)
        check_choice("exponential", self.exponential, ("auto", "exp", "exp2"))
        check_choice("backend", self.backend, ("auto", "torch", "numpy"))

    def block_elements_for(self, device: torch.device) -> int:
        """The block size on ``device``: the field, or the per-device default."""
        if self.block_elements is not None:
            return self.block_elements
        return 1 << 18 if device.type == "cpu" else 1 << 25

    def exponential_for(self, device: torch.device) -> str:
        """``"exp"`` or ``"exp2"`` on ``device``: the field, or the machine's default
        (``"exp"`` off the CPU and on an Intel CPU with torch built on MKL)."""
        if self.exponential != "auto":
            return self.exponential
        if device.type != "cpu" or _mkl_exp_on_intel():
            return "exp"
        return "exp2"

    def backend_for(self, device: torch.device) -> str:
        """``"torch"`` or ``"numpy"`` on ``device``: the field, or the machine's default
        (``"torch"`` off the CPU and on an Intel CPU with torch built on MKL). Raises
        ValueError for ``"numpy"`` off the CPU."""
        if self.backend == "numpy" and device.type != "cpu":
            raise ValueError(f"backend: 'numpy' runs on CPU tensors only, got tensors on "
                             f"{device}; use 'torch' or 'auto'")
        if self.backend != "auto":
            return self.backend
        if device.type != "cpu" or _mkl_exp_on_intel():
            return "torch"
        return "numpy"


@functools.lru_cache(maxsize=1)
def _mkl_exp_on_intel() -> bool:
    """Whether torch's CPU ``exp`` is MKL's vector exponential on an Intel CPU (its fast
    case): torch built with MKL, and the CPU's vendor (``/proc/cpuinfo``, else
    :func:`platform.processor`) is ``GenuineIntel``."""
    if not torch.backends.mkl.is_available():
        return False
    vendor = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    vendor = line.split(":", 1)[1].strip()
                    break
    except OSError:
        import platform

        vendor = platform.processor()
    return "GenuineIntel" in vendor


DEFAULT_TUNING = KernelTuning()


@functools.lru_cache(maxsize=1)
def _blas_controller():
    """threadpoolctl's handle on numpy's BLAS (found once, when first needed)."""
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController().select(user_api="blas")


@contextlib.contextmanager
def _one_blas_thread():
    """numpy's BLAS on one thread inside (restored on leaving).

    The workers of :func:`_symmetric_exp_moments` each take whole paths; a BLAS that
    split a block's GEMM over its own threads as well would run more threads than cores.
    The setting is process-wide: another thread's numpy GEMMs meanwhile run on one thread
    too.
    """
    with _blas_controller().limit(limits=1):
        yield


def _unshifted_exp_limit(dtype: torch.dtype, n: int, heads: int) -> float:
    """Largest ``c`` with every ``exp(l)``, ``|l| <= c``, and every sum of ``4 n^2 H`` of
    them representable as a normal number of ``dtype`` (no shift needed)."""
    info = torch.finfo(dtype)
    return min(math.log(info.max) - math.log(4.0 * n * n * heads), -math.log(info.tiny))


class _Scratch:
    """Scratch tensors and kernel plans reused by every step of one simulation.

    The same memory each step: no page faults for fresh pages and caches stay warm. A
    buffer is replaced when the shape, dtype or device asked for changes; a plan
    (:class:`_SymmetricPlan`) is kept per layout.
    """

    def __init__(self):
        self._tensors = {}
        self.plans = {}

    def get(self, name: str, shape: tuple, kw: dict) -> torch.Tensor:
        t = self._tensors.get(name)
        if t is None or tuple(t.shape) != tuple(shape) or t.dtype != kw["dtype"] \
                or t.device != kw["device"]:
            t = self._tensors[name] = torch.empty(shape, **kw)
        return t


def _empty(scratch: _Scratch | None, name: str, shape: tuple, kw: dict) -> torch.Tensor:
    return torch.empty(shape, **kw) if scratch is None else scratch.get(name, shape, kw)


class _SymmetricPlan:
    """One layout of :func:`_symmetric_exp_moments`: its tensors and every view its kernel
    calls read and write, made once.

    A step copies the tokens in and then only launches the kernels, about six per block of
    rows (the views, slices and reshapes of a block were about 20 more tensor calls per
    block and step). The calls, their shapes and their operands' offsets are those of the
    unplanned loop, so the numbers are the same bit for bit.

    ``tasks[t]`` lists the blocks of task ``t`` (one path in row blocks, or a group of paths
    as whole matrices), bound to the buffers of worker ``t % workers``.
    """

    def __init__(self, P, n, d, H, rows, group, workers, with_ito, kw, tokens=None,
                 exp2=False, numpy_blocks=False):
        self.rows, self.workers, self.with_ito = rows, workers, with_ito
        self.exp2 = exp2  # the queries carry log2 e and the logits are exponentiated by exp2
        # the tokens themselves (one call), or a buffer each step's tokens are copied into
        self.tokens = torch.empty((P, n, d), **kw) if tokens is None else tokens
        # queries[p, a, i, h] = (D_h x_i)_a (times log2 e with exp2): computed once, read by
        # every key block
        self.queries = torch.empty((P, d, n, H), **kw)
        self.values_t = torch.empty((P, d + 1, n), **kw)  # [1, x_j] per key
        self.values_t[:, 0] = 1.0
        self.sums = torch.empty((P, n, d + 1, H), **kw)
        # [p, j, i]; with row blocks the entries j < min I of i's block I are never
        # written and stay 0 (the Itô product keeps them 0: its weights are finite)
        self.head_sums = torch.zeros((P, n, n), **kw) if with_ito else None
        self.ito_weights = torch.empty((P, n, n), **kw) if with_ito else None
        self.pair_factor = None
        if with_ito and rows < n:  # a pair in two different blocks is computed once
            block = torch.arange(n, device=kw["device"]) // rows  # and counts twice
            self.pair_factor = torch.where(block[:, None] == block[None, :], 1.0,
                                           2.0).to(kw["dtype"])
        if rows == n:
            tasks = [slice(p0, min(P, p0 + group)) for p0 in range(0, P, group)]
        else:
            tasks = [slice(p, p + 1) for p in range(P)]
        workers = max(1, min(workers, len(tasks)))
        self.workers = workers
        buffers = [(torch.empty((group * n * rows * H,), **kw),
                    torch.empty((group * (d + 1) * rows * H,), **kw)) for _ in range(workers)]
        self.tasks = []
        for t, ps in enumerate(tasks):
            buffer, row_buffer = buffers[t % workers]
            if rows == n:
                self.tasks.append([self._whole(ps, buffer, row_buffer, n, d, H)])
            else:
                self.tasks.append([self._block(ps.start, i0, buffer, row_buffer, n, d, H)
                                   for i0 in range(0, n, rows)])
        # with numpy_blocks, each op's (x, q, u, v, r) as numpy arrays on the same memory
        self.arrays = None
        if numpy_blocks:
            self.arrays = [[tuple(a.numpy() for a in op[1:6]) for op in ops]
                           for ops in self.tasks]

    def _whole(self, ps, buffer, row_buffer, n, d, H):
        g = ps.stop - ps.start
        u = buffer[:g * n * n * H].view(g, n, n * H)  # u[., j, i H + h] = U^h_ij
        r = row_buffer[:g * (d + 1) * n * H].view(g, d + 1, n * H)
        return ("whole", self.tokens[ps], self.queries[ps].reshape(g, d, n * H), u,
                self.values_t[ps], r, self.sums[ps], r.view(g, d + 1, n, H).transpose(1, 2),
                u.view(g, n, n, H), None if self.head_sums is None else self.head_sums[ps])

    def _block(self, p, i0, buffer, row_buffer, n, d, H):
        i1 = min(n, i0 + self.rows)
        c, m = i1 - i0, n - i0
        x_p, q_p, v_p, s_p = self.tokens[p], self.queries[p], self.values_t[p], self.sums[p]
        u = buffer[:m * c * H].view(m, c * H)  # u[j, i H + h] = U^h_ij, j >= i0
        r = row_buffer[:(d + 1) * c * H].view(d + 1, c * H)
        u3 = u.view(m, c, H)
        handed = None
        if i1 < n:  # U^h_ji = U^h_ij: the block's exponentials serve the rows j >= i1
            handed = (s_p[i1:], v_p[:, i0:i1].expand(m - c, d + 1, c), u3[c:],
                      0.0 if i0 == 0 else 1.0)
        return ("block", x_p[i0:], q_p[:, i0:i1].reshape(d, c * H), u, v_p[:, i0:], r,
                s_p[i0:i1], r.view(d + 1, c, H).transpose(0, 1), u3,
                None if self.head_sums is None else self.head_sums[p, i0:, i0:i1],
                i0 == 0, handed)

    def _products(self, t, k, op):
        """The block's logits ``u = x q``, ``u = exp(u)`` (or ``exp2``) and row sums
        ``r = v u``, in torch or (``arrays``) in numpy on the same memory."""
        if self.arrays is not None:
            x, q, u, v, r = self.arrays[t][k]
            np.matmul(x, q, out=u)
            (np.exp2 if self.exp2 else np.exp)(u, out=u)
            np.matmul(v, u, out=r)
            return
        _, x, q, u, v, r = op[:6]
        mm = torch.bmm if op[0] == "whole" else torch.mm
        mm(x, q, out=u)
        if self.exp2:
            u.exp2_()
        else:
            u.exp_()
        mm(v, u, out=r)

    def run(self, t):
        """The kernels of task ``t``."""
        for k, op in enumerate(self.tasks[t]):
            self._products(t, k, op)
            if op[0] == "whole":
                s, r_t, u4, hs = op[6:]
                s.copy_(r_t)
                if hs is not None:
                    torch.sum(u4, -1, out=hs)
            else:
                s, r_t, u3, hs, first, handed = op[6:]
                if first:
                    s.copy_(r_t)
                else:  # rows of earlier blocks have handed over their part already
                    s.add_(r_t)
                if hs is not None:
                    torch.sum(u3, -1, out=hs)
                if handed is not None:
                    target, v_block, u_after, beta = handed
                    target.baddbmm_(v_block, u_after, beta=beta)


def _symmetric_exp_moments(tokens, weights, with_ito: bool, scratch: _Scratch | None = None,
                           workers: int = 1, tuning: KernelTuning = DEFAULT_TUNING):
    """Unnormalised softmax moments from the upper triangle of each ``U^h``, or None.

    ``U^h_ij = exp(<x_i, D_h x_j>)`` is symmetric in ``(i, j)`` because ``D_h`` is, so
    each head needs only ``n (n + 1) / 2`` exponentials. Returns ``S [P, n, d + 1, H]``
    with ``S[p, i, 0, h] = sum_j U^h_ij`` and ``S[p, i, 1 + a, h] = sum_j U^h_ij x_ja``,
    and (``with_ito``) ``T [P] = sum_{h, i, j} U^h_ij (1 + <x_i, x_j>^2)``. None when the
    logits could leave the range where unshifted exponentials are exact to rounding
    (``|<x_i, D_h x_j>| <= |D_h|_F max |x|^2`` above :func:`_unshifted_exp_limit`).

    Layout: all heads of a block of query rows ``I`` are one GEMM against the keys
    ``j >= min I`` (logits ``[j, (i, h)]``, reusing ``D_h x_i`` for every key), one
    vectorised exponential (``exp``, or ``exp2`` with ``log2 e`` folded into the
    weights: the faster on this machine, :meth:`KernelTuning.exponential_for`), one GEMM
    for the row sums over
    ``j`` and one batched GEMM that hands the same exponentials, transposed, to the rows
    ``j`` beyond the block. Per step: ``P H n (n + c) / 2`` exponentials for blocks of
    ``c`` rows, ``O(P H n d)`` memory besides one block per worker. Paths are independent:
    ``workers`` threads (each on one intra-op thread) take disjoint sets of paths, and every
    path's numbers are the same whatever the number of workers. With ``scratch`` the
    layout (:class:`_SymmetricPlan`) is made once and reused by every step.
    """
    P, n, d = tokens.shape
    H = weights.shape[1]
    bound = (weights * weights).sum((-1, -2)).amax().sqrt() * (tokens * tokens).sum(-1).amax()
    if tuning.exp_shift == "always" or not bool(bound <= _unshifted_exp_limit(tokens.dtype,
                                                                              n, H)):
        return None
    target = tuning.block_elements_for(tokens.device)
    planned = P if tuning.plan_paths is None else tuning.plan_paths
    # little work: whole matrices, paths in groups (fewer calls)
    if planned * n * n * H <= 4 * target:
        rows, group = n, max(1, min(P, target // (n * n * H)))
    else:  # blocks of rows; at least three, or symmetry saves little
        rows, group = max(1, min(target // (n * H), -(-n // 3))), 1
    kw = {"dtype": tokens.dtype, "device": tokens.device}
    exp2 = tuning.exponential_for(tokens.device) == "exp2"
    numpy_blocks = tuning.backend_for(tokens.device) == "numpy"
    key = (P, n, d, H, rows, group, workers, with_ito, exp2, numpy_blocks, tokens.dtype,
           tokens.device)
    if scratch is None:  # one call: views of the tokens given
        plan = _SymmetricPlan(P, n, d, H, rows, group, workers, with_ito, kw, tokens, exp2,
                              numpy_blocks)
    else:  # every step of a simulation: the same views, the tokens copied in
        plan = scratch.plans.get(key)
        if plan is None:
            plan = scratch.plans[key] = _SymmetricPlan(P, n, d, H, rows, group, workers,
                                                       with_ito, kw, exp2=exp2,
                                                       numpy_blocks=numpy_blocks)
        plan.tokens.copy_(tokens)
    if exp2:  # exp2(log2(e) l) = exp(l): the logits of the queries times log2 e
        weights = weights * _LOG2E
    torch.matmul(plan.tokens.unsqueeze(1), weights.permute(0, 2, 3, 1),  # [P, d, d, H]
                 out=plan.queries)
    plan.values_t[:, 1:] = plan.tokens.transpose(1, 2)

    def work(w):  # worker w: tasks w, w + workers, ...
        if plan.workers > 1:
            torch.set_num_threads(1)  # this thread's OpenMP and MKL settings
        for t in range(w, len(plan.tasks), plan.workers):
            plan.run(t)

    with _one_blas_thread() if numpy_blocks else contextlib.nullcontext():
        if plan.workers == 1:
            work(0)
        else:
            for future in [worker_pool().submit(work, w) for w in range(plan.workers)]:
                future.result()
    ito = None
    if with_ito:
        weights_ito = torch.bmm(plan.tokens, plan.tokens.transpose(1, 2),  # [p, j, i]
                                out=plan.ito_weights)  # <x_j, x_i>
        weights_ito.mul_(weights_ito).add_(1.0)
        if plan.pair_factor is not None:
            weights_ito.mul_(plan.pair_factor)
        ito = plan.head_sums.mul_(weights_ito).sum((1, 2))  # pairwise summation
    return plan.sums, ito

_POOL = None


def worker_pool():
    """The worker threads of :func:`_symmetric_exp_moments` (created on first use)."""
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1),
                                   thread_name_prefix="gradient_flow")
    return _POOL


@contextlib.contextmanager
def _path_workers(device: torch.device):
    """Yield the number of path workers for a step on ``device`` and run the step's own
    tensor operations on one intra-op thread meanwhile (restored afterwards).

    A step is many small kernels: with several intra-op threads each one synchronises the
    threads, which costs more than the kernel (``benchmarks/bench_gradient_flow.py``).
    The caller's thread count is spent instead on independent paths, one thread each.
    """
    if device.type != "cpu":
        yield 1
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield before
    finally:
        torch.set_num_threads(before)


def _softmax_moments(queries, keys, values, max_chunk_elements: int):
    """Row log-sum-exp and softmax means of ``values`` for logits ``queries @ keys^T``.

    queries ``[P, L, d]``, keys ``[P, n, d]``, values ``[P, n, E]`` ->
    (``lse [P, L]``, ``mean [P, L, E]``), shifted by each row's maximum, in row chunks
    of at most ``max_chunk_elements`` logits. The general path of :func:`step_quantities`
    for weights too large for :func:`_symmetric_exp_moments`.
    """
    P, L, d = queries.shape
    n = keys.shape[1]
    rows = max(1, max_chunk_elements // max(1, P * n))
    kt = keys.transpose(-1, -2)
    lses, means = [], []
    for start in range(0, L, rows):  # memory tiling of the stacked rows, not a loop over heads
        logits = torch.matmul(queries[:, start:start + rows], kt)
        rowmax = logits.amax(-1, keepdim=True)
        w = (logits - rowmax).exp_()
        total = w.sum(-1, keepdim=True)
        means.append(torch.matmul(w, values) / total)
        lses.append((rowmax + total.log()).squeeze(-1))
    return torch.cat(lses, 1), torch.cat(means, 1)


def _shifted_exp_moments(tokens, weights, with_ito: bool,
                         tuning: KernelTuning = DEFAULT_TUNING):
    """``(S0 [P, n, H], S1 [P, n, d, H], a [P, n, d, H], T [P] or None)`` from max-shifted
    softmax moments; ``S0 = sum_j U``, ``S1 = S0 a``, ``a`` the softmax mean of the tokens.
    ``a`` stays finite for any weights; ``S0``, ``S1`` and ``T`` overflow where the
    quantities themselves do."""
    P, n, d = tokens.shape
    H = weights.shape[1]
    cat = weights.permute(0, 2, 1, 3).reshape(P, d, H * d)  # cat[p, a, h d + b] = D_h[a, b]
    queries = torch.matmul(tokens, cat).view(P, n * H, d)  # rows (i, h): D_h x_i
    if with_ito:  # values x_j and the upper triangle of x_j x_j^T: enough for the Itô term
        iu = torch.triu_indices(d, d, device=tokens.device)
        values = torch.cat([tokens, tokens[..., iu[0]] * tokens[..., iu[1]]], -1)
    else:
        values = tokens
    lse, means = _softmax_moments(queries, tokens, values, tuning.shifted_chunk_elements)
    s0 = lse.view(P, n, H).exp()
    means = means.view(P, n, H, -1)
    a = means[..., :d].permute(0, 1, 3, 2).contiguous()
    ito = None
    if with_ito:
        mult = torch.where(iu[0] == iu[1], 1.0, 2.0).to(tokens.dtype)
        xx = tokens[..., iu[0]] * tokens[..., iu[1]] * mult  # x_i^T C x_i = <xx, c>
        xcx = (means[..., d:] * xx.unsqueeze(2)).sum(-1)
        ito = (s0 * (1.0 + xcx)).sum((1, 2))
    return s0, s0.unsqueeze(2) * a, a, ito


def step_quantities(
    tokens: torch.Tensor,
    weights: torch.Tensor,
    *,
    sign: int = -1,
    drift: torch.Tensor | None = None,
    sigma: float = 0.0,
    noise: torch.Tensor | None = None,
    validate: bool = True,
    tuning: KernelTuning = DEFAULT_TUNING,
) -> dict[str, torch.Tensor]:
    """Velocity and every energy-balance quantity at one state, batched over paths.

    The fast evaluation of :func:`reference_step_quantities` (same results to rounding):
    ``P H n (n + c) / 2`` exponentials (``U^h`` is symmetric) instead of ``P H n^2``,
    all heads of a block of ``c`` query rows in one GEMM, and every quantity read off the
    moments ``sum_j U^h_ij``, ``sum_j U^h_ij x_j`` (and, with noise, the Itô sum
    ``sum U^h_ij (1 + <x_i, x_j>^2)``). Weights so large that unshifted exponentials
    could overflow take a max-shifted path instead. On CPU the torch threads are spent on
    independent paths, one intra-op thread each (the results do not depend on the thread
    count); the setting is restored on return.

    Parameters
    ----------
    tokens : ``[P, n, d]`` unit vectors. weights : ``[P, H, d, d]`` symmetric.
    sign : -1 (descent, the paper) or +1 (GLPR clustering).
    drift : ``[P, H, d, d]`` or ``[H, d, d]`` symmetric weight drift ``f_h`` at this time,
        or None (0).
    sigma : noise amplitude of the weights. noise : the symmetric increment ``dW``
        ``[P, H, d, d]`` of this step (only for the martingale increment) or None.
    validate : check the arguments (``simulate`` checks once and passes False).
    tuning : :class:`KernelTuning`, how the kernel tiles its work (the defaults are the
        measured best; tests pass small blocks and chunks to reach every path).

    Returns
    -------
    dict with ``velocity [P, n, d]`` and, per path ``[P]``: ``energy``, ``energy_rate``
    (``dE/dt`` at fixed tokens, Itô correction included), ``slope_sq`` (harmonic-mean
    ``G^2``), ``dissipation`` (``-(1/n) sum_i <g_i, v_i>``), ``martingale_increment``
    (``1/(2Hn^2) sum U x_i^T (sigma dW) x_j``, 0 without noise), and ``Z [P, n, H]``
    (token-major: row ``i`` holds the heads of token ``i``).

    Complexity: ``O(P H n^2 d)`` time, ``O(P H n d)`` memory besides one cache-sized
    block (no ``n x n`` matrix per head is stored).

    >>> g = torch.Generator().manual_seed(0)
    >>> from companion import gradient_flow as gf
    >>> x, D = gf.uniform_sphere(5, 3, g, paths=2), gf.initial_weights(3, 3, g, paths=2)
    >>> q = step_quantities(x, D)
    >>> r = gf.reference_step_quantities(x, D)
    >>> bool(torch.allclose(q["velocity"], r["velocity"], rtol=1e-12, atol=1e-14))
    True
    """
    if validate:
        sign, sigma = check_step_args(tokens, weights, sign, drift, sigma, noise)
        if not isinstance(tuning, KernelTuning):
            raise TypeError(f"tuning: expected a KernelTuning, got {type(tuning).__name__}")
    with _path_workers(tokens.device) as workers:
        return _step(tokens, weights, sign, drift, sigma, noise, None, workers, tuning)


def _step(tokens, weights, sign, drift, sigma, noise, scratch: _Scratch | None,
          workers: int = 1, tuning: KernelTuning = DEFAULT_TUNING):
    """:func:`step_quantities` on checked arguments, with reusable scratch tensors."""
    P, n, d = tokens.shape
    H = weights.shape[1]
    with_ito = sigma > 0
    sym = _symmetric_exp_moments(tokens, weights, with_ito, scratch, workers, tuning)
    if sym is not None:
        sums, ito = sym
        s0 = sums[:, :, 0]  # [P, n, H]: n Z_ih
        s1 = sums[:, :, 1:]  # [P, n, d, H]: n Z_ih a_ih
        a = None  # s1 / s0, formed in place once s1 is read
    else:
        s0, s1, a, ito = _shifted_exp_moments(tokens, weights, with_ito, tuning)

    def stack_t(mats):  # [P, d, d H]: column b H + h holds M_h[b, :] (= M_h[:, b])
        if mats.dim() == 3:
            mats = mats.unsqueeze(0).expand(P, -1, -1, -1)
        return mats.permute(0, 3, 2, 1).reshape(P, d, d * H)

    def contract(mats_t, moments):  # [P, n, k]: sum_(b, h) moments_ibh M_h[b, :] per path
        # the matrices as the left operand: [k, d H] @ [d H, n] keeps the long
        # dimension n as the GEMM's output columns, the shape MKL runs fastest for
        # small k (benchmarks/bench_gradient_flow.py)
        return torch.matmul(mats_t, moments.reshape(P, n, d * H).transpose(1, 2)) \
            .transpose(1, 2).contiguous()

    # sum_h M_h a_ih (M symmetric) is one contraction over (b, h): a GEMM per path.
    weights_t = stack_t(weights)
    mats = [weights_t]
    if drift is not None:
        mats.append(stack_t(drift))
    if noise is not None and sigma > 0:
        mats.append(stack_t(noise))
    # n sum_h Z_ih M_h a_ih for M = D, f and dW in one GEMM
    zm = contract(torch.cat(mats, 1), s1) / n
    sum_zm = zm[..., :d]
    if a is None:
        a = s1.div_(s0.unsqueeze(2))  # a_ih: softmax mean of the tokens
    sum_m = contract(weights_t, a)
    vel = (sign / H) * (sum_m - (tokens * sum_m).sum(-1, keepdim=True) * tokens)
    ghat = (sum_zm - (tokens * sum_zm).sum(-1, keepdim=True) * tokens) / H  # (1/H) sum_h Z u
    Z = s0 / n
    energy = Z.sum((1, 2)) / (2 * H * n)
    dissipation = -(ghat * vel).sum(-1).mean(-1)
    mobility = 1.0 / (1.0 / Z).mean(-1)  # b_i: harmonic mean over heads of Z_ih
    slope_sq = (mobility * (vel * vel).sum(-1)).mean(-1)
    # sum_{i,h} Z_ih x_i^T M_h a_ih, M_h symmetric: [P]
    k = 1
    if drift is not None:
        rate = (tokens * zm[..., k * d:(k + 1) * d]).sum((1, 2))
        k += 1
    else:
        rate = torch.zeros_like(energy)
    if with_ito:
        rate = rate + (sigma * sigma / 4.0) * ito / n
    energy_rate = rate / (2 * H * n)
    if noise is not None and sigma > 0:
        mart = sigma * (tokens * zm[..., k * d:(k + 1) * d]).sum((1, 2)) / (2 * H * n)
    else:
        mart = torch.zeros_like(energy)
    return {
        "velocity": vel,
        "energy": energy,
        "energy_rate": energy_rate,
        "slope_sq": slope_sq,
        "dissipation": dissipation,
        "martingale_increment": mart,
        "Z": Z,
    }



def velocity(tokens: torch.Tensor, weights: torch.Tensor, sign: int = -1) -> torch.Tensor:
    """Right-hand side ``dx_i/dt`` of the multi-head model.

    ``sign/H sum_h P_{x_i}[(1/Z_ih)(1/n) sum_j exp(<x_i, D_h x_j>) D_h x_j]`` for tokens
    ``[paths, n, d]`` and symmetric weights ``[paths, heads, d, d]``; returns
    ``[paths, n, d]`` (tangent to the sphere). ``sign=-1`` is the paper's descent,
    ``+1`` the GLPR clustering dynamics.

    Complexity: ``O(paths heads n^2 d)`` time, no ``n x n`` matrix stored on CPU.

    References
    ----------
    .. [1] A. Massucco, D. Del Grande, M. Carioni, C. Brune, C.-B. Schönlieb, "Multi-
       Headed Transformer Architectures as Time-dependent Wasserstein Gradient Flows",
       arXiv:2605.18870, Eq. (5): the token dynamics of the multi-head model (numbered
       per the authors' code README).

    Examples
    --------
    The field is tangent to the sphere:

    >>> from companion.gradient_flow.simulation import initial_weights, uniform_sphere
    >>> x = uniform_sphere(4, 3, torch.Generator().manual_seed(0), paths=1)
    >>> v = velocity(x, initial_weights(2, 3, torch.Generator().manual_seed(1)))
    >>> v.shape, bool((v * x).sum(-1).abs().max() < 1e-12)
    (torch.Size([1, 4, 3]), True)
    """
    return step_quantities(tokens, weights, sign=sign)["velocity"]

