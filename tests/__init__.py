"""shardkit's test suite: a package so that worker processes can import test modules by name."""
