"""How long a planned step takes: a machine's speeds, and the step replayed on them.

``hardware`` holds a machine's speeds (:class:`~shardkit.tools.plan.timing.hardware.Hardware`,
with the published H100 and H200); ``step_time`` replays a plan's operators and collectives
on them (``estimate_step_time``). ``calibrate`` measures this machine into such a profile
(``calibrate_host`` in this process, ``calibrate_gloo`` between processes), ``bandwidth`` the
gloo bandwidth behind a plan's communication time, and ``measure_cache`` keeps both
measurements on disk. The wing reads what the memory model makes (the plan, the operators its
trace counted) and no other wing.
"""
