"""Loops in a sequence of calls: where consecutive units repeat over a container's items.

``parallelize_source`` writes one call per unit; where units follow a pattern, every block
(``blocks.0`` .. ``blocks.31``) or every block's attention and MLP, one ``for`` loop says it
better than 32 or 64 lines. :func:`runs` folds each such stretch into a :class:`Loop`: the
calls it makes are, by construction, the same calls in the same order (a body of up to
``MAX_PERIOD`` items, repeated over ``range(start, stop, step)``, each item's modules at fixed
offsets from the index), so a written loop is exactly the unrolled plan.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MAX_PERIOD", "MIN_REPEATS", "Item", "Loop", "runs"]

MAX_PERIOD = 4
"""Items in one loop body, at most: a block's attention and MLP apart is 2."""
MIN_REPEATS = 3
"""Fewer repeats are written out: two lines read as well as a loop of one."""


@dataclass(frozen=True, slots=True)
class Item:
    """One call to write: its modules and what else varies (reshard value, checkpoint mode)."""

    modules: tuple[str, ...]
    extra: object


@dataclass(frozen=True, slots=True)
class Loop:
    """Items repeating over ``container[i]`` for i in ``range(start, stop, step)``.

    Each body item's modules are (offset, tail): the module ``container.{i + offset}{tail}``.
    """

    container: str
    start: int
    stop: int
    step: int
    body: tuple[tuple[tuple[tuple[int, str], ...], object], ...]


def _index_of(fqn: str, container: str) -> tuple[int, str] | None:
    """(index, tail) when ``fqn`` is ``container.<index><tail>``; None otherwise."""
    prefix = f"{container}." if container else ""
    if not fqn.startswith(prefix):
        return None
    head, dot, tail = fqn[len(prefix) :].partition(".")
    if not head.isdigit() or (head != "0" and head.startswith("0")):
        return None
    return int(head), dot + tail


def _template(item: Item, container: str, i: int) -> tuple[tuple[tuple[int, str], ...], object]:
    found = [_index_of(m, container) for m in item.modules]
    if any(f is None for f in found):
        return ((), None)
    return tuple((f[0] - i, f[1]) for f in found if f is not None), item.extra


def _loop_at(items: list[Item], k: int) -> tuple[Loop, int] | None:
    """The loop covering the most items from ``k`` on, and how many it covers."""
    best: tuple[Loop, int] | None = None
    segments = items[k].modules[0].split(".")
    for s, segment in enumerate(segments):
        container = ".".join(segments[:s])
        start = _index_of(items[k].modules[0], container)
        if not segment.isdigit() or start is None:
            continue
        base = start[0]
        for period in range(1, min(MAX_PERIOD, len(items) - k) + 1):
            body = [_template(items[k + r], container, base) for r in range(period)]
            if any(not modules for modules, _ in body) or k + period >= len(items):
                continue
            following = _index_of(items[k + period].modules[0], container)
            step = following[0] - base if following else 0
            if step < 1:
                continue
            reps = 1
            while k + (reps + 1) * period <= len(items) and all(
                _template(items[k + reps * period + r], container, base + reps * step) == body[r]
                for r in range(period)
            ):
                reps += 1
            if reps >= MIN_REPEATS and (best is None or reps * period > best[1]):
                loop = Loop(container, base, base + reps * step, step, tuple(body))
                best = (loop, reps * period)
    return best


def runs(items: list[Item]) -> list[Item | Loop]:
    """``items`` with each stretch that repeats over a container folded into a loop."""
    out: list[Item | Loop] = []
    k = 0
    while k < len(items):
        found = _loop_at(items, k)
        if found is None:
            out.append(items[k])
            k += 1
        else:
            out.append(found[0])
            k += found[1]
    return out
