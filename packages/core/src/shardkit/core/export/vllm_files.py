"""vLLM's worker committing an export from files: all or nothing with no copy held in memory.

With its mirror in files (``vllm_receiver(mirror_dir=...)``) and all or nothing (the
default), a receiver writes each tensor an export brings to a file of its own beside the last
export's (``mirror_files.py``) and sends the engine nothing per bucket. Its commit hands the
worker two lists of files: the tensors to load (this export's file where it wrote one, the
last export's where a delta left a tensor as it was: vLLM's loads take whole layers), and the
last export's files of the same names. The worker loads the first list in one call, between
two engine steps, reading one file at a time; if the load raises, it loads the second the
same way, which puts back what served. So neither the staged export nor a copy of the
engine's tensors is held in memory (``vllm_versions.commit_staged`` holds both): the engine's
process holds one layer's tensors beyond its model while it loads. Where there is nothing to
put back from (the first export into an engine: no files yet), the commit keeps the engine's
tensors in memory to put back, as ``commit_staged`` does, unless the engine still serves the
weights it started with from a local folder of safetensors files: then those files are what
it puts back, each tensor read at its offset with plain calls (the header checked first).

The lists come over vLLM's RPC as plain values, ``[name, path, shape, dtype]``, from a
trainer process on this host. Each entry is checked before anything is loaded: a regular file
of this user's, named as ``MirrorFiles`` names them in a folder it made, a known dtype, and
exactly the shape's bytes; a list that does not pass is refused, naming each tensor and why.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from shardkit.core.export.mirror_files import read_tensor_file
from shardkit.core.export.vllm_versions import commit_loads, restored, serving_version, snapshot
from shardkit.core.export.vllm_worker_load import load_on_worker, model_of

__all__ = ["FileEntry", "TensorFile", "checked_files", "commit_files_on_worker", "started_from"]

FileEntry = tuple[str, str, list[int], str]
"""``[name, path, shape, dtype name]``: one tensor's file, as vLLM's RPC carries it."""

_DTYPES = frozenset(
    {
        "bfloat16",
        "float16",
        "float32",
        "float64",
        "float8_e4m3fn",
        "float8_e5m2",
        "int8",
        "uint8",
        "int16",
        "int32",
        "int64",
        "bool",
    }
)
_FILE_NAME = re.compile(r"[0-9]+\.bin")
_MAX_DIMS = 8


@dataclass(frozen=True, slots=True)
class TensorFile:
    """One tensor's file, checked (or its place in a checkpoint's file: ``offset``)."""

    name: str
    path: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int | None = None
    """Where its bytes start in a safetensors file (None: the whole file is the tensor)."""

    def read(self) -> torch.Tensor:
        """The tensor, read from its file (its size checked again as it is read)."""
        if self.offset is None:
            return read_tensor_file(self.path, self.shape, self.dtype, self.name)
        tensor = torch.empty(self.shape, dtype=self.dtype)
        wanted = tensor.numel() * self.dtype.itemsize
        with open(self.path, "rb") as file:
            file.seek(self.offset)
            read = file.readinto(tensor.view(-1).view(torch.uint8).numpy().data) if wanted else 0
        if read != wanted:
            raise ValueError(f"{self.name}: {self.path} ends before its {wanted} bytes")
        return tensor


def checked_files(entries: Sequence[Any], what: str) -> list[TensorFile]:
    """``entries`` as :class:`TensorFile` s, every one checked before any is read.

    Raises:
        ValueError: an entry is malformed, names a tensor twice, or its file is not a regular
            file of this user's named as a receiver's mirror names them, or is not exactly its
            shape's bytes. Every problem is named, by tensor.
    """
    files: list[TensorFile] = []
    problems: list[str] = []
    seen: set[str] = set()
    for entry in entries:
        found = _checked(entry)
        if isinstance(found, str):
            problems.append(found)
        elif found.name in seen:
            problems.append(f"{found.name}: named twice")
        else:
            seen.add(found.name)
            files.append(found)
    if problems:
        raise ValueError(
            f"the files {what} were refused, nothing was loaded: " + "; ".join(problems[:8])
        )
    return files


def _checked(entry: Any) -> TensorFile | str:
    """One entry checked: the file, or what is wrong with it."""
    if not isinstance(entry, (list, tuple)) or len(entry) != 4:
        return f"not [name, path, shape, dtype]: {entry!r:.80}"
    name, path, shape, dtype = entry
    if not isinstance(name, str) or not name:
        return f"a tensor's name is {name!r:.40}"
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        return f"{name}: dtype {dtype!r:.40} is not one a tensor file holds"
    if (
        not isinstance(shape, (list, tuple))
        or len(shape) > _MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        return f"{name}: shape {shape!r:.60} is not a list of sizes"
    if not isinstance(path, str):
        return f"{name}: its path is {path!r:.40}"
    file = Path(path)
    if (
        not file.is_absolute()
        or not _FILE_NAME.fullmatch(file.name)
        or not file.parent.name.startswith("shardkit-")
    ):
        return f"{name}: {path} is not a file of a receiver's mirror"
    try:
        info = os.lstat(file)
    except OSError as error:
        return f"{name}: {path} cannot be read ({error.strerror})"
    torch_dtype = getattr(torch, dtype)
    nbytes = torch_dtype.itemsize
    for size in shape:
        nbytes *= size
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        return f"{name}: {path} is not a regular file of this user's"
    if info.st_size != nbytes:
        return f"{name}: {path} holds {info.st_size} bytes, its shape {nbytes}"
    return TensorFile(name, file, tuple(shape), torch_dtype)


def _read_all(files: list[TensorFile]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each file's tensor in turn: one read as the load asks for it, none held after."""
    for each in files:
        yield each.name, each.read()


def commit_files_on_worker(
    worker: Any, version: int, path: str, load: Sequence[Any], back: Sequence[Any]
) -> int:
    """On the worker: export ``version`` loaded from the files ``load`` names; its number.

    ``back`` names the files of the export that serves now, the same tensors; if the load
    raises, they are loaded the same way. Empty where none are in files: then the engine's
    tensors are copied in memory first, to put back (the first export into an engine).

    Raises:
        ValueError: an entry of either list was refused (nothing loaded), or ``back`` names
            other tensors than ``load``.
        RuntimeError: the load raised; the message says what serves now.
    """
    new = checked_files(load, f"of export {version}")
    old = checked_files(back, f"to put back if export {version} fails")
    if old and sorted(f.name for f in old) != sorted(f.name for f in new):
        raise ValueError(
            f"the files to put back if export {version} fails name other tensors than the "
            "files to load; nothing was loaded"
        )

    def load_new() -> None:
        load_on_worker(worker, path, _read_all(new))

    how = "its tensors loaded again from their files"
    if not old and serving_version(worker) is None:
        old = started_from(worker, {f.name for f in new}) or []
        how = "its tensors loaded again from the checkpoint it started from"
    if old:

        def put_back() -> str:
            load_on_worker(worker, path, _read_all(old))
            return how

        return commit_loads(worker, version, path, load_new, put_back)
    # Nothing in files to put back: a copy in memory, as a staged commit keeps.
    before = snapshot(model_of(worker))
    return commit_loads(worker, version, path, load_new, partial(restored, before))


# safetensors' dtype names: what a checkpoint's header may say.
_CHECKPOINT_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 * 2**20


def started_from(worker: Any, names: set[str]) -> list[TensorFile] | None:
    """The tensors ``names`` in the checkpoint the worker's engine started from.

    None where that is not a local folder of safetensors files, or a header does not check
    out (then the caller keeps a copy in memory instead), or a name is not in it.
    """
    config = getattr(getattr(worker, "model_runner", None), "model_config", None)
    source = getattr(config, "model", None)
    folder = Path(source) if isinstance(source, str) else None
    if folder is None or not folder.is_dir():
        return None
    found: dict[str, TensorFile] = {}
    try:
        for file in sorted(folder.glob("*.safetensors")):
            found.update(_header(file, names))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if set(found) != names:
        return None
    return [found[name] for name in sorted(names)]


def _header(file: Path, names: set[str]) -> dict[str, TensorFile]:
    """The entries of ``names`` in one safetensors file, every offset checked against its size.

    Raises:
        ValueError, KeyError, TypeError: the header is not a safetensors header, or an entry's
            offsets, dtype or shape do not fit the file.
    """
    size = file.stat().st_size
    with open(file, "rb") as opened:
        length = int.from_bytes(opened.read(8), "little")
        if not 2 <= length <= min(_MAX_HEADER, size - 8):
            raise ValueError(f"{file}: a header of {length} bytes")
        header = json.loads(opened.read(length))
    if not isinstance(header, dict):
        raise ValueError(f"{file}: its header is not a table")
    start = 8 + length
    found = {}
    for name, entry in header.items():
        if name not in names:
            continue
        dtype = _CHECKPOINT_DTYPES[entry["dtype"]]
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(x) for x in entry["data_offsets"])
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= size - start:
            raise ValueError(f"{file}: {name}'s offsets do not fit")
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{file}: {name}'s bytes are not its shape's")
        found[name] = TensorFile(name, file, shape, dtype, offset=start + begin)
    return found
