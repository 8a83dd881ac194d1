"""A delta's encodings on the trainers' wire: each round-trips bit for bit, the smallest wins,
and an optimizer-like change costs about two bytes (gap and step) a changed element."""

from __future__ import annotations

import pytest
import torch

from shardkit.core.export import delta_encoding
from shardkit.core.export.delta_encoding import (
    DELTA_ENCODINGS,
    Encoding,
    as_decoded,
    choose_encoding,
    decode,
    encode,
    local_changes,
    message_bytes,
)


@pytest.mark.parametrize("run", [1 << 20, 2, 4])
def test_steps_escape_gaps_that_do_not_fit_a_byte(
    run: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run``: gaps worked that many changes at a time (the default, then runs whose edges
    fall between escaped and short gaps): the same message."""
    monkeypatch.setattr(delta_encoding, "GAP_RUN", run)
    # A change at position 0 (a gap of 0), gaps of 1 and 255 (a byte), 256 and 2**20 (escaped).
    positions = torch.tensor([0, 1, 256, 512, 512 + 2**20, 512 + 2**20 + 255])
    old = torch.zeros(2**21, dtype=torch.bfloat16)
    new = old.clone()
    new.view(torch.int16)[positions] = 1
    changes = local_changes(new, old)
    assert changes.positions.tolist() == positions.tolist()
    size = changes.steps_bytes()
    assert size == 8 + 2 * 6 + 3 * 4  # three escaped gaps (0, 256, 2**20) as int32
    decoded = decode(
        encode(changes, Encoding.STEPS, size), 6, 2**21, torch.bfloat16, Encoding.STEPS
    )
    assert decoded.stepped.tolist() == positions.tolist() and decoded.steps.tolist() == [1] * 6


def _optimizer_like(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Old and new values: most elements one unit in the last place up or down, a few sign
    changes and large moves, a NaN kept and a -0.0 made from 0.0."""
    g = torch.Generator().manual_seed(0)
    old = (torch.randn(50_000, generator=g) * 0.02).to(dtype)
    new = old.clone()
    width = {2: torch.int16, 4: torch.int32}[old.element_size()]
    picked = torch.randperm(50_000, generator=g)[:1500]
    new.view(width)[picked] += torch.where(torch.rand(1500, generator=g) < 0.5, 1, -1).to(width)
    new[7], new[11], new[13] = -new[7], 3.0, float("nan")
    old[13] = float("nan")
    old[17], new[17] = 0.0, -0.0
    return old, new


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("encoding", DELTA_ENCODINGS)
def test_each_encoding_gives_back_the_new_bits(dtype: torch.dtype, encoding: Encoding) -> None:
    old, new = _optimizer_like(dtype)
    changes = local_changes(new, old)
    assert 13 not in changes.positions.tolist() and 17 in changes.positions.tolist()
    size = message_bytes(
        encoding, changes.count, changes.length, old.element_size(), changes.steps_bytes()
    )
    message = encode(changes, encoding, size + 5)  # padded, as a gather pads
    # A peer's message decoded, and the gathering rank's own (never encoded) alike.
    for decoded in (
        decode(message, changes.count, changes.length, dtype, encoding),
        as_decoded(changes, encoding),
    ):
        rebuilt = old.clone()
        rebuilt[decoded.positions] = decoded.values
        width = {2: torch.int16, 4: torch.int32}[old.element_size()]
        rebuilt.view(width)[decoded.stepped] += decoded.steps.to(width)
        assert torch.equal(rebuilt.view(width), new.view(width))


def test_steps_win_for_an_optimizer_step_at_about_two_bytes_a_change() -> None:
    old, new = _optimizer_like(torch.bfloat16)
    changes = local_changes(new, old)
    steps = changes.steps_bytes()
    encoding, size = choose_encoding([changes.count, 0], [steps, 4], changes.length, 2)
    assert encoding is Encoding.STEPS and size == steps
    assert steps < 2.2 * changes.count  # a 1-byte gap and a 1-byte step, a few literals
    # Changes past 1/DENSE of the part go plain, whatever their encodings' sizes.
    assert choose_encoding([4_000], [10**6], 40_000, 2)[0] is Encoding.BITMASK
    assert choose_encoding([40_000], [10**6], 50_000, 2) == (Encoding.PLAIN, 100_000)


@pytest.mark.parametrize("length", [50_000, 50_001])
def test_changes_are_found_by_words_or_element_by_element_alike(length: int) -> None:
    """A part of whole 8-byte words is compared a word at a time, another element by element:
    the same positions, values and steps."""
    old, new = _optimizer_like(torch.bfloat16)
    old, new = torch.cat([old, old[: length - 50_000]]), torch.cat([new, new[: length - 50_000]])
    found = local_changes(new, old)
    flags = new.view(torch.int16) != old.view(torch.int16)
    expected = torch.nonzero(flags).view(-1)
    assert torch.equal(found.positions, expected)
    assert torch.equal(found.values.view(torch.int16), new.view(torch.int16)[expected])
    steps = new.view(torch.int16)[expected].long() - old.view(torch.int16)[expected].long()
    assert torch.equal(found.steps, steps)
