"""A model's parameters split the way Muon's users split them: hidden matrices, and the rest.

Muon is for the hidden weight matrices. Embeddings and the output head are matrices too, but
they map tokens, not features, and Muon's authors and torch's docs leave them (with norms,
biases and scalars) to AdamW. Telling them apart by name breaks on the next model, so this
goes by module type: the parameters of every ``nn.Embedding``, and of the output head
(transformers' ``get_output_embeddings()``, or the modules passed as ``head``), are the rest;
of the others, 2-D parameters are matrices. Tied embeddings appear once, under the name
``named_parameters()`` gives them, with the embedding.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

__all__ = ["ParamSplit", "split_matrices"]

NamedParams = list[tuple[str, nn.Parameter]]


@dataclass(frozen=True, slots=True)
class ParamSplit:
    """A model's trainable parameters in two lists of (name, parameter), model order."""

    matrices: NamedParams
    """The hidden weight matrices: for :class:`~shardkit.core.optim.Muon` (names and all, so
    that its errors name them)."""
    others: NamedParams
    """Embeddings, the head, norms, biases and scalars: for AdamW."""


def split_matrices(
    model: nn.Module, *, head: nn.Module | Iterable[nn.Module] | None = None, stacks: bool = False
) -> ParamSplit:
    """Split ``model``'s trainable parameters into hidden matrices and the rest.

    Works on a model before or after ``fully_shard`` (a DTensor parameter has its global
    shape), shardkit's or torch's::

        split = split_matrices(model)
        muon = Muon(split.matrices, lr=0.02)
        adamw = torch.optim.AdamW([p for _, p in split.others], lr=3e-4)

    Args:
        model: the model; parameters with ``requires_grad=False`` are left out of both.
        head: the output head's module or modules, where the model has no
            ``get_output_embeddings()`` (transformers' models have it) that says so.
        stacks: 3-D parameters (MoE expert stacks, ``(E, out, in)``: E matrices) as matrices
            too; by default they go with the rest.

    Returns:
        The two lists; every trainable parameter is in exactly one.
    """
    excluded = {id(p) for m in _token_modules(model, head) for p in m.parameters()}
    matrices: NamedParams = []
    others: NamedParams = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        hidden = param.dim() == 2 or (stacks and param.dim() == 3)
        (matrices if hidden and id(param) not in excluded else others).append((name, param))
    return ParamSplit(matrices, others)


def _token_modules(
    model: nn.Module, head: nn.Module | Iterable[nn.Module] | None
) -> list[nn.Module]:
    """The modules whose parameters map tokens: embeddings and the output head."""
    found: list[nn.Module] = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if head is not None:
        found.extend([head] if isinstance(head, nn.Module) else head)
        return found
    output = getattr(model, "get_output_embeddings", None)
    module = output() if callable(output) else None
    if isinstance(module, nn.Module):
        found.append(module)
    return found
