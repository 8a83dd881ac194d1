"""``shardkit-plan --fit``: the search from the shell, its check, its plan file and its code.

On the demo GPT at 8 ranks (seconds): a budget that fits prints the chosen plan, its check on
the fake group (as planned), runners-up and a ``parallelize`` function that compiles; the plan
file loads back to the plan printed. A budget nothing fits exits 1 and says what came
closest and what would fit on more ranks. Bad arguments exit 2 naming what is wrong.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardkit.tools.plan.apply.plan_json import load_plan
from shardkit.tools.plan.cli import main
from shardkit.tools.plan.search.fit import parse_precision

DEMO = "shardkit.tools.plan.examples:gpt_demo"
INPUTS = "shardkit.tools.plan.examples:gpt_demo_inputs"


def _fit(budget: str, *extra: str) -> list[str]:
    return [DEMO, "--world-size", "8", "--inputs", INPUTS, "--fit", budget, *extra]


def test_a_budget_that_fits_prints_the_plan_its_check_and_its_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "plan.json"
    # A plan for NCCL is a plan for GPUs: the budget counts what torch's caching allocator
    # reserves, which on a model this small is mostly its 20 MiB segments (live: ~20 MiB).
    assert main(_fit("40MiB", "--plan-out", str(out_file))) == 0
    out = capsys.readouterr().out
    assert "chosen: " in out and "runners-up:" in out
    assert "collectives: " in out and "as planned" in out  # the fake-group check ran
    plan = load_plan(out_file)
    code = out[out.index("def parallelize") :].split("\nplan written")[0]
    compile(code, "parallelize.py", "exec")
    assert "fully_shard(" in code
    # The printed peak is within the budget.
    peak_line = next(line for line in out.splitlines() if line.strip().startswith("peak "))
    assert "reserved (live tensors" in peak_line and "of 40.00 MiB" in peak_line
    assert plan.units[-1].modules == ("",)


def test_nothing_fitting_says_what_came_closest_and_what_would_fit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(_fit("12MiB", "--no-check")) == 1
    out = capsys.readouterr().out
    assert "nothing fits in 12.00 MiB" in out
    assert "16 ranks: peak" in out and "64 ranks: peak" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--fit", "12 parsecs"), "unknown unit"),
        (("--fit", "24MiB", "--precision", "bf17"), "dtypes are one of"),
        (("--fit", "24MiB", "--ranks-per-node", "3"), "--ranks-per-node 3"),
        (("--fit", "24MiB", "--wrap", "GPTBlock"), "chooses the units"),
    ],
)
def test_bad_arguments_exit_2_naming_the_problem(
    extra: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [DEMO, "--world-size", "8", "--inputs", INPUTS, *extra]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_fit_needs_inputs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([DEMO, "--world-size", "8", "--fit", "24MiB"]) == 2
    assert "--inputs" in capsys.readouterr().err


def test_precisions_parse_as_written() -> None:
    import torch

    bf16 = parse_precision("bf16/fp32+int8")
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert bf16.reduce_precision is not None and bf16.reduce_precision.wire_dtype == torch.int8
    assert parse_precision("fp32").reduce_dtype is None
    with pytest.raises(ValueError, match="wire"):
        parse_precision("bf16/fp32+fp4")


def test_allowed_precisions_are_searched(capsys: pytest.CaptureFixture[str]) -> None:
    # In float32 nothing fits 16 MiB of live tensors (the closest needs 17.6 MiB); gathered in
    # bfloat16 it does. On gloo (a CPU plan) the budget counts live bytes, finely enough.
    assert main(_fit("16MiB", "--no-check", "--backend", "gloo")) == 1
    capsys.readouterr()
    precisions = ("--precision", "fp32", "--precision", "bf16/fp32")
    assert main(_fit("16MiB", "--no-check", "--backend", "gloo", *precisions)) == 0
    chosen = next(line for line in capsys.readouterr().out.splitlines() if "chosen: " in line)
    assert chosen.endswith("bf16/fp32")
