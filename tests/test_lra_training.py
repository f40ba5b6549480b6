"""LRA model and training: dense path against a float64 reference, SBM padding
handling, one step reducing the loss for both attentions, the density regulariser's
gradient, and DDP (2 CPU processes on gloo) against one process on the same global batch."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from companion.lra import listops
from companion.lra.model import LRAClassifier, attention_flops
from companion.lra.train import TrainConfig, evaluate, main, train
from companion.sbm import density_regularizer


# Small problems: a second intra-op thread only adds contention on a shared machine.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _batch(seed=0, n=8, length=24, pad_from=18):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 17, (n, length), generator=g)
    tokens[n // 2:, pad_from:] = 0  # half of the rows padded
    labels = torch.randint(0, 10, (n,), generator=g)
    return tokens, labels


def test_dense_attention_matches_float64_reference():
    torch.manual_seed(0)
    model = LRAClassifier(17, 24, 10, attention="dense", dropout=0.0, dtype=torch.float64)
    tokens, _ = _batch()
    attn = model.blocks[0].attn
    x = torch.randn(8, 24, 64, dtype=torch.float64)
    valid = tokens != 0
    out, density = attn(x, valid)
    q, k, v = attn.qkv(x).reshape(8, 24, 3, 2, 32).permute(2, 0, 3, 1, 4)
    scores = q @ k.transpose(-1, -2) / math.sqrt(32)
    scores = scores.masked_fill(~valid[:, None, None, :], -math.inf)
    ref = (scores.softmax(-1) @ v).transpose(1, 2).reshape(8, 24, 64)
    torch.testing.assert_close(out, attn.out(ref), rtol=1e-10, atol=1e-10)
    assert torch.equal(density, torch.ones(8, 2, dtype=torch.float64))


def test_sbm_attention_never_touches_padding_and_density_counts_valid_pairs():
    torch.manual_seed(1)
    model = LRAClassifier(17, 24, 10, attention="sbm", num_clusters=8, dropout=0.0)
    tokens, _ = _batch()
    model.set_record(True)
    _, densities = model(tokens, generator=torch.Generator().manual_seed(3))
    valid = tokens != 0
    lengths = valid.sum(1).float()
    for edges, density in zip(model.last_edges(), densities):
        group, query, key = edges
        b = group // 2
        assert valid[b, query].all() and valid[b, key].all()
        counts = torch.bincount(group, minlength=16).float().reshape(8, 2)
        torch.testing.assert_close(density.detach(), counts / (lengths ** 2)[:, None])
        assert (density > 0).all() and (density <= 1).all()


@pytest.mark.parametrize("attention", ["dense", "sbm"])
def test_one_training_step_reduces_loss_on_a_fixed_batch(attention):
    torch.manual_seed(2)
    pairs = listops.generate(16, seed=0, min_length=8, max_length=30, max_depth=3)
    tokens, labels = listops.dataset(pairs, max_length=32)
    model = LRAClassifier(listops.vocab_size(), 32, 10, attention=attention,
                          num_clusters=16, dropout=0.0)

    def loss_now():
        # average over sampled graphs so the comparison is about the parameters
        with torch.no_grad():
            return sum(torch.nn.functional.cross_entropy(
                model(tokens, generator=torch.Generator().manual_seed(s))[0], labels)
                for s in range(4)) / 4

    before = loss_now()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    logits, _ = model(tokens, generator=torch.Generator().manual_seed(0))
    torch.nn.functional.cross_entropy(logits, labels).backward()
    opt.step()
    assert loss_now() < before


def test_density_regulariser_gradient_lowers_density():
    torch.manual_seed(4)
    model = LRAClassifier(17, 24, 10, attention="sbm", num_clusters=8, dropout=0.0)
    tokens, _ = _batch()
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)

    def mean_density():
        with torch.no_grad():
            return torch.stack([d.mean() for d in model(
                tokens, generator=torch.Generator().manual_seed(9))[1]]).mean()

    start = mean_density()
    for s in range(8):
        _, densities = model(tokens, generator=torch.Generator().manual_seed(s))
        loss = density_regularizer(densities, 1.0)
        opt.zero_grad()
        loss.backward()
        if s == 0:  # (later the STE has no sampled edge left to pass gradient through)
            assert model.blocks[0].attn.sbm.cluster_embeddings.grad.abs().sum() > 0
        opt.step()
    assert mean_density() < 0.7 * start


def test_train_tracks_density_and_keeps_best_dev_checkpoint():
    pairs = listops.generate(96, seed=1, min_length=4, max_length=20, max_depth=3)
    tokens, labels = listops.dataset(pairs, max_length=24)
    split = [(tokens[:64], labels[:64]), (tokens[64:80], labels[64:80]),
             (tokens[80:], labels[80:])]
    torch.manual_seed(0)
    model = LRAClassifier(listops.vocab_size(), 24, 10, attention="sbm", num_clusters=8)
    config = TrainConfig(steps=6, batch_size=16, lr=1e-3, eval_every=2, eval_batch_size=16)
    result = train(model, *split, config)
    assert len(result.losses) == 6 and len(result.densities) == 6
    assert len(result.densities[0]) == 2 and len(result.densities[0][0]) == 2
    assert [e["step"] for e in result.evals] == [2, 4, 6]
    best = max(result.evals, key=lambda e: e["dev_accuracy"])
    assert result.best_dev_accuracy == best["dev_accuracy"]
    # the kept parameters are the best checkpoint's: re-evaluating dev reproduces it
    acc, _ = evaluate(model, split[1], batch_size=16, seed=config.seed)
    assert acc == result.best_dev_accuracy
    assert 0 <= result.test_accuracy <= 1
    assert all(0 < d <= 1 for row in result.test_density for d in row)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="attention"):
        LRAClassifier(17, 24, 10, attention="linear")
    model = LRAClassifier(17, 24, 10, attention="dense")
    with pytest.raises(ValueError, match="tokens"):
        model(torch.zeros(2, 30, dtype=torch.long))
    with pytest.raises(ValueError, match="batch_size"):
        TrainConfig(batch_size=0)
    with pytest.raises(ValueError, match="num_edges"):
        attention_flops(-1, 32)
    assert attention_flops(10, 32) == 1280.0


def test_ddp_two_gloo_processes_match_one_process(tmp_path):
    """Same loss trajectory as one process with the same global batch (dense, no dropout:
    the only randomness left is the batch order, which every process shares)."""
    args = ["--task", "listops", "--attention", "dense", "--device", "cpu", "--seed", "3",
            "--n-train", "64", "--n-eval", "16", "--seq-len", "32", "--min-length", "4",
            "--max-length", "30", "--max-depth", "3", "--steps", "5", "--batch-size", "8",
            "--eval-every", "5", "--dropout", "0.0"]
    single = main([*args, "--out", str(tmp_path / "one.json")])["result"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node=2", "-m", "companion.lra.train", *args,
           "--out", str(tmp_path / "two.json")]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    double = json.loads((tmp_path / "two.json").read_text())["result"]
    torch.testing.assert_close(torch.tensor(double["losses"]), torch.tensor(single["losses"]),
                               rtol=1e-5, atol=1e-6)
    assert double["test_accuracy"] == pytest.approx(single["test_accuracy"])


class _GatheredStraightThrough(torch.autograd.Function):
    """Reference STE: ones forward, ``hardtanh(grad_A)`` to the gathered ``P_e``."""

    @staticmethod
    def forward(ctx, p_edges):
        return torch.ones_like(p_edges)

    @staticmethod
    def backward(ctx, grad_mask):
        return torch.nn.functional.hardtanh(grad_mask)


def test_padded_sbm_layer_matches_a_gathered_composition():
    """The classifier's padded SBM attention (SBMAttention with query_valid/key_valid:
    sparse-product STE, nothing gathered per edge) equals an independent composition of
    the public functions: memberships zeroed at padding, the same fastRG draw, P_e
    gathered per edge ([E, k]), a per-edge STE and weighted edge attention -- output,
    density and gradients, in float64."""
    from companion.sbm import edge_attention, fastrg_sample, sbm_parameters

    torch.manual_seed(5)
    model = LRAClassifier(17, 16, 10, attention="sbm", num_clusters=8, dropout=0.0,
                          dtype=torch.float64)
    attn = model.blocks[0].attn
    b, n = 3, 16
    x = torch.randn(b, n, 64, dtype=torch.float64)
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[0, 11:], valid[2, 5:] = False, False
    q, k, v = (attn.qkv(x).reshape(b, n, 3, 2, 32).permute(2, 0, 3, 1, 4).unbind(0))
    results = []
    for path in ("library", "gathered"):
        attn.zero_grad()
        gen = torch.Generator().manual_seed(11)
        if path == "library":
            y, density = attn.sbm(q, k, v, query_valid=valid, key_valid=valid, generator=gen)
        else:
            sbm = attn.sbm
            q_mem, s, k_mem = sbm_parameters(q, k, sbm.cluster_embeddings, sbm.mlp)
            keep = valid[:, None, :, None].to(q_mem.dtype)
            q_mem, k_mem = q_mem * keep, k_mem * keep
            group, query, key = edges = fastrg_sample(q_mem.detach(), s.detach(),
                                                      k_mem.detach(), gen)
            qs = (q_mem @ s).reshape(-1, n, 8)
            p_edges = (qs[group, query] * k_mem.reshape(-1, n, 8)[group, key]).sum(-1)
            weight = _GatheredStraightThrough.apply(p_edges)
            y = edge_attention(q, k, v, edges, edge_weight=weight)
            per_group = torch.zeros(b * 2, dtype=weight.dtype).index_add(0, group, weight)
            lengths = valid.sum(1).to(weight.dtype)
            density = per_group.reshape(b, 2) / (lengths * lengths)[:, None]
            assert bool(valid.reshape(-1)[group // 2 * n + key].all())  # no padded key
        (y.square().sum() + density.sum()).backward(retain_graph=True)
        results.append((y.detach(), density.detach(),
                        attn.sbm.cluster_embeddings.grad.clone(),
                        attn.sbm.mlp[0].weight.grad.clone()))
    assert float(results[0][0][2, :, 5:].abs().max()) == 0  # padded queries: zero rows
    for a, c in zip(*results):
        torch.testing.assert_close(a, c, rtol=1e-9, atol=1e-10)


# ----------------------------------------------------------- experiments (the chapter's driver)
def test_bootstrap_resamples_seeds_and_items_together():
    import numpy as np

    from companion.lra.experiments import bootstrap

    a = np.zeros((3, 40))
    a[:, :20] = 1.0  # mean 0.5
    lo, hi = bootstrap(lambda d: d["a"].mean() - d["b"].mean(), {"a": a, "b": a}, reps=50)
    assert lo == hi == 0.0  # paired arrays: same rows and columns for both
    lo, hi = bootstrap(lambda d: d["a"].mean(), {"a": a}, reps=400, seed=1)
    assert lo < 0.5 < hi and hi - lo < 0.5
    with pytest.raises(ValueError, match="arrays"):
        bootstrap(lambda d: 0.0, {"a": a, "b": a[:, :3]})


def test_model_flops_counts_dense_and_sbm_terms():
    import numpy as np

    from companion.lra.experiments import model_flops

    n, d, k = 10, 32, 8
    dense = model_flops(n, 0.3, attention="dense", clusters=k, classes=2)
    linear = 2 * (2 * n * 64 * 4 * 64 + 4 * n * 64 * 128) + 2 * (64 * 128 + 128 * 2)
    assert dense == linear + 2 * 2 * attention_flops(n * n, d)
    sbm = model_flops(n, 0.3, attention="sbm", clusters=k, classes=2)
    extra = 8 * n * d * d + 4 * n * d * k + 2 * k * k * d + 2 * n * k * k
    assert math.isclose(sbm, linear + 2 * 2 * (attention_flops(0.3 * n * n, d) + extra))
    both = model_flops(np.array([n, n]), np.array([0.3, 0.3]), attention="sbm", clusters=k,
                       classes=2)
    assert np.allclose(both, sbm)


def test_poisson_dispersion_is_one_for_poisson_counts_and_grows_with_bias():
    from companion.lra.experiments import poisson_dispersion

    g = torch.Generator().manual_seed(0)
    p = torch.rand(500, generator=g) * 0.5 + 0.05
    counts = torch.poisson(p.expand(400, 500), generator=g)
    value, (lo, hi) = poisson_dispersion(counts, p, groups=10, reps=200)
    assert lo <= value <= hi and abs(value - 1) < 0.1
    biased, _ = poisson_dispersion(counts, p * 1.2, groups=10, reps=200)
    assert biased > 1.15  # excess (0.2 P)^2 r / P = 0.04 * 40 * mean P ~ 0.5


def test_loglog_slope_recovers_a_power_law():
    import numpy as np

    from companion.lra.experiments import loglog_slope

    rng = np.random.default_rng(0)
    x = np.array([1e3, 1e4, 1e5, 1e6])
    times = 2e-7 * x[:, None] * rng.uniform(0.95, 1.05, (4, 5))
    slope, (lo, hi) = loglog_slope(x, times, reps=200)
    assert lo <= slope <= hi and abs(slope - 1) < 0.05


def test_loglog_slope_paired_rounds_absorb_a_slow_round():
    """Timings in rounds (one call at every x per round) with two rounds 4x slower at
    every x: resampling whole rounds keeps the interval tight around the true slope,
    resampling each x's repeats on its own does not."""
    import numpy as np

    from companion.lra.experiments import loglog_slope

    rng = np.random.default_rng(1)
    x = np.array([1e3, 1e4, 1e5, 1e6, 1e7])
    rounds = np.array([4.0, 4.0, 1.0, 1.0, 1.0])
    times = 2e-7 * x[:, None] * rounds * rng.uniform(0.97, 1.03, (5, 5))
    slope, (lo, hi) = loglog_slope(x, times, reps=400, paired=True)
    assert lo <= slope <= hi and abs(slope - 1) < 0.03 and hi - lo < 0.05
    _, (lo_u, hi_u) = loglog_slope(x, times, reps=400)
    assert hi_u - lo_u > 2 * (hi - lo)
    with pytest.raises(TypeError, match="paired"):
        loglog_slope(x, times, paired="yes")


def test_run_jobs_in_worker_processes_matches_one_process():
    from companion.lra.experiments import TrainJob, run_jobs

    pairs = listops.generate(48, seed=0, min_length=6, max_length=20, max_depth=2)
    tokens, labels = listops.dataset(pairs, max_length=24)
    splits = [(tokens[:32], labels[:32]), (tokens[32:40], labels[32:40]),
              (tokens[40:], labels[40:])]
    jobs = [TrainJob(task="lo", attention=att, seed=s, lam=1e-4, steps=2,
                     vocab=listops.vocab_size(), classes=10, pad=0, clusters=4, dropout=0.0,
                     lr=1e-3, batch=8, eval_batch=8)
            for att in ("dense", "sbm") for s in (0, 1)]
    one = run_jobs(jobs, {"lo": splits}, device="cpu", workers=1)
    two = run_jobs(jobs, {"lo": splits}, device="cpu", workers=2)
    assert list(one) == list(two) == [j.key for j in jobs]
    for key in one:
        assert one[key].result.losses == two[key].result.losses
        assert (one[key].correct == two[key].correct).all()
        assert (one[key].density == two[key].density).all()
        assert one[key].correct.shape == (8,)
        assert math.isclose(float(one[key].correct.mean()), one[key].result.test_accuracy)
        for a, b in zip(one[key].model.state_dict().values(),
                        two[key].model.state_dict().values()):
            assert torch.equal(a, b)


def test_run_jobs_under_torchrun_two_processes_matches_one_process():
    """nproc=2: each job trained by DDP under torchrun (gloo). Dense attention without
    dropout: the same losses and test predictions as one process (float rounding aside).
    SBM attention: the graphs are drawn per process, so only shapes and ranges are
    comparable."""
    from companion.lra.experiments import TrainJob, run_jobs

    pairs = listops.generate(48, seed=0, min_length=6, max_length=20, max_depth=2)
    tokens, labels = listops.dataset(pairs, max_length=24)
    splits = [(tokens[:32], labels[:32]), (tokens[32:40], labels[32:40]),
              (tokens[40:], labels[40:])]
    jobs = [TrainJob(task="lo", attention=att, seed=3, lam=1e-4, steps=3,
                     vocab=listops.vocab_size(), classes=10, pad=0, clusters=4, dropout=0.0,
                     lr=1e-3, batch=8, eval_batch=8) for att in ("dense", "sbm")]
    one = run_jobs(jobs, {"lo": splits}, device="cpu", workers=1, nproc=1)
    two = run_jobs(jobs, {"lo": splits}, device="cpu", workers=1, nproc=2)
    assert list(two) == [j.key for j in jobs]
    dense = jobs[0].key
    torch.testing.assert_close(torch.tensor(two[dense].result.losses),
                               torch.tensor(one[dense].result.losses), rtol=1e-5, atol=1e-6)
    assert (two[dense].correct == one[dense].correct).all()
    for a, b in zip(one[dense].model.state_dict().values(),
                    two[dense].model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    sbm = jobs[1].key
    assert two[sbm].correct.shape == (8,) and len(two[sbm].result.losses) == 3
    assert ((two[sbm].density > 0) & (two[sbm].density <= 1)).all()


def test_run_jobs_nproc_must_divide_the_batch():
    from companion.lra.experiments import TrainJob, run_jobs

    job = TrainJob(task="lo", attention="dense", seed=0, lam=0.0, steps=1, vocab=20,
                   classes=10, pad=0, clusters=4, dropout=0.0, lr=1e-3, batch=7)
    with pytest.raises(ValueError, match="nproc.*batch"):
        run_jobs([job], {"lo": []}, device="cpu", nproc=2)
