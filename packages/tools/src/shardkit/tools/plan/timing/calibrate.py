"""This machine's ``Hardware`` profile (``hardware``), measured and cached.

:func:`calibrate` measures, in this process (:mod:`shardkit.tools.plan.timing.calibrate_host`): a
linear layer's and causal attention's forward and backward in float32 and bfloat16, the
operators bound by bytes a transformer runs, the host's cost per operator and a ``selective``
checkpoint's, and from which size the host pages fresh allocations in and how fast; between
``ranks`` processes (:mod:`shardkit.tools.plan.timing.calibrate_gloo`): each collective's time by
size as shardkit's engine runs it on gloo, the share of a collective's time the compute loses
while it overlaps, and the engine's host work per collective. :func:`profile` makes them a
:class:`~shardkit.tools.plan.timing.hardware.Hardware` profile with overlap, contention and the
measured curves.

Each figure is the best of a few repeats; it takes about 15 seconds, once.

The figures are cached beside the bandwidth cache (``bandwidth.cache_path``'s folder), file
``hardware.json``, keyed by host name, threads, ranks and the timed sizes, and read as
untrusted input: size-capped plain JSON, every figure type- and range-checked (each curve's
bytes increasing and its seconds non-decreasing); anything else is measured again and the
file rewritten atomically.
"""

from __future__ import annotations

import contextlib
import math
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardkit.tools.plan.timing.bandwidth import cache_path as bandwidth_cache_path
from shardkit.tools.plan.timing.calibrate_gloo import measure_gloo
from shardkit.tools.plan.timing.calibrate_host import ATTENTION, MATMUL, measure_host
from shardkit.tools.plan.timing.hardware import Hardware, Link
from shardkit.tools.plan.timing.measure_cache import read_entries, write_entries

__all__ = [
    "ATTENTION",
    "CALIBRATION_FIELDS",
    "CURVES",
    "MATMUL",
    "calibrate",
    "hardware_cache_path",
    "measure",
    "profile",
]

CALIBRATION_FIELDS = (
    "float32_flops",
    "bfloat16_flops",
    "float32_attention_flops",
    "bfloat16_attention_flops",
    "float32_gbps",
    "bfloat16_gbps",
    "launch_s",
    "selective_op_s",
    "contention",
    "collective_overhead_s",
    "fresh_alloc_gbps",
    "fresh_alloc_bytes",
)
"""A calibration's figures: FLOP/s and GB/s per dtype, seconds per operator, gloo's."""
CURVES = ("all_gather", "reduce_scatter")
"""A calibration's curves: ``[[bytes sent, seconds], ...]`` per collective kind."""
_CACHE_FILE = "hardware.json"
_CACHE_VERSION = 2
_MAX_FIGURE = 1e18  # above any machine's FLOP/s: a larger cached figure is not a measurement
_MAY_BE_ZERO = frozenset(
    {
        "selective_op_s",
        "contention",
        "collective_overhead_s",
        "fresh_alloc_bytes",
        "fresh_alloc_gbps",
    }
)
_FRACTIONS = frozenset({"contention"})
_MAX_POINTS = 256


def hardware_cache_path() -> Path:
    """The cache file (in the bandwidth cache's folder)."""
    return bandwidth_cache_path().parent / _CACHE_FILE


def measure(
    ranks: int = 2,
    *,
    threads: int = 1,
    matmul: tuple[int, int, int] = MATMUL,
    attention: tuple[int, int, int, int] = ATTENTION,
) -> dict[str, Any]:
    """Measure :data:`CALIBRATION_FIELDS` and :data:`CURVES` now (no cache).

    Args:
        ranks: Ranks of the gloo calibration (at least 2).
        threads: Torch threads while measuring (a rank's ``OMP_NUM_THREADS``).
        matmul: (m, k, n) of the timed linear layer ``(m, k) -> (m, n)``, like the model's;
            the operators bound by bytes run on (m, n).
        attention: (batch, heads, sequence, head dim) of the timed attention, like the model's.

    Raises:
        RuntimeError: the gloo calibration failed.
    """
    figures: dict[str, Any] = dict(
        measure_host(threads=threads, matmul=matmul, attention=attention)
    )
    gloo = measure_gloo(ranks)
    figures.update({name: gloo[name] for name in (*CURVES, "contention", "collective_overhead_s")})
    return figures


def _key(ranks: int, threads: int, shapes: tuple[int, ...]) -> str:
    sizes = "x".join(map(str, shapes))
    return f"{socket.gethostname()}/threads={threads}/ranks={ranks}/shapes={sizes}"


def _valid(entry: object) -> dict[str, Any] | None:
    if not isinstance(entry, dict):
        return None
    figures: dict[str, Any] = {}
    for name in CALIBRATION_FIELDS:
        value = entry.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        low_ok = value >= 0 if name in _MAY_BE_ZERO else value > 0
        high = 1.0 if name in _FRACTIONS else _MAX_FIGURE
        if not math.isfinite(value) or not low_ok or value > high:
            return None
        figures[name] = float(value)
    for kind in CURVES:
        curve = _valid_curve(entry.get(kind))
        if curve is None:
            return None
        figures[kind] = curve
    return figures


def _valid_curve(points: object) -> list[list[float]] | None:
    """``[[bytes, seconds], ...]``: bytes increasing, seconds positive and non-decreasing."""
    if not isinstance(points, list) or not 0 < len(points) <= _MAX_POINTS:
        return None
    curve: list[list[float]] = []
    for point in points:
        if not isinstance(point, list) or len(point) != 2:
            return None
        if any(isinstance(v, bool) or not isinstance(v, int | float) for v in point):
            return None
        nbytes, seconds = float(point[0]), float(point[1])
        if not (math.isfinite(nbytes) and math.isfinite(seconds)):
            return None
        if not (0 < nbytes <= _MAX_FIGURE and 0 < seconds <= _MAX_FIGURE):
            return None
        if curve and (nbytes <= curve[-1][0] or seconds < curve[-1][1]):
            return None
        curve.append([nbytes, seconds])
    return curve


def _read(path: Path) -> dict[str, dict[str, Any]]:
    """The valid entries of the cache file (``measure_cache``)."""
    return read_entries(path, _CACHE_VERSION, _valid)


def _write(path: Path, key: str, figures: dict[str, Any]) -> None:
    entries: dict[str, Any] = dict(_read(path))
    entries[key] = figures
    write_entries(path, _CACHE_VERSION, entries)


def profile(figures: dict[str, Any], name: str) -> Hardware:
    """A CPU profile from measured figures.

    One link (gloo's curves), overlap with contention, the host is the device.
    """
    curves = {
        kind: tuple((int(nbytes), float(seconds)) for nbytes, seconds in figures[kind])
        for kind in CURVES
    }
    first_bytes, first_s = curves["all_gather"][0]
    last_bytes, last_s = curves["all_gather"][-1]
    link = Link(gbps=last_bytes / last_s / 1e9, latency_s=first_s, curves=curves)
    bf16 = figures["bfloat16_flops"]
    scalars = ", ".join(f"{k}={figures[k]:.3g}" for k in CALIBRATION_FIELDS)
    return Hardware(
        name=name,
        matmul_flops={"float32": figures["float32_flops"], "bfloat16": bf16, "float16": bf16},
        attention_flops={
            "float32": figures["float32_attention_flops"],
            "bfloat16": figures["bfloat16_attention_flops"],
        },
        memory_gbps={"float32": figures["float32_gbps"], "bfloat16": figures["bfloat16_gbps"]},
        launch_s=figures["launch_s"],
        intra_node=link,
        inter_node=link,
        ranks_per_node=1 << 30,
        host_link=None,
        overlap=True,
        contention=figures["contention"],
        collective_overhead_s=figures["collective_overhead_s"],
        selective_op_s=figures["selective_op_s"],
        fresh_alloc_bytes=int(figures["fresh_alloc_bytes"]),
        fresh_alloc_gbps=figures["fresh_alloc_gbps"],
        notes=(
            f"measured: {scalars}",
            f"gloo (shardkit's exchange, processes): {len(curves['all_gather'])} sizes, "
            f"all-gather {first_s * 1e3:.3g} ms at {first_bytes} B to "
            f"{last_bytes / last_s / 1e9:.3g} GB/s at {last_bytes} B",
        ),
    )


def calibrate(
    ranks: int = 2,
    *,
    threads: int = 1,
    path: Path | None = None,
    refresh: bool = False,
    matmul: tuple[int, int, int] = MATMUL,
    attention: tuple[int, int, int, int] = ATTENTION,
    measure_fn: Callable[[int, int], dict[str, Any]] | None = None,
) -> Hardware:
    """This machine's profile for ``ranks`` ranks of ``threads`` threads: cached or measured.

    Args:
        ranks: Ranks of the gloo calibration (at least 2).
        threads: Torch threads per rank.
        matmul: (m, k, n) of the timed matrix multiply (see :func:`measure`).
        attention: (batch, heads, sequence, head dim) of the timed attention.
        path: The cache file (default :func:`hardware_cache_path`).
        refresh: Measure even when the cache holds this host's figures.
        measure_fn: ``(ranks, threads) -> figures`` (default :func:`measure`), for tests.

    Raises:
        RuntimeError: the gloo calibration failed.
    """
    path = path if path is not None else hardware_cache_path()
    key = _key(ranks, threads, (*matmul, *attention))
    name = f"calibrated on {socket.gethostname()} ({threads} thread(s), {ranks} ranks)"
    cached = None if refresh else _read(path).get(key)
    if cached is not None:
        return profile(cached, name)
    run = measure_fn or (lambda r, t: measure(r, threads=t, matmul=matmul, attention=attention))
    figures = run(ranks, threads)
    checked = _valid(figures)
    if checked is None:
        raise RuntimeError(f"calibration gave figures that are not rates: {figures}")
    with contextlib.suppress(OSError):  # an unwritable cache: the figures still serve
        _write(path, key, checked)
    return profile(checked, name)
