"""What the trackers install process-wide, for the tests that check it comes and goes."""

from __future__ import annotations

import torch


def installed_hooks() -> tuple[bool, int, int]:
    """(our kernels installed, global forward pre-hooks, global forward hooks).

    Our kernels: c10d's and the functional collectives' operators (and their wait), at the
    BackendSelect key. All are installed together or not at all.
    """
    from torch.nn.modules import module

    has = torch._C._dispatch_has_kernel_for_dispatch_key
    kernels = {
        has("c10d::allreduce_", "BackendSelect"),
        has("_c10d_functional::all_gather_into_tensor", "BackendSelect"),
        has("_c10d_functional::wait_tensor", "BackendSelect"),
    }
    assert len(kernels) == 1, "some kernels installed, others not"
    return kernels.pop(), len(module._global_forward_pre_hooks), len(module._global_forward_hooks)
