"""The collective runtime: the only code that talks to torch.distributed or to a device API.

At the top, the step's collectives and what they stand on:

- ``collectives``: ``ProcessGroupRuntime``, the step's all-gathers, reduce-scatters and
  all-reduces (gloo's as exchanges of rows); ``handles`` their waits; ``protocol`` the
  ``CollectiveRuntime`` the engine calls; ``custom`` the user's collectives; ``pool`` the
  buffers reused across groups; ``reduction`` a reducing collective's op; ``ring_order`` the
  order gloo's ring adds rows in; ``gather_split`` and ``buffers`` pure tensor work on flat
  buffers; ``chunks`` torch.chunk's arithmetic (which rows a piece holds), for every cut of
  the core;
- the ground every wing stands on: ``groups`` (who this rank is, process groups, barriers),
  ``flat_collectives`` (the installed torch's names), ``device`` (what differs per device);
- one module per private torch API: ``dtensors``, ``meshes``, ``dynamo``;
- ``replica_exchange``: what one replica read of a checkpoint, broadcast to the others.

The wings, each below the step's collectives and above the ground:

- ``watch/``: what the runtime watches in every collective it issues: where each rank is
  (``progress``), checks that every rank issued the same (``desync``, ``step_check``), waits
  that never end (``hang``, ``stuck``, through the store's ``store_board``), memory under
  collectives in flight (``lifetimes``), and what observers see (``announce``,
  ``comm_debug``, ``collective_watch``);
- ``p2p/``: point to point and between steps: the row exchange, the table of tags, peer
  transfers, whole objects through the first rank, and the outcomes all ranks agree on;
- ``export/``: the weight export's own process groups (``shardkit.core.export`` uses them);
  they call ``torch.distributed``, so they live here.

Arrows run down: the step's collectives use the watches and ``p2p/``, the watches use
``p2p/`` (the step check's digests, the fingerprints' tags), and nothing in a wing imports the
step's collectives.
"""
