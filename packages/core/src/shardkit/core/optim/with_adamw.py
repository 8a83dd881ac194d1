"""One optimizer object for a transformer's two kinds of parameters: Muon's and AdamW's.

Muon takes the hidden matrices; the embeddings, the head, the norms and the biases take AdamW.
As two optimizers that is two objects to step, to schedule and to save, and code that takes
one optimizer (transformers' ``Trainer``, a single learning-rate scheduler, a training loop
written for AdamW) cannot take the pair. :class:`MuonWithAdamW` is the pair as one
``torch.optim.Optimizer``: each parameter group says which it takes by ``use_muon`` (the key
Keller Jordan's ``MuonWithAuxAdam`` made the usual one), and gets that optimizer's defaults.

It is the pair inside, not a third implementation: shardkit's :class:`Muon` steps the Muon
groups and torch's own ``torch.optim.AdamW`` the others, so a step has the pair's bits. The
three objects share the group dicts (a scheduler that sets this object's ``lr`` sets the
inner optimizer's) and one state table, so ``state_dict()`` is torch's format over every group
in the order given, which DCP's ``get_state_dict`` / ``set_state_dict`` read by parameter name.
Loading checks both kinds of state on every rank before anything loads, as Muon's own load
does (``state_checks.py``): a group saved as the other kind, an AdamW moment of another shape,
dtype or layout, a step that is not a finite count.
"""

from __future__ import annotations

import functools
import inspect
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shardkit.core.optim.muon import Muon
from shardkit.core.optim.rule import Options
from shardkit.core.optim.state_checks import (
    check_saved_group,
    check_state_dict,
    check_state_value,
    named_params,
    saved_parts,
)
from shardkit.core.runtime.p2p.agreement import everyone, raise_shared

__all__ = ["USE_MUON", "MuonWithAdamW"]

USE_MUON = "use_muon"
"""The group key that says which optimizer steps the group: True Muon, False AdamW."""

_PARAMS = "params"
_NAME = "MuonWithAdamW"


class MuonWithAdamW(torch.optim.Optimizer):
    """shardkit's :class:`Muon` and torch's ``AdamW`` as one optimizer, group by group.

    Each group names its optimizer with ``use_muon``::

        split = split_matrices(model)
        optimizer = MuonWithAdamW([
            {"params": split.matrices, "use_muon": True, "lr": 0.02},
            {"params": split.others, "use_muon": False, "lr": 3e-4, "weight_decay": 0.01},
        ])

    A Muon group takes ``torch.optim.Muon``'s hyperparameters and defaults, an AdamW group
    ``torch.optim.AdamW``'s. A step is Muon's step on its groups, then AdamW's on the others:
    the bits of the two stepped one after the other. Takes what the two take: the matrices of
    models sharded by shardkit's ``fully_shard`` or torch's (or replicated, or plain), and
    any parameter for AdamW.

    Args:
        params: parameter groups (dicts), each with ``use_muon`` (a bool); the parameters
            may be (name, parameter) pairs, as ``named_parameters()`` gives them, so that
            errors name them.
        replicated_over: Muon's ``replicated_over`` (see :class:`Muon`).

    Raises:
        ValueError: a group without a bool ``use_muon``, a parameter in two groups, or what
            the group's optimizer refuses (Muon: a parameter that is not a matrix, named).
    """

    def __init__(
        self, params: Iterable[dict[str, Any]], *, replicated_over: DeviceMesh | None = None
    ) -> None:
        self.replicated_over = replicated_over
        self.muon: Muon | None = None
        """The inner Muon (None until a group takes it)."""
        self.adamw: torch.optim.AdamW | None = None
        """The inner AdamW (None until a group takes it)."""
        self._order: list[tuple[bool, int]] = []  # each group: its kind, its index there
        super().__init__(params, defaults={})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the optimizer its ``use_muon`` names, with that one's defaults.

        Raises:
            ValueError: see the class; nothing is added then.
        """
        index = len(self.param_groups)
        kind = param_group.get(USE_MUON) if isinstance(param_group, dict) else None
        if not isinstance(kind, bool):
            raise ValueError(
                f"{_NAME}: parameter group {index} needs '{USE_MUON}': True (Muon) or False "
                f"(AdamW), not {kind!r}"
            )
        params = param_group[_PARAMS]
        listed = [params] if isinstance(params, torch.Tensor) else list(params)
        param_group[_PARAMS] = listed
        taken = {id(p) for group in self.param_groups for p in group[_PARAMS]}
        both = [_name_of(entry, j) for j, entry in enumerate(listed) if id(_tensor(entry)) in taken]
        if both:
            raise ValueError(
                f"{_NAME}: some parameters appear in more than one parameter group: {both} "
                f"(group {index})"
            )
        if not kind:
            _check_adamw_options({**_adamw_defaults(), **param_group})
        inner = self.muon if kind else self.adamw
        if inner is None:
            if kind:
                self.muon = inner = Muon([param_group], replicated_over=self.replicated_over)
            else:
                self.adamw = inner = torch.optim.AdamW([param_group])
        else:
            inner.add_param_group(param_group)
        inner.state = self.state
        self._order.append((kind, len(inner.param_groups) - 1))
        self.param_groups.append(inner.param_groups[-1])

    # torch's stubs overload step (None -> None, a closure -> float); one signature for both.
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Muon's step on its groups, then AdamW's on the others.

        Collective where Muon's matrices are sharded: every rank calls it.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for inner in (self.muon, self.adamw):
            if inner is not None:
                inner.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict`` once every rank has found it fit for both kinds of group.

        Raises:
            ValueError, TypeError: the same on every rank where any parameter is sharded,
                before anything is loaded: a group saved as the other kind, and what Muon's
                load refuses of its groups and of AdamW's (``state_checks.py``).
        """
        state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            changed = pre_hook(self, state_dict)
            if changed is not None:
                state_dict = changed
        parts: list[tuple[dict[str, Any], dict[str, Any]]] = []
        sharded = any(isinstance(p, DTensor) for g in self.param_groups for p in g[_PARAMS])
        if sharded:
            raise_shared(everyone(lambda: parts.append(self._checked_parts(state_dict))))
        else:
            parts.append(self._checked_parts(state_dict))
        muon_part, adamw_part = parts[0]
        if self.muon is not None:
            # Checked above: torch's load, without Muon's own check (a second agreement).
            torch.optim.Optimizer.load_state_dict(self.muon, muon_part)
        if self.adamw is not None:
            self.adamw.load_state_dict(adamw_part)
        self._share_loaded()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _checked_parts(self, state_dict: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """``state_dict`` split into Muon's and AdamW's state dicts, each checked."""
        saved_groups, state = saved_parts(_NAME, state_dict, len(self.param_groups))
        parts: dict[bool, dict[str, Any]] = {
            kind: {"param_groups": [], "state": {}} for kind in (True, False)
        }
        listed: set[Any] = set()
        for index, (saved, (kind, _)) in enumerate(zip(saved_groups, self._order, strict=True)):
            first = named_params(self.param_groups[index], index)[0][0]
            if not isinstance(saved, Mapping) or not isinstance(saved.get(_PARAMS), list):
                raise TypeError(
                    f"{_NAME}: parameter group {index} (first parameter {first}): the saved "
                    "group is not a mapping with a 'params' list"
                )
            if saved.get(USE_MUON) is not kind:
                raise ValueError(
                    f"{_NAME}: parameter group {index} (first parameter {first}) was saved "
                    f"with {USE_MUON}={saved.get(USE_MUON)!r}, this one has {USE_MUON}={kind}"
                )
            parts[kind]["param_groups"].append(saved)
            parts[kind]["state"].update((i, state[i]) for i in saved[_PARAMS] if i in state)
            listed.update(saved[_PARAMS])
        unlisted = [index for index in state if index not in listed]
        if unlisted:
            raise ValueError(
                f"{_NAME}: the state dict has state for parameter {unlisted[0]!r}, which none "
                "of its parameter groups lists"
            )
        if self.muon is not None:
            check_state_dict(self.muon, parts[True])
        if self.adamw is not None:
            _check_adamw_state(self.adamw, parts[False])
        return parts[True], parts[False]

    def _share_loaded(self) -> None:
        """One state table for the three again, and this object's groups the inner ones.

        Each inner load made new group dicts and a new state table.
        """
        shared: defaultdict[torch.Tensor, Any] = defaultdict(dict)
        for inner in (self.muon, self.adamw):
            if inner is not None:
                shared.update(inner.state)
                inner.state = shared
        self.state = shared
        self.param_groups = [
            (self.muon if kind else self.adamw).param_groups[at]  # type: ignore[union-attr]
            for kind, at in self._order
        ]


@functools.cache
def _adamw_defaults() -> dict[str, Any]:
    """``torch.optim.AdamW``'s defaults, from its signature (this torch release's)."""
    parameters = inspect.signature(torch.optim.AdamW.__init__).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def _check_adamw_options(options: Options) -> None:
    """Refuse what ``torch.optim.AdamW`` refuses of its arguments, for any group."""
    lr, eps, betas = options["lr"], options["eps"], options["betas"]
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not lr >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not eps >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")
    for at, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {at}: {beta}")
    if not options["weight_decay"] >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {options['weight_decay']}")


def _check_adamw_state(adamw: torch.optim.AdamW, state_dict: dict[str, Any]) -> None:
    """Refuse AdamW state unlike the groups'.

    Each group is checked as Muon's are; each entry must have AdamW's keys
    (``max_exp_avg_sq`` with amsgrad), moments fit for the parameter, and a step that is a
    finite count.
    """
    state = state_dict["state"]
    for index, (saved, group) in enumerate(
        zip(state_dict["param_groups"], adamw.param_groups, strict=True)
    ):
        named = named_params(group, index)
        check_saved_group("AdamW", _check_adamw_options, saved, group, named, index)
        moments = {"exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if group["amsgrad"] else set())
        for saved_index, (name, param) in zip(saved[_PARAMS], named, strict=True):
            entry = state.get(saved_index)
            if entry is None:
                continue  # no state: never stepped, as in torch
            where = f"AdamW: {name}"
            if not isinstance(entry, Mapping):
                raise TypeError(f"{where}: its state is a {type(entry).__name__}, not a mapping")
            if set(entry) != moments | {"step"}:
                raise ValueError(
                    f"{where}: its state has keys {sorted(entry)}, AdamW keeps "
                    f"{sorted(moments | {'step'})}"
                )
            for key in sorted(moments):
                check_state_value(f"{where}: state {key!r}", param, entry[key])
            _check_step(f"{where}: state 'step'", entry["step"])


def _check_step(where: str, step: Any) -> None:
    value = step.detach() if isinstance(step, torch.Tensor) else step
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{where} has {value.numel()} elements, not one")
        value = value.item()
    if not isinstance(value, int | float) or not 0 <= value < float("inf"):
        raise ValueError(f"{where} is {value!r}, not a finite count of steps")


def _tensor(entry: Any) -> Any:
    return entry[1] if isinstance(entry, tuple) else entry


def _name_of(entry: Any, at: int) -> str:
    return str(entry[0]) if isinstance(entry, tuple) else f"params[{at}]"
