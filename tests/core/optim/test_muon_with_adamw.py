"""MuonWithAdamW: Muon and AdamW as one optimizer, with the bits of torch's pair.

The oracle is a single process with ``torch.optim.Muon`` on the blocks' matrices and
``torch.optim.AdamW`` on the rest, each with its own scheduler, given the sharded run's reduced
gradients (``muon_runs``). The sharded side is one ``MuonWithAdamW`` with one scheduler, on
both engines. Then its state through DCP's ``get_state_dict`` / ``set_state_dict`` (saved by
``dcp.save`` or ``CheckpointManager``): a run resumed from a checkpoint trains on as the run
that saved it, and a checkpoint with one bad AdamW moment on one rank is refused on every rank
with nothing loaded.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from harness.pool import run_on_ranks
from shardkit.core.checkpoint import CheckpointManager
from shardkit.core.optim import MuonWithAdamW
from tests.core import models
from tests.core.ckpt_helpers import model_values, snapshot
from tests.core.optim import muon_ckpt_runs as ckpt
from tests.core.optim.muon_runs import ADAMW_LR, LR, batch, build, full, shard, step_against

STEPS = 6


def _halving(step: int) -> float:
    return 0.5**step


def _split(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[nn.Parameter]]:
    matrices = [
        (n, p) for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks.")
    ]
    taken = {id(p) for _, p in matrices}
    return matrices, [p for p in model.parameters() if id(p) not in taken]


def _one_object(model: nn.Module) -> MuonWithAdamW:
    matrices, others = _split(model)
    names = {id(p): n for n, p in model.named_parameters()}
    return MuonWithAdamW(
        [
            {"params": matrices, "use_muon": True, "lr": LR},
            {
                "params": [(names[id(p)], p) for p in others],
                "use_muon": False,
                "lr": ADAMW_LR,
                "weight_decay": 0.1,
            },
        ]
    )


def _steps_body(rank: int, world_size: int, impl: str) -> list[bool]:
    reference, sharded = build("gpt"), build("gpt")
    shard(sharded, impl, world_size)
    one = _one_object(sharded)
    matrices, others = _split(reference)
    pair = [
        torch.optim.Muon([p for _, p in matrices], lr=LR),
        torch.optim.AdamW(others, lr=ADAMW_LR, weight_decay=0.1),
    ]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, _halving) for o in (one, *pair)]
    ref_params = dict(reference.named_parameters())
    equal = []
    for step in range(STEPS):
        x, y = batch("gpt", step, rank, world_size)
        models.loss_of("gpt", sharded(x), y).backward()
        equal.append(step_against(sharded, ref_params, [one, *pair])[0])
        for scheduler in schedulers:
            scheduler.step()
    assert one.param_groups[0]["lr"] == pair[0].param_groups[0]["lr"] == LR * 0.5**STEPS
    return equal


@pytest.mark.parametrize("impl", ["shardkit", "torch"])
def test_one_object_with_one_scheduler_steps_as_torchs_pair(impl: str) -> None:
    for rank, equal in enumerate(run_on_ranks(2, _steps_body, impl=impl)):
        assert equal == [True] * STEPS, rank


def _train(model: nn.Module, one: MuonWithAdamW, steps: range, rank: int, world: int) -> None:
    for step in steps:
        ckpt.backward(model, step, rank, world)
        one.step()
        one.zero_grad()


def _through(via: str, path: str, state: dict[str, Any], *, saving: bool) -> None:
    if via == "dcp":
        (dcp_save if saving else dcp_load)(state, checkpoint_id=path)
        return
    with CheckpointManager(path) as manager:
        if saving:
            manager.save(2, state)
        else:
            assert manager.load(state) is not None


def _resume_body(rank: int, world_size: int, impl: str, path: str, via: str) -> dict[str, Any]:
    saved = ckpt.sharded_gpt(impl, world_size)
    one = _one_object(saved)
    _train(saved, one, range(2), rank, world_size)
    model_sd, optim_sd = get_state_dict(saved, one)
    _through(via, path, {"model": model_sd, "optim": optim_sd}, saving=True)
    _train(saved, one, range(2, 5), rank, world_size)

    resumed = ckpt.sharded_gpt(impl, world_size, seed=7)
    again = _one_object(resumed)
    # Copies: DCP would otherwise write into the live state, and the optimizer's own load
    # would go untested.
    model_sd, optim_sd = snapshot(get_state_dict(resumed, again))
    _through(via, path, {"model": model_sd, "optim": optim_sd}, saving=False)
    set_state_dict(resumed, again, model_state_dict=model_sd, optim_state_dict=optim_sd)
    shared = again.state is again.muon.state is again.adamw.state  # type: ignore[union-attr]
    kinds = {tuple(sorted(s)) for s in again.state.values()}
    _train(resumed, again, range(2, 5), rank, world_size)
    ours, theirs = dict(saved.named_parameters()), dict(resumed.named_parameters())
    return {
        "equal": all(torch.equal(full(ours[n]), full(theirs[n])) for n in ours),
        "shared": shared,
        "kinds": sorted(kinds),
    }


@pytest.mark.parametrize(
    ("impl", "via"), [("shardkit", "dcp"), ("torch", "dcp"), ("shardkit", "manager")]
)
def test_a_run_resumed_from_a_checkpoint_trains_on_as_the_run_that_saved(
    impl: str, via: str, tmp_path: Path
) -> None:
    path = str(tmp_path / "ckpt")
    for out in run_on_ranks(2, _resume_body, impl=impl, path=path, via=via):
        assert out["equal"] and out["shared"]
        assert out["kinds"] == [("exp_avg", "exp_avg_sq", "step"), ("momentum_buffer",)]


_BENT = "ln_f.weight"


def _hostile_body(rank: int, world_size: int, path: str, case: str) -> dict[str, Any]:
    import torch.distributed as dist

    model = ckpt.sharded_gpt("shardkit", world_size)
    one = _one_object(model)
    _train(model, one, range(1), rank, world_size)
    model_sd, optim_sd = snapshot(get_state_dict(model, one))
    if case == "nan" and rank == world_size - 1:
        optim_sd["state"][_BENT]["exp_avg_sq"].to_local().view(-1)[0] = float("nan")
    dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    fresh = ckpt.sharded_gpt("shardkit", world_size, seed=7)
    fresh_one = _one_object(fresh)
    model_sd, optim_sd = snapshot(get_state_dict(fresh, fresh_one))
    before = (model_values(fresh), ckpt.optim_values(fresh, [fresh_one]))
    error = ""
    try:
        dcp_load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        if case == "kind":  # the groups saved as the other kind each
            plain = copy.copy(fresh_one.state_dict())
            plain["param_groups"] = [
                {**g, "use_muon": not g["use_muon"]} for g in plain["param_groups"]
            ]
            fresh_one.load_state_dict(plain)
        else:
            set_state_dict(fresh, fresh_one, model_state_dict=model_sd, optim_state_dict=optim_sd)
    except (Exception, CheckpointException) as e:
        error = f"{type(e).__name__}: {e}"
    after = (model_values(fresh), ckpt.optim_values(fresh, [fresh_one]))
    same = all(torch.equal(b[k], a[k]) for b, a in zip(before, after, strict=True) for k in b)
    dist.barrier()
    return {"error": error, "same": same}


@pytest.mark.parametrize("case", ["nan", "kind"])
def test_bad_state_is_refused_on_every_rank_with_nothing_loaded(case: str, tmp_path: Path) -> None:
    outs = run_on_ranks(2, _hostile_body, path=str(tmp_path / "ckpt"), case=case)
    assert all(out["same"] for out in outs)
    assert outs[0]["error"] == outs[1]["error"]
    if case == "nan":
        assert "rank 1: AdamW: ln_f.weight: state 'exp_avg_sq' holds NaN" in outs[0]["error"]
    else:
        assert (
            "parameter group 0 (first parameter blocks.0.attn.qkv.weight) was saved with"
            in (outs[0]["error"])
        )


def test_groups_say_their_optimizer_and_each_is_checked_when_added() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    matrices = [(n, p) for n, p in model.named_parameters() if p.dim() == 2]
    biases = [(n, p) for n, p in model.named_parameters() if p.dim() == 1]
    refused: dict[str, list[dict[str, Any]]] = {
        "no kind": [{"params": matrices}],
        "twice": [{"params": matrices, "use_muon": True}, {"params": matrices, "use_muon": False}],
        "a bias for Muon": [{"params": biases, "use_muon": True}],
        "a negative lr": [{"params": biases, "use_muon": False, "lr": -1.0}],
    }
    messages = {}
    for case, groups in refused.items():
        with pytest.raises(ValueError) as raised:
            MuonWithAdamW(groups)
        messages[case] = str(raised.value)
    assert "needs 'use_muon'" in messages["no kind"]
    assert "more than one parameter group: ['0.weight', '1.weight']" in messages["twice"]
    assert (
        "0.bias" in messages["a bias for Muon"]
        and "give it to AdamW" in messages["a bias for Muon"]
    )
    assert messages["a negative lr"] == "Invalid learning rate: -1.0"
    # Each kind takes its own optimizer's defaults, as torch's two would.
    one = MuonWithAdamW(
        [{"params": matrices, "use_muon": True}, {"params": biases, "use_muon": False}]
    )
    muon, adamw = one.param_groups
    assert (muon["lr"], muon["weight_decay"], muon["momentum"]) == (1e-3, 0.1, 0.95)
    assert (adamw["lr"], adamw["weight_decay"], adamw["betas"]) == (1e-3, 1e-2, (0.9, 0.999))


def _trainer_run(out: Path, steps: int, resume: str | None = None) -> dict[str, torch.Tensor]:
    """A tiny Qwen2 trained by transformers' Trainer with one MuonWithAdamW and a scheduler."""
    from transformers import Trainer, TrainingArguments

    from shardkit.core.optim import split_matrices
    from tests.core.interop.hf_models import tiny_qwen2

    model = tiny_qwen2(seed=0)
    split = split_matrices(model)
    optimizer = MuonWithAdamW(
        [
            {"params": split.matrices, "use_muon": True, "lr": 0.02},
            {"params": split.others, "use_muon": False, "lr": 3e-4},
        ]
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9**step)
    gen = torch.Generator().manual_seed(1)
    data = [
        {
            "input_ids": torch.randint(0, 64, (16,), generator=gen),
            "labels": torch.randint(0, 64, (16,), generator=gen),
        }
        for _ in range(12)
    ]
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        save_strategy="steps",
        save_steps=2,
        seed=0,
        data_seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, scheduler))
    trainer.train(resume_from_checkpoint=resume)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_transformers_trainer_takes_it_and_resumes_it_bit_for_bit(tmp_path: Path) -> None:
    # Trainer takes one optimizer: the pair would not fit. Its checkpoint holds this object's
    # state dict (optimizer.pt), which its resume loads through MuonWithAdamW.load_state_dict.
    straight = _trainer_run(tmp_path / "straight", 5)
    _trainer_run(tmp_path / "stopped", 2)
    resumed = _trainer_run(tmp_path / "stopped", 5, resume=str(tmp_path / "stopped/checkpoint-2"))
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[n], resumed[n]) for n in straight)


def _bent(state_dict: dict[str, Any], case: str) -> dict[str, Any]:
    """A copy of ``state_dict`` made hostile as ``case`` says (AdamW's entry 2, a bias)."""
    bent = copy.deepcopy(state_dict)
    entry = bent["state"][2]
    if case == "truncated":
        bent["param_groups"] = bent["param_groups"][:1]
    elif case == "params not a list":
        bent["param_groups"][1]["params"] = "2,3"
    elif case == "unlisted state":
        bent["state"][99] = entry
    elif case == "missing key":
        del entry["exp_avg_sq"]
    elif case == "moment shape":
        entry["exp_avg"] = torch.zeros(3)
    elif case == "moment dtype":
        entry["exp_avg"] = entry["exp_avg"].double()
    elif case == "step":
        entry["step"] = torch.tensor(float("inf"))
    elif case == "not a mapping":
        bent["state"][2] = [entry["exp_avg"]]
    return bent


_HOSTILE = {
    "truncated": "the state dict has 1 parameter groups, this optimizer has 2",
    "params not a list": "parameter group 1 (first parameter 0.bias): the saved group is not",
    "unlisted state": "state for parameter 99, which none of its parameter groups lists",
    "missing key": "AdamW: 0.bias: its state has keys ['exp_avg', 'step'], AdamW keeps",
    "moment shape": "AdamW: 0.bias: state 'exp_avg' has shape (3,), the parameter (8,)",
    "moment dtype": "AdamW: 0.bias: state 'exp_avg' is torch.float64, the parameter",
    "step": "AdamW: 0.bias: state 'step' is inf, not a finite count of steps",
    "not a mapping": "AdamW: 0.bias: its state is a list, not a mapping",
}


@pytest.mark.parametrize("case", sorted(_HOSTILE))
def test_a_hostile_state_dict_is_refused_by_name_and_nothing_loads(case: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    named = list(model.named_parameters())
    one = MuonWithAdamW(
        [
            {"params": [(n, p) for n, p in named if p.dim() == 2], "use_muon": True},
            {"params": [(n, p) for n, p in named if p.dim() == 1], "use_muon": False},
        ]
    )
    model(torch.ones(3, 4)).sum().backward()
    one.step()
    saved = one.state_dict()
    assert sorted(saved["state"][2]) == ["exp_avg", "exp_avg_sq", "step"]  # 0.bias, AdamW's
    before = copy.deepcopy(saved)
    with pytest.raises((ValueError, TypeError)) as raised:
        one.load_state_dict(_bent(saved, case))
    assert _HOSTILE[case] in str(raised.value)
    after = one.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for index, entry in before["state"].items():
        assert all(torch.equal(v, after["state"][index][k]) for k, v in entry.items())
