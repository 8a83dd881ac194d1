"""The planner's example models under their documented name: ``shardkit.tools.examples:llama_8b``.

They live in :mod:`shardkit.tools.plan.examples`; this module keeps the short spec that
``shardkit-plan`` users type (and the README shows) working.
"""

from shardkit.tools.plan.examples import (
    Llama,
    LlamaConfig,
    gpt_35m,
    gpt_35m_inputs,
    gpt_demo,
    gpt_demo_inputs,
    gpt_small,
    gpt_small_inputs,
    llama_8b,
    llama_8b_inputs,
    llama_tiny,
    llama_tiny_inputs,
    llama_tp_plan,
    one_dim_params_in_own_dtype,
)

__all__ = [
    "Llama",
    "LlamaConfig",
    "gpt_35m",
    "gpt_35m_inputs",
    "gpt_demo",
    "gpt_demo_inputs",
    "gpt_small",
    "gpt_small_inputs",
    "llama_8b",
    "llama_8b_inputs",
    "llama_tiny",
    "llama_tiny_inputs",
    "llama_tp_plan",
    "one_dim_params_in_own_dtype",
]
