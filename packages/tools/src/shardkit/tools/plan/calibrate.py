"""This machine's :class:`~shardkit.tools.plan.hardware.Hardware` profile, measured and cached.

:func:`calibrate` times, on the CPU with the thread count a rank trains with (one, under
``OMP_NUM_THREADS=1``): matrix multiplies and causal attention (forward and backward) in
float32 and bfloat16 at given sizes (a CPU's attention kernel may not gain from bfloat16 what
its matrix multiplies do), a streaming add in both (the bandwidth of operators bound by
bytes), a one-element add (the dispatcher's overhead per operator), and gloo's collective
bandwidth and latency between ``ranks`` ranks (``bandwidth.measure_gloo_gbps``: threads of
this process over loopback). The best of a few repeats is kept; it takes a few seconds. The
profile has no overlap: with a rank per core, gloo's collectives take the cores the compute
runs on.

The figures are cached beside the bandwidth cache (``bandwidth.cache_path``'s folder), file
``hardware.json``, keyed by host name, threads, ranks and the timed sizes, and read as
untrusted input: size-capped plain JSON, every figure type- and range-checked; anything else
is measured again and the file rewritten atomically.
"""

from __future__ import annotations

import contextlib
import math
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from shardkit.tools.plan.bandwidth import cache_path as bandwidth_cache_path
from shardkit.tools.plan.bandwidth import measure_gloo_gbps
from shardkit.tools.plan.hardware import Hardware, Link
from shardkit.tools.plan.measure_cache import read_entries, write_entries
from shardkit.tools.plan.op_costs import attention_flops

__all__ = [
    "ATTENTION",
    "CALIBRATION_FIELDS",
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
    "gloo_gbps",
    "gloo_latency_s",
)
"""What a calibration measures: FLOP/s and GB/s per dtype, seconds per operator, gloo."""
_CACHE_FILE = "hardware.json"
_CACHE_VERSION = 1
_MAX_FIGURE = 1e18  # above any machine's FLOP/s: a larger cached figure is not a measurement
_REPEATS = 5
_STREAM_NUMEL = 4 * 1024 * 1024
_LAUNCHES = 2000
_LATENCY_BYTES = 64


def hardware_cache_path() -> Path:
    """The cache file (in the bandwidth cache's folder)."""
    return bandwidth_cache_path().parent / _CACHE_FILE


def _best(run: Callable[[], object], repeats: int = _REPEATS) -> float:
    """The fastest of ``repeats`` timed runs, after one to warm up."""
    run()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


MATMUL = (1024, 512, 512)
"""The default (m, k, n) of the timed matrix multiply."""
ATTENTION = (8, 4, 128, 32)
"""The default (batch, heads, sequence, head dim) of the timed causal attention."""


def measure(
    ranks: int = 2,
    *,
    threads: int = 1,
    matmul: tuple[int, int, int] = MATMUL,
    attention: tuple[int, int, int, int] = ATTENTION,
) -> dict[str, float]:
    """Measure :data:`CALIBRATION_FIELDS` now (no cache).

    Args:
        ranks: Ranks of the gloo calibration (at least 2).
        threads: Torch threads while measuring (a rank's ``OMP_NUM_THREADS``).
        matmul: (m, k, n) of the timed ``(m, k) @ (k, n)``, like the model's.
        attention: (batch, heads, sequence, head dim) of the timed attention, like the model's.
    """
    figures: dict[str, float] = {}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            figures.update(_measure_dtype(dtype, matmul))
            figures.update(_measure_attention(dtype, attention))
        # An input that requires grad: a training step's forward records autograd's graph.
        one, two = torch.ones(1, requires_grad=True), torch.ones(1)

        def launches() -> None:
            for _ in range(_LAUNCHES):
                torch.add(one, two)

        figures["launch_s"] = _best(launches, 3) / _LAUNCHES
    finally:
        torch.set_num_threads(before)
    figures["gloo_gbps"] = measure_gloo_gbps(ranks)
    small = measure_gloo_gbps(ranks, _LATENCY_BYTES)
    figures["gloo_latency_s"] = (ranks - 1) * _LATENCY_BYTES / (small * 1e9)
    return figures


def _measure_dtype(dtype: torch.dtype, matmul: tuple[int, int, int]) -> dict[str, float]:
    """FLOP/s of a matrix multiply and GB/s of a streaming add, in ``dtype``."""
    name = str(dtype).removeprefix("torch.")
    m, k, n = matmul
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    flops = 2 * m * k * n / _best(lambda: torch.mm(a, b, out=out))
    x, y = torch.ones(_STREAM_NUMEL, dtype=dtype), torch.ones(_STREAM_NUMEL, dtype=dtype)
    z = torch.empty_like(x)
    moved = 3 * x.numel() * x.element_size()
    gbps = moved / _best(lambda: torch.add(x, y, out=z)) / 1e9
    return {f"{name}_flops": flops, f"{name}_gbps": gbps}


def _measure_attention(dtype: torch.dtype, shape: tuple[int, int, int, int]) -> dict[str, float]:
    """FLOP/s of causal attention's forward and backward, counted as ``op_costs`` counts."""
    q, k, v = (torch.randn(shape).to(dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(shape).to(dtype)

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)

    flops = attention_flops(shape, shape, shape, causal=True) * (1 + 2.5)  # 2.5: backward's
    return {f"{str(dtype).removeprefix('torch.')}_attention_flops": flops / _best(step)}


def _key(ranks: int, threads: int, shapes: tuple[int, ...]) -> str:
    sizes = "x".join(map(str, shapes))
    return f"{socket.gethostname()}/threads={threads}/ranks={ranks}/shapes={sizes}"


def _valid(entry: object) -> dict[str, float] | None:
    if not isinstance(entry, dict):
        return None
    figures: dict[str, float] = {}
    for name in CALIBRATION_FIELDS:
        value = entry.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        if not math.isfinite(value) or not 0 < value <= _MAX_FIGURE:
            return None
        figures[name] = float(value)
    return figures


def _read(path: Path) -> dict[str, dict[str, float]]:
    """The valid entries of the cache file (``measure_cache``)."""
    return read_entries(path, _CACHE_VERSION, _valid)


def _write(path: Path, key: str, figures: dict[str, float]) -> None:
    entries: dict[str, Any] = dict(_read(path))
    entries[key] = figures
    write_entries(path, _CACHE_VERSION, entries)


def profile(figures: dict[str, float], name: str) -> Hardware:
    """A CPU profile from measured figures: no overlap, one link, the host is the device."""
    link = Link(gbps=figures["gloo_gbps"], latency_s=figures["gloo_latency_s"])
    bf16 = figures["bfloat16_flops"]
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
        overlap=False,
        notes=(f"measured: {', '.join(f'{k}={v:.3g}' for k, v in figures.items())}",),
    )


def calibrate(
    ranks: int = 2,
    *,
    threads: int = 1,
    path: Path | None = None,
    refresh: bool = False,
    matmul: tuple[int, int, int] = MATMUL,
    attention: tuple[int, int, int, int] = ATTENTION,
    measure_fn: Callable[[int, int], dict[str, float]] | None = None,
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
