"""Assertions over the per-rank values that ``run_on_ranks`` returns.

Values may be tensors, numbers, strings, None, and lists, tuples and dicts of them, nested. A
failure names the first rank that differs from rank 0 and where: ``rank 2, ['loss'][3]: ...``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["assert_all_close", "assert_all_equal"]


@dataclass(frozen=True, kw_only=True, slots=True)
class _Tolerance:
    rtol: float
    atol: float


_EXACT = _Tolerance(rtol=0.0, atol=0.0)


def assert_all_equal(results: Sequence[object]) -> None:
    """Asserts that every rank's value equals rank 0's exactly (NaN equals NaN).

    This is the check for what a collective hands to every rank: gloo gives all ranks the same
    bits. Tensors must also agree in dtype and shape.
    """
    __tracebackhide__ = True  # pytest: show the test's frame, not this one
    _assert_all(results, _EXACT)


def assert_all_close(results: Sequence[object], *, rtol: float, atol: float) -> None:
    """Asserts that every rank's value is close to rank 0's, as ``torch.testing.assert_close``.

    For values each rank computes on its own, where summation order may differ by rank.
    """
    __tracebackhide__ = True
    _assert_all(results, _Tolerance(rtol=rtol, atol=atol))


def _assert_all(results: Sequence[object], tolerance: _Tolerance) -> None:
    __tracebackhide__ = True
    if not results:
        raise ValueError("no results to compare: expected one value per rank")
    for rank, value in enumerate(results[1:], start=1):
        difference = _difference(results[0], value, "", tolerance)
        if difference is not None:
            raise AssertionError(f"rank {rank} differs from rank 0 at {difference}")


def _difference(expected: object, actual: object, path: str, tol: _Tolerance) -> str | None:
    """Where and how ``actual`` differs from ``expected`` first, or None when they agree."""
    at = path or "the top level"
    if type(expected) is not type(actual):
        return f"{at}: {type(actual).__name__} instead of {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor)  # same type, checked above
        try:
            torch.testing.assert_close(
                actual, expected, rtol=tol.rtol, atol=tol.atol, equal_nan=True
            )
        except AssertionError as exc:
            return f"{at}: {exc}"
        return None
    if isinstance(expected, Mapping):
        assert isinstance(actual, Mapping)
        if expected.keys() != actual.keys():
            return (
                f"{at}: keys {sorted(map(repr, actual))} instead of {sorted(map(repr, expected))}"
            )
        pairs = [(f"{path}[{key!r}]", expected[key], actual[key]) for key in expected]
        return _first_difference(pairs, tol)
    if isinstance(expected, list | tuple):
        assert isinstance(actual, list | tuple)
        if len(expected) != len(actual):
            return f"{at}: length {len(actual)} instead of {len(expected)}"
        pairs = [
            (f"{path}[{i}]", e, a) for i, (e, a) in enumerate(zip(expected, actual, strict=True))
        ]
        return _first_difference(pairs, tol)
    if isinstance(expected, float) and isinstance(actual, float):
        both_nan = math.isnan(expected) and math.isnan(actual)
        close = math.isclose(actual, expected, rel_tol=tol.rtol, abs_tol=tol.atol)
        return None if both_nan or close else f"{at}: {actual!r} instead of {expected!r}"
    return None if expected == actual else f"{at}: {actual!r} instead of {expected!r}"


def _first_difference(pairs: list[tuple[str, object, object]], tol: _Tolerance) -> str | None:
    for path, expected, actual in pairs:
        difference = _difference(expected, actual, path, tol)
        if difference is not None:
            return difference
    return None
