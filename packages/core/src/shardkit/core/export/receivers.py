"""Receivers: what takes an export's buckets, and the two adaptors every loader needs.

A :class:`WeightReceiver` is called on the trainer ranks that receive (in the same process:
the colocated mode) or by a transport's serving loop in another process. The exporter calls
``begin`` with the manifest, ``receive`` once per bucket in order, then ``finish`` once every
trainer rank has agreed the export went through, or ``abort`` with the error every rank raises.
A receiver that switches versions at once also has ``commit`` (``versions.py``): the exporter
calls it after the last bucket, before the ranks' last agreement; ``finish`` commits if no one
did. Both receivers here are all or nothing by default: they serve export k complete until
export k+1 is complete (their ``version``), staging what changes beside what they serve.

- :class:`ModuleReceiver` writes into a module's own tensors in place (a transformers model
  whose names and layouts match): whole tensors copied, changes scattered. It checks the whole
  manifest against the module before the first write; staged, nothing is written before the
  commit (``all_or_nothing=False``: written bucket by bucket, and a failed bucket's error names
  exactly the tensors already written).
- :class:`FullTensorReceiver` turns a delta export back into whole tensors, bit-identical to a
  full export, for loaders that take only whole tensors (vLLM's ``load_weights`` /
  ``reload_weights``, a safetensors writer). It keeps one copy of the weights in the export
  dtype (what a delta is relative to) and hands each bucket's tensors, whole, to a callable.
  It lives in ``full_tensor_receiver.py`` (its mirror, the rebuild of a delta on it, the staged
  loads' commit and abort) and is re-exported here.

Both hold the last export whole in this process (``holds_export``): an exporter compares a
delta with that copy on the receiving rank instead of keeping a part there.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Protocol, TypeGuard

import torch
from torch import nn

from shardkit.core.errors import WeightLoadError
from shardkit.core.export.full_tensor_receiver import FullTensorReceiver, TensorLoader
from shardkit.core.export.messages import (
    ChangedElements,
    ExportManifest,
    WeightBucket,
    check_changes_fit,
)
from shardkit.core.export.transfer import HoldsExport
from shardkit.core.export.versions import StagedTensors, partial_load_error

__all__ = [
    "FullTensorReceiver",
    "ModuleReceiver",
    "TensorLoader",
    "VersionedReceiver",
    "WeightReceiver",
    "holds_export",
]


class WeightReceiver(Protocol):
    """Takes one export after another: a manifest, its buckets in order, then the outcome."""

    def begin(self, manifest: ExportManifest) -> None:
        """Check the manifest before anything is written; raise to refuse the export."""

    def receive(self, bucket: WeightBucket) -> None:
        """Load one bucket."""

    def finish(self) -> None:
        """Every trainer rank agreed the export went through."""

    def abort(self, error: BaseException) -> None:
        """The export failed (``error`` is what every trainer rank raises)."""


def holds_export(receiver: object) -> TypeGuard[HoldsExport]:
    """Whether ``receiver`` holds its last export whole in this process (its ``held_tensor``).

    The exporter then compares a delta with that copy on the receiving rank instead of keeping
    a part of its own (``delta_find.HeldRows``).
    """
    return getattr(receiver, "holds_exports", False) is True and callable(
        getattr(receiver, "held_tensor", None)
    )


class VersionedReceiver(WeightReceiver, Protocol):
    """A receiver that switches from one export to the next at once (see ``versions.py``)."""

    def commit(self) -> None:
        """Every bucket arrived: serve this export from now on, or raise serving the last."""


class ModuleReceiver:
    """Writes exports into ``module``'s parameters and buffers, in place, by state-dict name.

    Args:
        module: the receiving model (not sharded); its tensors must have the exported names,
            shapes and dtypes (tied weights: writing one name writes both).
        strict: True refuses a manifest that leaves out one of the module's tensors.
        all_or_nothing: stage each export beside the module's tensors and copy it in at the
            commit (memory: one more copy of what the export changes); False writes each
            bucket as it comes, and a failed export leaves the module partly written.
    """

    def __init__(
        self, module: nn.Module, *, strict: bool = False, all_or_nothing: bool = True
    ) -> None:
        self.module = module
        self.strict = strict
        self.all_or_nothing = all_or_nothing
        self.loaded: list[str] = []
        self.version: int | None = None
        """The export the module holds complete (None: none yet, or one failed partway)."""
        self._manifest: ExportManifest | None = None
        self._targets: dict[str, torch.Tensor] = {}
        self._staged = StagedTensors()

    def begin(self, manifest: ExportManifest) -> None:
        """Check every name, shape and dtype against the module; write nothing yet."""
        targets = {
            name: tensor.detach() for name, tensor in self.module.state_dict(keep_vars=True).items()
        }
        problems: list[str] = []
        for entry in manifest.tensors:
            target = targets.get(entry.name)
            if target is None:
                problems.append(f"{entry.name}: not a tensor of {type(self.module).__name__}")
            elif tuple(target.shape) != entry.shape or target.dtype != entry.dtype:
                problems.append(
                    f"{entry.name}: the export sends {list(entry.shape)} {entry.dtype}, the "
                    f"module holds {list(target.shape)} {target.dtype}"
                )
        if self.strict:
            missing = sorted(set(targets) - {entry.name for entry in manifest.tensors})
            problems += [f"{name}: the export does not send it" for name in missing]
        if problems:
            raise WeightLoadError(
                f"export {manifest.export_id} does not fit {type(self.module).__name__}; nothing "
                "was written: " + "; ".join(problems)
            )
        self._manifest, self._targets, self.loaded = manifest, targets, []
        self._staged = StagedTensors()

    def receive(self, bucket: WeightBucket) -> None:
        """Stage (or write) whole tensors and changes; a failure names what was written."""
        if self.all_or_nothing:
            try:
                self._stage(bucket)
            except Exception as error:
                raise WeightLoadError(
                    f"export {self._export_id()} failed staging bucket {bucket.index}: "
                    f"{type(error).__name__}: {error}. Nothing was written: the module holds "
                    f"export {self.version}"
                ) from error
            return
        written: list[str] = []
        try:
            with torch.no_grad():
                for name, tensor in bucket.full:
                    self._targets[name].copy_(tensor)
                    written.append(name)
                for name, changes in bucket.changed:
                    changes.apply_to(self._contiguous(name))
                    written.append(name)
        except Exception as error:
            self.loaded += written
            self.version = None
            raise partial_load_error(self._manifest, self.loaded, bucket.index, error) from error
        self.loaded += written

    def _stage(self, bucket: WeightBucket) -> None:
        staged = self._staged
        changed = [(n, c, self._contiguous(n)) for n, c in bucket.changed if c.count]
        check_changes_fit(changed)  # refused now, not at the commit; the bucket at once
        for name, tensor in bucket.full:
            staged.values[name] = tensor.detach().clone()
        for name, changes, target in changed:
            tied = [n for n in staged.names() if _shares(target, self._targets[n])]
            if not tied:
                # A copy of the changes alone (a few bytes a change, not of the tensor): a
                # transport's bucket views its reused buffer only while it is handed over.
                staged.changes[name] = _kept(changes)
                continue
            # A tied tensor staged under another name too: written in place, its steps would
            # be added twice, so every name of it takes a whole new copy, as before deltas
            # were staged as changes (the last name's is the one the commit leaves).
            for other in tied:
                if other in staged.changes:
                    staged.values[other] = _applied(target, staged.changes.pop(other))
            staged.values[name] = _applied(target, changes)

    holds_exports: ClassVar[bool] = True
    """The module holds the last export whole: a delta's base on this rank (no kept part)."""

    def held_tensor(self, name: str) -> torch.Tensor | None:
        """The module's tensor ``name`` as export :attr:`version` left it (None: not held).

        Staged (the default), an export writes nothing before its commit, and a delta's
        exporter compares with it before its first bucket either way.
        """
        if self.version is None or self._manifest is not None:
            return None
        return self._targets.get(name)

    def _contiguous(self, name: str) -> torch.Tensor:
        target = self._targets[name]
        if not target.is_contiguous():
            raise WeightLoadError(f"{name}: the module's tensor is not contiguous")
        return target

    def _export_id(self) -> int | None:
        return None if self._manifest is None else self._manifest.export_id

    def commit(self) -> None:
        """Copy the staged export into the module, all of it or (on an error) none."""
        if self._manifest is None:
            return  # committed already, or nothing began
        if self.all_or_nothing:
            names = self._staged.names()
            self._staged.copy_into(self._targets)
            self.loaded = names
        self.version = self._manifest.export_id
        self._manifest = None

    def finish(self) -> None:
        """The export went through (committed here if the exporter did not)."""
        self.commit()

    def abort(self, error: BaseException) -> None:
        """The export failed on some rank: staged values dropped (the module holds the last)."""
        if self._manifest is not None and not self.all_or_nothing:
            self.version = None  # written bucket by bucket: part of it may be in
        self._manifest = None
        self._staged = StagedTensors()


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are views of one storage (tied weights under two names)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _applied(target: torch.Tensor, changes: ChangedElements) -> torch.Tensor:
    """A new copy of ``target`` with ``changes`` written in."""
    new = target.clone()
    changes.apply_to(new)
    return new


def _kept(changes: ChangedElements) -> ChangedElements:
    """``changes`` with tensors of their own, to hold past the bucket's hand-over."""
    return dataclasses.replace(
        changes,
        indices=changes.indices.clone(),
        values=changes.values.clone(),
        stepped=None if changes.stepped is None else changes.stepped.clone(),
        steps=None if changes.steps is None else changes.steps.clone(),
    )
