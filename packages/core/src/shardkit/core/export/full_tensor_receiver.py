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

import os
from collections.abc import Callable, MutableMapping
from typing import ClassVar

import torch

from shardkit.core.errors import WeightLoadError
from shardkit.core.export.messages import ExportManifest, WeightBucket
from shardkit.core.export.mirror_files import MirrorFiles
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
        mirror_dir: keep the mirror in files under this folder (a private folder of its own
            is made there and removed with the receiver) instead of in memory: the process
            then holds one bucket's tensors at a time and a delta reads the tensors it changes
            back from the files (``mirror_files.py``). Where the mirror is patched in place
            (streamed, or an engine that puts itself back) the files are rewritten in place
            and dropped if an export fails; otherwise the last export's stay whole until the
            commit. For deltas where the engine cannot give its weights back and memory is
            what runs out; use a disk, not a tmpfs such as /dev/shm, which is memory again.

    Raises:
        ValueError: ``all_or_nothing`` without ``keep_mirror`` (nothing to load back), or
            ``mirror_dir`` without it.
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
        mirror_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if mirror_dir is not None and not keep_mirror:
            raise ValueError(
                "FullTensorReceiver(mirror_dir=...) keeps the mirror in files: it needs "
                "keep_mirror=True"
            )
        if all_or_nothing and not keep_mirror and not self.loads_back_itself:
            raise ValueError(
                "FullTensorReceiver(all_or_nothing=True) needs keep_mirror=True: the mirror is "
                "what it loads back where a commit's load raises"
            )
        self.load = load
        self.transform = transform
        self.keep_mirror = keep_mirror
        self.all_or_nothing = all_or_nothing
        self._mirror_dir = mirror_dir
        self.mirror = self._store("mirror")
        self.version: int | None = None
        """The export loaded complete, which the mirror holds (None: none, or one failed)."""
        self._manifest: ExportManifest | None = None
        self._next_mirror = self._store("next")
        self._patched = False
        """A delta was patched into the mirror in place since the last commit."""
        self._staged = StagedLoads()
        self.loaded: list[str] = []

    def _store(self, label: str) -> MutableMapping[str, torch.Tensor]:
        """An empty mirror: a dict, or files under ``mirror_dir``."""
        return {} if self._mirror_dir is None else MirrorFiles(self._mirror_dir, label)

    @property
    def _mirror_in_files(self) -> bool:
        return isinstance(self.mirror, MirrorFiles)

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
        elif self.loads_back_itself and not self._mirror_in_files:
            # Nothing loads the mirror back here: a full export replaces it whole, so it is
            # not held twice (a delta after a failed full export is refused: "not held").
            # Files are rewritten in place instead (and dropped if the export fails).
            self.mirror.clear()
        self._manifest, self.loaded = manifest, []
        self._next_mirror.clear()
        self._staged = StagedLoads()

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

    def held_span(
        self, name: str, start: int, count: int
    ) -> tuple[tuple[int, ...], torch.dtype, torch.Tensor] | None:
        """The mirror's ``name``: its shape, its dtype and a flat run of its elements.

        The run is elements ``[start, start + count)``; None where ``name`` is not held. From
        files only those elements are read (a delta's base rows on the receiving rank).
        """
        if self.version is None or self._manifest is not None:
            return None
        if isinstance(self.mirror, MirrorFiles):
            spec = self.mirror.spec(name)
            return None if spec is None else (*spec, self.mirror.read_span(name, start, count))
        held = self.mirror.get(name)
        if held is None or not held.is_contiguous():
            return None
        return tuple(held.shape), held.dtype, held.reshape(-1)[start : start + count]

    @property
    def _keeps_tensors(self) -> bool:
        """Whether a bucket's tensors are held past its ``receive`` (so copied out of it).

        A transport's tensors view its buffer only during the call: the staged loads and a
        mirror in memory keep them; a mirror in files writes them out during it instead.
        """
        return self.all_or_nothing or (self.keep_mirror and not self._mirror_in_files)

    @property
    def _patches_mirror(self) -> bool:
        """Whether a delta is applied to the mirror in place.

        Where the mirror is never loaded back (the engine puts itself back, or loads come
        bucket by bucket and a failure leaves a mix anyway), each changed tensor is patched
        where it lies, not rebuilt beside it: no second copy of the model during a delta.
        A mirror in files is rewritten in place there (its pages are in the page cache
        already: several times faster than new files); elsewhere a tensor is read into a new
        one and written to new files, and the last export's stay whole until the commit.
        """
        return self.loads_back_itself or not self.all_or_nothing

    def _whole_tensors(self, bucket: WeightBucket) -> Tensors:
        """The bucket's whole tensors; the mirror untouched unless :attr:`_patches_mirror`."""
        tensors: Tensors = []
        kept = self._keeps_tensors
        in_place = self._patches_mirror and self._mirror_in_files
        for name, tensor in bucket.full:
            if kept:
                tensor = tensor.clone() if tensor.data_ptr() else tensor
            if in_place:
                self.mirror[name] = tensor  # its file rewritten: the mirror mixes versions
                self._patched = True
            elif self.keep_mirror:
                if self._patches_mirror and self.mirror.pop(name, None) is not None:
                    # A plain bucket of a delta export (dense: sent whole): version k's
                    # tensor dropped as k+1's arrives, not held beside it until the commit
                    # (the model twice at a dense delta's peak); the mirror mixes versions.
                    self._patched = True
                self._next_mirror[name] = tensor
            tensors.append((name, tensor))
        for name, changes in bucket.changed:
            mirrored = self.mirror[name]  # from a file: a new tensor already
            if changes.count:
                if self._patches_mirror:
                    self._patched = True  # the mirror now mixes two versions until the commit
                elif not self._mirror_in_files:
                    # A copy patched: the mirror keeps the version that serves until the commit.
                    mirrored = mirrored.clone()
                changes.apply_to(mirrored)
                if in_place:
                    self.mirror[name] = mirrored
                else:
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
        if isinstance(self.mirror, MirrorFiles) and isinstance(self._next_mirror, MirrorFiles):
            self.mirror.take_from(self._next_mirror)  # renamed into place, not copied
            if self._manifest.kind == "full":  # rewritten in place: drop what it no longer has
                for name in set(self.mirror) - {e.name for e in self._manifest.tensors}:
                    del self.mirror[name]
        else:
            self.mirror.update(self._next_mirror)
            self._next_mirror.clear()
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
            self.mirror.clear()
            self.version, self._patched = None, False
        self._manifest = None
        self._next_mirror.clear()
        self._staged = StagedLoads()


def _held_spec(
    mirror: MutableMapping[str, torch.Tensor], name: str
) -> tuple[tuple[int, ...], torch.dtype] | None:
    """The shape and dtype the mirror holds under ``name``, reading no file."""
    if isinstance(mirror, MirrorFiles):
        return mirror.spec(name)
    held = mirror.get(name)
    return None if held is None else (tuple(held.shape), held.dtype)


def _check_mirror(mirror: MutableMapping[str, torch.Tensor], manifest: ExportManifest) -> None:
    problems = []
    for entry in manifest.tensors:
        held = _held_spec(mirror, entry.name)
        if held is None:
            problems.append(f"{entry.name}: not held")
        elif held != (entry.shape, entry.dtype):
            problems.append(f"{entry.name}: held as {list(held[0])} {held[1]}")
    if problems:
        raise WeightLoadError(
            f"delta export {manifest.export_id} does not match the weights held; nothing was "
            "written: " + "; ".join(problems)
        )
