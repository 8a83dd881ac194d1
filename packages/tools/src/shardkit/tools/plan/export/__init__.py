"""A weight export's cost (``shardkit-plan --export-dtype``), predicted from the meta model.

``layout`` models the core's export (``shardkit.core.export``) on the sharding the model would
have: its tensors, its buckets and each bucket's gathers. ``cost`` (:func:`export_cost`) prices
one export from them: bytes, buckets, collectives, each rank's counts, the peak and the time
(on a ``timing`` profile). ``cli`` adds the ``--export-*`` options to ``shardkit-plan`` and
prints the figures beside the plan. The wing imports the top level's ``tp_styles`` and
``dtype_names`` and ``timing``'s ``Hardware``, and no other wing.
"""
