"""shardkit.tools: not built yet; the public API is empty until it really works."""

from shardkit.tools.__about__ import __version__

__all__ = ["__version__"]
