"""``sync_through_export`` refuses what the export's trl sync is not for (no trl needed).

Its real run, trl's GRPOTrainer at W=2 with vLLM, is tests/vllm/test_trl_grpo.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from shardkit.core.export.trl_sync import TrlExportSync, sync_through_export


def _trainer(*, use_vllm: bool = True, mode: str = "colocate", model: object = None) -> object:
    generation = SimpleNamespace(mode=mode, model=model or nn.Linear(2, 2), llm=None)
    return SimpleNamespace(use_vllm=use_vllm, vllm_generation=generation)


def test_the_sync_takes_the_place_of_trls_and_refuses_what_it_is_not_for() -> None:
    trainer = _trainer()
    sync = sync_through_export(trainer, delta=False)
    assert trainer.vllm_generation.sync_weights is sync  # type: ignore[attr-defined]
    assert isinstance(sync, TrlExportSync) and not sync.delta and sync.reports == []
    with pytest.raises(ValueError, match="use_vllm=True"):
        sync_through_export(_trainer(use_vllm=False))
    with pytest.raises(ValueError, match="vllm_mode='server'"):
        sync_through_export(_trainer(mode="server"))
    peft = nn.Linear(2, 2)
    setattr(peft, "peft_config", {})  # noqa: B010 (what a PEFT model carries)
    with pytest.raises(ValueError, match="PEFT"):
        sync_through_export(_trainer(model=peft))
