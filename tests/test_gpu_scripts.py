"""The prepared GPU scripts run end to end on a CPU at a tiny size and write what they say.

``benchmarks/gpu_paper_sbm.py --tiny``, ``benchmarks/gpu_check_sbm.py --device cpu
--tiny`` and ``benchmarks/gpu_check_hasse.py --device cpu --quick`` run as scripts
(``__main__``, their arguments in ``sys.argv``, ``OUT`` set, one intra-op thread), one
after the other in one subprocess (one interpreter importing torch, not three: see
:func:`ran_scripts`), their JSON checked against independent references where there is
one (the ListOps majority class recomputed from the generator, accuracies as multiples of
1 / test size, the expected edge count of fastRG at 5 %). Their refusals (bad arguments,
no CUDA) are their ``main`` called in this process: the same exit status and message,
without an interpreter importing torch for each.
"""
from __future__ import annotations

import doctest
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"


# Each script as `python benchmarks/NAME.py ARGS` runs it: __main__, sys.argv, the
# script's folder first on sys.path; its exit status from SystemExit (0 when it returns).
_RUN_SCRIPTS = r"""
import json, os, runpy, sys, traceback
plan = json.loads(sys.argv[1])
sys.path.insert(0, plan["folder"])
for name, args, out in plan["scripts"]:
    os.environ["OUT"] = out
    script = os.path.join(plan["folder"], name + ".py")
    sys.argv = [script, *args]
    for stream in (sys.stdout, sys.stderr):
        print("\n" + "=" * 8, "start", name, flush=True, file=stream)
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        print("\n" + "=" * 8, "exit", name, code, flush=True, file=stream)
"""

SCRIPTS = {
    "gpu_paper_sbm": ["--tiny", "--device", "cpu", "--budget-s", "600",
                      "--out", "{folder}/result/paper_sbm.json"],
    "gpu_check_sbm": ["--device", "cpu", "--tiny"],
    "gpu_check_hasse": ["--device", "cpu", "--quick"],
}


@dataclass
class ScriptRun:
    returncode: int
    stdout: str
    stderr: str
    folder: Path  # the script's own: OUT is folder / "out"


def _section(text: str, name: str) -> str:
    """What script ``name`` printed (from its start line to the next script's), or ''."""
    start = text.find(f"{'=' * 8} start {name}\n")
    if start < 0:
        return ""
    end = text.find(f"{'=' * 8} start ", start + 1)
    return text[start:] if end < 0 else text[start:end]


@pytest.fixture(scope="module")
def ran_scripts(tmp_path_factory) -> dict[str, ScriptRun]:
    """The three scripts, each end to end, one after the other in one fresh interpreter
    with one intra-op thread (OMP_NUM_THREADS=1), as `python benchmarks/NAME.py ARGS`
    with ``OUT`` set would run them: the import of torch paid once."""
    root = tmp_path_factory.mktemp("gpu-scripts")
    plan = {"folder": str(BENCH), "scripts": []}
    for name, args in SCRIPTS.items():
        folder = root / name
        folder.mkdir()
        plan["scripts"].append([name, [a.format(folder=folder) for a in args],
                                str(folder / "out")])
    proc = subprocess.run([sys.executable, "-c", _RUN_SCRIPTS, json.dumps(plan)], cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=600, check=False)
    runs = {}
    for name in SCRIPTS:
        out, err = _section(proc.stdout, name), _section(proc.stderr, name)
        ended = re.search(rf"^={{8}} exit {name} (-?\d+)$", out, re.M)
        # no exit line: the interpreter died in this script (its own status then)
        code = int(ended.group(1)) if ended else (proc.returncode or 1)
        runs[name] = ScriptRun(code, out, err + ("" if ended else proc.stderr[-3000:]),
                               root / name)
    return runs


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_paper_sbm_tiny_end_to_end(ran_scripts, tmp_path):
    proc = ran_scripts["gpu_paper_sbm"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.folder / "result" / "paper_sbm.json"
    result = json.loads(out.read_text())
    assert result["tiny"] is True and result["paper_setting"] is False
    assert result["device_type"] == "cpu"
    assert result["device"].startswith("cpu")
    assert result["torch"] == torch.__version__
    assert result["commit"] == "unknown" or len(result["commit"]) == 40
    # what the SBM chapter reads to show the table
    assert isinstance(result["dirty"], bool) and result["date"][:4].isdigit()
    assert result["budget_s"] == 600.0 and 0 <= result["data"]["majority_test_accuracy"] <= 1
    setting = result["setting"]
    assert (setting["seq_len"], setting["batch"], setting["max_steps"]) == (64, 4, 3)
    # one dense run, then SBM at the paper's two penalties, in that order
    assert [(r["attention"], r["lambda"]) for r in result["runs"]] == [
        ("dense", None), ("sbm", 1e-4), ("sbm", 1e-2)]
    n_test = setting["n_eval"]
    for run in result["runs"]:
        assert "error" not in run, run
        # a budget far above the tiny run's cost: max_steps decides, not the clock
        assert run["steps"] == 3 and run["step_s"] > 0 and run["train_s"] > 0
        # accuracy on n_test items is a multiple of 1 / n_test
        assert abs(run["test_accuracy"] * n_test - round(run["test_accuracy"] * n_test)) < 1e-9
        assert 0.0 <= run["test_accuracy"] <= 1.0
        assert 1 <= run["best_step"] <= run["steps"]
        assert run["peak_memory_mib"] is None  # not measured on CPU
        grid = run["test_density_per_layer_head"]
        assert len(grid) == 2 and all(len(layer) == 2 for layer in grid)
        if run["attention"] == "dense":
            assert run["test_density"] == 1.0
        else:
            assert 0.0 < run["test_density"] < 1.0
            flat = [x for layer in grid for x in layer]
            assert run["test_density"] == pytest.approx(sum(flat) / len(flat))
    # the majority-class rate, recomputed from the generator with the same seed
    from companion.lra import listops

    pairs = listops.generate(setting["n_train"] + 2 * n_test, seed=result["seed"],
                             min_length=setting["min_length"],
                             max_length=setting["max_length"],
                             max_depth=setting["max_depth"], max_args=setting["max_args"])
    test_labels = [y for _, y in pairs[setting["n_train"] + n_test:]]
    majority = Counter(test_labels).most_common(1)[0][1] / len(test_labels)
    assert result["data"]["majority_test_accuracy"] == pytest.approx(majority)
    table = out.with_suffix(".md").read_text()
    assert "| dense |" in table and "| sbm, λ = 0.0001 |" in table and "tiny check" in table
    # the SBM chapter's cell that shows this file: a table marked as not executed by the
    # build, with the device; and a plain sentence when the file is absent
    shown = _chapter_gpu_cell(tmp_path / "repo", result)
    (df, table_id, caption), = shown["tables"]
    assert table_id == "sbm-transformer-gpu-paper-listops" and len(df) == 3
    assert caption.startswith("Not executed by this build: a tiny check")
    assert result["device"] in caption and result["commit"][:7] in caption
    assert list(df["test accuracy"]) == [round(r["test_accuracy"], 3) for r in result["runs"]]
    shown = _chapter_gpu_cell(tmp_path / "empty-repo", None)
    assert not shown["tables"] and shown["text"][0].startswith(
        "Not run for this build: `python benchmarks/gpu_paper_sbm.py` on a GPU")


def _chapter_gpu_cell(root, result):
    """Run the chapter's GPU-results cell against ``root`` (holding ``result`` as
    benchmarks/results/gpu_paper_sbm.json, or nothing); what it would show."""
    import re

    import pandas as pd

    source = (REPO / "chapters" / "sbm_transformer.md").read_text()
    (cell,) = [c for c in re.findall(r"```\{code-cell\} ipython3\n(.*?)```", source, re.S)
               if "gpu_paper_sbm.json" in c and "save_table" in c]
    if result is not None:
        (root / "benchmarks" / "results").mkdir(parents=True)
        (root / "benchmarks" / "results" / "gpu_paper_sbm.json").write_text(json.dumps(result))
    shown = {"tables": [], "text": []}

    class Prose:
        @staticmethod
        def show(text):
            shown["text"].append(text)

    namespace = {"json": json, "pd": pd, "prose": Prose, "repo_root": lambda: root,
                 "save_table": lambda *args: shown["tables"].append(args)}
    code = "\n".join(line for line in cell.splitlines() if not line.startswith(":tags:"))
    exec(compile(code, "sbm_transformer.md", "exec"), namespace)
    return shown


def test_gpu_paper_sbm_bad_arguments_name_the_option(tmp_path, monkeypatch, capsys):
    # The script's main in this process: what `python gpu_paper_sbm.py ...` exits with
    # (its `sys.exit(main())`; argparse's errors are SystemExit(2)), without a new
    # interpreter importing torch for each refusal.
    module = _load("gpu_paper_sbm")
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.chdir(tmp_path)
    for args, option in ((["--budget-s", "0"], "--budget-s"),
                         (["--lambdas", "1e-4,x"], "--lambdas"),
                         (["--lambdas", "-1"], "--lambdas"),
                         (["--n-train", "0"], "--n-train")):
        with pytest.raises(SystemExit) as exit_info:
            module.main(["--tiny", "--device", "cpu", *args])
        stderr = capsys.readouterr().err
        assert exit_info.value.code == 2, (args, stderr)
        assert option in stderr, (args, stderr)
    assert not (tmp_path / "out").exists()  # nothing written
    assert list(tmp_path.iterdir()) == []


def test_plan_steps_fits_the_share():
    module = _load("gpu_paper_sbm")
    assert doctest.testmod(module).failed == 0
    # training steps plus six evaluations never exceed what is left of the share
    for share, calib, step, ev in ((300.0, 12.0, 0.7, 3.0), (100.0, 1.0, 0.013, 0.4)):
        steps = module.plan_steps(share, calib, step, ev)
        assert calib + 6 * ev + steps * step <= share < calib + 6 * ev + (steps + 1) * step
    assert module.plan_steps(1.0, 5.0, 1.0, 1.0) == 1  # over budget: still one step


def test_gpu_check_sbm_cpu_tiny(ran_scripts):
    proc = ran_scripts["gpu_check_sbm"]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((proc.folder / "out" / "gpu_sbm.json").read_text())
    assert result["device"] == "cpu" and result["tiny"] is True
    assert result["tests_exit_code"] == 0
    (row,) = result["timing"]
    assert (row["n"], row["density"]) == (256, 0.05)
    for name in ("edge", "dense_masked", "sdpa"):
        assert row[f"{name}_s"] > 0 and row[f"{name}_peak_mb"] is None
    # fastRG draws Poisson(sum P) edges per head, E = 0.05 * 256^2 = 3277 (sd ~57)
    assert abs(row["edges_per_head"] - 0.05 * 256 ** 2) < 6 * (0.05 * 256 ** 2) ** 0.5


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_gpu_check_sbm_without_cuda_says_so(tmp_path, monkeypatch, capsys):
    # main in this process: the exit status `python gpu_check_sbm.py` would have
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    assert _load("gpu_check_sbm").main([]) == 2
    stdout = capsys.readouterr().out
    assert "no CUDA device" in stdout and "--device cpu --tiny" in stdout
    assert not (tmp_path / "out").exists()  # nothing written


def test_gpu_check_hasse_cpu_quick(ran_scripts):
    proc = ran_scripts["gpu_check_hasse"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((proc.folder / "out" / "gpu_check_hasse.json").read_text())
    assert result["device"] == "cpu" and result["all_ok"] is True
    assert {r["mask"] for r in result["flex"]} >= {"causal", "sliding_window_64"}
    assert all(r["R_equal"] for r in result["reachability"])
