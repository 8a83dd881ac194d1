"""A checkpoint save's cost (``shardkit-plan --checkpoint``), predicted from the meta model.

``layout`` describes the state ``get_state_dict(model, optimizer)`` would save, sharded as
the model would be, and hands it to the core's own ``SaveLayout`` (who writes which chunk);
``timing`` measures the core's planning per unit of work once in this process; ``cost``
(:func:`checkpoint_cost`) gives each rank's bytes, ``.metadata`` and the planning and write
times. ``cli`` adds ``--checkpoint`` and ``--disk-gib-s`` to ``shardkit-plan`` and prints the
figures beside the plan. The wing imports the top level's ``tp_styles``, and no other wing.
"""
