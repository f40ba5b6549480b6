"""companion.thread_budget and the build's shares of the cores (build.thread_shares)."""
from __future__ import annotations

import pytest
import torch

from companion import thread_budget
from companion.book.build import thread_shares


def test_shares_use_every_core_and_give_each_run_at_least_one():
    for cores in range(1, 9):
        for n in range(1, 5):
            names = [f"c{i}" for i in range(n)]
            shares = thread_shares(cores, names)
            assert list(shares) == names and min(shares.values()) >= 1
            assert sum(shares.values()) == max(cores, n)
            # the first started (the longest expected) never gets less than a later one
            assert list(shares.values()) == sorted(shares.values(), reverse=True)
    assert thread_shares(2, []) == {}


def test_a_budget_is_read_adopted_and_bad_files_are_ignored(tmp_path, monkeypatch):
    path = tmp_path / "budget"
    monkeypatch.setenv(thread_budget.ENV_THREAD_BUDGET, str(path))
    before = torch.get_num_threads()
    try:
        assert thread_budget.adopt_thread_budget() == before  # no file yet: unchanged
        thread_budget.write_thread_budget(path, 1)
        assert thread_budget.adopt_thread_budget() == 1 == torch.get_num_threads()
        for bad in ("", "zero", "0", "-3", "1.5"):
            path.write_text(bad)
            assert thread_budget.read_thread_budget() is None
            assert thread_budget.adopt_thread_budget() == 1  # kept
        assert not list(tmp_path.glob("*.tmp-*"))
    finally:
        torch.set_num_threads(before)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="threads: expected a positive int"):
            thread_budget.write_thread_budget(path, bad)
