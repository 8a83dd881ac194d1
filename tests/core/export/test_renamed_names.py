"""The export's names renamed in round four of the house keep working, with a warning."""

from __future__ import annotations

import pytest
import torch

import shardkit.core.export as export
from shardkit.core.export.axis_gathers import AxisGather, tensor_source


def test_stage_is_axis_gather_under_its_old_name() -> None:
    with pytest.warns(DeprecationWarning, match="renamed AxisGather"):
        old = export.Stage
    assert old is AxisGather is export.AxisGather
    with pytest.warns(DeprecationWarning, match="renamed AxisGather"):
        from shardkit.core.export import Stage
    assert Stage is AxisGather
    assert "Stage" not in export.__all__  # the old name is kept, not published again


def test_a_sources_stages_are_its_gathers() -> None:
    source = tensor_source("w", "w", torch.zeros(2, 3), torch.float32, keep_dims=set())
    with pytest.warns(DeprecationWarning, match="renamed TensorSource.gathers"):
        assert source.stages == source.gathers == ()


def test_other_missing_names_still_fail() -> None:
    with pytest.raises(AttributeError, match="Stages"):
        export.Stages  # noqa: B018
