"""torch.profiler ranges named as torch's ``fully_shard`` names its own, while a profiler records.

A trace of a shardkit step shows the ``FSDP::`` ranges a trace of torch's engine shows: each
group's hooks (``FSDP::pre_forward (layers.0)``, ``FSDP::post_backward_reduce (layers.0)``),
its all-gathers and their copy-outs, the prefetches (``FSDP::backward_prefetch for layers.0``)
and the root's own (``FSDP::root_pre_forward``, ``FSDP::root_post_backward_callback``; the
root group's ranges carry no name, as torch's). So the traces, and what users built on torch's
(time per phase, overlap read off the timeline), work unchanged. torch opens every range at
every hook, about 8 us each on a CPU core with no profiler running; here one is opened only
while a profiler records (torch.profiler, the autograd profiler, NVTX emission), and costs one
check of torch's profiler state otherwise.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch

__all__ = ["fsdp_range"]

_NO_RANGE = contextlib.nullcontext()  # reusable: it holds no state


def fsdp_range(label: str, fqn: str = "") -> AbstractContextManager[object]:
    """The range ``FSDP::label (fqn)`` (``FSDP::label for fqn`` for a prefetch), or a no-op.

    ``fqn``: the group's module names as torch's engine gives them (``torch_fqn``: the root's
    is "").
    """
    if not torch._C._autograd._profiler_enabled():
        return _NO_RANGE
    if label.endswith("_prefetch"):
        return torch.profiler.record_function(f"FSDP::{label} for {fqn}")
    return torch.profiler.record_function(f"FSDP::{label} ({fqn})" if fqn else f"FSDP::{label}")
