"""Muon's elementwise parts over many matrices at once keep each matrix's bits.

``MUON_RULE.prepare_all`` and ``apply_all`` run the momentum, the nesterov blend, the bf16
cast, the weight decay and the add as foreach operators (five a step, not five a matrix: each
a launch on a GPU). Each tensor must get what the per-matrix ``prepare`` and ``apply``, torch's
Muon's own operations, give it: fp32, bf16 and fp16 parameters, the layouts the exchange hands
back (contiguous rows, a tall update's transposed layout, a column block's slice), odd sizes,
every ``adjust_lr_fn``, and a rank that holds none of a matrix (empty rows). The path is shut
by default (``muon._FOREACH_DEVICES``: slower on the CPU, unchecked on CUDA): opened here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardkit.core.optim import muon

_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rows, cols) of this rank's block, and the whole matrix's shape (the adjusted lr's).
_BLOCKS = [((64, 32), (128, 32)), ((32, 64), (64, 64)), ((7, 5), (7, 5)), ((0, 48), (8, 48)),
           ((16, 48), (48, 16)), ((24, 40), (24, 40))]  # fmt: skip


@pytest.fixture(autouse=True)
def _foreach_open_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(muon, "_FOREACH_DEVICES", frozenset({"cpu"}))


def _options(**changes: Any) -> dict[str, Any]:
    options = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True,
               "adjust_lr_fn": None}  # fmt: skip
    options.update(changes)
    return options


def _update_rows(block: tuple[int, int], whole: tuple[int, int], index: int) -> torch.Tensor:
    """A bf16 update block in one of the layouts the exchange hands back."""
    rows = torch.randn(block, dtype=torch.float32).bfloat16()
    if index % 3 == 1 and whole[0] > whole[1]:
        return rows.mT.contiguous().mT  # a tall matrix's update as Newton-Schulz returns it
    if index % 3 == 2 and block[1] > 1:
        wide = torch.randn((block[0], block[1] * 2)).bfloat16()
        return wide[:, : block[1]]  # a column block's slice: not contiguous
    return rows


@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"nesterov": False},
        {"adjust_lr_fn": "original"},
        {"adjust_lr_fn": "match_rms_adamw"},
        {"weight_decay": 0.0},
        {"momentum": 0.5, "lr": 3e-4},
    ],
)
def test_the_list_forms_keep_each_matrix_bits(dtype: torch.dtype, changes: dict[str, Any]) -> None:
    torch.manual_seed(0)
    options = _options(**changes)
    params = [torch.randn(block).to(dtype) for block, _ in _BLOCKS]
    grads = [torch.randn(block).to(dtype) for block, _ in _BLOCKS]
    bufs = [torch.randn(block).to(dtype) for block, _ in _BLOCKS]
    updates = [_update_rows(block, whole, i) for i, (block, whole) in enumerate(_BLOCKS)]
    shapes = [whole for _, whole in _BLOCKS]

    one_states = [{"momentum_buffer": b.clone()} for b in bufs]
    all_states = [{"momentum_buffer": b.clone()} for b in bufs]
    triples = zip(params, grads, one_states, strict=True)
    one = [muon._prepare(p, g, s, options) for p, g, s in triples]
    together = muon._prepare_all(params, grads, all_states, options)
    for i in range(len(_BLOCKS)):
        assert torch.equal(one[i], together[i]) and one[i].dtype == together[i].dtype, i
        assert torch.equal(one_states[i]["momentum_buffer"], all_states[i]["momentum_buffer"])

    one_params = [p.clone() for p in params]
    all_params = [p.clone() for p in params]
    for p, u, shape in zip(one_params, updates, shapes, strict=True):
        muon._apply(p, u, options, shape)
    muon._apply_all(all_params, updates, options, shapes)
    for i in range(len(_BLOCKS)):
        assert torch.equal(one_params[i], all_params[i]), (i, dtype)


def test_foreach_runs_only_where_it_keeps_the_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardkit.tools.track.ops import OpCounter

    params = [torch.randn(8, 4) for _ in range(3)]
    updates = [torch.randn(8, 4).bfloat16() for _ in range(3)]
    with OpCounter() as ops:
        muon._apply_all(params, updates, _options(), [(8, 4)] * 3)
    assert ops.by_op["aten._foreach_add_"] == 1 and ops.by_op["aten.add_"] == 0
    monkeypatch.setattr(muon, "_FOREACH_DEVICES", frozenset())  # shut: the default
    with OpCounter() as ops:
        muon._apply_all(params, updates, _options(), [(8, 4)] * 3)
    assert ops.by_op["aten._foreach_add_"] == 0 and ops.by_op["aten.add_"] == 3
    with OpCounter() as ops:  # a tensor lr: one at a time, as torch's Muon takes it
        muon._apply_all(params, updates, _options(lr=torch.tensor(0.02)), [(8, 4)] * 3)
    assert ops.by_op["aten.add_"] == 3
