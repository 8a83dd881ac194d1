"""Versions: a receiver serves export k complete until export k+1 is complete, then switches.

An export's number (``ExportManifest.export_id``, counted by its exporter) is the version it
installs. A receiver stages what an export sends beside what it serves, and switches in its
``commit``, which the exporter calls once every bucket was staged and before the ranks' last
agreement: a commit that fails is then the verdict every trainer rank raises, and an export that
fails earlier (a rank killed, the bound passed, a staging that raised) never touched what
serves. A commit that fails partway puts version k back before it raises.

Memory: the staging copy, held from the bucket that brings it to the commit: one more copy of
each tensor a full export sends; for a delta, its changes alone (positions, values, steps), and
at the commit the old values where they land.

- :class:`StagedTensors` stages new values for tensors a receiver holds (``ModuleReceiver``)
  and copies them in at the commit, keeping each tensor's old values until all went in; a
  delta's changes it stages as they came and writes in place at the commit, keeping the old
  values at their positions (a few bytes a change, not a copy of the tensor).
- :class:`StagedLoads` stages whole-tensor loads (``FullTensorReceiver``) and makes them at
  the commit; if one raises, it loads version k's tensors back from the receiver's mirror.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from shardkit.core.errors import WeightLoadError
from shardkit.core.export.messages import ChangedElements, ExportManifest

__all__ = ["StagedLoads", "StagedTensors", "partial_load_error"]

Tensors = list[tuple[str, torch.Tensor]]


@dataclass(slots=True)
class StagedTensors:
    """New values for a receiver's own tensors, copied in at once at the commit."""

    values: dict[str, torch.Tensor] = field(default_factory=dict)
    """By name: the staged export's whole new tensors (after :meth:`copy_into`: emptied)."""
    changes: dict[str, ChangedElements] = field(default_factory=dict)
    """By name: a delta's changes to a tensor the receiver holds (contiguous), written in
    place at the commit (after :meth:`copy_into`: emptied)."""

    def names(self) -> list[str]:
        """Every staged name: whole tensors first, then changed ones."""
        return [*self.values, *self.changes]

    def copy_into(self, targets: dict[str, torch.Tensor]) -> None:
        """Write every staged tensor and change into its target, in place; all or none.

        What each write replaces is kept until every write went through (a whole tensor's old
        values in the staging tensor its new ones leave; a change's old values at its
        positions): a write that raises puts them all back, last first (a tied tensor staged
        under two names is restored to what it held before both).
        """
        undo: list[Callable[[], None]] = []
        try:
            with torch.no_grad():
                for name, new in self.values.items():
                    target = targets[name]
                    old = target.clone()
                    target.copy_(new)
                    self.values[name] = old  # the new values' copy goes: one copy at a time
                    undo.append(partial(_copy, target, old))
                for name, changed in self.changes.items():
                    undo.append(_write_changes(changed, targets[name]))
        except BaseException:
            with torch.no_grad():
                for put_back in reversed(undo):
                    put_back()
            raise
        finally:
            self.values, self.changes = {}, {}


def _copy(target: torch.Tensor, values: torch.Tensor) -> None:
    target.copy_(values)


def _write_changes(changed: ChangedElements, target: torch.Tensor) -> Callable[[], None]:
    """Write ``changed`` into ``target`` in place; what puts its old values back.

    The old values are read at the changes' positions before anything is written, and put
    back stepped ones first, then the others (the reverse order of the writes).
    """
    flat = target.view(-1)
    where = target.device
    indices = changed.indices.to(where)
    old_values = flat[indices]
    stepped = changed.stepped
    has_steps = stepped is not None and changed.steps is not None and stepped.numel() > 0
    bits = flat.view(_BITS[target.element_size()])
    at = stepped.to(where) if has_steps and stepped is not None else None
    old_bits = bits[at] if at is not None else None

    def put_back() -> None:
        if at is not None and old_bits is not None:
            bits[at] = old_bits
        flat[indices] = old_values

    try:
        changed.apply_to(target)
    except BaseException:
        put_back()  # a write that raised partway: its own elements back first
        raise
    return put_back


@dataclass(slots=True)
class StagedLoads:
    """Whole-tensor loads, made at the commit, with version k loaded back if one raises."""

    loads: list[tuple[list[str], Tensors]] = field(default_factory=list)
    """Per bucket: the export's names in it, and the tensors to load (transformed)."""

    def load_all(
        self,
        load: Callable[[Tensors], None],
        previous: Callable[[list[str]], Tensors | None],
        version: str,
    ) -> None:
        """Load every staged bucket in order; on an error, put the held version back.

        Args:
            load: the receiver's load.
            previous: a bucket's tensors of the version that serves (by the export's names,
                transformed as the load takes them), or None where they are not held.
            version: the version that serves, for the error.

        Raises:
            WeightLoadError: a load raised; it says whether the version that served before
                was loaded back (it was, unless ``previous`` lacked a bucket or a load of it
                raised too).
        """
        touched: list[list[str]] = []
        try:
            for names, tensors in self.loads:
                touched.append(names)  # a load that raises may have written part of it
                load(tensors)
        except Exception as error:
            restored = _load_back(load, previous, touched)
            raise WeightLoadError(
                f"the load raised: {type(error).__name__}: {error}. "
                + (
                    f"{version} was loaded back, complete"
                    if restored is None
                    else f"{version} could not be loaded back ({restored}): the loaded "
                    "weights mix two versions until an export goes through"
                )
            ) from error
        finally:
            self.loads = []


def _load_back(
    load: Callable[[Tensors], None],
    previous: Callable[[list[str]], Tensors | None],
    touched: list[list[str]],
) -> str | None:
    """Load the serving version's tensors of ``touched`` buckets; None, or why it could not."""
    for names in touched:
        tensors = previous(names)
        if tensors is None:
            return f"the receiver holds no earlier tensors of {', '.join(names)}"
        try:
            load(tensors)
        except Exception as error:
            return f"{type(error).__name__}: {error}"
    return None


# Integers as wide as each element size: an element's bits, as ``ChangedElements`` steps them.
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def partial_load_error(
    manifest: ExportManifest | None, loaded: Sequence[str], bucket: int, error: Exception
) -> WeightLoadError:
    """The error of a load that failed after some tensors were written: it names them."""
    export = "the export" if manifest is None else f"export {manifest.export_id}"
    done = ", ".join(loaded) if loaded else "none"
    return WeightLoadError(
        f"{export} failed loading bucket {bucket}: {type(error).__name__}: {error}. Tensors "
        f"already written (the receiver holds the new values for these only): {done}"
    )
