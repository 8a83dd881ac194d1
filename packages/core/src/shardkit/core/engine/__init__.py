"""The engine: what one ``fully_shard`` call builds and what its hooks do in a step.

The chain, as data flows through it: ``fsdp_state`` (the hooks of one call, the root's lazy
init) -> ``param_group`` (one communication bucket: unshard, wait, reshard, reduce) ->
``param`` (one parameter's sharded and unsharded views), with a group's plan (one frozen
value) in ``plan``, its memory and fused copies in ``storage``, its reduction in
``reduce`` and a root's backward in ``backward``. Its decisions about *when* are
``shardkit.core.schedule``'s; its collectives go through ``shardkit.core.runtime``. Nothing
here is public: ``shardkit.core`` is.
"""
