"""One parameter group: the communication bucket a ``fully_shard`` call's parameters share.

- ``param_group``: ``FSDPParamGroup``, the group's life in a step: unshard, wait, reshard,
  and its post-backward handing the gradients to ``engine/reduce/``;
- ``plan``: ``GroupPlan``, the group's layout and its copy decisions, one frozen value;
- ``storage``: the group's buffers and the fused copies between them (copy-in, copy-out);
- ``unsharded``: the unsharded flat buffer, its memory between unshard and reshard;
- ``post_forward``: ``reshard_after_forward=int``, the 1/n slices kept for backward;
- ``hooked_params``: its parameters gathered through their all-gather hooks (Float8, NF4);
- ``upkeep``: the plan made again when the group's parameters change under it;
- ``unsynced``: its gradients without gradient sync, kept for the next backward.

When each of these happens is the schedule's (``shardkit.core.schedule``); the operations the
schedule's driver runs on the groups are ``engine/step_ops.py``'s.
"""
