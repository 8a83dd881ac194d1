"""WholeMatrixOptimizer: a rule's step on sharded matrices, each updated once and whole.

One step, for the parameters with gradients (docs/guide/muon.md tells the design):

1. every rank runs the rule's ``prepare`` on its block (elementwise: momentum stays sharded
   like the parameter, and a block gives the bits the whole tensor would);
2. one copy of each block of each sharded matrix goes to the matrix's owner, one exchange for
   all of a group's matrices (``exchange.py``); owners are chosen over every rank of the
   parameter's mesh (HSDP's replicas and TP's ranks too), balanced by the rule's cost
   (``owners.py``);
3. each owner runs ``update`` once per matrix it owns, whole (matrices of one shape batched
   where the rule can keep the bits);
4. the update's blocks go back to every rank that holds them, one exchange again (with
   ``exchange_rounds`` above 1, 2 to 4 run round by round, a round's updates travelling back
   while the owner works on the next);
5. every rank runs ``apply`` on its blocks (learning rate, weight decay: elementwise).

A 3-D parameter is a stack of E matrices (MoE experts), each placed and owned on its own.
Matrices this rank holds whole alone (plain tensors, a mesh of one rank) skip 2 and 4. The
optimizer's state is the rule's elementwise state, kept as DTensors like the parameters, so
``state_dict()`` and ``load_state_dict()`` are torch's own.

The step's memory: a group's rows are let go of once its first exchange has them all, and
each round's whole matrices once they are orthogonalized, so an owner holds its updates and
the second exchange's buffers, not every stage's tensors at once.

Next to split off: one group's round trip (``_step_sharded``, ``_plan_of``,
``_update_owned`` and ``_Plan``: steps 2 to 4) into ``owner_round_trip.py``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import ParamsT

from shardkit.core.optim.exchange import Packing, packing, start_gather, start_scatter
from shardkit.core.optim.matrices import MatrixPlacement, placement_of
from shardkit.core.optim.owners import assign_owners, rounds
from shardkit.core.optim.replica_check import check_replicas
from shardkit.core.optim.routes import routes
from shardkit.core.optim.rule import Options, WholeMatrixRule
from shardkit.core.optim.state_checks import check_loadable
from shardkit.core.optim.step_stats import StepStats, Tally
from shardkit.core.runtime.dtensors import local_of
from shardkit.core.runtime.groups import mesh_group

__all__ = ["StepStats", "WholeMatrixOptimizer"]


@dataclass(frozen=True, slots=True)
class _Matrix:
    """One matrix with a gradient in this step: a 2-D parameter, or one expert of a stack."""

    param: torch.Tensor
    options: Options
    placement: MatrixPlacement


@dataclass(frozen=True, slots=True)
class _Plan:
    """One group's step, the same every step while its matrices and dtypes stay."""

    rounds: list[tuple[Packing, Packing]]
    """Each round's exchanges: blocks to owners, update blocks back (their layouts)."""
    back: list[torch.dtype]
    """Each update's dtype (``update_dtype``)."""


class WholeMatrixOptimizer(torch.optim.Optimizer):
    """An optimizer whose update is a function of each whole matrix, on sharded parameters.

    Takes the parameters of a model sharded by shardkit's ``fully_shard`` or torch's (FSDP,
    HSDP, with TP too), or replicated, and plain tensors. Each sharded matrix is updated once
    in the job, whole, on one rank; every rank then applies its block. Subclasses give the
    rule and the defaults (:class:`~shardkit.core.optim.muon.Muon`,
    :class:`~shardkit.core.optim.column_norm.ColumnNormSGD`).

    Args:
        params: 2-D parameters, or parameter groups (dicts), or (name, parameter) pairs: names
            are what errors say (torch's optimizers take ``named_parameters()`` too).
        defaults: the hyperparameters of every group that does not set its own.
        rule: what the step computes.
        replicated_over: a mesh (TP's axis) whose ranks hold the same values of every
            parameter not placed on it and compute the same gradients for it: each such
            matrix is then orthogonalized once across that mesh too, not once per rank of it.
            Checked at the first step that meets the parameter (every rank raises where they
            differ). None: each parameter's own placements say where its copies are.
    """

    exchange_rounds: int = 1
    """Rounds each owner's matrices are cut into (of about equal cost), two collectives each:
    every round's blocks leave at once, the owner orthogonalizes a round as soon as it is in
    and sends its updates back while it works on the next. Bits are the same for any number.
    1 (the default) where communication and Newton-Schulz share the cores (gloo on a CPU,
    where more rounds measured slower: docs/guide/muon.md); more where the exchanges run on
    links and engines of their own. Set on the optimizer (``muon.exchange_rounds = 2``)."""

    def __init__(
        self,
        params: ParamsT,
        defaults: dict[str, Any],
        *,
        rule: WholeMatrixRule,
        replicated_over: DeviceMesh | None = None,
    ):
        self.rule = rule
        self.replicated_over = replicated_over
        # Made here, where every rank builds the optimizer in the same order (an N-D mesh's
        # group is a new group, which every rank of the world makes).
        self._replica_group = None if replicated_over is None else mesh_group(replicated_over)
        self._replicas_checked: set[int] = set()
        self.last_step_stats: StepStats | None = None
        """What this rank's last step did (None before the first)."""
        self._plans: dict[tuple[Any, ...], _Plan] = {}
        # Each parameter's matrices, placed when its group is added, by id (with the
        # parameter, so that an id reused by another tensor is never taken for it).
        self._placements: dict[int, tuple[torch.Tensor, tuple[MatrixPlacement, ...]]] = {}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its parameters must be matrices this optimizer can place.

        Raises:
            ValueError: a parameter that is neither 2-D nor a 3-D stack of matrices.
            NotImplementedError: a parameter whose shards are not blocks of its matrices.
        """
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        try:
            # Refused now, on every rank, rather than mid-step on some.
            added = self.param_groups[index]
            placed = [
                (p, placement_of(p, name, self.replicated_over)) for name, p in _named(added, index)
            ]
        except (ValueError, NotImplementedError):
            del self.param_groups[index]  # as if never added
            raise
        self._placements.update((id(p), (p, placement)) for p, placement in placed)

    def check_options(self, options: Options) -> None:
        """Refuse hyperparameters this optimizer cannot step with (subclasses say which).

        A group added and each group of a loaded state dict pass through it.
        """

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict`` once every rank has found it to be this optimizer's state.

        Raises:
            ValueError, TypeError: the same on every rank, nothing loaded; see
                ``state_checks.py`` for what is refused.
        """
        check_loadable(self, state_dict)
        super().load_state_dict(state_dict)

    # torch's stubs overload step (None -> None, a closure -> float); one signature for both.
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update of every parameter with a gradient.

        Every rank of a group of sharded matrices must call it (two collectives), with
        gradients on the same parameters.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_replicas()
        matrices, blocks = self._prepared()
        tally = Tally()
        for m, block in zip(matrices, blocks, strict=True):
            if m.placement.group is None:  # whole here: no owner but this rank
                # Applied at once, one at a time: holding every whole update for one
                # ``apply_all`` would add them all to the step's peak.
                self._apply([(m, self.rule.update(block, m.options))])
                tally.updated(self.rule, m.placement.shape)
        for indices in _by_group(matrices).values():
            rows = [blocks[i] for i in indices]
            for i in indices:  # the group's exchange lets go of its rows once they are in
                blocks[i] = _LET_GO
            self._step_sharded([matrices[i] for i in indices], rows, tally)
        self.last_step_stats = tally.stats()
        return loss

    def _check_replicas(self) -> None:
        """The parameters placed on ``replicated_over``'s word, first met: checked to agree."""
        if self._replica_group is None:
            return
        unchecked = [
            (name, param)
            for index, group in enumerate(self.param_groups)
            for name, param in _named(group, index)
            if param.grad is not None
            and id(param) not in self._replicas_checked
            and any(m.assumed for m in self._placement(param, name))
        ]
        if unchecked:  # the same on every rank: one program, one order of steps
            check_replicas(unchecked, self._replica_group)
        self._replicas_checked.update(id(p) for _, p in unchecked)

    def _prepared(self) -> tuple[list[_Matrix], list[torch.Tensor]]:
        """The matrices with gradients, in group order, and this rank's block of each.

        The rule's ``prepare`` runs once per parameter (a stack's experts share its state),
        over a group's parameters at once where the rule has ``prepare_all``.
        """
        matrices: list[_Matrix] = []
        blocks: list[torch.Tensor] = []
        for index, group in enumerate(self.param_groups):
            stepped = [(name, p) for name, p in _named(group, index) if p.grad is not None]
            prepared = self._prepare(stepped, group)
            for (name, param), rows in zip(stepped, prepared, strict=True):
                for placement in self._placement(param, name):
                    matrices.append(_Matrix(param, group, placement))
                    blocks.append(_block(rows, placement))
        return matrices, blocks

    def _placement(self, param: torch.Tensor, name: str) -> tuple[MatrixPlacement, ...]:
        """Where ``param``'s matrices live, as found when its group was added."""
        known = self._placements.get(id(param))
        if known is None or known[0] is not param:  # put in param_groups by hand
            placement = placement_of(param, name, self.replicated_over)
            known = self._placements[id(param)] = (param, placement)
        return known[1]

    def _prepare(
        self, named: list[tuple[str, torch.Tensor]], options: Options
    ) -> list[torch.Tensor]:
        """The rule's ``prepare`` of one group's parameters on this rank's shards.

        Their state is made on first use.
        """
        grads: list[torch.Tensor] = []
        states: list[dict[str, torch.Tensor]] = []
        for name, param in named:
            grad = param.grad
            assert grad is not None
            if torch.is_complex(param):
                raise RuntimeError(f"{name}: {self.rule.name} does not support complex parameters")
            if grad.is_sparse:
                raise RuntimeError(f"{name}: {self.rule.name} does not support sparse gradients")
            state = self.state[param]
            if not state:
                state.update(self.rule.init_state(grad))
            grads.append(_local(grad))
            states.append({k: _local(v) for k, v in state.items()})
        locals_ = [_local(p) for _, p in named]
        if self.rule.prepare_all is not None:
            return self.rule.prepare_all(locals_, grads, states, options)
        return [
            self.rule.prepare(p, g, s, options)
            for p, g, s in zip(locals_, grads, states, strict=True)
        ]

    def _apply(self, updates: Iterable[tuple[_Matrix, torch.Tensor]]) -> None:
        """The rule's ``apply`` of each update to this rank's block.

        A group's at once where the rule has ``apply_all``.
        """
        by_group: dict[int, tuple[Options, list[Any], list[Any], list[Any]]] = {}
        for m, update in updates:
            param = _block(_local(m.param), m.placement)
            if param.numel():  # a rank that holds none of the matrix has nothing to apply
                _, params, rows, shapes = by_group.setdefault(
                    id(m.options), (m.options, [], [], [])
                )
                params.append(param)
                rows.append(update)
                shapes.append(m.placement.shape)
        for options, params, rows, shapes in by_group.values():
            if self.rule.apply_all is not None:
                self.rule.apply_all(params, rows, options, shapes)
                continue
            for param, update, shape in zip(params, rows, shapes, strict=True):
                self.rule.apply(param, update, options, shape)

    def _step_sharded(
        self, matrices: list[_Matrix], blocks: list[torch.Tensor], tally: Tally
    ) -> None:
        """Steps 2 to 5 for one process group's sharded matrices."""
        group = matrices[0].placement.group
        assert group is not None
        placements = [m.placement for m in matrices]
        plan = self._plan_of(placements, [b.dtype for b in blocks], group)
        # Every round's blocks leave at once; the owner starts on a round as soon as it is in,
        # and its updates travel back while the owner works on the next round.
        arrivals = [start_gather(placements, there, blocks, group) for there, _ in plan.rounds]
        device = _local(matrices[0].param).device
        returns = []
        for round_index, (arrival, (there, home)) in enumerate(
            zip(arrivals, plan.rounds, strict=True)
        ):
            tally.exchanged(there.traffic)
            wholes = arrival.wait()
            if round_index == len(arrivals) - 1:
                blocks.clear()  # every round is in: the rows are not needed any more
            results = self._update_owned(matrices, wholes, plan.back)
            del wholes  # orthogonalized: not held through the updates' exchange
            for i in results:
                tally.updated(self.rule, placements[i].shape)
            returns.append(start_scatter(placements, home, results, group, device))
            tally.exchanged(home.traffic)
        for arrival in returns:
            self._apply((matrices[i], update) for i, update in arrival.wait().items())

    def _plan_of(
        self, placements: list[MatrixPlacement], dtypes: list[torch.dtype], group: dist.ProcessGroup
    ) -> _Plan:
        """Owners and routes: the same on every rank, kept while the matrices stay."""
        rounds_wanted = self.exchange_rounds
        if isinstance(rounds_wanted, bool) or not isinstance(rounds_wanted, int):
            raise TypeError(f"exchange_rounds must be an int, not {rounds_wanted!r}")
        if rounds_wanted < 1:
            raise ValueError(f"exchange_rounds must be at least 1, not {rounds_wanted}")
        key = (tuple(id(p) for p in placements), tuple(dtypes), rounds_wanted)
        plan = self._plans.get(key)
        if plan is None:
            costs = [self.rule.cost(p.shape) for p in placements]
            owners = assign_owners(
                costs,
                group.size(),
                [p.whole_on() for p in placements],
                [p.tall for p in placements],
            )
            back = [self.rule.update_dtype(d) for d in dtypes]
            there, home = routes(placements, owners, dtypes, back, group.rank())
            cut = [frozenset(r) for r in rounds(costs, owners, rounds_wanted)]
            plan = _Plan(
                [
                    (packing(there.only(r), placements), packing(home.only(r), placements))
                    for r in cut
                ],
                back,
            )
            self._plans[key] = plan
        return plan

    def _update_owned(
        self, matrices: list[_Matrix], wholes: dict[int, torch.Tensor], dtypes: list[torch.dtype]
    ) -> dict[int, torch.Tensor]:
        """The rule's update of every matrix this rank owns, batched by shape where it can."""
        batches: defaultdict[tuple[Any, ...], list[int]] = defaultdict(list)
        for i, whole in wholes.items():
            batches[(whole.shape, whole.dtype, id(matrices[i].options))].append(i)
        results: dict[int, torch.Tensor] = {}
        for indices in batches.values():
            options = matrices[indices[0]].options
            batch = self.rule.update_batch
            if (
                batch is not None
                and len(indices) > 1
                and self.rule.batches_on(wholes[indices[0]].device)
            ):
                stacked = batch(torch.stack([wholes[i] for i in indices]), options)
                results.update(zip(indices, stacked.unbind(0), strict=True))
            else:
                # Contiguous as each comes: the exchange sends row blocks, and a tall matrix's
                # update comes transposed (Newton-Schulz iterates on the wide side); copied
                # there, every such update would be held twice while the buffers are packed.
                results.update(
                    (i, self.rule.update(wholes[i], options).contiguous()) for i in indices
                )
        for i, update in results.items():
            if update.dtype != dtypes[i] or update.shape != wholes[i].shape:
                name = matrices[i].placement.name
                raise RuntimeError(
                    f"{name}: {self.rule.name}'s update is {tuple(update.shape)} "
                    f"{update.dtype}, its rule said {tuple(wholes[i].shape)} {dtypes[i]} "
                    "(WholeMatrixRule.update_dtype)"
                )
        return results


_LET_GO = torch.empty(0)
"""What a sharded matrix's rows become in the step's list once its group's exchange has them."""


def _named(group: Options, index: int) -> Iterable[tuple[str, torch.Tensor]]:
    """Each parameter of a group with its name: the one given, or where it sits."""
    params: list[torch.Tensor] = group["params"]
    names: list[str] | None = group.get("param_names")
    for j, param in enumerate(params):
        yield (names[j] if names else f"param_groups[{index}]['params'][{j}]"), param


def _by_group(matrices: list[_Matrix]) -> dict[dist.ProcessGroup, list[int]]:
    """The sharded matrices' indices by the process group that holds them, in order."""
    found: dict[dist.ProcessGroup, list[int]] = {}
    for i, m in enumerate(matrices):
        if m.placement.group is not None:
            found.setdefault(m.placement.group, []).append(i)
    return found


def _block(local: torch.Tensor, placement: MatrixPlacement) -> torch.Tensor:
    """This rank's block of one matrix in a parameter's local tensor (or its prepared one).

    The tensor itself for a 2-D parameter, one expert of a stack, empty where it holds none.
    """
    if local.dim() == 2:
        return local
    if placement.expert is None:
        return local.new_empty((0, 0))
    return local[placement.expert]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's rows of ``tensor`` (a DTensor's local tensor; a plain tensor itself)."""
    return local_of(tensor) if isinstance(tensor, DTensor) else tensor
