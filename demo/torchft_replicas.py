"""One rank of a replica group under torchft: fully_shard inside the group, torchft across groups.

torchtitan's fault-tolerant HSDP, on a small GPT: each replica group is its own `torchrun` job
whose ranks shard the model with `fully_shard` (shardkit's, or torch's with `--impl torch`);
torchft's Manager joins the groups through a lighthouse, and each FSDP module's all-reduce hook
averages the reduce-scattered gradient shards across the groups on torchft's fault-tolerant
gloo process group. A group that dies is restarted by `torchrun --max-restarts`; torchft heals
it from a live group (the weights and the optimizer's state over HTTP) and it rejoins.

demo/run_torchft.py launches the lighthouse and two groups of 2 ranks and checks the run; run
alone it is (from the repository root, one line per group, R = 0 and 1):

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 demo/torchft_replicas.py \
        --replica R --lighthouse http://HOST:PORT --run-dir RUN

A deterministic failure (`--kill-replica 1 --kill-rank 1 --kill-step 3 --alone-steps 2`): that
rank SIGKILLs itself at step 3 of its group's first attempt, after the forward. The live group
fails that step (its all-reduce lost its peer), then commits `--alone-steps` steps alone; then
it lets the restarted group in (the file `rejoin` in RUN) and waits, before its next quorum,
until the lighthouse holds the restarted group's request, so the groups meet at the same step
in every run. Each rank appends one JSON line per step to RUN/steps-R-RANK.jsonl (the loss as
`float.hex`, whether the step committed, with how many groups) and writes what its healing
cost to RUN/heal-R-RANK.json.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import signal
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, run as a script

from demo.distributed import init_distributed
from demo.model import GPT, ModelConfig
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from shardkit.core import fully_shard as shardkit_fully_shard

MODELS = {
    "tiny": ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2),
    "demo": ModelConfig(),  # make demo's GPT, 1.3M parameters: a forward of about 0.1 s here
}
BATCH = 2
POLL_S = 0.05


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replica", type=int, required=True, help="this group's replica id")
    parser.add_argument("--replicas", type=int, default=2, help="how many groups the run has")
    parser.add_argument("--lighthouse", required=True, help="the lighthouse's http://HOST:PORT")
    parser.add_argument("--run-dir", type=Path, required=True, help="records and signal files")
    parser.add_argument("--impl", choices=("shardkit", "torch"), default="shardkit")
    parser.add_argument(
        "--hook",
        choices=("public", "private"),
        default="public",
        help="set_all_reduce_hook (torchtitan 0.3.0) or each param group's _all_reduce_hook",
    )
    parser.add_argument(
        "--quorum",
        choices=("async", "sync"),
        default="async",
        help="async: the quorum (and a peer's state dict) runs beside forward, as torchtitan's",
    )
    parser.add_argument("--steps", type=int, default=8, help="steps every group commits")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--kill-replica", type=int, default=-1, help="-1: no failure")
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-step", type=int, default=3)
    parser.add_argument("--alone-steps", type=int, default=2)
    return parser.parse_args(argv)


def build_model(impl: str, mesh: Any, cfg: ModelConfig) -> nn.Module:
    """The GPT, the same on every rank of every group (seeded), one fully_shard per block."""
    fully_shard = torch_fully_shard if impl == "torch" else shardkit_fully_shard
    torch.manual_seed(0)
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def install_hook(model: nn.Module, hook: Callable[[Tensor], None], how: str) -> int:
    """The cross-group all-reduce on every FSDP module: torchtitan 0.3.0's public way, or
    torchtitan main's private one (each param group's `_all_reduce_hook`). Returns how many."""
    installed = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        if how == "public":
            module.set_all_reduce_hook(hook)
            installed += 1
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            group._all_reduce_hook = hook
            installed += 1
    return installed


def batch(cfg: ModelConfig, replica: int, rank: int, step: int) -> tuple[Tensor, Tensor]:
    """This rank's tokens at `step`: a pure function of (replica, rank, step)."""
    gen = torch.Generator().manual_seed(1_000_003 * step + 101 * replica + rank)
    tokens = torch.randint(cfg.vocab_size, (BATCH, cfg.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def lighthouse_counts(address: str) -> tuple[int, int]:
    """(groups waiting for a quorum, groups heartbeating), from the lighthouse's status page."""
    with urllib.request.urlopen(f"{address}/status", timeout=10) as page:
        html = page.read().decode()
    found = re.search(r"\[(\d+)/\d+ participants healthy\]\[(\d+) heartbeating\]", html)
    if found is None:
        raise RuntimeError(f"the lighthouse's status page changed: {html[:200]!r}")
    return int(found.group(1)), int(found.group(2))


def wait_until(done: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(POLL_S)


def make_transport(timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport, measuring what a healing group receives."""
    from torchft.checkpointing import HTTPTransport
    from torchft.checkpointing._serialization import _streaming_load

    class MeasuredHTTPTransport(HTTPTransport):  # type: ignore[misc]
        received: ClassVar[list[dict[str, float]]] = []  # one transport in a process

        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            start = time.perf_counter()
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as reply:
                payload = reply.read()
            fetched = time.perf_counter()
            loaded = _streaming_load(io.BytesIO(payload), weights_only=False)
            cls.received.append(
                {
                    "bytes": len(payload),
                    "fetch_s": fetched - start,
                    "deserialize_s": time.perf_counter() - fetched,
                }
            )
            return loaded

    return MeasuredHTTPTransport(timeout=timeout, num_chunks=0)


@dataclass(kw_only=True, slots=True)
class Replica:
    """This rank's model and optimizer, and the state torchft moves between groups."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    phase: str = "start"
    """What the training thread is doing (forward, backward, commit, between steps)."""
    sent: list[dict[str, str]] = field(default_factory=list)
    """Each state dict torchft took to send, and what the training thread was doing then."""
    load_s: float = 0.0
    """How long loading a peer's state took."""

    def state_dict(self) -> dict[str, Any]:
        # torchft calls this on its quorum thread, while the training thread may be running a
        # forward (the async quorum): pytorch/torchtitan#4753's pattern.
        during = self.phase
        state = {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}
        self.sent.append({"during": during, "until": self.phase})
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        start = time.perf_counter()
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        self.load_s = time.perf_counter() - start

    def digest(self) -> str:
        """A digest of this rank's shards of the parameters and of the optimizer's state."""
        digest = hashlib.sha256()
        tensors: list[Tensor] = list(self.model.parameters())
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, Tensor)]
        for t in tensors:
            local = t.to_local() if isinstance(t, DTensor) else t
            digest.update(local.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()


def make_manager(
    args: argparse.Namespace, replica: Replica, transport: Any, timeout: timedelta
) -> Any:
    """torchft's Manager for this rank: rank 0 first, which serves the group's manager and
    writes its address in the group's TCPStore, then the others, which read it (so a restarted
    rank never reads the address of a dead attempt's manager)."""
    import torchft

    manager = None
    for turn in range(2):
        if (dist.get_rank() == 0) == (turn == 0):
            manager = torchft.Manager(
                pg=torchft.ProcessGroupGloo(timeout=timeout),
                load_state_dict=replica.load_state_dict,
                state_dict=replica.state_dict,
                min_replica_size=1,
                use_async_quorum=args.quorum == "async",
                replica_id=f"group_{args.replica}",
                lighthouse_addr=args.lighthouse,
                rank=dist.get_rank(),
                world_size=dist.get_world_size(),
                timeout=timeout,
                quorum_timeout=timedelta(seconds=120),
                connect_timeout=timeout,
                init_sync=False,  # every group builds the same weights from the seed
                checkpoint_transport=transport,
            )
        dist.barrier()
    return manager


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from torchft.process_group import ManagedProcessGroup

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    run_dir: Path = args.run_dir
    failing = args.kill_replica >= 0
    if attempt > 0 and failing:  # a restarted group comes back when the live one lets it
        wait_until((run_dir / "rejoin").exists, "the live group to let this group rejoin")

    cfg = MODELS[args.model]
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = build_model(args.impl, mesh, cfg)
    replica = Replica(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    timeout = timedelta(seconds=30)
    transport = make_transport(timeout)
    manager = make_manager(args, replica, transport, timeout)
    replicate_pg = ManagedProcessGroup(manager)
    replicate_pg.register("dp_replicate")
    hook_calls = [0]

    def all_reduce_hook(reduced: Tensor) -> None:  # torchtitan's
        hook_calls[0] += 1
        dist.all_reduce(reduced, group=replicate_pg, op=dist.ReduceOp.AVG)

    installed = install_hook(model, all_reduce_hook, args.hook)
    if rank == 0 and attempt == 0:  # every group heartbeating before the first quorum
        wait_until(lambda: lighthouse_counts(args.lighthouse)[1] >= args.replicas, "the groups")
    log = (run_dir / f"steps-{args.replica}-{rank}.jsonl").open("a")
    first_step_here = True
    rejoin_step = args.kill_step + args.alone_steps
    live_group = failing and args.replica != args.kill_replica
    while manager.current_step() < args.steps:
        step = manager.current_step()
        if live_group and rank == 0 and step == rejoin_step and not (run_dir / "rejoin").exists():
            (run_dir / "rejoin").touch()
            wait_until(lambda: lighthouse_counts(args.lighthouse)[0] >= 1, "the restarted group")
        manager.start_quorum()
        replica.optimizer.zero_grad()
        if first_step_here:  # a (re)started group learns which step it is at
            manager.wait_quorum()
        step = manager.current_step()
        hook_calls[0] = 0
        inputs, targets = batch(cfg, args.replica, rank, step)
        replica.phase = "forward"
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))
        replica.phase = "backward"
        kill = (args.replica, rank, step) == (args.kill_replica, args.kill_rank, args.kill_step)
        if kill and attempt == 0:
            manager.wait_quorum()  # the step's quorum holds this group: the peers count on it
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        replica.phase = "commit"
        participants = manager.num_participants()
        participating = manager.is_participating()  # False while it heals beside a step
        committed = manager.should_commit()
        if committed:
            replica.optimizer.step()
        record = {
            "step": step,
            "attempt": attempt,
            "loss": float(loss.item()).hex(),
            "committed": committed,
            "participants": participants,
            "participating": participating,
            "hook_calls": hook_calls[0],
        }
        log.write(json.dumps(record) + "\n")
        log.flush()
        first_step_here = False
        replica.phase = "between steps"
    final = {"final": True, "attempt": attempt, "installed": installed, "digest": replica.digest()}
    log.write(json.dumps(final) + "\n")
    log.close()
    if transport.received or replica.sent:
        heal = {"received": transport.received, "sent": replica.sent, "load_s": replica.load_s}
        (run_dir / f"heal-{args.replica}-{rank}.json").write_text(json.dumps(heal))
    dist.barrier()
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
