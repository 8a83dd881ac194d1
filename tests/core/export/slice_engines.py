"""A stand-in for one rank of a vLLM engine of TP degree 2 in the trainer's process.

Its worker is a plain object whose model takes ``WindowedWeight`` as vLLM's loaders do (each
name's rows kept as this rank's window), so staging, the commit, its snapshot and its undo
run as shardkit's code runs them on a real worker (``vllm_versions.py``); only the probe and
the worker's place are answered here. It can fail its load partway, after a first write.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from shardkit.core.export.vllm_slices import tp_place_of_worker
from shardkit.core.export.vllm_worker import probe_worker


class WindowModel(nn.Module):
    """Each loaded name's window, as a parameter replaced in place on later loads."""

    def __init__(self) -> None:
        super().__init__()
        self.windows = nn.ParameterDict()
        self.names: dict[str, str] = {}
        self.fail = False

    def load_weights(self, weights: Any) -> None:
        for name, weight in weights:
            held = getattr(weight, "held", weight)  # a whole window comes as a plain tensor
            key = name.replace(".", "__")
            if key in self.windows:
                self.windows[key].data.copy_(held)  # in place, as vLLM's loaders
            else:
                self.windows[key] = nn.Parameter(held.clone(), requires_grad=False)
                self.names[key] = name
            if self.fail:
                raise RuntimeError("the stand-in's load raised after a first write")

    def held(self) -> dict[str, torch.Tensor]:
        """Each name's window as the engine rank holds it now."""
        return {self.names[k]: v.detach().clone() for k, v in self.windows.items()}


class StandInTPEngine:
    """A ``vllm.LLM`` with its engine core in this process: engine rank ``rank`` of 2."""

    def __init__(self, rank: int) -> None:
        self.llm_engine = SimpleNamespace(
            model_config=SimpleNamespace(dtype=torch.bfloat16),
            vllm_config=SimpleNamespace(parallel_config=SimpleNamespace()),
            model_executor=object(),  # vLLM sets it where the engine core is in-process
        )
        self.rank = rank
        self.model = WindowModel()
        self.worker = SimpleNamespace(model_runner=SimpleNamespace(model=self.model))

    def collective_rpc(self, method: Any, args: tuple[Any, ...] = ()) -> list[Any]:
        if method is probe_worker:
            return [("load_weights", "bfloat16", "a stand-in", os.getpid())]
        if method is tp_place_of_worker:
            return [(self.rank, 2)]
        return [method(self.worker, *args)]
