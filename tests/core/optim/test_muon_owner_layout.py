"""The owner layout's prototype (``benchmarks/muon_owner_layout.py``) trains what it stands for.

bench-muon measures issue 83's other design, each matrix reduced whole onto its owner and
gathered back, beside the built Muon (docs/guide/muon.md, "The two designs side by side"). Its
figures mean that design's only if the prototype runs the same update on the same gradients:
its parameters after a few steps equal shardkit's Muon's bit for bit, and its row-layout peer's
equal AdamW's, in the benchmark's own workers and model.
"""

from __future__ import annotations

import pytest
import torch
from benchmarks import muon_run

from harness.pool import run_on_ranks

_CONFIGS = ("muon", "owner", "rows", "adamw")


@pytest.mark.parametrize("world", [2])
def test_the_owner_layout_trains_as_shardkits_muon_and_moves_the_row_layouts_bytes(
    world: int,
) -> None:
    run_on_ranks(world, muon_run.setup, size="fake-tiny", scale=1, configs=_CONFIGS)
    try:
        for step in range(2, 5):
            for config in _CONFIGS:
                run_on_ranks(world, muon_run.step_seconds, config=config, step=step)
        ranks = {c: run_on_ranks(world, muon_run.full_parameters, config=c) for c in _CONFIGS}
        sent = {c: run_on_ranks(world, muon_run.layout_bytes, config=c) for c in muon_run.LAYOUTS}
    finally:
        run_on_ranks(world, muon_run.teardown)
    full = {config: by_rank[0] for config, by_rank in ranks.items()}
    matrices = [n for n, p in full["muon"].items() if muon_run.takes_muon(n, p)]
    assert matrices
    for design, peer in (("owner", "muon"), ("rows", "adamw")):
        assert full[design].keys() == full[peer].keys()
        unequal = [n for n in full[peer] if not torch.equal(full[design][n], full[peer][n])]
        assert not unequal, f"{design} differs from {peer} in {unequal}"
    # Not vacuous: Muon moved the matrices elsewhere than AdamW did.
    assert all(not torch.equal(full["owner"][n], full["rows"][n]) for n in matrices)
    # Every rank holds the same whole model after the all-gather.
    for config in _CONFIGS:
        for other in ranks[config][1:]:
            assert all(torch.equal(other[n], full[config][n]) for n in full[config])
    # The same bytes on the wire: the tiny GPT's owners get equal shares, so no padding.
    assert sent["owner"] == sent["rows"]
    assert all(padding == 0 for _, padding in sent["owner"] + sent["rows"])
