"""Memory snapshots: a restart that loses at most the step in flight, nothing read from disk.

Each step's training state is copied into the node's shared memory and replicated to a peer
on another node.

``MemorySnapshots`` (``memory_snapshots.py``) is the entry point: ``snapshot()`` each step,
``resume()`` after a restart (from memory, else from the newest disk checkpoint of a
``CheckpointManager``). Behind it, in the order a snapshot travels:

- ``contents``: what a snapshot holds (a state's tensors as one byte range, its other values
  as JSON) and the model fingerprint; ``state_copy``: a state's tensors copied into a slot
  (and checked against the layout first), a snapshot written back into a state in place;
- ``format`` and ``checksum``: a snapshot's bytes (header, checksums, data) and every check
  before they are trusted;
- ``slots``: the slot files under ``/dev/shm``;
- ``writer_plan`` and ``writer``: what a rank's writer will do (one frozen value), then the
  copy on the training thread, and checksums, header and the replica's exchange with the
  peer on a thread of its own; ``device_staging`` the accelerator's path (staged on the
  device, moved off the training thread);
- ``gradient_log`` and ``log_replay``: the steps between two whole replicas sent as their
  gradients, and replayed on a lost node;
- ``survey`` and ``restore``: what each rank holds, and the agreed restore.

See [Note: memory snapshots]. Nothing here reaches the engine: a snapshot is of a state dict.
"""

from shardkit.core.snapshots.format import SnapshotError
from shardkit.core.snapshots.memory_snapshots import MemorySnapshots, ResumePoint

__all__ = ["MemorySnapshots", "ResumePoint", "SnapshotError"]
