"""The bandwidth behind the planner's communication time: given, a default, or measured on gloo.

On NCCL the planner assumes :data:`~shardkit.tools.units.DEFAULT_BANDWIDTH_GBPS` (an
InfiniBand-class link) unless told otherwise. On gloo that figure is wrong by two orders of
magnitude: gloo moves bytes through TCP sockets with the CPU, and a plan for it is usually a
plan for this very machine. So with ``--backend gloo`` and no ``--bandwidth-gbps``, the
bandwidth is measured here: ``ranks`` gloo process groups in this process (one thread each,
over loopback) all-gather a few MiB a few times, and the best time gives the payload bytes per
second one rank sends (what the planner's byte counts are). It takes well under a second.

The figure is cached in ``$SHARDKIT_CACHE_DIR`` (default ``$XDG_CACHE_HOME/shardkit`` or
``~/.cache/shardkit``), file ``gloo-bandwidth.json``, keyed by host name and the number of
ranks measured. The file is read as untrusted input: size-capped, plain JSON, every field
type- and range-checked; an entry that is missing or wrong is measured again and the file
rewritten (atomically, keeping only the valid entries).
"""

from __future__ import annotations

import datetime
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardkit.tools.plan.records import Bandwidth
from shardkit.tools.plan.timing.measure_cache import read_entries, write_entries
from shardkit.tools.units import DEFAULT_BANDWIDTH_GBPS

__all__ = [
    "CACHE_ENV",
    "MAX_CALIBRATION_RANKS",
    "cache_path",
    "default_bandwidth",
    "gloo_bandwidth",
    "measure_gloo_gbps",
    "read_cached_gbps",
]

CACHE_ENV = "SHARDKIT_CACHE_DIR"
"""Environment variable naming the cache folder."""
MAX_CALIBRATION_RANKS = 4
"""Ranks the calibration runs with at most: enough for the ring's per-rank rate."""
_CACHE_FILE = "gloo-bandwidth.json"
_CACHE_VERSION = 1
_MAX_GBPS = 1e5  # above any link: a larger cached figure is not a measurement
_CALIBRATION_BYTES = 4 * 1024 * 1024
_REPEATS = 3


def cache_path() -> Path:
    """The cache file (its folder is created when a measurement is written)."""
    folder = os.environ.get(CACHE_ENV)
    if folder:
        return Path(folder) / _CACHE_FILE
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shardkit" / _CACHE_FILE


def _key(ranks: int) -> str:
    return f"{socket.gethostname()}/ranks={ranks}"


def _valid_entry(entry: object) -> float | None:
    if not isinstance(entry, dict):
        return None
    gbps = entry.get("gbps")
    if isinstance(gbps, bool) or not isinstance(gbps, int | float):
        return None
    if not math.isfinite(gbps) or not 0 < gbps <= _MAX_GBPS:
        return None
    return float(gbps)


def _checked_entry(entry: object) -> dict[str, Any] | None:
    """An entry's bandwidth and when it was measured, checked; None if it is not valid."""
    gbps = _valid_entry(entry)
    if gbps is None or not isinstance(entry, dict):
        return None
    checked: dict[str, Any] = {"gbps": gbps}
    when = entry.get("measured_unix_s")
    if isinstance(when, float) and math.isfinite(when):
        checked["measured_unix_s"] = when
    return checked


def _read_entries(path: Path) -> dict[str, dict[str, Any]]:
    """The valid entries of the cache file (``measure_cache``)."""
    return read_entries(path, _CACHE_VERSION, _checked_entry)


def read_cached_gbps(path: Path, ranks: int) -> float | None:
    """This host's cached bandwidth for ``ranks`` ranks, if the cache holds a valid one."""
    entry = _read_entries(path).get(_key(ranks))
    return None if entry is None else float(entry["gbps"])


def _write_entry(path: Path, ranks: int, gbps: float) -> None:
    entries = _read_entries(path)
    entries[_key(ranks)] = {"gbps": gbps, "measured_unix_s": time.time()}
    write_entries(path, _CACHE_VERSION, entries)


def measure_gloo_gbps(ranks: int, nbytes: int = _CALIBRATION_BYTES) -> float:
    """GB/s one rank sends at in a gloo all-gather of ``nbytes`` per rank among ``ranks``.

    The ranks are threads of this process, each with its own gloo process group over
    loopback (nothing global is touched: no default process group is needed or made).

    Raises:
        RuntimeError: the process groups could not be made or the collective failed.
    """
    if ranks < 2:
        raise ValueError(f"measure_gloo_gbps: needs at least 2 ranks, got {ranks}")
    # torch.distributed exports both stores at runtime; its stubs do not say so.
    store = dist.PrefixStore(  # type: ignore[attr-defined]
        f"shardkit-calibration-{os.getpid()}",
        dist.HashStore(),  # type: ignore[attr-defined]
    )
    timeout = datetime.timedelta(seconds=60)
    groups: list[Any] = [None] * ranks
    best: list[float] = [math.inf] * ranks
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            # Typed Any: the stubs of a backend's collectives lag behind its methods.
            group: Any = dist.ProcessGroupGloo(store, rank, ranks, timeout)
            groups[rank] = group
            numel = nbytes // 4
            shard = torch.ones(numel)
            gathered = [torch.empty(numel) for _ in range(ranks)]
            group.allgather([gathered], [shard]).wait()  # warm-up: connections, pages
            for _ in range(_REPEATS):
                start = time.perf_counter()
                group.allgather([gathered], [shard]).wait()
                best[rank] = min(best[rank], time.perf_counter() - start)
        except BaseException as err:  # reported to the caller below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    groups.clear()  # the groups' own threads are joined here, not at interpreter exit
    if errors:
        raise RuntimeError(f"gloo calibration failed: {errors[0]}") from errors[0]
    seconds = max(best)  # the collective is over when its slowest rank is
    return (ranks - 1) * nbytes / seconds / 1e9


def gloo_bandwidth(
    world_size: int,
    *,
    path: Path | None = None,
    measure: Callable[[int], float] = measure_gloo_gbps,
) -> Bandwidth:
    """This machine's gloo bandwidth for a plan on ``world_size`` ranks: cached, or measured.

    Args:
        world_size: The planned world size; the calibration runs on
            ``min(world_size, MAX_CALIBRATION_RANKS)`` ranks.
        path: The cache file (default :func:`cache_path`).
        measure: Measures GB/s for a number of ranks (:func:`measure_gloo_gbps`).
    """
    if world_size < 2:
        return Bandwidth(gbps=None, source="unavailable", detail="one rank sends nothing")
    path = path if path is not None else cache_path()
    ranks = min(world_size, MAX_CALIBRATION_RANKS)
    where = f"gloo measured on {socket.gethostname()} with {ranks} ranks over loopback"
    cached = read_cached_gbps(path, ranks)
    if cached is not None:
        return Bandwidth(gbps=cached, source="cached", detail=f"{where}; cached in {path}")
    try:
        gbps = measure(ranks)
    except (RuntimeError, ValueError, OSError) as err:
        return Bandwidth(gbps=None, source="unavailable", detail=f"calibration failed: {err}")
    if not (math.isfinite(gbps) and 0 < gbps <= _MAX_GBPS):
        return Bandwidth(
            gbps=None, source="unavailable", detail=f"calibration gave {gbps} GB/s, not a rate"
        )
    detail = f"{where} just now"
    try:
        _write_entry(path, ranks, gbps)
        detail += f"; cached in {path}"
    except OSError as err:
        detail += f" (not cached: {err})"
    return Bandwidth(gbps=gbps, source="measured", detail=detail)


def default_bandwidth() -> Bandwidth:
    """The NCCL default (no measurement: a GPU interconnect is not this machine's loopback)."""
    return Bandwidth(
        gbps=DEFAULT_BANDWIDTH_GBPS,
        source="default",
        detail="the default, an InfiniBand-class network; pass --bandwidth-gbps for yours",
    )
