"""One training step's operators on torch's fake process group: shardkit beside torch.

The fake backend makes this one process stand for rank 0 of a world of W ranks: collectives
are issued and return at once, moving nothing. So the step runs everything an engine does
on the host at any W, on a CPU, and :class:`shardkit.tools.OpCounter` counts the operators
it dispatches: on a GPU each one that is not a view is a kernel launch, and a count that
grows with W is a step that becomes launch-bound at scale (issue 31). Counts are exact: the
test (``tests/core/engine/test_op_counts.py``) holds shardkit to them, and ``bench_op_counts.py``
prints them beside torch's.

Cases: ``plain`` (fp32), ``bf16`` (bf16 parameters, fp32 reductions), ``hsdp`` (a (2, W/2)
replicate x shard mesh, bf16) and ``tp`` (a (W/2, 2) dp x tp mesh: tensor parallelism on each
block's MLP, then FSDP on dp). ``uneven``: model sizes that no W of the run divides, so every
group pads its shards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from shardkit.tools import OpCounter

CASES = ("plain", "bf16", "hsdp", "tp")
ENGINES = ("torch", "shardkit")


@dataclass(frozen=True, kw_only=True, slots=True)
class StepOps:
    """The operators one training step dispatched."""

    engine: str
    case: str
    world: int
    total: int
    """Every operator."""
    launches: int
    """Those that are not views (kernel launches on a GPU)."""
    by_op: dict[str, int]
    """Per operator name."""


class _Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, x + self.fc2(F.gelu(self.fc1(self.norm(x)))))


class _Net(nn.Module):
    """An embedding, ``depth`` pre-norm MLP blocks, a final norm and a head."""

    def __init__(self, dim: int, hidden: int, depth: int, vocab: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_Block(dim, hidden) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return cast(torch.Tensor, self.head(self.norm(h)))


@contextmanager
def fake_world(world: int) -> Iterator[None]:
    """This process as rank 0 of ``world`` fake ranks (the default process group)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _meshes(case: str, world: int) -> tuple[DeviceMesh, DeviceMesh | None]:
    """The data-parallel mesh (what fully_shard gets) and the TP mesh, if any."""
    if case == "hsdp":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard")), None
    if case == "tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        return mesh["dp"], mesh["tp"]
    return init_device_mesh("cpu", (world,)), None


def _engine(name: str) -> tuple[Callable[..., Any], type[Any]]:
    """``fully_shard`` and ``MixedPrecisionPolicy`` of torch or of shardkit."""
    if name == "torch":
        from torch.distributed import fsdp

        return fsdp.fully_shard, fsdp.MixedPrecisionPolicy
    import shardkit.core

    return shardkit.core.fully_shard, shardkit.core.MixedPrecisionPolicy


def _sharded(engine: str, case: str, world: int, uneven: bool) -> _Net:
    fully_shard, MixedPrecisionPolicy = _engine(engine)
    torch.manual_seed(0)
    # Uneven: odd sizes (TP halves 202 into 101), so every dp world of the run pads.
    if uneven:
        model = _Net(dim=51, hidden=202, depth=8, vocab=97)
    else:
        model = _Net(dim=64, hidden=256, depth=8, vocab=128)
    dp_mesh, tp_mesh = _meshes(case, world)
    if tp_mesh is not None:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        for block in model.blocks:
            plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
            parallelize_module(block, tp_mesh, plan)
    policy: Any = None
    if case in ("bf16", "hsdp", "tp"):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs: dict[str, Any] = {"mesh": dp_mesh}
    if policy is not None:
        kwargs["mp_policy"] = policy
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def count_step(
    engine: str,
    case: str,
    world: int,
    *,
    uneven: bool = False,
    fused_packing: bool = False,
    reduce_precision: Any = None,
) -> StepOps:
    """The operators of one training step (after two unmeasured ones) at ``world`` fake ranks.

    Args:
        engine: ``torch`` or ``shardkit``.
        case: one of :data:`CASES`.
        world: the fake world size (even, for the hsdp and tp meshes).
        uneven: model sizes that every group's shards pad at W=8 and W=64.
        fused_packing: shardkit packs gradients as on a GPU (one ``_chunk_cat`` per group).
        reduce_precision: shardkit's ``ReducePrecision`` for every group, or None.
    """
    with fake_world(world), _packing(fused_packing):
        model = _sharded(engine, case, world, uneven)
        if reduce_precision is not None:
            model.set_reduce_precision(reduce_precision)  # type: ignore[operator]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        vocab = model.head.out_features
        tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))

        def step() -> None:
            loss = model(tokens).float().square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        step()
        step()
        with OpCounter() as ops:
            step()
    return StepOps(
        engine=engine,
        case=case,
        world=world,
        total=ops.total,
        launches=ops.launches,
        by_op=dict(ops.by_op),
    )


@contextmanager
def _packing(fused: bool) -> Iterator[None]:
    """shardkit's gradient packing as on an accelerator (``_chunk_cat``), or as it is."""
    if not fused:
        yield
        return
    always: Callable[[torch.device], bool] = lambda device: True  # noqa: E731
    with mock.patch("shardkit.core.engine.reduce.reducer.prefers_fused_packing", always):
        yield
