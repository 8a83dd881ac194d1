"""``python -m shardkit.core.run``: run a program written for torch's FSDP on shardkit's.

Usage::

    python -m shardkit.core.run train.py --its --args
    python -m shardkit.core.run -m package.module --its --args
    torchrun --nproc-per-node 2 -m shardkit.core.run train.py --its --args

It calls :func:`shardkit.core.patch_torch` and then runs the script (or module) as ``python``
would, as ``__main__`` with its own ``sys.argv``. Because the patch comes before the program's
first import, every ``from torch.distributed.fsdp import fully_shard`` in it, and in the
libraries it imports, gets shardkit's.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections.abc import Sequence

from shardkit.core.torch_patch import patch_torch

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    # For the help and the errors only: the program's own arguments must not be parsed.
    parser = argparse.ArgumentParser(
        prog="python -m shardkit.core.run",
        usage="%(prog)s (SCRIPT | -m MODULE) [ARGS...]",
        description="Run a program written for torch's FSDP with torch's FSDP names "
        "resolving to shardkit's (shardkit.core.patch_torch).",
    )
    parser.add_argument("-m", metavar="MODULE", help="run a module, as python -m does")
    parser.add_argument("program", nargs="?", metavar="SCRIPT", help="the script to run")
    return parser


def main(argv: Sequence[str]) -> None:
    """Patch torch, then run ``argv`` (``[script, *args]`` or ``["-m", module, *args]``).

    Raises:
        SystemExit: no script or module was given (status 2), or help was asked for (0).
    """
    args = list(argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args or (args[0].startswith("-") and not (args[0] == "-m" and len(args) > 1)):
        parser = _parser()
        if args[:1] in (["-h"], ["--help"]):
            parser.parse_args(args[:1])  # prints the help and exits 0
        parser.error("give a script, or -m and a module")
    patch_torch()
    if args[0] == "-m":
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return
    script = args[0]
    sys.argv = args
    # As `python script.py` does: the script's folder comes first on the import path.
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
