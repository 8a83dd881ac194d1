"""Tensor-subclass parameters gathered through fsdp_pre_all_gather / fsdp_post_all_gather.

The subclass (tests/core/quant_support.py) keeps fp32 data and sends int8 rows plus fp32
scales: two inputs of different dtypes, so the all-gather carries bytes. shardkit must train
it bit for bit as torch's fully_shard does, and as a single process that applies the same
quantize/dequantize round trip in forward; send the quantized bytes, not fp32; call the post
hook with ``out=`` from the second unshard on; and refuse what torch refuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from harness.pool import run_on_ranks
from shardkit.core.layout import HookInput, ParamSpec, group_layout
from tests.core import quant_support as qs
from tests.core.parity import fully_shard_of, global_loss, rank_batch

TORCH_ONE_HOOK = (
    "Both fsdp_pre_all_gather and fsdp_post_all_gather should be defined if using all-gather "
    "extensions"
)


@dataclass(frozen=True, kw_only=True)
class Case:
    """One training configuration of the differential test."""

    tensor: str = "QuantTensor"  # the subclass, by name in quant_support
    uneven: bool = False  # the 3-row head is quantized too
    mp: bool = False  # MixedPrecisionPolicy(param_dtype=bf16)
    offload: bool = False  # CPUOffloadPolicy
    hsdp: bool = False  # a 2x2 (replicate, shard) mesh
    shard_dim: int = 0  # the dim the quantized weights are sharded on

    @property
    def single_process(self) -> bool:
        """Whether the single process is a reference (bf16 compute and column-wise scales
        are not what it computes)."""
        return not self.mp and self.shard_dim == 0


def _api(impl: str) -> Any:
    if impl == "shardkit":
        import shardkit.core as api

        return api
    import torch.distributed.fsdp as torch_api

    return torch_api


def _mesh(case: Case, world_size: int) -> DeviceMesh:
    if case.hsdp:
        return init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world_size,))


def _shard(impl: str, model: qs.QuantNet, case: Case, world_size: int, **extra: Any) -> None:
    api = _api(impl)
    kwargs: dict[str, Any] = {"mesh": _mesh(case, world_size), **extra}
    if case.mp:
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if case.offload:
        kwargs["offload_policy"] = api.CPUOffloadPolicy(pin_memory=False)  # torch's needs it
    if case.shard_dim:
        dim = case.shard_dim
        kwargs["shard_placement_fn"] = lambda p: Shard(dim) if isinstance(p, qs.QuantData) else None
    for block in model.blocks:
        fully_shard_of(impl)(block, **kwargs)
    fully_shard_of(impl)(model, **kwargs)


def _plain_params(model: nn.Module) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        value = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = value.plain() if isinstance(value, qs.QuantData) else value.detach().clone()
    return out


def _train(impl: str, rank: int, world_size: int, case: Case) -> dict[str, Any]:
    qs.reset_records()
    local = impl == "local"
    model = qs.build(
        "local" if local else "sharded", uneven=case.uneven, tensor_cls=getattr(qs, case.tensor)
    )
    if not local:
        _shard(impl, model, case, world_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses: list[float] = []
    for step in range(5):
        x, y = rank_batch("mlp", step, rank, world_size, impl)
        loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_loss(loss, impl, world_size))
    local_types = {
        type(p.to_local()).__name__ for p in model.parameters() if isinstance(p, DTensor)
    }
    return {
        "losses": losses,
        "params": _plain_params(model),
        "calls": dict(qs.CALLS),
        "local_types": local_types,
        "freed": qs.all_freed(),  # after backward every group resharded
    }


def _parity_body(rank: int, world_size: int, case: Case) -> dict[str, Any]:
    impls = ("shardkit", "torch", "local") if case.single_process else ("shardkit", "torch")
    return {impl: _train(impl, rank, world_size, case) for impl in impls}


def _tolerance(case: Case, world_size: int) -> float:
    """Bit for bit where two ranks shard; with four, torch's reduce-scatter sums the
    gradients in another order than shardkit's, for plain parameters as for these (the
    differences are of the last bits: below 1e-7 in fp32, 1e-3 after five bf16 steps)."""
    shard_ranks = world_size // 2 if case.hsdp else world_size
    if shard_ranks == 2:
        return 0.0
    return 1e-3 if case.mp else 1e-6


def _same(ours: dict[str, Any], theirs: dict[str, Any], tol: float) -> None:
    torch.testing.assert_close(ours["losses"], theirs["losses"], rtol=tol, atol=tol)
    assert ours["params"].keys() == theirs["params"].keys()
    for name, value in ours["params"].items():
        torch.testing.assert_close(value, theirs["params"][name], rtol=tol, atol=tol, msg=name)


CASES = {
    "fp32": (Case(), [2, 4]),
    "bf16": (Case(mp=True), [2, 4]),
    "legacy_signature": (Case(tensor="LegacyQuantTensor"), [2]),
    # Shards cut by torch.chunk, as torch's are (torchao's NF4 refuses narrow).
    "chunk_only": (Case(tensor="ChunkOnlyQuantTensor"), [2]),
    "uneven": (Case(tensor="FullScaleQuantTensor", uneven=True), [2, 4]),
    "shard_dim_1": (Case(tensor="FullScaleQuantTensor", shard_dim=1), [2]),
    "cpu_offload": (Case(offload=True), [2]),
    "hsdp": (Case(hsdp=True), [4]),
}


@pytest.mark.parametrize(
    ("name", "world_size"),
    [pytest.param(n, w, id=f"{n}-w{w}") for n, (_, sizes) in CASES.items() for w in sizes],
)
def test_trains_as_torch_and_the_single_process(name: str, world_size: int) -> None:
    case = CASES[name][0]
    result = run_on_ranks(world_size, _parity_body, case=case)[0]
    ours, theirs = result["shardkit"], result["torch"]
    _same(ours, theirs, _tolerance(case, world_size))  # bit for bit at W=2
    # The same hook calls: the post hook builds each parameter once, then fills it (out=)
    # with the first call's all-gather outputs, whose memory each reshard frees.
    assert ours["calls"] == theirs["calls"]
    assert ours["calls"]["post"] == (5 if case.uneven else 4)
    assert ours["calls"]["post_out"] == ours["calls"]["post_out_same_outputs"] > 0
    assert ours["freed"] and theirs["freed"]
    assert "QuantTensor" in "".join(ours["local_types"])  # the sharded local stays the subclass
    if case.single_process:
        _same(ours, result["local"], 1e-5)


def _one_rank_body(rank: int, world_size: int) -> dict[str, Any]:
    case = Case()
    result: dict[str, Any] = {
        impl: _train(impl, rank, world_size, case) for impl in ("shardkit", "local")
    }
    try:
        _train("torch", rank, world_size, case)
        result["torch_error"] = ""
    except ValueError as error:
        result["torch_error"] = str(error)
    return result


def test_one_rank_trains_as_the_single_process() -> None:
    result = run_on_ranks(1, _one_rank_body)[0]
    _same(result["shardkit"], result["local"], 1e-5)
    assert result["shardkit"]["calls"]["post_out"] > 0
    # Differs from torch on purpose: torch's world-size-1 path hands the post hook only the
    # first of the pre hook's tensors, so a subclass with two cannot train there.
    assert "not enough values to unpack" in result["torch_error"]


def _gather_bytes_body(rank: int, world_size: int) -> dict[str, Any]:
    from shardkit.core import CollectiveEvent, layout_of, subscribe

    model = qs.build("sharded")
    _shard("shardkit", model, Case(), world_size)
    before = {g.fqn: g.layout.hooks_pending for g in layout_of(model)}
    events: list[CollectiveEvent] = []
    unsubscribe = subscribe(lambda e: events.append(e) if isinstance(e, CollectiveEvent) else None)
    x, y = rank_batch("mlp", 0, rank, world_size, "shardkit")
    nn.functional.mse_loss(model(x), y).backward()
    unsubscribe()
    after = {
        g.fqn: (g.layout.hooks_pending, g.layout.all_gather_input_bytes) for g in layout_of(model)
    }
    gathers = [(e.module_fqn, e.input_bytes) for e in events if e.kind == "all_gather"]
    return {"before": before, "after": after, "gathers": gathers}


def _slot(nbytes: int) -> int:
    return -(-nbytes // 16) * 16  # slots of the all-gather input are 16-byte aligned


def test_the_all_gather_sends_the_quantized_bytes() -> None:
    result = run_on_ranks(2, _gather_bytes_body)[0]
    # A block at W=2: fc1.weight's shard is 16x16 (int8 rows + 16 fp32 scales), fc1.bias 16
    # fp32, fc2.weight's 8x32 (int8 + 8 scales), fc2.bias 8 fp32.
    quantized = (
        _slot(_slot(16 * 16) + 16 * 4) + _slot(16 * 4) + _slot(_slot(8 * 32) + 8 * 4) + _slot(8 * 4)
    )
    fp32 = (16 * 16 + 16 + 8 * 32 + 8) * 4
    assert quantized < fp32 / 2
    blocks = [nbytes for fqn, nbytes in result["gathers"] if fqn.startswith("blocks.")]
    assert blocks == [quantized] * 4  # two blocks, forward and backward: one gather each
    # The layout view tells the hook inputs only once known, then the bytes sent.
    assert result["before"]["blocks.0"] == ("fc1.weight", "fc2.weight")
    assert result["after"]["blocks.0"] == ((), quantized)
    assert result["before"]["<root>"] == ()


def _errors_body(rank: int, world_size: int, impl: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for cls in ("PreOnlyTensor", "PostOnlyTensor"):
        model = qs.build("sharded", tensor_cls=getattr(qs, cls))
        try:
            _shard(impl, model, Case(), world_size)
            out[cls] = "no error"
        except AssertionError as error:
            out[cls] = (str(error), type(model) is qs.QuantNet, isinstance(error, TypeError))
    model = qs.build("sharded", tensor_cls=qs.TwoArgumentTensor)
    _shard(impl, model, Case(), world_size)
    try:
        model(rank_batch("mlp", 0, rank, world_size, impl)[0])
        out["signature"] = "no error"
    except AssertionError as error:
        out["signature"] = str(error)
    return out


def test_one_hook_alone_or_a_wrong_signature_fails_as_torch() -> None:
    ours = run_on_ranks(1, _errors_body, impl="shardkit")[0]
    theirs = run_on_ranks(1, _errors_body, impl="torch")[0]
    for cls in ("PreOnlyTensor", "PostOnlyTensor"):
        message, untouched, is_type_error = ours[cls]
        assert message.startswith(TORCH_ONE_HOOK) and theirs[cls][0].startswith(TORCH_ONE_HOOK)
        assert "fc1.weight" in message  # names the parameter
        assert untouched and is_type_error  # refused before anything changed
    # torch's whole message (the signature found, the one expected), then the parameter.
    assert theirs["signature"].startswith("Invalid fsdp_pre_all_gather: (mesh")
    assert ours["signature"].startswith(theirs["signature"])
    assert "fc1.weight of FSDP module blocks.0" in ours["signature"]


def _uneven_body(rank: int, world_size: int, impl: str) -> tuple[bool, str]:
    model = qs.build("sharded", uneven=True)  # per-row scales: not the padded shard's size
    _shard(impl, model, Case(), world_size)
    if impl == "torch" and rank != world_size - 1:
        # torch checks only where the shard is short and raises before its collective; the
        # other ranks would wait in the all-gather for ever, so they do not run forward.
        return False, ""
    try:
        model(rank_batch("mlp", 0, rank, world_size, impl)[0])
    except AssertionError as error:
        return isinstance(error, ValueError) or impl == "torch", str(error)
    return False, "no error"


def test_unpadded_inputs_of_an_uneven_shard_fail_as_torch_on_every_rank() -> None:
    ours = run_on_ranks(2, _uneven_body, impl="shardkit")
    theirs = run_on_ranks(2, _uneven_body, impl="torch")
    torch_message = theirs[1][1]
    assert torch_message.startswith("When a parameter is unevenly sharded by FSDP")
    for raised, message in ours:  # every rank raises, so none hangs in the collective
        assert raised and message.startswith(torch_message), message
        assert "head.weight of FSDP module <root>" in message


def _reshard_int_body(rank: int, world_size: int, impl: str) -> dict[str, Any]:
    model = qs.build("sharded")
    try:
        _shard(impl, model, Case(), world_size, reshard_after_forward=2)
        model(rank_batch("mlp", 0, rank, world_size, impl)[0])
    except AssertionError as error:
        return {
            "message": str(error),
            "untouched": type(model) is qs.QuantNet,
            "not_implemented": isinstance(error, NotImplementedError),
        }
    return {"message": "no error"}


def test_reshard_after_forward_int_is_refused_as_torch_fails() -> None:
    ours = run_on_ranks(4, _reshard_int_body, impl="shardkit")[0]
    theirs = run_on_ranks(4, _reshard_int_body, impl="torch")[0]
    # torch fails after the first forward (an AssertionError); shardkit at fully_shard.
    assert theirs["message"].startswith("Expected 1 all_gather_output")
    assert "reshard_after_forward=2 is not supported" in ours["message"]
    assert "fc1.weight" in ours["message"]
    assert ours["untouched"] and ours["not_implemented"]


def _state_dict_body(rank: int, world_size: int, impl: str, path: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    model = qs.build("sharded")
    _shard(impl, model, Case(), world_size)
    x, y = rank_batch("mlp", 0, rank, world_size, impl)
    nn.functional.mse_loss(model(x), y).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    sharded = model.state_dict()["blocks.0.fc1.weight"]
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)
    out: dict[str, Any] = {
        "sharded": (type(sharded).__name__, type(sharded.to_local()).__name__),
        "full": {k: v.plain() if isinstance(v, qs.QuantData) else v for k, v in full.items()},
        "params": _plain_params(model),
    }
    dcp_save(model.state_dict(), checkpoint_id=f"{path}/{impl}")
    other = qs.build("sharded")
    _shard("torch" if impl == "shardkit" else "shardkit", other, Case(), world_size)
    target = other.state_dict()
    with torch.serialization.safe_globals([qs.QuantTensor]):  # DCP pickles the subclass
        dcp_load(target, checkpoint_id=f"{path}/{impl}")
    other.load_state_dict(target)
    out["loaded_by_the_other"] = _plain_params(other)
    if impl == "shardkit":
        from shardkit.core import iter_full_state_dict

        try:
            list(iter_full_state_dict(model))
            out["iter_full"] = "no error"
        except NotImplementedError as error:
            out["iter_full"] = str(error)
    return out


def test_state_dicts_and_dcp_as_torch(tmp_path: Path) -> None:
    ours = run_on_ranks(2, _state_dict_body, impl="shardkit", path=str(tmp_path))[0]
    theirs = run_on_ranks(2, _state_dict_body, impl="torch", path=str(tmp_path))[0]
    assert ours["sharded"] == theirs["sharded"] == ("DTensor", "QuantTensor")
    assert ours["full"].keys() == theirs["full"].keys()
    for name, value in ours["full"].items():  # get_model_state_dict(full_state_dict=True)
        torch.testing.assert_close(value, theirs["full"][name], rtol=0, atol=0, msg=name)
    for result in (ours, theirs):  # saved by one implementation, loaded by the other
        for name, value in result["params"].items():
            torch.testing.assert_close(
                result["loaded_by_the_other"][name], value, rtol=0, atol=0, msg=name
            )
    # shardkit's own full-state-dict files refuse such parameters by name (DCP handles them).
    assert "blocks.0.fc1.weight" in ours["iter_full"]


def test_layout_plans_hook_inputs_once_known() -> None:
    hooked = ParamSpec(fqn="w", shape=(6, 4), dtype=torch.float32, all_gather_hooks=True)
    bias = ParamSpec(fqn="b", shape=(6,), dtype=torch.float32)
    before = group_layout([hooked, bias], shard_world=2)
    assert before.hooks_pending == ("w",)
    assert before.storage.numels == (0, 3)  # the subclass keeps its own storage
    inputs = (HookInput(12, torch.int8), HookInput(3, torch.float32))
    after = group_layout(
        [
            ParamSpec(
                fqn="w",
                shape=(6, 4),
                dtype=torch.float32,
                all_gather_hooks=True,
                all_gather_inputs=inputs,
            ),
            bias,
        ],
        shard_world=2,
    )
    assert after.hooks_pending == ()
    w = after.params[0]
    assert w.all_gather_inputs is not None and w.all_gather_inputs.offsets == (0, 16)
    # w: 12 int8 bytes, then 3 fp32 scales at 16 -> a 32-byte slot; b: 3 fp32 at 32.
    assert after.all_gather_input_bytes == 48
    assert after.unsharded.numels == (0, 6)  # the hook's outputs are the parameter's own
    assert after.reduce_scatter_output_numel == 12 + 3  # gradients are plain, as before
