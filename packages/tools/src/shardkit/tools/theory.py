"""Closed-form communication and memory of sharded data parallelism (ZeRO / FSDP).

Notation: ``num_params`` is the parameter count Ψ, ``world_size`` the shard group size W,
``param_bytes`` (b_p) and ``grad_bytes`` (b_g) the bytes per element of the all-gathered
parameters and of the reduced gradients. Bytes are what one rank *sends* under a
bandwidth-optimal (ring or direct-exchange) algorithm; it receives as many.

Per step:

- all-gather of Ψ elements: Ψ·b_p·(W-1)/W; FSDP gathers twice (forward and backward) with
  ``reshard_after_forward=True`` and once with ``False``;
- reduce-scatter of the gradients: Ψ·b_g·(W-1)/W;
- HSDP adds an all-reduce of each rank's Ψ/W shard across R replicas: 2·(Ψ/W)·b_g·(R-1)/R.

Memory per rank (ZeRO paper, K bytes of optimizer state per parameter): DDP (b_p + b_g + K)Ψ,
ZeRO-1 (b_p + b_g)Ψ + KΨ/W, ZeRO-2 b_pΨ + (b_g + K)Ψ/W, ZeRO-3 / FSDP (b_p + b_g + K)Ψ/W.

Every function is exact integer arithmetic, rounded down; these are the minima that padding,
alignment and the real schedule only add to. The planner compares its plans with them, and
the communication tracker the steps it saw (``track.comm_minimum``): so they live here, beside
the other records the rooms share.
"""

from __future__ import annotations

__all__ = [
    "all_gather_bytes",
    "all_reduce_bytes",
    "comm_seconds",
    "fsdp_step_bytes",
    "reduce_scatter_bytes",
    "zero_memory_per_rank",
]


def _check(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"shardkit.tools.theory: {name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"shardkit.tools.theory: {name} must be >= {minimum}, got {value}")


def all_gather_bytes(num_params: int, world_size: int, bytes_per_element: int) -> int:
    """Bytes one rank sends to all-gather ``num_params`` elements over ``world_size`` ranks.

    Args:
        num_params: Elements of the full (gathered) tensor.
        world_size: Ranks in the group.
        bytes_per_element: Size of one gathered element (2 for bf16).

    Returns:
        ``num_params * bytes_per_element * (world_size - 1) // world_size``.
    """
    _check("num_params", num_params, 0)
    _check("world_size", world_size, 1)
    _check("bytes_per_element", bytes_per_element, 0)
    return num_params * bytes_per_element * (world_size - 1) // world_size


def reduce_scatter_bytes(num_params: int, world_size: int, bytes_per_element: int) -> int:
    """Bytes one rank sends to reduce-scatter ``num_params`` elements (the same as a gather)."""
    return all_gather_bytes(num_params, world_size, bytes_per_element)


def all_reduce_bytes(numel: int, world_size: int, bytes_per_element: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``numel`` elements: 2·n·b·(W-1)/W."""
    _check("numel", numel, 0)
    _check("world_size", world_size, 1)
    _check("bytes_per_element", bytes_per_element, 0)
    return 2 * numel * bytes_per_element * (world_size - 1) // world_size


def fsdp_step_bytes(
    num_params: int,
    world_size: int,
    *,
    param_bytes: int,
    grad_bytes: int,
    reshard_after_forward: bool = True,
    replicas: int = 1,
) -> int:
    """Bytes one rank sends per training step under FSDP (ZeRO-3) or ZeRO-2.

    Args:
        num_params: Trainable parameters Ψ (all of them gathered and reduced).
        world_size: The shard group size W.
        param_bytes: Bytes per gathered element (the ``param_dtype``'s size).
        grad_bytes: Bytes per reduced element (the ``reduce_dtype``'s size).
        reshard_after_forward: True gathers in forward and again in backward (ZeRO-3);
            False keeps parameters between them and gathers once (ZeRO-2 traffic).
        replicas: HSDP replica groups R; above 1 each rank also all-reduces its Ψ/W shard.

    Returns:
        ``(2·b_p + b_g)·Ψ·(W-1)/W`` (or ``(b_p + b_g)·…``), plus ``2·(Ψ/W)·b_g·(R-1)/R``.
    """
    _check("replicas", replicas, 1)
    gathers = 2 if reshard_after_forward else 1
    total = gathers * all_gather_bytes(num_params, world_size, param_bytes)
    total += reduce_scatter_bytes(num_params, world_size, grad_bytes)
    if replicas > 1:
        total += all_reduce_bytes(num_params // world_size, replicas, grad_bytes)
    return total


def zero_memory_per_rank(
    num_params: int,
    world_size: int,
    *,
    stage: int,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_bytes: int = 12,
) -> int:
    """Model-state bytes per rank under ZeRO stage 0 (DDP) to 3 (FSDP); no activations.

    The defaults are the ZeRO paper's mixed-precision Adam (bf16 parameters and gradients,
    K = 12: fp32 master, m and v). FSDP2 with fp32 sharded parameters and Adam is
    ``param_bytes=4, grad_bytes=4, optimizer_bytes=8`` at stage 3: 16Ψ/W.

    Args:
        num_params: Parameters Ψ.
        world_size: Data-parallel ranks W.
        stage: 0 (nothing sharded), 1 (optimizer state), 2 (+ gradients), 3 (+ parameters).
        param_bytes: Bytes per parameter element.
        grad_bytes: Bytes per gradient element.
        optimizer_bytes: Optimizer state bytes per parameter (K).

    Returns:
        The bytes, rounded down.
    """
    _check("num_params", num_params, 0)
    _check("world_size", world_size, 1)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"shardkit.tools.theory: stage must be 0, 1, 2 or 3, got {stage!r}")
    replicated = (param_bytes, grad_bytes, optimizer_bytes)
    # Stage s shards the last s of (optimizer, gradients, parameters), counting from optimizer.
    full = sum(b for i, b in enumerate(reversed(replicated)) if i >= stage)
    sharded = sum(b for i, b in enumerate(reversed(replicated)) if i < stage)
    return full * num_params + sharded * num_params // world_size


def comm_seconds(num_bytes: int, bandwidth_gbps: float) -> float:
    """Seconds to send ``num_bytes`` at ``bandwidth_gbps`` GB/s (1 GB = 1e9 bytes).

    Raises:
        ValueError: ``bandwidth_gbps`` is not positive.
    """
    if not bandwidth_gbps > 0:
        raise ValueError(
            f"shardkit.tools.theory: bandwidth_gbps must be positive, got {bandwidth_gbps}"
        )
    return num_bytes / (bandwidth_gbps * 1e9)
