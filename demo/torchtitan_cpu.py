"""Run torchtitan 0.3.0's trainer on CPU (gloo), with torch's FSDP or, launched so, shardkit's.

torchtitan assumes an accelerator and has no flag for the CPU. This script changes six things
in the running process, before torchtitan's trainer is imported, then runs ``torchtitan.train``
as ``python -m torchtitan.train`` would, with the same arguments. torchtitan's files are not
changed, and the same six apply to torch's FSDP and shardkit's, so their losses compare:

1. the device: torchtitan picks it once, when ``torchtitan.tools.utils`` is imported (the
   accelerator, or ``"cuda"`` when there is none), and other modules copy it; it is set to
   ``"cpu"`` there, with ``torch.cpu`` plus the memory functions torchtitan's monitor calls. The
   process group backend follows (``cpu`` -> gloo);
2. FlexAttention eagerly: torch 2.13 has no CPU backward for compiled ``flex_attention`` and
   refuses CPU inputs that need gradients, although its eager implementation has one;
3. gradients summed with ``SUM``: gloo has no ``PREMUL_SUM``, which torch's FSDP uses once
   torchtitan sets the divide factor to 1;
4. no ``torch.distributed.set_timeout`` in torch 2.13: the groups keep their first timeout;
5. with ``--training.enable_cpu_offload``, one gloo backend instead of ``cpu:gloo,cpu:gloo``;
6. pipeline schedules that take microbatches: torchtitan calls ``step(arg_mbs=..., kwarg_mbs=...,
   target_mbs=...)``, torch 2.13's ``step`` takes a whole batch and splits it itself.

Usage (torch's FSDP, then shardkit's through the launcher; the arguments are torchtitan's)::

    torchrun --nproc-per-node 2 demo/torchtitan_cpu.py --module llama3 \
        --config llama3_debugmodel ...
    torchrun --nproc-per-node 2 -m shardkit.core.run demo/torchtitan_cpu.py --module llama3 \
        --config llama3_debugmodel ...

See docs/guide/torchtitan.md for the flags of a short CPU run and the losses measured.
"""

from __future__ import annotations

import inspect
import logging
import os
import runpy
import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

logger = logging.getLogger(__name__)


def _total_memory() -> int:
    """Physical memory in bytes: what torchtitan logs as the device's capacity."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_device_module() -> ModuleType:
    """``torch.cpu`` with the memory functions torchtitan calls on a device module.

    torchtitan's memory monitor asks the device module for a name, properties and allocator
    statistics, which ``torch.cpu`` does not have. Empty statistics make it log ``-1`` peaks
    (its value for "unknown") instead of failing; nothing in training reads them.
    """
    module = ModuleType("torchtitan_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("_"):
            setattr(module, name, getattr(torch.cpu, name))

    def get_device_name(device: Any = None) -> str:
        return "CPU"

    def get_device_properties(device: Any = None) -> SimpleNamespace:
        return SimpleNamespace(name="CPU", total_memory=_total_memory())

    def memory_stats(device: Any = None) -> dict[str, int]:
        return {}

    def current_device() -> int:
        # torch.cpu says "cpu"; torchtitan passes this to barrier(device_ids=[...]), which
        # takes integers only.
        return 0

    def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    module.current_device = current_device  # type: ignore[attr-defined]
    module.get_device_name = get_device_name  # type: ignore[attr-defined]
    module.get_device_properties = get_device_properties  # type: ignore[attr-defined]
    module.memory_stats = memory_stats  # type: ignore[attr-defined]
    module.reset_peak_memory_stats = nothing  # type: ignore[attr-defined]
    module.empty_cache = nothing  # type: ignore[attr-defined]
    return module


def use_cpu() -> None:
    """Point torchtitan's device choice at the CPU; call before importing anything else of it.

    Raises:
        RuntimeError: a torchtitan module that copies the device choice was imported before,
            so it would keep ``"cuda"``.
    """
    copied = sorted(
        name
        for name, module in list(sys.modules.items())
        if name.startswith("torchtitan.")
        and name != "torchtitan.tools.utils"
        and any(hasattr(module, attr) for attr in ("device_type", "device_module"))
    )
    if copied:
        raise RuntimeError(
            f"torchtitan_cpu: {copied[0]} was imported before the device was set to the CPU "
            "and keeps torchtitan's own choice; run this script first (it runs torchtitan.train)"
        )
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type = "cpu"
    tt_utils.device_module = cpu_device_module()
    # torch.device("cpu", 0) would be another device than torch.device("cpu") in comparisons;
    # the CPU has no index to choose by LOCAL_RANK.
    tt_utils.get_local_device = lambda: torch.device("cpu")
    _eager_flex_attention_on_cpu()
    _sum_gradients_on_gloo()
    _keep_timeouts_without_set_timeout()
    _one_backend_for_offload()
    _pipeline_steps_on_microbatches()


def _eager_flex_attention_on_cpu() -> None:
    """Let the llama3 models' FlexAttention train on the CPU, eagerly.

    torchtitan calls ``flex_attention`` and ``create_block_mask`` through ``torch.compile``
    unconditionally; torch 2.13 has no compiled CPU backward for FlexAttention, and refuses CPU
    inputs that need gradients (a guard marked to be removed), although its eager
    implementation (the math reference, backward included) is device-agnostic. So torchtitan's
    two compiled callables are replaced by torch's eager functions, and the guard is kept for
    every device but the CPU. The rest of torch.compile is left as it is.
    """
    import torch.nn.attention.flex_attention as flex
    import torchtitan.models.common.attention as tt_attention

    guard = flex._validate_device

    def validate_device(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if query.device.type != "cpu":
            guard(query, key, value)

    flex._validate_device = validate_device
    tt_attention.FlexAttention._compiled_flex_attn = flex.flex_attention
    tt_attention._compiled_create_block_mask = flex.create_block_mask


def _sum_gradients_on_gloo() -> None:
    """Reduce gradients with a plain sum, which gloo has.

    torchtitan turns FSDP's gradient division off (``set_gradient_divide_factor(1.0)`` on every
    FSDP module) and scales by the token count itself. torch's ``fully_shard`` then
    reduce-scatters with ``PREMUL_SUM(1.0)``, which gloo refuses ("Cannot use
    ReduceOp.PREMUL_SUM with Gloo"); ``set_force_sum_reduction_for_comms(True)`` makes it a
    ``SUM`` with nothing to divide, the same numbers. torchtitan itself sets it only with
    symmetric memory (CUDA). Shardkit sums on gloo either way and accepts the call.
    """
    import torchtitan.distributed.fsdp as tt_fsdp

    disable_division = tt_fsdp.disable_fsdp_gradient_division

    def disable_division_and_sum(model: torch.nn.Module) -> None:
        # Which engine ran: under python -m shardkit.core.run, torch's names are shardkit's.
        patch = sys.modules.get("shardkit.core.torch_patch")
        shardkit = patch is not None and patch.is_torch_patched()
        logger.info("torchtitan_cpu: fully_shard is %s's", "shardkit" if shardkit else "torch")
        disable_division(model)
        for module in model.modules():
            if isinstance(module, tt_fsdp.FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    tt_fsdp.disable_fsdp_gradient_division = disable_division_and_sum


def _keep_timeouts_without_set_timeout() -> None:
    """Keep the process groups' timeouts where torch has no ``torch.distributed.set_timeout``.

    After the first step torchtitan shortens every group's timeout with
    ``torch.distributed.set_timeout``, which torch 2.13 does not have (torchtitan 0.3.0 asks for
    a nightly). The groups then keep the timeout they were made with
    (``--comm.init-timeout-seconds``); only how soon a hang is reported changes.
    """
    if hasattr(torch.distributed, "set_timeout"):
        return
    import torchtitan.distributed.utils as tt_dist_utils

    def keep_timeouts(timeout: Any, parallel_dims: Any) -> None:
        logger.info("torchtitan_cpu: torch has no set_timeout; timeouts stay as initialised")

    tt_dist_utils.set_pg_timeouts = keep_timeouts


def _one_backend_for_offload() -> None:
    """With ``--training.enable_cpu_offload``, ask for gloo once, not for the CPU twice.

    torchtitan adds a ``cpu:gloo`` backend for offloaded state next to the device's
    (``cpu:gloo,cpu:gloo`` here), which torch refuses ("Duplicate device type cpu"); on the CPU
    the device's backend is that one already.
    """
    import torchtitan.distributed.utils as tt_dist_utils

    init_distributed = tt_dist_utils.init_distributed

    def init_on_cpu(comm_config: Any, enable_cpu_backend: bool = False, **kwargs: Any) -> int:
        result: int = init_distributed(comm_config, enable_cpu_backend=False, **kwargs)
        return result

    tt_dist_utils.init_distributed = init_on_cpu


def _pipeline_steps_on_microbatches() -> None:
    """Let torch 2.13's pipeline schedules take the microbatches torchtitan has already split.

    torchtitan 0.3.0 builds its microbatches itself and calls ``schedule.step(arg_mbs=...,
    kwarg_mbs=..., target_mbs=..., losses=..., loss_kwargs=...)`` (a torch nightly's
    signature). torch 2.13's ``step(*args, target=..., **kwargs)`` would take those lists for
    model keyword arguments and split them again. Called so, the schedule now does what its own
    ``step`` does after splitting: it sets up its stages for the iteration and runs
    ``_step_microbatches`` on the given lists. Whole-batch calls go to torch's ``step``.
    """
    from torch.distributed.pipelining import schedules

    for schedule in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        if "arg_mbs" not in inspect.signature(schedule.step).parameters:
            schedule.step = _step_on_microbatches(schedule.step)  # type: ignore[method-assign]


def _step_on_microbatches(whole_batch_step: Any) -> Any:
    """``step`` that also takes ``arg_mbs`` / ``kwarg_mbs`` / ``target_mbs`` lists."""

    def step(
        self: Any,
        *args: Any,
        arg_mbs: list[Any] | None = None,
        kwarg_mbs: list[Any] | None = None,
        target_mbs: list[Any] | None = None,
        losses: list[Any] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return whole_batch_step(
                self,
                *args,
                losses=losses,
                return_outputs=return_outputs,
                loss_kwargs=loss_kwargs,
                **kwargs,
            )
        if args or kwargs:
            raise TypeError("torchtitan_cpu: step() takes a whole batch or microbatches, not both")
        # PipelineScheduleSingle keeps one stage, PipelineScheduleMulti a list.
        stages = self._stages if hasattr(self, "_stages") else [self._stage]
        for stage in stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        self._step_microbatches(
            arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs
        )
        for stage in stages:
            if stage.is_last and return_outputs:
                return self._merge_outputs(stage.output_chunks)
        return None

    return step


def main() -> None:
    """Set the CPU, then run ``torchtitan.train`` with this script's arguments."""
    use_cpu()
    sys.argv = ["torchtitan.train", *sys.argv[1:]]
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
