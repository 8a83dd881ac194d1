"""The exception types of user errors, compatible with torch's ``fully_shard``.

Code and test suites written for torch catch torch's exception types, some of which are
unusual for user errors (``AssertionError`` for a second ``fully_shard``, say). Each class
here is both the type a user error should have and the type torch raises in the same case,
so ``except ValueError`` and ``except AssertionError`` both work. Messages start with torch's
own wording of the problem, then say more.
"""

from __future__ import annotations

__all__ = [
    "AllGatherHookError",
    "AllGatherInputError",
    "BufferLifetimeError",
    "CheckpointLoadError",
    "CheckpointSaveError",
    "DesyncError",
    "FullyShardUsageError",
    "IncompleteCheckpointError",
    "InvalidPlacementError",
    "InvalidShardDimError",
    "NumericsCheckError",
    "ShardedMatrixError",
    "ShardkitError",
    "StateDictFileError",
    "StuckCollectiveError",
    "UnevenShardingError",
    "UnsupportedCopyError",
    "UnsupportedWithHooksError",
    "WeightExportError",
    "WeightLoadError",
    "WriterProcessError",
    "first_sentence",
]


class ShardkitError(Exception):
    """Base of the errors raised by type (not every error of the core derives from it)."""


class FullyShardUsageError(ShardkitError, ValueError, AssertionError):
    """A call torch refuses with an AssertionError: ``fully_shard`` twice, an unnamed 2-D mesh."""


class InvalidShardDimError(ShardkitError, ValueError, AssertionError):
    """``shard_placement_fn`` returned a dim the parameter does not have."""


class InvalidPlacementError(ShardkitError, TypeError, ValueError):
    """``shard_placement_fn`` returned neither ``Shard``, None nor a usable placement result.

    Torch raises ValueError for a value of the wrong type; TypeError is the usual type.
    """


class NumericsCheckError(ShardkitError, RuntimeError):
    """A compressed gradient reduction erred past ``ReducePrecision.check_tolerance``."""


class UnevenShardingError(ShardkitError, ValueError, NotImplementedError):
    """A dim other than 0 whose size the shard group does not divide."""


class UnsupportedCopyError(ShardkitError, RuntimeError, AssertionError):
    """``copy.deepcopy`` of a sharded module."""


class AllGatherHookError(ShardkitError, TypeError, AssertionError):
    """A tensor subclass's all-gather hooks that break torch's protocol.

    One hook without the other, or an ``fsdp_pre_all_gather`` that takes neither ``(mesh)``
    nor the five-argument form.
    """


class AllGatherInputError(ShardkitError, ValueError, AssertionError):
    """``fsdp_pre_all_gather`` returned tensors that the all-gather cannot carry.

    Not the padded shard size of an unevenly sharded parameter, or other sizes than at the
    first unshard.
    """


class UnsupportedWithHooksError(ShardkitError, NotImplementedError, AssertionError):
    """A feature that parameters with all-gather hooks do not support, as with torch.

    ``reshard_after_forward=int``.
    """


class StateDictFileError(ShardkitError, ValueError):
    """A state dict file that cannot be loaded as it is: truncated, malformed or unsafe.

    Raised on every rank with the same message, which names the file and what is wrong where.
    """


class CheckpointSaveError(ShardkitError, RuntimeError):
    """A checkpoint save failed and was not published; the message says why, per rank.

    Raised on every rank with the same message: a rank failed to write (in the background
    too), a rank's results did not match its plan, or a value could not be planned (one the
    safe reader could not read back: ``checkpoint.dcp_reading.LoadableSavePlanner``).
    """


class CheckpointLoadError(ShardkitError, RuntimeError):
    """No checkpoint could be loaded on every rank; the message says why, for each."""


class IncompleteCheckpointError(ShardkitError, RuntimeError):
    """A checkpoint directory whose save never finished."""


class WriterProcessError(ShardkitError, RuntimeError):
    """A checkpoint's writer process failed or died; the message says how.

    The save that used it raises ``CheckpointSaveError``, naming this one.
    """


class DesyncError(ShardkitError, RuntimeError):
    """Ranks about to run different collectives (``SHARDKIT_DEBUG``); names what each runs."""


class StuckCollectiveError(DesyncError):
    """Every rank waits in one of the engine's collectives, and they cannot pair.

    Raised on every rank, with the same message, once each has waited longer than
    ``SHARDKIT_COLLECTIVE_BOUND`` (``set_collective_bound``) and they do not all wait on the
    same collective; names what each waits on. The process group's connections are closed to
    end the waits: it cannot be used again.
    """


class BufferLifetimeError(ShardkitError, RuntimeError):
    """A buffer released while a collective not yet waited for reads or writes it.

    Raised by the lifetime checks (``SHARDKIT_DEBUG_LIFETIMES``): a bug of the engine or of a
    custom collective, never of the user's model. Names the buffer, the collective, its
    module and its process group.
    """


class WeightExportError(ShardkitError, RuntimeError):
    """A weight export failed, and every trainer rank says so with one message.

    A rank late past the bound, a receiver that failed, or ranks that disagree on what to
    export: every rank raises the same message, which names the bucket (and its first tensor)
    and the rank. The export's own process groups are dropped; the next export is a full one,
    on new groups.
    """


class WeightLoadError(ShardkitError, RuntimeError):
    """A receiver could not take an export.

    Names, shapes or dtypes that do not fit (nothing was written), or a load that failed
    partway (the message names the tensors written).
    """


class ShardedMatrixError(ShardkitError, RuntimeError):
    """``torch.optim.Muon`` given a matrix sharded across ranks, which it cannot see whole.

    Raised at its step, before any parameter changes; names the parameter and the fix,
    ``shardkit.core.optim.Muon``.
    """


def first_sentence(text: str) -> str:
    """The first sentence of a library's message, for ours (the rest is often advice)."""
    line = text.strip().splitlines()[0] if text.strip() else "no reason given"
    end = line.find(". ")
    return line if end < 0 else line[: end + 1]
