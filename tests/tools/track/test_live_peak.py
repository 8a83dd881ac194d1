"""LivePeak: the peak of live tensor bytes, the same on real tensors and fake ones."""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from shardkit.tools.track.live_peak import LivePeak


def _work() -> None:
    a = torch.ones(1000)  # 4,000 bytes
    b = a * 2  # 4,000 more: the peak
    del a
    c = b.view(10, 100)  # a view: no new storage
    storage = c.untyped_storage()
    storage.resize_(0)  # an engine frees unsharded parameters this way
    storage.resize_(400)  # and gathers them back


def test_counts_allocations_frees_views_and_resizes() -> None:
    with LivePeak() as live:
        _work()
    assert live.peak == 8000
    assert live.live == 0  # everything made inside is gone


def test_fake_tensors_count_as_real_ones() -> None:
    with FakeTensorMode(), LivePeak() as live:
        _work()
    assert live.peak == 8000


def test_what_exists_at_the_start_counts_from_the_modules_and_optimizers() -> None:
    model = nn.Linear(10, 10)  # 440 bytes of parameters
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 10)).sum().backward()
    optimizer.step()  # two states per parameter, and a step count each
    with LivePeak(model, optimizers=[optimizer]) as live:
        pass
    assert live.peak == 440 + 440 + 2 * 440 + 2 * 4  # parameters, gradients, states, steps
