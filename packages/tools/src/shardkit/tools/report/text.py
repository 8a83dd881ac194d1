"""The terminal summary: plain-text tables that answer the profiling questions at a glance.

Three questions shape the sections: is communication hidden behind compute (per rank and step:
the payload and the bytes on the wire, the payload against the theoretical minimum, the exposed
(waited-on) time first, then the total time in flight and what of it overlapped; per mesh axis,
such as data against tensor parallelism, where the collectives' groups belong to a named mesh),
which collectives cost the most (grouped by kind, axis, module and phase), and where the memory
goes (each rank's peak by category, the modules at the top of the peak, the CUDA allocator's
own figures).

Next to split off: the memory section (``_memory_section`` to ``_allocator_table``: the peak,
module and allocator tables), into a module of its own beside this one.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from shardkit.tools.records import (
    AxisComm,
    Category,
    CollectiveRecord,
    CommSummary,
    ModulePeak,
    Phase,
    RankReport,
    StepComm,
)
from shardkit.tools.units import format_bytes

__all__ = ["format_seconds", "format_table", "module_label", "summarize"]

MAX_STEP_ROWS = 12
"""Ranks with more steps show the first and last few, so long runs stay one screen."""
MAX_GROUP_ROWS = 15
"""Collective groups shown, the most expensive first."""
MAX_MODULE_ROWS = 10
"""Modules shown in the memory ranking."""


def format_seconds(s: float) -> str:
    """A duration in the unit that keeps it short: ``0.0123`` → ``'12.3 ms'``."""
    if s == 0:
        return "0"
    if abs(s) < 1e-3:
        return f"{s * 1e6:.0f} us"  # ASCII "us": summaries end up in logs of any encoding
    if abs(s) < 1.0:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def module_label(module: str, phase: Phase) -> str:
    """A module's name for people: the root (FQN ``''``) and "no module" made readable.

    An empty FQN is the root module in forward and backward, and no module at all in the
    optimizer step or outside any module.
    """
    if module:
        return module
    if phase in (Phase.FORWARD, Phase.BACKWARD):
        return "(root)"
    return "(optimizer step)" if phase is Phase.OPTIMIZER else "(outside modules)"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> str:
    """Aligns cells into columns under a rule; no trailing spaces.

    Args:
        headers: One title per column.
        rows: Rows of cells, each as long as ``headers``.
        align: One ``'l'`` or ``'r'`` per column; by default the first column is left-aligned
            (names) and the rest right-aligned (numbers).

    Returns:
        The table, lines joined by newlines, without a final newline.
    """
    align = align or "l" + "r" * (len(headers) - 1)
    if len(align) != len(headers):
        raise ValueError(f"align={align!r} has {len(align)} letters for {len(headers)} columns")
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row {list(row)} has {len(row)} cells for {len(headers)} columns")
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        padded = (
            c.ljust(w) if a == "l" else c.rjust(w)
            for c, w, a in zip(cells, widths, align, strict=True)
        )
        return "  ".join(padded).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def summarize(reports: Sequence[RankReport]) -> str:
    """The terminal summary of a profiled run.

    Args:
        reports: One report per rank, in any order; a rank may lack communication or memory
            data (its sections say so).

    Returns:
        Text ending in a newline, ready for stdout or ``summary.txt``.
    """
    if not reports:
        return "shardkit profile: no rank reports\n"
    reports = sorted(reports, key=lambda r: r.rank)
    world = max(r.world_size for r in reports)
    ranks = ", ".join(str(r.rank) for r in reports)
    sections = [
        f"shardkit profile: {len(reports)} of {world} ranks (ranks {ranks})",
        _comm_section(reports),
        _axis_section(reports),
        _collective_groups_section(reports),
        _memory_section(reports),
    ]
    return "\n\n".join(s for s in sections if s) + "\n"


# ---------------------------------------------------------------------------------------------
# Communication


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole > 0 else "-"


def _comm_section(reports: Sequence[RankReport]) -> str:
    with_comm = [r for r in reports if r.comm is not None and r.comm.steps]
    if not with_comm:
        return "communication per step: not recorded"
    headers = ["rank", "step", "collectives", "payload", "wire", "vs min", "step time"]
    headers += ["exposed", "comm total", "overlapped", "exposed/step"]
    rows: list[list[str]] = []
    for report in with_comm:
        assert report.comm is not None  # filtered above
        rows += _comm_rows(report.rank, report.comm)
    known_min = any(r.comm and r.comm.theoretical_min_bytes for r in with_comm)
    computed = any(r.comm and r.comm.minimum_computed for r in with_comm)
    notes = [
        "payload: bytes a rank sends under a bandwidth-optimal (ring) algorithm; wire: bytes it"
        " sent under the algorithms that ran (gloo's reduce-scatter sends twice its payload;"
        " an engine's point-to-point messages count as sent)",
        _min_note(known_min, computed),
        "exposed: the training thread waited on communication (% of comm total, the time any"
        " collective was in flight)",
        "overlapped: communication in flight while the rank computed (% of comm total)",
        "exposed/step: share of the step spent waiting on communication",
    ]
    missing = [str(r.rank) for r in reports if r.comm is None or not r.comm.steps]
    if missing:
        notes.append(f"no communication summary from ranks {', '.join(missing)}")
    table = format_table(headers, rows, align="r" * len(headers))
    return "communication per step\n" + table + "\n" + "\n".join(f"  {n}" for n in notes)


def _min_note(known: bool, computed: bool) -> str:
    if not known:
        return "vs min: unknown (no theoretical minimum was given, nor computable from the model)"
    note = "vs min: payload over the theoretical minimum for the model (1.00x is optimal)"
    if computed:
        note += (
            "; computed from its FSDP groups: each gather or reduction of a group's Ψ elements"
            " of b bytes over W ranks sends at least Ψ·b·(W-1)/W (no padding)"
        )
    return note


def _comm_rows(rank: int, comm: CommSummary) -> list[list[str]]:
    steps = comm.steps
    if len(steps) > MAX_STEP_ROWS:
        half = MAX_STEP_ROWS // 2
        shown: list[StepComm | None] = [*steps[:half], None, *steps[-half:]]
    else:
        shown = list(steps)
    rows: list[list[str]] = []
    for step in shown:
        if step is None:
            rows.append(["", f"({len(steps) - 2 * (MAX_STEP_ROWS // 2)} more)", *[""] * 9])
            continue
        ratio = (
            f"{step.sent_bytes / comm.theoretical_min_bytes:.2f}x"
            if comm.theoretical_min_bytes
            else "-"
        )
        rows.append(_comm_row(str(step.step), step, ratio))
    total = StepComm(
        step=-1,
        collectives=sum(s.collectives for s in steps),
        sent_bytes=sum(s.sent_bytes for s in steps),
        wire_bytes=_sum_known([s.wire_bytes for s in steps]),
        comm_s=sum(s.comm_s for s in steps),
        exposed_s=sum(s.exposed_s for s in steps),
        step_s=sum(s.step_s for s in steps),
    )
    mean_ratio = "-" if comm.sent_over_min is None else f"{comm.sent_over_min:.2f}x"
    rows.append(_comm_row("all", total, mean_ratio))
    rows[0][0] = str(rank)
    return rows


def _comm_row(label: str, s: StepComm, ratio: str) -> list[str]:
    return [
        "",
        label,
        str(s.collectives),
        format_bytes(s.sent_bytes),
        _maybe_bytes(s.wire_bytes),
        ratio,
        format_seconds(s.step_s),
        f"{format_seconds(s.exposed_s)} ({_percent(s.exposed_s, s.comm_s)})",
        format_seconds(s.comm_s),
        f"{format_seconds(s.overlapped_s)} ({_percent(s.overlapped_s, s.comm_s)})",
        _percent(s.exposed_s, s.step_s),
    ]


def _sum_known(values: Sequence[int | None]) -> int | None:
    """The sum, or None if one of the values is unknown."""
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def _maybe_bytes(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def _axis_section(reports: Sequence[RankReport]) -> str:
    """Bytes and time per mesh axis and rank, over the reported steps; '' without axes."""
    rows: list[list[str]] = []
    for report in reports:
        steps = report.comm.steps if report.comm is not None else []
        totals: dict[str | None, list[AxisComm]] = defaultdict(list)
        for step in steps:
            for part in step.by_axis:
                totals[part.axis].append(part)
        if all(axis is None for axis in totals):
            continue
        first = len(rows)
        for axis, parts in totals.items():
            comm_s, exposed_s = sum(p.comm_s for p in parts), sum(p.exposed_s for p in parts)
            rows.append(
                [
                    "",
                    _axis_label(axis),
                    str(sum(p.collectives for p in parts)),
                    format_bytes(sum(p.sent_bytes for p in parts)),
                    f"{format_seconds(exposed_s)} ({_percent(exposed_s, comm_s)})",
                    format_seconds(comm_s),
                ]
            )
        rows[first][0] = str(report.rank)
    if not rows:
        return ""
    headers = ["rank", "axis", "collectives", "payload", "exposed", "comm total"]
    table = format_table(headers, rows, align="rlrrrr")
    return "communication by mesh axis (each rank's steps together)\n" + table


def _axis_label(axis: str | None) -> str:
    return "(no mesh axis)" if axis is None else axis


@dataclass(kw_only=True, slots=True)
class _Group:
    """Running totals of one (kind, module, phase) group of collectives."""

    calls: int = 0
    sent_bytes: int = 0
    wire_bytes: int | None = 0
    time_s: float = 0.0
    wait_s: float = 0.0


def _collective_groups_section(reports: Sequence[RankReport]) -> str:
    groups: dict[tuple[str, str | None, str, str], _Group] = defaultdict(_Group)
    for report in reports:
        for c in report.collectives:
            group = groups[(c.kind, c.axis, module_label(_for(c), c.phase), c.phase.value)]
            group.calls += 1
            group.sent_bytes += c.sent_bytes
            group.wire_bytes = _sum_known([group.wire_bytes, c.wire_bytes])
            group.time_s += c.duration_s
            group.wait_s += c.wait_s
    if not groups:
        return "collectives: none recorded"
    ranked = sorted(groups.items(), key=lambda kv: kv[1].time_s, reverse=True)
    with_axis = any(axis is not None for _, axis, _, _ in groups)
    headers = ["kind", *(["axis"] if with_axis else []), "module", "phase"]
    headers += ["calls", "payload", "wire", "exposed", "time"]
    rows = [
        [
            kind,
            *([_axis_label(axis)] if with_axis else []),
            module,
            phase,
            str(g.calls),
            format_bytes(g.sent_bytes),
            _maybe_bytes(g.wire_bytes),
            f"{format_seconds(g.wait_s)} ({_percent(g.wait_s, g.time_s)})",
            format_seconds(g.time_s),
        ]
        for (kind, axis, module, phase), g in ranked[:MAX_GROUP_ROWS]
    ]
    what = "kind, axis, module and phase" if with_axis else "kind, module and phase"
    title = (
        f"collectives by {what} (summed over {len(reports)} ranks; the module"
        " a collective is for where the engine says, else the one running)"
    )
    align = "llll" if with_axis else "lll"
    text = title + "\n" + format_table(headers, rows, align=align + "rrrrr")
    rest = ranked[MAX_GROUP_ROWS:]
    if rest:
        calls = sum(g.calls for _, g in rest)
        text += f"\n  ... {len(rest)} more groups ({calls} calls), the cheapest"
    return text


# ---------------------------------------------------------------------------------------------
# Memory


def _memory_section(reports: Sequence[RankReport]) -> str:
    with_memory = [r for r in reports if r.memory is not None]
    if not with_memory:
        return "memory: not recorded"
    parts = [_peak_table(with_memory), _module_table(with_memory), _allocator_table(with_memory)]
    missing = [str(r.rank) for r in reports if r.memory is None]
    if missing:
        parts.append(f"no memory data from ranks {', '.join(missing)}")
    return "\n\n".join(p for p in parts if p)


def _peak_table(reports: Sequence[RankReport]) -> str:
    lines = []
    rows: list[list[str]] = []
    for report in reports:
        assert report.memory is not None  # filtered by the caller
        peak = report.memory.peak
        where = f"step {peak.step}, {peak.phase.value}, {module_label(peak.module, peak.phase)}"
        lines.append(
            f"  rank {report.rank} ({report.memory.device}): peak {format_bytes(peak.total)} "
            f"at {peak.t_s:.3f} s ({where})"
        )
        first = len(rows)
        for category in Category:
            size = peak.by_category.get(category, 0)
            if size:
                rows.append(["", category.value, format_bytes(size), _percent(size, peak.total)])
        rows.append(["", "total", format_bytes(peak.total), "100%" if peak.total else "-"])
        rows[first][0] = str(report.rank)
    table = format_table(["rank", "category", "at peak", "share"], rows, align="rlrr")
    return "memory at each rank's peak\n" + "\n".join(lines) + "\n" + table


def _module_table(reports: Sequence[RankReport]) -> str:
    # The same module and phase on every rank is one row, at its highest rank's figure.
    best: dict[tuple[str, str], tuple[int, ModulePeak]] = {}
    for report in reports:
        assert report.memory is not None  # filtered by the caller
        for mp in report.memory.module_peaks:
            key = (mp.module, mp.phase.value)
            if key not in best or mp.peak.total > best[key][1].peak.total:
                best[key] = (report.rank, mp)
    if not best:
        return ""
    ranked = sorted(best.values(), key=lambda rm: rm[1].peak.total, reverse=True)
    rows = []
    for rank, mp in ranked[:MAX_MODULE_ROWS]:
        total = mp.peak.total
        category, size = max(mp.peak.by_category.items(), key=lambda kv: kv[1], default=(None, 0))
        biggest = "-" if category is None else f"{category.value} {format_bytes(size)}"
        rows.append(
            [
                module_label(mp.module, mp.phase),
                mp.phase.value,
                format_bytes(total),
                f"{biggest} ({_percent(size, total)})",
                str(rank),
            ]
        )
    title = "top modules by peak memory (live bytes while each ran)"
    return (
        title + "\n" + format_table(["module", "phase", "peak", "biggest", "rank"], rows, "llrlr")
    )


def _allocator_table(reports: Sequence[RankReport]) -> str:
    keys = sorted({k for r in reports if r.memory for k in r.memory.allocator})
    if not keys:
        return ""
    rows = []
    for report in reports:
        assert report.memory is not None  # filtered by the caller
        figures = report.memory.allocator
        rows.append(
            [str(report.rank), *(format_bytes(figures[k]) if k in figures else "-" for k in keys)]
        )
    table = format_table(["rank", *keys], rows, align="r" * (len(keys) + 1))
    return "allocator (CUDA caching allocator)\n" + table


def _for(c: CollectiveRecord) -> str:
    """The module a collective is for: the one it serves where known, else the one running."""
    return c.serves if c.serves is not None else c.module
