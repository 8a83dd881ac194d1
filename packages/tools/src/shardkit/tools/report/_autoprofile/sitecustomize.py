"""shardkit-profile's start-up hook, imported by Python in every process of a profiled command.

``shardkit-profile`` puts this folder first on ``PYTHONPATH``, so Python's ``site`` imports this
module at start-up. It must cost nothing where it has nothing to do, and never break the
program it rides in:

- it first runs the ``sitecustomize`` that this one shadows, if there is one further down the
  path, so a user's or distribution's own hook keeps working;
- it does nothing unless ``SHARDKIT_PROFILE_DIR`` is set, and nothing in torchrun's launcher
  (the elastic agent that starts the ranks: it trains nothing);
- it imports nothing heavy at start-up: the profiler starts when the program itself first
  imports torch, so Python processes that never use torch pay nothing;
- at exit it writes ``rank-<RANK>.json`` (``RANK`` from the environment, as torchrun sets it;
  otherwise the rank the profiler saw), unless no module ran and no collective was issued
  (helper processes such as data-loader or compile workers). If two processes still claim one
  rank, the file with more records is kept;
- an error in any of this is logged as a warning, never raised into the program.
"""

from __future__ import annotations

import os
import sys

# typing.TYPE_CHECKING without importing typing: every import here is paid by every Python
# process the command starts (importlib.abc alone would add some 20 ms). mypy knows the name.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

    from shardkit.tools.records import RankReport
    from shardkit.tools.track.profiler import Profiler

__all__ = ["is_launcher", "should_profile"]

# The names shardkit.tools.report.cli sets; repeated here because importing that module would
# import more than a start-up hook should (a test checks they agree).
ENV_DIR = "SHARDKIT_PROFILE_DIR"
ENV_MEMORY = "SHARDKIT_PROFILE_MEMORY"
ENV_COMM = "SHARDKIT_PROFILE_COMM"

_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")
_LAUNCHER_SCRIPTS = ("torch/distributed/run.py", "torch/distributed/launch.py")


def is_launcher(argv: Sequence[str], orig_argv: Sequence[str]) -> bool:
    """Whether this process is torchrun's launcher rather than a rank it started.

    Args:
        argv: ``sys.argv`` as it is during start-up (``-m``'s module name not yet in it).
        orig_argv: ``sys.orig_argv``, the interpreter's whole command line.
    """
    script = (argv[0] if argv else "").replace(os.sep, "/")
    if os.path.basename(script) == "torchrun" or script.endswith(_LAUNCHER_SCRIPTS):
        return True
    return _run_module(orig_argv) in _LAUNCHER_MODULES


def _run_module(orig_argv: Sequence[str]) -> str | None:
    """The module of ``python [options] -m <module>``, as Python's own parser reads it."""
    args = list(orig_argv[1:])
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-", "--") or not arg.startswith("-"):
            return None  # a script or stdin: the rest are its arguments
        if arg.startswith("--"):
            i += 2 if arg == "--check-hash-based-pycs" else 1
            continue
        for j, flag in enumerate(arg[1:], start=2):  # short flags combine: -um, -Xdev
            if flag in "mcWX":  # these take a value: the rest of this word, or the next one
                value = arg[j:] or (args[i + 1] if i + 1 < len(args) else "")
                if flag == "m":
                    return value
                if flag == "c":
                    return None
                i += 0 if arg[j:] else 1
                break
        i += 1
    return None


def should_profile(env: Mapping[str, str], argv: Sequence[str], orig_argv: Sequence[str]) -> bool:
    """Whether to start a profiler in this process: asked to, and not torchrun's launcher."""
    return bool(env.get(ENV_DIR)) and not is_launcher(argv, orig_argv)


def _warn(message: str, *args: object) -> None:
    import logging  # only on the way out: start-up stays free of imports

    logging.getLogger("shardkit.tools.autoprofile").warning(message, *args)


def _run_shadowed_sitecustomize() -> None:
    """Runs the next ``sitecustomize`` on ``sys.path``, the one this module hides."""
    from importlib.machinery import PathFinder

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or spec.origin == os.path.abspath(__file__):
        return
    from importlib.util import module_from_spec  # some 3 ms, so only when there is one

    try:
        spec.loader.exec_module(module_from_spec(spec))
    except Exception as err:  # what site itself does for a failing sitecustomize: go on
        _warn("the sitecustomize at %s failed: %r", spec.origin, err)


class _ThenStart:
    """Loads torch with its own loader, then starts the profiler (a loader, by duck typing)."""

    def __init__(self, inner: Loader) -> None:
        self._inner = inner

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        # Hand torch back its own loader: nothing after import should see this one.
        module.__loader__ = self._inner
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        _start()

    def __getattr__(self, name: str) -> Any:
        # Resource readers and the like, asked for while torch imports, are its loader's.
        return getattr(self._inner, name)


class _WhenTorchImports:
    """Finds nothing itself; wraps torch's loader the first time torch is imported.

    A meta path finder by duck typing, for the same reason as ``_ThenStart``.
    """

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)  # one shot; the search below must not come back here
        from importlib.util import find_spec

        spec = find_spec(fullname)
        if spec is not None and spec.loader is not None:
            # A loader by duck typing, not by the importlib.abc.Loader type the stubs ask for.
            spec.loader = _ThenStart(spec.loader)  # type: ignore[assignment]
        return spec


def _start() -> None:
    try:
        from shardkit.tools.track.profiler import Profiler

        profiler = Profiler(
            comm=os.environ.get(ENV_COMM, "1") != "0",
            memory=os.environ.get(ENV_MEMORY, "1") != "0",
        )
        profiler.start()
    except Exception as err:  # profiling is a guest: never fail the program's import of torch
        _warn("shardkit-profile could not start the profiler in pid %d: %r", os.getpid(), err)
        return
    import atexit

    atexit.register(_finish, profiler, os.environ[ENV_DIR], os.getpid())


def _finish(profiler: Profiler, folder: str, pid: int) -> None:
    if os.getpid() != pid:  # a forked child inherited the handler; the parent writes
        return
    try:
        profiler.stop()
        report = _with_launcher_rank(profiler.rank_report())
        if not (report.spans or report.collectives):
            # No module ran and nothing was communicated: a helper process (a data-loader or
            # compile worker, which inherits RANK), whose file would hide the rank's own.
            return
        _write(folder, report)
    except Exception as err:  # at exit, an error only loses this rank's report
        _warn("shardkit-profile could not write the report of pid %d: %r", os.getpid(), err)


def _with_launcher_rank(report: RankReport) -> RankReport:
    """The report under torchrun's RANK and WORLD_SIZE, which outlive the process group."""
    import dataclasses

    rank = int(os.environ.get("RANK", report.rank))
    world = int(os.environ.get("WORLD_SIZE", report.world_size))
    if (rank, world) == (report.rank, report.world_size):
        return report
    return dataclasses.replace(report, rank=rank, world_size=world)


def _size(report: RankReport) -> int:
    samples = 0 if report.memory is None else len(report.memory.timeline)
    return len(report.collectives) + len(report.spans) + samples


def _write(folder: str, report: RankReport) -> None:
    from shardkit.tools.report.json_io import rank_report_path, write_rank_report

    path = rank_report_path(folder, report.rank)
    if path.exists():
        import json

        from shardkit.tools.records import RankReport

        try:
            other = RankReport.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, TypeError, ValueError):
            other = None  # unreadable: replace it
        if other is not None and _size(other) >= _size(report):
            _warn("%s exists with more records; keeping it (pid %d)", path, os.getpid())
            return
    write_rank_report(path, report)


def _main() -> None:
    _run_shadowed_sitecustomize()
    if not should_profile(os.environ, sys.argv, getattr(sys, "orig_argv", [])):
        return
    if "torch" in sys.modules:
        _start()
    else:
        sys.meta_path.insert(0, _WhenTorchImports())


if __name__ == "sitecustomize":  # as site imports it, not as a module of shardkit.tools
    _main()
