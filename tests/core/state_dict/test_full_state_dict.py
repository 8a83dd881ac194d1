"""Full state dicts in one file, streamed through rank 0 group by group, both formats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from harness.pool import run_on_ranks
from tests.core import models
from tests.core.parity import Run, apply, full_params

FORMATS = ["model.safetensors", "model.pt"]
# Loading also reads torch.save's legacy (non-zip) format, as torch.load(weights_only=True) does.
LOAD_FORMATS = [*FORMATS, "legacy.pt"]


def _write(state_dict: dict[str, torch.Tensor], path: Path) -> None:
    """``state_dict`` in the format ``path``'s name asks for."""
    if path.name.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(state_dict, path)
    else:
        torch.save(state_dict, path, _use_new_zipfile_serialization=path.name != "legacy.pt")


def _sharded(world_size: int, seed: int = 0, hsdp: tuple[int, int] | None = None, **kw: Any) -> Any:
    model = models.build("gpt", seed=seed)
    run = Run(model="gpt", hsdp=hsdp, **kw)
    from tests.core.parity import make_mesh

    apply("shardkit", model, make_mesh(run, world_size), run)
    return model


def _save_body(
    rank: int, world_size: int, path: str, hsdp: tuple[int, int] | None
) -> dict[str, torch.Tensor]:
    from shardkit.core import save_full_state_dict

    model = _sharded(world_size, seed=4, hsdp=hsdp)
    x, y = models.batch("gpt", 0, 2)
    models.loss_of("gpt", model(x), y).backward()  # after a step's worth of hooks
    save_full_state_dict(model, path)
    return full_params(model)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize(("world_size", "hsdp"), [(1, None), (2, None), (4, (2, 2))])
def test_save_writes_the_full_state_dict(
    world_size: int, hsdp: tuple[int, int] | None, name: str, tmp_path: Path
) -> None:
    path = tmp_path / name
    params = run_on_ranks(world_size, _save_body, path=str(path), hsdp=hsdp)[0]
    if name.endswith(".safetensors"):
        from safetensors.torch import load_file

        loaded = load_file(path)
    else:
        loaded = torch.load(path, weights_only=True)
    reference = models.build("gpt", seed=4).state_dict()
    if name.endswith(".pt"):
        assert list(loaded) == list(reference)  # every key, in the model's order
    assert set(loaded) == set(reference)
    for key, value in params.items():
        assert loaded[key].equal(value), key
    assert loaded["scale"].equal(reference["scale"])  # buffers too
    assert not path.with_name(path.name + ".partial").exists()


def _load_body(
    rank: int, world_size: int, path: str, hsdp: tuple[int, int] | None
) -> dict[str, torch.Tensor]:
    from shardkit.core import load_full_state_dict

    model = _sharded(world_size, seed=0, hsdp=hsdp)
    ptrs = {n: p.to_local().data_ptr() for n, p in model.named_parameters()}
    load_full_state_dict(model, path)
    moved = [
        n
        for n, p in model.named_parameters()
        if p.to_local().numel() and p.to_local().data_ptr() != ptrs[n]
    ]
    assert not moved, f"load replaced storage of {moved}"
    x, y = models.batch("gpt", 0, 2)
    out = full_params(model)
    out["__loss__"] = models.loss_of("gpt", model(x), y).detach().reshape(1)
    return out


@pytest.mark.parametrize("name", LOAD_FORMATS)
@pytest.mark.parametrize(("world_size", "hsdp"), [(1, None), (2, None), (4, None), (4, (2, 2))])
def test_load_from_a_single_process_file(
    world_size: int, hsdp: tuple[int, int] | None, name: str, tmp_path: Path
) -> None:
    reference = models.build("gpt", seed=11)
    path = tmp_path / name
    _write(reference.state_dict(), path)
    results = run_on_ranks(world_size, _load_body, path=str(path), hsdp=hsdp)
    x, y = models.batch("gpt", 0, 2)
    expected_loss = models.loss_of("gpt", reference(x), y)
    for key, value in reference.state_dict().items():
        if key != "scale":
            assert results[0][key].equal(value), key
    torch.testing.assert_close(results[0]["__loss__"][0], expected_loss, rtol=1e-6, atol=0)


def _reshard_body(rank: int, world_size: int, path: str, save: bool) -> dict[str, torch.Tensor]:
    from shardkit.core import load_full_state_dict, save_full_state_dict

    model = _sharded(world_size, seed=6 if save else 0)
    if save:
        save_full_state_dict(model, path)
    else:
        load_full_state_dict(model, path)
    return full_params(model)


def test_save_at_two_ranks_load_at_four(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt.safetensors")
    saved = run_on_ranks(2, _reshard_body, path=path, save=True)[0]
    loaded = run_on_ranks(4, _reshard_body, path=path, save=False)[0]
    for key, value in saved.items():
        assert loaded[key].equal(value), key


@pytest.mark.parametrize("name", LOAD_FORMATS)
def test_bf16_file_loads_into_an_fp32_model(name: str, tmp_path: Path) -> None:
    # Hugging Face weights often come in bf16; load_state_dict converts them, so does this.
    reference = {
        k: v.to(torch.bfloat16) for k, v in models.build("gpt", seed=11).state_dict().items()
    }
    path = tmp_path / name
    _write(reference, path)
    loaded = run_on_ranks(2, _load_body, path=str(path), hsdp=None)[0]
    for key, value in reference.items():
        if key != "scale":
            assert loaded[key].dtype == torch.float32 and loaded[key].equal(value.float()), key


def _bad_file_body(rank: int, world_size: int, path: str) -> dict[str, Any]:
    from shardkit.core import load_full_state_dict

    model = _sharded(world_size)
    before = full_params(model)
    try:
        load_full_state_dict(model, path)
        message = "no error"
    except RuntimeError as error:
        message = str(error)
    after = full_params(model)
    return {"message": message, "unchanged": all(after[k].equal(v) for k, v in before.items())}


@pytest.mark.parametrize("name", FORMATS)
def test_bad_file_is_refused_before_any_write(name: str, tmp_path: Path) -> None:
    sd = models.build("gpt", seed=2).state_dict()
    sd["blocks.1.mlp.0.weight"] = torch.zeros(3, 3)
    del sd["ln_f.bias"]
    path = tmp_path / name
    _write(sd, path)
    results = run_on_ranks(2, _bad_file_body, path=str(path))
    for result in results:  # every rank raises the same error
        assert "blocks.1.mlp.0.weight: shape mismatch" in result["message"]
        assert "ln_f.bias: missing" in result["message"]
        assert result["unchanged"]


def _checkpoint_wrapped_body(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh

    from shardkit.core import fully_shard, iter_full_state_dict

    def build(seed: int, shard: bool) -> Any:
        model = models.build("gpt", seed=seed)
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)  # torchtitan's order: AC, then FSDP
        if shard:
            mesh = init_device_mesh("cpu", (world_size,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        return model

    plain = build(seed=3, shard=False).state_dict()  # the oracle: keys and values
    sharded = build(seed=3, shard=True)
    full = dict(iter_full_state_dict(sharded, rank0_only=False))
    target = build(seed=5, shard=True)
    target.load_state_dict(plain)  # full tensors: each rank keeps its shard
    loaded = dict(iter_full_state_dict(target, rank0_only=False))
    return {"plain": plain, "full": full, "loaded": loaded}


def test_full_state_dicts_through_torchs_checkpoint_wrapper() -> None:
    # The wrapper renames its keys (no _checkpoint_wrapped_module.): a full state dict has
    # the plain model's keys with full tensors, and loads back under them.
    for out in run_on_ranks(2, _checkpoint_wrapped_body):
        for which in ("full", "loaded"):
            assert set(out[which]) == set(out["plain"])
            for key, value in out["plain"].items():
                assert type(out[which][key]) is torch.Tensor, (which, key)
                assert torch.equal(out[which][key], value), (which, key)
