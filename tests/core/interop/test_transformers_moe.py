"""Mixture-of-experts layers from ``transformers``, trained as their users write them.

Each rank trains on its own batch, so its router sends its tokens to its own experts. Two
layouts:

- Experts as separate modules (Switch Transformers: ``experts.expert_{i}``, one MLP each): an
  expert that gets no token on a rank has no gradient there. Sharded one group per block,
  shardkit reduces zeros for it (by default, or as torch under
  ``set_reduce_scatter_unused_params(True)``); sharded one group per expert, each expert is
  marked ``set_conditional(True)`` and its block anchors it.
- Experts as one 3-D tensor (Mixtral, OLMoE, Qwen2-MoE): the tensor gets a gradient wherever any
  expert ran (zero rows for the others), so every rank reduces the same parameters: SPMD.

The oracle is unsharded replicas (``tests.core.replica_oracle``): the mean over ranks of each
rank's gradient. torch's ``fully_shard`` runs beside: where it trains, shardkit's losses and
parameters are bit for bit its; on Switch without the setting it is the control, which fails.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from tests.core.parity import full_params, fully_shard_of
from tests.core.replica_oracle import ReplicaTraining, Turn, plain, sgd, train_replicas
from tests.core.torch_releases import torch_has

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (not a dependency of shardkit)",
)

VOCAB, STEPS, LR = 32, 2, 0.1


# --- the models: tiny configs, no dropout or router jitter (each rank's forward is exact) ---


def _switch() -> nn.Module:
    """Switch Transformers: 2 encoder, 2 decoder blocks, each side's second sparse (4 experts)."""
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    config = SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_heads=2,
        num_layers=2, num_decoder_layers=2,
        num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
        num_experts=4, expert_capacity=64, router_jitter_noise=0.0, dropout_rate=0.0,
        relative_attention_num_buckets=8, relative_attention_max_distance=16,
    )  # fmt: skip
    torch.manual_seed(7)
    return SwitchTransformersForConditionalGeneration(config)


def _mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=32, output_router_logits=True,
    )  # fmt: skip
    torch.manual_seed(7)
    return MixtralForCausalLM(config)


def _olmoe() -> nn.Module:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    config = OlmoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32, output_router_logits=True, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(7)
    return OlmoeForCausalLM(config)


def _qwen2_moe() -> nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
        max_position_embeddings=32, output_router_logits=True,
    )  # fmt: skip
    torch.manual_seed(7)
    return Qwen2MoeForCausalLM(config)


_DECODERS: dict[str, Callable[[], nn.Module]] = {
    "mixtral": _mixtral,
    "olmoe": _olmoe,
    "qwen2_moe": _qwen2_moe,
}


def _build(name: str) -> nn.Module:
    model = _switch() if name == "switch" else _DECODERS[name]()
    model.train()
    return model


# --- each rank's step: its own batch (from seeds), the model's own loss ----------------------


def _loss(name: str, model: nn.Module, rank: int, step: int) -> torch.Tensor:
    # Seed 3: on Switch, rank 1 sends a token to every expert of the decoder's sparse block in
    # the first step and rank 0 does not (see the premise test below).
    generator = torch.Generator().manual_seed(1000 * step + rank + 3)
    # Switch: 8 tokens, one expert each of 4; the others: 4 tokens, two experts each of 8.
    tokens = torch.randint(2, VOCAB, (1, 8 if name == "switch" else 4), generator=generator)
    if name == "switch":
        labels = torch.randint(2, VOCAB, (1, 6), generator=generator)
        # Teacher forcing: the labels shifted right behind a start token (0).
        start = torch.zeros(1, 1, dtype=labels.dtype)
        decoder_tokens = torch.cat([start, labels[:, :-1]], dim=1)
        out = model(
            input_ids=tokens,
            decoder_input_ids=decoder_tokens,
            labels=labels,
            output_router_logits=True,
        )
    else:
        out = model(input_ids=tokens, labels=tokens)
    loss: torch.Tensor = out.loss
    return loss


def _blocks(name: str, model: Any) -> list[nn.Module]:
    if name == "switch":
        return [*model.encoder.block, *model.decoder.block]
    return list(model.model.layers)


def _experts(model: Any) -> list[Any]:
    """Switch's experts, one module each, in its sparse blocks."""
    blocks: list[Any] = _blocks("switch", model)
    return [
        expert
        for block in blocks
        for layer in block.layer
        if getattr(layer, "is_sparse", False)
        for expert in layer.mlp.experts.values()
    ]


# --- sharded training -------------------------------------------------------------------------


def _train(name: str, impl: str, rank: int, layout: str, unused_zeros: bool) -> dict[str, Any]:
    """``layout``: "blocks" (a group per block, and the root) or "experts" (each expert too,
    marked conditional). ``unused_zeros``: ``set_reduce_scatter_unused_params(True)``."""
    mesh = init_device_mesh("cpu", (2,))
    fully_shard = fully_shard_of(impl)
    model: Any = _build(name)
    experts = _experts(model) if layout == "experts" else []
    for module in [*experts, *_blocks(name, model)]:
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for expert in experts:
        expert.set_conditional(True)
    if unused_zeros:
        # Recursive by default in both engines: the root's call sets every group under it.
        model.set_reduce_scatter_unused_params(True)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses: list[float] = []
    first: dict[str, Any] = {}
    for step in range(STEPS):
        loss = _loss(name, model, rank, step)
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            first = plain({n: p.grad for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "first": first, "params": full_params(model)}


def _oracle(name: str) -> dict[str, Any]:
    def loss(model: nn.Module, turn: Turn) -> torch.Tensor:
        return _loss(name, model, turn.rank, turn.step)

    training = ReplicaTraining(
        make_model=lambda: _build(name), loss=loss, world_size=2, steps=STEPS, optimizer=sgd(LR)
    )
    run = train_replicas(training)
    return {"first": run.grads[0], "params": run.params}


def _unused_per_rank(name: str) -> list[set[str]]:
    """The parameters each rank's first batch leaves without a gradient, on a plain replica."""
    unused: list[set[str]] = []
    for rank in range(2):
        model = _build(name)
        _loss(name, model, rank, 0).backward()
        unused.append({n for n, p in model.named_parameters() if p.grad is None})
    return unused


def _body(
    rank: int, world_size: int, name: str, layout: str, unused_zeros: bool, impls: tuple[str, ...]
) -> dict[str, Any]:
    out = {impl: _train(name, impl, rank, layout, unused_zeros) for impl in impls}
    out["oracle"] = _oracle(name)
    return out


def _assert_matches_oracle(ours: dict[str, Any], oracle: dict[str, Any], zeros: bool) -> None:
    """Within 1e-5: a tied embedding's uses sum in another order than on one process (torch's
    ``fully_shard`` too). A parameter no rank used: None, or zeros under the setting."""
    for name, expected in oracle["first"].items():
        got = ours["first"][name]
        if expected is None and not zeros:
            assert got is None, f"{name}: no rank used it, yet it has a gradient"
            continue
        assert got is not None, f"{name}: some rank used it (or the setting is on), no gradient"
        want = torch.zeros_like(got) if expected is None else expected
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=_named(name))
    for name, expected in oracle["params"].items():
        got = ours["params"][name]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=_named(name))


def _named(name: str) -> Callable[[str], str]:
    return lambda message: f"{name}: {message}"


def _assert_bitwise(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert ours["losses"] == theirs["losses"]
    for name, grad in theirs["first"].items():
        got = ours["first"][name]
        assert (got is None) == (grad is None), name
        assert got is None or torch.equal(got, grad), name
    for name, value in theirs["params"].items():
        assert torch.equal(ours["params"][name], value), name


def test_the_switch_batches_leave_experts_unused_on_some_ranks() -> None:
    # The premise of the Switch tests. In the decoder's sparse block one rank uses every expert
    # and the other does not: only the latter has zeros to add, so a reduction it ends later
    # (at the end of backward) would pair with the other rank's next block's. In the encoder's,
    # an expert gets a token on no rank: grad None (zeros under the setting).
    unused = _unused_per_rank("switch")
    decoder = "decoder.block.1."
    assert [any(n.startswith(decoder) for n in names) for names in unused] == [True, False]
    assert any(n.startswith("encoder.block.1.") for n in unused[0] & unused[1]), unused
    assert all(".experts." in n for n in unused[0] | unused[1]), unused


def test_switch_experts_sharded_per_block_train_as_the_oracle() -> None:
    from harness.pool import run_on_ranks

    results = run_on_ranks(
        2, _body, name="switch", layout="blocks", unused_zeros=False, impls=("shardkit",)
    )
    for result in results:
        _assert_matches_oracle(result["shardkit"], result["oracle"], zeros=False)


def test_switch_under_reduce_scatter_unused_params_is_bitwise_torch() -> None:
    from harness.pool import run_on_ranks

    # torch's engine has the switch from 2.13 on; before, shardkit's against the oracle alone.
    with_torch = torch_has("FSDPModule.set_reduce_scatter_unused_params")
    impls = ("shardkit", "torch") if with_torch else ("shardkit",)
    results = run_on_ranks(2, _body, name="switch", layout="blocks", unused_zeros=True, impls=impls)
    for result in results:
        if with_torch:
            _assert_bitwise(result["shardkit"], result["torch"])
        _assert_matches_oracle(result["shardkit"], result["oracle"], zeros=True)


def test_switch_experts_sharded_each_and_marked_conditional_train_as_the_oracle() -> None:
    from harness.pool import run_on_ranks

    results = run_on_ranks(
        2, _body, name="switch", layout="experts", unused_zeros=False, impls=("shardkit",)
    )
    for result in results:
        _assert_matches_oracle(result["shardkit"], result["oracle"], zeros=False)


def torch_switch_control(rank: int, world_size: int) -> str:
    """Switch under torch's ``fully_shard``, no setting (``tests.core.torch_control`` runs it)."""
    _train("switch", "torch", rank, "blocks", unused_zeros=False)
    return "trained"


def test_torch_control_fails_on_switch_without_the_setting() -> None:
    from tests.core.torch_control import run_control

    outcome = run_control(f"{__name__}:torch_switch_control")
    print(f"torch fully_shard on Switch Transformers: {outcome}")  # recorded (-s shows it)
    # torch reduces the gradients each rank has: the ranks' sparse blocks differ in size.
    assert not outcome.trained, outcome


def _idle_experts(name: str, rank: int) -> dict[str, list[int]]:
    """Per 3-D expert tensor, the experts whose rows got no gradient from ``rank``'s batch.

    Every parameter has a gradient (None would fail here): the idle experts' rows are zeros.
    """
    model = _build(name)
    _loss(name, model, rank, 0).backward()
    idle: dict[str, list[int]] = {}
    for param_name, p in model.named_parameters():
        assert p.grad is not None, param_name
        if p.dim() == 3:
            idle[param_name] = [e for e in range(p.shape[0]) if not p.grad[e].any()]
    return idle


@pytest.mark.parametrize("name", sorted(_DECODERS))
def test_the_batches_leave_experts_idle_on_some_ranks_yet_every_tensor_has_a_gradient(
    name: str,
) -> None:
    # The premise of the next test: the ranks' idle experts differ, yet to FSDP it is SPMD.
    rank0, rank1 = _idle_experts(name, 0), _idle_experts(name, 1)
    assert rank0.keys() == rank1.keys() and len(rank0) == 4, rank0
    assert any(rank0[t] != rank1[t] and (rank0[t] or rank1[t]) for t in rank0), (rank0, rank1)


@pytest.mark.parametrize("name", sorted(_DECODERS))
def test_experts_in_one_tensor_train_unchanged(name: str) -> None:
    from harness.pool import run_on_ranks

    results = run_on_ranks(
        2, _body, name=name, layout="blocks", unused_zeros=False, impls=("shardkit", "torch")
    )
    for result in results:
        _assert_matches_oracle(result["shardkit"], result["oracle"], zeros=False)
        _assert_bitwise(result["shardkit"], result["torch"])
