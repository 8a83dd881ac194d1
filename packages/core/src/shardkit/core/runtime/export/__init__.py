"""The weight export's own process groups, in the runtime because they call torch.distributed.

- ``export_groups``: the groups an exporter makes (never the training's), its gathers, and
  its bounded waits with one verdict in the c10d store that every rank raises;
- ``receiver_group``: the trainer's receiving rank and its receiver processes as a group of
  their own (its own ``TCPStore``; gloo or NCCL made directly), with bounded broadcasts.

Only ``shardkit.core.export`` uses them. They would sit in ``export/`` but for the rule that
only ``runtime/`` talks to process groups and issues collectives (``tests/test_layering.py``):
both make process groups (``dist.new_group``; gloo's and NCCL's backends built directly) and
send on them, so they are a wing of the runtime, and ``export/`` issues no collective itself.
"""
