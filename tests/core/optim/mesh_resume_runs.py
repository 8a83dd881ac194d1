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
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from shardkit.core.optim import split_matrices
from tests.core.ckpt_helpers import model_values
from tests.core.optim.model_runs import SEQ, VOCAB, Case, _head, _loss, _optimizers, build, place
from tests.core.optim.muon_ckpt_runs import optim_values, step_all
from tests.core.optim.muon_runs import ADAMW_LR, LR, step_against

SAVE_AFTER = 2
RESUMED = 8  # 10 steps in all, as issue 83's bit-identity asks


def _backward(model: nn.Module, step: int, dp_rank: int, dp_size: int) -> None:
    """This data-parallel rank's rows of step ``step``'s batch (2 rows a rank), backward."""
    gen = torch.Generator().manual_seed(4000 + step)
    tokens = torch.randint(0, VOCAB, (2 * dp_size, SEQ + 1), generator=gen)
    rows = tokens.chunk(dp_size)[dp_rank]
    _loss(model, rows[:, :-1], rows[:, 1:]).backward()


def _single_process_optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    """torch's Muon on the matrices, AdamW on the rest: what a checkpoint's keys load into."""
    split = split_matrices(model, head=_head(model), stacks=True)
    return [
        torch.optim.Muon([p for _, p in split.matrices], lr=LR),
        torch.optim.AdamW([p for _, p in split.others], lr=ADAMW_LR, weight_decay=0.1),
    ]


def _values(model: nn.Module, opts: list[Any]) -> dict[str, dict[str, torch.Tensor]]:
    return {"model": model_values(model), "optim": optim_values(model, opts)}


def _through(model: nn.Module, opts: list[Any], path: str, *, saving: bool) -> None:
    model_sd, optim_sd = get_state_dict(model, opts)
    state = {"model": model_sd, "optim": optim_sd}
    if saving:
        dcp_save(state, checkpoint_id=path)
        return
    dcp_load(state, checkpoint_id=path)
    set_state_dict(model, opts, model_state_dict=model_sd, optim_state_dict=optim_sd)


def save_body(rank: int, world_size: int, *, model_name: str, path: str) -> dict[str, Any]:
    """``SAVE_AFTER`` steps on shardkit's FSDP at this world size, then a DCP save; the full
    values saved."""
    model = build(model_name)
    dp_rank, dp_size = place(Case(model=model_name), model, "shardkit", world_size)
    opts, _ = _optimizers(model, placed=True)
    for step in range(SAVE_AFTER):
        _backward(model, step, dp_rank, dp_size)
        step_all(opts)
    _through(model, opts, path, saving=True)
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
    _through(model, opts, path, saving=False)
    loaded = _values(model, opts)
    reference = build(case.model)
    ref_opts = _single_process_optimizers(reference)
    _through(reference, ref_opts, path, saving=False)
    ref_loaded = _values(reference, ref_opts)
    ref_params = dict(reference.named_parameters())
    equal, max_diff = [], []
    for step in range(SAVE_AFTER, SAVE_AFTER + RESUMED):
        _backward(model, step, dp_rank, dp_size)
        same, diff = step_against(model, ref_params, [*opts, *ref_opts])
        equal.append(same)
        max_diff.append(diff)
    return {"loaded": loaded, "ref_loaded": ref_loaded, "equal": equal, "max_diff": max_diff}
