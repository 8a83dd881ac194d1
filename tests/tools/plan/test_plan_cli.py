"""shardkit-plan: tables, JSON (a plan's, and ``--fit``'s), and clear errors for factories."""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import pytest
import torch
from torch import nn

from shardkit.tools.examples import Llama, LlamaConfig
from shardkit.tools.plan.apply.plan_json import load_plan
from shardkit.tools.plan.cli import load_factory, main
from shardkit.tools.plan.gpt import GPT, GPTConfig
from shardkit.tools.units import DEFAULT_BANDWIDTH_GBPS

TINY = "shardkit.tools.examples:llama_tiny"


def cpu_llama() -> nn.Module:
    """A factory as users write it: the model on the default device (the planner picks meta)."""
    config = LlamaConfig(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=100)
    return Llama(config)


def tiny_gpt() -> nn.Module:
    """Two narrow blocks: a search over their plans takes a second or two."""
    return GPT(GPTConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=16))


def tiny_gpt_inputs() -> torch.Tensor:
    """Token ids (batch 2, 16 tokens) for :func:`tiny_gpt`."""
    return torch.zeros(2, 16, dtype=torch.long)


FIT = ["tests.tools.plan.test_plan_cli:tiny_gpt", "--world-size", "4"]
FIT += ["--inputs", "tests.tools.plan.test_plan_cli:tiny_gpt_inputs"]


def moved_model() -> nn.Module:
    """A factory that moves its model to a device: that needs data, which meta has not."""
    return nn.Linear(4, 4).to("cpu")


class PinnedBuffer(nn.Module):
    """A model that names a device for one of its tensors: that escapes the meta context."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("table", torch.zeros(8, device="cpu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.fc(x))


def test_json_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([TINY, "--world-size", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["factory"] == TINY and data["world_size"] == 4
    assert [g["fqn"] for g in data["groups"]] == [*(f"layers.{i}" for i in range(4)), "<root>"]
    assert data["param_count"] == sum(g["param_count"] for g in data["groups"])
    assert data["sent_bytes_per_step"] == sum(c["sent_bytes_per_step"] for c in data["collectives"])
    assert data["options"]["reshard_after_forward"] is None
    assert data["options"]["bandwidth_gbps"] == DEFAULT_BANDWIDTH_GBPS
    assert data["memory"]["category_max"]["activations"] == 0


def test_options_reach_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [TINY, "--world-size", "4", "--mesh", "2,2", "--param-dtype", "bf16"]
    argv += ["--reduce-dtype", "fp32", "--no-reshard-after-forward", "--optimizer", "sgd"]
    argv += ["--inputs", "shardkit.tools.examples:llama_tiny_inputs", "--backend", "gloo"]
    argv += ["--bandwidth-gbps", "10", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["replicas"], data["shard_size"]) == (2, 2)
    options = data["options"]
    assert (options["param_dtype"], options["reduce_dtype"]) == ("bfloat16", "float32")
    assert options["reshard_after_forward"] is False and options["optimizer"] == "sgd"
    assert data["activations_traced"] and data["memory"]["category_max"]["activations"] > 0
    assert data["memory"]["category_max"]["optimizer_state"] == 0
    assert {c["kind"] for c in data["collectives"]} == {
        "all_gather",
        "reduce_scatter",
        "all_reduce",
    }
    assert data["comm_seconds"] == pytest.approx(data["sent_bytes_per_step"] / 10e9)


def test_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([TINY, "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "on 2 ranks (FSDP)" in out
    # The units chosen without --wrap, and why: the blocks of the ModuleList, and the root.
    assert (
        "sharding units (one fully_shard each), by default every element of an nn.ModuleList" in out
    )
    assert "  TransformerBlock x4: layers.0 .. layers.3\n  Llama: <root>\n" in out
    assert "layers.0 .. layers.3 (x4)" in out  # identical blocks fold into one row
    assert "all_gather" in out and "reduce_scatter" in out
    for category in ("sharded_params", "unsharded_params", "optimizer_state", "comm_buffers"):
        assert category in out
    assert "activations not counted" in out
    assert main([TINY, "--world-size", "2", "--all-groups"]) == 0
    assert "layers.3  " in capsys.readouterr().out


def test_tensor_parallel_plan(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [TINY, "--world-size", "4", "--tp", "2"]
    argv += ["--tp-plan", "shardkit.tools.examples:llama_tp_plan"]
    assert main(argv) == 2  # the tp collectives need activations: --inputs
    assert "tp_plan needs inputs" in capsys.readouterr().err
    argv += ["--inputs", "shardkit.tools.examples:llama_tiny_inputs"]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["tp_degree"], data["shard_size"]) == (2, 2)
    assert set(data["sent_bytes_by_axis"]) == {"dp", "tp"}
    assert {c["axis"] for c in data["collectives"]} == {"dp", "tp"}
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "on 4 ranks (FSDP x TP 2)" in out and "by mesh axis: dp" in out
    # The sequence-parallel norms' gradients, all-reduced over tp: 2 per block and the last.
    norms = [ln.split() for ln in out.splitlines() if ln.split()[:2] == ["all_reduce", "tp"]]
    assert len(norms) == 1 and "(x9)" in norms[0]


def test_wrap_by_class_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([TINY, "--world-size", "2", "--wrap", "Attention,FeedForward", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    groups = [g["fqn"] for g in data["groups"]]
    assert groups[:2] == ["layers.0.attention", "layers.0.feed_forward"] and len(groups) == 9
    assert [g["module_class"] for g in data["groups"]][-3:] == ["Attention", "FeedForward", "Llama"]
    assert main([TINY, "--world-size", "2", "--wrap", "Attention,FeedForward"]) == 0
    out = capsys.readouterr().out
    assert "sharding units (one fully_shard each), by --wrap Attention,FeedForward:" in out
    assert "  Attention x4: layers.0.attention .. layers.3.attention\n" in out
    assert main([TINY, "--world-size", "2", "--wrap", "Block"]) == 2  # a typo wraps nothing
    assert "--wrap names Block, which no module" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("no_such_module_xyz:build", "cannot import module 'no_such_module_xyz'"),
        ("shardkit.tools.examples:nothing", "has no attribute 'nothing'"),
        ("shardkit.tools.examples", "is not of the form module:function"),
        ("shardkit.tools.examples:llama_tiny_inputs", "returned Tensor, not an nn.Module"),
        ("shardkit.tools.examples:__doc__", "not a callable"),
    ],
)
def test_bad_factories_are_named(
    factory: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([factory, "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert message in err and factory in err


def test_a_factory_building_on_cpu_is_built_on_meta(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tests.tools.plan.test_plan_cli:cpu_llama", "--world-size", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [g["fqn"] for g in data["groups"]] == ["layers.0", "layers.1", "<root>"]
    assert data["param_count"] == sum(p.numel() for p in cpu_llama().parameters())
    assert "activations" in data["memory"]["category_max"]


def test_a_tensor_escaping_meta_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tests.tools.plan.test_plan_cli:PinnedBuffer", "--world-size", "2"]) == 1
    err = capsys.readouterr().err
    assert "buffer table (on cpu)" in err and "fc.weight" not in err
    assert "torch.device('meta')" in err


def test_a_factory_needing_data_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tests.tools.plan.test_plan_cli:moved_model", "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "moved_model' raised NotImplementedError: Cannot copy out of meta tensor" in err
    assert "FACTORY runs under torch.device('meta'), where tensors have no data" in err


def test_a_model_that_cannot_be_planned(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([TINY, "--world-size", "4", "--mesh", "2,3"]) == 1
    assert "mesh_shape" in capsys.readouterr().err


def test_bad_arguments_exit_2() -> None:
    with pytest.raises(SystemExit) as info:
        main([TINY, "--world-size", "2", "--param-dtype", "int7"])
    assert info.value.code == 2
    with pytest.raises(SystemExit):
        main([TINY])  # --world-size is required


def test_helpers() -> None:
    assert load_factory("shardkit.tools.examples:llama_tiny")().__class__.__name__ == "Llama"


def test_reduce_precision_reaches_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    sent: dict[str, int] = {}
    for precision in (None, "bfloat16", "int8"):
        argv = [TINY, "--world-size", "4", "--json"]
        argv += [] if precision is None else ["--reduce-precision", precision]
        assert main(argv) == 0
        data = json.loads(capsys.readouterr().out)
        if precision is not None:
            assert data["options"]["reduce_precision"]["wire_dtype"] == precision
        sent[str(precision)] = sum(
            c["sent_bytes_per_step"] for c in data["collectives"] if c["kind"] == "reduce_scatter"
        )
    assert sent["bfloat16"] == sent["None"] // 2
    assert sent["int8"] <= 0.26 * sent["None"]


def test_a_param_dtype_override_reaches_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    # The CLI names the function as --inputs names a factory; its plan is the Python API's.
    from shardkit.tools.examples import llama_tiny, one_dim_params_in_own_dtype
    from shardkit.tools.plan.options import PlanOptions
    from shardkit.tools.plan.planner import plan

    override = "shardkit.tools.examples:one_dim_params_in_own_dtype"
    argv = [TINY, "--world-size", "4", "--param-dtype", "bf16", "--reduce-dtype", "fp32"]
    assert main([*argv, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*argv, "--param-dtype-override", override, "--json"]) == 0
    kept = json.loads(capsys.readouterr().out)
    assert kept["options"]["param_dtype_override_fn"] == (
        "shardkit.tools.plan.examples:one_dim_params_in_own_dtype"
    )
    assert plain["options"]["param_dtype_override_fn"] is None
    options = PlanOptions(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        param_dtype_override_fn=one_dim_params_in_own_dtype,
    )
    expected = plan(llama_tiny(), world_size=4, options=options).to_dict()
    assert kept["collectives"] == expected["collectives"]
    # The norms' scales gathered in fp32, not bf16: every block's all-gather grows by them.
    gathers = [
        (p["sent_bytes_per_step"], k["sent_bytes_per_step"])
        for p, k in zip(plain["collectives"], kept["collectives"], strict=True)
        if p["kind"] == "all_gather"
    ]
    assert gathers and all(k > p for p, k in gathers), gathers


def test_a_param_dtype_override_that_is_not_a_function_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [TINY, "--world-size", "2", "--param-dtype-override", "shardkit.tools.examples:nope"]
    assert main(argv) == 2
    assert "has no attribute 'nope'" in capsys.readouterr().err


def test_fit_prints_the_chosen_plan_and_the_search_as_one_json_document(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "plan.json"
    assert main([*FIT, "--fit", "64MiB", "--json", "--plan-out", str(out_file)]) == 0
    data = json.loads(capsys.readouterr().out)  # stdout holds the document and nothing else
    assert set(data) == {
        *("factory", "world_size", "hardware", "fits", "plan", "step_time"),
        *("search", "check", "parallelize", "budget_counts", "peak"),
    }
    assert data["fits"] and data["world_size"] == 4 and data["hardware"] == "H100"
    # A plan for NCCL budgets what the CUDA caching allocator reserves, live bytes beside it.
    peak = data["peak"]
    assert data["budget_counts"] == "reserved"
    assert peak["reserved_bytes"] >= peak["allocated_bytes"] >= peak["live_bytes"] > 0
    # The plan is the document --plan-out writes: load_plan reads it back, as the file.
    assert load_plan(json.dumps(data["plan"])) == load_plan(out_file)
    search = data["search"]
    assert set(search) == {
        *("budget_bytes", "plans_evaluated", "best", "closest", "runners_up"),
        *("seconds", "traces", "larger_worlds"),
    }
    best = search["best"]
    assert best["fits"] and best["peak_bytes"] <= search["budget_bytes"] == 64 * 2**20
    assert set(best) == {"choice", "peak_bytes", "live_peak_bytes", "step_seconds", "parts", "fits"}
    assert (best["peak_bytes"], best["live_peak_bytes"]) == (
        peak["reserved_bytes"],
        peak["live_bytes"],
    )
    assert data["step_time"]["total_s"] == pytest.approx(best["step_seconds"])
    assert search["plans_evaluated"] >= 1 and search["larger_worlds"] == []
    assert all(set(entry) == {*best, "why"} for entry in search["runners_up"])
    check = data["check"]  # the fake-group check ran, and found the plan's collectives
    assert check["world_size"] == 4 and check["collectives_match"]
    assert check["first_mismatch"] is None and check["peak_ratio"] > 0
    compile(data["parallelize"], "parallelize.py", "exec")


def test_fit_json_when_nothing_fits_says_what_came_closest(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*FIT, "--fit", "1KiB", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert not data["fits"] and data["plan"] is None and data["step_time"] is None
    assert data["check"] is None and data["parallelize"] is None
    search = data["search"]
    assert search["best"] is None and search["closest"]["peak_bytes"] > 1024
    assert [w["world_size"] for w in search["larger_worlds"]] == [8, 16, 32]
