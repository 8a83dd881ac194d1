"""Choosing a plan: the fastest sharding plan whose predicted peak fits a memory budget.

``candidates`` builds the plans a user would try from the model's structure, ``search``
compares them by predicted peak and step time, and ``evaluator`` predicts each with the two
models (the memory model's ``planner`` and ``timing``'s step time). ``budget`` reads a budget
as people write it. ``fit`` is ``shardkit-plan --fit``: it runs the search, checks the chosen
plan on the fake process group and writes it out (the ``apply`` wing's).
"""
