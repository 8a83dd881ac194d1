"""The torch-facing view: torch's private FSDP objects, as shardkit's engine answers them.

What code written for torch's FSDP2 reads of torch's private objects is served here from
shardkit's engine. See [Note: torch-facing view].

- ``fsdp_classes``: torch's own FSDP classes, and the base that lets shardkit's sharded
  modules pass torch's ``isinstance`` checks;
- ``view``: ``fully_shard.state(m)``, ``_get_fsdp_state()`` and the state's private names
  that torch's pipelining and torchtitan reach (an instance of torch's ``FSDPState``, filed
  where torch's composable APIs look states up);
- ``group_view``: a group's and its parameters' private names;
- ``strict``: a name the view does not serve fails by name;
- ``mesh_infos``: torch's ``FSDPMeshInfo`` / ``HSDPMeshInfo`` / ``DDPMeshInfo`` of a group's
  mesh;
- ``param_fields``: torch's ``FSDPParam`` sizes, dtypes and states of one parameter.

Only these modules name torch's private FSDP objects; the engine never imports them at load.
"""
