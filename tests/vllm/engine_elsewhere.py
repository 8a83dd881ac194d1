"""Exports into a vLLM engine whose engine core runs in a process of its own (vLLM's default).

Run by tests/vllm/test_engine_process.py in a fresh interpreter, because vLLM reads
``VLLM_ENABLE_V1_MULTIPROCESSING`` once per process (the other vLLM tests run their engines in
theirs). ``VLLM_ALLOW_INSECURE_SERIALIZATION`` is unset throughout. Usage::

    python -m tests.vllm.engine_elsewhere FOLDER

In order, printing one JSON line of what it found:

1. an engine started without shardkit's worker extension: the receiver refuses it in
   ``begin``, naming the settings, within seconds (before: a hang in ``collective_rpc``);
2. an engine started with it (``worker_extension_cls=EXTENSION``): a full export, then a
   delta, and its greedy tokens and log-probabilities against a fresh engine's on the weights
   sent; the version its worker serves; an export whose commit fails in the engine's process
   (a tensor its loader refuses), after which the worker serves the delta's version and the
   same outputs;
3. that engine's core process killed: the next export raises within the receiver's bound.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from demo.grpo_vllm import start_engine

from shardkit.core.export.vllm import EXTENSION, VLLMReceiver
from tests.vllm import engines

BOUND_S = 20.0


def _engine(folder: Path, *, extension: bool) -> Any:
    extra = {"worker_extension_cls": EXTENSION} if extension else {}
    return start_engine(folder, seed=0, shares_the_group=False, max_num_seqs=4, **extra)


def _timed_error(work: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        work()
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def main() -> None:
    root = Path(sys.argv[1])
    first = engines.save_tiny_qwen2(root / "first", seed=0)
    second = engines.perturbed(first, seed=1)
    third = engines.with_changes(second, seed=2)
    out: dict[str, Any] = {}

    plain = _engine(root / "first", extension=False)
    refused = VLLMReceiver(plain, bound_s=BOUND_S)
    out["no_route"] = _timed_error(
        lambda: engines.export_into(refused, *engines.full_export(second))
    )
    plain.llm_engine.engine_core.shutdown()

    receiving = _engine(root / "first", extension=True)
    receiver = VLLMReceiver(receiving, bound_s=BOUND_S)
    out["full"] = _timed_error(lambda: engines.export_into(receiver, *engines.full_export(second)))
    out["delta"] = _timed_error(
        lambda: engines.export_into(receiver, *engines.delta_export(second, third, export_id=1))
    )
    received = engines.greedy(receiving)
    out["serving"] = receiver.serving_version()
    # The manifest check is skipped, so that the engine's own loader meets the bad tensor.
    receiver._checkpoint = None
    bad = engines.with_a_bad_tensor(second, "model.layers.1.mlp.up_proj.weight", export_id=2)
    out["bad_commit"] = _timed_error(lambda: engines.export_into(receiver, *bad))
    out["serving_after_bad"] = receiver.serving_version()
    out["same_after_bad"] = engines.greedy(receiving) == received
    # All or nothing with the mirror in files: the engine's process loads each export from
    # the files the receiver wrote on this host, and puts the last one back from its files.
    in_files = VLLMReceiver(receiving, bound_s=BOUND_S, mirror_dir=root / "mirror")
    in_files._checkpoint = None
    out["files_full"] = _timed_error(
        lambda: engines.export_into(in_files, *engines.full_export(second, export_id=3))
    )
    out["files_delta"] = _timed_error(
        lambda: engines.export_into(in_files, *engines.delta_export(second, third, export_id=4))
    )
    out["files_same"] = engines.greedy(receiving) == received
    bad = engines.with_a_bad_tensor(second, "model.layers.1.mlp.up_proj.weight", export_id=5)
    out["files_bad_commit"] = _timed_error(lambda: engines.export_into(in_files, *bad))
    out["files_serving_after_bad"] = in_files.serving_version()
    out["files_same_after_bad"] = engines.greedy(receiving) == received
    reference = _engine(
        engines.save_weights_beside(root / "first", root / "third", third), extension=True
    )
    out["equal"] = received == engines.greedy(reference)
    reference.llm_engine.engine_core.shutdown()

    # vLLM starts its engine core as a multiprocessing child of this process.
    cores = multiprocessing.active_children()
    for core in cores:
        os.kill(core.pid or 0, signal.SIGKILL)
    out["killed"] = len(cores)
    out["after_kill"] = _timed_error(
        lambda: engines.export_into(receiver, *engines.full_export(third, export_id=6))
    )
    print(json.dumps(out), flush=True)
    os._exit(0)  # vLLM's client threads of the dead engine would hold the exit


if __name__ == "__main__":
    main()
