"""Experts on their own mesh: ``shard_placement_fn`` returning torch's ``ShardPlacementResult``.

A small mixture-of-experts model on 4 gloo ranks: dense parameters on a data-parallel mesh of
4, the routed experts on a mesh of their own, one parameter group per mesh in each block.
Either with expert parallelism (a ("ep", "efsdp") mesh of 2x2: each ep rank holds different
experts, sharded over "efsdp", as torchtitan does) or with HSDP experts (an HSDPMeshInfo on a
(replicate, shard) mesh of 2x2). The oracle is torch's own ``fully_shard``: same seed, same
data, bit-identical losses, gradients and parameters, and the same state dict and groups.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from harness.pool import run_on_ranks
from tests.core.parity import fully_shard_of

_common = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_common")
if not hasattr(_common, "ShardPlacementResult"):
    pytest.skip("torch before 2.13 has no ShardPlacementResult", allow_module_level=True)

_DIM, _HIDDEN, _LOCAL_EXPERTS, _STEPS = 8, 16, 2, 3


class _Experts(nn.Module):
    """This rank's routed experts, as one grouped weight per projection."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, _DIM, _HIDDEN) * 0.2)  # (E, D, H)
        self.w2 = nn.Parameter(torch.randn(experts, _HIDDEN, _DIM) * 0.2)  # (E, H, D)

    def forward(self, x: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # As torchtitan's grouped experts: weights that are DTensors on the ep axis compute
        # on this rank's experts, their local tensors.
        w1, w2 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2))
        h = torch.einsum("td,edh->eth", x, w1).relu()  # (E, T, H)
        out = torch.einsum("eth,ehd->etd", h, w2)  # (E, T, D)
        return torch.einsum("te,etd->td", scores, out)  # (T, D)


class _Block(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(_DIM)
        self.router = nn.Linear(_DIM, _LOCAL_EXPERTS, bias=False)
        self.experts = _Experts(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        out: torch.Tensor = x + self.experts(h, self.router(h).softmax(-1))
        return out


class _MoE(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.embed = nn.Linear(4, _DIM)
        self.blocks = nn.ModuleList(_Block(experts) for _ in range(2))
        self.head = nn.Linear(_DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.head(h)
        return out


def _build(meshes: _Meshes | None) -> _MoE:
    """The same model on every rank, but for the experts: ep rank r keeps its own slice.

    A plain tensor of its experts, or (``ep_dtensor``) the whole weight as a DTensor sharded
    on the ep axis, as torchtitan's expert parallelism leaves it.
    """
    ep = 1 if meshes is None else meshes.ep
    torch.manual_seed(0)
    model = _MoE(_LOCAL_EXPERTS * ep)
    if ep == 1:
        return model
    assert meshes is not None
    for block in model.blocks:
        experts: Any = block.experts
        for name in ("w1", "w2"):
            full = getattr(experts, name).detach()
            if meshes.kind != "ep":
                mine: torch.Tensor = distribute_tensor(full, meshes.ep_mesh, [Shard(0)])
            else:
                start = meshes.ep_rank * _LOCAL_EXPERTS
                mine = full[start : start + _LOCAL_EXPERTS].clone()
            setattr(experts, name, nn.Parameter(mine))
    return model


class _Meshes:
    """The dense mesh of 4, the experts' mesh and its torch mesh description."""

    def __init__(self, kind: str) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

        self.kind = kind
        self.dp = init_device_mesh("cpu", (4,))
        self.dp_info = FSDPMeshInfo(mesh=self.dp, shard_mesh_dim=0)
        if kind.startswith("ep"):  # ep, ep_dtensor, ep_titan (its experts DTensors too)
            two_d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "efsdp"))
            self.ep, self.ep_rank, self.ep_mesh = 2, two_d.get_local_rank("ep"), two_d["ep"]
            self.experts: DeviceMesh = two_d["efsdp"]
            self.experts_info: Any = FSDPMeshInfo(mesh=self.experts, shard_mesh_dim=0)
        else:
            self.ep, self.ep_rank = 1, 0
            self.experts = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            self.experts_info = HSDPMeshInfo(
                mesh=self.experts, shard_mesh_dim=1, replicate_mesh_dim=0
            )

    def placement_fn(self, block: nn.Module) -> Any:
        """torchtitan's way for "ep" (every parameter placed); dense left to None for HSDP."""
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult

        experts: Any = block.experts
        expert_params = set(experts.parameters())

        def place(param: nn.Parameter) -> Any:
            if param in expert_params:
                return ShardPlacementResult(placement=Shard(0), mesh_info=self.experts_info)
            if self.kind.startswith("ep"):
                return ShardPlacementResult(placement=Shard(0), mesh_info=self.dp_info)
            return None

        return place


def _shard(impl: str, meshes: _Meshes) -> _MoE:
    fully_shard = fully_shard_of(impl)
    model = _build(meshes)
    # ep_dtensor: an int policy is each group's own: the dense group (4 ranks) keeps a half
    # after forward, the experts' (2 ranks) nothing.
    policy = 2 if meshes.kind == "ep_dtensor" else None
    for block in model.blocks:
        fully_shard(
            block,
            mesh=meshes.dp,
            reshard_after_forward=policy,
            shard_placement_fn=meshes.placement_fn(block),
        )
    fully_shard(model, mesh=meshes.dp)
    if meshes.kind == "ep_titan":
        # torchtitan's settings with expert parallelism: explicit prefetch, no division (as
        # plain sums: torch's divides by 1 in the collective otherwise, which gloo lacks).
        sharded: Any = model  # FSDPModule's methods, which the model's class does not show
        first, second = sharded.blocks
        first.set_modules_to_forward_prefetch([second])
        second.set_modules_to_backward_prefetch([first])
        for module in (first, second, sharded):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def _backward(model: Any, meshes: _Meshes, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The step's backward: two microbatches, the first without reductions, for ep_titan."""
    if meshes.kind != "ep_titan":
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss
    losses: list[torch.Tensor] = []
    for last, (xs, ys) in enumerate(zip(x.chunk(2), y.chunk(2), strict=True)):
        model.set_requires_gradient_sync(bool(last))
        losses.append(F.mse_loss(model(xs), ys))
        losses[-1].backward()
    return (losses[0] + losses[1]) / 2


def _full(tensors: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in tensors.items()
    }


def _train(impl: str, meshes: _Meshes, rank: int) -> tuple[_MoE, dict[str, Any]]:
    model = _shard(impl, meshes)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses: list[float] = []
    grads: dict[str, torch.Tensor] = {}
    for step in range(_STEPS):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(6, 4, generator=gen), torch.randn(6, 3, generator=gen)
        losses.append(_backward(model, meshes, x, y).item())
        if step == _STEPS - 1:
            grads = _full({n: p.grad for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return model, {
        "losses": losses,
        "grads": grads,
        "params": _full(dict(model.named_parameters())),
        "state_dict": _describe(model.state_dict()),
        "groups": _groups_of(impl, model),
    }


def _describe(state_dict: dict[str, Any]) -> dict[str, tuple[str, list[Any], torch.Tensor]]:
    """Each key's placements, mesh (ranks and axis names) and local shard."""
    out = {}
    for key, value in state_dict.items():
        assert isinstance(value, DTensor), f"{key} is no DTensor"
        mesh = value.device_mesh
        where = [mesh.mesh.tolist(), mesh.mesh_dim_names]
        out[key] = (repr(value.placements), where, value.to_local().detach().clone())
    return out


def _groups_of(impl: str, model: _MoE) -> list[list[list[str]]]:
    """Each state's ``_fsdp_param_groups``, as torch's ``fully_shard.state`` shows them."""
    fully_shard = fully_shard_of(impl)
    out = []
    for module in (*model.blocks, model):
        state = fully_shard.state(module)  # type: ignore[attr-defined]
        groups = [[p._param_fqn for p in g.fsdp_params] for g in state._fsdp_param_groups]
        if len(groups) > 1:
            try:
                state._fsdp_param_group  # noqa: B018  (one group only: ambiguous here)
                groups.append(["no error"])
            except AssertionError:
                pass
        out.append(groups)
    return out


def _parity_body(rank: int, world_size: int, kind: str, path: str) -> dict[str, dict[str, Any]]:
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from shardkit.core import iter_full_state_dict

    meshes = _Meshes(kind)
    theirs_model, theirs = _train("torch", meshes, rank)
    ours_model, ours = _train("shardkit", meshes, rank)
    if kind == "ep":
        # Each ep rank's plain experts have the same names and shapes: one checkpoint cannot
        # hold them all (torch's neither). Experts that are DTensors on the ep axis can.
        return {"torch": theirs, "shardkit": ours}
    # The full state dict, on the coordinator (rank 0) only: every group gathered.
    ours["full"] = {k: v.clone() for k, v in iter_full_state_dict(ours_model)}
    # torch's checkpoint (DCP) loads into a fresh shardkit model.
    dcp_save(theirs_model.state_dict(), checkpoint_id=path)
    fresh = _shard("shardkit", meshes)
    state_dict = fresh.state_dict()
    dcp_load(state_dict, checkpoint_id=path)
    fresh.load_state_dict(state_dict)
    ours["loaded"] = _full(dict(fresh.named_parameters()))
    return {"torch": theirs, "shardkit": ours}


@pytest.mark.parametrize("kind", ["ep", "ep_dtensor", "ep_titan", "hsdp"])
def test_experts_on_their_own_mesh_match_torch(kind: str, tmp_path: Path) -> None:
    results = run_on_ranks(4, _parity_body, kind=kind, path=str(tmp_path / "ckpt"))
    for rank, result in enumerate(results):
        ours, theirs = result["shardkit"], result["torch"]
        assert ours["losses"] == theirs["losses"], f"rank {rank}"
        if "full" in ours and rank > 0:
            assert not ours["full"], f"rank {rank}: a full state dict off the coordinator"
        checks = (
            ("grads", "grads"),
            ("params", "params"),
            ("loaded", "params"),
            ("full", "params"),
        )
        for what, their in checks:
            if what not in ours or (what == "full" and rank > 0):
                continue
            assert ours[what].keys() == theirs[their].keys()
            for name, value in theirs[their].items():
                assert torch.equal(ours[what][name], value), f"rank {rank}: {what} of {name}"
        assert list(ours["state_dict"]) == list(theirs["state_dict"])
        for key, (placements, mesh, local) in theirs["state_dict"].items():
            got = ours["state_dict"][key]
            assert (got[0], got[1]) == (placements, mesh), f"rank {rank}: {key}"
            assert torch.equal(got[2], local), f"rank {rank}: {key}"
        assert ours["groups"] == theirs["groups"], f"rank {rank}"
        # Each block: its dense group, then its experts' group (torch's order).
        assert [len(g) for g in ours["groups"]] == [2, 2, 1]


def _refused(call: Any) -> str:
    try:
        call()
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _errors_body(rank: int, world_size: int) -> dict[str, str]:
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        ShardPlacementResult,
    )

    from shardkit.core import fully_shard

    meshes = _Meshes("hsdp")
    two_d_as_fsdp = FSDPMeshInfo(mesh=meshes.experts, shard_mesh_dim=1)
    cases: dict[str, Any] = {
        "wrong type": "Shard(0)",
        "no mesh info": ShardPlacementResult(placement=Shard(0), mesh_info=object()),  # type: ignore[arg-type]
        "no device mesh": ShardPlacementResult(
            placement=Shard(0),
            mesh_info=FSDPMeshInfo.__new__(FSDPMeshInfo),  # its fields never set
        ),
        "2-D as FSDP": ShardPlacementResult(placement=Shard(0), mesh_info=two_d_as_fsdp),
        "placement": ShardPlacementResult(placement=1, mesh_info=meshes.dp_info),  # type: ignore[arg-type]
    }
    out = {}
    for case, result in cases.items():
        model = _build(None)
        block = model.blocks[0]
        out[case] = _refused(
            lambda b=block, r=result: fully_shard(
                b, mesh=meshes.dp, shard_placement_fn=lambda p: r if p.dim() == 3 else None
            )
        )
        out[case + " untouched"] = str(type(block) is _Block)
    # Two objects for one mesh: refused, as torch refuses them.
    other = FSDPMeshInfo(mesh=meshes.dp, shard_mesh_dim=0)
    model = _build(None)
    out["two objects"] = _refused(
        lambda: fully_shard(
            model.blocks[0],
            mesh=meshes.dp,
            shard_placement_fn=lambda p: ShardPlacementResult(
                placement=None, mesh_info=meshes.dp_info if p.dim() == 3 else other
            ),
        )
    )
    out.update(_settings(meshes))
    return out


def _settings(meshes: _Meshes) -> dict[str, str]:
    """A block of two groups: the settings that name one group refused, unshard on both."""
    model = _shard("shardkit", meshes)
    block: Any = model.blocks[0]
    out = {
        name: _refused(lambda n=name, a=arg: getattr(block, n)(a))
        for name, arg in (
            ("set_all_reduce_hook", lambda t: None),
            ("set_custom_all_gather", object()),
            ("set_custom_reduce_scatter", object()),
        )
    }
    block.unshard(async_op=True).wait()
    out["unsharded"] = str([type(w).__name__ for w in (block.router.weight, block.experts.w1)])
    block.reshard()
    out["resharded"] = str([type(w).__name__ for w in (block.router.weight, block.experts.w1)])
    return out


def test_bad_placement_results_are_refused_by_name() -> None:
    out = run_on_ranks(4, _errors_body)[0]
    for name in ("set_all_reduce_hook", "set_custom_all_gather", "set_custom_reduce_scatter"):
        assert out[name].startswith(f"ValueError: {name} is not supported with multiple param")
    assert out["unsharded"] == "['Parameter', 'Parameter']"  # both groups gathered
    assert out["resharded"] == "['DTensor', 'DTensor']"
    assert out["wrong type"].startswith("InvalidPlacementError: Invalid shard_placement_fn")
    assert "experts.w1" in out["wrong type"]
    assert "mesh_info of type object" in out["no mesh info"]
    assert "not a DeviceMesh" in out["no device mesh"]
    assert "needs a 1-D mesh with shard_mesh_dim=0" in out["2-D as FSDP"]
    assert "placement is 1" in out["placement"]
    assert "different mesh_info objects" in out["two objects"]
    assert all(v == "True" for k, v in out.items() if k.endswith("untouched"))
