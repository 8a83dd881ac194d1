"""Compare the newest saved benchmark run with the ones before: fail if a ratio got >10% worse.

Ratios (shardkit's step time or memory over the peer's, measured in the same run) are
compared rather than absolute times: the machine is shared and noisy, but a ratio taken
within one run is fair. The baseline of each ratio is its median over up to ``--baseline``
earlier runs (3 by default), so that one lucky run does not make the next look like a
regression: single runs of the same code vary by up to about 8% on this machine.
Usage: python scripts/bench_compare.py [--threshold 0.10] [--baseline 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

RATIO_KEYS = (
    "ratio_vs_peer",
    "peak_rss_ratio_vs_peer",
    "time_ratio_vs_torch",
    "ratio_vs_fsdp1",
    "peak_rss_ratio_vs_fsdp1",
)


def _ratios(path: Path) -> dict[str, float]:
    data = json.loads(path.read_text())
    found: dict[str, float] = {}
    for bench in data["benchmarks"]:
        ours = (
            bench["extra_info"].get("subject") == "shardkit"
            or "shardkit" in bench["name"]
            or "rss" in bench["name"]
            or "[" not in bench["name"]
        )
        if not ours:
            continue  # another implementation's ratio to the peer is not ours to guard
        # A ratio is compared only with ratios measured the same way ("method": how the
        # benchmark pairs or orders its runs; changing it starts a new series).
        method = bench["extra_info"].get("method", "")
        for key in RATIO_KEYS:
            if key in bench["extra_info"]:
                found[f"{bench['name']} {key} {method}".rstrip()] = float(bench["extra_info"][key])
    return found


def _median_ratios(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = set().union(*runs) if runs else set()
    return {key: statistics.median(r[key] for r in runs if key in r) for key in keys}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threshold", type=float, default=0.10)
    parser.add_argument("--dir", type=Path, default=Path(".benchmarks"))
    parser.add_argument(
        "--baseline", type=int, default=3, help="earlier runs to take the median of"
    )
    args = parser.parse_args()
    runs = sorted(args.dir.glob("*/*.json"), key=lambda p: p.name)
    if len(runs) < 2:
        sys.stdout.write("need two saved runs (make bench twice, on two commits)\n")
        return 0
    earlier = runs[-1 - max(1, args.baseline) : -1]
    old = _median_ratios([_ratios(run) for run in earlier])
    new = _ratios(runs[-1])
    worse = []
    names = ", ".join(run.name.split("_")[0] for run in earlier)
    sys.stdout.write(f"median of runs {names}  ->  {runs[-1].name}\n")
    for key in sorted(set(old) & set(new)):
        change = new[key] / old[key] - 1
        flag = "WORSE" if change > args.threshold else ""
        sys.stdout.write(f"{key:70s} {old[key]:7.3f} -> {new[key]:7.3f} ({change:+.1%}) {flag}\n")
        if flag:
            worse.append(key)
    if worse:
        sys.stdout.write(f"{len(worse)} ratio(s) worsened by more than {args.threshold:.0%}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
