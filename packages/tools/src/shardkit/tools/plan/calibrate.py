"""This machine's :class:`~shardkit.tools.plan.hardware.Hardware` profile, measured and cached.

:func:`calibrate` times, on the CPU with the thread count a rank trains with (one, under
``OMP_NUM_THREADS=1``):

- a linear layer's forward and backward (its three matrix multiplies, the weight's
  transposed as ``nn.Linear`` runs them) and causal attention's forward and backward, in
  float32 and bfloat16 at given sizes (a CPU's attention kernel may not gain from bfloat16
  what its matrix multiplies do);
- the operators bound by bytes as a transformer runs them (GELU, layer norm, softmax, a
  residual add, and their backward), their bytes counted as the step's counts count them
  (``op_costs.operator_bytes``): a streaming add alone reaches twice their rate;
- a training step of tiny layers, for the host's cost per operator (dispatch, autograd's
  graph and its backward), and the same under a ``selective`` checkpoint, for its policy's
  cost per operator of the checkpointed forward;
- filling fresh tensors against reused ones: how fast the host pages in a large
  allocation, and from which size (glibc maps allocations above a threshold anew, about
  33 MiB here, so the engine's buffers that large are paged in every step);
- gloo between ``ranks`` processes (:mod:`shardkit.tools.plan.calibrate_gloo`): each
  collective's time by size as shardkit's engine runs it, the share of a collective's time
  the compute loses while it overlaps, and the engine's host work per collective.

The best of a few repeats is kept; it takes about half a minute, once.

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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from shardkit.tools.plan.bandwidth import cache_path as bandwidth_cache_path
from shardkit.tools.plan.calibrate_gloo import measure_gloo
from shardkit.tools.plan.hardware import Hardware, Link
from shardkit.tools.plan.measure_cache import read_entries, write_entries
from shardkit.tools.plan.op_costs import attention_flops, operator_bytes
from shardkit.tools.plan.recompute import selective_context

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
_REPEATS = 5
_FRESH_LARGEST = 256 * 1024 * 1024  # the largest size probed for fresh allocations
_FRESH_SMALLEST = 1024 * 1024
_FRESH_RESOLUTION = 256 * 1024
_TINY_LAYERS = 8  # the per-operator timing's layers (Linear, GELU, LayerNorm, width 8)


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
    figures: dict[str, Any] = {}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            figures.update(_measure_dtype(dtype, matmul))
            figures.update(_measure_attention(dtype, attention))
        figures.update(_measure_per_operator())
        figures.update(_measure_fresh_alloc())
    finally:
        torch.set_num_threads(before)
    gloo = measure_gloo(ranks)
    figures.update({name: gloo[name] for name in (*CURVES, "contention", "collective_overhead_s")})
    return figures


class _OperatorTimer(TorchDispatchMode):
    """Seconds and bytes (as the step's counts count them) of each kernel-launching operator."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's, unannotated
        self.seconds = 0.0
        self.nbytes = 0
        self.operators = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        start = time.perf_counter()
        out = func(*args, **kwargs)
        elapsed = time.perf_counter() - start
        moved = operator_bytes(func, args, kwargs, out)
        if moved is not None:
            self.seconds += elapsed
            self.nbytes += moved
            self.operators += 1
        return out


def _measure_dtype(dtype: torch.dtype, matmul: tuple[int, int, int]) -> dict[str, float]:
    """FLOP/s of a linear layer's forward and backward, GB/s of the byte-bound operators."""
    name = str(dtype).removeprefix("torch.")
    m, k, n = matmul
    x = torch.randn(m, k).to(dtype).requires_grad_()
    weight = torch.randn(n, k).to(dtype).requires_grad_()
    grad = torch.randn(m, n).to(dtype)

    def linear() -> None:
        F.linear(x, weight).backward(grad)
        x.grad = weight.grad = None

    flops = 6 * m * k * n / _best(linear)  # forward, input gradient, weight gradient
    h = torch.randn(m, n).to(dtype).requires_grad_()
    scale, shift = (torch.ones(n, dtype=dtype, requires_grad=True) for _ in range(2))

    def byte_bound() -> None:
        normed = F.layer_norm(F.gelu(h), (n,), scale, shift)
        (torch.softmax(normed, dim=-1) + h).sum().backward()
        h.grad = scale.grad = shift.grad = None

    byte_bound()  # warm-up
    best = math.inf
    for _ in range(_REPEATS):
        with _OperatorTimer() as timer:
            byte_bound()
        best = min(best, timer.seconds / timer.nbytes)
    return {f"{name}_flops": flops, f"{name}_gbps": 1 / best / 1e9}


def _measure_attention(dtype: torch.dtype, shape: tuple[int, int, int, int]) -> dict[str, float]:
    """FLOP/s of causal attention's forward and backward, counted as ``op_costs`` counts."""
    q, k, v = (torch.randn(shape).to(dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(shape).to(dtype)

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)

    flops = attention_flops(shape, shape, shape, causal=True) * (1 + 2.5)  # 2.5: backward's
    return {f"{str(dtype).removeprefix('torch.')}_attention_flops": flops / _best(step)}


def _measure_per_operator() -> dict[str, float]:
    """Seconds per operator of the host, and of a ``selective`` checkpoint's policy.

    The first from a training step of tiny layers (forward and backward, the operators the
    step's counts count); the second from the same step under a ``selective`` checkpoint,
    per operator of the forward it wraps.
    """
    torch.manual_seed(0)
    layers = [[nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8)] for _ in range(_TINY_LAYERS)]
    block = nn.Sequential(*(layer for trio in layers for layer in trio))
    x = torch.randn(4, 8, requires_grad=True)

    def plain() -> None:
        block(x).sum().backward()

    def selective() -> None:
        out = checkpoint(block, x, use_reentrant=False, context_fn=selective_context)
        out.sum().backward()

    plain()
    with _OperatorTimer() as step:
        plain()
    with torch.no_grad(), _OperatorTimer() as forward:
        block(x)
    plain_s, selective_s = _best(plain), _best(selective)
    return {
        "launch_s": plain_s / step.operators,
        "selective_op_s": max(selective_s - plain_s, 0.0) / forward.operators,
    }


def _fresh_seconds(nbytes: int) -> float:
    """What filling a new ``nbytes`` tensor costs beyond filling a reused one."""
    numel = nbytes // 4
    reused = torch.empty(numel)
    fill_reused = _best(lambda: reused.fill_(1.0))
    fill_fresh = _best(lambda: torch.empty(numel).fill_(1.0))
    return max(fill_fresh - fill_reused, 0.0)


def _measure_fresh_alloc() -> dict[str, float]:
    """How fast a fresh large allocation is paged in, and from which size allocations are.

    The rate from the largest size probed (256 MiB); the size by bisection, to 256 KiB:
    the smallest whose fresh fill costs at least half its bytes at that rate more than a
    reused fill (glibc's threshold moves with what was freed, so it is measured, not
    assumed). 0 bytes: not even the largest size was paged in afresh.
    """
    extra = _fresh_seconds(_FRESH_LARGEST)
    if extra <= 0:
        return {"fresh_alloc_gbps": 0.0, "fresh_alloc_bytes": 0.0}
    rate = _FRESH_LARGEST / extra

    def paged(nbytes: int) -> bool:
        return _fresh_seconds(nbytes) >= 0.5 * nbytes / rate

    if not paged(_FRESH_LARGEST):
        return {"fresh_alloc_gbps": 0.0, "fresh_alloc_bytes": 0.0}
    low, high = _FRESH_SMALLEST, _FRESH_LARGEST  # high is paged in; below low is not asked
    if paged(low):
        high = low
    while high - low > _FRESH_RESOLUTION:
        middle = (low + high) // 2 // 4 * 4
        if paged(middle):
            high = middle
        else:
            low = middle
    return {"fresh_alloc_gbps": rate / 1e9, "fresh_alloc_bytes": float(high)}


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
