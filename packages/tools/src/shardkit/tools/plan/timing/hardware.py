"""A machine's speeds, as the step-time model uses them: compute, memory, links, overlap.

A :class:`Hardware` profile says how fast one rank computes (matrix-multiply FLOP/s per dtype,
memory bandwidth for the operators bound by bytes), what each operator costs to launch, how
fast each mesh axis' link is and what a collective costs to start, how fast host and device
exchange bytes (CPU offload) and whether communication runs beside compute. Two profiles are
published, :data:`H100` and :data:`H200`; :func:`shardkit.tools.plan.timing.calibrate.calibrate`
measures this machine.

The published figures are NVIDIA's datasheets (H100 Tensor Core GPU datasheet, SXM5 column;
H200 Tensor Core GPU datasheet, SXM column): dense (not 2:4 sparse) Tensor Core throughput,
HBM bandwidth, NVLink 4's 900 GB/s (both directions together, so 450 GB/s each way), PCIe
Gen5 x16 (64 GB/s each way, about 55 GB/s reached in practice) and one 400 Gb/s InfiniBand NDR
adapter per GPU (50 GB/s). The efficiencies and latencies are assumptions, marked where set.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["H100", "H200", "PROFILES", "Hardware", "Link", "interpolate"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    """A mesh axis' connection, as one rank sees it."""

    gbps: float
    """GB/s (1e9 bytes per second) one rank sends at, each way, as reached (not peak)."""
    latency_s: float
    """Seconds a collective costs before its bytes: start-up, synchronisation, small hops."""
    curves: Mapping[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    """Measured seconds by bytes sent, per collective kind ('all_gather', 'reduce_scatter'):
    ``(sent bytes, seconds)`` points in increasing order of bytes, their seconds
    non-decreasing. Where a kind has one, it replaces ``latency_s`` and ``gbps``: a link's
    rate need not be one figure (gloo over loopback slows past the socket buffers, and
    reduces on the CPU)."""

    def seconds(self, sent_bytes: int, kind: str = "all_gather") -> float:
        """Time of a collective of ``kind`` in which this rank sends ``sent_bytes``.

        On a measured curve: linear between the two points around ``sent_bytes``, the first
        point's time below it (a collective costs its start-up however small), and the last
        point's rate above it.
        """
        curve = self.curves.get(kind)
        if not curve:
            return self.latency_s + sent_bytes / (self.gbps * 1e9)
        return interpolate(curve, sent_bytes)


def interpolate(curve: tuple[tuple[int, float], ...], nbytes: int) -> float:
    """Seconds at ``nbytes`` on ``(bytes, seconds)`` points (see :meth:`Link.seconds`)."""
    first_bytes, first_s = curve[0]
    if nbytes <= first_bytes:
        return first_s
    last_bytes, last_s = curve[-1]
    if nbytes >= last_bytes:
        return last_s * nbytes / last_bytes
    upper = bisect.bisect_left(curve, nbytes, key=lambda point: point[0])
    (low_bytes, low_s), (high_bytes, high_s) = curve[upper - 1], curve[upper]
    return low_s + (high_s - low_s) * (nbytes - low_bytes) / (high_bytes - low_bytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    """One rank's machine: how fast it computes, moves bytes and communicates."""

    name: str
    """For reports: 'H100', 'H200', 'calibrated on <host>'."""
    matmul_flops: Mapping[str, float]
    """Peak FLOP/s of FLOP-counted operators (matrix multiplies, attention) by dtype name
    ('float32', 'bfloat16', 'float16'); a dtype missing falls back to 'float32'."""
    attention_flops: Mapping[str, float] = field(default_factory=dict)
    """FLOP/s of fused attention by dtype, where it differs from ``matmul_flops`` (a CPU's
    flash kernel in bfloat16 gains nothing from its matrix units); missing: theirs."""
    memory_gbps: Mapping[str, float]
    """GB/s that operators bound by bytes reach, by dtype name (as ``matmul_flops``)."""
    compute_efficiency: float = 1.0
    """The fraction of ``matmul_flops`` reached (1.0 where the figure is measured)."""
    launch_s: float
    """Seconds each operator costs beyond its roofline: a kernel launch on a GPU, the
    dispatcher's overhead on a CPU."""
    intra_node: Link
    """Between ranks of one node (NVLink; loopback on one machine)."""
    inter_node: Link
    """Between nodes (InfiniBand)."""
    ranks_per_node: int = 8
    """Ranks sharing ``intra_node``: a process group larger than this crosses nodes."""
    host_link: Link | None = None
    """Host <-> device copies (offload), each way; None: the host is the device (a CPU)."""
    host_memory_gbps: float = 0.0
    """The host's memory bandwidth: the optimizer's step on offloaded state runs there."""
    host_launch_s: float = 0.0
    """Seconds per operator on the host (the offloaded optimizer's dispatch)."""
    overlap: bool = True
    """Whether collectives run beside compute (GPUs: side streams). False: each one adds its
    time, as if the compute stood waiting for it."""
    contention: float = 0.0
    """The fraction of an overlapped collective's time the compute loses to it all the same
    (0 on a GPU; on a CPU, gloo's threads move the bytes on the cores the compute runs on, so
    most of a collective's time is taken from the compute even while it overlaps)."""
    collective_overhead_s: float = 0.0
    """Seconds of the engine's own host work per collective, on the compute stream: its
    hooks, buffers and the ranks meeting (a CPU profile measures it; a GPU's is hidden behind
    its kernels, 0)."""
    fresh_alloc_bytes: int = 0
    """Host allocations this large or larger come fresh from the operating system each time
    and are paged in as they are first written (glibc maps them above a threshold that moves
    with what was freed: measured by ``calibrate``); 0: none do (a GPU's caching allocator
    keeps its blocks)."""
    fresh_alloc_gbps: float = 0.0
    """GB/s at which a fresh allocation is paged in (beyond writing it), for
    ``fresh_alloc_bytes``."""
    selective_op_s: float = 0.0
    """Seconds a ``selective`` checkpoint adds per operator of the checkpointed forward: its
    policy runs in Python for each, in forward and again in the recomputation (measured on a
    CPU profile; 0 on the GPU profiles, where the host runs ahead of the kernels)."""
    tf32: bool = False
    """Whether float32 matrix multiplies run as TF32 (``torch.backends.cuda.matmul.allow_tf32``)."""
    tf32_flops: float = 0.0
    """TF32 FLOP/s, used for float32 when ``tf32``."""
    notes: tuple[str, ...] = field(default=())
    """Where the figures come from."""

    def flop_rate(self, dtype: str, *, attention: bool = False) -> float:
        """FLOP/s reached by FLOP-counted operators in ``dtype`` (by attention's)."""
        if attention and dtype in self.attention_flops:
            return self.attention_flops[dtype] * self.compute_efficiency
        if dtype == "float32" and self.tf32 and self.tf32_flops:
            return self.tf32_flops * self.compute_efficiency
        peak = self.matmul_flops.get(dtype) or self.matmul_flops["float32"]
        return peak * self.compute_efficiency

    def bytes_rate(self, dtype: str) -> float:
        """Bytes per second of operators bound by memory, in ``dtype``."""
        return (self.memory_gbps.get(dtype) or self.memory_gbps["float32"]) * 1e9

    def link(self, axis: str, group_size: int) -> Link:
        """The link a collective on mesh axis ``axis`` over ``group_size`` ranks runs on.

        torchtitan's layout puts the inner axes (tp, dp_shard) inside a node and the
        replicas across nodes; plain 'dp' crosses nodes once it has more ranks than a node.
        """
        if axis == "dp_replicate" or (axis == "dp" and group_size > self.ranks_per_node):
            return self.inter_node
        return self.intra_node

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "name": self.name,
            "matmul_flops": dict(self.matmul_flops),
            "attention_flops": dict(self.attention_flops),
            "memory_gbps": dict(self.memory_gbps),
            "compute_efficiency": self.compute_efficiency,
            "launch_s": self.launch_s,
            "intra_node": _link_dict(self.intra_node),
            "inter_node": _link_dict(self.inter_node),
            "ranks_per_node": self.ranks_per_node,
            "host_link": None
            if self.host_link is None
            else {"gbps": self.host_link.gbps, "latency_s": self.host_link.latency_s},
            "host_memory_gbps": self.host_memory_gbps,
            "overlap": self.overlap,
            "contention": self.contention,
            "collective_overhead_s": self.collective_overhead_s,
            "selective_op_s": self.selective_op_s,
            "fresh_alloc_bytes": self.fresh_alloc_bytes,
            "fresh_alloc_gbps": self.fresh_alloc_gbps,
            "tf32": self.tf32,
            "notes": list(self.notes),
        }


def _link_dict(link: Link) -> dict[str, Any]:
    out: dict[str, Any] = {"gbps": link.gbps, "latency_s": link.latency_s}
    if link.curves:
        out["curves"] = {kind: [list(p) for p in points] for kind, points in link.curves.items()}
    return out


_TERA = 1e12
# Assumptions (not datasheet figures): large GEMMs reach about 70% of dense peak; streaming
# kernels about 80% of HBM bandwidth; NCCL's bus bandwidth about 80% of NVLink's per-direction
# peak and 90% of the InfiniBand adapter's; ~10 us to start a collective in a node and ~20 us
# across nodes; ~5 us per kernel launch; a host DDR5 socket's ~200 GB/s for the optimizer.
_GPU_COMMON: dict[str, Any] = {
    "compute_efficiency": 0.7,
    "launch_s": 5e-6,
    "intra_node": Link(gbps=0.8 * 450.0, latency_s=10e-6),
    "inter_node": Link(gbps=0.9 * 50.0, latency_s=20e-6),
    "ranks_per_node": 8,
    "host_link": Link(gbps=55.0, latency_s=10e-6),
    "host_memory_gbps": 200.0,
    "host_launch_s": 5e-6,
    "overlap": True,
}
_GPU_FLOPS = {"float32": 67 * _TERA, "bfloat16": 989 * _TERA, "float16": 989 * _TERA}

H100 = Hardware(
    name="H100",
    matmul_flops=_GPU_FLOPS,
    tf32_flops=494 * _TERA,
    memory_gbps={"float32": 0.8 * 3350.0},
    notes=(
        "NVIDIA H100 datasheet (SXM5): 989 TFLOP/s bf16/fp16 dense, 67 fp32, 494 tf32; "
        "HBM3 3.35 TB/s; NVLink 4 900 GB/s; PCIe Gen5",
        "assumed: 70% of peak FLOP/s, 80% of HBM and NVLink, 90% of a 400 Gb/s IB adapter",
    ),
    **_GPU_COMMON,
)
"""An H100 SXM5 in an 8-GPU NVLink node, one 400 Gb/s InfiniBand adapter per GPU."""

H200 = replace(
    H100,
    name="H200",
    memory_gbps={"float32": 0.8 * 4800.0},
    notes=(
        "NVIDIA H200 datasheet (SXM): the H100's compute, HBM3e 4.8 TB/s, NVLink 900 GB/s",
        "assumed: 70% of peak FLOP/s, 80% of HBM and NVLink, 90% of a 400 Gb/s IB adapter",
    ),
)
"""An H200 SXM: the H100's compute and links, with HBM3e's 4.8 TB/s."""

PROFILES: dict[str, Hardware] = {"h100": H100, "h200": H200}
"""The published profiles by the CLI's names."""
