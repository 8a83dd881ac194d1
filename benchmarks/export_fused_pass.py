"""How fast can a delta find its changes on one CPU core? A fused pass beside the eager walk.

Usage: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/export_fused_pass.py [ELEMENTS] [ROUNDS]

Issue 86 asks a delta's trainer side to be at most 0.3x a full export's where at most 5% of
the elements change. A delta must compare every element of a rank's part with the last
export's before it knows what to send; ``delta_find.refresh_part`` does it in torch's eager
operators, span by span (a cast, a compare of 8-byte words, ``nonzero``, the changed words'
lanes). This script measures what the same work costs in one fused loop, the best a kernel
written for it could do on this core: each fp32 element cast to bf16 bits (round to nearest
even, as torch casts), compared with the kept bits, written back, and its position, value and
int8 step appended branch-free. The loop is compiled at run time with
``torch.utils.cpp_extension.load_inline`` (a C++ compiler and ninja; about 20 s the first
time): a measurement, not a path of the package, whose only runtime dependencies are torch,
numpy and safetensors.

The part: ``ELEMENTS`` (default 75M, a 150M model's part at W=2) fp32 values drawn N(0, 0.02),
then each moved by 1e-6 up or down (about 4% of their bf16 values change, as after an AdamW
step at lr 1e-6). Checked first: the fused loop's bits, positions and count equal torch's cast
and the eager walk's. Then ``ROUNDS`` (default 5) of each, alternating: the fused loop, the
eager walk, and a plain cast into a fresh buffer (what a full export's pack does before its
gather). Prints one JSON line of medians (ms).
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_SOURCE = r"""
#include <torch/extension.h>
#include <cstdint>
#include <cstring>

static inline int16_t bf16_bits(float value) {
  uint32_t u;
  std::memcpy(&u, &value, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN, as torch casts it
  return (int16_t)((u + ((u >> 16) & 1u) + 0x7fffu) >> 16);  // round to nearest even
}

int64_t refresh(torch::Tensor src, torch::Tensor kept, torch::Tensor positions,
                torch::Tensor values, torch::Tensor steps) {
  const float* s = src.data_ptr<float>();
  int16_t* k = kept.data_ptr<int16_t>();
  int32_t* p = positions.data_ptr<int32_t>();
  int16_t* v = values.data_ptr<int16_t>();
  int8_t* st = steps.data_ptr<int8_t>();
  int64_t n = src.numel(), count = 0;
  for (int64_t i = 0; i < n; ++i) {
    int16_t now = bf16_bits(s[i]);
    int16_t before = k[i];
    int32_t step = (int32_t)now - (int32_t)before;
    k[i] = now;
    p[count] = (int32_t)i;  // written every time, kept only where the bits changed
    v[count] = now;
    st[count] = (int8_t)(step > 127 || step < -128 ? -128 : step);
    count += (now != before);
  }
  return count;
}
"""


def _fused() -> Any:
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        "shardkit_fused_delta_pass",
        cpp_sources=[_SOURCE],
        functions=["refresh"],
        extra_cflags=["-O3", "-march=native"],
    )


def _timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def main(argv: list[str]) -> None:
    from shardkit.core.export import delta_find
    from shardkit.core.export.axis_gathers import AxisGather

    elements = int(argv[0]) if argv else 75_000_000
    rounds = int(argv[1]) if len(argv) > 1 else 5
    torch.set_num_threads(1)
    started = time.perf_counter()
    module = _fused()
    compile_s = time.perf_counter() - started
    generator = torch.Generator().manual_seed(0)
    before = torch.randn(elements, generator=generator) * 0.02
    kept = before.to(torch.bfloat16).view(torch.int16).clone()
    after = before + torch.sign(torch.randn(elements, generator=generator)) * 1e-6
    positions = torch.empty(elements, dtype=torch.int32)
    values = torch.empty(elements, dtype=torch.int16)
    steps = torch.empty(elements, dtype=torch.int8)
    gather = AxisGather(0, 0, 1, (elements,))
    limit = elements // 8

    # The same answer first: the fused loop's bits and changes, torch's and the eager walk's.
    fused_kept = kept.clone()
    count = module.refresh(after, fused_kept, positions, values, steps)
    expected = after.to(torch.bfloat16).view(torch.int16)
    assert torch.equal(fused_kept, expected), "the fused cast differs from torch's"
    walked = delta_find.refresh_part(
        [(gather, after, 0)], kept.clone().view(torch.uint8), torch.bfloat16, limit
    )
    assert walked is not None and walked.count == count, (count, walked)
    assert torch.equal(walked.positions, positions[:count])
    assert torch.equal(walked.values.view(torch.int16), values[:count])
    assert torch.equal(walked.steps, steps[:count])

    times: dict[str, list[float]] = {"fused": [], "eager": [], "cast": []}

    def cast() -> None:
        torch.empty_like(after, dtype=torch.bfloat16).copy_(after)

    pieces = [(gather, after, 0)]
    for _ in range(rounds):  # each pass on a fresh copy of the kept bits, made untimed
        base = kept.clone()
        fused = functools.partial(module.refresh, after, base, positions, values, steps)
        times["fused"].append(_timed(fused))
        part = kept.clone().view(torch.uint8)
        eager = functools.partial(delta_find.refresh_part, pieces, part, torch.bfloat16, limit)
        times["eager"].append(_timed(eager))
        times["cast"].append(_timed(cast))
    medians = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(
        json.dumps(
            {
                "elements": elements,
                "changed": count / elements,
                "compile_s": compile_s,
                "fused_ms": medians["fused"],
                "eager_ms": medians["eager"],
                "cast_ms": medians["cast"],
                "rounds": {k: [round(x * 1e3, 1) for x in v] for k, v in times.items()},
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
