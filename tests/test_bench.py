"""The benchmark's case lookup: an unknown case name is a clear error, not a StopIteration."""

import pytest

from lowbit.bench.common import case_named


def test_case_named_finds_the_row():
    cases = [("a", 1), ("b", 2)]
    assert case_named(cases, "b", "dense") == ("b", 2)


def test_case_named_unknown_name_lists_the_cases():
    with pytest.raises(ValueError, match=r"layer: no case named 'c'; cases are \['a', 'b'\]"):
        case_named([("a", 1), ("b", 2)], "c", "layer")
