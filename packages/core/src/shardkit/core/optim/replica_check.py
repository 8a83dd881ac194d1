"""Ranks said to hold the same matrices do: checked once, before a step first trusts them.

``replicated_over`` (an argument of the whole-matrix optimizers) is the user's word that every
rank of that mesh holds the same values of the parameters its placements leave off it, and
computes the same gradients for them: under FSDP x TP, the matrices no TP style cuts. The step
then takes one copy of each such matrix to its owner and sends the update to every holder, so a
rank whose values differed would be overwritten without a word. The first step that meets such
a parameter compares its values and its gradient across those ranks, before any state changes:
two collectives once (the count, then two float64 checksums of each tensor), and every rank
raises the same error where they differ, naming the parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardkit.core.runtime.dtensors import local_of
from shardkit.core.runtime.flat_collectives import all_gather_single

__all__ = ["check_replicas"]


def check_replicas(params: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup) -> None:
    """Refuse, on every rank of ``group``, parameters or gradients that differ across it.

    Args:
        params: (name, parameter) of each parameter to check, with its gradient, in the same
            order on every rank of ``group``.
        group: the ranks said to hold the same values.

    Raises:
        ValueError: the ranks check different numbers of parameters, or one differs; the
            same on every rank.
    """
    device = _local(params[0][1]).device if params else torch.device("cpu")
    count = torch.tensor([len(params)], dtype=torch.int64, device=device)
    counts = _gathered(count, group)
    if len({int(c.item()) for c in counts}) > 1:
        raise ValueError(
            "replicated_over: its ranks step different numbers of the parameters it is said "
            f"to replicate ({[int(c.item()) for c in counts]}); they must be one program's"
        )
    if not params:
        return
    sums = torch.stack([s for _, p in params for s in _checksums(p)])
    found = _gathered(sums, group)
    for i, (name, _) in enumerate(params):
        mine = [f[4 * i : 4 * i + 4].view(torch.int64).tolist() for f in found]
        differing = [r for r, m in enumerate(mine) if m != mine[0]]
        if differing:
            what = "values" if any(m[:2] != mine[0][:2] for m in mine) else "gradients"
            raise ValueError(
                f"{name}: its {what} differ across replicated_over's ranks (group ranks 0 and "
                f"{differing}); replicated_over says they hold the same, so one update would "
                "overwrite the others. Leave out replicated_over, or make the ranks agree "
                "(the same seed, the same batch on every rank of that axis)"
            )


def _checksums(param: torch.Tensor) -> list[torch.Tensor]:
    """Two float64 sums of the parameter's local tensor and two of its gradient's.

    A plain sum, then one weighted by position, so that elements moved show too.
    """
    grad = param.grad
    assert grad is not None, "only parameters with gradients are stepped"
    found = []
    for tensor in (_local(param), _local(grad)):
        flat = tensor.detach().reshape(-1).double()
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
        found += [flat.sum(), (flat * weights).sum()]
    return found


def _gathered(tensor: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Every group rank's ``tensor`` (1-D), in group-rank order."""
    found = tensor.new_empty((group.size() * tensor.numel(),))
    all_gather_single(found, tensor, group=group)
    return list(found.chunk(group.size()))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return local_of(tensor) if isinstance(tensor, DTensor) else tensor
