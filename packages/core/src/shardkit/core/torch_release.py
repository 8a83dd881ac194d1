"""The torch releases shardkit is tested on, and what it says on any other.

The packages declare ``torch>=2.10`` with no upper bound: a torch newer than the newest tested
release installs and imports, with an :class:`UntestedTorchWarning` that names the tested range,
rather than pip refusing it or replacing the user's torch with another multi-gigabyte build.
Differences between the releases of the range are found by feature detection where they are
used (``runtime/flat_collectives.py`` for ``torch.distributed``'s names; ``torch_patch.py`` replaces
only the FSDP names the installed torch has). This module compares release numbers, for the
warning and for the changes of behaviour with no name to detect, and words the errors for
torch's names that shardkit does not implement.
"""

from __future__ import annotations

import re
import warnings

import torch

__all__ = [
    "ACCUMULATES_IN_GRAD_DTYPE",
    "FOLLOWS_GRAD_DTYPE",
    "NEWEST_TESTED",
    "OLDEST_TESTED",
    "REDUCES_IN_PARAM_DTYPE",
    "UntestedTorchWarning",
    "not_in_shardkit",
    "release_of",
    "warn_if_untested",
]

OLDEST_TESTED = (2, 10)
"""The oldest torch release the test suite passes on (``make check-torch-all``)."""

NEWEST_TESTED = (2, 15)
"""The newest torch release the test suite passes on; a newer one gets a warning."""


class UntestedTorchWarning(UserWarning):
    """The installed torch is outside the range of releases shardkit is tested on."""


def release_of(version: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version string (``"2.16.0.dev20261201+cu130"`` -> (2, 16))."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else None


REDUCES_IN_PARAM_DTYPE = (release_of(torch.__version__) or (0, 0)) >= (2, 15)
"""Whether ``reduce_dtype=None`` reduces gradients in the parameters' own dtype (torch 2.15 on)
rather than in ``param_dtype`` (2.10 to 2.14). A change of behaviour, not of names: there is
nothing to detect, so the release decides."""

ACCUMULATES_IN_GRAD_DTYPE = (release_of(torch.__version__) or (0, 0)) >= (2, 15)
"""Whether gradients accumulate in their reduce dtype inside autograd, through the unsharded
parameters' ``grad_dtype`` (torch 2.15 on), rather than being cast to it when a group's
backward ends (2.10 to 2.14). Tensors have ``grad_dtype`` on every tested release: what changed
is ``fully_shard``'s use of it, so the release decides. See [Note: post-backward trigger]."""

FOLLOWS_GRAD_DTYPE = ACCUMULATES_IN_GRAD_DTYPE and hasattr(
    torch.empty(0), "_has_grad_dtype_override"
)
"""Whether a ``grad_dtype`` the user set on a parameter before sharding is kept and decides its
gradients' dtype (torch 2.15 on; earlier ``fully_shard`` builds the sharded parameter without
it). See ``engine/grad_dtype_policy.py``."""


def _tested_range() -> str:
    return "{}.{} to {}.{}".format(*OLDEST_TESTED, *NEWEST_TESTED)


def warn_if_untested(version: str = torch.__version__) -> None:
    """Warn when ``version`` is outside the tested releases (``shardkit.core`` checks at import).

    A patch release (2.15.1) counts as its release (2.15). It is a warning, not a refusal: a
    newer torch usually works, and ``make check-torch TORCH=<version>`` tells.
    """
    release = release_of(version)
    if release is None or OLDEST_TESTED <= release <= NEWEST_TESTED:
        return
    side = "newer" if release > NEWEST_TESTED else "older"
    warnings.warn(
        f"shardkit is tested on torch {_tested_range()}; the installed torch {version} is "
        f"{side}. Report what fails; `make check-torch TORCH=<version>` runs the test suite "
        "on any release",
        UntestedTorchWarning,
        stacklevel=2,
    )


def not_in_shardkit(feature: str, release: str, instead: str) -> NotImplementedError:
    """The error for a part of torch ``release``'s FSDP2 API that shardkit does not implement.

    ``instead`` says what shardkit does, or what to use.
    """
    return NotImplementedError(
        f"{feature} (torch {release}'s FSDP2) is not implemented by shardkit: {instead}"
    )
