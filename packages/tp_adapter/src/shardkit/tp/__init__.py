"""shardkit.tp: not built yet; the public API is empty until it really works."""

from shardkit.tp.__about__ import __version__

__all__ = ["__version__"]
