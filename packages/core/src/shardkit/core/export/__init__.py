"""Weights to an inference engine: a sharded model's weights, out of its shards, in buckets.

:class:`WeightExporter` (every rank of the model's mesh) sends the weights, whole or as the
elements changed since its last export, in the receiver's dtype, a bucket of whole layers at a
time, to a :class:`WeightReceiver`: in the same process (:class:`ModuleReceiver`,
:class:`FullTensorReceiver`, ``shardkit.core.export.vllm``), through shared memory to another
process on the host (:class:`SharedMemorySender`), or to receiver processes over a group of
their own (:class:`GroupSender`). See docs/guide/export.md.
"""

# The plan's arithmetic (buckets, names, gathers) is published too: shardkit-plan repeats an
# export's layout from a model on the meta device with the export's own rules.
from typing import Any

from shardkit.core.export import axis_gathers
from shardkit.core.export.axis_gathers import AxisGather, TensorSource
from shardkit.core.export.buckets import (
    ExportBucket,
    default_layer_of,
    export_sources,
    plan_buckets,
)
from shardkit.core.export.export_options import (
    ExportOptions,
    ExportReport,
    check_shape_options,
)
from shardkit.core.export.exporter import WeightExporter, export_weights
from shardkit.core.export.group_transport import (
    GroupSender,
    ReceiverGroupSpec,
    serve_receiver_group,
)
from shardkit.core.export.messages import (
    ChangedElements,
    ExportedTensor,
    ExportKind,
    ExportManifest,
    WeightBucket,
)
from shardkit.core.export.receivers import (
    FullTensorReceiver,
    ModuleReceiver,
    TensorLoader,
    WeightReceiver,
)
from shardkit.core.export.shared_memory import SharedMemorySender, serve_shared_memory
from shardkit.core.export.transfer import TransferCounts

__all__ = [
    "AxisGather",
    "ChangedElements",
    "ExportBucket",
    "ExportKind",
    "ExportManifest",
    "ExportOptions",
    "ExportReport",
    "ExportedTensor",
    "FullTensorReceiver",
    "GroupSender",
    "ModuleReceiver",
    "ReceiverGroupSpec",
    "SharedMemorySender",
    "TensorLoader",
    "TensorSource",
    "TransferCounts",
    "WeightBucket",
    "WeightExporter",
    "WeightReceiver",
    "check_shape_options",
    "default_layer_of",
    "export_sources",
    "export_weights",
    "plan_buckets",
    "serve_receiver_group",
    "serve_shared_memory",
]


def __getattr__(name: str) -> Any:
    """The published names kept under their old spelling, with a DeprecationWarning."""
    if name == "Stage":
        return getattr(axis_gathers, name)  # the warning is the axis_gathers module's
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
