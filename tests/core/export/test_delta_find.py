"""Finding a delta's changes on one rank: the sample that tells a dense part, and the part
refreshed in place either way, bit for bit what packing it afresh gives."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardkit.core.export import delta_find, delta_sample
from shardkit.core.export.axis_gathers import AxisGather
from shardkit.core.export.delta_encoding import DENSE, local_changes
from tests.core.export.dispatch_counts import CountKernels

SHAPES = [(3000, 96), (37, 5), (1000, 300), (64,)]


def _pieces() -> tuple[list[tuple[AxisGather, torch.Tensor, int]], torch.Tensor]:
    """fp32 pieces of a rank (part 0 of 2 along dim 0) and a part that packed them in bf16."""
    torch.manual_seed(0)
    pieces, offset = [], 0
    for shape in SHAPES:
        gather = AxisGather(0, 0, 2, shape)
        piece = torch.randn(gather.piece_shape(0)) * 0.02
        pieces.append((gather, piece, offset))
        offset += -(-gather.padded_numel * 2 // 8) * 8
    return pieces, _packed(pieces, offset)


def _packed(pieces: list[tuple[AxisGather, torch.Tensor, int]], nbytes: int) -> torch.Tensor:
    """The part packed afresh: each piece cast to bf16 at its offset, padding zero."""
    part = torch.zeros(nbytes, dtype=torch.uint8)
    for _, piece, offset in pieces:
        flat = piece.reshape(-1).to(torch.bfloat16)
        part[offset : offset + 2 * flat.numel()] = flat.view(torch.uint8)
    return part


def _kept(
    pieces: list[tuple[AxisGather, torch.Tensor, int]], part: torch.Tensor
) -> list[torch.Tensor]:
    """Each piece's last exported elements in a kept bf16 part, as int16 (views)."""
    return [part[offset : offset + 2 * p.numel()].view(torch.int16) for _, p, offset in pieces]


def _move(pieces: list[tuple[AxisGather, torch.Tensor, int]], share: float) -> None:
    """Move about ``share`` of every piece's elements by far more than a bf16 unit."""
    generator = torch.Generator().manual_seed(int(share * 1000))
    for _, piece, _ in pieces:
        moved = torch.rand(piece.shape, generator=generator) < share
        piece.add_(moved * 0.5)


@pytest.mark.parametrize(("share", "dense"), [(0.01, False), (0.05, False), (0.3, True)])
def test_the_sample_tells_a_dense_part_and_writes_nothing(share: float, dense: bool) -> None:
    pieces, part = _pieces()
    _move(pieces, share)
    before = part.clone()
    scratch = torch.empty(delta_find.SPAN_ELEMENTS, dtype=torch.bfloat16)
    assert delta_sample.sample_is_dense(pieces, _kept(pieces, part), scratch) is dense
    assert torch.equal(part, before)


def _sampled_window_by_window(
    pieces: list[tuple[AxisGather, torch.Tensor, int]], part: torch.Tensor
) -> tuple[int, int]:
    """The sample's changed and seen elements, one window at a time: the oracle."""
    changed = seen = 0
    stride, window = delta_sample.SAMPLE_STRIDE, delta_sample.SAMPLE_WINDOW
    for _, piece, offset in pieces:
        flat, first = piece.reshape(-1), offset // 2
        kept = part[offset : offset + 2 * flat.numel()].view(torch.int16)
        for at in range(-(-first // stride) * stride - first, flat.numel(), stride):
            new = flat[at : at + window].to(torch.bfloat16).view(torch.int16)
            changed += int((new != kept[at : at + window]).sum())
            seen += new.numel()
    return changed, seen


@pytest.mark.parametrize("scratch_windows", [1, 3, 1000])
@pytest.mark.parametrize("share", [0.1, 0.2])
def test_the_sample_reads_its_windows_at_once_and_one_count_a_part(
    scratch_windows: int, share: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The windows as one strided view a piece (in batches of what the scratch holds), their
    changes summed where they are counted: the same verdict as window by window, with ops a
    piece, not a window, and one count read back a part (on a GPU each read waits for the
    device: 283 a part of 75M elements before)."""
    monkeypatch.setattr(delta_sample, "SAMPLE_STRIDE", 64)
    monkeypatch.setattr(delta_sample, "SAMPLE_WINDOW", 8)
    pieces, part = _pieces()
    _move(pieces, share)
    changed, seen = _sampled_window_by_window(pieces, part)
    assert seen > 5000  # thousands of windows, some cut short by a piece's end
    scratch = torch.empty(8 * scratch_windows, dtype=torch.bfloat16)
    with CountKernels() as counted:  # type: ignore[no-untyped-call]
        dense = delta_sample.sample_is_dense(pieces, _kept(pieces, part), scratch)
    assert dense is (changed * DENSE > seen) is (share > 1 / DENSE)
    assert counted.reads == 1
    # 4 ops (cast, compare, count, sum) a batch of windows, plus each piece's short window
    batches = seen // 8 // scratch_windows + len(pieces)
    assert counted.kernels <= 4 * (batches + len(pieces)) + 1, counted.kernels


@pytest.mark.parametrize("share", [0.01, 0.3])
@pytest.mark.parametrize("chunk", [1000, 1 << 22])
def test_a_refreshed_part_is_the_part_packed_afresh(
    share: float, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sparse: the changes are exactly the bits that differ, and the part is refreshed. Dense
    (told by the sample, nothing compared): None, and the part is refreshed all the same."""
    monkeypatch.setattr(delta_find, "SPAN_ELEMENTS", chunk)
    pieces, part = _pieces()
    old = part.clone()
    _move(pieces, share)
    length = part.numel() // 2
    found = delta_find.refresh_part(pieces, part, torch.bfloat16, limit=length // DENSE)
    fresh = _packed(pieces, part.numel())
    assert torch.equal(part, fresh)
    if share > 1 / DENSE:
        assert found is None
        return
    assert found is not None
    oracle = local_changes(fresh.view(torch.bfloat16), old.view(torch.bfloat16))
    _same_changes(found, oracle)


def _same_changes(found: Any, oracle: Any) -> None:
    """``found`` (a part's walk: int32 positions, int8 steps saturated at -128) against the
    element-wise oracle (int64 positions, exact int32 steps)."""
    assert found.positions.dtype == torch.int32 and found.steps.dtype == torch.int8
    assert torch.equal(found.positions.long(), oracle.positions)
    assert torch.equal(found.values.view(torch.int16), oracle.values.view(torch.int16))
    assert torch.equal(found.steps, oracle.steps.clamp(-128, 128).to(torch.int8))


def _rank_one_of_wholes() -> tuple[
    list[tuple[AxisGather, torch.Tensor, int]],
    list[tuple[torch.Tensor, int]],
    tuple[torch.Tensor, ...],
    int,
]:
    """Rank 1's fp32 pieces (part 1 of 2 along dim 0) of bf16 whole tensors, each whole tensor
    with its first row of rank 1's, the receiver's rows of them (flat views, at offsets off the
    8-byte words, no padding), and the part's bytes."""
    torch.manual_seed(0)
    pieces, wholes, offset = [], [], 0
    for shape in SHAPES:
        gather = AxisGather(0, 0, 2, shape)
        whole = (torch.randn(shape) * 0.02).to(torch.bfloat16)
        count = gather.piece_shape(1)[0]
        start = gather.shape[0] - count
        pieces.append((gather, whole[start : start + count].float(), offset))
        wholes.append((whole, start))
        offset += -(-gather.padded_numel * 2 // 8) * 8
    rows = tuple(whole[start:].reshape(-1) for whole, start in wholes)
    return pieces, wholes, rows, offset


@pytest.mark.parametrize("share", [0.01, 0.3])
@pytest.mark.parametrize("span", [1000, 1 << 22])
def test_the_receivers_rows_as_the_base_give_the_kept_parts_changes(
    share: float, span: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1's rows of whole tensors (at offsets off the 8-byte words, no padding) compared in
    place of a kept part: the same changes, bit for bit, and the rows never written."""
    monkeypatch.setattr(delta_find, "SPAN_ELEMENTS", span)
    pieces, wholes, held_rows, offset = _rank_one_of_wholes()
    old = _packed(pieces, offset)
    _move(pieces, share)
    before = [whole.clone() for whole, _ in wholes]
    length = offset // 2
    held = delta_find.HeldRows(held_rows, length)
    found = delta_find.refresh_part(pieces, held, torch.bfloat16, limit=length // DENSE)
    assert all(torch.equal(w, b) for (w, _), b in zip(wholes, before, strict=True))
    if share > 1 / DENSE:
        assert found is None
        return
    assert found is not None
    fresh = _packed(pieces, offset)
    _same_changes(found, local_changes(fresh.view(torch.bfloat16), old.view(torch.bfloat16)))


@pytest.mark.parametrize("span", [1000, 1 << 22])
def test_a_part_found_past_its_limit_is_refreshed_and_goes_plain(
    span: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the limit by changed words (spans after it cast uncompared) or only by changed
    elements, once the changed words' lanes are counted: None, and the part refreshed."""
    monkeypatch.setattr(delta_find, "SPAN_ELEMENTS", span)
    pieces, part = _pieces()
    old = part.clone()
    _move(pieces, 0.01)
    oracle = local_changes(
        _packed(pieces, part.numel()).view(torch.bfloat16), old.view(torch.bfloat16)
    )
    words = int(torch.unique(oracle.positions >> 2).numel())
    assert words < oracle.count  # some word holds two changes: its elements pass the limit
    for limit in (50, words):
        part = old.clone()
        assert delta_find.refresh_part(pieces, part, torch.bfloat16, limit=limit) is None
        assert torch.equal(part, _packed(pieces, part.numel()))


@pytest.mark.parametrize("span", [1000, 1 << 22])
def test_a_sparse_part_costs_a_fixed_number_of_ops_a_span(
    span: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per span: the copies of the pieces it covers, the compare of its words, and about 17 ops
    on its changed words and their lanes, whatever their number, plus 2 casting positions and
    steps to the widths held (int32, int8) and 3 copying its changes into the joined fields
    (which ``torch.cat`` did in 3 for the part, holding every change twice); nothing per change
    or per tensor (on a GPU each op is a launch). The default span, 2^22 elements, is 16 times
    the cache-sized chunks of 2^18 that cost about as many ops each before."""
    monkeypatch.setattr(delta_find, "SPAN_ELEMENTS", span)
    pieces, part = _pieces()
    _move(pieces, 0.01)
    length = part.numel() // 2
    spans = -(-length // delta_find._span(length))
    with CountKernels() as counted:  # type: ignore[no-untyped-call]
        found = delta_find.refresh_part(pieces, part, torch.bfloat16, limit=part.numel())
    assert found is not None and found.count > 0
    # copies and zeroings: at most one each per piece a span covers (spans + pieces of them)
    fills = 2 * (spans + len(pieces))
    assert counted.kernels <= 22 * spans + fills + 30, (counted.kernels, spans)


def test_a_gpu_part_walks_full_spans_a_cpu_part_sixteenths() -> None:
    """A 64 MiB bucket's part at W=2 (16M bf16 elements): 16 spans on the CPU (its scratch a
    small share of the part), 4 on a GPU, where each span costs its launches and two waits for
    the device whatever its bytes; a part smaller than a span is one span on a GPU."""
    part = 16 * 2**20
    assert -(-part // delta_find._span(part, "cpu")) == 16
    assert -(-part // delta_find._span(part, "cuda")) == 4
    assert delta_find._span(1000, "cuda") == delta_find.SPAN_ELEMENTS
    assert delta_find._span(1000, "cpu") == delta_find.SMALLEST_SPAN
    assert delta_find._span(2**30, "cpu") == delta_find.SPAN_ELEMENTS


@pytest.mark.parametrize("share", [0.1, 0.2])
def test_the_sample_over_the_receivers_rows_is_the_sample_over_a_kept_part(
    share: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1's rows of whole tensors (off the 8-byte words, no padding) as the base: the
    sample reads the same windows of the same bits as over a kept part, and tells the same."""
    monkeypatch.setattr(delta_sample, "SAMPLE_STRIDE", 64)
    monkeypatch.setattr(delta_sample, "SAMPLE_WINDOW", 8)
    pieces, _, rows, offset = _rank_one_of_wholes()
    part = _packed(pieces, offset)
    _move(pieces, share)
    held = delta_find.HeldRows(rows, offset // 2)
    scratch = torch.empty(8 * 5, dtype=torch.bfloat16)
    over_rows = delta_find._kept_elements(pieces, held, torch.bfloat16)
    over_part = delta_find._kept_elements(pieces, part, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(over_rows, over_part, strict=True))
    changed, seen = _sampled_window_by_window(pieces, part)
    dense = delta_sample.sample_is_dense(pieces, over_rows, scratch)
    assert dense is (changed * DENSE > seen) is (share > 1 / DENSE)
