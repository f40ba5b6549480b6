"""The resumable corpus pass: analyse_corpus(checkpoint=...).

A small random MPNet (float64) on random windows, saved every 2 windows (one batch of
2). The kill test starts the pass in a subprocess whose save of a later chunk writes a
partial temporary file, then signals through a file and waits forever; the test waits
for that file (not for a time), kills the process (SIGKILL), and re-runs the pass here:
it continues after the last complete save and returns the statistics of an
uninterrupted pass, bit for bit.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from companion.context_similarity import analyse_corpus, corpus
from test_mpnet_capture import SEPARATORS, _tiny_mpnet, _windows

OPTS = dict(separators=SEPARATORS, batch_size=2, percentile=10.0, progress=False, nproc=1,
            where=("pre_wo", "post_wo"), per_window=(True, False))


def _main_files(folder):
    """The main files of passes (not their per-chunk window files)."""
    return sorted(p for p in folder.glob("context-similarity-*.pt") if ".w" not in p.name)


def _assert_identical(got, want):
    for g, w in zip(got, want):
        assert g.config() == w.config()
        for name, value in w.tensors().items():
            assert torch.equal(getattr(g, name), value), name
        if w.per_window:
            gw, ww = g.window_sums(), w.window_sums()
            assert gw.keys() == ww.keys()
            for name in ww:
                assert torch.equal(gw[name], ww[name]), name


@pytest.fixture(scope="module")
def setup():
    model = _tiny_mpnet(torch.float64, head_size=8, intermediate=24)
    wins = _windows(n=9)
    tracked = torch.full((2, 5), 4, dtype=torch.long)
    plain = analyse_corpus(model, wins, track_tokens=tracked, **OPTS)
    return model, wins, tracked, plain


def test_a_checkpointed_pass_equals_a_plain_one_and_a_finished_one_is_reused(
        setup, tmp_path, monkeypatch):
    model, wins, tracked, plain = setup
    got = analyse_corpus(model, wins, track_tokens=tracked, checkpoint=tmp_path,
                         checkpoint_every=3, **OPTS)  # rounded up to 2 batches
    _assert_identical(got, plain)
    files = _main_files(tmp_path)
    assert len(files) == 1 and not list(tmp_path.glob("*.tmp-*"))
    state = torch.load(files[0], weights_only=True)
    assert state["batches"] == state["n_batches"] == 5
    # each chunk's per-window parts saved once, in a file of their own: 4, 4, 1 windows
    assert [n.rsplit(".w", 1)[1] for n in state["chunks"]] == ["2.pt", "4.pt", "5.pt"]
    sizes = [len(next(iter(torch.load(tmp_path / n, weights_only=True)["windows"][0]
                           .values()))) for n in state["chunks"]]
    assert sizes == [4, 4, 1] and "windows" not in state["stats"][0]

    def no_forward(*args, **kwargs):
        raise AssertionError("a finished pass runs no forward")

    monkeypatch.setattr(corpus, "analyse_batch", no_forward)
    _assert_identical(analyse_corpus(model, wins, track_tokens=tracked, checkpoint=tmp_path,
                                     checkpoint_every=3, **OPTS), plain)


def test_a_changed_parameter_window_weight_or_code_never_reuses_a_checkpoint(
        setup, tmp_path, monkeypatch):
    model, wins, _, _ = setup
    key = corpus.checkpoint_key
    params = dict(separators=SEPARATORS, where=("pre_wo",), batch_size=2, percentile=10.0,
                  attention_threshold=0.1, device="cpu", per_window=(False,),
                  track_tokens=None, nproc=1, settings=corpus.CaptureSettings(),
                  distributed=None, group=None, checkpoint_every=2)
    base = key(model, wins, params)
    assert key(model, wins, dict(params)) == base
    changed = [key(model, wins, {**params, "percentile": 5.0}),
               key(model, wins, {**params, "attention_threshold": 0.2}),
               key(model, wins, {**params, "batch_size": 3}),
               key(model, wins, {**params, "separators": {**SEPARATORS, ".": 6}}),
               key(model, wins, {**params, "track_tokens": torch.zeros(2, 5, dtype=torch.long)}),
               key(model, wins, {**params, "settings": corpus.CaptureSettings(lanes=1)})]
    other = _windows(n=9)
    other.input_ids[4, 7] += 1
    changed.append(key(model, other, params))
    twin = _tiny_mpnet(torch.float64, head_size=8, intermediate=24)
    assert key(twin, wins, params) == base  # same weights, same key
    with torch.no_grad():
        twin.encoder.relative_attention_bias.weight[3, 1] += 1e-12
    changed.append(key(twin, wins, params))
    monkeypatch.setattr(corpus, "_code_digest", lambda: "other code")
    changed.append(key(model, wins, params))
    assert len(set(changed)) == len(changed) and base not in changed

    # and a pass with another percentile makes its own file, its own statistics
    monkeypatch.undo()
    opts = {**OPTS, "per_window": (False, False)}
    first = analyse_corpus(model, wins, checkpoint=tmp_path, checkpoint_every=2, **opts)
    second = analyse_corpus(model, wins, checkpoint=tmp_path, checkpoint_every=2,
                            **{**opts, "percentile": 20.0})
    assert len(_main_files(tmp_path)) == 2
    _assert_identical(second, analyse_corpus(model, wins, **{**opts, "percentile": 20.0}))
    _assert_identical(first, analyse_corpus(model, wins, **opts))


CHILD = textwrap.dedent("""
    import os, sys, threading
    import torch
    from transformers import MPNetModel
    from companion.context_similarity import corpus

    model_dir, wins_path, folder, ready, block_at = sys.argv[1:]
    model = MPNetModel.from_pretrained(model_dir, attn_implementation="eager",
                                       dtype=torch.float64).eval()
    data = torch.load(wins_path, weights_only=False)
    real, saves = corpus._save_checkpoint, []

    def save(path, state):
        if "batches" in state:  # the main file (a chunk's window file was saved before)
            saves.append(state["batches"])
            if len(saves) == int(block_at):
                # a save cut short: part of a temporary file, then wait to be killed
                path.with_name(f"{path.name}.tmp-{os.getpid()}").write_bytes(b"partial")
                with open(ready, "w") as fh:
                    fh.write(" ".join(map(str, saves)))
                threading.Event().wait()
        real(path, state)

    corpus._save_checkpoint = save
    corpus.analyse_corpus(model, data["windows"], track_tokens=data["tracked"],
                          checkpoint=folder, checkpoint_every=2, **data["opts"])
    print("finished without being killed")
""")


def test_a_killed_pass_continues_from_its_last_save_bit_for_bit(setup, tmp_path,
                                                                 monkeypatch):
    model, wins, tracked, _ = setup
    model.save_pretrained(tmp_path / "model")
    # loaded here as the child loads it: a loaded tensor's address inside the file's
    # mapping decides the GEMM kernel's path, and with it the float64 bits (a model
    # built in memory and the same weights loaded from a file differ in the last bits)
    from transformers import MPNetModel

    model = MPNetModel.from_pretrained(tmp_path / "model", attn_implementation="eager",
                                       dtype=torch.float64).eval()
    plain = analyse_corpus(model, wins, track_tokens=tracked, **OPTS)
    torch.save({"windows": wins, "tracked": tracked, "opts": OPTS}, tmp_path / "wins.pt")
    (tmp_path / "child.py").write_text(CHILD)
    folder, ready = tmp_path / "ckpt", tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen([sys.executable, str(tmp_path / "child.py"),
                              str(tmp_path / "model"), str(tmp_path / "wins.pt"), str(folder),
                              str(ready), "3"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300  # a guard against a hung child, not the signal
        while not ready.exists():
            if child.poll() is not None:
                pytest.fail(f"the child ended before its third save: {child.stdout.read()}")
            assert time.monotonic() < deadline, "the child never reached its third save"
            time.sleep(0.05)
        child.kill()
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
    assert ready.read_text() == "1 2 3"  # killed inside the save after batch 3
    saved = _main_files(folder)
    assert len(saved) == 1 and list(folder.glob("*.tmp-*"))
    state = torch.load(saved[0], weights_only=True)
    assert state["batches"] == 2  # the last whole save
    # batch 3's window file was written but is not listed: the resumed pass writes it again
    assert len(state["chunks"]) == 2 and len(list(folder.glob("*.w3.pt"))) == 1

    resumed_saves = []
    real = corpus._save_checkpoint
    monkeypatch.setattr(corpus, "_save_checkpoint",
                        lambda path, state: (resumed_saves.append(state.get("batches")),
                                             real(path, state)))
    got = analyse_corpus(model, wins, track_tokens=tracked, checkpoint=folder,
                         checkpoint_every=2, **OPTS)
    # went on after batch 2 (a window file, then the main file, per batch)
    assert resumed_saves == [None, 3, None, 4, None, 5]
    assert not list(folder.glob("*.tmp-*"))
    _assert_identical(got, plain)


def test_an_unreadable_checkpoint_is_started_over_and_bad_input(setup, tmp_path):
    model, wins, _, _ = setup
    opts = {**OPTS, "per_window": (False, False)}
    analyse_corpus(model, wins, checkpoint=tmp_path, **opts)
    (saved,) = _main_files(tmp_path)
    saved.write_bytes(b"not a checkpoint")
    with pytest.warns(UserWarning, match="unreadable"):
        got = analyse_corpus(model, wins, checkpoint=tmp_path, **opts)
    _assert_identical(got, analyse_corpus(model, wins, **opts))
    # a window file the main file lists, gone: started over too
    windowed = tmp_path / "windowed"
    analyse_corpus(model, wins, checkpoint=windowed, checkpoint_every=2, **OPTS)
    (main,) = _main_files(windowed)
    (windowed / torch.load(main, weights_only=True)["chunks"][1]).unlink()
    with pytest.warns(UserWarning, match="listed by .* is missing or unreadable"):
        got = analyse_corpus(model, wins, checkpoint=windowed, checkpoint_every=2, **OPTS)
    _assert_identical(got, analyse_corpus(model, wins, **OPTS))
    with pytest.raises(TypeError, match="checkpoint: expected a directory path"):
        analyse_corpus(model, wins, checkpoint=3, **opts)
    with pytest.raises(ValueError, match="checkpoint_every: expected an int >= 1"):
        analyse_corpus(model, wins, checkpoint=tmp_path, checkpoint_every=0, **opts)
    with pytest.raises(ValueError, match="into: not with checkpoint"):
        analyse_corpus(model, wins, checkpoint=tmp_path, into=(None, None), **opts)


def test_a_pass_takes_the_cores_the_build_gives_it_between_saves_same_numbers(
        setup, tmp_path, monkeypatch):
    # the build rewrites a chapter's thread budget when another chapter ends
    # (companion.thread_budget); the resumable pass adopts it before each chunk, so it
    # runs the rest on more lanes, and its statistics stay those of a one-thread pass
    from companion import thread_budget

    model, wins, tracked, plain = setup
    budget = tmp_path / "budget"
    thread_budget.write_thread_budget(budget, 1)
    monkeypatch.setenv(thread_budget.ENV_THREAD_BUDGET, str(budget))
    seen = []
    real = corpus.analyse_batch

    def counting(*args, **kwargs):
        seen.append(torch.get_num_threads())
        if len(seen) == 2:  # another chapter ended: this one may now use 2 threads
            thread_budget.write_thread_budget(budget, 2)
        return real(*args, **kwargs)

    monkeypatch.setattr(corpus, "analyse_batch", counting)
    before = torch.get_num_threads()
    try:
        got = analyse_corpus(model, wins, track_tokens=tracked, checkpoint=tmp_path / "ck",
                             checkpoint_every=4, **OPTS)  # chunks of 2 batches
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    # chunk 1 on one thread; chunk 2 on two lanes of one intra-op thread each; the last
    # chunk, a single batch, on one lane of two threads
    assert seen == [1, 1, 1, 1, 2]
    _assert_identical(got, plain)
