"""A state dict written to one file from tensors produced one at a time.

For state dicts that never exist whole in memory: a converter that rebuilds one tensor at a
time from another checkpoint, say. The writers of ``file_writers.py`` take the entries up
front (that fixes the safetensors header) and then each tensor's bytes as it comes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

from shardkit.core.formats.file_writers import Entry, FileWriter, format_of, open_writer

__all__ = ["partial_writer", "write_state_dict_file"]


def write_state_dict_file(
    path: str | os.PathLike[str],
    expected: Mapping[str, torch.Tensor],
    tensors: Iterable[tuple[str, torch.Tensor]],
) -> None:
    """Write a state dict to one file from tensors produced one at a time.

    ``expected`` announces every entry, in file order: its key and a tensor of its shape and
    dtype (meta tensors do; nothing is read from them). ``tensors`` then yields ``(key,
    tensor)`` in that same order; each is written and let go before the next is asked for,
    so a state dict larger than memory streams through one tensor at a time.

    ``.safetensors`` paths are written as safetensors, other paths in torch.save's format
    (``torch.load(path, weights_only=True)`` reads them). The file appears complete or not
    at all: it is written under a temporary name (``<name>.partial``) and renamed; on any
    error, including one raised by ``tensors``, the temporary file is removed.

    Raises:
        ValueError: ``tensors`` yields a key out of order or never announced, or a tensor
            whose shape or dtype differs from the announcement (naming the key), or ends early.
        OSError: writing failed (a full disk, say), naming the file; nothing is left behind.
    """
    target = Path(path)
    entries = [Entry(k, tuple(v.shape), v.dtype) for k, v in expected.items()]
    with partial_writer(target, entries) as writer:
        _write_in_order(writer, entries, tensors, target)


@contextlib.contextmanager
def partial_writer(
    target: Path, entries: list[Entry], key_order: list[str] | None = None
) -> Iterator[FileWriter]:
    """A writer of ``target``'s temporary file (``<name>.partial``), moved into place at the end.

    When the block ends, the file is finished and renamed onto ``target``; when anything
    raises, from opening the file (its header written) to renaming it, the writer is let go
    and the temporary file removed. An ``OSError`` that names no file (a full disk: ``ENOSPC``
    from a write) is raised again naming ``target``.
    """
    partial = target.with_name(target.name + ".partial")
    writer: FileWriter | None = None
    try:
        writer = open_writer(partial, entries, format_of(target), key_order)
        yield writer
        done, writer = writer, None
        done.close()
        partial.replace(target)
    except BaseException as error:
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.close()  # lets go of the file, which is then removed
        partial.unlink(missing_ok=True)
        if isinstance(error, OSError) and error.filename is None:
            raise OSError(error.errno, error.strerror or str(error), str(target)) from error
        raise


def _write_in_order(
    writer: FileWriter, entries: list[Entry], tensors: Iterable[tuple[str, torch.Tensor]], at: Path
) -> None:
    pending = iter(entries)
    for key, tensor in tensors:
        entry = next(pending, None)
        if entry is None or key != entry.name:
            wanted = "no more keys" if entry is None else repr(entry.name)
            raise ValueError(f"{at}: got {key!r} where {wanted} was announced")
        found = Entry(key, tuple(tensor.shape), tensor.dtype)
        if found != entry:
            raise ValueError(
                f"{at}: {key} was announced as {list(entry.shape)} {entry.dtype}, "
                f"got {list(found.shape)} {found.dtype}"
            )
        writer.write(key, tensor.detach().cpu())
        del tensor  # on disk now: the producer may free it before making the next
    missing = [e.name for e in pending]
    if missing:
        raise ValueError(f"{at}: the tensors ended before {missing} were written")
