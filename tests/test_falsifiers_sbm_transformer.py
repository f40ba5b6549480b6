"""Falsifiers of the SBM-Transformer chapter's paper claims: each test computes a claim's
measurement with the library function the chapter calls (companion.lra.paper_measures),
on the object the chapter measures and on a perturbed one, and asserts that the claim's
own judgement (companion.book.statements.sbm_transformer) reads "differs" only for the
perturbed one.

The objects are the chapter's at smoke size: SBM classifiers trained on the generated
ListOps and Pathfinder data (a few steps, at the paper's λ and at a large λ), their
per-input densities and answers, fastRG heads and timed attention layers."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from falsify import assert_flips, falsifies

from companion.lra import experiments, listops, pathfinder
from companion.lra import paper_measures as PM

CPU = torch.device("cpu")
REPS = 300


def _listops_splits():
    pairs = listops.generate(96 + 32 + 96, seed=0, min_length=4, max_length=30, max_depth=4,
                             max_args=5)
    tok, lab = listops.dataset(pairs, max_length=32, device=CPU)
    return [(tok[:96], lab[:96]), (tok[96:128], lab[96:128]), (tok[128:], lab[128:])]


def _pathfinder_splits():
    pf = pathfinder.generate(96 + 32 + 96, seed=0, size=10, contour_length=3, num_distractors=0,
                             paddle_length=1.5, marker_radius=1.0, path_intensity=0.4)
    tok = pathfinder.to_sequences(pf.images, levels=3)
    lab = pf.labels
    return [(tok[:96], lab[:96]), (tok[96:128], lab[96:128]), (tok[128:], lab[128:])]


TASKS = {"ListOps": (_listops_splits, listops.vocab_size, 10, 0),
         "Pathfinder": (_pathfinder_splits, lambda: 3, 2, None)}
LAMBDAS = (1e-4, 10.0)  # the paper's λ, and a penalty large enough to move 20 steps


@pytest.fixture(scope="module")
def trained():
    """Per task: the splits and the SBM runs at both λ (20 steps of 16, seed 0)."""
    torch.set_num_threads(1)
    out = {}
    for task, (make, vocab, classes, pad) in TASKS.items():
        splits = make()
        jobs = [experiments.TrainJob(task, "sbm", 0, lam, steps=20, vocab=vocab(),
                                     classes=classes, pad=pad, clusters=16, dropout=0.0,
                                     lr=2e-3, batch=16) for lam in LAMBDAS]
        runs = experiments.run_jobs(jobs, {task: splits}, device=CPU, workers=1)
        out[task] = (splits, {lam: runs[task, "sbm", 0, lam] for lam in LAMBDAS})
    return out


def _labels(trained, task):
    return trained[task][0][2][1].numpy()


@falsifies("sbm-transformer-listops-sbm-at-least-dense")
@falsifies("sbm-transformer-pathfinder-sbm-at-least-dense")
@pytest.mark.parametrize("task", ["ListOps", "Pathfinder"])
def test_at_least_dense_against_an_sbm_model_that_learned_nothing(task, trained):
    claim_id = f"sbm-transformer-{task.lower()}-sbm-at-least-dense"
    y = _labels(trained, task)
    majority_class = np.bincount(y).argmax()
    majority = float((y == majority_class).mean())
    rng = np.random.default_rng(0)
    # two classifiers of the test split that learned the task (right on 95 % of the
    # inputs, over 3 seeds): the comparison can be made
    dense = (rng.random((3, len(y))) < 0.95).astype(float)
    sbm = (rng.random((3, len(y))) < 0.95).astype(float)
    cmp = PM.compare_accuracy(sbm, dense, majority, reps=REPS)
    assert cmp.comparable
    # the falsifier: the SBM model answers the majority class on every input
    guess = np.tile((y == majority_class).astype(float), (3, 1))
    bad = PM.compare_accuracy(guess, dense, majority, reps=REPS)
    assert bad.comparable
    assert_flips(claim_id, (cmp.difference, cmp.interval), (bad.difference, bad.interval))
    # and the gate: a dense model that guesses the majority class makes no comparison
    assert not PM.compare_accuracy(sbm, guess, majority, reps=REPS).comparable



@falsifies("sbm-transformer-listops-far-less-attention")
@falsifies("sbm-transformer-pathfinder-far-less-attention")
@pytest.mark.parametrize("task", ["ListOps", "Pathfinder"])
def test_far_less_attention_against_dense_attention(task, trained):
    claim_id = f"sbm-transformer-{task.lower()}-far-less-attention"
    sbm = trained[task][1][LAMBDAS[0]].density[None]
    dense = np.ones_like(sbm)  # dense attention: every pair, density 1 on every input
    assert_flips(claim_id, PM.mean_density(sbm, reps=REPS), PM.mean_density(dense, reps=REPS))


@falsifies("sbm-transformer-lambda-lowers-density")
def test_lambda_lowers_density_against_exchanged_runs(trained):
    runs = trained["ListOps"][1]
    lo, hi = runs[LAMBDAS[0]].density[None], runs[LAMBDAS[1]].density[None]
    assert_flips("sbm-transformer-lambda-lowers-density",
                 PM.density_change(lo, hi, reps=REPS), PM.density_change(hi, lo, reps=REPS))


@falsifies("sbm-transformer-pathfinder-density-follows-difficulty")
def test_density_follows_difficulty_against_reversed_densities(trained):
    (splits, runs) = trained["Pathfinder"]
    nll = runs[LAMBDAS[0]].nll[None]  # a trained model's loss on each test image
    density = np.sort(runs[LAMBDAS[0]].density)
    # densities handed out in order of difficulty (the statement holds), then reversed
    order = np.argsort(np.argsort(nll[0], kind="stable"), kind="stable")
    rising, falling = density[order][None], density[::-1][order][None]
    assert_flips("sbm-transformer-pathfinder-density-follows-difficulty",
                 PM.density_difficulty_correlation(rising, nll, reps=REPS),
                 PM.density_difficulty_correlation(falling, nll, reps=REPS))


def _sampled_densities(p, inputs=64, n=64, seed=0):
    """Per-input densities E / n² of fastRG graphs of a head at expected density ``p``."""
    from companion.sbm import fastrg_sample

    g = torch.Generator().manual_seed(seed)
    m = torch.full((inputs, 1, n, 4), float(np.sqrt(p)))
    s = torch.full((1, 4, 4), 1 / 16)
    group = fastrg_sample(m, s, m, g)[0]
    return (torch.bincount(group, minlength=inputs).double() / n ** 2).numpy()[None]


@falsifies("sbm-transformer-listops-flops-reduced")
@falsifies("sbm-transformer-pathfinder-flops-reduced")
@falsifies("sbm-transformer-listops-memory-reduced")
@falsifies("sbm-transformer-pathfinder-memory-reduced")
@pytest.mark.parametrize("measure", ["flops", "memory"])
@pytest.mark.parametrize("task", ["ListOps", "Pathfinder"])
def test_cost_reduced_against_full_density(task, measure):
    claim_id = f"sbm-transformer-{task.lower()}-{measure}-reduced"
    # heads as sparse as the chapter's λ = 0.1 ListOps run at ci (well under 1 %): 0.5 %
    sparse = _sampled_densities(0.005)
    full = np.ones_like(sparse)  # the falsifier: every head at full density
    kw = dict(length=PM.LRA_LENGTHS[task], measure=measure, classes=TASKS[task][2],
              reps=REPS)
    after = PM.cost_ratio_at_length(full, **kw)
    assert after[0] > 1  # at full density SBM only adds its sampling work
    assert_flips(claim_id, PM.cost_ratio_at_length(sparse, **kw), after)


@falsifies("sbm-transformer-density-none-to-full")
def test_density_span_against_frozen_embeddings():
    kw = dict(head_dim=32, clusters=16, n=32, inits=2, draws=4, steps=60, reps=REPS)
    free = PM.density_extremes(**kw)
    frozen = PM.density_extremes(frozen=True, **kw)
    assert free["sparsest"].mean() < 0.05 and free["densest"].mean() > 0.95
    assert_flips("sbm-transformer-density-none-to-full",
                 (free["span"], free["interval"]), (frozen["span"], frozen["interval"]))


def _thread_cpu_times(fn, *, repeats=5, warmup=1, cuda_sync=False, **_unused):
    """companion.timing.call_times in this thread's CPU seconds: the work of a call, which
    a busy machine does not stretch as it stretches wall time (one torch thread, and CPU
    autograd runs in the calling thread)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        out.append(time.thread_time() - start)
    return out


@falsifies("sbm-transformer-cost-linear-in-edges")
def test_cost_linear_against_the_dense_path(monkeypatch):
    import companion.timing

    torch.set_num_threads(1)
    # The chapter times wall seconds on a quiet run; a test must not depend on the load
    # of the machine it runs on, so here each call's cost is its thread's CPU time.
    monkeypatch.setattr(companion.timing, "call_times", _thread_cpu_times)
    # n = 1024: up to 0.8 M edges per head, where the per-edge work outweighs the fixed
    # cost of the call; the dense path's n² work outweighs its sampling
    kw = dict(densities=[0.1, 0.2, 0.4, 0.8], repeats=3, reps=REPS, seed=0)
    edges = PM.cost_against_edges(1024, path="edges", **kw)
    dense = PM.cost_against_edges(1024, path="dense", **kw)
    np.testing.assert_allclose(edges["edges"], dense["edges"], rtol=0.05)  # same graphs' law
    assert_flips("sbm-transformer-cost-linear-in-edges",
                 (edges["slope"], edges["interval"]), (dense["slope"], dense["interval"]))


def test_inference_memory_by_hand():
    # one layer, n = 3, dim 2, one head of 2, ffn 4, k = 2: attention stage
    # 2*3*2 + 4*3*1*2 = 36 floats, dense adds 2*9 = 18; SBM adds 4*3*2 (MLP) + 2*3*2
    # (memberships) + 4 (S) = 40 floats, 46 with Qhat S, and 40 bytes on each of 0.5*9
    # edges; the FFN stage (2*3*2 + 2*3*4 = 36 floats) is smaller
    kw = dict(dim=2, heads=1, head_dim=2, ffn=4, clusters=2)
    assert PM.inference_memory(3, 1.0, attention="dense", **kw) == 4 * (36 + 18)
    assert PM.inference_memory(3, 0.5, attention="sbm", **kw) == 4 * (36 + 40) + 40 * 4.5
    assert PM.inference_memory(3, 0.5, attention="sbm", sampler="query-major", **kw) \
        == 4 * (36 + 46) + 40 * 4.5
    assert PM.inference_memory(3, 0.0, attention="sbm", **dict(kw, ffn=40)) == 4 * (12 + 240)
    with pytest.raises(ValueError, match="attention"):
        PM.inference_memory(3, 0.5, attention="linear")


def test_cost_ratio_is_the_formula_ratio():
    rho = np.array([[0.1, 0.3], [0.2, 0.2]])
    r, (lo, hi) = PM.cost_ratio_at_length(rho, length=1024, measure="flops", classes=2,
                                          reps=50)
    # the paper's fastRG: model_flops with the column sums and S~ in place of Qhat S
    k, fixed = PM.PAPER_MODEL["clusters"], 2 * 2 * (2 * 1024 * 128 ** 2 - 2 * 1024 * 128
                                                  - 2 * 128 ** 2)
    sbm = sum(experiments.model_flops(1024, x, attention="sbm", classes=2, **PM.PAPER_MODEL)
              - fixed for x in rho.ravel())
    dense = 4 * experiments.model_flops(1024, 1.0, attention="dense", classes=2,
                                        **PM.PAPER_MODEL)
    assert k == 128
    assert r == pytest.approx(sbm / dense, rel=1e-12)
    assert lo <= r <= hi
    with pytest.raises(ValueError, match="measure"):
        PM.cost_ratio_at_length(rho, length=8, measure="time", classes=2)
    with pytest.raises(ValueError, match="density"):
        PM.cost_ratio_at_length(np.ones(3), length=8, measure="flops", classes=2)


def test_compare_accuracy_refuses_unpaired_items():
    with pytest.raises(ValueError, match="same test items"):
        PM.compare_accuracy(np.ones((1, 3)), np.ones((1, 4)), 0.5)
    with pytest.raises(ValueError, match="majority"):
        PM.compare_accuracy(np.ones((1, 3)), np.ones((1, 3)), 1.5)


def test_density_span_interval_is_calibrated_over_initialisations():
    """Another seed's span (new heads, new graphs) falls inside seed 0's 95 % interval
    about as often as its level says: at least 3 of 4 seeds (fixed seeds, no flakiness)."""
    kw = dict(head_dim=32, clusters=16, n=32, inits=2, draws=4, steps=60, reps=REPS)
    lo, hi = PM.density_extremes(seed=0, **kw)["interval"]
    inside = [lo <= PM.density_extremes(seed=s, **kw)["span"] <= hi for s in range(1, 5)]
    assert sum(inside) >= 3, inside


def test_compare_accuracy_floor_is_the_model_without_attention_when_higher():
    rng = np.random.default_rng(1)
    dense = (rng.random((3, 200)) < 0.6).astype(float)
    sbm = (rng.random((3, 200)) < 0.6).astype(float)
    # 0.6 clears a majority class of 0.3 by 10 points, not a no-attention model at 0.55
    assert PM.compare_accuracy(sbm, dense, 0.3, reps=REPS).comparable
    cmp = PM.compare_accuracy(sbm, dense, 0.3, no_attention=0.55, reps=REPS)
    assert not cmp.comparable and cmp.floor == 0.55
    assert "nearly no attention" in cmp.reason
    # a no-attention model below the majority class leaves the majority class the floor
    assert PM.compare_accuracy(sbm, dense, 0.3, no_attention=0.1, reps=REPS).floor == 0.3
