"""What the converter refuses, with a message naming the file, key or unit, writing nothing.

Each case starts from a good FSDP1 checkpoint and breaks one thing: the world size, the model,
the wrap policy or settings, the files (truncated, corrupt, missing, duplicated), or hides a
pickled object that ``torch.load(weights_only=True)`` refuses. The output's folder must stay
empty: no output, no temporary file.
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import struct
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from shardkit.core.formats import file_writers
from shardkit.legacy.convert.cli import main
from tests.core.full_disk import full_disk_open
from tests.legacy.convert_support import (
    BLOCK,
    FACTORY,
    SETTINGS,
    Fsdp1Run,
    Payload,
    Setting,
)

Checkpoints = Callable[[Setting], Fsdp1Run]


def _refused(
    args: list[str], match: str, out: Path, capsys: pytest.CaptureFixture[str], output: str
) -> None:
    """The conversion fails with ``match`` in its message and leaves ``out`` empty."""
    out.mkdir(exist_ok=True)
    assert main([*args, "-o", str(out / output)]) == 1
    message = capsys.readouterr().err
    assert match in message, message
    assert list(out.iterdir()) == [], "something was written"


@pytest.fixture
def flat(fsdp1_checkpoints: Checkpoints, tmp_path: Path) -> Fsdp1Run:
    """A copy of the W=2, use_orig_params=False checkpoints, free to break."""
    run = fsdp1_checkpoints(SETTINGS["W2-flat"])
    shutil.copytree(run.folder, tmp_path / "ckpt")
    return Fsdp1Run(run.setting, tmp_path / "ckpt", run.full, run.after)


def _local(run: Fsdp1Run, *files: str, **changes: str | None) -> list[str]:
    """A local-mode command line, with options changed or removed (None)."""
    options = {"--model": FACTORY, "--world-size": "2", "--wrap": BLOCK, **changes}
    args = ["local", *(files or run.local_files)]
    for key, value in options.items():
        if value is not None:
            args += [key] if value == "" else [key, value]
    return args


LOCAL_CASES: dict[str, tuple[dict[str, str | None], str]] = {
    "wrong world size": ({"--world-size": "4"}, "wrong world size: the files were saved by 2"),
    "wider model": (
        {"--model": "tests.legacy.fsdp1_models:wider_gpt"},
        "unit _flat_param holds 282 elements in all, the model gives 376",
    ),
    "deeper model": (
        {"--model": "tests.legacy.fsdp1_models:deeper_gpt"},
        "the layout has ['blocks.3._flat_param'] that the file lacks",
    ),
    "no wrap policy": ({"--wrap": None}, "the file has ['blocks.0._flat_param',"),
    "use_orig_params": ({"--use-orig-params": ""}, "saved it with use_orig_params=False"),
}


@pytest.mark.parametrize("case", list(LOCAL_CASES))
@pytest.mark.parametrize("output", ["converted", "model.safetensors"])
def test_local_settings_that_do_not_match(
    flat: Fsdp1Run, case: str, output: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    changes, match = LOCAL_CASES[case]
    _refused(_local(flat, **changes), match, tmp_path / "out", capsys, output)


def test_a_wrong_param_dtype(
    fsdp1_checkpoints: Checkpoints, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """bf16 aligns every parameter to 8 elements, fp32 to 4: the units' sizes differ."""
    run = fsdp1_checkpoints(SETTINGS["W2-orig"])
    args = _local(run, **{"--use-orig-params": "", "--param-dtype": "bf16"})
    _refused(args, "or mixed precision differ from those FSDP1 had", tmp_path, capsys, "out")


def test_missing_and_duplicated_rank_files(
    flat: Fsdp1Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rank0, _ = flat.local_files
    out = tmp_path / "out"
    _refused(_local(flat, rank0), "files of rank(s) [1] are missing", out, capsys, "converted")
    _refused(_local(flat, rank0, rank0), "several files of the same rank", out, capsys, "c")


def test_truncated_and_corrupt_rank_files(
    flat: Fsdp1Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rank1 = Path(flat.local_files[1])
    data = rank1.read_bytes()
    out = tmp_path / "out"
    rank1.write_bytes(data[: len(data) // 2])
    _refused(_local(flat), f"{rank1}: truncated or corrupt", out, capsys, "converted")
    rank1.write_bytes(bytes(range(256)) * 8)
    _refused(_local(flat), f"{rank1}: not a torch.save file", out, capsys, "c")


def test_a_pickled_object_is_refused_not_run(
    flat: Fsdp1Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "unpickled"
    rank1 = Path(flat.local_files[1])
    state = torch.load(flat.folder / "full.pt", weights_only=True)
    torch.save({**state, "extra": Payload(marker)}, rank1)
    out = tmp_path / "out"
    refused = f"{rank1} holds something other than tensors and plain containers"
    _refused(_local(flat), refused, out, capsys, "converted")
    torch.save({**state, "extra": Payload(marker)}, flat.folder / "full.pt")
    full = ["full", str(flat.folder / "full.pt")]
    _refused(full, "Unsupported global", out, capsys, "model.safetensors")
    assert not marker.exists()


def test_a_legacy_file_claiming_more_than_it_holds_is_refused(
    flat: Fsdp1Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A FULL checkpoint in torch's pre-1.6 format, one storage's size damaged to claim 8 GiB:
    # refused from the pickle's numbers, before torch would allocate it.
    state = torch.load(flat.folder / "full.pt", weights_only=True)
    path = tmp_path / "legacy.pt"
    torch.save({**state, "marker": torch.zeros(12345)}, path, _use_new_zipfile_serialization=False)
    count = b"M" + struct.pack("<H", 12345)  # BININT2: the storage's count, then the shape's
    raw = path.read_bytes()
    assert raw.count(count) == 2
    path.write_bytes(raw.replace(count, b"J" + struct.pack("<i", 2**31 - 1), 1))
    claimed = f"{path}: its storages declare"
    _refused(["full", str(path)], claimed, tmp_path / "out", capsys, "model.safetensors")


def test_full_mode_refuses_what_is_not_full(
    flat: Fsdp1Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    local = ["full", flat.local_files[0]]
    _refused(local, "an FSDP1 LOCAL_STATE_DICT file", out, capsys, "converted")
    state = torch.load(flat.folder / "full.pt", weights_only=True)
    del state["blocks.1.mlp.0.bias"]
    state["blocks.2.ln1.weight"] = torch.zeros(7)
    torch.save(state, flat.folder / "full.pt")
    args = ["full", str(flat.folder / "full.pt"), "--model", FACTORY]
    _refused(args, "blocks.1.mlp.0.bias: missing", out, capsys, "converted")
    _refused(args, "blocks.2.ln1.weight: [7] float32 in the checkpoint, [6] float32", out,
             capsys, "converted")  # fmt: skip


def test_sharded_checkpoints_that_do_not_match(
    flat: Fsdp1Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = str(flat.folder / "sharded")
    out = tmp_path / "out"
    wider = ["sharded", folder, "--model", "tests.legacy.fsdp1_models:wider_gpt"]
    _refused(wider, "does not match the model (TinyGPT)", out, capsys, "converted")
    _refused(wider, "tok.weight: [37, 6] float32 in the checkpoint, [37, 8] float32", out,
             capsys, "model.safetensors")  # fmt: skip
    deeper = ["sharded", folder, "--model", "tests.legacy.fsdp1_models:deeper_gpt"]
    _refused(deeper, "blocks.3.ln1.weight: missing", out, capsys, "converted")
    other = ["sharded", folder, "--model", "tests.legacy.fsdp1_models:stack"]
    _refused(other, "none of the model's keys (['layers.0.bias',", out, capsys, "converted")


def _data_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.distcp"))


def test_broken_sharded_checkpoints(
    flat: Fsdp1Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = flat.folder / "sharded"
    args = ["sharded", str(folder), "--model", FACTORY]
    out = tmp_path / "out"
    last = _data_files(folder)[-1]
    data = last.read_bytes()
    # Bytes overwritten in place: found only when that tensor is read, mid-write.
    last.write_bytes(data[:100] + bytes(len(data) - 200) + data[-100:])
    _refused(args, f"{folder}: cannot read model.", out, capsys, "converted")
    _refused(args, f"{folder}: cannot read model.", out, capsys, "model.safetensors")
    last.write_bytes(data[: len(data) // 2])
    _refused(args, f"{last}: truncated: {len(data) // 2} bytes", out, capsys, "converted")
    last.unlink()
    _refused(args, f"{last}: missing", out, capsys, "converted")


def test_dcp_metadata_is_never_unpickled_freely(
    flat: Fsdp1Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "unpickled"
    folder = flat.folder / "sharded"
    (folder / ".metadata").write_bytes(pickle.dumps({"payload": Payload(marker)}))
    args = ["sharded", str(folder)]
    _refused(args, "refused global pathlib.Path.touch", tmp_path / "out", capsys, "converted")
    assert not marker.exists()
    (folder / ".metadata").write_bytes(b"\x80\x04\x95")
    _refused(args, "truncated or corrupt", tmp_path / "out", capsys, "converted")


def test_an_existing_output_is_left_alone(
    flat: Fsdp1Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"keep me")
    assert main(["full", str(flat.folder / "full.pt"), "-o", str(out)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert out.read_bytes() == b"keep me"


def _small_full(tmp_path: Path) -> Path:
    """A FULL checkpoint of two tensors (torch.save of a plain state dict)."""
    path = tmp_path / "full.pt"
    torch.save({"a.weight": torch.randn(64, 32), "b.bias": torch.arange(9.0)}, path)
    return path


@pytest.mark.parametrize("room", [0, 4096], ids=["header", "mid-write"])
def test_a_full_disk_leaves_nothing_and_says_so_in_one_line(
    room: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _small_full(tmp_path)
    monkeypatch.setattr(file_writers, "open", full_disk_open(room), raising=False)
    out = tmp_path / "out"
    out.mkdir()
    target = out / "model.safetensors"
    assert main(["full", str(source), "-o", str(target), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no traceback
    assert err.startswith("shardkit-convert: error: [Errno 28] No space left on device"), err
    assert str(target) in err, err
    assert list(out.iterdir()) == [], "a partial file was left behind"


def test_a_full_disk_under_dcp_output_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _small_full(tmp_path)

    def full_disk_fsync(fd: int) -> None:  # where a full disk shows when writes are delayed
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full_disk_fsync)
    out = tmp_path / "out"
    out.mkdir()
    target = out / "converted"
    assert main(["full", str(source), "-o", str(target), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(target) in err and "No space left" in err, err
    assert list(out.iterdir()) == [], "a partial checkpoint was left behind"


def test_a_directory_where_a_file_is_expected_and_the_reverse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "ckpt.pt"
    folder.mkdir()
    out = tmp_path / "out"
    _refused(["full", str(folder)], f"{folder}: is a directory, not a file", out, capsys, "c")
    source = _small_full(tmp_path)
    args = ["sharded", str(source)]
    _refused(args, f"{source}: is a file, not a directory", out, capsys, "c")
    missing = tmp_path / "nothing.pt"
    _refused(["full", str(missing)], f"{missing}: no such file", out, capsys, "c")


def _dcp(folder: Path) -> Path:
    """A small DCP checkpoint, saved in this process."""
    state = {"a.weight": torch.randn(8, 4), "b.bias": torch.arange(3.0)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_save(state, checkpoint_id=folder, no_dist=True)
    return folder


def _no_properties(metadata: Metadata) -> None:
    metadata.state_dict_metadata["a.weight"].properties = None  # type: ignore[union-attr]


def _storage_path_not_a_string(metadata: Metadata) -> None:
    for info in (metadata.storage_data or {}).values():
        info.relative_path = 5


def _storage_path_outside(metadata: Metadata) -> None:
    for info in (metadata.storage_data or {}).values():
        info.relative_path = "../../elsewhere.distcp"


def _storage_offset_not_an_int(metadata: Metadata) -> None:
    for info in (metadata.storage_data or {}).values():
        info.offset = "x"


def _entries_not_a_dict(metadata: Metadata) -> None:
    metadata.state_dict_metadata = [1, 2]  # type: ignore[assignment]


METADATA_DAMAGE: dict[str, tuple[Callable[[Metadata], None], str]] = {
    "entries not a dict": (_entries_not_a_dict, "state_dict_metadata is a list"),
    "no properties": (_no_properties, "a.weight: no dtype"),
    "data file not a string": (_storage_path_not_a_string, "its data file is 5"),
    "data file outside": (_storage_path_outside, "its data file is '../../elsewhere.distcp'"),
    "offset not an int": (_storage_offset_not_an_int, "its bytes are at offset 'x'"),
}


@pytest.mark.parametrize("case", list(METADATA_DAMAGE))
def test_damaged_dcp_metadata_is_refused_naming_the_file(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each once escaped as a raw AttributeError or TypeError (a traceback from the script).
    folder = _dcp(tmp_path / "ckpt")
    damage, match = METADATA_DAMAGE[case]
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    damage(metadata)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    expected = f"{folder / '.metadata'}: damaged DCP metadata: "
    _refused(["sharded", str(folder)], expected, tmp_path / "out", capsys, "c")
    _refused(["sharded", str(folder)], match, tmp_path / "out", capsys, "c.safetensors")
