"""The synthetic two-step rank report the report tests share.

Its numbers are round so that the tests can assert on exactly what the reports must show.
"""

from __future__ import annotations

from shardkit.tools.records import (
    Category,
    CollectiveRecord,
    CommSummary,
    MemoryReport,
    MemorySample,
    ModulePeak,
    Phase,
    PhaseSpan,
    RankReport,
    StepComm,
)

__all__ = ["STEP_S", "MiB", "make_report", "make_reports"]

MiB = 1024 * 1024
STEP_S = 0.06
"""Each synthetic step starts this long after the previous one."""


# One step of the synthetic run: (kind, module, phase, start, end, sent MiB, wait).
_COLLECTIVES = [
    # The first all-gather is all exposed; the prefetched second overlaps it partly.
    ("all_gather", "blocks.0", Phase.FORWARD, 0.000, 0.006, 1, 0.006),
    ("all_gather", "blocks.1", Phase.FORWARD, 0.005, 0.012, 1, 0.002),
    ("reduce_scatter", "blocks.1", Phase.BACKWARD, 0.030, 0.043, 2, 0.0),
    ("reduce_scatter", "blocks.0", Phase.BACKWARD, 0.045, 0.055, 2, 0.002),
]
# (module, phase, start, end)
_SPANS = [
    ("blocks.0", Phase.FORWARD, 0.000, 0.010),
    ("blocks.1", Phase.FORWARD, 0.010, 0.020),
    ("blocks.1", Phase.BACKWARD, 0.020, 0.035),
    ("blocks.0", Phase.BACKWARD, 0.035, 0.050),
    ("", Phase.OPTIMIZER, 0.050, 0.055),
]
# (t, phase, module, MiB by category)
_SP, _UP, _ACT, _GRAD, _OPT = (
    "sharded_params",
    "unsharded_params",
    "activations",
    "gradients",
    "optimizer_state",
)
_SAMPLES = [
    (0.000, Phase.FORWARD, "blocks.0", {_SP: 4}),
    (0.010, Phase.FORWARD, "blocks.1", {_SP: 4, _UP: 2, _ACT: 4}),
    (0.030, Phase.BACKWARD, "blocks.1", {_SP: 4, _UP: 2, _ACT: 8, _GRAD: 1}),  # the peak
    (0.050, Phase.OPTIMIZER, "", {_SP: 4, _GRAD: 2, _OPT: 8}),
]


def _sample(t: float, phase: Phase, module: str, step: int, mib: dict[str, int]) -> MemorySample:
    by_category = {Category(name): n * MiB for name, n in mib.items()}
    return MemorySample(t_s=t, by_category=by_category, module=module, phase=phase, step=step)


def make_report(rank: int = 0, world_size: int = 2, steps: int = 2) -> RankReport:
    """Two blocks, per step: forward, backward, optimizer; two all-gathers, two reduce-scatters.

    Per step: 4 collectives sending 6 MiB (twice the 3 MiB minimum; 10 MiB on the wire, as the
    reduce-scatters' wire bytes are twice their payload on gloo), 40 ms of communication of
    which 10 ms exposed, in a 55 ms step. The memory peak is 15 MiB (8 MiB activations) during
    blocks.1's backward.
    """
    spans: list[PhaseSpan] = []
    collectives: list[CollectiveRecord] = []
    timeline: list[MemorySample] = []
    for step in range(steps):
        t = step * STEP_S
        for module, phase, lo, hi in _SPANS:
            spans.append(
                PhaseSpan(module=module, phase=phase, start_s=t + lo, end_s=t + hi, step=step)
            )
        for kind, module, phase, lo, hi, sent, wait in _COLLECTIVES:
            collectives.append(
                CollectiveRecord(
                    kind=kind,
                    op=f"c10d.{kind}",
                    group_size=2,
                    group="0",
                    input_bytes=MiB // 2,
                    sent_bytes=sent * MiB,
                    # gloo's reduce-scatter puts twice its payload on the wire.
                    wire_bytes=(2 if kind == "reduce_scatter" else 1) * sent * MiB,
                    start_s=t + lo,
                    end_s=t + hi,
                    wait_s=wait,
                    module=module,
                    phase=phase,
                    step=step,
                )
            )
        timeline += [_sample(t + dt, phase, m, step, mib) for dt, phase, m, mib in _SAMPLES]
    peak = timeline[2]
    steps_comm = [
        StepComm(
            step=s,
            collectives=4,
            sent_bytes=6 * MiB,
            wire_bytes=10 * MiB,
            comm_s=0.040,
            exposed_s=0.010,
            step_s=0.055,
            sent_bytes_by_kind={"all_gather": 2 * MiB, "reduce_scatter": 4 * MiB},
        )
        for s in range(steps)
    ]
    module_peaks = [
        ModulePeak(module="blocks.1", phase=Phase.BACKWARD, peak=peak),
        ModulePeak(module="blocks.1", phase=Phase.FORWARD, peak=timeline[1]),
        ModulePeak(module="", phase=Phase.OPTIMIZER, peak=timeline[3]),
    ]
    return RankReport(
        rank=rank,
        world_size=world_size,
        collectives=collectives,
        spans=spans,
        comm=CommSummary(steps=steps_comm, theoretical_min_bytes=3 * MiB),
        memory=MemoryReport(device="cpu", timeline=timeline, peak=peak, module_peaks=module_peaks),
    )


def make_reports(world_size: int = 2) -> list[RankReport]:
    return [make_report(rank, world_size) for rank in range(world_size)]
