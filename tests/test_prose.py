"""prose: the words of a generated sentence follow the numbers."""
from __future__ import annotations

import pytest

from companion.book import prose


@pytest.mark.parametrize("a, b, word", [(0.37, 0.342, "above"), (0.29, 0.291, "below"),
                                        (2, 2, "equal to")])
def test_compare_follows_the_values(a, b, word):
    assert prose.compare(a, b) == word


def test_compare_words_and_tolerance():
    assert prose.compare(3.0, 1.0, more="slower", less="faster") == "slower"
    assert prose.compare(1.0, 1.04, rel_tol=0.05) == "equal to"
    assert prose.compare(1.0, 1.06, rel_tol=0.05) == "below"


@pytest.mark.parametrize("call, exc, match", [
    (lambda: prose.compare("a", 1), TypeError, "a: expected a number"),
    (lambda: prose.compare(True, 1), TypeError, "a: expected a number"),
    (lambda: prose.compare(float("nan"), 1), ValueError, "numbers to compare"),
    (lambda: prose.num(None), TypeError, "x: expected a number"),
    (lambda: prose.claim_phrase({"id": "x"}), TypeError, "record: expected a claim"),
    (lambda: prose.show(3), TypeError, "markdown: expected a str"),
])
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_claim_phrase_states_measurement_interval_and_verdict():
    rec = {"measured": 0.412, "interval": (0.38, 0.44), "verdict": "reproduced"}
    assert prose.claim_phrase(rec) == "0.412 (interval [0.38, 0.44]): reproduced"
    assert prose.claim_phrase({"measured": False, "verdict": "fails"}) == "does not hold: fails"
