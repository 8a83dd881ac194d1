"""The planner's example models under their documented name: ``shardkit.tools.examples:llama_8b``.

They live in :mod:`shardkit.tools.plan.examples`; this module keeps the short spec that
``shardkit-plan`` users type (and the README shows) working.
"""

from shardkit.tools.plan import examples as _examples
from shardkit.tools.plan.examples import *  # noqa: F403  (every public name, as listed there)

__all__ = _examples.__all__
