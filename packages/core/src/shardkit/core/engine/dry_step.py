"""A dry iteration: the step's collectives with no compute, for a rank out of batches.

A joined rank (``engine/join``) must issue what an iteration of the others issues, in the
same order, or their collectives hang. It runs the engine's own step sequence, the root's
``StepDriver``, over a :class:`~shardkit.core.engine.step_trace.StepTrace`: the same calls in
the same order, so gathers, prefetches and reductions (and their limits in flight) are
decided by the same code as in a real iteration. Where autograd would put a gradient on a
full parameter, zeros are put, so this rank's share of every reduction is zero and each shard
it owns receives the others' sum.
"""

from __future__ import annotations

import torch

from shardkit.core.engine.group.param_group import FSDPParamGroup
from shardkit.core.engine.param import FSDPParam
from shardkit.core.engine.root_context import RootState
from shardkit.core.engine.step_trace import StepTrace
from shardkit.core.runtime.watch.progress import PROGRESS
from shardkit.core.state_machines import ShardedState, TrainingState

__all__ = ["run_dry_step"]


def run_dry_step(root: RootState, trace: StepTrace, *, forward_only: bool = False) -> None:
    """Run one iteration of ``root``'s step over ``trace``'s events, with zero gradients.

    ``forward_only``: an evaluation's iteration (gradients disabled): the forward's events,
    then the root's post-forward and the step check a forward without backward ends with.

    Forward: the root's pre-forward, each recorded pre- and post-forward, the root's
    post-forward. Backward: each recorded pre-backward and end of backward, then what the
    end-of-backward callback ends (a group backward reached and did not end) and the callback
    itself, which finishes the reductions where this backward is the last.
    """
    ctx = root.ctx
    assert ctx is not None, "a dry step runs after the root's lazy init"
    driver, groups = ctx.driver, root.all_groups
    for group in groups:
        if group.sharded_state is ShardedState.SHARDED_POST_FORWARD:
            group.reshard()  # as the root's pre-forward: slices from before the last step
    ctx.in_root_forward = True
    PROGRESS.enter("forward")  # as the hooks do: each collective's record names its phase
    driver.root_pre_forward()
    reaches = trace.backward_reaches()
    in_forward = True
    for event in trace.events:
        group = event.group
        if event.kind == "pre_forward":
            driver.pre_forward(group)
        elif event.kind == "post_forward":
            driver.post_forward(group)
            if group in reaches and not forward_only:
                driver.output_needs_grad(group)
        elif forward_only:
            break
        else:
            if in_forward:
                _root_post_forward(root, groups)
                in_forward = False
                PROGRESS.enter("backward")
            if event.kind == "pre_backward":
                driver.pre_backward(group)
            else:
                _put_zero_grads(group, event.grads)
                driver.end_backward(group)
    if forward_only:
        _root_post_forward(root, groups)
        root.check_step_end()
        return
    if in_forward:
        _root_post_forward(root, groups)
        PROGRESS.enter("backward")
    for group in groups:
        # The callback would end it with whatever gradients it holds: it gets zeros first.
        if group.training_state is TrainingState.PRE_BACKWARD:
            _put_zero_grads(group, None)
            driver.end_backward(group)
    root.end_backward(last=all(g.options.is_last_backward for g in groups))


def _root_post_forward(root: RootState, groups: list[FSDPParamGroup]) -> None:
    ctx = root.ctx
    assert ctx is not None
    ctx.in_root_forward = False
    ctx.driver.root_post_forward(groups)


def _put_zero_grads(group: FSDPParamGroup, params: tuple[FSDPParam, ...] | None) -> None:
    """Zeros where autograd would have put ``params``' gradients (None: every trainable one).

    Where the group reduces missing gradients as zeros itself (``reduce.unused``), it is only
    told that it ran: its reduction then has every rank's rows, and a parameter none of the
    active ranks used keeps None, as theirs. Elsewhere zeros are put on the full parameters.
    A gradient already held (kept without gradient sync by a real iteration before this rank
    joined) stays: zeros added to it would change nothing.
    """
    if group.reducer.reduces_zeros():
        group.ran_forward_with_grad = True
        return
    for p in group.trainable if params is None else params:
        full = p.unsharded_param
        if full is not None and full.grad is None:
            full.grad = torch.zeros_like(full)
