"""Receivers: what takes an export's buckets, and the two adaptors every loader needs.

A :class:`WeightReceiver` is called on the trainer ranks that receive (in the same process:
the colocated mode) or by a transport's serving loop in another process. The exporter calls
``begin`` with the manifest, ``receive`` once per bucket in order, then ``finish`` once every
trainer rank has agreed the export went through, or ``abort`` with the error every rank raises.

- :class:`ModuleReceiver` writes into a module's own tensors in place (a transformers model
  whose names and layouts match): whole tensors copied, changes scattered. It checks the whole
  manifest against the module before the first write, and if a bucket fails later its error
  names exactly the tensors already written.
- :class:`FullTensorReceiver` turns a delta export back into whole tensors, bit-identical to a
  full export, for loaders that take only whole tensors (vLLM's ``load_weights`` /
  ``reload_weights``, a safetensors writer). It keeps one copy of the weights in the export
  dtype (what a delta is relative to) and hands each bucket's tensors, whole, to a callable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from shardkit.core.errors import WeightLoadError
from shardkit.core.export.messages import ExportManifest, WeightBucket

__all__ = [
    "FullTensorReceiver",
    "ModuleReceiver",
    "TensorLoader",
    "WeightReceiver",
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


class ModuleReceiver:
    """Writes exports into ``module``'s parameters and buffers, in place, by state-dict name.

    Args:
        module: the receiving model (not sharded); its tensors must have the exported names,
            shapes and dtypes (tied weights: writing one name writes both).
        strict: True refuses a manifest that leaves out one of the module's tensors.
    """

    def __init__(self, module: nn.Module, *, strict: bool = False) -> None:
        self.module = module
        self.strict = strict
        self.loaded: list[str] = []
        self._manifest: ExportManifest | None = None
        self._targets: dict[str, torch.Tensor] = {}

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

    def receive(self, bucket: WeightBucket) -> None:
        """Copy whole tensors, scatter changes; a failure names what was written."""
        written: list[str] = []
        try:
            with torch.no_grad():
                for name, tensor in bucket.full:
                    self._targets[name].copy_(tensor)
                    written.append(name)
                for name, changes in bucket.changed:
                    target = self._targets[name]
                    if not target.is_contiguous():
                        raise WeightLoadError(f"{name}: the module's tensor is not contiguous")
                    changes.apply_to(target)
                    written.append(name)
        except Exception as error:
            self.loaded += written
            raise _partial_load(self._manifest, self.loaded, bucket.index, error) from error
        self.loaded += written

    def finish(self) -> None:
        """The export went through."""
        self._manifest = None

    def abort(self, error: BaseException) -> None:
        """The export failed on some rank."""
        self._manifest = None


class FullTensorReceiver:
    """Hands every bucket's tensors, whole, to ``load``: delta exports rebuilt on a mirror.

    Args:
        load: called once per bucket with its ``(name, whole tensor)`` list.
        transform: optional, applied to each bucket's list before ``load`` (fuse q/k/v, rename
            for a receiver whose layout differs). Whole layers come in one bucket.
        keep_mirror: keep the last export's tensors (needed for delta exports; a full-only
            receiver can drop them to save the memory).
    """

    def __init__(
        self,
        load: TensorLoader,
        *,
        transform: Callable[[list[tuple[str, torch.Tensor]]], list[tuple[str, torch.Tensor]]]
        | None = None,
        keep_mirror: bool = True,
    ) -> None:
        self.load = load
        self.transform = transform
        self.keep_mirror = keep_mirror
        self.mirror: dict[str, torch.Tensor] = {}
        self._manifest: ExportManifest | None = None
        self._last_export: int | None = None
        self.loaded: list[str] = []

    def begin(self, manifest: ExportManifest) -> None:
        """Check a delta against the mirror (the export it is relative to, all tensors)."""
        if manifest.kind == "delta":
            if not self.keep_mirror:
                raise WeightLoadError("a delta export needs FullTensorReceiver(keep_mirror=True)")
            if self._last_export != manifest.export_id - 1:
                raise WeightLoadError(
                    f"delta export {manifest.export_id} is relative to export "
                    f"{manifest.export_id - 1}, but this receiver holds "
                    f"{'none' if self._last_export is None else self._last_export}; export in "
                    "full first (exporter.reset())"
                )
            _check_mirror(self.mirror, manifest)
        self._manifest, self.loaded = manifest, []

    def receive(self, bucket: WeightBucket) -> None:
        """Rebuild the bucket's whole tensors and hand them to ``load``."""
        tensors = self._whole_tensors(bucket)
        if self.transform is not None:
            tensors = self.transform(tensors)
        try:
            self.load(tensors)
        except Exception as error:
            raise _partial_load(self._manifest, self.loaded, bucket.index, error) from error
        self.loaded += bucket.names

    def _whole_tensors(self, bucket: WeightBucket) -> list[tuple[str, torch.Tensor]]:
        tensors: list[tuple[str, torch.Tensor]] = []
        for name, tensor in bucket.full:
            if self.keep_mirror:
                self.mirror[name] = tensor.clone() if tensor.data_ptr() else tensor
            tensors.append((name, tensor))
        for name, changes in bucket.changed:
            # The mirror is patched in place, and loaders copy what they take: the tensor
            # handed on is the mirror's own (no second copy of the layer).
            mirrored = self.mirror[name]
            changes.apply_to(mirrored)
            tensors.append((name, mirrored))
        return tensors

    def finish(self) -> None:
        """The export went through: the mirror now holds it."""
        if self._manifest is not None:
            self._last_export = self._manifest.export_id
        self._manifest = None

    def abort(self, error: BaseException) -> None:
        """The export failed: the next one must be full."""
        # The mirror may hold part of the failed export: the next one must be full.
        self._last_export = None
        self._manifest = None


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
