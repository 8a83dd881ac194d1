"""A TP-sliced export at W=2 into a ``vllm serve --tensor-parallel-size 2`` (torchrun, 2 ranks).

Run by ``test_tp_sliced_server.py``, which starts the server (shardkit's worker extension,
``VLLM_SERVER_DEV_MODE=1``) on other weights and passes its URL. Rank 0 is the driver: it
reaches the server's two workers through ``POST /collective_rpc`` and pauses its scheduling
around each export; each rank sends its engine rank's windows to that worker through shared
memory. Three syncs, as ``tp_sliced_elsewhere_run.py``: T1, T1 moved, T1 again; after each,
rank 0 records greedy completions over HTTP and each engine rank's parameter digests. Rank 0
writes ``result.json`` into ``--out`` (the trainer's T1 in ``--out/trained``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist

from shardkit.core.export.tp_export import SlicedExporter
from shardkit.core.export.vllm_server_calls import ServerCalls
from shardkit.core.export.vllm_slices_remote import remote_slice_receiver
from tests.vllm import servers
from tests.vllm.tp_sliced_elsewhere_run import BOUND_S, shared_key, write_results
from tests.vllm.tp_sliced_run import DTYPE, sharded_trainer


def observe(url: str, folder: Path) -> dict[str, Any]:
    """What the server serves: greedy completions over HTTP, each engine rank's digests."""
    digests = ServerCalls(url, BOUND_S).rpc_all("shardkit_partition_digests", [], "read-back")
    return {"outputs": servers.completions(url, folder), "digests": digests}


def run(out: Path, url: str, served: Path, rank: int) -> dict[str, Any]:
    tp, model, _ = sharded_trainer(out, rank)
    key = shared_key()
    exporter = SlicedExporter(model, tp, dtype=DTYPE, bucket_bytes=2**20, bound_s=BOUND_S)
    receiver = remote_slice_receiver(exporter, authkey=key, url=url if rank == 0 else None)
    assert receiver is not None  # W = K: every rank takes an engine rank's windows
    found: dict[str, Any] = {"rank": rank, "served": [], "reports": []}
    if rank == 0:
        found["before"] = observe(url, served)
    kept = [p.detach().clone() for p in model.parameters()]
    for sync, shift in (("first", 0.0), ("moved", 0.01), ("again", 0.0)):
        with torch.no_grad():
            for param, was in zip(model.parameters(), kept, strict=True):
                param.copy_(was + shift)
        report = exporter.export(receiver)
        found["reports"].append({"window_bytes": report.window_bytes, "seconds": report.seconds})
        if rank == 0:
            found["served"].append(receiver.served)
            found[sync] = observe(url, served)
    return found


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--served", type=Path, required=True, help="the server's model folder")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    write_results(args.out, run(args.out, args.url, args.served, dist.get_rank()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
