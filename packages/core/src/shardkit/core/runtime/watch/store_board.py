"""The c10d store as a board: each rank posts where it is, one rank writes the verdict.

Three watches talk through the store rather than through collectives, because their whole
point is that a collective may never complete: the hang watch (``hang.py``: each rank's
progress, the alarm, the reports), the stuck check (``stuck.py``: each waiting rank's record,
rank 0's verdict) and the weight export's watch (``runtime/export/export_groups.py``: each
rank's beat, the export's verdict). They read and write it the same three ways, here:

- ``post``: a rank's own key, overwritten (progress, a beat);
- ``read``: any key, None while nobody wrote it (``check`` first: ``get`` would block until
  it exists, and a watch must never wait on a peer);
- ``decide``: the first verdict written stays (``compare_set`` from absent), and every rank
  reads that one, so all raise the same message however many found the fault at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.distributed_c10d import Store

__all__ = ["StoreBoard"]


@dataclass(frozen=True, slots=True)
class StoreBoard:
    """Posts and verdicts in one store (or under one prefix of it)."""

    store: Store | None
    """None where there is no store (a single process): posts fail, reads find nothing."""
    tolerant: bool = True
    """Whether a failing store reads as absent (False from ``post``, None from ``read``)
    rather than raising: the hang watch's thread outlives the process group at shutdown, when
    the store server may be gone. The export's watch runs inside a live export and raises."""

    def post(self, key: str, value: str) -> bool:
        """Set ``key`` to ``value``; False if the store is absent or (tolerant) unreachable."""
        if self.store is None:
            return False
        try:
            self.store.set(key, value)
        except Exception:  # a destroyed process group, a store server gone at shutdown
            if not self.tolerant:
                raise
            return False
        return True

    def read(self, key: str) -> str | None:
        """The value of ``key``; None while absent (or, tolerant, if the store is gone)."""
        if self.store is None:
            return None
        try:
            if not self.store.check([key]):
                return None
            return self.store.get(key).decode()
        except Exception:  # a peer's record cannot be read: the caller reports what can be
            if not self.tolerant:
                raise
            return None

    def decide(self, key: str, verdict: str) -> str:
        """Write ``verdict`` under ``key`` unless a verdict is there already; the one kept."""
        if self.store is None:
            return verdict
        stored = self.store.compare_set(key, "", verdict)
        return stored.decode() if stored else verdict
