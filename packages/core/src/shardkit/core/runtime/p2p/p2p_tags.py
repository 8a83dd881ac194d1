"""The core's point-to-point tags: one table, one owner for each tag.

gloo pairs a receive with the next message from the same sender that carries the same tag,
whatever that message holds. Two kinds of message between the same two ranks of a group, with
one tag, could pair with each other: a receive paired with a longer message aborts the process,
and one paired with a message of the same size mixes data silently. So each kind of message
has tags of its own, listed here beside the module that owns them (the one that decides when
they are sent), and every ``isend`` and ``irecv`` of the core takes its tag from this table.
``tests/core/runtime/test_p2p_tags.py`` checks that no two blocks overlap, that each block is
named by its owner alone, and that no module spells a tag as a number of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DATA_BY_FINGERPRINT",
    "EXPORT_GATHER",
    "FINGERPRINTS",
    "GATHER_EXCHANGE",
    "OBJECT_TRANSFERS",
    "PEER_TRANSFER",
    "REDUCE_EXCHANGE",
    "STEP_CHECK",
    "TABLE",
    "TagBlock",
]


@dataclass(frozen=True, slots=True)
class TagBlock:
    """Tags ``first`` to ``first + count - 1``: one kind of message, owned by one module."""

    owner: str
    """The runtime module that owns these tags, by its name (``desync``: ``watch/desync.py``)."""
    first: int
    count: int = 1

    def tag(self, offset: int = 0) -> int:
        """The block's ``offset``-th tag (a block of one tag has offset 0 only)."""
        return self.first + offset


GATHER_EXCHANGE = TagBlock("collectives", 1)
"""gloo's all-gather, run as an exchange of rows. Not the reductions' tag: the next group's
all-gather (prefetch) is in flight to a peer while this group's reduce-scatter is."""

REDUCE_EXCHANGE = TagBlock("collectives", 2)
"""gloo's reduce-scatter, run as an exchange of rows and a local sum, and the exchange that
carries a compressed reduce-scatter (``ProcessGroupRuntime.exchange_rows``)."""

OBJECT_TRANSFERS = TagBlock("object_collectives", 3)
"""Whole objects gathered to a group's first rank and scattered back, between steps (state
dicts, checkpoints)."""

STEP_CHECK = TagBlock("step_check", 4)
"""The step check's digests, exchanged on the step's own groups. The check exists for ranks that
ran different collectives: a rank that checks while a peer still sends a gather, a reduction or
a whole object must not receive those bytes as digests, nor they its digests."""

_FINGERPRINTS_FIRST = 1 << 10
_DATA_FIRST = 1 << 20

PEER_TRANSFER = TagBlock("peer_transfer", 5, _FINGERPRINTS_FIRST - 5)
"""Memory snapshots to a peer and back, one tag per part of a transfer (a snapshot's header and
data, then each log entry's): a pair of ranks posts all its parts at once, and a receiver must
never write one part into another's tensor."""

FINGERPRINTS = TagBlock("desync", _FINGERPRINTS_FIRST, _DATA_FIRST - _FINGERPRINTS_FIRST)
"""The desync checks' fingerprints, one tag per epoch (desync errors raised on the group so far),
so that messages an error left unmatched never pair with later ones."""

DATA_BY_FINGERPRINT = TagBlock("desync", _DATA_FIRST, 1 << 30)
"""With desync checks on, a gloo exchange's own messages, tagged from its fingerprint instead of
the exchange's fixed tag: the messages of collectives that differ never pair. They end below
2**31, the largest tag c10d takes."""

EXPORT_GATHER = TagBlock("export_groups", _DATA_FIRST + (1 << 30))
"""A weight export's buckets gathered on gloo as point-to-point messages (gloo's own gather
moves about a tenth of the bytes a second here), on the export's own groups."""

TABLE = (
    GATHER_EXCHANGE,
    REDUCE_EXCHANGE,
    OBJECT_TRANSFERS,
    STEP_CHECK,
    PEER_TRANSFER,
    FINGERPRINTS,
    DATA_BY_FINGERPRINT,
    EXPORT_GATHER,
)
"""Every block of tags, in the order of their values."""
