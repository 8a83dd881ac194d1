"""What a test author reads when a task on the pool fails: the errors and their messages."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CrashRetried", "RankTaskError", "RankTaskTimeout", "TaskFailure", "output_tail"]

# How much of a rank's output goes into a message: the end, where a stack dump or a crash is.
_OUTPUT_TAIL_CHARS = 4000


class RankTaskError(Exception):
    """A task raised on some rank, or the pool could not run it."""


class RankTaskTimeout(RankTaskError):
    """A task did not finish on every rank within its timeout."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskFailure:
    """How a task went wrong across the ranks, gathered by the pool to build one message."""

    name: str
    """The task's function as ``module.qualname``."""
    world_size: int
    timeout_s: float
    errors: dict[int, str]
    """Rank → traceback, for the ranks that raised or whose worker died."""
    running: list[int]
    """Ranks still in the task when the pool gave up waiting."""
    stuck: list[int]
    """Ranks that finished the task but did not get through the reset barrier after it."""
    outputs: dict[int, str]
    """Rank → what the rank printed during the task (with faulthandler's stacks, if dumped)."""

    @property
    def failed(self) -> bool:
        """Whether the test must fail."""
        return bool(self.errors or self.running or self.stuck)

    def exception(self) -> RankTaskError:
        """The exception to raise: a timeout when ranks hung and none of them failed first."""
        error_type = RankTaskTimeout if self.running and not self.errors else RankTaskError
        return error_type(self._message())

    def _message(self) -> str:
        parts = [self._summary()]
        for rank, error in sorted(self.errors.items()):
            parts.append(f"--- rank {rank} ---\n{error.rstrip()}")
        for rank in self.running:
            tail = output_tail(self.outputs.get(rank, ""))
            parts.append(f"--- rank {rank}: still running; the end of its output ---\n{tail}")
        return "\n\n".join(parts)

    def _summary(self) -> str:
        where = f"{self.name} on world_size={self.world_size}"
        fresh = "The pool was killed; the next task starts a fresh one."
        if self.running and not self.errors:
            return (
                f"{where} timed out after {self.timeout_s:g} s: rank(s) {self.running} still "
                f"running. Their Python stacks are at the end of their output below. {fresh}"
            )
        if self.errors:
            summary = f"{where} failed on rank(s) {sorted(self.errors)}."
        else:
            summary = f"{where} returned on every rank."
        if self.running:
            summary += (
                f" Rank(s) {self.running} were still running, most likely waiting in a "
                f"collective for the failed rank(s). {fresh}"
            )
        if self.stuck:
            summary += (
                f" Afterwards rank(s) {self.stuck} did not get through the barrier between "
                "tasks: the task left the ranks' collectives out of step (one rank issued a "
                f"collective the others did not) or broke the process group. {fresh}"
            )
        return summary


@dataclass(frozen=True, kw_only=True, slots=True)
class CrashRetried:
    """A task whose worker died of a crash signal, run again on a fresh pool."""

    failure: TaskFailure
    """How the crashed run went (each rank's error, the crashed ranks' output)."""
    signals: dict[int, str]
    """Rank → the signal that killed its worker ("SIGSEGV")."""

    def headline(self) -> str:
        """One line: the task, the ranks and signals, and that it ran again."""
        ranks = ", ".join(f"rank {rank} ({name})" for rank, name in sorted(self.signals.items()))
        return (
            f"{self.failure.name} on world_size={self.failure.world_size}: the worker of "
            f"{ranks} crashed; the task ran again on a fresh pool"
        )

    def report(self) -> str:
        """The headline and the end of each crashed rank's output (faulthandler's stacks)."""
        parts = [self.headline()]
        for rank in sorted(self.signals):
            said = self.failure.errors.get(rank) or (
                "it returned, then died in the barrier after the task; the end of its output:\n"
                + output_tail(self.failure.outputs.get(rank, ""))
            )
            parts.append(f"--- rank {rank} ---\n{said.rstrip()}")
        return "\n".join(parts)


def output_tail(output: str) -> str:
    """The end of a rank's output: where a stack dump or a crash report is."""
    return output[-_OUTPUT_TAIL_CHARS:].rstrip()
