"""The native collective path, as NCCL runs it, with real data on gloo.

On gloo the runtime gathers and reduce-scatters by exchanging rows with each peer; on every
other backend (NCCL, and torch's fake group, which moves no data) it issues one native
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` per group, into and from (W, N) rows.
Without several GPUs that path would never move a byte in a test: here gloo runs it (gloo has
both collectives), so its layouts, in-place inputs and reductions train as torch's fully_shard
does. gloo's native reduce-scatter also adds the ranks in torch's own order: bit for bit at W=4.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harness.pool import run_on_ranks
from tests.core.parity import Run, assert_parity, parity_body


def _native_body(rank: int, world_size: int, run: Run) -> Any:
    """parity_body with the runtime told that gloo is some other backend; and the algorithms
    of shardkit's collectives (as it tells observers)."""
    from shardkit.core import observe
    from shardkit.core.runtime import collectives

    algorithms: set[str] = set()

    def seen(event: Any) -> None:
        if isinstance(event, observe.CollectiveEvent) and event.kind != "all_reduce":
            algorithms.add(event.algorithm)

    original = collectives._uses_gloo
    collectives._uses_gloo = lambda group: False
    unsubscribe = observe.subscribe(seen)
    try:
        return parity_body(rank, world_size, run), algorithms
    finally:
        unsubscribe()
        collectives._uses_gloo = original


def _traces(world_size: int, run: Run) -> list[Any]:
    results = run_on_ranks(world_size, _native_body, run=run)
    assert all(algorithms == {"native"} for _, algorithms in results), results[0][1]
    return [traces for traces, _ in results]


def _policy(name: str) -> dict[str, Any]:
    from shardkit.core import CPUOffloadPolicy, MixedPrecisionPolicy

    if name == "bf16":
        return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}
    if name == "bf16_reduce_fp32":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return {"mp_policy": policy}
    if name == "offload":
        return {"offload_policy": CPUOffloadPolicy(pin_memory=False)}
    return {}


@pytest.mark.parametrize(
    ("world_size", "policy", "hsdp"),
    [
        (2, "fp32", None),
        (4, "fp32", None),
        (4, "bf16", None),
        (4, "bf16_reduce_fp32", None),
        (2, "offload", None),
        (4, "fp32", (2, 2)),
    ],
)
def test_the_native_path_trains_as_torch_bit_for_bit(
    world_size: int, policy: str, hsdp: tuple[int, int] | None
) -> None:
    run = Run(model="gpt", shard_kwargs=_policy(policy), hsdp=hsdp, impls=("shardkit", "torch"))
    assert_parity(_traces(world_size, run), rtol=0, atol=0)


def test_uneven_shards_take_the_native_path_too() -> None:
    # The MLP head has 3 rows: padded shards at W=4; checked against the single process too.
    run = Run(model="mlp", impls=("shardkit", "torch", "local"))
    assert_parity(_traces(4, run))
