"""The version of this package; all shardkit packages move in lockstep."""

__version__ = "0.1.0"
