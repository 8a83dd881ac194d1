"""The TP-sliced export's plan, without vLLM: each engine rank's windows (vLLM's cuts written
out by hand here), the trainer's blocks, their overlaps and the bytes each rank receives."""

from __future__ import annotations

import re

import pytest

from shardkit.core.export.tp_routes import block_of, overlap, plan_routes, volume
from shardkit.core.export.tp_slices import EngineTP, SliceKind, engine_window

HD = 4  # head dim


def _tp(degree: int, heads: int = 8, kv: int = 2, vocab: int = 100) -> EngineTP:
    return EngineTP(degree=degree, num_heads=heads, num_kv_heads=kv, head_dim=HD, vocab_size=vocab)


def _rows(tp: EngineTP, name: str, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    windows = [engine_window(tp, name, shape, r) for r in range(tp.degree)]
    return [(w.start, w.stop) for w in windows]


def test_query_rows_split_by_head_and_land_first_in_qkv() -> None:
    tp = _tp(4)
    rows = _rows(tp, "model.layers.0.self_attn.q_proj.weight", (8 * HD, 16))
    assert rows == [(0, 8), (8, 16), (16, 24), (24, 32)]  # two heads of 4 rows per rank
    w = engine_window(tp, "model.layers.0.self_attn.q_proj.bias", (8 * HD,), 3)
    assert (w.dim, w.start, w.stop, w.fused, w.fused_offset) == (0, 24, 32, "qkv_proj", 0)


def test_kv_heads_split_where_the_engine_has_fewer_ranks_than_kv_heads() -> None:
    tp = _tp(2, heads=8, kv=4)
    assert _rows(tp, "m.layers.0.self_attn.k_proj.weight", (4 * HD, 16)) == [(0, 8), (8, 16)]
    v = engine_window(tp, "m.layers.0.self_attn.v_proj.weight", (4 * HD, 16), 1)
    # qkv_proj on a rank: its 4 query heads (16 rows), its 2 kv heads of k (8), then of v.
    assert (v.start, v.stop, v.fused_offset) == (8, 16, 16 + 8)


def test_kv_heads_replicated_where_the_engine_has_more_ranks_than_kv_heads() -> None:
    tp = _tp(8, heads=8, kv=2)
    assert tp.kv_replicas == 4
    rows = _rows(tp, "m.layers.0.self_attn.k_proj.weight", (2 * HD, 16))
    # Ranks 0-3 hold kv head 0, ranks 4-7 kv head 1 (vLLM's tp_rank // replicas).
    assert rows == [(0, 4)] * 4 + [(4, 8)] * 4
    k = engine_window(tp, "m.layers.0.self_attn.k_proj.weight", (2 * HD, 16), 5)
    v = engine_window(tp, "m.layers.0.self_attn.v_proj.bias", (2 * HD,), 5)
    assert (k.fused_offset, v.fused_offset) == (HD, 2 * HD)  # one q head, one k head, then v


def test_gate_and_up_fill_the_fused_halves_and_down_splits_columns() -> None:
    tp = _tp(2)
    gate = engine_window(tp, "m.layers.1.mlp.gate_proj.weight", (24, 16), 1)
    up = engine_window(tp, "m.layers.1.mlp.up_proj.weight", (24, 16), 1)
    assert (gate.start, gate.stop, gate.fused, gate.fused_offset) == (12, 24, "gate_up_proj", 0)
    assert (up.start, up.stop, up.fused_offset) == (12, 24, 12)
    down = engine_window(tp, "m.layers.1.mlp.down_proj.weight", (16, 24), 1)
    assert (down.dim, down.start, down.stop, down.local_shape) == (1, 12, 24, (16, 12))
    bias = engine_window(tp, "m.layers.1.self_attn.o_proj.bias", (16,), 1)
    assert bias.dim is None and bias.local_shape == (16,)  # a row-parallel bias is whole


@pytest.mark.parametrize(
    ("vocab", "degree", "expected"),
    [
        (100, 4, [(0, 32), (32, 64), (64, 96), (96, 100)]),  # padded to 128: 32 a rank
        (60, 4, [(0, 16), (16, 32), (32, 48), (48, 60)]),  # padded to 64
        (10, 4, [(0, 10), (10, 10), (10, 10), (10, 10)]),  # 64 padded rows: the last ranks none
        (130, 2, [(0, 96), (96, 130)]),  # padded to 192
    ],
)
def test_vocab_rows_follow_the_padded_partition(
    vocab: int, degree: int, expected: list[tuple[int, int]]
) -> None:
    tp = _tp(degree, vocab=vocab)
    assert _rows(tp, "model.embed_tokens.weight", (vocab, 16)) == expected
    assert _rows(tp, "lm_head.weight", (vocab, 16)) == expected


def test_norms_are_whole_and_unknown_names_refused_by_name() -> None:
    tp = _tp(4)
    norm = engine_window(tp, "model.layers.0.post_attention_layernorm.weight", (16,), 2)
    assert norm.dim is None and norm.numel == 16
    with pytest.raises(ValueError, match=re.escape("mlp.experts.w1: no tensor-parallel rule")):
        engine_window(tp, "model.layers.0.mlp.experts.w1", (16, 16), 0)
    custom = EngineTP(
        degree=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=HD,
        vocab_size=100,
        kinds={"model.layers.0.mlp.experts.w1": SliceKind.COLUMN},
    )
    assert engine_window(custom, "model.layers.0.mlp.experts.w1", (16, 16), 1).start == 8


def test_engines_vllm_cannot_build_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot split 6 query heads"):
        EngineTP(degree=4, num_heads=6, num_kv_heads=2, head_dim=HD, vocab_size=64)
    with pytest.raises(ValueError, match="cannot place 3 kv heads"):
        EngineTP(degree=2, num_heads=6, num_kv_heads=3, head_dim=HD, vocab_size=64)
    with pytest.raises(ValueError, match="does not split into 4 equal parts"):
        engine_window(_tp(4), "m.layers.0.mlp.up_proj.weight", (10, 16), 0)
    with pytest.raises(ValueError, match="engine rank 4 is outside"):
        engine_window(_tp(4), "m.layers.0.mlp.up_proj.weight", (16, 16), 4)


def test_overlap_and_volume() -> None:
    assert overlap(((0, 4), (0, 8)), ((2, 6), (4, 12))) == ((2, 4), (4, 8))
    assert overlap(((0, 4), (0, 8)), ((4, 6), (0, 8))) is None
    assert volume(((2, 4), (4, 8))) == 8


def test_blocks_cut_as_torch_chunk_and_strided_cuts_last() -> None:
    # FSDP over 4 ranks of 10 rows: 3, 3, 3, 1.
    blocks = [block_of((10, 6), [0], [4], [i]) for i in range(4)]
    assert [b[0] for b in blocks] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    # FSDP (mesh dim 0, strided) over TP's rows (mesh dim 1): TP's 2 chunks first, FSDP's
    # 2 of each after: (dp 1, tp 0) holds rows 3-5 of 10.
    assert block_of((10, 6), [0, 0], [2, 2], [1, 0], frozenset({0}))[0] == (3, 5)
    # FSDP rows and TP columns (a row-parallel weight under FSDP x TP).
    assert block_of((10, 6), [0, 1], [2, 2], [1, 1]) == ((5, 10), (3, 6))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("m.layers.0.self_attn.q_proj.weight", (8 * HD, 10)),
        ("m.layers.0.self_attn.k_proj.weight", (2 * HD, 10)),  # K=4 > 2 kv heads: replicated
        ("m.layers.0.mlp.down_proj.weight", (10, 12)),  # columns against FSDP's rows
        ("model.embed_tokens.weight", (100, 10)),  # padded vocabulary, uneven FSDP rows
        ("model.norm.weight", (10,)),
    ],
)
def test_each_engine_rank_receives_exactly_its_window_once(
    world: int, degree: int, name: str, shape: tuple[int, ...]
) -> None:
    tp = _tp(degree)
    blocks = {rank: block_of(shape, [0], [world], [rank]) for rank in range(world)}
    receivers = {g: g % degree for g in range(degree * 2)}  # two engines of degree K
    windows, routes = plan_routes(tp, name, shape, blocks, receivers)
    for g, window in windows.items():
        mine = [r for r in routes if r.receiver == g]
        assert sum(volume(r.box) for r in mine) == window.numel
        # The blocks are disjoint and inside the window: each element arrives once.
        for a in mine:
            assert overlap(a.box, window.box) == a.box
            for b in mine:
                assert a is b or overlap(a.box, b.box) is None
        # A cut tensor is never whole on an engine rank.
        assert window.dim is None or window.numel < volume(tuple((0, s) for s in shape))


def test_a_plain_tensor_is_copied_by_each_receiver_from_its_own() -> None:
    windows, routes = plan_routes(
        _tp(2), "m.layers.0.mlp.up_proj.weight", (8, 4), None, {0: 0, 1: 1}
    )
    assert [(r.sender, r.receiver, r.box) for r in routes] == [
        (0, 0, ((0, 4), (0, 4))),
        (1, 1, ((4, 8), (0, 4))),
    ]
    assert windows[1].box == ((4, 8), (0, 4))
