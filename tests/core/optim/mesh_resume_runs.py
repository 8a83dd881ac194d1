"""Muon's state through a checkpoint into HSDP and FSDP x TP meshes, bit for bit after it.

The demo's GPT or a transformers Qwen2 (``model_runs``) trains ``SAVE_AFTER`` steps on FSDP
at W=2 and saves model and optimizers with DCP. At W=4 a fresh model placed on HSDP 2 x 2 or
on FSDP x TP 2 x 2 (either engine) loads it, and so does a single process (plain tensors,
``torch.optim.Muon`` and AdamW) from the same files. Both train on ``RESUMED`` steps: each
step the single process is given the placed run's reduced gradients, and the parameters must
stay equal bit for bit. The loaded values come back too, to be compared with what was saved:
a value the load missed (the placed model starts from other values) or a momentum resharded
into the wrong rows shows there, or at the first step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardkit.core.optim import split_matrices
from tests.core.ckpt_helpers import model_values
from tests.core.optim.model_runs import Case, _head, _optimizers, backward, build, place
from tests.core.optim.muon_ckpt_runs import load, optim_values, save, step_all
from tests.core.optim.muon_runs import ADAMW_LR, LR, step_against

SAVE_AFTER = 2
RESUMED = 8  # 10 steps in all, as issue 83's bit-identity asks


def _single_process_optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    """torch's Muon on the matrices, AdamW on the rest: what a checkpoint's keys load into."""
    split = split_matrices(model, head=_head(model), stacks=True)
    return [
        torch.optim.Muon([p for _, p in split.matrices], lr=LR),
        torch.optim.AdamW([p for _, p in split.others], lr=ADAMW_LR, weight_decay=0.1),
    ]


def _values(model: nn.Module, opts: list[Any]) -> dict[str, dict[str, torch.Tensor]]:
    return {"model": model_values(model), "optim": optim_values(model, opts)}


def save_body(rank: int, world_size: int, *, model_name: str, path: str) -> dict[str, Any]:
    """``SAVE_AFTER`` steps on shardkit's FSDP at this world size, then a DCP save; the full
    values saved."""
    model = build(model_name)
    case = Case(model=model_name)
    dp_rank, dp_size = place(case, model, "shardkit", world_size)
    opts, _ = _optimizers(model, placed=True)
    for step in range(SAVE_AFTER):
        backward(model, case, step, dp_rank, dp_size)
        step_all(opts)
    save(model, opts, path, "dcp")
    return _values(model, opts)


def resume_body(rank: int, world_size: int, *, impl: str, case: Case, path: str) -> dict[str, Any]:
    """Load ``path`` into ``case``'s placement (engine ``impl``) and into a single process;
    ``RESUMED`` steps of both. The placed side's loaded values, the single process's, and per
    step whether every parameter is bitwise equal on both sides (with the largest difference).
    """
    model = build(case.model)
    dp_rank, dp_size = place(case, model, impl, world_size)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.5)  # not the saved values: a value the load missed shows
    opts, _ = _optimizers(model, placed=True)
    load(model, opts, path, "dcp")
    loaded = _values(model, opts)
    reference = build(case.model)
    ref_opts = _single_process_optimizers(reference)
    load(reference, ref_opts, path, "dcp")
    ref_loaded = _values(reference, ref_opts)
    ref_params = dict(reference.named_parameters())
    equal, max_diff = [], []
    for step in range(SAVE_AFTER, SAVE_AFTER + RESUMED):
        backward(model, case, step, dp_rank, dp_size)
        same, diff = step_against(model, ref_params, [*opts, *ref_opts])
        equal.append(same)
        max_diff.append(diff)
    return {"loaded": loaded, "ref_loaded": ref_loaded, "equal": equal, "max_diff": max_diff}
