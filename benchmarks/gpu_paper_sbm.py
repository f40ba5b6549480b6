"""ListOps at the SBM-Transformer paper's setting, dense and SBM, for a fixed wall-clock budget.

The LRA ListOps run of Cho et al. (NeurIPS 2022): expressions of 500 to 2000 tokens,
nesting depth 10, up to 10 arguments, padded to length 2000; 2 layers, 2 heads of size
32, width 64, FFN 128, k = 128 clusters, dropout 0.1; AdamW at 5e-4, batch 128; density
penalty lambda in {1e-4, 1e-2}. A CPU cannot train this in a book build, so this script
is prepared for one short run on a GPU machine (``make bench`` does not run it).

What it does, with the library's LRA code (``companion.lra``: ``listops`` for the data,
``model.LRAClassifier``, ``train.train`` for AdamW + OneCycle + best-dev checkpoint):

1. generates ``--n-train`` / ``--n-eval`` / ``--n-eval`` ListOps expressions (seeded);
2. splits ``--budget-s`` equally over the runs (dense, then SBM at each lambda);
3. per run, times a few calibration steps of a throw-away copy of the model (after one
   untimed warm-up step) and one dev evaluation, and sets the number of steps so that
   training plus its six evaluations fit the run's share (the one-cycle schedule needs
   the step count in advance);
4. trains a fresh model (same seed) for that many steps and records test accuracy at
   the best dev checkpoint, the mean test density (per layer and head too), the training
   time per step, the steps, the wall time and, on CUDA, the peak memory.

The result is ``benchmarks/results/gpu_paper_sbm.json`` (and ``.md``), marked with the
device, torch version and commit; with ``OUT`` set (the device tool) a copy goes to
``$OUT`` too; ``--out FILE`` writes there instead. The SBM chapter shows the JSON when
it is present, marked as not executed by the book build.

Usage::

    python benchmarks/gpu_paper_sbm.py                  # paper setting, ~5 min on a GPU
    python benchmarks/gpu_paper_sbm.py --budget-s 120   # shorter
    python benchmarks/gpu_paper_sbm.py --tiny --device cpu --out /tmp/x.json  # seconds, CPU

``--tiny`` (length 64, depth 4, batch 4, k = 16, at most 3 steps per run) checks the
script end to end on a CPU; its numbers say nothing about the paper's setting.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from functools import partial
from pathlib import Path

import torch

from companion.timing import call_seconds

ROOT = Path(__file__).resolve().parents[1]
TOPIC = "gpu_paper_sbm"

PAPER = dict(seq_len=2000, min_length=500, max_length=2000, max_depth=10, max_args=10,
             batch=128, lr=5e-4, clusters=128, n_train=10000, n_eval=500, max_steps=None,
             calibration_steps=3)
TINY = dict(seq_len=64, min_length=10, max_length=60, max_depth=4, max_args=5, batch=4,
            lr=2e-3, clusters=16, n_train=64, n_eval=16, max_steps=3, calibration_steps=1)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="wall-clock seconds for all training runs together (default 300)")
    p.add_argument("--lambdas", default="1e-4,1e-2",
                   help="comma-separated density penalties of the SBM runs")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true",
                   help="length 64, batch 4, a few steps: a CPU check of the script")
    p.add_argument("--n-train", type=int, default=None)
    p.add_argument("--n-eval", type=int, default=None)
    p.add_argument("--batch", type=int, default=None,
                   help="global batch (default: the paper's 128; --tiny: 4)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="cap on the steps of each run (default: none; --tiny: 3)")
    p.add_argument("--out", default=None,
                   help="write the JSON (and a .md next to it) here instead of "
                        "benchmarks/results/")
    args = p.parse_args(argv)
    if not (args.budget_s > 0 and math.isfinite(args.budget_s)):
        p.error(f"--budget-s: expected a positive number of seconds, got {args.budget_s}")
    try:
        args.lambda_values = [float(x) for x in args.lambdas.split(",") if x.strip()]
    except ValueError:
        p.error(f"--lambdas: expected comma-separated numbers, got {args.lambdas!r}")
    if not args.lambda_values or any(not (v >= 0) for v in args.lambda_values):
        p.error(f"--lambdas: expected nonnegative numbers, got {args.lambdas!r}")
    for name in ("n_train", "n_eval", "max_steps", "batch"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')}: expected a positive int, got {value}")
    return args


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _listops_splits(setting: dict, seed: int, device):
    from companion.lra import listops

    n_train, n_eval = setting["n_train"], setting["n_eval"]
    pairs = listops.generate(n_train + 2 * n_eval, seed=seed,
                             min_length=setting["min_length"],
                             max_length=setting["max_length"],
                             max_depth=setting["max_depth"], max_args=setting["max_args"])
    tokens, labels = listops.dataset(pairs, max_length=setting["seq_len"], device=device)
    a, b = n_train, n_train + n_eval
    splits = [(tokens[:a], labels[:a]), (tokens[a:b], labels[a:b]), (tokens[b:], labels[b:])]
    lengths = (tokens != 0).sum(1).float()
    majority = float(torch.bincount(labels[b:], minlength=10).max()) / len(labels[b:])
    return splits, {"mean_tokens": float(lengths.mean()), "max_tokens": int(lengths.max()),
                    "majority_test_accuracy": majority}


def _model(attention: str, setting: dict, seed: int, device):
    from companion.lra import listops
    from companion.lra.model import LRAClassifier

    torch.manual_seed(seed)
    return LRAClassifier(listops.vocab_size(), setting["seq_len"], 10, attention=attention,
                         num_clusters=setting["clusters"], pad_id=0, dropout=0.1,
                         device=device)


def plan_steps(share_s: float, calibration_s: float, step_s: float, eval_s: float, *,
               max_steps: int | None = None) -> int:
    """Steps that fit ``share_s`` seconds after calibration, at ``step_s`` per step plus
    six evaluations of ``eval_s`` (five dev evaluations and the test one); at least 1.

    >>> plan_steps(100.0, 10.0, 1.0, 5.0)
    60
    >>> plan_steps(100.0, 10.0, 1.0, 5.0, max_steps=3)
    3
    """
    steps = int((share_s - calibration_s - 6 * eval_s) // max(step_s, 1e-9))
    if max_steps is not None:
        steps = min(steps, max_steps)
    return max(1, steps)


def run_one(attention: str, lam: float, splits, setting: dict, share_s: float, *,
            seed: int, device: torch.device, max_steps: int | None) -> dict:
    """Calibrate, then train one model for the steps that fit ``share_s``; a dict row."""
    from companion.lra.train import TrainConfig, evaluate, train

    row = {"attention": attention, "lambda": lam if attention == "sbm" else None,
           "budget_s": share_s}
    started = time.perf_counter()
    try:
        # calibration on a throw-away copy: one untimed step (CUDA context, kernel
        # selection, allocator warm-up), then the time per step and of one dev evaluation
        probe = _model(attention, setting, seed, device)
        k = setting["calibration_steps"]

        def probe_config(steps):
            return TrainConfig(steps=steps, batch_size=setting["batch"], lr=setting["lr"],
                               lam=lam, eval_every=steps, eval_batch_size=setting["batch"],
                               seed=seed)

        cuda = device.type == "cuda"
        train(probe, *splits, probe_config(1))
        calibration_s = call_seconds(partial(train, probe, *splits, probe_config(k)),
                                     repeats=1, warmup=0, cuda_sync=cuda)
        eval_s = call_seconds(
            partial(evaluate, probe, splits[1], batch_size=setting["batch"], seed=seed),
            repeats=1, warmup=0, cuda_sync=cuda)
        step_s = max((calibration_s - 2 * eval_s) / k, 1e-6)  # train() evaluated dev + test
        del probe
        steps = plan_steps(share_s, time.perf_counter() - started, step_s, eval_s,
                           max_steps=max_steps)
        row.update(calibration_s=calibration_s, planned_steps=steps,
                   calibrated_step_s=step_s)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        model = _model(attention, setting, seed, device)
        config = TrainConfig(steps=steps, batch_size=setting["batch"], lr=setting["lr"],
                             lam=lam, eval_every=max(steps // 5, 1),
                             eval_batch_size=setting["batch"], seed=seed)
        result = train(model, *splits, config)
        _sync(device)
        density = result.test_density  # [layers][heads]
        flat = [x for layer in density for x in layer]
        tail = result.densities[-max(1, len(result.densities) // 10):]
        row.update(
            steps=steps, train_s=result.seconds, step_s=result.seconds / steps,
            test_accuracy=result.test_accuracy, best_dev_accuracy=result.best_dev_accuracy,
            best_step=result.best_step, test_density=sum(flat) / len(flat),
            test_density_per_layer_head=density,
            train_density_last_tenth=sum(x for d in tail for layer in d for x in layer)
            / sum(len(layer) for d in tail for layer in d),
            final_task_loss=result.task_losses[-1],
            peak_memory_mib=(torch.cuda.max_memory_allocated(device) / 2**20
                             if device.type == "cuda" else None))
    except torch.OutOfMemoryError as exc:  # say so in the results, run the others
        row["error"] = "out of memory: " + str(exc).splitlines()[0]
        if device.type == "cuda":
            torch.cuda.empty_cache()
    row["wall_s"] = time.perf_counter() - started
    return row


def markdown(result: dict) -> str:
    s = result["setting"]
    kind = ("tiny check" if result["tiny"] else "paper setting" if result["paper_setting"]
            else "changed setting")
    lines = [f"# ListOps at the paper's setting ({kind})",
             "",
             f"{result['device']}, torch {result['torch']}, commit {result['commit'][:12]}"
             f"{' (dirty)' if result['dirty'] else ''}, {result['date']}. Length "
             f"{s['seq_len']} (expressions of {s['min_length']} to {s['max_length']} tokens, "
             f"depth {s['max_depth']}), batch {s['batch']}, k = {s['clusters']}, budget "
             f"{result['budget_s']:g} s in all. Majority-class test accuracy "
             f"{result['data']['majority_test_accuracy']:.3f}.",
             "",
             "| run | steps | s / step | test accuracy | test density | peak MiB |",
             "|---|---|---|---|---|---|"]
    for r in result["runs"]:
        name = r["attention"] + (f", λ = {r['lambda']:g}" if r["lambda"] is not None else "")
        if "error" in r:
            lines.append(f"| {name} | {r['error']} | | | | |")
            continue
        peak = "" if r["peak_memory_mib"] is None else f"{r['peak_memory_mib']:.0f}"
        lines.append(f"| {name} | {r['steps']} | {r['step_s']:.3f} | "
                     f"{r['test_accuracy']:.3f} | {r['test_density']:.4f} | {peak} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    from companion.devices import resolve_device
    from companion.book.gitstate import git_state

    device = resolve_device(args.device)
    if device.type == "cpu" and not os.environ.get("COMPANION_TORCH_THREADS"):
        # width-64 models: more intra-op threads gain little, and on a shared machine
        # spin-waiting threads made steps several times slower (as in the chapter)
        torch.set_num_threads(1)
    setting = dict(TINY if args.tiny else PAPER)
    for name in ("n_train", "n_eval", "max_steps", "batch"):
        if getattr(args, name) is not None:
            setting[name] = getattr(args, name)
    wall0 = time.perf_counter()
    t0 = time.perf_counter()
    splits, data_info = _listops_splits(setting, args.seed, device)
    data_info["generate_s"] = time.perf_counter() - t0
    print(f"{device}: {setting['n_train']} + 2 x {setting['n_eval']} expressions, mean "
          f"{data_info['mean_tokens']:.0f} tokens, in {data_info['generate_s']:.1f} s",
          flush=True)
    plan = [("dense", 0.0)] + [("sbm", lam) for lam in args.lambda_values]
    share = args.budget_s / len(plan)
    runs = []
    for attention, lam in plan:
        row = run_one(attention, lam, splits, setting, share, seed=args.seed, device=device,
                      max_steps=setting["max_steps"])
        runs.append(row)
        print(json.dumps({k: v for k, v in row.items()
                          if k != "test_density_per_layer_head"}), flush=True)
    commit, dirty = git_state(ROOT)
    result = {
        "script": "benchmarks/gpu_paper_sbm.py",
        "tiny": bool(args.tiny),
        # the paper's length, depth and batch (the training set is smaller than LRA's
        # 96,000 expressions: drawing them would take a large part of the budget)
        "paper_setting": (not args.tiny and all(setting[k] == PAPER[k] for k in (
            "seq_len", "min_length", "max_length", "max_depth", "max_args", "batch",
            "clusters"))),
        "device": _device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": commit,
        "dirty": dirty,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "budget_s": args.budget_s,
        "seed": args.seed,
        "setting": {k: setting[k] for k in ("seq_len", "min_length", "max_length",
                                            "max_depth", "max_args", "batch", "lr",
                                            "clusters", "n_train", "n_eval", "max_steps")},
        "model": {"layers": 2, "heads": 2, "head_dim": 32, "dim": 64, "ffn": 128,
                  "dropout": 0.1},
        "data": data_info,
        "runs": runs,
        "wall_s": time.perf_counter() - wall0,
    }
    text = markdown(result)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        out.with_suffix(".md").write_text(text)
        print(text)
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from results_io import write_results

        write_results(TOPIC, result, text)
        if os.environ.get("OUT"):
            out_dir = Path(os.environ["OUT"])
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / f"{TOPIC}.json").write_text(json.dumps(result, indent=2))
            (out_dir / f"{TOPIC}.md").write_text(text)
    return 1 if any("error" in r for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
