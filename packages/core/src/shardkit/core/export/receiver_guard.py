"""Receiver work under the export's watch: timed, and its failure every rank's verdict.

Both exporters (``WeightExporter``'s bucket transfer and the TP-sliced exporter) hand the
receiver its calls (begin, each bucket, commit, finish) through :func:`guard_receiver`, so a
receiver that raises or outlasts the bound ends the export on every rank with one error.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from shardkit.core.runtime.export.export_groups import ExportWatch
from shardkit.core.runtime.groups import global_rank

__all__ = ["guard_receiver", "receiver_outcome"]


def guard_receiver(
    watch: ExportWatch | None,
    work: Callable[[], None],
    label: str,
    *,
    export: str,
    receiver: str,
) -> float:
    """Runs receiver ``work`` timed; the seconds it took.

    Its failure, or its taking longer than the watch's bound, becomes the watch's verdict, so
    every rank raises the same error (without a watch, W=1, the failure is raised as it is).
    ``export`` and ``receiver`` name both in the message ("weight export 5", "the receiver").
    """
    seconds, failure = receiver_outcome(watch, work, label, export=export, receiver=receiver)
    if failure is not None:
        assert watch is not None
        raise watch.give_verdict(failure[0]) from failure[1]
    return seconds


def receiver_outcome(
    watch: ExportWatch | None,
    work: Callable[[], None],
    label: str,
    *,
    export: str,
    receiver: str,
) -> tuple[float, tuple[str, BaseException | None] | None]:
    """Runs receiver ``work`` timed, as :func:`guard_receiver`, but gives no verdict.

    Returns the seconds and, where it failed or was late, the verdict's text and the error
    (for the caller to give once its peers know: the TP-sliced exporter's agreement after
    ``begin``). Without a watch (W=1) a failure is raised as it is.
    """
    if watch is not None:
        watch.post(f"the receiver, {label}")
    start = time.perf_counter()
    try:
        work()
    except Exception as error:
        if watch is None:
            raise
        text = (
            f"{export}: {receiver} on rank {global_rank()} failed at {label}: "
            f"{type(error).__name__}: {error}"
        )
        return time.perf_counter() - start, (text, error)
    seconds = time.perf_counter() - start
    if watch is not None and seconds > watch.bound_s:
        late = (
            f"{export}: rank {global_rank()} is late: its receiver took {seconds:.1f} s at "
            f"{label} (bound {watch.bound_s:g} s, SHARDKIT_EXPORT_BOUND)"
        )
        return seconds, (late, None)
    return seconds, None
