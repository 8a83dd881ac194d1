"""The comm report shows a whole-matrix optimizer's step: its two all-to-alls and their bytes.

shardkit's Muon moves each matrix's rows to its owner and the update's rows back, in one
``all_to_all_single`` each way with split sizes of every length (``runtime/byte_exchange.py``).
The tracker counts what this rank really sends in one (its input less the part it keeps,
``c10d_ops``), so the report's optimizer-step row is the optimizer's own tally, to the byte.
"""

from __future__ import annotations

from typing import Any

from harness.pool import run_on_ranks
from shardkit.core.optim import Muon
from shardkit.tools.records import Phase
from shardkit.tools.report.text import summarize
from shardkit.tools.track.comm import CommTracker
from tests.core.optim.muon_runs import batch, build, loss_of, shard, takes_muon


def _tracked_muon_step(rank: int, world_size: int) -> dict[str, Any]:
    model = build("gpt")
    shard(model, "shardkit", world_size)
    named = list(model.named_parameters())
    opt = Muon([(n, p) for n, p in named if takes_muon("gpt", n, p)], lr=0.02)
    for step in range(2):  # the first makes the state; the second is tracked
        with CommTracker() as comm:
            x, y = batch("gpt", step, rank, world_size)
            loss_of("gpt", model(x), y).backward()
            opt.step()
            opt.zero_grad()
    stats = opt.last_step_stats
    assert stats is not None
    return {"report": comm.rank_report(), "sent": stats.bytes_sent}


def test_the_report_shows_the_optimizer_steps_exchange() -> None:
    results = run_on_ranks(2, _tracked_muon_step)
    for r in results:
        exchange = [c for c in r["report"].collectives if c.phase is Phase.OPTIMIZER]
        assert [c.kind for c in exchange] == ["all_to_all", "all_to_all"]
        assert sum(c.sent_bytes for c in exchange) == r["sent"] > 0
    text = summarize([r["report"] for r in results])
    rows = [line for line in text.splitlines() if "(optimizer step)" in line]
    assert any("all_to_all" in line and " 4 " in line for line in rows), text
