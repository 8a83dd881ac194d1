"""Pipeline schedules as the pipelining tests and benchmark lay them out on their ranks.

torch.distributed.pipelining's schedules, by the names the tests and the benchmark use, and
which stages each pipeline rank holds: one; two looped (interleaved 1F1B); or two in a V
(zero-bubble V: the first and the last on pipeline rank 0).
"""

from __future__ import annotations

__all__ = ["MULTI_STAGE", "SCHEDULES", "stage_indices"]

SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zbv_zero_bubble": "ScheduleZBVZeroBubble",
}
MULTI_STAGE = frozenset({"interleaved_1f1b", "zbv_zero_bubble"})  # two stages per pipeline rank


def stage_indices(kind: str, pp_rank: int, pp: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` of ``pp`` holds under schedule ``kind``."""
    if kind not in MULTI_STAGE:
        return [pp_rank]
    if kind == "zbv_zero_bubble":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank, pp_rank + pp]
