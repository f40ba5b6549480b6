"""timing.call_seconds against a scripted clock: which calls are timed and how reduced."""
import pytest

from companion import timing


class ScriptedClock:
    """perf_counter returning a scripted sequence; fn() records how often it ran."""

    def __init__(self, durations):
        self.durations = list(durations)
        self.now = 0.0
        self.reading = 0

    def perf_counter(self):
        # readings alternate start/stop; a stop advances by the next scripted duration
        if self.reading % 2 == 1:
            self.now += self.durations.pop(0)
        self.reading += 1
        return self.now


@pytest.mark.parametrize("reduce, expected", [("median", 3.0), ("min", 1.0)])
def test_warmup_untimed_and_reduction(monkeypatch, reduce, expected):
    clock = ScriptedClock([5.0, 1.0, 3.0])
    monkeypatch.setattr(timing.time, "perf_counter", clock.perf_counter)
    calls = []
    seconds = timing.call_seconds(lambda: calls.append(1), repeats=3, warmup=2,
                                  reduce=reduce)
    assert len(calls) == 5  # 2 untimed + 3 timed
    assert seconds == expected


def test_even_repeats_median_is_the_mean_of_the_middle_two(monkeypatch):
    clock = ScriptedClock([4.0, 1.0, 2.0, 10.0])
    monkeypatch.setattr(timing.time, "perf_counter", clock.perf_counter)
    assert timing.call_seconds(lambda: None, repeats=4, warmup=0) == 3.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(repeats=0), "repeats"), (dict(warmup=-1), "warmup"), (dict(reduce="mean"), "reduce"),
    (dict(cuda_sync="yes"), "cuda_sync")])
def test_bad_arguments_name_the_parameter(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        timing.call_seconds(lambda: None, **kwargs)
    with pytest.raises(TypeError, match="fn"):
        timing.call_seconds(3)


def test_call_times_returns_every_timed_call_in_order(monkeypatch):
    clock = ScriptedClock([5.0, 1.0, 3.0])
    monkeypatch.setattr(timing.time, "perf_counter", clock.perf_counter)
    calls = []
    times = timing.call_times(lambda: calls.append(1), repeats=3, warmup=1)
    assert times == [5.0, 1.0, 3.0]
    assert len(calls) == 4


@pytest.mark.parametrize("budget, most, expected", [
    (0.0, 5, [2.0]),                  # no budget left after the least calls
    (5.0, 5, [2.0, 2.0, 2.0]),        # stops once the calls add up to the budget
    (100.0, 4, [2.0, 2.0, 2.0, 2.0]),  # stops at max_repeats
])
def test_call_times_budget(monkeypatch, budget, most, expected):
    clock = ScriptedClock([2.0] * 10)
    monkeypatch.setattr(timing.time, "perf_counter", clock.perf_counter)
    assert timing.call_times(lambda: None, repeats=1, warmup=0, budget_s=budget,
                             max_repeats=most) == expected


def test_call_times_without_budget_ignores_max_repeats(monkeypatch):
    clock = ScriptedClock([1.0] * 10)
    monkeypatch.setattr(timing.time, "perf_counter", clock.perf_counter)
    assert len(timing.call_times(lambda: None, repeats=2, warmup=0, max_repeats=6)) == 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(repeats=0), "repeats"), (dict(warmup=-1), "warmup"), (dict(budget_s=-1.0), "budget_s"),
    (dict(budget_s=1.0, repeats=3, max_repeats=2), "max_repeats"),
    (dict(cuda_sync=1), "cuda_sync")])
def test_call_times_bad_arguments_name_the_parameter(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        timing.call_times(lambda: None, **kwargs)
    with pytest.raises(TypeError, match="fn"):
        timing.call_times(None)
