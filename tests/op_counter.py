"""OpCounter: a dispatch mode the hot-path tests use to count what one call allocates."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

UNSAFE_SPLITS = (
    torch.ops.aten.unsafe_split_with_sizes.default,
    torch.ops.aten.unsafe_split.Tensor,
)


class OpCounter(TorchDispatchMode):
    """Counts aten ops by class: views, allocations (new storage), in-place writes.

    ``t.view(dtype)`` is not differentiable, so autograd emits an ``aten.detach`` under it: that
    detach is part of the one Python-level view and is not counted as another. The unsafe
    splits return views of their input whose aliasing the schema does not declare: views.
    """

    def __init__(self):
        super().__init__()
        self.views, self.allocations, self.writes = [], [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default and self.views[-1:] == ["aten.view.dtype"]:
            pass
        elif func.is_view or func in UNSAFE_SPLITS:
            self.views.append(str(func))
        elif func._schema.is_mutable:
            self.writes.append(str(func))
        else:
            self.allocations.append(str(func))
        return func(*args, **(kwargs or {}))
