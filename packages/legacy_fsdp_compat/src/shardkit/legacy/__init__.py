"""shardkit.legacy: not built yet; the public API is empty until it really works."""

from shardkit.legacy.__about__ import __version__

__all__ = ["__version__"]
