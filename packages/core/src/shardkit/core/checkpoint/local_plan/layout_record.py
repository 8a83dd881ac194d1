"""The layout record: a checkpoint's own description, from which each rank plans its load alone.

DCP's ``.metadata`` writes the sharding rule out chunk by chunk: one entry per chunk of every
tensor, O(W) per tensor, and every rank of a load unpickles all of it. But the chunks, and
which rank wrote each, follow from what ``chunk_writers`` plans a save from: every value's
name, global shape, dtype, mesh and placements. The record holds exactly that, so its size
grows with the values and their distinct meshes, not with the chunks:

- ``meshes``: each distinct mesh once: its shape, and its ranks (omitted where they are
  ``0..n-1`` in order, the usual case, so that a mesh costs a few bytes at any W);
- ``shards``: each distinct set of FSDP1 ShardedTensor shards once (their offsets and sizes:
  a ShardedTensor's shards are data, not a rule, so they are written out, once per geometry).
  Since version 3 each column of offsets or sizes is written as runs of equal steps (its
  first value, then each step and how many times it repeats): FSDP1's ``torch.chunk`` cut is
  a few runs at any W, where listed it was 4 numbers a shard, and 70B's record at 8,192
  ranks took each loading rank 160 ms of JSON to parse (a third of a million numbers);
- ``values``: per value of the flat state its key, kind, shape, dtype and flags, mesh and
  placements (``Shard``, ``Replicate``, ``_StridedShard``, or a ShardedTensor's shards);
- the save's world size and the layout's digest, which the reader recomputes from what it
  parsed: a record that parses into another layout than the one saved is refused;
- ``plain``: where each value that every rank holds lies (its file number, offset, length),
  in their turn order (value t written by rank t mod W). Those are few (a step count a
  parameter, the param groups), but every rank reads all of them: from the record, rather
  than from the indexes of hundreds of writers.

Where each written item lies in its file is not a rule (DCP's ``torch.save`` framing sets each
item's length), so each rank indexes its own file (``rank_index``); a reader opens the indexes
of the ranks whose chunks it needs. With the record, the writers follow from
``SaveLayout.items_of``: the same code that planned the save plans the load.

The file: one line ``shardkit-layout <version> <sha256 of the rest>``, then the JSON. It is
read with ``json`` (no pickle), its size bounded before it is read, every field checked. The
version names the rule by which a chunk's holders shared its writing (``replica_shares``):
1, whole chunks taking turns tensor by tensor; 2, by bytes, large chunks cut by rows into
pieces that several holders write (their rows follow from the layout, as the chunks do); 3,
by bytes, with ShardedTensors' shards in runs (above). A reader of version 2 refuses a record
of version 3 by its version, rather than by a field it cannot find.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import TensorProperties
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardkit.core.checkpoint.local_plan.chunk_writers import SaveLayout, ValueLayout, mesh_key
from shardkit.core.checkpoint.local_plan.sharded_tensor_chunks import Shards
from shardkit.core.errors import StateDictFileError

__all__ = ["RECORD", "Record", "encode_record", "read_record", "write_record"]

RECORD = "layout.json"
_MAGIC = "shardkit-layout"
_RULES = {1: "turns", 2: "bytes", 3: "bytes"}
"""How the holders of a chunk shared its writing, by the record's version (``replica_shares``):
version 1, whole chunks by turns; versions 2 and 3, by bytes, large chunks in row pieces."""
_WRITTEN = {"turns": 1, "bytes": 3}
"""The version a save writes, by its rule: 1 for ``turns`` (what readers of it expect), else
3, whose ShardedTensor shards are in runs."""
_RUNS_FROM = 3  # the first version whose shards are written in runs
_MOST_STEP = 1 << 62  # a step's bound: no shape is near it, and int64 holds it
_MOST_BYTES = 256 << 20  # far beyond any model's record (70B: well under 1 MiB)
_KINDS = ("dtensor", "sharded", "tensor", "bytes")


@dataclass(frozen=True, slots=True)
class Record:
    """A checkpoint's layout record, read and checked."""

    layout: SaveLayout
    plain: np.ndarray
    """(values every rank holds, 3): each one's file number, offset and length, in turn order."""


class _NotRecordable(ValueError):
    """A placement the record cannot describe (the checkpoint then loads through DCP)."""


def encode_record(layout: SaveLayout, plain: np.ndarray) -> bytes | None:
    """The record's bytes, or None where a placement is not one the record describes.

    Its version says ``layout.rule`` (how the holders of a chunk shared its writing), and
    with it how ShardedTensors' shards are written (listed for ``turns``, else in runs).

    ``plain``: as :attr:`Record.plain`.
    """
    meshes: dict[str, int] = {}
    mesh_list: list[dict[str, Any]] = []
    shards: dict[str, int] = {}
    shard_list: list[dict[str, Any]] = []
    values = []
    version = _WRITTEN[layout.rule]
    try:
        for value in layout.values:
            entry: dict[str, Any] = {"fqn": value.fqn, "kind": value.kind}
            if value.kind != "bytes":
                props = value.properties
                assert props is not None
                entry["shape"] = list(value.shape)
                entry["dtype"] = str(props.dtype).removeprefix("torch.")
                entry["flags"] = [bool(props.requires_grad), bool(props.pin_memory)]
            if value.mesh is not None:
                if value.mesh_id not in meshes:
                    meshes[value.mesh_id] = len(mesh_list)
                    mesh_list.append(_mesh_entry(value.mesh))
                entry["mesh"] = meshes[value.mesh_id]
                entry["placements"] = [
                    _placement_entry(p, shards, shard_list, version) for p in value.placements
                ]
            values.append(entry)
    except _NotRecordable:
        return None
    body = json.dumps(
        {
            "world_size": layout.world_size,
            "digest": layout.digest,
            "meshes": mesh_list,
            "shards": shard_list,
            "values": values,
            "plain": plain.reshape(-1).tolist(),
        },
        separators=(",", ":"),
    ).encode()
    head = f"{_MAGIC} {version} {hashlib.sha256(body).hexdigest()}\n".encode()
    return head + body


def write_record(folder: Path, layout: SaveLayout, plain: np.ndarray) -> int:
    """Write ``folder``'s record (flushed, then renamed into place); its bytes.

    0 where the layout has a placement the record cannot describe: then a record left in
    ``folder`` by an earlier save into it is removed.
    """
    data = encode_record(layout, plain)
    if data is None:  # a placement it cannot describe: loads go through DCP's planning
        (folder / RECORD).unlink(missing_ok=True)
        return 0
    temporary = folder / f".{RECORD}.tmp"
    with open(temporary, "wb") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, folder / RECORD)
    return len(data)


def read_record(folder: Path) -> Record:
    """``folder``'s record, checked field by field.

    Raises:
        StateDictFileError: naming the file and what is wrong (missing, oversized, truncated,
            a checksum that does not match, a field of the wrong kind, a layout that is not
            the one saved).
    """
    path = folder / RECORD
    try:
        size = path.stat().st_size
        if size > _MOST_BYTES:
            raise ValueError(f"{size} bytes, more than any record ({_MOST_BYTES})")
        data = path.read_bytes()
        head, _, body = data.partition(b"\n")
        words = head.decode("ascii", errors="replace").split(" ")
        versions = {str(v): v for v in _RULES}
        if len(words) != 3 or words[0] != _MAGIC or words[1] not in versions:
            raise ValueError(
                f"not a layout record of version {', '.join(versions)} (header {head[:80]!r})"
            )
        if hashlib.sha256(body).hexdigest() != words[2]:
            raise ValueError("its checksum does not match its contents (truncated or corrupt)")
        return _decode(json.loads(body), versions[words[1]])
    except (OSError, ValueError, TypeError, KeyError, IndexError) as error:
        raise StateDictFileError(f"{path}: damaged layout record: {error}") from None


def _mesh_entry(mesh: np.ndarray) -> dict[str, Any]:
    ranks = mesh.reshape(-1)
    in_order = bool((ranks == np.arange(ranks.size)).all())
    return {"shape": list(mesh.shape), "ranks": None if in_order else ranks.tolist()}


def _placement_entry(
    placement: Any, shards: dict[str, int], shard_list: list[Any], version: int
) -> list[Any]:
    if isinstance(placement, _StridedShard):  # before Shard: it is one
        return ["strided_shard", placement.dim, int(placement.split_factor)]
    if isinstance(placement, Shard):
        return ["shard", placement.dim]
    if isinstance(placement, Replicate):
        return ["replicate"]
    if isinstance(placement, Shards):
        if placement.key not in shards:
            shards[placement.key] = len(shard_list)
            shard_list.append(_shards_entry(placement, version))
        return ["shards", shards[placement.key]]
    raise _NotRecordable(f"placement {placement!r}")


def _natural(value: object, what: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{what} is {value!r}, not a non-negative integer")
    return value


def _naturals(value: object, what: str) -> list[int]:
    if not isinstance(value, list):
        raise ValueError(f"{what} is not a list")
    return [_natural(v, what) for v in value]


def _decode(body: object, version: int) -> Record:
    """The record's JSON as a :class:`Record`, every field checked, its digest recomputed."""
    if not isinstance(body, dict):
        raise ValueError("its contents are not a JSON object")
    world = _natural(body["world_size"], "world_size")
    if world < 1:
        raise ValueError("world_size is 0")
    meshes = [_decode_mesh(m, world) for m in body["meshes"]]
    shards = [_decode_shards(s, version, world) for s in body["shards"]]
    checked: set[tuple[Any, ...]] = set()
    values = [_decode_value(v, meshes, shards, checked) for v in body["values"]]
    fqns = [v.fqn for v in values]
    if len(set(fqns)) != len(fqns):
        raise ValueError("a value is listed twice")
    layout = SaveLayout.from_values(values, world, _RULES[version])
    if layout.digest != body["digest"]:
        raise ValueError("it describes another layout than the one saved (digest differs)")
    plain = np.array(_naturals(body["plain"], "a plain value's place"), dtype=np.int64)
    count = sum(v.kind not in ("dtensor", "sharded") for v in values)
    if plain.size != 3 * count:
        raise ValueError(f"it places {plain.size // 3} values that every rank holds, of {count}")
    return Record(layout, plain.reshape(count, 3))


def _decode_mesh(entry: Any, world: int) -> tuple[np.ndarray, str]:
    shape = _naturals(entry["shape"], "a mesh's shape")
    count = int(np.prod(shape)) if shape else 1
    if entry["ranks"] is None:
        ranks = np.arange(count, dtype=np.int64)
    else:
        ranks = np.array(_naturals(entry["ranks"], "a mesh's rank"), dtype=np.int64)
    if ranks.size != count or count == 0 or bool((ranks >= world).any()):
        raise ValueError(f"a mesh of shape {shape} lists {ranks.size} ranks (world {world})")
    if np.unique(ranks).size != count:
        raise ValueError(f"a mesh of shape {shape} lists a rank twice")
    mesh = ranks.reshape(shape)
    return mesh, mesh_key(mesh)


def _shards_entry(shards: Shards, version: int) -> dict[str, Any]:
    """One ShardedTensor's shards: listed (versions 1 and 2), or each column in runs."""
    offsets, sizes = shards.offsets, shards.sizes
    if version < _RUNS_FROM:
        return {"offsets": offsets.tolist(), "sizes": sizes.tolist()}
    return {
        "count": int(offsets.shape[0]),
        "offsets": [_runs(column) for column in offsets.T],
        "sizes": [_runs(column) for column in sizes.T],
    }


def _runs(column: np.ndarray) -> list[int]:
    """``column`` as its first value, then (step, repeats) for each run of equal steps."""
    if column.size == 0:
        return []
    steps = np.diff(column)  # (shards - 1,)
    starts = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]]) if steps.size else steps
    repeats = np.diff(np.r_[starts, steps.size])
    runs = np.stack([steps[starts.astype(np.int64)], repeats], axis=1).reshape(-1)
    return [int(column[0]), *runs.tolist()]


def _from_runs(runs: object, count: int, what: str) -> np.ndarray:
    """A column of ``count`` values from :func:`_runs`'s list, its steps and repeats checked."""
    if not isinstance(runs, list) or len(runs) % 2 != 1 - (count == 0):
        raise ValueError(f"{what} is not a first value and (step, repeats) pairs")
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    if any(type(v) is not int or abs(v) >= _MOST_STEP for v in runs):
        raise ValueError(f"{what} holds {runs[:8]!r}..., not integers of int64")
    pairs = np.array(runs[1:], dtype=np.int64).reshape(-1, 2)  # (runs, 2): step, repeats
    if bool((pairs[:, 1] < 1).any()) or int(pairs[:, 1].sum()) != count - 1:
        raise ValueError(f"{what}'s runs repeat {int(pairs[:, 1].sum())} steps, not {count - 1}")
    steps = np.repeat(pairs[:, 0], pairs[:, 1])
    return np.cumsum(np.r_[np.int64(runs[0]), steps])


def _decode_shards(entry: Any, version: int, world: int) -> Shards:
    if version < _RUNS_FROM:
        offsets = np.array(entry["offsets"], dtype=np.int64)
        sizes = np.array(entry["sizes"], dtype=np.int64)
    else:
        count = _natural(entry["count"], "a ShardedTensor's count of shards")
        if count > world:  # each shard on a rank of its own
            raise ValueError(f"a ShardedTensor of {count} shards at {world} ranks")
        columns = [entry["offsets"], entry["sizes"]]
        if not all(isinstance(c, list) for c in columns) or len(columns[0]) != len(columns[1]):
            raise ValueError("a ShardedTensor's offsets and sizes differ in dims")
        offsets, sizes = (
            np.stack([_from_runs(c, count, f"a shard's {n}") for c in cs], axis=1)
            if cs
            else np.zeros((count, 0), dtype=np.int64)
            for n, cs in zip(("offsets", "sizes"), columns, strict=True)
        )
    if offsets.ndim != 2 or offsets.shape != sizes.shape or bool((offsets < 0).any()):
        raise ValueError("a ShardedTensor's shards are not (shards, ndim) offsets and sizes")
    if bool((sizes < 0).any()):
        raise ValueError("a ShardedTensor's shard has a negative size")
    return Shards(offsets, sizes)


def _decode_value(
    entry: Any,
    meshes: list[tuple[np.ndarray, str]],
    shards: list[Shards],
    checked: set[tuple[Any, ...]],
) -> ValueLayout:
    """One value's entry, checked.

    ``checked``: the (shape, mesh, shards) of ShardedTensors checked already: one check per
    distinct one, not per tensor (O(shards) each, 8,192 at 8,192 ranks, for thousands of
    tensors that share a few).
    """
    fqn, kind = entry["fqn"], entry["kind"]
    if not isinstance(fqn, str) or kind not in _KINDS:
        raise ValueError(f"a value named {fqn!r} of kind {kind!r}")
    if kind == "bytes":
        return ValueLayout(fqn, "bytes")
    shape = tuple(_naturals(entry["shape"], f"{fqn}'s shape"))
    dtype = getattr(torch, str(entry["dtype"]), None)
    flags = entry["flags"]
    if not isinstance(dtype, torch.dtype) or [type(f) for f in flags] != [bool, bool]:
        raise ValueError(f"{fqn}: dtype {entry['dtype']!r}, flags {flags!r}")
    properties = TensorProperties(dtype=dtype, requires_grad=flags[0], pin_memory=flags[1])
    if kind == "tensor":
        return ValueLayout(fqn, kind, shape, properties)
    mesh, mesh_id = meshes[_natural(entry["mesh"], f"{fqn}'s mesh")]
    placements = tuple(_decode_placement(p, shards, len(shape), fqn) for p in entry["placements"])
    if kind == "dtensor" and len(placements) != mesh.ndim:
        raise ValueError(f"{fqn}: {len(placements)} placements on a {mesh.ndim}-dim mesh")
    if kind == "sharded":
        key = (shape, mesh_id, tuple(map(id, placements)))
        if key not in checked:
            _check_shards(fqn, shape, mesh, placements)
            checked.add(key)
    return ValueLayout(fqn, kind, shape, properties, mesh, placements, mesh_id)


def _decode_placement(entry: Any, shards: list[Shards], ndim: int, fqn: str) -> Any:
    name = entry[0]
    if name == "replicate" and len(entry) == 1:
        return Replicate()
    if name == "shards" and len(entry) == 2:
        return shards[_natural(entry[1], f"{fqn}'s shards")]
    dim = _natural(entry[1], f"{fqn}'s shard dim")
    if dim >= ndim:
        raise ValueError(f"{fqn}: sharded along dim {dim} of {ndim}")
    if name == "shard" and len(entry) == 2:
        return Shard(dim)
    if name == "strided_shard" and len(entry) == 3:
        return _StridedShard(dim, split_factor=_natural(entry[2], f"{fqn}'s split factor"))
    raise ValueError(f"{fqn}: placement {entry!r}")


def _check_shards(fqn: str, shape: tuple[int, ...], mesh: np.ndarray, placements: Any) -> None:
    """A ShardedTensor's shards: one per rank of its mesh, inside it, covering it once.

    Inside and of the tensor's volume in all, and, where they split one dim (FSDP1's), end to
    end along it: then no two overlap and none leaves a hole.
    """
    if len(placements) != 1 or not isinstance(placements[0], Shards):
        raise ValueError(f"{fqn}: a ShardedTensor's placements are not its shards")
    shards = placements[0]
    offsets, sizes = shards.offsets, shards.sizes
    if offsets.shape != (mesh.size, len(shape)):
        raise ValueError(f"{fqn}: {offsets.shape[0]} shards of {offsets.shape[1]} dims")
    if bool((offsets + sizes > np.array(shape, dtype=np.int64)).any()):
        raise ValueError(f"{fqn}: a shard reaches past the tensor's shape {list(shape)}")
    if int(np.prod(sizes, axis=1).sum()) != int(np.prod(shape)):
        raise ValueError(f"{fqn}: its shards overlap or leave holes (volume differs)")
    full = sizes == np.array(shape, dtype=np.int64)
    split = [d for d in range(len(shape)) if not bool(full[:, d].all())]
    if len(split) == 1:
        d = split[0]
        order = np.argsort(offsets[:, d], kind="stable")
        ends = offsets[order, d] + sizes[order, d]
        if bool((offsets[order[1:], d] != ends[:-1]).any()) or int(offsets[order[0], d]) != 0:
            raise ValueError(f"{fqn}: its shards overlap or leave holes along dim {d}")
