"""Muon resumes on HSDP 2 x 2 and FSDP x TP 2 x 2 from a checkpoint saved on FSDP at W=2, on
both engines, and trains on as a single process loaded from the same files, bit for bit (see
``mesh_resume_runs``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from harness.pool import run_on_ranks
from tests.core.optim.mesh_resume_runs import RESUMED, resume_body, save_body
from tests.core.optim.model_runs import Case

pytest.importorskip("transformers")


Saved = Callable[[str], tuple[str, dict[str, Any]]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    """A model's checkpoint saved at W=2 and the full values it holds (saved on first use)."""
    found: dict[str, tuple[str, dict[str, Any]]] = {}

    def get(model: str) -> tuple[str, dict[str, Any]]:
        if model not in found:
            path = str(tmp_path_factory.mktemp(f"muon_{model}"))
            found[model] = (path, run_on_ranks(2, save_body, model_name=model, path=path)[0])
        return found[model]

    return get


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("impl", ["shardkit", "torch"])
@pytest.mark.parametrize("layout", ["hsdp", "tp"])
@pytest.mark.parametrize("model", ["demo_gpt", "qwen2"])
def test_a_w2_checkpoint_resumes_on_hsdp_and_tp_meshes_bit_for_bit(
    saved: Saved, model: str, layout: str, impl: str
) -> None:
    path, values = saved(model)
    results = run_on_ranks(
        4, resume_body, impl=impl, case=Case(model=model, layout=layout), path=path
    )
    for rank, out in enumerate(results):
        for side in ("loaded", "ref_loaded"):
            assert _same(out[side]["model"], values["model"]), (rank, side)
            assert _same(out[side]["optim"], values["optim"]), (rank, side)
        assert out["equal"] == [True] * RESUMED, (rank, out["max_diff"])
