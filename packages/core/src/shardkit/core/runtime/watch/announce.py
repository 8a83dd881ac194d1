"""What the runtime tells observers of each collective: its kind, its bytes, its algorithm.

Subscribers of ``shardkit.core.observe`` (the tools' trackers) get a ``CollectiveEvent``
before the c10d calls that carry a collective out, and a ``CollectiveIssuedEvent`` after them,
so that they can tell those calls from the program's own. The bytes announced as sent are the
least a bandwidth-optimal algorithm sends, whatever the runtime ran: the trackers compare the
two. Nothing is built when nobody listens.
"""

from __future__ import annotations

from shardkit.core import observe

__all__ = ["announce", "announce_issued"]


def announce(kind: str, group_size: int, input_bytes: int, algorithm: str, label: str) -> None:
    """A collective about to be issued: ``input_bytes`` from this rank, over ``group_size``.

    ``kind``: 'all_gather', 'reduce_scatter' (``input_bytes``: all W rows) or 'all_reduce'.
    """
    if not observe.has_subscribers():
        return
    size = group_size
    if kind == "all_gather":
        sent = input_bytes * (size - 1)
    elif kind == "reduce_scatter":
        sent = input_bytes // size * (size - 1)
    else:  # a ring all-reduce: a reduce-scatter then an all-gather
        sent = 2 * input_bytes * (size - 1) // max(size, 1)
    observe.emit(observe.CollectiveEvent(kind, size, input_bytes, sent, algorithm, label))


def announce_issued(kind: str) -> None:
    """The collective announced last is issued (its c10d calls are made)."""
    if observe.has_subscribers():
        observe.emit(observe.CollectiveIssuedEvent(kind))
