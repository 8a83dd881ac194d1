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

Both hold the last export whole in this process (``holds_export``): an exporter compares a
delta with that copy on the receiving rank instead of keeping a part there.

Next to split off: :class:`FullTensorReceiver` (its mirror, the rebuild of a delta on it, the
staged loads' commit and abort) into a module of its own, re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar, Protocol, TypeGuard

import torch
from torch import nn

from shardkit.core.errors import WeightLoadError
from shardkit.core.export.messages import ExportManifest, WeightBucket
from shardkit.core.export.transfer import HoldsExport
from shardkit.core.export.versions import StagedLoads, StagedTensors, Tensors

__all__ = [
    "FullTensorReceiver",
    "ModuleReceiver",
    "TensorLoader",
    "VersionedReceiver",
    "WeightReceiver",
    "holds_export",
]

TensorLoader = Callable[[list[tuple[str, torch.Tensor]]], None]
"""Takes one bucket's whole tensors, by name (whole layers: vLLM's loaders need them so)."""


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
            raise _partial_load(self._manifest, self.loaded, bucket.index, error) from error
        self.loaded += written

    def _stage(self, bucket: WeightBucket) -> None:
        staged = self._staged.values
        for name, tensor in bucket.full:
            staged[name] = tensor.detach().clone()
        for name, changes in bucket.changed:
            if changes.count:
                new = self._contiguous(name).clone()
                changes.apply_to(new)
                staged[name] = new

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
            names = list(self._staged.values)
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


class FullTensorReceiver:
    """Hands every bucket's tensors, whole, to ``load``: delta exports rebuilt on a mirror.

    Args:
        load: called once per bucket with its ``(name, whole tensor)`` list.
        transform: optional, applied to each bucket's list before ``load`` (fuse q/k/v, rename
            for a receiver whose layout differs). Whole layers come in one bucket.
        keep_mirror: keep the last export's tensors (needed for delta exports, and to load
            them back where a commit's load raises; a full-only receiver that streams can drop
            them to save the memory).
        all_or_nothing: call ``load`` only at the commit, every bucket in turn; if one raises,
            load the mirror's tensors of the buckets already loaded back (memory: the staged
            export, one more copy of what it changes). False calls ``load`` per bucket as it
            comes.

    Raises:
        ValueError: ``all_or_nothing`` without ``keep_mirror`` (nothing to load back).
    """

    loads_back_itself: ClassVar[bool] = False
    """A subclass whose commit puts the last version back on its own needs no mirror for it."""

    def __init__(
        self,
        load: TensorLoader,
        *,
        transform: Callable[[list[tuple[str, torch.Tensor]]], list[tuple[str, torch.Tensor]]]
        | None = None,
        keep_mirror: bool = True,
        all_or_nothing: bool = True,
    ) -> None:
        if all_or_nothing and not keep_mirror and not self.loads_back_itself:
            raise ValueError(
                "FullTensorReceiver(all_or_nothing=True) needs keep_mirror=True: the mirror is "
                "what it loads back where a commit's load raises"
            )
        self.load = load
        self.transform = transform
        self.keep_mirror = keep_mirror
        self.all_or_nothing = all_or_nothing
        self.mirror: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        """The export loaded complete, which the mirror holds (None: none, or one failed)."""
        self._manifest: ExportManifest | None = None
        self._next_mirror: dict[str, torch.Tensor] = {}
        self._patched = False
        """A delta was patched into the mirror in place since the last commit."""
        self._staged = StagedLoads()
        self.loaded: list[str] = []

    def begin(self, manifest: ExportManifest) -> None:
        """Check a delta against the mirror (the export it is relative to, all tensors)."""
        if manifest.kind == "delta":
            if not self.keep_mirror:
                raise WeightLoadError("a delta export needs FullTensorReceiver(keep_mirror=True)")
            if self.version != manifest.export_id - 1:
                raise WeightLoadError(
                    f"delta export {manifest.export_id} is relative to export "
                    f"{manifest.export_id - 1}, but this receiver holds "
                    f"{'none' if self.version is None else self.version}; export in "
                    "full first (exporter.reset())"
                )
            _check_mirror(self.mirror, manifest)
        elif self.loads_back_itself:
            # Nothing loads the mirror back here: a full export replaces it whole, so it is
            # not held twice (a delta after a failed full export is refused: "not held").
            self.mirror = {}
        self._manifest, self.loaded = manifest, []
        self._next_mirror, self._staged = {}, StagedLoads()

    def receive(self, bucket: WeightBucket) -> None:
        """Rebuild the bucket's whole tensors; stage them (or hand them to ``load``)."""
        tensors = self._whole_tensors(bucket)
        if self.transform is not None:
            tensors = self.transform(tensors)
        if self.all_or_nothing:
            self._stage(bucket.names, tensors)
            return
        try:
            self.load(tensors)
        except Exception as error:
            self.version = None
            raise _partial_load(self._manifest, self.loaded, bucket.index, error) from error
        self.loaded += bucket.names

    def _stage(self, names: list[str], tensors: Tensors) -> None:
        """Keep one bucket's tensors for the commit (a receiver may send them on now)."""
        self._staged.loads.append((names, tensors))

    def _apply(self) -> None:
        """Make the staged loads, all of them, or load the serving version back (the commit)."""
        serving = "no export" if self.version is None else f"export {self.version}"
        self._staged.load_all(self.load, self._held, serving)

    def _held(self, names: list[str]) -> Tensors | None:
        """The mirror's tensors of ``names``, as the load takes them (None: not all held)."""
        if self.version is None or any(name not in self.mirror for name in names):
            return None
        tensors = [(name, self.mirror[name]) for name in names]
        return self.transform(tensors) if self.transform is not None else tensors

    @property
    def holds_exports(self) -> bool:
        """The mirror holds the last export whole: a delta's base on this rank."""
        return self.keep_mirror

    def held_tensor(self, name: str) -> torch.Tensor | None:
        """The mirror's tensor ``name`` of export :attr:`version` (None: not held)."""
        if self.version is None or self._manifest is not None:
            return None
        return self.mirror.get(name)

    @property
    def _patches_mirror(self) -> bool:
        """Whether a delta is applied to the mirror in place.

        Where the mirror is never loaded back (the engine puts itself back, or loads come
        bucket by bucket and a failure leaves a mix anyway), each changed tensor is patched
        where it lies, not rebuilt beside it: no second copy of the model during a delta.
        """
        return self.loads_back_itself or not self.all_or_nothing

    def _whole_tensors(self, bucket: WeightBucket) -> Tensors:
        """The bucket's whole tensors; the mirror untouched unless :attr:`_patches_mirror`."""
        tensors: Tensors = []
        for name, tensor in bucket.full:
            if self.keep_mirror or self.all_or_nothing:
                # Kept past this call (a transport's tensors view its buffer only during it).
                tensor = tensor.clone() if tensor.data_ptr() else tensor
            if self.keep_mirror:
                self._next_mirror[name] = tensor
            tensors.append((name, tensor))
        for name, changes in bucket.changed:
            mirrored = self.mirror[name]
            if changes.count:
                if self._patches_mirror:
                    self._patched = True  # the mirror now mixes two versions until the commit
                else:
                    # A copy patched: the mirror keeps the version that serves until the commit.
                    mirrored = mirrored.clone()
                changes.apply_to(mirrored)
                self._next_mirror[name] = mirrored
            tensors.append((name, mirrored))
        return tensors

    def commit(self) -> None:
        """Every bucket arrived: load them all (or put the last export back), then switch."""
        if self._manifest is None:
            return  # committed already, or nothing began
        if self.all_or_nothing:
            try:
                self._apply()
            except WeightLoadError as error:
                raise WeightLoadError(f"export {self._manifest.export_id}: {error}") from error
            self.loaded = [entry.name for entry in self._manifest.tensors]
        self.mirror.update(self._next_mirror)
        self._next_mirror = {}
        self._patched = False
        self.version = self._manifest.export_id
        self._manifest = None

    def finish(self) -> None:
        """The export went through (committed here if the exporter did not)."""
        self.commit()

    def abort(self, error: BaseException) -> None:
        """The export failed: staged tensors dropped; the mirror still holds ``version``.

        Unless a delta was patched into it in place: then it mixes two versions and is
        dropped (``version`` None); the exporter's next export is full and rebuilds it.
        """
        if self._manifest is not None and not self.all_or_nothing:
            self.version = None  # loaded bucket by bucket: part of it may be in
        if self._patched:
            self.mirror, self.version, self._patched = {}, None, False
        self._manifest = None
        self._next_mirror, self._staged = {}, StagedLoads()


def _check_mirror(mirror: dict[str, torch.Tensor], manifest: ExportManifest) -> None:
    problems = []
    for entry in manifest.tensors:
        held = mirror.get(entry.name)
        if held is None:
            problems.append(f"{entry.name}: not held")
        elif tuple(held.shape) != entry.shape or held.dtype != entry.dtype:
            problems.append(f"{entry.name}: held as {list(held.shape)} {held.dtype}")
    if problems:
        raise WeightLoadError(
            f"delta export {manifest.export_id} does not match the weights held; nothing was "
            "written: " + "; ".join(problems)
        )


def _partial_load(
    manifest: ExportManifest | None, loaded: Sequence[str], bucket: int, error: Exception
) -> WeightLoadError:
    """The error of a load that failed after some tensors were written: it names them."""
    export = "the export" if manifest is None else f"export {manifest.export_id}"
    done = ", ".join(loaded) if loaded else "none"
    return WeightLoadError(
        f"{export} failed loading bucket {bucket}: {type(error).__name__}: {error}. Tensors "
        f"already written (the receiver holds the new values for these only): {done}"
    )
