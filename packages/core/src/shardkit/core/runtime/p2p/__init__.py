"""Point to point, and whole objects between steps.

- ``row_exchange``: the one loop that sends a row to every peer and receives theirs (gloo's
  all-gather and reduce-scatter, the desync fingerprints, the step check's digests, the
  export's gathers post through it);
- ``p2p_tags``: the table of point-to-point tags, one owner for each (gloo pairs messages by
  sender and tag alone);
- ``peer_transfer``: bytes from one rank to another on a group of their own (memory
  snapshots' replicas);
- ``object_collectives``: whole objects through a group's first rank, broadcasts and byte
  messages (state dicts, checkpoints);
- ``agreement``: one rank's outcome, or every rank's, shared, so every rank raises the same
  error.

Nothing here knows the step: the step's collectives, the watches, the checkpoints, the
snapshots and the export use these.
"""
