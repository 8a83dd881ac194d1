"""``load_torch_file``: the core's reader of untrusted torch.save files, for other packages."""

from __future__ import annotations

import io
import pickle
import pickletools
import re
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shardkit.core import StateDictFileError, load_torch_file
from tests.core.file_mutations import byteswapped, rewrite_zip


class Allowed:
    """A class a caller lets the file name (as FSDP1's ShardedTensor records are let)."""

    def __init__(self) -> None:
        self.value = 3


def test_any_object_of_tensors_and_containers(tmp_path: Path) -> None:
    path = tmp_path / "list.pt"
    first, second = torch.arange(5.0), torch.ones(2, dtype=torch.bfloat16)
    torch.save([first, {"b": second}], path)
    loaded = load_torch_file(path)
    assert torch.equal(loaded[0], first) and torch.equal(loaded[1]["b"], second)


def test_named_classes_only_when_the_caller_allows_them(tmp_path: Path) -> None:
    path = tmp_path / "object.pt"
    torch.save({"obj": Allowed()}, path)
    with pytest.raises(StateDictFileError, match=f"{path} holds something other than tensors"):
        load_torch_file(path)
    assert load_torch_file(path, safe_globals=[Allowed])["obj"].value == 3


def test_a_legacy_file_claiming_more_than_it_holds_is_refused(tmp_path: Path) -> None:
    # torch < 1.6's format: the storage's element count is in the pickle. One changed count
    # claims 8 GiB; torch.load would allocate it before reading a byte of it.
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.zeros(12345)}, path, _use_new_zipfile_serialization=False)
    raw = path.read_bytes()
    count = b"M" + struct.pack("<H", 12345)  # BININT2: the storage's count, then the shape's
    assert raw.count(count) == 2
    path.write_bytes(raw.replace(count, b"J" + struct.pack("<i", 2**31 - 1), 1))
    with pytest.raises(StateDictFileError, match=f"storages declare {(2**31 - 1) * 4} bytes"):
        load_torch_file(path)  # refused from the pickle's numbers, before torch allocates
    # The same file, undamaged, loads.
    path.write_bytes(raw)
    assert torch.equal(load_torch_file(path)["w"], torch.zeros(12345))


def _saved(path: Path, obj: object) -> bytes:
    torch.save(obj, path)
    return path.read_bytes()


def _method(method: int) -> Callable[[str], int]:
    return lambda _: method


def _deflate_data(name: str) -> int:
    return zipfile.ZIP_DEFLATED if name.startswith("data/") else zipfile.ZIP_STORED


def test_deflate_compressed_records_load_as_torch_reads_them(tmp_path: Path) -> None:
    # A valid file: torch.load decompresses the records. Mapped, they were read as their
    # compressed bytes (garbage values, silently).
    path = tmp_path / "deflated.pt"
    state = {"w": torch.arange(300.0).reshape(20, 15), "b": torch.ones(7, dtype=torch.bfloat16)}
    raw = _saved(path, state)
    path.write_bytes(rewrite_zip(raw, _deflate_data))
    with zipfile.ZipFile(path) as archive:
        assert archive.getinfo("deflated/data/0").compress_type == zipfile.ZIP_DEFLATED
    expected = torch.load(path, weights_only=True)
    loaded = load_torch_file(path)
    assert loaded.keys() == expected.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(loaded[key], value) and torch.equal(expected[key], value), key


def test_the_pickle_compressed_too(tmp_path: Path) -> None:
    path = tmp_path / "all.pt"
    raw = _saved(path, {"w": torch.arange(50, dtype=torch.int64)})
    path.write_bytes(rewrite_zip(raw, lambda _: zipfile.ZIP_DEFLATED))
    assert torch.equal(load_torch_file(path)["w"], torch.arange(50, dtype=torch.int64))


@pytest.mark.parametrize(
    ("method", "name"), [(zipfile.ZIP_BZIP2, "bzip2"), (zipfile.ZIP_LZMA, "LZMA")]
)
def test_records_of_other_compression_methods_are_refused(
    method: int, name: str, tmp_path: Path
) -> None:
    path = tmp_path / "other.pt"
    raw = _saved(path, {"w": torch.arange(300.0)})
    path.write_bytes(rewrite_zip(raw, lambda record: method if record == "data/0" else 0))
    expected = f"{path}: record other/data/0 is compressed with zip method {method} \\({name}\\)"
    with pytest.raises(StateDictFileError, match=expected):
        load_torch_file(path)


def _central_entry(raw: bytes, name: str) -> int:
    """Where the central directory's entry of record ``name`` starts."""
    position = zipfile.ZipFile(io.BytesIO(raw)).start_dir
    while True:
        name_len, extra_len, comment_len = struct.unpack("<3H", raw[position + 28 : position + 34])
        if raw[position + 46 : position + 46 + name_len] == name.encode():
            return position
        position += 46 + name_len + extra_len + comment_len


def test_an_encrypted_record_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "secret.pt"
    raw = bytearray(_saved(path, {"w": torch.arange(30.0)}))
    raw[_central_entry(bytes(raw), "secret/data/0") + 8] |= 1  # the flags' "encrypted" bit
    path.write_bytes(bytes(raw))
    with pytest.raises(StateDictFileError, match=f"{path}: record secret/data/0 is encrypted"):
        load_torch_file(path)


@pytest.mark.parametrize("extra", [8, -8])
@pytest.mark.parametrize("method", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_a_record_of_another_size_than_declared_is_refused(
    extra: int, method: int, tmp_path: Path
) -> None:
    # torch.load (unmapped) refuses it; mapped, it read 8 bytes past the record, or short.
    path = tmp_path / "sized.pt"
    state = {"model": {"w": torch.arange(4.0), "v": torch.arange(100.0)}}
    raw = _saved(path, state)
    record = torch.arange(100.0).view(torch.uint8).numpy().tobytes()
    record = record + bytes(extra) if extra > 0 else record[:extra]
    path.write_bytes(rewrite_zip(raw, lambda _: method, {"data/1": record}))
    with pytest.raises(RuntimeError, match="does not match expected size"):
        torch.load(io.BytesIO(path.read_bytes()), weights_only=True)
    expected = (
        f"{path}: tensor 'model.v': record sized/data/1 holds {400 + extra} bytes, but its "
        f"storage is declared as 400 \\(100 elements of FloatStorage\\)"
    )
    with pytest.raises(StateDictFileError, match=expected):
        load_torch_file(path)


def test_tensors_sharing_one_record_load_as_torch_reads_them(tmp_path: Path) -> None:
    path = tmp_path / "views.pt"
    base = torch.arange(24.0)
    state = {"a": base[:12].view(3, 4), "b": base[12:].view(4, 3).t(), "c": base[5:9]}
    raw = _saved(path, state)
    with zipfile.ZipFile(io.BytesIO(raw)) as archive:
        assert [i.filename for i in archive.infolist()].count("views/data/0") == 1
    for data in (raw, rewrite_zip(raw, _deflate_data)):
        path.write_bytes(data)
        loaded = load_torch_file(path)
        for key, value in state.items():
            assert torch.equal(loaded[key], value), key


def test_a_big_endian_file_loads_as_torch_reads_it(tmp_path: Path) -> None:
    # The byteorder record says "big": torch swaps each storage's bytes as it loads it.
    path = tmp_path / "big.pt"
    state = {"w": torch.arange(10.0), "i": torch.arange(5, dtype=torch.int64) << 40}
    raw = _saved(path, {k: byteswapped(v) for k, v in state.items()})
    for method in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        path.write_bytes(rewrite_zip(raw, _method(method), {"byteorder": b"big"}))
        loaded = load_torch_file(path)
        for key, value in state.items():
            assert torch.equal(loaded[key], value), key


class _PathLike:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __fspath__(self) -> str:
        return str(self.path)


def test_any_path_type(tmp_path: Path) -> None:
    path = tmp_path / "w.pt"
    torch.save({"w": torch.arange(3.0)}, path)
    for given in (str(path), path, _PathLike(path)):
        assert torch.equal(load_torch_file(given)["w"], torch.arange(3.0))


def _legacy_pickles_end(raw: bytes, pickles: int) -> int:
    """Where the first ``pickles`` pickles of a legacy file end."""
    stream = io.BytesIO(raw)
    for _ in range(pickles):
        for _op in pickletools.genops(stream):
            pass
    return stream.tell()


def test_a_legacy_storage_left_out_of_the_storage_list_is_refused(tmp_path: Path) -> None:
    # Two views of one storage; the second's storage key damaged: torch allocates a storage
    # for the new key, never fills it (the list of storages whose bytes follow lacks it) and
    # loads whatever memory held as "b".
    path = tmp_path / "legacy.pt"
    base = torch.arange(15.0)
    state = {"a": base[:12].view(3, 4), "b": base[12:]}
    torch.save(state, path, _use_new_zipfile_serialization=False)
    raw = path.read_bytes()
    (key,) = pickle.loads(raw[_legacy_pickles_end(raw, 4) :])  # the storage list
    assert raw.count(key.encode()) == 3  # each view's persistent id, and the storage list
    second = raw.index(key.encode(), raw.index(key.encode()) + 1)
    path.write_bytes(raw[:second] + b"0" + raw[second + 1 :])
    expected = (
        f"{path}: its storage keys do not match the storages its pickle declares "
        f"(storage '0{key[1:]}' of tensor 'b')"
    )
    with pytest.raises(StateDictFileError, match=re.escape(expected)):
        load_torch_file(path)


def test_a_legacy_storage_of_another_count_than_declared_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.arange(6.0)}, path, _use_new_zipfile_serialization=False)
    raw = path.read_bytes()
    start = _legacy_pickles_end(raw, 5)  # the storage's element count, then its bytes
    assert struct.unpack("<q", raw[start : start + 8]) == (6,)
    path.write_bytes(raw[:start] + struct.pack("<q", 5) + raw[start + 8 : -4])
    expected = "holds 5 elements at byte .*, its pickle declares 6"
    with pytest.raises(
        StateDictFileError, match=f"{path}: storage '.*' \\(of tensor 'w'\\) {expected}"
    ):
        load_torch_file(path)


@pytest.mark.parametrize("before", [b"PK\x05\x06", b"PK\x06\x06"], ids=["end", "zip64 end"])
def test_a_byte_before_an_end_record_is_read_as_torch_reads_it(
    before: bytes, tmp_path: Path
) -> None:
    # torch's reader takes the central directory's offset from the end record (the zip64 one
    # where it is found); Python's zipfile assumes the directory ends where the end records
    # start and shifts every offset by the difference, so it refused these files.
    path = tmp_path / "gap.pt"
    raw = _saved(path, {"w": torch.arange(20.0)})
    at = raw.rindex(before)  # torch.save writes zip64 end records too
    path.write_bytes(raw[:at] + b"\0" + raw[at:])
    expected = torch.load(io.BytesIO(path.read_bytes()), weights_only=True)
    assert torch.equal(load_torch_file(path)["w"], expected["w"])


def _declare_size(path: Path, record: str, size: int) -> None:
    """Set a record's uncompressed size in the central directory (what torch allocates)."""
    raw = bytearray(path.read_bytes())
    struct.pack_into("<L", raw, _central_entry(bytes(raw), record) + 24, size)
    path.write_bytes(bytes(raw))


def test_a_deflate_record_that_decompresses_to_another_size_is_refused(tmp_path: Path) -> None:
    # torch decompresses into a buffer of the declared size and does not check it was filled.
    path = tmp_path / "short.pt"
    raw = _saved(path, {"w": torch.arange(100.0)})
    path.write_bytes(rewrite_zip(raw, _deflate_data))
    _declare_size(path, "short/data/0", 404)
    expected = (
        f"{path}: record short/data/0 is damaged: it declares 404 bytes, its compressed data "
        f"decompresses to 400"
    )
    with pytest.raises(StateDictFileError, match=re.escape(expected)):
        load_torch_file(path)


def test_a_deflate_record_declaring_more_than_deflate_expands_to_is_refused(
    tmp_path: Path,
) -> None:
    path = tmp_path / "huge.pt"
    raw = _saved(path, {"w": torch.arange(100.0)})
    path.write_bytes(rewrite_zip(raw, _deflate_data))
    _declare_size(path, "huge/data/0", 2**31)
    with pytest.raises(StateDictFileError, match="more than DEFLATE can expand to"):
        load_torch_file(path)  # refused from the numbers: nothing allocated, nothing inflated
