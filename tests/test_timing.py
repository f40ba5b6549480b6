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
