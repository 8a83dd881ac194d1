"""Tests of the multi-rank harness (``harness/`` at the repo root)."""
