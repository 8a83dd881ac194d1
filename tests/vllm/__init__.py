"""Tests of the vLLM receiver (shardkit.core.export.vllm), run by ``make check-vllm`` alone."""
