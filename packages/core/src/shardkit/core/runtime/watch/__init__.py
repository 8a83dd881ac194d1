"""What the runtime watches in every collective it issues, and what it tells of them.

- ``progress``: where this rank is (its step, its phase, the last collective it reached, what
  it waits on) and the settings of every watch (``SHARDKIT_DEBUG``, ``SHARDKIT_HANG_TIMEOUT``,
  ``SHARDKIT_COLLECTIVE_BOUND``, ``SHARDKIT_DEBUG_LIFETIMES``);
- ``desync`` (debug mode) and ``step_check`` (on by default): every rank issued the same
  collectives, compared per collective or once per step;
- ``hang`` and ``stuck``: waits that never end, ended (the hang report after minutes; a stuck
  wait's error on every rank after seconds), through the c10d store (``store_board``: a
  rank's posts, reads that never wait, the first verdict kept; the export's watch uses it too);
- ``lifetimes``: no buffer released while a collective in flight still uses it;
- ``announce``, ``comm_debug`` and ``collective_watch``: what observers see (the tools'
  events; torch's ``CommDebugMode``; collectives the program issues itself, held back under
  torch's ``Join``).

The step's collectives (``runtime/collectives.py``, ``handles.py``, ``pool.py``) record into
these as they issue and wait; nothing here imports them. See [Note: desync checks] and
[Note: step check].
"""
