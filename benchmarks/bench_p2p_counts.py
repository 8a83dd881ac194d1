"""Point-to-point calls per phase at W=3 on gloo: the table ``bench_p2p_counts`` prints.

See ``p2p_count_workload.py``. Counts, not times: run it before and after a change to the
runtime's messages, and the two tables must match unless the change meant them to differ.
"""

from __future__ import annotations

from typing import Any

from benchmarks.p2p_count_workload import PHASES, count_p2p
from harness.pool import run_on_ranks

WORLD = 3


def test_p2p_counts(benchmark: Any) -> None:
    found: list[dict[str, dict[str, int]]] = []

    def measure() -> None:
        found[:] = run_on_ranks(WORLD, count_p2p)

    benchmark.pedantic(measure, rounds=1, iterations=1)
    print(f"\npoint-to-point calls per rank at W={WORLD} (gloo): isend / irecv")
    print(f"{'phase':<18}" + "".join(f"{'rank ' + str(r):>14}" for r in range(WORLD)))
    for phase in PHASES:
        cells = [f"{c.get('isend', 0)} / {c.get('irecv', 0)}" for c in (f[phase] for f in found)]
        print(f"{phase:<18}" + "".join(f"{cell:>14}" for cell in cells))
    for rank_counts in found:
        for phase in PHASES:
            assert set(rank_counts[phase]) <= {"isend", "irecv"}, rank_counts[phase]
