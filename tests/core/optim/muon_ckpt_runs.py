"""Muon's state through checkpoints: save sharded, load at another layout, train on bit for bit.

A sharded GPT (Muon on its blocks' matrices, AdamW on the rest) trains ``SAVE_AFTER`` steps
and saves model and optimizers. A fresh model at another world size, or under the other
engine, loads it; so does a single process (plain tensors, ``torch.optim.Muon`` and AdamW),
from the same checkpoint. Both then train on: each step the single process is given the
sharded run's reduced gradients, as in ``muon_runs``, and must hold the sharded run's
parameters bit for bit. A load that missed or bent one value, or a resharded momentum in the
wrong rows, shows as a difference at the first step.

Every run sees the same global batch (``GLOBAL_BATCH`` rows, each rank its slice by rank), so
the reduced gradients differ across world sizes only in summation order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from shardkit.core.checkpoint import CheckpointManager
from tests.core import models
from tests.core.ckpt_helpers import full_tensors, model_values
from tests.core.optim.muon_runs import ADAMW_LR, LR, full, shard, takes_muon

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4
SAVE_AFTER = 2
RESUMED = 8  # steps trained after the load: 10 in all, as issue 83's bit-identity asks

Optimizers = list[torch.optim.Optimizer]


def optimizers(model: nn.Module, *, sharded: bool) -> Optimizers:
    """shardkit's Muon (sharded) or torch's (one process) on the blocks' matrices; AdamW on
    the rest, with weight decay so that both moments and the decay matter."""
    from shardkit.core.optim import Muon

    matrices = [(n, p) for n, p in model.named_parameters() if takes_muon("gpt", n, p)]
    taken = {id(p) for _, p in matrices}
    others = [p for p in model.parameters() if id(p) not in taken]
    muon: torch.optim.Optimizer = (
        Muon(matrices, lr=LR) if sharded else torch.optim.Muon([p for _, p in matrices], lr=LR)
    )
    return [muon, torch.optim.AdamW(others, lr=ADAMW_LR, weight_decay=0.1)]


def sharded_gpt(impl: str, world_size: int, seed: int = 0) -> nn.Module:
    model: nn.Module = models.build("gpt", seed=seed)
    shard(model, impl, world_size)
    return model


def backward(model: nn.Module, step: int, rank: int, world_size: int) -> None:
    """This rank's forward and backward of step ``step``'s global batch."""
    x, y = models.batch("gpt", step, GLOBAL_BATCH)
    x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
    models.loss_of("gpt", model(x), y).backward()


def step_all(opts: Optimizers) -> None:
    for opt in opts:
        opt.step()
        opt.zero_grad()


def optim_values(model: nn.Module, opts: Optimizers) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor, full and plain, keyed ``"<param fqn>.<state key>"``."""
    names = {id(p): name for name, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for opt in opts:
        for param, state in opt.state.items():
            for key, value in full_tensors(dict(state)).items():
                out[f"{names[id(param)]}.{key}"] = value
    return out


def _through(via: str, path: str, state: dict[str, Any], *, saving: bool) -> None:
    """Save ``state`` to ``path`` or load it from there: "dcp" (``dcp.save`` / ``dcp.load``)
    or "manager" (``CheckpointManager``, as step ``SAVE_AFTER`` under ``path``)."""
    if via == "dcp":
        (dcp_save if saving else dcp_load)(state, checkpoint_id=path)
        return
    with CheckpointManager(path) as manager:
        if saving:
            manager.save(SAVE_AFTER, state)
        else:
            assert manager.load(state) is not None, f"no checkpoint under {path}"


def save(model: nn.Module, opts: Optimizers, path: str, via: str) -> None:
    """Save model and optimizers to ``path`` (see :func:`_through`)."""
    model_sd, optim_sd = get_state_dict(model, opts)
    _through(via, path, {"model": model_sd, "optim": optim_sd}, saving=True)


def load(model: nn.Module, opts: Optimizers, path: str, via: str) -> None:
    """Load what :func:`save` wrote into a fresh ``model`` and ``opts`` (their state made by
    ``get_state_dict``, as DCP needs, then overwritten)."""
    model_sd, optim_sd = get_state_dict(model, opts)
    _through(via, path, {"model": model_sd, "optim": optim_sd}, saving=False)
    set_state_dict(model, opts, model_state_dict=model_sd, optim_state_dict=optim_sd)


def save_body(rank: int, world_size: int, impl: str, path: str, via: str) -> dict[str, Any]:
    """Train ``SAVE_AFTER`` steps sharded by ``impl``, save; the full values saved."""
    model = sharded_gpt(impl, world_size)
    opts = optimizers(model, sharded=True)
    for step in range(SAVE_AFTER):
        backward(model, step, rank, world_size)
        step_all(opts)
    save(model, opts, path, via)
    return {"model": model_values(model), "optim": optim_values(model, opts)}


def resume_body(rank: int, world_size: int, impl: str, path: str, via: str) -> dict[str, Any]:
    """Load ``path`` sharded by ``impl`` and into a single process, train both on.

    Returns the full values as loaded (sharded side), whether the state is sharded like the
    parameters, and per resumed step whether the two sides hold equal parameters bitwise.
    """
    model = sharded_gpt(impl, world_size, seed=7)  # another seed: a missed value shows
    opts = optimizers(model, sharded=True)
    load(model, opts, path, via)
    loaded = {"model": model_values(model), "optim": optim_values(model, opts)}
    reference: nn.Module = models.build("gpt", seed=9)
    ref_opts = optimizers(reference, sharded=False)
    load(reference, ref_opts, path, via)
    ref_loaded = optim_values(reference, ref_opts)
    ref_params = dict(reference.named_parameters())
    equal: list[bool] = []
    for step in range(SAVE_AFTER, SAVE_AFTER + RESUMED):
        backward(model, step, rank, world_size)
        for name, p in model.named_parameters():
            ref_params[name].grad = None if p.grad is None else full(p.grad)
        step_all(opts)
        step_all(ref_opts)
        equal.append(
            all(torch.equal(full(p), ref_params[n].detach()) for n, p in model.named_parameters())
        )
    momentum = [s["momentum_buffer"] for s in opts[0].state.values()]
    return {
        **loaded,
        "equal": equal,
        "ref_loaded": ref_loaded,
        "momentum_kinds": {type(m).__name__ for m in momentum},
    }


HOSTILE_PARAM = "blocks.0.attn.qkv.weight"


def _bend(optim_sd: dict[str, Any], case: str) -> None:
    """Make the saved momentum of ``HOSTILE_PARAM`` hostile: another shape, or a NaN in the
    last rank's rows only."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    state = optim_sd["state"][HOSTILE_PARAM]
    buf = state["momentum_buffer"]
    assert isinstance(buf, DTensor)
    if case == "shape":
        state["momentum_buffer"] = distribute_tensor(
            torch.zeros(8, buf.size(1)), buf.device_mesh, [Shard(0)]
        )
    elif dist.get_rank() == dist.get_world_size() - 1:
        buf.to_local().view(-1)[0] = float("nan")


def hostile_body(rank: int, world_size: int, path: str, case: str) -> dict[str, Any]:
    """Save a checkpoint whose Muon state is bent by ``case``; load it into a fresh model.

    The load goes into copies of the state dicts (``snapshot``), as the guide says: DCP writes
    in place, so only then is nothing live touched when ``set_state_dict`` refuses. Returns
    the error each rank raised and whether the live model and optimizers are as they were.
    """
    from tests.core.ckpt_helpers import snapshot

    model = sharded_gpt("shardkit", world_size)
    opts = optimizers(model, sharded=True)
    backward(model, 0, rank, world_size)
    step_all(opts)
    model_sd, optim_sd = get_state_dict(model, opts)
    optim_sd = snapshot(optim_sd)
    _bend(optim_sd, case)
    dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    fresh = sharded_gpt("shardkit", world_size, seed=7)
    fresh_opts = optimizers(fresh, sharded=True)
    model_sd, optim_sd = snapshot(get_state_dict(fresh, fresh_opts))
    before = {"model": model_values(fresh), "optim": optim_values(fresh, fresh_opts)}
    error = ""
    try:
        dcp_load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        set_state_dict(fresh, fresh_opts, model_state_dict=model_sd, optim_state_dict=optim_sd)
    except (Exception, CheckpointException) as e:  # DCP's (not an Exception), or Muon's
        error = f"{type(e).__name__}: {e}"
    after = {"model": model_values(fresh), "optim": optim_values(fresh, fresh_opts)}
    same = all(
        torch.equal(before[part][k], after[part][k]) for part in before for k in before[part]
    )
    return {"error": error, "same": same}


def full_state_body(
    rank: int, world_size: int, impl: str, broadcast: bool = False, copy: bool = True
) -> dict[str, Any]:
    """Muon's state as full tensors (``StateDictOptions(full_state_dict=True)``), loaded back
    into fresh sharded optimizers, then one more step on the run that saved (the uninterrupted
    run) and on the one that loaded.

    Returns the kinds of the saved tensors, Muon's parameter names, and the names of the
    values (parameters, buffers, ``"<name>.<state key>"``) that differ between the two runs
    right after the load and after the step.

    ``broadcast``: loaded with ``broadcast_from_rank0=True``, only rank 0 holding the state
    dicts (the other ranks pass empty ones), as a job loading a consolidated file does.
    ``copy``: load copies of the state dicts, as a file holds them, rather than what
    ``get_state_dict`` returned: that keeps each AdamW "step" the saving run's live 0-dim
    tensor (only DTensors are gathered anew), torch's ``set_state_dict`` and
    ``Optimizer.load_state_dict`` pass it on as it is, and AdamW adds to it in place, so the
    saving run's next step also advances the loaded run's counter.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from tests.core.ckpt_helpers import snapshot

    model = sharded_gpt(impl, world_size)
    opts = optimizers(model, sharded=True)
    backward(model, 0, rank, world_size)
    step_all(opts)
    options = StateDictOptions(full_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, opts, options=options)
    if copy:
        model_sd, optim_sd = snapshot((model_sd, optim_sd))
    state: dict[str, dict[str, Any]] = optim_sd["state"]  # type: ignore[assignment]
    kinds = {type(v).__name__ for s in state.values() for v in s.values()}
    fresh = sharded_gpt(impl, world_size, seed=7)
    fresh_opts = optimizers(fresh, sharded=True)
    if broadcast:
        # torch's set_state_dict takes an empty model dict as "optimizers only" (it skips the
        # model where rank 0 broadcasts it: a hang), so the two are loaded one after the other.
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        if rank != 0:
            model_sd, optim_sd = {}, {}
        set_model_state_dict(fresh, model_sd, options=options)
        set_optimizer_state_dict(fresh, fresh_opts, optim_sd, options=options)
    else:
        set_state_dict(
            fresh, fresh_opts, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options
        )
    differ_loaded = _differing(model, opts, fresh, fresh_opts)
    for run, run_opts in ((model, opts), (fresh, fresh_opts)):
        backward(run, 1, rank, world_size)
        step_all(run_opts)
    muon_params = {id(p) for group in opts[0].param_groups for p in group["params"]}
    return {
        "kinds": kinds,
        "muon_names": {n for n, p in model.named_parameters() if id(p) in muon_params},
        "differ_loaded": differ_loaded,
        "differ_after_a_step": _differing(model, opts, fresh, fresh_opts),
    }


def _differing(
    model: nn.Module, opts: Optimizers, other: nn.Module, other_opts: Optimizers
) -> list[str]:
    """The names of the parameters, buffers and optimizer state values (``"<name>.<key>"``)
    that are not bitwise equal in two runs, or that one run lacks."""
    ours = {**model_values(model), **optim_values(model, opts)}
    theirs = {**model_values(other), **optim_values(other, other_opts)}
    return sorted(
        k
        for k in ours.keys() | theirs.keys()
        if k not in ours or k not in theirs or not torch.equal(ours[k], theirs[k])
    )
