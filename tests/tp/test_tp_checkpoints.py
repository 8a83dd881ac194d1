"""2D and 3D checkpoints: DCP-native, resharded across dp x tp splits, interchangeable with
torch's fully_shard + TP, loadable into 1D FSDP and into one process.

A checkpoint (model and AdamW state) is saved after 2 steps. A fresh model in another layout
loads it: every value must come back exactly, and 2 more steps must give the saving run's
losses (the same global batch in every layout, so equal up to summation order).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from harness.pool import run_on_ranks
from tests.tp import tp_models
from tests.tp.tp_ckpt import RESUMED, load_body, save_body

LAYOUTS: dict[str, tuple[int, ...]] = {
    "2x2": (2, 2),
    "4x1": (4, 1),
    "1x4": (1, 4),
    "1x2x2": (1, 2, 2),
    "2x1x2": (2, 1, 2),
    "fsdp4": (4,),  # 1D FSDP, no TP
}

Saver = Callable[[str, str], dict[str, Any]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saver:
    """Saves one checkpoint per (implementation, layout) on first use."""
    runs: dict[tuple[str, str], dict[str, Any]] = {}

    def save(impl: str, layout: str) -> dict[str, Any]:
        if (impl, layout) not in runs:
            path = tmp_path_factory.mktemp(f"ckpt_{impl}_{layout}")
            result = run_on_ranks(4, save_body, impl=impl, layout=LAYOUTS[layout], path=str(path))[
                0
            ]
            runs[(impl, layout)] = dict(result, path=str(path))
        return runs[(impl, layout)]

    return save


def _assert_same(
    loaded: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], what: str
) -> None:
    assert loaded.keys() == saved.keys(), what
    differs = [name for name in saved if not loaded[name].equal(saved[name])]
    assert differs == [], f"{what}: loaded values differ from the saved ones: {differs}"


def _assert_loaded(result: dict[str, Any], saver: dict[str, Any]) -> None:
    _assert_same(result["model"], saver["model"], "model")
    _assert_same(result["optim"], saver["optim"], "optimizer")
    assert result["after"] == pytest.approx(saver["after"], rel=1e-5)


@pytest.mark.parametrize(
    ("save_layout", "load_layout"),
    [
        ("2x2", "4x1"),
        ("2x2", "1x4"),
        ("4x1", "2x2"),
        ("1x4", "2x2"),
        ("2x2", "1x2x2"),
        ("2x1x2", "2x2"),
        ("2x2", "fsdp4"),
        ("fsdp4", "2x2"),
    ],
)
def test_dcp_reshards_across_dp_x_tp_splits(
    saved: Saver, save_layout: str, load_layout: str
) -> None:
    saver = saved("shardkit", save_layout)
    result = run_on_ranks(
        4, load_body, impl="shardkit", layout=LAYOUTS[load_layout], path=saver["path"]
    )[0]
    _assert_loaded(result, saver)


@pytest.mark.parametrize(
    ("saver_impl", "loader_impl"), [("torch", "shardkit"), ("shardkit", "torch")]
)
def test_dcp_interchanges_with_torch_fully_shard_and_tp(
    saved: Saver, saver_impl: str, loader_impl: str
) -> None:
    saver = saved(saver_impl, "2x2")
    result = run_on_ranks(4, load_body, impl=loader_impl, layout=(2, 2), path=saver["path"])[0]
    _assert_loaded(result, saver)


def _metadata(path: str) -> dict[str, Any]:
    """What DCP recorded for each key: global size, dtype and the chunks written."""
    out: dict[str, Any] = {}
    for key, meta in FileSystemReader(path).read_metadata().state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            out[key] = type(meta).__name__
            continue
        out[key] = (
            tuple(meta.size),
            meta.properties.dtype,
            sorted((tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks),
        )
    return out


def test_both_write_the_same_metadata(saved: Saver) -> None:
    assert _metadata(saved("shardkit", "2x2")["path"]) == _metadata(saved("torch", "2x2")["path"])


def test_a_2d_checkpoint_loads_into_one_process(saved: Saver, tmp_path: Path) -> None:
    saver = saved("shardkit", "2x2")
    out = tmp_path / "model.pt"
    dcp_to_torch_save(saver["path"], out)
    state = torch.load(out, weights_only=True)
    model = tp_models.build("sp", seed=7)
    model.load_state_dict(state["model"])
    values = {name: p.detach() for name, p in model.named_parameters()}
    _assert_same(values, saver["model"], "model")
    # The single process goes on from there with the saving run's losses (its own optimizer
    # state is fresh, so only the first resumed step is comparable).
    x, y = tp_models.batch("sp", RESUMED[0], 4)
    loss = F.mse_loss(model(x), y)
    assert loss.item() == pytest.approx(saver["after"][0], rel=1e-5)


def _writeback(rank: int, world_size: int) -> dict[str, Any]:
    from tests.tp.tp_ckpt import adamw, build, train

    model, *dp = build("shardkit", (2, 2))
    opt = adamw(model)
    train(model, opt, range(1), (dp[0], dp[1]))
    params: dict[str, Any] = dict(model.named_parameters())
    state = model.state_dict()
    # The state dict holds the sharded DTensors themselves (detached): no copy.
    aliases = all(
        state[name].placements == p.placements
        and state[name].to_local().data_ptr() == p.to_local().data_ptr()
        for name, p in params.items()
    )
    doubled = {name: (2 * value).detach() for name, value in state.items()}
    model.load_state_dict(doubled)
    after: dict[str, Any] = dict(model.named_parameters())
    in_place = all(after[name] is p for name, p in params.items())
    # The optimizer still holds the same objects, and sees the loaded values.
    seen = all(any(q is p for q in opt.param_groups[0]["params"]) for p in after.values())
    values = {name: p.full_tensor() for name, p in after.items()}
    expected = {name: v.full_tensor() for name, v in doubled.items()}
    return {
        "aliases": aliases,
        "in_place": in_place,
        "seen": seen,
        "values": values,
        "expected": expected,
    }


def test_2d_state_dict_is_the_parameters_and_loads_in_place() -> None:
    result = run_on_ranks(4, _writeback)[0]
    assert result["aliases"] and result["in_place"] and result["seen"]
    for name, value in result["expected"].items():
        assert torch.equal(result["values"][name], value), name
