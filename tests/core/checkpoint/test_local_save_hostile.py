"""Rank 0 checks every rank's save results before it writes ``.metadata``: hostile input.

A locally planned save (``checkpoint/local_plan/save.py``) ends with one gather of each rank's
results to rank 0: a header (layout digest, item count, failure flag, message length) and
int64 rows (file number, offset, length, bytes). Here rank 1 sends something wrong in each
way, through the real gather: rows with a negative offset, one row too few, a ragged body,
a message length beyond its body, a body longer than the gather takes (never received,
never allocated), a forged layout digest. Every rank must raise the same
error and no ``.metadata`` may be written; a forged digest reads as another layout, so the
save goes through DCP's own planning on every rank and its checkpoint holds the state.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.pool import run_on_ranks

CASES = (
    "negative offset",
    "one row short",
    "ragged rows",
    "message too long",
    "oversized body",
    "forged digest",
)
_MOST = 32  # the "oversized body" case's bound on a body's words (rank 0's own is 8 or less)


def _forge(case: str, head: torch.Tensor, body: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 1's header and body, made wrong in the way ``case`` names."""
    head, body = head.clone(), body.clone()
    text = int(head[4])  # the failure message's bytes come first in the body
    if case == "negative offset":
        body[text + 1] = -8  # the first row's offset
    elif case == "one row short":
        body, head[2] = body[:-4], head[2] - 1
    elif case == "ragged rows":
        body = body[:-1]
    elif case == "message too long":
        head[4] = 1 << 40
    elif case == "oversized body":  # more than the gather takes: never received
        body = torch.cat([body, torch.zeros(2 * _MOST, dtype=torch.int64)])
    elif case == "forged digest":
        head[0] ^= 1
    return head, body


def _hostile_saves(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from shardkit.core.checkpoint.local_plan.save import LayoutCache, save_planned_locally
    from shardkit.core.runtime.groups import checkpoint_group
    from shardkit.core.runtime.p2p import object_collectives

    real = object_collectives.gather_rows_to_first
    # Wherever the save's modules imported the gather from, rank 1's goes through _forge.
    holders = [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("shardkit.core.checkpoint") and hasattr(module, "gather_rows_to_first")
    ]
    assert holders, "no checkpoint module gathers with gather_rows_to_first"
    state = {"weights": torch.arange(12.0) + rank * 0, "step": torch.tensor(5)}
    outcomes: dict[str, Any] = {}
    for case in CASES:

        def forged(head: torch.Tensor, body: torch.Tensor, group: Any, case: str = case) -> Any:
            if rank == 1:
                head, body = _forge(case, head, body)
            if case == "oversized body":
                return real(head, body, group, most=_MOST)
            return real(head, body, group)

        for module in holders:
            module.gather_rows_to_first = forged  # type: ignore[attr-defined]
        folder = Path(root) / case.replace(" ", "_")
        cache = LayoutCache()
        try:
            save_planned_locally(state, folder, cache, checkpoint_group())
            outcomes[case] = {"error": None, "fallback": cache.dcp_reason}
        except RuntimeError as error:
            outcomes[case] = {"error": str(error), "fallback": cache.dcp_reason}
        finally:
            for module in holders:
                module.gather_rows_to_first = real  # type: ignore[attr-defined]
        outcomes[case]["metadata"] = (folder / ".metadata").exists()
    return outcomes


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    root = tmp_path_factory.mktemp("hostile")
    return run_on_ranks(2, _hostile_saves, root=str(root)), root


@pytest.mark.parametrize("case", [c for c in CASES if c != "forged digest"])
def test_a_malformed_result_fails_the_save_on_every_rank(
    case: str, outcomes: tuple[list[dict[str, Any]], Path]
) -> None:
    ranks, _ = outcomes
    first = ranks[0][case]
    assert first["error"] and re.search(r"rank(\(s\))? \[?1\b", first["error"]), first
    assert all(r[case] == first for r in ranks), [r[case] for r in ranks]  # the same text
    assert not first["metadata"]  # nothing that loads as a checkpoint
    assert not first["fallback"]


def test_a_forged_digest_saves_through_dcps_planning(
    outcomes: tuple[list[dict[str, Any]], Path],
) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ranks, root = outcomes
    assert all(r["forged digest"]["error"] is None for r in ranks)
    assert all("another layout" in r["forged digest"]["fallback"] for r in ranks)
    dcp_to_torch_save(root / "forged_digest", root / "forged.pt")
    saved = torch.load(root / "forged.pt", weights_only=True)
    assert torch.equal(saved["weights"], torch.arange(12.0)) and int(saved["step"]) == 5
