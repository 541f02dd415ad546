"""hf_pma.utils.parsing: the one check of "an integer, not a bool, in range" and of "a number"."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hf_pma.utils.parsing import check_int, is_int, is_number

bounds = st.one_of(st.none(), st.integers(-5, 5))


@given(
    st.one_of(st.integers(-10, 10), st.booleans(), st.floats(), st.text(max_size=3), st.none()),
    bounds,
    bounds,
)
def test_is_int_is_an_int_not_a_bool_within_the_bounds(value, low, high):
    expected = type(value) is int and (low is None or value >= low) and (high is None or value <= high)
    assert is_int(value, low, high) is expected


@given(st.one_of(st.integers(-10, 10), st.booleans(), st.floats(), st.text(max_size=3), st.none()))
def test_is_number_takes_ints_and_floats_but_no_bools(value):
    number = type(value) in (int, float)
    assert is_number(value) is number
    assert is_number(value, finite=True) is (number and math.isfinite(value))


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, "last"), "last must be a positive integer, got 0"),
        ((True, "last"), "last must be a positive integer, got True"),
        ((2.0, "every"), "every must be a positive integer, got 2.0"),
        ((-1, "snapshot_steps", 0), "snapshot_steps must be a non-negative integer, got -1"),
        ((None, "keep_last"), "keep_last must be a positive integer, got None"),
        (("3", "keep_last", 1, None, True), "keep_last must be a positive integer or None, got '3'"),
        ((9, "rank", 0, 7), "rank must be an integer from 0 to 7, got 9"),
        ((1, "depth", 2), "depth must be an integer >= 2, got 1"),
        (("\x1b[2J" * 40, "n"), "n must be a positive integer, got '\\x1b[2J"),
    ],
)
def test_check_int_names_the_parameter_in_one_line(args, message):
    with pytest.raises(ValueError) as info:
        check_int(*args)
    assert (
        str(info.value).startswith(message) and "\n" not in str(info.value) and "\x1b" not in str(info.value)
    )


@given(st.integers(1, 10**30))
def test_check_int_returns_what_it_accepts(value):
    assert check_int(value, "n") is value
    assert check_int(None, "n", allow_none=True) is None
