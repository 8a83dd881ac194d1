"""Small random programs over the shapes that decide where a group's backward ends.

A program is a few blocks (a linear layer, some with an inner linear of their own), sharded in
one of four ways each (alone, with another block as one ``fully_shard([a, b])`` group, its inner
layer nested in a group of its own, or left to the root's group), and a forward that calls them
in a random order, some twice, with something between the calls: a cast, a view, a
``.detach()``, a call under ``no_grad``, a non-tensor value passed in and out. Each call may run
under activation checkpointing (reentrant or not); the batch may need a gradient or not; the
mixed-precision policy casts the forward inputs or not. The loss adds every call's output, so
each call feeds backward on its own path as well as through the calls after it.

:func:`run_program` trains one program on an engine (torch's ``fully_shard`` or shardkit's) for
two backwards and returns every parameter's gradient on this rank after each: ``None``, or its
local shard and its full tensor. :func:`compare` names every difference, bit for bit. See
[Note: post-backward trigger] for why these shapes are the ones that matter: each decides
whether a group's inputs, its count of gradients or the end-of-backward callback ends its
backward, and a rule that misjudges one drops or doubles a gradient.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from tests.core.parity import fully_shard_of, torch_policy

DIM, BATCH = 8, 2

# What stands between one call and the next (applied to the call's input).
EDGES = ("none", "cast", "view", "detach", "no_grad", "non_tensor")
# How a block is sharded: alone, in a list group with another block, with its inner layer in a
# group of its own inside the block's, or not at all (its parameters are the root's).
SHARDINGS = ("alone", "list", "nested", "root")
CHECKPOINTS = ("none", "reentrant", "non_reentrant")
POLICIES = ("fp32", "bf16_cast", "bf16_no_cast")

Grads = dict[str, tuple[torch.Tensor, torch.Tensor] | None]  # name -> (local, full) or None


@dataclass(frozen=True, slots=True)
class Call:
    """One call of a block in the program's forward."""

    block: int
    source: int  # -1: the batch; otherwise the output of that earlier call
    edge: str  # what is applied to the input first (``EDGES``)
    checkpoint: str  # ``CHECKPOINTS``


@dataclass(frozen=True, slots=True)
class Program:
    """A random program: blocks, how each is sharded, and the calls of its forward."""

    seed: int
    blocks: int
    inner: tuple[bool, ...]  # per block: has an inner linear layer
    bias: tuple[bool, ...]  # per block: its linear layer has a bias
    sharding: tuple[str, ...]  # per block (``SHARDINGS``)
    pairs: tuple[tuple[int, int], ...]  # the list groups, each two blocks
    root_head: bool  # the root has a linear layer of its own, applied to the last output
    calls: tuple[Call, ...]
    batch_needs_grad: bool
    policy: str  # ``POLICIES``

    @property
    def reentrant(self) -> bool:
        """Whether a call runs under a reentrant checkpoint (``oracle`` says why it matters)."""
        return any(_reentrant(c) for c in self.calls)

    def describe(self) -> str:
        calls = ", ".join(
            f"b{c.block}({'x' if c.source < 0 else f'c{c.source}'}|{c.edge}|{c.checkpoint})"
            for c in self.calls
        )
        return (
            f"seed {self.seed}: sharding {self.sharding} pairs {self.pairs} inner {self.inner} "
            f"head {self.root_head} policy {self.policy} batch_grad {self.batch_needs_grad} "
            f"calls [{calls}]"
        )


def generate(seed: int) -> Program:
    """The program of ``seed`` (the same on every rank and every run)."""
    rng = random.Random(seed)
    blocks = rng.randint(2, 4)
    inner = tuple(rng.random() < 0.3 for _ in range(blocks))
    bias = tuple(rng.random() < 0.5 for _ in range(blocks))
    sharding = [rng.choice(SHARDINGS) for _ in range(blocks)]
    for b in range(blocks):
        if sharding[b] == "nested" and not inner[b]:
            sharding[b] = "alone"
    # Pair the blocks marked "list" two by two; an odd one out is sharded alone.
    listed = [b for b in range(blocks) if sharding[b] == "list"]
    rng.shuffle(listed)
    pairs = tuple((min(a, b), max(a, b)) for a, b in zip(listed[0::2], listed[1::2], strict=False))
    if len(listed) % 2:
        sharding[listed[-1]] = "alone"
    order = list(range(blocks))
    if rng.random() < 0.3:
        rng.shuffle(order)
    if rng.random() < 0.35:  # a block used twice
        order.insert(rng.randint(1, len(order)), rng.choice(order))
    calls = []
    for i, block in enumerate(order):
        # Mostly a chain; sometimes the batch again or an older output (two paths to the loss).
        source = i - 1 if rng.random() < 0.8 else rng.randint(-1, i - 1)
        edge = rng.choice(EDGES) if rng.random() < 0.6 else "none"
        ckpt = rng.choice(CHECKPOINTS) if rng.random() < 0.3 else "none"
        calls.append(Call(block, source, edge, ckpt))
    calls = _hooked_completions(calls, pairs)
    reentrant = any(_reentrant(c) for c in calls)
    policy = rng.choice(POLICIES)
    return Program(
        seed=seed,
        blocks=blocks,
        inner=inner,
        bias=bias,
        sharding=tuple(sharding),
        pairs=pairs,
        root_head=rng.random() < 0.5,
        calls=tuple(calls),
        batch_needs_grad=rng.random() < 0.4,
        # The oracle of a reentrant checkpoint is the replicas' (see ``oracle``), in fp32.
        policy="fp32" if reentrant else policy,
    )


def _reentrant(call: Call) -> bool:
    return call.checkpoint == "reentrant" and call.edge != "no_grad"


def _hooked_completions(calls: list[Call], pairs: tuple[tuple[int, int], ...]) -> list[Call]:
    """``calls`` where the call that completes a list group's forward keeps gradients on.

    Left out: a list group whose forward completes in a call made with gradients off (under
    ``no_grad``, or a reentrant checkpoint's). The group's pre-backward hook goes on that
    call's output, which has none to hook, so backward reaches the group's earlier calls
    with their parameters freed, and both engines raise ("storage of size 0": a known limit,
    loud on both; see [Note: post-backward trigger]), unless no node reads them.
    """
    out = list(calls)
    for pair in pairs:
        ran: set[int] = set()
        for i, call in enumerate(out):
            if call.block not in pair:
                continue
            ran.add(call.block)
            if ran == set(pair):
                edge = "none" if call.edge == "no_grad" else call.edge
                ckpt = "none" if call.checkpoint == "reentrant" else call.checkpoint
                out[i] = Call(call.block, call.source, edge, ckpt)
                ran = set()
    return out


class Block(nn.Module):
    """A linear layer, an optional inner one after it; passes a non-tensor value through."""

    def __init__(self, inner: bool, bias: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM, bias=bias)
        self.inner = nn.Linear(DIM, DIM, bias=False) if inner else None

    def forward(self, x: torch.Tensor, extra: Any = None) -> Any:
        # Without a cast of the forward inputs, bf16 weights take the input cast here.
        y = torch.tanh(self.lin(x.to(self.lin.weight.dtype)))
        if self.inner is not None:
            y = self.inner(y)
        return y if extra is None else (y, extra)


class Net(nn.Module):
    """The program's blocks and, maybe, a head of the root's own; runs the program's calls."""

    def __init__(self, program: Program) -> None:
        super().__init__()
        self.program = program
        self.blocks = nn.ModuleList(
            Block(program.inner[b], program.bias[b]) for b in range(program.blocks)
        )
        self.head = nn.Linear(DIM, DIM, bias=False) if program.root_head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs: list[torch.Tensor] = []
        for call in self.program.calls:
            source = x if call.source < 0 else outputs[call.source]
            outputs.append(_run_call(self.blocks[call.block], source, call))
        if self.head is not None:
            outputs.append(self.head(outputs[-1].to(self.head.weight.dtype)))
        # Every output on a path of its own, in fp32: the loss is the same on both engines.
        return sum((o.float().square().mean() for o in outputs), torch.zeros(()))


def _run_call(block: nn.Module, x: torch.Tensor, call: Call) -> torch.Tensor:
    if call.edge == "cast":
        x = x.float() if x.dtype != torch.float32 else x.to(torch.bfloat16)
    elif call.edge == "view":
        x = x.unflatten(1, (2, DIM // 2)).transpose(1, 2).transpose(1, 2).flatten(1)
    elif call.edge == "detach":
        x = x.detach()
    extra = (3, "tag", None) if call.edge == "non_tensor" else None

    def run(inp: torch.Tensor) -> torch.Tensor:
        out = block(inp, extra) if extra is not None else block(inp)
        return out[0] if extra is not None else out  # type: ignore[no-any-return]

    if call.edge == "no_grad":
        with torch.no_grad():
            return run(x)
    if call.checkpoint == "none":
        return run(x)
    out: torch.Tensor = checkpoint(run, x, use_reentrant=call.checkpoint == "reentrant")
    return out


def _policy(program: Program) -> Any:
    from shardkit.core import MixedPrecisionPolicy

    if program.policy == "fp32":
        return None
    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, cast_forward_inputs=program.policy == "bf16_cast"
    )


def shard(engine: str, program: Program, model: Net) -> None:
    """Shard ``model`` on ``engine`` as ``program`` says (inner groups first, the root last)."""
    fully_shard = fully_shard_of(engine)
    policy = _policy(program)
    kwargs: dict[str, Any] = {"mesh": init_device_mesh("cpu", (dist.get_world_size(),))}
    if policy is not None:
        kwargs["mp_policy"] = policy if engine == "shardkit" else torch_policy(policy)
    blocks = model.blocks
    for b, how in enumerate(program.sharding):
        if how == "nested":
            fully_shard(blocks[b].inner, **kwargs)
    for b, how in enumerate(program.sharding):
        if how in ("alone", "nested"):
            fully_shard(blocks[b], **kwargs)
    for a, b in program.pairs:
        fully_shard([blocks[a], blocks[b]], **kwargs)
    fully_shard(model, **kwargs)


def _grads(model: nn.Module) -> Grads:
    out: Grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            out[name] = None
        elif isinstance(grad, DTensor):
            out[name] = (grad.to_local().detach().clone(), grad.full_tensor().detach().clone())
        else:
            out[name] = (grad.detach().clone(), grad.detach().clone())
    return out


def oracle(program: Program) -> str:
    """What ``program`` is checked against: torch's ``fully_shard``, or unsharded replicas.

    Torch's engine is no oracle under a reentrant checkpoint around a sharded module's call:
    that forward runs under ``no_grad``, so torch watches none of its inputs and ends the group
    at another call's inputs or never, and then drops the gradient (``None`` where one is due),
    leaves an unsharded bf16 gradient on the sharded parameter, or fails ("storage of size 0").
    There the oracle is the program itself on unsharded replicas, each on its rank's batch, the
    gradients summed over the ranks and divided by their number (in fp32, where two ranks' sum
    is the same whatever the order: bit for bit what a sharded reduction must give).
    """
    return "replicas" if program.reentrant else "torch"


def _replica_mean(model: nn.Module) -> Grads:
    """The replicas' gradients summed over the ranks and divided by their number, as shards."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out: Grads = {}
    for name, param in model.named_parameters():
        present = torch.tensor([param.grad is not None], dtype=torch.int64)
        dist.all_reduce(present)
        if int(present) == 0:
            out[name] = None
            continue
        full = param.grad.detach().clone() if param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(full)
        full /= world
        out[name] = (full.chunk(world)[rank].clone(), full)
    return out


def run_program(engine: str, program: Program, backwards: int = 2) -> list[Grads] | str:
    """Each backward's gradients on this rank, or the error the engine raised.

    ``engine``: "torch" or "shardkit" (``fully_shard``'s), or "replicas" (no sharding).
    """
    torch.manual_seed(program.seed)
    model = Net(program)
    if engine != "replicas":
        shard(engine, program, model)
    rank = dist.get_rank()
    found: list[Grads] = []
    try:
        for step in range(backwards):
            batch = torch.Generator().manual_seed(program.seed * 1000 + rank * 10 + step)
            x = torch.randn(BATCH, DIM, generator=batch).requires_grad_(program.batch_needs_grad)
            model(x).backward()
            found.append(_replica_mean(model) if engine == "replicas" else _grads(model))
            model.zero_grad(set_to_none=True)
    except Exception as exc:  # the oracle's refusal is compared, not raised
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return found


def compare(reference: list[Grads] | str, ours: list[Grads] | str) -> list[str]:
    """Every difference between the oracle's gradients and ours (empty: bit for bit)."""
    if isinstance(reference, str) or isinstance(ours, str):
        if isinstance(reference, str) and isinstance(ours, str):
            return []  # both refused the program
        return [f"oracle: {_outcome(reference)}; shardkit: {_outcome(ours)}"]
    problems = []
    for step, (theirs, mine) in enumerate(zip(reference, ours, strict=True)):
        for name, want in theirs.items():
            got = mine.get(name)
            if want is None or got is None:
                if (want is None) != (got is None):
                    problems.append(
                        f"backward {step}: {name}.grad is "
                        f"{'None' if got is None else 'set'} (oracle: "
                        f"{'None' if want is None else 'set'})"
                    )
                continue
            for kind, a, b in (("local shard", want[0], got[0]), ("full", want[1], got[1])):
                if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                    same_shape = a.shape == b.shape
                    diff = (a.double() - b.double()).abs().max().item() if same_shape else -1
                    problems.append(
                        f"backward {step}: {name}.grad ({kind}) differs: "
                        f"{a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}, "
                        f"max |diff| {diff:.3g}"
                    )
    return problems


def _outcome(result: list[Grads] | str) -> str:
    return result if isinstance(result, str) else "ran"


def check_seeds(rank: int, world_size: int, seeds: list[int]) -> dict[int, list[str]]:
    """Pool task: each seed's program on both engines, and the differences on this rank.

    Also returns, under -1, the seeds whose program torch refused (kept few by the generator).
    """
    del world_size
    problems: dict[int, list[str]] = {}
    refused: list[str] = []
    for seed in seeds:
        program = generate(seed)
        reference = run_program(oracle(program), program)
        ours = run_program("shardkit", program)
        if isinstance(reference, str):
            refused.append(f"{seed}: {reference}")
        found = compare(reference, ours)
        if found:
            problems[seed] = [f"rank {rank}: {program.describe()}", *found]
    if refused:
        problems[-1] = refused
    return problems
