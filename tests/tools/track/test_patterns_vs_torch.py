"""shardkit sends and holds no more than torch's ``fully_shard`` for the same program, and
gets its bits.

For each client pattern of ``client_patterns`` (W=2, or 4 for HSDP and a 2-rank reshard):
every tracked step's collectives, by kind, are no more in number and bytes than torch's, its
memory peak (as the tracker measures both engines) no higher, and the losses are the same bit
for bit. Where shardkit sends less, the test says where and why, so a change that loses it
fails.
"""

from __future__ import annotations

from collections import Counter

import pytest

from harness.pool import run_on_ranks
from tests.tools.track.client_patterns import PATTERNS, WORLD_SIZE, measured

# What shardkit saves on purpose, per step: (kind, how many fewer calls than torch).
_FEWER = {
    # The block called twice stays gathered across its two backward passes (its gradient
    # count completes after the second); torch gathers it again for the first.
    "twice": {"all_gather": 1},
}


@pytest.mark.parametrize("pattern", PATTERNS)
def test_no_more_collectives_or_memory_than_torch(pattern: str) -> None:
    world_size = WORLD_SIZE.get(pattern, 2)
    ours = run_on_ranks(world_size, measured, engine="shardkit", pattern=pattern)
    theirs = run_on_ranks(world_size, measured, engine="torch", pattern=pattern)
    for rank in range(world_size):
        assert ours[rank]["losses"] == theirs[rank]["losses"], f"rank {rank}"
        for step, (mine, torch_s) in enumerate(
            zip(ours[rank]["steps"], theirs[rank]["steps"], strict=True)
        ):
            where = f"rank {rank}, tracked step {step}"
            for kind in ("all_gather", "reduce_scatter", "all_reduce"):
                calls = Counter(k for k, _ in mine)[kind]
                torch_calls = Counter(k for k, _ in torch_s)[kind]
                fewer = _FEWER.get(pattern, {}).get(kind, 0)
                assert calls == torch_calls - fewer, f"{where}: {kind} calls"
                sent = sum(b for k, b in mine if k == kind)
                torch_sent = sum(b for k, b in torch_s if k == kind)
                assert sent <= torch_sent, f"{where}: {kind} bytes"
            peak, torch_peak = ours[rank]["peaks"][step], theirs[rank]["peaks"][step]
            assert peak <= torch_peak, f"{where}: peak {peak} B, torch's {torch_peak} B"
