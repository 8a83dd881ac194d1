"""The receiver for loaders that take only whole tensors: :class:`FullTensorReceiver`.

vLLM's ``load_weights`` / ``reload_weights`` and a safetensors writer take whole tensors, so a
delta export is turned back into them here, bit-identical to a full export: the receiver keeps
one copy of the weights in the export dtype (its mirror: what a delta is relative to), patches
a delta's changes into it, and hands each bucket's tensors, whole, to a callable. Staged (all
or nothing, the default), the loads are made at the commit and version k is loaded back from
the mirror if one raises (``versions.StagedLoads``); streamed, each bucket is loaded as it
comes. Its own module beside ``receivers.py`` (which re-exports it): the mirror, its rebuild of
a delta, and the staged loads' commit and abort are a concept of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from shardkit.core.errors import WeightLoadError
from shardkit.core.export.messages import ExportManifest, WeightBucket
from shardkit.core.export.versions import StagedLoads, Tensors, partial_load_error

__all__ = ["FullTensorReceiver", "TensorLoader"]

TensorLoader = Callable[[list[tuple[str, torch.Tensor]]], None]
"""Takes one bucket's whole tensors, by name (whole layers: vLLM's loaders need them so)."""


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
            raise partial_load_error(self._manifest, self.loaded, bucket.index, error) from error
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
                if self._patches_mirror and self.mirror.pop(name, None) is not None:
                    # A plain bucket of a delta export (dense: sent whole): version k's
                    # tensor dropped as k+1's arrives, not held beside it until the commit
                    # (the model twice at a dense delta's peak); the mirror mixes versions.
                    self._patched = True
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
