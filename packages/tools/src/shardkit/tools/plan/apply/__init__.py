"""Carrying out a sharding plan: on a model, as JSON, as code to paste, and checked first.

``apply`` (``apply_plan``) makes the calls a training script would make; ``plan_json`` writes
and reads a plan as JSON; ``parallelize_source`` writes it as a ``parallelize`` function, with
``source_loops`` folding repeated units into loops; ``launch_check`` (``check_plan``) runs one
rank of its step on torch's fake process group and measures it against the planner.
"""
