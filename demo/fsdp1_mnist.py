"""FSDP1's "getting started" MNIST tutorial, in its shape, on a synthetic MNIST-sized set.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 demo/fsdp1_mnist.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 demo/fsdp1_mnist.py --fsdp torch

The script is written as the tutorial's readers write it: the FSDP1 names come from three
imports (the wrapper, ``fully_sharded_data_parallel``'s configs, ``wrap``'s policies) and
nothing else refers to the library. ``fsdp_names(impl)`` does those three imports from torch
or from shardkit.legacy with the module paths changed and nothing else, so a run with
``impl="shardkit"`` is the tutorial with its imports swapped. The data is synthetic (the
tutorial downloads MNIST); the model, the loss, the optimizer, the schedule, the sampler and
the per-epoch train and test passes are the tutorial's.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

PACKAGES = {"torch": "torch.distributed.fsdp", "shardkit": "shardkit.legacy"}


def fsdp_names(impl: str) -> SimpleNamespace:
    """The tutorial's three FSDP1 imports, from ``impl``'s package path."""
    package = PACKAGES[impl]
    fsdp = importlib.import_module(package).FullyShardedDataParallel
    configs = importlib.import_module(f"{package}.fully_sharded_data_parallel")
    wrap = importlib.import_module(f"{package}.wrap")
    return SimpleNamespace(
        FSDP=fsdp,
        CPUOffload=configs.CPUOffload,
        BackwardPrefetch=configs.BackwardPrefetch,
        size_based_auto_wrap_policy=wrap.size_based_auto_wrap_policy,
        enable_wrap=wrap.enable_wrap,
        wrap=wrap.wrap,
    )


class Net(nn.Module):
    """The tutorial's CNN (two convolutions, dropout, two linear layers); ``width`` scales it."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, 1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(2 * width * 12 * 12, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


@dataclass(kw_only=True)
class Args:
    """The tutorial's command-line arguments that matter here."""

    impl: str = "shardkit"
    optimizer: str = "adadelta"  # the tutorial's; the others check each optimizer's path
    lr: float = 1.0
    gamma: float = 0.7
    epochs: int = 2
    batch_size: int = 32
    test_batch_size: int = 64
    width: int = 32
    train_size: int = 256
    test_size: int = 128
    manual_wrap: bool = False  # enable_wrap + wrap instead of the size-based policy


OPTIMIZERS: dict[str, Any] = {
    "adadelta": torch.optim.Adadelta,
    "sgd": functools.partial(torch.optim.SGD, momentum=0.9),
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "adagrad": torch.optim.Adagrad,
    "rmsprop": torch.optim.RMSprop,
}


def _datasets(args: Args) -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(3)
    images = torch.randn(args.train_size + args.test_size, 1, 28, 28, generator=g)
    labels = torch.randint(0, 10, (args.train_size + args.test_size,), generator=g)
    n = args.train_size
    return TensorDataset(images[:n], labels[:n]), TensorDataset(images[n:], labels[n:])


def _build(args: Args, names: SimpleNamespace) -> nn.Module:
    if not args.manual_wrap:
        policy = functools.partial(names.size_based_auto_wrap_policy, min_num_params=100)
        model: nn.Module = names.FSDP(
            Net(args.width), auto_wrap_policy=policy, device_id=torch.device("cpu")
        )
        return model
    with names.enable_wrap(wrapper_cls=names.FSDP, device_id=torch.device("cpu")):
        model = Net(args.width)
        model.conv2 = names.wrap(model.conv2)
        model.fc1 = names.wrap(model.fc1)
        wrapped: nn.Module = names.wrap(model)
        return wrapped


def _train_epoch(model: nn.Module, loader: DataLoader[Any], opt: torch.optim.Optimizer) -> float:
    model.train()
    totals = torch.zeros(2)
    for data, target in loader:
        opt.zero_grad()
        loss = F.nll_loss(model(data), target, reduction="sum")
        loss.backward()
        opt.step()
        totals += torch.tensor([loss.item(), len(data)])
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def _test_epoch(model: nn.Module, loader: DataLoader[Any]) -> float:
    model.eval()
    totals = torch.zeros(2)
    with torch.no_grad():
        for data, target in loader:
            loss = F.nll_loss(model(data), target, reduction="sum")
            totals += torch.tensor([loss.item(), len(data)])
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def fsdp_main(args: Args) -> list[float]:
    """Train as the tutorial does; the train and test loss of every epoch, in turn."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    names = fsdp_names(args.impl)
    torch.manual_seed(1)
    train_set, test_set = _datasets(args)
    train_sampler: DistributedSampler[Any] = DistributedSampler(
        train_set, rank=rank, num_replicas=world_size, shuffle=True
    )
    test_sampler: DistributedSampler[Any] = DistributedSampler(
        test_set, rank=rank, num_replicas=world_size
    )
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size, sampler=test_sampler)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP1's own deprecation warnings
        model = _build(args, names)
    opt = OPTIMIZERS[args.optimizer](model.parameters(), lr=args.lr)
    scheduler = StepLR(opt, step_size=1, gamma=args.gamma)
    losses = []
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        losses.append(_train_epoch(model, train_loader, opt))
        losses.append(_test_epoch(model, test_loader))
        scheduler.step()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--fsdp", choices=sorted(PACKAGES), default="shardkit")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adadelta")
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--manual-wrap", action="store_true")
    cli = parser.parse_args()
    dist.init_process_group("gloo")
    args = Args(
        impl=cli.fsdp,
        optimizer=cli.optimizer,
        lr=cli.lr,
        epochs=cli.epochs,
        manual_wrap=cli.manual_wrap,
    )
    losses = fsdp_main(args)
    if dist.get_rank() == 0:
        for epoch in range(args.epochs):
            train, test = losses[2 * epoch], losses[2 * epoch + 1]
            print(f"epoch {epoch + 1}: train loss {train:.6f}, test loss {test:.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
