"""The step-time model's ranking of measured steps (W=2, gloo, the demo GPT; plan_time_run.py).

Twelve configurations (batch and sequence length, bfloat16 parameters, one unit for the whole
model, parameters kept after forward, recomputed blocks) are trained on two ranks and timed
by the calibrated model of this machine; the model must order them as measured. Issue 65's
target is a Spearman correlation of 0.9 or more; measured step times on a shared machine are
noisy (each configuration keeps its fastest step of three interleaved rounds), so the
assertion is looser and the figure is reported.
"""

from __future__ import annotations

import sys
from typing import Any

from benchmarks import plan_time_run


def test_step_time_model_ranks_configurations(benchmark: Any) -> None:
    result: dict[str, Any] = {}

    def measure() -> None:
        result.update(plan_time_run.run())

    benchmark.pedantic(measure, rounds=1, iterations=1)
    measured, predicted = result["measured"], result["predicted"]
    benchmark.extra_info.update(
        {
            "spearman": result["spearman"],
            "hardware": result["hardware"].to_dict(),
            **{f"measured_ms {name}": s * 1e3 for name, s in measured.items()},
            **{f"predicted_ms {name}": s * 1e3 for name, s in predicted.items()},
        }
    )
    sys.stdout.write("\n")
    for name in measured:
        sys.stdout.write(
            f"{name:<26} measured {measured[name] * 1e3:8.1f} ms  "
            f"predicted {predicted[name] * 1e3:8.1f} ms\n"
        )
    sys.stdout.write(f"Spearman {result['spearman']:.3f} ({len(measured)} configurations)\n")
    assert result["spearman"] >= 0.7
