"""The benchmark's receiving process: a bf16 Qwen2-style model of SIZE, served by a transport.

Usage: python benchmarks/export_receiver.py SIZE shm ADDRESS READY_FILE
       python benchmarks/export_receiver.py SIZE group HOST PORT READY_FILE
The authkey (shm) comes in SHARDKIT_BENCH_AUTHKEY (hex).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.export_run import build
from shardkit.core.export import ModuleReceiver


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    size, transport = argv[0], argv[1]
    receiver = ModuleReceiver(build(size, torch.bfloat16))
    ready_file = Path(argv[-1])

    def ready() -> None:
        ready_file.touch()

    if transport == "shm":
        from shardkit.core.export import serve_shared_memory

        authkey = bytes.fromhex(os.environ["SHARDKIT_BENCH_AUTHKEY"])
        serve_shared_memory(argv[2], authkey, receiver, ready=ready)
    else:
        from shardkit.core.export import ReceiverGroupSpec, serve_receiver_group

        spec = ReceiverGroupSpec(host=argv[2], port=int(argv[3]), receivers=1, bound_s=300.0)
        serve_receiver_group(spec, 1, receiver, ready=ready)


if __name__ == "__main__":
    main(sys.argv[1:])
