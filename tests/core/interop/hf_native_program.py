"""A training program on transformers' native FSDP2 path, as its users write it.

Run under ``torchrun`` (torch's engine) or ``torchrun -m shardkit.core.run`` (shardkit's), two
ranks on gloo: ``from_pretrained(SRC, distributed_config=DistributedConfig(fsdp_size=2))``
shards the model as it reads it (transformers calls ``fully_shard`` itself), three AdamW steps,
then ``save_pretrained`` twice: gathered (one safetensors file) and with
``distributed_checkpoint=True`` (DCP, one safetensors file per rank). With ``--reload DIR`` it
then reads another run's DCP checkpoint back through ``from_pretrained`` and saves it gathered,
so that a checkpoint written by one engine is shown to load on the other.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        [-m shardkit.core.run] hf_native_program.py SRC OUT [--reload DIR]

Rank 0 writes ``OUT/result.json``: the losses, and the module that made the model's class.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.distributed as dist

STEPS = 3


def _native(path: str) -> Any:
    from transformers import LlamaForCausalLM
    from transformers.distributed.configuration_utils import DistributedConfig

    config = DistributedConfig(fsdp_size=2)
    return LlamaForCausalLM.from_pretrained(path, distributed_config=config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("src")
    parser.add_argument("out")
    parser.add_argument("--reload", default=None)
    args = parser.parse_args()
    model = _native(args.src)
    rank, world = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses: list[float] = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, 64, (2 * world, 12), generator=gen).chunk(world)[rank]
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    model.save_pretrained(os.path.join(args.out, "full"))
    model.save_pretrained(os.path.join(args.out, "dcp"), distributed_checkpoint=True)
    if args.reload is not None:
        _native(args.reload).save_pretrained(os.path.join(args.out, "reloaded"))
    if rank == 0:
        result = {"losses": losses, "engine": type(model).__module__}
        with open(os.path.join(args.out, "result.json"), "w") as file:
            json.dump(result, file)
    dist.barrier()


if __name__ == "__main__":
    main()
