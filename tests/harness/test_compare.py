"""Comparing the per-rank values of a task: equal, close, and where they differ."""

from __future__ import annotations

import math

import pytest
import torch

from harness.compare import assert_all_close, assert_all_equal


def test_equal_values_pass() -> None:
    value = {"loss": [1.5, math.nan], "params": (torch.arange(3.0), None), "name": "w"}
    assert_all_equal([value, value, {**value}])


def test_difference_names_the_rank_and_the_place() -> None:
    base = {"loss": [1.0, 2.0], "step": 3}
    with pytest.raises(
        AssertionError, match=r"rank 2 differs from rank 0 at \['loss'\]\[1\]: 2\.5"
    ):
        assert_all_equal([base, base, {"loss": [1.0, 2.5], "step": 3}])


def test_tensors_must_match_in_value_dtype_and_shape() -> None:
    ones = torch.ones(2)
    with pytest.raises(AssertionError, match=r"(?s)rank 1 .* at \[0\]: .*Mismatched elements"):
        assert_all_equal([[ones], [torch.tensor([1.0, 1.5])]])
    with pytest.raises(AssertionError, match="dtype"):
        assert_all_equal([ones, ones.double()])
    with pytest.raises(AssertionError, match="shape"):
        assert_all_equal([ones, torch.ones(3)])


def test_types_and_structure_must_match() -> None:
    with pytest.raises(AssertionError, match="float instead of int"):
        assert_all_equal([1, 1.0])
    with pytest.raises(AssertionError, match="keys"):
        assert_all_equal([{"a": 1}, {"b": 1}])
    with pytest.raises(AssertionError, match="length 1 instead of 2"):
        assert_all_equal([[1, 2], [1]])


def test_close_allows_the_tolerance_and_no_more() -> None:
    assert_all_close([[1.0, torch.ones(2)], [1.0 + 1e-7, torch.ones(2) + 1e-7]], rtol=1e-6, atol=0)
    with pytest.raises(AssertionError, match="rank 1"):
        assert_all_close([1.0, 1.01], rtol=1e-6, atol=0.0)


def test_no_results_is_a_mistake() -> None:
    with pytest.raises(ValueError, match="no results"):
        assert_all_equal([])
