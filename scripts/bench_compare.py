"""Compare the last two saved benchmark runs: fail if a ratio against the peer got >10% worse.

Ratios (shardkit's step time or memory over the peer's, measured in the same run) are
compared rather than absolute times: the machine is shared and noisy, but a ratio taken
within one run is fair. Usage: python scripts/bench_compare.py [--threshold 0.10]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RATIO_KEYS = ("ratio_vs_peer", "peak_rss_ratio_vs_peer", "time_ratio_vs_torch")


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
        for key in RATIO_KEYS:
            if key in bench["extra_info"]:
                found[f"{bench['name']} {key}"] = float(bench["extra_info"][key])
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threshold", type=float, default=0.10)
    parser.add_argument("--dir", type=Path, default=Path(".benchmarks"))
    args = parser.parse_args()
    runs = sorted(args.dir.glob("*/*.json"), key=lambda p: p.name)
    if len(runs) < 2:
        sys.stdout.write("need two saved runs (make bench twice, on two commits)\n")
        return 0
    old, new = _ratios(runs[-2]), _ratios(runs[-1])
    worse = []
    sys.stdout.write(f"{runs[-2].name}  ->  {runs[-1].name}\n")
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
