"""A delta staged as its changes: written in place at the commit, all of it or none.

``ModuleReceiver`` (all or nothing, the default) stages a delta's changes as they came
(positions, values, steps) and writes them into the module's tensors at the commit, keeping
the old values at those positions until every write went through; before, it staged a whole
new copy of every tensor a delta touched (nearly all of them: an optimizer step moves a few
percent of every tensor's elements). Tied tensors staged under two names still take whole
copies (steps written twice in place would be added twice).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from harness.allocations import allocated_peak
from shardkit.core.errors import WeightLoadError
from shardkit.core.export import ModuleReceiver
from shardkit.core.export.messages import (
    ChangedElements,
    ExportedTensor,
    ExportManifest,
    WeightBucket,
)
from tests.core.export.dispatch_counts import CountKernels


def _module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024, bias=False), nn.Linear(1024, 8, bias=False)).to(
        torch.bfloat16
    )


def _manifest(module: nn.Module, export_id: int) -> ExportManifest:
    entries = tuple(
        ExportedTensor(n, tuple(t.shape), t.dtype, 0) for n, t in module.state_dict().items()
    )
    return ExportManifest(export_id, "delta", entries, 1)


def _changes(tensor: torch.Tensor, every: int, seed: int) -> ChangedElements:
    """Every ``every``-th element: half of them new values, half one-unit steps of the bits."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.arange(0, tensor.numel(), every)
    values_at, stepped = positions[0::2], positions[1::2]
    values = torch.randn(values_at.numel(), generator=gen).to(tensor.dtype)
    steps = torch.randint(-3, 4, (stepped.numel(),), generator=gen, dtype=torch.int8)
    return ChangedElements(values_at, values, stepped, steps)


def _expected(module: nn.Module, changes: dict[str, ChangedElements]) -> dict[str, torch.Tensor]:
    state = {n: t.clone() for n, t in module.state_dict().items()}
    for name, changed in changes.items():
        changed.apply_to(state[name])
    return state


class _FailingMidway(ChangedElements):
    """Changes whose write raises after writing them (a fault partway through a commit)."""

    def apply_to(self, full: torch.Tensor) -> None:
        ChangedElements.apply_to(self, full)
        raise RuntimeError("the write failed partway")


def test_a_staged_delta_holds_its_changes_and_commits_them_in_place() -> None:
    module = _module()
    receiver = ModuleReceiver(module)
    receiver.version = 0  # holds export 0 (the delta's base)
    changes = {n: _changes(t, 64, i) for i, (n, t) in enumerate(module.state_dict().items())}
    expected = _expected(module, changes)
    before = {n: t.clone() for n, t in module.state_dict().items()}
    receiver.begin(_manifest(module, 1))
    bucket = WeightBucket(0, changed=tuple(changes.items()))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        receiver.receive(bucket)
    model_bytes = sum(t.nbytes for t in before.values())
    # Before: a new copy of each tensor it touched, the model's bytes. Now: nothing that size.
    assert allocated_peak(prof) < model_bytes // 8, (allocated_peak(prof), model_bytes)
    assert all(torch.equal(before[n], t) for n, t in module.state_dict().items())  # staged only
    receiver.commit()
    assert receiver.version == 1
    assert all(torch.equal(expected[n], t) for n, t in module.state_dict().items())


def test_staged_changes_do_not_depend_on_the_buffer_they_came_in() -> None:
    # A transport's bucket views its buffer only while it is handed over (the shared-memory
    # transport reuses two segments in turn): changes kept by reference until the commit
    # wrote what a later bucket left there (found by the slow shared-memory test: an
    # embedding's elements wrong after a delta of five buckets).
    module = _module()
    receiver = ModuleReceiver(module)
    receiver.version = 0
    changes = {n: _changes(t, 64, i) for i, (n, t) in enumerate(module.state_dict().items())}
    expected = _expected(module, changes)
    receiver.begin(_manifest(module, 1))
    receiver.receive(WeightBucket(0, changed=tuple(changes.items())))
    for changed in changes.values():  # the buffer reused by the next bucket
        changed.indices.fill_(0)
        changed.values.fill_(7.0)
        assert changed.steps is not None
        changed.steps.fill_(1)
    receiver.commit()
    assert all(torch.equal(expected[n], t) for n, t in module.state_dict().items())


def test_a_commit_whose_write_raises_partway_puts_every_tensor_back() -> None:
    module = _module()
    receiver = ModuleReceiver(module)
    receiver.version = 0
    (first, a), (second, b) = module.state_dict().items()
    good = _changes(a, 16, 1)
    fields = _changes(b, 16, 2)
    failing = _FailingMidway(fields.indices, fields.values, fields.stepped, fields.steps)
    before = {n: t.clone() for n, t in module.state_dict().items()}
    receiver.begin(_manifest(module, 1))
    receiver.receive(WeightBucket(0, changed=((first, good), (second, failing))))
    with pytest.raises(RuntimeError, match="partway"):
        receiver.commit()
    # The first tensor's changes and the second's own partial write: both undone, bit for bit.
    assert all(torch.equal(before[n], t) for n, t in module.state_dict().items())


def test_changes_that_do_not_fit_are_refused_when_staged_nothing_written() -> None:
    module = _module()
    receiver = ModuleReceiver(module)
    receiver.version = 0
    name, tensor = next(iter(module.state_dict().items()))
    outside = ChangedElements(torch.tensor([0, tensor.numel()]), torch.zeros(2, dtype=tensor.dtype))
    before = tensor.clone()
    receiver.begin(_manifest(module, 1))
    with pytest.raises(WeightLoadError, match=f"{name}: the changes do not fit the tensor"):
        receiver.receive(WeightBucket(0, changed=((name, outside),)))
    assert torch.equal(module.state_dict()[name], before)


def test_a_buckets_changes_are_checked_at_once_every_misfit_named() -> None:
    """The positions' bounds of every tensor of a bucket read back in one go, not one number at
    a time (on a GPU each read waits for the device; checked tensor by tensor, a 150M model's
    delta read 568 numbers alone), and each tensor that cannot take its changes named, nothing
    staged."""
    module = nn.Sequential(*(nn.Linear(16, 16, bias=False) for _ in range(12))).to(torch.bfloat16)
    state = module.state_dict()
    changes = {n: _changes(t, 5, i) for i, (n, t) in enumerate(state.items())}
    expected = _expected(module, changes)
    receiver = ModuleReceiver(module)
    receiver.version = 0
    receiver.begin(_manifest(module, 1))
    with CountKernels() as counted:  # type: ignore[no-untyped-call]
        receiver.receive(WeightBucket(0, changed=tuple(changes.items())))
    assert counted.reads == 0  # was 4 a tensor: 48
    receiver.commit()
    assert all(torch.equal(expected[n], t) for n, t in module.state_dict().items())

    names = list(state)
    bad = {
        names[3]: ChangedElements(torch.tensor([0, 256]), torch.zeros(2, dtype=torch.bfloat16)),
        names[7]: ChangedElements(torch.tensor([-1]), torch.zeros(1, dtype=torch.bfloat16)),
    }
    before = {n: t.clone() for n, t in module.state_dict().items()}
    receiver.begin(_manifest(module, 2))
    with pytest.raises(WeightLoadError) as raised:
        receiver.receive(WeightBucket(0, changed=((names[0], changes[names[0]]), *bad.items())))
    for name in bad:
        assert f"{name}: the changes do not fit the tensor" in str(raised.value)
    assert names[0] not in str(raised.value)
    assert all(torch.equal(before[n], t) for n, t in module.state_dict().items())


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight  # one storage, two names


def test_a_tied_tensor_sent_under_both_names_takes_its_steps_once() -> None:
    torch.manual_seed(0)
    module = _Tied().to(torch.bfloat16)
    receiver = ModuleReceiver(module)
    receiver.version = 0
    weight = module.embed.weight.detach()
    changes = _changes(weight, 8, 3)
    expected = weight.clone()
    changes.apply_to(expected)
    entries = tuple(
        ExportedTensor(n, tuple(weight.shape), weight.dtype, 0)
        for n in ("embed.weight", "head.weight")
    )
    receiver.begin(ExportManifest(1, "delta", entries, 1))
    receiver.receive(WeightBucket(0, changed=(("embed.weight", changes), ("head.weight", changes))))
    receiver.commit()
    assert torch.equal(module.embed.weight.detach(), expected)
    assert module.head.weight is module.embed.weight
