r"""``shardkit-convert``: FSDP1 checkpoints to DCP or safetensors, from the shell.

    shardkit-convert full model.pt -o converted/
    shardkit-convert sharded ckpt_dir/ -o model.safetensors --model mypkg.models:build
    shardkit-convert local ckpt/rank*.pt -o converted/ --model mypkg.models:build \\
        --world-size 8 --wrap mypkg.models:Block --use-orig-params --param-dtype bf16

Exit status: 0 converted; 1 the checkpoint cannot be converted or the output cannot be
written (a one-line message says why, naming the file; nothing is left behind); 2 bad
arguments (including a model or policy that cannot be imported).
"""

from __future__ import annotations

import argparse
import logging
import os
import pkgutil
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecision

from shardkit.legacy.convert.api import Fsdp1Checkpoint, convert_checkpoint
from shardkit.legacy.convert.full import FullCheckpoint
from shardkit.legacy.convert.local import LocalCheckpoint
from shardkit.legacy.convert.plan import CheckpointError
from shardkit.legacy.convert.sharded import ShardedCheckpoint
from shardkit.legacy.flat_layout import WrapPolicy

__all__ = ["main"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

_DESCRIPTION = """\
Convert a checkpoint of torch's FSDP1 (FullyShardedDataParallel) into a DCP checkpoint
that shardkit.core (or torch's fully_shard) loads at any world size with dcp.load, or into
one .safetensors file (for shardkit.core.load_full_state_dict, or a plain model). Runs in
one CPU process; reads one tensor at a time; unpickles nothing but tensors and plain data.
Everything is checked before anything is written, and the output appears only when complete.

modes:
  full     FULL_STATE_DICT: one torch.save file of full tensors (rank 0's
           torch.save(model.state_dict())). --model is optional, to check against.
  sharded  SHARDED_STATE_DICT: the directory FSDP1's ranks wrote with
           torch.distributed.checkpoint. --model is optional, to check against.
  local    LOCAL_STATE_DICT: every rank's torch.save(model.state_dict()) file, which
           hold flat shards of each FSDP1 unit. Where each parameter lies comes from the
           model and the FSDP1 settings it was trained with, all required: --model,
           --world-size, the wrap policy (--wrap or --wrap-policy), --use-orig-params and
           --param-dtype as FSDP1 had them.

Run `shardkit-convert MODE --help` for a mode's options."""


def _resolve(spec: str, what: str) -> Any:
    """The object named ``module:attribute``, for an argument."""
    try:
        return pkgutil.resolve_name(spec if ":" in spec else f"{spec}:")
    except (ImportError, AttributeError, ValueError) as err:
        raise argparse.ArgumentTypeError(f"{what} {spec!r}: {err}") from err


def _model(spec: str) -> nn.Module:
    factory = _resolve(spec, "--model")
    if not callable(factory):
        raise argparse.ArgumentTypeError(f"--model {spec!r} is not callable")
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as err:  # whatever the user's factory raises
        raise argparse.ArgumentTypeError(
            f"--model {spec!r} raised {type(err).__name__}: {err}"
        ) from err
    if not isinstance(model, nn.Module):
        raise argparse.ArgumentTypeError(f"--model {spec!r} returned {type(model).__name__}")
    return model


def _common(parser: argparse.ArgumentParser, *, model_required: bool) -> None:
    parser.add_argument(
        "-o", "--output", required=True, help="a .safetensors file, or a DCP directory (new)"
    )
    parser.add_argument(
        "--model",
        required=model_required,
        metavar="MODULE:FACTORY",
        help="a function returning the model (called on the meta device: nothing allocated)",
    )
    parser.add_argument(
        "--output-prefix",
        default="",
        help="DCP output: put the keys under this prefix (model: for dcp.load({'model': sd}))",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines")


def _input_prefix(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefix",
        help="where the model's entries are (model for {'model': sd, ...}); default: found "
        "from --model's keys, else every tensor",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardkit-convert",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    modes = parser.add_subparsers(dest="mode", required=True, metavar="MODE")
    full = modes.add_parser("full", help="one torch.save file of full tensors")
    full.add_argument("input", metavar="FILE", help="the torch.save file")
    _input_prefix(full)
    _common(full, model_required=False)
    sharded = modes.add_parser("sharded", help="a DCP checkpoint directory of FSDP1")
    sharded.add_argument("input", metavar="DIR", help="the DCP checkpoint directory")
    _input_prefix(sharded)
    _common(sharded, model_required=False)
    local = modes.add_parser("local", help="every rank's LOCAL_STATE_DICT file")
    local.add_argument("inputs", nargs="+", metavar="FILE", help="one file per rank, any order")
    _common(local, model_required=True)
    local.add_argument("--world-size", type=int, required=True, help="ranks that saved")
    wrap = local.add_mutually_exclusive_group()
    wrap.add_argument(
        "--wrap",
        action="append",
        metavar="MODULE:CLASS",
        help="a module class FSDP1 wrapped (ModuleWrapPolicy); repeat for several",
    )
    wrap.add_argument(
        "--wrap-policy",
        metavar="MODULE:NAME",
        help="FSDP1's auto_wrap_policy object itself (ModuleWrapPolicy, CustomPolicy, "
        "or a callable policy); without --wrap or this, the root was the only unit",
    )
    local.add_argument("--use-orig-params", action="store_true", help="FSDP1 had it True")
    local.add_argument(
        "--param-dtype", choices=sorted(_DTYPES), help="MixedPrecision param_dtype FSDP1 had"
    )
    return parser


def _source(args: argparse.Namespace) -> Fsdp1Checkpoint:
    model = None if args.model is None else _model(args.model)
    if args.mode == "full":
        return FullCheckpoint(path=args.input, model=model, prefix=args.prefix)
    if args.mode == "sharded":
        return ShardedCheckpoint(path=args.input, model=model, prefix=args.prefix)
    assert model is not None, "argparse requires --model in local mode"
    policy: WrapPolicy | None = None
    if args.wrap:
        policy = {_resolve(name, "--wrap") for name in args.wrap}
    elif args.wrap_policy:
        policy = _resolve(args.wrap_policy, "--wrap-policy")
    dtype = args.param_dtype and _DTYPES[args.param_dtype]
    return LocalCheckpoint(
        files=args.inputs,
        model=model,
        world_size=args.world_size,
        auto_wrap_policy=policy,
        use_orig_params=args.use_orig_params,
        mixed_precision=None if dtype is None else MixedPrecision(param_dtype=dtype),
    )


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``shardkit-convert``; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as ``python -m`` does: the user's modules import
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("shardkit-convert: %(message)s"))
    root = logging.getLogger("shardkit.legacy.convert")
    root.addHandler(handler)
    root.setLevel(logging.WARNING if args.quiet else logging.INFO)
    try:
        try:
            source = _source(args)
        except argparse.ArgumentTypeError as err:
            parser.error(str(err))
        convert_checkpoint(source, args.output, output_prefix=args.output_prefix)
    except (CheckpointError, ValueError, OSError) as err:
        # One line, naming the file (OSError: a full disk, no permission, an existing output);
        # the conversion removed whatever it had begun to write.
        print(f"shardkit-convert: error: {_one_line(err)}", file=sys.stderr)
        return 1
    finally:
        root.removeHandler(handler)
    return 0
