"""What :func:`~shardkit.tools.plan.timing.calibrate.calibrate` times in this process, on the CPU.

With the thread count a rank trains with (one, under ``OMP_NUM_THREADS=1``), each the best of
a few repeats:

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
- fresh tensors against reused ones: how fast the host pages in a large allocation, and
  from which size (glibc maps allocations above a threshold anew, about 33 MiB here, so the
  engine's buffers that large are paged in every step).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from shardkit.tools.plan.op_costs import attention_flops, operator_bytes
from shardkit.tools.plan.recompute import selective_context

__all__ = [
    "ATTENTION",
    "MATMUL",
    "fresh_seconds",
    "measure_fresh_alloc",
    "measure_host",
    "measure_per_operator",
]

_REPEATS = 5
_FRESH_LARGEST = 256 * 1024 * 1024  # the largest size probed for fresh allocations
_FRESH_SMALLEST = 1024 * 1024
_FRESH_RESOLUTION = 256 * 1024
_TINY_LAYERS = 8  # the per-operator timing's layers (Linear, GELU, LayerNorm, width 8)


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


def measure_host(
    *,
    threads: int = 1,
    matmul: tuple[int, int, int] = MATMUL,
    attention: tuple[int, int, int, int] = ATTENTION,
) -> dict[str, float]:
    """Every figure this module times (see its docstring), with ``threads`` torch threads."""
    figures: dict[str, float] = {}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            figures.update(_measure_dtype(dtype, matmul))
            figures.update(_measure_attention(dtype, attention))
        figures.update(measure_per_operator())
        figures.update(measure_fresh_alloc())
    finally:
        torch.set_num_threads(before)
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


def measure_per_operator() -> dict[str, float]:
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


def fresh_seconds(nbytes: int) -> float:
    """What filling a new ``nbytes`` tensor costs beyond filling a reused one."""
    numel = nbytes // 4
    reused = torch.empty(numel)
    fill_reused = _best(lambda: reused.fill_(1.0))
    fill_fresh = _best(lambda: torch.empty(numel).fill_(1.0))
    return max(fill_fresh - fill_reused, 0.0)


def measure_fresh_alloc() -> dict[str, float]:
    """How fast a fresh large allocation is paged in, and from which size allocations are.

    The rate from the largest size probed (256 MiB); the size by bisection, to 256 KiB:
    the smallest whose fresh fill costs at least half its bytes at that rate more than a
    reused fill (glibc's threshold moves with what was freed, so it is measured, not
    assumed). 0 bytes: not even the largest size was paged in afresh.
    """
    extra = fresh_seconds(_FRESH_LARGEST)
    if extra <= 0:
        return {"fresh_alloc_gbps": 0.0, "fresh_alloc_bytes": 0.0}
    rate = _FRESH_LARGEST / extra

    def paged(nbytes: int) -> bool:
        return fresh_seconds(nbytes) >= 0.5 * nbytes / rate

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
