"""FULL_STATE_DICT with ``rank0_only``: a failure on rank 0 raises on every rank, promptly.

Only rank 0 rebuilds the full tensors and copies them to the CPU, which is where a rank that
holds the whole model runs out of memory. It used to raise there alone while the other ranks
waited in the next group's gather until rank 0's process exited, or for the process group's
timeout if rank 0's program caught the error and went on.
"""

from __future__ import annotations

from typing import Any

from harness.pool import run_on_ranks
from tests.legacy.legacy_parity import LegacyRun, full_params, wrap_model

NO_MEMORY = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 2048 bytes"


def _out_of_memory_body(rank: int, world_size: int, fails_after: int) -> dict[str, Any]:
    from shardkit.core.state_dict import full
    from shardkit.legacy import FullStateDictConfig, FullyShardedDataParallel, StateDictType

    model = wrap_model("shardkit", LegacyRun(model="gpt"))
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    original: Any = full.param_pieces
    calls = [0]

    def out_of_memory(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] > fails_after:
            raise RuntimeError(NO_MEMORY)
        return original(*args)

    if rank == 0:
        setattr(full, "param_pieces", out_of_memory)  # noqa: B010  (mypy: another signature)
    try:
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            model.state_dict()
        error, message = "", "no error"
    except Exception as exc:
        error, message = type(exc).__name__, str(exc)
    finally:
        full.param_pieces = original
    with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        again = model.state_dict()  # the ranks are still in step
    params = full_params("shardkit", model)
    complete = rank != 0 or all(again[k].equal(v) for k, v in params.items())
    return {"error": error, "message": message, "complete": complete}


def test_running_out_of_memory_on_rank0_raises_on_every_rank() -> None:
    for fails_after in (0, 4):
        results = run_on_ranks(2, _out_of_memory_body, fails_after=fails_after, timeout_s=60)
        first = results[0]
        assert first["error"] == "RuntimeError", first
        assert first["message"].startswith("rank 0: the full state dict could not be gathered")
        assert NO_MEMORY in first["message"], first
        assert results[1] == first
        assert first["complete"]
