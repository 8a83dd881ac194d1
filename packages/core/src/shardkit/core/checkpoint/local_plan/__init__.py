"""The locally planned save and load: DCP's files, with no plan exchange before the I/O.

DCP's ``save`` gathers every rank's plan to rank 0 and scatters the checked plan back; here
every rank plans alone from the sharding, in the order a save travels:

- ``chunk_writers``: who writes which chunk, and the checkpoint's metadata, a pure function of
  the flat state's keys, shapes, dtypes, meshes and placements (``SaveLayout``; the planner
  predicts saves with it);
- ``sharded_tensor_chunks``: FSDP1's ShardedTensors in that layout, each shard written by the
  rank it is placed on;
- ``save``: the save itself (``save_planned_locally``: each rank's items written, one gather
  of results, rank 0's ``.metadata``, DCP's own planning where the ranks' keys differ), and
  ``save_dcp``, that save as a drop-in for ``dcp.save``;
- ``save_results``: what each rank wrote, as int64 rows, their gather to rank 0, rank 0's
  checks and ``.metadata``'s file;
- ``layout_record`` and ``rank_index``: what a save leaves beside DCP's files for the loads
  (the layout, checksummed JSON; each rank's index of its own files);
- ``chunk_sources`` and ``load``: a load planned by each rank alone from them (no plan
  exchange, no ``.metadata``).

``CheckpointManager`` saves through ``save``, its asynchronous saves too (``async_save``,
``process_writer``).
"""
