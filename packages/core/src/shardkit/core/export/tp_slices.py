"""The part of each tensor one rank of a tensor-parallel engine holds: vLLM's slicing, as data.

An engine of tensor-parallel degree K (vLLM's ``tensor_parallel_size``) cuts a decoder's
weights by kind, and each engine rank loads only its cut. The cuts, learned from vLLM's
parallel layers and their weight loaders (read, not copied):

- column-parallel (q, k, v, gate, up; their biases): output rows, ``out / K`` per rank;
- k and v under grouped-query attention: by kv head. Where ``K >= num_kv_heads`` every
  engine rank holds one kv head, each head replicated on ``K / num_kv_heads`` consecutive
  ranks (rank ``r`` holds head ``r // (K / num_kv_heads)``); else ``num_kv_heads / K`` heads;
- row-parallel (o, down): input columns, ``in / K`` per rank; their biases whole;
- vocab-parallel (the embedding and the LM head): the vocabulary padded up to a multiple of
  64, ``padded / K`` rows per rank, rank ``r`` holding the real rows of
  ``[r * per, (r + 1) * per)`` (the last ranks may hold fewer, or none; vLLM fills the rest
  of its partition with zeros);
- everything else (norms): whole on every rank.

The engine fuses q, k and v into ``qkv_proj`` and gate and up into ``gate_up_proj``; a
:class:`Window` says where its rows land in the fused parameter (:attr:`Window.fused_offset`).
A window is a pure function of the tensor's name and shape, the model's head counts and K:
every trainer rank computes every engine rank's windows alone. ``tp_routes.py`` intersects
them with the trainer's shards.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = [
    "VOCAB_PADDING",
    "Box",
    "EngineTP",
    "SliceKind",
    "Window",
    "default_kind",
    "engine_window",
]

VOCAB_PADDING = 64
"""vLLM pads a vocab-parallel layer's rows to a multiple of this (its default padding)."""

Box = tuple[tuple[int, int], ...]
"""A block of a tensor: ``[start, stop)`` along each dim."""


class SliceKind(Enum):
    """How an engine of degree K cuts one tensor."""

    Q = "q"
    """The query rows of the fused ``qkv_proj`` (column-parallel by head)."""
    K = "k"
    """The key rows of ``qkv_proj``, by kv head (replicated where K exceeds the kv heads)."""
    V = "v"
    """The value rows of ``qkv_proj``, as the keys."""
    GATE = "gate"
    """The first half of the fused ``gate_up_proj`` (column-parallel)."""
    UP = "up"
    """The second half of ``gate_up_proj``."""
    COLUMN = "column"
    """A column-parallel tensor of its own: output rows."""
    ROW = "row"
    """A row-parallel weight: input columns (its bias: whole)."""
    VOCAB = "vocab"
    """A vocab-parallel embedding or LM head: padded vocabulary rows."""
    WHOLE = "whole"
    """Replicated: every engine rank holds all of it."""


_FUSED = {
    SliceKind.Q: "qkv_proj",
    SliceKind.K: "qkv_proj",
    SliceKind.V: "qkv_proj",
    SliceKind.GATE: "gate_up_proj",
    SliceKind.UP: "gate_up_proj",
}

# Llama's and Qwen2's module names (vLLM's stacked_params_mapping and parallel layers).
_LEAVES = {
    "q_proj": SliceKind.Q,
    "k_proj": SliceKind.K,
    "v_proj": SliceKind.V,
    "gate_proj": SliceKind.GATE,
    "up_proj": SliceKind.UP,
    "o_proj": SliceKind.ROW,
    "down_proj": SliceKind.ROW,
    "embed_tokens": SliceKind.VOCAB,
    "lm_head": SliceKind.VOCAB,
}


def default_kind(name: str) -> SliceKind | None:
    """The kind of a Llama/Qwen2 checkpoint name (None: no rule for it).

    Norms (a module named ``*norm``) are whole.
    """
    module, _, _ = name.rpartition(".")
    leaf = module.rpartition(".")[2]
    if leaf in _LEAVES:
        return _LEAVES[leaf]
    return SliceKind.WHOLE if leaf.endswith("norm") else None


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineTP:
    """An engine's tensor-parallel degree and the model facts its cuts depend on."""

    degree: int
    """K: the engine's tensor-parallel ranks."""
    num_heads: int
    """Query heads (``num_attention_heads``)."""
    num_kv_heads: int
    """Key/value heads (``num_key_value_heads``)."""
    head_dim: int
    """Elements per head."""
    vocab_size: int
    """The real vocabulary (``vocab_size``), before the engine's padding."""
    kinds: Mapping[str, SliceKind] = field(default_factory=dict)
    """Kinds by checkpoint name, over :func:`default_kind` (a model with other module names)."""

    def __post_init__(self) -> None:
        if self.degree < 1:
            raise ValueError(f"EngineTP.degree must be at least 1, got {self.degree}")
        if self.num_heads % self.degree:
            raise ValueError(
                f"an engine of TP degree {self.degree} cannot split {self.num_heads} query "
                "heads evenly (vLLM requires it)"
            )
        kv, k = self.num_kv_heads, self.degree
        if (k % kv if k >= kv else kv % k) != 0:
            raise ValueError(
                f"an engine of TP degree {k} cannot place {kv} kv heads: one must divide the "
                "other (vLLM requires it)"
            )
        if (-(-self.vocab_size // VOCAB_PADDING) * VOCAB_PADDING) % k:
            raise ValueError(
                f"an engine of TP degree {k} cannot split the padded vocabulary of "
                f"{self.vocab_size} rows evenly"
            )

    @classmethod
    def from_config(cls, config: Any, degree: int) -> EngineTP:
        """From a transformers config.

        Its ``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` (else ``hidden_size``
        over the heads) and ``vocab_size``.
        """
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        return cls(
            degree=degree,
            num_heads=heads,
            num_kv_heads=int(kv),
            head_dim=int(head_dim),
            vocab_size=int(config.vocab_size),
        )

    def kind_of(self, name: str) -> SliceKind:
        """The kind of checkpoint tensor ``name``.

        Raises:
            ValueError: no rule names it (pass ``kinds``): guessing could load a wrong cut.
        """
        kind = self.kinds.get(name) or default_kind(name)
        if kind is None:
            raise ValueError(
                f"{name}: no tensor-parallel rule for it (Llama/Qwen2 names are known); pass "
                "EngineTP(kinds={name: SliceKind...})"
            )
        return kind

    @property
    def kv_replicas(self) -> int:
        """Engine ranks holding each kv head (1 where K <= num_kv_heads)."""
        return max(1, self.degree // self.num_kv_heads)

    @property
    def local_heads(self) -> int:
        """Query heads per engine rank."""
        return self.num_heads // self.degree

    @property
    def local_kv_heads(self) -> int:
        """Kv heads per engine rank (one, replicated, where K >= num_kv_heads)."""
        return max(1, self.num_kv_heads // self.degree)


@dataclass(frozen=True, slots=True)
class Window:
    """The part of one checkpoint tensor one engine rank holds."""

    name: str
    """The checkpoint name."""
    shape: tuple[int, ...]
    """The checkpoint tensor's full shape."""
    dim: int | None
    """The cut dim (None: whole)."""
    start: int
    stop: int
    """``[start, stop)`` along ``dim`` (the whole dim where ``dim`` is None)."""
    fused: str | None = None
    """The engine's fused module (``qkv_proj``, ``gate_up_proj``) it lands in, if any."""
    fused_offset: int = 0
    """Its first row in the engine rank's fused parameter."""

    @property
    def box(self) -> Box:
        """The window as a block of the full tensor."""
        return tuple(
            (self.start, self.stop) if d == self.dim else (0, size)
            for d, size in enumerate(self.shape)
        )

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of what the engine rank receives."""
        return tuple(stop - start for start, stop in self.box)

    @property
    def numel(self) -> int:
        """Its elements."""
        count = 1
        for size in self.local_shape:
            count *= size
        return count


def engine_window(tp: EngineTP, name: str, shape: tuple[int, ...], rank: int) -> Window:
    """What engine rank ``rank`` of ``tp`` holds of checkpoint tensor ``name`` of ``shape``.

    Raises:
        ValueError: ``rank`` outside the engine; a tensor whose size the engine cannot split
            (the message names it); no rule for the name.
    """
    if not 0 <= rank < tp.degree:
        raise ValueError(f"engine rank {rank} is outside an engine of TP degree {tp.degree}")
    kind = tp.kind_of(name)
    if not shape or kind is SliceKind.WHOLE or (kind is SliceKind.ROW and len(shape) < 2):
        return Window(name, shape, None, 0, shape[0] if shape else 1)
    heads = tp.local_heads * tp.head_dim
    kv = tp.local_kv_heads * tp.head_dim
    if kind is SliceKind.Q:
        return _rows(name, shape, rank * heads, heads, "qkv_proj", 0)
    if kind in (SliceKind.K, SliceKind.V):
        head = rank // tp.kv_replicas * tp.local_kv_heads
        offset = heads if kind is SliceKind.K else heads + kv
        return _rows(name, shape, head * tp.head_dim, kv, "qkv_proj", offset)
    if kind is SliceKind.VOCAB:
        padded = -(-tp.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
        per = padded // tp.degree
        if shape[0] != tp.vocab_size:
            raise ValueError(f"{name}: {shape[0]} rows, but the vocabulary has {tp.vocab_size}")
        start = min(rank * per, shape[0])
        return Window(name, shape, 0, start, min(start + per, shape[0]))
    dim = 1 if kind is SliceKind.ROW else 0
    if shape[dim] % tp.degree:
        raise ValueError(
            f"{name}: dim {dim} of {list(shape)} does not split into {tp.degree} equal parts "
            "(vLLM requires it)"
        )
    per = shape[dim] // tp.degree
    if kind is SliceKind.ROW:
        return Window(name, shape, 1, rank * per, (rank + 1) * per)
    fused = _FUSED.get(kind)
    return _rows(name, shape, rank * per, per, fused, per if kind is SliceKind.UP else 0)


def _rows(
    name: str, shape: tuple[int, ...], start: int, rows: int, fused: str | None, offset: int
) -> Window:
    if start + rows > shape[0]:
        raise ValueError(f"{name}: rows [{start}, {start + rows}) lie outside its {shape[0]} rows")
    return Window(name, shape, 0, start, start + rows, fused, offset)
