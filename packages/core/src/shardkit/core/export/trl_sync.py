"""trl's ``GRPOTrainer`` (colocated vLLM) syncing its weights through the export.

trl 1.16 syncs a colocated engine in ``VLLMGeneration.sync_weights``
(``trl/generation/vllm_generation.py``): for an FSDP2 model every rank walks the parameters,
gathers each one whole with ``full_tensor()`` in fp32, and calls the engine's model's
``load_weights`` with it, one parameter at a time. :func:`sync_through_export` puts a
:class:`TrlExportSync` in its place on the trainer's ``vllm_generation``: every rank exports
from its shards into its own engine (``ExportOptions(to="all")``, one all-gather per bucket of
whole layers, cast to the engine's dtype on the shard), by the loading path the engine's build
offers (``vllm.py``: vLLM's CPU build repacks its linear layers, so trl's ``load_weights``
loop cannot load it there), ``delta=True`` after the first sync.

Call it once the trainer is built and before ``train()``; the exporter is made at the first
sync, once accelerate has sharded the model. It is a documented replacement of one bound
method on one object (trl offers no hook there), made where trl makes the engine, so trl's
generation, scoring and loss are untouched. This module imports neither trl nor vLLM.

See docs/guide/export.md ("trl's GRPOTrainer").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from shardkit.core.export.exporter import ExportOptions, ExportReport, WeightExporter
from shardkit.core.export.vllm import VLLMReceiver, engine_dtype

__all__ = ["TrlExportSync", "sync_through_export"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class TrlExportSync:
    """What trl's ``vllm_generation.sync_weights`` calls once :func:`sync_through_export` ran.

    Calling it exports the trainer's model into this rank's engine; ``reports`` keeps every
    sync's :class:`~shardkit.core.export.exporter.ExportReport`.
    """

    generation: Any
    """trl's ``VLLMGeneration`` (colocate mode): its ``model`` and its ``llm``."""
    delta: bool = True
    """Send only the changed elements after the first sync (a bucket changed past 1/8 goes
    plain: never larger than a full export)."""
    bucket_bytes: int | None = None
    """The export's bucket bound (None: the exporter's default, 64 MiB)."""
    reports: list[ExportReport] = field(default_factory=list)
    """Every sync's report, in order."""
    _exporter: WeightExporter | None = None
    _receiver: VLLMReceiver | None = None

    def __call__(self) -> None:
        """Export the model into this rank's engine (every rank calls it, as trl does)."""
        llm = self.generation.llm
        if getattr(self.generation, "enable_sleep_mode", False):
            llm.wake_up(tags=["weights"])  # trl's own sync wakes the weights first too
            self.generation._llm_weights_sleeping = False
        if self._exporter is None:
            bound: dict[str, Any] = {}
            if self.bucket_bytes is not None:
                bound["bucket_bytes"] = self.bucket_bytes
            options = ExportOptions(dtype=engine_dtype(llm), to="all", **bound)
            self._exporter = WeightExporter(self.generation.model, options)
            self._receiver = VLLMReceiver(llm)
        report = self._exporter.export(self._receiver, delta=self.delta)
        self.reports.append(report)
        logger.info(
            "trl sync %d: %s export, %d bytes sent, %.3f s",
            len(self.reports),
            report.kind,
            report.counts.sent_bytes,
            report.seconds,
        )


def sync_through_export(
    trainer: Any, *, delta: bool = True, bucket_bytes: int | None = None
) -> TrlExportSync:
    """Make ``trainer`` (trl's ``GRPOTrainer``) sync its colocated vLLM through the export.

    Args:
        trainer: a trl ``GRPOTrainer`` built with ``use_vllm=True, vllm_mode="colocate"``,
            its model sharded by FSDP2 (accelerate's ``fsdp_version: 2``) or unsharded.
        delta: see :attr:`TrlExportSync.delta`.
        bucket_bytes: see :attr:`TrlExportSync.bucket_bytes`.

    Returns:
        The sync now in ``trainer.vllm_generation.sync_weights`` (its ``reports``).

    Raises:
        ValueError: the trainer does not use vLLM, uses it in server mode, or trains a PEFT
            model (whose adapters trl merges before its sync; the export sends the state
            dict as it is).
    """
    generation = getattr(trainer, "vllm_generation", None)
    if not getattr(trainer, "use_vllm", False) or generation is None:
        raise ValueError(f"{type(trainer).__name__}: no vLLM to sync (build it with use_vllm=True)")
    if generation.mode != "colocate":
        raise ValueError(
            f"{type(trainer).__name__}: vllm_mode={generation.mode!r}; the export's trl sync "
            'is for vllm_mode="colocate" (its engine in each training process)'
        )
    if hasattr(generation.model, "peft_config"):
        raise ValueError(
            f"{type(trainer).__name__}: a PEFT model; trl merges its adapters before syncing, "
            "which the export does not do"
        )
    sync = TrlExportSync(generation=generation, delta=delta, bucket_bytes=bucket_bytes)
    generation.sync_weights = sync
    return sync
